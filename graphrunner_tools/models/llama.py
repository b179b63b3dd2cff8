"""A small Llama-style decoder with a static KV cache, written the way serving engines write it.

The model exists so graphrunner has something realistic to capture: RMSNorm, rotary position
embeddings (``rotate_half`` form), grouped-query attention, a SwiGLU MLP and a preallocated KV
cache written in place. Weights are random, drawn from a seed; nothing is ever downloaded.

Module and parameter names mirror Hugging Face ``LlamaForCausalLM``
(``model.embed_tokens``, ``model.layers.N.self_attn.{q,k,v,o}_proj``,
``model.layers.N.mlp.{gate,up,down}_proj``, ``model.layers.N.{input,post_attention}_layernorm``,
``model.norm``, ``lm_head``), so an HF state dict of the same shape loads with
``load_state_dict(sd, strict=False)``. ``transformers`` is never imported.

Decode-step contract (what a static-input runner relies on):

* ``decode_step(input_ids[B], positions[B], slot_ids=None) -> logits[B, vocab]``.
  ``positions[i]`` is the position of row ``i``'s new token; row ``i`` writes its key/value at
  ``(cache row slot_ids[i] or i, positions[i])`` and attends to cache positions
  ``0..positions[i]`` inclusive of that row.
* ``verify_step(input_ids[B, T], positions[B, T], slot_ids=None) -> logits[B, T, vocab]``:
  several new tokens per row (a speculative verify step); the caller masks padded cells.
* Everything but the attention core is plain tensor code with shapes fixed by ``B``: no host
  reads, no data-dependent shapes, so it captures into a graph. The KV cache tensors are
  allocated once and only ever written in place (``index_put_``), so a captured graph can hold
  their addresses.
* With ``LlamaConfig.attention == "varlen"`` (default) the attention core is
  :func:`varlen_attention`, decorated with :func:`graphrunner.breakable.no_graph`: an eager
  break that reads the per-request lengths on the host and trims the keys to the longest one.
  With ``"masked"`` it is :func:`masked_attention`, which attends over all ``max_seq_len``
  cache positions with a mask and is capture-safe (usable by a full-graph backend).
* Rows are independent: a padding row (``input_ids`` 0, ``positions`` 0, beyond the real batch)
  only writes its own cache row and never changes a real row's logits or cache row.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from graphrunner.breakable import no_graph

__all__ = [
    "LlamaConfig",
    "RMSNorm",
    "RotaryEmbedding",
    "rotate_half",
    "apply_rotary",
    "rope_cos_sin",
    "repeat_kv",
    "LlamaAttention",
    "LlamaMLP",
    "LlamaDecoderLayer",
    "LlamaModel",
    "LlamaForCausalLM",
    "varlen_attention",
    "masked_attention",
    "build_model",
]

_ATTENTION_KINDS = ("varlen", "masked")


def _check_positive_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"LlamaConfig.{name} must be a positive int, got {value!r}")


@dataclass(frozen=True)
class LlamaConfig:
    """Shape and numerics of a :class:`LlamaForCausalLM`.

    Defaults are the demo size (4 layers, hidden 256, 8 query heads, 2 KV heads, vocab 1024,
    max_seq_len 256, max_batch_size 64): a decode step at batch 32 takes a few ms on 2 CPU cores.

    Fields:
        num_layers: decoder layers.
        hidden_size: model width; must be divisible by ``num_heads``.
        num_heads: query heads; must be divisible by ``num_kv_heads``.
        num_kv_heads: key/value heads (grouped-query attention; ``num_heads // num_kv_heads``
            query heads share one KV head).
        intermediate_size: SwiGLU inner width.
        vocab_size: embedding rows and logit width.
        max_seq_len: KV cache positions per row; valid positions are ``0..max_seq_len - 1``.
        max_batch_size: KV cache rows; the largest batch (or slot id + 1) a step may use.
        rope_theta: rotary base.
        rms_norm_eps: RMSNorm epsilon.
        attention: ``"varlen"`` (attention core is an eager ``no_graph`` break that trims to the
            longest request) or ``"masked"`` (capture-safe core over all ``max_seq_len``
            positions with a mask).
        init_std: standard deviation of random linear weights; ``None`` means
            ``1 / sqrt(fan_in)`` (activations stay O(1), so attention is not uniform and tests
            discriminate). Embeddings are N(0, 1); norm weights are 1.

    Raises:
        ValueError: on a non-positive size, indivisible heads, an odd ``head_dim`` or an unknown
            ``attention`` kind.
    """

    num_layers: int = 4
    hidden_size: int = 256
    num_heads: int = 8
    num_kv_heads: int = 2
    intermediate_size: int = 512
    vocab_size: int = 1024
    max_seq_len: int = 256
    max_batch_size: int = 64
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    attention: str = "varlen"
    init_std: float | None = None

    def __post_init__(self) -> None:
        for name in (
            "num_layers",
            "hidden_size",
            "num_heads",
            "num_kv_heads",
            "intermediate_size",
            "vocab_size",
            "max_seq_len",
            "max_batch_size",
        ):
            _check_positive_int(name, getattr(self, name))
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"LlamaConfig.hidden_size ({self.hidden_size}) must be divisible by num_heads ({self.num_heads})"
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"LlamaConfig.num_heads ({self.num_heads}) must be divisible by num_kv_heads "
                f"({self.num_kv_heads}) for grouped-query attention"
            )
        if self.head_dim % 2:
            raise ValueError(
                f"LlamaConfig head_dim = hidden_size / num_heads = {self.head_dim} must be even for rotary embeddings"
            )
        if self.attention not in _ATTENTION_KINDS:
            raise ValueError(f"LlamaConfig.attention must be one of {_ATTENTION_KINDS}, got {self.attention!r}")
        if self.rope_theta <= 0 or self.rms_norm_eps <= 0:
            raise ValueError("LlamaConfig.rope_theta and rms_norm_eps must be > 0")
        if self.init_std is not None and self.init_std <= 0:
            raise ValueError(f"LlamaConfig.init_std must be > 0 or None, got {self.init_std!r}")

    @property
    def head_dim(self) -> int:
        """Per-head width, ``hidden_size // num_heads``."""
        return self.hidden_size // self.num_heads

    @property
    def num_kv_groups(self) -> int:
        """Query heads per KV head, ``num_heads // num_kv_heads``."""
        return self.num_heads // self.num_kv_heads

    def replace(self, **changes) -> LlamaConfig:
        """Return a copy with ``changes`` applied (validated like the constructor)."""
        return dataclasses.replace(self, **changes)

    @classmethod
    def tiny(cls, **overrides) -> LlamaConfig:
        """Test size: 2 layers, hidden 64, 4 heads, 2 KV heads, vocab 128, 32 positions, 8 rows."""
        base = dict(
            num_layers=2,
            hidden_size=64,
            num_heads=4,
            num_kv_heads=2,
            intermediate_size=128,
            vocab_size=128,
            max_seq_len=32,
            max_batch_size=8,
        )
        base.update(overrides)
        return cls(**base)

    @classmethod
    def demo(cls, **overrides) -> LlamaConfig:
        """Demo size (the dataclass defaults), with ``overrides`` applied."""
        return cls(**overrides)


