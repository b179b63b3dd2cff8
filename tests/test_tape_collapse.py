"""Composite matmuls collapsed to the one kernel they reach (tape.collapse),
and the proof every rewrite goes through (tape.proof).

Each test compares replay with eager PyTorch bit for bit on new input values
over several replays.  The negative controls turn a check off and show the
wrong result it prevents: without the views-only check and the proof, a
matmul whose composite copies an input (a broadcast batch) would read, at
every replay, the copy made at capture; without the proof, a ``[B, 1, C]``
input with strides ``(C, 1, 1)`` replays as ``mm`` where eager runs ``bmm``
(issue 21).
"""

import time

import pytest
import torch
import torch.nn.functional as F

from graphrunner.tape import TapeGraph, collapse, proof, tape_graph
from graphrunner.tape.bindings import VF


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
    return {v for v in g._env.values() if v in (VF.mm, VF.bmm, VF.matmul)}


def _decoder_like(x, w1, w2, k, v):
    """Linear layers on a [B, 1, K] input and a 4-d attention matmul pair."""
    h = torch.nn.functional.linear(x * 2, w1)  # matmul(x, w1.t()) -> mm
    q = h.view(2, 1, 4, 8).transpose(1, 2)  # [2, 4, 1, 8]
    s = torch.matmul(q * 1.5, k.transpose(-1, -2))  # -> bmm on views of the cache
    o = torch.matmul(s.softmax(-1) * 1.0, v)  # -> bmm
    return torch.nn.functional.linear(o.transpose(1, 2).reshape(2, 1, 32) + 0.5, w2)


def test_matmuls_become_mm_and_bmm_bit_exact():
    x, w1, w2 = torch.randn(2, 1, 16), torch.randn(32, 16), torch.randn(16, 32)
    k, v = torch.randn(2, 4, 6, 8), torch.randn(2, 4, 6, 8)
    g, out = _capture(_decoder_like, x, w1, w2, k, v)
    assert {VF.mm, VF.bmm} <= _kernels(g)
    assert VF.matmul not in _kernels(g)
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
    assert VF.addmm in g._env.values() and torch._C._nn.linear not in g._env.values()
    assert _replays_match(g, out, _gpt2_like, [x, w1, b1, w2, b2], (0, 2))


def _broadcast_batch(x, w):
    return torch.matmul(x * 2, w)  # [3, 1, 4, 8] @ [2, 8, 5]: matmul expands and copies both


def test_a_composite_that_copies_its_input_is_not_collapsed():
    x, w = torch.randn(3, 1, 4, 8), torch.randn(2, 8, 5)
    g, out = _capture(_broadcast_batch, x, w)
    assert VF.matmul in _kernels(g) and VF.bmm not in _kernels(g)
    assert _replays_match(g, out, _broadcast_batch, [x, w], (0,))


def test_without_the_views_only_check_the_proof_alone_refuses_the_stale_copy(monkeypatch):
    monkeypatch.setattr(collapse, "ONLY_VIEWS", False)
    x, w = torch.randn(3, 1, 4, 8), torch.randn(2, 8, 5)
    g, out = _capture(_broadcast_batch, x, w)
    assert VF.matmul in _kernels(g) and VF.bmm not in _kernels(g)  # fresh data: the copy stays stale
    assert _replays_match(g, out, _broadcast_batch, [x, w], (0,))


def test_negative_control_without_the_views_only_check_and_the_proof_replay_reads_a_stale_copy(monkeypatch):
    monkeypatch.setattr(collapse, "ONLY_VIEWS", False)
    monkeypatch.setattr(proof, "ENABLED", False)
    x, w = torch.randn(3, 1, 4, 8), torch.randn(2, 8, 5)
    g, out = _capture(_broadcast_batch, x, w)
    assert VF.bmm in _kernels(g)  # collapsed onto the copies made at capture end
    assert not _replays_match(g, out, _broadcast_batch, [x, w], (0,))


