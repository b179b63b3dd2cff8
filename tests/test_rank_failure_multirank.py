"""A failure on one rank is an error on every rank, never an abort (issue 43 items 3 and 4), on real gloo
ranks:

- a rank whose background capture fails alone (its step raises, out of memory, while its peer is inside
  the step's own ``all_reduce``) reports it out of band and aborts the process group: every rank raises
  the same ``RankFailedError`` (a ``CaptureError``) naming the failed rank and its cause at the same call,
  the runner stops on every rank, every process exits 0. Negative control: the old path (no report, no
  abort) kills a process with a signal (gloo's "Received data size doesn't match expected size") or hangs;
- a background capture thread never outlives its runner inside a collective: the out-of-step
  ``wait_captured()`` of issue 43 exits 0 on both ranks (full interpreter shutdown), and a runner dropped
  while its thread waits inside a collective for a peer that never comes ends that thread first
  (negative control: without it the thread is still inside the collective).

The "20 runs in a row" of the issue are run by hand (``python tests/test_rank_failure_multirank.py 20``)."""

from __future__ import annotations

import gc
import os
import sys
import threading
import time

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
from mp_util import format_results, run_ranks  # noqa: E402

import graphrunner as gr  # noqa: E402

pytestmark = [pytest.mark.multirank, pytest.mark.slow]  # slow: spawns rank processes

D, TIMEOUT = 4, 20.0
W = torch.randn(D, D, generator=torch.Generator().manual_seed(0)) / 3
THREAD = "graphrunner-background-capture"


def _tp_runner(rank):
    """The issue's tensor-parallel step on the breakable backend, buckets 1, 2, 4; rank 1's step runs out of
    memory when its background thread captures key 2."""
    return _oom_runner(rank, lambda x: x.shape[0] == 2 and threading.current_thread().name == THREAD)


def _fail_in_background(rank, world, old):
    from graphrunner.errors import RankFailedError

    if old:  # the old path: the failed rank sends its next frame as if nothing happened
        import graphrunner.background as background
        import graphrunner.channel as channel

        channel.fail_ranks = lambda group, exc, where, alone=False: exc
        background.fail_ranks = channel.fail_ranks  # imported by name there
    runner = _tp_runner(rank)
    runner.capture(background=True)
    log, messages = [], []
    t0 = time.monotonic()
    for i in range(6):
        x = torch.full((3, D), float(i + 1))  # key 4 first, then key 2
        try:
            out = runner(x=x)
        except RankFailedError as exc:
            log.append("RankFailedError")
            messages.append(str(exc))
            continue
        except Exception as exc:  # noqa: BLE001 - anything else is a failure of the test
            log.append(f"{type(exc).__name__}: {exc}"[:300])
            continue
        torch.testing.assert_close(out, (x @ W) * world + 1, rtol=1e-5, atol=1e-5)
        log.append("ok")
    alive = [t.name for t in threading.enumerate() if t.name == THREAD]
    return {"log": log, "messages": messages, "seconds": time.monotonic() - t0, "thread_alive": alive}


@pytest.mark.timeout(120)
def test_a_rank_whose_background_capture_fails_alone_makes_every_rank_raise_and_exit_normally():
    res = run_ranks(_fail_in_background, world_size=2, args=(False,), timeout=90)
    for r in res:
        assert r.ok and r.exitcode == 0 and not r.timed_out, format_results(res)
    logs = [r.value["log"] for r in res]
    # key 4 replays at call 2; rank 1 fails capturing key 2 after call 2; every rank raises at call 3 and the
    # runner stops on every rank (the process group is aborted): every later call raises the same error
    assert logs[0] == logs[1] == ["ok", "ok"] + ["RankFailedError"] * 4, logs
    first = [r.value["messages"][0] for r in res]
    assert first[0] == first[1], first  # the same error on every rank
    assert first[0].startswith("rank 1 of 2 failed alone in its background capture"), first[0]
    assert "OutOfMemoryError" in first[0] and "simulated on rank 1" in first[0], first[0]
    assert "destroy_process_group" in first[0]  # what to do
    for r in res:
        # TIMEOUT is the group's collective deadline: under it, rank 0's pending all_reduce ended because rank 1
        # aborted the group, not because a deadline expired
        assert r.value["seconds"] < TIMEOUT, r.value
        assert r.value["thread_alive"] == [], r.value


def test_negative_control_without_the_report_and_the_abort_a_process_dies_or_hangs():
    # the old path: rank 1's next call sends its agreement frame while rank 0 is inside the step's
    # all_reduce; gloo aborts a process ("Received data size doesn't match expected size", SIGABRT),
    # or, where the sizes happen to pair, a rank waits out its deadline: never every rank raising alike
    res = run_ranks(_fail_in_background, world_size=2, args=(True,), timeout=60)
    died = [r.rank for r in res if r.timed_out or (r.exitcode is not None and r.exitcode < 0)]
    same = (
        all(r.ok for r in res)
        and res[0].value["log"] == res[1].value["log"]
        and all("RankFailedError" in r.value["log"] for r in res)
    )
    assert died or not same, format_results(res)
    assert died, "expected gloo to abort a process or a rank to hang on the old path:\n" + format_results(res)


