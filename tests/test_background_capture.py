"""Serving while graphs are captured: ``GraphRunner.capture(background=True)`` (issue 25 item 1).

One rank: every call from the first is served and equals eager (padded to its key while the key
is not captured, replayed after); a key replays from the call after its capture; the step never
runs on two threads at once; the trace checker passes; a capture failure surfaces on the next call
and eager serving goes on. Three gloo ranks with an all-reduce inside the step: every rank
switches each key from eager to graph at the same call, and the results equal eager.
"""

from __future__ import annotations

import os
import sys
import threading
import time

import pytest
import torch

import graphrunner as gr
from graphrunner.backends.protocol import check_capture_order
from graphrunner.errors import CaptureError
from graphrunner.tape import is_tape_capturing

sys.path.insert(0, os.path.dirname(__file__))
from mp_util import assert_all_ok, run_ranks  # noqa: E402

D = 8
BUCKETS = [1, 2, 4, 8]


class Step:
    """``x -> tanh(x @ w) @ w.T + 1``, counting Python runs and the threads running it at once."""

    def __init__(self, seed: int = 0, slow: float = 0.0, fail_key=None) -> None:
        self.w = torch.randn(D, D, generator=torch.Generator().manual_seed(seed)) / 3
        self.runs, self.active, self.most_active, self.slow, self.fail_key = 0, 0, 0, slow, fail_key
        self.lock = threading.Lock()

    def __call__(self, x):
        with self.lock:
            self.runs += 1
            self.active += 1
            self.most_active = max(self.most_active, self.active)
        try:
            if self.slow:
                time.sleep(self.slow)  # widen the window in which a call could overlap a capture
            if self.fail_key is not None and x.shape[0] == self.fail_key and is_tape_capturing():
                raise RuntimeError("planted capture failure")
            return torch.tanh(x @ self.w) @ self.w.T + 1
        finally:
            with self.lock:
                self.active -= 1

    def eager(self, x):
        return torch.tanh(x @ self.w) @ self.w.T + 1


def make_runner(step, trace=None, backend="full"):
    return gr.GraphRunner(
        step,
        inputs={"x": gr.BatchInput(trailing=(D,), dtype=torch.float32)},
        buckets=BUCKETS,
        backend=backend,
        progress=False,
        trace=trace,
    )


def batches(n, seed=1):
    g = torch.Generator().manual_seed(seed)
    sizes = torch.randint(1, 9, (n,), generator=g).tolist()
    return [torch.randn(s, D, generator=g) for s in sizes]


@pytest.mark.parametrize("backend", ["full", "breakable"])
def test_every_call_is_served_and_equals_eager_from_the_first(backend):
    step = Step(slow=0.001)
    trace = gr.Trace()
    runner = make_runner(step, trace, backend)
    assert runner.capture(background=True) is None  # returns at once
    replayed_before = []
    for x in batches(40):
        before = sum(runner.stats.replays.values())
        out = runner(x=x)
        replayed_before.append(sum(runner.stats.replays.values()) > before)
        torch.testing.assert_close(out, step.eager(x), rtol=1e-5, atol=1e-6)
    report = runner.wait_captured(timeout=60)
    assert sorted(runner.captured_keys) == BUCKETS and report is runner.report
    assert sorted(b.bucket for b in report.buckets) == BUCKETS
    assert step.most_active == 1  # a call never ran the step while a key was captured
    for x in batches(10, seed=2):  # now every call replays
        before = sum(runner.stats.replays.values())
        torch.testing.assert_close(runner(x=x), step.eager(x), rtol=1e-5, atol=1e-6)
        assert sum(runner.stats.replays.values()) == before + 1
    check_capture_order(trace)  # the protocol's order held for every background capture
    runner.cleanup()


