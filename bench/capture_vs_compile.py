"""Capture time of every bucket of the demo decoder vs torch.compile compiling the same step.

Both sides take the same step, ``model.decode_step(input_ids[B], positions[B])`` of the demo
Llama decoder (``graphrunner_tools.models``) with ``LlamaConfig(attention="masked")``: the masked
attention core has no host reads, so the full-graph backend captures each step whole and
dynamo traces it without graph breaks (the default ``"varlen"`` core reads ``max(positions)``
on the host; dynamo would trace through the ``@no_graph`` break and graph-break or
specialize there, which is not like for like). In one process, side by side:

- graphrunner: wall time of ``GraphRunner(step, ..., backend="full", device="tape").capture()``
  (all buckets, largest first, 2 warmups each, progress bar off), once for all ``--buckets``
  and once for exactly the ``--compile-buckets`` sizes. For information also the
  ``breakable`` backend on the default varlen config for all buckets.
- torch.compile: ``torch._dynamo.reset()`` first, then ``compiled = torch.compile(step,
  dynamic=False)`` (inductor, CPU) and the wall time of the FIRST call at each bucket size
  (the compile; dynamic=False recompiles per size). Inductor's on-disk caches are disabled
  (``--compile-cache cold``, default) so a second run does not measure a cache hit; pass
  ``--compile-cache warm`` to leave them on.

Both run under ``torch.inference_mode()``. ``torch._dynamo`` / ``torch._inductor`` are
imported before either side is timed (a first tape capture imports ``torch._dynamo`` too:
PyTorch's dispatch-mode machinery is wrapped in ``torch._disable_dynamo``); the import time
is reported separately. The ratio is ``compile seconds / capture seconds`` on the same bucket
sizes (target >= 50x). Compiling all six buckets takes minutes on a small CPU machine, so the
compile side defaults to buckets 1,2,4,8 (``--compile-buckets all`` for the full list); the
output says which. ``--quick`` skips the compile side unless ``--compile-buckets`` is given.
Writes JSON (``--out``). Not a test: it never fails on a timing.

    python bench/capture_vs_compile.py [--quick] [--buckets 1,2,4,8,16,32] [--compile-buckets 1,2,4,8|all]
"""

from __future__ import annotations

import argparse
import importlib
import os
import time
import warnings
from dataclasses import asdict
from typing import Any

import torch

from graphrunner_tools.bench import decode_runner, environment, parse_buckets, sync_device, target_note, write_json
from graphrunner_tools.models import LlamaConfig, build_model

# Target: capturing every bucket is at least this many times faster than compiling the same sizes.
TARGET_RATIO = 50.0


def _capture(model: Any, backend: str, gr_device: str, dev: str, buckets: list[int], warmups: int) -> dict[str, Any]:
    runner = decode_runner(model, backend, gr_device, buckets, warmups)
    sync_device(dev)
    t0 = time.perf_counter()
    report = runner.capture()
    sync_device(dev)
    wall = time.perf_counter() - t0
    per_bucket = {str(b.bucket): b.capture_seconds for b in report.buckets}
    segments = {str(b.bucket): b.num_segments for b in report.buckets}
    runner.cleanup()
    return {
        "backend": backend,
        "buckets": buckets,
        "wall_seconds": wall,
        "per_bucket_seconds": per_bucket,
        "segments": segments,
    }


