"""Capture-time cost of the padding check (issue 21): capture with it on and off, side by side.

For each workload, ``GraphRunner.capture()`` runs with the padding check on
(the default ``checks=``) and off (``checks=("drift", "fingerprint")``) in
interleaved rounds in one process (a fresh runner and an emptied cache per
round, same seed), and the median wall time of the whole capture (all
buckets: warmups + the check + graph capture) is compared. Per checked key it
also reports what the check itself says it cost: the capture report's bucket
``info`` ``leak_check_seconds`` and ``leak_check_forwards`` (medians over the
rounds), and their sum as a share of the capture.

Workloads (both declare ``bounds=`` on their integer inputs, as the demo and
``gr.hf.DecodeRunner`` do, so the check draws real token ids and positions):

- ``demo``: the demo decoder's decode step (``graphrunner_tools.models``, masked
  attention on the ``full`` backend, varlen on ``breakable``), ``--layers`` layers;
- ``hf_llama``: a tiny random-weight ``transformers.LlamaForCausalLM`` decode step
  over a ``StaticCache`` (``gr.hf.make_static_cache``, ``gr.hf.make_decode_step``,
  ``gr.hf.decode_inputs(vocab, max_cache_len)``), as ``DecodeRunner`` builds it;
  skipped without ``transformers``.

The script also runs against a checkout from before issue 21 (the old leak
check: one extra forward with float padding perturbed, ``GraphRunner(leak_check=)``,
demo model in ``graphrunner.models``): it detects the API
(``"checks" in inspect.signature(GraphRunner).parameters``) and times
``leak_check=True`` against ``leak_check=False`` there, e.g.
``PYTHONPATH=/path/to/old/checkout python bench/padding_check_cost.py --out /tmp/old.json``
(run from a directory where ``graphrunner`` resolves to that checkout).

Prints a table and writes JSON (``--out``, default
``bench/results/padding_check_cost.json``). Not a test: it never fails on a timing.

    python bench/padding_check_cost.py [--rounds 7] [--layers 2] [--buckets 1,2,4,8,16] [--backend full] [--threads 1]
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import os
import platform
import statistics
import time
from typing import Any, Callable, Dict, List

import torch

import graphrunner
from graphrunner.runner import BatchInput, GraphRunner

#: True on the API of issue 20 onwards (``checks=``); False on the old one (``leak_check=``).
NEW_API = "checks" in inspect.signature(GraphRunner).parameters

if NEW_API:  # the tools moved out of the library in issue 20
    from graphrunner_tools.bench import environment, write_json
    from graphrunner_tools.models import LlamaConfig, build_model
else:  # an old checkout: its own tools (an installed graphrunner_tools would belong to another checkout)
    from graphrunner.bench import environment, write_json
    from graphrunner.models import LlamaConfig, build_model


def check_kwargs(on: bool) -> Dict[str, Any]:
    """GraphRunner keyword arguments for the padding check on or off (every other check on), either API."""
    if NEW_API:
        return {"checks": None} if on else {"checks": ("drift", "fingerprint")}
    return {"leak_check": bool(on)}


def demo_workload(backend: str, layers: int, buckets: List[int], device: str):
    """``(make, reset, ctx)``: a factory of uncaptured runners over the demo decoder's decode step, the
    cache reset run around each capture, and the context the capture runs in (as ``graphrunner demo``: none)."""
    attention = "masked" if backend == "full" else "varlen"
    config = LlamaConfig.demo(num_layers=layers, attention=attention, max_batch_size=max(64, max(buckets)))
    model = build_model(config, seed=0)
    bounds = NEW_API or "bounds" in inspect.signature(BatchInput).parameters

    def spec(hi: int) -> BatchInput:
        return (BatchInput(trailing=(), dtype=torch.long, pad=0, bounds=(0, hi)) if bounds
                else BatchInput(trailing=(), dtype=torch.long, pad=0))

    def make(on: bool) -> GraphRunner:
        return GraphRunner(lambda input_ids, positions: model.decode_step(input_ids, positions),
                           inputs={"input_ids": spec(config.vocab_size - 1), "positions": spec(config.max_seq_len - 1)},
                           buckets=list(buckets), backend=backend, device=device, progress=False, **check_kwargs(on))

    return make, model.reset_cache, contextlib.nullcontext


def hf_llama_workload(backend: str, buckets: List[int], device: str, max_cache_len: int = 32):
    """``(make, reset, ctx)`` over a tiny HF Llama decode step (DecodeRunner's construction, captured under
    ``torch.inference_mode()``), or None without transformers."""
    try:
        import transformers
    except ImportError:
        return None
    from graphrunner import hf as ghf
    from graphrunner.hf.cache import row_view_cache

    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).float().eval()
    rows = max(buckets)
    with torch.inference_mode():
        cache = ghf.make_static_cache(model, rows, max_cache_len)
        ghf.prefill(model, cache, torch.zeros((rows, 1), dtype=torch.long))  # allocate, as DecodeRunner does
        ghf.zero_cache(cache)
    views: Dict[int, Any] = {}

    def pick(n: int):
        if n not in views:
            views[n] = row_view_cache(cache, n)
        return views[n]

    step = ghf.make_decode_step(model, pick)
    params = inspect.signature(ghf.decode_inputs).parameters
    inputs = ghf.decode_inputs(cfg.vocab_size, max_cache_len) if params else ghf.decode_inputs()

    def make(on: bool) -> GraphRunner:
        return GraphRunner(step, inputs=inputs, buckets=list(buckets), backend=backend, device=device,
                           progress=False, fallback="error", **check_kwargs(on))

    def reset() -> None:
        with torch.inference_mode():
            ghf.zero_cache(cache)

    return make, reset, torch.inference_mode  # DecodeRunner captures under inference mode


def one_capture(make: Callable[[bool], GraphRunner], reset: Callable[[], None], ctx: Callable[[], Any],
                on: bool) -> Dict[str, Any]:
    """Capture a fresh runner (padding check ``on`` or off) inside ``ctx()``; wall seconds and the per-key
    check facts."""
    reset()
    runner = make(on)
    with ctx():
        t0 = time.perf_counter()
        report = runner.capture()
        wall = time.perf_counter() - t0
    keys = {}
    for b in report.buckets:
        if b.info.get("leak_check_sizes") is not None:
            keys[str(b.bucket)] = {"sizes": list(b.info["leak_check_sizes"]),
                                   "seconds": float(b.info.get("leak_check_seconds", 0.0)),
                                   "forwards": b.info.get("leak_check_forwards")}
    runner.cleanup()
    reset()
    return {"wall": wall, "report_total": report.total_seconds, "keys": keys,
            "capture_per_key": {str(b.bucket): b.capture_seconds for b in report.buckets}}


def measure(make, reset, ctx, rounds: int) -> Dict[str, Any]:
    one_capture(make, reset, ctx, True)  # warm the code paths once (imports, allocator, lazy init)
    one_capture(make, reset, ctx, False)
    runs: Dict[str, List[Dict[str, Any]]] = {"on": [], "off": []}
    for rep in range(rounds):
        order = ("off", "on") if rep % 2 == 0 else ("on", "off")
        for variant in order:
            runs[variant].append(one_capture(make, reset, ctx, variant == "on"))
    med = {v: statistics.median(r["wall"] for r in runs[v]) for v in runs}
    keys: Dict[str, Any] = {}
    for k in runs["on"][0]["keys"]:
        secs = [r["keys"][k]["seconds"] for r in runs["on"] if k in r["keys"]]
        keys[k] = {"sizes": runs["on"][0]["keys"][k]["sizes"], "forwards": runs["on"][0]["keys"][k]["forwards"],
                   "seconds_median": statistics.median(secs)}
    check_s = statistics.median(sum(x["seconds"] for x in r["keys"].values()) for r in runs["on"])
    forwards = [x["forwards"] for x in keys.values()]
    return {
        "capture_s": med,
        "capture_s_all_rounds": {v: [r["wall"] for r in runs[v]] for v in runs},
        "difference_s": med["on"] - med["off"],
        # each round's on minus its own off (the two captures run back to back): steadier on a loaded machine
        "difference_s_paired_median": statistics.median(a["wall"] - b["wall"] for a, b in zip(runs["on"], runs["off"])),
        "ratio_on_over_off": med["on"] / med["off"],
        "check_seconds": check_s,  # sum over keys of leak_check_seconds (median over rounds)
        "check_share_of_capture": check_s / med["on"],
        "keys_checked": len(keys),
        "forwards": None if any(f is None for f in forwards) else sum(forwards),
        "per_key": keys,
    }


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="auto")
    ap.add_argument("--backend", default="full", choices=["full", "breakable"])
    ap.add_argument("--layers", type=int, default=2, help="demo decoder layers (default: 2)")
    ap.add_argument("--buckets", default="1,2,4,8,16", help="comma-separated buckets (default: 1,2,4,8,16)")
    ap.add_argument("--rounds", type=int, default=7, help="interleaved rounds per variant (default: 7)")
    ap.add_argument("--workloads", default="demo,hf_llama", help="comma-separated: demo, hf_llama")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default: 1)")
    ap.add_argument("--quick", action="store_true", help="2 rounds")
    ap.add_argument("--out", default=os.path.join("bench", "results", "padding_check_cost.json"))
    args = ap.parse_args(argv)
    if args.quick:
        args.rounds = 2
    buckets = sorted(int(x) for x in args.buckets.split(",") if x.strip())
    wanted = [w.strip() for w in args.workloads.split(",") if w.strip()]
    unknown = set(wanted) - {"demo", "hf_llama"}
    if unknown:
        ap.error(f"unknown workload(s) {sorted(unknown)}: choose from demo, hf_llama")

    torch.set_num_threads(max(1, args.threads))
    workloads = {}
    if "demo" in wanted:
        workloads[f"demo_{args.backend}"] = demo_workload(args.backend, args.layers, buckets, args.device)
    if "hf_llama" in wanted:
        hf = hf_llama_workload(args.backend, buckets, args.device)
        if hf is None:
            print("hf_llama skipped: transformers is not installed")
        else:
            workloads[f"hf_llama_{args.backend}"] = hf
    rows = {name: measure(make, reset, ctx, args.rounds) for name, (make, reset, ctx) in workloads.items()}
    api = "checks= (padding-vs-eager equivalence check)" if NEW_API else "leak_check= (old float-padding leak check)"
    result = {
        "benchmark": "padding_check_cost",
        "graphrunner": graphrunner.__version__,
        "graphrunner_path": os.path.dirname(graphrunner.__file__),
        "api": "checks" if NEW_API else "leak_check",
        "torch": torch.__version__,
        "python": platform.python_version(),
        "buckets": buckets,
        "layers": args.layers,
        "backend": args.backend,
        "rounds": args.rounds,
        "threads": args.threads,
        "device": args.device,
        "workloads": rows,
        "environment": environment() if environment is not None else None,
    }
    print(f"padding check capture cost: graphrunner {graphrunner.__version__} from "
          f"{os.path.dirname(graphrunner.__file__)}, API {api}")
    print(f"buckets {buckets}, backend {args.backend}, {args.rounds} interleaved rounds, medians, "
          f"threads {args.threads}")
    print(f"  {'workload':<16} {'off s':>7} {'on s':>7} {'on-off s':>9} {'paired':>8} {'on/off':>7} {'check s':>8} "
          f"{'share':>6} {'keys':>5} {'fwds':>5}")
    for name, r in rows.items():
        fw = "-" if r["forwards"] is None else str(r["forwards"])
        print(f"  {name:<16} {r['capture_s']['off']:7.3f} {r['capture_s']['on']:7.3f} {r['difference_s']:+9.3f} "
              f"{r['difference_s_paired_median']:+8.3f} "
              f"{r['ratio_on_over_off']:6.2f}x {r['check_seconds']:8.4f} {r['check_share_of_capture'] * 100:5.1f}% "
              f"{r['keys_checked']:>5} {fw:>5}")
        for k, v in r["per_key"].items():
            fwd = "?" if v["forwards"] is None else v["forwards"]
            print(f"      key {k:>4}: real sizes {v['sizes']}, {fwd} extra forwards, "
                  f"{v['seconds_median'] * 1e3:7.2f} ms")
    print("  (on-off: difference of the medians; paired: median of each round's on minus its off; check s: the sum "
          "over keys of the report's leak_check_seconds, its share: of the capture with the check)")
    write_json(args.out, result, announce=True)
    return result


if __name__ == "__main__":
    main()
