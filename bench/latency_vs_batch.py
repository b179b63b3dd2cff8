"""Per-call latency of the demo decoder's decode step against batch size, eager vs graphs.

Methods (each a different way to run ``model.decode_step(input_ids[B], positions[B])`` of
the demo Llama decoder, ``graphrunner_tools.models``, random weights):

- ``eager``:          plain eager PyTorch, default config (``attention="varlen"``, an eager
                      ``@no_graph`` attention core that trims keys to the longest request).
- ``eager_masked``:   plain eager PyTorch, ``attention="masked"`` (attends all cache positions).
- ``tape_full``:      ``GraphRunner(backend="full", device="tape")`` on the masked config: the
                      whole step is one TapeGraph. Compare with ``eager_masked``.
- ``tape_breakable``: ``GraphRunner(backend="breakable", device="tape")`` on the default varlen
                      config: graph segments around the attention breaks. Compare with ``eager``.
- ``cuda_eager``, ``cuda_full``, ``cuda_breakable``: the same on CUDA (real CUDA graphs) when
                      ``torch.cuda.is_available()``.

Runner methods are timed through ``runner(input_ids=..., positions=...)`` (copy into the
static buffers, replay, slice: what a caller pays), at batch sizes equal to the buckets (no
padding). Measurement is interleaved: every round times ``--calls`` calls of every
(method, batch) pair, rotating the method order between rounds; the reported latency is the
median over rounds. Before timing, each graph method's output is compared with its eager
reference (``max_abs_diff``). Prints a table and the speedups, writes JSON (``--out``).
Not a test: it never fails on a timing.

    python bench/latency_vs_batch.py [--quick] [--batches 1,2,4,8,16,32] [--rounds 7] [--calls 20]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

import torch

from graphrunner_tools.bench import decode_runner, environment, parse_int_list, sync_device, write_json
from graphrunner_tools.models import LlamaConfig, build_model

# method -> (device kind, attention config, backend or None for eager, eager reference method)
METHODS: dict[str, tuple] = {
    "eager": ("cpu", "varlen", None, None),
    "eager_masked": ("cpu", "masked", None, None),
    "tape_full": ("cpu", "masked", "full", "eager_masked"),
    "tape_breakable": ("cpu", "varlen", "breakable", "eager"),
    "cuda_eager": ("cuda", "varlen", None, None),
    "cuda_eager_masked": ("cuda", "masked", None, None),
    "cuda_full": ("cuda", "masked", "full", "cuda_eager_masked"),
    "cuda_breakable": ("cuda", "varlen", "breakable", "cuda_eager"),
}

DESCRIPTIONS = {
    "eager": "eager PyTorch, varlen attention (default config)",
    "eager_masked": "eager PyTorch, masked attention",
    "tape_full": "GraphRunner full backend on the tape device, masked attention (one graph per bucket)",
    "tape_breakable": "GraphRunner breakable backend on the tape device, varlen attention (@no_graph breaks)",
    "cuda_eager": "eager PyTorch on CUDA, varlen attention",
    "cuda_eager_masked": "eager PyTorch on CUDA, masked attention",
    "cuda_full": "GraphRunner full backend, CUDA graphs, masked attention",
    "cuda_breakable": "GraphRunner breakable backend, CUDA graph segments, varlen attention",
}


def main(argv: list[str] | None = None) -> dict:
    """Run the benchmark; return (and write to ``--out``) the result dict.

    Keys: ``benchmark``, ``environment``, ``config`` (model config + settings), ``batches``,
    ``methods`` (``{name: {description, device, attention, backend, reference,
    latency_us: [median per batch], latency_us_rounds: [[per round] per batch],
    max_abs_diff: [per batch] or None, capture_seconds}}``), ``speedup`` (``{graph
    method: [reference latency / method latency per batch]}``), ``notes``.
    """
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.path.join("bench", "results", "latency_vs_batch.json"))
    ap.add_argument("--quick", action="store_true", help="smoke run: batches 1,2,4, 2 rounds, 3 calls")
    ap.add_argument("--batches", type=parse_int_list, default=None, help="batch sizes (default 1,2,4,8,16,32)")
    ap.add_argument("--rounds", type=int, default=None, help="interleaved rounds (default 7)")
    ap.add_argument("--calls", type=int, default=None, help="calls per (method, batch) per round (default 20)")
    ap.add_argument(
        "--methods", default=None, help=f"comma-separated subset of {','.join(METHODS)} (default: all available)"
    )
    ap.add_argument(
        "--position", type=int, default=128, help="cache position of every row's new token (varlen attends 0..position)"
    )
    ap.add_argument("--warmups", type=int, default=2, help="GraphRunner warmups per bucket")
    ap.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (0: leave as is)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    batches = args.batches or ([1, 2, 4] if args.quick else [1, 2, 4, 8, 16, 32])
    rounds = args.rounds or (2 if args.quick else 7)
    calls = args.calls or (3 if args.quick else 20)
    if args.threads:
        torch.set_num_threads(args.threads)
    cuda = torch.cuda.is_available()
    notes: list[str] = []
    if args.methods:
        wanted = [m.strip() for m in args.methods.split(",") if m.strip()]
        unknown = [m for m in wanted if m not in METHODS]
        if unknown:
            raise SystemExit(f"--methods: unknown {unknown}; known {list(METHODS)}")
    else:
        wanted = list(METHODS)
    if not cuda:
        dropped = [m for m in wanted if METHODS[m][0] == "cuda"]
        wanted = [m for m in wanted if METHODS[m][0] != "cuda"]
        if dropped:
            notes.append("CUDA not available: cuda methods skipped")
    # A graph method needs its eager reference for the speedup and the correctness check.
    for m in list(wanted):
        ref = METHODS[m][3]
        if ref is not None and ref not in wanted:
            wanted.append(ref)
    wanted = [m for m in METHODS if m in wanted]

    base = LlamaConfig(max_batch_size=max(64, max(batches)))
    if args.position >= base.max_seq_len or args.position < 0:
        raise SystemExit(f"--position must be in [0, {base.max_seq_len}), got {args.position}")

    models: dict[tuple, Any] = {}

    def model_for(dev: str, attention: str) -> Any:
        key = (dev, attention)
        if key not in models:
            models[key] = build_model(base.replace(attention=attention), seed=args.seed, device=dev)
        return models[key]

    gen = torch.Generator().manual_seed(args.seed)
    ids_cpu = {b: torch.randint(0, base.vocab_size, (b,), generator=gen) for b in batches}
    pos_cpu = {b: torch.full((b,), args.position, dtype=torch.long) for b in batches}

    fns: dict[str, Callable[[int], Any]] = {}
    capture_s: dict[str, float | None] = {}
    for m in wanted:
        dev, attention, backend, _ = METHODS[m]
        model = model_for(dev, attention)
        ids = {b: t.to(dev) for b, t in ids_cpu.items()}
        pos = {b: t.to(dev) for b, t in pos_cpu.items()}
        if backend is None:

            def fn(b, model=model, ids=ids, pos=pos):
                with torch.inference_mode():
                    return model.decode_step(ids[b], pos[b])

            capture_s[m] = None
        else:
            runner = decode_runner(model, backend, "cuda" if dev == "cuda" else "tape", batches, args.warmups)
            t0 = time.perf_counter()
            runner.capture()
            sync_device(dev)
            capture_s[m] = time.perf_counter() - t0

            def fn(b, runner=runner, ids=ids, pos=pos):
                return runner(input_ids=ids[b], positions=pos[b])

        fns[m] = fn

    # Correctness first: each graph method against its eager reference, same inputs.
    diffs: dict[str, list[float] | None] = {}
    for m in wanted:
        ref = METHODS[m][3]
        if ref is None:
            diffs[m] = None
            continue
        row = []
        for b in batches:
            got = fns[m](b).float().cpu().clone()
            want = fns[ref](b).float().cpu()
            row.append(float((got - want).abs().max()))
        diffs[m] = row
        if max(row) > 1e-3:
            notes.append(f"{m}: max |graph - eager| = {max(row):.3g} (expected ~0)")

    # Warm every (method, batch) once, then interleaved rounds.
    for m in wanted:
        for b in batches:
            fns[m](b)
        sync_device(METHODS[m][0])
    per_round: dict[str, dict[int, list[float]]] = {m: {b: [] for b in batches} for m in wanted}
    for r in range(rounds):
        k = r % len(wanted)
        order = wanted[k:] + wanted[:k]
        if r % 2:
            order.reverse()
        for m in order:
            dev = METHODS[m][0]
            fn = fns[m]
            for b in batches:
                sync_device(dev)
                t0 = time.perf_counter()
                for _ in range(calls):
                    fn(b)
                sync_device(dev)
                per_round[m][b].append((time.perf_counter() - t0) / calls * 1e6)

    methods: dict[str, Any] = {}
    for m in wanted:
        dev, attention, backend, ref = METHODS[m]
        methods[m] = {
            "description": DESCRIPTIONS[m],
            "device": dev,
            "attention": attention,
            "backend": backend or "none (eager)",
            "reference": ref,
            "latency_us": [statistics.median(per_round[m][b]) for b in batches],
            "latency_us_rounds": [per_round[m][b] for b in batches],
            "max_abs_diff": diffs[m],
            "capture_seconds": capture_s[m],
        }
    speedup = {
        m: [methods[METHODS[m][3]]["latency_us"][i] / methods[m]["latency_us"][i] for i in range(len(batches))]
        for m in wanted
        if METHODS[m][3] is not None
    }
    result = {
        "benchmark": "latency_vs_batch",
        "environment": environment(),
        "config": {
            **asdict(base),
            "attention": "per method",
            "position": args.position,
            "rounds": rounds,
            "calls_per_round": calls,
            "warmups": args.warmups,
            "seed": args.seed,
            "quick": args.quick,
        },
        "batches": batches,
        "methods": methods,
        "speedup": speedup,
        "notes": notes,
    }

    print(
        f"latency_vs_batch: demo decoder ({base.num_layers} layers, hidden {base.hidden_size}), "
        f"position {args.position}, median of {rounds} interleaved rounds x {calls} calls, "
        f"{torch.get_num_threads()} threads"
    )
    head = f"{'method':>24} " + " ".join(f"{'b' + str(b):>9}" for b in batches) + "   (us/call)"
    print(head)
    for m in wanted:
        print(f"{m:>24} " + " ".join(f"{v:>9.1f}" for v in methods[m]["latency_us"]))
    for m, sp in speedup.items():
        print(f"{m + ' speedup':>24} " + " ".join(f"{v:>8.2f}x" for v in sp) + f"   vs {METHODS[m][3]}")
    for m in wanted:
        if capture_s[m] is not None:
            print(
                f"  {m}: capture of {len(batches)} buckets {capture_s[m]:.2f}s, max |graph - eager| {max(diffs[m]):.3g}"
            )
    for n in notes:
        print(f"  note: {n}")
    write_json(args.out, result, announce=True)
    return result


if __name__ == "__main__":
    main()
