"""Attention over transformers' varlen batch that computes each request's queries against its own keys only.

The step of continuous batching (:func:`graphrunner.hf.batch_step.make_step`)
hands the model one additive mask ``[1, 1, tokens, kv]`` per attention type: a
block-diagonal pattern (query ``t`` may attend key ``j`` iff the same request,
``key_pos <= position`` and, for sliding layers, ``key_pos > position - window``).
A dense ``scaled_dot_product_attention`` over that mask computes every query
against every key of the step. On the CPU (the tape, or eager on the CPU) this
module replaces that computation, without changing the model's config or any
global:

- :func:`varlen_sdpa` (``torch.ops.graphrunner.varlen_sdpa``) is a custom op
  whose CPU kernel reads the per-token request / position metadata on the host,
  finds each request's run of query rows and its run of keys, and runs
  ``scaled_dot_product_attention`` on those slices (no mask where every key of
  the slice is allowed, e.g. a decode row; else the slice's own 0 / ``-inf``
  mask). A recorder at the dispatch level (the tape) sees one op and calls it
  again at every replay, so the host reads happen at replay, on that call's
  metadata, as a flash-attention varlen kernel reads its ``cu_seqlens``. It is
  not capturable by a CUDA stream capture (host reads): the CUDA path keeps the
  dense mask.
- :class:`VarlenMask` is what the step passes as ``attention_mask``: a tensor
  subclass of the dense mask's shape and dtype that holds the metadata instead
  of the cells. ``F.scaled_dot_product_attention(q, k, v, attn_mask=<it>)`` is
  routed to :func:`varlen_sdpa` where it applies (:meth:`VarlenMask.applies`);
  every other use of the mask (slicing, ``.to``, an eager attention adding it
  to scores it computed densely, ...) gets the dense mask, built once per
  instance by the builder the step hands in (the same ops as before), so every
  model computes the same allowed cells whichever path it takes.
- :class:`VarlenCache` serves models whose attention is transformers' eager
  one (``paged|eager``, or a model's own ``eager_attention_forward``: gemma2,
  gpt_oss): a view of the paged cache whose ``update`` marks the keys and
  values it returns. The eager attention's ops on them (``repeat_kv``,
  ``query @ key.T``, scale, softcapping, ``+ mask``, sinks, ``softmax``) are
  deferred as a chain that ``@ value`` hands to :func:`varlen_eager_attention`,
  the same per-request kernel with that chain; any other use computes the
  deferred ops densely.
"""

import functools
import math
import re
import threading
from collections.abc import Callable
from typing import Any, Optional

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils._pytree import tree_map

__all__ = [
    "VarlenCache",
    "VarlenMask",
    "request_runs",
    "varlen_eager_attention",
    "varlen_sdpa",
    "varlen_sdpa_reference",
]

_SDPA = F.scaled_dot_product_attention

#: Tensor methods and properties answered from the mask's shape, dtype and device, without its cells.
_METADATA = {
    torch.Tensor.shape.__get__,  # type: ignore[attr-defined]
    torch.Tensor.dtype.__get__,  # type: ignore[attr-defined]
    torch.Tensor.device.__get__,
    torch.Tensor.ndim.__get__,  # type: ignore[attr-defined]
    torch.Tensor.layout.__get__,  # type: ignore[attr-defined]
    torch.Tensor.is_cuda.__get__,  # type: ignore[attr-defined]
    torch.Tensor.requires_grad.__get__,  # type: ignore[attr-defined]
    torch.Tensor.dim,
    torch.Tensor.size,
    torch.Tensor.numel,
    torch.Tensor.is_floating_point,
    torch.Tensor.__len__,
}


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


