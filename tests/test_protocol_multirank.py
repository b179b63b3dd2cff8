"""The capture protocol across real processes (gloo), with timeouts.

- A slow post-warmup hook on one rank: the merged traces show that no rank
  constructed its graph before the slow rank's last hook finished.
  Negative control: without the final barrier the checker detects the early
  capture.
- Fault: one rank raises in its second warmup; every other rank raises
  RankTimeoutError within the group timeout, and every process exits.
"""

import time

import pytest
import torch
from mp_util import assert_all_ok, format_results, run_ranks

from graphrunner.backends import BreakableGraphBackend, FullGraphBackend
from graphrunner.backends.protocol import check_capture_order
from graphrunner.breakable import no_graph
from graphrunner.devices import TapeDevice
from graphrunner.group import TorchDistGroup
from graphrunner.trace import EventKind, Trace

pytestmark = [pytest.mark.multirank, pytest.mark.slow]  # slow: spawns rank processes (-m "not slow" skips it)

SLOW_RANK = 1
HOOK_SLEEP = 1.5
KEYS = (4, 2)


class FullNoFinalBarrier(FullGraphBackend):
    """Negative control: the final barrier is skipped (nothing else changes)."""

    def _final_barrier(self, key):
        pass


_BACKENDS = {"full": FullGraphBackend, "breakable": BreakableGraphBackend, "full_no_final_barrier": FullNoFinalBarrier}


def _slow_hook_worker(rank, world_size, backend_names, outdir):
    torch.manual_seed(0)
    group = TorchDistGroup(timeout=20)
    w = torch.randn(4, 4)
    x = torch.randn(4, 4)
    paths = {}
    for name in backend_names:
        trace = Trace(rank=rank)
        backend = _BACKENDS[name](device=TapeDevice(), group=group, trace=trace)
        warm = {"n": 0}

        def hook():
            warm["n"] += 1  # noqa: B023 - called in this iteration, before the variable moves on
            if rank == SLOW_RANK and warm["n"] % backend.warmups == 0:  # noqa: B023 - called in this iteration, before the variable moves on
                time.sleep(HOOK_SLEEP)  # the last hook of every key is slow on this rank

        @no_graph
        def eager_part(h):
            return h * 2

        with torch.inference_mode(), backend.capture_session():
            for k in KEYS:
                backend.capture_one(k, lambda k=k: eager_part(x[:k] @ w), capture_inputs=x, post_warmup_hook=hook)
        with torch.inference_mode():
            out = backend.replay(KEYS[-1])
            torch.testing.assert_close(out, (x[: KEYS[-1]] @ w) * 2)
        group.barrier(phase="test_end")
        path = f"{outdir}/{name}_rank{rank}.jsonl"
        trace.to_jsonl(path)
        paths[name] = path
    return paths


def _merged(results, name):
    return Trace.merge([Trace.from_jsonl(r.value[name]) for r in results])


def _construct_vs_slow_hook(merged, key):
    """(earliest graph_construct begin over fast ranks, end of the slow rank's last hook) for key."""
    cons = [
        e.t_begin_ns
        for e in merged.events
        if e.kind == EventKind.GRAPH_CONSTRUCT and e.key == key and e.rank != SLOW_RANK
    ]
    hooks = [e.end for e in merged.events if e.kind == EventKind.HOOK and e.key == key and e.rank == SLOW_RANK]
    return min(cons), max(hooks)


def test_slow_hook_no_rank_captures_early_and_negative_control(tmp_path):
    names = ["full", "breakable", "full_no_final_barrier"]
    res = run_ranks(_slow_hook_worker, world_size=2, args=(names, str(tmp_path)), timeout=90)
    assert_all_ok(res)

    for name in ("full", "breakable"):
        merged = _merged(res, name)
        assert {e.rank for e in merged.events} == {0, 1}
        assert check_capture_order(merged) == [], name
        for key in KEYS:
            first_construct, slow_hook_end = _construct_vs_slow_hook(merged, key)
            assert first_construct >= slow_hook_end, (name, key)

    # Negative control: the fast ranks start constructing while the slow hook sleeps.
    merged = _merged(res, "full_no_final_barrier")
    first_construct, slow_hook_end = _construct_vs_slow_hook(merged, KEYS[0])
    assert first_construct < slow_hook_end
    v = check_capture_order(merged)
    early = [s for s in v if f"before rank {SLOW_RANK} finished its last warmup/hook" in s]
    assert early, v
    assert any("no barrier between the last warmup/hook and graph construction" in s for s in v), v


FAULT_TIMEOUT = 5.0
HANG_TIMEOUT = 2.0


def _fault_worker(rank, world_size, faulty_rank, mode, timeout):
    # The first Python dispatch mode of a process imports torch._dynamo (seconds on a busy machine); the
    # drift check records warmup 2 under one. Pay that once here, or it blurs the injected hang.
    import torch._dynamo  # noqa: F401

    group = TorchDistGroup(timeout=timeout)
    backend = FullGraphBackend(device=TapeDevice(), group=group)
    calls = {"n": 0}

    def forward():
        calls["n"] += 1
        if rank == faulty_rank and calls["n"] == 2:
            if mode == "raise":
                raise RuntimeError("injected failure in warmup 2")
            time.sleep(timeout + 2.0)  # "hang": stuck past everyone's deadline
        return torch.ones(4) * rank

    with backend.capture_session():
        backend.capture_one(8, forward)  # the others (and a hung rank on waking) fail
    return "captured"


@pytest.mark.parametrize("mode,timeout", [("raise", FAULT_TIMEOUT), ("hang", HANG_TIMEOUT)])
def test_fault_in_warmup_makes_every_rank_fail_within_timeout(mode, timeout):
    world = 3
    res = run_ranks(_fault_worker, world_size=world, args=(1, mode, timeout), timeout=60)
    report = format_results(res)
    if mode == "raise":
        assert res[1].exc_type == "CaptureError", report
        assert "shape key 8" in res[1].exc_message and "warmup 2/2 forward" in res[1].exc_message
    else:
        # the stuck rank wakes up to find its peers gone: it fails too, loudly
        assert res[1].exc_type == "RankTimeoutError", report
    for r in (0, 2):
        assert res[r].exc_type == "RankTimeoutError", report
        msg = res[r].exc_message
        assert f"rank {r} of {world}" in msg and "'pre_capture'" in msg and "shape key 8" in msg, msg
        assert res[r].seconds < timeout + 15, report
        if mode == "hang":
            assert res[r].seconds >= timeout - 0.2, report  # it waited for the deadline, then failed
    # every process exited on its own (none had to be killed by run_ranks' 60 s timeout)
    assert all(r.exitcode is not None and not r.timed_out for r in res), report
