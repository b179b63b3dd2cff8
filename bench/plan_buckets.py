"""Buckets planned from traffic vs vLLM's ladder (issue 25 item 3), at equal graph counts.

For each traffic the batch size of every call is drawn (seeded), vLLM's ladder
``gr.default_buckets(max size)`` is taken as the baseline (its graph count
``K``), and ``gr.plan_buckets(sizes, max_graphs=K)`` plans ``K`` buckets from
the same sizes. Printed and written per traffic: the padded-row fraction of
each (padding rows / rows computed by replays), their ratio, the graph counts,
and the fewest planned graphs that pad no more than the ladder. Traffics:

- ``uniform``: sizes uniform in 1..256;
- ``lognormal``: ``exp(N(3, 1))`` rounded, clipped to 1..256 (many small batches, a long tail);
- ``bursty``: a two-state Markov chain: quiet stretches of 1..8 rows, bursts of 160..256;
- ``loadtest``: the decode schedule (batch size of every step) of the loadtest engine itself
  (``graphrunner_tools.loadtest``: continuous batching of seeded requests over the demo
  decoder, one level per concurrency), run in this process; ``--no-loadtest`` skips it.

In the same run, the planner's speed at scale (issue 34 item 8): the wall and CPU seconds of
``gr.plan_buckets`` on 100,000 distinct sizes (``--scale-sizes``; drawn from 1..1,000,000, each
seen 1..3 times, seeded) with ``max_graphs=64`` (``--scale-graphs``); ``--no-scale`` skips it.

Writes JSON (``--out``, default ``bench/results/plan_buckets.json``) with
``environment()``: the ratios per traffic and the timing. Not a test: no threshold.

    python bench/plan_buckets.py [--calls 20000] [--seed 0] [--threads 1] [--no-loadtest]
                                 [--scale-sizes 100000] [--scale-graphs 64] [--no-scale]
"""

from __future__ import annotations

import argparse
import math
import os
import random
import time

import torch

import graphrunner as gr
from graphrunner_tools.bench import environment, write_json
from graphrunner_tools.plan import compare_with_ladder
from graphrunner_tools.threads import torch_threads

MAX = 256


def uniform(n: int, rng: random.Random) -> list[int]:
    return [rng.randint(1, MAX) for _ in range(n)]


def lognormal(n: int, rng: random.Random) -> list[int]:
    return [min(MAX, max(1, round(math.exp(rng.gauss(3.0, 1.0))))) for _ in range(n)]


def bursty(n: int, rng: random.Random) -> list[int]:
    out, burst = [], False
    for _ in range(n):
        if rng.random() < (0.05 if burst else 0.02):  # bursts last ~20 calls, quiet stretches ~50
            burst = not burst
        out.append(rng.randint(160, MAX) if burst else rng.randint(1, 8))
    return out


def loadtest_schedule(requests: int, levels: list[int], seed: int) -> list[int]:
    """The graph engine's decode schedule of an in-process loadtest (rank 0 of 1)."""
    from graphrunner_tools.loadtest import LoadtestConfig, serve_rank

    cfg = LoadtestConfig(
        requests=requests, concurrency=tuple(levels), layers=1, seed=seed, progress=False, device="auto"
    )
    res = serve_rank(0, 1, cfg)
    if res["error"] or any(lv.get("error") for lv in res["levels"]):
        raise RuntimeError(f"loadtest failed: {res}")
    return [n for lv in res["levels"] for n in lv["graph"]["schedule"]]


def measure(name: str, sizes: list[int]) -> dict[str, object]:
    t0 = time.perf_counter()
    r = compare_with_ladder(sizes)
    plan_s = time.perf_counter() - t0
    pp, lp = r["planned_padding"], r["ladder_padding"]
    row = {
        "calls": len(sizes),
        "distinct_sizes": len(set(sizes)),
        "max_size": max(sizes),
        "graphs": {"ladder": lp["graphs"], "planned": pp["graphs"]},
        "padded_fraction": {"ladder": lp["padded_fraction"], "planned": pp["padded_fraction"]},
        "padded_rows": {"ladder": lp["padded_rows"], "planned": pp["padded_rows"]},
        "ratio_planned_over_ladder": r["ratio"],
        "planned_graphs_to_match_ladder": r["graphs_to_match"],
        "planned": r["planned"],
        "seconds_to_plan_with_search": plan_s,
    }
    ratio = "n/a" if r["ratio"] is None else f"{r['ratio']:.2f}x"
    print(
        f"{name:>10} {len(sizes):>7} {lp['graphs']:>7} {pp['graphs']:>7} {lp['padded_fraction']:>9.2%} "
        f"{pp['padded_fraction']:>9.2%} {ratio:>7} {r['graphs_to_match']:>8}"
    )
    return row


