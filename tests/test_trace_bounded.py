"""A Trace stays bounded on a long run (capture events always kept, replay
events a ring), and the protocol checker is linear in events (issue 10, item 5)."""

from __future__ import annotations

import pytest
import torch

import graphrunner as gr
import graphrunner.backends.protocol as protocol_mod
import graphrunner.trace as trace_mod
from graphrunner.backends.protocol import check_capture_order
from graphrunner.trace import EventKind, Trace

BUCKETS = [1, 2, 4]


def _serve(trace, calls):
    r = gr.GraphRunner(
        lambda x: x * 2,
        {"x": gr.BatchInput(trailing=(3,))},
        buckets=BUCKETS,
        backend="full",
        device="tape",
        trace=trace,
        progress=False,
    )
    r.capture()
    keys = []
    for i in range(calls):
        n = 1 + i % 4
        x = torch.full((n, 3), float(i))
        assert torch.equal(r(x=x), x * 2)
        keys.append(r.bucket_for(n))
    return keys


def test_replay_events_are_a_ring_and_capture_events_are_kept():
    t = Trace(max_replay_events=50)
    keys = _serve(t, 1000)
    replays = t.of(EventKind.REPLAY)
    assert 50 <= len(replays) <= 2 * 50 + 64
    assert [e.key for e in replays] == keys[-len(replays) :]  # the most recent ones, in order
    assert t.replays_recorded == 1000
    assert t.replay_events_dropped == 1000 - len(replays)
    assert len(t.of(EventKind.CAPTURE_FORWARD)) == len(BUCKETS)
    assert len(t.of(EventKind.WARMUP_FORWARD)) == 2 * len(BUCKETS)
    assert check_capture_order(t) == []


def test_unbounded_trace_keeps_every_replay_negative_control():
    t = Trace(max_replay_events=None)
    _serve(t, 400)
    assert len(t.of(EventKind.REPLAY)) == t.replays_recorded == 400 and t.replay_events_dropped == 0


def test_default_bound_and_bad_bound():
    assert Trace().max_replay_events == trace_mod.DEFAULT_MAX_REPLAY_EVENTS == 10_000
    with pytest.raises(ValueError, match="max_replay_events"):
        Trace(max_replay_events=-1)


def _synthetic(n_replays):
    """A trace of one valid capture followed by ``n_replays`` replays, each
    with a synchronize after it (outside the replay)."""
    t = Trace(max_replay_events=None)
    clock = iter(range(10, 10**9, 10))

    def span(kind, key=1, **data):
        ev = t.record(kind, key=key, backend="full", **data)
        ev.t_begin_ns = next(clock)
        ev.t_end_ns = next(clock)
        return ev

    for i in range(2):
        span(EventKind.SYNCHRONIZE, phase="warmup")
        span(EventKind.BARRIER, phase="warmup")
        span(EventKind.WARMUP_FORWARD, i=i, warmups=2)
    span(EventKind.SYNCHRONIZE, phase="pre_capture")
    span(EventKind.BARRIER, phase="pre_capture")
    span(EventKind.GRAPH_CONSTRUCT, warmups=2)
    span(EventKind.CAPTURE_FORWARD)
    for _ in range(n_replays):
        span(EventKind.REPLAY)
        span(EventKind.SYNCHRONIZE, key=None, phase="user")
    return t


def test_checker_work_is_linear_in_events(monkeypatch):
    calls = {"n": 0}
    real = protocol_mod._inside

    def counting(inner, outer):
        calls["n"] += 1
        return real(inner, outer)

    monkeypatch.setattr(protocol_mod, "_inside", counting)
    for n in (500, 2000):
        calls["n"] = 0
        t = _synthetic(n)
        assert check_capture_order(t) == []
        # The quadratic checker made replays x events (~2n^2) containment tests.
        assert calls["n"] <= 2 * len(t.events), (n, calls["n"])


def test_checker_still_finds_a_sync_inside_a_replay():
    """Negative control of the linear sweep: a synchronize that begins inside
    a replay span (here the 300th of 600) is still reported."""
    t = _synthetic(600)
    replays = t.of(EventKind.REPLAY)
    victim = replays[300]
    sync = t.record(EventKind.SYNCHRONIZE, key=None, backend="full", phase="user")
    sync.t_begin_ns = victim.t_begin_ns + 1
    sync.t_end_ns = victim.t_end_ns - 1
    v = check_capture_order(t)
    assert v == ["rank 0 key 1: synchronize inside replay"]