def _float_mask(ok: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    """The additive mask of ``ok``: 0 where allowed, ``-inf`` where not (the dense step mask's values)."""
    return torch.zeros(ok.shape, dtype=dtype).masked_fill_(torch.from_numpy(~ok), float("-inf"))


@torch.library.custom_op("graphrunner::varlen_sdpa", mutates_args=(), device_types="cpu")
def varlen_sdpa(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    tok_req: torch.Tensor,
    tok_pos: torch.Tensor,
    key_req: torch.Tensor,
    key_pos: torch.Tensor,
    window: Optional[int],  # noqa: UP045 - custom_op's schema inference takes typing.Optional
    scale: Optional[float],  # noqa: UP045
    enable_gqa: bool,
) -> torch.Tensor:
    """Varlen attention: ``scaled_dot_product_attention(query, key, value, attn_mask=M, scale=scale,
    enable_gqa=enable_gqa)`` for the block-diagonal mask ``M`` the metadata describes, computed per request.

    ``query [1, heads, tokens, d]``, ``key``/``value [1, kv_heads, kv, d]`` (as sdpa takes them); ``tok_req``,
    ``tok_pos [tokens]`` (each query's request, negative for a padding query, and position); ``key_req``,
    ``key_pos [kv]`` (each key's request, negative for a padding key, and position); ``window`` (sliding
    layers: a key is allowed only if ``key_pos > pos - window``) or ``None``. Query ``t`` attends key ``j``
    iff ``key_req[j] == tok_req[t] >= 0``, ``key_pos[j] <= tok_pos[t]`` and within the window. Each maximal
    run of query rows of one request is computed against its request's keys: their one contiguous run
    (transformers lays keys out request by request), with no mask when every cell is allowed, else that
    slice's ``0 / -inf`` mask; a request whose keys are not one run is computed against every key with its
    rows' full mask (the same cells, only slower). Padding query rows (``tok_req < 0``) are zeros (the dense
    mask lets them see every key; nothing reads them). Values equal the dense masked sdpa's up to the
    rounding of different split sizes (~1e-7 in float32). CPU only: the metadata is read on the host."""
    out = query.new_zeros((*query.shape[:-1], value.shape[-1]))
    with torch._C.DisableTorchFunction():  # host reads of the metadata: a capture's guard would refuse them
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
        if span is None:  # not one run (or none): every key, this rows' full mask
            ok = (kr[None, :] == r) & _allowed(tp[t0:t1], kp, window)
            k0, k1 = 0, kr.shape[0]
        else:
            k0, k1 = span
            ok = _allowed(tp[t0:t1], kp[k0:k1], window)
        mask = None if ok.all() else _float_mask(ok, query.dtype)
        out[:, :, t0:t1] = _SDPA(
            query[:, :, t0:t1],
            key[:, :, k0:k1],
            value[:, :, k0:k1],
            attn_mask=mask,
            scale=scale,
            enable_gqa=enable_gqa,
        )
    return out


@varlen_sdpa.register_fake
def _(query, key, value, tok_req, tok_pos, key_req, key_pos, window, scale, enable_gqa):
    return query.new_empty((*query.shape[:-1], value.shape[-1]))


def varlen_sdpa_reference(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    tok_req: torch.Tensor,
    tok_pos: torch.Tensor,
    key_req: torch.Tensor,
    key_pos: torch.Tensor,
    window: int | None,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> torch.Tensor:
    """The meaning of :func:`varlen_sdpa` as one dense masked sdpa (torch ops only): the ``[tokens, kv]`` mask
    of the allowed cells, ``-inf`` elsewhere; padding query rows zeroed. A reference for tests."""
    ok = (tok_req[:, None] == key_req[None, :]) & (tok_req >= 0)[:, None]
    ok &= key_pos[None, :] <= tok_pos[:, None]
    if window is not None:
        ok &= key_pos[None, :] > tok_pos[:, None] - window
    pad = tok_req < 0
    ok |= pad[:, None]  # a padding row sees every key (finite), then is zeroed
    mask = torch.zeros(ok.shape, dtype=query.dtype).masked_fill_(~ok, float("-inf"))
    out = _SDPA(query, key, value, attn_mask=mask, scale=scale, enable_gqa=enable_gqa)
    return out.masked_fill(pad[:, None], 0.0)


class VarlenMask(torch.Tensor):
    """The step's attention mask of one attention type, as metadata: shape ``[1, 1, tokens, kv]`` and the
    dense mask's dtype and device, no cells of its own.

    ``F.scaled_dot_product_attention(query, key, value, attn_mask=<it>)`` runs :func:`varlen_sdpa` where
    :meth:`applies` says so; any other torch function that receives it (the eager attention's ``scores +
    mask``, indexing, ``.to``, ``torch.where``, ...) receives :meth:`dense` instead, the mask ``dense_fn``
    builds (0 allowed, ``-inf`` masked; built once per instance, so the layers of one step share it).
    Metadata queries (``shape``, ``dtype``, ``device``, ``dim()``, ``size()``, ...) are answered without
    building it. Made by :meth:`make`; never reaches the dispatcher (a bug if it does: it raises)."""

    tok_req: torch.Tensor
    tok_pos: torch.Tensor
    key_req: torch.Tensor
    key_pos: torch.Tensor
    window: int | None
    _dense_fn: Callable[[], torch.Tensor]
    _dense: torch.Tensor | None
    _lock: threading.Lock

    @staticmethod
    def __new__(cls, *args: Any, **kwargs: Any) -> "VarlenMask":
        raise TypeError("VarlenMask is made by VarlenMask.make(...)")

    @classmethod
    def make(
        cls,
        tok_req: torch.Tensor,
        tok_pos: torch.Tensor,
        key_req: torch.Tensor,
        key_pos: torch.Tensor,
        window: int | None,
        dtype: torch.dtype,
        dense_fn: Callable[[], torch.Tensor],
    ) -> "VarlenMask":
        """The mask of ``tok_req``/``tok_pos [tokens]`` against ``key_req``/``key_pos [kv]`` (int tensors on
        the CPU, read by :func:`varlen_sdpa` when it runs) with ``window`` (``None``: full attention), in
        ``dtype``; ``dense_fn()`` must return the same mask as a ``[1, 1, tokens, kv]`` tensor of ``dtype``
        (0 / ``-inf``)."""
        shape = (1, 1, int(tok_req.shape[0]), int(key_req.shape[0]))
        self = torch.Tensor._make_wrapper_subclass(cls, shape, dtype=dtype, device=tok_req.device)
        self.tok_req, self.tok_pos, self.key_req, self.key_pos = tok_req, tok_pos, key_req, key_pos
        self.window = window
        self._dense_fn, self._dense, self._lock = dense_fn, None, threading.Lock()
        return self

    def dense(self) -> torch.Tensor:
        """The dense mask ``[1, 1, tokens, kv]`` (built on first use, then kept)."""
        with self._lock:
            if self._dense is None:
                self._dense = self._dense_fn()
            return self._dense

    def applies(self, query: Any, key: Any, value: Any, kwargs: dict) -> bool:
        """Whether ``F.scaled_dot_product_attention(query, key, value, attn_mask=self, **kwargs)`` means
        :func:`varlen_sdpa` on this mask's metadata: CPU tensors of rank 4, batch 1, the query's rows the
        mask's tokens (not transformers' ``pack_gqa`` of a one-token step, whose rows are heads), the keys
        the mask's keys, no dropout, not causal, and heads that sdpa itself would accept."""
        tokens, kv = self.shape[2], self.shape[3]
        if not all(isinstance(t, torch.Tensor) and type(t) is torch.Tensor for t in (query, key, value)):
            return False
        if not (query.dim() == key.dim() == value.dim() == 4) or query.device.type != "cpu":
            return False
        if key.device != query.device or value.device != query.device or self.device != query.device:
            return False
        if query.shape[0] != 1 or key.shape[0] != 1 or value.shape[0] != 1:
            return False
        if query.shape[2] != tokens or key.shape[2] != kv or value.shape[2] != kv:
            return False
        if kwargs.get("dropout_p", 0.0) != 0.0 or kwargs.get("is_causal", False):
            return False
        if set(kwargs) - {"dropout_p", "is_causal", "scale", "enable_gqa"}:
            return False
        gqa = bool(kwargs.get("enable_gqa", False))
        heads, kv_heads = query.shape[1], key.shape[1]
        return value.shape[1] == kv_heads and (heads == kv_heads or (gqa and heads % kv_heads == 0))

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func in _METADATA:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        if any(t is not cls and issubclass(t, _Lazy) for t in types):
            return NotImplemented  # the deferred attention's handler sees this call
        if func is _SDPA:
            q, k, v, *rest = args
            mask = rest[0] if rest else kwargs.pop("attn_mask", None)
            extra = dict(zip(("dropout_p", "is_causal", "scale", "enable_gqa"), rest[1:]))
            extra.update(kwargs)
            if isinstance(mask, VarlenMask) and mask.applies(q, k, v, extra):
                return torch.ops.graphrunner.varlen_sdpa(
                    q,
                    k,
                    v,
                    mask.tok_req,
                    mask.tok_pos,
                    mask.key_req,
                    mask.key_pos,
                    mask.window,
                    extra.get("scale"),
                    bool(extra.get("enable_gqa", False)),
                )
            if rest:
                args = (q, k, v, *rest)
            else:
                args = (q, k, v)
                kwargs["attn_mask"] = mask
        args, kwargs = tree_map(_densify, (args, kwargs))
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):  # type: ignore[override]
        raise RuntimeError(
            f"a VarlenMask reached the dispatcher ({func}): every torch function should have received its dense "
            "mask (graphrunner.hf.varlen_attention)"
        )

    def __repr__(self, *, tensor_contents: Any = None) -> str:  # type: ignore[override]
        return f"VarlenMask(shape={tuple(self.shape)}, dtype={self.dtype}, window={self.window})"


def _densify(x: Any) -> Any:
    return x.dense() if isinstance(x, VarlenMask) else x


# ---------------------------------------------------------------- transformers' eager attention


#: The chains :func:`varlen_eager_attention` computes (step names joined by ``,``): elementwise scalar steps
#: before the mask, then the mask, optional sinks and centring, the softmax, casts, the sink column dropped.
_CHAIN = re.compile(
    r"^((mul|div)=[^,]+,|tanh,)*mask,(sinks,)?(center,)?softmax=[a-z0-9]+,(to=[a-z0-9]+,)?(drop,)?(to=[a-z0-9]+,)?$"
)


@functools.lru_cache(maxsize=64)
def _parse_chain(chain: str) -> tuple[tuple[str, Any], ...]:
    """``chain`` (``"mul=0.25,tanh,mask,softmax=float32,to=float32"``) as ``((name, argument), ...)``."""
    if not _CHAIN.match(chain + ","):
        raise ValueError(f"not an attention chain varlen_eager_attention computes: {chain!r}")
    steps: list[tuple[str, Any]] = []
    for part in chain.split(","):
        name, _, arg = part.partition("=")
        if name in ("mul", "div"):
            steps.append((name, float(arg)))
        elif name in ("softmax", "to"):
            steps.append((name, None if arg == "none" else getattr(torch, arg)))
        else:
            steps.append((name, None))
    if ("sinks", None) in steps and ("drop", None) not in steps:
        raise ValueError(f"sinks without their column dropped: {chain!r}")
    return tuple(steps)


@torch.library.custom_op("graphrunner::varlen_eager_attention", mutates_args=(), device_types="cpu")
def varlen_eager_attention(
    query: torch.Tensor,
    key_t: torch.Tensor,
    value: torch.Tensor,
    tok_req: torch.Tensor,
    tok_pos: torch.Tensor,
    key_req: torch.Tensor,
    key_pos: torch.Tensor,
    window: Optional[int],  # noqa: UP045 - custom_op's schema inference takes typing.Optional
    chain: str,
    sinks: Optional[torch.Tensor],  # noqa: UP045
) -> torch.Tensor:
    """transformers' eager attention (after its ``repeat_kv``) per request: for each run of query rows of one
    request against its key run (as :func:`varlen_sdpa` finds them), ``w = query @ key_t`` (``key_t [1,
    heads, d, kv]``), then ``chain``'s steps in order: ``mul=c`` / ``div=c`` (a Python float), ``tanh``
    (softcapping), ``mask`` (``+`` the slice's ``0 / -inf`` mask, skipped where every cell is allowed),
    ``sinks`` (``cat([w, sinks], -1)``, ``sinks [1, heads, tokens, 1]``), ``center`` (``w - rowmax``),
    ``softmax=<dtype>`` (over the keys; ``none``: no dtype), ``to=<dtype>``, ``drop`` (the sink column);
    then ``@ value``. The chain must match ``_CHAIN`` (elementwise steps only before the mask, row
    reductions only after it: where slicing a row to its request's keys is exact in meaning). Padding query
    rows are zeros. The dense computation's values to float rounding."""
    steps = _parse_chain(chain)
    out = query.new_zeros((*query.shape[:-1], value.shape[-1]))
    with torch._C.DisableTorchFunction():
        tr, tp = tok_req.numpy(), tok_pos.numpy()
        kr, kp = key_req.numpy(), key_pos.numpy()
    keys: dict[int, tuple[int, int] | None] = {}
    for r, k0, k1 in request_runs(kr):
        if r >= 0:
            keys[r] = (k0, k1) if r not in keys else None
    for r, t0, t1 in request_runs(tr):
        if r < 0:
            continue
        span = keys.get(r)
        if span is None:
            ok = (kr[None, :] == r) & _allowed(tp[t0:t1], kp, window)
            k0, k1 = 0, kr.shape[0]
        else:
            k0, k1 = span
            ok = _allowed(tp[t0:t1], kp[k0:k1], window)
        w = torch.matmul(query[:, :, t0:t1], key_t[..., k0:k1])
        for name, arg in steps:
            if name == "mul":
                w = w * arg
            elif name == "div":
                w = w / arg
            elif name == "tanh":
                w = torch.tanh(w)
            elif name == "mask":
                if not ok.all():
                    w = w + _float_mask(ok, w.dtype)
            elif name == "sinks":
                assert sinks is not None
                w = torch.cat([w, sinks[:, :, t0:t1]], dim=-1)
            elif name == "center":
                w = w - w.max(dim=-1, keepdim=True).values
            elif name == "softmax":
                w = F.softmax(w, dim=-1, dtype=arg)
            elif name == "to":
                w = w.to(arg)
            elif name == "drop":
                w = w[..., :-1]
        out[:, :, t0:t1] = torch.matmul(w, value[:, :, k0:k1])
    return out


@varlen_eager_attention.register_fake
def _(query, key_t, value, tok_req, tok_pos, key_req, key_pos, window, chain, sinks):
    return query.new_empty((*query.shape[:-1], value.shape[-1]))


_FULL = slice(None)


class _Lazy(torch.Tensor):
    """A deferred tensor of transformers' eager attention over a :class:`VarlenMask`.

    ``kind``: ``"kv"`` (a key or value the cache returned, ``held``, its keys axis ``axis``),
    ``"scores"`` (``query @ key_t`` and the steps of ``state["chain"]`` so far), ``"rowmax"`` (a scores
    node's ``max(-1, keepdim=True).values``), ``"other"``; a ``matmul`` of scores whose chain is complete
    with the value runs :func:`varlen_eager_attention`. Any other use materialises the node by replaying
    the ops that made it (``origin``) on materialised inputs: the dense computation."""

    kind: str
    mask: VarlenMask
    held: torch.Tensor | None
    axis: int
    state: dict[str, Any]
    origin: Callable[[], torch.Tensor]
    _value: torch.Tensor | None

    @staticmethod
    def __new__(cls, *args: Any, **kwargs: Any) -> "_Lazy":
        raise TypeError("made by _Lazy.node(...)")

    @classmethod
    def node(
        cls,
        kind: str,
        mask: VarlenMask,
        shape: Any,
        dtype: torch.dtype,
        origin: Callable[[], torch.Tensor],
        held: torch.Tensor | None = None,
        axis: int = -1,
        **state: Any,
    ) -> "_Lazy":
        self = torch.Tensor._make_wrapper_subclass(cls, tuple(shape), dtype=dtype, device=mask.device)
        self.kind, self.mask, self.held, self.axis, self.state = kind, mask, held, axis, state
        self.origin, self._value = origin, None
        return self

    def value(self) -> torch.Tensor:
        """The dense value (``held`` for a key or value; else the ops that made it, replayed once)."""
        if self.held is not None:
            return self.held
        if self._value is None:
            self._value = self.origin()
        return self._value

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _METADATA:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        got = _advance(func, args, kwargs)
        if got is not None:
            return got
        return _call_dense(func, args, kwargs)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):  # type: ignore[override]
        raise RuntimeError(
            f"a deferred attention tensor reached the dispatcher ({func}): graphrunner.hf.varlen_attention"
        )

    def __repr__(self, *, tensor_contents: Any = None) -> str:  # type: ignore[override]
        return f"_Lazy({self.kind}, shape={tuple(self.shape)}, dtype={self.dtype})"


