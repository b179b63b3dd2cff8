"""The capture-unsafe op catalogue: what a device graph cannot hold.

Owns the rules that make a tape capture fail where a CUDA stream capture
fails (host synchronisation, data-dependent output shapes, host values
computed from tensor data): :func:`check_safe` for every recorded aten op,
the :class:`Guard` torch-function mode for host-reading idioms that never
reach the dispatcher (``tolist``, ``print``, ``.cpu()``, ...), the friendly
names used in :class:`~graphrunner.errors.CaptureUnsafeOpError` messages,
``F.one_hot`` with ``num_classes`` run without its CPU-only host read (as on
CUDA), and :func:`user_frame`, the user's source line named in capture errors.
"""

from __future__ import annotations

import sys
import threading

import torch
from torch.overrides import TorchFunctionMode

from graphrunner._frames import user_frame as _user_frame_of
from graphrunner._frames import where as _where
from graphrunner.errors import CaptureUnsafeOpError

from .state import ActiveCapture

_INDEX_OPS = {"index", "_unsafe_index", "index_put", "index_put_", "_index_put_impl_", "_unsafe_index_put"}

# ops returning non-tensors that only read metadata (safe to freeze)
_METADATA_OPS = {
    "sym_size",
    "sym_stride",
    "sym_numel",
    "sym_storage_offset",
    "size",
    "stride",
    "numel",
    "dim",
    "is_same_size",
    "_has_compatible_shallow_copy_type",
    "is_contiguous",
    "is_strides_like_format",
    "is_non_overlapping_and_dense",
    "is_complex",
    "is_floating_point",
    "is_signed",
    "is_conj",
    "is_neg",
    "is_inference",
    "is_set_to",
    "_nnz",
    "output_nr",
    "_version",
    "is_leaf",
    "retains_grad",
    "storage_offset",
    "is_coalesced",
    "dense_dim",
    "sparse_dim",
    "_is_zerotensor",
    "is_pinned",
    "_debug_has_internal_overlap",
}

_FRIENDLY = {
    "item": "Tensor.item() / float(t) / int(t) of a tensor (reads a value on the host)",
    "_local_scalar_dense": "Tensor.item() / float(t) / int(t) / bool(t) of a tensor (reads a value on the host)",
    "is_nonzero": "bool(t) / `if t:` on a tensor (reads a value on the host)",
    "nonzero": "torch.nonzero / 1-argument torch.where (output shape depends on data)",
    "masked_select": "torch.masked_select (output shape depends on data)",
    "equal": "torch.equal (returns a host bool)",
    "allclose": "torch.allclose (returns a host bool)",
    "bincount": "torch.bincount (output shape depends on data)",
    "repeat_interleave": "torch.repeat_interleave with tensor repeats (output shape depends on data)",
    "_unique2": "torch.unique (output shape depends on data)",
    "_unique": "torch.unique (output shape depends on data)",
    "unique_dim": "torch.unique with dim (output shape depends on data)",
    "unique_consecutive": "torch.unique_consecutive (output shape depends on data)",
    "argwhere": "torch.argwhere (output shape depends on data)",
    "one_hot": "F.one_hot without num_classes (or num_classes=-1: the class count is read on the host; "
    "pass num_classes, a Python int >= 1, and it is capturable, as on CUDA)",
}

# Composite ops that reach the mode whole under inference_mode, untagged.
_EXPLICIT_UNSAFE = {
    "where.default": "1-argument torch.where (a nonzero: output shape depends on data)",
    "nonzero_numpy": "nonzero (output shape depends on data)",
    "argwhere": "torch.argwhere (output shape depends on data)",
    "unique_dim": "torch.unique (output shape depends on data)",
    "_unique": "torch.unique (output shape depends on data)",
    "is_nonzero": _FRIENDLY["is_nonzero"],
}

# Host-reading idioms that reach the dispatcher as nothing (or as an innocuous
# op), caught by a TorchFunctionMode guard instead.  Keyed by __qualname__.
_UNSAFE_FUNCTIONS = {
    "TensorBase.tolist": "Tensor.tolist() (copies data to a Python list on the host)",
    "TensorBase.numpy": "Tensor.numpy() (hands host memory to NumPy)",
    "TensorBase.cpu": "Tensor.cpu() (a device-to-host copy)",
    "Tensor.__repr__": "printing / repr() of a tensor (reads data on the host)",
    "Tensor.__format__": "formatting a tensor (f-string / print) (reads data on the host)",
    "Tensor.__array__": "converting a tensor to a NumPy array",
    "TensorBase.item": "Tensor.item() (reads a value on the host)",
    "TensorBase.__bool__": "bool(t) / `if t:` on a tensor (reads a value on the host)",
    "TensorBase.__float__": "float(t) of a tensor (reads a value on the host)",
    "TensorBase.__int__": "int(t) of a tensor (reads a value on the host)",
    "TensorBase.__index__": "using a tensor as a Python index (reads a value on the host)",
    "TensorBase.__complex__": "complex(t) of a tensor (reads a value on the host)",
    "TensorBase.equal": "Tensor.equal (returns a host bool)",
    "TensorBase.allclose": "Tensor.allclose (returns a host bool)",
    "equal": "torch.equal (returns a host bool)",
    "allclose": "torch.allclose (returns a host bool)",
}


