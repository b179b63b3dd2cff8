"""Replay fast paths of TapeGraph: verified public bindings, 0-dim scalars, CSE, aliases.

Every test checks replay against eager bit for bit on new input values.
"""

import pytest
import torch

from graphrunner.tape import TapeGraph, tape_graph


def _bits(t):
    it = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    return t.contiguous().view(it)


def _calls(g, fn):
    """How many calls of ``fn`` the generated replay makes."""
    return sum(g.source.count(f"{name}(") for name, v in g._env.items() if v is fn)


def _check(fn, inputs, refill, *, mode=torch.inference_mode):
    """Capture fn() (reads ``inputs`` in place), refill them, replay; compare to eager."""
    with mode():
        fn()
        g = TapeGraph()
        with tape_graph(g):
            out = fn()
        refill()
        snap = [t.clone() for t in inputs]
        g.replay()
        got = [o.clone() for o in (out if isinstance(out, (list, tuple)) else [out])]
        for t, s in zip(inputs, snap):  # replay may write its inputs: eager starts from the same state
            t.copy_(s)
        ref = fn()
        ref = ref if isinstance(ref, (list, tuple)) else [ref]
    for a, b in zip(got, ref):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(_bits(a), _bits(b))
    return g


@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32, torch.int64]
)
def test_python_scalars_bit_exact_all_dtypes(dtype):
    gen = torch.Generator().manual_seed(0)

    def fresh():
        t = torch.randn(3, 17, generator=gen) * 10
        return t.to(dtype)

    x = fresh()

    def fn():
        y = x * 0.1 + 3
        y = y - 1e-6 if dtype.is_floating_point else y - 2
        z = (x * 2) / 7
        w = torch.where(x > 0, x, torch.zeros_like(x)) + 1
        return y, z, w.masked_fill(x < -5, 4)

    g = _check(fn, [x], lambda: x.copy_(fresh()))
    if dtype == torch.float32:  # scalar ops went through public bindings, not OpOverload._op
        assert _calls(g, torch.ops.aten.mul.Tensor._op) == 0 and _calls(g, torch.ops.aten.add.Tensor._op) == 0
        assert _calls(g, torch.mul) == 2


def test_cse_reuses_repeated_pure_ops_only_when_safe():
    x = torch.randn(8)
    pos = torch.tensor([3])

    def fn():
        outs = []
        for _ in range(3):
            m = torch.arange(8) > pos[:, None]  # same value in every "layer"
            outs.append(x.masked_fill(m, 0.0))
        a = x * 2
        b = x * 2  # same op, but `a` is written below
        a.add_(1)
        return outs + [a, b]

    g = _check(fn, [x, pos], lambda: (x.copy_(torch.randn(8)), pos.fill_(5)))
    assert _calls(g, torch.gt) == 1  # the mask is computed once
    assert _calls(g, torch.mul) == 2  # x * 2 twice: `a` is written after, so no reuse


def test_cse_respects_writes_between_repeats():
    x = torch.randn(4)

    def fn():
        a = x.sin()
        x.add_(1)  # x written between the two sin() calls
        b = x.sin()
        x.sub_(1)
        return a, b

    _check(fn, [x], lambda: x.copy_(torch.randn(4)))


def test_alias_elimination_with_inplace_metadata_change():
    x = torch.randn(2, 3)

    def fn():
        y = x * 1.5
        v = y.view(2, 3)  # same metadata as y: replaced by y at replay
        y.unsqueeze_(0)  # ... unless metadata changes in place (then kept)
        return v + 1, y * 2

    _check(fn, [x], lambda: x.copy_(torch.randn(2, 3)))


def test_alias_and_slices_without_inplace_metadata_change():
    x = torch.randn(4, 6)

    def fn():
        y = x + 1
        a = y[:, :]  # full slice: same metadata
        b = y[:, 2:5]  # slice -> narrow
        c = y.view(4, 6)
        return a * 2, b * 3, c - 1

    _check(fn, [x], lambda: x.copy_(torch.randn(4, 6)))


def test_linear_rewrite_external_and_internal_weight():
    x = torch.randn(2, 1, 16)
    w = torch.randn(8, 16)
    F = torch.nn.functional

    def fn():
        w2 = w * 2  # internal weight: no capture-time w2.t() may be kept
        return F.linear(x, w), F.linear(x, w2), F.linear(x, w, torch.ones(8))

    g = _check(fn, [x, w], lambda: (x.copy_(torch.randn(2, 1, 16)), w.copy_(torch.randn(8, 16))))
    assert g.num_replayed_ops >= 4


def test_inplace_ops_through_bindings_write_externals():
    cache = torch.zeros(2, 4, 3)
    pos = torch.tensor([1])
    new = torch.randn(2, 1, 3)

    def fn():
        cache.index_copy_(1, pos, new * 2)
        cache[:, 0].add_(0.5)
        return cache.sum(1)

    _check(fn, [cache, pos, new], lambda: (pos.fill_(2), new.copy_(torch.randn(2, 1, 3))))


def test_no_grad_capture_and_parameters():
    lin = torch.nn.Linear(4, 3)
    x = torch.randn(5, 4)

    def fn():
        return torch.relu(lin(x)) * 0.5

    _check(fn, [x], lambda: x.copy_(torch.randn(5, 4)), mode=torch.no_grad)


def test_replay_ignores_torch_function_modes():
    from torch.overrides import TorchFunctionMode

    calls = []

    class Spy(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            calls.append(func)
            return func(*args, **(kwargs or {}))

    x = torch.randn(3)
    with torch.inference_mode():
        g = TapeGraph()
        with tape_graph(g):
            out = x * 3 + 1
        x.copy_(torch.randn(3))
        with Spy():
            g.replay()
        assert not calls
        assert torch.equal(out, x * 3 + 1)


def test_view_chains_collapse_and_writes_through_views():
    x = torch.randn(2, 3, 8)

    def fn():
        y = x * 2
        v = y.view(2, 3, 2, 4).transpose(1, 2).reshape(2, 2, 12)[:, 1]  # a chain of views of y
        v.add_(1)  # writes y through the chain
        w = y.narrow(2, 2, 3).unsqueeze(0)
        return v * 3, y + 0, w.sum(-1)

    g = _check(fn, [x], lambda: x.copy_(torch.randn(2, 3, 8)))
    # each chain is one as_strided call, or a constant view of a preplanned buffer
    assert _calls(g, torch._C.TensorBase.view) == 0
    assert _calls(g, torch._C.TensorBase.transpose) == 0


def test_survivor_view_refreshed():
    x = torch.randn(4, 4)
    with torch.inference_mode():
        g = TapeGraph()
        with tape_graph(g):
            y = x + 1
            v = y.t()[1:3]  # only a view of y is kept
        del y
        x.copy_(torch.randn(4, 4))
        g.replay()
        assert torch.equal(v, (x + 1).t()[1:3])
