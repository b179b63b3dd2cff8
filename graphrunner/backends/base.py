"""The capture protocol, in one place.

:class:`GraphBackend` holds the one method that orders capture,
:meth:`GraphBackend.capture_one`. For every shape key, on every rank (the steps are named, in order and with
their reasons, by :class:`graphrunner.backends.protocol.Step`)::

    BEGIN
    repeat warmups (default 2):
        WARMUP_SYNC, WARMUP_BARRIER                  # device.synchronize(); group.barrier()
        WARMUP_FORWARD, POST_WARMUP_HOOK             # out = forward_fn(); post_warmup_hook()
    AFTER_WARMUPS                                    # the checks' work after the warmups
    FINAL_SYNC                                       # drain the last warmup/hook's async work
    FINAL_BARRIER                                    # no rank starts capturing early
    GRAPH_CONSTRUCT                                  # <make a graph>, only after both
    CAPTURE_FORWARD                                  # copy_into(output_view(key), forward_fn()) exactly once; no hook
    AFTER_CAPTURE, END

Checks attach to this order as capture hooks (:mod:`graphrunner.recording.hooks`)
at fixed points: ``begin`` (``BEGIN``), around each warmup forward
(``before_warmup``, its ops, ``after_warmup``: ``WARMUP_FORWARD``),
``after_warmups`` (``AFTER_WARMUPS``, before ``FINAL_SYNC``), the ops of the
captured forward (``CAPTURE_FORWARD``), ``after_capture`` (``AFTER_CAPTURE``),
``end`` (``END``), and ``before_replay`` in debug mode. The drift
check (``drift_check=True``) is one of them, in :attr:`GraphBackend.hooks`
like any other: :mod:`graphrunner.checks` provides it by name
(:func:`~graphrunner.recording.hooks.provided_check`), so a backend never
imports a check.

Subclasses supply only :meth:`GraphBackend._make_graph` and
:meth:`GraphBackend._capture_into` (and the two counters of
:meth:`GraphBackend._graph_stats`). ``capture_one`` calls the protocol's
phases in order (``_warmups``, ``_pre_capture``, ``_bind_outputs``,
``_capture``, ``_after_capture``; ``_fail`` on an error), which share one
:class:`~graphrunner.backends.keycapture.KeyCapture`; the graph holds only
its :class:`~graphrunner.backends.keycapture.BoundForward`. Each step of a
phase is a small method (``_final_sync`` for ``FINAL_SYNC``, ``_final_barrier``
for ``FINAL_BARRIER``, ...) so that a
test can break exactly one step and watch the checks fail; the order itself
lives only in ``capture_one``. Nothing on the replay path synchronizes the
device or calls the group. See ``docs/protocol.md``.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import time
from collections.abc import Callable, Hashable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, NoReturn

import torch

from graphrunner.backends.failure import raise_capture_failure
from graphrunner.backends.keycapture import BoundForward, KeyCapture
from graphrunner.backends.outputs import OutputBuffer, tensor_bytes, unflatten
from graphrunner.backends.protocol import Step
from graphrunner.devices import get_device
from graphrunner.errors import CaptureError
from graphrunner.group import LocalGroup
from graphrunner.recording.hooks import Capture, CaptureHook, provided_check
from graphrunner.tape.state import reuse_snapshot_buffers
from graphrunner.trace import EventKind, Trace, as_trace

__all__ = ["GraphBackend"]

logger = logging.getLogger("graphrunner")


@dataclass
class _Entry:
    """Everything one captured key holds (kept alive until cleanup)."""

    key: Any
    graph: Any
    forward_fn: Callable[[], Any]
    capture_inputs: Any
    spec: tuple
    views: list[torch.Tensor]
    capture_seconds: float = 0.0
    warmup_seconds: float = 0.0
    graph_capture_seconds: float = 0.0
    capture_input_bytes: int = 0
    extra: dict[str, Any] = field(default_factory=dict)
    replay_hooks: tuple = ()


class GraphBackend:
    """Base class of every backend: the one capture protocol.

    Args:
        device: a device object (``synchronize()``, ``new_graph()``,
            ``graph_pool()``, ``capture_stream()``, ``capture(graph)``), a
            kind for :func:`graphrunner.devices.get_device` (``"auto"``,
            ``"tape"``, ``"cuda"``), or ``None`` for ``"auto"``.
        group: a group (``rank``, ``size``, ``barrier(phase=, key=)``,
            ``all_max``, ``all_min``); ``None`` means :class:`LocalGroup`.
        warmups: eager warmup forwards before each capture (``>= 0``; the
            default 2 lets lazy initialisation and autotuning settle).
        trace: a :class:`~graphrunner.trace.Trace` to record protocol events
            into, or ``None`` to record nothing.
        drift_check: record the op stream (ops, shapes, dtypes, non-tensor
            arguments, source lines) of the last warmup and of the capture
            and raise :class:`CaptureError` naming the first op that differs
            (:mod:`graphrunner.checks.drift`): the step reads Python state
            that a graph would freeze. Default ``True``; ``False`` skips the
            recording (and its capture-time cost).
        hooks: more capture hooks (:class:`~graphrunner.recording.hooks.CaptureHook`)
            run for every key, after the drift check's.

    Use::

        with backend.capture_session():
            for key in keys_largest_first:
                backend.capture_one(key, forward_fn, capture_inputs, post_warmup_hook)
        out = backend.replay(key)          # leading-rows views of the shared output buffer
        backend.cleanup()

    Keys are any hashable values (the runner uses ints, the padded batch
    size). The forward may return any pytree of tensors (tensor, tuple,
    list, dict, namedtuple, dataclass, ``None``). All keys share one output
    buffer, allocated at the first key captured, so capture the largest key
    first; dim 0 of every tensor is its row dimension and ``replay(key)``
    returns that key's leading-rows views, valid until the next replay of
    any key. 0-dim tensors are not batch-major: every key shares the whole
    scalar. Events are recorded with the trace's ``rank``; with a multi-rank
    group the trace's ``rank`` is set to the group's.
    """

    #: Name recorded in trace events and used in messages.
    name = "base"

    #: What the drift check compares: ``"all"`` ops of the step, ``"segments"``
    #: (ops outside ``@no_graph`` bodies, which run eagerly at replay), or
    #: ``None`` (nothing: the backend freezes no Python state).
    _drift_scope: str | None = "all"

    def __init__(
        self,
        device: Any = None,
        group: Any = None,
        warmups: int = 2,
        trace: Trace | None = None,
        drift_check: bool = True,
        *,
        output_arena: Any = None,
        hooks: Any = (),
    ):
        if isinstance(warmups, bool) or not isinstance(warmups, int):
            raise TypeError(f"warmups must be an int >= 0, got {type(warmups).__name__} ({warmups!r})")
        if warmups < 0:
            raise ValueError(f"warmups must be >= 0, got {warmups}; use 0 to capture without warmup forwards")
        if not isinstance(drift_check, bool):
            raise TypeError(f"drift_check must be True or False, got {type(drift_check).__name__} ({drift_check!r})")
        self.device = self._resolve_device(device)
        self.group = group if group is not None else LocalGroup()
        self.warmups = warmups
        #: ``capture_begin``'s error mode: ``"global"``, or ``"thread_local"`` while a background
        #: capture runs (other threads may then use the device; :mod:`graphrunner.background`).
        self.capture_error_mode = "global"
        self.drift_check = drift_check
        self.trace: Trace = as_trace(trace)
        if self.trace and int(getattr(self.group, "size", 1)) > 1 and self.trace.rank != self.rank:
            # One trace per process; every event carries the trace's rank, so
            # in a multi-rank group it must be this process's rank.
            self.trace.rank = self.rank
        self._entries: dict[Hashable, _Entry] = {}
        self.output_arena = output_arena
        self._out = OutputBuffer(output_arena)
        self._in_session = False
        self._capturing: Any | None = None
        #: The capture hooks run for every key (the drift check first, when on).
        self.hooks: list[CaptureHook] = []
        if drift_check and self._drift_scope is not None:
            self.hooks.append(provided_check("drift"))  # graphrunner.checks provides it
        for h in hooks:
            if not isinstance(h, CaptureHook):
                raise TypeError(f"hooks must be CaptureHook instances, got {type(h).__name__}")
            self.hooks.append(h)

    @staticmethod
    def _resolve_device(device: Any) -> Any:

        return get_device("auto" if device is None else device)

    @property
    def rank(self) -> int:
        """This process's rank in ``group``."""
        return int(getattr(self.group, "rank", 0))

    def __repr__(self) -> str:
        return f"{type(self).__name__}(device={self.device!r}, group={self.group!r}, warmups={self.warmups}, keys={list(self._entries)})"

    # ------------------------------------------------------------- session
    @contextlib.contextmanager
    def capture_session(self) -> Iterator[GraphBackend]:
        """Context manager around a batch of :meth:`capture_one` calls.

        On entry: ``gc.collect()`` then ``gc.freeze()`` (objects that exist
        now are never scanned by the collector during capture, so a GC pass
        cannot free memory a capture is using nor stall one rank), and a
        ``session_begin`` event. On exit, also on an exception:
        ``gc.unfreeze()`` (skipped if the caller had frozen objects itself
        before the session, so an engine's own ``gc.freeze()`` stays) and
        ``session_end``. Sessions do not nest. Within a session the tape's
        snapshots of the storages a capture writes (to put them back) reuse
        the buffers of earlier captures' snapshots
        (:func:`graphrunner.tape.state.reuse_snapshot_buffers`), dropped at exit.
        """
        if self._in_session:
            raise CaptureError(f"{type(self).__name__}.capture_session() is already active; sessions do not nest")
        caller_froze = gc.get_freeze_count() > 0  # e.g. an engine that froze its heap after fork
        gc.collect()
        empty_cache = getattr(self.device, "empty_cache", None)
        if empty_cache is not None:
            empty_cache()  # as torch.cuda.graph does: cached blocks and released pools back to the driver
        gc.freeze()
        self._in_session = True
        self.trace.record(EventKind.SESSION_BEGIN, backend=self.name)
        try:
            with reuse_snapshot_buffers():
                yield self
        finally:
            self._in_session = False
            if not caller_froze:
                gc.unfreeze()
            self.trace.record(EventKind.SESSION_END, backend=self.name)

    # ------------------------------------------------------------- protocol
    def capture_one(
        self,
        key: Hashable,
        forward_fn: Callable[[], Any],
        capture_inputs: Any = None,
        post_warmup_hook: Callable[[], Any] | None = None,
        lead_dims: int = 1,
        hooks: Sequence[CaptureHook] = (),
        findings: list | None = None,
    ) -> None:
        """Warm up and capture ``forward_fn`` for ``key``: THE capture protocol.

        Steps (:class:`~graphrunner.backends.protocol.Step`), in this order and
        nowhere else (``H.x``: every hook's ``x``, :mod:`graphrunner.recording.hooks`):

        - ``BEGIN``: ``H.begin``.
        - ``warmups`` times: ``WARMUP_SYNC`` (device synchronize),
          ``WARMUP_BARRIER`` (group barrier), ``WARMUP_FORWARD``
          (``H.before_warmup``, ``forward_fn()`` with its ops fed to
          ``H.warmup_consumers``, ``H.after_warmup``), then
          ``POST_WARMUP_HOOK`` (``post_warmup_hook()``, if given).
        - ``AFTER_WARMUPS``: ``H.after_warmups`` (a check's extra eager
          forwards and collectives).
        - ``FINAL_SYNC`` (device synchronize), then ``FINAL_BARRIER`` (group
          barrier).
        - ``GRAPH_CONSTRUCT`` (:meth:`_make_graph`), then ``CAPTURE_FORWARD``:
          ``forward_fn()`` captured exactly once (its output copied into the
          shared output buffer inside the graph; its ops fed to
          ``H.capture_consumers``). The post-warmup hook does not run.
        - ``AFTER_CAPTURE``: ``H.after_capture`` (the drift check compares the
          last warmup's op stream with the capture's), then ``END``:
          ``H.end`` (also after an error).

        ``forward_fn`` takes no arguments and reads static input tensors;
        ``capture_inputs`` (any object, typically those static tensors) is
        kept alive until :meth:`cleanup`, because a graph holds addresses,
        not Python references. Must be called inside
        :meth:`capture_session`; a key may be captured once (until cleanup).
        ``lead_dims``: how many leading dims of an output tensor may be
        smaller than the shared output buffer's (1: rows only; a runner with
        several named dims passes more); the key's output is the leading
        corner ``buffer[:a, :b, ...]`` of the buffer. ``hooks``: capture
        hooks for this key only, run after :attr:`hooks`. ``findings``: a
        list puts the hooks in collect mode (``graphrunner check``): what
        they find is appended to it instead of raised.

        Errors: ``RankTimeoutError`` from the group passes through unchanged;
        any other exception cleans up this key's capture state and is
        re-raised as ``CaptureError`` naming the shape key and the step,
        with the original as ``__cause__`` (:meth:`_fail`).
        """
        run = self._start(key, forward_fn, capture_inputs, post_warmup_hook, lead_dims, hooks, findings)
        try:
            out = self._warmups(run)  # BEGIN, WARMUP_* and POST_WARMUP_HOOK, AFTER_WARMUPS
            self._pre_capture(run)  # FINAL_SYNC, FINAL_BARRIER
            self._bind_outputs(run, out)
            del out  # not held through the capture
            self._capture(run)  # GRAPH_CONSTRUCT, CAPTURE_FORWARD
            self._after_capture(run)  # AFTER_CAPTURE
        except BaseException as exc:
            self._fail(run, exc)  # END; discards the key, raises
        self._end(run)  # END

    def _start(
        self,
        key: Hashable,
        forward_fn: Callable[[], Any],
        capture_inputs: Any,
        post_warmup_hook: Callable[[], Any] | None,
        lead_dims: int,
        hooks: Sequence[CaptureHook],
        findings: list | None,
    ) -> KeyCapture:
        """Check :meth:`capture_one`'s arguments; the key's :class:`KeyCapture` (``key`` is now capturing)."""
        if not self._in_session:
            raise CaptureError(
                f"capture_one(key={key!r}) called outside a capture session: wrap the captures in "
                f"`with backend.capture_session(): ...`"
            )
        if not self._hashable(key):
            raise TypeError(f"shape key must be hashable (an int or a tuple), got {type(key).__name__} {key!r}")
        if key in self._entries:
            raise CaptureError(
                f"shape key {key!r} is already captured by this {type(self).__name__}; call cleanup() to re-capture"
            )
        if not callable(forward_fn):
            raise TypeError(f"forward_fn must be callable with no arguments, got {type(forward_fn).__name__}")
        if post_warmup_hook is not None and not callable(post_warmup_hook):
            raise TypeError(f"post_warmup_hook must be callable or None, got {type(post_warmup_hook).__name__}")
        cap = Capture(
            key=key,
            backend=self,
            forward_fn=forward_fn,
            post_warmup_hook=post_warmup_hook,
            freezes=self._drift_scope,
            findings=findings,
        )
        bound = BoundForward(forward_fn, key, lead_dims, self._out, self._recording_capture)
        self._capturing = key
        return KeyCapture(key, cap, [*self.hooks, *hooks], bound, capture_inputs)

    def _warmups(self, run: KeyCapture) -> Any:
        """``BEGIN`` (``H.begin``), the warmups (:meth:`_warmup`), ``AFTER_WARMUPS``
        (``H.after_warmups``); returns the last warmup's output (``None`` without warmups)."""
        run.call_hooks("begin", step="{} check (begin)")
        out = None
        for i in range(self.warmups):
            out = None  # the previous warmup's output is not kept alive across the next forward
            out = self._warmup(run, i)
        run.cap.last_output = out
        for h in run.hooks:
            run.step = f"{h.name} check"
            with run.cap.timing():
                self._after_warmups(run.key, h, run.cap)
        run.cap.last_output = None  # not held through the capture
        run.t_warm = time.perf_counter()
        return out

    def _warmup(self, run: KeyCapture, i: int) -> Any:
        """Warmup ``i``: ``WARMUP_SYNC``, ``WARMUP_BARRIER``, ``WARMUP_FORWARD`` (``H.before_warmup``,
        the forward with its ops to ``H.warmup_consumers``, ``H.after_warmup``), ``POST_WARMUP_HOOK``;
        returns the output."""
        key, cap, of = run.key, run.cap, f"{i + 1}/{self.warmups}"
        run.step = f"warmup {of} {Step.WARMUP_SYNC.value}"
        self._warmup_sync(key, i)
        run.step = f"warmup {of} {Step.WARMUP_BARRIER.value}"
        self._warmup_barrier(key, i)
        run.step = f"warmup {of} {Step.WARMUP_FORWARD.value}"
        run.call_hooks("before_warmup", i)
        with run.watching([c for h in run.hooks for c in h.warmup_consumers(cap, i)]):
            out = self._warmup_forward(key, cap.forward_fn, i)
        run.call_hooks("after_warmup", i, out)
        if cap.post_warmup_hook is not None:
            run.step = f"{Step.POST_WARMUP_HOOK.value} {of}"
            self._post_warmup_hook(key, cap.post_warmup_hook, i)
        return out

    def _pre_capture(self, run: KeyCapture) -> None:
        """``FINAL_SYNC``, then ``FINAL_BARRIER``."""
        run.step = Step.FINAL_SYNC.value
        self._final_sync(run.key)
        run.step = Step.FINAL_BARRIER.value
        self._final_barrier(run.key)

    def _bind_outputs(self, run: KeyCapture, out: Any) -> None:
        """Bind the key's views of the shared output buffer from the last warmup's output (after
        ``FINAL_BARRIER``, before ``GRAPH_CONSTRUCT``: bookkeeping, not a step of its own). With
        ``warmups=0`` there is none: the capture binds them from the captured output."""
        if out is not None or self.warmups > 0:
            run.step = "output binding"
            run.bound.bind(out)

    def _capture(self, run: KeyCapture) -> None:
        """``GRAPH_CONSTRUCT``, then ``CAPTURE_FORWARD``: the bound forward captured into the graph
        exactly once (its ops fed to ``H.capture_consumers``); then the key is stored."""
        key, bound = run.key, run.bound
        bound.recorder = run.new_recorder([c for h in run.hooks for c in h.capture_consumers(run.cap)])
        run.step = Step.GRAPH_CONSTRUCT.value
        pool_before = self._pool_bytes()
        run.graph = self._construct(key)
        run.step = Step.CAPTURE_FORWARD.value
        run.t_cap = time.perf_counter()
        self._capture_forward(key, run.graph, bound)
        if bound.views is None:
            raise CaptureError(f"the capture of shape key {key!r} never called the forward")
        run.t_end = time.perf_counter()
        rec, bound.recorder = bound.recorder, None  # a replay (of an eager graph) records nothing
        run.cap.check_seconds += rec.seconds if rec is not None else 0.0
        pool_after = self._pool_bytes()
        if pool_before is not None and pool_after is not None:
            run.cap.info["graph_pool_bytes"] = max(0, pool_after - pool_before)
        self._entries[key] = _Entry(
            key=key,
            graph=run.graph,
            forward_fn=bound.forward_fn,
            capture_inputs=run.capture_inputs,
            spec=bound.spec,
            views=bound.views,
            capture_seconds=run.t_end - run.t0,
            warmup_seconds=run.t_warm - run.t0,
            graph_capture_seconds=run.t_end - run.t_cap,
            capture_input_bytes=tensor_bytes(run.capture_inputs),
            extra=run.cap.info,
            replay_hooks=tuple(h for h in run.hooks if h.replay_check),
        )

    def _after_capture(self, run: KeyCapture) -> None:
        """``AFTER_CAPTURE``: ``H.after_capture`` (the key is stored; an error here discards it)."""
        run.cap.outputs = (run.bound.spec, run.bound.views)
        run.call_hooks("after_capture", step="{} check")
        run.cap.info["checks_seconds"] = run.cap.check_seconds
        self._entries[run.key].capture_seconds = time.perf_counter() - run.t0  # the checks after the capture too

    def _end(self, run: KeyCapture) -> None:
        """``END`` after a capture that succeeded: ``H.end``."""
        self._capturing = None
        self._end_hooks(run.hooks, run.cap)
        logger.debug("%s: captured key %r on rank %d in %.3fs", self.name, run.key, self.rank, run.t_end - run.t0)

    def _fail(self, run: KeyCapture, exc: BaseException) -> NoReturn:
        """``END`` after a capture that failed with ``exc``: ``H.end``, the key discarded (:meth:`_abort`),
        and the error the caller needs raised: a ``RankTimeoutError`` found in ``exc``'s chain
        unchanged, ``exc`` itself when every rank raises it (``RanksDisagreeError``, the channel's
        ``AgreementError`` or ``RankFailedError``, or not an ``Exception``), a rank's collective that
        failed as a ``RankTimeoutError``, else a
        ``CaptureError`` naming the key, the rank and the step, with ``exc`` as its cause."""
        self._capturing = None
        run.bound.recorder = None
        self._end_hooks(run.hooks, run.cap)
        self._abort(run.key, run.graph)
        raise_capture_failure(exc, backend=self.name, rank=self.rank, group=self.group, step=run.step, key=run.key)

    def _end_hooks(self, hooks: Sequence[CaptureHook], cap: Capture) -> None:
        """Every hook's ``end`` (they drop references); an error there is logged, not raised:
        the capture's own outcome is what the caller needs."""
        cap.last_output = None
        for h in hooks:
            try:
                h.end(cap)
            except Exception:  # noqa: BLE001
                logger.exception("%s: the %s check's end() failed for key %r", self.name, h.name, cap.key)

    def _pool_bytes(self) -> int | None:
        """The bytes of the device's graph pool now: ``device.pool_bytes()`` (that pool alone), else
        ``device.memory_reserved()`` (a custom device's whole reserved memory), else None."""
        measure = getattr(self.device, "pool_bytes", None) or getattr(self.device, "memory_reserved", None)
        return int(measure()) if measure is not None else None

    # Each step of the protocol (graphrunner.backends.protocol.Step) is one
    # small method. Override one only to test what breaks without it; never
    # reorder them (the order lives in capture_one).
    def _sync(self, key: Any, phase: str) -> None:
        """Device synchronize, recorded as a ``synchronize`` span."""
        with self.trace.span(EventKind.SYNCHRONIZE, key=key, backend=self.name, phase=phase):
            self.device.synchronize()

    def _barrier(self, key: Any, phase: str) -> None:
        """Group barrier, recorded as a ``barrier`` span."""
        with self.trace.span(EventKind.BARRIER, key=key, backend=self.name, phase=phase):
            self.group.barrier(phase=phase, key=key)

    def _warmup_sync(self, key: Any, i: int) -> None:
        """``WARMUP_SYNC``: synchronize before warmup forward ``i``."""
        self._sync(key, "warmup")

    def _warmup_barrier(self, key: Any, i: int) -> None:
        """``WARMUP_BARRIER``: barrier before warmup forward ``i``."""
        self._barrier(key, "warmup")

    def _warmup_forward(self, key: Any, forward_fn: Callable[[], Any], i: int) -> Any:
        """``WARMUP_FORWARD``: warmup forward ``i`` (eager); returns its output."""
        with (
            self.trace.span(EventKind.WARMUP_FORWARD, key=key, backend=self.name, i=i, warmups=self.warmups),
            self._warmup_context(),
        ):
            return forward_fn()

    def _post_warmup_hook(self, key: Any, hook: Callable[[], Any], i: int) -> None:
        """``POST_WARMUP_HOOK``: the post-warmup hook after warmup forward ``i``."""
        with self.trace.span(EventKind.HOOK, key=key, backend=self.name, i=i), self._warmup_context():
            hook()

    def _warmup_context(self):
        """The device's warmup context (on CUDA: the capture stream), if it has one."""
        make = getattr(self.device, "warmup_context", None)
        return make() if make is not None else contextlib.nullcontext()

    def _final_sync(self, key: Any) -> None:
        """``FINAL_SYNC``: synchronize after the last warmup and its hook, so their
        asynchronous work (lazy kernel loading, hook side effects) cannot run
        into the capture."""
        self._sync(key, "pre_capture")

    def _final_barrier(self, key: Any) -> None:
        """``FINAL_BARRIER``: barrier after the final synchronize, so no rank starts
        capturing while another is still warming up."""
        self._barrier(key, "pre_capture")

    def _construct(self, key: Any) -> Any:
        """``GRAPH_CONSTRUCT``: make the graph (``graph_construct`` span)."""
        with self.trace.span(EventKind.GRAPH_CONSTRUCT, key=key, backend=self.name, warmups=self.warmups):
            return self._make_graph(key)

    def _capture_forward(self, key: Any, graph: Any, fn: Callable[[], None]) -> None:
        """``CAPTURE_FORWARD``: capture ``fn`` into ``graph`` once (``capture_forward`` span)."""
        with self.trace.span(EventKind.CAPTURE_FORWARD, key=key, backend=self.name):
            self._capture_into(graph, key, fn)

    def _after_warmups(self, key: Any, hook: CaptureHook, cap: Capture) -> None:
        """``AFTER_WARMUPS``: ``hook.after_warmups(cap)`` (a ``check`` span, when the hook has that step)."""
        if type(hook).after_warmups is CaptureHook.after_warmups:
            return
        with self.trace.span(EventKind.CHECK, key=key, backend=self.name, check=hook.name):
            hook.after_warmups(cap)

    def _recording_capture(self, recorder: Any) -> Any:
        """The context around the captured ``forward_fn()`` that feeds its ops
        to the hooks: the recorder itself, entered innermost (inside the
        device's capture, so a tape's own ops are not seen). A backend that
        installs the recorder's modes elsewhere returns ``recorder.recording()``."""
        return recorder

    def _abort(self, key: Any, graph: Any) -> None:
        """Clean up after a failed capture: reset the graph, and drop the
        output buffer if this key allocated it."""
        if graph is not None and hasattr(graph, "reset"):
            try:
                graph.reset()
            except Exception:  # noqa: BLE001 - the capture error is what the caller needs
                logger.exception("%s: reset of the graph for key %r failed after a capture error", self.name, key)
        if self._out.first_key == key and not self._entries:
            self._out.release()
        self._entries.pop(key, None)

    # ----------------------------------------------------- subclass hooks
    def _make_graph(self, key: Any) -> Any:
        """Return a new, empty graph for ``key`` (called only at ``GRAPH_CONSTRUCT``)."""
        raise NotImplementedError

    def _capture_into(self, graph: Any, key: Any, fn: Callable[[], None]) -> None:
        """Capture ``fn()`` into ``graph``, calling it exactly once."""
        raise NotImplementedError

    def _graph_stats(self, graph: Any) -> dict[str, int]:
        """``{"num_segments": n, "num_breaks": m}`` of a captured graph."""
        raise NotImplementedError

    # -------------------------------------------------------------- replay
    def can_run(self, key: Hashable) -> bool:
        """True if ``key`` was captured (and not cleaned up)."""
        try:
            return key in self._entries
        except TypeError:
            return False

    def keys(self) -> list[Hashable]:
        """The captured keys, in capture order."""
        return list(self._entries)

    def replay(self, key: Hashable) -> Any:
        """Replay ``key``'s graph and return its output pytree.

        The tensors returned are leading-rows views of the shared static
        output buffer: they are overwritten by the next replay of any key
        (clone to keep them). No device synchronize, no group call. Raises
        ``CaptureError`` for a key that was never captured.
        """
        entry = self._entry(key)
        self._replay_entry(entry)
        return unflatten(entry.spec, entry.views)

    def replayer(self, key: Hashable) -> tuple[Callable[[], None], Any]:
        """``(replay, outputs)`` of a captured key, for a caller that replays it many times:
        ``replay()`` does what :meth:`replay` does (debug hooks, trace span, the graph) without
        rebuilding the output pytree, and ``outputs`` is that pytree (the same views at every
        replay). Valid until :meth:`cleanup`."""
        entry = self._entry(key)
        graph = entry.graph
        if entry.replay_hooks or self.trace:
            return (lambda: self._replay_entry(entry)), unflatten(entry.spec, entry.views)
        return graph.replay, unflatten(entry.spec, entry.views)

    def _entry(self, key: Hashable) -> _Entry:
        try:
            return self._entries[key]
        except (KeyError, TypeError):
            raise CaptureError(
                f"replay of shape key {key!r}, which this {type(self).__name__} never captured "
                f"(captured: {list(self._entries)}); check can_run(key) first, or capture it"
            ) from None

    def _replay_entry(self, entry: _Entry) -> None:
        for h in entry.replay_hooks:  # debug-mode checks only; empty otherwise
            h.before_replay(entry.key)
        if self.trace:
            with self.trace.span(EventKind.REPLAY, key=entry.key, backend=self.name):
                entry.graph.replay()
        else:
            entry.graph.replay()

    @staticmethod
    def _hashable(key: Any) -> bool:
        try:
            hash(key)
            return True
        except TypeError:
            return False

    # --------------------------------------------------------------- info
    def info(self, key: Hashable) -> dict[str, Any]:
        """Report data for a captured key (raises ``KeyError`` otherwise):

        ``key``, ``backend``, ``rank``, ``capture_seconds`` (whole
        ``capture_one``: warmups + capture), ``warmup_seconds``,
        ``graph_capture_seconds`` (construction + capture only),
        ``checks_seconds`` (the capture hooks' share of ``capture_seconds``:
        :attr:`Capture.check_seconds <graphrunner.recording.hooks.Capture.check_seconds>`),
        ``num_segments``, ``num_breaks``, ``num_ops`` and ``num_collectives`` (tape graphs only: aten ops
        recorded, and the collectives among them), ``output_bytes`` (this key's views), ``output_buffer_bytes`` (the whole shared buffer, the same
        for every key: do not sum it over keys), ``capture_input_bytes``
        (distinct storages reachable from ``capture_inputs``),
        ``bytes_held`` = ``output_bytes + capture_input_bytes``, and, where the
        device measures its memory (``device.pool_bytes()``, else
        ``device.memory_reserved()``), ``graph_pool_bytes``: what the device's
        graph pool grew by around this key's graph construction and capture
        (not part of ``bytes_held``).
        """
        entry = self._entries.get(key) if self._hashable(key) else None
        if entry is None:
            raise KeyError(
                f"shape key {key!r} is not captured by this {type(self).__name__} (captured: {list(self._entries)})"
            )
        out_bytes = sum(v.numel() * v.element_size() for v in entry.views)
        d: dict[str, Any] = {
            "key": key,
            "backend": self.name,
            "rank": self.rank,
            "capture_seconds": entry.capture_seconds,
            "warmup_seconds": entry.warmup_seconds,
            "graph_capture_seconds": entry.graph_capture_seconds,
        }
        d.update(self._graph_stats(entry.graph))
        d.update(entry.extra)
        d.update(
            output_bytes=out_bytes,
            output_buffer_bytes=self._out.nbytes,
            capture_input_bytes=entry.capture_input_bytes,
            bytes_held=out_bytes + entry.capture_input_bytes,
        )
        return d

    # ------------------------------------------------------------- cleanup
    def cleanup(self) -> None:
        """Reset every graph and drop every key, the output buffer and the
        capture inputs. The backend can capture again afterwards."""
        if self._capturing is not None:
            raise CaptureError(f"cleanup() during the capture of shape key {self._capturing!r}")
        for entry in self._entries.values():
            if hasattr(entry.graph, "reset"):
                try:
                    entry.graph.reset()
                except Exception:  # noqa: BLE001
                    logger.exception("%s: graph.reset() failed for key %r during cleanup", self.name, entry.key)
        self._entries.clear()
        self._out.release()
        release_pool = getattr(self.device, "release_pool", None)
        in_use = getattr(self.device, "pool_in_use", None)
        if release_pool is not None and not (in_use is not None and in_use()):
            # a CUDA pool whose graphs were all reset cannot be captured into again; a pool that
            # another runner's graphs on the same device still hold is kept (and stays counted)
            release_pool()