def _compile_side(model: Any, dev: str, buckets: list[int], cold: bool, vocab: int, seed: int) -> dict[str, Any]:
    import torch._dynamo
    import torch._inductor.config as inductor_config

    def step(input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return model.decode_step(input_ids, positions)

    dynamo_cfg = torch._dynamo.config
    limit_name = "recompile_limit" if hasattr(dynamo_cfg, "recompile_limit") else "cache_size_limit"
    old_limit = getattr(dynamo_cfg, limit_name)
    old_disable = getattr(inductor_config, "force_disable_caches", None)
    setattr(dynamo_cfg, limit_name, max(old_limit, len(buckets) + 2))
    if cold and old_disable is not None:
        inductor_config.force_disable_caches = True
    per_bucket: dict[str, float] = {}
    diffs: dict[str, float] = {}
    gen = torch.Generator().manual_seed(seed)
    with warnings.catch_warnings():  # inductor warns that the caches are off, once per run
        try:
            warnings.filterwarnings("ignore", message=".*force disabled by torch.compiler.config.force_disable_caches")
            torch._dynamo.reset()
            compiled = torch.compile(step, dynamic=False)
            for b in buckets:
                ids = torch.randint(0, vocab, (b,), generator=gen).to(dev)
                pos = torch.full((b,), 100, dtype=torch.long, device=dev)
                with torch.inference_mode():
                    sync_device(dev)
                    t0 = time.perf_counter()
                    out = compiled(ids, pos)
                    sync_device(dev)
                    per_bucket[str(b)] = time.perf_counter() - t0
                    ref = step(ids, pos)
                    diffs[str(b)] = float((out.float() - ref.float()).abs().max())
                print(
                    f"  torch.compile bucket {b:>3}: {per_bucket[str(b)]:7.2f}s (max |compiled - eager| "
                    f"{diffs[str(b)]:.2g})",
                    flush=True,
                )
        finally:
            torch._dynamo.reset()
            setattr(dynamo_cfg, limit_name, old_limit)
            if old_disable is not None:
                inductor_config.force_disable_caches = old_disable
    return {
        "buckets": buckets,
        "per_bucket_seconds": per_bucket,
        "seconds": sum(per_bucket.values()),
        "max_abs_diff": diffs,
        "backend": "inductor",
        "dynamic": False,
        "cache": "cold (inductor caches disabled)" if cold else "warm (inductor caches enabled)",
    }


def main(argv: list[str] | None = None) -> dict:
    """Run the comparison; return (and write to ``--out``) the result dict.

    Keys: ``benchmark``, ``environment``, ``config``, ``device``, ``import_seconds``,
    ``capture`` (``full_all`` and ``full_same`` and ``breakable_varlen_all``: wall seconds and
    per-bucket seconds), ``compile`` (per-bucket first-call seconds, total, max_abs_diff;
    ``None`` when skipped), ``capture_seconds_all_buckets``, ``capture_seconds_same_buckets``,
    ``compile_seconds``, ``compile_buckets``, ``compile_skipped`` (reason or ``None``),
    ``ratio`` (compile / capture on the same sizes, or ``None``), ``ratio_vs_all_buckets``
    (compile of the subset / capture of all buckets, more sizes on the capture side), ``target_ratio``,
    ``meets_target``, ``notes``.
    """
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.path.join("bench", "results", "capture_vs_compile.json"))
    ap.add_argument(
        "--quick",
        action="store_true",
        help="smoke run: buckets 1,2; compile side skipped unless --compile-buckets is given",
    )
    ap.add_argument("--buckets", type=parse_buckets, default=None, help="graphrunner buckets (default 1,2,4,8,16,32)")
    ap.add_argument(
        "--compile-buckets",
        default=None,
        help="sizes torch.compile compiles: comma-separated, 'all' (= --buckets) or 'none' "
        "(default 1,2,4,8; with --quick: none)",
    )
    ap.add_argument(
        "--compile-cache",
        choices=["cold", "warm"],
        default="cold",
        help="cold: disable inductor's on-disk caches (default); warm: leave them on",
    )
    ap.add_argument(
        "--device",
        choices=["cpu", "cuda"],
        default="cpu",
        help="cpu: tape graphs vs inductor-CPU (default); cuda: CUDA graphs vs inductor-CUDA",
    )
    ap.add_argument("--warmups", type=int, default=2, help="GraphRunner warmups per bucket")
    ap.add_argument("--no-breakable", action="store_true", help="skip the informational breakable capture")
    ap.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (0: leave as is)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    if args.threads:
        torch.set_num_threads(args.threads)
    dev = args.device
    if dev == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: CUDA is not available on this machine")
    gr_device = "cuda" if dev == "cuda" else "tape"
    buckets = args.buckets or ([1, 2] if args.quick else [1, 2, 4, 8, 16, 32])
    notes: list[str] = []
    spec = args.compile_buckets
    if spec is None:
        spec = "none" if args.quick else "1,2,4,8"
    if spec == "none":
        compile_buckets: list[int] = []
    elif spec == "all":
        compile_buckets = list(buckets)
    else:
        compile_buckets = parse_buckets(spec)
    compile_skipped = None
    if not compile_buckets:
        compile_skipped = (
            "--quick: torch.compile takes seconds to a minute per size; pass --compile-buckets"
            if args.quick
            else "--compile-buckets none"
        )
    elif compile_buckets != buckets:
        notes.append(
            f"torch.compile compiled only buckets {compile_buckets} of {buckets} to keep the run bounded; "
            f"the ratio compares the same sizes (a graphrunner capture of exactly {compile_buckets})"
        )

    cfg = LlamaConfig(attention="masked", max_batch_size=max(64, max(buckets + compile_buckets)))

    t0 = time.perf_counter()
    # importlib, not `import torch._dynamo`: that statement would make `torch` a
    # local name of main() and break every use of torch above it.
    importlib.import_module("torch._dynamo")  # imported by both sides; timed apart
    importlib.import_module("torch._inductor.config")
    import_seconds = time.perf_counter() - t0

    print(
        f"capture_vs_compile: demo decoder ({cfg.num_layers} layers, hidden {cfg.hidden_size}, masked attention) "
        f"on {dev}, {torch.get_num_threads()} threads",
        flush=True,
    )
    capture: dict[str, Any] = {}
    model = build_model(cfg, seed=args.seed, device=dev)
    # The capture of the compile sizes runs first, so it (not the all-bucket capture) pays any
    # first-capture-in-this-process cost: the ratio errs against graphrunner, not for it.
    if compile_buckets:
        capture["full_same"] = _capture(model, "full", gr_device, dev, compile_buckets, args.warmups)
        print(
            f"  graphrunner full capture, buckets {compile_buckets}: {capture['full_same']['wall_seconds']:.3f}s",
            flush=True,
        )
    capture["full_all"] = _capture(model, "full", gr_device, dev, buckets, args.warmups)
    print(f"  graphrunner full capture, buckets {buckets}: {capture['full_all']['wall_seconds']:.3f}s", flush=True)
    if not args.no_breakable:
        vmodel = build_model(cfg.replace(attention="varlen"), seed=args.seed, device=dev)
        capture["breakable_varlen_all"] = _capture(vmodel, "breakable", gr_device, dev, buckets, args.warmups)
        print(
            f"  graphrunner breakable capture (varlen config), buckets {buckets}: "
            f"{capture['breakable_varlen_all']['wall_seconds']:.3f}s",
            flush=True,
        )
        del vmodel

    compile_result = None
    if compile_buckets:
        cmodel = build_model(cfg, seed=args.seed, device=dev)
        compile_result = _compile_side(
            cmodel, dev, compile_buckets, args.compile_cache == "cold", cfg.vocab_size, args.seed
        )
        print(
            f"  torch.compile (inductor, dynamic=False, {compile_result['cache']}), buckets {compile_buckets}: "
            f"{compile_result['seconds']:.2f}s",
            flush=True,
        )

    cap_all = capture["full_all"]["wall_seconds"]
    cap_same = capture["full_same"]["wall_seconds"] if "full_same" in capture else None
    comp = compile_result["seconds"] if compile_result else None
    ratio = comp / cap_same if comp is not None and cap_same else None
    ratio_all = comp / cap_all if comp is not None and cap_all else None
    result = {
        "benchmark": "capture_vs_compile",
        "environment": environment(),
        "config": {
            **asdict(cfg),
            "warmups": args.warmups,
            "seed": args.seed,
            "quick": args.quick,
            "compile_cache": args.compile_cache,
        },
        "device": dev,
        "step": "model.decode_step(input_ids[B], positions[B]), LlamaConfig(attention='masked'), inference_mode",
        "import_seconds": import_seconds,
        "capture": capture,
        "compile": compile_result,
        "buckets": buckets,
        "capture_seconds_all_buckets": cap_all,
        "capture_seconds_same_buckets": cap_same,
        "compile_seconds": comp,
        "compile_buckets": compile_buckets,
        "compile_skipped": compile_skipped,
        "ratio": ratio,
        "ratio_vs_all_buckets": ratio_all,
        "target_ratio": TARGET_RATIO,
        "meets_target": (ratio >= TARGET_RATIO) if ratio is not None else None,
        "notes": notes,
    }
    if ratio is not None:
        print(
            f"  ratio: torch.compile {comp:.2f}s / graphrunner capture {cap_same:.3f}s on buckets {compile_buckets} "
            f"= {ratio:.1f}x ({target_note(ratio, TARGET_RATIO, at_most=False)})"
        )
        print(
            f"  compile of {compile_buckets} / capture of all {buckets} (more sizes on the capture side) "
            f"= {ratio_all:.1f}x"
        )
    else:
        print(f"  compile side skipped: {compile_skipped}")
    for n in notes:
        print(f"  note: {n}")
    write_json(args.out, result, announce=True)
    return result


if __name__ == "__main__":
    main()
