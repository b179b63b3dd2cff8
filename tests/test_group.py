"""Rank groups: LocalGroup semantics, and TorchDistGroup over real gloo
processes (agreement values, barrier, a stuck peer and a dead peer raise
RankTimeoutError naming rank, phase and key instead of hanging)."""

import os
import time

import pytest
from mp_util import assert_all_ok, format_results, run_ranks

from graphrunner.errors import RankTimeoutError
from graphrunner.group import LocalGroup, TorchDistGroup


def test_local_group():
    g = LocalGroup()
    assert (g.rank, g.size) == (0, 1)
    assert g.barrier() is None
    assert g.barrier(phase="warmup", key=8) is None
    assert g.all_max(5, phase="bucket", key=None) == 5
    assert g.all_min(-3) == -3
    with pytest.raises(TypeError, match="expects a Python int"):
        g.all_max(1.5)
    with pytest.raises(TypeError):
        g.all_min("3")


def test_torch_dist_group_needs_init():
    import torch.distributed as dist

    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="init_process_group"):
        TorchDistGroup()


# --------------------------------------------------------------- multi-rank
def _values_worker(rank, world_size):
    g = TorchDistGroup(timeout=10)
    assert (g.rank, g.size) == (rank, world_size)
    g.barrier(phase="start", key=None)
    mx = g.all_max(rank * 10 + 1, phase="agree", key=(1, 2))
    mn = g.all_min(rank * 10 + 1, phase="agree", key=(1, 2))
    return mx, mn


def _stuck_worker(rank, world_size, done_file):
    g = TorchDistGroup(timeout=1.0)
    g.barrier(phase="start")
    if rank == 1:
        # Stuck (alive, never reaching the barrier) until rank 0 is done, for
        # at most 25 s: longer than the test's bound, so only the group's own
        # timeout can end rank 0's wait in time (not this rank leaving).
        t0 = time.monotonic()
        while not os.path.exists(done_file) and time.monotonic() - t0 < 25:
            time.sleep(0.05)
        return "slept"
    t0 = time.monotonic()
    try:
        g.barrier(phase="pre_capture", key=16)
    except RankTimeoutError as exc:
        result = ("timeout", str(exc), time.monotonic() - t0)
    else:
        result = ("no timeout", "", time.monotonic() - t0)
    open(done_file, "w").close()
    return result


def _dead_worker(rank, world_size):
    g = TorchDistGroup(timeout=20)
    g.barrier(phase="start")
    if rank == 1:
        os._exit(7)  # dies without a word
    t0 = time.monotonic()
    try:
        g.all_max(3, phase="bucket_agree", key=4)
    except RankTimeoutError as exc:
        return ("timeout", str(exc), repr(exc.__cause__), time.monotonic() - t0)
    return ("no error", "", "", time.monotonic() - t0)


@pytest.mark.multirank
def test_torch_dist_group_agreement_three_ranks():
    res = run_ranks(_values_worker, world_size=3, timeout=60)
    assert_all_ok(res)
    assert [r.value for r in res] == [(21, 1)] * 3


@pytest.mark.multirank
def test_torch_dist_group_stuck_peer_times_out_naming_rank_phase_key(tmp_path):
    res = run_ranks(_stuck_worker, world_size=2, args=(str(tmp_path / "done"),), timeout=60)
    assert_all_ok(res)
    status, msg, secs = res[0].value
    assert status == "timeout", format_results(res)
    assert "rank 0 of 2" in msg and "'pre_capture'" in msg and "shape key 16" in msg
    # the group's 1 s timeout: not gloo's 30 s default, nor the stuck peer leaving (25 s)
    assert 0.9 <= secs < 15, secs
    assert res[1].value == "slept"


@pytest.mark.multirank
def test_torch_dist_group_dead_peer_fails_fast():
    res = run_ranks(_dead_worker, world_size=2, timeout=60)
    assert res[1].exitcode == 7 and not res[1].ok
    assert res[0].ok, format_results(res)
    status, msg, cause, secs = res[0].value
    assert status == "timeout"
    assert "rank 0 of 2" in msg and "'bucket_agree'" in msg and "shape key 4" in msg
    assert "RuntimeError" in cause  # gloo's error is chained as __cause__
    assert secs < 20  # did not wait for the 20 s timeout: a dead peer is detected
    assert res[0].exitcode == 0 and not res[0].timed_out


def _threads_worker(rank, world_size):
    import os

    import torch

    return (torch.get_num_threads(), os.environ.get("OMP_NUM_THREADS"))


@pytest.mark.multirank
def test_rank_processes_run_with_one_thread_each():
    """Ranks share the machine's cores: each rank process runs one intra-op
    thread (more busy-wait on cores their peers hold)."""
    res = run_ranks(_threads_worker, world_size=2, timeout=60, init=False)
    assert_all_ok(res)
    assert [r.value for r in res] == [(1, "1")] * 2
