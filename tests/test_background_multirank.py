"""Ranks out of step around a background capture (issue 34 item 5), on real gloo ranks: every rank
raises a clear error, serving goes on with the keys already captured, every process exits normally."""

from __future__ import annotations

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
