"""The TorchScript replay engine (tape.jit): same results as the Python replay.

Every test compares replay with eager PyTorch bit for bit on new input
values over several replays.  The trace is made at capture end, and making
it leaves no trace (externals, generators, survivors and their poison are
as a capture without it leaves them); each of those invariants has a
negative control that breaks the mechanism keeping it and shows the test
fails.  The negative control of a failed trace breaks its rollback and
shows the double write it prevents.
"""

import contextlib
import threading
import time

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from graphrunner.tape import TapeGraph, graph_pool_handle, jit, tape_graph
from graphrunner.tape import graph as graph_mod


@pytest.fixture(autouse=True)
def _trace_small_programs(monkeypatch):
    """These tests trace small programs on purpose (the trace's mechanics), below the
    size from which a graph is traced by default (jit.JIT_MIN_OPS)."""
    monkeypatch.setattr(jit, "JIT_MIN_OPS", 0)


def _step(x, w, cache, pos, idx):
    h = torch.nn.functional.linear(x * 2, w)  # a weight matmul
    cache.index_put_((idx, pos), h)  # a cache write at a runtime index
    rows = cache.index_select(0, idx)  # reads it back
    return torch.softmax(rows @ w, -1) + h.sum()  # a list-held index, a reduction


def _make():
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(3, 8, generator=g), torch.randn(8, 8, generator=g)
    cache = torch.zeros(6, 4, 8)
    pos, idx = torch.tensor([0, 1, 2]), torch.tensor([4, 1, 3])
    return x, w, cache, pos, idx


def _capture(args, pool=None, **kw):
    with torch.inference_mode():
        g = TapeGraph(**kw)
        with tape_graph(g, pool=pool):
            out = _step(*args)
    return g, out


def _replays_match(g, out, args, n=4) -> bool:
    x, w, cache, pos, idx = args
    gen = torch.Generator().manual_seed(1)
    ok = True
    for _ in range(n):
        x.copy_(torch.randn(x.shape, generator=gen))
        pos.copy_(torch.randint(0, 4, (3,), generator=gen))
        idx.copy_(torch.randperm(6, generator=gen)[:3])
        before = cache.clone()
        g.replay()
        got, got_cache = out.clone(), cache.clone()
        cache.copy_(before)
        with torch.inference_mode():
            ref = _step(*args)
        ok &= torch.equal(got, ref) and torch.equal(got_cache, cache)
    return ok


def _no_tracing(*args, **kwargs):
    raise AssertionError("torch.jit.trace called after capture")


def test_traced_at_capture_end_and_replays_bit_exact_with_nothing_frozen(monkeypatch):
    args = _make()
    g, out = _capture(args, jit_replay=True)
    assert g.replay_engine == "jit" and g._jit._trace is not None  # before any replay
    monkeypatch.setattr(torch.jit, "trace", _no_tracing)  # the first replay does not trace
    assert _replays_match(g, out, args)
    assert g.replay_engine == "jit"
    consts = [
        n
        for n in g._jit._trace.graph.nodes()
        if n.kind() == "prim::Constant" and n.output().type().kind() == "TensorType"
    ]
    assert consts == []  # every tensor, the index list's included, is a parameter


def test_python_engine_on_request_and_by_environment(monkeypatch):
    args = _make()
    g, out = _capture(args, jit_replay=False)
    assert g.replay_engine == "python" and _replays_match(g, out, args)
    monkeypatch.setenv(jit.JIT_ENV_VAR, "0")
    assert TapeGraph().jit_replay is False
    monkeypatch.setenv(jit.JIT_ENV_VAR, "1")
    assert TapeGraph().jit_replay is True


def test_a_program_binding_a_generator_replays_in_python():
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(4)
    with torch.inference_mode():
        g = TapeGraph(jit_replay=True)
        with tape_graph(g):
            out = x + torch.randn(4, generator=gen)
    state = gen.get_state()
    g.replay()
    assert g.replay_engine == "python"
    gen.set_state(state)
    assert torch.equal(out, x + torch.randn(4, generator=gen))