def test_a_key_replays_from_the_call_after_its_capture():
    step = Step()
    runner = make_runner(step)
    runner.capture(background=True)
    runner.wait_captured(timeout=60)
    runs = step.runs
    x = torch.randn(3, D)
    torch.testing.assert_close(runner(x=x), step.eager(x), rtol=1e-5, atol=1e-6)
    assert step.runs == runs  # a replay runs no Python
    assert runner.stats.replays[4] == 1


def test_negative_control_before_capture_the_call_runs_the_step_eagerly_padded_to_its_key():
    step = Step()
    runner = make_runner(step)
    gate = threading.Event()
    runner.capturer.background_gate = gate  # (test hook) hold the background thread before its first key
    runner.capture(background=True)
    x = torch.randn(3, D)
    runs = step.runs
    out = runner(x=x)
    assert step.runs == runs + 1 and sum(runner.stats.replays.values()) == 0  # eager, not a replay
    assert runner.stats.fallbacks == 1 and "capturing" in str(runner.stats.fallback_reasons)
    torch.testing.assert_close(out, step.eager(x), rtol=1e-5, atol=1e-6)
    gate.set()
    runner.wait_captured(timeout=60)


def test_a_failed_background_capture_surfaces_on_the_next_call_and_eager_serving_goes_on():
    step = Step(fail_key=2)
    runner = make_runner(step)
    runner.capture(background=True)
    assert runner.wait_captured(timeout=60) is None  # finished, with an error
    x = torch.randn(2, D)
    with pytest.raises(CaptureError, match=r"background capture failed.*shape key 2.*planted capture failure"):
        runner(x=x)
    for x in batches(12, seed=3):  # later calls are served: eagerly for the keys not captured
        torch.testing.assert_close(runner(x=x), step.eager(x), rtol=1e-5, atol=1e-6)
    assert 2 not in runner.captured_keys and 8 in runner.captured_keys


def test_capture_background_twice_is_refused_and_cleanup_stops_it():
    runner = make_runner(Step())
    runner.capture(background=True)
    with pytest.raises(CaptureError, match="already"):
        runner.capture(background=True)
    runner.wait_captured(timeout=60)
    runner.cleanup()
    with pytest.raises(CaptureError, match="after cleanup"):
        runner(x=torch.randn(1, D))


# ---------------------------------------------------------------- several ranks
WORLD = 3


def _all_reduce_runner(fail_key=None):
    """``(runner, w, backend)``: a runner over ``tanh(x @ w)`` all-reduced across the ranks (a collective
    inside the step: captures must pair across ranks) on a full backend; ``fail_key``: a host read at
    that batch size, which fails its capture on every rank before the collective."""
    import torch.distributed as dist

    from graphrunner.group import TorchDistGroup

    w = torch.randn(D, D, generator=torch.Generator().manual_seed(0)) / 3

    def step(x):
        if x.shape[0] == fail_key:
            float(x.sum())
        y = torch.tanh(x @ w)
        dist.all_reduce(y)
        return y

    backend = gr.backends.FullGraphBackend(group=TorchDistGroup(timeout=20.0), trace=gr.Trace())
    runner = gr.GraphRunner(
        step,
        inputs={"x": gr.BatchInput(trailing=(D,), dtype=torch.float32)},
        buckets=BUCKETS,
        backend=backend,
        progress=False,
    )
    return runner, w, backend


def _rank_worker(rank, world):
    runner, w, backend = _all_reduce_runner()
    runner.capture(background=True)
    g = torch.Generator().manual_seed(7)  # the same sizes on every rank; values per rank
    switched, outs = [], []
    for i in range(30):
        n = int(torch.randint(1, 9, (1,), generator=g))
        x = torch.full((n, D), float(rank + 1)) * (i + 1) / 30
        before = sum(runner.stats.replays.values())
        out = runner(x=x)
        switched.append(sum(runner.stats.replays.values()) > before)
        outs.append((n, i, out.clone()))
    runner.wait_captured(timeout=60)
    x = torch.ones(8, D)
    runner(x=x)  # its agreement tells every rank that every rank has every key
    check_capture_order(backend.trace)
    # eager reference: the sum over ranks of tanh(x_r @ w), computed locally
    for n, i, out in outs:
        want = sum(torch.tanh(torch.full((n, D), float(r + 1)) * (i + 1) / 30 @ w) for r in range(world))
        torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    return {"switched": switched, "keys": sorted(runner.captured_keys)}


