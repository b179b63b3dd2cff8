"""Composite matmuls collapsed to the one kernel they reach (tape.collapse).

Each test compares replay with eager PyTorch bit for bit on new input values
over several replays.  The negative control turns the views-only check
off and shows the stale result it prevents: a matmul whose composite copies an input
(a broadcast batch) would read, at every replay, the copy made at capture.
"""

import torch

from graphrunner.tape import TapeGraph, collapse, tape_graph
from graphrunner.tape.bindings import _VF


def _capture(step, *xs):
    with torch.inference_mode():
        g = TapeGraph()
        with tape_graph(g):
            out = step(*xs)
    return g, out


def _replays_match(g, out, step, args, varied, n=3) -> bool:
    """Replay equals eager ``step(*args)`` after new values in ``args[i]`` for i in ``varied``."""
    gen = torch.Generator().manual_seed(1)
    ok = True
    for _ in range(n):
        for i in varied:
            args[i].copy_(torch.randn(args[i].shape, generator=gen))
        g.replay()
        with torch.inference_mode():
            ok &= torch.equal(out, step(*args))
    return ok


def _kernels(g) -> set:
    return {v for v in g._env.values() if v in (_VF.mm, _VF.bmm, _VF.matmul)}


def _decoder_like(x, w1, w2, k, v):
    """Linear layers on a [B, 1, K] input and a 4-d attention matmul pair."""
    h = torch.nn.functional.linear(x * 2, w1)           # matmul(x, w1.t()) -> mm
    q = h.view(2, 1, 4, 8).transpose(1, 2)                # [2, 4, 1, 8]
    s = torch.matmul(q * 1.5, k.transpose(-1, -2))       # -> bmm on views of the cache
    o = torch.matmul(s.softmax(-1) * 1.0, v)             # -> bmm
    return torch.nn.functional.linear(o.transpose(1, 2).reshape(2, 1, 32) + 0.5, w2)


def test_matmuls_become_mm_and_bmm_bit_exact():
    x, w1, w2 = torch.randn(2, 1, 16), torch.randn(32, 16), torch.randn(16, 32)
    k, v = torch.randn(2, 4, 6, 8), torch.randn(2, 4, 6, 8)
    g, out = _capture(_decoder_like, x, w1, w2, k, v)
    assert {_VF.mm, _VF.bmm} <= _kernels(g)
    assert _VF.matmul not in _kernels(g)
    assert _replays_match(g, out, _decoder_like, [x, w1, w2, k, v], (0, 3, 4))


def _gpt2_like(x, w1, b1, w2, b2):
    """Biased linears (functional ``linear``: one ``addmm``) on [B, 1, K] and [B, K] inputs."""
    h = torch.nn.functional.linear(x * 2, w1, b1)
    h = torch.nn.functional.gelu(h, approximate="tanh")
    return torch.nn.functional.linear(h.view(2, 32) * 0.5, w2, b2)


def test_biased_linear_becomes_addmm_into_a_planned_buffer_bit_exact():
    x, w1, b1 = torch.randn(2, 1, 16), torch.randn(32, 16), torch.randn(32)
    w2, b2 = torch.randn(8, 32), torch.randn(8)
    g, out = _capture(_gpt2_like, x, w1, b1, w2, b2)
    assert _VF.addmm in g._env.values() and torch._C._nn.linear not in g._env.values()
    assert _replays_match(g, out, _gpt2_like, [x, w1, b1, w2, b2], (0, 2))


def _broadcast_batch(x, w):
    return torch.matmul(x * 2, w)  # [3, 1, 4, 8] @ [2, 8, 5]: matmul expands and copies both


def test_a_composite_that_copies_its_input_is_not_collapsed():
    x, w = torch.randn(3, 1, 4, 8), torch.randn(2, 8, 5)
    g, out = _capture(_broadcast_batch, x, w)
    assert _VF.matmul in _kernels(g) and _VF.bmm not in _kernels(g)
    assert _replays_match(g, out, _broadcast_batch, [x, w], (0,))


def test_negative_control_without_the_views_only_check_replay_reads_a_stale_copy(monkeypatch):
    monkeypatch.setattr(collapse, "ONLY_VIEWS", False)
    x, w = torch.randn(3, 1, 4, 8), torch.randn(2, 8, 5)
    g, out = _capture(_broadcast_batch, x, w)
    assert _VF.bmm in _kernels(g)  # collapsed onto the copies made at capture end
    assert not _replays_match(g, out, _broadcast_batch, [x, w], (0,))


def test_collapse_matches_the_composite_on_any_data():
    """The rewrite found once is the composite's own kernel: equal on fresh data too."""
    cases = [((1, 1, 16), (16, 16), True), ((5, 3, 16), (16, 16), True),
             ((2, 3, 16), (16, 16), False), ((1, 2, 4, 8), (1, 2, 8, 16), False), ((4, 16), (16, 8), False)]
    gen = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for xs, ws, transpose_w in cases:
            x, w = torch.randn(xs, generator=gen), torch.randn(ws, generator=gen)
            if transpose_w:
                w = w.t()
            out = torch.empty(torch.matmul(x, w).shape)
            got = collapse.collapse(_VF.matmul, [x, w], out)
            assert got is not None, (xs, ws)
            fn, args, out_view = got
            for _ in range(3):
                x.copy_(torch.randn(xs, generator=gen))
                fn(*args, out=out_view)
                assert torch.equal(out, torch.matmul(x, w)), (xs, ws)
        # not collapsible: a vector operand (mv path), and the broadcast batch above
        assert collapse.collapse(_VF.matmul, [torch.randn(2, 4, 8), torch.randn(8)], torch.empty(2, 4)) is None
        assert collapse.collapse(_VF.matmul, [torch.randn(3, 1, 4, 8), torch.randn(2, 8, 5)],
                                 torch.empty(3, 2, 4, 5)) is None
