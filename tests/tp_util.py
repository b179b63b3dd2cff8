"""Tensor-parallel test models: a tiny Llama with random weights saved to a directory (no download), for
``from_pretrained(..., tp_plan="auto")`` on gloo ranks."""

from __future__ import annotations

import torch


def tiny_llama_dir(path, vocab_size: int, num_hidden_layers: int) -> str:
    """A ``LlamaForCausalLM`` (hidden 32, 4 heads, 2 KV heads, untied embeddings, seed 0) saved to ``path``;
    returns ``path`` as text. An odd ``vocab_size`` gives two ranks vocabulary shards of different sizes."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    LlamaForCausalLM(cfg).save_pretrained(str(path))
    return str(path)