# ------------------------------------------------------------------------- item 4: never outlive the runner
def _plain_runner():
    import torch.distributed as dist

    def step(x):
        h = x @ W
        dist.all_reduce(h)
        return h + 1

    backend = gr.backends.BreakableGraphBackend(group=gr.TorchDistGroup(timeout=TIMEOUT))
    return gr.GraphRunner(step, {"x": gr.BatchInput(trailing=(D,))}, [1, 2, 4], backend=backend, progress=False)


def _wait_on_one_rank_and_exit(rank, world):
    """Issue 43's reproduction 2: rank 0 calls wait_captured() after capture(background=True), rank 1 serves."""
    # torch._dynamo imported up front (as an engine has): the thread's one-time import is then instant and the
    # exit abort of the old path showed in about 1 run in 5 (6 of 30 by hand), else about 1 in 20
    import torch._dynamo  # noqa: F401

    runner = _plain_runner()
    runner.capture(background=True)
    try:
        if rank == 0:
            got = runner.wait_captured(timeout=30)
            bg = runner.server.last_background or runner.server.background
            return {"wait": repr(got), "error": type(bg.error).__name__ if bg is not None else None}
        runner(x=torch.ones(3, D))
        return {"served": True}
    except gr.GraphRunnerError as exc:
        return {"raised": type(exc).__name__}


@pytest.mark.timeout(120)
def test_wait_captured_on_one_rank_raises_on_both_and_both_processes_exit_normally():
    # spawn: a full interpreter shutdown (atexit, finalizers, static destructors) after the worker returns
    res = run_ranks(_wait_on_one_rank_and_exit, world_size=2, timeout=90, start_method="spawn")
    for r in res:
        assert r.ok and r.exitcode == 0 and not r.timed_out, format_results(res)
    assert res[0].value == {"wait": "None", "error": "AgreementError"}, res[0].value  # its capture met rank 1's call
    assert res[1].value == {"raised": "AgreementError"}, res[1].value


def _drop_runner_inside_a_collective(rank, world, old):
    import graphrunner.background as background

    background.END_GRACE = 1.0
    if old:  # the old path: nothing ends the thread when its runner goes away
        background.BackgroundCapture.end = lambda self, why, grace=None: None
    runner = _plain_runner()
    runner.capture(background=True)
    if rank == 1:  # never captures: rank 0's thread waits inside its first collective for a peer that never comes
        time.sleep(8)
        ch = runner.group.channel
        peer = ch.peer_failure()
        del runner
        gc.collect()
        return {"peer": None if peer is None else str(peer)}
    runner.wait_captured(timeout=0.1)  # rank 0 alone: its thread starts the capture's first collective
    deadline = time.monotonic() + 30
    while runner.group.channel.seq < 1 and time.monotonic() < deadline:  # inside it (the sequence counts it)
        time.sleep(0.01)
    time.sleep(0.2)
    inside = [t for t in threading.enumerate() if t.name == THREAD]
    t0 = time.monotonic()
    del runner  # the engine drops its runner (or the interpreter exits)
    gc.collect()
    alive = [t.name for t in threading.enumerate() if t.name == THREAD]
    return {"inside": len(inside), "alive_after_drop": alive, "drop_seconds": time.monotonic() - t0}


@pytest.mark.timeout(120)
def test_a_runner_dropped_while_its_thread_is_inside_a_collective_ends_the_thread_first():
    res = run_ranks(_drop_runner_inside_a_collective, world_size=2, args=(False,), timeout=60)
    for r in res:
        assert r.ok and r.exitcode == 0 and not r.timed_out, format_results(res)
    v0 = res[0].value
    assert v0["inside"] == 1 and v0["alive_after_drop"] == [], v0  # ended before the runner was gone
    assert v0["drop_seconds"] < TIMEOUT, v0  # the grace period, then the abort: not the collective's deadline
    peer = res[1].value["peer"]  # rank 1 learns why rank 0 left, out of band
    assert peer is not None and peer.startswith("rank 0 of 2 failed alone (its runner went away)"), peer


def test_negative_control_without_end_the_thread_outlives_its_runner_inside_a_collective():
    res = run_ranks(_drop_runner_inside_a_collective, world_size=2, args=(True,), timeout=60)
    assert res[0].ok, format_results(res)
    assert res[0].value["inside"] == 1 and res[0].value["alive_after_drop"] == [THREAD], res[0].value
    assert res[1].ok and res[1].value["peer"] is None, format_results(res)


