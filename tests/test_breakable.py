"""Breakable graphs: segments + eager breaks, replayed against eager PyTorch."""

from __future__ import annotations

import pytest
import torch

import graphrunner as gr
from graphrunner.breakable import BreakableGraph, breakable_graph, force_no_graph, is_in_breakable_graph, no_graph
from graphrunner.devices import CudaDevice, TapeDevice, get_device
from graphrunner.errors import CaptureError
from graphrunner.tape import is_tape_capturing


class BreakMLP(torch.nn.Module):
    """An MLP with one eager break per layer; the break does host-side work
    (``.item()``) that a graph could not hold."""

    def __init__(self, layers: int = 3, width: int = 16, seed: int = 0) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.weights = [torch.randn(width, width, generator=g) / width**0.5 for _ in range(layers)]
        self.break_calls = 0

    @no_graph
    def scale(self, h: torch.Tensor) -> torch.Tensor:
        self.break_calls += 1
        peak = h.abs().max().item()  # host sync: must run eagerly
        return h / (1.0 + peak)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x
        for w in self.weights:
            h = torch.relu(h @ w) + 0.5
            h = self.scale(h)
        return h * 2


def capture(fn, device=None, **kw):
    graph = BreakableGraph(device=device or TapeDevice())
    with torch.inference_mode(), breakable_graph(graph, **kw):
        out = fn()
    return graph, out


def test_no_graph_outside_capture_is_a_plain_call():
    m = BreakMLP()
    x = torch.randn(4, 16)
    assert torch.equal(m(x), m.forward(x))
    assert m.break_calls == 6
    assert not is_in_breakable_graph()


@pytest.mark.parametrize("layers", [1, 3, 6])
def test_replay_equals_eager_for_new_inputs(layers):
    m = BreakMLP(layers=layers)
    static_x = torch.randn(5, 16)
    graph, out = capture(lambda: m(static_x))
    assert graph.num_breaks == layers
    assert graph.num_segments == layers + 1
    for seed in range(4):
        fresh = torch.randn(5, 16, generator=torch.Generator().manual_seed(100 + seed))
        static_x.copy_(fresh)
        graph.replay()
        with torch.inference_mode():
            expected = m(fresh)
        assert torch.equal(out, expected), f"replay differs from eager for input seed {seed}"


def test_barrier_fn_runs_before_each_break_during_capture_only():
    events = []

    @no_graph
    def brk(t):
        events.append("break")
        return t + 1

    x = torch.zeros(3)
    graph, out = capture(lambda: brk(brk(x * 2) * 3), barrier_fn=lambda: events.append("barrier"))
    assert events == ["barrier", "break", "barrier", "break"]
    events.clear()
    x.fill_(1.0)
    graph.replay()
    assert events == ["break", "break"]
    assert torch.equal(out, (((torch.ones(3) * 2) + 1) * 3) + 1)


def test_capture_stub_runs_at_capture_and_real_body_at_replay():
    calls = []

    def stub(t):
        calls.append("stub")
        return torch.zeros_like(t)

    @no_graph(capture_stub=stub)
    def real(t):
        calls.append("real")
        return t.sum(dim=-1, keepdim=True).expand_as(t).clone()

    x = torch.arange(6.0).reshape(2, 3)
    graph, out = capture(lambda: real(x + 1) * 10)
    assert calls == ["stub"]
    graph.replay()
    assert calls == ["stub", "real"]
    assert torch.equal(out, ((x + 1).sum(-1, keepdim=True).expand_as(x)) * 10)


def test_break_shape_change_at_replay_raises_naming_the_function():
    n = {"rows": 2}

    @no_graph
    def shifty(t):
        return torch.ones(n["rows"], 3)

    x = torch.ones(2, 3)
    graph, out = capture(lambda: shifty(x) + x)
    x.fill_(4.0)
    graph.replay()  # positive control: unchanged break, new input
    assert torch.equal(out, torch.full((2, 3), 5.0))
    n["rows"] = 3
    with pytest.raises(CaptureError, match=r"shifty.*\(3, 3\).*\(2, 3\)"):
        graph.replay()


def test_break_dtype_change_at_replay_raises():
    dt = {"dtype": torch.float32}

    @no_graph
    def caster(t):
        return t.to(dt["dtype"])

    x = torch.ones(4)
    graph, out = capture(lambda: caster(x * 2) + 1)
    x.fill_(3.0)
    graph.replay()  # positive control: unchanged break, new input
    assert torch.equal(out, torch.full((4,), 7.0))
    dt["dtype"] = torch.float64
    with pytest.raises(CaptureError, match=r"caster.*float64"):
        graph.replay()


