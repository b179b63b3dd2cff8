"""Eager breaks do not pin the memory of the tensors they are given (issue 13
item 3): a segment's output passed to a break is held through the graph's
memory, not the caller's tensor object, so once the caller drops it nothing
but the graph refers to it, as on a CUDA pool."""

from __future__ import annotations

import gc
import weakref

import torch

import graphrunner.breakable as breakable_mod
from graphrunner.breakable import BreakableGraph, breakable_graph, no_graph
from graphrunner.devices import TapeDevice


@no_graph
def _halve(h: torch.Tensor) -> torch.Tensor:
    return h / (1.0 + h.abs().max().item())


def _capture(x, w, refs):
    """Capture ``relu(x @ w) -> break -> * 3``, handing the break a segment
    output that only the step's frame references; ``refs`` gets a weak
    reference to it."""
    graph = BreakableGraph(device=TapeDevice())
    with torch.inference_mode(), breakable_graph(graph):
        h = torch.relu(x @ w) + 0.5
        refs.append(weakref.ref(h))
        out = _halve(h) * 3
        del h
    return graph, out


def _eager(x, w):
    with torch.inference_mode():
        return _halve(torch.relu(x @ w) + 0.5) * 3


def test_dropped_break_input_is_freed_and_replay_stays_exact():
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(4, 8, generator=g), torch.randn(8, 8, generator=g)
    refs: list = []
    graph, out = _capture(x, w, refs)
    gc.collect()
    assert refs[0]() is None, "the eager break (or its segment) still holds the caller's tensor object"
    for seed in range(3):
        x.copy_(torch.randn(4, 8, generator=torch.Generator().manual_seed(10 + seed)))
        graph.replay()
        assert torch.equal(out, _eager(x, w))


def test_negative_control_strong_references_pin_the_input(monkeypatch):
    """With the break keeping its arguments as given (the old behaviour, the
    hold disabled), the caller's tensor object stays alive after capture."""
    monkeypatch.setattr(breakable_mod, "_hold", lambda v, owns: v)
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(4, 8, generator=g), torch.randn(8, 8, generator=g)
    refs: list = []
    graph, out = _capture(x, w, refs)
    gc.collect()
    assert refs[0]() is not None
    graph.replay()
    assert torch.equal(out, _eager(x, w))


def test_external_break_inputs_are_kept_as_given():
    """A tensor the graph did not produce (a static input) is the user's
    buffer, kept like every external of a tape; the break sees it in place."""
    seen = []

    @no_graph
    def record(t):
        seen.append(t)
        return t * 2

    x = torch.randn(3)
    graph = BreakableGraph(device=TapeDevice())
    with torch.inference_mode(), breakable_graph(graph):
        out = record(x) + 1
    x.copy_(torch.randn(3))
    graph.replay()
    assert seen[-1] is x
    with torch.inference_mode():
        assert torch.equal(out, x * 2 + 1)
