"""CUDA conformance without a GPU (issue 23).

Two parts:

1. The rules of :mod:`graphrunner.testing.cuda_standin` (torch 2.13's CUDAGraph.cpp and
   caching allocator), each shown firing when broken and silent when followed.
2. The defects those rules found in graphrunner's CUDA paths, each driven through
   ``CudaDevice``: tests marked ``cuda`` take the ``cuda_device`` fixture and run on the real
   GPU where there is one, on the stand-in elsewhere; the ones that would leave a real
   process unusable (a capture CUDA cannot end) run on the stand-in only.
"""

from __future__ import annotations

import os
import tempfile
import warnings

import pytest
import torch
import torch.distributed as dist

import graphrunner as gr
from graphrunner.backends import BreakableGraphBackend, FullGraphBackend
from graphrunner.breakable import BreakableGraph, breakable_graph, no_graph
from graphrunner.devices import CudaDevice
from graphrunner.errors import CaptureError, RankTimeoutError
from graphrunner.testing import cuda_standin as cs

W = torch.randn(16, 16, generator=torch.Generator().manual_seed(0))


def dense(x):
    return torch.tanh(x @ W) * 2 + 1


@no_graph
def host_norm(x):
    """Eager work a graph cannot hold (reads the data on the host)."""
    return x / (float(x.abs().max()) + 1.0)


def break_first(x):
    return dense(host_norm(x)) + 3


def break_middle(x):
    return dense(host_norm(dense(x)))


def _static(dev, seed=0, rows=4):
    return torch.randn(rows, 16, generator=torch.Generator().manual_seed(seed)).to(dev.torch_device)


# =========================================================================== 1. the stand-in's rules


def test_every_standin_call_has_the_installed_torch_signature():
    assert cs.check_signatures() == []


def test_signature_check_catches_a_standin_that_drifts_from_torch():
    """Negative control: a stand-in function with another signature than torch's is reported."""
    api = dict(cs.CudaStandin()._api)
    api["synchronize"] = lambda device=None, non_blocking=False: None
    assert cs.check_signatures(api) == ["synchronize"]


def test_standin_calls_are_bound_to_the_real_signature(cuda_standin):
    with pytest.raises(TypeError):
        torch.cuda.synchronize(0, 1)  # torch's synchronize takes one argument
    with pytest.raises(TypeError):
        torch.cuda.CUDAGraph().capture_begin(pool=None, mode="global")  # no such keyword in torch
    with pytest.raises(ValueError, match="Expected a cuda device"):
        torch.cuda.current_stream(torch.device("cpu"))


def test_capture_on_the_default_stream_is_refused(cuda_standin):
    g = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="non-default stream"):
        g.capture_begin()
    s = torch.cuda.Stream()
    x = torch.ones(3)
    with torch.cuda.stream(s):  # the rule followed: a side stream
        g.capture_begin()
        y = x * 2
        g.capture_end()
    x.fill_(5)
    g.replay()
    assert torch.equal(y, torch.full((3,), 10.0))


def test_capture_must_end_on_its_stream(cuda_standin):
    g = torch.cuda.CUDAGraph()
    s, other = torch.cuda.Stream(), torch.cuda.Stream()
    x = torch.ones(2)
    with torch.cuda.stream(s):
        g.capture_begin()
        x.mul(3)
    with torch.cuda.stream(other), pytest.raises(RuntimeError, match="same stream it began on"):
        g.capture_end()
    with torch.cuda.stream(s):
        g.capture_end()  # negative control: on its own stream it ends
    g.replay()


def test_a_graph_that_owns_a_capture_refuses_another_until_reset(cuda_standin):
    g, x = torch.cuda.CUDAGraph(), torch.ones(2)
    with torch.cuda.graph(g):
        x.add(1)
    with pytest.raises(RuntimeError, match="already owns a captured graph"):
        with torch.cuda.graph(g):
            x.add(1)
    g.reset()
    with torch.cuda.graph(g):  # after reset it captures again
        y = x.add(2)
    g.replay()
    assert torch.equal(y, torch.full((2,), 3.0))