def _dense_of(x: Any) -> Any:
    if isinstance(x, _Lazy):
        return x.value()
    if isinstance(x, VarlenMask):
        return x.dense()
    return x


def _call_dense(func, args, kwargs):
    """``func`` on the dense values of every deferred tensor and mask among its arguments."""
    args, kwargs = tree_map(_dense_of, (args, kwargs))
    with torch._C.DisableTorchFunctionSubclass():
        return func(*args, **kwargs)


def _plain(func, *args, **kwargs):
    with torch._C.DisableTorchFunctionSubclass():
        return func(*args, **kwargs)


def _kv_axis_after_getitem(index: Any, axis: int) -> int | None:
    """The keys axis after ``x[index]`` for an index of full slices and ``None``s (``x[:, :, None]``)."""
    items = index if isinstance(index, tuple) else (index,)
    if any(not (i is None or (isinstance(i, slice) and i == _FULL)) for i in items):
        return None
    out = src = 0
    for i in items:
        if i is None:
            out += 1
            continue
        if src == axis:
            return out
        src += 1
        out += 1
    return out + (axis - src) if axis >= src else None


def _scalar(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _dtype_name(d: torch.dtype | None) -> str:
    return "none" if d is None else str(d).removeprefix("torch.")


_MUL = (torch.Tensor.__mul__, torch.mul, torch.Tensor.mul)
_DIV = (torch.Tensor.__truediv__, torch.Tensor.__div__, torch.div, torch.true_divide, torch.Tensor.div)
_ADD = (torch.Tensor.__add__, torch.add, torch.Tensor.add)
_SUB = (torch.Tensor.__sub__, torch.sub, torch.Tensor.sub)
_TANH = (torch.tanh, torch.Tensor.tanh)


def _step(func, node: "_Lazy", args, kwargs) -> str | None:
    """The chain step ``func(*args, **kwargs)`` is on scores ``node`` (``args[0]``), else ``None``."""
    n = len(args)
    if func in _MUL and n == 2 and not kwargs and _scalar(args[1]):
        return f"mul={float(args[1])!r}"
    if func in _DIV and n == 2 and not kwargs and _scalar(args[1]) and args[1] != 0:
        return f"div={float(args[1])!r}"
    if func in _TANH and n == 1 and not kwargs:
        return "tanh"
    if func in _ADD and n == 2 and not kwargs and args[1] is node.mask:
        return "mask"
    if func in _SUB and n == 2 and not kwargs:
        m = args[1]
        if isinstance(m, _Lazy) and m.kind == "rowmax" and m.state["of"] is node:
            return "center"
    if func is F.softmax and n == 1 and kwargs.get("dim") in (-1, node.dim() - 1):
        dtype = kwargs.get("dtype")
        if set(kwargs) <= {"dim", "dtype", "_stacklevel"} and (dtype is None or isinstance(dtype, torch.dtype)):
            return f"softmax={_dtype_name(dtype)}"
    if func is torch.Tensor.to and n == 2 and not kwargs and isinstance(args[1], torch.dtype):
        return f"to={_dtype_name(args[1])}"
    if func is torch.Tensor.__getitem__ and n == 2 and isinstance(args[1], tuple):
        if args[1] == (Ellipsis, slice(None, -1, None)) and node.state["sinks"] is not None:
            return "drop"
    return None


def _advance(func, args, kwargs) -> Any:
    """The deferred result of ``func(*args, **kwargs)`` where it continues an eager attention over the
    step's masks, the op's result where it ends one, else ``None`` (the caller computes it densely)."""
    a0 = args[0] if args else kwargs.get("input")
    if isinstance(a0, _Lazy) and a0.kind == "kv":
        return _advance_kv(func, a0, args, kwargs)
    if func is torch.matmul and len(args) == 2 and not kwargs:
        q, b = args
        if type(q) is torch.Tensor and isinstance(b, _Lazy) and b.kind == "kv":
            return _scores(q, b)
        if isinstance(q, _Lazy) and q.kind == "scores" and isinstance(b, _Lazy) and b.kind == "kv":
            return _finish(q, b)
        return None
    if func is torch.cat and isinstance(a0, (list, tuple)) and len(a0) == 2:
        return _cat_sinks(a0, args, kwargs)
    if not (isinstance(a0, _Lazy) and a0.kind == "scores"):
        return None
    node = a0
    if func is F.dropout and len(args) == 1 and kwargs.get("training") is False and not kwargs.get("inplace"):
        return node  # dropout in eval mode: the input itself
    if func is torch.Tensor.max and len(args) == 1 and kwargs == {"dim": -1, "keepdim": True}:
        values = _derive(node, "rowmax", func, args, kwargs, pick=0, of=node)
        indices = _Lazy.node("other", node.mask, values.shape, torch.int64, lambda: _call_dense(func, args, kwargs)[1])
        return torch.return_types.max((values, indices))
    step = _step(func, node, args, kwargs)
    if step is None:
        return None
    return _derive(node, "scores", func, args, kwargs, chain=(*node.state["chain"], step))


def _derive(node: _Lazy, kind: str, func, args, kwargs, **changes: Any) -> _Lazy:
    """A deferred ``func(*args, **kwargs)`` continuing ``node``: its state with ``changes``."""
    meta_args, meta_kwargs = tree_map(_meta_of, (args, kwargs))
    meta = _plain(func, *meta_args, **meta_kwargs)
    pick = changes.pop("pick", None)
    if pick is not None:
        meta = meta[pick]

    def origin():
        out = _call_dense(func, args, kwargs)
        return out[pick] if pick is not None else out

    state: dict[str, Any] = {**node.state, **changes}
    return _Lazy.node(kind, node.mask, meta.shape, meta.dtype, origin, **state)


def _meta_of(x: Any) -> Any:
    if isinstance(x, (_Lazy, VarlenMask)) or (isinstance(x, torch.Tensor) and x.device.type != "meta"):
        return torch.empty(x.shape, dtype=x.dtype, device="meta")
    return x


def _advance_kv(func, node: _Lazy, args, kwargs) -> Any:
    """A key or value through ``repeat_kv`` and ``transpose``: the real op, the keys axis followed."""
    real = node.held
    assert real is not None
    rest = args[1:]
    axis: int | None = None
    if func is torch.Tensor.__getitem__ and len(rest) == 1 and not kwargs:
        axis = _kv_axis_after_getitem(rest[0], node.axis)
    elif func in (torch.Tensor.expand, torch.Tensor.contiguous) and not kwargs:
        axis = node.axis
    elif func in (torch.Tensor.reshape, torch.Tensor.view) and not kwargs:
        axis = node.axis  # checked below: the dims from the keys axis on are unchanged
    elif func is torch.Tensor.transpose and len(rest) == 2 and not kwargs and all(isinstance(d, int) for d in rest):
        d0, d1 = (d % real.dim() for d in rest)
        axis = d1 if node.axis == d0 else d0 if node.axis == d1 else node.axis
    if axis is None:
        return None
    out = _plain(func, real, *rest, **kwargs)
    if func in (torch.Tensor.reshape, torch.Tensor.view):
        tail = real.dim() - node.axis
        if out.dim() < tail or tuple(out.shape[out.dim() - tail :]) != tuple(real.shape[node.axis :]):
            return out
        axis = out.dim() - tail
    if out.shape[axis] != node.mask.shape[3]:
        return out
    return _Lazy.node("kv", node.mask, out.shape, out.dtype, lambda: out, held=out, axis=axis)


def _scores(q: torch.Tensor, k: _Lazy) -> Any:
    """``query @ key_t``, deferred where the shapes are the step's: ``[1, heads, tokens, d] @ [1, heads, d, kv]``."""
    kt = k.held
    assert kt is not None
    mask = k.mask
    if not (
        q.dim() == kt.dim() == 4
        and k.axis == 3
        and q.shape[0] == kt.shape[0] == 1
        and q.shape[1] == kt.shape[1]
        and q.shape[2] == mask.shape[2]
        and q.shape[3] == kt.shape[2]
        and q.dtype == kt.dtype
        and q.device.type == "cpu"
    ):
        return None
    shape = (1, q.shape[1], q.shape[2], kt.shape[3])
    return _Lazy.node(
        "scores", mask, shape, q.dtype, lambda: _plain(torch.matmul, q, kt), q=q, kt=kt, chain=(), sinks=None
    )


def _cat_sinks(pair, args, kwargs) -> Any:
    """``cat([scores, sinks], dim=-1)`` of scores and a plain ``[1, heads, tokens, 1]`` sinks tensor."""
    node, sinks = pair
    dim = kwargs.get("dim", args[1] if len(args) > 1 else 0)
    if not (isinstance(node, _Lazy) and node.kind == "scores" and type(sinks) is torch.Tensor and dim in (-1, 3)):
        return None
    if node.state["sinks"] is not None or tuple(sinks.shape) != (*node.shape[:3], 1) or sinks.dtype != node.dtype:
        return None
    return _derive(node, "scores", torch.cat, args, kwargs, sinks=sinks, chain=(*node.state["chain"], "sinks"))


def _finish(p: _Lazy, v: _Lazy) -> Any:
    """``probs @ value`` of a complete chain: :func:`varlen_eager_attention` on the chain's inputs."""
    st, mask, vr = p.state, p.mask, v.held
    assert vr is not None
    chain = ",".join(st["chain"])
    if v.mask is not mask or not _CHAIN.match(chain + ","):
        return None
    if ("sinks" in st["chain"]) != ("drop" in st["chain"]):
        return None
    q = st["q"]
    if not (vr.dim() == 4 and v.axis == 2 and vr.shape[:2] == q.shape[:2] and vr.dtype == p.dtype):
        return None
    return torch.ops.graphrunner.varlen_eager_attention(
        q, st["kt"], vr, mask.tok_req, mask.tok_pos, mask.key_req, mask.key_pos, mask.window, chain, st["sinks"]
    )


class VarlenCache:
    """A view of transformers' ``PagedAttentionCache`` for one step whose ``update`` returns the layer's keys
    and values marked with the layer's :class:`VarlenMask`, so that transformers' eager attention
    (``paged|eager`` or a model's own ``eager_attention_forward``: ``repeat_kv``, ``query @ key.T * scale``,
    softcapping, ``+ mask``, sinks, ``softmax``, ``@ value``) runs as :func:`varlen_eager_attention`; any
    other use of them gets the real tensors (and of a deferred result, the dense computation). Every other
    attribute is the cache's. ``masks``: layer type -> mask."""

    def __init__(self, cache: Any, masks: dict[str, VarlenMask]) -> None:
        self._cache, self._masks = cache, masks

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kw: Any):
        """The cache's ``update``; its keys and values marked (see the class)."""
        k, v = self._cache.update(key_states, value_states, layer_idx, *args, **kw)
        mask = self._masks.get(self._cache.layer_to_allocator[layer_idx].layer_type)
        if mask is None or type(k) is not torch.Tensor or type(v) is not torch.Tensor or k.dim() != 4:
            return k, v
        if k.shape[2] != mask.shape[3] or v.shape[2] != mask.shape[3]:
            return k, v
        return _marked(k, mask), _marked(v, mask)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._cache, name)


def _marked(t: torch.Tensor, mask: VarlenMask) -> "_Lazy":
    """``t`` (``[1, kv_heads, kv, d]``) as a deferred key or value over ``mask``."""
    return _Lazy.node("kv", mask, t.shape, t.dtype, lambda: t, held=t, axis=2)
