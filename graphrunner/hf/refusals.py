"""Which models :func:`graphrunner.hf.generate_batch` serves, and the one gate every entry point calls.

:func:`refusal` says why a model cannot be served (``None`` when it can);
:func:`check_served` raises it as the :class:`~graphrunner.errors.CaptureError`
that :func:`~graphrunner.hf.generate_batch`, :func:`~graphrunner.hf.init_continuous_batching`
and :meth:`GraphBatching.install <graphrunner.hf.batching.GraphBatching.install>`
raise; :func:`refused` words every later refusal (a capture or equivalence failure) the same way.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

from graphrunner.errors import CaptureError
from graphrunner.hf.internals import attention_implementation

if TYPE_CHECKING:
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

__all__ = ["MASKED_IMPLEMENTATIONS", "RefusedError", "check_served", "model_type", "refusal", "refused"]

#: The attention implementations whose paged attention reads the step's attention mask (the ones served).
MASKED_IMPLEMENTATIONS = ("sdpa", "paged|sdpa", "paged|eager", "eager")


def model_type(model: Any) -> str:
    """The architecture named in refusals: ``model.config.model_type``, else the model's class name."""
    return str(getattr(getattr(model, "config", None), "model_type", type(model).__name__))


class RefusedError(CaptureError):
    """A :class:`~graphrunner.errors.CaptureError` that says ``gr.hf`` cannot serve a model and why (made by
    :func:`refused`): already worded, so a caller re-raises it as it is."""


def refused(model: Any, why: object, entry: str = "generate_batch") -> CaptureError:
    """The :class:`RefusedError` of ``gr.hf.<entry>`` refusing ``model`` for the reason ``why``."""
    return RefusedError(f"gr.hf.{entry} cannot serve architecture {model_type(model)!r}: {why}")


def check_served(
    model: Any, continuous_batching_config: ContinuousBatchingConfig | None = None, entry: str = "generate_batch"
) -> None:
    """Raise :func:`refused`'s :class:`CaptureError` when :func:`refusal` refuses ``model`` under
    ``continuous_batching_config``; ``entry`` names the entry point in the message."""
    why = refusal(model, continuous_batching_config)
    if why is not None:
        raise refused(model, why, entry)


def refusal(model: Any, continuous_batching_config: ContinuousBatchingConfig | None = None) -> str | None:
    """Why :func:`generate_batch` cannot serve ``model`` through graphs, or ``None`` when it can.

    Served: models whose continuous batching runs transformers' index-based paged
    cache with a mask-based attention (``sdpa``, ``eager`` / ``paged|eager``),
    synchronous batching, every layer a full- or sliding-attention layer.
    Refused: layers that keep a recurrent state per request (state-space / mamba,
    linear-attention, short-convolution, RG-LRU, RWKV and xLSTM layers of hybrid and
    state-space models), which the paged cache does not hold (it pages attention keys
    and values only): decided from the config's ``layer_types`` (else
    ``layers_block_type`` / ``block_types``), else its ``model_type`` when it names
    no layers, the reason naming the layer kind; flash attention (its varlen kernels
    take ``max_length_q/k`` as Python ints, which a graph would freeze, and the decode
    fast path's block table); asynchronous batching; and other layer types the paged
    cache has no allocator for."""
    from transformers.generation.continuous_batching.cache import group_layers_by_attn_type

    config = getattr(model, "config", None)
    if config is None or not hasattr(model, "generate_batch"):
        return f"{type(model).__name__} is not a transformers generation model (no config / generate_batch)"
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    model_type = str(getattr(text, "model_type", "") or getattr(config, "model_type", ""))
    declared = next(
        (
            list(map(str, v))
            for v in (getattr(text, n, None) for n in ("layer_types", "layers_block_type", "block_types"))
            if isinstance(v, (list, tuple)) and v
        ),
        [],
    )
    stateful = r"mamba|ssm|linear|conv|recurrent|rwkv|lstm|hybrid|lru|delta|state"
    kinds = sorted({k for k in declared if k not in ("full_attention", "sliding_attention") and re.search(stateful, k)})
    if not declared and re.search(r"mamba|rwkv|lstm|ssm|recurrent", model_type):
        kinds = [model_type]  # a state-space / RNN model whose config names no layers (rwkv, xlstm)
    try:
        groups, no_allocator = group_layers_by_attn_type(text), None
    except ValueError as exc:
        groups, no_allocator = None, exc
    if kinds:
        names = " ".join(list(getattr(text, "__dict__", {})) + [model_type])
        family = next(
            (
                label
                for pattern, label in (
                    (r"mamba|ssm_", "mamba state-space"),
                    (r"rwkv", "RWKV recurrent"),
                    (r"lstm", "xLSTM recurrent"),
                    (r"(^|\s)linear_", "linear-attention"),
                    (r"(^|\s)lru_", "RG-LRU recurrent"),
                    (r"conv_L_cache|conv_kernel|conv_states", "short-convolution"),
                )
                if re.search(pattern, names)
            ),
            "recurrent",
        )
        why = (
            f"its {'/'.join(kinds)} layers ({family}) keep a recurrent state per request that transformers' paged "
            "cache does not hold (it pages attention keys and values only)"
        )
        if no_allocator is not None:
            return (
                f"{why}: the paged cache has no allocator for its layer types {sorted(set(declared))} "
                f"({no_allocator}), so continuous batching itself cannot run it"
            )
        return (
            f"{why}: continuous batching takes them for full-attention layers, so it cannot build their cache "
            "or (given head counts) restarts that state at every step and returns wrong tokens without an error"
        )
    impl = attention_implementation(model)
    if impl not in MASKED_IMPLEMENTATIONS:
        return (
            f"its attention implementation {impl!r} is not mask-based: flash varlen attention takes "
            "max_length_q/k as Python ints a graph would freeze (and a block table on its decode fast path); "
            "load the model with attn_implementation='sdpa' or 'eager' (a half-precision model also needs "
            "ContinuousBatchingConfig(auto_switch_to_flash=False): transformers switches it to flash otherwise)"
        )
    if no_allocator is not None:
        layer_types = sorted(set(getattr(text, "layer_types", None) or []))
        return (
            f"transformers' paged cache has no allocator for its layer types {layer_types} ({no_allocator}): "
            "continuous batching itself cannot run it"
        )
    if getattr(text, "kv_lora_rank", None) is not None:
        return "its latent (MLA) attention cache is not one of the index-based caches the step is written for"
    cb = continuous_batching_config
    if cb is not None and getattr(cb, "use_async_batching", None):
        return "asynchronous batching double-buffers the step's inputs; run it with use_async_batching=False"
    if not groups:
        return "it has no attention layers"
    return None
