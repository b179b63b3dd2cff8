"""The binding verification's cheaper proof (``bindings._SameCall``): a binding that dispatches the
recorded aten call itself, on the same arguments, is taken without computing it again; anything else
is computed and compared on the capture's data as before (the negative controls)."""

import pytest
import torch

from graphrunner.tape import TapeGraph, bindings, tape_graph

aten = torch.ops.aten


def _bits(t):
    it = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    return t.contiguous().view(it)


def _calls(g, fn):
    return sum(g.source.count(f"{name}(") for name, v in g._env.items() if v is fn)


def _capture_replay(fn, x, fresh):
    """Capture ``fn(x)``, refill ``x``, replay; the graph and whether replay equals eager bit for bit."""
    with torch.inference_mode():
        fn(x)
        g = TapeGraph(jit_replay=False)
        with tape_graph(g):
            out = fn(x)
        x.copy_(fresh)
        g.replay()
        got = out.clone()
        ref = fn(x)
    return g, got.dtype == ref.dtype and got.shape == ref.shape and torch.equal(_bits(got), _bits(ref))


def test_big_op_proven_as_the_recorded_call_without_computing_it():
    x = torch.randn(256, 256)  # 256 KiB in, 256 KiB out: over _SAME_CALL_MIN_BYTES
    before = list(bindings.SAME_CALL_STATS)
    g, same = _capture_replay(lambda t: torch.tanh(t).softmax(-1), x, torch.randn(256, 256))
    assert same
    assert _calls(g, torch.tanh) == 1 and _calls(g, torch._C._VariableFunctions.softmax) == 1
    assert bindings.SAME_CALL_STATS[0] - before[0] == 2  # both proven by the dispatch, neither computed again
    assert bindings.SAME_CALL_STATS[1] == before[1]


def test_small_op_still_computed_and_compared():
    x = torch.randn(4, 8)
    before = list(bindings.SAME_CALL_STATS)
    g, same = _capture_replay(lambda t: torch.tanh(t), x, torch.randn(4, 8))
    assert same and _calls(g, torch.tanh) == 1
    assert bindings.SAME_CALL_STATS[0] == before[0] and bindings.SAME_CALL_STATS[1] > before[1]


def test_is_same_call_refuses_anything_but_the_very_call():
    x, y = torch.randn(8, 8), torch.randn(8, 8)
    with torch.inference_mode():
        out = aten.add.Tensor(x, y)
        rec = (aten.add.Tensor, (x, y), {}, out)
        assert bindings._is_same_call(torch.add, [x, y], {}, *rec)
        # another op, swapped or other tensors (equal values are not the same tensors), another scalar
        assert not bindings._is_same_call(torch.sub, [x, y], {}, *rec)
        assert not bindings._is_same_call(torch.add, [y, x], {}, *rec)
        assert not bindings._is_same_call(torch.add, [x, y.clone()], {}, *rec)
        assert not bindings._is_same_call(torch.add, [x, y], {"alpha": 2}, *rec)
        # a scalar of another type (1 for 1.0), a second op after the call, another result returned
        assert bindings._is_same_call(torch.mul, [x, 2.0], {}, aten.mul.Tensor, (x, 2.0), {}, x * 2.0)
        assert not bindings._is_same_call(torch.mul, [x, 2], {}, aten.mul.Tensor, (x, 2.0), {}, x * 2.0)
        assert not bindings._is_same_call(lambda a, b: torch.add(a, b).neg(), [x, y], {}, *rec)
        assert not bindings._is_same_call(lambda a, b: (torch.add(a, b), x)[1], [x, y], {}, *rec)
        # a binding that touches its result without an op but leaves it as it was: still the call

        def sneaky(a, b):
            r = torch.add(a, b)
            r.requires_grad_(False)  # no op; metadata kept: still the call
            return r

        assert bindings._is_same_call(sneaky, [x, y], {}, *rec)
    w = torch.randn(8, 8)
    with torch.no_grad():  # (not inference tensors: requires_grad can be set on them)
        o = aten.add.Tensor(w, w)
    rec2 = (aten.add.Tensor, (w, w), {}, o)

    def grads(a, b):  # changes its result without dispatching an op: refused
        r = torch.add(a, b)
        r.requires_grad_(True)
        return r

    assert not bindings._is_same_call(grads, [w, w], {}, *rec2)


@pytest.mark.parametrize("size", [(4, 8), (256, 256)])
def test_wrong_binding_rejected_small_and_big(monkeypatch, size):
    """Negative control: a candidate binding that computes something else (``torch.rsub`` offered for
    ``aten.sub``: it dispatches ``aten.rsub``) is not the recorded call, is computed, differs, and
    is dropped; the replay goes through the aten op and equals eager."""
    monkeypatch.setitem(bindings._BINDINGS, aten.sub.Tensor, (torch.rsub,))
    x = torch.randn(*size)
    y = torch.randn(*size)
    g, same = _capture_replay(lambda t: torch.sub(t, y), x, torch.randn(*size))
    assert same
    assert _calls(g, torch.rsub) == 0


def test_binding_with_the_same_op_on_other_arguments_rejected(monkeypatch):
    """Negative control: a candidate that dispatches the recorded op itself but on other arguments
    (``Tensor.__rsub__``-like: ``sub(y, x)``) is not taken by the proof, and the comparison on the
    data drops it."""

    def swapped_sub(a, b):
        return torch.sub(b, a)

    real_bindings = bindings._bindings
    monkeypatch.setattr(
        bindings, "_bindings", lambda func: (swapped_sub,) if func is aten.sub.Tensor else real_bindings(func)
    )
    x = torch.randn(256, 256)
    y = torch.randn(256, 256)
    before = list(bindings.SAME_CALL_STATS)
    g, same = _capture_replay(lambda t: torch.sub(t, y), x, torch.randn(256, 256))
    assert same
    assert _calls(g, swapped_sub) == 0
    assert bindings.SAME_CALL_STATS[0] == before[0]  # not proven the call ...
    assert bindings.SAME_CALL_STATS[1] > before[1]  # ... computed, compared, dropped