def test_a_pool_released_by_all_its_graphs_cannot_be_captured_into_until_empty_cache(cuda_standin):
    pool, x = torch.cuda.graph_pool_handle(), torch.ones(4)
    a, b = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
    with torch.cuda.graph(a, pool=pool):
        x * 2
    with torch.cuda.graph(b, pool=pool):  # sharing a live pool is fine
        x * 3
    assert cuda_standin.pool_use_count(pool) == 2
    a.reset()
    del b  # the destructor releases as reset() does
    assert cuda_standin.pool_use_count(pool) == 0
    s = torch.cuda.Stream()
    c = torch.cuda.CUDAGraph()
    with torch.cuda.stream(s), pytest.raises(RuntimeError, match=r"use_count > 0 INTERNAL ASSERT"):
        c.capture_begin(pool=pool)
    # Negative control: once empty_cache() freed the released pool, its handle captures again.
    cuda_standin.allocator().captures_underway.clear()  # the failed begin above left it recording
    torch.cuda.empty_cache()
    d = torch.cuda.CUDAGraph()
    with torch.cuda.graph(d, pool=pool):
        x * 4
    assert cuda_standin.pool_use_count(pool) == 1


def test_synchronize_during_capture_invalidates_it_and_strands_the_allocator(cuda_standin):
    g, x = torch.cuda.CUDAGraph(), torch.ones(2)
    s = torch.cuda.Stream()
    torch.cuda.synchronize()  # negative control: outside a capture it is fine
    torch.cuda.empty_cache()
    with torch.cuda.stream(s):
        g.capture_begin()
        x * 2
        with pytest.raises(RuntimeError, match="operation not permitted when stream is capturing"):
            torch.cuda.synchronize()
        with pytest.raises(RuntimeError, match="previous error during capture"):
            g.capture_end()
    assert len(cuda_standin.allocator().captures_underway) == 1  # endAllocateToPool never ran
    with pytest.raises(RuntimeError, match=r"captures_underway.empty\(\) INTERNAL ASSERT"):
        torch.cuda.empty_cache()
    with pytest.raises(RuntimeError, match="without a preceding successful capture"):
        g.replay()


def test_host_sync_op_during_capture_invalidates_it(cuda_standin):
    g, x = torch.cuda.CUDAGraph(), torch.ones(2)
    with torch.cuda.stream(torch.cuda.Stream()):
        g.capture_begin()
        with pytest.raises(gr.CaptureUnsafeOpError):
            x.sum().item()
        with pytest.raises(RuntimeError, match="previous error during capture"):
            g.capture_end()


def test_empty_capture_warns_as_cuda_graph_cpp(cuda_standin):
    g = torch.cuda.CUDAGraph()
    with pytest.warns(UserWarning, match="The CUDA Graph is empty"):
        with torch.cuda.graph(g):
            pass
    h = torch.cuda.CUDAGraph()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # negative control: a capture with work does not warn
        with torch.cuda.graph(h):
            torch.ones(2).add(1)


def test_replay_computes_real_results_and_outputs_are_garbage_until_then(cuda_standin):
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(1))
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = dense(x)
    assert torch.isnan(y).all()  # uninitialised pool memory until the first replay
    fresh = torch.randn(4, 16, generator=torch.Generator().manual_seed(2))
    x.copy_(fresh)
    g.replay()
    assert torch.equal(y, dense(fresh))


