"""All ranks replay the same bucket: a tensor-parallel MLP on 3 gloo ranks.

Each rank holds a shard of the MLP weights and all-reduces its partial result
inside the captured step (so the collective is part of the graph). Every rank
draws its own random local batch size per step. With agreement on, every rank
replays the same bucket (or falls back together, padded to the agreed batch)
and equals an eager single-process reference. Negative control: with
``runner.agree_bucket = False`` (unsafe, testing only) and a step without collectives,
the ranks are observed choosing different buckets.

Paired calls (issue 21): a call lost before the agreement on one of 3 ranks
makes every rank raise ``AgreementError`` naming the call numbers (negative
control: without the call number every rank returns wrong values silently),
and a sparse input on one of 2 ranks is invalid input on every rank
(negative controls: the escaping ``RuntimeError`` of old, caught by the call
number, or mispairing the next calls without it).
"""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
from mp_util import CountingGroup, assert_all_ok, run_ranks  # noqa: E402

pytestmark = [pytest.mark.multirank, pytest.mark.slow]  # slow: spawns rank processes (-m "not slow" skips it)

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
    result["unagreed"] = {"chosen": chosen, "traffic": {k: group.counts[k] - before[k] for k in group.counts}}
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


# --------------------------------------------------------------------------- paired calls (issue 21)
#
# A tensor-parallel step (an all_reduce inside the graph) makes a mispaired call visible in
# the values: a rank whose call meets a peer's call of another step adds that step's partial
# product into its rows.

PAIR_BUCKETS = [1, 2, 4, 8]


