"""Collectives inside a tape capture are recorded and re-issued at replay (2 gloo ranks)."""

import pytest
import torch
from mp_util import assert_all_ok, format_results, run_ranks

pytestmark = [pytest.mark.multirank, pytest.mark.slow]  # slow: spawns rank processes (-m "not slow" skips it)


def _worker(rank, world):
    import torch.distributed as dist

    from graphrunner.tape import TapeGraph, tape_graph

    torch.manual_seed(rank)
    w = torch.randn(4, 4)
    x = torch.randn(2, 4)  # static input
    gathered = torch.empty(2 * world, 4)  # static output buffer (external)
    inplace = torch.zeros(4)  # external reduced in place

    def step():
        h = x @ w
        dist.all_reduce(h)
        inplace.copy_(x[0])
        dist.all_reduce(inplace)
        dist.all_gather_into_tensor(gathered, h * (rank + 1))
        return h.relu() + gathered.sum(0)

    results = []
    with torch.inference_mode():
        g = TapeGraph()
        with tape_graph(g):
            out = step()
        ok_undo = bool(torch.equal(inplace, torch.zeros(4)))
        for i in range(3):
            x.copy_(torch.randn(2, 4) + i)
            g.replay()
            got = (out.clone(), inplace.clone(), gathered.clone())
            ref = step()  # eager, same inputs
            results.append(torch.equal(got[0], ref) and torch.equal(got[1], inplace) and torch.equal(got[2], gathered))
            # negative control: the reduced result differs from the local one
            results.append(not torch.equal(got[1], x[0]))
    return ok_undo, results


def test_all_reduce_and_all_gather_replay_matches_eager():
    res = run_ranks(_worker, 2, timeout=60)
    assert_all_ok(res)
    for r in res:
        ok_undo, results = r.value
        assert ok_undo, f"rank {r.rank}: capture left its write to an external in place\n{format_results(res)}"
        assert len(results) == 6 and all(results), f"rank {r.rank}: {results}"
