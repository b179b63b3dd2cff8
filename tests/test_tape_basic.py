"""TapeGraph semantics against eager PyTorch (TAPE-NOTES items 1-7)."""

import gc
import weakref

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.overrides import _get_current_function_mode_stack
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

from graphrunner.errors import CaptureError
from graphrunner.tape import TapeGraph, TapePool, graph_pool_handle, is_tape_capturing, tape_graph


class Block(nn.Module):
    def __init__(self, d=16):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 4 * d)
        self.fc2 = nn.Linear(4 * d, d)

    def forward(self, x):
        h = self.fc2(F.gelu(self.fc1(self.norm(x))))
        return (x + h).softmax(-1).reshape(x.shape[0], -1)


@pytest.mark.parametrize("ctx", [torch.no_grad, torch.inference_mode])
def test_replay_matches_eager_bit_exact_for_new_inputs(ctx):
    torch.manual_seed(0)
    m = Block().eval()
    x = torch.randn(3, 16)
    with ctx():
        g = TapeGraph()
        with tape_graph(g):
            out = m(x)
        assert g.num_ops > 0
        first = out
        for _ in range(4):
            x.copy_(torch.randn(3, 16))
            g.replay()
            assert out is first  # static output, refreshed in place
            assert torch.equal(out, m(x))
        # negative control: a stale output is not equal to eager for new input
        stale = out.clone()
        x.copy_(torch.randn(3, 16))
        assert not torch.equal(stale, m(x))


def test_inference_mode_capture_replays_under_inference_mode():
    x = torch.randn(4)
    with torch.inference_mode():
        g = TapeGraph()
        with tape_graph(g):
            y = x * 2
    assert y.is_inference()
    for v in (5.0, -1.5):
        x.fill_(v)  # new input before each replay: a replay that does nothing fails
        g.replay()  # called outside inference_mode: must not raise
        assert torch.equal(y, torch.full((4,), 2 * v))
    with torch.no_grad():
        g2 = TapeGraph()
        with tape_graph(g2):
            z = x * 3
    for v in (2.0, 7.0):
        x.fill_(v)
        g2.replay()
        assert torch.equal(z, torch.full((4,), 3 * v))
    assert not z.is_inference() and not z.requires_grad


def test_replay_runs_with_autograd_off():
    w = torch.randn(4, 4, requires_grad=True)
    x = torch.randn(2, 4)
    with torch.no_grad():
        g = TapeGraph()
        with tape_graph(g):
            y = x @ w
    for seed in range(2):
        x.copy_(torch.randn(2, 4, generator=torch.Generator().manual_seed(seed)))
        with torch.enable_grad():
            g.replay()
        assert not y.requires_grad and y.grad_fn is None
        assert torch.equal(y, (x @ w).detach())


def test_autograd_recording_raises_clear_error_and_leaves_graph_empty():
    w = torch.randn(4, 4, requires_grad=True)
    g = TapeGraph()
    with pytest.raises(CaptureError, match="inference"):
        with tape_graph(g):
            torch.randn(2, 4) @ w
    assert g.num_ops == 0 and not is_tape_capturing()
    # negative control: same op under no_grad captures fine
    with torch.no_grad(), tape_graph(g):
        torch.randn(2, 4) @ w
    assert g.num_ops > 0


def _counter_step():
    cache = torch.zeros(6, 4)
    counter = torch.zeros((), dtype=torch.long)
    pos = torch.tensor([0])
    k = torch.randn(1, 4)

    def step():
        cache.index_copy_(0, pos, k * 2)
        counter.add_(1)
        return cache.sum(0)

    return step, cache, counter, pos, k


def test_negative_control_without_the_restore_the_capture_write_stays(monkeypatch):
    # The tape's restore of snapshotted externals at capture end, disabled:
    # the capture's own write is left behind, which the test below would see
    # (counter 1 after capture, 4 after three replays instead of 3).
    from graphrunner.tape import recording

    monkeypatch.setattr(recording.TapeCapture, "restore", lambda self: None)
    step, cache, counter, _, _ = _counter_step()
    with torch.inference_mode():
        g = TapeGraph()
        with tape_graph(g):
            step()
        assert counter.item() == 1
        assert not torch.equal(cache, torch.zeros(6, 4))
        for _ in range(3):
            g.replay()
        assert counter.item() == 4


def test_writes_to_externals_are_undone_at_capture_and_land_at_replay():
    step, cache, counter, pos, k = _counter_step()
    with torch.inference_mode():
        g = TapeGraph()
        with tape_graph(g):
            out = step()
        # a CUDA capture launches nothing: the externals look untouched
        assert torch.equal(cache, torch.zeros(6, 4))
        assert counter.item() == 0
        ref_cache, ref_counter = cache.clone(), counter.clone()
        for i in range(3):
            pos.fill_(i)
            k.copy_(torch.randn(1, 4))
            g.replay()
            ref_cache.index_copy_(0, pos, k * 2)
            ref_counter.add_(1)
            assert torch.equal(cache, ref_cache)
            assert torch.equal(out, ref_cache.sum(0))
        assert counter.item() == 3 == ref_counter.item()  # without the undo: 4 (negative control above)


def test_python_control_flow_and_scalars_are_frozen():
    x = torch.randn(4)
    state = {"n": 2, "scale": 3.0}

    def f():
        if state["n"] > 1:  # python branch taken at capture
            return x * state["scale"] + x.shape[0]
        return x - 1

    with torch.inference_mode():
        g = TapeGraph()
        with tape_graph(g):
            out = f()
        state.update(n=0, scale=100.0)
        x.copy_(torch.randn(4))
        g.replay()
        assert torch.equal(out, x * 3.0 + 4)  # frozen, as on a CUDA graph
        assert not torch.equal(out, f())  # negative control: eager follows the new Python state


