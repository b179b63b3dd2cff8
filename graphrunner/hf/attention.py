"""The continuous-batching step's attention, through transformers' attention dispatch (``AttentionInterface``).

A model's attention layers call the function its config names
(``ALL_ATTENTION_FUNCTIONS.get_interface(config._attn_implementation, ...)``),
passing it the query, the keys and values the paged cache returned, the mask of
the layer's attention type and their own arguments (``scaling``, ``softcap``,
``s_aux`` sinks, ...). Within :func:`routed` (around each step's forward) the
model names :func:`step_attention`, registered under :data:`NAME` with
``AttentionInterface.register`` and named with ``model.set_attn_implementation``
(both public); outside it the model is transformers' own. :func:`step_attention` never computes attention
itself: it calls transformers' function for the implementation the model had
when it was installed (the *inner* one: ``sdpa``, or ``paged|eager`` which
transformers' continuous batching picks for an ``eager`` model), on the cells
the step allows, in one of two forms chosen by the mask the step hands it:

- **dense** (a floating ``[1, 1, tokens, kv]`` mask, ``0`` allowed, ``-inf``
  masked): the inner function once over every query and key of the step. This
  is what a CUDA graph replays (the step builds the mask from the metadata in
  the graph), and transformers' own engine's computation.
- **per request** (the packed integer metadata of :func:`per_request_mask`):
  ``torch.ops.graphrunner.per_request_attention``, a custom op whose CPU kernel
  reads the metadata on the host and calls the inner function once per run of a
  request's query rows, against that request's keys only (with the slice's own
  mask, or none where every cell is allowed). A recorder at the dispatch level
  (the tape) sees one op and runs it again at every replay on that call's
  metadata, as a flash-attention varlen kernel reads its ``cu_seqlens``. Not
  capturable by a CUDA stream capture (host reads): CUDA keeps the dense form.

Both forms call the same transformers function with the same arguments, so a
model's softcapping, sinks or grouped heads are whatever transformers does with
them; graphrunner only decides which cells each call sees. A call without the
step's mask (the model used outside the step while installed) goes to the inner
function unchanged.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from transformers import AttentionInterface

from graphrunner.hf.internals import attention_implementation

if TYPE_CHECKING:
    from transformers import PreTrainedModel

__all__ = [
    "NAME",
    "per_request_mask",
    "request_runs",
    "request_slices",
    "routed",
    "step_attention",
]

#: The name :func:`step_attention` is registered under in transformers' ``AttentionInterface``.
NAME = "graphrunner"

#: The keyword arguments of transformers' continuous-batching forward that reach every attention call: the step's
#: metadata, which a per-request call must not see (the slices are cut here) and that change from step to step.
_STEP_KWARGS = frozenset(
    {
        "cu_seq_lens_q",
        "cu_seq_lens_k",
        "max_length_q",
        "max_length_k",
        "read_index",
        "write_index",
        "logits_indices",
        "cache",
        "block_table",
        "use_cache",
        "position_ids",
        "output_attentions",
    }
)


# --------------------------------------------------------------------------- routing


class _Routed:
    """The models whose attention is routed now, by their configs' ids (configs are not hashable): how many
    :func:`routed` blocks hold each, and the inner implementation of each config."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.holds: dict[int, int] = {}
        self.inner: dict[int, str] = {}


_ROUTED = _Routed()


def _configs(model: PreTrainedModel) -> list[Any]:
    """Every distinct config of ``model``'s modules (a multimodal model's text config is a sub-config)."""
    seen: dict[int, Any] = {}
    for module in model.modules():
        cfg = getattr(module, "config", None)
        if cfg is not None:
            seen.setdefault(id(cfg), cfg)
    return list(seen.values())


@contextlib.contextmanager
def routed(model: PreTrainedModel) -> Iterator[None]:
    """Within the block, ``model``'s attention layers call :func:`step_attention` (registered as :data:`NAME`
    with ``AttentionInterface.register`` and named with ``model.set_attn_implementation``, both public), which
    delegates to the implementation the model had (the inner one); after it, the model runs its own again.
    Blocks nest and may overlap across threads (a background capture beside a served step): the first one in
    names :data:`NAME`, the last one out puts the inner one back. Outside every block the model is
    transformers' own, so transformers' continuous batching (which accepts only its own names) runs it too."""
    AttentionInterface.register(NAME, step_attention)
    key = id(model.config)
    with _ROUTED.lock:
        if _ROUTED.holds.get(key, 0) == 0:
            inner = attention_implementation(model)
            if inner is None or inner == NAME:
                raise RuntimeError(f"the model's attention implementation is {inner!r}: not one transformers runs")
            for cfg in _configs(model):
                _ROUTED.inner[id(cfg)] = inner
            model.set_attn_implementation(NAME)
        _ROUTED.holds[key] = _ROUTED.holds.get(key, 0) + 1
    try:
        yield
    finally:
        with _ROUTED.lock:
            _ROUTED.holds[key] -= 1
            if _ROUTED.holds[key] == 0:
                del _ROUTED.holds[key]
                inner = _ROUTED.inner[key]
                for cfg in _configs(model):
                    _ROUTED.inner.pop(id(cfg), None)
                model.set_attn_implementation(inner)


