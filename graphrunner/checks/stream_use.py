"""Stream ownership at capture: side-stream work must be joined before it is used.

The third contract of SGLang's RFC #32432 (after metadata and workspace):
work forked onto a side stream (an all-to-all, a metadata copy, a prefetch)
inside the captured step or inside an eager break must be joined back to
the stream the graph runs on before anything reads what it wrote: before
the next graph segment that reads it, and before the capture ends. On a GPU
a missing join is a race that shows up as wrong tokens under load; here it
is refused at capture.

:class:`StreamCheck` is a capture hook. It watches the ops of the captured
forward through the one op recorder (:mod:`graphrunner.recording.ops`),
including the bodies of eager breaks (``eager_breaks = True``), and keeps
the books of who waited for whom in a
:class:`~graphrunner.tape.streams.StreamClocks`:

- on the tape, the tape's own clocks (:data:`graphrunner.tape.streams.CLOCKS`,
  kept by ``TapeStream.wait_stream``, events and ``synchronize``);
- on CUDA, clocks fed by ``torch.cuda._gpu_trace`` (event record / wait,
  stream, event and device synchronize), the hooks PyTorch's own CUDA
  sanitizer uses: no monkey-patching of ``torch.cuda.Stream``. The CUDA
  stand-in (:mod:`graphrunner.testing.cuda_standin`) fires the same hooks.

Each op is stamped with the stream it was issued on. Reading (or writing) a
tensor whose last write ran on another stream that the reader has not waited
for since is a hazard: :class:`~graphrunner.errors.CaptureError` naming the
reader and writer streams, the tensor (the runner input's name, or its
path from the step: ``model.layers.0.buf``, or its shape and dtype), and the
source lines of the write and of the read. After the capture, a side stream
whose writes the stream after capture never waited for is refused too
(nothing read them yet, but the next replay would race them).

Runs when ``"streams"`` is in ``GraphRunner(checks=...)`` and in debug mode
(``debug=True``), for the full and the breakable backend alike; on a
backend directly: ``hooks=[StreamCheck()]``. It costs a dictionary lookup
per tensor argument of each captured op, at capture only; replay is
untouched.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import torch
from torch.cuda import _gpu_trace as gt

from graphrunner._aten import storage_key, tensors_in
from graphrunner._frames import where as where_text
from graphrunner.checks.contracts import named_tensors
from graphrunner.checks.findings import finding_at
from graphrunner.errors import CaptureError
from graphrunner.recording.hooks import Capture, CaptureHook
from graphrunner.recording.ops import OpConsumer, OpEvent
from graphrunner.tape.streams import CLOCKS, StreamClocks, by_id, current_stream

__all__ = ["StreamCheck", "cuda_clocks"]

_JOIN = (
    "join the side stream back before the data is used: current_stream().wait_stream(side) right after "
    "the side-stream work (inside the eager break, so before the next graph segment), or record an event "
    "on the side stream after the work and wait on it"
)


# ----------------------------------------------------------------- ledgers
class _TapeLedger:
    """The tape's streams: :data:`CLOCKS` and the thread's current tape stream."""

    def __init__(self) -> None:
        self.clocks = CLOCKS

    @staticmethod
    def current() -> int:

        return current_stream().id

    @staticmethod
    def name(sid: int) -> str:

        s = by_id(sid)
        return repr(s) if s is not None else f"tape stream {sid}"

    def close(self) -> None:
        pass


_CUDA_LEDGERS: list[StreamClocks] = []
_CUDA_LOCK = threading.Lock()
_REGISTERED = False


def _each(method: str):
    def cb(*args: Any) -> None:
        for c in list(_CUDA_LEDGERS):
            getattr(c, method)(*args)

    return cb


def _register_trace() -> None:
    """Register the ``torch.cuda._gpu_trace`` callbacks once per process (they cannot be removed;
    they feed the clocks of the checks in progress, none when idle) and turn tracing on."""
    global _REGISTERED
    with _CUDA_LOCK:
        if _REGISTERED:
            return

        gt.register_callback_for_event_record(_each("record"))
        gt.register_callback_for_event_wait(_each("wait"))
        gt.register_callback_for_stream_synchronization(_each("sync_stream"))
        gt.register_callback_for_event_synchronization(_each("sync_event"))
        gt.register_callback_for_device_synchronization(_each("sync_device"))
        _REGISTERED = True
    standin = getattr(torch.cuda, "_graphrunner_standin", None)
    activate = getattr(torch._C, "_activate_gpu_trace", None)
    if standin is None and activate is not None and torch.cuda.is_available():
        activate()  # the C++ side calls the Python hooks from now on (what CUDA's sanitizer turns on)


def cuda_clocks() -> StreamClocks:
    """New :class:`~graphrunner.tape.streams.StreamClocks` fed by ``torch.cuda``'s stream and event
    calls (``torch.cuda._gpu_trace``) until :func:`_release` ``(clocks)``."""
    _register_trace()
    c = StreamClocks()
    with _CUDA_LOCK:
        _CUDA_LEDGERS.append(c)
    return c


def _release(c: StreamClocks) -> None:
    with _CUDA_LOCK:
        if c in _CUDA_LEDGERS:
            _CUDA_LEDGERS.remove(c)


class _CudaLedger:
    """``torch.cuda`` streams of one device, in debug mode: clocks fed by the GPU trace hooks."""

    def __init__(self, device: Any) -> None:
        self.device = getattr(device, "cuda_device", None)
        self.clocks = cuda_clocks()

    def current(self) -> int:
        return int(torch.cuda.current_stream(self.device).cuda_stream)

    @staticmethod
    def name(sid: int) -> str:
        return f"CUDA stream {sid:#x}" if sid > 0xFFFF else f"CUDA stream {sid}"

    def close(self) -> None:
        _release(self.clocks)


# ----------------------------------------------------------------- the check
class _Write:
    __slots__ = ("stream", "t", "where", "op", "desc", "brk", "reported")

    def __init__(self, stream: int, t: int, where: Any, op: str, desc: str, brk: Any) -> None:
        self.stream, self.t, self.where, self.op, self.desc, self.brk = stream, t, where, op, desc, brk
        self.reported = False


def _desc(t: torch.Tensor) -> str:
    return f"{tuple(t.shape)} {str(t.dtype).replace('torch.', '')}"


def _fn_name(fn: Any) -> str:
    return getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or repr(fn)


class _Watch(OpConsumer):
    """Stamps each op with its stream and checks every tensor it touches against the last write."""

    eager_breaks = True  # see the bodies of eager breaks too (RecordingDevice.eager_break_context)

    def __init__(self, check: StreamCheck, cap: Capture, ledger: Any) -> None:
        self.check, self.cap, self.ledger = check, cap, ledger
        self.writes: dict[int, _Write] = {}
        self.main = ledger.current()
        self.side: dict[int, _Write] = {}  # stream -> its last write (streams other than the main one)
        self._now = (self.main, 0)

    def before(self, ev: OpEvent) -> None:
        led = self.ledger
        s = led.current()
        t = led.clocks.note_op(s)
        clocks = led.clocks
        if self.writes:
            for v in list(ev.args) + list(ev.kwargs.values()):
                for x in tensors_in(v):
                    k = storage_key(x)
                    w = self.writes.get(k) if k is not None else None
                    if w is not None and w.stream != s and not w.reported and not clocks.knows(s, w.stream, w.t):
                        w.reported = True
                        self.check._hazard(self.cap, led, ev, x, w, s)
        self._now = (s, t)
        self._note(ev, ev.written, s, t)

    def after(self, ev: OpEvent) -> None:
        # what the op allocated is written by it, on its stream (a view of an input is not)
        if ev.out is None:
            return
        ins = {storage_key(x) for v in list(ev.args) + list(ev.kwargs.values()) for x in tensors_in(v)}
        fresh = [x for x in tensors_in(ev.out) if storage_key(x) not in ins]
        if fresh:
            self._note(ev, fresh, *self._now)

    def _note(self, ev: OpEvent, written: Sequence[torch.Tensor], s: int, t: int) -> None:
        if written:
            where, brk = ev.where, (ev.break_fn if ev.in_eager_break else None)
            for x in written:
                k = storage_key(x)
                if k is None:
                    continue
                w = self.writes[k] = _Write(s, t, where, ev.op, _desc(x), brk)
                if s != self.main:
                    self.side[s] = w


class StreamCheck(CaptureHook):
    """Refuses, at capture, a read of side-stream work that was not joined (see the module docstring).

    ``names``: ``{storage key: name}`` of the step's inputs (the runner passes
    its static inputs); ``step``: the user's step, whose modules and closure
    tensors name the rest (default: the forward the backend captures).
    """

    name = "streams"

    def __init__(self, names: dict[int, str] | None = None, step: Any = None) -> None:
        self.names = dict(names or {})
        self.step = step
        self._ledger: Any = None
        self._watch: _Watch | None = None
        self._paths: dict[int, str] | None = None

    def begin(self, cap: Capture) -> None:
        self._ledger = (
            _CudaLedger(cap.backend.device) if getattr(cap.backend.device, "kind", "") == "cuda" else _TapeLedger()
        )
        self._paths = None

    def capture_consumers(self, cap: Capture) -> Sequence[Any]:
        if self._ledger is None:
            self.begin(cap)
        self._watch = _Watch(self, cap, self._ledger)
        return (self._watch,)

    def after_capture(self, cap: Capture) -> None:
        watch, led = self._watch, self._ledger
        if watch is None:
            return
        now = led.current()
        for s, w in watch.side.items():
            if s != now and not w.reported and not led.clocks.knows(now, s, w.t):
                w.reported = True
                what = self._tensor(cap, None, w)
                msg = (
                    f"stream ownership: {led.name(s)} still runs unjoined work when the capture of shape key "
                    f"{cap.key!r} ends: its last write ({w.op} into {what} at {where_text(w.where)}"
                    f"{self._in_break(w.brk)}) was never waited for by {led.name(now)}, so the next replay, "
                    f"and whatever reads {what} after it, races that write. To fix: {_JOIN}."
                )
                cap.fail(CaptureError(msg), finding_at("stream-unjoined", msg, w.where, fix=_JOIN))

    def end(self, cap: Capture) -> None:
        if self._ledger is not None:
            self._ledger.close()
        self._ledger = self._watch = None
        self._paths = None

    # -- messages -------------------------------------------------------------
    @staticmethod
    def _in_break(fn: Any) -> str:
        return f", in eager break {_fn_name(fn)}" if fn is not None else ""

    def _tensor(self, cap: Capture, x: torch.Tensor | None, w: _Write) -> str:
        k = storage_key(x) if x is not None else None
        if k is None:
            k = next((key for key, ww in (self._watch.writes.items() if self._watch else ()) if ww is w), None)
        if k in self.names:
            return f"input {self.names[k]!r} ({w.desc})"
        if self._paths is None:
            self._paths = {}
            try:
                for path, _, t in named_tensors(self.step if self.step is not None else cap.forward_fn).values():
                    sk = storage_key(t)
                    if sk is not None:
                        self._paths.setdefault(sk, path)
            except Exception:  # noqa: BLE001 - naming is best effort; the hazard is reported anyway
                pass
        named = self._paths.get(k) if k is not None else None
        return f"{named} ({w.desc})" if named else f"a {w.desc} tensor"

    def _hazard(self, cap: Capture, led: Any, ev: OpEvent, x: torch.Tensor, w: _Write, reader: int) -> None:
        what = self._tensor(cap, x, w)
        place = (
            f"in eager break {_fn_name(ev.break_fn)}"
            if ev.in_eager_break
            else "in a graph segment"
            if cap.freezes is not None
            else "in the step"
        )
        verb = "writes" if any(storage_key(t) == storage_key(x) for t in ev.written) else "reads"
        msg = (
            f"stream ownership: {led.name(reader)} {verb} {what} ({ev.op} at {where_text(ev.where)}, {place}) "
            f"but its last write ({w.op} at {where_text(w.where)}{self._in_break(w.brk)}) ran on "
            f"{led.name(w.stream)}, with no join in between (wait_stream, or a wait on an event recorded after "
            f"the write), at the capture of shape key {cap.key!r}. On a GPU this read races the write and may "
            "see the value from before it (silent corruption under load; the tape shows that stale value when "
            f"this check is off). To fix: {_JOIN}."
        )
        cap.fail(CaptureError(msg), finding_at("stream-hazard", msg, ev.where, fix=_JOIN))
