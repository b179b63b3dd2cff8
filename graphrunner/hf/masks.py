"""Attention masks for the decode step, built inside the graph from tensors the runner owns.

transformers derives a decode step's masks from the cache's counters; for
sliding-window layers one of them is a Python int (``cumulative_length_int``),
which a graph would freeze. Its own compiled-generate path avoids that by
building the masks before the forward (``masking_utils.create_masks_for_generate``)
and passing them in: one 4D mask, or a dict keyed by layer type that the
modeling code indexes per layer. :class:`MaskPlan` follows the same structure,
but computes each mask with tensor ops from the step's inputs, so the masks
are part of the captured graph and change with every replay:

* ``cache_position`` ``[B, 1]``: the cache slot the token is written to;
* ``first_slot`` ``[B, 1]``: the first slot holding a real token of the row
  (left-padded prompts: the number of pad tokens; 0 otherwise).

A causal mask lets a row attend slot ``j`` iff ``first_slot <= j <= slot``;
a sliding one also needs ``j > slot - window`` (``sliding_window_overlay``);
linear-attention and conv layers get ``None`` (transformers gives them no mask
for a one-token step). The row's own slot is always attended, so a row never
has an empty mask (padding rows stay finite). ``sdpa`` takes boolean masks,
``eager`` additive float masks (0 or the dtype's minimum), as transformers'
``sdpa_mask`` and ``eager_mask`` return them.

Models the plan does not cover (chunked attention, unknown layer types, other
attention implementations) build their masks themselves (``kind="model"``);
equal-length prompts only. Either way, :mod:`graphrunner.hf.selftest`
compares the replayed steps with the model's own eager decode at capture.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from graphrunner.hf.internals import config_attention_implementation

#: mask kinds by ``masking_utils`` creator name
_KIND_BY_CREATOR = {
    "create_causal_mask": "causal",
    "create_sliding_window_causal_mask": "sliding",
    "create_recurrent_attention_mask": "none",
}
#: attention implementations whose masks the plan builds
_IMPLEMENTATIONS = ("sdpa", "eager")


def _creator_kind(fn: Any) -> str | None:
    """The mask kind a ``masking_utils`` creator (or a ``functools.partial`` of one) builds, else None."""
    fn = getattr(fn, "func", fn)
    return _KIND_BY_CREATOR.get(getattr(fn, "__name__", ""))


@dataclass(frozen=True)
class MaskPlan:
    """How :class:`~graphrunner.hf.DecodeRunner`'s decode step gives attention its masks.

    ``kind`` is ``"explicit"`` (masks built in the step, see the module
    docstring) or ``"model"`` (the model builds them; ``reason`` says why).
    ``layers`` maps each mask key (a layer type) to ``"causal"``,
    ``"sliding"`` or ``"none"``; ``keyed`` says whether the model takes a dict
    (``config.layer_types``) or one 4D mask (the single entry ``""``).
    """

    kind: str
    reason: str = ""
    layers: dict[str, str] = field(default_factory=dict)
    keyed: bool = False
    window: int | None = None
    implementation: str = "sdpa"

    @property
    def explicit(self) -> bool:
        """True when the step builds the masks (ragged prompts and sliding windows are supported)."""
        return self.kind == "explicit"

    def build(self, cache_position: torch.Tensor, first_slot: torch.Tensor, length: int, dtype: torch.dtype) -> Any:
        """The ``attention_mask`` argument for one step: a 4D mask ``[B, 1, 1, length]`` or a dict of them.

        ``cache_position`` and ``first_slot`` are ``[B, 1]`` long tensors;
        ``length`` is the cache's slot count; ``dtype`` the model's (eager
        attention adds the mask to its scores). Only tensor ops: capturable.
        """
        kv = torch.arange(length, device=cache_position.device).unsqueeze(0)
        own = kv == cache_position
        causal = ((kv >= first_slot) & (kv <= cache_position)) | own
        built: dict[str, torch.Tensor] = {}
        window = self.window

        def mask(kind: str) -> torch.Tensor | None:
            if kind == "none":
                return None
            if kind not in built:
                if kind == "causal":
                    m = causal
                elif window is None:  # plan_masks gives sliding layers an int window: a MaskPlan built by hand
                    raise ValueError(f"MaskPlan: sliding layers {self.layers} need an int window, got None")
                else:
                    m = (causal & (kv > cache_position - int(window))) | own
                m = m[:, None, None, :]
                if self.implementation == "eager":
                    zero = torch.zeros((), dtype=dtype, device=m.device)
                    m = torch.where(m, zero, torch.finfo(dtype).min)
                built[kind] = m
            return built[kind]

        if not self.keyed:
            return mask(self.layers[""])
        return {key: mask(kind) for key, kind in self.layers.items()}


def plan_masks(config: Any) -> MaskPlan:
    """The :class:`MaskPlan` for a model ``config``, following ``masking_utils.create_masks_for_generate``.

    With ``layer_types``: one mask per layer type, each from the creator
    transformers maps it to (``LAYER_PATTERN_TO_MASK_FUNCTION_MAPPING``,
    nested dicts for hybrid types); else a sliding mask when
    ``sliding_window`` is set, a causal one otherwise. Anything else
    (chunked attention, unknown types, attention implementations other than
    sdpa/eager) gives ``kind="model"`` with the reason.
    """
    from transformers import masking_utils

    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    impl = config_attention_implementation(text) or config_attention_implementation(config) or "sdpa"
    if impl not in _IMPLEMENTATIONS:
        return MaskPlan("model", reason=f"attention implementation {impl!r} (masks are built for sdpa and eager)")
    window = getattr(text, "sliding_window", None)
    mapping = getattr(masking_utils, "LAYER_PATTERN_TO_MASK_FUNCTION_MAPPING", {})
    layer_types = getattr(text, "layer_types", None)
    layers: dict[str, str] = {}
    if layer_types is not None:
        for pattern in sorted(set(layer_types)):
            creators = mapping.get(pattern)
            if creators is None:
                return MaskPlan("model", reason=f"layer type {pattern!r} has no mask creator in transformers")
            items: tuple[tuple[str, Any], ...] = (
                tuple(creators.items()) if isinstance(creators, dict) else ((pattern, creators),)
            )
            for key, fn in items:
                kind = _creator_kind(fn)
                if kind is None:
                    return MaskPlan("model", reason=f"layer type {key!r} needs a {getattr(fn, '__name__', fn)} mask")
                layers[key] = kind
        keyed = True
    elif window is not None:
        layers, keyed = {"": "sliding"}, False
    elif getattr(text, "attention_chunk_size", None) is not None:
        return MaskPlan("model", reason="chunked attention (attention_chunk_size)")
    else:
        layers, keyed = {"": "causal"}, False
    if "sliding" in layers.values() and not isinstance(window, int):
        return MaskPlan("model", reason=f"sliding layers without an int config.sliding_window ({window!r})")
    return MaskPlan("explicit", layers=layers, keyed=keyed, window=window, implementation=impl)
