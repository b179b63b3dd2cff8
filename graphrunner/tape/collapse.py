"""Composite calls collapsed to the one kernel they reach, for replay.

Owns one rewrite of the generated replay: a call of a composite binding
(``torch.matmul``, which bias-free ``linear`` replays through, or
``linear`` with a bias) whose result goes to a preplanned buffer and whose
arguments are fixed for the graph's life (externals, constants, preplanned
buffers) becomes a direct call of the single kernel the composite runs
(``torch.mm`` / ``torch.bmm`` / ``torch.addmm`` with ``out=``), on the very
views the composite would build.  ``torch.matmul(x, w, out=o)`` computes
into a fresh tensor and copies it into ``o``; ``linear(x, w, b)`` allocates
its result; both build views at every call.  A decode step has dozens.

The rewrite is found by running the composite once at capture end under a
dispatch mode that logs what it reaches, and considered only when the log is
nothing but view ops around exactly one kernel of :data:`_KERNELS` (no copy
of an input on the way, e.g. for a broadcast batch) and the result is the
whole kernel result in its memory order (:func:`collapse` for the ``out=``
form, :func:`collapse_functional` for the functional one).

The log is a derivation, not a proof: under a dispatch mode an inference
``matmul`` runs its Python decomposition, whose choice of path is not
always eager's C++ one (a ``[B, 1, C]`` input with strides ``(C, 1, 1)``
folds to ``mm`` there and runs ``bmm`` in eager: other bits).  So every
candidate is then proven (:func:`graphrunner.tape.proof.proven`): the
direct call must leave the same bits as the composite, run as replay runs
it, on the capture's data and on fresh random data, or the graph keeps the
composite.
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from .bindings import VF
from .proof import proven
from .state import storage_of

_aten = torch.ops.aten
# The kernels a collapsed call may reach, and the binding that calls each
# with out=.
_KERNELS = {_aten.mm.default: VF.mm, _aten.bmm.default: VF.bmm, _aten.addmm.default: VF.addmm}
# Composite bindings collapsed in their out= form, and in their functional form.
COLLAPSIBLE = frozenset({VF.matmul})
COLLAPSIBLE_FUNCTIONAL = frozenset({torch._C._nn.linear})
# ``_unsafe_view`` returns a view without declaring it (no alias annotation).
_VIEWS = frozenset({_aten._unsafe_view.default})
# Off only in the negative-control test: ignore what else the composite ran
# besides the kernel and the final copy (a clone of an input on the way: the
# replay would then read the copy made at capture end).
ONLY_VIEWS = True


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
    st = storage_of(t)
    return st.data_ptr() if st is not None and st.nbytes() else None


def _whole(t: torch.Tensor, base: torch.Tensor) -> bool:
    """``t`` covers all of contiguous ``base``, in its memory order."""
    return (
        t.is_contiguous()
        and base.is_contiguous()
        and t.numel() == base.numel()
        and _storage_ptr(t) == _storage_ptr(base)
        and t.storage_offset() == base.storage_offset()
    )


def _run_logged(call, args: list, inference: bool, out=None):
    """``(result, non-view calls)`` of ``call(*args[, out=out])`` run under
    :class:`_Log`, or None if it failed."""
    try:
        with torch.inference_mode(inference):
            log = _Log()
            with torch._C.DisableTorchFunction(), log:
                res = call(*args) if out is None else call(*args, out=out)
    except Exception:  # noqa: BLE001 - any failure just means "replay the composite"
        return None
    work = [c for c in log.calls if not (c[0].is_view or c[0] in _VIEWS)]
    if not ONLY_VIEWS:
        work = [c for c in work if c[0] in _KERNELS or c[0] is _aten.copy_.default][-2:]
    return res, work


def _plain(ts) -> bool:
    return all(type(t) is torch.Tensor and t.layout == torch.strided for t in ts)


def _kernel(call) -> tuple | None:
    """``(binding, args, result)`` of a logged kernel call of :data:`_KERNELS`
    taking tensors only, else None."""
    func, kargs, kkw, res = call
    if func not in _KERNELS or kkw or not all(isinstance(a, torch.Tensor) for a in kargs):
        return None
    return _KERNELS[func], tuple(kargs), res


def collapse(call, args: list, out: torch.Tensor, seen: dict | None = None, tls: tuple | None = None):
    """The direct kernel call that ``call(*args, out=out)`` amounts to:
    ``(binding, args, out_view)`` such that ``binding(*args, out=out_view)``
    computes what the composite computes, with the same kernel on the same
    input views, and leaves in ``out`` what the composite leaves there; or
    None when ``call`` is not collapsible here.

    Accepted composite runs (logged on a scratch output): views, one kernel
    of :data:`_KERNELS` on views of ``args``, views of its result, then one
    ``copy_`` of the whole result, in memory order, into the whole (contiguous)
    output, which ``out_view`` (``out`` seen with the kernel result's shape)
    then replaces.  Then proven equal to the composite (``seen``: the values
    temporaries among ``args`` held at capture, see
    :func:`~graphrunner.tape.proof.proven`).  ``args`` and ``out`` must stay
    the same tensors for the graph's life; nothing is written to them."""
    if call not in COLLAPSIBLE or not _plain([*args, out]) or not out.is_contiguous():
        return None
    with torch.inference_mode(out.is_inference()):
        scratch = torch.empty_strided(out.size(), out.stride(), dtype=out.dtype, device=out.device)
    got = _run_logged(call, args, out.is_inference(), scratch)
    if got is None or len(got[1]) != 2 or got[1][1][0] is not _aten.copy_.default:
        return None
    kernel, (_, (dst, src, *rest), ckw, _) = _kernel(got[1][0]), got[1][1]
    if kernel is None or rest or ckw or not (_whole(dst, scratch) and _whole(src, kernel[2])):
        return None
    kfn, kargs, kout = kernel[0], kernel[1], view_like(out, kernel[2])

    def composite(tw):
        call(*tw(args), out=tw(out))
        return tw(out)

    def direct(tw):
        kfn(*tw(kargs), out=tw(kout))
        return tw(out)

    if not proven(
        composite,
        direct,
        args,
        [out],
        seen,
        inference=out.is_inference(),
        tls=tls,
        memo=("collapse", call, args, out, kfn, kargs, kout),
    ):
        return None
    return kfn, kargs, kout


def collapse_functional(call, args: list, inference: bool, seen: dict | None = None, tls: tuple | None = None):
    """The direct kernel call that ``res = call(*args)`` amounts to:
    ``(binding, args, result)`` such that ``binding(*args, out=b)``, with
    ``b`` of the metadata of ``result`` (:func:`view_like` of a buffer of
    ``res``'s metadata), computes what the composite returns; or None.

    Accepted composite runs: views, one kernel of :data:`_KERNELS` on views
    of ``args``, then views of its result ending in the whole result, in
    memory order (contiguous both); then proven equal to the composite
    (writing into a buffer of the result's metadata, as the plan will).
    Nothing is written to ``args``."""
    if call not in COLLAPSIBLE_FUNCTIONAL or not _plain(args):
        return None
    got = _run_logged(call, args, inference)
    if got is None or len(got[1]) != 1:
        return None
    kernel, res = _kernel(got[1][0]), got[0]
    if kernel is None or type(res) is not torch.Tensor or not _whole(res, kernel[2]):
        return None
    kfn, kargs, kres = kernel
    with torch.inference_mode(inference):
        buf = torch.empty_strided(res.size(), res.stride(), dtype=res.dtype, device=res.device)
    kout = view_like(buf, kres)

    def composite(tw):
        return tw(buf).copy_(call(*tw(args)))

    def direct(tw):
        kfn(*tw(kargs), out=tw(kout))
        return tw(buf)

    if not proven(
        composite,
        direct,
        args,
        [buf],
        seen,
        inference=inference,
        tls=tls,
        memo=("collapse_functional", call, args, kfn, kargs, buf, kout),
    ):
        return None
    return kernel


def view_like(buf: torch.Tensor, res: torch.Tensor) -> torch.Tensor:
    """``buf`` (contiguous) seen with the size and strides of ``res`` (contiguous, as many elements)."""
    with torch.inference_mode(buf.is_inference()):
        return buf.as_strided(res.size(), res.stride(), buf.storage_offset())
