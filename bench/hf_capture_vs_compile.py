"""Capture time of a Hugging Face decode step vs ``torch.compile`` of the same step.

A tiny ``LlamaForCausalLM`` (random weights, built from a config: nothing is
downloaded) decodes through a ``StaticCache``. One side is
``gr.hf.DecodeRunner(...).capture()`` over ``--buckets`` (wall time: cache
allocation, warmups and graph capture of every bucket). The other is
``torch.compile`` (inductor, ``dynamic=False``, inductor's on-disk caches off)
of the same decode step (:func:`graphrunner.hf.steps.make_decode_step`), timed
as the first call of each of ``--compile-buckets`` (compilation dominates),
each with its own cache of that batch size. Prints both and the ratio;
writes JSON::

    python bench/hf_capture_vs_compile.py --buckets 1,2,4 --compile-buckets 1

``--quick`` captures only and skips the compile side (seconds, not minutes).
Requires transformers (``pip install -e '.[hf]'``); without it the script
records ``skipped``.
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

import torch

from graphrunner_tools.bench import environment, parse_buckets, skipped_without_transformers, write_json


def _model():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=256,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).eval()


def _compile_seconds(model, batches: list[int], cache_len: int) -> dict[str, Any]:
    import torch._inductor.config as inductor_config

    from graphrunner.hf.cache import make_static_cache
    from graphrunner.hf.steps import make_decode_step

    inductor_config.fx_graph_cache = False
    if hasattr(inductor_config, "autotune_local_cache"):
        inductor_config.autotune_local_cache = False
    torch._dynamo.reset()
    per: dict[str, float] = {}
    for b in batches:
        cache = make_static_cache(model, b, cache_len)
        step = torch.compile(make_decode_step(model, cache), dynamic=False)
        ids = torch.zeros((b, 1), dtype=torch.long)
        pos = torch.zeros((b, 1), dtype=torch.long)
        t0 = time.perf_counter()
        with torch.inference_mode():
            step(ids, pos)
        per[str(b)] = time.perf_counter() - t0
    return {"seconds": sum(per.values()), "per_bucket_seconds": per}


def main(argv=None):
    """Run the measurement (see the module docstring) and return the JSON dict."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--buckets", type=parse_buckets, default=[1, 2, 4])
    ap.add_argument("--compile-buckets", default="1", help="comma-separated sizes to torch.compile, or 'none'")
    ap.add_argument("--cache-len", type=int, default=64)
    ap.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (0: leave as is)")
    ap.add_argument("--quick", action="store_true", help="capture only; skip torch.compile")
    ap.add_argument("--out", default=os.path.join("bench", "results", "hf_capture_vs_compile.json"))
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    result: dict[str, Any] = {
        "benchmark": "hf_capture_vs_compile",
        "environment": environment(),
        "buckets": args.buckets,
        "skipped": None,
    }
    if skipped_without_transformers(result, args.out):
        return result
    from graphrunner import hf

    model = _model()
    t0 = time.perf_counter()
    runner = hf.DecodeRunner(
        model,
        max_batch=args.buckets[-1],
        max_cache_len=args.cache_len,
        buckets=args.buckets,
        backend="full",
        device="tape",
    )
    runner.capture()
    capture_s = time.perf_counter() - t0
    runner.cleanup()
    result["capture_seconds"] = capture_s
    print(f"hf_capture_vs_compile: tiny Llama (2 layers, hidden 128), {torch.get_num_threads()} threads")
    print(f"  gr.hf.DecodeRunner capture, buckets {args.buckets}: {capture_s:.3f}s")
    spec = "none" if args.quick else args.compile_buckets
    compile_buckets = [] if spec == "none" else parse_buckets(spec)
    result["compile_buckets"] = compile_buckets
    if compile_buckets:
        comp = _compile_seconds(_model(), compile_buckets, args.cache_len)
        result["compile"] = comp
        result["ratio_compile_over_capture_all_buckets"] = comp["seconds"] / capture_s
        print(
            f"  torch.compile (inductor, cold), buckets {compile_buckets}: {comp['seconds']:.2f}s: "
            f"{comp['seconds'] / capture_s:.1f}x the capture of all {len(args.buckets)} buckets"
        )
    else:
        result["compile"] = None
        print("  torch.compile side skipped (--quick or --compile-buckets none)")
    write_json(args.out, result, announce=True)
    return result


if __name__ == "__main__":
    main()
