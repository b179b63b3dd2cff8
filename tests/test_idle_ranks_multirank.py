"""Idle data-parallel ranks join the padded step (issue 24), on 3 real gloo processes.

The step is a tensor-parallel MLP whose partial products are all-reduced inside the
captured graph, like the MoE/MLP collectives that span every data-parallel rank: if one
rank skipped the step, its peers' all-reduce would wait for it. Ranks draw their own batch
sizes per step, including 0: rank 2 is idle every third step, rank 1 for 20 consecutive
steps, and at one step every rank is idle. With agreement every rank, idle ones included,
runs the agreed key (or the joint eager fallback, for batches above the largest bucket),
the idle rank gets 0 rows, and the active ranks' rows equal an eager single-process
reference in which the idle rank contributes nothing. When every rank is idle nobody runs
the step (and nobody hangs).

Negative control: with agreement off (``runner.agree_bucket = False``, unsafe) the idle rank
returns alone without running the step, and its peers' all-reduce fails after the group's
timeout with a clear ``RankTimeoutError`` (naming the replay and the key), not a hang.
"""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
from mp_util import assert_all_ok, run_ranks  # noqa: E402

pytestmark = [pytest.mark.multirank, pytest.mark.slow]  # slow: spawns rank processes (-m "not slow" skips it)

WORLD = 3
D, H = 8, 12
BUCKETS = [1, 2, 4, 8]
STEPS = 36
ALL_IDLE = STEPS - 2  # every rank idle at this step


def idle(step, r):
    return (r == 2 and step % 3 == 0) or (r == 1 and 10 <= step < 30) or step == ALL_IDLE


def _worker(rank, world):
    import datetime
    import random

    import torch
    import torch.distributed as dist

    from graphrunner.backends import BreakableGraphBackend, FullGraphBackend
    from graphrunner.errors import RankTimeoutError
    from graphrunner.group import TorchDistGroup
    from graphrunner.runner import BatchInput, GraphRunner

    gen = torch.Generator().manual_seed(0)
    w1_full = torch.randn(D, H, generator=gen) / 4
    w2_full = torch.randn(H, D, generator=gen) / 4
    shards = [slice(r * H // world, (r + 1) * H // world) for r in range(world)]
    w1, w2 = w1_full[:, shards[rank]].contiguous(), w2_full[shards[rank]].contiguous()

    def tp_mlp(x):
        part = torch.relu(x @ w1) @ w2
        dist.all_reduce(part)  # spans every rank: an idle rank that skipped would leave it waiting
        return part

    def batch(step, r):
        if idle(step, r):
            return torch.zeros(0, D)
        n = random.Random(10_000 * step + r).randint(1, BUCKETS[-1] + 2)  # 9, 10: the joint fallback
        return torch.randn(n, D, generator=torch.Generator().manual_seed(10_000 * step + r))

    def reference(step, r):
        xs = [batch(step, q) for q in range(world)]
        rows = max(x.shape[0] for x in xs)
        acc = torch.zeros(rows, D)
        for q, x in enumerate(xs):
            xp = torch.zeros(rows, D)
            xp[: x.shape[0]] = x
            acc += torch.relu(xp @ w1_full[:, shards[q]]) @ w2_full[shards[q]]
        return acc[: xs[r].shape[0]]

    inputs = {"x": BatchInput(trailing=(D,), dtype=torch.float32, pad=0.0)}
    result = {}
    for name, cls in (("full", FullGraphBackend), ("breakable", BreakableGraphBackend)):
        group = TorchDistGroup(timeout=60)
        runner = GraphRunner(
            tp_mlp, inputs, BUCKETS, backend=cls(device="tape", group=group, warmups=1), group=group, progress=False
        )
        runner.capture()
        rows = []
        for step in range(STEPS):
            x = batch(step, rank)
            calls = runner.stats.calls
            out = runner(x=x)
            ref = reference(step, rank)
            ok = out.shape == ref.shape and torch.allclose(out, ref, rtol=1e-5, atol=1e-6)
            # negative control for the reference: this rank's partial product alone differs (when a
            # peer has rows; by chance a peer's relu may zero its contribution: counted, not required)
            others = any(batch(step, q).shape[0] for q in range(world) if q != rank)
            alone = bool(
                x.shape[0] and others and not torch.allclose(torch.relu(x @ w1) @ w2, ref, rtol=1e-5, atol=1e-6)
            )
            ran = runner.stats.calls - calls  # 1 when this call replayed or fell back (the step ran)
            rows.append((x.shape[0], tuple(out.shape), runner.stats.last_bucket, ran, bool(ok), alone, others))
        result[name] = rows

    # Negative control: no agreement. The idle rank returns alone; its peers' all-reduce times out.
    short = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=4))
    sync = dist.new_group(backend="gloo")

    def lonely(x):
        part = x * 2.0
        dist.all_reduce(part, group=short)
        return part

    group = TorchDistGroup(timeout=60)
    runner = GraphRunner(
        lonely,
        inputs,
        BUCKETS,
        backend=FullGraphBackend(device="tape", group=group, warmups=1),
        group=group,
        progress=False,
    )
    runner.agree_bucket = False
    runner.capture()
    x = torch.zeros(0, D) if rank == 2 else torch.ones(2, D)
    try:
        out = runner(x=x)
        result["unagreed"] = ("returned", tuple(out.shape))
    except RankTimeoutError as exc:
        result["unagreed"] = ("RankTimeoutError", str(exc))
    dist.barrier(group=sync)  # the idle rank waits here (another group) until its peers gave up
    return result


