"""Capture hygiene: break results with structure, pools, empty segments, warmup
streams, GC freezing, pool release and grad-requiring inputs."""

from __future__ import annotations

import dataclasses
import gc

import pytest
import torch

import graphrunner as gr
from graphrunner.backends import FullGraphBackend
from graphrunner.breakable import BreakableGraph, breakable_graph, no_graph
from graphrunner.devices import TapeDevice, get_device
from graphrunner.errors import CaptureError
from graphrunner.tape import graph_pool_handle


@dataclasses.dataclass
class Meta:
    lens: torch.Tensor
    scale: int


def _capture(fn, device=None, pool=None):
    graph = BreakableGraph(device=device or TapeDevice(), pool=pool)
    with torch.inference_mode(), breakable_graph(graph):
        out = fn()
    return graph, out


def test_break_returning_a_dataclass_refreshes_its_tensors_and_freezes_its_scalars():
    state = {"scale": 3}

    @no_graph
    def metadata(x):
        return Meta(lens=x.sum(-1), scale=state["scale"])

    x = torch.ones(2, 4)

    def step():
        m = metadata(x * 2)
        return m.lens * m.scale

    graph, out = _capture(step)
    x.copy_(torch.arange(8.0).reshape(2, 4))
    graph.replay()
    assert torch.equal(out, (x * 2).sum(-1) * 3)
    state["scale"] = 4  # a Python value the later segment froze at 3
    with pytest.raises(CaptureError, match=r"metadata.*froze that Python value"):
        graph.replay()


def test_break_returning_an_opaque_object_is_rejected_at_capture():
    @no_graph
    def opaque(x):
        return object()

    graph = BreakableGraph(device=TapeDevice())
    with pytest.raises(CaptureError, match=r"opaque.*may return only tensors"):
        with breakable_graph(graph):
            opaque(torch.ones(2))
    assert not graph.captured


class PoolRecordingDevice(TapeDevice):
    def __init__(self):
        super().__init__()
        self.pools, self.empty_checks, self.in_warmup, self.released = [], 0, False, 0

    def capture(self, graph, stream=None, capture_error_mode="global", pool=None):
        self.pools.append(pool)
        return super().capture(graph, stream=stream, capture_error_mode=capture_error_mode, pool=pool)

    def is_empty(self, graph):
        self.empty_checks += 1
        return super().is_empty(graph)

    def warmup_context(self):
        device = self

        class _Ctx:
            def __enter__(self):
                device.in_warmup = True

            def __exit__(self, *exc):
                device.in_warmup = False

        return _Ctx()

    def release_pool(self):
        self.released += 1
        super().release_pool()


def test_breakable_graph_pool_is_used_for_every_segment():
    dev = PoolRecordingDevice()
    mine = graph_pool_handle()

    @no_graph
    def brk(t):
        return t + 1

    x = torch.ones(3)
    _capture(lambda: brk(x * 2) * 3, device=dev, pool=mine)
    assert dev.pools and all(p is mine for p in dev.pools)
    dev.pools.clear()
    # control: no override -> pool=None, the device's own shared pool, which the device may renew
    # (a CUDA pool released by all its graphs cannot be captured into again)
    _capture(lambda: brk(x * 2) * 3, device=dev)
    assert dev.pools and all(p is None for p in dev.pools)


def test_empty_segments_are_decided_by_the_device():
    """CUDA graphs have no op count: the device says whether a segment is empty."""
    dev = PoolRecordingDevice()

    @no_graph
    def brk(t):
        return t + 1

    x = torch.zeros(2)
    graph, out = _capture(lambda: brk(brk(x)), device=dev)
    assert dev.empty_checks == 3 and graph.num_segments == 0 and graph.num_breaks == 2
    x.fill_(5.0)
    graph.replay()
    assert torch.equal(out, torch.full((2,), 7.0))


def test_warmups_and_hooks_run_in_the_device_warmup_context_and_capture_does_not():
    dev = PoolRecordingDevice()
    seen = []
    x = torch.ones(2)

    def forward():
        seen.append(("forward", dev.in_warmup))
        return x * 2

    backend = FullGraphBackend(device=dev, warmups=2)
    with backend.capture_session():
        backend.capture_one(2, forward, post_warmup_hook=lambda: seen.append(("hook", dev.in_warmup)))
    assert seen == [("forward", True), ("hook", True), ("forward", True), ("hook", True), ("forward", False)]


def test_cleanup_releases_the_pool_and_the_runner_captures_again():
    dev = PoolRecordingDevice()
    w = torch.randn(4, 4)
    runner = gr.GraphRunner(
        lambda x: x @ w,
        inputs={"x": gr.BatchInput(trailing=(4,), dtype=torch.float32)},
        buckets=[1, 2],
        backend="full",
        device=dev,
        progress=False,
    )
    runner.capture()
    first_pool = dev.graph_pool()
    runner.cleanup()
    assert dev.released == 1 and dev.graph_pool() is not first_pool
    runner.capture()
    x = torch.randn(2, 4)
    with torch.inference_mode():
        expected = x @ w
    assert torch.equal(runner(x=x), expected)


def test_capture_session_keeps_a_callers_gc_freeze():
    backend = FullGraphBackend(device=TapeDevice(), warmups=0)
    assert gc.get_freeze_count() == 0
    with backend.capture_session():
        assert gc.get_freeze_count() > 0
    assert gc.get_freeze_count() == 0  # control: the session undoes its own freeze
    gc.freeze()
    try:
        frozen = gc.get_freeze_count()
        with backend.capture_session():
            pass
        assert gc.get_freeze_count() >= frozen  # the engine's freeze survives
    finally:
        gc.unfreeze()


def test_inputs_that_require_grad_do_not_chain_autograd_onto_static_buffers():
    w = torch.randn(3, 3)
    runner = gr.GraphRunner(
        lambda x: x @ w,
        inputs={"x": gr.BatchInput(trailing=(3,), dtype=torch.float32)},
        buckets=[2, 4],
        backend="full",
        device="tape",
        progress=False,
    )
    runner.capture()
    for _ in range(3):
        x = torch.randn(3, 3, requires_grad=True)
        out = runner(x=x)
        assert torch.equal(out, x.detach() @ w)
    assert all(buf.grad_fn is None for buf in runner.static_inputs.values())


def test_get_device_names_missing_methods_of_a_custom_device():
    class Half:
        def synchronize(self):
            pass

        def new_graph(self):
            return gr.tape.TapeGraph()

    with pytest.raises(TypeError, match=r"lacks graph_pool, capture_stream, capture"):
        get_device(Half())
