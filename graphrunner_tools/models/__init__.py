"""Demo models for graphrunner: a small Llama-style decoder with a static KV cache.

``build_model(config, seed=0, device="cpu", dtype=torch.float32)`` returns a
:class:`LlamaForCausalLM` whose ``decode_step(input_ids[B], positions[B], slot_ids=None)``
is written for graph capture (attention is an eager ``no_graph`` break). See
:mod:`graphrunner_tools.models.llama` for the full contract.
"""

from graphrunner_tools.models.llama import (
    LlamaConfig,
    LlamaForCausalLM,
    RMSNorm,
    RotaryEmbedding,
    apply_rotary,
    build_model,
    masked_attention,
    repeat_kv,
    rope_cos_sin,
    rotate_half,
    varlen_attention,
)

__all__ = [
    "LlamaConfig",
    "LlamaForCausalLM",
    "RMSNorm",
    "RotaryEmbedding",
    "apply_rotary",
    "build_model",
    "masked_attention",
    "repeat_kv",
    "rope_cos_sin",
    "rotate_half",
    "varlen_attention",
]