# ------------------------------------------------------------------ the same mechanism: capture() and a call
def _oom_runner(rank, fail):
    """The tensor-parallel step; rank 1's step runs out of memory when ``fail(x)``."""
    import torch.distributed as dist

    def step(x):
        if rank == 1 and fail(x):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (simulated on rank 1)")
        h = x @ W
        dist.all_reduce(h)
        return h + 1

    backend = gr.backends.BreakableGraphBackend(group=gr.TorchDistGroup(timeout=TIMEOUT))
    return gr.GraphRunner(step, {"x": gr.BatchInput(trailing=(D,))}, [1, 2, 4], backend=backend, progress=False)


def _raised(exc):
    return {"type": type(exc).__name__, "message": str(exc), "notes": list(getattr(exc, "__notes__", []))}


def _fail_in_blocking_capture(rank, world):
    runner = _oom_runner(rank, lambda x: x.shape[0] == 2)  # rank 1 fails capturing key 2, rank 0 goes on
    t0 = time.monotonic()
    try:
        runner.capture()
    except Exception as exc:  # noqa: BLE001
        return {**_raised(exc), "seconds": time.monotonic() - t0}
    return {"type": None, "seconds": time.monotonic() - t0}


def test_a_blocking_capture_that_fails_on_one_rank_makes_its_peer_raise_rank_failed_error_at_once():
    res = run_ranks(_fail_in_blocking_capture, world_size=2, timeout=90)
    for r in res:
        assert r.ok and r.exitcode == 0 and not r.timed_out, format_results(res)
        assert r.value["seconds"] < TIMEOUT, r.value  # not the deadline: the abort ended rank 0's all_reduce
    v0, v1 = res[0].value, res[1].value
    assert v1["type"] == "CaptureError" and "OutOfMemoryError" in v1["message"], v1  # its own error ...
    assert any("failed alone" in n and "RankFailedError" in n for n in v1["notes"]), v1  # ... saying so
    assert v0["type"] == "RankFailedError", v0
    assert v0["message"].startswith("rank 1 of 2 failed alone in its capture") and "OutOfMemoryError" in v0["message"]


def _fail_in_a_call(rank, world):
    state = {"fail": False}
    runner = _oom_runner(rank, lambda x: state["fail"])
    runner.capture()
    log = []
    for i in range(4):
        state["fail"] = i == 1
        x = torch.full((5, D), float(i + 1))  # 5 rows: no key, the eager fallback runs the step (and its all_reduce)
        try:
            out = runner(x=x)
        except Exception as exc:  # noqa: BLE001
            log.append(_raised(exc))
            continue
        torch.testing.assert_close(out, (x @ W) * world + 1, rtol=1e-5, atol=1e-5)
        log.append("ok")
    return log


def test_a_step_that_raises_on_one_rank_in_a_call_keeps_its_type_there_and_stops_every_rank():
    res = run_ranks(_fail_in_a_call, world_size=2, timeout=90)
    for r in res:
        assert r.ok and r.exitcode == 0 and not r.timed_out, format_results(res)
    l0, l1 = res[0].value, res[1].value
    assert l0[0] == l1[0] == "ok"
    assert l1[1]["type"] == "OutOfMemoryError", l1[1]  # the user's exception keeps its type on the failed rank
    assert any("RankFailedError" in n for n in l1[1]["notes"]), l1[1]
    assert l0[1]["type"] == "RankFailedError", l0[1]
    assert l0[1]["message"].startswith("rank 1 of 2 failed alone in the step's eager fallback"), l0[1]
    for log in (l0, l1):  # the runner stopped on every rank: the same error at once
        assert [e["type"] for e in log[2:]] == ["RankFailedError"] * 2, log
        assert log[2]["message"] == l0[1]["message"]


if __name__ == "__main__":  # the "20 runs in a row", by hand: python tests/test_rank_failure_multirank.py 20
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 20
    bad = 0
    for i in range(n):
        t0 = time.monotonic()
        for name in (
            "test_a_rank_whose_background_capture_fails_alone_makes_every_rank_raise_and_exit_normally",
            "test_wait_captured_on_one_rank_raises_on_both_and_both_processes_exit_normally",
        ):
            try:
                globals()[name]()
                ok = "ok"
            except AssertionError as exc:
                bad += 1
                ok = f"FAILED: {str(exc)[:2000]}"
            print(f"run {i + 1}/{n} {name[:60]}: {ok} ({time.monotonic() - t0:.1f}s)", flush=True)
    print(f"{n - bad}/{n} runs passed both tests" if bad == 0 else f"{bad} failures in {n} runs", flush=True)
    sys.exit(1 if bad else 0)


