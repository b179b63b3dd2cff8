"""The collective channel (graphrunner.channel): fixed-size frames that carry the phase and a
sequence number, so ranks out of step raise AgreementError on every rank instead of gloo aborting,
hanging or pairing a barrier with a vector.

In-process tests simulate the ranks with threads over a shared element-wise max; the gloo tests
run real processes (tests/mp_util.py)."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from mp_util import run_ranks

import graphrunner as gr
from graphrunner.channel import FRAME, HEADER, PAYLOAD, Channel
from graphrunner.errors import AgreementError


class _Reduction:
    """``size`` simulated ranks' element-wise max of one frame each (threads meet at a barrier)."""

    def __init__(self, size):
        self.size, self.frames, self.sent = size, {}, []
        self.meet = threading.Barrier(size, action=self._reduce)
        self.read = threading.Barrier(size)
        self.out = None

    def _reduce(self):
        frames = [self.frames[r] for r in range(self.size)]
        assert len({len(f) for f in frames}) == 1, "frames of different sizes would make gloo abort"
        self.sent.append(frames)
        self.out = [max(col) for col in zip(*frames)]

    def send(self, rank):
        def send(frame):
            self.frames[rank] = list(frame)
            self.meet.wait(timeout=10)
            out = list(self.out)
            self.read.wait(timeout=10)  # every rank read it before the next frame
            return out

        return send


def _ranks(*programs):
    """Run one program per simulated rank (``program(channel, send) -> value``) on threads."""
    return _ranks_from([Channel(r, len(programs)) for r in range(len(programs))], *programs)