def test_break_structure_change_at_replay_raises():
    mode = {"pair": True}

    @no_graph
    def pairer(t):
        return (t + 1, t * 2) if mode["pair"] else t + 1

    x = torch.ones(3)
    graph, out = capture(lambda: (lambda r: r[0] + r[1])(pairer(x)))
    x.fill_(2.0)
    graph.replay()  # positive control
    assert torch.equal(out, torch.full((3,), 7.0))
    mode["pair"] = False  # tuple -> single tensor
    with pytest.raises(CaptureError, match=r"pairer returned a different structure"):
        graph.replay()


def test_break_python_value_change_at_replay_raises():
    k = {"v": 7}

    @no_graph
    def counted(t):
        return t * 2, k["v"]

    x = torch.ones(3)
    graph, out = capture(lambda: (lambda r: r[0] + r[1])(counted(x)))
    x.fill_(2.0)
    graph.replay()  # positive control: the same Python value
    assert torch.equal(out, torch.full((3,), 11.0))
    k["v"] = 8  # the segment after the break froze 7
    with pytest.raises(CaptureError, match=r"counted.*froze that Python value"):
        graph.replay()


def test_breaks_at_start_end_and_back_to_back():
    @no_graph
    def inc(t):
        return t + 1

    x = torch.zeros(4)

    def step():
        a = inc(x)  # break at the very start
        b = inc(inc(a))  # back to back
        c = b * 3
        return inc(c)  # break at the very end

    graph, out = capture(step)
    assert graph.num_breaks == 4
    assert graph.num_segments == 1  # empty segments between breaks are dropped
    for v in (1.0, -2.5, 7.0):
        x.fill_(v)
        graph.replay()
        assert torch.equal(out, ((torch.full((4,), v) + 3) * 3) + 1)


def test_break_returning_a_tuple_and_non_tensor_values():
    @no_graph
    def split(t):
        return t[:, :2].clone(), t[:, 2:].clone(), 7

    x = torch.randn(3, 5)
    graph, out = capture(lambda: (lambda a, b, k: a.sum(-1) * k + b.sum(-1))(*split(x * 2)))
    x.copy_(torch.randn(3, 5))
    graph.replay()
    y = x * 2
    assert torch.equal(out, y[:, :2].clone().sum(-1) * 7 + y[:, 2:].clone().sum(-1))


def test_nested_breakable_graph_raises_and_outer_stays_usable():
    g1, g2 = BreakableGraph(device=TapeDevice()), BreakableGraph(device=TapeDevice())
    x = torch.ones(2)
    with pytest.raises(CaptureError, match="nest"):
        with breakable_graph(g1):
            with breakable_graph(g2):
                pass
    assert not is_in_breakable_graph()
    graph, out = capture(lambda: x * 3)
    x.fill_(2.0)
    graph.replay()
    assert torch.equal(out, torch.full((2,), 6.0))


def test_exception_mid_capture_cleans_up_and_next_capture_works():
    @no_graph
    def boom(t):
        raise RuntimeError("kaboom in the break")

    x = torch.ones(3)
    graph = BreakableGraph(device=TapeDevice())
    with pytest.raises(RuntimeError, match="kaboom"):
        with breakable_graph(graph):
            boom(x * 2)
    assert not is_in_breakable_graph() and not is_tape_capturing()
    assert graph.num_segments == 0 and not graph.captured
    with pytest.raises(CaptureError, match="holds no capture"):
        graph.replay()

    with pytest.raises(ValueError, match="inside segment"):
        with breakable_graph(graph):
            x + 1  # noqa: B018 - an op recorded into the segment before the error
            raise ValueError("inside segment")
    assert not is_tape_capturing() and not graph.captured

    with breakable_graph(graph):
        out = x * 5
    x.fill_(3.0)
    graph.replay()
    assert torch.equal(out, torch.full((3,), 15.0))


def test_capturing_into_a_captured_graph_raises_until_reset():
    x = torch.ones(2)
    graph, _ = capture(lambda: x + 1)
    with pytest.raises(CaptureError, match="reset"):
        with breakable_graph(graph):
            pass
    graph.reset()
    with breakable_graph(graph):
        out = x + 2
    graph.replay()
    assert torch.equal(out, torch.full((2,), 3.0))


def test_enable_false_returns_the_function_unchanged():
    def plain(t):
        return t * 2

    assert no_graph(enable=False)(plain) is plain
    x = torch.ones(3)
    graph, out = capture(lambda: no_graph(plain, enable=False)(x + 1))
    assert graph.num_breaks == 0 and graph.num_segments == 1
    graph.replay()  # a value read right after capture would be garbage on a GPU: replay first
    assert torch.equal(out, torch.full((3,), 4.0))
    x.fill_(5.0)
    graph.replay()  # plain ran inside the segment: its work replays
    assert torch.equal(out, torch.full((3,), 12.0))


