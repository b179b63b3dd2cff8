"""The replay's fixed cost: a graph against eager, per step and batch (issue 44, item 3).

For each step (a tiny 2-op step ``x * w + y``; a 3-layer MLP, width 512, ReLU;
the demo decoder of ``graphrunner_tools``, 4 layers, masked attention, ``full``
backend) and each batch (1, 8, 32), interleaved in one process:

- ``graph``: ``runner(**inputs)``, the whole call (validation, copy into the
  static buffers, routing, the replay, output views, stats);
- ``eager``: ``step(**inputs)`` under ``torch.inference_mode()``;
- ``replay``: ``runner.backend.replay(bucket)`` alone (the graph, no runner).

The ratio printed is graph time / eager time (below 1: the graph is faster),
beside its target: at batch 1, a step of 10 or more ops (the MLP and the
decoder) is never slower as a graph (``<= 1.00x``); the tiny step has none (it
is faster eagerly: its two element-wise ops cost less than any call path).
``fixed_us`` is the runner's own cost per call: ``graph - replay``. Times are
per-call CPU time of the thread (``time.thread_time``), medians of interleaved
rounds (on a shared machine wall time counts other processes' time); wall
medians are in the JSON too. One torch thread by default. Not a test: it never
fails on a timing.

    python bench/replay_cost.py [--rounds 9] [--calls 200] [--out bench/results/replay_cost.json]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from graphrunner.runner import BatchInput, GraphRunner
from graphrunner_tools.bench import environment, target_note, write_json

BUCKETS = [1, 2, 4, 8, 16, 32]
BATCHES = (1, 8, 32)
#: graph time / eager time at batch 1 for steps of 10 or more ops
TARGET = 1.0


def tiny_step(seed: int):
    w = torch.randn(16, generator=torch.Generator().manual_seed(seed))

    def step(x, y):
        return x * w + y

    inputs = {"x": BatchInput(trailing=(16,)), "y": BatchInput(trailing=(16,))}
    return step, inputs, lambda n, g: {"x": torch.randn(n, 16, generator=g), "y": torch.randn(n, 16, generator=g)}


def mlp_step(seed: int, width: int = 512, layers: int = 3):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(*[m for _ in range(layers) for m in (torch.nn.Linear(width, width), torch.nn.ReLU())])
    model.eval().requires_grad_(False)

    def step(x):
        return model(x)

    return step, {"x": BatchInput(trailing=(width,))}, lambda n, g: {"x": torch.randn(n, width, generator=g)}


def demo_step(seed: int):
    from graphrunner_tools.demo import decode_inputs
    from graphrunner_tools.models.llama import LlamaConfig, build_model

    config = LlamaConfig.demo(num_layers=4, attention="masked", max_batch_size=64)
    model = build_model(config, seed=seed)

    def step(input_ids, positions):
        return model.decode_step(input_ids, positions)

    inputs = decode_inputs(config)

    def make(n, g):
        return {
            "input_ids": torch.randint(0, config.vocab_size, (n,), generator=g),
            "positions": torch.randint(0, config.max_seq_len, (n,), generator=g),
        }

    return step, inputs, make


STEPS: dict[str, Any] = {
    "tiny": ("tiny 2-op step (x * w + y)", tiny_step, False),
    "mlp": ("MLP, 3 layers, width 512, ReLU", mlp_step, True),
    "demo": ("demo decoder (4 layers, hidden 256)", demo_step, True),
}


def _per_call(fn: Callable[[], Any], calls: int) -> tuple:
    w0, c0 = time.perf_counter(), time.thread_time()
    for _ in range(calls):
        fn()
    return (time.thread_time() - c0) / calls * 1e6, (time.perf_counter() - w0) / calls * 1e6


def measure(name: str, args) -> dict[str, Any]:
    label, make_step, targeted = STEPS[name]
    step, inputs, make = make_step(args.seed)
    runner = GraphRunner(step, inputs, BUCKETS, backend="full", device="tape", progress=False)
    runner.capture()
    ops = max(int(getattr(e.graph, "num_ops", 0)) for e in runner.backend._entries.values())
    gen = torch.Generator().manual_seed(args.seed + 1)
    calls = args.calls if name != "demo" else max(10, args.calls // 10)
    rows: dict[str, Any] = {}
    for n in BATCHES:
        batch = make(n, gen)
        with torch.inference_mode():
            assert torch.equal(runner(**batch), step(**batch)), f"{name}: graph and eager disagree at batch {n}"
            variants = {
                "graph": lambda batch=batch: runner(**batch),
                "eager": lambda batch=batch: step(**batch),
                "replay": lambda n=n: runner.backend.replay(n),
            }
            for fn in variants.values():  # warm
                _per_call(fn, max(3, calls // 10))
            cpu: dict[str, list[float]] = {k: [] for k in variants}
            wall: dict[str, list[float]] = {k: [] for k in variants}
            for rep in range(args.rounds):
                for k in list(variants) if rep % 2 == 0 else list(reversed(variants)):
                    c, w = _per_call(variants[k], calls)
                    cpu[k].append(c)
                    wall[k].append(w)
        med = {k: statistics.median(v) for k, v in cpu.items()}
        rows[str(n)] = {
            "graph_us": med["graph"],
            "eager_us": med["eager"],
            "replay_us": med["replay"],
            "fixed_us": med["graph"] - med["replay"],
            "ratio_graph_over_eager": med["graph"] / med["eager"],
            "target": TARGET if (targeted and n == 1) else None,
            "wall_us": {k: statistics.median(v) for k, v in wall.items()},
            "cpu_us_all_rounds": cpu,
        }
    runner.cleanup()
    return {"label": label, "ops": ops, "calls_per_round": calls, "batches": rows}


def main(argv=None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", default="tiny,mlp,demo", help="comma-separated: tiny, mlp, demo")
    ap.add_argument("--calls", type=int, default=200, help="calls per timed round (the decoder: a tenth)")
    ap.add_argument("--rounds", type=int, default=9, help="interleaved rounds per variant")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=os.path.join("bench", "results", "replay_cost.json"))
    args = ap.parse_args(argv)
    torch.set_num_threads(max(1, args.threads))
    names = [s.strip() for s in args.steps.split(",") if s.strip()]
    unknown = [s for s in names if s not in STEPS]
    if unknown:
        ap.error(f"unknown step(s) {unknown}: choose from {list(STEPS)}")
    result: dict[str, Any] = {
        "benchmark": "replay_cost",
        "backend": "full",
        "device": "tape",
        "buckets": BUCKETS,
        "rounds": args.rounds,
        "threads": args.threads,
        "clock": "thread CPU time",
        "environment": environment(),
        "steps": {},
    }
    print(
        f"replay_cost: GraphRunner call vs the step run eagerly (tape, full backend; per-call thread CPU time, "
        f"medians of {args.rounds} interleaved rounds)"
    )
    print(
        f"  {'step':<38} {'ops':>4} {'batch':>5} {'eager us':>9} {'graph us':>9} {'replay us':>9} "
        f"{'fixed us':>8} {'graph/eager':>11}"
    )
    for name in names:
        r = result["steps"][name] = measure(name, args)
        for n, row in r["batches"].items():
            note = target_note(row["ratio_graph_over_eager"], row["target"]) if row["target"] else ""
            print(
                f"  {r['label']:<38} {r['ops']:>4} {n:>5} {row['eager_us']:>9.1f} {row['graph_us']:>9.1f} "
                f"{row['replay_us']:>9.1f} {row['fixed_us']:>8.1f} {row['ratio_graph_over_eager']:>10.3f}x  {note}",
                flush=True,
            )
    write_json(args.out, result, announce=True)
    return result


if __name__ == "__main__":
    main()
