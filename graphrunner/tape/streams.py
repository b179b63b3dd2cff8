"""Streams on the tape: CUDA's stream and event API, with its ordering rules, on a CPU.

A CPU runs every op when it is issued, so it cannot race two streams. What
it can do is keep the books CUDA keeps and show what an unjoined stream
would do to a reader:

* :class:`TapeStream` (``wait_stream``, ``wait_event``, ``record_event``,
  ``synchronize``, ``query``) and :class:`TapeEvent` (``record``, ``wait``,
  ``query``, ``synchronize``) mirror ``torch.cuda.Stream`` / ``Event``;
  :func:`stream` is ``torch.cuda.stream`` (the current stream is tracked per
  thread, :func:`current_stream`); :func:`default_stream` is the stream work
  runs on outside any ``stream(...)`` block.
* :data:`CLOCKS` (a :class:`StreamClocks`) holds one vector clock per stream:
  what each stream has waited for (``wait_stream``, an event wait) and what
  the host knows is finished (``synchronize``). ``CLOCKS.knows(reader,
  writer, t)`` answers "is work number ``t`` of ``writer`` ordered before
  work issued on ``reader`` now": the question every hazard check asks
  (:mod:`graphrunner.checks.stream_use`). The same class keeps the books of
  ``torch.cuda`` streams in debug mode.
* **Deferred side-stream writes** (the emulation of an unjoined stream).
  Outside a tape capture, what an op on a non-default stream writes into
  memory that existed before it is invisible to every other stream until
  someone joins that stream (``wait_stream``, waiting on an event recorded
  after the write, ``synchronize`` of the stream, of the event or of the
  device): the schedule where the side stream runs as late as CUDA allows.
  The op runs at once (its stream sees its own writes); when the thread
  leaves the stream (the ``stream(...)`` block ends) the bytes it changed are
  put aside and the memory gets back what the other streams see; a join
  writes them back. A reader on another stream with no join in between
  therefore reads the value from *before* the side-stream write, as it may
  on a GPU. Bookkeeping is per storage: a join writes back every byte the
  side stream changed up to the join, and a storage written again after the
  event that was waited on stays deferred as a whole. Memory the side
  stream allocated itself reads as it was allocated (uninitialised on a
  GPU). Inside a tape capture nothing is deferred: the graph records ops in
  the order they were issued, and :class:`~graphrunner.tape.TapeGraph`
  refuses, as CUDA does (``cudaErrorStreamCaptureUnjoined``), a stream
  forked from the capture stream that is not joined back by capture end.

Streams cost nothing until one is entered: the default stream installs no
dispatch mode; a non-default stream installs one while it is current.
"""

from __future__ import annotations

import contextlib
import itertools
import sys
import threading
import weakref
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from graphrunner._aten import written_tensors
from graphrunner._frames import user_frame
from graphrunner._frames import where as where_text
from graphrunner.errors import CaptureError

from .state import capture_here, storage_bytes, storage_of

__all__ = [
    "TapeStream",
    "TapeEvent",
    "StreamClocks",
    "CLOCKS",
    "current_stream",
    "default_stream",
    "stream",
    "synchronize",
    "set_stream",
]


