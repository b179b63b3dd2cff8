"""Trace recording, export, merging, and the capture-order checker.

The checker is tested on a trace recorded from a real backend (it holds) and
on hand-built traces each breaking one rule (negative controls: each must be
reported, with a message naming the rule).
"""

import json
import time

import pytest
import torch

from graphrunner.backends import BreakableGraphBackend, EagerBackend, FullGraphBackend
from graphrunner.backends.protocol import check_capture_order
from graphrunner.devices import TapeDevice
from graphrunner.trace import NULL_TRACE, Event, EventKind, NullTrace, Trace, as_trace, layer_of

K = EventKind


# ----------------------------------------------------------------- recording
def test_record_and_span_times_and_fields():
    tr = Trace(rank=3)
    ev = tr.record(K.SESSION_BEGIN, backend="full", note="x")
    assert ev.t_end_ns == ev.t_begin_ns and ev.rank == 3 and ev.data == {"note": "x"}
    with tr.span(K.WARMUP_FORWARD, key=8, backend="full", i=0) as sp:
        assert sp.t_end_ns is None  # open span
        time.sleep(0.002)
    assert sp.t_end_ns - sp.t_begin_ns >= 2_000_000
    assert [e.kind for e in tr.events] == [K.SESSION_BEGIN, K.WARMUP_FORWARD]
    assert tr.of(K.WARMUP_FORWARD, key=8)[0] is sp
    assert tr.of(rank=0) == []
    r = tr.record(K.BARRIER, rank=1)
    assert r.rank == 1


def test_span_records_error_and_end_time_then_reraises():
    tr = Trace()
    with pytest.raises(ValueError):
        with tr.span(K.CAPTURE_FORWARD, key=4):
            raise ValueError("boom")
    (ev,) = tr.events
    assert ev.t_end_ns is not None and ev.t_end_ns >= ev.t_begin_ns
    assert "ValueError: boom" in ev.data["error"]


def test_null_trace_records_nothing_and_is_falsy():
    assert as_trace(None) is NULL_TRACE
    t = Trace()
    assert as_trace(t) is t and bool(t)
    n = NullTrace()
    assert not n
    assert n.record(K.REPLAY, key=1) is None
    with n.span(K.REPLAY, key=1) as sp:
        assert sp is None
    assert n.events == []


def test_layers():
    assert layer_of(Event(K.SYNCHRONIZE)) == "device"
    assert layer_of(Event(K.BARRIER)) == "group"
    assert layer_of(Event(K.EAGER_BREAK)) == "breakable"
    assert layer_of(Event(K.REPLAY)) == "backend"
    assert layer_of(Event(K.REPLAY, data={"layer": "runner"})) == "runner"


# ------------------------------------------------------------------- export
def _real_trace(backend_cls=FullGraphBackend, rank=0, keys=(8, 4), **kw):
    tr = Trace(rank=rank)
    x = torch.randn(8, 3)
    b = backend_cls(device=TapeDevice(), trace=tr, **kw)
    with torch.inference_mode(), b.capture_session():
        for k in keys:
            b.capture_one(k, lambda k=k: x[:k] * 2, capture_inputs=x, post_warmup_hook=lambda: None)
    with torch.inference_mode():
        for k in keys:
            b.replay(k)
    return tr


def test_jsonl_roundtrip(tmp_path):
    tr = _real_trace()
    tr.record(K.REPLAY, key=(2, "decode"), extra=torch.float32)  # tuple key, non-JSON data
    p = tmp_path / "t.jsonl"
    tr.to_jsonl(str(p))
    lines = p.read_text().splitlines()
    assert len(lines) == len(tr.events)
    rec = json.loads(lines[0])
    assert set(rec) >= {"kind", "key", "rank", "backend", "t_begin_ns", "t_end_ns", "seq", "layer", "data"}
    back = Trace.from_jsonl(str(p))
    assert [(e.kind, e.key, e.rank, e.backend, e.t_begin_ns, e.t_end_ns) for e in back.events] == [
        (e.kind, e.key, e.rank, e.backend, e.t_begin_ns, e.t_end_ns) for e in tr.events
    ]
    assert back.events[-1].key == (2, "decode")  # JSON list came back as the tuple key
    assert back.events[-1].data["extra"] == "torch.float32"
    assert check_capture_order(back) == []


def test_chrome_trace_loads_with_required_fields(tmp_path):
    merged = Trace.merge([_real_trace(rank=0), _real_trace(BreakableGraphBackend, rank=1)])
    p = tmp_path / "t.json"
    merged.to_chrome(str(p))
    doc = json.loads(p.read_text())
    evs = doc["traceEvents"]
    spans = [e for e in evs if e["ph"] == "X"]
    meta = [e for e in evs if e["ph"] == "M"]
    assert len(spans) == len(merged.events)
    for e in spans:
        assert {"name", "cat", "ph", "ts", "dur", "pid", "tid", "args"} <= set(e)
        assert isinstance(e["ts"], float) and e["ts"] >= 0 and e["dur"] >= 0
    assert {e["pid"] for e in spans} == {0, 1}  # pid = rank
    names = {(e["pid"], e["args"]["name"]) for e in meta if e["name"] == "process_name"}
    assert names == {(0, "rank 0"), (1, "rank 1")}
    threads = {e["args"]["name"] for e in meta if e["name"] == "thread_name"}
    assert {"backend", "device", "group"} <= threads
    # one thread per layer: synchronize events sit on the device thread, barriers on the group thread
    tid = {e["args"]["name"]: e["tid"] for e in meta if e["name"] == "thread_name"}
    assert all(e["tid"] == tid["device"] for e in spans if e["cat"] == K.SYNCHRONIZE)
    assert all(e["tid"] == tid["group"] for e in spans if e["cat"] == K.BARRIER)


