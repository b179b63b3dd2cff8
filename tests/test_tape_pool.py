"""Graphs sharing a memory pool, as on CUDA (issue 13 item 2): ports of
PyTorch's test_graph_two_successive, test_graph_three_successive and
test_graph_concurrent_replay (test/test_cuda.py) to the tape, written anew.

Memory freed after one capture into a pool (here an output the user
dropped) is reused by the next capture into that pool, so replaying such
graphs out of capture order corrupts exactly as on CUDA; concurrent replays
of one pool's graphs raise instead (docs/concepts.md, "Graphs that share a
pool")."""

from __future__ import annotations

import threading

import pytest
import torch

import graphrunner.tape.pool as arena
from graphrunner.errors import CaptureError
from graphrunner.tape import TapeGraph, graph_pool_handle

SIZE = 1000
MODES = ("Don't share", "via pool()", "via graph_pool_handle()")


def _block(nbytes: int) -> int:
    return -(-nbytes // 512) * 512  # CUDA's 512-byte block rounding


def _three_successive(share_mem):
    a = torch.ones(SIZE)
    g0, g1, g2 = TapeGraph(), TapeGraph(), TapeGraph()
    g0_args = (graph_pool_handle(),) if share_mem == "via graph_pool_handle()" else ()
    g0.capture_begin(*g0_args)
    b = a.clone()
    c = b + 1
    d = b + 2
    g0.capture_end()
    args = (g0.pool(),) if share_mem == "via pool()" else g0_args
    g1.capture_begin(*args)
    e = c + 3
    del c
    g1.capture_end()
    g2.capture_begin(*args)
    f = d + 4
    g2.capture_end()
    return (g0, g1, g2), (a, b, d, e, f)


@pytest.mark.parametrize("share_mem", MODES)
def test_three_successive_out_of_order_replay_corrupts_only_when_sharing(share_mem):
    (g0, g1, g2), (_, _, _, e, f) = _three_successive(share_mem)
    g0.replay()
    g1.replay()
    g2.replay()
    assert e.sum().item() == SIZE * 5  # capture order is valid in every mode
    assert f.sum().item() == SIZE * 7
    g0.replay()
    g2.replay()
    g1.replay()
    # Shared: g2's capture reused the memory of c (dropped) for f, so g1's
    # "e = c + 3" read f's values: 7 + 3.
    expect = SIZE * (7 + 3) if share_mem != "Don't share" else SIZE * 5
    assert e.sum().item() == expect
    assert f.sum().item() == SIZE * 7


def test_three_successive_negative_control_without_reuse_sharing_passes_silently(monkeypatch):
    """With the arena's reuse disabled (the tape before this change) the
    shared-pool out-of-order replay gives the uncorrupted result, a CPU pass
    for code that breaks on a GPU."""
    monkeypatch.setattr(arena, "_move", lambda *a: False)
    (g0, g1, g2), (_, _, _, e, _) = _three_successive("via pool()")
    for g in (g0, g1, g2, g0, g2, g1):
        g.replay()
    assert e.sum().item() == SIZE * 5


def test_pool_bytes_estimate_counts_the_reused_block_once():
    block = _block(SIZE * 4)  # one float32 vector of SIZE
    graphs, _ = _three_successive("Don't share")
    assert [g.pool_bytes for g in graphs] == [3 * block, block, block]
    assert sum(g.pool().bytes_held for g in graphs) == 5 * block
    graphs, _ = _three_successive("via pool()")
    assert [g.pool_bytes for g in graphs] == [3 * block, block, 0]  # f took c's block
    assert graphs[0].pool() is graphs[2].pool() and graphs[0].pool().bytes_held == 4 * block


def _with_temps(t, val):
    x = t.clone() + val
    y = t.clone() + val
    return x + y


def _capture_first_begin_second(share_mem, a, hold=False):
    """Capture g0 (five temporaries-making steps on a clone of ``a``, then ``_hold`` if ``hold``)
    and begin g1's capture sharing g0's pool as ``share_mem`` says; return g0, g1, g0's output."""
    g0, g1 = TapeGraph(), TapeGraph()
    g0_args = (graph_pool_handle(),) if share_mem == "via graph_pool_handle()" else ()
    g0.capture_begin(*g0_args)
    b = a.clone()
    for _ in range(5):
        b = _with_temps(b, 1)
    if hold:
        _hold(b)
    g0.capture_end()
    g1.capture_begin(*((g0.pool(),) if share_mem == "via pool()" else g0_args))
    return g0, g1, b


@pytest.mark.parametrize("share_mem", MODES)
def test_two_successive_in_order_replay_is_exact_in_every_mode(share_mem):
    a = torch.ones(SIZE)
    g0, g1, b = _capture_first_begin_second(share_mem, a)
    for _ in range(5):
        b = _with_temps(b, 1)
    g1.capture_end()
    c = a.clone()  # unrelated eager work mixed with the replays
    for _ in range(2):
        c = _with_temps(c, 3)
    g0.replay()
    for _ in range(2):
        c = _with_temps(c, 3)
    g1.replay()
    for _ in range(2):
        c = _with_temps(c, 3)
    assert b.sum().item() == SIZE * 3070  # 1 -> 2t + 2, ten times
    assert c.sum().item() == SIZE * 442
    if share_mem != "Don't share":  # g1 reused g0's freed temporaries' blocks
        assert g1.pool_bytes < g0.pool_bytes


_GATE = {"armed": False, "inside": threading.Event(), "release": threading.Event()}


@torch.library.custom_op("graphrunner_test::hold", mutates_args=("x",))
def _hold(x: torch.Tensor) -> None:
    """Mutates nothing really; at replay, while armed, waits to be released
    (holds a replay in progress, deterministically)."""
    if _GATE["armed"]:
        _GATE["inside"].set()
        _GATE["release"].wait(30)


def _two_concurrent(share_mem):
    a = torch.ones(SIZE)
    g0, g1, b = _capture_first_begin_second(share_mem, a, hold=True)
    c = a.clone()
    for _ in range(5):
        c = _with_temps(c, 2)
    g1.capture_end()
    return g0, g1, b, c


def _replay_while_held(g0, g1):
    """Replay g1 while g0's replay (in another thread) is inside its hold op."""
    _GATE["inside"].clear()
    _GATE["release"].clear()
    _GATE["armed"] = True
    t = threading.Thread(target=g0.replay, name="replayer-g0")
    t.start()
    try:
        assert _GATE["inside"].wait(30)
        g1.replay()
    finally:
        _GATE["release"].set()
        t.join(30)
        _GATE["armed"] = False


@pytest.mark.parametrize("share_mem", MODES)
def test_concurrent_replay_raises_naming_both_graphs_only_when_sharing(share_mem):
    g0, g1, b, c = _two_concurrent(share_mem)
    g0.replay()
    g1.replay()
    assert b.sum().item() == SIZE * 94 and c.sum().item() == SIZE * 156  # sequential: exact
    if share_mem == "Don't share":
        _replay_while_held(g0, g1)
    else:
        with pytest.raises(CaptureError, match="concurrent replay in one memory pool") as info:
            _replay_while_held(g0, g1)
        assert repr(g0) in str(info.value) and repr(g1) in str(info.value)
    assert b.sum().item() == SIZE * 94 and c.sum().item() == SIZE * 156
    g1.replay()  # the pool is usable again once g0's replay ended


def test_concurrent_replay_negative_control_without_the_check_passes_silently(monkeypatch):
    g0, g1, _, c = _two_concurrent("via pool()")

    class _NoLock:
        def acquire(self, blocking=True):
            return True

        def release(self):
            pass

    g0.pool()._replay_lock = _NoLock()
    _replay_while_held(g0, g1)  # no error: the overlap goes unnoticed
    assert c.sum().item() == SIZE * 156


def test_memory_a_capture_still_reads_is_not_reused_before_that_read():
    """g1 reads g0's output b, allocates temporaries, reads b again, and the
    user drops b by the end of g1's capture: CUDA frees b only then, so none
    of g1's own tensors may be placed on b's memory before its last read."""
    a = torch.arange(SIZE, dtype=torch.float32)
    g0, g1 = TapeGraph(), TapeGraph()
    with torch.no_grad():
        g0.capture_begin()
        b = a * 2
        g0.capture_end()
        g1.capture_begin(g0.pool())
        x = b + 1
        y = x * 3
        z = b * 5 + y
        del b, x, y
        g1.capture_end()
    a.copy_(torch.randn(SIZE, generator=torch.Generator().manual_seed(0)))
    g0.replay()
    g1.replay()
    b_ref = a * 2
    assert torch.equal(z, b_ref * 5 + (b_ref + 1) * 3)


def _misregistered() -> list:
    from graphrunner.tape.state import OURS

    return [k for k, s in list(OURS.items()) for t in list(s) if id(t.untyped_storage()) != k]


def test_moved_survivors_stay_registered_under_their_new_memory():
    """A survivor moved onto reused pool memory is the tape's own tensor on
    that memory from then on; left registered under its old storage's id (which
    a later storage may get), it would make that storage's user look absent
    and its memory look free while the user still holds it."""
    graphs, tensors = _three_successive("via pool()")
    assert not _misregistered()


def test_moved_survivors_negative_control_stale_registration(monkeypatch):
    monkeypatch.setattr(arena, "_reregister", lambda st, moved: None)
    graphs, tensors = _three_successive("via pool()")
    assert _misregistered()
