"""All ranks replay the same bucket: a tensor-parallel MLP on 3 gloo ranks.

Each rank holds a shard of the MLP weights and all-reduces its partial result
inside the captured step (so the collective is part of the graph). Every rank
draws its own random local batch size per step. With agreement on, every rank
replays the same bucket (or falls back together, padded to the agreed batch)
and equals an eager single-process reference. Negative control: with
``runner.agree_bucket = False`` (unsafe, testing only) and a step without collectives,
the ranks are observed choosing different buckets.
"""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
from mp_util import CountingGroup, assert_all_ok, run_ranks  # noqa: E402

pytestmark = pytest.mark.multirank

WORLD = 3
D, H = 8, 12  # H is split into WORLD shards
BUCKETS = [1, 2, 4, 8]
STEPS = 30


def _worker(rank, world, steps):
    import random

    import torch
    import torch.distributed as dist

    from graphrunner.backends import BreakableGraphBackend, FullGraphBackend
    from graphrunner.breakable import no_graph
    from graphrunner.group import TorchDistGroup
    from graphrunner.runner import BatchInput, GraphRunner

    gen = torch.Generator().manual_seed(0)  # the same full weights on every rank
    w1_full = torch.randn(D, H, generator=gen) / 4
    w2_full = torch.randn(H, D, generator=gen) / 4
    shard = slice(rank * H // world, (rank + 1) * H // world)
    w1, w2 = w1_full[:, shard].contiguous(), w2_full[shard].contiguous()

    @no_graph
    def act(h):  # an eager break in the breakable backend, captured in the full one
        return torch.relu(h)

    def tp_mlp(x):
        part = act(x @ w1) @ w2
        dist.all_reduce(part)  # inside the captured step: recorded and re-issued at replay
        return part

    shards = [slice(r * H // world, (r + 1) * H // world) for r in range(world)]

    def batch(step, r):  # every rank can regenerate every rank's input of a step
        n = random.Random(10_000 * step + r).randint(1, BUCKETS[-1] + 2)  # 9, 10 force a joint fallback
        return torch.randn(n, D, generator=torch.Generator().manual_seed(10_000 * step + r))

    def reference(step, r):
        # Eager single-process reference of the tensor-parallel step: row i of
        # the all-reduced result sums every rank's partial product for its row i
        # (ranks with fewer rows contribute their zero padding, i.e. nothing).
        xs = [batch(step, q) for q in range(world)]
        rows_ = max(x.shape[0] for x in xs)
        acc = torch.zeros(rows_, D)
        for q, x in enumerate(xs):
            xp = torch.zeros(rows_, D)
            xp[: x.shape[0]] = x
            acc += torch.relu(xp @ w1_full[:, shards[q]]) @ w2_full[shards[q]]
        return acc[: xs[r].shape[0]]

    inputs = {"x": BatchInput(trailing=(D,), dtype=torch.float32, pad=0.0)}
    result = {}
    for name, cls in (("full", FullGraphBackend), ("breakable", BreakableGraphBackend)):
        group = CountingGroup(TorchDistGroup(timeout=30))
        backend = cls(device="tape", group=group, warmups=1)
        runner = GraphRunner(tp_mlp, inputs, BUCKETS, backend=backend, group=group, progress=False)
        report = runner.capture()
        before = dict(group.counts)
        rows = []
        for step in range(steps):
            x = batch(step, rank)
            n = x.shape[0]
            out = runner(x=x)
            ref = reference(step, rank)
            # Not bit-exact: gloo's all-reduce adds the partial products in its
            # own order, the reference in rank order.
            ok = out.shape == ref.shape and torch.allclose(out, ref, rtol=1e-5, atol=1e-6)
            # Negative control for the reference: this rank's partial product alone differs.
            local_only = torch.relu(x @ w1) @ w2
            ok = ok and not torch.allclose(local_only, ref, rtol=1e-5, atol=1e-6)
            rows.append((n, runner.stats.last_bucket, runner.bucket_for(n), bool(ok)))
        traffic = {k: group.counts[k] - before[k] for k in group.counts}
        result[name] = {
            "rows": rows,
            "traffic": traffic,
            "segments": [(b.num_segments, b.num_breaks) for b in report.buckets],
            "fallbacks": runner.stats.fallbacks,
        }

    # Negative control: no agreement, a step without collectives (so divergent
    # buckets cannot hang), same kind of random local batches.
    group = CountingGroup(TorchDistGroup(timeout=30))
    backend = FullGraphBackend(device="tape", group=group, warmups=1)
    runner = GraphRunner(lambda x: x * 2.0, inputs, BUCKETS, backend=backend, group=group, progress=False)
    runner.agree_bucket = False
    runner.capture()
    before = dict(group.counts)
    rng = random.Random(1000 * rank + 17)
    chosen = []
    for _ in range(steps):
        n = rng.randint(1, BUCKETS[-1])
        out = runner(x=torch.full((n, D), float(n)))
        assert torch.equal(out, torch.full((n, D), 2.0 * n))
        chosen.append(runner.stats.last_bucket)
    result["unagreed"] = {"chosen": chosen,
                          "traffic": {k: group.counts[k] - before[k] for k in group.counts}}
    dist.barrier()
    return result


@pytest.fixture(scope="module")
def results():
    res = run_ranks(_worker, world_size=WORLD, args=(STEPS,), timeout=150)
    assert_all_ok(res)
    return [r.value for r in res]


@pytest.mark.parametrize("backend", ["full", "breakable"])
def test_every_rank_replays_the_same_bucket_and_matches_eager(results, backend):
    per_rank = [r[backend]["rows"] for r in results]
    for rank, rows in enumerate(per_rank):
        bad = [i for i, row in enumerate(rows) if not row[3]]
        assert not bad, f"rank {rank}: replay != eager reference at steps {bad}: {[rows[i] for i in bad]}"
    for step in range(STEPS):
        chosen = {rows[step][1] for rows in per_rank}
        assert len(chosen) == 1, f"step {step}: ranks chose buckets {[rows[step][1] for rows in per_rank]}"
        agreed_n = max(rows[step][0] for rows in per_rank)
        want = next((b for b in BUCKETS if b >= agreed_n), None)
        assert chosen == {want}, f"step {step}: local batches {[rows[step][0] for rows in per_rank]}"
    # Agreement mattered: on some step a rank's own batch would have picked another bucket.
    assert any(row[1] != row[2] for rows in per_rank for row in rows)
    # Joint eager fallbacks happened (and, with the all-reduce inside, matched eager).
    assert all(r[backend]["fallbacks"] > 0 for r in results)
    assert len({r[backend]["fallbacks"] for r in results}) == 1


@pytest.mark.parametrize("backend", ["full", "breakable"])
def test_each_call_makes_exactly_one_agreement_collective(results, backend):
    for r in results:
        assert r[backend]["traffic"] == {"barrier": 0, "all_max": 0, "all_min": 0, "all_max_vector": STEPS}


def test_breakable_capture_has_the_break(results):
    for r in results:
        assert set(r["breakable"]["segments"]) == {(2, 1)}
        assert set(r["full"]["segments"]) == {(1, 0)}


def test_negative_control_without_agreement_ranks_diverge(results):
    chosen = [r["unagreed"]["chosen"] for r in results]
    diverged = [s for s in range(STEPS) if len({c[s] for c in chosen}) > 1]
    assert diverged, "with agree_bucket=False the ranks should have chosen different buckets:\n" + repr(chosen)
    for r in results:
        assert r["unagreed"]["traffic"] == {"barrier": 0, "all_max": 0, "all_min": 0, "all_max_vector": 0}
