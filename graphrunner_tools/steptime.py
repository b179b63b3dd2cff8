"""``graphrunner bench --step TARGET``: time your own step through its GraphRunner against the step run eagerly.

``TARGET`` is what ``graphrunner check`` takes (:mod:`graphrunner_tools.targets`):
``FILE_OR_MODULE:FACTORY`` returning an uncaptured :class:`~graphrunner.GraphRunner`, or
``FILE_OR_MODULE:STEP`` with ``--inputs NAME`` (example tensors, the batch on dim 0; the runner is
built with ``--backend``, default ``full``, and buckets ``--batches``). The runner is captured,
then for each batch size (default: the runner's buckets) random inputs are drawn from its
``BatchInput`` declarations (floats ``randn``; integers inside ``bounds``, or the pad value when
an input declares none; the same inputs for both sides), the runner's output is compared with the
eager step's (``max |graph - eager|``), and ``runner(**inputs)`` (copy in, replay, slice) and
``runner.step(**inputs)`` under ``torch.inference_mode()`` are timed in interleaved rounds. Prints
one table (median microseconds per call, the speedup eager / runner) and returns the figures; never
fails on a timing. Usage errors raise :class:`~graphrunner.checks.lint.CheckUsageError` (one line,
exit 2 in the CLI).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["random_inputs", "time_runner", "runner_for_target", "step_table"]


def random_inputs(runner: Any, batch: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """``{name: tensor}`` of ``batch`` rows for each of ``runner.inputs`` (its ``BatchInput`` declarations) on
    the runner's device: floats from ``randn``, integers uniform inside ``bounds`` (the pad value, which every
    step must accept, when the input declares none), booleans False."""
    out: dict[str, torch.Tensor] = {}
    for name, spec in runner.inputs.items():
        shape = (batch, *tuple(spec.trailing))
        dtype = spec.dtype
        if dtype.is_floating_point or dtype.is_complex:
            t = torch.randn(shape, generator=gen, dtype=torch.float32).to(dtype)
        elif dtype == torch.bool:
            t = torch.zeros(shape, dtype=torch.bool)
        elif spec.bounds is not None:
            lo, hi = spec.bounds
            t = torch.randint(int(lo), int(hi) + 1, shape, generator=gen, dtype=dtype)
        else:
            t = torch.full(shape, spec.pad, dtype=dtype)
        out[name] = t.to(runner.torch_device)
    return out


def _max_diff(a: Any, b: Any) -> float:
    """The largest absolute difference between two outputs (tensors, or dicts / lists / tuples of them)."""
    if isinstance(a, torch.Tensor):
        if a.numel() == 0:
            return 0.0
        return float((a.detach().double() - b.detach().double()).abs().max())
    if isinstance(a, dict):
        return max((_max_diff(a[k], b[k]) for k in a), default=0.0)
    if isinstance(a, (list, tuple)):
        return max((_max_diff(x, y) for x, y in zip(a, b)), default=0.0)
    return 0.0


def time_runner(
    runner: Any, batches: Sequence[int] | None = None, rounds: int = 5, calls: int = 20, seed: int = 0
) -> dict[str, Any]:
    """Capture ``runner`` (if not yet) and time it against ``runner.step`` eagerly; the figures as a dict.

    ``batches``: the batch sizes (default: the runner's buckets; it must be keyed by one batch dim).
    Per batch: ``eager_us`` and ``runner_us`` (medians over ``rounds`` interleaved rounds of ``calls``
    calls, the order alternating), ``speedup`` (eager / runner), ``max_abs_diff`` (graph against eager on
    the same inputs, before timing) and ``bucket`` (the key that served it; None: eager fallback).
    Returns ``{"backend", "device", "capture_seconds", "threads", "rows": [...]}``."""
    from graphrunner.checks.lint import CheckUsageError

    if len(runner.dims) != 1:
        raise CheckUsageError(
            f"the runner is keyed by several dims {list(runner.dims)}; --step times runners "
            "keyed by one batch dim (buckets=[...])"
        )
    batches = list(batches or runner.keys)
    t0 = time.perf_counter()
    if not runner.captured:
        runner.capture()
    capture_s = time.perf_counter() - t0
    gen = torch.Generator().manual_seed(seed)
    dev = runner.device
    rows: list[dict[str, Any]] = []
    for b in batches:
        x = random_inputs(runner, b, gen)
        with torch.inference_mode():
            graph = _clone(runner(**{k: v.clone() for k, v in x.items()}))  # a view the next call overwrites
            eager = runner.step(**{k: v.clone() for k, v in x.items()})
            diff = _max_diff(graph, eager)
            times: dict[str, list[float]] = {"eager": [], "runner": []}
            fns = {"eager": lambda: runner.step(**x), "runner": lambda: runner(**x)}  # noqa: B023 - called in this iteration, before the variable moves on
            for fn in fns.values():
                fn()
            for r in range(rounds):
                for name in ("eager", "runner") if r % 2 == 0 else ("runner", "eager"):
                    dev.synchronize()
                    t = time.perf_counter()
                    for _ in range(calls):
                        fns[name]()
                    dev.synchronize()
                    times[name].append((time.perf_counter() - t) / calls * 1e6)
        e, g = statistics.median(times["eager"]), statistics.median(times["runner"])
        rows.append(
            {
                "batch": b,
                "bucket": runner.bucket_for(b),
                "eager_us": e,
                "runner_us": g,
                "speedup": e / g,
                "max_abs_diff": diff,
                "rounds_us": {k: v for k, v in times.items()},
            }
        )
    return {
        "backend": type(runner.backend).__name__,
        "device": type(dev).__name__,
        "capture_seconds": capture_s,
        "threads": torch.get_num_threads(),
        "rows": rows,
    }


def _clone(out: Any) -> Any:
    """A copy of an output (tensors, or dicts / lists / tuples of them)."""
    if isinstance(out, torch.Tensor):
        return out.clone()
    if isinstance(out, dict):
        return {k: _clone(v) for k, v in out.items()}
    if isinstance(out, (list, tuple)):
        return type(out)(_clone(v) for v in out)
    return out


def runner_for_target(
    target: str, inputs: str | None = None, batches: Sequence[int] | None = None, backend: str | None = None
) -> Any:
    """The uncaptured runner ``TARGET`` names: a factory's runner (``inputs`` None; ``batches`` and ``backend``
    then must be None: the factory configures its runner), or one built from a step and the example inputs
    ``inputs`` names (an attribute next to the step, or ``FILE_OR_MODULE:NAME``), with buckets ``batches``
    (default: the examples' batch size) and ``backend`` (default ``"full"``)."""
    from graphrunner.checks.lint import CheckUsageError
    from graphrunner.runner import GraphRunner
    from graphrunner_tools.targets import load_factory, load_target, runner_from_examples

    if inputs is None:
        if backend is not None:
            raise CheckUsageError(
                "--backend configures a step timed with --inputs; a factory configures its "
                "GraphRunner itself (drop --backend, or pass --inputs NAME)"
            )
        factory = load_factory(target)
        from graphrunner.checks.lint import required_parameters

        needed = required_parameters(factory)
        if needed:
            raise CheckUsageError(
                f"{target} takes ({', '.join(needed)}): a step needs example inputs, --inputs "
                "NAME (a dict of tensors next to it); a factory takes no arguments"
            )
        try:
            runner = factory()
        except Exception as exc:
            raise CheckUsageError(f"{target}() raised {type(exc).__name__}: {exc}") from exc
        if not isinstance(runner, GraphRunner):
            raise CheckUsageError(
                f"{target}() returned {type(runner).__name__}; --step needs a factory returning "
                "an uncaptured gr.GraphRunner, or a step with --inputs NAME"
            )
        return runner
    module, step = load_target(target)
    if not callable(step):
        raise CheckUsageError(f"{target} is {type(step).__name__}, not a callable step")
    if ":" in inputs:
        examples = load_target(inputs)[1]
    else:
        if not hasattr(module, inputs):
            raise CheckUsageError(
                f"argument --inputs: {target.rpartition(':')[0]!r} has no attribute {inputs!r}; "
                "name a dict of example tensors defined next to the step, or FILE_OR_MODULE:NAME"
            )
        examples = getattr(module, inputs)
    return runner_from_examples(step, examples, batches, backend or "full", what=f"--inputs {inputs}")


def step_table(target: str, result: dict[str, Any]) -> list[str]:
    """The printed table of :func:`time_runner`'s ``result`` for ``target``."""
    lines = [
        f"graphrunner bench --step {target}: {result['backend']} on {result['device']}, capture "
        f"{result['capture_seconds']:.2f}s, {result['threads']} thread(s)",
        f"  {'batch':>6} {'bucket':>7} {'eager us':>10} {'runner us':>10} {'speedup':>8}  max |graph - eager|",
    ]
    for r in result["rows"]:
        bucket = "eager" if r["bucket"] is None else str(r["bucket"])
        lines.append(
            f"  {r['batch']:>6} {bucket:>7} {r['eager_us']:>10.1f} {r['runner_us']:>10.1f} "
            f"{r['speedup']:>7.2f}x  {r['max_abs_diff']:.3g}"
        )
    lines.append(
        "  (runner: the whole call, copy in, replay, slice; medians of interleaved rounds; above 1.00x "
        "the runner is faster)"
    )
    return lines
