"""The capture protocol's steps, named, in order, and the checker of that order.

:class:`Step` names every step of :meth:`GraphBackend.capture_one
<graphrunner.backends.base.GraphBackend.capture_one>`, the one method that
orders a capture; docstrings, ``docs/protocol.md`` and the other docs refer to
the steps by these names (no numbers). :func:`check_capture_order` reads the
events a backend recorded into a :class:`~graphrunner.trace.Trace` (one rank's,
or several merged with :meth:`Trace.merge <graphrunner.trace.Trace.merge>`)
and returns the violations of that order; an empty list means it held.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from enum import Enum
from typing import Any

from graphrunner.trace import Event, EventKind, Trace

__all__ = ["Step", "check_capture_order"]


class Step(Enum):
    """The steps of the capture protocol, in the order :meth:`GraphBackend.capture_one
    <graphrunner.backends.base.GraphBackend.capture_one>` runs them for every shape key, on
    every rank (``H.x``: every capture hook's ``x``, :mod:`graphrunner.recording.hooks`)::

        BEGIN                     H.begin
        repeat warmups (default 2):
            WARMUP_SYNC           device.synchronize()            phase "warmup"
            WARMUP_BARRIER        group.barrier()                 phase "warmup"
            WARMUP_FORWARD        H.before_warmup; forward_fn() (ops to H.warmup_consumers); H.after_warmup
            POST_WARMUP_HOOK      post_warmup_hook(), if given
        AFTER_WARMUPS             H.after_warmups (a check's eager forwards and collectives)
        FINAL_SYNC                device.synchronize()            phase "pre_capture"
        FINAL_BARRIER             group.barrier()                 phase "pre_capture"
        GRAPH_CONSTRUCT           make the graph (device.new_graph() / BreakableGraph)
        CAPTURE_FORWARD           capture forward_fn() exactly once (ops to H.capture_consumers)
        AFTER_CAPTURE             H.after_capture (drift compare, externals named, fingerprint)
        END                       H.end (always, also after an error)

    Why this order:

    - ``WARMUP_FORWARD``: the first calls of a model do lazy work (kernel loading, handle
      creation, autotuning, allocator growth, lazily made buffers) that a capture would freeze
      or refuse.
    - ``WARMUP_SYNC`` then ``WARMUP_BARRIER`` before each warmup: ranks run each warmup
      together, so a warmup's collectives cannot meet another rank's previous warmup, and a
      failure on one rank surfaces at the next barrier on every rank.
    - ``POST_WARMUP_HOOK`` only after warmups, never for the capture: an engine resets its
      state after each warmup, and nothing outside the captured forward is replayed.
    - ``AFTER_WARMUPS`` before ``FINAL_SYNC``: a check's extra forwards queue device work and
      make collectives like a warmup, so the same synchronize and barrier must drain and align
      them.
    - ``FINAL_SYNC``: the last warmup's and its hook's asynchronous device work must not run
      into the capture.
    - ``FINAL_BARRIER`` after ``FINAL_SYNC``: no rank starts capturing while another still
      warms up; a rank says "ready" only when its device is idle.
    - ``GRAPH_CONSTRUCT`` only after both, then ``CAPTURE_FORWARD`` exactly once: making a
      graph while warmup work is in flight is the same hazard as capturing then.
    - ``AFTER_CAPTURE`` and ``END``: the checks compare and name what was captured, and drop
      their references (``END`` also after an error).

    Between ``FINAL_BARRIER`` and ``GRAPH_CONSTRUCT`` the key's views of the shared output
    buffer are bound from the last warmup's output (bookkeeping, not a step: no device or group
    call, no event). Each member's value is the phrase a capture error names the step with
    (``warmup 2/2 forward``, ``final barrier``, ``capture``, ...); :attr:`event` is the
    :class:`~graphrunner.trace.EventKind` the step records (``None``: none of its own).
    """

    BEGIN = "begin"
    WARMUP_SYNC = "synchronize"
    WARMUP_BARRIER = "barrier"
    WARMUP_FORWARD = "forward"
    POST_WARMUP_HOOK = "post-warmup hook"
    AFTER_WARMUPS = "after warmups"
    FINAL_SYNC = "final synchronize"
    FINAL_BARRIER = "final barrier"
    GRAPH_CONSTRUCT = "graph construction"
    CAPTURE_FORWARD = "capture"
    AFTER_CAPTURE = "after capture"
    END = "end"

    @property
    def event(self) -> str | None:
        """The :class:`~graphrunner.trace.EventKind` span this step records, or ``None``."""
        return _EVENTS.get(self)


_EVENTS: dict[Step, str] = {
    Step.WARMUP_SYNC: EventKind.SYNCHRONIZE,
    Step.WARMUP_BARRIER: EventKind.BARRIER,
    Step.WARMUP_FORWARD: EventKind.WARMUP_FORWARD,
    Step.POST_WARMUP_HOOK: EventKind.HOOK,
    Step.AFTER_WARMUPS: EventKind.CHECK,
    Step.FINAL_SYNC: EventKind.SYNCHRONIZE,
    Step.FINAL_BARRIER: EventKind.BARRIER,
    Step.GRAPH_CONSTRUCT: EventKind.GRAPH_CONSTRUCT,
    Step.CAPTURE_FORWARD: EventKind.CAPTURE_FORWARD,
}


# ----------------------------------------------------------------- checker
_PROTOCOL_KINDS = {
    EventKind.WARMUP_FORWARD,
    EventKind.HOOK,
    EventKind.CHECK,
    EventKind.SYNCHRONIZE,
    EventKind.BARRIER,
    EventKind.GRAPH_CONSTRUCT,
    EventKind.CAPTURE_FORWARD,
}


def _order(e: Event) -> tuple[int, int]:
    return (e.t_begin_ns, e.seq)


def _inside(inner: Event, outer: Event) -> bool:
    return (
        inner is not outer
        and inner.rank == outer.rank
        and outer.t_begin_ns <= inner.t_begin_ns <= outer.end
        and (inner.t_begin_ns > outer.t_begin_ns or inner.seq > outer.seq)
    )


def _enclosed(events: Sequence[Event], outer_kind: str, inner_kinds: Any) -> Iterator[tuple[Event, Event]]:
    """``(inner, outer)`` for every event of ``inner_kinds`` that begins inside
    a span of ``outer_kind`` on the same rank (see :func:`_inside`), in one
    pass over ``events`` (sorted by :func:`_order`): per rank, the open outer
    span that ends last is the one to test against."""
    open_outer: dict[int, Event] = {}
    for e in events:
        if e.kind == outer_kind:
            cur = open_outer.get(e.rank)
            if cur is None or e.end > cur.end:
                open_outer[e.rank] = e
        if e.kind in inner_kinds:
            cur = open_outer.get(e.rank)
            if cur is not None and _inside(e, cur):
                yield e, cur


def _episodes(events: Sequence[Event]) -> list[list[Event]]:
    """Split one (rank, key)'s protocol events into capture attempts: an
    attempt ends with its ``capture_forward`` (or its ``graph_construct`` if
    the capture forward never started); a later warmup/sync/barrier starts a
    new one."""
    episodes: list[list[Event]] = []
    cur: list[Event] = []
    closed = False
    for e in events:
        if closed and e.kind in _PROTOCOL_KINDS and e.kind != EventKind.CAPTURE_FORWARD:
            episodes.append(cur)
            cur, closed = [], False
        cur.append(e)
        if e.kind == EventKind.CAPTURE_FORWARD:
            closed = True
    if cur:
        episodes.append(cur)
    return episodes


def _check_episode(rank: int, key: Any, ev: list[Event], warmups: int | None, tag: str) -> list[str]:
    v: list[str] = []
    where = f"rank {rank} key {key!r}{tag}"
    warm = [e for e in ev if e.kind == EventKind.WARMUP_FORWARD]
    hooks = [e for e in ev if e.kind == EventKind.HOOK]
    checks = [e for e in ev if e.kind == EventKind.CHECK]
    syncs = [e for e in ev if e.kind == EventKind.SYNCHRONIZE]
    bars = [e for e in ev if e.kind == EventKind.BARRIER]
    cons = [e for e in ev if e.kind == EventKind.GRAPH_CONSTRUCT]
    caps = [e for e in ev if e.kind == EventKind.CAPTURE_FORWARD]

    expected = warmups
    if expected is None:
        for e in cons + warm:
            if "warmups" in e.data:
                expected = int(e.data["warmups"])
                break
    if expected is not None and len(warm) != expected:
        v.append(f"{where}: {len(warm)} warmup forwards, expected {expected}")

    # Each warmup forward is preceded (since the previous warmup's forward
    # and hook ended) by a synchronize and then a barrier.
    prev_end = None
    for i, w in enumerate(warm):
        lo = prev_end if prev_end is not None else -1
        s = [e for e in syncs if e.t_begin_ns >= lo and e.end <= w.t_begin_ns]
        b = [e for e in bars if e.t_begin_ns >= lo and e.end <= w.t_begin_ns]
        if not s:
            v.append(f"{where}: warmup forward {i} not preceded by a synchronize")
        if not b:
            v.append(f"{where}: warmup forward {i} not preceded by a barrier")
        elif s and not any(x.t_begin_ns >= min(y.end for y in s) for x in b):
            v.append(f"{where}: warmup forward {i}: barrier did not follow the synchronize")
        ends = [w.end] + [
            h.end
            for h in hooks
            if h.t_begin_ns >= w.end and (i + 1 >= len(warm) or h.t_begin_ns < warm[i + 1].t_begin_ns)
        ]
        prev_end = max(ends)

    # Hooks: only after a warmup forward, at most one per warmup, never
    # after graph construction (the capture forward runs without it).
    if len(hooks) > len(warm):
        v.append(f"{where}: {len(hooks)} post-warmup hooks for {len(warm)} warmup forwards")
    for h in hooks:
        before = [w for w in warm if w.end <= h.t_begin_ns]
        if not before:
            v.append(f"{where}: post-warmup hook ran before any warmup forward ended")
        if any(c.t_begin_ns <= h.t_begin_ns for c in cons + caps):
            v.append(f"{where}: post-warmup hook ran after graph construction / during capture")
    for i, w in enumerate(warm):
        hs = [
            h for h in hooks if h.t_begin_ns >= w.end and (i + 1 >= len(warm) or h.t_begin_ns < warm[i + 1].t_begin_ns)
        ]
        if len(hs) > 1:
            v.append(f"{where}: {len(hs)} hooks after warmup forward {i}")

    # Checks (capture hooks' after_warmups): after the last warmup forward.
    for k in checks:
        if warm and k.t_begin_ns < max(w.end for w in warm):
            v.append(f"{where}: check {k.data.get('check')!r} ran before the last warmup forward ended")

    # Construction: exactly once, after a synchronize and then a barrier
    # that both follow the last warmup forward, its hook and the checks.
    if len(cons) != 1:
        v.append(f"{where}: {len(cons)} graph constructions, expected 1")
    if len(caps) != 1:
        v.append(f"{where}: {len(caps)} capture forwards, expected exactly 1")
    if cons:
        c = cons[0]
        last = max([e.end for e in warm + hooks + checks if e.t_begin_ns <= c.t_begin_ns] or [-1])
        final_syncs = [s for s in syncs if s.t_begin_ns >= last and s.end <= c.t_begin_ns]
        if not final_syncs:
            v.append(f"{where}: no synchronize between the last warmup/hook and graph construction")
        fb = [b for b in bars if b.t_begin_ns >= last and b.end <= c.t_begin_ns]
        if not fb:
            v.append(f"{where}: no barrier between the last warmup/hook and graph construction")
        if final_syncs and fb:
            first_sync_end = min(s.end for s in final_syncs)
            if not any(b.t_begin_ns >= first_sync_end for b in fb):
                v.append(
                    f"{where}: final barrier began before the final synchronize ended (expected synchronize, then barrier)"
                )
        for w in warm + hooks + checks:
            if w.t_begin_ns > c.t_begin_ns:
                v.append(f"{where}: {w.kind} ran after graph construction began")
        for cap in caps:
            if cap.t_begin_ns < c.t_begin_ns:
                v.append(f"{where}: capture forward began before graph construction")
    for cap in caps:
        for w in warm:
            if w.t_begin_ns >= cap.t_begin_ns:
                v.append(f"{where}: warmup forward after the capture forward")
    return v


def check_capture_order(trace: Trace, warmups: int | None = None) -> list[str]:
    """Return the violations of the capture protocol found in ``trace``.

    ``trace`` may hold one rank's events or several ranks' merged with
    :meth:`Trace.merge`. For every (rank, key) capture attempt it checks:

    - the number of ``warmup_forward`` events equals ``warmups`` (or, when
      ``None``, the ``warmups`` the backend stamped on its events);
    - each warmup forward is preceded by a ``synchronize`` and then a
      ``barrier``;
    - ``hook`` events run only after a warmup forward (at most one each) and
      never after graph construction;
    - ``check`` events (capture hooks' work after the warmups) only after the
      last warmup forward;
    - after the last warmup forward, its hook and the checks: a ``synchronize``, then a
      ``barrier``, and only then ``graph_construct`` (exactly one);
    - exactly one ``capture_forward``, after the construction.

    Per rank: no ``synchronize`` or ``barrier`` inside a ``replay`` span.

    Across ranks (merged trace): no rank's ``graph_construct`` for a key
    begins before every other rank's last warmup activity (the end of its
    last hook, or of its last warmup forward) for that key ended; and every
    rank that appears in the trace captured each key the others captured.

    Events nested inside a ``capture_forward`` (the barrier before each eager
    break, segment events) or inside a ``replay`` are not protocol steps.
    An empty list means the protocol held. Time is linear in the number of
    events (after one sort), plus the per-key capture checks.
    """
    events = sorted(trace.events, key=_order)
    violations: list[str] = []

    # No synchronize or barrier inside a replay.
    for e, span in _enclosed(events, EventKind.REPLAY, (EventKind.SYNCHRONIZE, EventKind.BARRIER)):
        violations.append(f"rank {span.rank} key {span.key!r}: {e.kind} inside replay")

    # Inside a capture forward only the barriers before eager breaks belong;
    # any other protocol step there is a violation of its own.
    nested = set()
    for e, c in _enclosed(events, EventKind.CAPTURE_FORWARD, _PROTOCOL_KINDS):
        nested.add(id(e))
        if e.kind != EventKind.BARRIER:
            violations.append(f"rank {c.rank} key {c.key!r}: {e.kind} ran inside the capture forward")

    groups: dict[tuple[int, Any], list[Event]] = {}
    for e in events:
        if e.kind in _PROTOCOL_KINDS and e.key is not None and id(e) not in nested:
            try:
                groups.setdefault((e.rank, e.key), []).append(e)
            except TypeError:  # unhashable key
                groups.setdefault((e.rank, repr(e.key)), []).append(e)

    # last warmup activity and construction begin, per (key, rank), per episode index
    last_activity: dict[Any, dict[int, list[int | None]]] = {}
    construct: dict[Any, dict[int, list[int | None]]] = {}
    for (rank, key), evs in sorted(groups.items(), key=lambda kv: (kv[0][0], repr(kv[0][1]))):
        eps = _episodes(evs)
        for n, ep in enumerate(eps):
            tag = f" (capture #{n + 1})" if len(eps) > 1 else ""
            violations.extend(_check_episode(rank, key, ep, warmups, tag))
            cons = [e for e in ep if e.kind == EventKind.GRAPH_CONSTRUCT]
            act = [
                e.end
                for e in ep
                if e.kind in (EventKind.WARMUP_FORWARD, EventKind.HOOK, EventKind.CHECK)
                and (not cons or e.t_begin_ns <= cons[0].t_begin_ns)
            ]
            last_activity.setdefault(key, {}).setdefault(rank, []).append(max(act) if act else None)
            construct.setdefault(key, {}).setdefault(rank, []).append(cons[0].t_begin_ns if cons else None)

    ranks = sorted({e.rank for e in events})
    if len(ranks) > 1:
        for key, per_rank in construct.items():
            missing = [r for r in ranks if r not in per_rank]
            if missing:
                violations.append(f"key {key!r}: captured on ranks {sorted(per_rank)} but not on ranks {missing}")
            for r, cons_list in per_rank.items():
                for n, begin in enumerate(cons_list):
                    if begin is None:
                        continue
                    for other, acts in last_activity.get(key, {}).items():
                        act_end = acts[n] if n < len(acts) else None
                        if other == r or act_end is None:
                            continue
                        if begin < act_end:
                            violations.append(
                                f"key {key!r}: rank {r} began graph construction {(act_end - begin) / 1e6:.3f} ms before "
                                f"rank {other} finished its last warmup/hook (missing or broken final barrier)"
                            )
    return violations