def user_frame() -> str:
    """Describe the innermost stack frame outside torch and the graphrunner
    runtime (:mod:`graphrunner._frames`: the one rule for "the user's line")."""
    return _where(_user_frame_of(sys._getframe(1)))


def _unsafe(what: str, op: str) -> CaptureUnsafeOpError:
    return CaptureUnsafeOpError(
        f"capture-unsafe operation during tape capture: {what} [op: {op}] at {user_frame()}. "
        "A device graph cannot hold a host synchronisation or a data-dependent shape. "
        "Move this code out of the captured region, e.g. into a function decorated with "
        "@no_graph (graphrunner.no_graph) so it runs eagerly between graph segments, "
        "or rewrite it with static shapes."
    )


def _returns_only_tensors(schema) -> bool:
    for r in schema.returns:
        s = str(r.type)
        if s not in ("Tensor", "Tensor?", "List[Tensor]", "List[Optional[Tensor]]", "Tensor[]", "Tensor?[]"):
            return False
    return True


def _op_reason(func) -> tuple[tuple[str, str] | None, str | None]:
    """What :func:`unsafe_reason` decides from the op alone: ``(reason, None)`` (unsafe, or safe
    whatever its arguments) or ``(None, name)`` for an op whose arguments decide (a mask index, a
    ``repeat_interleave`` without ``output_size``)."""
    name = func._schema.name.split("::", 1)[-1]
    tags = func.tags
    # index.Tensor is tagged dynamic_output_shape, but only a bool/uint8 mask
    # index makes it so (checked below): no false alarm on long-index indexing.
    # repeat_interleave.Tensor is tagged too, but is static given output_size
    # (also checked below).
    if (
        name not in _INDEX_OPS
        and name != "repeat_interleave"
        and (torch.Tag.dynamic_output_shape in tags or torch.Tag.data_dependent_output in tags)
    ):
        return (_FRIENDLY.get(name, f"{name} (output shape or value read on the host)"), str(func)), None
    if not _returns_only_tensors(func._schema) and name not in _METADATA_OPS:
        return (_FRIENDLY.get(name, f"{name} (returns a host value computed from tensor data)"), str(func)), None
    if name in _EXPLICIT_UNSAFE or f"{name}.{func._overloadname}" in _EXPLICIT_UNSAFE:
        return (_EXPLICIT_UNSAFE.get(name) or _EXPLICIT_UNSAFE[f"{name}.{func._overloadname}"], str(func)), None
    if name == "repeat_interleave" or name in _INDEX_OPS:
        return None, name
    return None, None


# An op its name, schema and tags do not make unsafe (_op_reason) -> None, or its name when its arguments
# decide: asked once per op, not per recorded call
_SAFE_OPS: dict = {}


def unsafe_reason(func, args, kwargs) -> tuple[str, str] | None:
    """Why the aten op ``func`` called with ``args``/``kwargs`` cannot be held
    by a device graph, as ``(what, op)`` (a friendly description and the op's
    name), or ``None`` when it can. The predicate behind :func:`check_safe`,
    exported for tools that report every unsafe op instead of raising at the
    first (``graphrunner check``)."""
    name = _SAFE_OPS.get(func, False)
    if name is False:
        reason, name = _op_reason(func)
        if reason is not None:  # (not kept: rare, and its text follows the tables as they are now)
            return reason
        _SAFE_OPS[func] = name
    if name is None:
        return None
    if name == "repeat_interleave" and func._overloadname in ("Tensor", "self_Tensor"):
        if kwargs.get("output_size") is None:  # with output_size the shape is static
            return _FRIENDLY[name], str(func)
    if name in _INDEX_OPS:
        idx = args[1] if len(args) > 1 else kwargs.get("indices")
        if "put" in name and _is_masked_fill(args, kwargs):
            return None
        for t in idx or ():
            if isinstance(t, torch.Tensor) and t.dtype in (torch.bool, torch.uint8):
                what = (
                    "boolean-mask assignment x[mask] = v (index_put with a bool mask; data-dependent)"
                    if "put" in name
                    else "boolean-mask indexing x[mask] (output shape depends on data)"
                )
                return what, str(func)
    return None


