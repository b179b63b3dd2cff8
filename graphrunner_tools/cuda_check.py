"""The Python checks of ``scripts/cuda-check.sh`` (one GPU; or ``--dry-run``: the CUDA stand-in).

``python -m graphrunner_tools.cuda_check CHECK --out DIR`` runs one check, writes
``DIR/CHECK.json`` and prints one summary line ``PASS|FAIL CHECK: ...``; the exit status is 0
on PASS. Checks:

``perf``
    full and breakable graph vs eager, per call, at batch 1/8/32 on the demo decoder
    (``masked`` attention for full, the ``varlen`` eager break for breakable): device time
    per call from CUDA events, host time per call (issuing the calls, before the
    synchronize), and whether graph and eager outputs are bit-exact (within 1e-4 otherwise).
``memory``
    reserved memory (``torch.cuda.memory_reserved``) after the capture of each bucket, after
    ``cleanup()``, and after ``empty_cache()``; ``info(key)["graph_pool_bytes"]`` per bucket.
``defects``
    the scenarios of issue 23, each in its own process (one of them leaves CUDA's allocator
    mid-capture, which would poison this process): a breakable step that starts with a
    break, ``debug_eager``, ``BreakableGraph.reset()`` then re-capture, a retry after a
    failed capture, a host sync inside a capture (a ``CaptureError`` that says restart), a
    gloo collective inside a capture (a ``CaptureError``, not ``RankTimeoutError``), an
    empty full graph (an error), and one GPU per rank.
``hf``
    ``gr.hf.DecodeRunner`` on 4 architectures (tiny random models; bart with its own generation_config,
    greedy and sampled; llama with a repetition penalty and an n-gram ban too) vs ``model.generate``;
    skipped (PASS, ``skipped``) without transformers.

Under ``$GRAPHRUNNER_CUDA_STANDIN=1`` (``--dry-run`` of the script) the stand-in of
:mod:`graphrunner.testing.cuda_standin` is installed first: timings are then the CPU's.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch

BATCHES = (1, 8, 32)
SCENARIOS = (
    "break_first",
    "debug_eager",
    "reset_recapture",
    "retry_after_failure",
    "sync_in_capture",
    "gloo_collective_in_capture",
    "empty_full_graph",
    "gpu_per_rank",
)


def _device():
    from graphrunner.devices import CudaDevice
    from graphrunner.testing.cuda_standin import install_from_env

    install_from_env()
    if not torch.cuda.is_available():
        raise SystemExit("cuda_check: torch.cuda.is_available() is False (use the script's --dry-run)")
    return CudaDevice()


def _decoder(dev, attention: str, max_batch: int):
    from graphrunner_tools.models import LlamaConfig, build_model

    config = LlamaConfig.tiny(num_layers=2, attention=attention, max_seq_len=64, max_batch_size=max_batch)
    return build_model(config, seed=0, device=dev.torch_device), config


def _inputs(dev, config, b: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, config.vocab_size, (b,), generator=g).to(dev.torch_device)
    pos = torch.randint(0, config.max_seq_len // 2, (b,), generator=g).to(dev.torch_device)
    return ids, pos


def _timed(fn: Callable[[], Any], n: int) -> tuple[float, float]:
    """(device ms per call from CUDA events, host ms per call issuing them)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    host = (time.perf_counter() - t0) * 1000.0 / n
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / n, host


