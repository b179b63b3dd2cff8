"""The one op recorder every check consumes.

It sits below the backends (which run it around the warmups and the capture
for the hooks' consumers) and the checks (which consume it); nothing here
knows either. A check that needs to see what a step does (the drift check,
the externals of debug mode, ``runner.compare``, the ``graphrunner check``
lint) does not install its own ``TorchDispatchMode``: it is an :class:`OpConsumer` handed
to one :class:`OpRecorder`, which installs one dispatch mode (and, when a
consumer asks for it, one torch-function mode) and turns every aten op into
an :class:`OpEvent` with the facts every check needs, computed once:

- ``op`` / ``name``: the overload (``aten.mul.Tensor``) and schema name;
- ``written``: the tensors the op writes (mutable schema arguments, ``out=``):
  :func:`written_tensors`;
- ``where``: the user's ``(file, line, function)`` (:mod:`graphrunner._frames`);
- ``in_eager_break``: whether the op runs inside a ``@no_graph`` body (which
  runs eagerly at every replay of a breakable graph), and ``break_fn``, that
  body's function;
- storage identity by :func:`storage_key` (the storage's data pointer): one
  definition for every check;
- ``stream``: the stream the op was issued on (:func:`op_stream`: the
  current ``torch.cuda`` stream for CUDA tensors and under the CUDA
  stand-in, else the current tape stream, :mod:`graphrunner.tape.streams`).

The helpers that say which arguments an op writes and what identifies a
storage live in :mod:`graphrunner._aten`, shared with the tape's own
recording (:mod:`graphrunner.tape.recording`), which keeps its own mode.

Consumers see each op before it runs (:meth:`OpConsumer.before`) and after
(:meth:`OpConsumer.after`, with ``event.out`` set); function events
(``.item()``, ``.tolist()``, ``F.one_hot``) reach :meth:`OpConsumer.function`.
Ops run inside an *atomic* torch function (:data:`ATOMIC_FUNCTIONS`: the tape
runs ``F.one_hot`` as zeros + scatter, eager as one ``aten.one_hot``) carry
``atomic_call``, the call they belong to, so a check that compares op streams
can see the call once. A tape capture marks the ops of its own substitutions
(:func:`graphrunner.tape.unsafe.atomic_call`) without any torch-function mode;
the recorder's torch-function mode, installed only for consumers that ask for
function events, marks every atomic function's ops.

"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator, Sequence
from time import perf_counter
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from graphrunner._aten import storage_key, tensors_in, written_tensors
from graphrunner._frames import is_internal
from graphrunner.tape.rng import OwnedGenerators, redirect, redirected, stand_in_op
from graphrunner.tape.state import capture_here, storage_bytes
from graphrunner.tape.streams import current_stream
from graphrunner.tape.unsafe import atomic_call

__all__ = [
    "OpEvent",
    "FunctionEvent",
    "op_stream",
    "OpConsumer",
    "OpRecorder",
    "RecordingDevice",
    "WriteGuard",
    "storage_key",
    "written_tensors",
    "tensors_in",
    "no_graph_code",
    "mark_no_graph_code",
    "ATOMIC_FUNCTIONS",
]

Where = tuple[str, int, str]

#: Torch functions seen as one op (their aten ops carry ``atomic=True``): the
#: tape runs ``F.one_hot(t, num_classes)`` at capture as zeros + scatter (as
#: CUDA does) while an eager CPU call is one ``aten.one_hot``.
ATOMIC_FUNCTIONS = ((torch.nn.functional.one_hot, "F.one_hot"),)


def no_graph_code() -> Any:
    """The code object of every ``@no_graph`` wrapper (they share one): a frame running it is
    an eager break. ``None`` until :mod:`graphrunner.breakable` is imported (it registers the
    code with :func:`mark_no_graph_code`); no frame can run a wrapper before that."""
    return _NO_GRAPH_CODE


def mark_no_graph_code(code: Any) -> None:
    """Register ``code`` as the code object of the ``@no_graph`` wrappers (called once, by
    :mod:`graphrunner.breakable`, a layer above, when it defines them)."""
    global _NO_GRAPH_CODE
    _NO_GRAPH_CODE = code


_NO_GRAPH_CODE: Any = None


class _Frames:
    """One walk of the stack above an op: the user's frame and the enclosing ``@no_graph`` frame."""

    __slots__ = ("frame", "_where", "_break", "_walked_where", "_walked_break", "stop")

    def __init__(self, frame: Any, stop: Any = None):
        self.frame, self.stop = frame, stop
        self._walked_where = self._walked_break = False
        self._where: Where | None = None
        self._break: Any = None

    def where(self) -> Where | None:
        if not self._walked_where:
            self._walked_where = True
            f, stop = self.frame, self.stop
            while f is not None:
                if not is_internal(f.f_code):
                    self._where = (f.f_code.co_filename, f.f_lineno, f.f_code.co_name)
                    break
                if f.f_code is stop:
                    break
                f = f.f_back
        return self._where

    def eager_break(self) -> Any:
        if not self._walked_break:
            self._walked_break = True
            f, code, stop = self.frame, no_graph_code(), self.stop
            while f is not None:  # up to the step's entry: a break runs inside the step
                c = f.f_code
                if c is code:
                    self._break = f
                    break
                if c is stop:
                    break
                f = f.f_back
        return self._break

    def user_stack(self) -> list[tuple[Any, int]]:
        """The non-internal frames up to ``stop`` (included), innermost first, as ``(frame, lineno)``."""
        out, f = [], self.frame
        while f is not None:
            if not is_internal(f.f_code):
                out.append((f, f.f_lineno))
            if f.f_code is self.stop:
                break
            f = f.f_back
        return out