def _is_masked_fill(args, kwargs) -> bool:
    """Whether an ``index_put`` is ``x[mask] = scalar``: ATen runs it as ``masked_fill_`` (no data-dependent
    shape, no host read), so CUDA stream capture holds it. ATen's condition (``canDispatchToMaskedFill``):
    no accumulation, a one-element value on the host (Python's ``x[mask] = 0`` puts the scalar there, also
    for a CUDA ``x``), and one bool/uint8 index on ``x``'s device whose sizes are ``x``'s dims it indexes."""
    self = args[0] if args else kwargs.get("self")
    idx = args[1] if len(args) > 1 else kwargs.get("indices")
    value = args[2] if len(args) > 2 else kwargs.get("values")
    accumulate = args[3] if len(args) > 3 else kwargs.get("accumulate", False)
    if accumulate or not isinstance(self, torch.Tensor) or not isinstance(value, torch.Tensor):
        return False
    if value.numel() != 1 or value.device.type != "cpu":
        return False
    masks = [t for t in idx or () if t is not None]
    if len(masks) != 1 or masks[0].dtype not in (torch.bool, torch.uint8) or masks[0].device != self.device:
        return False
    start = next(i for i, t in enumerate(idx) if t is not None)
    mask = masks[0]
    return start + mask.dim() <= self.dim() and tuple(mask.shape) == tuple(self.shape[start : start + mask.dim()])


def check_safe(func, args, kwargs) -> None:
    """Raise CaptureUnsafeOpError if ``func`` cannot be held by a device graph."""
    reason = unsafe_reason(func, args, kwargs)
    if reason is not None:
        raise _unsafe(*reason)


def unsafe_function_reason(func, args, kwargs) -> tuple[str, str] | None:
    """Why the torch function ``func`` (seen by a ``TorchFunctionMode``) reads
    a tensor on the host where a device graph cannot, as ``(what, name)``, or
    ``None``: the host-reading idioms that never reach the dispatcher
    (``tolist``, ``print``, ``.cpu()``, ``.item()``, ...) and ``F.one_hot``
    without ``num_classes``. The predicate behind :class:`Guard`."""
    qualname = getattr(func, "__qualname__", None)
    what = _UNSAFE_FUNCTIONS.get(qualname) if qualname is not None else None
    if what is not None:
        return what, qualname or str(func)
    if func is ONE_HOT and _one_hot_reads_host(args, kwargs):
        return _FRIENDLY["one_hot"], "one_hot"
    return None


ONE_HOT = torch.nn.functional.one_hot


def _one_hot_static(args, kwargs) -> torch.Tensor | None:
    """``F.one_hot(t, num_classes)`` as PyTorch runs it on CUDA when
    ``num_classes >= 1`` is given: zeros, then a scatter of ones, with no host
    read of the class values (CUDA relies on the scatter's device assert; on
    the tape an out-of-range class makes the scatter raise).  Raises
    CaptureUnsafeOpError without ``num_classes`` (or with -1: the class count
    is read on the host); returns None for any other call (a non-int64
    input, ...), which then runs as is."""
    t = args[0] if args else kwargs.get("input")
    n = args[1] if len(args) > 1 else kwargs.get("num_classes", -1)
    if type(t) is not torch.Tensor or t.dtype != torch.int64 or len(args) + len(kwargs) > 2:
        return None
    if _one_hot_reads_host(args, kwargs):
        raise _unsafe(_FRIENDLY["one_hot"], "one_hot")
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        return None
    out = torch.zeros(*t.shape, n, dtype=t.dtype, device=t.device)
    return out.scatter_(-1, t.unsqueeze(-1), 1)


def _one_hot_reads_host(args, kwargs) -> bool:
    """True for an ``F.one_hot`` call on an int64 tensor without
    ``num_classes`` (or with -1): the class count is read on the host."""
    t = args[0] if args else kwargs.get("input")
    n = args[1] if len(args) > 1 else kwargs.get("num_classes", -1)
    if type(t) is not torch.Tensor or t.dtype != torch.int64 or len(args) + len(kwargs) > 2:
        return False
    return isinstance(n, int) and not isinstance(n, bool) and n == -1


class Guard(TorchFunctionMode):
    """Rejects host-reading Tensor methods that never reach the dispatcher,
    and runs ``F.one_hot`` with ``num_classes`` without its CPU-only host read."""

    def __init__(self, cap: ActiveCapture):
        super().__init__()
        self.cap = cap

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        reason = unsafe_function_reason(func, args, kwargs)
        if reason is not None:
            err = _unsafe(*reason)
            self.cap.failed = err
            raise err
        if func is ONE_HOT:
            _substituting.call = ("F.one_hot", args, kwargs)
            try:
                out = _one_hot_static(args, kwargs)
            except CaptureUnsafeOpError as err:
                self.cap.failed = err
                raise
            finally:
                _substituting.call = None
            if out is not None:
                return out
        return func(*args, **kwargs)


_substituting = threading.local()


def atomic_call() -> tuple | None:
    """The torch function a tape capture on this thread is running as several aten ops right now
    (``F.one_hot`` as zeros + scatter), as ``(name, args, kwargs)``, else ``None``: an op recorder
    marks the ops it dispatches as one call (:class:`graphrunner.recording.ops.OpEvent`)."""
    return getattr(_substituting, "call", None)