@pytest.fixture(scope="module")
def results():
    res = run_ranks(_worker, world_size=WORLD, timeout=300)
    assert_all_ok(res)
    return [r.value for r in res]


@pytest.mark.parametrize("backend", ["full", "breakable"])
def test_idle_ranks_join_the_padded_step_and_peers_match_eager(results, backend):
    per_rank = [res[backend] for res in results]
    for rank, rows in enumerate(per_rank):
        bad = [(s, row) for s, row in enumerate(rows) if not row[4]]
        assert not bad, f"rank {rank}: results differ from eager at {bad}"
        for s, (n, shape, *_) in enumerate(rows):
            assert shape == (n, D), (rank, s, shape)
        with_peers = [row for row in rows if row[0] and row[6]]
        assert sum(row[5] for row in with_peers) > 0.8 * len(with_peers), "the reference ignores the peers"
    for s in range(STEPS):
        ns = [per_rank[r][s][0] for r in range(WORLD)]
        buckets = {per_rank[r][s][2] for r in range(WORLD)}
        ran = [per_rank[r][s][3] for r in range(WORLD)]
        if s == ALL_IDLE:
            assert ns == [0, 0, 0] and ran == [0, 0, 0] and buckets == {None}, (s, per_rank[0][s])
        else:
            # every rank, idle ones included, ran the step: the same key (or all fell back together)
            assert ran == [1, 1, 1] and len(buckets) == 1, (s, ns, buckets, ran)
            want = next((b for b in BUCKETS if b >= max(ns)), None)
            assert buckets == {want}, (s, ns, buckets)
    # the schedule did what it claims: an idle rank among active ones, a long idle run, joint fallbacks
    idle_joins = [(r, s) for r in range(WORLD) for s in range(STEPS) if per_rank[r][s][0] == 0 and s != ALL_IDLE]
    assert (2, 0) in idle_joins and all((1, s) in idle_joins for s in range(10, 30))
    assert any(per_rank[0][s][2] is None and s != ALL_IDLE for s in range(STEPS))


def test_without_agreement_an_idle_rank_leaves_its_peers_with_a_clear_error(results):
    outcomes = [res["unagreed"] for res in results]
    assert outcomes[2] == ("returned", (0, D))  # the idle rank ran nothing
    for rank in (0, 1):
        kind, msg = outcomes[rank]
        assert kind == "RankTimeoutError", outcomes
        assert "did not complete" in msg and "'replay'" in msg and "shape key 2" in msg, msg