class OpEvent:
    """One aten op as the checks see it (computed lazily, once, for all consumers).

    ``func``, ``args``, ``kwargs``: the op and its arguments; ``out``: its
    result (``None`` before it ran); ``atomic_call``: the atomic torch function
    call it runs inside, ``(name, args, kwargs)``, or ``None``. Properties:
    ``atomic`` (``atomic_call is not None``), ``name`` (schema name, ``aten::mul``),
    ``op`` (``aten.mul.Tensor``), ``written`` (:func:`written_tensors`),
    ``where`` (the user's frame), ``in_eager_break`` and ``break_fn`` (the
    ``@no_graph`` function it runs in), :meth:`user_stack`.
    """

    __slots__ = ("func", "args", "kwargs", "out", "atomic_call", "_frames", "_written", "_stream")

    def __init__(self, func: Any, args: tuple, kwargs: dict, frames: _Frames, atomic_call: tuple | None):
        self.func, self.args, self.kwargs, self.atomic_call = func, args, kwargs, atomic_call
        self.out: Any = None
        self._frames = frames
        self._written: list[torch.Tensor] | None = None
        self._stream: Any = None

    @property
    def atomic(self) -> bool:
        """True when the op runs inside an atomic torch function (:attr:`atomic_call`)."""
        return self.atomic_call is not None

    @property
    def stream(self) -> Any:
        """The stream the op was issued on (:func:`op_stream`; read it before the op runs)."""
        if self._stream is None:
            self._stream = op_stream(self.args, self.kwargs)
        return self._stream

    @property
    def name(self) -> str:
        """Schema name, e.g. ``aten::mul``."""
        return self.func._schema.name

    @property
    def op(self) -> str:
        """The overload, e.g. ``aten.mul.Tensor``."""
        return str(self.func)

    @property
    def written(self) -> list[torch.Tensor]:
        """The tensors this op writes."""
        if self._written is None:
            self._written = written_tensors(self.func, self.args, self.kwargs)
        return self._written

    @property
    def where(self) -> Where | None:
        """``(file, line, function)`` of the user's frame, or ``None``."""
        return self._frames.where()

    @property
    def in_eager_break(self) -> bool:
        """True when the op runs inside a ``@no_graph`` body."""
        return self._frames.eager_break() is not None

    @property
    def break_fn(self) -> Any:
        """The ``@no_graph`` function the op runs in, or ``None``."""
        f = self._frames.eager_break()
        return None if f is None else f.f_locals.get("fn")

    def user_stack(self) -> list[tuple[Any, int]]:
        """The user's frames above the op, innermost first."""
        return self._frames.user_stack()


def op_stream(args: Sequence[Any], kwargs: dict) -> Any:
    """The stream an op with these arguments is issued on now: ``torch.cuda.current_stream`` of the
    first CUDA tensor's device (or of the current device under the CUDA stand-in, whose tensors stay
    on the CPU), else the calling thread's current tape stream
    (:func:`graphrunner.tape.streams.current_stream`)."""
    for v in list(args) + list(kwargs.values()):
        for t in tensors_in(v):
            if t.is_cuda:
                return torch.cuda.current_stream(t.device)
    if getattr(torch.cuda, "_graphrunner_standin", None) is not None:
        return torch.cuda.current_stream()

    return current_stream()


