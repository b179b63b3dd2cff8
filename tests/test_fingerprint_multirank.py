"""The capture fingerprint on 3 gloo ranks: a rank configured differently
(bucket values, bucket count, an input spec) or capturing a different graph
makes EVERY rank raise a CaptureError at capture, naming the field, the
ranks and both values, within the group timeout. Negative control: with the
fingerprint off, mismatched bucket values capture and replay mismatched
keys without any error."""

from __future__ import annotations

import os
import sys
import time

import pytest

sys.path.insert(0, os.path.dirname(__file__))
from mp_util import assert_all_ok, run_ranks  # noqa: E402

pytestmark = [pytest.mark.multirank, pytest.mark.slow]  # slow: spawns rank processes (-m "not slow" skips it)

WORLD, D, TIMEOUT = 3, 4, 20.0


def _worker(rank, world, case):
    import torch

    import graphrunner as gr
    from graphrunner.errors import AgreementError, CaptureError

    buckets, trailing, extra_op = [1, 2, 4, 8], (D,), False
    if case == "bucket_values" and rank == 1:
        buckets = [1, 3, 4, 8]
    if case == "bucket_count" and rank == 1:
        buckets = [1, 2, 4]
    if case == "input_spec" and rank == 2:
        trailing = (D + 1,)
    if case == "graph" and rank == 1:
        extra_op = True
    if case.startswith("off_bucket_values") and rank == 1:  # the same collectives as its peers' at capture
        buckets = [1, 2, 5, 8]
    if case == "off_bucket_collectives" and rank == 1:  # key 3 has no padding to check: one collective fewer
        buckets = [1, 3, 4, 8]

    def step(x):  # no collectives: a mismatch cannot hang, it can only be silent
        y = x * 2.0
        return y * 1.0 if extra_op else y  # the same values, one more op in rank 1's graph

    group = gr.TorchDistGroup(timeout=TIMEOUT)
    off = case.startswith("off_")  # the negative control: no fingerprint check
    runner = gr.GraphRunner(
        step,
        {"x": gr.BatchInput(trailing=trailing)},
        buckets,
        backend="breakable",
        device="tape",
        group=group,
        warmups=1,
        progress=False,
        checks=("drift", "padding") if off else None,
    )
    t0 = time.monotonic()
    try:
        runner.capture()
    except (CaptureError, AgreementError) as exc:
        return {"raised": str(exc), "type": type(exc).__name__, "seconds": time.monotonic() - t0}
    if case.endswith("_no_digest"):  # nor the configuration digest in each call's agreement
        runner.server.agreement.digest = 0
    chosen = []
    for n in (3, 2, 5, 7):
        x = torch.full((n, trailing[0]), float(n))
        try:
            out = runner(x=x)
        except AgreementError as exc:
            return {"raised": str(exc), "type": type(exc).__name__, "seconds": time.monotonic() - t0, "call": n}
        assert torch.equal(out, x * 2.0)  # each rank's own result looks right...
        chosen.append(runner.stats.last_bucket)
    return {"raised": None, "chosen": chosen}  # ...but the ranks replayed these keys


def _run(case):
    res = run_ranks(_worker, world_size=WORLD, args=(case,), timeout=90)
    assert_all_ok(res)
    return [r.value for r in res]


def _assert_all_raise(values, *needles):
    for rank, v in enumerate(values):
        assert v["raised"], f"rank {rank} did not raise: {v}"
        assert v["seconds"] < TIMEOUT, v
        for needle in needles:
            assert needle in v["raised"], (rank, needle, v["raised"])
        assert v["raised"].startswith(f"rank {rank} of {WORLD}:")


def test_bucket_values_mismatch_raises_on_every_rank():
    _assert_all_raise(
        _run("bucket_values"),
        "'buckets' differs",
        'ranks 0, 2: {"batch":[1,2,4,8]}',
        'rank 1: {"batch":[1,3,4,8]}',
        "'keys' differs",
    )


def test_bucket_count_mismatch_raises_on_every_rank():
    _assert_all_raise(
        _run("bucket_count"), "'buckets' differs", 'rank 1: {"batch":[1,2,4]}', 'ranks 0, 2: {"batch":[1,2,4,8]}'
    )


def test_input_spec_mismatch_raises_on_every_rank():
    values = _run("input_spec")
    _assert_all_raise(values, "'inputs' differs", '"trailing":[5]', '"trailing":[4]', "rank 2:")
    assert "'buckets' differs" not in values[0]["raised"]


def test_captured_graph_mismatch_raises_after_the_first_key():
    values = _run("graph")
    _assert_all_raise(values, "captures of key 8", "'tape_ops' differs")
    ops = values[0]["raised"].split("'tape_ops' differs (")[1]
    assert ops.startswith("ranks 0, 2: ") and "; rank 1: " in ops
    n02, n1 = int(ops.split(";")[0].split(": ")[1]), int(ops.split("; rank 1: ")[1].split(")")[0])
    assert n1 == n02 + 1  # rank 1 recorded exactly one more op
    assert "'num_segments'" not in values[0]["raised"]


def test_same_configuration_passes_and_agrees():
    values = _run("same")
    assert all(v["raised"] is None for v in values)
    assert len({tuple(v["chosen"]) for v in values}) == 1


def test_without_fingerprint_the_configuration_digest_stops_the_first_call_on_every_rank():
    # rank 1 built other buckets and its capture makes the same collectives as its peers'; the digest of the
    # configuration rides in every call's agreement, so the first call raises on every rank, nothing replayed
    values = _run("off_bucket_values")
    for rank, v in enumerate(values):
        assert v["type"] == "AgreementError" and v["call"] == 3, v  # the first call, batch 3
        assert v["raised"].startswith(f"rank {rank} (call 1 of a runner whose configuration digest is")
        assert "another configuration" in v["raised"] and v["seconds"] < TIMEOUT


def test_negative_control_without_fingerprint_and_digest_mismatched_buckets_replay_silently():
    values = _run("off_bucket_values_no_digest")
    assert all(v["raised"] is None for v in values), values
    chosen = [v["chosen"] for v in values]
    # batch 3, 2, 5, 7 on every rank, agreed: ranks 0 and 2 replay buckets 4, 2, 8, 8; rank 1 replays 5, 2, 5, 8
    assert chosen[0] == chosen[2] == [4, 2, 8, 8] and chosen[1] == [5, 2, 5, 8], chosen


def test_without_fingerprint_a_configuration_that_changes_the_collectives_raises_on_every_rank():
    # rank 1's key 3 covers one size, so its padding check makes no collective where its peers' key 4 makes one:
    # the collective channel (graphrunner.channel) finds the ranks out of step in that collective, on every rank
    values = _run("off_bucket_collectives")
    _assert_all_raise(values, "out of step", "'leak_check'", "'pre_capture'")
    assert {v["type"] for v in values} == {"AgreementError"}
