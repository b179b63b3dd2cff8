"""Capture work skipped where its result is never used (issue 53 item 3), the generated code unchanged.

* The ``out=`` check of a binding (``bindings.Verifier._out_ok``) runs only for a result a preplanned
  buffer may stand in for (``TapeCapture.owns_storage``: it allocated its storage, at offset 0, and
  spans it), the only results ``codegen.plan_buffers`` gives one.
* A view of an internal storage picks no binding (it replays as one ``as_strided`` on the tensor that
  allocated the storage); after an in-place metadata change it replays through the recorded aten op.
* Within a capture session a generated source compiled before is not compiled again
  (``codegen.compiled_source``): keys whose text is equal (their sizes show only in the externals'
  shapes) share the code object, each with its own bindings; and the TorchScript trace of such a
  program (``jit.JitReplay.shared``), when its tensors differ only in sizes and strides and its trace
  raised no ``TracerWarning``.

Each against fresh work (the skip switched off) and eager, with a negative control.
"""

import warnings

import pytest
import torch

from graphrunner.tape import TapeGraph, bindings, codegen, jit, tape_graph
from graphrunner.tape.recording import TapeCapture
from graphrunner.tape.state import reuse_snapshot_buffers


def _step(x, w):
    y = torch.nn.functional.linear(x, w) * 0.5  # fresh results owning their storage: out= buffers
    v = y.transpose(0, 1)  # views of an internal storage
    z = v.unsqueeze(0) + 1
    u = x.transpose(0, 1)  # a view of an external: a binding is picked, no buffer may replace it
    return z.sum(-1), y[1:] * 2, u * 3


def _capture(fn, *args, jit=False):
    with torch.inference_mode():
        fn(*args)
        g = TapeGraph(jit_replay=jit)
        with tape_graph(g):
            out = fn(*args)
    return g, out


def _replays_like_eager(g, out, fn, args, fresh):
    with torch.inference_mode():
        for a, f in zip(args, fresh):
            a.copy_(f)
        g.replay()
        got = [o.clone() for o in out]
        return all(torch.equal(a, b) for a, b in zip(got, fn(*args)))


@pytest.fixture
def out_checks(monkeypatch):
    """The results whose binding's out= form was checked, in order."""
    seen = []
    real = bindings.Verifier._out_ok

    def spy(self, fn, ca, ck, out):
        seen.append(out)
        return real(self, fn, ca, ck, out)

    monkeypatch.setattr(bindings.Verifier, "_out_ok", spy)
    return seen


def test_the_out_check_runs_only_for_results_a_planned_buffer_may_replace(out_checks, monkeypatch):
    x, w = torch.randn(4, 8), torch.randn(8, 8)
    g, out = _capture(_step, x, w)
    assert out_checks and all(t.storage_offset() == 0 and t._base is None for t in out_checks)
    assert "out=" in g.source
    assert _replays_like_eager(g, out, _step, (x, w), (torch.randn(4, 8), torch.randn(8, 8)))
    # the same capture with every result out=-checked (as before): more checks, the very same code
    skipped = len(out_checks)
    out_checks.clear()
    monkeypatch.setattr(TapeCapture, "owns_storage", lambda self, n: True, raising=True)
    monkeypatch.setattr(codegen, "plan_buffers", _plan_with_the_real_gate(codegen.plan_buffers), raising=True)
    g_all, _ = _capture(_step, x, w)
    assert len(out_checks) > skipped
    assert g_all.source == g.source


def _plan_with_the_real_gate(plan_buffers):
    """``plan_buffers`` with ``TapeCapture.owns_storage`` as it really is (only the recording's gate is forced open)."""
    real = TapeCapture.__dict__["owns_storage"]

    def plan(cap, *a, **k):
        TapeCapture.owns_storage, saved = real, TapeCapture.owns_storage
        try:
            return plan_buffers(cap, *a, **k)
        finally:
            TapeCapture.owns_storage = saved

    return plan