class FunctionEvent:
    """One torch-function call (``Tensor.item``, ``F.one_hot``, ...): ``func``, ``args``,
    ``kwargs``, ``where``/``in_eager_break``/``user_stack`` as for :class:`OpEvent`."""

    __slots__ = ("func", "args", "kwargs", "_frames")

    def __init__(self, func: Any, args: tuple, kwargs: dict, frames: _Frames):
        self.func, self.args, self.kwargs, self._frames = func, args, kwargs, frames

    where = OpEvent.where
    in_eager_break = OpEvent.in_eager_break
    user_stack = OpEvent.user_stack


class OpConsumer:
    """What a check implements to see ops. All three methods are optional no-ops.

    ``functions = True`` asks the recorder for torch-function events too. A
    consumer may return a true value from :meth:`function` to say the call is
    a reported host read: the ops it dispatches then reach :meth:`before` with
    ``atomic=True``. ``OpEvent.atomic`` marks the ops of a tape capture's own
    substitutions always, and those of every atomic function only when some
    consumer of the recorder asks for function events (the torch-function mode
    that sees them is installed only then): a consumer that needs it in eager
    code sets ``functions = True``.
    """

    functions = False

    def before(self, ev: OpEvent) -> None:
        """The op is about to run."""

    def after(self, ev: OpEvent) -> None:
        """The op ran; ``ev.out`` holds its result."""

    def function(self, ev: FunctionEvent) -> Any:
        """A torch function is about to run (only with ``functions = True``)."""


class _Dispatch(TorchDispatchMode):
    def __init__(self, rec: OpRecorder):
        super().__init__()
        self.rec = rec

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        rec = self.rec
        if not rec.on:
            return func(*args, **kwargs)
        t0 = perf_counter()
        calls = rec._atomic_calls
        ev = OpEvent(func, args, kwargs, _Frames(sys._getframe(1), rec.stop), calls[-1] if calls else atomic_call())
        muted = rec._muted
        for owner, c in rec._before:
            if not muted or owner not in muted:
                c(ev)
        t1 = perf_counter()
        if redirected() is not None and capture_here() is None:  # (a tape capture redirects as it records)
            run, run_kwargs = stand_in_op(func, args, kwargs)
            out = run(*args, **run_kwargs)
        else:
            out = func(*args, **kwargs)
        t2 = perf_counter()
        if rec._after:
            ev.out = out
            for owner, c in rec._after:
                if not muted or owner not in muted:
                    c(ev)
        rec.seconds += t1 - t0 + perf_counter() - t2
        return out


class _Function(TorchFunctionMode):
    def __init__(self, rec: OpRecorder):
        super().__init__()
        self.rec = rec

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        rec = self.rec
        if not rec.on:
            return func(*args, **kwargs)
        atomic = next((name for f, name in ATOMIC_FUNCTIONS if func is f), None)
        mute = []
        if rec._functions:
            ev = FunctionEvent(func, args, kwargs, _Frames(sys._getframe(1), rec.stop))
            for owner, hook in rec._functions:
                if owner not in rec._muted and hook(ev):
                    mute.append(owner)
        if atomic is None and not mute:
            return func(*args, **kwargs)
        if atomic is not None:
            rec._atomic_calls.append((atomic, args, kwargs))
        for c in mute:
            rec._muted[c] = rec._muted.get(c, 0) + 1
        try:
            return func(*args, **kwargs)
        finally:
            if atomic is not None:
                rec._atomic_calls.pop()
            for c in mute:
                rec._muted[c] -= 1
                if not rec._muted[c]:
                    del rec._muted[c]