def check_perf(out: str) -> tuple[bool, str, dict[str, Any]]:
    from graphrunner.backends import BreakableGraphBackend, FullGraphBackend

    dev = _device()
    rows, ok = [], True
    n = int(os.environ.get("CUDA_CHECK_CALLS", "50"))
    for backend_cls, attention in ((FullGraphBackend, "masked"), (BreakableGraphBackend, "varlen")):
        model, config = _decoder(dev, attention, max(BATCHES))
        backend = backend_cls(device=dev)
        statics = {b: _inputs(dev, config, b, b) for b in BATCHES}
        with torch.inference_mode():
            with backend.capture_session():
                for b in sorted(BATCHES, reverse=True):
                    ids, pos = statics[b]
                    backend.capture_one(b, lambda ids=ids, pos=pos: model.decode_step(ids, pos), (ids, pos))  # noqa: B023 - called in this iteration, before the variable moves on
            for b in BATCHES:
                ids, pos = statics[b]
                fresh = _inputs(dev, config, b, 100 + b)
                ids.copy_(fresh[0])
                pos.copy_(fresh[1])
                eager = model.decode_step(ids, pos).clone()
                graph = backend.replay(b).clone()
                torch.cuda.synchronize()
                exact = bool(torch.equal(graph, eager))
                close = exact or bool(torch.allclose(graph, eager, atol=1e-4, rtol=1e-4))
                ok &= close
                eager_dev, eager_host = _timed(lambda: model.decode_step(ids, pos), n)  # noqa: B023 - called in this iteration, before the variable moves on
                graph_dev, graph_host = _timed(lambda: backend.replay(b), n)  # noqa: B023 - called in this iteration, before the variable moves on
                rows.append(
                    {
                        "backend": backend.name,
                        "batch": b,
                        "bit_exact": exact,
                        "allclose": close,
                        "max_abs_diff": float((graph - eager).abs().max()),
                        "eager_device_ms": eager_dev,
                        "graph_device_ms": graph_dev,
                        "eager_host_ms": eager_host,
                        "graph_host_ms": graph_host,
                        "speedup_device": eager_dev / graph_dev if graph_dev > 0 else None,
                        "speedup_host": eager_host / graph_host if graph_host > 0 else None,
                        "segments": backend.info(b)["num_segments"],
                    }
                )
        backend.cleanup()
    line = "; ".join(
        f"{r['backend']}@{r['batch']}: {r['speedup_device'] or 0:.2f}x dev "
        f"{r['speedup_host'] or 0:.2f}x host {'exact' if r['bit_exact'] else 'close' if r['allclose'] else 'DIFF'}"
        for r in rows
    )
    return ok, line, {"calls": n, "rows": rows}


def check_memory(out: str) -> tuple[bool, str, dict[str, Any]]:
    from graphrunner.backends import FullGraphBackend

    dev = _device()
    model, config = _decoder(dev, "masked", max(BATCHES))
    backend = FullGraphBackend(device=dev)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_reserved(dev.cuda_device)
    per_bucket = []
    with torch.inference_mode(), backend.capture_session():
        for b in sorted(BATCHES, reverse=True):
            ids, pos = _inputs(dev, config, b, b)
            backend.capture_one(b, lambda ids=ids, pos=pos: model.decode_step(ids, pos), (ids, pos))
            per_bucket.append(
                {
                    "batch": b,
                    "reserved_bytes": torch.cuda.memory_reserved(dev.cuda_device),
                    "graph_pool_bytes": backend.info(b).get("graph_pool_bytes"),
                }
            )
    backend.cleanup()
    after_cleanup = torch.cuda.memory_reserved(dev.cuda_device)
    torch.cuda.empty_cache()
    after_empty = torch.cuda.memory_reserved(dev.cuda_device)
    free, total = torch.cuda.mem_get_info(dev.cuda_device)
    ok = after_empty <= max(r["reserved_bytes"] for r in per_bucket)
    data = {
        "baseline_reserved": base,
        "per_bucket": per_bucket,
        "after_cleanup": after_cleanup,
        "after_empty_cache": after_empty,
        "free": free,
        "total": total,
    }
    line = (
        f"reserved {base} -> "
        + ", ".join(f"b{r['batch']}={r['reserved_bytes']}" for r in per_bucket)
        + f" -> cleanup {after_cleanup} -> empty_cache {after_empty} bytes"
    )
    return ok, line, data


# ----------------------------------------------------------------------------- defect scenarios


