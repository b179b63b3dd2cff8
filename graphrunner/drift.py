"""Drift check: did the step's op stream change between the last warmup and the capture?

A device graph freezes every Python value its ops were called with (a
scalar argument, a shape, a slice bound, a branch taken). A step that reads
Python state which changes between calls (a counter, a cache length kept in
a Python int) therefore replays the capture-time value forever, silently.
Two consecutive eager calls of such a step already disagree, so the capture
protocol records the op stream of its last warmup and of the capture with
:class:`OpRecorder` and compares them with :func:`find_drift`: the first op
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

import contextlib
import sys
from dataclasses import dataclass
from typing import Any, Iterator, List, Optional, Tuple

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from graphrunner._frames import is_internal as _is_internal
from graphrunner._frames import where as _where_of
from graphrunner.errors import CaptureError

__all__ = ["OpRecord", "OpRecorder", "RecordingDevice", "find_drift", "drift_error"]

#: Torch functions recorded as one op, their internals not recorded: the tape
#: runs ``F.one_hot(t, num_classes)`` at capture as zeros + scatter (as CUDA
#: does) while an eager CPU call is one ``aten.one_hot``.
_ATOMIC_FUNCTIONS = ((torch.nn.functional.one_hot, "F.one_hot"),)

#: Ops whose tensor input is built from Python data (``torch.tensor(n)``): a
#: graph holds its values as constants, so small ones are compared too.
_FRESH_OPS = ("aten::lift_fresh", "aten::lift_fresh_copy")
_FRESH_MAX_NUMEL = 64

#: Aliasing ops with no non-tensor argument: they cannot carry a Python value
#: into a graph, and a capture may add some (factory calls under a tape
#: capture's modes dispatch an extra ``detach``), so they are not recorded.
_IGNORED_OPS = frozenset(("aten::detach", "aten::detach_", "aten::alias"))

def _no_graph_wrapper_code():
    from graphrunner.breakable import force_no_graph  # a no_graph wrapper: all share one code object

    return force_no_graph.__code__


class _Tensor:
    """A tensor argument as the drift check compares it: shape, dtype, and
    for tensors built from Python data the values."""

    __slots__ = ("shape", "dtype", "values")

    def __init__(self, t: torch.Tensor, values: Any = None):
        self.shape, self.dtype, self.values = tuple(t.shape), t.dtype, values

    def __eq__(self, other) -> bool:
        return (isinstance(other, _Tensor) and self.shape == other.shape and self.dtype == other.dtype
                and _same(self.values, other.values))

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


def _describe(v: Any, fresh: bool = False) -> Any:
    """The comparable form of one op argument."""
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
    where: Optional[Tuple[str, int, str]]

    @property
    def short_op(self) -> str:
        """The op without its overload, e.g. ``aten.mul``."""
        parts = self.op.split(".")
        return ".".join(parts[:2]) if len(parts) > 2 else self.op


class _DispatchRecorder(TorchDispatchMode):
    def __init__(self, owner: "OpRecorder"):
        super().__init__()
        self.owner = owner

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        owner = self.owner
        if owner.on and not owner._atomic_depth and func._schema.name not in _IGNORED_OPS:
            where = owner._locate(sys._getframe(1))
            if where is not False:
                fresh = func._schema.name in _FRESH_OPS
                desc = tuple((str(i + 1), _describe(a, fresh)) for i, a in enumerate(args))
                desc += tuple((k, _describe(v)) for k, v in kwargs.items())
                owner.ops.append(OpRecord(str(func), desc, where))
        return func(*args, **kwargs)


class _FunctionRecorder(TorchFunctionMode):
    def __init__(self, owner: "OpRecorder"):
        super().__init__()
        self.owner = owner

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = None
        for f, n in _ATOMIC_FUNCTIONS:
            if func is f:
                name = n
        if name is None:
            return func(*args, **kwargs)
        owner = self.owner
        if owner.on and not owner._atomic_depth:
            where = owner._locate(sys._getframe(1))
            if where is not False:
                desc = tuple((str(i + 1), _describe(a)) for i, a in enumerate(args))
                desc += tuple((k, _describe(v)) for k, v in kwargs.items())
                owner.ops.append(OpRecord(name, desc, where))
        owner._atomic_depth += 1
        try:
            return func(*args, **kwargs)
        finally:
            owner._atomic_depth -= 1


class OpRecorder:
    """Context manager that records the op stream of the code it wraps.

    Every aten op that reaches the dispatcher inside the block is appended to
    :attr:`ops` as an :class:`OpRecord` (and then runs unchanged). Enter it
    innermost, directly around the step, so that ops a graph implementation
    runs for itself (a tape's verification) are not seen. With
    ``skip_eager_breaks=True``, ops run inside a ``@no_graph`` body are not
    recorded (they run eagerly at every replay of a breakable graph).
    ``label`` names the run in messages (``"warmup 2"``, ``"capture"``).
    Recording costs a Python call and a stack walk per op.

    The two halves can be used apart: :meth:`modes` installs the recording
    modes without recording, :meth:`recording` records while modes
    installed elsewhere are active (a breakable capture installs them inside
    each graph segment: :class:`RecordingDevice`).
    """

    def __init__(self, label: str, skip_eager_breaks: bool = False):
        self.label = label
        self.skip_eager_breaks = bool(skip_eager_breaks)
        self.ops: List[OpRecord] = []
        #: True while ops are recorded (inside :meth:`recording` or the ``with`` block).
        self.on = False
        self._atomic_depth = 0
        self._modes: list = []
        self._no_graph = _no_graph_wrapper_code() if skip_eager_breaks else None

    def _locate(self, frame) -> "Tuple[str, int, str] | None | bool":
        """The user frame of the op being recorded; ``False`` to skip the op
        (it runs inside a ``@no_graph`` body and eager breaks are skipped)."""
        user = None
        f = frame
        skip = self._no_graph
        while f is not None:
            code = f.f_code
            if code is skip:
                return False
            if user is None and not _is_internal(code):
                user = (code.co_filename, f.f_lineno, code.co_name)
                if skip is None:
                    break
            f = f.f_back
        return user

    @contextlib.contextmanager
    def modes(self) -> Iterator[None]:
        """Install the recording torch-function and dispatch modes (on top of
        any active ones) for the block; ops are recorded only while
        :attr:`on`."""
        with _FunctionRecorder(self), _DispatchRecorder(self):
            yield

    @contextlib.contextmanager
    def recording(self) -> Iterator["OpRecorder"]:
        """Record (set :attr:`on`) for the block, through modes installed by
        :meth:`modes`."""
        was, self.on = self.on, True
        try:
            yield self
        finally:
            self.on = was

    def __enter__(self) -> "OpRecorder":
        self._stack = contextlib.ExitStack()
        try:
            self._stack.enter_context(self.modes())
            self._stack.enter_context(self.recording())
        except BaseException:
            self._stack.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self._stack.__exit__(*exc)


class RecordingDevice:
    """A device that installs ``recorder``'s modes inside every graph
    capture it runs, innermost (above the capture's own modes, such as a
    tape's recorder), and delegates everything else to ``device``.

    A breakable capture opens and closes one capture per graph segment
    around its eager breaks; a mode pushed once around the whole step would
    sit between a segment's modes and break their nesting. Given to a
    :class:`~graphrunner.breakable.BreakableGraph`, this records the ops of
    the segments only; the eager-break bodies between them run with no
    recording mode installed."""

    def __init__(self, device: Any, recorder: OpRecorder):
        self._device, self._recorder = device, recorder

    def __getattr__(self, name: str) -> Any:
        return getattr(self._device, name)

    @contextlib.contextmanager
    def capture(self, graph: Any, *args: Any, **kwargs: Any) -> Iterator[None]:
        """``device.capture(graph, ...)`` with the recorder's modes inside it."""
        with self._device.capture(graph, *args, **kwargs), self._recorder.modes():
            yield


def _where(rec: Optional[OpRecord]) -> str:
    return _where_of(rec.where if rec is not None else None)


def _arg_diff(a: OpRecord, b: OpRecord) -> Tuple[str, Any, Any]:
    """The first argument that differs between two records of the same op."""
    da, db = dict(a.args), dict(b.args)
    for label in list(da) + [k for k in db if k not in da]:
        va, vb = da.get(label, "<absent>"), db.get(label, "<absent>")
        if not _same(va, vb):
            name = f"argument {label}" if label.isdigit() else f"argument {label}="
            return name, va, vb
    return "the arguments", a.args, b.args


def _first_difference(warmup: OpRecorder, capture: OpRecorder) -> Optional[Tuple[str, OpRecord]]:
    wa, ca = warmup.ops, capture.ops
    for i, (a, b) in enumerate(zip(wa, ca)):
        if a.op != b.op:
            return (f"op {i + 1} was {a.short_op} at {warmup.label} (at {_where(a)}) but {b.short_op} at "
                    f"{capture.label} (at {_where(b)}): the step took a different path", b)
        if not _same(a.args, b.args):
            name, va, vb = _arg_diff(a, b)
            return (f"{name} of {b.short_op} was {va!r} at {warmup.label} and {vb!r} at {capture.label}, "
                    f"at {_where(b)} (op {i + 1} of the step)", b)
    if len(wa) != len(ca):
        n = min(len(wa), len(ca))
        longer, other, extra = (warmup, capture, wa[n]) if len(wa) > len(ca) else (capture, warmup, ca[n])
        return (f"{longer.label} ran {max(len(wa), len(ca))} ops and {other.label} {n}; the first extra op is "
                f"{extra.short_op} at {_where(extra)}: the step took a different path", extra)
    return None


def find_drift(warmup: OpRecorder, capture: OpRecorder) -> Optional[str]:
    """Compare two recorded op streams; ``None`` when they agree, else one
    sentence naming the first op that differs, its source line and both
    values (the body of the :func:`drift_error` message)."""
    found = _first_difference(warmup, capture)
    return None if found is None else found[0]


def drift_error(key: Any, warmup: OpRecorder, capture: OpRecorder, warmups: int) -> Optional[CaptureError]:
    """The :class:`CaptureError` for a drift between ``warmup`` and
    ``capture`` of shape key ``key``, or ``None`` when their op streams agree.
    The message names the op, the line and both values, and what to do."""
    found = _first_difference(warmup, capture)
    if found is None:
        return None
    what, rec = found
    hint = ""
    if warmups == 1:
        hint = (" With warmups=1 the only warmup may be lazy initialisation (a cache built on the first call): "
                "if so, capture with warmups >= 2.")
    fn = f" ({rec.where[2]})" if rec.where is not None else ""
    return CaptureError(
        f"drift between {warmup.label} and the capture of shape key {key!r}: {what}. The step depends on "
        "state that changes between calls (a Python counter, a length kept in a Python int, a value read "
        "from a tensor), and the graph would replay the capture-time value at every call. Make the value "
        f"a tensor input (or a tensor the step updates in place), or @no_graph the enclosing function{fn} "
        "and use the breakable backend so it runs eagerly at every replay." + hint +
        " If the difference is harmless, pass drift_check=False."
    )