def test_force_no_graph_splits_the_segment_without_eager_work():
    barriers = []
    x = torch.ones(3)

    def step():
        a = x * 2
        force_no_graph()
        return a + 1

    graph, out = capture(step, barrier_fn=lambda: barriers.append(1))
    assert graph.num_segments == 2 and graph.num_breaks == 1 and barriers == [1]
    x.fill_(4.0)
    graph.replay()
    assert torch.equal(out, torch.full((3,), 9.0))
    force_no_graph()  # outside capture: does nothing


def test_is_in_breakable_graph_during_capture_including_break_bodies():
    seen = {}

    @no_graph
    def inner(t):
        seen["inner_is_plain"] = True
        return t

    @no_graph
    def body(t):
        seen["in_break"] = is_in_breakable_graph()
        return inner(t)  # nested break inside a break body: a plain call

    def step():
        seen["in_segment"] = is_in_breakable_graph()
        return body(x) + 1

    x = torch.ones(1)
    graph, _ = capture(step)
    assert seen == {"in_segment": True, "in_break": True, "inner_is_plain": True}
    assert graph.num_breaks == 1
    assert not is_in_breakable_graph()


def test_every_segment_comes_from_device_new_graph():
    class CountingDevice(TapeDevice):
        made = 0

        def new_graph(self):
            CountingDevice.made += 1
            return super().new_graph()

    m = BreakMLP(layers=2)
    x = torch.randn(2, 16)
    graph, _ = capture(lambda: m(x), device=CountingDevice())
    assert CountingDevice.made == 3  # a segment before, between and after the two breaks
    assert graph.num_segments == 3


def test_no_graph_rejects_non_callables():
    with pytest.raises(TypeError, match="function"):
        no_graph(42)
    with pytest.raises(TypeError, match="capture_stub"):
        no_graph(capture_stub=3)


def test_get_device_choices():
    assert isinstance(get_device("auto"), CudaDevice if torch.cuda.is_available() else TapeDevice)
    assert isinstance(get_device("tape"), TapeDevice)
    dev = TapeDevice()
    assert get_device(dev) is dev
    with pytest.raises(ValueError, match="unknown device"):
        get_device("tpu")
    with pytest.raises(TypeError):
        get_device(3)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA"):
            get_device("cuda")


def test_public_names_are_exported():
    for name in ("BreakableGraph", "breakable_graph", "no_graph", "get_device", "CudaDevice", "TapeDevice"):
        assert name in gr.__all__ and hasattr(gr, name), name
    for name in ("force_no_graph", "is_in_breakable_graph"):  # the segment controls stay in their module
        assert name not in gr.__all__ and hasattr(gr.breakable, name), name
    # Meta's alias stays in its module, not in the top-level API
    import graphrunner.breakable as breakable_mod

    assert "BreakableCUDAGraph" not in gr.__all__ and breakable_mod.BreakableCUDAGraph is BreakableGraph


def test_meta_names_breakable_cuda_graph_and_cuda_graph_keyword():
    """Meta's spelling: BreakableCUDAGraph(...) and breakable_graph(cuda_graph=...)."""
    from graphrunner.breakable import BreakableCUDAGraph

    assert BreakableCUDAGraph is BreakableGraph
    m = BreakMLP()
    static_x = torch.randn(5, 16)
    graph = BreakableCUDAGraph(device=TapeDevice())
    with torch.inference_mode(), gr.breakable_graph(cuda_graph=graph):
        out = m(static_x)
    assert graph.num_breaks == 3
    static_x.copy_(torch.randn(5, 16))
    graph.replay()
    with torch.inference_mode():
        assert torch.equal(out, m.forward(static_x))


def test_graph_and_cuda_graph_together_or_neither_raise():
    g = BreakableGraph(device=TapeDevice())
    with pytest.raises(TypeError, match="both graph and cuda_graph"):
        with breakable_graph(g, cuda_graph=g):
            pass
    with pytest.raises(TypeError, match="needs a BreakableGraph"):
        with breakable_graph():
            pass
    with pytest.raises(TypeError, match="needs a BreakableGraph.*TapeGraph"):
        with breakable_graph(gr.tape.TapeGraph()):
            pass
    assert not is_in_breakable_graph() and not g.captured
    with breakable_graph(graph=g):  # negative control: one of them is fine
        pass
    assert g.captured