def _scenario(name: str) -> str:
    """Run one scenario in this process; return what happened (raise on a failed expectation)."""
    from graphrunner.backends import BreakableGraphBackend, FullGraphBackend
    from graphrunner.breakable import BreakableGraph, breakable_graph, no_graph
    from graphrunner.errors import CaptureError, RankTimeoutError

    dev = _device()
    w = torch.randn(16, 16, generator=torch.Generator().manual_seed(0)).to(dev.torch_device)

    def dense(x):
        return torch.tanh(x @ w) * 2 + 1

    @no_graph
    def host_norm(x):
        return x / (float(x.abs().max()) + 1.0)

    def static(seed):
        return torch.randn(4, 16, generator=torch.Generator().manual_seed(seed)).to(dev.torch_device)

    def capture(backend, step, x, key=4):
        with backend.capture_session():
            backend.capture_one(key, lambda: step(x), capture_inputs=x)

    def replays_right(backend, step, x, key=4):
        fresh = static(9)
        x.copy_(fresh)
        got, want = backend.replay(key), step(fresh)
        torch.cuda.synchronize()
        if not torch.equal(got, want):
            raise AssertionError(f"replay differs from eager by {float((got - want).abs().max())}")

    x = static(1)
    if name == "break_first":
        step = lambda t: dense(host_norm(t)) + 3  # noqa: E731
        b = BreakableGraphBackend(device=dev)
        capture(b, step, x)
        replays_right(b, step, x)
        return "captured and replayed bit-exact"
    if name == "debug_eager":
        b = BreakableGraphBackend(device=dev, debug_eager=True)
        capture(b, dense, x)
        replays_right(b, dense, x)
        return "captured and replayed bit-exact"
    if name == "reset_recapture":
        g = BreakableGraph(device=dev)
        step = lambda t: dense(host_norm(dense(t)))  # noqa: E731
        with breakable_graph(g, stream=dev.capture_stream()):
            step(x)
        g.reset()
        with breakable_graph(g, stream=dev.capture_stream()):
            out = step(x)
        fresh = static(9)
        x.copy_(fresh)
        g.replay()
        if not torch.equal(out, step(fresh)):
            raise AssertionError("replay after re-capture differs from eager")
        return "re-captured and replayed bit-exact"
    if name == "retry_after_failure":
        calls = []

        def flaky(t):
            calls.append(1)
            if len(calls) == 3:
                raise ValueError("flaky step")
            return dense(t)

        b = FullGraphBackend(device=dev)
        try:
            capture(b, flaky, x)
        except CaptureError:
            pass
        else:
            raise AssertionError("the planted failure did not fail the capture")
        capture(b, flaky, x)
        replays_right(b, dense, x)
        return "failed once, retried, replayed bit-exact"
    if name == "sync_in_capture":

        def syncing(t):
            y = dense(t)
            torch.cuda.synchronize()
            return y

        try:
            capture(FullGraphBackend(device=dev), syncing, x)
        except CaptureError as exc:
            if "Restart the process" not in str(exc):
                raise AssertionError(f"the error does not say restart: {exc}") from exc
            try:
                capture(FullGraphBackend(device=dev), dense, x, key=2)
            except CaptureError as again:
                if "Restart the process" in str(again):
                    return "CaptureError says restart; the next capture is refused"
                raise
            raise AssertionError("a capture after the stranded one was not refused") from exc
        raise AssertionError("a synchronize inside the capture did not fail it")
    if name == "gloo_collective_in_capture":
        import tempfile

        import torch.distributed as dist

        import graphrunner as gr

        class TwoRanks(gr.LocalGroup):
            size = 2

        d = tempfile.mkdtemp()
        dist.init_process_group("gloo", init_method=f"file://{d}/store", rank=0, world_size=1)

        def reducing(t):
            y = dense(t)
            dist.all_reduce(y)
            return y

        try:
            capture(FullGraphBackend(device=dev, group=TwoRanks()), reducing, x)
        except RankTimeoutError as exc:
            raise AssertionError(f"misclassified as RankTimeoutError: {exc}") from exc
        except CaptureError as exc:
            if "only NCCL collectives can be captured" not in str(exc):
                raise AssertionError(f"unclear error: {exc}") from exc
            return "CaptureError naming NCCL, not RankTimeoutError"
        return "the gloo collective was captured (this torch/gloo allows it): no error"
    if name == "empty_full_graph":
        try:
            capture(FullGraphBackend(device=dev, drift_check=False), lambda t: (), x)
        except CaptureError as exc:
            if "captured no work" in str(exc):
                return "CaptureError: captured no work"
            raise
        raise AssertionError("an empty full graph was accepted")
    if name == "gpu_per_rank":
        from graphrunner_tools.launch import bind_gpu

        n = torch.cuda.device_count()
        got = [bind_gpu(r) for r in range(max(2, n))]
        want = [r % n for r in range(max(2, n))]
        if got != want or torch.cuda.current_device() != want[-1]:
            raise AssertionError(f"ranks bound {got}, expected {want}")
        return f"ranks bound GPUs {got} of {n}"
    raise ValueError(f"unknown scenario {name!r}; one of {SCENARIOS}")


