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
- Models whose attention is transformers' eager one (gemma2, gpt_oss) never
  call sdpa: :mod:`graphrunner.hf.varlen_eager` serves them with the same
  per-request loop (:func:`request_slices`).
"""

import threading
from collections.abc import Callable, Iterator
from typing import Any, Optional

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils._pytree import tree_map

__all__ = [
    "CellessTensor",
    "VarlenMask",
    "float_mask",
    "request_runs",
    "request_slices",
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


class CellessTensor(torch.Tensor):
    """A tensor of a shape, dtype and device with no cells of its own: the base of :class:`VarlenMask` and
    of :mod:`graphrunner.hf.varlen_eager`'s deferred tensors. Made by :meth:`wrap` in a subclass's
    classmethod (calling the class raises ``TypeError``); its subclass's ``__torch_function__`` decides
    every torch function (metadata queries, ``_METADATA``, are answered without cells), so one never
    reaches the dispatcher: if it does, ``RuntimeError`` names the op (a torch function went unhandled)."""

    @staticmethod
    def __new__(cls, *args: Any, **kwargs: Any) -> "CellessTensor":
        raise TypeError(f"{cls.__name__} is made by its classmethods (CellessTensor.wrap), not called")

    @classmethod
    def wrap(cls, shape: Any, dtype: torch.dtype, device: torch.device) -> Any:
        """A new instance of ``cls`` of ``shape``, ``dtype`` and ``device``, no storage; the caller sets its fields."""
        return torch.Tensor._make_wrapper_subclass(cls, tuple(shape), dtype=dtype, device=device)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):  # type: ignore[override]
        raise RuntimeError(
            f"a {cls.__name__} reached the dispatcher ({func}): its __torch_function__ should have handed every "
            "torch function dense tensors (graphrunner.hf.varlen_attention)"
        )


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


def float_mask(ok: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    """The additive mask of ``ok``: 0 where allowed, ``-inf`` where not (the dense step mask's values)."""
    return torch.zeros(ok.shape, dtype=dtype).masked_fill_(torch.from_numpy(~ok), float("-inf"))


def request_slices(
    tok_req: torch.Tensor, tok_pos: torch.Tensor, key_req: torch.Tensor, key_pos: torch.Tensor, window: int | None
) -> Iterator[tuple[int, int, int, int, np.ndarray]]:
    """``(t0, t1, k0, k1, ok)`` for each maximal run ``t0:t1`` of query rows of one request (padding rows,
    ``tok_req < 0``, skipped): ``k0:k1`` is the request's one contiguous run of keys (transformers lays
    keys out request by request), ``ok [t1 - t0, k1 - k0]`` the cells those rows may attend (``key_pos <=
    position``, within ``window``). A request whose keys are not one run gets every key (``0:kv``) and ok
    also tests ``key_req``: the same cells, only slower. The metadata (1-d int CPU tensors) is read on the
    host; the one loop both per-request kernels run."""
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
        if span is None:  # not one run (or none): every key, these rows' full mask
            yield t0, t1, 0, int(kr.shape[0]), (kr[None, :] == r) & _allowed(tp[t0:t1], kp, window)
        else:
            k0, k1 = span
            yield t0, t1, k0, k1, _allowed(tp[t0:t1], kp[k0:k1], window)


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
    for t0, t1, k0, k1, ok in request_slices(tok_req, tok_pos, key_req, key_pos, window):
        out[:, :, t0:t1] = _SDPA(
            query[:, :, t0:t1],
            key[:, :, k0:k1],
            value[:, :, k0:k1],
            attn_mask=None if ok.all() else float_mask(ok, query.dtype),
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


class VarlenMask(CellessTensor):
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
        self = cls.wrap(shape, dtype, tok_req.device)
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
        if any(t is not cls and getattr(t, "handles_varlen_masks", False) for t in types):
            return NotImplemented  # the deferred eager attention's handler (graphrunner.hf.varlen_eager) sees this call
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

    def __repr__(self, *, tensor_contents: Any = None) -> str:  # type: ignore[override]
        return f"VarlenMask(shape={tuple(self.shape)}, dtype={self.dtype}, window={self.window})"


def _densify(x: Any) -> Any:
    return x.dense() if isinstance(x, VarlenMask) else x
