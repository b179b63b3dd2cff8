"""A tensor created inside a capture and kept on an object, not returned (issue 21 item 5b).

``self.last = h`` in a step: Python does not run at replay, so the attribute
is never re-bound; a runner with several buckets (and its eager checks)
leaves it holding another call's tensor.  A tape capture warns
(:class:`StashedTensorWarning`, an :class:`EscapedTensorWarning`), naming the
attribute; through a runner (or any backend with the drift check) the
stashed-state check raises instead (tests/test_cross_call.py has the
reproduction of issue 33).  The negative control turns both off and shows the
stale attribute passing silently.
"""

import warnings

import pytest
import torch

import graphrunner as gr
import graphrunner.tape.graph as tape_graph_mod
from graphrunner.tape import EscapedTensorWarning, StashedTensorWarning, TapeGraph, tape_graph

H = 4
STASH: dict = {}


class Step(torch.nn.Module):
    def __init__(self, keep="attr"):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(H, H, generator=torch.Generator().manual_seed(0)), requires_grad=False)
        self.keep = keep

    def forward(self, x):
        h = x @ self.w
        if self.keep == "attr":
            self.last = h
        elif self.keep == "list":
            self.history = [h]
        elif self.keep == "global":
            STASH["h"] = h
        elif self.keep == "buffer":
            self.register_buffer("state", h, persistent=False)
        elif self.keep == "returned":
            self.last = h
            return h
        return h.sum(-1)


def _capture(step, x):
    with torch.inference_mode():
        g = TapeGraph()
        with tape_graph(g):
            out = step(x)
    return g, out


@pytest.mark.parametrize(
    "keep,name",
    [
        ("attr", r"Step\.last"),
        ("list", r"Step\.history\[0\]"),
        ("buffer", r"Step\.state"),
        ("global", r"test_tape_stashed\.STASH\['h'\]"),
    ],
)
def test_a_tensor_kept_on_self_and_not_returned_warns_naming_the_attribute(keep, name):
    s = Step(keep)
    with pytest.warns(StashedTensorWarning, match=name + r" after it and is not among the capture's outputs"):
        _capture(s, torch.randn(2, H))
    assert issubclass(StashedTensorWarning, EscapedTensorWarning)


def test_no_warning_for_outputs_and_for_steps_that_keep_nothing():
    with warnings.catch_warnings():
        warnings.simplefilter("error", EscapedTensorWarning)
        g, out = _capture(Step("returned"), torch.randn(2, H))  # kept on self, but an output too
        g, out = _capture(Step("none"), torch.randn(2, H))
        g.replay()


def _runner(step, **kw):
    r = gr.GraphRunner(
        step, {"x": gr.BatchInput(trailing=(H,))}, [2, 4], backend="full", device="tape", progress=False, **kw
    )
    return r


def _stale_after_calls(r, s) -> bool:
    """After calls of 3 and 4 rows (bucket 4), is ``s.last`` other than what eager would have left there?"""
    stale = False
    for n in (3, 4):
        x = torch.randn(n, H)
        r(x=x)
        want = x @ s.w
        stale |= s.last.shape != want.shape or not torch.equal(s.last, want)
    return stale


def test_runner_capture_refuses_naming_self_last_and_the_line():
    """Through a runner the stashed-state check (part of the drift check) raises at capture, naming the
    attribute and the line that assigns it; the tape's warning is not issued as well."""
    s = Step("attr")
    r = _runner(s)
    with warnings.catch_warnings():
        warnings.simplefilter("error", EscapedTensorWarning)
        with pytest.raises(
            gr.CaptureError,
            match=r"kept in Step\.last after it \(assigned at .*test_tape_stashed"
            r"\.py:\d+ in forward: `self\.last = h`\)",
        ):
            r.capture()


def test_negative_control_without_the_checks_the_stale_attribute_passes_silently(monkeypatch):
    monkeypatch.setattr(tape_graph_mod, "warn_stashed", lambda cap, const_storages: None)
    s = Step("attr")
    r = _runner(s, checks=("padding", "fingerprint"))  # no drift check: no stashed-state check either
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        r.capture()
    assert not [w for w in rec if issubclass(w.category, EscapedTensorWarning)]
    assert _stale_after_calls(r, s)  # what the error is about
