"""The replay engine by program size (tape.jit.JIT_MIN_OPS).

A program replaying fewer than JIT_MIN_OPS ops replays in Python and is not
traced at capture end (the Python replay is faster there, and the capture
spares the trace); a bigger one is traced.  Both replay bit-equal to eager.
The negative control sets the threshold to 0: the small program is traced.
"""

import torch

from graphrunner.tape import TapeGraph, jit, tape_graph


def _small(x, w):
    return x * w + 1.0


def _big(x, w):
    y = x
    for _ in range(8):
        y = torch.relu(y * w + 1.0)
    return y


def _capture(step, x, w):
    with torch.inference_mode():
        g = TapeGraph(jit_replay=True)
        with tape_graph(g):
            out = step(x, w)
    return g, out


def _replays_like_eager(g, out, step, x, w) -> bool:
    ok = True
    for _ in range(3):
        with torch.inference_mode():
            x.copy_(torch.randn(x.shape))
        g.replay()
        with torch.inference_mode():
            ok &= torch.equal(out, step(x, w))
    return ok


def _traced(monkeypatch):
    calls = []
    real = torch.jit.trace

    def trace(*a, **k):
        calls.append(1)
        return real(*a, **k)

    monkeypatch.setattr(torch.jit, "trace", trace)
    return calls


def test_a_small_program_replays_in_python_untraced(monkeypatch):
    calls = _traced(monkeypatch)
    x, w = torch.randn(4, 16), torch.randn(16)
    g, out = _capture(_small, x, w)
    assert 0 < g.num_replayed_ops < jit.JIT_MIN_OPS
    assert g.replay_engine == "python" and calls == []
    assert _replays_like_eager(g, out, _small, x, w)
    assert calls == []  # nor at a replay


def test_a_big_program_is_traced(monkeypatch):
    calls = _traced(monkeypatch)
    x, w = torch.randn(4, 16), torch.randn(16)
    g, out = _capture(_big, x, w)
    assert g.num_replayed_ops >= jit.JIT_MIN_OPS
    assert g.replay_engine == "jit" and calls == [1]
    assert _replays_like_eager(g, out, _big, x, w)


def test_negative_control_without_the_threshold_the_small_program_is_traced(monkeypatch):
    monkeypatch.setattr(jit, "JIT_MIN_OPS", 0)
    calls = _traced(monkeypatch)
    x, w = torch.randn(4, 16), torch.randn(16)
    g, out = _capture(_small, x, w)
    assert g.replay_engine == "jit" and calls == [1]
    assert _replays_like_eager(g, out, _small, x, w)
