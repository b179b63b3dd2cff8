"""transformers' eager attention over the continuous-batching step, per request: a deferred chain run as one op.

Models whose attention is transformers' eager one (``paged|eager``, or a
model's own ``eager_attention_forward``: gemma2's softcapping, gpt_oss's
sinks) compute ``query @ key.T`` densely themselves and never call sdpa, so a
:class:`~graphrunner.hf.varlen_attention.VarlenMask` alone would only save the
mask's add. :class:`VarlenCache` is a view of the paged cache for one step
whose ``update`` marks the keys and values it returns. The eager attention's
ops on them (``repeat_kv``, ``query @ key.T``, scale, softcapping, ``+ mask``,
sinks, ``softmax``) are deferred as a chain that ``@ value`` hands to
:func:`varlen_eager_attention`, which runs that chain per request
(:func:`~graphrunner.hf.varlen_attention.request_slices`). A chain is accepted
only where slicing a row to its request's keys is exact in meaning
(elementwise scalar steps before the mask, row reductions after it); any other
use of a deferred tensor computes the deferred ops densely, as before.
"""

import functools
import math
import re
from collections.abc import Callable
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch.utils._pytree import tree_map

from graphrunner.hf.varlen_attention import _METADATA, CellessTensor, VarlenMask, float_mask, request_slices

__all__ = ["VarlenCache", "varlen_eager_attention"]

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
    for t0, t1, k0, k1, ok in request_slices(tok_req, tok_pos, key_req, key_pos, window):
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
                    w = w + float_mask(ok, w.dtype)
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


class _Lazy(CellessTensor):
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
    #: a VarlenMask among a call's arguments defers to this class's handler
    handles_varlen_masks = True

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
        self = cls.wrap(shape, dtype, mask.device)
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
