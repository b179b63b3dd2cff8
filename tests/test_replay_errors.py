"""A replay (or eager fallback) that fails names the cause: the key, the input out of its
bounds, and debug mode as the way to check every call (issue 33, reproduction 5)."""

from __future__ import annotations

import pytest
import torch

import graphrunner as gr


class SlotState:
    """A per-slot state written in place and read back: ``state[slots] = h``."""

    def __init__(self):
        self.state = torch.zeros(8, 4)

    def __call__(self, h, slots):
        self.state[slots] = h
        return self.state[slots] * 2.0


def _runner(bounds=(0, 7), fallback="eager", **kw):
    inputs = {"h": gr.BatchInput(trailing=(4,)), "slots": gr.BatchInput(dtype=torch.long, pad=0, bounds=bounds)}
    r = gr.GraphRunner(SlotState(), inputs, [1, 2, 4], device="tape", progress=False, checks=(), fallback=fallback,
                       **kw)
    r.capture()
    return r


def test_an_index_out_of_range_at_replay_names_the_key_the_input_and_debug_mode():
    r = _runner()
    with pytest.raises(gr.GraphRunnerError) as ei:
        r(h=torch.ones(3, 4), slots=torch.tensor([0, 1, 99]))
    msg = str(ei.value)
    assert "the replay of bucket 4 raised" in msg and "index 99 is out of bounds" in msg
    assert "input 'slots'" in msg and "99" in msg and "debug=True" in msg
    assert ei.value.__cause__ is not None  # the original error is chained
    good = torch.tensor([2, 3, 4])
    assert torch.equal(r(h=torch.ones(3, 4), slots=good), torch.full((3, 4), 2.0))  # still usable


def test_without_bounds_the_error_says_to_declare_them():
    r = _runner(bounds=None)
    with pytest.raises(gr.GraphRunnerError, match=r"inputs without bounds=: \['h', 'slots'\]"):
        r(h=torch.ones(3, 4), slots=torch.tensor([0, 1, 99]))


def test_the_eager_fallback_names_the_cause_too():
    r = _runner()
    with pytest.raises(gr.GraphRunnerError, match=r"the eager fallback of sizes \(batch 6\) raised .*input 'slots'"):
        r(h=torch.ones(6, 4), slots=torch.tensor([0, 1, 2, 3, 4, 99]))  # 6 rows: over the largest bucket


def test_debug_mode_refuses_the_call_before_anything_runs():
    r = _runner(debug=True)
    with pytest.raises(ValueError, match="slots"):
        r(h=torch.ones(3, 4), slots=torch.tensor([0, 1, 99]))