def _failing_trace(fn, args, **kw):
    fn(*args)  # runs the whole replay, as tracing does, then fails
    raise RuntimeError("planted trace failure")


def test_a_failed_trace_rolls_back_and_replays_in_python(monkeypatch):
    args = _make()
    cache = args[2]
    before = cache.clone()
    monkeypatch.setattr(torch.jit, "trace", _failing_trace)
    g, out = _capture(args, jit_replay=True)
    assert g.replay_engine == "python" and "planted trace failure" in g._jit.why_python
    assert torch.equal(cache, before)  # the failed trace's write is rolled back
    assert _replays_match(g, out, args)


def _add_graph(cache, x, **kw):
    g = TapeGraph(jit_replay=True)
    with torch.inference_mode(), tape_graph(g, **kw):
        cache.add_(x)
    return g


def test_negative_control_without_the_rollback_the_cache_write_lands_twice(monkeypatch):
    """A read-modify-write of an external shows the double write, for a
    trace failing at capture end and for one failing at a deferred first
    replay (the pool was replaying at capture end)."""
    cache, x = torch.zeros(4), torch.randn(4)
    monkeypatch.setattr(torch.jit, "trace", _failing_trace)
    g = _add_graph(cache, x)
    assert torch.equal(cache, torch.zeros(4))  # capture end: the trace's write rolled back
    g.replay()
    assert torch.equal(cache, x)  # one write
    cache.zero_()
    pool = graph_pool_handle()
    with _pool_busy(pool):
        g1 = _add_graph(cache, x, pool=pool)
    assert g1.replay_engine == "jit-pending"
    g1.replay()
    assert torch.equal(cache, x)  # the first replay traced, failed, rolled back, replayed once
    cache.zero_()
    monkeypatch.setattr(jit, "_restore", lambda saved: None)
    _add_graph(cache, x)
    assert torch.equal(cache, x)  # capture end left the trace's write behind
    cache.zero_()
    with _pool_busy(pool):
        g2 = _add_graph(cache, x, pool=pool)
    g2.replay()
    assert torch.equal(cache, 2 * x)  # the trace's write, then the Python replay's


@contextlib.contextmanager
def _pool_busy(pool):
    """The pool's replay lock held, as by a replay of another of its graphs in another thread."""
    pool._replay_lock.acquire()
    try:
        yield
    finally:
        pool._replay_lock.release()


def test_traced_at_the_first_replay_when_the_pool_is_replaying_at_capture_end():
    args = _make()
    cache = args[2]
    before = cache.clone()
    pool = graph_pool_handle()
    with _pool_busy(pool):
        g, out = _capture(args, jit_replay=True, pool=pool)
    assert g.replay_engine == "jit-pending" and torch.equal(cache, before)
    assert _replays_match(g, out, args)
    assert g.replay_engine == "jit"


def test_a_replay_of_the_pool_waits_for_a_capture_end_trace(monkeypatch):
    """A replay in another thread that finds its pool's lock held by a
    capture end tracing waits for it, then replays (no CaptureError)."""
    pool = graph_pool_handle()
    a = torch.randn(8)
    g0 = TapeGraph(jit_replay=True, poison_captured_values=False)
    with torch.inference_mode(), tape_graph(g0, pool=pool):
        b = a * 2
    a.copy_(torch.randn(8))
    result, threads = [], []
    prepare = jit.JitReplay.prepare

    def prepare_with_a_replay_arriving(self, keep, generators):
        started = threading.Event()

        def replay():
            started.set()
            try:
                g0.replay()
                result.append("replayed")
            except Exception as exc:  # noqa: BLE001
                result.append(exc)

        t = threading.Thread(target=replay)
        threads.append(t)
        t.start()
        started.wait()
        time.sleep(0.05)
        result.append("traced")  # the replay is still waiting
        prepare(self, keep, generators)

    monkeypatch.setattr(jit.JitReplay, "prepare", prepare_with_a_replay_arriving)
    g1 = TapeGraph(jit_replay=True, poison_captured_values=False)
    with torch.inference_mode(), tape_graph(g1, pool=pool):
        c = a + 1
    threads[0].join(10)
    assert result == ["traced", "replayed"] and g1.replay_engine == "jit"
    assert torch.equal(b, a * 2) and torch.equal(c, a + 1)