class RMSNorm(nn.Module):
    """Root-mean-square norm: ``weight * x / sqrt(mean(x**2, -1) + eps)``.

    Computed in float32 and cast back to the input dtype before the weight is applied
    (as Hugging Face Llama does). ``weight`` has shape ``[hidden_size]`` and starts at ones.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Normalize over the last dim; output has ``x``'s shape and dtype."""
        dtype = x.dtype
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """Return ``cat(-x2, x1)`` where ``x1, x2`` are the two halves of the last dim (HF form)."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rope_cos_sin(
    positions: torch.Tensor, head_dim: int, theta: float = 10000.0, dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary tables computed from the formula for integer ``positions`` of any shape.

    Pair ``(j, j + head_dim/2)`` at position ``p`` is rotated by angle
    ``p * theta ** (-2j / head_dim)``. Returns ``(cos, sin)`` of shape
    ``positions.shape + (head_dim,)`` in ``dtype`` (computed in float32).
    """
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim))
    freqs = positions.to(torch.float32)[..., None] * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` (``[..., head_dim]``) by tables broadcastable to it: ``x*cos + rotate_half(x)*sin``."""
    return x * cos + rotate_half(x) * sin


class RotaryEmbedding(nn.Module):
    """Precomputed rotary tables for positions ``0..max_seq_len-1``.

    ``forward(positions)`` gathers rows of the tables with a long index (capture-safe: no host
    read) and returns ``(cos, sin)`` of shape ``positions.shape + (head_dim,)``. The tables are
    non-persistent buffers, so they follow ``.to()`` and are not in the state dict.
    """

    def __init__(self, head_dim: int, max_seq_len: int, theta: float = 10000.0) -> None:
        super().__init__()
        cos, sin = rope_cos_sin(torch.arange(max_seq_len), head_dim, theta)
        self.register_buffer("cos_cached", cos, persistent=False)
        self.register_buffer("sin_cached", sin, persistent=False)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Return ``(cos, sin)`` for long ``positions`` (values in ``[0, max_seq_len)``)."""
        flat = positions.reshape(-1)
        cos = self.cos_cached.index_select(0, flat).view(*positions.shape, -1)
        sin = self.sin_cached.index_select(0, flat).view(*positions.shape, -1)
        return cos, sin


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """Expand ``[B, kv_heads, T, D]`` to ``[B, kv_heads * n_rep, T, D]`` (KV head ``h`` serves
    query heads ``h*n_rep .. h*n_rep + n_rep - 1``), as HF ``repeat_kv``."""
    if n_rep == 1:
        return x
    b, h, t, d = x.shape
    return x[:, :, None].expand(b, h, n_rep, t, d).reshape(b, h * n_rep, t, d)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Grouped-query attention of new tokens against gathered cache rows.

    q: ``[B, T, H, D]``; k, v: ``[B, Hkv, L, D]`` (cache positions ``0..L-1``);
    positions: ``[B, T]``, query ``(b, t)`` sees keys ``0..positions[b, t]``.
    Returns ``[B, T, H, D]``.
    """
    b, t, h, d = q.shape
    hkv, length = k.shape[1], k.shape[2]
    g = h // hkv
    qg = q.transpose(1, 2).reshape(b, hkv, g * t, d)  # [B, Hkv, G*T, D]
    scores = torch.matmul(qg, k.transpose(-1, -2)).view(b, hkv, g, t, length)
    scores = scores.to(torch.float32) * (1.0 / math.sqrt(d))
    key_pos = torch.arange(length, device=q.device)
    masked = key_pos > positions[:, None, None, :, None]  # [B, 1, 1, T, L]
    scores = scores.masked_fill(masked, float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(v.dtype).view(b, hkv, g * t, length)
    out = torch.matmul(probs, v)  # [B, Hkv, G*T, D]
    return out.view(b, hkv, g, t, d).reshape(b, h, t, d).transpose(1, 2)


def _gather_rows(cache: torch.Tensor, slot_ids: torch.Tensor | None, batch: int, length: int) -> torch.Tensor:
    if slot_ids is None:
        return cache[:batch, :, :length]
    return cache[:, :, :length].index_select(0, slot_ids)


@no_graph
def varlen_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    positions: torch.Tensor,
    slot_ids: torch.Tensor | None,
) -> torch.Tensor:
    """Attention core as an eager break (``@no_graph``): data-dependent by design.

    q: ``[B, T, H, D]`` (rotated); k_cache, v_cache: one layer's cache ``[max_batch, Hkv, S, D]``
    already holding the new keys/values; positions: ``[B]`` (decode, T == 1) or ``[B, T]``;
    slot_ids: ``[B]`` cache rows or ``None`` for rows ``0..B-1``.
    Reads ``max(positions)`` on the host, gathers keys ``0..max`` of each row and masks each
    query ``(b, t)`` to keys ``0..positions[b, t]``. Returns ``[B, T, H, D]``.

    Raises:
        ValueError: if a position is outside ``[0, S)``.
    """
    if positions.dim() == 1:
        positions = positions[:, None]
    lo, hi = int(positions.min()), int(positions.max())
    seq = k_cache.shape[2]
    if lo < 0 or hi >= seq:
        raise ValueError(f"positions must lie in [0, max_seq_len={seq}), got min {lo}, max {hi}")
    k = _gather_rows(k_cache, slot_ids, q.shape[0], hi + 1)
    v = _gather_rows(v_cache, slot_ids, q.shape[0], hi + 1)
    return _attend(q, k, v, positions)


@no_graph(enable=False)
def masked_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    positions: torch.Tensor,
    slot_ids: torch.Tensor | None,
) -> torch.Tensor:
    """Capture-safe attention core: same contract as :func:`varlen_attention`, no host reads.

    Attends over all ``S = max_seq_len`` cache positions of each row with a mask, so its shapes
    depend only on ``B`` and ``T``; it can live inside a full graph. Positions are not
    range-checked (that would need a host read). Declared ``@no_graph(enable=False)``, which
    leaves it a plain function: captured like any other code.
    """
    if positions.dim() == 1:
        positions = positions[:, None]
    k = _gather_rows(k_cache, slot_ids, q.shape[0], k_cache.shape[2])
    v = _gather_rows(v_cache, slot_ids, q.shape[0], v_cache.shape[2])
    return _attend(q, k, v, positions)


class LlamaAttention(nn.Module):
    """Grouped-query self-attention with this layer's static KV cache.

    Parameters ``q_proj [H*D, hidden]``, ``k_proj``/``v_proj [Hkv*D, hidden]``,
    ``o_proj [hidden, H*D]`` (no bias). Buffers ``k_cache``/``v_cache``
    ``[max_batch_size, Hkv, max_seq_len, D]`` (non-persistent, zero at start) are allocated once
    and only written in place; replacing them invalidates any captured graph.
    """

    def __init__(self, config: LlamaConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.attention = config.attention
        hd = config.head_dim
        self.q_proj = nn.Linear(config.hidden_size, config.num_heads * hd, bias=False)
        self.k_proj = nn.Linear(config.hidden_size, config.num_kv_heads * hd, bias=False)
        self.v_proj = nn.Linear(config.hidden_size, config.num_kv_heads * hd, bias=False)
        self.o_proj = nn.Linear(config.num_heads * hd, config.hidden_size, bias=False)
        shape = (config.max_batch_size, config.num_kv_heads, config.max_seq_len, hd)
        self.register_buffer("k_cache", torch.zeros(shape), persistent=False)
        self.register_buffer("v_cache", torch.zeros(shape), persistent=False)

    def _project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(b, t, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(b, t, self.num_kv_heads, self.head_dim)
        cos, sin = cos[:, :, None, :], sin[:, :, None, :]
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        positions: torch.Tensor,
        rows: torch.Tensor,
        slot_ids: torch.Tensor | None,
        attn_positions: torch.Tensor,
    ) -> torch.Tensor:
        """Cached attention for new tokens ``x [B, T, hidden]`` at ``positions [B, T]``.

        Writes the new keys/values at ``(rows[b], :, positions[b, t])`` with ``index_put_``
        (duplicate ``(row, position)`` pairs within one call leave an unspecified winner), then
        runs the configured attention core with ``attn_positions`` (``[B]`` or ``[B, T]``) and
        ``slot_ids``. Returns ``[B, T, hidden]``.
        """
        b, t, _ = x.shape
        q, k, v = self._project(x, cos, sin)
        heads = torch.arange(self.num_kv_heads, device=x.device)
        index = (rows[:, None, None], heads[None, None, :], positions[:, :, None])  # -> [B,T,Hkv]
        self.k_cache.index_put_(index, k.to(self.k_cache.dtype))
        self.v_cache.index_put_(index, v.to(self.v_cache.dtype))
        core = varlen_attention if self.attention == "varlen" else masked_attention
        out = core(q, self.k_cache, self.v_cache, attn_positions, slot_ids)
        return self.o_proj(out.reshape(b, t, self.num_heads * self.head_dim))

    def forward_full(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Uncached causal attention over the whole sequence ``x [B, T, hidden]`` (reference).

        Uses ``repeat_kv`` and a triangular mask; never touches the cache.
        """
        b, t, _ = x.shape
        q, k, v = self._project(x, cos, sin)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [B, heads, T, D]
        n_rep = self.num_heads // self.num_kv_heads
        k, v = repeat_kv(k, n_rep), repeat_kv(v, n_rep)
        scores = (q @ k.transpose(-1, -2)).to(torch.float32) / math.sqrt(self.head_dim)
        causal = torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1)
        scores = scores.masked_fill(causal, float("-inf"))
        out = torch.softmax(scores, dim=-1).to(v.dtype) @ v  # [B, H, T, D]
        return self.o_proj(out.transpose(1, 2).reshape(b, t, self.num_heads * self.head_dim))


class LlamaMLP(nn.Module):
    """SwiGLU MLP: ``down_proj(silu(gate_proj(x)) * up_proj(x))`` (no bias)."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Apply the MLP to ``x [..., hidden]``; same shape out."""
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaDecoderLayer(nn.Module):
    """Pre-norm block: ``h = x + attn(norm1(x)); out = h + mlp(norm2(h))``."""

    def __init__(self, config: LlamaConfig, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, layer_idx)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, *attn_args) -> torch.Tensor:
        """Cached step; ``attn_args`` are passed to :meth:`LlamaAttention.forward` after ``x``."""
        h = x + self.self_attn(self.input_layernorm(x), *attn_args)
        return h + self.mlp(self.post_attention_layernorm(h))

    def forward_full(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Uncached causal block over a whole sequence (reference path)."""
        h = x + self.self_attn.forward_full(self.input_layernorm(x), cos, sin)
        return h + self.mlp(self.post_attention_layernorm(h))


class LlamaModel(nn.Module):
    """The decoder stack without the LM head: ``embed_tokens``, ``layers``, final ``norm``."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    """Small Llama decoder with a static KV cache; see the module docstring for the contract.

    Build it with :func:`build_model` (random weights from a seed, inference mode:
    ``eval()`` and ``requires_grad=False``). The KV cache lives in each layer's
    ``self_attn.k_cache`` / ``v_cache`` (``[max_batch_size, num_kv_heads, max_seq_len, head_dim]``);
    :meth:`kv_cache_tensors` lists them. ``forward`` is :meth:`decode_step`.
    """

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.rotary_emb = RotaryEmbedding(config.head_dim, config.max_seq_len, config.rope_theta)

    # ------------------------------------------------------------------ cache
    def kv_cache_tensors(self) -> list[torch.Tensor]:
        """All cache tensors, ``[k_0, v_0, k_1, v_1, ...]`` (the tensors a graph holds)."""
        out = []
        for layer in self.model.layers:
            out += [layer.self_attn.k_cache, layer.self_attn.v_cache]
        return out

    def reset_cache(self) -> None:
        """Zero every cache tensor in place (addresses kept, so captured graphs stay valid)."""
        for t in self.kv_cache_tensors():
            t.zero_()

    # ------------------------------------------------------------------ steps
    def _run_layers(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        slot_ids: torch.Tensor | None,
        attn_positions: torch.Tensor,
    ) -> torch.Tensor:
        b = input_ids.shape[0]
        rows = slot_ids if slot_ids is not None else torch.arange(b, device=input_ids.device)
        cos, sin = self.rotary_emb(positions)
        h = self.model.embed_tokens(input_ids)
        cos, sin = cos.to(h.dtype), sin.to(h.dtype)
        for layer in self.model.layers:
            h = layer(h, cos, sin, positions, rows, slot_ids, attn_positions)
        return self.model.norm(h)

    def _check_ids(self, name: str, t: torch.Tensor, dims: int) -> None:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype not in (torch.int64, torch.int32):
            raise TypeError(f"{name} must be an integer (long) tensor, got dtype {t.dtype}")
        if t.dim() != dims:
            raise ValueError(f"{name} must have {dims} dim(s), got shape {tuple(t.shape)}")

    def _check_ids_and_positions(self, input_ids: torch.Tensor, positions: torch.Tensor, dims: int) -> None:
        self._check_ids("input_ids", input_ids, dims)
        self._check_ids("positions", positions, dims)
        if positions.shape != input_ids.shape:
            raise ValueError(
                f"positions shape {tuple(positions.shape)} must equal input_ids shape {tuple(input_ids.shape)}"
            )

    def _check_slots(self, slot_ids: torch.Tensor | None, batch: int) -> None:
        if slot_ids is None:
            if batch > self.config.max_batch_size:
                raise ValueError(
                    f"batch size {batch} exceeds max_batch_size={self.config.max_batch_size}; "
                    "build the model with a larger LlamaConfig.max_batch_size"
                )
            return
        self._check_ids("slot_ids", slot_ids, 1)
        if slot_ids.shape[0] != batch:
            raise ValueError(f"slot_ids must have shape [{batch}], got {tuple(slot_ids.shape)}")

    def decode_step(
        self, input_ids: torch.Tensor, positions: torch.Tensor, slot_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        """One decode step for ``B`` requests; returns logits ``[B, vocab_size]``.

        Args:
            input_ids: long ``[B]``, the new token of each row.
            positions: long ``[B]``, the position of that token (``0..max_seq_len-1``).
            slot_ids: optional long ``[B]`` cache rows; default ``None`` means row ``i`` uses
                cache row ``i`` (then ``B <= max_batch_size``). With slot ids, two rows must
                not share a slot (padding rows need a slot no real request uses).

        Row ``i`` writes its key/value into its cache row at ``positions[i]`` and attends to
        that row's positions ``0..positions[i]``. Rows are independent, so padding rows
        (``input_ids`` 0, ``positions`` 0, ``i >=`` real batch) only overwrite position 0 of
        their own cache rows and do not change real rows' logits. Only shapes are checked here
        (capture-safe); position values are checked by the ``varlen`` attention break.

        Raises:
            TypeError / ValueError: wrong dtype, rank, mismatched shapes or ``B`` too large.
        """
        self._check_ids_and_positions(input_ids, positions, 1)
        b = input_ids.shape[0]
        self._check_slots(slot_ids, b)
        h = self._run_layers(input_ids[:, None], positions[:, None], slot_ids, positions)
        return self.lm_head(h[:, 0])

    forward = decode_step

    def verify_step(
        self, input_ids: torch.Tensor, positions: torch.Tensor, slot_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Several new tokens per row at given positions (a speculative verify step); logits ``[B, T, vocab]``.

        Args:
            input_ids: long ``[B, T]``, the tokens of each row (e.g. the last accepted token then
                the drafts).
            positions: long ``[B, T]``, the position of each token; row ``b`` writes its
                key/value at ``(cache row slot_ids[b] or b, positions[b, t])`` and query ``(b, t)``
                attends to that row's positions ``0..positions[b, t]``.
            slot_ids: optional long ``[B]`` cache rows, as in :meth:`decode_step`.

        ``logits[b, t]`` predicts the token after ``input_ids[b, t]``. The caller owns padding:
        a padded cell writes the cache at its position like any other, so give padded cells a
        position no real query reads (``graphrunner_tools.spec`` masks them to a scratch position).
        Only shapes are checked (capture-safe).

        Raises:
            TypeError / ValueError: wrong dtype, rank, mismatched shapes or ``B`` too large.
        """
        self._check_ids_and_positions(input_ids, positions, 2)
        self._check_slots(slot_ids, input_ids.shape[0])
        return self.lm_head(self._run_layers(input_ids, positions, slot_ids, positions))

    def prefill(
        self, input_ids: torch.Tensor, slot_ids: torch.Tensor | None = None, start_pos: int = 0
    ) -> torch.Tensor:
        """Batched eager prefill: write tokens at positions ``start_pos..start_pos+T-1``.

        Args:
            input_ids: long ``[B, T]`` prompt tokens (all rows the same length; prefill ragged
                prompts one request at a time with ``slot_ids``).
            slot_ids: optional long ``[B]`` cache rows (default rows ``0..B-1``).
            start_pos: first position (chunked prefill: earlier positions must already be in
                the cache).

        Returns logits ``[B, T, vocab_size]``; ``logits[:, -1]`` predicts position
        ``start_pos + T``. Attention is causal over the cache row.

        Raises:
            TypeError / ValueError: bad dtype/shape, or ``start_pos + T > max_seq_len``.
        """
        self._check_ids("input_ids", input_ids, 2)
        b, t = input_ids.shape
        self._check_slots(slot_ids, b)
        if isinstance(start_pos, bool) or not isinstance(start_pos, int) or start_pos < 0:
            raise ValueError(f"start_pos must be a non-negative int, got {start_pos!r}")
        if start_pos + t > self.config.max_seq_len:
            raise ValueError(
                f"prefill of {t} tokens from start_pos {start_pos} exceeds max_seq_len={self.config.max_seq_len}"
            )
        positions = (start_pos + torch.arange(t, device=input_ids.device)).expand(b, t)
        h = self._run_layers(input_ids, positions, slot_ids, positions)
        return self.lm_head(h)

    def forward_full(self, tokens: torch.Tensor) -> torch.Tensor:
        """Reference causal forward of whole sequences ``tokens [B, T]`` without any cache.

        Returns logits ``[B, T, vocab_size]``; position ``t`` sees tokens ``0..t``. Rotary
        tables come from :func:`rope_cos_sin` (the formula), not the cached tables, and GQA
        uses :func:`repeat_kv`; the KV cache is neither read nor written.
        """
        self._check_ids("tokens", tokens, 2)
        b, t = tokens.shape
        h = self.model.embed_tokens(tokens)
        pos = torch.arange(t, device=tokens.device)
        cos, sin = rope_cos_sin(pos, self.config.head_dim, self.config.rope_theta, h.dtype)
        cos, sin = cos[None], sin[None]  # [1, T, D]
        for layer in self.model.layers:
            h = layer.forward_full(h, cos, sin)
        return self.lm_head(self.model.norm(h))


def build_model(
    config: LlamaConfig | None = None,
    seed: int = 0,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
) -> LlamaForCausalLM:
    """Build a :class:`LlamaForCausalLM` with random weights drawn from ``seed``.

    Weights are drawn on CPU in float32 from a private ``torch.Generator`` (the global RNG is
    untouched) in parameter-name order, then moved to ``device``/``dtype``, so a seed gives the
    same weights on every device. Linear weights ~ N(0, init_std or 1/sqrt(fan_in)),
    embeddings ~ N(0, 1), norm weights = 1. The result is in ``eval()`` mode with
    ``requires_grad=False`` and a zeroed KV cache. ``config=None`` means ``LlamaConfig()``.
    """
    config = LlamaConfig() if config is None else config
    if not isinstance(config, LlamaConfig):
        raise TypeError(f"config must be a LlamaConfig, got {type(config).__name__}")
    gen = torch.Generator(device="cpu").manual_seed(int(seed))
    # inference_mode(False): parameters and cache must be normal tensors so they can be written
    # in place (reset_cache) outside inference mode even if build_model is called inside it.
    # fork_rng: nn.Linear's default init draws from the global CPU RNG; restore it afterwards.
    with torch.inference_mode(False), torch.no_grad(), torch.random.fork_rng(devices=[]):
        model = LlamaForCausalLM(config)
        for name, p in sorted(model.named_parameters()):
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif "embed_tokens" in name:
                p.normal_(0.0, 1.0, generator=gen)
            else:
                std = config.init_std or 1.0 / math.sqrt(p.shape[1])
                p.normal_(0.0, std, generator=gen)
        model = model.to(device=device, dtype=dtype)
    model.requires_grad_(False)
    return model.eval()
