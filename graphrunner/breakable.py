"""Breakable graphs: device-graph segments with eager breaks between them.

A step that cannot be captured whole (attention metadata, all-to-all, host
syncs) is captured as a :class:`BreakableGraph`: every call of a
:func:`no_graph` function during capture ends the current graph segment, runs
the function eagerly once, records it as an eager step, and starts a new
segment. Replay runs segment, eager step, segment, ... in capture order.

    graph = BreakableGraph()
    with breakable_graph(graph):
        out = step(static_inputs)        # @no_graph functions inside break it
    ...
    static_inputs.copy_(new_values)
    graph.replay()                        # refreshes ``out`` in place

Segments come from ``device.new_graph()``: TapeGraphs on any machine, CUDA
graphs in one shared pool when CUDA is present. The active capture is held
in a ``ContextVar``; outside capture a ``no_graph`` function is a plain call.

Meta's ``breakable_cuda_graphs`` spellings work too: ``BreakableCUDAGraph``
is :class:`BreakableGraph`, and ``breakable_graph(cuda_graph=graph)`` is
``breakable_graph(graph)``.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from typing import Any

import torch

from graphrunner._pytree import describe, flatten, structure, unflatten
from graphrunner.devices import get_device
from graphrunner.errors import CaptureError
from graphrunner.recording.ops import mark_no_graph_code
from graphrunner.tape.state import alias_of

__all__ = [
    "BreakableGraph",
    "BreakableCUDAGraph",
    "breakable_graph",
    "no_graph",
    "force_no_graph",
    "is_in_breakable_graph",
]

logger = logging.getLogger("graphrunner")

_ACTIVE: ContextVar[_Capture | None] = ContextVar("graphrunner_breakable_capture", default=None)


def _fn_name(fn: Callable) -> str:
    return getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or repr(fn)


def _bind_error(f: Callable, params: list[inspect.Parameter] | None = None) -> str | None:
    """Why ``f`` cannot be called with ``params`` (the required parameters of
    another function; none when None), or None if it can or its signature
    cannot be read (a C function)."""
    try:
        sig = inspect.signature(f)
    except (TypeError, ValueError):
        return None
    args: list[None] = []
    kwargs: dict[str, None] = {}
    for p in params or ():
        if p.default is not p.empty or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        if p.kind == p.KEYWORD_ONLY:
            kwargs[p.name] = None
        else:
            args.append(None)
    try:
        sig.bind(*args, **kwargs)
    except TypeError as exc:
        return str(exc)
    return None


def _params(fn: Callable) -> list[inspect.Parameter] | None:
    """The parameters of ``fn``, or None if its signature cannot be read."""
    try:
        return list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return None


def _overlaps(t: torch.Tensor) -> bool:
    """True if a replay ``copy_`` into ``t`` would be refused because several
    of its elements share one memory location (an ``expand``-ed, stride-0
    view; ``as_strided``/``unfold`` windows), or if PyTorch cannot tell."""
    if t.layout != torch.strided or t.numel() <= 1:
        return False
    if any(st == 0 and n > 1 for n, st in zip(t.shape, t.stride())):
        return True
    return torch._debug_has_internal_overlap(t) != 0  # 1: overlaps, 2: too hard to tell


def _hold(v, owns: Callable[[torch.Tensor], bool]):
    """``v`` with every plain tensor whose memory the device's graphs own (a
    segment's output) replaced by an alias, recursing into tuples; anything
    else (lists, dicts, objects, external tensors) is returned as is."""
    if type(v) is torch.Tensor:
        return alias_of(v) if not v.requires_grad and owns(v) else v
    if type(v) is tuple:
        return tuple(_hold(x, owns) for x in v)
    return v


class _EagerStep:
    """One eager break, replayed by calling the function again on the same
    (static) arguments and copying its fresh result into the tensors the
    capture returned, which later segments read.

    A result tensor whose elements share memory (``mask.expand(b, h, q, k)``)
    cannot be written by ``copy_``; it is replaced at capture by a contiguous
    copy with the same values (``self.result``, what the capture returns and
    later segments read), and replay copies each fresh result into that.

    ``owns`` (the device's ``owns_memory``, if it has one) marks arguments
    that are graph memory: those are held through an alias on their memory,
    so the caller's tensor object is not pinned."""

    __slots__ = ("fn", "args", "kwargs", "leaves", "spec", "name", "single", "result")

    def __init__(self, fn, args, kwargs, result, owns: Callable[[torch.Tensor], bool] | None = None) -> None:
        if owns is not None:
            # Graph memory (a segment's output) is held through an alias, not
            # the caller's tensor object: once the caller drops it, the pool
            # sees it freed, as a CUDA pool would (the graph keeps the memory).
            args = tuple(_hold(a, owns) for a in args)
            kwargs = {k: _hold(v, owns) for k, v in kwargs.items()}
        self.fn, self.args, self.kwargs = fn, args, kwargs
        self.name = _fn_name(fn)
        try:
            self.spec, self.leaves = flatten(result, f"the result of @no_graph function {self.name}", scalars=True)
        except TypeError as exc:
            raise CaptureError(str(exc)) from None
        if any(type(t) is torch.Tensor and _overlaps(t) for t in self.leaves):
            self.leaves = [
                t.clone(memory_format=torch.contiguous_format) if type(t) is torch.Tensor and _overlaps(t) else t
                for t in self.leaves
            ]
            result = unflatten(self.spec, self.leaves)
        self.result = result
        # The common case (one tensor, or nothing) skips the tree walk at replay.
        self.single = isinstance(result, torch.Tensor) or result is None

    def __call__(self) -> None:
        fresh = self.fn(*self.args, **self.kwargs)
        if self.single:
            old = self.leaves[0] if self.leaves else None
            if fresh is old:
                return
            if (
                old is not None
                and type(fresh) is torch.Tensor
                and fresh.shape == old.shape
                and fresh.dtype == old.dtype
            ):
                old.copy_(fresh)
                return
            # Anything else falls through to the general check and its error.
        try:
            spec, leaves = flatten(fresh, f"the result of @no_graph function {self.name}", scalars=True)
        except TypeError as exc:
            raise CaptureError(str(exc)) from None
        if spec != self.spec:
            if structure(spec) == structure(self.spec):
                raise CaptureError(
                    f"@no_graph function {self.name} returned {describe(spec, leaves)} at replay where it "
                    f"returned {describe(self.spec, self.leaves)} at capture; the segments after it froze "
                    "that Python value. Return tensors for values that change, or re-capture."
                )
            raise CaptureError(
                f"@no_graph function {self.name} returned a different structure at replay "
                f"({describe(spec, leaves)}) than at capture ({describe(self.spec, self.leaves)}); a graph "
                "freezes it. Return the same structure every call, or re-capture."
            )
        for i, (old, new) in enumerate(zip(self.leaves, leaves)):
            if old is new:
                continue
            if new.shape != old.shape or new.dtype != old.dtype:
                raise CaptureError(
                    f"@no_graph function {self.name} returned output {i} as {tuple(new.shape)} {new.dtype} "
                    f"at replay, but {tuple(old.shape)} {old.dtype} at capture; the graph segments after "
                    "it read the captured tensor. Keep shapes and dtypes fixed per shape key "
                    "(pad to the bucket), or re-capture."
                )
            old.copy_(new)


class BreakableGraph:
    """A captured step: graph segments and eager steps, replayed in order.

    ``device`` (default ``get_device("auto")``) makes every segment with
    ``device.new_graph()``; ``pool`` overrides the device's shared pool for
    API parity with ``torch.cuda.CUDAGraph``. ``trace``, ``key`` and
    ``backend`` only label the segment and eager-break events recorded during
    capture. Capture with :func:`breakable_graph`; ``replay()`` raises
    :class:`CaptureError` before a capture. A graph is captured once;
    ``reset()`` empties it for a new capture.
    """

    def __init__(
        self, pool: Any = None, device: Any = None, trace: Any = None, key: Any = None, backend: str = "breakable"
    ) -> None:
        self.device = get_device(device if device is not None else "auto")
        self._pool = pool
        self.trace, self.key, self.backend = trace, key, backend
        self._steps: list[Callable[[], None]] = []
        self._graphs: list[Any] = []
        self.num_breaks = 0
        self._inference_mode = False  # captured under inference_mode: replay under it too

    @property
    def num_segments(self) -> int:
        """Number of device-graph segments captured (empty segments are dropped)."""
        return len(self._graphs)

    @property
    def num_ops(self) -> int | None:
        """Aten ops recorded over all segments when every segment is a tape
        graph (:attr:`TapeGraph.num_ops`), else ``None`` (CUDA graphs do not count them)."""
        counts = [getattr(g, "num_ops", None) for g in self._graphs]
        known = [c for c in counts if c is not None]
        return None if len(known) < len(counts) else sum(known)

    @property
    def num_collectives(self) -> int | None:
        """Collectives recorded over all segments when every segment is a tape graph
        (:attr:`TapeGraph.num_collectives`), else ``None``."""
        counts = [getattr(g, "num_collectives", None) for g in self._graphs]
        known = [c for c in counts if c is not None]
        return None if len(known) < len(counts) else sum(known)

    @property
    def captured(self) -> bool:
        """True once a capture has completed and replay is allowed."""
        return bool(self._steps)

    def pool(self) -> Any:
        """The memory-pool handle the segments are captured into."""
        return self._pool if self._pool is not None else self.device.graph_pool()

    def replay(self) -> None:
        """Run every segment and eager step in capture order, with autograd off
        (under ``inference_mode`` if the capture was). No synchronization."""
        if not self._steps:
            raise CaptureError(
                "replay() of a BreakableGraph that holds no capture; capture it "
                "with `with breakable_graph(graph): ...` first"
            )
        # Eager steps run with autograd off, under the grad mode of the capture.
        with torch.inference_mode() if self._inference_mode else torch.no_grad():
            for step in self._steps:
                step()

    def reset(self) -> None:
        """Drop every segment and eager step; the graph can be captured again."""
        for g in self._graphs:
            with contextlib.suppress(Exception):
                g.reset()
        self._steps.clear()
        self._graphs.clear()
        self.num_breaks = 0

    def _record(self, kind: str, **data) -> None:
        if self.trace is not None:
            self.trace.record(kind, key=self.key, backend=self.backend, **data)


#: Meta's ``breakable_cuda_graphs`` name for :class:`BreakableGraph` (the same
#: class), so code written against that module ports by import rename.
BreakableCUDAGraph = BreakableGraph


class _Capture:
    """State of one active breakable capture: the open segment, if any."""

    def __init__(self, graph: BreakableGraph, stream, capture_error_mode: str, barrier_fn) -> None:
        self.graph, self.stream, self.mode, self.barrier_fn = graph, stream, capture_error_mode, barrier_fn
        self.segment: tuple[Any, Any] | None = None  # (graph, context) while a segment is being captured

    def open_segment(self) -> None:
        g = self.graph.device.new_graph()
        # pool=None unless the graph overrides it: the device's own shared pool, which the device
        # renews when every graph it captured there released it (a CUDA pool cannot be reused then).
        ctx = self.graph.device.capture(g, stream=self.stream, capture_error_mode=self.mode, pool=self.graph._pool)
        self.graph._record("segment_begin", segment=len(self.graph._graphs))
        ctx.__enter__()
        self.segment = (g, ctx)

    def close_segment(self, exc_info=(None, None, None)) -> None:
        if self.segment is None:
            raise CaptureError(
                "breakable_graph: no segment is open to end (the capture's segments and eager "
                "breaks went out of step); reset the graph and capture again"
            )
        g, ctx = self.segment
        self.segment = None
        ctx.__exit__(*exc_info)
        if exc_info[0] is not None:
            return
        self.graph._record("segment_end", segment=len(self.graph._graphs))
        is_empty = getattr(self.graph.device, "is_empty", None)
        if is_empty(g) if is_empty is not None else getattr(g, "num_ops", None) == 0:
            return  # nothing captured (break at start/end, back-to-back breaks)
        self.graph._graphs.append(g)
        self.graph._steps.append(g.replay)

    def eager_break(self, fn: Callable, stub: Callable | None, args, kwargs):
        self.close_segment()
        if self.barrier_fn is not None:
            self.barrier_fn()
        # The body runs eagerly with no segment open, so no_graph calls nested
        # in it are plain calls.
        trace = self.graph.trace
        span = (
            trace.span("eager_break", key=self.graph.key, backend=self.graph.backend, fn=_fn_name(fn))
            if trace is not None
            else contextlib.nullcontext()
        )
        # A device may watch the body (a check's op recorder: RecordingDevice.eager_break_context).
        watch = getattr(self.graph.device, "eager_break_context", None)
        with span, watch() if watch is not None else contextlib.nullcontext():
            result = (stub or fn)(*args, **kwargs)
        step = _EagerStep(fn, args, kwargs, result, getattr(self.graph.device, "owns_memory", None))
        self.graph._steps.append(step)
        self.graph.num_breaks += 1
        self.open_segment()
        return step.result


@contextlib.contextmanager
def breakable_graph(
    graph: BreakableGraph | None = None,
    stream: Any = None,
    capture_error_mode: str = "global",
    barrier_fn: Callable[[], None] | None = None,
    *,
    cuda_graph: BreakableGraph | None = None,
) -> Iterator[BreakableGraph]:
    """Capture the block into ``graph``, breaking it at every :func:`no_graph` call.

    ``graph`` is a :class:`BreakableGraph` (alias :data:`BreakableCUDAGraph`);
    ``cuda_graph=`` is accepted as a synonym, the keyword Meta's
    ``breakable_cuda_graphs`` uses (give one of the two, not both).
    ``stream`` is the capture stream (default: the device's), and
    ``capture_error_mode`` is passed to each segment's ``capture_begin``.
    ``barrier_fn``, if given, must be callable with no arguments; it is called
    before every eager break during capture (never at replay) so that ranks
    realign before eager code that may hold collectives. The arguments are
    checked on entry (``TypeError``), before anything is captured. Nesting
    raises :class:`CaptureError`. If the block raises, the open segment's
    capture is ended, ``graph`` is reset to empty and the exception
    propagates.
    """
    if cuda_graph is not None:
        if graph is not None:
            raise TypeError(
                "breakable_graph() got both graph and cuda_graph (a synonym, for Meta's "
                "breakable_cuda_graphs); pass the BreakableGraph once"
            )
        graph = cuda_graph
    if not isinstance(graph, BreakableGraph):
        raise TypeError(
            "breakable_graph() needs a BreakableGraph (graph= or cuda_graph=), got "
            f"{type(graph).__name__}; make one with graphrunner.BreakableGraph()"
        )
    if barrier_fn is not None and not callable(barrier_fn):
        raise TypeError(
            f"breakable_graph(): barrier_fn must be callable (called with no arguments before "
            f"each eager break) or None, got {type(barrier_fn).__name__}"
        )
    if barrier_fn is not None:
        why = _bind_error(barrier_fn)
        if why is not None:
            raise TypeError(
                f"breakable_graph(): barrier_fn {_fn_name(barrier_fn)} is called with no arguments "
                f"before each eager break, but cannot be: {why}"
            )
    if _ACTIVE.get() is not None:
        raise CaptureError(
            "breakable_graph() inside another breakable_graph capture: nesting is not "
            "supported; end the outer capture first"
        )
    if graph.captured:
        raise CaptureError("this BreakableGraph already holds a capture; call graph.reset() first")
    state = _Capture(graph, stream, capture_error_mode, barrier_fn)
    graph._inference_mode = torch.is_inference_mode_enabled()
    token = _ACTIVE.set(state)
    try:
        state.open_segment()
        yield graph
        state.close_segment()
    except BaseException as exc:
        if state.segment is not None:
            try:
                state.close_segment((type(exc), exc, exc.__traceback__))
            except BaseException as end_exc:  # noqa: BLE001
                if end_exc is not exc:
                    # The device reports what ending the capture revealed (a collective in the
                    # capture, a CUDA capture that cannot be ended: restart): that error, chained.
                    graph.reset()
                    raise end_exc
        graph.reset()
        raise
    finally:
        _ACTIVE.reset(token)
    if not graph._steps:
        # An empty block: keep replay() legal and a no-op, like an empty CUDA graph.
        graph._steps.append(lambda: None)


def no_graph(fn: Callable | None = None, *, enable: bool = True, capture_stub: Callable | None = None):
    """Mark a function (or bound method) as an eager break.

    Use as ``@no_graph`` or ``@no_graph(enable=..., capture_stub=...)``.
    Outside a breakable capture, and inside the body of another break, the
    function is a plain call. During a capture, a call ends the current
    segment, calls the capture's ``barrier_fn``, runs the body (or
    ``capture_stub``, called with the same arguments, if given) once, records
    an eager step and starts a new segment. At replay the real body runs
    again on the same arguments and its fresh result is copied into the
    tensors returned at capture (later segments read those); a changed shape,
    dtype, structure or Python value raises :class:`CaptureError` naming the
    function. Arguments must therefore be static tensors (graph inputs,
    segment outputs, weights) or values that are fixed for the shape key.
    A tensor argument whose memory a segment owns (its output), given
    directly or in a tuple, is held through that memory when the device
    tells (``device.owns_memory``, the tape), not as the caller's object;
    everything else is kept as given until ``reset()``.
    ``enable=False`` returns ``fn`` unchanged (captured like any other code).
    A ``capture_stub`` that is not callable, or cannot take ``fn``'s required
    parameters, raises ``TypeError`` here, at decoration time.
    """
    if capture_stub is not None and not callable(capture_stub):
        raise TypeError(f"no_graph: capture_stub must be callable, got {type(capture_stub).__name__}")
    if fn is None:
        return lambda f: no_graph(f, enable=enable, capture_stub=capture_stub)
    if not callable(fn):
        raise TypeError(f"no_graph expects a function or method, got {type(fn).__name__}")
    if capture_stub is not None:
        params = _params(fn)
        why = _bind_error(capture_stub, params) if params is not None else None
        if why is not None:
            raise TypeError(
                f"no_graph({_fn_name(fn)}): capture_stub {_fn_name(capture_stub)} is called with the "
                f"same arguments as the function during capture, but cannot take them: {why}. "
                "Give it the function's parameters (or *args, **kwargs)"
            )
    if not enable:
        return fn

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        state = _ACTIVE.get()
        if state is None or state.segment is None:
            return fn(*args, **kwargs)
        return state.eager_break(fn, capture_stub, args, kwargs)

    wrapper.__graphrunner_no_graph__ = True  # type: ignore[attr-defined]  # our marker on the function object
    return wrapper


@no_graph
def force_no_graph() -> None:
    """Split the current breakable-capture segment here, with no eager work.

    Inside a :func:`breakable_graph` capture this ends the open segment and
    starts a new one (``barrier_fn`` runs, as for any break); outside capture
    it does nothing. Useful to bisect a graph bug by cutting a step into
    smaller segments.
    """


mark_no_graph_code(force_no_graph.__code__)  # every @no_graph wrapper runs this code: the op recorder's eager breaks


def is_in_breakable_graph() -> bool:
    """True while a :func:`breakable_graph` capture is active in this context,
    including inside the body of an eager break; False otherwise."""
    return _ACTIVE.get() is not None
