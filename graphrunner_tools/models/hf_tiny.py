"""Tiny random-weight transformers causal LMs of any ``model_type``, built from configs (nothing downloaded).

:func:`tiny_config` shrinks ``AutoConfig.for_model(model_type)``'s default
config: every size attribute it knows (hidden sizes, layer and head counts,
vocabulary, experts, state sizes, ...) that the config has is set to a small
value, the rest stays at transformers' defaults. :func:`build_tiny` makes the
eval-mode ``AutoModelForCausalLM`` from it with seeded random weights.
:func:`causal_lm_types` lists the model types transformers maps to a causal
LM. Used by the ``gr.hf`` tests and ``bench/hf_architectures.py``.
"""

from __future__ import annotations

from typing import Any

#: config attribute -> tiny value (set only where the config has the attribute)
TINY: dict[str, Any] = {
    "vocab_size": 128,
    "hidden_size": 64,
    "n_embd": 64,
    "d_model": 64,
    "intermediate_size": 128,
    "ffn_hidden_size": 128,
    "n_inner": 128,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 32,
    "num_hidden_layers": 2,
    "n_layer": 2,
    "num_layers": 2,
    "n_layers": 2,
    "num_attention_heads": 4,
    "n_head": 4,
    "n_heads": 4,
    "num_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 64,
    "n_positions": 64,
    "n_ctx": 64,
    "num_local_experts": 4,
    "num_experts": 4,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "n_shared_experts": 1,
    "first_k_dense_replace": 1,
    "n_group": 1,
    "topk_group": 1,
    "kv_lora_rank": 16,
    "q_lora_rank": 32,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 8,
    "v_head_dim": 16,
    "state_size": 8,
    "expand": 2,
    "n_groups": 2,
    "chunk_size": 16,
    "conv_kernel": 4,
    "time_step_rank": 8,
    "rotary_dim": 8,
    "encoder_attention_heads": 4,
    "decoder_attention_heads": 4,
    "encoder_layers": 2,
    "decoder_layers": 2,
    "encoder_ffn_dim": 128,
    "decoder_ffn_dim": 128,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
}


def tiny_config(model_type: str, **overrides: Any):
    """``AutoConfig.for_model(model_type)`` with every attribute of :data:`TINY` it has made tiny, then ``overrides``.

    ``layer_types``, when the default config has one, is cut to the tiny
    layer count keeping its mix of types (one layer of each type first);
    special token ids beyond the tiny vocabulary become 0 (pad), 1 (bos) or 2 (eos, decoder start)."""
    from transformers import AutoConfig

    cfg = AutoConfig.for_model(model_type)
    text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    for name, value in TINY.items():
        if name in vars(text) or hasattr(type(text), name):
            try:
                setattr(text, name, value)
            except (AttributeError, TypeError, ValueError):
                pass
    if hasattr(text, "qk_rope_head_dim"):  # multi-head latent attention: rotary on the rope part only
        text.head_dim = text.qk_rope_head_dim
        if hasattr(text, "num_key_value_heads"):
            text.num_key_value_heads = text.num_attention_heads
    if all(hasattr(text, a) for a in ("expand", "num_heads", "head_dim", "hidden_size")):  # Mamba2 heads
        text.num_heads = text.expand * text.hidden_size // text.head_dim
    vocab = getattr(text, "vocab_size", None)
    for name in ("pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id"):
        value = getattr(text, name, None)  # special ids of the full vocabulary: out of the tiny one
        if isinstance(vocab, int) and isinstance(value, int) and value >= vocab:
            setattr(text, name, {"pad_token_id": 0, "bos_token_id": 1}.get(name, 2))
        elif isinstance(vocab, int) and isinstance(value, list) and any(v >= vocab for v in value):
            setattr(text, name, [v for v in value if v < vocab] or None)
    types = getattr(text, "layer_types", None)
    if isinstance(types, (list, tuple)) and types:
        n = getattr(text, "num_hidden_layers", len(types))
        kept = list(dict.fromkeys(types))[:n]  # one layer of each type first, then the pattern
        try:
            text.layer_types = (kept + list(types))[: max(n, len(kept))]
            text.num_hidden_layers = len(text.layer_types)
        except AttributeError:  # a derived property (e.g. Mamba2's)
            pass
    for name, value in overrides.items():
        setattr(text, name, value)
    return cfg


def _wants_is_decoder(model_type: str) -> bool:
    """True when the causal-LM class of ``model_type`` asks for ``config.is_decoder`` (encoder families such as
    BERT: without it their "causal LM" attends bidirectionally, and transformers warns)."""
    import inspect

    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    cls = getattr(transformers, str(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type, "")), None)
    try:
        return cls is not None and "config.is_decoder" in inspect.getsource(cls.__init__)
    except (OSError, TypeError):
        return False


def build_tiny(model_type: str, seed: int = 0, **overrides: Any):
    """An eval-mode tiny ``AutoModelForCausalLM`` of ``model_type`` with random weights from ``seed``
    (``is_decoder=True`` where the causal-LM class asks for it, as its own warning says)."""
    import torch
    from transformers import AutoModelForCausalLM

    if "is_decoder" not in overrides and _wants_is_decoder(model_type):
        overrides = {**overrides, "is_decoder": True}
    cfg = tiny_config(model_type, **overrides)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(cfg).eval()


def causal_lm_types() -> list[str]:
    """Every ``model_type`` transformers maps to a causal LM class, sorted."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