@pytest.mark.parametrize("bad", [3, "barrier", lambda rank: None])
def test_bad_barrier_fn_raises_on_entry_before_any_capture(bad):
    calls = []

    @no_graph
    def brk(t):
        calls.append("break")
        return t + 1

    g = BreakableGraph(device=TapeDevice())
    with pytest.raises(TypeError, match="barrier_fn"):
        with torch.inference_mode(), breakable_graph(g, barrier_fn=bad):
            calls.append("body")
            brk(torch.zeros(2))
    assert calls == [] and not g.captured and not is_tape_capturing()


@pytest.mark.parametrize("stub", [lambda: None, lambda t, u: None, lambda *, t: None])
def test_capture_stub_that_cannot_take_the_arguments_raises_at_decoration(stub):
    def real(t):
        return t + 1

    with pytest.raises(TypeError, match="capture_stub .* cannot take them"):
        no_graph(capture_stub=stub)(real)


@pytest.mark.parametrize("stub", [lambda t: t, lambda *a, **k: a[0], lambda t, scale=2: t])
def test_capture_stub_with_compatible_signature_is_accepted(stub):
    """Negative control for the check above: compatible stubs decorate and run."""
    real = no_graph(capture_stub=stub)(lambda t: t + 1)
    graph, out = capture(lambda: real(torch.zeros(2)) * 3)
    graph.replay()
    assert torch.equal(out, torch.full((2,), 3.0))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_breakable_replay_equals_eager():
    dev = CudaDevice()
    m = BreakMLP(layers=3)
    m.weights = [w.cuda() for w in m.weights]
    static_x = torch.randn(8, 16, device="cuda")
    with torch.inference_mode():
        m(static_x)  # warm up kernels outside capture
    torch.cuda.synchronize()
    graph, out = capture(lambda: m(static_x), device=dev)
    assert graph.num_segments == 4
    for seed in range(3):
        fresh = torch.randn(8, 16, generator=torch.Generator().manual_seed(seed)).cuda()
        static_x.copy_(fresh)
        graph.replay()
        with torch.inference_mode():
            expected = m(fresh)
        torch.cuda.synchronize()
        assert torch.equal(out, expected)


# -- overlapping (expanded, stride-0) break results ---------------------------


def _sdpa_like_step(x, b, q, k):
    """A step whose break returns an expanded (stride-0) mask, as Gemma3's
    sdpa mask does, read by the next segment."""

    @no_graph
    def make_mask(t):
        keep = (t.sum(dim=(0, 1)) > 0).to(t.dtype)  # (k,), depends on the input
        return keep.view(1, 1, k).expand(b, q, k)

    def step():
        return (x * 3) * make_mask(x) + 1

    return step


def test_expanded_break_result_replays_equal_to_eager():
    b, q, k = 2, 3, 5
    static_x = torch.randn(b, q, k)
    step = _sdpa_like_step(static_x, b, q, k)
    graph, out = capture(step)
    assert graph.num_breaks == 1
    for seed in range(5):
        fresh = torch.randn(b, q, k, generator=torch.Generator().manual_seed(200 + seed))
        fresh[..., seed % k] = -10.0  # make that key's column sum negative: the mask changes per replay
        static_x.copy_(fresh)
        graph.replay()
        with torch.inference_mode():
            expected = _sdpa_like_step(fresh, b, q, k)()
        assert torch.equal(out, expected), f"replay {seed} differs from eager"


def test_expanded_break_result_in_a_tuple_with_scale():
    b, q, k = 2, 4, 3
    static_x = torch.randn(b, q, k)

    @no_graph
    def brk(t):
        base = t.new_ones(1, 1, k) * t.mean()
        return base.expand(b, q, k) * 2, t.new_ones(1, 1, k).expand(b, q, k)

    def step():
        m, ones = brk(static_x)
        return static_x + m - ones

    graph, out = capture(step)
    for seed in range(3):
        fresh = torch.randn(b, q, k, generator=torch.Generator().manual_seed(300 + seed))
        static_x.copy_(fresh)
        graph.replay()
        with torch.inference_mode():
            m = (fresh.new_ones(1, 1, k) * fresh.mean()).expand(b, q, k) * 2
            expected = fresh + m - 1
        assert torch.allclose(out, expected), f"replay {seed} differs from eager"


def test_expanded_break_result_is_what_raw_copy_refuses():
    # Negative control: the raw write the replay used to do is refused by PyTorch,
    # so the tests above do exercise the overlapping case.
    k = 4
    view = torch.ones(1, 1, k).expand(2, 3, k)
    with pytest.raises(RuntimeError, match="single memory location"):
        view.copy_(torch.zeros(2, 3, k))
