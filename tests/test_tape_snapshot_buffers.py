"""Snapshot buffers reused within a capture session (graphrunner.tape.state.reuse_snapshot_buffers):
the externals a capture writes are put back exactly, replays match eager, and the buffers are reused."""

import pytest
import torch

import graphrunner.tape.jit as tape_jit
import graphrunner.tape.recording as tape_recording
from graphrunner.backends.full import FullGraphBackend
from graphrunner.tape import TapeGraph, tape_graph
from graphrunner.tape.state import _BUF_FREE, release_snapshot, reuse_snapshot_buffers, snapshot_copy


@pytest.fixture(autouse=True)
def _trace_small_programs(monkeypatch):
    """These tests trace small programs on purpose (the trace's mechanics), below the
    size from which a graph is traced by default (jit.JIT_MIN_OPS)."""
    monkeypatch.setattr(tape_jit, "JIT_MIN_OPS", 0)


N = 1 << 19  # float32: 2 MiB, above the size whose snapshot buffers are reused


def _captures_put_back(n_graphs: int = 3) -> bool:
    """Capture ``n_graphs`` graphs that each write a cache in place (an index_copy_ at their own rows, as a
    KV cache is written) inside one session; True when, after each capture, the cache holds exactly
    what it held before it and every replay matches eager."""
    torch.manual_seed(0)
    cache = torch.randn(N)
    ok = True
    with torch.inference_mode(), reuse_snapshot_buffers():
        graphs = []
        for i in range(n_graphs):
            cache.add_(1.0)  # an eager write between captures (a warmup): each capture sees new bytes
            before = cache.clone()
            idx = torch.arange(i * 8, i * 8 + 8)
            src = torch.randn(8)
            g = TapeGraph()
            with tape_graph(g):
                cache.index_copy_(0, idx, src * 2)
                out = cache[idx].sum()
            ok = ok and torch.equal(cache, before)  # a capture runs nothing
            graphs.append((g, idx, src, out))
        for g, idx, src, out in graphs:
            src.copy_(torch.randn(8))
            want = cache.clone()
            want.index_copy_(0, idx, src * 2)
            g.replay()
            ok = ok and torch.equal(cache, want) and torch.equal(out, want[idx].sum())
    return ok


@pytest.mark.parametrize("jit", [True, False])
def test_captures_in_a_session_put_externals_back_and_replay_as_eager(jit, monkeypatch):
    monkeypatch.setenv("GRAPHRUNNER_TAPE_JIT", "1" if jit else "0")
    assert _captures_put_back()
    assert not _BUF_FREE  # dropped when the session ends


def test_stale_snapshot_buffer_is_caught(monkeypatch):
    """Negative control: a reused buffer handed out without the copy (it holds an earlier capture's bytes)
    puts the cache back wrong, and the test above fails."""

    def stale(b):
        free = _BUF_FREE.get((b.numel(), b.device))
        return free.pop() if free else b.clone()

    monkeypatch.setattr(tape_recording, "snapshot_copy", stale)
    monkeypatch.setattr(tape_jit, "snapshot_copy", stale)
    assert not _captures_put_back()


def test_buffers_are_reused_only_inside_a_session():
    b = torch.arange(N * 4, dtype=torch.uint8)
    with torch.inference_mode():
        outside = snapshot_copy(b)
        release_snapshot(outside)
        assert not _BUF_FREE and torch.equal(outside, b)
        with reuse_snapshot_buffers():
            first = snapshot_copy(b)
            release_snapshot(first)
            again = snapshot_copy(b.flip(0))
            assert again.data_ptr() == first.data_ptr() and torch.equal(again, b.flip(0))
            small = torch.arange(16, dtype=torch.uint8)
            release_snapshot(snapshot_copy(small))
            assert (16, small.device) not in _BUF_FREE  # small copies are not kept
        assert not _BUF_FREE


def test_backend_session_enters_the_reuse():
    backend = FullGraphBackend(device="tape")
    with backend.capture_session():
        b = torch.zeros(N * 4, dtype=torch.uint8)
        with torch.inference_mode():
            release_snapshot(snapshot_copy(b))
        assert _BUF_FREE
    assert not _BUF_FREE
