"""One agreement per step with (reqs, draft) keys on 3 gloo ranks.

Every rank draws its own (reqs, draft) sizes per step, as if each rank's
budget had picked its own tier; the step all-reduces inside the graph. With
agreement every call makes exactly one collective (counted), every rank
replays the same key (the smallest covering the element-wise max of the
sizes) or all fall back together, padded to the agreed sizes, and the result
equals an eager reference built from every rank's inputs. One rank's invalid
inputs make every rank raise for that step, and the runner stays usable.
"""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
from mp_util import CountingGroup, assert_all_ok, run_ranks  # noqa: E402

pytestmark = [pytest.mark.multirank, pytest.mark.slow]  # slow: spawns rank processes (-m "not slow" skips it)

WORLD, H, STEPS, BAD_STEP = 3, 4, 24, 7
BUCKETS = {"reqs": [1, 2, 4], "draft": [1, 3]}


def _worker(rank, world):
    import random

    import torch
    import torch.distributed as dist

    import graphrunner as gr
    from graphrunner.errors import GraphRunnerError

    gen = torch.Generator().manual_seed(0)
    shards = [torch.randn(H, generator=gen) for _ in range(world)]  # every rank knows every rank's weights

    @gr.no_graph
    def host(h):
        return h * 1.0

    def step(x):  # cell-independent: real cells never read padding
        part = host(torch.tanh(x * shards[rank]))
        dist.all_reduce(part)
        return part

    def sizes(s, q):
        rnd = random.Random(1000 * s + q)
        r, d = rnd.randint(1, 4), rnd.randint(1, 3)
        return (5 if s % 5 == 4 and q == 0 else r), d  # rank 0's reqs 5 is over the largest bucket: a joint fallback

    def x_of(s, q):
        r, d = sizes(s, q)
        return torch.randn(r, d, H, generator=torch.Generator().manual_seed(1000 * s + q))

    def reference(s):
        xs = [x_of(s, q) for q in range(world)]
        R, Dr = max(x.shape[0] for x in xs), max(x.shape[1] for x in xs)
        acc = torch.zeros(R, Dr, H)
        for q, x in enumerate(xs):
            xp = torch.zeros(R, Dr, H)
            xp[: x.shape[0], : x.shape[1]] = x
            acc += torch.tanh(xp * shards[q])
        r, d = sizes(s, rank)
        return acc[:r, :d], (R, Dr)

    result = {}
    for backend in ("full", "breakable"):
        group = CountingGroup(gr.TorchDistGroup(timeout=30))
        runner = gr.GraphRunner(
            step,
            {"x": gr.BatchInput(trailing=(H,), dims=("reqs", "draft"))},
            BUCKETS,
            backend=backend,
            device="tape",
            group=group,
            warmups=1,
            progress=False,
        )
        runner.capture()
        before = dict(group.counts)
        rows = []
        for s in range(STEPS):
            x = x_of(s, rank)
            if s == BAD_STEP:
                try:
                    runner(x=x.double() if rank == 1 else x)
                except (ValueError, GraphRunnerError) as exc:
                    rows.append(("raised", type(exc).__name__))
                continue
            ref, agreed = reference(s)
            out = runner(x=x)
            ok = out.shape == ref.shape and torch.allclose(out, ref, rtol=1e-5, atol=1e-6)
            # Negative control of the reference: this rank's own part alone is not it.
            ok = ok and not torch.allclose(torch.tanh(x * shards[rank]), ref, rtol=1e-5, atol=1e-6)
            rows.append(
                (tuple(x.shape[:2]), runner.stats.last_bucket, runner.key_for(tuple(x.shape[:2])), agreed, bool(ok))
            )
        result[backend] = {
            "rows": rows,
            "traffic": {k: group.counts[k] - before[k] for k in group.counts},
            "fallbacks": runner.stats.fallbacks,
        }
    dist.barrier()
    return result


@pytest.fixture(scope="module")
def results():
    res = run_ranks(_worker, world_size=WORLD, timeout=150)
    assert_all_ok(res)
    return [r.value for r in res]


@pytest.mark.parametrize("backend", ["full", "breakable"])
def test_every_rank_replays_the_same_key_and_matches_eager(results, backend):
    per_rank = [r[backend]["rows"] for r in results]
    for s in range(STEPS):
        rows = [pr[s] for pr in per_rank]
        if rows[0][0] == "raised":
            continue
        assert all(row[4] for row in rows), f"step {s}: replay != eager reference: {rows}"
        assert len({row[1] for row in rows}) == 1, f"step {s}: ranks chose keys {[row[1] for row in rows]}"
        R, Dr = rows[0][3]
        want = None if R > 4 else (next(b for b in (1, 2, 4) if b >= R), next(b for b in (1, 3) if b >= Dr))
        assert rows[0][1] == want, f"step {s}: sizes {[row[0] for row in rows]}"
    # agreement mattered: some rank's own sizes would have picked another key
    assert any(row[1] != row[2] for pr in per_rank for row in pr if row[0] != "raised" and row[1] is not None)
    fallbacks = {r[backend]["fallbacks"] for r in results}
    assert len(fallbacks) == 1 and fallbacks.pop() > 0  # ranks fell back together


@pytest.mark.parametrize("backend", ["full", "breakable"])
def test_one_collective_per_call(results, backend):
    for r in results:
        assert r[backend]["traffic"] == {"barrier": 0, "all_max": 0, "all_min": 0, "all_max_vector": STEPS}


def test_invalid_inputs_on_one_rank_make_every_rank_raise(results):
    for backend in ("full", "breakable"):
        raised = [r[backend]["rows"][BAD_STEP] for r in results]
        assert raised == [("raised", "GraphRunnerError"), ("raised", "ValueError"), ("raised", "GraphRunnerError")]
