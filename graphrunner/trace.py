"""Structured events from every layer, and their export.

A :class:`Trace` is a list of :class:`Event` spans. Every layer that is handed
a trace records what it does: the backends record the capture protocol
(``session_begin``/``session_end``, ``warmup_forward``, ``hook``,
``synchronize``, ``barrier``, ``graph_construct``, ``capture_forward``,
``replay``); a ``BreakableGraph`` records ``segment_begin``/``segment_end``
and ``eager_break``. Times come from :func:`time.monotonic_ns`, which on Linux
is one system-wide clock, so traces written by different processes on one
machine can be merged (:meth:`Trace.merge`) and compared.

:func:`graphrunner.backends.protocol.check_capture_order` (beside the
protocol it checks) reads a (possibly merged) trace and returns the list of
violations of the capture protocol; an empty list means it held.

Export: :meth:`Trace.to_jsonl` (one JSON object per event, reload with
:meth:`Trace.from_jsonl`) and :meth:`Trace.to_chrome` (Chrome trace-event
format; open in https://ui.perfetto.dev or ``chrome://tracing``; one process
per rank, one thread per layer). See ``docs/protocol.md``.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "EventKind",
    "Event",
    "Trace",
    "NullTrace",
    "NULL_TRACE",
    "as_trace",
    "layer_of",
    "DEFAULT_MAX_REPLAY_EVENTS",
]


class EventKind:
    """The event kinds (plain ``str`` constants) every layer records.

    Backend layer: ``SESSION_BEGIN``, ``SESSION_END``, ``WARMUP_FORWARD``,
    ``HOOK``, ``CHECK`` (a capture hook's work after the warmups, e.g. the
    padding check's extra forward; ``data["check"]`` names it), ``GRAPH_CONSTRUCT``, ``CAPTURE_FORWARD``, ``REPLAY``. Device
    layer: ``SYNCHRONIZE``. Group layer: ``BARRIER`` (also used for the
    barrier before each eager break during a breakable capture; those carry
    ``data["phase"] == "capture_break"``). Breakable-graph layer:
    ``SEGMENT_BEGIN``, ``SEGMENT_END``, ``EAGER_BREAK``.
    """

    SESSION_BEGIN = "session_begin"
    SESSION_END = "session_end"
    WARMUP_FORWARD = "warmup_forward"
    HOOK = "hook"
    CHECK = "check"
    SYNCHRONIZE = "synchronize"
    BARRIER = "barrier"
    GRAPH_CONSTRUCT = "graph_construct"
    CAPTURE_FORWARD = "capture_forward"
    SEGMENT_BEGIN = "segment_begin"
    SEGMENT_END = "segment_end"
    EAGER_BREAK = "eager_break"
    REPLAY = "replay"

    ALL = (
        SESSION_BEGIN,
        SESSION_END,
        WARMUP_FORWARD,
        HOOK,
        CHECK,
        SYNCHRONIZE,
        BARRIER,
        GRAPH_CONSTRUCT,
        CAPTURE_FORWARD,
        SEGMENT_BEGIN,
        SEGMENT_END,
        EAGER_BREAK,
        REPLAY,
    )


_LAYER = {
    EventKind.SYNCHRONIZE: "device",
    EventKind.BARRIER: "group",
    EventKind.SEGMENT_BEGIN: "breakable",
    EventKind.SEGMENT_END: "breakable",
    EventKind.EAGER_BREAK: "breakable",
}
_LAYER_TID = {"backend": 1, "device": 2, "group": 3, "breakable": 4, "runner": 5, "other": 9}


def layer_of(event: Event) -> str:
    """The layer an event belongs to: ``data["layer"]`` if set, else derived
    from its kind (``backend``, ``device``, ``group`` or ``breakable``)."""
    layer = event.data.get("layer") if event.data else None
    return str(layer) if layer else _LAYER.get(event.kind, "backend")


_SEQ = itertools.count()


@dataclass
class Event:
    """One recorded span (an instant event has ``t_end_ns == t_begin_ns``).

    Fields: ``kind`` (an :class:`EventKind` string), ``key`` (the shape key or
    ``None``), ``rank``, ``backend`` (the recording backend's name, or
    ``None``), ``t_begin_ns``/``t_end_ns`` (:func:`time.monotonic_ns`;
    ``t_end_ns`` is ``None`` while the span is open), ``data`` (JSON-able
    extras: ``phase``, ``i``, ``warmups``, ``error`` when the span raised, ...)
    and ``seq`` (a process-wide counter that orders events with equal begin
    times; only meaningful within one process).
    """

    kind: str
    key: Any = None
    rank: int = 0
    backend: str | None = None
    t_begin_ns: int = 0
    t_end_ns: int | None = None
    data: dict[str, Any] = field(default_factory=dict)
    seq: int = field(default_factory=lambda: next(_SEQ))

    @property
    def end(self) -> int:
        """``t_end_ns``, or ``t_begin_ns`` for a span that never closed."""
        return self.t_end_ns if self.t_end_ns is not None else self.t_begin_ns

    def to_dict(self) -> dict[str, Any]:
        """The JSONL record of this event (see ``docs/protocol.md``)."""
        return {
            "kind": self.kind,
            "key": jsonable(self.key),
            "rank": self.rank,
            "backend": self.backend,
            "t_begin_ns": self.t_begin_ns,
            "t_end_ns": self.t_end_ns,
            "seq": self.seq,
            "layer": layer_of(self),
            "data": {k: jsonable(v) for k, v in (self.data or {}).items()},
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Event:
        """Inverse of :meth:`to_dict`; JSON lists in ``key`` become tuples."""
        return cls(
            kind=d["kind"],
            key=_unjson_key(d.get("key")),
            rank=int(d.get("rank", 0)),
            backend=d.get("backend"),
            t_begin_ns=int(d["t_begin_ns"]),
            t_end_ns=None if d.get("t_end_ns") is None else int(d["t_end_ns"]),
            data=dict(d.get("data") or {}),
            seq=int(d.get("seq", 0)),
        )


def jsonable(v: Any) -> Any:
    """``v`` as JSON-ready data: scalars as they are, lists/tuples/dicts
    recursively (dict keys as strings), anything else as its ``repr``."""
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    if isinstance(v, (list, tuple)):
        return [jsonable(x) for x in v]
    if isinstance(v, dict):
        return {str(k): jsonable(x) for k, x in v.items()}
    return repr(v)


def _unjson_key(v: Any) -> Any:
    if isinstance(v, list):
        return tuple(_unjson_key(x) for x in v)
    return v


#: Replay events a :class:`Trace` keeps by default (the most recent ones).
DEFAULT_MAX_REPLAY_EVENTS = 10_000


class Trace:
    """A thread-safe list of :class:`Event` spans recorded by one process.

    Args:
        rank: the rank stamped on events recorded without an explicit ``rank``.
        max_replay_events: how many ``replay`` events to keep (the most
            recent; default :data:`DEFAULT_MAX_REPLAY_EVENTS`), so a trace
            attached to a long-running server stays bounded. Every other
            event (the whole capture protocol) is always kept.
            ``replays_recorded`` counts every replay and
            ``replay_events_dropped`` those no longer in ``events``.
            ``None`` keeps everything.

    ``record(kind, ...)`` adds an instant event; ``span(kind, ...)`` is a
    context manager that adds the event when entered (so ``events`` is in
    begin order) and sets ``t_end_ns`` when left, also on an exception (then
    ``data["error"]`` names it). ``bool(trace)`` is ``True`` (a
    :class:`NullTrace` is falsy), so layers may write ``if trace:``.
    """

    enabled = True

    def __init__(self, rank: int = 0, max_replay_events: int | None = DEFAULT_MAX_REPLAY_EVENTS):
        if max_replay_events is not None and int(max_replay_events) < 0:
            raise ValueError(f"max_replay_events must be >= 0 or None, got {max_replay_events}")
        self.rank = int(rank)
        self.events: list[Event] = []
        self.max_replay_events = None if max_replay_events is None else int(max_replay_events)
        self.replays_recorded = 0
        self.replay_events_dropped = 0
        self._replays_kept = 0
        self._lock = threading.Lock()

    def __bool__(self) -> bool:
        return True

    def __len__(self) -> int:
        return len(self.events)

    def __repr__(self) -> str:
        dropped = f", replay_events_dropped={self.replay_events_dropped}" if self.replay_events_dropped else ""
        return f"Trace(rank={self.rank}, events={len(self.events)}{dropped})"

    def _new(self, kind: str, key: Any, backend: str | None, rank: int | None, data: dict[str, Any]) -> Event:
        ev = Event(
            kind=kind,
            key=key,
            rank=self.rank if rank is None else int(rank),
            backend=backend,
            t_begin_ns=time.monotonic_ns(),
            data=data,
        )
        with self._lock:
            self.events.append(ev)
            if kind == EventKind.REPLAY:
                self.replays_recorded += 1
                self._replays_kept += 1
                bound = self.max_replay_events
                if bound is not None and self._replays_kept > 2 * bound + 64:
                    self._drop_old_replays(bound)
        return ev

    def _drop_old_replays(self, keep: int) -> None:
        """Drop all but the last ``keep`` replay events (caller holds the lock).
        Runs once per ``keep + 64`` replays or more, so recording stays O(1)
        amortized."""
        replays = sum(1 for e in self.events if e.kind == EventKind.REPLAY)
        drop = replays - keep
        if drop <= 0:
            self._replays_kept = replays
            return
        kept: list[Event] = []
        for e in self.events:
            if e.kind == EventKind.REPLAY and drop > 0:
                drop -= 1
                self.replay_events_dropped += 1
                continue
            kept.append(e)
        self.events[:] = kept
        self._replays_kept = keep

    def record(
        self, kind: str, key: Any = None, backend: str | None = None, rank: int | None = None, **data: Any
    ) -> Event:
        """Record an instant event of ``kind`` now and return it."""
        ev = self._new(kind, key, backend, rank, data)
        ev.t_end_ns = ev.t_begin_ns
        return ev

    @contextlib.contextmanager
    def span(
        self, kind: str, key: Any = None, backend: str | None = None, rank: int | None = None, **data: Any
    ) -> Iterator[Event]:
        """Record a span of ``kind`` around the ``with`` body; yields the
        :class:`Event` (``t_begin_ns`` set on entry, ``t_end_ns`` on exit)."""
        ev = self._new(kind, key, backend, rank, data)
        try:
            yield ev
        except BaseException as exc:
            ev.data["error"] = f"{type(exc).__name__}: {exc}"[:300]
            raise
        finally:
            ev.t_end_ns = time.monotonic_ns()

    def of(self, kind: str | None = None, key: Any = ..., rank: int | None = None) -> list[Event]:
        """Events filtered by ``kind``, ``key`` (``...`` = any) and ``rank``."""
        return [
            e
            for e in self.events
            if (kind is None or e.kind == kind) and (key is ... or e.key == key) and (rank is None or e.rank == rank)
        ]

    def clear(self) -> None:
        """Drop every recorded event."""
        with self._lock:
            self.events.clear()
            self.replays_recorded = self.replay_events_dropped = self._replays_kept = 0

    # ---------------------------------------------------------------- export
    def to_jsonl(self, path: str) -> None:
        """Write one JSON object per event to ``path`` (fields: ``kind``,
        ``key``, ``rank``, ``backend``, ``t_begin_ns``, ``t_end_ns``, ``seq``,
        ``layer``, ``data``)."""
        with open(path, "w", encoding="utf-8") as f:
            for ev in list(self.events):
                f.write(json.dumps(ev.to_dict()) + "\n")

    @classmethod
    def from_jsonl(cls, path: str) -> Trace:
        """Load a trace written by :meth:`to_jsonl` (its rank is that of the
        first event, or 0)."""
        events = []
        with open(path, encoding="utf-8") as f:
            for line in f:
                line = line.strip()
                if line:
                    events.append(Event.from_dict(json.loads(line)))
        t = cls(rank=events[0].rank if events else 0, max_replay_events=None)
        t.events = events
        return t

    def to_chrome_dict(self) -> dict[str, Any]:
        """The Chrome trace-event JSON object (``{"traceEvents": [...]}``):
        complete events (``ph="X"``, ``ts``/``dur`` in microseconds since the
        first event) with ``pid`` = rank and ``tid`` = layer, plus metadata
        events naming each process ``rank N`` and each thread by its layer."""
        events = sorted(self.events, key=lambda e: (e.t_begin_ns, e.seq))
        t0 = events[0].t_begin_ns if events else 0
        out: list[dict[str, Any]] = []
        seen_pid = set()
        seen_tid = set()
        for ev in events:
            layer = layer_of(ev)
            tid = _LAYER_TID.get(layer, _LAYER_TID["other"])
            if ev.rank not in seen_pid:
                seen_pid.add(ev.rank)
                out.append(
                    {"name": "process_name", "ph": "M", "pid": ev.rank, "tid": 0, "args": {"name": f"rank {ev.rank}"}}
                )
                out.append(
                    {"name": "process_sort_index", "ph": "M", "pid": ev.rank, "tid": 0, "args": {"sort_index": ev.rank}}
                )
            if (ev.rank, tid) not in seen_tid:
                seen_tid.add((ev.rank, tid))
                out.append({"name": "thread_name", "ph": "M", "pid": ev.rank, "tid": tid, "args": {"name": layer}})
            args = {"key": jsonable(ev.key), "backend": ev.backend}
            args.update({k: jsonable(v) for k, v in (ev.data or {}).items()})
            name = ev.kind if ev.key is None else f"{ev.kind} {jsonable(ev.key)}"
            out.append(
                {
                    "name": name,
                    "cat": ev.kind,
                    "ph": "X",
                    "ts": (ev.t_begin_ns - t0) / 1000.0,
                    "dur": max(ev.end - ev.t_begin_ns, 0) / 1000.0,
                    "pid": ev.rank,
                    "tid": tid,
                    "args": args,
                }
            )
        return {"traceEvents": out, "displayTimeUnit": "ms", "otherData": {"clock": "time.monotonic_ns", "t0_ns": t0}}

    def to_chrome(self, path: str) -> None:
        """Write :meth:`to_chrome_dict` as JSON to ``path`` (open it in
        https://ui.perfetto.dev or ``chrome://tracing``)."""
        with open(path, "w", encoding="utf-8") as f:
            json.dump(self.to_chrome_dict(), f)

    @staticmethod
    def merge(traces: Iterable[Trace]) -> Trace:
        """One trace holding every event of ``traces`` (e.g. one per rank,
        loaded with :meth:`from_jsonl`), sorted by begin time. Events keep
        their own ``rank``."""
        traces = list(traces)
        merged = Trace(rank=traces[0].rank if traces else 0, max_replay_events=None)
        events = [e for t in traces for e in t.events]
        events.sort(key=lambda e: (e.t_begin_ns, e.rank, e.seq))
        merged.events = events
        return merged


class NullTrace(Trace):
    """A trace that records nothing (falsy). ``record`` returns ``None``;
    ``span`` yields ``None``. Used when a layer is given ``trace=None``."""

    enabled = False

    def __init__(self, rank: int = 0):
        super().__init__(rank, max_replay_events=None)

    def __bool__(self) -> bool:
        return False

    def record(  # type: ignore[override]  # records nothing: no Event
        self, kind: str, key: Any = None, backend: str | None = None, rank: int | None = None, **data: Any
    ) -> None:
        """Do nothing."""
        return None

    @contextlib.contextmanager
    def span(  # type: ignore[override]  # records nothing: no Event
        self, kind: str, key: Any = None, backend: str | None = None, rank: int | None = None, **data: Any
    ) -> Iterator[None]:
        """Run the body; record nothing."""
        yield None


NULL_TRACE = NullTrace()


def as_trace(trace: Trace | None) -> Trace:
    """``trace`` itself, or the shared :data:`NULL_TRACE` when ``None``."""
    return NULL_TRACE if trace is None else trace