def test_collapse_matches_the_composite_on_any_data():
    """The rewrite found once is the composite's own kernel: equal on fresh data too."""
    cases = [
        ((1, 1, 16), (16, 16), True),
        ((5, 3, 16), (16, 16), True),
        ((2, 3, 16), (16, 16), False),
        ((1, 2, 4, 8), (1, 2, 8, 16), False),
        ((4, 16), (16, 8), False),
    ]
    gen = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for xs, ws, transpose_w in cases:
            x, w = torch.randn(xs, generator=gen), torch.randn(ws, generator=gen)
            if transpose_w:
                w = w.t()
            out = torch.empty(torch.matmul(x, w).shape)
            got = collapse.collapse(VF.matmul, [x, w], out)
            assert got is not None, (xs, ws)
            fn, args, out_view = got
            for _ in range(3):
                x.copy_(torch.randn(xs, generator=gen))
                fn(*args, out=out_view)
                assert torch.equal(out, torch.matmul(x, w)), (xs, ws)
        # not collapsible: a vector operand (mv path), and the broadcast batch above
        assert collapse.collapse(VF.matmul, [torch.randn(2, 4, 8), torch.randn(8)], torch.empty(2, 4)) is None
        assert (
            collapse.collapse(VF.matmul, [torch.randn(3, 1, 4, 8), torch.randn(2, 8, 5)], torch.empty(3, 2, 4, 5))
            is None
        )


# --- issue 21 item 4: a rewrite is kept only when proven bit-equal -----------------------------------

B, C, N = 8, 64, 48


def _jamba_like(x, w):
    """Jamba's ``x_proj(conv_out.transpose(1, 2))`` in three lines: a [B, 1, C] input with strides (C, 1, 1)."""
    return F.linear(x.unsqueeze(-1).transpose(1, 2), w)


def _replays_vs_eager(g, out, step, args, ctx, n=4) -> list:
    """torch.equal of each replay against eager ``step`` on the same new inputs (args[0] refilled)."""
    gen = torch.Generator().manual_seed(7)
    got = []
    for _ in range(n):
        args[0].copy_(torch.randn(args[0].shape, generator=gen))
        g.replay()
        with ctx():
            got.append(torch.equal(out, step(*args)))
    return got


def _capture_in(ctx, step, *xs):
    with ctx():
        g = TapeGraph()
        with tape_graph(g):
            out = step(*xs)
    return g, out