def _inner_of(module: torch.nn.Module) -> str:
    cfg = getattr(module, "config", None)
    inner = _ROUTED.inner.get(id(cfg)) if cfg is not None else None
    if inner is None:
        raise RuntimeError(
            f"graphrunner's attention was called by {type(module).__name__} outside graphrunner.hf.attention.routed: "
            "set the model's attention implementation back to sdpa or eager"
        )
    return inner


def _inner_function(inner: str) -> Callable[..., tuple[torch.Tensor, Any]]:
    """transformers' attention function of the implementation ``inner`` (its ``eager`` one for ``eager``)."""
    if inner == "eager":
        from transformers.integrations.eager_paged import eager_paged_attention_forward

        return eager_paged_attention_forward
    return AttentionInterface()[inner]


# --------------------------------------------------------------------------- the step's mask


def per_request_mask(
    tok_req: torch.Tensor, tok_pos: torch.Tensor, key_req: torch.Tensor, key_pos: torch.Tensor, window: int | None
) -> torch.Tensor:
    """The per-request form of a layer type's mask: ``tok_req``, ``tok_pos [tokens]`` (each query's request,
    negative for padding, and position), ``key_req``, ``key_pos [kv]`` (each key's) and ``window`` (``-1``: none)
    packed in one int32 tensor ``[1, 1, 1, 2 tokens + 2 kv + 1]`` (4-d: transformers passes a 4-d mask through
    to the attention unchanged). :func:`step_attention` reads it back by the query's and keys' lengths. Query
    ``t`` may attend key ``j`` iff the same request (``>= 0``), ``key_pos <= position`` and within the window."""
    w = torch.full((1,), -1 if window is None else int(window), dtype=torch.int32, device=tok_req.device)
    parts = [x.to(torch.int32) for x in (tok_req, tok_pos, key_req, key_pos)]
    return torch.cat([*parts, w])[None, None, None]


def _unpack(meta: torch.Tensor, tokens: int, kv: int) -> tuple[torch.Tensor, ...]:
    flat = meta.reshape(-1)
    if flat.shape[0] != 2 * tokens + 2 * kv + 1:
        raise ValueError(
            f"graphrunner's per-request mask holds {flat.shape[0]} values, not the {2 * tokens + 2 * kv + 1} of "
            f"{tokens} queries and {kv} keys: the mask was not made by per_request_mask for this layer"
        )
    t, k = tokens, kv
    return flat[:t], flat[t : 2 * t], flat[2 * t : 2 * t + k], flat[2 * t + k : 2 * t + 2 * k], flat[-1:]


def request_runs(ids: np.ndarray) -> list[tuple[int, int, int]]:
    """``[(request, start, stop), ...]``: the maximal runs of equal values in the 1-d integer array ``ids``, in
    order (``ids[start:stop] == request``), negative values (padding) included as runs of their own."""
    n = int(ids.shape[0])
    if n == 0:
        return []
    cuts = np.flatnonzero(ids[1:] != ids[:-1]) + 1
    starts = [0, *cuts.tolist()]
    stops = [*cuts.tolist(), n]
    values = ids[starts].tolist()
    return list(zip(values, starts, stops))


def _allowed(q_pos: np.ndarray, k_pos: np.ndarray, window: int | None) -> np.ndarray:
    """``[rows, keys]`` bool: the key positions each query position of one request may attend."""
    ok = k_pos[None, :] <= q_pos[:, None]
    if window is not None:
        ok &= k_pos[None, :] > q_pos[:, None] - window
    return ok


def request_slices(
    tok_req: torch.Tensor, tok_pos: torch.Tensor, key_req: torch.Tensor, key_pos: torch.Tensor, window: int | None
) -> Iterator[tuple[int, int, int, int, np.ndarray]]:
    """``(t0, t1, k0, k1, ok)`` for each maximal run ``t0:t1`` of query rows of one request (padding rows,
    ``tok_req < 0``, skipped): ``k0:k1`` is the request's one contiguous run of keys (transformers lays
    keys out request by request), ``ok [t1 - t0, k1 - k0]`` the cells those rows may attend (``key_pos <=
    position``, within ``window``). A request whose keys are not one run gets every key (``0:kv``) and ok
    also tests ``key_req``: the same cells, only slower. The metadata (1-d int CPU tensors) is read on the host."""
    tr, tp = tok_req.numpy(), tok_pos.numpy()
    kr, kp = key_req.numpy(), key_pos.numpy()
    keys: dict[int, tuple[int, int] | None] = {}
    for r, k0, k1 in request_runs(kr):
        if r >= 0:
            keys[r] = (k0, k1) if r not in keys else None  # None: the request's keys are not one run
    for r, t0, t1 in request_runs(tr):
        if r < 0:
            continue
        span = keys.get(r)
        if span is None:  # not one run (or none): every key, these rows' full mask
            yield t0, t1, 0, int(kr.shape[0]), (kr[None, :] == r) & _allowed(tp[t0:t1], kp, window)
        else:
            k0, k1 = span
            yield t0, t1, k0, k1, _allowed(tp[t0:t1], kp[k0:k1], window)