def test_merge_sorts_by_clock_and_keeps_ranks():
    a, b = Trace(rank=0), Trace(rank=1)
    a.record(K.SESSION_BEGIN)
    b.record(K.SESSION_BEGIN)
    a.record(K.SESSION_END)
    m = Trace.merge([a, b])
    assert [e.rank for e in m.events] == [0, 1, 0]
    assert [e.t_begin_ns for e in m.events] == sorted(e.t_begin_ns for e in m.events)


# ------------------------------------------------------------------ checker
@pytest.mark.parametrize("cls", [FullGraphBackend, BreakableGraphBackend, EagerBackend])
def test_checker_accepts_a_real_trace(cls):
    tr = _real_trace(cls)
    assert check_capture_order(tr) == []
    assert check_capture_order(tr, warmups=2) == []
    # the same checker counts warmups: told 3, it reports both keys
    v = check_capture_order(tr, warmups=3)
    assert len(v) == 2 and all("2 warmup forwards, expected 3" in s for s in v)


def test_checker_accepts_zero_warmups_and_recapture_after_cleanup():
    tr = Trace()
    x = torch.randn(4, 2)
    b = FullGraphBackend(device=TapeDevice(), trace=tr, warmups=0)
    for _ in range(2):
        with b.capture_session():
            b.capture_one(4, lambda: x + 1)
        b.cleanup()
    assert check_capture_order(tr) == []


class _Builder:
    """Hand-built trace: each step takes 10 ns, in order."""

    def __init__(self):
        self.trace = Trace()
        self.t = 0

    def add(self, kind, key=8, rank=0, dur=10, **data):
        ev = Event(kind, key=key, rank=rank, backend="test", t_begin_ns=self.t, t_end_ns=self.t + dur, data=data)
        self.trace.events.append(ev)
        self.t += dur + 1
        return ev

    def good(self, key=8, rank=0, warmups=2, hook=True, skip=(), replay=True):
        for i in range(warmups):
            self.add(K.SYNCHRONIZE, key, rank, phase="warmup")
            self.add(K.BARRIER, key, rank, phase="warmup")
            self.add(K.WARMUP_FORWARD, key, rank, i=i, warmups=warmups)
            if hook:
                self.add(K.HOOK, key, rank, i=i)
        if "sync" not in skip:
            self.add(K.SYNCHRONIZE, key, rank, phase="pre_capture")
        if "barrier" not in skip:
            self.add(K.BARRIER, key, rank, phase="pre_capture")
        self.add(K.GRAPH_CONSTRUCT, key, rank, warmups=warmups)
        self.add(K.CAPTURE_FORWARD, key, rank)
        if replay:
            self.add(K.REPLAY, key, rank)
        return self


def test_checker_hand_built_good_trace_is_clean():
    b = _Builder().good().good(key=4)
    assert check_capture_order(b.trace) == []


def test_checker_reports_missing_final_synchronize():
    v = check_capture_order(_Builder().good(skip=("sync",)).trace)
    assert any("no synchronize between the last warmup/hook and graph construction" in s for s in v), v


def test_checker_reports_missing_final_barrier():
    v = check_capture_order(_Builder().good(skip=("barrier",)).trace)
    assert any("no barrier between the last warmup/hook and graph construction" in s for s in v), v


def test_checker_reports_barrier_before_sync():
    b = _Builder().good(skip=("sync", "barrier", "x"), replay=False)
    # rebuild the tail: barrier, sync, construct, capture
    b.trace.events = b.trace.events[:-2]
    b.add(K.BARRIER, phase="pre_capture")
    b.add(K.SYNCHRONIZE, phase="pre_capture")
    b.add(K.GRAPH_CONSTRUCT, warmups=2)
    b.add(K.CAPTURE_FORWARD)
    v = check_capture_order(b.trace)
    assert any("final barrier began before the final synchronize ended" in s for s in v), v


def test_checker_reports_wrong_warmup_count_and_missing_warmup_sync():
    b = _Builder()
    b.add(K.WARMUP_FORWARD, i=0, warmups=2)  # no sync/barrier before it, and only one warmup
    b.add(K.SYNCHRONIZE)
    b.add(K.BARRIER)
    b.add(K.GRAPH_CONSTRUCT, warmups=2)
    b.add(K.CAPTURE_FORWARD)
    v = check_capture_order(b.trace)
    assert any("1 warmup forwards, expected 2" in s for s in v), v
    assert any("warmup forward 0 not preceded by a synchronize" in s for s in v), v
    assert any("warmup forward 0 not preceded by a barrier" in s for s in v), v