class StreamClocks:
    """Vector clocks over streams: who has waited for whose work.

    Streams and events are named by ints (a :class:`TapeStream`'s ``id``;
    for ``torch.cuda`` the ``cuda_stream`` handle and the event handle that
    ``torch.cuda._gpu_trace`` reports). Work issued on stream ``s`` now gets
    the time :meth:`now` ``(s)``; recording an event on ``s`` closes that
    time (later work gets a later one) and snapshots ``s``'s clock; waiting on
    the event merges the snapshot into the waiter's clock; synchronizing puts
    the stream's (event's) clock into the host's, which every stream's later
    work is ordered after. Thread-safe.
    """

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._v: dict[int, dict[int, int]] = {}
        self._host: dict[int, int] = {}
        self._events: dict[int, dict[int, int]] = {}
        self._event_stream: dict[int, int] = {}
        #: stream -> time of the last op noted on it (:meth:`note_op`).
        self.last_op: dict[int, int] = {}
        self._tmp = itertools.count(-1, -1)  # private event ids for wait_stream

    def _vec(self, s: int) -> dict[int, int]:
        v = self._v.get(s)
        if v is None:
            v = self._v[s] = {s: 0}
        return v

    @staticmethod
    def _merge(into: dict[int, int], other: dict[int, int]) -> None:
        for k, t in other.items():
            if into.get(k, 0) < t:
                into[k] = t

    def now(self, s: int) -> int:
        """The time of work issued on stream ``s`` now."""
        with self._lock:
            return self._vec(s).get(s, 0) + 1

    def note_op(self, s: int) -> int:
        """Note work issued on ``s`` now; return its time."""
        with self._lock:
            t = self._vec(s).get(s, 0) + 1
            self.last_op[s] = t
            return t

    def record(self, event: int, s: int) -> dict[int, int]:
        """Event ``event`` recorded on stream ``s``; returns its clock."""
        with self._lock:
            v = self._vec(s)
            v[s] = v.get(s, 0) + 1
            snap = dict(v)
            self._events[event] = snap
            self._event_stream[event] = s
            return snap

    def wait(self, event: int, s: int) -> None:
        """Stream ``s`` waits on ``event`` (a never-recorded event waits for nothing, as on CUDA)."""
        with self._lock:
            snap = self._events.get(event)
            if snap is not None:
                self._merge(self._vec(s), snap)

    def wait_stream(self, waiter: int, source: int) -> None:
        """``waiter.wait_stream(source)``: an event recorded on ``source``, waited on by ``waiter``."""
        if waiter == source:
            return
        with self._lock:
            e = next(self._tmp)
            self.record(e, source)
            self.wait(e, waiter)
            self._events.pop(e, None)
            self._event_stream.pop(e, None)

    def sync_stream(self, s: int) -> None:
        """The host waited for all work issued on ``s``."""
        with self._lock:
            v = self._vec(s)
            v[s] = v.get(s, 0) + 1
            self._merge(self._host, v)

    def sync_event(self, event: int) -> None:
        """The host waited for ``event``."""
        with self._lock:
            snap = self._events.get(event)
            if snap is not None:
                self._merge(self._host, snap)

    def sync_device(self) -> None:
        """The host waited for every stream."""
        with self._lock:
            for s in list(self._v):
                self.sync_stream(s)

    def forget_event(self, event: int) -> None:
        with self._lock:
            self._events.pop(event, None)
            self._event_stream.pop(event, None)

    def event_time(self, event: int) -> tuple[int, int] | None:
        """``(stream, time)`` the event was last recorded at, or None."""
        with self._lock:
            s = self._event_stream.get(event)
            return None if s is None else (s, self._events[event].get(s, 0))

    def knows(self, reader: int, writer: int, t: int) -> bool:
        """True if work at time ``t`` on ``writer`` is ordered before work issued on ``reader`` now."""
        if reader == writer:
            return True
        with self._lock:
            return max(self._vec(reader).get(writer, 0), self._host.get(writer, 0)) >= t

    def known(self, writer: int) -> int:
        """The latest time of ``writer`` that some other stream, or the host, has waited for."""
        with self._lock:
            best = self._host.get(writer, 0)
            for s, v in self._v.items():
                if s != writer:
                    best = max(best, v.get(writer, 0))
            return best

    def clock(self, s: int) -> dict[int, int]:
        """A copy of stream ``s``'s clock."""
        with self._lock:
            return dict(self._vec(s))


#: The books of every tape stream in this process.
CLOCKS = StreamClocks()

_ids = itertools.count(1)
_ALL: weakref.WeakValueDictionary[int, TapeStream] = weakref.WeakValueDictionary()
_event_ids = itertools.count(1)
_local = threading.local()
_LOCK = threading.RLock()


