"""A background capture that yields to the calls it serves beside: ``capture(background=True, share=)``
(:mod:`graphrunner.pacing`, issue 53 item 2).

The rest after a key is ``d * (1 - share) / share`` for a key of ``d`` seconds, taken only while calls
come: a hand-driven clock checks the rule; a real runner served by a tight loop of calls shows that
a small share holds the capture back while the calls come and lets it finish once they stop, and
``share=1`` (the negative control, today's behaviour) captures every key during the same loop.
"""

from __future__ import annotations

import time

import pytest
import torch

import graphrunner as gr
from graphrunner.pacing import Pace, rest_after

D = 8
BUCKETS = [1, 2, 4, 8, 16, 32]


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_the_rest_by_hand_and_only_while_calls_come():
    assert rest_after(0.2, 0.25) == pytest.approx(0.6)  # 0.2 s of capture in every 0.8 s
    assert rest_after(0.2, 1.0) == 0.0 and rest_after(-1.0, 0.5) == 0.0
    clock = Clock()
    pace = Pace(0.25, idle=0.05, clock=clock)
    with pace.busy():
        pace.captured(0.2)  # rests until 100.6 while calls come
        assert pace.resting()  # a call in progress: busy
        clock.now = 100.3
        assert pace.resting()
    assert pace.keys == [(pytest.approx(99.8), 100.0, pytest.approx(100.6))]
    clock.now = 100.34  # the last call ended 40 ms ago: still busy
    assert pace.resting()
    clock.now = 100.36  # no call for 60 ms: idle, the capture goes on
    assert not pace.resting()
    with pace.busy():  # a call again: the rest is not over
        assert pace.resting()
        clock.now = 100.61  # the rest is over, calls or not
        assert not pace.resting()
    one = Pace(1.0, clock=clock)
    with one.busy():
        one.captured(5.0)
        assert not one.resting()  # share 1: never rests


@pytest.mark.parametrize("bad", [0, -0.5, 1.5, float("nan"), "x", None])
def test_a_share_outside_0_1_is_refused_naming_it(bad):
    with pytest.raises(ValueError, match="share"):
        Pace(bad)
    runner = _runner()
    with pytest.raises(ValueError, match="share"):
        runner.capture(background=True, share=bad)
    assert not runner.captured  # nothing started


def test_a_share_below_1_needs_a_background_capture():
    runner = _runner()
    with pytest.raises(ValueError, match="background=True"):
        runner.capture(share=0.5)
    assert not runner.captured


def _step(w):
    def step(x):
        return torch.tanh(x @ w) @ w.T + 1

    return step


def _runner():
    w = torch.randn(D, D, generator=torch.Generator().manual_seed(0)) / 3
    runner = gr.GraphRunner(
        _step(w),
        inputs={"x": gr.BatchInput(trailing=(D,), dtype=torch.float32)},
        buckets=BUCKETS,
        backend="full",
        progress=False,
    )
    runner.eager = _step(w)
    return runner


def _serve_until_captured(runner, deadline=120.0):
    """Calls back to back, each checked against eager, until every key is captured; the calls made."""
    g = torch.Generator().manual_seed(1)
    end = time.perf_counter() + deadline
    calls = 0
    while len(runner.captured_keys) < len(BUCKETS):
        assert time.perf_counter() < end, f"{len(runner.captured_keys)} keys captured in {deadline} s"
        x = torch.randn(int(torch.randint(1, 33, (1,), generator=g)), D, generator=g)
        out = runner(x=x)
        with torch.inference_mode():
            torch.testing.assert_close(out, runner.eager(x))
        calls += 1
    return calls


def _early_starts(keys, share):
    """Keys that started before the rest ``share`` gives their predecessor was over (1 ms slack)."""
    return [
        i
        for i in range(1, len(keys))
        if keys[i][0] < keys[i - 1][1] + rest_after(keys[i - 1][1] - keys[i - 1][0], share) - 1e-3
    ]


@pytest.mark.parametrize("share", [0.2, 1.0])
def test_while_calls_come_each_key_waits_the_rest_its_predecessor_earned(share):
    """Calls back to back (each equal to eager) while the 6 keys are captured, the runner never idle
    (the idle threshold raised to 1 s so that a busy machine's pauses do not count as idle): at share
    0.2 every key starts at least 4x its predecessor's capture time after it (the keys' share of the
    time <= 0.2). share=1 is the negative control: its keys come back to back, which the same check
    at 0.2 sees."""
    runner = _runner()
    runner.capture(background=True, share=share)
    pace = runner.server.background.pace
    pace.idle_after = 1.0
    try:
        calls = _serve_until_captured(runner)
        assert calls >= len(BUCKETS)  # at least one call waited at every key (share 1: exactly one)
        keys = pace.keys
        assert len(keys) == len(BUCKETS)
        assert _early_starts(keys, share) == []  # the rule held for the share it ran with
        early = _early_starts(keys, 0.2)
        if share < 1:
            assert early == []
            # the keys' share of the time from the first key's start to the last's: each key before the last
            # is followed by its rest, so those keys took at most 0.2 of it (the last key's own time is not
            # followed by its rest inside the span: a slow last key on a busy machine is no violation)
            spent = sum(end - start for start, end, _ in keys[:-1])
            assert spent <= 0.2 * (keys[-1][0] - keys[0][0]) + 1e-3 * len(keys), keys
        else:
            assert len(early) >= len(BUCKETS) - 2, keys  # back to back: not the rest of share 0.2
    finally:
        runner.cleanup()


def test_an_idle_runner_captures_at_full_speed_whatever_the_share():
    """No call at all: the rest never starts (idle), so at share 0.001 every key still follows its
    predecessor at once (the rest such a share earns would be about 1000x a key's time)."""
    runner = _runner()
    runner.capture(background=True, share=0.001)
    pace = runner.server.background.pace
    assert runner.wait_captured(timeout=120) is not None
    assert len(runner.captured_keys) == len(BUCKETS) == len(pace.keys)
    assert len(_early_starts(pace.keys, 0.001)) == len(BUCKETS) - 1
    runner.cleanup()
