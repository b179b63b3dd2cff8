"""The proofs' memo within a capture session (tape.proof, ``memo=``).

A proof's random trials read nothing of the capture: random values drawn
into the layouts of its tensors, then the two calls.  Within a session, a
proof of the same signature (calls, arguments, every tensor's metadata and
aliasing, context, random pool) reuses the verdict instead of running them
again.  The tests check that a reused verdict is the one a fresh proof gives,
that the capture trial still runs, that anything in the signature that
differs means a fresh proof, and (negative control) that a signature blind
to shapes would take a wrong verdict.
"""

import torch

from graphrunner.tape import TapeGraph, proof, tape_graph
from graphrunner.tape.state import reuse_snapshot_buffers


def _calls(x, o, counter):
    """ref = 3x; test = 3x for 8 columns, else 2x + x*1.0001 (differs on random data)."""

    def ref(tw):
        counter[0] += 1
        return torch.mul(tw(x), 3.0, out=tw(o))

    def test(tw):
        counter[0] += 1
        if x.shape[-1] == 8:
            return torch.mul(tw(x), 3.0, out=tw(o))
        return torch.add(tw(x) * 2, tw(x) * 1.0001, out=tw(o))

    return ref, test


def _prove(x, o, counter, capture=False):
    ref, test = _calls(x, o, counter)
    return proof.proven(ref, test, [x], [o], capture=capture, memo=("t", torch.mul, x, o))


def _warm_pool():
    # draw the random pools first: a proof that redraws one is not memoized
    c = [0]
    for cols in (8, 5):
        _prove(torch.randn(64, cols), torch.empty(64, cols), c)


def test_same_signature_reuses_the_verdict_within_a_session():
    _warm_pool()
    with reuse_snapshot_buffers():
        c = [0]
        assert _prove(torch.randn(4, 8), torch.empty(4, 8), c)
        assert c[0] == 2  # ran: ref and test once each
        before = proof.stats.reused
        assert _prove(torch.randn(4, 8), torch.empty(4, 8), c)  # other values, same signature
        assert c[0] == 2 and proof.stats.reused == before + 1
        # the capture trial reads this capture's data: it always runs
        assert _prove(torch.randn(4, 8), torch.empty(4, 8), c, capture=True)
        assert c[0] == 4
        # a refusal is reused as a refusal
        assert not _prove(torch.randn(4, 5), torch.empty(4, 5), c)
        n = c[0]
        assert not _prove(torch.randn(4, 5), torch.empty(4, 5), c)
        assert c[0] == n
    assert not proof._MEMO  # dropped at the session's end
    c = [0]
    assert _prove(torch.randn(4, 8), torch.empty(4, 8), c) and c[0] == 2  # outside a session: always runs
    assert _prove(torch.randn(4, 8), torch.empty(4, 8), c) and c[0] == 4


def test_another_signature_is_proven_afresh():
    _warm_pool()
    with reuse_snapshot_buffers():
        c = [0]
        x = torch.randn(4, 8)
        assert _prove(x, torch.empty(4, 8), c)
        for other in (
            x.t().contiguous().t(),  # strides
            torch.randn(4, 8, dtype=torch.float64),  # dtype
            torch.randn(5, 8),
        ):  # shape
            n = c[0]
            _prove(other, torch.empty(other.shape, dtype=other.dtype), c)
            assert c[0] == n + 2
        n = c[0]
        ref, test = _calls(x, torch.empty(4, 8), c)
        proof.proven(ref, test, [x], [torch.empty(4, 8)], capture=False, memo=("t", torch.mul, x, 2.0))
        assert c[0] == n + 2  # another literal in the calls
        o = torch.empty(4, 8)
        n = c[0]
        proof.proven(ref, test, [x], [o], capture=False, memo=("t", torch.mul, o, o))
        assert c[0] == n + 2  # other aliasing


def test_negative_control_a_signature_blind_to_shapes_takes_a_wrong_verdict(monkeypatch):
    _warm_pool()
    real_sig = proof._sig

    def no_shapes(v, stores):
        s = real_sig(v, stores)
        return s[:2] + s[3:5] if isinstance(v, torch.Tensor) else s  # drops size, shape, strides, ...

    monkeypatch.setattr(proof, "_sig", no_shapes)
    monkeypatch.setattr(proof, "_memo_key", _memo_key_with(no_shapes))
    with reuse_snapshot_buffers():
        c = [0]
        assert _prove(torch.randn(4, 8), torch.empty(4, 8), c)
        # with the real signature this is refused (test_same_signature_...); here the memo says yes
        assert _prove(torch.randn(4, 5), torch.empty(4, 5), c)


def _memo_key_with(sig):
    def key(memo, inputs, outputs, inference, tls):
        return (sig((inputs, outputs, memo), {}), inference, torch.get_num_threads())

    return key


def test_a_session_capture_replays_like_eager_with_reused_proofs():
    """Two captures of a step with linears (rewrites proven) in one session: the second reuses
    the first's random trials; both replay bit-equal to eager on new values."""
    w1, w2 = torch.randn(32, 16), torch.randn(16, 32)

    def step(x):
        return torch.nn.functional.linear(torch.relu(torch.nn.functional.linear(x, w1)), w2) * 2

    _warm_pool()
    graphs = []
    with reuse_snapshot_buffers(), torch.inference_mode():
        for _ in range(2):
            x = torch.randn(3, 16)
            g = TapeGraph()
            r0 = proof.stats.reused
            with tape_graph(g):
                out = step(x)
            graphs.append((g, x, out, proof.stats.reused - r0, g.rewrite_proofs[0]))
    assert graphs[0][4] > 0 and graphs[1][3] > 0
    for g, x, out, _, _ in graphs:
        for _ in range(2):
            with torch.inference_mode():
                x.copy_(torch.randn(3, 16))
            g.replay()
            with torch.inference_mode():
                assert torch.equal(out, step(x))


def test_the_cached_composite_lookup_is_the_dispatchers():
    from graphrunner.tape import bindings

    aten = torch.ops.aten
    for op in (aten.matmul.default, aten.linear.default, aten.mm.default, aten.add.Tensor, aten.tanh.default):
        want = torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), "CompositeImplicitAutograd")
        assert bindings._composite(op) is want and bindings._composite(op) is want  # computed, then cached
    assert bindings._composite(aten.matmul.default) and not bindings._composite(aten.mm.default)