def test_negative_control_a_gate_that_refuses_every_result_loses_the_planned_buffers(monkeypatch):
    x, w = torch.randn(4, 8), torch.randn(8, 8)
    g, _ = _capture(_step, x, w)
    monkeypatch.setattr(TapeCapture, "owns_storage", lambda self, n: False)
    g_none, out = _capture(_step, x, w)
    assert "out=" in g.source and "out=" not in g_none.source  # the comparison above can see a wrong gate
    assert _replays_like_eager(g_none, out, _step, (x, w), (torch.randn(4, 8), torch.randn(8, 8)))


def _picks(monkeypatch):
    seen = []
    real = bindings.Verifier.pick

    def spy(self, cap, func, *a, **k):
        seen.append(func)
        return real(self, cap, func, *a, **k)

    monkeypatch.setattr(bindings.Verifier, "pick", spy)
    return seen


def test_a_view_of_an_internal_storage_picks_no_binding_and_replays_like_eager(monkeypatch):
    picked = _picks(monkeypatch)
    x, w = torch.randn(4, 8), torch.randn(8, 8)
    g, out = _capture(_step, x, w)
    aten = torch.ops.aten
    assert aten.linear.default in picked and aten.mul.Tensor in picked
    assert not {aten.unsqueeze.default, aten.slice.Tensor} & set(picked)
    assert picked.count(aten.transpose.int) == 1  # x's (an external), not y's
    assert _replays_like_eager(g, out, _step, (x, w), (torch.randn(4, 8), torch.randn(8, 8)))


@pytest.mark.parametrize("change_first", [False, True])
def test_views_around_an_in_place_metadata_change_replay_like_eager(monkeypatch, change_first):
    picked = _picks(monkeypatch)
    x = torch.randn(3, 4)

    def fn(x):
        y = x * 2
        if change_first:
            y.unsqueeze_(0)
        v = y.transpose(-1, -2)  # recorded before the change (through the aten op) or after (a binding)
        if not change_first:
            y.unsqueeze_(0)
        return v * 3, y + 1

    g, out = _capture(fn, x)
    assert (torch.ops.aten.transpose.int in picked) == change_first
    assert "as_strided" not in g.source  # after set_ / unsqueeze_ no view is rewritten
    assert _replays_like_eager(g, out, fn, (x,), (torch.randn(3, 4),))


def _kv_step(q, kv):
    # the kv length shows only in kv's shape, not in the generated text
    y = (q * 2).transpose(0, 1)
    o = torch.matmul(kv.transpose(0, 1), (torch.matmul(kv, y) * 0.125).softmax(0))
    for _ in range(3):  # enough ops to be traced (jit.JIT_MIN_OPS)
        o = torch.tanh(o) * 0.5 + o
    return o


@pytest.mark.parametrize("jit", [False, True])
def test_keys_with_equal_text_share_the_compiled_code_and_replay_like_fresh_code(jit):
    q = torch.randn(4, 8)
    kvs = [torch.randn(n, 8) for n in (16, 24)]
    before = list(codegen.CODE_STATS)
    with reuse_snapshot_buffers():
        shared = [_capture(_kv_step, q, kv, jit=jit) for kv in kvs]
    reused = codegen.CODE_STATS[1] - before[1]
    fresh = [_capture(_kv_step, q, kv, jit=jit) for kv in kvs]  # outside a session: nothing kept
    assert codegen.CODE_STATS[1] - before[1] == reused
    assert reused == (2 if jit else 1)  # the second key's replay (and its traced copy) compiled once
    assert shared[0][0].source == shared[1][0].source == fresh[1][0].source
    a, b = (g._env for g, _ in shared)
    assert a.keys() == b.keys() and any(a[n] is not b[n] for n in a)  # one code, bindings of its own
    for (g, out), (gf, outf), kv in zip(shared, fresh, kvs):
        fresh_q, fresh_kv = torch.randn(4, 8), torch.randn(*kv.shape)
        assert _replays_like_eager(g, out, _kv_step, (q, kv), (fresh_q, fresh_kv))
        with torch.inference_mode():
            gf.replay()
        assert torch.equal(out, outf)