# ------------------------------------------- issue 52 item 7 (2): a step with no collective of its own
def _local_runner(rank):
    """A step without a collective of its own (every collective of the capture is the channel's); rank
    1's step runs out of memory when its background thread captures key 2."""

    def step(x):
        if rank == 1 and x.shape[0] == 2 and threading.current_thread().name == THREAD:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (simulated on rank 1)")
        return torch.tanh(x @ W) + 1

    backend = gr.backends.BreakableGraphBackend(group=gr.TorchDistGroup(timeout=TIMEOUT))
    return gr.GraphRunner(step, {"x": gr.BatchInput(trailing=(D,))}, [1, 2, 4], backend=backend, progress=False)


def _fail_one_key_and_go_on(rank, world, old):
    import torch.distributed as dist

    import graphrunner.background as background

    if old:  # the old path: a key's failure on one rank is never agreed on, fail_ranks ends the group
        background.agree_key_end = lambda group, key, failed: 0  # no collective after a key, as before
        background.StepCollectives.none = property(lambda self: False)  # a failure goes to fail_ranks
    runner = _local_runner(rank)
    runner.capture(background=True)
    log, messages = [], []
    t0 = time.monotonic()
    for i in range(10):
        n = 3 if i < 4 else (3, 2, 1)[i % 3]  # key 4 first (captured, replayed), then key 2 (fails on rank 1)
        x = torch.full((n, D), float(i + 1)) / 7
        try:
            out = runner(x=x)
        except gr.CaptureError as exc:
            log.append(type(exc).__name__)
            messages.append(str(exc))
            continue
        except Exception as exc:  # noqa: BLE001 - anything else is a failure of the test
            log.append(f"{type(exc).__name__}: {exc}"[:300])
            continue
        torch.testing.assert_close(out, torch.tanh(x @ W) + 1, rtol=1e-5, atol=1e-5)
        log.append("ok")
    group_ok = False
    if runner.group.channel.failure is None:  # not aborted (a collective on an aborted gloo group aborts the process)
        t = torch.full((2,), float(rank + 1))
        dist.all_reduce(t)  # the process group is still usable
        group_ok = t.tolist() == [3.0, 3.0]
    alive = [th.name for th in threading.enumerate() if th.name == THREAD]
    stats = runner.stats
    return {
        "log": log,
        "messages": messages,
        "seconds": time.monotonic() - t0,
        "thread_alive": alive,
        "group_ok": group_ok,
        "keys": sorted(runner.captured_keys),
        "replays": dict(stats.replays),
        "fallbacks": stats.fallbacks,
    }


@pytest.mark.timeout(120)
def test_a_key_whose_background_capture_fails_on_one_rank_stays_eager_on_every_rank_and_serving_goes_on():
    res = run_ranks(_fail_one_key_and_go_on, world_size=2, args=(False,), timeout=90)
    for r in res:
        assert r.ok and r.exitcode == 0 and not r.timed_out, format_results(res)
    v0, v1 = res[0].value, res[1].value
    # key 4 replays from call 2; rank 1's capture of key 2 fails after call 2 (granted there): every rank raises
    # CaptureError at call 3 (not served: retry it), then every later call is served, key 2 and 1 eagerly
    assert v0["log"] == v1["log"] == ["ok", "ok", "CaptureError"] + ["ok"] * 7, (v0["log"], v1["log"])
    assert "OutOfMemoryError" in v1["messages"][0] and "simulated on rank 1" in v1["messages"][0], v1
    assert "rank 1 of 2: its background capture of" in v0["messages"][0], v0["messages"][0]
    assert "RankFailedError" not in v0["messages"][0] + v1["messages"][0]
    for v in (v0, v1):
        assert v["keys"] == [4], v  # the key that failed on rank 1 stays eager on every rank
        assert v["replays"][4] > 0 and v["replays"][2] == v["replays"][1] == 0, v
        assert v["fallbacks"] == v0["fallbacks"] > 0, v
        assert v["group_ok"], v  # the process group was not aborted
        assert v["thread_alive"] == [], v
        assert v["seconds"] < TIMEOUT, v  # no collective waited out its deadline


@pytest.mark.timeout(120)
def test_negative_control_without_the_key_agreement_the_group_ends_and_later_calls_are_refused():
    """What happened before: rank 1's failure went through fail_ranks (reported, the group aborted),
    so every later call on every rank raised RankFailedError: the test above would fail."""
    res = run_ranks(_fail_one_key_and_go_on, world_size=2, args=(True,), timeout=90)
    for r in res:
        assert r.ok and r.exitcode == 0 and not r.timed_out, format_results(res)
    for r in res:
        assert r.value["log"] == ["ok", "ok"] + ["RankFailedError"] * 8, r.value["log"]
        assert not r.value["group_ok"], r.value
