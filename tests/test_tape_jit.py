"""The TorchScript replay engine (tape.jit): same results as the Python replay.

Every test compares replay with eager PyTorch bit for bit on new input
values over several replays.  The negative control breaks the rollback of a
failed trace and shows the double write it prevents.
"""

import torch

from graphrunner.tape import TapeGraph, jit, tape_graph


def _step(x, w, cache, pos, idx):
    h = torch.nn.functional.linear(x * 2, w)                 # a weight matmul
    cache.index_put_((idx, pos), h)                           # a cache write at a runtime index
    rows = cache.index_select(0, idx)                        # reads it back
    return torch.softmax(rows @ w, -1) + h.sum()             # a list-held index, a reduction


def _make():
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(3, 8, generator=g), torch.randn(8, 8, generator=g)
    cache = torch.zeros(6, 4, 8)
    pos, idx = torch.tensor([0, 1, 2]), torch.tensor([4, 1, 3])
    return x, w, cache, pos, idx


def _capture(args, **kw):
    with torch.inference_mode():
        g = TapeGraph(**kw)
        with tape_graph(g):
            out = _step(*args)
    return g, out


def _replays_match(g, out, args, n=4) -> bool:
    x, w, cache, pos, idx = args
    gen = torch.Generator().manual_seed(1)
    ok = True
    for i in range(n):
        x.copy_(torch.randn(x.shape, generator=gen))
        pos.copy_(torch.randint(0, 4, (3,), generator=gen))
        idx.copy_(torch.randperm(6, generator=gen)[:3])
        before = cache.clone()
        g.replay()
        got, got_cache = out.clone(), cache.clone()
        cache.copy_(before)
        with torch.inference_mode():
            ref = _step(*args)
        ok &= torch.equal(got, ref) and torch.equal(got_cache, cache)
    return ok


def test_replays_through_a_trace_bit_exact_with_nothing_frozen():
    args = _make()
    g, out = _capture(args, jit_replay=True)
    assert g.replay_engine == "jit-pending"
    assert _replays_match(g, out, args)
    assert g.replay_engine == "jit"
    consts = [n for n in g._jit._trace.graph.nodes()
              if n.kind() == "prim::Constant" and n.output().type().kind() == "TensorType"]
    assert consts == []  # every tensor, the index list's included, is a parameter


def test_python_engine_on_request_and_by_environment(monkeypatch):
    args = _make()
    g, out = _capture(args, jit_replay=False)
    assert g.replay_engine == "python" and _replays_match(g, out, args)
    monkeypatch.setenv(jit.JIT_ENV_VAR, "0")
    assert TapeGraph().jit_replay is False
    monkeypatch.setenv(jit.JIT_ENV_VAR, "1")
    assert TapeGraph().jit_replay is True


def test_a_program_binding_a_generator_replays_in_python():
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(4)
    with torch.inference_mode():
        g = TapeGraph(jit_replay=True)
        with tape_graph(g):
            out = x + torch.randn(4, generator=gen)
    state = gen.get_state()
    g.replay()
    assert g.replay_engine == "python"
    gen.set_state(state)
    assert torch.equal(out, x + torch.randn(4, generator=gen))


def _failing_trace(fn, args, **kw):
    fn(*args)  # runs the whole replay, as tracing does, then fails
    raise RuntimeError("planted trace failure")


def test_a_failed_trace_rolls_back_and_replays_in_python(monkeypatch):
    args = _make()
    g, out = _capture(args, jit_replay=True)
    monkeypatch.setattr(torch.jit, "trace", _failing_trace)
    assert _replays_match(g, out, args)
    assert g.replay_engine == "python" and "planted trace failure" in g._jit.why_python


def test_negative_control_without_the_rollback_the_cache_write_lands_twice(monkeypatch):
    """A read-modify-write of an external shows the double write."""
    cache, x = torch.zeros(4), torch.randn(4)
    with torch.inference_mode():
        g = TapeGraph(jit_replay=True)
        with tape_graph(g):
            cache.add_(x)
    monkeypatch.setattr(torch.jit, "trace", _failing_trace)
    g.replay()
    assert torch.equal(cache, x)  # one write, rolled back once
    cache.zero_()
    g2 = TapeGraph(jit_replay=True)
    with torch.inference_mode(), tape_graph(g2):
        cache.add_(x)
    monkeypatch.setattr(jit, "_restore", lambda saved: None)
    g2.replay()
    assert torch.equal(cache, 2 * x)  # the trace's write, then the Python replay's


def test_a_replay_under_a_dispatch_mode_runs_in_python_and_is_not_traced():
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.n += 1
            return func(*args, **(kwargs or {}))

    args = _make()
    g, out = _capture(args, jit_replay=True)
    with Count():
        g.replay()
    assert Count.n > 0 and g.replay_engine == "jit-pending"  # the mode saw the ops; no trace was made
    assert _replays_match(g, out, args) and g.replay_engine == "jit"