def check_defects(out: str) -> tuple[bool, str, dict[str, Any]]:
    results, ok = {}, True
    for name in SCENARIOS:
        t0 = time.perf_counter()
        p = subprocess.run(
            [sys.executable, "-m", "graphrunner_tools.cuda_check", "scenario", name],
            capture_output=True,
            text=True,
            timeout=180,
        )
        passed = p.returncode == 0
        ok &= passed
        results[name] = {
            "ok": passed,
            "seconds": round(time.perf_counter() - t0, 2),
            "result": p.stdout.strip().splitlines()[-1] if p.stdout.strip() else "",
            "stderr_tail": p.stderr.strip()[-2000:] if not passed else "",
        }
    line = ", ".join(f"{k}={'ok' if v['ok'] else 'FAIL'}" for k, v in results.items())
    return ok, line, results


def check_hf(out: str) -> tuple[bool, str, dict[str, Any]]:
    try:
        import transformers  # noqa: F401
    except ImportError:
        return True, "skipped: transformers is not installed", {"skipped": True}
    import graphrunner as gr
    from graphrunner_tools.models.hf_tiny import build_tiny

    dev = _device()
    results, ok = {}, True
    # architecture -> {name: generate arguments}: one runner each; bart with its own generation_config (forced
    # EOS), greedy and sampled (the global CUDA generator on both sides); llama with a repetition penalty and an
    # n-gram ban too
    cases = {
        "llama": {"llama": {}, "llama+processors": {"repetition_penalty": 1.3, "no_repeat_ngram_size": 2}},
        "qwen2": {"qwen2": {}},
        "mistral": {"mistral": {}},
        "bart": {"bart": {}, "bart+sampling": {"do_sample": True}},
    }
    for arch, variants in cases.items():
        try:
            model = build_tiny(arch, seed=0).to(dev.torch_device)
            ids = torch.randint(3, 128, (3, 5), generator=torch.Generator().manual_seed(1)).to(dev.torch_device)
            runner = gr.hf.DecodeRunner(
                model, max_batch=4, max_cache_len=16, buckets=[1, 2, 4], device=dev, progress=False
            )
            runner.capture()
        except Exception as exc:  # noqa: BLE001 - reported per architecture
            for name in variants:
                results[name] = {
                    "ok": False,
                    "error": f"{type(exc).__name__}: {str(exc)[:500]}",
                    "traceback": traceback.format_exc()[-3000:],
                }
            ok = False
            continue
        for name, kwargs in variants.items():
            try:
                kw = {"max_new_tokens": 5, "do_sample": False, **kwargs}
                torch.manual_seed(7)
                with torch.inference_mode():
                    ref = model.generate(ids, attention_mask=torch.ones_like(ids), cache_implementation="static", **kw)
                torch.manual_seed(7)
                got = runner.generate(ids, **kw)
                same = bool(torch.equal(torch.as_tensor(got).to(ref.device), ref))
                results[name] = {"ok": same}
                ok &= same
            except Exception as exc:  # noqa: BLE001 - reported per case
                results[name] = {
                    "ok": False,
                    "error": f"{type(exc).__name__}: {str(exc)[:500]}",
                    "traceback": traceback.format_exc()[-3000:],
                }
                ok = False
    return ok, ", ".join(f"{a}={'ok' if r['ok'] else 'FAIL'}" for a, r in results.items()), results


CHECKS = {"perf": check_perf, "memory": check_memory, "defects": check_defects, "hf": check_hf}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m graphrunner_tools.cuda_check", description=__doc__.split("\n")[0])
    p.add_argument("check", choices=sorted(CHECKS) + ["scenario"])
    p.add_argument("name", nargs="?", help="the scenario (with 'scenario')")
    p.add_argument("--out", default=os.environ.get("OUT", "."), help="folder for CHECK.json (default $OUT or .)")
    args = p.parse_args(argv)
    if args.check == "scenario":
        print(_scenario(args.name))
        return 0
    os.makedirs(args.out, exist_ok=True)
    t0 = time.perf_counter()
    try:
        ok, line, data = CHECKS[args.check](args.out)
    except Exception as exc:  # noqa: BLE001 - one summary line, the traceback in the JSON
        ok, line, data = False, f"{type(exc).__name__}: {str(exc)[:300]}", {"traceback": traceback.format_exc()}
    from graphrunner.testing.cuda_standin import installed_standin

    data = {
        "check": args.check,
        "ok": ok,
        "summary": line,
        "seconds": round(time.perf_counter() - t0, 2),
        "standin": installed_standin() is not None,
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "data": data,
    }
    with open(os.path.join(args.out, f"{args.check}.json"), "w") as f:
        json.dump(data, f, indent=1, default=str)
    print(f"{'PASS' if ok else 'FAIL'} {args.check}: {line}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