class _Pending:
    """What one stream wrote into one storage that the other streams do not see yet."""

    __slots__ = ("st", "outside", "mask", "vals", "t")

    def __init__(self, st: Any) -> None:
        self.st = st
        self.outside: torch.Tensor | None = None  # while the stream is current: what the others see
        self.mask: torch.Tensor | None = None  # bytes the stream changed
        self.vals: torch.Tensor | None = None  # their values (set with mask)
        self.t = 0  # time of the stream's last write into it


def _bytes(st: Any) -> torch.Tensor:
    return storage_bytes(st)


class TapeStream:
    """A stream of the tape device: ``torch.cuda.Stream``'s API.

    Work runs when it is issued (sequentially); the ordering rules are kept
    in :data:`CLOCKS`, and the writes of a non-default stream stay invisible
    to other streams until it is joined (see the module docstring).
    ``priority`` is accepted for parity and ignored; ``name`` labels it in
    messages.
    """

    def __init__(
        self, device: Any = None, priority: int = 0, name: str | None = None, *, _default: bool = False
    ) -> None:
        self.id = 0 if _default else next(_ids)
        self.priority = int(priority)
        self.name = name
        self.is_default = _default
        self._pending: dict[int, _Pending] = {}
        self._active = 0  # threads in which this stream is current
        self._first: tuple[int, Any] | None = None  # (time, user frame) of the first unjoined op
        _ALL[self.id] = self

    @property
    def stream_id(self) -> int:
        """The stream's number (0: the default stream)."""
        return self.id

    cuda_stream = stream_id

    def __repr__(self) -> str:
        label = "default " if self.is_default else ""
        extra = f" {self.name!r}" if self.name else ""
        return f"<TapeStream {label}{self.id}{extra}>"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, TapeStream) and other.id == self.id

    def __hash__(self) -> int:
        return hash(("tape-stream", self.id))

    def wait_stream(self, stream: TapeStream) -> None:
        """Work issued on this stream from now on waits for all work issued on ``stream`` so far."""
        if not isinstance(stream, TapeStream):
            raise TypeError(f"wait_stream expects a TapeStream (from the tape device), got {type(stream).__name__}")
        self.wait_event(stream.record_event())

    def wait_event(self, event: TapeEvent) -> None:
        """Work issued on this stream from now on waits for ``event``."""
        event.wait(self)

    def record_event(self, event: TapeEvent | None = None) -> TapeEvent:
        """Record ``event`` (default: a new one) on this stream and return it."""
        event = event if event is not None else TapeEvent()
        event.record(self)
        return event

    def synchronize(self) -> None:
        """Wait (host) for all work issued on this stream: its deferred writes land."""
        CLOCKS.sync_stream(self.id)
        _land()

    def query(self) -> bool:
        """True if all work issued on this stream has completed (False while writes are deferred)."""
        return not self._pending

    # -- deferral ----------------------------------------------------------
    def _note(self, t: int, written: list[torch.Tensor]) -> None:
        if self._first is None or self._first[0] <= CLOCKS.known(self.id):
            self._first = (t, _user_where())
        for w in written:
            st = storage_of(w)
            if st is None or st.nbytes() == 0:
                continue
            k = id(st)
            e = self._pending.get(k)
            if e is None:
                e = self._pending[k] = _Pending(st)
            if e.outside is None:
                e.outside = _bytes(st).clone()
            e.t = t

    def _swap_out(self) -> None:
        for k, e in list(self._pending.items()):
            if e.outside is None:
                continue
            cur = _bytes(e.st)
            if cur.numel() != e.outside.numel():  # resized meanwhile: give up deferring it
                del self._pending[k]
                continue
            # bytes the stream changed: this time, or before (swapped in at entry, maybe changed since)
            changed = cur != e.outside
            e.mask = changed if e.mask is None else (e.mask | changed)
            e.vals = cur.clone()
            cur.copy_(e.outside)
            e.outside = None
            if not bool(e.mask.any()):
                del self._pending[k]

    def _swap_in(self) -> None:
        for e in self._pending.values():
            cur = _bytes(e.st)
            e.outside = cur.clone()
            if e.mask is not None and e.vals is not None and cur.numel() == e.mask.numel():
                cur.copy_(torch.where(e.mask, e.vals, cur))

    def _land(self, upto: int) -> None:
        for k, e in list(self._pending.items()):
            if e.t > upto:
                continue
            if e.outside is None and e.mask is not None and e.vals is not None:  # not current anywhere: write back
                cur = _bytes(e.st)
                if cur.numel() == e.mask.numel():
                    cur.copy_(torch.where(e.mask, e.vals, cur))
            # current somewhere: the memory already holds its writes; the others now see them
            del self._pending[k]