class _Count(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += 1
        return func(*args, **(kwargs or {}))


def test_a_replay_under_a_dispatch_mode_runs_in_python():
    args = _make()
    g, out = _capture(args, jit_replay=True)
    with _Count() as count:
        g.replay()
    assert count.n >= g.num_replayed_ops > 0  # the mode saw the replay's ops one by one
    assert g.replay_engine == "jit" and _replays_match(g, out, args)


def _ops_seen_by_a_mode_around_the_capture(jit_replay: bool):
    args = _make()
    with _Count() as count:
        g, out = _capture(args, jit_replay=jit_replay)
    return count.n, g, out, args


def test_a_mode_around_the_capture_does_not_see_the_trace():
    """The trace made at capture end runs with the caller's dispatch modes
    disabled: a mode around the capture (a check's op recorder) sees the same
    ops as with the engine off, and the graph is traced all the same."""
    n_off, g_off, _, _ = _ops_seen_by_a_mode_around_the_capture(False)
    n_on, g, out, args = _ops_seen_by_a_mode_around_the_capture(True)
    assert g_off.replay_engine == "python" and g.replay_engine == "jit"
    assert n_on == n_off > 0
    assert _replays_match(g, out, args)


def test_negative_control_with_the_modes_left_on_the_mode_sees_the_trace(monkeypatch):
    n_off, _, _, _ = _ops_seen_by_a_mode_around_the_capture(False)
    monkeypatch.setattr(graph_mod, "_disable_current_modes", contextlib.nullcontext)
    n_on, _, _, _ = _ops_seen_by_a_mode_around_the_capture(True)
    assert n_on > n_off


# ---------------------------------------------------------------------------
# the trace at capture end leaves no trace


def _kv_step(x, w, cache, pos):
    """Writes the cache in place at rows ``pos`` and advances ``pos``."""
    h = torch.nn.functional.silu(x @ w)
    cache.index_copy_(0, pos, h)
    cache.mul_(0.5).add_(1.0)
    pos.add_(x.shape[0])
    return cache.sum(0) + h.sum()


def _kv_make():
    gen = torch.Generator().manual_seed(5)
    return (
        torch.randn(2, 8, generator=gen),
        torch.randn(8, 8, generator=gen),
        torch.randn(12, 8, generator=gen),
        torch.tensor([0, 1]),
    )


def _kv_capture(args, **kw):
    with torch.inference_mode():
        g = TapeGraph(jit_replay=True, **kw)
        with tape_graph(g):
            out = _kv_step(*args)
    return g, out


def test_externals_written_by_the_step_hold_their_pre_capture_bytes_after_capture():
    args = _kv_make()
    x, w, cache, pos = args
    before = [t.clone() for t in args]
    g, out = _kv_capture(args)
    assert g.replay_engine == "jit"
    assert torch.equal(cache, before[2]) and torch.equal(pos, before[3])
    # N replays == N eager calls from the pre-capture state (new inputs each time)
    ref = [t.clone() for t in before]
    gen = torch.Generator().manual_seed(9)
    for _ in range(5):
        new_x = torch.randn(2, 8, generator=gen)
        x.copy_(new_x)
        ref[0].copy_(new_x)
        g.replay()
        with torch.inference_mode():
            want = _kv_step(*ref)
        assert torch.equal(out, want)
        assert torch.equal(cache, ref[2]) and torch.equal(pos, ref[3])
    assert g.replay_engine == "jit"


def test_a_parameter_written_in_place_is_given_back_too():
    """An external held as an ``nn.Parameter`` (a module state kept as one)
    is rolled back like a plain tensor."""
    counter, x = torch.nn.Parameter(torch.zeros(4), requires_grad=False), torch.randn(4)
    g = _add_graph(counter, x)
    assert g.replay_engine == "jit" and torch.equal(counter, torch.zeros(4))
    for n in range(1, 4):
        g.replay()
        assert torch.equal(counter, n * x)


def test_negative_control_without_the_rollback_capture_end_leaves_the_trace_writes(monkeypatch):
    args = _kv_make()
    before = [t.clone() for t in args]
    monkeypatch.setattr(jit, "_restore", lambda saved: None)
    g, _ = _kv_capture(args)
    assert g.replay_engine == "jit"
    assert not torch.equal(args[2], before[2]) and not torch.equal(args[3], before[3])
    assert torch.equal(args[3], before[3] + 4)  # two runs at capture end: the trace and its first call


SEED = 1234


def _rng_step(x):
    return torch.nn.functional.dropout(x, p=0.5, training=True) + torch.randn_like(x)


def _rng_sequence(graphed: bool, n=4):
    """Seed, (capture,) then n steps each followed by an eager draw."""
    x = torch.ones(16, 8)
    torch.manual_seed(SEED)
    seq = []
    with torch.inference_mode():
        if graphed:
            g = TapeGraph(jit_replay=True)
            with tape_graph(g):
                out = _rng_step(x)
            assert g.replay_engine == "jit"
        for _ in range(n):
            if graphed:
                g.replay()
                seq.append(out.clone())
            else:
                seq.append(_rng_step(x))
            seq.append(torch.rand(3))
    return seq, torch.get_rng_state()


def test_rng_the_trace_at_capture_end_draws_nothing():
    """After manual_seed(s), capture + replays interleaved with eager draws
    reproduce what eager alone draws from s (the capture's own draws and the
    trace's are both given back)."""
    ref, ref_state = _rng_sequence(graphed=False)
    got, state = _rng_sequence(graphed=True)
    assert len(got) == len(ref) and all(torch.equal(a, b) for a, b in zip(ref, got))
    assert not torch.equal(ref[0], ref[2])  # the step really is random
    assert torch.equal(state, ref_state)


def test_negative_control_without_the_generator_restore_the_trace_draws(monkeypatch):
    prepare = TapeGraph._prepare_jit
    monkeypatch.setattr(TapeGraph, "_prepare_jit", lambda self, keep, generators: prepare(self, keep, []))
    ref, _ = _rng_sequence(graphed=False)
    got, _ = _rng_sequence(graphed=True)
    assert not torch.equal(ref[0], got[0])


def _poison_step(x, w):
    h = x @ w
    idx = (x.abs() * 3).long()
    return h, idx, h[1]


def _poison_capture(x, w):
    g = TapeGraph(poison_captured_values=True, jit_replay=True)
    with torch.inference_mode(), tape_graph(g):
        outs = _poison_step(x, w)
    return g, outs


def _poisoned(outs) -> bool:
    h, idx, row = outs
    return bool(torch.isnan(h).all() and torch.isnan(row).all() and (idx == torch.iinfo(torch.int64).max).all())


def test_survivors_stay_poisoned_until_the_first_replay():
    x, w = torch.randn(4, 4), torch.randn(4, 4)
    g, outs = _poison_capture(x, w)
    assert g.replay_engine == "jit" and _poisoned(outs)  # traced, and still garbage as on a GPU
    for _ in range(2):
        x.copy_(torch.randn(4, 4))
        g.replay()
        with torch.inference_mode():
            ref = _poison_step(x, w)
        assert all(torch.equal(a, b) for a, b in zip(outs, ref))


def test_negative_control_a_trace_after_poisoning_without_restoring_survivors_unpoisons(monkeypatch):
    poison = TapeGraph._poison

    def poison_then_trace(self, targets):
        poison(self, targets)
        self._prepare_jit([], [])  # a trace at capture end that does not give survivors their bytes back

    monkeypatch.setattr(TapeGraph, "_poison", poison_then_trace)
    x, w = torch.randn(4, 4), torch.randn(4, 4)
    _, outs = _poison_capture(x, w)
    assert not _poisoned(outs)
    with torch.inference_mode():
        ref = _poison_step(x, w)
    assert all(torch.equal(a, b) for a, b in zip(outs, ref))


def _reads_another_graphs_poisoned_indices():
    """Graph b indexes a table with graph a's int64 survivor, poisoned (the
    int64 maximum, out of range) until a replays."""
    x, table = torch.rand(3) * 5, torch.randn(5, 4)
    a = TapeGraph(poison_captured_values=True, jit_replay=True)
    with torch.inference_mode(), tape_graph(a):
        idx = x.long()
    b = TapeGraph(poison_captured_values=True, jit_replay=True)
    with torch.inference_mode(), tape_graph(b):
        rows = table.index_select(0, idx) * 2
    return a, b, x, table, idx, rows


def test_the_trace_reads_other_graphs_poisoned_survivors_with_their_real_values():
    """As the capture does (a CUDA capture never computes on garbage); they
    are poisoned again after."""
    a, b, x, table, idx, rows = _reads_another_graphs_poisoned_indices()
    assert b.replay_engine == "jit"
    assert (idx == torch.iinfo(torch.int64).max).all() and torch.isnan(rows).all()
    a.replay()
    b.replay()
    assert torch.equal(rows, table.index_select(0, x.long()) * 2)


def test_negative_control_on_the_poison_the_trace_fails(monkeypatch):
    stop = TapeGraph._stop
    monkeypatch.setattr(TapeGraph, "_stop", lambda self, repoison=True: stop(self, True))
    _, b, _, _, idx, _ = _reads_another_graphs_poisoned_indices()
    assert b.replay_engine == "python" and "tracing failed" in b._jit.why_python
    assert (idx == torch.iinfo(torch.int64).max).all()


def test_ineligible_or_opted_out_graphs_are_not_traced_at_capture_end(monkeypatch):
    """A program binding a generator replays in Python, as does a graph made
    with ``jit_replay=False``: tracing is not even tried."""
    calls = []
    trace = torch.jit.trace
    monkeypatch.setattr(torch.jit, "trace", lambda *a, **k: calls.append(1) or trace(*a, **k))
    gen = torch.Generator().manual_seed(3)
    with torch.inference_mode():
        g = TapeGraph(jit_replay=True)
        with tape_graph(g):
            torch.randn(4, generator=gen)
    assert g.replay_engine == "python" and calls == []
    args = _make()
    _capture(args, jit_replay=False)
    assert calls == []
    _capture(args, jit_replay=True)
    assert calls == [1]


def test_traces_at_first_replay_the_first_replay_is_the_trace_s_run(monkeypatch):
    """Inside jit.traces_at_first_replay() (gr.hf's capture followed by its equivalence check) the
    capture end neither traces nor runs the program; the first replay traces, and that run is the
    replay, bit for bit; outside the block the trace is made at capture end as before."""
    traced = []
    trace = torch.jit.trace
    monkeypatch.setattr(torch.jit, "trace", lambda *a, **k: traced.append(1) or trace(*a, **k))
    args = _make()
    cache = args[2]
    before = cache.clone()
    with jit.traces_at_first_replay():
        g, out = _capture(args, jit_replay=True)
        assert g.replay_engine == "jit-pending" and not traced
        assert torch.equal(cache, before)
        assert _replays_match(g, out, args)
    assert g.replay_engine == "jit" and len(traced) == 1
    _capture(_make(), jit_replay=True)
    assert len(traced) == 2  # outside the block: traced at capture end


def test_negative_control_traced_at_first_replay_without_the_rollback_the_write_lands_twice(monkeypatch):
    """The first replay's trace keeps capture end's guarantee: a failed trace leaves one write (the
    Python replay's) and the graph replays in Python; without the rollback, two."""
    cache, x = torch.zeros(4), torch.randn(4)
    monkeypatch.setattr(torch.jit, "trace", _failing_trace)
    with jit.traces_at_first_replay():
        g = _add_graph(cache, x)
        assert g.replay_engine == "jit-pending" and torch.equal(cache, torch.zeros(4))
        g.replay()
    assert g.replay_engine == "python" and torch.equal(cache, x)
    cache.zero_()
    monkeypatch.setattr(jit, "_restore", lambda saved: None)
    with jit.traces_at_first_replay():
        g = _add_graph(cache, x)
        g.replay()
    assert torch.equal(cache, 2 * x)