def test_negative_control_a_different_text_is_compiled_anew():
    q = torch.randn(4, 8)
    before = list(codegen.CODE_STATS)
    with reuse_snapshot_buffers():
        g1, _ = _capture(_kv_step, q, torch.randn(16, 8))
        g2, _ = _capture(lambda q, kv: _kv_step(q, kv) * 2, q, torch.randn(16, 8))  # one more op
    assert g1.source != g2.source
    assert codegen.CODE_STATS[1] == before[1] and codegen.CODE_STATS[0] - before[0] == 2


def _shared_pair(kvs, q=None, at_first_replay=False):
    """Two graphs of ``_kv_step`` over ``kvs`` captured (and first replayed) in one session, traced."""
    q = torch.randn(4, 8) if q is None else q
    with reuse_snapshot_buffers():
        with jit.traces_at_first_replay() if at_first_replay else _nothing():
            got = [_capture(_kv_step, q, kv, jit=True) for kv in kvs]
        if at_first_replay:
            with torch.inference_mode():
                for g, _ in got:
                    g.replay()
    return q, got


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


@pytest.mark.parametrize("at_first_replay", [False, True])
def test_a_program_equal_but_for_sizes_replays_through_the_first_ones_trace_like_eager(at_first_replay):
    kvs = [torch.randn(16, 8), torch.randn(24, 8)]
    q, ((g1, out1), (g2, out2)) = _shared_pair(kvs, at_first_replay=at_first_replay)
    assert g1.replay_engine == g2.replay_engine == "jit"
    assert (g1._jit.shared, g2._jit.shared) == (False, True) and g2._jit._trace is g1._jit._trace
    gf, outf = _capture(_kv_step, q, kvs[1], jit=True)  # outside a session: traced for itself
    assert gf.replay_engine == "jit" and not gf._jit.shared and gf._jit._trace is not g1._jit._trace
    for _ in range(2):
        fresh_q, fresh_kv = torch.randn(4, 8), torch.randn(24, 8)
        assert _replays_like_eager(g2, out2, _kv_step, (q, kvs[1]), (fresh_q, fresh_kv))
        with torch.inference_mode():
            gf.replay()
        assert torch.equal(out2, outf)  # the shared trace computes what the graph's own trace does
        assert _replays_like_eager(g1, out1, _kv_step, (q, kvs[0]), (fresh_q, torch.randn(16, 8)))


def test_negative_control_other_dtypes_other_aliasing_or_a_tracer_warning_share_nothing(monkeypatch):
    q = torch.randn(4, 8)
    with reuse_snapshot_buffers():
        g1, _ = _capture(_kv_step, q, torch.randn(16, 8), jit=True)
        g2, out2 = _capture(_kv_step, q.double(), torch.randn(24, 8).double(), jit=True)
    assert not g2._jit.shared and g2._jit._trace is not g1._jit._trace
    with reuse_snapshot_buffers():
        g1, _ = _capture(_kv_step, q, torch.randn(16, 8), jit=True)
        kv = torch.randn(24, 8)
        g3, _ = _capture(_kv_step, kv[:4], kv, jit=True)  # the query is a view of the cache: other aliasing
    assert g1.source == g3.source and g3.replay_engine == "jit" and not g3._jit.shared
    real = torch.jit.trace

    def warns(*a, **k):
        warnings.warn("a value read on the host", torch.jit.TracerWarning, stacklevel=2)
        return real(*a, **k)

    monkeypatch.setattr(torch.jit, "trace", warns)
    _, ((g1, _), (g2, _)) = _shared_pair([torch.randn(16, 8), torch.randn(24, 8)])
    assert g1.replay_engine == g2.replay_engine == "jit" and not g2._jit.shared