class TapeEvent:
    """An event of the tape device: ``torch.cuda.Event``'s API (timing flags accepted, ignored)."""

    def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False) -> None:
        self.id = next(_event_ids)
        self.stream: TapeStream | None = None
        self.enable_timing = enable_timing

    def __repr__(self) -> str:
        where = f" on {self.stream!r}" if self.stream is not None else " (not recorded)"
        return f"<TapeEvent {self.id}{where}>"

    def record(self, stream: TapeStream | None = None) -> None:
        """Record the work issued on ``stream`` (default: the current stream) so far."""
        stream = stream if stream is not None else current_stream()
        CLOCKS.record(self.id, stream.id)
        self.stream = stream

    def wait(self, stream: TapeStream | None = None) -> None:
        """Work issued on ``stream`` (default: the current stream) from now on waits for this event."""
        stream = stream if stream is not None else current_stream()
        CLOCKS.wait(self.id, stream.id)
        _land()

    def query(self) -> bool:
        """True if the work recorded has completed (False while any of it is deferred)."""
        at = CLOCKS.event_time(self.id)
        if at is None or self.stream is None:
            return True
        return not any(e.t <= at[1] for e in self.stream._pending.values())

    def synchronize(self) -> None:
        """Wait (host) for the recorded work."""
        CLOCKS.sync_event(self.id)
        _land()

    def __del__(self) -> None:
        try:
            CLOCKS.forget_event(self.id)
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass


_DEFAULT = TapeStream(_default=True)
_STREAMS: dict[int, TapeStream] = {}  # streams with deferred writes, by id (strong while pending)


def default_stream(device: Any = None) -> TapeStream:
    """The stream work runs on outside any :func:`stream` block."""
    return _DEFAULT


def _stack() -> list[TapeStream]:
    s = getattr(_local, "stack", None)
    if s is None:
        s = _local.stack = []
    return s


def current_stream(device: Any = None) -> TapeStream:
    """The current stream of the calling thread."""
    s = getattr(_local, "stack", None)
    return s[-1] if s else _DEFAULT


def _user_where() -> Any:

    return user_frame(sys._getframe(2))


def _land() -> None:
    """Write back every deferred write some stream (or the host) has now waited for."""
    with _LOCK, _disable_current_modes(), torch.inference_mode():
        for sid, s in list(_STREAMS.items()):
            s._land(CLOCKS.known(sid))
            if not s._pending:
                _STREAMS.pop(sid, None)


def by_id(sid: int) -> TapeStream | None:
    """The live stream numbered ``sid``, or None."""
    return _DEFAULT if sid == 0 else _ALL.get(sid)


def unjoined_forks(
    capture_stream: TapeStream | int, t0: int, last_before: dict[int, int], clocks: StreamClocks | None = None
) -> list[tuple[int, Any]]:
    """``(stream id, user frame of its first unjoined op)`` of every stream forked from
    ``capture_stream`` since its time ``t0`` (it waited on it) that did work after ``last_before``
    (:attr:`StreamClocks.last_op` then) which the capture stream has not waited for
    (``clocks``: default :data:`CLOCKS`)."""
    clocks = clocks if clocks is not None else CLOCKS
    c = capture_stream if isinstance(capture_stream, int) else capture_stream.id
    out = []
    for sid, t in list(clocks.last_op.items()):
        if sid == c or last_before.get(sid) == t:
            continue
        if clocks.clock(sid).get(c, 0) < t0 or clocks.knows(c, sid, t):
            continue
        s = by_id(sid)
        out.append((sid, s._first[1] if s is not None and s._first is not None else None))
    return out


