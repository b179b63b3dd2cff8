"""Ranks out of step around a background capture (issue 34 item 5), on real gloo ranks: every rank
raises a clear error, serving goes on with the keys already captured, every process exits normally."""

from __future__ import annotations

import contextlib
import time

import pytest
import torch
from mp_util import run_ranks

import graphrunner as gr
from graphrunner.errors import AgreementError

D, TIMEOUT = 4, 20.0
W = torch.randn(D, D, generator=torch.Generator().manual_seed(0)) / 3


def _runner():
    import torch.distributed as dist

    def step(x):  # a collective inside the step: captures and replays must pair across ranks
        y = torch.tanh(x @ W)
        dist.all_reduce(y)
        return y

    backend = gr.backends.FullGraphBackend(group=gr.TorchDistGroup(timeout=TIMEOUT))
    return gr.GraphRunner(step, {"x": gr.BatchInput(trailing=(D,))}, [1, 2, 4, 8], backend=backend, progress=False)


def _want(x, world):
    return torch.tanh(x @ W) * world  # every rank passes the same x


def _wait_on_one_rank(rank, world):
    runner = _runner()
    runner.capture(background=True)
    log, served = [], 0
    t0 = time.monotonic()
    while served < 8:
        if served == 2 and rank == 0 and not log.count("waited"):
            runner.wait_captured(timeout=30)  # rank 0 alone: its capture meets rank 1's next call
            log.append("waited")
        x = torch.full((3, D), float(served + 1))
        try:
            out = runner(x=x)
        except AgreementError as exc:
            assert exc.collectives is not None  # the channel: this call happened on no rank: retry it
            log.append("AgreementError")
            continue
        except gr.CaptureError as exc:
            log.append("CaptureError")  # the failed background capture, on every rank at the same call
            assert "background capture failed" in str(exc)
            continue
        torch.testing.assert_close(out, _want(x, world), rtol=1e-5, atol=1e-5)
        served += 1
        log.append("ok")
    return {"log": log, "keys": sorted(runner.captured_keys), "seconds": time.monotonic() - t0}


@pytest.mark.slow
def test_wait_captured_on_one_rank_raises_on_every_rank_and_serving_goes_on():
    res = run_ranks(_wait_on_one_rank, world_size=2, timeout=120)
    for r in res:
        assert r.ok and r.exitcode == 0 and not r.timed_out, r
        # not a timing claim: TIMEOUT is the group's collective deadline; a rank that took longer than it
        # had a collective wait out its deadline instead of pairing (the mispairing was not found in it)
        assert r.value["seconds"] < TIMEOUT  # no collective waited for its timeout
        assert r.value["log"].count("ok") == 8 and r.value["log"].count("CaptureError") == 1, r.value
    assert "AgreementError" in res[1].value["log"]  # the serving rank's call met rank 0's capture
    assert res[0].value["keys"] == res[1].value["keys"]  # the keys captured before it replay on both


def _background_and_blocking(rank, world):
    runner = _runner()
    t0 = time.monotonic()
    try:
        if rank == 0:
            runner.capture(background=True)
            runner(x=torch.ones(3, D))
        else:
            runner.capture()
    except gr.GraphRunnerError as exc:
        return {"type": type(exc).__name__, "message": str(exc), "seconds": time.monotonic() - t0}
    return {"type": None, "seconds": time.monotonic() - t0}


@pytest.mark.slow
def test_background_capture_on_one_rank_and_blocking_on_the_other_raise_on_both():
    res = run_ranks(_background_and_blocking, world_size=2, timeout=120)
    for r in res:
        assert r.ok and r.exitcode == 0 and not r.timed_out, r
        # < TIMEOUT (the collective deadline): the channel found the mismatch, no deadline expired
        assert r.value["type"] == "AgreementError" and r.value["seconds"] < TIMEOUT, r.value
        assert "out of step" in r.value["message"]


