"""``graphrunner demo``: capture the demo decoder through GraphRunner and serve decode steps.

The demo builds the Llama-style decoder of :mod:`graphrunner_tools.models` with
random weights, captures its decode step once per bucket (the default full
backend uses the masked, capturable attention; for the breakable backend
attention is an eager break), then serves a stream of decode steps with random
batch sizes, by default from 1 to the largest bucket so every call replays a
graph (``max_batch`` above it shows the eager fallback). Every call is
checked twice:

- bit for bit against eager PyTorch on the same padded batch (what the graph
  computes): any difference is a graph bug;
- against eager on the real, unpadded batch within float32 tolerance (CPU
  GEMMs may round differently for a different number of rows), which shows
  padding rows never leak into real rows.

It prints the capture report, the fallbacks in words, a latency table per bucket
(runner call vs eager on the same batch) with one speed line saying what the
ratio means on this device, and the trace checker's verdict,
writes the trace as JSONL and Chrome trace, and returns non-zero on any
mismatch or protocol violation.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, TextIO

import torch

from graphrunner.backends.protocol import check_capture_order
from graphrunner.devices import get_device
from graphrunner.progress import StatusLine
from graphrunner.runner import BatchInput, GraphRunner
from graphrunner.trace import Trace
from graphrunner_tools.models import LlamaConfig, build_model

#: Tolerance of the unpadded-batch check (float32 GEMM rounding differences only).
UNPADDED_ATOL = 1e-4
UNPADDED_RTOL = 1e-4
#: Interleaved calls per bucket behind each median of the latency table.
LATENCY_REPS = 15


@dataclass
class DemoResult:
    """What one demo run measured; ``ok`` is False on any mismatch or violation.

    ``latency`` maps each bucket (as a string) to its latency table row:
    ``eager_ms``, ``graph_ms`` and ``speedup``, or ``eager_ms`` and
    ``runner_ms`` for the eager backend (no graph).
    """

    steps: int
    graph_mismatches: int
    padding_mismatches: int
    max_abs_diff_padded: float
    max_abs_diff_unpadded: float
    fallbacks: int
    violations: list[str]
    latency: dict[str, dict[str, float]] = field(default_factory=dict)
    trace_files: list[str] = field(default_factory=list)
    #: The batch size of each served step, in order (the latency table's calls are not among them).
    batches: list[int] = field(default_factory=list)
    #: Padding rows computed and real rows served by those steps (``runner.stats`` before the latency table).
    padding_rows: int = 0
    real_rows: int = 0
    threads: int = 0  #: torch intra-op threads the steps ran with
    #: Why the trace files could not be written (``None`` when they were, or none was asked for).
    trace_error: str | None = None

    @property
    def ok(self) -> bool:
        """True when every call matched eager, the capture protocol held and the trace was written."""
        return (
            self.graph_mismatches == 0
            and self.padding_mismatches == 0
            and not self.violations
            and self.trace_error is None
        )


def decode_inputs(config: LlamaConfig) -> dict[str, BatchInput]:
    """The demo decoder's decode-step inputs as a runner declares them: one token id and one position
    per row (long, padded with 0, bounded by the vocabulary and the context length)."""
    return {
        "input_ids": BatchInput(trailing=(), dtype=torch.long, pad=0, bounds=(0, config.vocab_size - 1)),
        "positions": BatchInput(trailing=(), dtype=torch.long, pad=0, bounds=(0, config.max_seq_len - 1)),
    }


def _pad(t: torch.Tensor, rows: int) -> torch.Tensor:
    if t.shape[0] == rows:
        return t
    return torch.cat([t, t.new_zeros(rows - t.shape[0], *t.shape[1:])])


def _ms(samples: list[float]) -> float:
    return statistics.median(samples) * 1e3 if samples else float("nan")


def _legend(backend: str, reps: int) -> str:
    """The one line under the latency table that explains its columns (the capture report has its own)."""
    if backend == "eager":
        return (
            f"columns: eager_ms = the eager step, runner_ms = the whole runner call (no graph); medians of "
            f"{reps} interleaved calls"
        )
    return (
        f"columns: eager_ms = eager step, graph_ms = runner call (copy in, pad, replay, slice), "
        f"speedup = eager_ms / graph_ms; medians of {reps} interleaved calls"
    )


def _fallback_line(
    fallbacks: int, calls: int, reasons: dict[str, int], buckets: list[int], max_batch: int, graphed: bool
) -> str:
    """The fallbacks of the served steps in a new user's words: none, or how many calls ran
    eagerly instead of through their bucket, and why (a batch above the largest bucket, ...)."""
    if fallbacks == 0:
        through = "replayed their bucket's graph" if graphed else "ran through their bucket"
        return f"fallbacks: none: every batch drawn (1..{max_batch}) fits a bucket, so all {calls} calls {through}"
    over = reasons.get("over_max_bucket", 0)
    why = []
    if over:
        why.append(
            f"{over} had a batch above the largest bucket, {buckets[-1]} (batches drawn up to {max_batch}; "
            f"a bucket of {max_batch} would hold them)"
        )
    why += [f"{n} {reason}" for reason, n in sorted(reasons.items()) if reason != "over_max_bucket"]
    head = f"fallbacks: {fallbacks} of {calls} calls ran eagerly, without a graph (correct, not faster): "
    return head + "; ".join(why)


def _speed_lines(latency: dict[str, dict[str, float]], device_kind: str) -> list[str]:
    """What the latency table says, graphs vs eager in one line, then what the ratio means on
    this device (the tape is an emulation: its ratio is no GPU's)."""
    ratios = {int(b): row["speedup"] for b, row in latency.items()}
    lo_b, hi_b = min(ratios, key=ratios.__getitem__), max(ratios, key=ratios.__getitem__)
    lo, hi = ratios[lo_b], ratios[hi_b]
    span = f"{lo:.2f}x (bucket {lo_b}) to {hi:.2f}x (bucket {hi_b})"
    if lo >= 1.0:
        head = f"speed: graphs faster than eager at every bucket: {span}"
    elif hi < 1.0:
        head = f"speed: graphs slower than eager at every bucket: {span}"
    else:
        head = f"speed: graphs {span} (below 1.00x eager is faster)"
    if device_kind == "tape":
        return [
            head,
            "  no GPU here: the graphs are the tape, graphrunner's CPU emulation of CUDA graphs; a replay skips",
            "  each op's Python and dispatch work (most of a small batch's step), not GPU kernel launches, so a",
            "  GPU gives other ratios (docs/speed.md)",
        ]
    return [
        head,
        f"  {device_kind} graphs: a replay launches the captured step at once, not kernel by kernel; the gain is",
        "  largest where launches dominate the step: small batches (docs/speed.md)",
    ]


def _latency_table(
    runner: GraphRunner,
    model,
    dev,
    buckets: list[int],
    config: LlamaConfig,
    gen: torch.Generator,
    out: TextIO,
    graphed: bool = True,
    reps: int = LATENCY_REPS,
) -> dict[str, dict[str, float]]:
    """Time, per bucket, a full-bucket runner call against the eager step on
    the same inputs, interleaved call by call; print and return the medians.

    Columns (and keys of each bucket's dict): ``eager_ms`` and, with a graph,
    ``graph_ms`` and ``speedup``; ``graphed=False`` (the eager backend: no
    graph) gives ``runner_ms`` and no speedup."""
    call_col = "graph_ms" if graphed else "runner_ms"
    latency: dict[str, dict[str, float]] = {}
    print(f"\n{'bucket':>7} {'eager_ms':>9} {call_col:>9}" + (f" {'speedup':>8}" if graphed else ""), file=out)
    for b in buckets:
        ids = torch.randint(0, config.vocab_size, (b,), generator=gen).to(dev.torch_device)
        pos = torch.randint(0, config.max_seq_len, (b,), generator=gen).to(dev.torch_device)
        eager_s: list[float] = []
        call_s: list[float] = []
        for _ in range(reps):
            dev.synchronize()
            t0 = time.perf_counter()
            runner(input_ids=ids, positions=pos)
            dev.synchronize()
            t1 = time.perf_counter()
            with torch.inference_mode():
                model.decode_step(ids, pos)
            dev.synchronize()
            eager_s.append(time.perf_counter() - t1)
            call_s.append(t1 - t0)
        e, c = _ms(eager_s), _ms(call_s)
        latency[str(b)] = {"eager_ms": e, call_col: c}
        line = f"{b:>7} {e:>9.3f} {c:>9.3f}"
        if graphed:
            latency[str(b)]["speedup"] = e / c
            line += f" {e / c:>7.2f}x"
        print(line, file=out)
    return latency


def _write_trace(trace: Trace, prefix: str, files: list[str]) -> str | None:
    """Write ``<prefix>.jsonl`` and ``<prefix>.chrome.json``, appending each written path to
    ``files``; return ``None``, or one line saying why a file could not be written (its folder
    removed or replaced by a file during the run, a full disk, no permission)."""
    path = f"{prefix}.jsonl"
    try:
        parent = os.path.dirname(prefix)
        if parent:
            os.makedirs(parent, exist_ok=True)
        trace.to_jsonl(path)
        files.append(path)
        path = f"{prefix}.chrome.json"
        trace.to_chrome(path)
        files.append(path)
    except OSError as exc:
        folder = os.path.dirname(os.path.abspath(path))
        why = exc.strerror or type(exc).__name__
        if os.path.exists(folder) and not os.path.isdir(folder):
            why = f"{folder!r} is a file now, not a folder"
        return (
            f"cannot write the trace file {path!r} ({why}); the run itself finished: pass another "
            "--trace-out prefix, or '' to write none"
        )
    return None


def run_demo(
    backend: str = "full",
    device: str = "auto",
    steps: int = 200,
    buckets: Sequence[int] = (1, 2, 4, 8, 16, 32),
    max_batch: int | None = None,
    seed: int = 0,
    layers: int = 4,
    trace_out: str | None = "graphrunner-demo-trace",
    progress: bool = True,
    out: TextIO | None = None,
    drift_check: bool = True,
    checks: Any = None,
) -> DemoResult:
    """Run the demo and return its :class:`DemoResult` (see the module docstring).

    ``max_batch`` is the largest batch size drawn (default ``max(buckets)``,
    so every call replays a graph); batches above ``max(buckets)`` take the
    eager fallback. ``trace_out`` is a path prefix:
    ``<prefix>.jsonl`` and ``<prefix>.chrome.json`` are written (``None``
    writes nothing). The steps run with the caller's torch thread count
    (``graphrunner demo --threads N`` sets it; ``threads`` in the result and
    the header line say what was used). ``drift_check`` is passed to
    :class:`GraphRunner` (``False`` only to show what a frozen value does).
    """
    out = sys.stdout if out is None else out  # looked up per call, so redirected stdout is honoured
    if backend not in ("full", "breakable", "eager"):
        raise ValueError(f"backend must be 'full', 'breakable' or 'eager', got {backend!r}")
    max_batch = max(buckets) if max_batch is None else max_batch
    if steps < 1 or max_batch < 1:
        raise ValueError(f"steps and max_batch must be >= 1, got steps={steps}, max_batch={max_batch}")
    dev = get_device(device)
    torch_device = dev.torch_device
    # A full graph cannot hold the varlen attention break (it reads lengths on
    # the host); the masked attention computes the same thing capturably.
    attention = "masked" if backend == "full" else "varlen"
    config = LlamaConfig.demo(num_layers=layers, attention=attention, max_batch_size=max(64, max_batch, max(buckets)))
    model = build_model(config, seed=seed, device=torch_device)
    print(
        f"graphrunner demo: Llama-style decoder ({config.num_layers} layers, hidden {config.hidden_size}, "
        f"{config.num_heads}/{config.num_kv_heads} heads, {attention} attention), backend={backend}, "
        f"device={dev.kind} ({torch_device}), buckets={list(buckets)}, {steps} steps with batch 1..{max_batch}, "
        f"threads={torch.get_num_threads()}",
        file=out,
    )

    trace = Trace()
    runner = GraphRunner(
        lambda input_ids, positions: model.decode_step(input_ids, positions),
        inputs=decode_inputs(config),
        buckets=list(buckets),
        backend=backend,
        device=dev,
        trace=trace,
        progress=progress,
        checks=checks if checks is not None else None if drift_check else ("padding", "fingerprint"),
    )
    report = runner.capture()
    # The warmup forwards wrote K/V of the capture inputs into the cache; start
    # serving from a clean cache, zeroed in place (graphs hold its address).
    model.reset_cache()
    print(report.table(), file=out)

    gen = torch.Generator().manual_seed(seed + 1)
    graph_bad = pad_bad = 0
    max_padded = max_unpadded = 0.0
    threads = torch.get_num_threads()
    batches: list[int] = []
    # serving progress on stderr: about ten milestones (redrawn in place on a terminal)
    status = StatusLine() if progress else None
    every = max(1, steps // 10)
    t_start = time.perf_counter()
    for i in range(steps):
        n = int(torch.randint(1, max_batch + 1, (1,), generator=gen))
        batches.append(n)
        ids = torch.randint(0, config.vocab_size, (n,), generator=gen).to(torch_device)
        pos = torch.randint(0, config.max_seq_len, (n,), generator=gen).to(torch_device)

        got = runner(input_ids=ids, positions=pos).clone()
        bucket = runner.stats.last_bucket
        rows = bucket if bucket is not None else n
        with torch.inference_mode():
            padded_ref = model.decode_step(_pad(ids, rows), _pad(pos, rows))[:n]
            ref = model.decode_step(ids, pos)

        # NaN counts as an infinite difference (max() would skip it).
        d_pad = (got - padded_ref).abs().nan_to_num(nan=float("inf")).max().item()
        d_unpad = (got - ref).abs().nan_to_num(nan=float("inf")).max().item()
        max_padded, max_unpadded = max(max_padded, d_pad), max(max_unpadded, d_unpad)
        if not torch.equal(got, padded_ref):
            graph_bad += 1
        if not torch.allclose(got, ref, atol=UNPADDED_ATOL, rtol=UNPADDED_RTOL):
            pad_bad += 1
        if status is not None and ((i + 1) % every == 0 or i + 1 == steps):
            status.write(
                f"serving: step {i + 1}/{steps}, {time.perf_counter() - t_start:.1f}s, "
                f"mismatches {graph_bad + pad_bad}",
                final=i + 1 == steps,
            )

    stats = runner.stats
    fallbacks, padding_rows, real_rows = stats.fallbacks, stats.padding_rows, stats.real_rows
    graphed = backend != "eager"
    reasons = dict(stats.fallback_reasons)
    print("\n" + _fallback_line(fallbacks, stats.calls, reasons, list(buckets), max_batch, graphed), file=out)
    print(
        f"padding: {padding_rows} padding rows computed beside {real_rows} real rows (a call runs the smallest "
        f"bucket that holds its batch)",
        file=out,
    )
    latency = _latency_table(runner, model, dev, list(buckets), config, gen, out, graphed=graphed)
    print(_legend(backend, LATENCY_REPS), file=out)
    if graphed:
        for line in _speed_lines(latency, dev.kind):
            print(line, file=out)
    if backend == "breakable":
        print(
            "note: breakable runs attention eagerly at every replay, so it gains little; --backend full "
            "(the default) captures the whole step, the faster one (docs/speed.md)",
            file=out,
        )
    print(
        f"graph vs eager on the padded batch: {steps - graph_bad}/{steps} bit-exact (max |diff| {max_padded:.3g})",
        file=out,
    )
    print(
        f"graph vs eager on the real batch: {steps - pad_bad}/{steps} within atol={UNPADDED_ATOL} "
        f"rtol={UNPADDED_RTOL} (max |diff| {max_unpadded:.3g})",
        file=out,
    )

    violations = check_capture_order(trace)
    keys = len({e.key for e in trace.events if e.kind == "capture_forward"})
    if violations:
        print(f"trace checker: {len(violations)} protocol violation(s):", file=out)
        for v in violations:
            print(f"  - {v}", file=out)
    else:
        print(
            f"trace checker: capture protocol held for all {keys} keys "
            f"(warmups, hook, sync, barrier, construct, one capture; nothing synced in replay)",
            file=out,
        )

    files: list[str] = []
    trace_error = None
    if trace_out:
        trace_error = _write_trace(trace, trace_out, files)
        if trace_error is None:
            print(
                f"trace: {len(trace.events)} events -> {files[0]}, {files[1]} "
                f"(open the .chrome.json in https://ui.perfetto.dev or chrome://tracing)",
                file=out,
            )
        else:
            print(f"graphrunner demo: error: {trace_error}", file=sys.stderr)
    runner.cleanup()

    result = DemoResult(
        steps=steps,
        graph_mismatches=graph_bad,
        padding_mismatches=pad_bad,
        max_abs_diff_padded=max_padded,
        max_abs_diff_unpadded=max_unpadded,
        fallbacks=fallbacks,
        violations=violations,
        latency=latency,
        trace_files=files,
        batches=batches,
        padding_rows=padding_rows,
        real_rows=real_rows,
        threads=threads,
        trace_error=trace_error,
    )
    print("demo: OK" if result.ok else "demo: FAILED (see above)", file=out)
    return result
