"""What rides in a call's one agreement collective, on real gloo ranks: shadow verification's
verdict (debug mode makes exactly one collective per call too) and the engine's own step number
(``runner.run(inputs, step=n)``)."""

from __future__ import annotations

import pytest
import torch
from mp_util import CountingGroup, run_ranks

import graphrunner as gr

TIMEOUT = 20.0
D = 4


class Scaled:
    """``x * scale``: ``scale`` a Python float the graph freezes at capture."""

    def __init__(self):
        self.scale = 2.0

    def __call__(self, x):
        return x * self.scale


def _verdict_worker(rank, world, verify_every):
    step = Scaled()
    group = CountingGroup(gr.TorchDistGroup(timeout=TIMEOUT))
    runner = gr.GraphRunner(
        step,
        {"x": gr.BatchInput(trailing=(D,))},
        [1, 2, 4],
        device="tape",
        group=group,
        warmups=1,
        progress=False,
        verify_every=verify_every,
    )
    runner.capture()
    outcome, wrong = [], 0
    for call in range(1, 6):
        if call == 3 and rank == 1:
            step.scale = 3.0  # rank 1 changes a value its graph froze: its replays are wrong from now on
        before = dict(group.counts)
        x = torch.full((3, D), float(call))
        try:
            out = runner(x=x)
        except gr.GraphRunnerError as exc:
            outcome.append((call, type(exc).__name__, str(exc)[:300]))
        else:
            outcome.append((call, "ok", None))
            wrong += not torch.equal(out, step(x))
        outcome[-1] += (sum(group.counts.values()) - sum(before.values()),)
    return {"outcome": outcome, "wrong": wrong}


@pytest.mark.slow
def test_a_failed_verification_raises_on_its_rank_then_on_every_rank_with_one_collective_per_call():
    res = run_ranks(_verdict_worker, world_size=2, args=(1,), timeout=120)
    for r in res:
        assert r.ok and r.exitcode == 0, r
    o0, o1 = (r.value["outcome"] for r in res)
    assert all(c[-1] == 1 for c in o0 + o1), (o0, o1)  # exactly one collective per call, debug mode included
    assert o1[2][1] == "ContractError" and "shadow verification of call 3" in o1[2][2]  # rank 1 finds it at once
    assert o0[2][1] == "ok"  # rank 0's own replay of call 3 was right
    for o in (o0, o1):  # call 4: the verdict rode in the agreement: every rank refuses it
        assert o[3][1] == "ContractError" and "of call 3" in o[3][2] and "refuses call 4" in o[3][2], o[3]
    assert o1[4][1] == "ContractError" and o0[4][1] == "ok"  # call 5: rank 1's replay is verified (and wrong) again
    assert res[0].value["wrong"] == res[1].value["wrong"] == 0  # no wrong result was returned on any rank


@pytest.mark.slow
def test_negative_control_without_verification_rank_1_serves_wrong_results_silently():
    res = run_ranks(_verdict_worker, world_size=2, args=(0,), timeout=120)
    for r in res:
        assert r.ok and r.exitcode == 0, r
    assert all(c[1] == "ok" for r in res for c in r.value["outcome"])
    assert res[1].value["wrong"] == 3  # calls 3, 4 and 5 replayed the frozen 2.0
    assert res[0].value["wrong"] == 0


def _step_worker(rank, world, with_steps):
    runner = gr.GraphRunner(
        lambda x: x + 1.0,
        {"x": gr.BatchInput(trailing=(D,))},
        [1, 2, 4],
        device="tape",
        group=gr.TorchDistGroup(timeout=TIMEOUT),
        warmups=1,
        progress=False,
    )
    runner.capture()
    outcome = []
    engine_step = 0
    for call in range(4):
        engine_step += 1
        if rank == 2 and call == 2:
            engine_step += 1  # rank 2's engine skipped a step (a data-parallel rank with nothing to do, say)
        x = torch.full((2, D), float(engine_step))
        try:
            out = runner.run({"x": x}, step=engine_step if with_steps else None)
        except gr.GraphRunnerError as exc:
            outcome.append((call, type(exc).__name__, str(exc)[:300], getattr(exc, "steps", None)))
        else:
            assert torch.equal(out, x + 1.0)
            outcome.append((call, "ok", engine_step, None))
    return outcome


@pytest.mark.slow
def test_ranks_at_different_engine_steps_raise_agreement_error_on_every_rank():
    res = run_ranks(_step_worker, world_size=3, args=(True,), timeout=120)
    for r in res:
        assert r.ok and r.exitcode == 0, r
        o = r.value
        assert [c[1] for c in o[:2]] == ["ok", "ok"]
        assert o[2][1] == "AgreementError" and "engine step" in o[2][2], o[2]
        assert o[2][3] == ((4 if r.rank == 2 else 3), 3, 4)  # (own, lowest, highest)
        assert o[3][1] == "AgreementError" and "refused without a collective" in o[3][2]


@pytest.mark.slow
def test_negative_control_without_step_numbers_the_skipped_step_pairs_silently():
    res = run_ranks(_step_worker, world_size=3, args=(False,), timeout=120)
    for r in res:
        assert r.ok and r.exitcode == 0, r
        assert all(c[1] == "ok" for c in r.value)  # rank 2's step 4 was served with its peers' step 3


def test_step_must_be_an_int():
    runner = gr.GraphRunner(
        lambda x: x + 1.0, {"x": gr.BatchInput(trailing=(D,))}, [1, 2], device="tape", progress=False
    )
    runner.capture()
    x = torch.ones(1, D)
    assert torch.equal(runner.run({"x": x}, step=7), x + 1.0)  # one rank: accepted, nothing to agree
    with pytest.raises(TypeError, match=r"run\(step=...\) must be the engine's step number"):
        runner.run({"x": x}, step=1.5)
    with pytest.raises(TypeError, match=r"run\(step=...\)"):
        runner.run({"x": x}, step=True)
    with pytest.raises(ValueError, match=r"in \[0, 2\*\*62\), got -1"):
        runner.run({"x": x}, step=-1)
