"""The replay's fast paths (issue 44, items 3 and 4): each against eager with real values, and what
they must leave alone (torch's executor flag, grad mode, the static buffers)."""

import pytest
import torch

import graphrunner as gr
from graphrunner.tape import TapeGraph, tape_graph
from graphrunner.tape import jit as tape_jit


@pytest.fixture(autouse=True)
def _trace_small_programs(monkeypatch):
    """These tests trace small programs on purpose (the trace's mechanics), below the
    size from which a graph is traced by default (jit.JIT_MIN_OPS)."""
    monkeypatch.setattr(tape_jit, "JIT_MIN_OPS", 0)


def _mlp():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.ReLU(), torch.nn.Linear(32, 32)).eval()
    model.requires_grad_(False)
    return model


def test_the_traced_replay_keeps_the_callers_executor_flag_and_matches_eager():
    model, x = _mlp(), torch.randn(4, 32)
    g = TapeGraph(jit_replay=True)
    with torch.inference_mode():
        with tape_graph(g):
            out = model(x)
        assert g.replay_engine == "jit"
        get, put = torch._C._get_graph_executor_optimize, torch._C._set_graph_executor_optimize
        before = get()
        try:
            for flag in (True, False):
                put(flag)
                x.copy_(torch.randn(4, 32))
                g.replay()
                assert get() is flag  # put back as found, either way
                assert torch.equal(out, model(x))
        finally:
            put(before)


def test_a_grad_mode_capture_replays_with_grad_off_and_gives_grad_mode_back():
    model, x = _mlp(), torch.randn(4, 32)
    g = TapeGraph()
    with tape_graph(g):
        out = model(x)
    for jit in (True, False):
        g2 = TapeGraph(jit_replay=jit)
        with tape_graph(g2):
            out2 = model(x)
        for _ in range(2):
            x.copy_(torch.randn(4, 32))
            assert torch.is_grad_enabled()
            g2.replay()
            assert torch.is_grad_enabled()
            assert torch.equal(out2, model(x))
            assert not out2.requires_grad
    g.replay()
    assert torch.equal(out, model(x))


def test_serving_warms_the_copies_without_writing_the_static_buffers():
    w = torch.randn(8)
    runner = gr.GraphRunner(
        lambda x, y: x * w + y,
        {"x": gr.BatchInput(trailing=(8,)), "y": gr.BatchInput(trailing=(8,))},
        buckets=[1, 2, 4],
        progress=False,
    )
    runner.capture()
    staging = runner.server.inputs
    before = {n: b.clone() for n, b in staging.buffers.items()}
    filled = staging.filled
    staging.warm()
    assert staging.filled == filled
    for n, b in staging.buffers.items():
        assert torch.equal(b, before[n]), n
    # the first call of each bucket after capture is exact, whatever the calls before it left
    for n in (3, 1, 4, 2):
        x, y = torch.randn(n, 8), torch.randn(n, 8)
        assert torch.equal(runner(x=x, y=y), x * w + y)


def test_negative_control_a_replay_that_leaves_the_flag_off_is_caught(monkeypatch):
    from graphrunner.tape import jit

    model, x = _mlp(), torch.randn(4, 32)
    g = TapeGraph(jit_replay=True)
    get, put = torch._C._get_graph_executor_optimize, torch._C._set_graph_executor_optimize
    before = get()
    with torch.inference_mode():
        with tape_graph(g):
            out = model(x)
        assert g.replay_engine == "jit" and out is not None
        monkeypatch.setattr(jit, "_set_optimize", lambda flag: put(False))  # never puts it back
        try:
            put(True)
            g.replay()
            assert get() is False  # what the first test's check catches
        finally:
            put(before)