def unjoined_error(capture_stream: TapeStream, t0: int, last_before: dict[int, int]) -> Exception | None:
    """The :class:`~graphrunner.errors.CaptureError` a capture on ``capture_stream`` ends with when a
    stream forked from it was not joined back (CUDA's ``cudaErrorStreamCaptureUnjoined``), or None."""
    bad = unjoined_forks(capture_stream, t0, last_before)
    if not bad:
        return None

    sid, loc = bad[0]
    s = by_id(sid)
    name = repr(s) if s is not None else f"stream {sid}"
    return CaptureError(
        f"a side stream was not joined: side stream {name} (id {sid}) waited on the capture stream "
        f"{capture_stream!r} during the capture (a fork) and then ran work (first at {where_text(loc)}) that the "
        "capture stream never waited for, so the capture cannot end (CUDA: cudaErrorStreamCaptureUnjoined). Join "
        "it before the capture ends or the graph segment is cut by an eager break: "
        "current_stream().wait_stream(side) right after the side-stream work (or record an event on the side "
        f"stream and wait on it). Unjoined side-stream id(s): {[b[0] for b in bad]}"
    )


def synchronize() -> None:
    """Wait (host) for every stream: all deferred writes land."""
    CLOCKS.sync_device()
    _land()


class _SideMode(TorchDispatchMode):
    """Installed while a non-default stream is current: notes its ops and defers its writes."""

    def __init__(self, s: TapeStream) -> None:
        super().__init__()
        self.s = s

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        s = self.s
        if current_stream() is not s:
            return func(*args, **kwargs)
        t = CLOCKS.note_op(s.id)
        if capture_here() is None:  # a capture records in issue order instead (see the module docstring)
            written = written_tensors(func, args, kwargs)
            with _LOCK, _disable_current_modes(), torch.inference_mode():
                s._note(t, written)
                if s._pending:
                    _STREAMS[s.id] = s
        elif s._first is None or s._first[0] <= CLOCKS.known(s.id):
            s._first = (t, _user_where())
        return func(*args, **kwargs)


def _leave(s: TapeStream) -> None:
    if s.is_default:
        return
    with _LOCK:
        s._active -= 1
        if s._active == 0 and s._pending:
            with _disable_current_modes(), torch.inference_mode():
                s._swap_out()


def _enter(s: TapeStream) -> None:
    if s.is_default:
        return
    with _LOCK:
        if s._active == 0 and s._pending:
            with _disable_current_modes(), torch.inference_mode():
                s._swap_in()
        s._active += 1


class _StreamContext:
    """``with stream(s):`` (``torch.cuda.stream``): ``s`` is the current stream of this thread in the block."""

    def __init__(self, s: TapeStream | None) -> None:
        if s is not None and not isinstance(s, TapeStream):
            raise TypeError(f"stream() expects a TapeStream (device.new_stream()) or None, got {type(s).__name__}")
        self.s = s
        self.mode: _SideMode | None = None

    def __enter__(self) -> TapeStream | None:
        s = self.s
        if s is None:
            return None
        prev = current_stream()
        _stack().append(s)
        if s is not prev:
            _leave(prev)
            _enter(s)
        if not s.is_default:
            self.mode = _SideMode(s)
            self.mode.__enter__()
        return s

    def __exit__(self, *exc: Any) -> None:
        s = self.s
        if s is None:
            return
        try:
            if self.mode is not None:
                self.mode.__exit__(*exc)
                self.mode = None
        finally:
            stack = _stack()
            stack.pop()
            now = current_stream()
            if s is not now:
                _leave(s)
                _enter(now)


def stream(s: TapeStream | None) -> _StreamContext:
    """Context manager: make ``s`` the current stream of this thread (``None``: a no-op), as
    ``torch.cuda.stream`` does."""
    return _StreamContext(s)


@contextlib.contextmanager
def set_stream(s: TapeStream) -> Iterator[TapeStream]:
    """:func:`stream` as a generator context (for callers that want ``contextlib`` semantics)."""
    with stream(s):
        yield s