@pytest.fixture
def gloo_world_of_one():
    """A one-rank gloo process group in this process."""
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    d = tempfile.mkdtemp()
    dist.init_process_group("gloo", init_method=f"file://{os.path.join(d, 'store')}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_a_gloo_collective_cannot_be_captured(cuda_standin, gloo_world_of_one):
    t = torch.ones(3)
    dist.all_reduce(t)  # negative control: eagerly it runs
    assert torch.equal(t, torch.ones(3))
    g = torch.cuda.CUDAGraph()
    with torch.cuda.stream(torch.cuda.Stream()):
        g.capture_begin()
        with pytest.raises(RuntimeError, match="gloo.*not permitted when stream is capturing|ProcessGroupGloo"):
            dist.all_reduce(t)
        with pytest.raises(RuntimeError, match="previous error during capture"):
            g.capture_end()


# =========================================================================== 2. the defects


def _capture_step(backend, step, x, key=4):
    with backend.capture_session():
        backend.capture_one(key, lambda: step(x), capture_inputs=x)


@pytest.mark.cuda
@pytest.mark.parametrize("step", [break_first, break_middle], ids=["break_first", "break_middle"])
def test_breakable_step_starting_with_a_break_captures_and_replays(cuda_device, step):
    """Defect 1: an empty first segment released the shared pool's only user; the next
    segment's capture_begin hit ``INTERNAL ASSERT use_count > 0``."""
    x = _static(cuda_device)
    backend = BreakableGraphBackend(device=cuda_device)
    _capture_step(backend, step, x)
    for seed in (3, 4):
        fresh = _static(cuda_device, seed)
        x.copy_(fresh)
        assert torch.equal(backend.replay(4), step(fresh))
    backend.cleanup()


@pytest.mark.cuda
def test_debug_eager_captures_and_replays(cuda_device):
    """Defect 1: ``debug_eager=True`` always starts with an empty segment."""
    x = _static(cuda_device)
    backend = BreakableGraphBackend(device=cuda_device, debug_eager=True)
    _capture_step(backend, dense, x)
    fresh = _static(cuda_device, 5)
    x.copy_(fresh)
    assert torch.equal(backend.replay(4), dense(fresh))
    assert backend.info(4)["num_breaks"] == 1


@pytest.mark.cuda
def test_breakable_graph_reset_then_recapture_on_the_same_device(cuda_device):
    """Defect 1: ``BreakableGraph.reset()`` released every graph of the device's pool; the
    next capture on the device captured into that released pool."""
    x = _static(cuda_device)
    g = BreakableGraph(device=cuda_device)
    with breakable_graph(g, stream=cuda_device.capture_stream()):
        out = break_middle(x)
    g.reset()
    with breakable_graph(g, stream=cuda_device.capture_stream()):
        out = break_middle(x)
    fresh = _static(cuda_device, 6)
    x.copy_(fresh)
    g.replay()
    assert torch.equal(out, break_middle(fresh))


@pytest.mark.cuda
@pytest.mark.parametrize("backend_cls", [FullGraphBackend, BreakableGraphBackend])
def test_retry_of_the_first_key_after_a_failed_capture(cuda_device, backend_cls):
    """Defect 1: a failed first capture released the pool; the retry captured into it."""
    x = _static(cuda_device)
    calls = []
    step = break_middle if backend_cls is BreakableGraphBackend else dense

    def flaky(t):
        calls.append(1)
        if len(calls) == 3:  # the capture (after two warmups), once
            raise ValueError("flaky step")
        return step(t)

    backend = backend_cls(device=cuda_device)
    with pytest.raises(CaptureError, match="shape key 4"):
        _capture_step(backend, flaky, x)
    _capture_step(backend, flaky, x)
    fresh = _static(cuda_device, 7)
    x.copy_(fresh)
    assert torch.equal(backend.replay(4), step(fresh))


@pytest.mark.cuda
@pytest.mark.parametrize("backend_cls", [FullGraphBackend, BreakableGraphBackend])
def test_retry_of_the_first_key_in_the_same_capture_session(cuda_device, backend_cls):
    """A backend used directly (``capture_one`` in one ``capture_session``, as SGLang's runner
    drives it) whose first key's capture raises in the forward retries that key in the same
    session: the failed capture released the only use of the shared pool (no ``empty_cache``
    in between frees it), so the retry must capture into a fresh pool, not the released one
    (``INTERNAL ASSERT use_count > 0`` in the caching allocator)."""
    x = _static(cuda_device)
    calls = []
    step = break_middle if backend_cls is BreakableGraphBackend else dense

    def flaky(t):
        calls.append(1)
        if len(calls) == 3:  # the first capture (after two warmups), once
            raise ValueError("flaky step")
        return step(t)

    backend = backend_cls(device=cuda_device)
    with backend.capture_session():
        with pytest.raises(CaptureError, match="(?s)shape key 4.*flaky step") as failed:
            backend.capture_one(4, lambda: flaky(x), capture_inputs=x)
        assert "use_count" not in str(failed.value)
        failed = None  # the traceback holds the failed capture's tensors
        released = cuda_device.graph_pool()
        backend.capture_one(4, lambda: flaky(x), capture_inputs=x)
        assert cuda_device.graph_pool() != released
        if cs.installed_standin() is not None:  # what a retry into it would have hit
            assert cs.installed_standin().pool_use_count(released) == 0
        backend.capture_one(2, lambda: step(x[:2]), capture_inputs=x)  # the next key shares the new pool
    for seed in (7, 8):
        fresh = _static(cuda_device, seed)
        x.copy_(fresh)
        assert torch.equal(backend.replay(4), step(fresh))
        assert torch.equal(backend.replay(2), step(fresh[:2]))
    backend.cleanup()


def _syncing_step(t):
    y = dense(t)
    torch.cuda.synchronize()  # host sync inside the captured step: invalidates a CUDA capture
    return y


@pytest.mark.parametrize("backend_cls", [FullGraphBackend, BreakableGraphBackend])
def test_a_capture_cuda_cannot_end_says_restart(cuda_standin, backend_cls):
    """Defect 2: capture_end throws on an invalidated capture before it tells the allocator;
    the error must say that the process needs a restart, and later captures are refused."""
    dev = CudaDevice()
    x = _static(dev)
    backend = backend_cls(device=dev)
    with pytest.raises(CaptureError, match="(?s)shape key 4.*Restart the process") as info:
        _capture_step(backend, _syncing_step, x)
    assert "operation not permitted when stream is capturing" in str(info.value)
    assert cuda_standin.allocator().captures_underway  # the allocator really is mid-capture
    with pytest.raises(CaptureError, match="Restart the process"):
        _capture_step(backend_cls(device=CudaDevice()), dense, x, key=2)
    with pytest.raises(CaptureError, match="Restart the process"):
        dev.empty_cache()  # instead of torch's INTERNAL ASSERT


def test_a_capture_that_fails_but_ends_cleanly_does_not_ask_for_a_restart(cuda_standin):
    """Negative control of the above: a Python error in the step leaves the allocator healthy."""
    dev = CudaDevice()
    x = _static(dev)

    def bad(t):
        raise KeyError("no such layer")

    with pytest.raises(CaptureError) as info:
        _capture_step(FullGraphBackend(device=dev, warmups=0), bad, x)
    assert "Restart" not in str(info.value)
    assert not cuda_standin.allocator().captures_underway
    torch.cuda.empty_cache()
    _capture_step(FullGraphBackend(device=dev), dense, x, key=2)


class _TwoRanks(gr.LocalGroup):
    """One process posing as rank 0 of 2 (its barriers return at once)."""

    size = 2


def _all_reduce_step(t):
    y = dense(t)
    dist.all_reduce(y)
    return y


@pytest.mark.parametrize("backend_cls", [FullGraphBackend, BreakableGraphBackend])
def test_a_gloo_collective_in_a_cuda_capture_is_a_capture_error_not_a_rank_timeout(
    cuda_standin, gloo_world_of_one, backend_cls
):
    """Defect 4: the capture error of a gloo collective was classified as RankTimeoutError
    because its text names the process group."""
    dev = CudaDevice()
    x = _static(dev)
    backend = backend_cls(device=dev, group=_TwoRanks())
    with pytest.raises(CaptureError, match="(?s)shape key 4.*only NCCL collectives can be captured") as info:
        _capture_step(backend, _all_reduce_step, x)
    assert not isinstance(info.value, RankTimeoutError)
    assert "all_reduce" in str(info.value)


def test_a_collective_that_fails_outside_capture_is_still_a_rank_timeout(gloo_world_of_one):
    """Negative control: a collective failure in a warmup (not in a CUDA capture) of a
    multi-rank group stays a RankTimeoutError."""

    def dead_peer(t):
        raise RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer")

    backend = FullGraphBackend(device="tape", group=_TwoRanks())
    with pytest.raises(RankTimeoutError):
        _capture_step(backend, dead_peer, torch.ones(4, 16))


def test_each_rank_binds_its_own_gpu(cuda_standin):
    """Defect 4: every rank of ``loadtest --ranks N`` used cuda:0."""
    from graphrunner_tools.launch import bind_gpu

    assert torch.cuda.current_device() == 0
    assert bind_gpu(3) == 1  # 2 stand-in GPUs: rank 3 -> cuda:1
    assert torch.cuda.current_device() == 1
    assert CudaDevice().cuda_device == torch.device("cuda", 1)
    assert bind_gpu(2) == 0 and torch.cuda.current_device() == 0


def test_bind_gpu_without_cuda_does_nothing(monkeypatch):
    monkeypatch.delenv(cs.ENV_VAR, raising=False)
    from graphrunner_tools.launch import bind_gpu

    if torch.cuda.is_available():
        pytest.skip("has a GPU")
    assert bind_gpu(1) is None


@pytest.mark.cuda
def test_an_empty_full_graph_is_an_error(cuda_device):
    """Defect 6: a full graph that captured no work (on CUDA: work on another stream) replays
    as nothing; it was accepted silently."""
    x = _static(cuda_device)
    backend = FullGraphBackend(device=cuda_device, drift_check=False)
    with pytest.raises(CaptureError, match="(?s)shape key 4.*captured no work"):
        _capture_step(backend, lambda t: (), x)
    _capture_step(backend, dense, x, key=2)  # negative control: a step with work captures


@pytest.mark.cuda
def test_current_stream_waits_for_the_capture_stream_also_when_a_warmup_raises(cuda_device):
    """Defect 6: ``current.wait_stream(capture_stream)`` was skipped when the block raised,
    so later work on the current stream could race the warmup's."""
    if cs.installed_standin() is None:
        pytest.skip("stream waits are recorded by the stand-in only")
    current = torch.cuda.current_stream(cuda_device.cuda_device)
    side = cuda_device.capture_stream()
    with cuda_device.warmup_context():  # negative control: the normal path waits
        pass
    assert current.waited_on[-1:] == [side]
    current.waited_on.clear()
    with pytest.raises(ValueError):
        with cuda_device.warmup_context():
            raise ValueError("warmup failed")
    assert current.waited_on == [side]


@pytest.mark.cuda
def test_capture_session_empties_the_cache_and_info_reports_the_graph_pool(cuda_device):
    """Defect 6: no empty_cache around capture, and the graph pool was nowhere in ``info``."""
    x = _static(cuda_device)
    backend = FullGraphBackend(device=cuda_device)
    before = torch.cuda.memory_reserved(cuda_device.cuda_device)
    _capture_step(backend, dense, x)
    grown = torch.cuda.memory_reserved(cuda_device.cuda_device) - before
    info = backend.info(4)
    assert info["graph_pool_bytes"] == grown
    if cs.installed_standin() is not None:
        assert ("empty_cache", "") in cs.installed_standin().log
        assert grown > 0


def test_get_device_auto_follows_graphrunner_device(monkeypatch, cuda_standin):
    """Item 5: the suite sets GRAPHRUNNER_DEVICE=tape so that "auto" is the tape on a GPU box."""
    monkeypatch.setenv("GRAPHRUNNER_DEVICE", "tape")
    assert gr.get_device("auto").kind == "tape"
    monkeypatch.delenv("GRAPHRUNNER_DEVICE")
    assert gr.get_device("auto").kind == "cuda"  # negative control: unset, "auto" takes the GPU
    monkeypatch.setenv("GRAPHRUNNER_DEVICE", "gpu")
    with pytest.raises(ValueError, match="GRAPHRUNNER_DEVICE"):
        gr.get_device("auto")


def test_the_suite_runs_with_auto_meaning_tape():
    assert os.environ.get("GRAPHRUNNER_DEVICE") == "tape"
    assert gr.get_device("auto").kind == "tape"


@pytest.mark.cuda
def test_cuda_marked_tests_see_auto_as_cuda(cuda_device):
    assert "GRAPHRUNNER_DEVICE" not in os.environ
    assert gr.get_device("auto").kind == "cuda"