def test_checker_reports_hook_or_sync_during_capture():
    b = _Builder().good(replay=False)
    cap = b.trace.events[-1]
    cap.t_end_ns = cap.t_begin_ns + 100
    b.trace.events.append(Event(K.HOOK, key=8, t_begin_ns=cap.t_begin_ns + 10, t_end_ns=cap.t_begin_ns + 20))
    b.trace.events.append(Event(K.SYNCHRONIZE, key=8, t_begin_ns=cap.t_begin_ns + 30, t_end_ns=cap.t_begin_ns + 40))
    v = check_capture_order(b.trace)
    assert any("hook ran inside the capture forward" in s for s in v), v
    assert any("synchronize ran inside the capture forward" in s for s in v), v


def test_checker_reports_hook_after_construction():
    b = _Builder()
    for i in range(2):
        b.add(K.SYNCHRONIZE)
        b.add(K.BARRIER)
        b.add(K.WARMUP_FORWARD, i=i, warmups=2)
    b.add(K.SYNCHRONIZE)
    b.add(K.BARRIER)
    b.add(K.GRAPH_CONSTRUCT, warmups=2)
    b.add(K.HOOK, i=1)
    b.add(K.CAPTURE_FORWARD)
    v = check_capture_order(b.trace)
    assert any("hook ran after graph construction" in s for s in v), v


def test_checker_reports_two_capture_forwards():
    b = _Builder().good(replay=False)
    b.trace.events.append(Event(K.CAPTURE_FORWARD, key=8, t_begin_ns=b.t, t_end_ns=b.t + 5))
    v = check_capture_order(b.trace)
    assert any("2 capture forwards, expected exactly 1" in s for s in v), v


def test_checker_reports_hook_before_any_warmup():
    b = _Builder()
    b.add(K.HOOK, i=0)
    b.good(hook=False)
    v = check_capture_order(b.trace)
    assert any("hook ran before any warmup forward ended" in s for s in v), v


def test_checker_reports_sync_or_barrier_inside_replay():
    b = _Builder().good(replay=False)
    b.trace.events.append(Event(K.REPLAY, key=8, t_begin_ns=b.t, t_end_ns=b.t + 100))
    b.trace.events.append(Event(K.SYNCHRONIZE, key=8, t_begin_ns=b.t + 10, t_end_ns=b.t + 20))
    b.trace.events.append(Event(K.BARRIER, key=8, t_begin_ns=b.t + 30, t_end_ns=b.t + 40))
    v = check_capture_order(b.trace)
    assert any("synchronize inside replay" in s for s in v), v
    assert any("barrier inside replay" in s for s in v), v


def test_checker_ignores_barriers_nested_in_the_capture_forward():
    # the breakable backend's barrier before each eager break is inside capture_forward
    b = _Builder().good(replay=False)
    cap = b.trace.events[-1]
    cap.t_end_ns = cap.t_begin_ns + 100
    b.trace.events.append(
        Event(
            K.BARRIER,
            key=8,
            t_begin_ns=cap.t_begin_ns + 10,
            t_end_ns=cap.t_begin_ns + 20,
            data={"phase": "capture_break"},
        )
    )
    assert check_capture_order(b.trace) == []


def test_checker_cross_rank_early_construction_reported():
    # rank 0 constructs at t=1000, while rank 1's last hook ends at t=2000
    tr = Trace()

    def ev(kind, rank, t0, t1, **d):
        tr.events.append(Event(kind, key=8, rank=rank, t_begin_ns=t0, t_end_ns=t1, data=d))

    for rank, hook_end in ((0, 500), (1, 2000)):
        ev(K.SYNCHRONIZE, rank, 10, 20)
        ev(K.BARRIER, rank, 30, 40)
        ev(K.WARMUP_FORWARD, rank, 50, 60, warmups=1)
        ev(K.HOOK, rank, 70, hook_end)
        ev(K.SYNCHRONIZE, rank, hook_end + 1, hook_end + 2)
        ev(K.BARRIER, rank, hook_end + 3, hook_end + 4)
        ev(K.GRAPH_CONSTRUCT, rank, hook_end + 5, hook_end + 6, warmups=1)
        ev(K.CAPTURE_FORWARD, rank, hook_end + 7, hook_end + 8)
    v = check_capture_order(tr)
    assert (
        len(v) == 1 and "rank 0 began graph construction" in v[0] and "rank 1 finished its last warmup/hook" in v[0]
    ), v
    # positive: shift rank 0's construction past rank 1's hook end
    for e in tr.events:
        if e.rank == 0 and e.kind in (K.GRAPH_CONSTRUCT, K.CAPTURE_FORWARD):
            e.t_begin_ns += 3000
            e.t_end_ns += 3000
    assert check_capture_order(tr) == []


def test_checker_reports_key_missing_on_a_rank():
    b = _Builder().good(key=8, rank=0).good(key=4, rank=0).good(key=8, rank=1)
    v = check_capture_order(b.trace)
    assert any("key 4: captured on ranks [0] but not on ranks [1]" in s for s in v), v