def test_returned_external_stays_the_external():
    x = torch.randn(3)
    with torch.inference_mode():
        g = TapeGraph()
        with tape_graph(g):
            same = x.contiguous()
            y = x + 1
        assert same is x
        x.copy_(torch.randn(3))
        g.replay()
        assert torch.equal(y, x + 1)


def test_survivors_keep_identity_views_refresh_base_and_temporaries_die():
    x = torch.randn(4, 4)
    holder = {}
    with torch.inference_mode():
        g = TapeGraph()
        with tape_graph(g):
            tmp = x.exp()
            holder["row"] = (tmp * 2)[1]  # only a view of the product survives
            holder["obj"] = tmp.sum()
            tmp_ref = weakref.ref(tmp)
            del tmp
        gc.collect()
        assert tmp_ref() is None  # a temporary: not kept alive by the graph
        row, s = holder["row"], holder["obj"]
        for _ in range(3):
            x.copy_(torch.randn(4, 4))
            g.replay()
            assert holder["row"] is row and holder["obj"] is s
            assert torch.equal(row, (x.exp() * 2)[1])
            assert torch.equal(s, x.exp().sum())


def test_rng_draws_fresh_numbers_and_reproduces_eager_sequence():
    x = torch.ones(5)

    def f():
        return x * torch.rand(5) + F.dropout(x, 0.5, training=True)

    with torch.inference_mode():
        torch.manual_seed(123)
        eager = [f().clone() for _ in range(4)]
        torch.manual_seed(123)
        g = TapeGraph()
        with tape_graph(g):  # consumes nothing from the generator, as a CUDA capture
            out = f()
        got = []
        for _ in range(4):
            g.replay()
            got.append(out.clone())
    assert len(got) == len(eager)
    for a, b in zip(eager, got):
        assert torch.equal(a, b)
    assert not torch.equal(got[1], got[2])  # negative control: fresh numbers per replay


def test_exception_inside_capture_leaves_no_mode_and_empty_graph():
    x = torch.randn(3)
    g = TapeGraph()
    with pytest.raises(ZeroDivisionError):
        with torch.inference_mode(), tape_graph(g):
            x + 1  # noqa: B018 - an op recorded before the error
            1 / 0  # noqa: B018 - raises ZeroDivisionError inside the capture
    assert not is_tape_capturing()
    assert _get_current_dispatch_mode_stack() == [] and _get_current_function_mode_stack() == []
    assert g.num_ops == 0
    with pytest.raises(CaptureError, match="empty"):
        g.replay()
    with torch.inference_mode(), tape_graph(g):
        y = x + 1
    x.copy_(torch.tensor([10.0, 20.0, 30.0]))
    g.replay()
    assert torch.equal(y, torch.tensor([11.0, 21.0, 31.0]))


def test_raw_api_failure_then_capture_end_raises_and_next_capture_works():
    from graphrunner.errors import CaptureUnsafeOpError

    x = torch.randn(3)
    g = TapeGraph()
    with torch.inference_mode():
        g.capture_begin()
        with pytest.raises(CaptureUnsafeOpError):
            x.sum().item()
        with pytest.raises(CaptureError, match="failed"):
            g.capture_end()
        assert not is_tape_capturing() and g.num_ops == 0
        g.capture_begin()
        y = x * 2
        g.capture_end()
        x.copy_(torch.tensor([1.0, -2.0, 4.0]))
        g.replay()
        assert torch.equal(y, torch.tensor([2.0, -4.0, 8.0]))


def test_misuse_errors():
    g, h = TapeGraph(), TapeGraph()
    with pytest.raises(CaptureError, match="empty"):
        g.replay()
    with torch.inference_mode():
        g.capture_begin()
        try:
            with pytest.raises(CaptureError, match="already capturing"):
                g.capture_begin()
            with pytest.raises(CaptureError, match="another TapeGraph"):
                h.capture_begin()
            with pytest.raises(CaptureError, match="while it is capturing"):
                g.replay()
        finally:
            g.reset()
    assert not is_tape_capturing()
    with pytest.raises(CaptureError, match="not capturing"):
        g.capture_end()
    with pytest.raises(ValueError):
        g.capture_begin(capture_error_mode="bogus")


def test_pool_handles_and_is_tape_capturing():
    p = graph_pool_handle()
    assert isinstance(p, TapePool)
    g1, g2 = TapeGraph(), TapeGraph()
    x = torch.randn(2)
    with torch.inference_mode():
        assert not is_tape_capturing()
        with tape_graph(g1, pool=p):
            assert is_tape_capturing()
            x + 1
        with tape_graph(g2, pool=g1.pool()):
            x + 2
    assert g1.pool() is p and g2.pool() is p
    g1.reset()
    assert g1.num_ops == 0


def test_views_of_externals_are_hoisted_and_replay_uses_generated_code():
    w = torch.randn(8, 8)
    x = torch.randn(2, 8)
    with torch.inference_mode():
        g = TapeGraph()
        with tape_graph(g):
            y = F.linear(x, w)[:, :4]
    assert g.num_replayed_ops < g.num_ops  # w.t() (and the final slice) are not replayed
    for seed in range(2):
        gen = torch.Generator().manual_seed(seed)
        w.copy_(torch.randn(8, 8, generator=gen))  # the hoisted w.t() is a view: it sees the new w
        x.copy_(torch.randn(2, 8, generator=gen))
        g.replay()
        assert torch.equal(y, F.linear(x, w)[:, :4])
