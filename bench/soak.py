"""Soak: N gloo ranks serve many steps through one GraphRunner each, checked against eager.

Each rank holds a shard of a small tensor-parallel MLP and all-reduces its
partial result inside the captured step (an eager break sits between the two
matmuls, so the breakable backend is exercised). Every step every rank
draws its own batch size (1 .. largest bucket + 2, so some steps fall back
together); the runner agrees on the bucket. Every output is compared with
an eager reference of the all-reduced result computed on the same rank (all
ranks can regenerate every rank's input of a step), and each
rank's resident memory (RSS) is sampled along the way. Prints one line per
rank and writes JSON::

    python bench/soak.py --ranks 3 --steps 10000 --out bench/results/soak.json

Target: 0 mismatches and flat RSS (the last sample within a few MiB of the
one taken after warm-up). Not part of ``graphrunner bench`` (it runs for a
while); ``--steps 300`` is a smoke run.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time

import torch

from graphrunner_tools.bench import environment, write_json
from graphrunner_tools.launch import launch_ranks

D, H = 16, 48
BUCKETS = [1, 2, 4, 8]


def _rss_mib() -> float:
    """This process's resident set size in MiB (Linux ``/proc``; NaN elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except OSError:
        return float("nan")


def _batch(step: int, rank: int) -> torch.Tensor:
    n = random.Random(1_000_003 * step + rank).randint(1, BUCKETS[-1] + 2)
    return torch.randn(n, D, generator=torch.Generator().manual_seed(1_000_003 * step + rank))


def _reference(step: int, rank: int, world: int, n: int, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """What ``rank`` must get at ``step``: row j is the sum over ranks r of
    rank r's shard applied to rank r's row j (zeros where r has fewer rows:
    its padding), i.e. the all-reduce of every rank's partial result."""
    out = torch.zeros(n, D)
    for r in range(world):
        xr = _batch(step, r)[:n]
        if xr.shape[0] < n:
            xr = torch.cat([xr, xr.new_zeros(n - xr.shape[0], D)])
        shard = slice(r * H // world, (r + 1) * H // world)
        out += torch.relu(xr @ w1[:, shard]) @ w2[shard]
    return out


def _rank_main(rank, world, steps, backend):
    """One rank (started by torch's elastic launcher, its gloo group joined): the soak; returns its numbers."""
    import torch.distributed as dist

    import graphrunner as gr

    gen = torch.Generator().manual_seed(0)
    w1, w2 = torch.randn(D, H, generator=gen) / 4, torch.randn(H, D, generator=gen) / 4
    shard = slice(rank * H // world, (rank + 1) * H // world)
    w1s, w2s = w1[:, shard].contiguous(), w2[shard].contiguous()

    @gr.no_graph
    def act(h):
        return torch.relu(h)

    def step(x):
        part = act(x @ w1s) @ w2s
        dist.all_reduce(part)
        return part

    runner = gr.GraphRunner(
        step,
        {"x": gr.BatchInput(trailing=(D,))},
        buckets=BUCKETS,
        backend=backend,
        device="tape",
        group=gr.TorchDistGroup(timeout=30),
        progress=False,
    )
    runner.capture()
    mismatches, max_diff, rss = 0, 0.0, []
    sample_every = max(1, steps // 20)
    t0 = time.perf_counter()
    for i in range(steps):
        x = _batch(i, rank)
        out = runner(x=x)
        ref = _reference(i, rank, world, x.shape[0], w1, w2)
        diff = (out - ref).abs().max().item()
        max_diff = max(max_diff, diff)
        if not torch.allclose(out, ref, atol=1e-4, rtol=1e-4):
            mismatches += 1
        if i % sample_every == 0 or i == steps - 1:
            rss.append((i, _rss_mib()))
    seconds = time.perf_counter() - t0
    stats = runner.stats
    runner.cleanup()
    return {
        "rank": rank,
        "steps": steps,
        "mismatches": mismatches,
        "max_abs_diff": max_diff,
        "replays": sum(stats.replays.values()),
        "fallbacks": stats.fallbacks,
        "seconds": seconds,
        "rss_mib": rss,
    }


def main(argv=None):
    """Run the soak (see the module docstring) and return the JSON dict."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, default=3)
    ap.add_argument("--steps", type=int, default=10_000)
    ap.add_argument("--backend", default="breakable", choices=["full", "breakable", "eager"])
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank process (default 1)")
    ap.add_argument("--out", default=os.path.join("bench", "results", "soak.json"))
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    # the ranks: torch's elastic launcher, one hour for the whole run; the first failed rank ends it
    outcomes = launch_ranks(_rank_main, args.ranks, args=(args.steps, args.backend), timeout=3600, threads=args.threads)
    ranks = [o.value for o in outcomes if o.ok]
    ok = len(ranks) == args.ranks
    for r in ranks:
        first = r["rss_mib"][1][1] if len(r["rss_mib"]) > 1 else r["rss_mib"][0][1]
        last = r["rss_mib"][-1][1]
        r["rss_growth_mib"] = last - first
        print(
            f"rank {r['rank']}: {r['steps']} steps in {r['seconds']:.1f}s, {r['mismatches']} mismatches "
            f"(max |diff| {r['max_abs_diff']:.2g}), {r['replays']} replays, {r['fallbacks']} fallbacks, "
            f"RSS {first:.1f} -> {last:.1f} MiB ({r['rss_growth_mib']:+.1f})"
        )
        ok = ok and r["mismatches"] == 0
    for o in outcomes:
        if not o.ok:
            print(f"soak: rank {o.rank} failed: {o.error}")
    result = {
        "benchmark": "soak",
        "environment": environment(),
        "ranks": args.ranks,
        "steps": args.steps,
        "backend": args.backend,
        "threads_per_rank": args.threads,
        "wall_seconds": time.perf_counter() - t0,
        "per_rank": ranks,
        "ok": ok,
    }
    write_json(args.out, result, announce=True)
    print("soak: OK" if ok else "soak: FAILED")
    return result


if __name__ == "__main__":
    sys.exit(0 if main()["ok"] else 1)
