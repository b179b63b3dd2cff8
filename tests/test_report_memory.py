"""The capture report's graph memory (issue 25 item 2) against a hand computation on the tape,
``GraphRunner(memory_budget=...)`` leaving exactly the right keys to eager, and the report's
one-time cost and legend (issue 26 item 6)."""

from __future__ import annotations

import json

import pytest
import torch

import graphrunner as gr
from graphrunner.budget import MemoryBudget, one_time_imports
from graphrunner.report import LEGEND, BucketReport, CaptureReport, RunnerStats

F32 = 4  # bytes


def block(nbytes: int) -> int:
    """A CUDA caching-allocator block: a multiple of 512 bytes (at least 512)."""
    return max(512, -(-nbytes // 512) * 512)


def chain(x):
    """Three ops: ``a = 2x`` and ``b = a + 1`` are live together (two blocks of ``B*T*4``
    bytes), then ``b.sum(-1)`` ([B] floats) reuses ``a``'s freed block."""
    a = x * 2
    b = a + 1
    return b.sum(-1)


def make(t: int = 100, buckets=(1, 2, 4, 8), backend: str = "full", **kw) -> gr.GraphRunner:
    return gr.GraphRunner(
        chain, {"x": gr.BatchInput(trailing=(t,))}, list(buckets), backend=backend, device="tape", progress=False, **kw
    )


def pool_need(b: int, t: int) -> int:
    """The hand computation: the largest captured key's two live temporaries."""
    return 2 * block(b * t * F32)


@pytest.mark.parametrize("backend", ["full", "breakable"])
@pytest.mark.parametrize("t", [64, 100])
def test_graph_pool_bytes_per_key_match_a_hand_computation(backend, t):
    r = make(t, backend=backend)
    rep = r.capture()
    # largest first: key 8 takes two blocks; every smaller key fits in the blocks 8 freed
    assert [b.bucket for b in rep.buckets] == [8, 4, 2, 1]
    assert [b.graph_pool_bytes for b in rep.buckets] == [pool_need(8, t), 0, 0, 0]
    assert rep.graph_pool_bytes == pool_need(8, t) == r.device.pool_bytes()  # rows sum to the pool
    assert rep.static_input_bytes == 8 * t * F32
    assert rep.output_buffer_bytes == 8 * F32
    assert rep.total_bytes == pool_need(8, t) + 8 * t * F32 + 8 * F32
    assert rep.total_bytes_held == 8 * t * F32 + 8 * F32
    d = json.loads(rep.to_json())
    assert d["graph_pool_bytes"] == pool_need(8, t) and d["total_bytes"] == rep.total_bytes
    assert [b["graph_pool_bytes"] for b in d["buckets"]] == [pool_need(8, t), 0, 0, 0]
    table = rep.table()
    mem = next(line for line in table.splitlines() if line.startswith("memory:"))
    assert mem == (
        f"memory: graph pool {gr.report.format_bytes(pool_need(8, t))} + static inputs "
        f"{gr.report.format_bytes(8 * t * F32)} + output buffer 32 B = "
        f"{gr.report.format_bytes(rep.total_bytes)}"
    )
    r.cleanup()


def test_a_smaller_key_captured_alone_needs_its_own_blocks():
    # negative control of the reuse: without the larger key, key 2 pays its own two blocks
    r = make(100, buckets=(1, 2))
    rep = r.capture()
    assert [b.graph_pool_bytes for b in rep.buckets] == [pool_need(2, 100), 0]
    assert pool_need(2, 100) == 2 * 1024 != pool_need(8, 100)


def _eager(x):
    with torch.inference_mode():
        return chain(x)


@pytest.mark.parametrize(
    "budget,left,pool",
    [
        (None, [], pool_need(8, 100)),
        (pool_need(8, 100), [], pool_need(8, 100)),  # exactly the need: fits
        (pool_need(8, 100) - 1, [8], pool_need(4, 100)),  # one byte short: 8 left to eager
        (pool_need(4, 100), [8], pool_need(4, 100)),
        (pool_need(4, 100) - 1, [8, 4], pool_need(2, 100)),
        (pool_need(1, 100), [8, 4, 2], pool_need(1, 100)),
        (pool_need(1, 100) - 1, [8, 4, 2, 1], 0),  # nothing fits: every call eager
    ],
)
def test_memory_budget_leaves_exactly_the_keys_that_do_not_fit(budget, left, pool):
    r = make(100, memory_budget=budget)
    rep = r.capture()
    assert rep.left_to_eager == left and rep.memory_budget == budget
    assert [b.bucket for b in rep.buckets] == [k for k in (8, 4, 2, 1) if k not in left]
    assert rep.graph_pool_bytes == pool == r.device.pool_bytes()
    assert budget is None or rep.graph_pool_bytes <= budget
    assert r.backend.keys() == [b.bucket for b in rep.buckets]
    gen = torch.Generator().manual_seed(0)
    for n in range(1, 9):
        x = torch.randn(n, 100, generator=gen)
        before = r.stats.fallbacks
        got = r(x=x).clone()
        bucket = r.bucket_for(n)
        if bucket in left:  # served by the eager fallback, on the call's own rows
            assert r.stats.fallbacks == before + 1 and r.stats.last_bucket is None
            torch.testing.assert_close(got, _eager(x), rtol=0, atol=0)
        else:  # replayed from its graph: equal to eager on the padded batch
            assert r.stats.last_bucket == bucket
            padded = torch.cat([x, x.new_zeros(bucket - n, 100)])
            torch.testing.assert_close(got, _eager(padded)[:n], rtol=0, atol=0)
    if left:
        assert r.stats.fallback_reasons == {"cannot_replay": sum(1 for n in range(1, 9) if r.bucket_for(n) in left)}
        line = next(x for x in rep.table().splitlines() if x.startswith("memory_budget"))
        assert line.endswith("left to eager: " + ", ".join(map(str, left)))
    r.cleanup()


def test_memory_budget_rejects_bad_values_naming_the_argument():
    with pytest.raises(ValueError, match="memory_budget must be >= 0 bytes, got -1"):
        make(memory_budget=-1)
    with pytest.raises(TypeError, match=r"memory_budget must be a number of bytes.*float"):
        make(memory_budget=1.5)
    with pytest.raises(TypeError, match="memory_budget .*bool"):
        make(memory_budget=True)
    with pytest.raises(ValueError, match="one rank only.*has 2"):
        MemoryBudget(1 << 20, world_size=2)
    assert MemoryBudget(None, world_size=2).budget is None


def test_memory_budget_needs_a_device_that_measures_memory():
    rows = [BucketReport(4, 0.1, 0.05, 1, 0, 0, graph_pool_bytes=None)]
    with pytest.raises(gr.CaptureError, match="does not report its graph memory"):
        MemoryBudget(100).append(4, [], rows[0])
    MemoryBudget(None).append(4, [], rows[0])  # no budget: nothing to measure


def test_report_without_pool_figures_says_so_and_prints_no_sum():
    rows = [BucketReport(4, 0.5, 0.25, 1, 0, 4096), BucketReport(2, 0.25, 0.125, 1, 0, 2048)]
    rep = CaptureReport("full", "cuda", 0, 1, rows, total_seconds=1.0, static_input_bytes=64, output_buffer_bytes=4096)
    assert rep.graph_pool_bytes is None
    total = next(x.split() for x in rep.table().splitlines() if x.split()[:1] == ["total"])
    assert total[-1] == "-"
    assert "memory: static inputs 64 B + output buffer 4.0 KiB = 4.1 KiB (graph pool not measured)" in rep.table()


def test_one_time_cost_is_labelled_once_and_the_legend_is_short():
    rows = [BucketReport(4, 0.5, 0.25, 1, 0, 0, graph_pool_bytes=2048)]
    rep = CaptureReport(
        "full",
        "tape",
        0,
        1,
        rows,
        total_seconds=0.5,
        static_input_bytes=64,
        output_buffer_bytes=64,
        one_time_seconds=1.4,
        one_time_what="torch._dynamo import, once per process",
    )
    head = rep.table().splitlines()[0]
    assert head.endswith("wall=0.500s (+1.40s one-time before the first key: torch._dynamo import, once per process)")
    assert rep.table().splitlines()[-1] == LEGEND and len(LEGEND) <= 160
    for col in ("capture_s", "checks_s", "graph_s", "graph_pool"):
        assert col in LEGEND
    rep.one_time_seconds = 0.0  # later captures: no one-time note
    assert "one-time" not in rep.table()
    assert one_time_imports() >= 0.0
    assert one_time_imports() == 0.0  # imported now: a later capture pays nothing


def test_checks_seconds_is_the_hooks_time_within_the_capture():
    """A hook that sleeps a known time at each of its points: the key's ``checks_seconds`` holds
    that time (plus the recorders' own small share), inside ``capture_seconds``; a backend
    without hooks reports 0 (the control)."""
    import time

    from graphrunner.recording.hooks import CaptureHook

    naps = {"begin": 0.02, "after_warmups": 0.03, "after_capture": 0.04}

    class Sleeper(CaptureHook):
        name = "sleeper"

        def begin(self, cap):
            time.sleep(naps["begin"])

        def after_warmups(self, cap):
            time.sleep(naps["after_warmups"])

        def after_capture(self, cap):
            time.sleep(naps["after_capture"])

    def capture(hooks):
        backend = gr.backends.FullGraphBackend(device="tape", drift_check=False, hooks=hooks)
        with backend.capture_session():
            backend.capture_one(2, lambda: torch.ones(2) * 3)
        return backend.info(2)

    info = capture([Sleeper()])
    want = sum(naps.values())
    assert want <= info["checks_seconds"] < want + 0.05
    assert info["checks_seconds"] <= info["capture_seconds"]
    assert capture([])["checks_seconds"] == 0.0


def test_runner_stats_count_a_fallback_only_under_its_reason():
    stats = RunnerStats(replays={4: 0})
    stats.count(None, (9,), (9,), "over_max_bucket")
    stats.count(4, (3,), (4,))
    assert (stats.replays, stats.fallbacks, stats.fallback_reasons) == ({4: 1}, 1, {"over_max_bucket": 1})
    assert (stats.padding_rows, stats.real_rows, stats.calls) == (1, 12, 2)
    # a fallback without its reason is refused before any counter moves (it would be filed under None)
    with pytest.raises(ValueError, match="pass reason="):
        stats.count(None, (2,), (2,))
    assert (stats.fallbacks, stats.fallback_reasons, stats.real_rows, stats.last_bucket) == (
        1,
        {"over_max_bucket": 1},
        12,
        4,
    )
