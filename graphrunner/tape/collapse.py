"""Composite calls collapsed to the one kernel they reach, for replay.

Owns one rewrite of the generated replay: a call of a composite binding
(``torch.matmul``, which ``linear`` replays through) that writes a
preplanned ``out=`` buffer, with arguments fixed for the graph's life
(externals, constants, preplanned buffers), becomes a direct call of the
single kernel the composite runs (``torch.mm`` / ``torch.bmm`` /
``torch.mv`` with ``out=``), on the very views the composite would build.
``torch.matmul(x, w, out=o)`` on a ``[B, 1, K]`` input spends about a
microsecond, a 4-d attention matmul about three, building those views at
every call; a decode step has dozens.

The rewrite is found by running the composite once at capture end under a
dispatch mode that logs what it reaches (:func:`collapse`), on a scratch
output of the buffer's metadata.  It is kept only when the log is nothing
but view ops plus exactly one kernel of :data:`_KERNELS`, whose inputs are
views of the call's own arguments (no copy made on the way, e.g. a
``contiguous()`` of an unfoldable input) and whose ``out=`` is a view of the
output.  The composite's choice of path depends only on metadata (dims,
sizes, strides, dtype), which a graph freezes, so the kernel then sees the
same tensors, data included, at every replay: bit-identical to the
composite for any data, not only the capture's.
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from .bindings import _VF
from .state import _storage

_aten = torch.ops.aten
# The kernels a collapsed call may reach, and the binding that calls each
# with out= (structured kernels: the functional and out= forms share one
# implementation).
_KERNELS = {_aten.mm.default: _VF.mm, _aten.bmm.default: _VF.bmm}
# The composite bindings tried.
COLLAPSIBLE = frozenset({_VF.matmul})
# Off only in the negative-control test: ignore what else the composite ran
# besides the kernel and the final copy (a clone of an input on the way: the
# replay would then read the copy made at capture end).
ONLY_VIEWS = True
# ``_unsafe_view`` returns a view without declaring it (no alias annotation).
_VIEWS = frozenset({_aten._unsafe_view.default})


class _Log(TorchDispatchMode):
    """Records every aten call that reaches the Python dispatch key, composites
    decomposed (only the ops they reach are recorded), with its result."""

    def __init__(self):
        super().__init__()
        self.calls: list = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if torch._C._dispatch_has_kernel_for_dispatch_key(func.name(), "CompositeImplicitAutograd"):
            # the composite's own kernel (what runs outside a mode), with the
            # ops it reaches coming back through this mode
            with self:
                out = func.decompose(*args, **kwargs)
            if out is not NotImplemented:
                return out
        out = func(*args, **kwargs)
        self.calls.append((func, args, kwargs, out))
        return out


def _storage_ptr(t: torch.Tensor):
    st = _storage(t)
    return st.data_ptr() if st is not None and st.nbytes() else None


def _whole(t: torch.Tensor, base: torch.Tensor) -> bool:
    """``t`` covers all of contiguous ``base``, in its memory order."""
    return (t.is_contiguous() and base.is_contiguous() and t.numel() == base.numel()
            and _storage_ptr(t) == _storage_ptr(base) and t.storage_offset() == base.storage_offset())


def collapse(call, args: list, out: torch.Tensor):
    """The direct kernel call that ``call(*args, out=out)`` amounts to:
    ``(binding, args, out_view)`` such that ``binding(*args, out=out_view)``
    computes what the composite computes, with the same kernel on the same
    input views, and leaves in ``out`` what the composite leaves there; or
    None when ``call`` is not collapsible here.

    Accepted composite runs (logged on a scratch output): views, one kernel
    of :data:`_KERNELS` on views of ``args``, views of its result, then one
    ``copy_`` of the whole result, in memory order, into the whole (contiguous)
    output, which ``out_view`` (``out`` seen with the kernel result's shape)
    then replaces.  ``args`` and ``out`` must stay the same tensors for the
    graph's life; nothing is written to them."""
    if call not in COLLAPSIBLE or not all(
            type(a) is torch.Tensor and a.layout == torch.strided for a in [*args, out]):
        return None
    try:
        with torch.inference_mode(out.is_inference()):
            scratch = torch.empty_strided(out.size(), out.stride(), dtype=out.dtype, device=out.device)
            log = _Log()
            with torch._C.DisableTorchFunction(), log:
                call(*args, out=scratch)
    except Exception:  # noqa: BLE001 - any failure just means "replay the composite"
        return None
    work = [c for c in log.calls if not (c[0].is_view or c[0] in _VIEWS)]
    if not ONLY_VIEWS:
        work = [c for c in work if c[0] in _KERNELS or c[0] is _aten.copy_.default][-2:]
    if len(work) != 2 or work[0][0] not in _KERNELS or work[1][0] is not _aten.copy_.default:
        return None
    (func, kargs, kkw, res), (_, (dst, src, *rest), ckw, _) = work
    if kkw or rest or ckw or not all(isinstance(a, torch.Tensor) for a in kargs):
        return None
    if not (out.is_contiguous() and _whole(dst, scratch) and _whole(src, res)):
        return None
    with torch.inference_mode(out.is_inference()):
        out_view = out.as_strided(res.size(), res.stride(), out.storage_offset())
    return _KERNELS[func], tuple(kargs), out_view