@pytest.mark.multirank
@pytest.mark.slow
def test_three_ranks_switch_every_key_at_the_same_call_and_equal_eager():
    results = run_ranks(_rank_worker, world_size=WORLD, timeout=240)
    assert_all_ok(results)
    switched = [r.value["switched"] for r in results]
    assert switched[0] == switched[1] == switched[2]  # the same calls replayed on every rank
    assert not switched[0][0] and any(switched[0])  # the first call eager, later ones replayed
    assert all(r.value["keys"] == BUCKETS for r in results)


def _failing_rank_worker(rank, world):
    runner, w, _ = _all_reduce_runner(fail_key=2)  # the capture of key 2 fails on every rank
    runner.capture(background=True)
    assert runner.wait_captured(timeout=60) is None  # failed at key 2
    raised = None
    for i in range(6):
        x = torch.full((3, D), float(rank + 1)) * (i + 1)
        try:
            out = runner(x=x)
        except CaptureError as exc:
            raised = (i, str(exc))
            continue
        want = sum(torch.tanh(torch.full((3, D), float(r + 1)) * (i + 1) @ w) for r in range(world))
        torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    return {"raised": raised, "keys": sorted(runner.captured_keys)}


@pytest.mark.multirank
@pytest.mark.slow
def test_three_ranks_a_failed_background_capture_raises_at_the_same_call_and_serving_goes_on():
    results = run_ranks(_failing_rank_worker, world_size=WORLD, timeout=240)
    assert_all_ok(results)
    raised = [r.value["raised"] for r in results]
    assert all(r is not None and r[0] == 0 for r in raised)  # the first call after the failure, every rank
    assert all("shape key 2" in r[1] for r in raised)
    assert all(r.value["keys"] == [4, 8] for r in results)  # keys captured before the failure replay


@pytest.mark.cuda
@pytest.mark.parametrize("backend", ["full", "breakable"])
def test_background_capture_on_cuda_captures_thread_local_and_equals_eager(cuda_device, backend):
    """On CUDA (the stand-in on this machine, enforcing CUDAGraph.cpp's rules): the background thread
    captures every key in ``thread_local`` mode, calls are served meanwhile, and results equal eager."""
    step = Step()
    runner = gr.GraphRunner(
        step,
        inputs={"x": gr.BatchInput(trailing=(D,), dtype=torch.float32)},
        buckets=BUCKETS,
        backend=backend,
        device=cuda_device,
        progress=False,
    )
    modes = []
    real = cuda_device.capture

    def capture(graph, stream=None, capture_error_mode="global", pool=None):
        modes.append(capture_error_mode)
        return real(graph, stream=stream, capture_error_mode=capture_error_mode, pool=pool)

    cuda_device.capture = capture
    runner.capture(background=True)
    dev = cuda_device.torch_device
    for x in batches(8):
        torch.testing.assert_close(runner(x=x.to(dev)).cpu(), step.eager(x), rtol=1e-5, atol=1e-6)
    assert runner.wait_captured(timeout=60) is not None
    for x in batches(8, seed=4):
        torch.testing.assert_close(runner(x=x.to(dev)).cpu(), step.eager(x), rtol=1e-5, atol=1e-6)
    assert sorted(runner.captured_keys) == BUCKETS
    assert modes and set(modes) == {"thread_local"}
    assert runner.backend.capture_error_mode == "global"  # restored after the background capture
    runner.cleanup()


