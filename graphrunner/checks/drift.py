"""Drift check: did the step's op stream change between the last warmup and the capture?

A device graph freezes every Python value its ops were called with (a
scalar argument, a shape, a slice bound, a branch taken). A step that reads
Python state which changes between calls (a counter, a cache length kept in
a Python int) therefore replays the capture-time value forever, silently.
Two consecutive eager calls of such a step already disagree, so the capture
hook :class:`DriftCheck` records the op stream of the last warmup and of the
capture (:class:`OpStream`, fed by the one op recorder of
:mod:`graphrunner.recording.ops`) and compares them with :func:`find_drift`: the first op
whose name, tensor shapes and dtypes, or non-tensor arguments differ is
reported as a :class:`~graphrunner.errors.CaptureError` naming the op, the
user's ``file:line`` and both values.

Only the last warmup is compared: state that settles in the first warmup
(lazy initialisation, a cache allocated on first use) is not a drift. With
``warmups=1`` the only warmup is compared (the message says that lazy
initialisation needs ``warmups >= 2``); with ``warmups=0`` there is nothing
to compare. Ops inside a ``@no_graph`` body are skipped when
``skip_eager_breaks=True`` (the breakable backend): they run eagerly at every
replay, so Python state there is re-read each time and is not frozen. Tensor
*values* are not compared (they are the graph's inputs), except the values
of small tensors built from Python data (``torch.tensor(n)``), which a graph
holds as constants.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch.utils._python_dispatch import _disable_current_modes

from graphrunner._frames import is_library, library_name
from graphrunner._frames import where as _where_of
from graphrunner.checks.findings import finding_at
from graphrunner.checks.stash import StashCheck
from graphrunner.errors import CaptureError
from graphrunner.recording.hooks import Capture, CaptureHook, Finding
from graphrunner.recording.ops import OpConsumer, OpEvent, OpRecorder

__all__ = ["OpRecord", "OpStream", "DriftCheck", "find_drift", "drift_error", "drift_finding"]

#: Ops whose tensor input is built from Python data (``torch.tensor(n)``): a
#: graph holds its values as constants, so small ones are compared too.
_FRESH_OPS = ("aten::lift_fresh", "aten::lift_fresh_copy")
_FRESH_MAX_NUMEL = 64

#: Aliasing ops with no non-tensor argument: they cannot carry a Python value
#: into a graph, and a capture may add some (factory calls under a tape
#: capture's modes dispatch an extra ``detach``), so they are not recorded.
_IGNORED_OPS = frozenset(("aten::detach", "aten::detach_", "aten::alias"))


class _Tensor:
    """A tensor argument as the drift check compares it: shape, dtype, and
    for tensors built from Python data the values."""

    __slots__ = ("shape", "dtype", "values")

    def __init__(self, t: torch.Tensor, values: Any = None):
        self.shape, self.dtype, self.values = tuple(t.shape), t.dtype, values

    def __eq__(self, other) -> bool:
        return (
            isinstance(other, _Tensor)
            and self.shape == other.shape
            and self.dtype == other.dtype
            and _same(self.values, other.values)
        )

    def __hash__(self) -> int:
        return hash((self.shape, self.dtype))

    def __repr__(self) -> str:
        dt = str(self.dtype).replace("torch.", "")
        vals = f" holding {self.values!r}" if self.values is not None else ""
        return f"a {dt} tensor of shape {self.shape}{vals}"


def _same(a: Any, b: Any) -> bool:
    """Equality of recorded values, with NaN equal to NaN."""
    if a is b:
        return True
    if isinstance(a, float) and isinstance(b, float):
        return a == b or (a != a and b != b)
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if type(a) is not type(b):
        return False
    return a == b


_SIMPLE = (int, float, bool, str, complex, type(None), torch.dtype, torch.device, torch.layout, torch.memory_format)
_SCALARS = frozenset((int, float, bool, type(None)))


def _describe(v: Any, fresh: bool = False) -> Any:
    """The comparable form of one op argument."""
    if type(v) in _SCALARS:
        return v
    if isinstance(v, torch.Tensor):
        values = None
        if fresh and v.device.type == "cpu" and v.numel() <= _FRESH_MAX_NUMEL:
            with _disable_current_modes():
                values = v.tolist()
        return _Tensor(v, values)
    if isinstance(v, _SIMPLE):
        return v
    if isinstance(v, (list, tuple)):
        return tuple(_describe(x) for x in v)
    if isinstance(v, torch.Generator):
        return "<generator>"
    return f"<{type(v).__name__}>"


@dataclass
class OpRecord:
    """One recorded op: ``op`` (e.g. ``"aten.mul.Tensor"``), ``args`` (a tuple
    of ``(label, value)``: ``"1"``, ``"2"``, ... for positional arguments,
    the keyword for the others; tensors as shape and dtype) and ``where``
    (``(filename, lineno, function)`` of the innermost frame outside torch
    and the graphrunner runtime, or ``None``)."""

    op: str
    args: tuple
    where: tuple[str, int, str] | None

    @property
    def short_op(self) -> str:
        """The op without its overload, e.g. ``aten.mul``."""
        parts = self.op.split(".")
        return ".".join(parts[:2]) if len(parts) > 2 else self.op


class OpStream(OpConsumer):
    """An op consumer that keeps the comparable op stream of one run (:attr:`ops`).

    Every aten op it sees is appended as an :class:`OpRecord`, except
    aliasing ops without Python arguments and, with
    ``skip_eager_breaks=True``, ops inside a ``@no_graph`` body (they run
    eagerly at every replay of a breakable graph). ``label`` names the run in
    messages (``"warmup 2"``, ``"capture"``). Fed by the one op recorder
    (:class:`graphrunner.recording.ops.OpRecorder`); use :meth:`recorder` for a
    stand-alone recording.

    ``F.one_hot(t, n)`` is one ``"F.one_hot"`` record however it ran: eager
    CPU runs it as one ``aten.one_hot`` (inference mode) or as
    ``aminmax``, two host reads, ``zeros``, ``unsqueeze``, ``scatter_``
    (autograd on), a tape capture as zeros + scatter (its ops carry the
    call: ``OpEvent.atomic_call``). The stream asks for no torch-function
    events: a torch-function mode would cost a Python call per torch function
    of the step, most of the check's cost.
    """

    def __init__(self, label: str, skip_eager_breaks: bool = False):
        self.label = label
        self.skip_eager_breaks = bool(skip_eager_breaks)
        self.ops: list[OpRecord] = []
        self._call: Any = None  # the atomic call the last op belonged to

    def _where(self, ev: OpEvent) -> tuple[str, int, str] | None | Literal[False]:
        if self.skip_eager_breaks and ev.in_eager_break:
            return False
        return ev.where

    def before(self, ev: OpEvent) -> None:
        call = ev.atomic_call
        if call is not None:  # one record per atomic call, at its first op
            if call is not self._call:
                self._call = call
                where = self._where(ev)
                if where is not False:
                    self.ops.append(_one_hot_record(call[0], call[1], call[2], where))
            return
        func = ev.func
        kind = _KINDS.get(func)
        if kind is None:
            kind = _KINDS[func] = _kind(func)
        op, what = kind
        if what is _IGNORED:
            return
        where = self._where(ev)
        if where is False:
            return
        if what is _ONE_HOT_OP:
            self.ops.append(_one_hot_record("F.one_hot", ev.args, ev.kwargs, where))
            return
        fresh = what is _FRESH
        desc = tuple([(_LABELS[i] if i < 32 else str(i + 1), _describe(a, fresh)) for i, a in enumerate(ev.args)])
        if ev.kwargs:
            desc += tuple([(k, _describe(v)) for k, v in ev.kwargs.items()])
        rec = OpRecord(op, desc, where)
        if what is _SCATTER and _ends_decomposed_one_hot(self.ops):
            start = self.ops[-5]
            t, n = start.args[0][1], self.ops[-2].args[0][1][-1]
            del self.ops[-5:]
            rec = OpRecord("F.one_hot", (("1", t), ("2", n)), start.where)
        self.ops.append(rec)

    def recorder(self) -> OpRecorder:
        """A stand-alone :class:`~graphrunner.recording.ops.OpRecorder` feeding only this stream
        (``with stream.recorder(): step()``)."""
        return OpRecorder([self])


_LABELS = tuple(str(i + 1) for i in range(32))  # positional argument labels
_IGNORED, _ONE_HOT_OP, _FRESH, _SCATTER, _PLAIN = "ignored", "one_hot", "fresh", "scatter", "plain"
_KINDS: dict = {}  # op overload -> (its name as records spell it, how OpStream treats it)


def _kind(func: Any) -> tuple[str, str]:
    name, op = func._schema.name, str(func)
    if name in _IGNORED_OPS:
        return op, _IGNORED
    if name == "aten::one_hot":
        return op, _ONE_HOT_OP
    if name in _FRESH_OPS:
        return op, _FRESH
    return op, _SCATTER if op == "aten.scatter_.value" else _PLAIN


#: The ops eager CPU runs ``F.one_hot(t, n)`` as with autograd on, before its ``scatter_``.
_ONE_HOT_DECOMPOSED = (
    "aten.aminmax.default",
    "aten._local_scalar_dense.default",
    "aten._local_scalar_dense.default",
    "aten.zeros.default",
    "aten.unsqueeze.default",
)


def _ends_decomposed_one_hot(ops: list[OpRecord]) -> bool:
    return len(ops) >= 5 and tuple(r.op for r in ops[-5:]) == _ONE_HOT_DECOMPOSED


def _one_hot_record(name: str, args: tuple, kwargs: dict, where: Any) -> OpRecord:
    """The record of one ``F.one_hot(t, num_classes)`` call (or ``aten.one_hot``), arguments by position."""
    t = args[0] if args else kwargs.get("input", kwargs.get("self"))
    n = args[1] if len(args) > 1 else kwargs.get("num_classes", -1)
    return OpRecord(name, (("1", _describe(t)), ("2", _describe(n))), where)


class DriftCheck(CaptureHook):
    """The drift check as a capture hook (installed by a backend with ``drift_check=True``).

    Records the op stream of the last warmup forward and of the captured
    forward (ops outside ``@no_graph`` bodies on a breakable backend; nothing
    on an eager backend, which freezes nothing; nothing with ``warmups=0``)
    and, after the capture, raises the :func:`drift_error` of the first
    difference (in collect mode, records it as a ``"drift"`` finding). Then
    the stashed-state check (:attr:`stash`, :mod:`graphrunner.checks.stash`):
    a tensor the capture made and left on an object's attribute (state kept by
    re-binding it, which a graph freezes too).
    """

    name = "drift"

    def __init__(self) -> None:

        self._streams: dict[Hashable, tuple[OpStream, OpStream]] = {}  # key -> (last warmup, capture)
        #: The stashed-state check (:mod:`graphrunner.checks.stash`): Python state the graph freezes
        #: by re-binding an attribute, reported after the drift.
        self.stash = StashCheck()

    def begin(self, cap: Capture) -> None:
        if cap.freezes is None or cap.warmups < 1:
            return
        skip = cap.freezes == "segments"
        self._streams[cap.key] = (OpStream(f"warmup {cap.warmups}", skip), OpStream("capture", skip))

    def warmup_consumers(self, cap: Capture, i: int) -> Sequence[Any]:
        s = self._streams.get(cap.key)
        return (s[0],) if s is not None and i == cap.warmups - 1 else ()

    def capture_consumers(self, cap: Capture) -> Sequence[Any]:
        s = self._streams.get(cap.key)
        return ((s[1],) if s is not None else ()) + tuple(self.stash.capture_consumers(cap))

    def after_capture(self, cap: Capture) -> None:
        s = self._streams.get(cap.key)
        found = first_difference(*s) if s is not None else None
        err = drift_error(cap.key, s[0], s[1], cap.warmups) if s is not None and found is not None else None
        if found is not None and err is not None:  # err: the same difference, as the error
            cap.fail(err, drift_finding(found[0], found[1], cap.backend.name))
        self.stash.after_capture(cap)

    def end(self, cap: Capture) -> None:
        self._streams.pop(cap.key, None)
        self.stash.end(cap)


def _where(rec: OpRecord | None) -> str:
    return _where_of(rec.where if rec is not None else None)


def _arg_diff(a: OpRecord, b: OpRecord) -> tuple[str, Any, Any]:
    """The first argument that differs between two records of the same op."""
    da, db = dict(a.args), dict(b.args)
    for label in list(da) + [k for k in db if k not in da]:
        va, vb = da.get(label, "<absent>"), db.get(label, "<absent>")
        if not _same(va, vb):
            name = f"argument {label}" if label.isdigit() else f"argument {label}="
            return name, va, vb
    return "the arguments", a.args, b.args


def first_difference(warmup: OpStream, capture: OpStream) -> tuple[str, OpRecord] | None:
    wa, ca = warmup.ops, capture.ops
    for i, (a, b) in enumerate(zip(wa, ca)):
        if a.op != b.op:
            return (
                f"op {i + 1} was {a.short_op} at {warmup.label} (at {_where(a)}) but {b.short_op} at "
                f"{capture.label} (at {_where(b)}): the step took a different path",
                b,
            )
        if a.args != b.args and not _same(a.args, b.args):  # == first: fast, and NaN-blind only one way
            name, va, vb = _arg_diff(a, b)
            return (
                f"{name} of {b.short_op} was {va!r} at {warmup.label} and {vb!r} at {capture.label}, "
                f"at {_where(b)} (op {i + 1} of the step)",
                b,
            )
    if len(wa) != len(ca):
        n = min(len(wa), len(ca))
        longer, other, extra = (warmup, capture, wa[n]) if len(wa) > len(ca) else (capture, warmup, ca[n])
        return (
            f"{longer.label} ran {max(len(wa), len(ca))} ops and {other.label} {n}; the first extra op is "
            f"{extra.short_op} at {_where(extra)}: the step took a different path",
            extra,
        )
    return None


def find_drift(warmup: OpStream, capture: OpStream) -> str | None:
    """Compare two recorded op streams; ``None`` when they agree, else one
    sentence naming the first op that differs, its source line and both
    values (the body of the :func:`drift_error` message)."""
    found = first_difference(warmup, capture)
    return None if found is None else found[0]


def drift_error(key: Any, warmup: OpStream, capture: OpStream, warmups: int) -> CaptureError | None:
    """The :class:`CaptureError` for a drift between ``warmup`` and
    ``capture`` of shape key ``key``, or ``None`` when their op streams agree.
    The message names the op, the line and both values, and what to do."""
    found = first_difference(warmup, capture)
    if found is None:
        return None
    what, rec = found
    hint = ""
    if warmups == 1:
        hint = (
            " With warmups=1 the only warmup may be lazy initialisation (a cache built on the first call): "
            "if so, capture with warmups >= 2."
        )
    fn = f" ({rec.where[2]})" if rec.where is not None else ""
    return CaptureError(
        f"drift between {warmup.label} and the capture of shape key {key!r}: {what}. The step depends on "
        "state that changes between calls (a Python counter, a length kept in a Python int, a value read "
        "from a tensor), and the graph would replay the capture-time value at every call. Make the value "
        f"a tensor input (or a tensor the step updates in place), or @no_graph the enclosing function{fn} "
        "and use the breakable backend so it runs eagerly at every replay."
        + hint
        + ' If the difference is harmless, leave "drift" out of GraphRunner(checks=...) (drift_check=False on a '
        "backend)."
    )


def drift_finding(text: str, rec: OpRecord | None, backend: str, key: Any = None) -> Finding:
    """The ``"drift"`` :class:`~graphrunner.recording.hooks.Finding` for a difference ``text`` at
    op ``rec`` (collect mode, ``graphrunner check``), with the fix for its line."""
    loc = rec.where if rec is not None else None
    breakable = "" if backend == "breakable" else " and use backend='breakable'"
    if loc is not None and is_library(loc[0]):
        fix = (
            f"make it an input: the value is Python state inside {library_name(loc[0])}, which @no_graph "
            "cannot wrap; keep it in a tensor (an input, or a buffer the step updates in place) instead of a "
            "Python number, or use a cache/model configuration that does"
        )
    elif loc is not None:
        fix = (
            f"make the value a tensor input (or a tensor the step updates in place), or @no_graph the "
            f"enclosing function {loc[2]}{breakable} so it runs eagerly at every replay"
        )
    else:
        fix = "make the value a tensor input"
    return finding_at(
        "drift",
        f"{text}: the step reads Python state that changes between calls, which the graph freezes",
        loc,
        fix=fix,
        bucket=key,
        in_library=bool(loc and is_library(loc[0])),
    )