class OpRecorder:
    """Installs one dispatch mode (and, when a consumer asks for function events, a torch-function
    mode) that feeds ``consumers``.

    Use as a context manager around the code to record (enter it innermost,
    directly around the step, so ops a graph runs for itself are not seen),
    or in two halves: :meth:`modes` installs the modes without recording,
    :meth:`recording` records while modes installed elsewhere are active (a
    breakable capture installs them inside each graph segment:
    :class:`RecordingDevice`). ``stop``: the code object of the step's entry
    (the forward a backend calls): the user-frame walk ends at its frame,
    since the frames that call it are not the user's. Recording costs
    a Python call per op, plus a stack walk for consumers that ask ``where``.
    """

    def __init__(self, consumers: Sequence[OpConsumer], stop: Any = None):
        self.consumers = list(consumers)
        self.stop = stop
        #: True while ops are recorded.
        self.on = False
        #: Seconds spent feeding the consumers (the recorder's Python per op, the op itself not counted).
        self.seconds = 0.0
        self._atomic_calls: list = []  # the atomic torch-function calls running now, innermost last
        self._muted: dict = {}  # consumer -> depth of reported host reads it asked to be muted in
        base = OpConsumer
        # (consumer, its bound method): the consumer is what _muted is keyed by
        self._before = [(c, c.before) for c in self.consumers if type(c).before is not base.before]
        self._after = [(c, c.after) for c in self.consumers if type(c).after is not base.after]
        self._functions = [(c, c.function) for c in self.consumers if c.functions]
        self._redirect: OwnedGenerators | None = None  # a consumer's stand-in generators, while recording

    @contextlib.contextmanager
    def modes(self) -> Iterator[None]:
        """Install the recording modes (on top of any active ones) for the block; ops are
        recorded only while :attr:`on`. The torch-function mode only when a consumer asks for
        function events (``functions = True``): it costs a Python call per torch function."""
        with _Function(self) if self._functions else contextlib.nullcontext(), _Dispatch(self):
            yield

    @contextlib.contextmanager
    def recording(self) -> Iterator[OpRecorder]:
        """Record (set :attr:`on`) for the block, through modes installed by :meth:`modes`."""
        was, self.on = self.on, True
        owned = next(
            (
                g
                for g in reversed([getattr(c, "generators", None) for c in self.consumers])
                if isinstance(g, OwnedGenerators)
            ),
            None,
        )
        try:
            with redirect(owned) if owned is not None else contextlib.nullcontext():
                self._redirect = owned
                yield self
        finally:
            self.on = was
            self._redirect = None

    def __enter__(self) -> OpRecorder:
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
    """A device that installs ``recorder``'s modes inside every graph capture it runs,
    innermost (above the capture's own modes, such as a tape's recorder), and delegates
    everything else to ``device``.

    A breakable capture opens and closes one capture per graph segment around
    its eager breaks; a mode pushed once around the whole step would sit
    between a segment's modes and break their nesting. Given to a
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

    def eager_break_context(self) -> Any:
        """The context a breakable capture runs each eager-break body in: while the recorder
        records, one more recorder feeds the body's ops to the consumers that ask for them
        (``eager_breaks = True``: the stream check, which must see a side stream forked in a
        break); the other consumers see the segments only, as before."""
        rec = self._recorder
        wanted = [c for c in rec.consumers if getattr(c, "eager_breaks", False)]
        if not wanted or not rec.on:
            return contextlib.nullcontext()
        return OpRecorder(wanted, stop=rec.stop)


class WriteGuard(OpConsumer):
    """An op consumer that puts back what the recorded code wrote outside itself.

    Writes (in place, ``out=``) to storages that the recorded code did not
    create and that are not in ``inputs`` (tensors whose writes are the
    caller's business: static inputs) are logged before they happen, with
    what they will overwrite: the indexed cells of an ``index_put_`` or
    ``index_copy_`` (a KV cache written at a few slots costs a few slots), the
    written view of another in-place op, the whole storage for an ``out=``
    argument. :meth:`restore` undoes the log newest first (so the state is as
    before the first logged write). It never sets a generator it does not own:
    with ``generators`` (:class:`~graphrunner.tape.rng.OwnedGenerators`), code
    recorded with the guard draws from their stand-ins (the recorder installs a
    :func:`~graphrunner.tape.rng.redirect`) and :meth:`restore` resets them, so
    the next run draws the same numbers. Used by ``runner.compare``, by the padding check
    around its extra forwards and by a background capture, so the KV cache or
    a counter tensor are as before and the engine's generators untouched. ``snapshots`` maps the
    key of every storage put back to a description of the tensor written.
    """

    def __init__(self, inputs: Sequence[torch.Tensor] = (), generators: OwnedGenerators | None = None):
        self.created: set = set()  # storages made by the recorded code
        self.inputs = {storage_key(t) for t in inputs}
        self.snapshots: dict = {}
        self._undo: list = []  # (restore function, its argument), oldest first
        self._whole: set = set()  # storages logged whole since the last restore
        #: Generators standing in for the step's while it is recorded with this guard (None: the
        #: step draws from its own; the guard never sets a generator it does not own).
        self.generators = generators

    def before(self, ev: OpEvent) -> None:
        if not ev.func._schema.is_mutable:
            return
        for t in ev.written:
            k = storage_key(t)
            if k is None or k in self.created or k in self.inputs or k in self._whole:
                continue
            self.snapshots.setdefault(k, f"{tuple(t.shape)} {t.dtype}")
            with _disable_current_modes(), torch.inference_mode():
                self._undo.append(self._undo_entry(ev, t, k))

    def _undo_entry(self, ev: OpEvent, t: torch.Tensor, k: int) -> tuple:
        """``(restore function, argument)`` that puts back what ``ev`` is about to write into ``t``."""
        args, name = ev.args, ev.name
        if args and args[0] is t and name not in _RESHAPING:  # in place on self: its cells only
            if name in _INDEX_PUT and len(args) >= 3:
                index = [None if i is None else i.clone() for i in args[1]]
                return _put_index, (t, index, torch.ops.aten.index.Tensor(t, index))
            if name == "aten::index_copy_" and len(args) >= 4:
                dim, index = args[1], args[2].clone()
                return _put_index_copy, (t, dim, index, t.index_select(dim, index))
            return _put_view, (t, t.clone())
        st = t.untyped_storage()
        self._whole.add(k)
        return _put_storage, (st, storage_bytes(st).clone())

    def after(self, ev: OpEvent) -> None:
        # storages an op returned fresh: made by the recorded code (its writes to them are its
        # own business, not state to put back). The schema says which returns are fresh (no
        # alias annotation); for an op whose returns may alias an argument (reshape, contiguous,
        # an op outside aten), a returned storage that is none of its arguments' is fresh.
        fresh = FRESH_RETURNS.get(ev.func, UNKNOWN)
        if fresh is UNKNOWN:
            fresh = FRESH_RETURNS[ev.func] = fresh_returns(ev.func)
        created = self.created
        if fresh is True:
            for t in tensors_in(ev.out):
                k = storage_key(t)
                if k is not None:
                    created.add(k)
        elif fresh is None:
            args = {storage_key(t) for v in (*ev.args, *ev.kwargs.values()) for t in tensors_in(v)}
            for t in tensors_in(ev.out):
                k = storage_key(t)
                if k is not None and k not in args:
                    created.add(k)

    def restore(self) -> None:
        """Undo every logged write, newest first, and reset the guard's own generators (never another's).

        The guard can record again: the log is emptied and the storages the last run
        created are forgotten (their addresses may be reused); :attr:`snapshots` keeps
        growing."""
        with _disable_current_modes(), torch.inference_mode():
            for put, arg in reversed(self._undo):
                put(*arg)
        self._undo.clear()
        self._whole.clear()
        if self.generators is not None:
            self.generators.reset()  # the next run draws what this one drew
        self.created.clear()


FRESH_RETURNS: dict = {}  # op overload -> True (every return fresh), False (none), None (look)
UNKNOWN = object()  # not in FRESH_RETURNS yet


def fresh_returns(func: Any) -> bool | None:
    """``True`` when every return of aten op ``func`` is a fresh tensor (no alias annotation),
    ``False`` when none can be (a view kernel, an in-place or ``out=`` op whose returns are all
    annotated), ``None`` when it depends (a composite view such as ``reshape``, which copies when
    it cannot view; ``Tensor(a)`` returns such as ``contiguous``'s; ops outside ``aten``): then
    the returns are compared with the arguments' storages."""
    if getattr(func, "namespace", None) != "aten":
        return None
    rets = func._schema.returns
    annotated = [r.alias_info is not None for r in rets]
    if func.is_view and all(annotated):
        # a composite view (reshape, flatten) copies when it cannot view: look
        return (
            None if torch._C._dispatch_has_kernel_for_dispatch_key(func.name(), "CompositeImplicitAutograd") else False
        )
    if not any(annotated):
        return True
    if all(r.alias_info.is_write for r in rets):
        return False  # in place / out=: the returns are the written arguments
    return None


#: In-place ops that index their ``self`` with a list of index tensors (``self[indices] = values``).
_INDEX_PUT = frozenset(("aten::index_put_", "aten::_index_put_impl_"))
#: In-place ops that may change their ``self``'s shape or storage: put back whole.
_RESHAPING = frozenset(
    (
        "aten::resize_",
        "aten::resize_as_",
        "aten::set_",
        "aten::squeeze_",
        "aten::unsqueeze_",
        "aten::transpose_",
        "aten::t_",
        "aten::as_strided_",
        "aten::swapdims_",
        "aten::swapaxes_",
    )
)


def _put_index(t: torch.Tensor, index: list, old: torch.Tensor) -> None:
    torch.ops.aten.index_put_(t, index, old)


def _put_index_copy(t: torch.Tensor, dim: int, index: torch.Tensor, old: torch.Tensor) -> None:
    t.index_copy_(dim, index, old)


def _put_view(t: torch.Tensor, old: torch.Tensor) -> None:
    t.copy_(old)


def _put_storage(st: Any, old: torch.Tensor) -> None:
    storage_bytes(st).copy_(old)