def _calls_inside_hold(rank, world, stale_hold):
    import threading

    from graphrunner import runner as runner_module

    if stale_hold:  # the negative control: hold() takes the lock before a granted key is captured

        @contextlib.contextmanager
        def stale(server):
            with server.background.call():
                yield

        runner_module.hold_background = stale
    runner = _runner()
    runner.capture(background=True)
    outs = []

    def serve():  # as gr.hf's engine: every call inside hold() (the step's other work beside no capture)
        for i in range(6):
            with runner.hold():
                x = torch.full((3, D), float(i + 1))
                outs.append((x, runner(x=x).clone()))  # the next call overwrites the output

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    # a deadlock detector, not a timing claim: far above six calls and four keys (about 2.5 s); the negative
    # control, which deadlocks, is given 8 s of it, well above that too
    t.join(8.0 if stale_hold else TIMEOUT)
    if t.is_alive():
        return {"stuck": True}
    for x, out in outs:
        torch.testing.assert_close(out, _want(x, world), rtol=1e-5, atol=1e-5)
    assert runner.wait_captured(timeout=TIMEOUT) is not None
    return {"stuck": False, "keys": sorted(runner.captured_keys), "agreement_s": runner.stats.agreement_seconds}


@pytest.mark.slow
@pytest.mark.parametrize("stale_hold", [False, True], ids=["hold", "negative_control_stale_hold"])
def test_calls_inside_hold_on_several_ranks_are_served_while_keys_are_granted(stale_hold):
    res = run_ranks(_calls_inside_hold, world_size=2, timeout=120, args=(stale_hold,))
    for r in res:
        assert r.ok and r.exitcode == 0 and not r.timed_out, r
    if stale_hold:  # a call in hold() waits for the key its grant handed the capture, which waits for the lock
        assert all(r.value["stuck"] for r in res)
    else:
        assert not any(r.value["stuck"] for r in res)
        assert res[0].value["keys"] == res[1].value["keys"] == [1, 2, 4, 8]
        assert all(r.value["agreement_s"] > 0 for r in res)  # six calls' agreements, counted in the stats


def _idle_ticks(rank, world, rows):
    """Calls of ``rows`` rows (0: an idle tick) on every rank, 0.1 s apart, until every key replays, with the
    capture's share 0.01 (a rest of 99 times a key's capture while calls come); how many calls that took."""
    runner = _runner()
    runner.capture(background=True, share=0.01)
    calls, t0 = 0, time.monotonic()
    while len(runner.captured_keys) < 4 and time.monotonic() - t0 < 60:
        x = torch.full((rows, D), 1.0)
        out = runner(x=x)
        assert out.shape == (rows, D)
        if rows:
            torch.testing.assert_close(out, _want(x, world), rtol=1e-5, atol=1e-5)
        calls += 1
        time.sleep(0.1)
    return {"keys": sorted(runner.captured_keys), "calls": calls}


@pytest.mark.slow
def test_idle_calls_on_every_rank_grant_a_key_each_without_the_captures_rest():
    """An idle server's ticks (calls without rows on every rank) grant the keys: each grants the next, captured
    before the next call, so the 4 keys replay after 5 calls, the share's rest not applied (an idle call is not
    busy). The control: the same calls with a row each are busy, and the rest (99 times a key's capture) holds
    the grants back for several calls per key."""
    idle = run_ranks(_idle_ticks, world_size=2, timeout=120, args=(0,))
    busy = run_ranks(_idle_ticks, world_size=2, timeout=120, args=(1,))
    for r in idle + busy:
        assert r.ok and r.exitcode == 0 and not r.timed_out, r
    assert [r.value for r in idle] == [{"keys": [1, 2, 4, 8], "calls": 5}] * 2
    assert busy[0].value["keys"] == [1, 2, 4, 8] and busy[0].value["calls"] == busy[1].value["calls"] > 8
