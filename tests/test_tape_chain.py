"""Chaining TapeGraphs with eager code between (the breakable-graph pattern) and
escaped-tensor warnings (TAPE-NOTES items 7 and 8)."""

import warnings

import pytest
import torch

from graphrunner.tape import EscapedTensorWarning, TapeGraph, tape_graph


def test_two_graphs_with_eager_break_between_match_eager():
    torch.manual_seed(0)
    w1, w2 = torch.randn(8, 8), torch.randn(8, 8)
    x = torch.randn(2, 8)
    scale = torch.ones(2, 1)  # static buffer written by the eager break

    def part1():
        return torch.tanh(x @ w1)

    def eager_break(h):  # host-side code that cannot be captured
        scale.copy_(h.abs().amax(dim=1, keepdim=True) + float(h.sum().item() > 0))

    def part2(h):
        return (h / scale) @ w2 + h

    def eager_step():
        h = part1()
        eager_break(h)
        return part2(h)

    with torch.inference_mode():
        g1, g2 = TapeGraph(), TapeGraph()
        with tape_graph(g1):
            h = part1()  # survives: read by the eager break and by graph 2
        eager_break(h)
        with tape_graph(g2):
            out = part2(h)  # h is an external of graph 2
        with warnings.catch_warnings():
            warnings.simplefilter("error", EscapedTensorWarning)  # pure chaining must not warn
            for _ in range(4):
                x.copy_(torch.randn(2, 8))
                g1.replay()
                eager_break(h)
                g2.replay()
                ref = eager_step()
                assert torch.equal(out, ref)
        # negative control: skipping graph 1's replay leaves h stale -> wrong result
        x.copy_(torch.randn(2, 8))
        eager_break(h)
        g2.replay()
        assert not torch.equal(out, eager_step())


def test_survivor_written_by_another_graph_warns():
    x = torch.randn(4)
    state = {}
    with torch.inference_mode():
        g1, g2 = TapeGraph(), TapeGraph()
        with tape_graph(g1):
            if "cache" not in state:
                state["cache"] = torch.zeros(4)  # lazily allocated inside a capture: wrong
            y = x + state["cache"]
        with pytest.warns(EscapedTensorWarning, match="another graph"):
            with tape_graph(g2):
                state["cache"].add_(x)
        # negative control: a buffer allocated before capture does not warn
        buf = torch.zeros(4)
        g3 = TapeGraph()
        with warnings.catch_warnings():
            warnings.simplefilter("error", EscapedTensorWarning)
            with tape_graph(g3):
                buf.add_(x)
    assert y is not None


def test_survivor_written_by_eager_code_warns_at_next_replay():
    x = torch.randn(4)
    with torch.no_grad():  # version counters exist outside inference_mode
        g = TapeGraph()
        with tape_graph(g):
            acc = x * 2
        with warnings.catch_warnings():
            warnings.simplefilter("error", EscapedTensorWarning)
            g.replay()  # negative control: untouched survivor, no warning
            g.replay()
        acc.add_(1)  # eager write to the graph's survivor
        with pytest.warns(EscapedTensorWarning, match="outside the graph"):
            g.replay()
        assert torch.equal(acc, x * 2)  # and the replay overwrote it


class _DiesAfter:
    """A weak reference whose tensor is freed (by another thread, say) after ``n`` dereferences."""

    def __init__(self, ref, n):
        self.ref, self.n = ref, n

    def __call__(self):
        self.n -= 1
        return self.ref() if self.n >= 0 else None


def test_survivor_freed_between_version_reads_does_not_break_replay():
    # a replay reads each held survivor's version once before the replay and once after;
    # a survivor freed in between (its last reference dropped by another thread) is skipped,
    # not dereferenced twice (the second dereference gets None: AttributeError)
    x = torch.randn(4)
    with torch.no_grad():  # version counters exist outside inference_mode
        g = TapeGraph()
        with tape_graph(g):
            acc = x * 2
        assert g._versioned
        g._versioned = [(_DiesAfter(w, 2), v) for w, v in g._versioned]
        g.replay()
        assert torch.equal(acc, x * 2)
