"""A replay (or eager fallback) that fails names the cause: the key, the input out of its
bounds, and debug mode as the way to check every call (issue 33, reproduction 5), in a note
(PEP 678) on the user's own exception, which keeps its type (issue 42 item 2)."""

from __future__ import annotations

import re

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
    r = gr.GraphRunner(
        SlotState(), inputs, [1, 2, 4], device="tape", progress=False, checks=(), fallback=fallback, **kw
    )
    r.capture()
    return r


def _notes(exc):
    return "\n".join(getattr(exc, "__notes__", []))


def test_an_index_out_of_range_at_replay_names_the_key_the_input_and_debug_mode():
    r = _runner()
    with pytest.raises(Exception) as ei:
        r(h=torch.ones(3, 4), slots=torch.tensor([0, 1, 99]))
    assert not isinstance(ei.value, gr.GraphRunnerError)  # the error the step's op raised, its own type
    assert "index 99 is out of bounds" in str(ei.value)
    notes = _notes(ei.value)
    assert "the replay of bucket 4" in notes
    assert "input 'slots'" in notes and "99" in notes and "debug=True" in notes
    good = torch.tensor([2, 3, 4])
    assert torch.equal(r(h=torch.ones(3, 4), slots=good), torch.full((3, 4), 2.0))  # still usable


def test_without_bounds_the_error_says_to_declare_them():
    r = _runner(bounds=None)
    with pytest.raises(Exception) as ei:
        r(h=torch.ones(3, 4), slots=torch.tensor([0, 1, 99]))
    assert "inputs without bounds=: ['h', 'slots']" in _notes(ei.value)


def test_the_eager_fallback_names_the_cause_too():
    r = _runner()
    with pytest.raises(IndexError) as ei:  # what eager PyTorch raises for it, unchanged
        r(h=torch.ones(6, 4), slots=torch.tensor([0, 1, 2, 3, 4, 99]))  # 6 rows: over the largest bucket
    with pytest.raises(IndexError) as eager:
        SlotState()(torch.ones(6, 4), torch.tensor([0, 1, 2, 3, 4, 99]))
    assert str(ei.value) == str(eager.value)
    assert re.search(r"the eager fallback of sizes \(batch 6\).*input 'slots'", _notes(ei.value))


def test_debug_mode_refuses_the_call_before_anything_runs():
    """REVIEW item 5: nothing ran (the step, the state), and the message names the value and the bounds."""

    class Counting(SlotState):
        calls = 0

        def __call__(self, h, slots):
            Counting.calls += 1  # eager runs: the fallback, debug mode's shadow verification
            return super().__call__(h, slots)

    step = Counting()
    inputs = {"h": gr.BatchInput(trailing=(4,)), "slots": gr.BatchInput(dtype=torch.long, pad=0, bounds=(0, 7))}
    r = gr.GraphRunner(step, inputs, [1, 2, 4], device="tape", progress=False, checks=(), debug=True)
    r.capture()
    r(h=torch.full((2, 4), 3.0), slots=torch.tensor([5, 6]))
    before, eager_calls, replays = step.state.clone(), Counting.calls, sum(r.stats.replays.values())
    with pytest.raises(ValueError) as ei:
        r(h=torch.ones(3, 4), slots=torch.tensor([0, 1, 99]))
    msg = str(ei.value)
    assert "input 'slots'" in msg and "holds 99" in msg and "[0, 7]" in msg
    assert torch.equal(step.state, before) and step.state[5, 0] == 3.0  # nothing written since the good call
    assert sum(r.stats.replays.values()) == replays and Counting.calls == eager_calls  # nothing ran
    assert r.stats.fallbacks == 0


# ---------------------------------------------------------------- issue 42 item 2: the user's exceptions keep their type
class BadRequest(ValueError):
    """An engine's own error type for a bad request."""


@gr.no_graph
def _validate(x):
    if torch.isnan(x).any():
        raise BadRequest("request carries a NaN row")
    return x


def _guarded_step(x):
    _validate(x)
    return torch.tanh(x) * 2.0


def _guarded_runner():
    r = gr.GraphRunner(_guarded_step, {"x": gr.BatchInput(trailing=(3,))}, [1, 2, 4], device="tape", progress=False)
    r.capture()
    return r


def _nan_rows(n):
    x = torch.ones(n, 3)
    x[1, 0] = float("nan")
    return x


@pytest.mark.parametrize("rows, where", [(3, "the replay of bucket 4"), (6, "the eager fallback of sizes (batch 6)")])
def test_a_users_exception_reaches_the_caller_with_its_own_type_and_a_note(rows, where):
    """A ValueError subclass raised by a @no_graph break during a replay (3 rows) or by the step in
    the eager fallback (6 rows: over the largest bucket) is caught by the engine as its own type;
    graphrunner's context is a note, and the runner serves the next call right."""
    r = _guarded_runner()
    with pytest.raises(BadRequest) as ei:
        r(x=_nan_rows(rows))
    assert str(ei.value) == "request carries a NaN row"  # its own message (pytest's match= reads the notes too)
    assert type(ei.value) is BadRequest and not isinstance(ei.value, gr.GraphRunnerError)
    assert where in _notes(ei.value)
    x = torch.randn(rows, 3, generator=torch.Generator().manual_seed(rows))
    assert torch.equal(r(x=x), _guarded_step(x))  # still usable, the right values
    assert torch.equal(r(x=x[:2]), _guarded_step(x[:2]))


def test_graphrunners_own_errors_keep_their_classes():
    r = _guarded_runner()
    r.cleanup()
    with pytest.raises(gr.CaptureError):
        r(x=torch.ones(2, 3))
