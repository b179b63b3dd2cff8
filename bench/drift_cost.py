"""Capture-time cost of the drift check (issue 9 item 1): capture with it on and off, side by side.

For each workload, ``GraphRunner.capture()`` runs with the drift check on
(the default ``checks=``) and off (``checks=("padding", "fingerprint")``) in
interleaved rounds in one process (fresh model
state per round, same seed), and the median wall time of the whole capture
(all buckets: warmups + graph capture + the check) is compared. Workloads:
the demo decoder on the ``full`` and ``breakable`` backends and, with
``transformers`` installed, a tiny random-weight ``LlamaForCausalLM``
decode step. The check records the op stream of the last warmup and of the
capture only, so it costs nothing per replay.

Prints a table with the ratio on/off and writes JSON (``--out``, default
``bench/results/drift_cost.json``). Not a test: it never fails on a timing.

    python bench/drift_cost.py [--reps 5] [--layers 4] [--device auto] [--threads 1]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from graphrunner.runner import BatchInput, GraphRunner
from graphrunner_tools.bench import environment, write_json
from graphrunner_tools.models import LlamaConfig, build_model
from graphrunner_tools.threads import torch_threads

BUCKETS = [1, 2, 4, 8]


def demo_workload(backend: str, layers: int, device: str):
    """A factory of uncaptured runners over the demo decoder's decode step."""
    attention = "masked" if backend == "full" else "varlen"
    config = LlamaConfig.demo(num_layers=layers, attention=attention, max_batch_size=max(BUCKETS))

    def make(drift_check: bool) -> GraphRunner:
        model = build_model(config, seed=0)
        return GraphRunner(lambda input_ids, positions: model.decode_step(input_ids, positions),
                           inputs={"input_ids": BatchInput(trailing=(), dtype=torch.long, pad=0),
                                   "positions": BatchInput(trailing=(), dtype=torch.long, pad=0)},
                           buckets=BUCKETS, backend=backend, device=device, progress=False,
                           checks=None if drift_check else ("padding", "fingerprint"))

    return make


def hf_llama_workload(device: str):
    """A factory of uncaptured runners over a tiny HF Llama decode step, or None without transformers."""
    try:
        import transformers
    except ImportError:
        return None
    from graphrunner import hf as ghf
    from graphrunner.hf.cache import row_view_cache

    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval()

    def make(drift_check: bool) -> GraphRunner:
        with torch.inference_mode():
            cache = ghf.make_static_cache(model, max(BUCKETS), 16)
            ghf.prefill(model, cache, torch.zeros((max(BUCKETS), 1), dtype=torch.long))
        views = {}

        def pick(rows):
            if rows not in views:
                views[rows] = row_view_cache(cache, rows)
            return views[rows]

        return GraphRunner(ghf.make_decode_step(model, pick), inputs=ghf.decode_inputs(), buckets=BUCKETS,
                           backend="full", device=device, progress=False,
                           checks=None if drift_check else ("padding", "fingerprint"))

    return make


def time_capture(make, drift_check: bool) -> float:
    runner = make(drift_check)
    t0 = time.perf_counter()
    runner.capture()
    dt = time.perf_counter() - t0
    runner.cleanup()
    return dt


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="auto")
    ap.add_argument("--layers", type=int, default=4, help="demo decoder layers (default: 4)")
    ap.add_argument("--reps", type=int, default=5, help="interleaved rounds per variant (default: 5)")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default: 1)")
    ap.add_argument("--quick", action="store_true", help="2 layers, 2 rounds")
    ap.add_argument("--out", default=os.path.join("bench", "results", "drift_cost.json"))
    args = ap.parse_args(argv)
    if args.quick:
        args.layers, args.reps = 2, 2

    workloads = {f"demo_{b}": demo_workload(b, args.layers, args.device) for b in ("full", "breakable")}
    hf = hf_llama_workload(args.device)
    if hf is not None:
        workloads["hf_llama_full"] = hf
    rows = {}
    with torch_threads(args.threads):
        for name, make in workloads.items():
            time_capture(make, True)  # warm the code paths once (imports, allocator)
            times = {"on": [], "off": []}
            for _ in range(args.reps):
                for variant in ("off", "on"):
                    times[variant].append(time_capture(make, variant == "on"))
            med = {k: statistics.median(v) for k, v in times.items()}
            rows[name] = {
                "capture_s": med,
                "capture_s_all_rounds": times,
                "ratio_on_over_off": med["on"] / med["off"],
                "extra_ms_per_bucket": (med["on"] - med["off"]) * 1e3 / len(BUCKETS),
            }
    result = {
        "buckets": BUCKETS,
        "layers": args.layers,
        "rounds": args.reps,
        "threads": args.threads,
        "device": args.device,
        "workloads": rows,
        "environment": environment(),
    }
    print(f"drift check capture cost (buckets {BUCKETS}, {args.reps} interleaved rounds, medians)")
    print(f"  {'workload':<16} {'off s':>8} {'on s':>8} {'on/off':>7} {'+ms/bucket':>11}")
    for name, r in rows.items():
        print(f"  {name:<16} {r['capture_s']['off']:8.3f} {r['capture_s']['on']:8.3f} "
              f"{r['ratio_on_over_off']:6.2f}x {r['extra_ms_per_bucket']:11.1f}")
    write_json(args.out, result, announce=True)
    return result


if __name__ == "__main__":
    main()