def _float_mask(ok: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    """The additive ``[1, 1, rows, keys]`` mask of ``ok``: 0 where allowed, ``-inf`` where not."""
    return torch.zeros(ok.shape, dtype=dtype).masked_fill_(torch.from_numpy(~ok), float("-inf"))[None, None]


# --------------------------------------------------------------------------- the per-request op


@dataclass(frozen=True)
class _Call:
    """What a per-request op call needs besides tensors: the inner function, the layer and its own arguments."""

    function: Callable[..., tuple[torch.Tensor, Any]]
    module: weakref.ref
    kwargs: dict[str, Any]


class _Calls:
    """The calls the per-request op can make, by an integer a graph records (one per layer and arguments)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.by_key: dict[tuple, int] = {}
        self.calls: list[_Call] = []

    def handle(self, inner: str, module: torch.nn.Module, kwargs: dict[str, Any]) -> int:
        key = (
            inner,
            id(module),
            tuple(sorted((k, id(v) if isinstance(v, torch.Tensor) else v) for k, v in kwargs.items())),
        )
        with self.lock:
            n = self.by_key.get(key)
            if n is not None and self.calls[n].module() is module:
                return n
            self.calls.append(_Call(_inner_function(inner), weakref.ref(module), dict(kwargs)))
            self.by_key[key] = len(self.calls) - 1
            return len(self.calls) - 1


_CALLS = _Calls()


def _layer_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    """The layer's own attention arguments among ``kwargs`` (not the step's metadata): plain values and
    parameters (``s_aux`` sinks). Raises ``TypeError`` for another tensor, which per-request slices would cut wrong."""
    out = {}
    for k, v in kwargs.items():
        if k in _STEP_KWARGS or k.startswith("graphrunner"):
            continue
        if isinstance(v, torch.Tensor) and not isinstance(v, torch.nn.Parameter):
            raise TypeError(
                f"the attention call passes the tensor {k!r}, which graphrunner's per-request attention cannot "
                "slice by request: serve this model with attention='dense'"
            )
        out[k] = v
    return out


@torch.library.custom_op("graphrunner::per_request_attention", mutates_args=(), device_types="cpu")
def per_request_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor, call: int
) -> torch.Tensor:
    """Attention of each request's queries against its own keys: ``[1, tokens, heads, d]`` as transformers'
    attention functions return it. ``query [1, heads, tokens, d]``, ``key``/``value [1, kv_heads, kv, d]``,
    ``mask``: :func:`per_request_mask`'s packing; ``call``: the inner function, layer and arguments registered
    by :func:`step_attention`. Each run of one request's query rows calls the inner function on those rows
    and the request's keys (no mask where every cell is allowed, else the slice's ``0 / -inf`` mask); padding
    rows (``tok_req < 0``) are zeros (nothing reads them). CPU only: the metadata is read on the host."""
    made = _CALLS.calls[call]
    module = made.module()
    if module is None:
        raise RuntimeError("graphrunner's per-request attention outlived the model it was captured for")
    tokens, kv = int(query.shape[2]), int(key.shape[2])
    tok_req, tok_pos, key_req, key_pos, w = _unpack(mask, tokens, kv)
    window = int(w.item())
    out = query.new_zeros((1, tokens, query.shape[1], value.shape[-1]))
    for t0, t1, k0, k1, ok in request_slices(tok_req, tok_pos, key_req, key_pos, None if window < 0 else window):
        part, _ = made.function(
            module,
            query[:, :, t0:t1],
            key[:, :, k0:k1],
            value[:, :, k0:k1],
            None if ok.all() else _float_mask(ok, query.dtype),
            **made.kwargs,
        )
        out[:, t0:t1] = part
    return out


@per_request_attention.register_fake
def _(query, key, value, mask, call):
    return query.new_empty((1, query.shape[2], query.shape[1], value.shape[-1]))


def step_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    **kwargs: Any,
) -> tuple[torch.Tensor, Any]:
    """The attention function registered as :data:`NAME` (transformers' signature: the layer, ``query [1, heads,
    tokens, d]``, ``key``/``value [1, kv_heads, kv, d]``, the mask, the layer's keywords; returns ``(output [1,
    tokens, heads, d], weights or None)``). With :func:`per_request_mask`'s integer mask: the per-request op;
    with any other mask (the step's dense one, or none outside the step): the inner function unchanged."""
    inner = _inner_of(module)
    if isinstance(attention_mask, torch.Tensor) and not attention_mask.is_floating_point():
        call = _CALLS.handle(inner, module, _layer_kwargs(kwargs))
        return torch.ops.graphrunner.per_request_attention(query, key, value, attention_mask, call), None
    return _inner_function(inner)(module, query, key, value, attention_mask, **kwargs)