def scale(distinct: int, max_graphs: int, seed: int) -> dict[str, object]:
    """Seconds (wall and CPU) of one ``gr.plan_buckets`` over ``distinct`` distinct seeded sizes."""
    rng = random.Random(f"scale-{seed}")
    sizes = [n for n in rng.sample(range(1, 10 * distinct + 1), distinct) for _ in range(rng.randint(1, 3))]
    t0, c0 = time.perf_counter(), time.process_time()
    planned = gr.plan_buckets(sizes, max_graphs=max_graphs, progress=False)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    print(
        f"plan_buckets at scale: {distinct:,} distinct sizes ({len(sizes):,} calls), max_graphs={max_graphs}: "
        f"{wall:.2f} s ({cpu:.2f} s CPU), {len(planned)} buckets"
    )
    return {
        "distinct_sizes": distinct,
        "calls": len(sizes),
        "max_graphs": max_graphs,
        "seconds": wall,
        "cpu_seconds": cpu,
        "buckets": len(planned),
    }


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=20000, help="calls per seeded traffic (default: 20000)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default: 1)")
    ap.add_argument("--no-loadtest", action="store_true", help="skip the loadtest trace")
    ap.add_argument("--loadtest-requests", type=int, default=256, help="requests of the loadtest (default: 256)")
    ap.add_argument("--loadtest-levels", default="16,64,128", help="its concurrency levels (default: 16,64,128)")
    ap.add_argument(
        "--scale-sizes", type=int, default=100_000, help="distinct sizes of the timing at scale (default: 100000)"
    )
    ap.add_argument("--scale-graphs", type=int, default=64, help="max_graphs of the timing at scale (default: 64)")
    ap.add_argument("--no-scale", action="store_true", help="skip the timing at scale")
    ap.add_argument("--quick", action="store_true", help="2000 calls, a 64-request loadtest, 20000 distinct sizes")
    ap.add_argument("--out", default=os.path.join("bench", "results", "plan_buckets.json"))
    args = ap.parse_args(argv)
    if args.quick:
        args.calls, args.loadtest_requests, args.scale_sizes = 2000, 64, min(args.scale_sizes, 20_000)
    rows = {}
    print(
        f"{'traffic':>10} {'calls':>7} {'g_vllm':>7} {'g_plan':>7} {'pad_vllm':>9} {'pad_plan':>9} {'ratio':>7} "
        f"{'g_match':>8}"
    )
    with torch_threads(args.threads):
        for name, draw in (("uniform", uniform), ("lognormal", lognormal), ("bursty", bursty)):
            rows[name] = measure(name, draw(args.calls, random.Random(f"{name}-{args.seed}")))
        if not args.no_loadtest:
            levels = [int(x) for x in args.loadtest_levels.split(",")]
            t0 = time.perf_counter()
            sched = [n for n in loadtest_schedule(args.loadtest_requests, levels, args.seed) if n]
            rows["loadtest"] = measure("loadtest", sched)
            rows["loadtest"]["loadtest"] = {
                "requests": args.loadtest_requests,
                "levels": levels,
                "seconds": time.perf_counter() - t0,
                "schedule": sched,
            }
    print(
        "columns: g_* = graphs (equal counts: the planner gets the ladder's), pad_* = padded rows / rows "
        "replayed, ratio = pad_plan / pad_vllm, g_match = fewest planned graphs padding no more than the ladder"
    )
    timing = None if args.no_scale else scale(args.scale_sizes, args.scale_graphs, args.seed)  # NumPy: one thread
    # exact: never more padding than the ladder with as many graphs
    for name, row in rows.items():
        assert row["padded_rows"]["planned"] <= row["padded_rows"]["ladder"], name
    result = {
        "bench": "plan_buckets",
        "environment": environment(),
        "threads": torch.get_num_threads(),
        "seed": args.seed,
        "calls": args.calls,
        "results": rows,
        "scale": timing,
        "note": "vLLM's ladder is gr.default_buckets(max size): 1, 2, 4, multiples of 8 below 256, then 16",
    }
    write_json(args.out, result, announce=True)
    return result


if __name__ == "__main__":
    main()