def test_values_are_the_elementwise_max_over_ranks_and_long_payloads_go_in_frames():
    a = list(range(30))
    b = [60 - v for v in range(30)]
    results, red, chans = _ranks(
        lambda ch, s: ch.exchange(s, "all_max_vector", a, "v"), lambda ch, s: ch.exchange(s, "all_max_vector", b, "v")
    )
    expect = [max(x, y) for x, y in zip(a, b)]  # the hand computation
    assert results == [("ok", expect), ("ok", expect)]
    assert len(red.sent) == -(-30 // PAYLOAD)  # three frames for 30 values
    assert all(len(f) == FRAME for frames in red.sent for f in frames)
    assert [c.seq for c in chans] == [1, 1]  # one collective, however many frames


def test_every_kind_of_collective_is_one_frame_of_the_same_size():
    def prog(v):
        def p(ch, s):
            ch.exchange(s, "barrier", [], "warmup", key=8)
            return ch.exchange(s, "all_max", [v], "x")[0], -ch.exchange(s, "all_min", [-v], "x")[0]

        return p

    results, red, _ = _ranks(prog(3), prog(5))
    assert results == [("ok", (5, 3)), ("ok", (5, 3))]
    assert {len(f) for frames in red.sent for f in frames} == {FRAME}


def _agree(ch, s):  # another phase and kind
    return ch.exchange(s, "all_max_vector", [1, 2, 3], "runner_agree", key=3)


def _warmup_barrier(ch, s):  # the same kind, another phase
    return ch.exchange(s, "barrier", [], "warmup", key=8)


def _later_barrier(ch, s):  # the same collective, but this rank made one more before
    ch.seq += 1
    return ch.exchange(s, "barrier", [], "pre_capture", key=8)


@pytest.mark.parametrize("other", [_agree, _warmup_barrier, _later_barrier])
def test_out_of_step_collectives_raise_agreement_error_on_every_rank(other):
    def barrier(ch, s):
        return ch.exchange(s, "barrier", [], "pre_capture", key=8)

    results, _, chans = _ranks(barrier, other)
    assert [r[0] for r in results] == ["raised", "raised"], results
    for rank, (_, exc) in enumerate(results):
        assert isinstance(exc, AgreementError) and exc.unpaired and exc.collectives is not None
        msg = str(exc)
        assert msg.startswith(f"rank {rank} of 2:") and "out of step" in msg and "'pre_capture'" in msg
    assert chans[0].seq == chans[1].seq  # past every rank's: collectives made alike pair again
    results, _, _ = _ranks_from(chans, lambda ch, s: ch.exchange(s, "all_max", [ch.rank], "x")[0])
    assert results == [("ok", 1), ("ok", 1)]


def _ranks_from(chans, *programs):
    """:func:`_ranks` on existing channels; one program for every rank, or one per rank."""
    red = _Reduction(len(chans))
    results = [None] * len(chans)
    programs = programs * len(chans) if len(programs) == 1 else programs

    def run(r):
        try:
            results[r] = ("ok", programs[r](chans[r], red.send(r)))
        except Exception as exc:  # noqa: BLE001
            results[r] = ("raised", exc)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(len(chans))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    return results, red, chans


def test_payloads_of_different_lengths_raise_on_every_rank():
    results, _, _ = _ranks(
        lambda ch, s: ch.exchange(s, "all_max_vector", [1] * 3, "fingerprint"),
        lambda ch, s: ch.exchange(s, "all_max_vector", [1] * 4, "fingerprint"),
    )
    assert all(r[0] == "raised" and isinstance(r[1], AgreementError) for r in results), results
    assert "of 3 values" in str(results[0][1]) and "of 4 values" in str(results[0][1])


def test_negative_control_without_the_header_a_barrier_pairs_with_a_vector_silently():
    """REVIEW item 4: the real channel, its frames' headers blanked on the wire (what the group sent before
    the channel: values only). The pair that raises on every rank with headers now pairs silently: rank 0's
    barrier returns, and rank 1 takes its agreement from a barrier."""

    def blank(send):
        return lambda frame: send([0] * HEADER + list(frame[HEADER:]))

    def barrier(ch, s):
        return ch.exchange(s, "barrier", [], "pre_capture", key=8)

    def vector(ch, s):
        return ch.exchange(s, "all_max_vector", [7], "runner_agree", key=3)

    with_header, _, _ = _ranks(barrier, vector)
    assert [r[0] for r in with_header] == ["raised", "raised"]
    assert all(isinstance(r[1], AgreementError) for r in with_header)
    blanked, red, _ = _ranks(lambda ch, s: barrier(ch, blank(s)), lambda ch, s: vector(ch, blank(s)))
    assert blanked == [("ok", []), ("ok", [7])]
    assert all(f[:HEADER] == [0] * HEADER for frames in red.sent for f in frames)  # no header went out


# ----------------------------------------------------------------- real ranks (gloo)
TIMEOUT = 20.0


def _step(x):
    return x * 2.0 + 1.0


def _recapture_worker(rank, world, raw):
    from graphrunner.group import TorchDistGroup

    class RawGroup(TorchDistGroup):
        """The old path: every collective one all_reduce of its own size, no frame, no header."""

        def _exchange(self, kind, values, phase, key):
            where = f"{kind} in phase {phase!r} for shape key {key!r}"
            return self._all_reduce_max(values or [0], where)

    group = (RawGroup if raw else TorchDistGroup)(timeout=TIMEOUT)
    runner = gr.GraphRunner(
        _step, {"x": gr.BatchInput(trailing=(4,))}, [1, 2, 4], device="tape", group=group, warmups=1, progress=False
    )
    runner.capture()
    x = torch.arange(12.0).reshape(3, 4)
    assert torch.equal(runner(x=x), _step(x))  # both ranks serve one call, in step
    t0 = time.monotonic()
    try:
        if rank == 0:  # re-captures while its peer serves the next call
            runner.cleanup()
            runner.capture()
        else:
            runner(x=x)
    except gr.GraphRunnerError as exc:
        return {"type": type(exc).__name__, "raised": str(exc), "seconds": time.monotonic() - t0}
    return {"type": None, "raised": None, "seconds": time.monotonic() - t0}


@pytest.mark.slow
def test_a_rank_that_recaptures_while_its_peer_serves_raises_agreement_error_on_both_ranks():
    res = run_ranks(_recapture_worker, world_size=2, args=(False,), timeout=90)
    for r in res:
        assert r.ok and r.exitcode == 0 and not r.timed_out, r
        v = r.value
        assert v["type"] == "AgreementError", v
        # TIMEOUT is the group's collective deadline, not a speed target: under it, the mispairing was
        # found in the collective's header, not by a deadline expiring
        assert v["seconds"] < TIMEOUT, v  # found in the collective itself, not by a timeout
        assert v["raised"].startswith(f"rank {r.rank} of 2:") and "out of step" in v["raised"]
        assert "'runner_agree'" in v["raised"] and "'fingerprint'" in v["raised"], v["raised"]


@pytest.mark.slow
def test_negative_control_the_unframed_path_does_not_raise_agreement_error():
    # the same scenario over a group whose collectives are unframed (each its own size): gloo pairs the
    # re-capturing rank's fingerprint vector with the serving rank's agreement; no rank learns the ranks are
    # out of step (a silent wrong pairing, a hang until the timeout, or an aborted process)
    res = run_ranks(_recapture_worker, world_size=2, args=(True,), timeout=90)
    assert not all(r.ok and r.value["type"] == "AgreementError" for r in res), res