def _pair_setup(rank, world):
    import torch
    import torch.distributed as dist

    gen = torch.Generator().manual_seed(0)
    w1_full = torch.randn(D, H, generator=gen) / 4
    w2_full = torch.randn(H, D, generator=gen) / 4
    shards = [slice(q * H // world, (q + 1) * H // world) for q in range(world)]
    w1, w2 = w1_full[:, shards[rank]].contiguous(), w2_full[shards[rank]].contiguous()

    def tp_mlp(x):
        part = torch.relu(x @ w1) @ w2
        dist.all_reduce(part)
        return part

    def batch(step, q):
        import random

        n = random.Random(7_000 * step + q).randint(1, PAIR_BUCKETS[-1])
        return torch.randn(n, D, generator=torch.Generator().manual_seed(7_000 * step + q))

    def reference(steps, r):
        """Eager reference of rank ``r``'s output when rank ``q``'s call is its step ``steps[q]``."""
        xs = [batch(s, q) for q, s in enumerate(steps)]
        rows_ = max(x.shape[0] for x in xs)
        acc = torch.zeros(rows_, D)
        for q, x in enumerate(xs):
            xp = torch.zeros(rows_, D)
            xp[: x.shape[0]] = x
            acc += torch.relu(xp @ w1_full[:, shards[q]]) @ w2_full[shards[q]]
        return acc[: xs[r].shape[0]]

    return tp_mlp, batch, reference


def _pair_runner(tp_mlp, timeout=20.0, counting=False):
    import torch

    from graphrunner.backends import FullGraphBackend
    from graphrunner.group import TorchDistGroup
    from graphrunner.runner import BatchInput, GraphRunner

    group = TorchDistGroup(timeout=timeout)
    if counting:
        group = CountingGroup(group)
    backend = FullGraphBackend(device="tape", group=group, warmups=1)
    runner = GraphRunner(
        tp_mlp,
        {"x": BatchInput(trailing=(D,), dtype=torch.float32, pad=0.0)},
        PAIR_BUCKETS,
        backend=backend,
        group=group,
        progress=False,
    )
    runner.capture()
    return runner, group


def _without_call_numbers(runner):
    """The negative control's runner: every rank sends call number 0 (the agreement as it was
    before the call number was carried), so no mismatch can be seen."""
    ag = runner.server.agreement
    agree, invalid = ag.agree, ag.invalid
    ag.agree = lambda sizes, call, *step: agree(sizes, 0, *step)
    ag.invalid = lambda zero, call, *step: invalid(zero, 0, *step)


class _Interrupted(dict):
    """Call inputs whose reading is interrupted (a KeyboardInterrupt, as a signal would raise
    it): the call has started, so the runner counted it, but never reaches the agreement."""

    def __getitem__(self, k):
        raise KeyboardInterrupt("request cancelled while its inputs were read")


def _close(out, ref):
    import torch

    return out.shape == ref.shape and torch.allclose(out, ref, rtol=1e-5, atol=1e-6)


def _lost_call_worker(rank, world, lost, steps):
    """Rank 1's call of step ``lost`` is interrupted before it reaches the agreement (its serving
    loop catches the interrupt and moves on); every rank serves ``steps`` steps."""
    import time

    import torch.distributed as dist

    from graphrunner.errors import GraphRunnerError
    from graphrunner.keys import AgreementError

    tp_mlp, batch, reference = _pair_setup(rank, world)
    log = {}

    def serve(runner, schedule):
        rows = []
        for s in schedule:
            if rank == 1 and s == lost:
                try:
                    runner.run(_Interrupted(x=batch(s, rank)))
                except KeyboardInterrupt:
                    rows.append(("lost", s))
                continue
            t0 = time.monotonic()
            try:
                out = runner(x=batch(s, rank))
            except AgreementError as exc:
                rows.append(("AgreementError", s, str(exc), exc.calls, time.monotonic() - t0))
                continue
            except GraphRunnerError as exc:  # pragma: no cover - reported, the test fails on it
                rows.append((type(exc).__name__, s, str(exc)))
                continue
            # What rank q's call paired with: the k-th collective of every rank.
            rows.append(("ok", s, out.clone()))
        return rows

    # 1. With the call number: the mismatch is seen by every rank at the same call.
    runner, group = _pair_runner(tp_mlp, counting=True)
    before = group.counts["all_max_vector"]
    rows = serve(runner, range(steps))
    log["seq"] = [(r[0], r[1], _close(r[2], reference([r[1]] * world, rank))) if r[0] == "ok" else r for r in rows]
    log["seq_collectives"] = group.counts["all_max_vector"] - before
    # 2. Re-synchronised: a new runner on every rank (steps re-aligned by the caller) is paired again.
    runner2, _ = _pair_runner(tp_mlp)
    log["new_runner"] = [_close(runner2(x=batch(s, rank)), reference([s] * world, rank)) for s in (100, 101, 102)]
    # 3. Negative control: the same schedule without the call number. Rank 1 makes one extra
    # call at the end, so every rank makes as many collectives and nobody hangs.
    runner3, _ = _pair_runner(tp_mlp)
    _without_call_numbers(runner3)
    rows = serve(runner3, range(steps + 1) if rank == 1 else range(steps))
    served = [r for r in rows if r[0] != "lost"]

    def at(q, k):  # the step of rank q's k-th collective
        return k if q != 1 or k < lost else k + 1

    log["unseq"] = [
        (
            r[0],
            r[1],
            _close(r[2], reference([r[1]] * world, rank)),
            _close(r[2], reference([at(q, k) for q in range(world)], rank)),
        )
        if r[0] == "ok"
        else r[:2]
        for k, r in enumerate(served)
    ]
    dist.barrier()
    return log


@pytest.fixture(scope="module")
def lost_call():
    res = run_ranks(_lost_call_worker, world_size=3, args=(3, 6), timeout=120)
    assert_all_ok(res)
    return [r.value for r in res]


def test_a_lost_call_raises_agreement_error_on_every_rank_naming_the_call_numbers(lost_call):
    lost = 3
    for rank, log in enumerate(lost_call):
        rows = log["seq"]
        ok = [r for r in rows if r[0] == "ok"]
        # Before the lost call: every step served and equal to eager.
        assert [r[1] for r in ok] == list(range(lost)) and all(r[2] for r in ok), rows
        errs = [r for r in rows if r[0] == "AgreementError"]
        first = errs[0]
        # The first call after the loss: ranks 0 and 2 at their call 4 (step 3), rank 1 at its call 5 (step 4).
        own = lost + 2 if rank == 1 else lost + 1
        assert first[1] == (lost + 1 if rank == 1 else lost)
        assert first[3] == (own, lost + 1, lost + 2)
        other = lost + 1 if rank == 1 else lost + 2
        assert (
            f"rank {rank} is at call {own} but another rank is at call {other} (lowest {lost + 1}, "
            f"highest {lost + 2} over the 3 ranks): a rank skipped or added a call"
        ) in first[2]
        assert "every rank must call the runner the same number of times" in first[2]
        assert first[4] < 10, "the mismatch must be seen at once, not after a timeout"
        # Afterwards the runner refuses every call on every rank, without a collective.
        assert all("refused without a collective" in r[2] for r in errs[1:]) and len(errs[1:]) >= 1
        assert log["seq_collectives"] == lost + 1
        assert rank == 1 or not any(r[0] == "lost" for r in rows)
    # A new runner on every rank serves correctly again.
    assert all(all(log["new_runner"]) for log in lost_call)


def test_negative_control_without_the_call_number_a_lost_call_returns_wrong_values_silently(lost_call):
    lost = 3
    wrong = []
    for rank, log in enumerate(lost_call):
        rows = log["unseq"]
        assert all(r[0] == "ok" for r in rows), rows  # no rank raised: every call "succeeded"
        for r in rows:
            _, s, matches_eager, matches_mispaired = r
            assert matches_mispaired, (rank, s)  # each result is exactly the mispaired sum...
            if not matches_eager:
                wrong.append((rank, s))
        # ...which, from the lost call on, differs from eager for this rank's own step.
        assert all(not r[2] for r in rows if r[1] >= lost), (rank, rows)
    assert {r for r, _ in wrong} == {0, 1, 2}


def _sparse_worker(rank, world, bad, steps):
    """Rank 1 passes a sparse tensor at step ``bad``."""
    import torch.distributed as dist

    from graphrunner.errors import GraphRunnerError
    from graphrunner.keys import AgreementError

    tp_mlp, batch, reference = _pair_setup(rank, world)
    log = {}

    def serve(runner, schedule):
        rows = []
        for s in schedule:
            x = batch(s, rank)
            if rank == 1 and s == bad:
                x = x.to_sparse()
            try:
                out = runner(x=x)
            except (ValueError, AgreementError, GraphRunnerError, RuntimeError) as exc:
                rows.append((type(exc).__name__, s, str(exc)))
                continue
            rows.append(("ok", s, out.clone()))
        return rows

    # 1. Today: the sparse input is invalid input on rank 1, agreed as such.
    runner, _ = _pair_runner(tp_mlp)
    rows = serve(runner, range(steps))
    log["fixed"] = [(r[0], r[1], _close(r[2], reference([r[1]] * world, rank))) if r[0] == "ok" else r for r in rows]

    def old_validation(r):  # the RuntimeError of data_ptr() escapes before the agreement, as before
        validate = r.server.inputs.validate

        def patched(inputs):
            for t in inputs.values():
                t.data_ptr()
            return validate(inputs)

        r.server.inputs.validate = patched

    # 2. Negative control, call numbers on: the escaped RuntimeError still cannot mispair calls.
    runner2, _ = _pair_runner(tp_mlp)
    if rank == 1:
        old_validation(runner2)
    log["old_validation_seq"] = [r[:2] + ((r[2],) if r[0] != "ok" else ()) for r in serve(runner2, range(steps))]
    # 3. Negative control, call numbers off: rank 1 skipped the collective, so rank 0's call of
    # step ``bad`` pairs with rank 1's next step (rank 1 makes one extra call: nobody hangs).
    runner3, _ = _pair_runner(tp_mlp)
    _without_call_numbers(runner3)
    if rank == 1:
        old_validation(runner3)
    rows = serve(runner3, range(steps + 1) if rank == 1 else range(steps))
    served = [r for r in rows if r[0] == "ok"]  # the k-th: rank 0's step k, rank 1's step k (k+1 from bad on)
    log["old_validation_unseq"] = [
        (
            r[0],
            r[1],
            _close(r[2], reference([r[1]] * world, rank)),
            _close(r[2], reference([k, k if k < bad else k + 1], rank)),
        )
        for k, r in enumerate(served)
    ]
    log["old_validation_unseq_errors"] = [r[:3] for r in rows if r[0] != "ok"]
    dist.barrier()
    return log


@pytest.fixture(scope="module")
def sparse_input():
    res = run_ranks(_sparse_worker, world_size=2, args=(2, 5), timeout=90)
    assert_all_ok(res)
    return [r.value for r in res]


def test_a_sparse_input_on_one_rank_is_invalid_input_on_every_rank_and_all_continue(sparse_input):
    bad = 2
    for rank, log in enumerate(sparse_input):
        rows = log["fixed"]
        err = rows[bad]
        if rank == 1:
            assert (
                err[0] == "ValueError"
                and (
                    "input 'x' is a sparse tensor (layout torch.sparse_coo); pass a "
                    "dense (strided) tensor, e.g. x.to_dense()"
                )
                in err[2]
            ), err
        else:
            assert err[0] == "GraphRunnerError" and "another rank passed invalid inputs at call 3" in err[2], err
        others = [r for i, r in enumerate(rows) if i != bad]
        assert all(r[0] == "ok" and r[2] for r in others), rows  # before and after: equal to eager


def test_negative_control_an_escaping_error_before_the_agreement_is_caught_by_the_call_number(sparse_input):
    bad = 2
    r0, r1 = (log["old_validation_seq"] for log in sparse_input)
    assert r1[bad][0] == "RuntimeError" and "data pointer" in r1[bad][2]  # escaped: no collective on rank 1
    # Rank 0's call of step 2 (call 3) meets rank 1's call of step 3 (call 4): both raise.
    assert r0[bad][0] == "AgreementError" and "rank 0 is at call 3 but another rank is at call 4" in r0[bad][2]
    assert r1[bad + 1][0] == "AgreementError" and "rank 1 is at call 4 but another rank is at call 3" in r1[bad + 1][2]


def test_negative_control_an_escaping_error_without_the_call_number_mispairs_the_next_calls(sparse_input):
    bad = 2
    r0, r1 = (log["old_validation_unseq"] for log in sparse_input)
    assert [e[0] for e in sparse_input[1]["old_validation_unseq_errors"]] == ["RuntimeError"]
    assert sparse_input[0]["old_validation_unseq_errors"] == []  # rank 0 saw nothing wrong
    for rows in (r0, r1):
        assert all(r[0] == "ok" and r[3] for r in rows), rows  # every output is the mispaired sum
    assert all(r[2] for r in r0[:bad]) and not any(r[2] for r in r0[bad:])  # wrong from step 2 on, silently
    assert not any(r[2] for r in r1[bad:])
