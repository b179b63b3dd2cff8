"""``gr.hf.DecodeRunner.generate`` against ``model.generate(..., cache_implementation="static")``, per call.

For each of ``--archs`` (tiny random-weight transformers causal LMs from
``graphrunner_tools.models.hf_tiny``: nothing is downloaded) and each of
``--batches``: greedy decoding of ``--new`` tokens after a ``--prompt``-token
prompt, once through ``model.generate`` with a static cache and once through
a ``DecodeRunner`` captured beforehand (``buckets`` = the batches; capture and
self-test time are reported apart, not in the per-call time; the model is
moved to the runner's device first, and on CUDA ``model.generate`` compiles its
static-cache forward at its first call, the token check's, as transformers
does for a user). Every round
times one call of each (method, batch) pair, the order rotating between
rounds; the figure is the median over ``--rounds`` rounds. Before timing, each
runner's tokens are compared with ``model.generate``'s (``equal``).

The models are tiny (2 layers, hidden 64), so a call is dominated by
per-step host work (Python, dispatch, ``generate``'s bookkeeping), which is
what a replayed graph removes; on a real model and a GPU the ratio depends
on how much of the step is launch overhead. Prints one table, writes JSON
(``--out``). Not a test: it never fails on a timing.

    python bench/hf_generate.py [--quick] [--archs llama,qwen2,gpt2] [--batches 1,8,32] [--new 16]

Requires transformers (``pip install -e '.[hf]'``); without it the script
records ``skipped``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any

import torch

from graphrunner_tools.bench import environment, parse_int_list, skipped_without_transformers, write_json

DEFAULT_ARCHS = ("llama", "qwen2", "gpt2")


def _time(fn) -> float:
    """Wall seconds of ``fn()`` (queued GPU work included)."""
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    sync()
    t0 = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - t0


def measure_arch(arch: str, batches: list[int], prompt: int, new: int, rounds: int, device: str) -> dict[str, Any]:
    """One architecture: capture, the token check, then interleaved rounds; the dict of its JSON entry."""
    import graphrunner as gr
    from graphrunner_tools.models.hf_tiny import build_tiny

    dev = gr.get_device(device)
    model = build_tiny(arch).to(getattr(dev, "torch_device", "cpu"))  # the model where the graphs run
    vocab = int(model.config.vocab_size)
    ids = {
        b: torch.randint(3, vocab, (b, prompt), generator=torch.Generator().manual_seed(b)).to(model.device)
        for b in batches
    }
    runner = gr.hf.DecodeRunner(
        model, max_batch=max(batches), max_cache_len=prompt + new, buckets=batches, device=dev, progress=False
    )
    t0 = time.perf_counter()
    report = runner.capture()
    capture_s = time.perf_counter() - t0
    self_test_s = sum(step["seconds"] for step in report.after_capture)

    def reference(b: int) -> torch.Tensor:
        with torch.inference_mode():
            return model.generate(
                ids[b],
                attention_mask=torch.ones_like(ids[b]),
                max_new_tokens=new,
                min_new_tokens=new,
                do_sample=False,
                cache_implementation="static",
            )

    def ours(b: int) -> torch.Tensor:
        return runner.generate(ids[b], max_new_tokens=new, min_new_tokens=new, do_sample=False)

    equal = {str(b): bool(torch.equal(ours(b), reference(b))) for b in batches}
    times: dict[str, dict[str, list[float]]] = {
        "generate": {str(b): [] for b in batches},
        "runner": {str(b): [] for b in batches},
    }
    pairs = [(m, b) for b in batches for m in ("generate", "runner")]
    for r in range(rounds):
        k = r % len(pairs)
        for method, b in pairs[k:] + pairs[:k]:
            fn = (lambda b=b: reference(b)) if method == "generate" else (lambda b=b: ours(b))
            times[method][str(b)].append(_time(fn) * 1e3)
    med = {m: {b: statistics.median(v) for b, v in per.items()} for m, per in times.items()}
    runner.cleanup()
    return {
        "arch": arch,
        "layers": int(getattr(model.config, "num_hidden_layers", 0) or 0),
        "hidden": int(getattr(model.config, "hidden_size", 0) or 0),
        "vocab": vocab,
        "capture_seconds": capture_s,
        "self_test_seconds": self_test_s,
        "equal": equal,
        "ms_per_call": med,
        "ms_all_rounds": times,
        "speedup": {str(b): med["generate"][str(b)] / med["runner"][str(b)] for b in batches},
    }


def main(argv=None) -> dict[str, Any]:
    """Run the measurement (see the module docstring) and return the JSON dict."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--archs",
        default=",".join(DEFAULT_ARCHS),
        help="comma-separated transformers model_types (default: %(default)s)",
    )
    ap.add_argument("--batches", type=parse_int_list, default=[1, 8, 32])
    ap.add_argument("--prompt", type=int, default=8, help="prompt tokens (default: %(default)s)")
    ap.add_argument("--new", type=int, default=16, help="new tokens per call (default: %(default)s)")
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds (default: %(default)s)")
    ap.add_argument("--device", default="auto", help="the runner's device: auto, tape or cuda (default: auto)")
    ap.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (0: leave as is)")
    ap.add_argument("--quick", action="store_true", help="llama only, batches 1,8, 6 new tokens, 2 rounds")
    ap.add_argument("--out", default=os.path.join("bench", "results", "hf_generate.json"))
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    archs = [a.strip() for a in args.archs.split(",") if a.strip()]
    if args.quick:
        archs, args.batches, args.new, args.rounds = archs[:1], [1, 8], 6, 2
    result: dict[str, Any] = {
        "benchmark": "hf_generate",
        "environment": environment(),
        "archs": archs,
        "batches": args.batches,
        "prompt": args.prompt,
        "new": args.new,
        "rounds": args.rounds,
        "skipped": None,
        "results": [],
    }
    if skipped_without_transformers(result, args.out):
        return result
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # transformers' own notes about tiny random configs
        for arch in archs:
            result["results"].append(measure_arch(arch, args.batches, args.prompt, args.new, args.rounds, args.device))
    bs = args.batches
    print(
        f"hf_generate: gr.hf.DecodeRunner.generate vs model.generate(cache_implementation='static'), greedy, "
        f"prompt {args.prompt} + {args.new} new tokens, tiny random models, median of {args.rounds} interleaved "
        f"rounds, {torch.get_num_threads()} threads"
    )
    print(f"  {'arch':<8} {'':<15}" + "".join(f"{f'b{b}':>9}" for b in bs) + "   (ms/call)")
    for r in result["results"]:
        print(
            f"  {r['arch']:<8} {'model.generate':<15}"
            + "".join(f"{r['ms_per_call']['generate'][str(b)]:>9.1f}" for b in bs)
        )
        print(f"  {'':<8} {'DecodeRunner':<15}" + "".join(f"{r['ms_per_call']['runner'][str(b)]:>9.1f}" for b in bs))
        print(
            f"  {'':<8} {'speedup':<15}"
            + "".join(f"{r['speedup'][str(b)]:>8.2f}x" for b in bs)
            + f"   tokens equal: {'yes' if all(r['equal'].values()) else 'NO ' + str(r['equal'])}; capture "
            f"{r['capture_seconds']:.2f}s (self-test {r['self_test_seconds']:.2f}s)"
        )
    write_json(args.out, result, announce=True)
    return result


if __name__ == "__main__":
    main()