@pytest.mark.parametrize("ctx", [torch.inference_mode, torch.no_grad], ids=["inference", "no_grad"])
@pytest.mark.parametrize("weight", ["tensor", "parameter"])
def test_b1c_linear_replays_bit_exact_vs_eager(ctx, weight):
    """The repro of issue 21: the tape collapsed this matmul to ``mm`` (the Python decomposition folds a
    size-1 dim) where eager runs ``bmm``; with a weight that requires grad eager folds to ``mm``."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(B, C, generator=gen)
    w = torch.randn(N, C, generator=gen)
    if weight == "parameter":
        w = torch.nn.Parameter(w)  # requires grad: matmul folds to mm in eager
    assert x.unsqueeze(-1).transpose(1, 2).stride() == (C, 1, 1)
    g, out = _capture_in(ctx, _jamba_like, x, w)
    assert all(_replays_vs_eager(g, out, _jamba_like, [x, w], ctx))


def test_negative_control_the_b1c_rewrite_without_its_proof_replays_other_bits(monkeypatch):
    monkeypatch.setattr(proof, "ENABLED", False)
    gen = torch.Generator().manual_seed(3)
    x, w = torch.randn(B, C, generator=gen), torch.randn(N, C, generator=gen)
    g, out = _capture_in(torch.inference_mode, _jamba_like, x, w)
    assert VF.mm in _kernels(g)  # the unproven rewrite
    got = _replays_vs_eager(g, out, _jamba_like, [x, w], torch.inference_mode)
    assert not all(got)
    with torch.inference_mode():
        assert torch.allclose(out, _jamba_like(x, w), atol=1e-4)  # close, not equal: another summation order


def test_b1c_rewrite_is_refused_by_the_proof_itself(monkeypatch):
    """At the collapse: the log finds ``mm``, the proof sees the composite (``bmm``) differ and drops it."""
    with torch.inference_mode():
        x, w = torch.randn(B, C), torch.randn(N, C)
        xv, wt = x.unsqueeze(-1).transpose(1, 2), w.t()
        out = torch.empty(B, 1, N)
        before = proof.stats.snapshot()
        assert collapse.collapse(VF.matmul, [xv, wt], out) is None
        after = proof.stats.snapshot()
        assert after[0] == before[0] + 1 and after[1] == before[1] + 1  # one proof, refused
        monkeypatch.setattr(proof, "ENABLED", False)
        fn, _, _ = collapse.collapse(VF.matmul, [xv, wt], out)  # what the log alone would do
        assert fn is VF.mm


def _decode_linear(x, w):
    return F.linear(x * 2, w)  # a contiguous [B, 1, C]: the composite itself folds to mm


def test_a_genuinely_equal_rewrite_still_happens_and_is_proven():
    x, w = torch.randn(B, 1, C), torch.randn(N, C)
    before = proof.stats.snapshot()
    g, out = _capture_in(torch.inference_mode, _decode_linear, x, w)
    after = proof.stats.snapshot()
    assert VF.mm in _kernels(g) and VF.matmul not in _kernels(g)  # collapsed
    assert after[0] > before[0] and after[1] == before[1]  # proven, nothing refused
    assert g.rewrite_proofs[0] == after[0] - before[0] and g.rewrite_proofs[1] == 0
    assert all(_replays_vs_eager(g, out, _decode_linear, [x, w], torch.inference_mode))


def test_proof_compares_on_capture_data_and_on_random_data(monkeypatch):
    """A rewrite equal on the capture's data only (zeros here) is refused on random data; the
    proof writes nothing to the real tensors and draws nothing from the global generator."""
    x = torch.zeros(4, 8)
    o = torch.full((4, 8), 5.0)
    x0, o0 = x.clone(), o.clone()

    def ref(tw):
        return torch.mul(tw(x), 3.0, out=tw(o))

    def same(tw):
        return torch.add(tw(x) * 2, tw(x), out=tw(o))

    def only_on_zeros(tw):
        return torch.mul(tw(x), 2.0, out=tw(o))

    def reads_its_output(tw):
        return tw(o).mul_(0).add_(tw(x) * 3)  # reads the buffer first: its NaN prefill stays NaN

    state = torch.get_rng_state()
    assert proof.proven(ref, same, [x], [o])
    assert not proof.proven(ref, only_on_zeros, [x], [o])
    assert not proof.proven(ref, reads_its_output, [x], [o])
    monkeypatch.setattr(proof, "RANDOM_TRIALS", 0)  # the capture's data alone: zeros cannot tell 2x from 3x
    assert proof.proven(ref, only_on_zeros, [x], [o])
    # the value a temporary held at capture (seen) is what the capture-data leg reads
    assert not proof.proven(ref, only_on_zeros, [x], [o], {id(x): torch.ones(4, 8)})
    assert torch.equal(x, x0) and torch.equal(o, o0) and torch.equal(torch.get_rng_state(), state)


def test_proof_capture_cost_on_a_decoder_like_step():
    """Not a timing gate: the cost is reported per graph (TapeGraph.rewrite_proofs)."""
    x, w1, w2 = torch.randn(2, 1, 16), torch.randn(32, 16), torch.randn(16, 32)
    k, v = torch.randn(2, 4, 6, 8), torch.randn(2, 4, 6, 8)
    t0 = time.perf_counter()
    g, out = _capture(_decoder_like, x, w1, w2, k, v)
    total = time.perf_counter() - t0
    n, refused, seconds = g.rewrite_proofs
    assert n >= 4 and refused == 0 and 0 < seconds < total