class RowCache:
    """A decode step over state indexed by batch row (row ``i`` is request ``i``'s): it adds each
    row's token at its position and returns the sum of the row so far. A background capture's
    warmups run it on padding (issue 42 item 3: never on what the last call left), whose token pad
    is 1.0 here, so they add to every row's position 0 again."""

    def __init__(self, rows: int = 8, length: int = 16) -> None:
        self.cache = torch.zeros(rows, length)

    def __call__(self, tok, pos):
        rows = torch.arange(tok.shape[0])
        self.cache.index_put_((rows, pos), tok, accumulate=True)
        return self.cache[: tok.shape[0]].sum(-1) * 1.0


def _serve_row_cache(monkeypatch=None):
    step, ref = RowCache(), RowCache()
    runner = gr.GraphRunner(
        step,
        inputs={
            "tok": gr.BatchInput(trailing=(), dtype=torch.float32, pad=1.0),
            "pos": gr.BatchInput(trailing=(), dtype=torch.long, bounds=(0, 15)),
        },
        buckets=BUCKETS,
        backend="full",
        progress=False,
        checks=("drift",),
    )
    gate = threading.Event()
    runner.capturer.background_gate = gate  # the requests' first tokens land before any capture
    runner.capture(background=True)
    outs, want = [], []
    for p in range(12):  # 6 requests decode 12 tokens; capture runs between their steps
        tok = torch.arange(1, 7, dtype=torch.float32) * (p + 1)
        pos = torch.full((6,), p)
        outs.append(runner(tok=tok, pos=pos).clone())
        want.append(ref(tok, pos))
        if p == 0:
            gate.set()
        time.sleep(0.01)
    runner.wait_captured(timeout=60)
    return outs, want


def test_background_capture_puts_back_what_its_warmups_wrote():
    """The capture's warmups run on padding (position 0 of rows 0..b-1, every request's first token):
    put back after each key, the requests' results equal the eager reference at every step."""
    outs, want = _serve_row_cache()
    for got, ref in zip(outs, want):
        assert torch.equal(got, ref)


def test_negative_control_without_put_back_the_capture_corrupts_serving_state(monkeypatch):
    import graphrunner.background as background

    monkeypatch.setattr(background.PutBack, "end", lambda self, cap: None)
    outs, want = _serve_row_cache()
    assert any(not torch.equal(got, ref) for got, ref in zip(outs, want))


def _write_during_a_capture(use_hold: bool) -> float:
    """Write one cache cell from the serving thread while the background thread captures a key: a
    cell the capture writes too (its warmups run on padding: position 0 of every row)."""
    step = RowCache()
    inside, release = threading.Event(), threading.Event()
    real = step.__call__

    def slow_step(tok, pos):
        out = real(tok, pos)
        if threading.current_thread().name == "graphrunner-background-capture" and not inside.is_set():
            inside.set()  # the first warmup of the first key wrote the cache (the put-back took its copy)
            release.wait(5)
        return out

    runner = gr.GraphRunner(
        slow_step,
        inputs={
            "tok": gr.BatchInput(trailing=(), dtype=torch.float32, pad=1.0),
            "pos": gr.BatchInput(trailing=(), dtype=torch.long, bounds=(0, 15)),
        },
        buckets=BUCKETS,
        backend="full",
        progress=False,
        checks=("drift",),
    )
    runner.capture(background=True)
    assert inside.wait(10)

    def write():
        step.cache[5, 0] = 42.0  # a prefill of request 5, outside the runner's calls

    if use_hold:
        threading.Timer(0.05, release.set).start()
        with runner.hold():  # waits for the key being captured, keeps the next one back
            write()
    else:
        write()
        release.set()
    runner.wait_captured(timeout=60)
    return float(step.cache[5, 0])


def test_hold_keeps_a_write_outside_the_runner_from_being_put_back():
    assert _write_during_a_capture(use_hold=True) == 42.0


def test_negative_control_a_write_during_a_capture_without_hold_is_put_back():
    assert _write_during_a_capture(use_hold=False) == 0.0  # the key's put-back restored the cell
