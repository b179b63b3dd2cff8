"""The padding-leak check and debug bounds on 2 gloo ranks: a leak found on one rank only (a rank-dependent step) makes
EVERY rank raise PaddingLeakError at capture, within the group timeout (its verdict is agreed by one
collective per checked key), instead of one rank raising while its peer waits at the next barrier.
Negative control: with the check off both ranks capture, and the leaky rank's sum silently includes
the padding rows."""

from __future__ import annotations

import os
import sys
import time

import pytest

sys.path.insert(0, os.path.dirname(__file__))
from mp_util import assert_all_ok, run_ranks  # noqa: E402

pytestmark = [pytest.mark.multirank, pytest.mark.slow]  # slow: spawns rank processes (-m "not slow" skips it)

TIMEOUT = 20.0


def _worker(rank, world, check):
    import torch

    import graphrunner as gr

    def step(x):
        y = torch.tanh(x + 0.5)
        return y.sum(0, keepdim=True).expand_as(y).contiguous() if rank == 1 else y * 2  # rank 1 leaks

    group = gr.TorchDistGroup(timeout=TIMEOUT)
    runner = gr.GraphRunner(
        step,
        {"x": gr.BatchInput(trailing=(3,))},
        [2, 4],
        backend="full",
        device="tape",
        group=group,
        warmups=1,
        progress=False,
        # no fingerprint: the ranks' graphs differ on purpose; this test is about the leak verdict
        checks=("drift", "padding") if check else ("drift",),
    )
    t0 = time.monotonic()
    try:
        runner.capture()
    except gr.PaddingLeakError as exc:
        return {"raised": str(exc), "seconds": time.monotonic() - t0}
    x = torch.randn(3, 3, generator=torch.Generator().manual_seed(0))
    out = runner(x=x)
    return {"raised": None, "diff": float((out - step(x)).abs().max())}


def test_a_leak_on_one_rank_raises_on_every_rank_and_control():
    res = run_ranks(_worker, world_size=2, args=(True,), timeout=90)
    assert_all_ok(res)
    v0, v1 = res[0].value, res[1].value
    assert v1["raised"] and "output" in v1["raised"] and "bucket 4" in v1["raised"]
    assert v0["raised"] and "another rank found padding leaking" in v0["raised"]
    assert v0["seconds"] < TIMEOUT and v1["seconds"] < TIMEOUT

    res = run_ranks(_worker, world_size=2, args=(False,), timeout=90)
    assert_all_ok(res)
    assert res[0].value == {"raised": None, "diff": 0.0}
    assert res[1].value["raised"] is None and res[1].value["diff"] > 0.1  # silently includes padding


def _debug_worker(rank, world):
    import torch

    import graphrunner as gr

    table = torch.arange(10.0)[:, None].expand(10, 2).contiguous()
    group = gr.TorchDistGroup(timeout=TIMEOUT)
    runner = gr.GraphRunner(
        lambda ids: table[ids] * 2,
        {"ids": gr.BatchInput(dtype=torch.long, bounds=(0, 9))},
        [2, 4],
        backend="full",
        device="tape",
        group=group,
        warmups=1,
        progress=False,
        debug=True,
    )
    runner.capture()
    ids = torch.tensor([1, 12, 2]) if rank == 1 else torch.tensor([1, 2, 3])
    t0 = time.monotonic()
    try:
        runner(ids=ids)
        raised = None
    except (ValueError, gr.GraphRunnerError) as exc:
        raised = f"{type(exc).__name__}: {exc}"
    ok = runner(ids=torch.tensor([4, 5]))  # both ranks still usable, in step
    return {"raised": raised, "seconds": time.monotonic() - t0, "ok": ok[:, 0].tolist()}


def test_debug_bounds_on_one_rank_raise_on_every_rank():
    res = run_ranks(_debug_worker, world_size=2, timeout=90)
    assert_all_ok(res)
    v0, v1 = res[0].value, res[1].value
    assert v1["raised"].startswith("ValueError") and "row 1 holds 12" in v1["raised"]
    assert v0["raised"].startswith("GraphRunnerError") and "another rank passed invalid inputs" in v0["raised"]
    assert v0["ok"] == v1["ok"] == [8.0, 10.0] and v0["seconds"] < TIMEOUT
