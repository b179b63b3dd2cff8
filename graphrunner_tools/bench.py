"""``graphrunner bench``: run the benchmark suite, write one JSON file and a latency plot.

The benchmark scripts live in the repository's ``bench/`` directory (it is not a
package and is not installed). This driver finds that directory next to the
package source tree (``<repo>/graphrunner_tools/../bench``; override with
``--bench-dir`` or ``$GRAPHRUNNER_BENCH_DIR``; from an installed wheel there is
none, and the command says so and exits 2), imports each script with
:mod:`importlib` and calls its ``main(argv)`` in this one process, then merges
the results::

    graphrunner bench                      # full suite (a few minutes on 2 CPU cores)
    graphrunner bench --quick              # smoke run (seconds; torch.compile skipped)
    python -m graphrunner_tools.bench --only latency_vs_batch --out /tmp/b.json

Outputs (defaults, in the repository wherever the command runs):
``bench/results/bench.json`` (the merged results; each script also writes its
own ``bench/results/<name>.json`` next to it) and
``bench/results/latency_vs_batch.png`` (per-call latency of the demo decoder
step against batch size) and ``bench/results/loadtest_sweep.png`` (tokens/s and p99
decode-step time against concurrency, graph and eager engines side by side); plots are
skipped with a message when matplotlib is missing, and the summary prints the sweep as a
table either way.
See ``docs/benchmarks.md`` for what each script measures and how to read the
JSON. Benchmarks print ratios measured side by side in one run; they never
fail on a timing. stdout holds tables only (each script's, then the speed table of
:func:`speed_lines` and the summary of :func:`summary_lines`, whose figures are the tables' own, every target
marked ``met`` or ``MISSED`` by :func:`target_note`); progress lines and
``wrote <file>`` go to stderr. The exit status is 1 when a script raised, else 0.

The module also holds the small helpers the scripts share
(:func:`decode_inputs`, :func:`decode_runner`, :func:`environment`).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import importlib.util
import json
import os
import platform
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from graphrunner_tools.threads import add_threads_argument, thread_facts, torch_threads

__all__ = [
    "SUITE",
    "DEFAULT_OUT",
    "DEFAULT_PLOT",
    "BenchDirNotFoundError",
    "find_bench_dir",
    "parse_int_list",
    "parse_buckets",
    "load_script",
    "run_suite",
    "plot_latency",
    "plot_loadtest",
    "loadtest_table",
    "summarize",
    "summary_lines",
    "speed_lines",
    "decode_inputs",
    "decode_runner",
    "environment",
    "target_note",
    "progress_line",
    "write_json",
    "build_parser",
    "add_bench_subparser",
    "main",
]

#: The scripts of the suite, in the order they run (``bench/<name>.py``).
#: ``capture_vs_compile`` runs last: torch.compile leaves compiled state behind.
SUITE = (
    "tape_vs_eager",
    "runner_overhead",
    "latency_vs_batch",
    "loadtest_sweep",
    "hf_generate",
    "capture_vs_compile",
    "hf_capture_vs_compile",
)

#: Default merged JSON path and plot file name: ``results/bench.json`` inside the
#: benchmark directory (``<repo>/bench/results/bench.json``, wherever the command runs),
#: and ``latency_vs_batch.png`` next to the JSON.
DEFAULT_OUT = os.path.join("bench", "results", "bench.json")
DEFAULT_PLOT = os.path.join("bench", "results", "latency_vs_batch.png")

# Quick-mode arguments for scripts that have no ``--quick`` flag of their own
# (used only when the script's source does not mention "--quick").
_QUICK_FALLBACK: dict[str, list[str]] = {
    "tape_vs_eager": ["--batches", "1,8", "--reps", "3", "--inner", "5"],
    "runner_overhead": ["--calls", "40", "--reps", "2"],
}

# Methods drawn on the latency plot, in legend order, with their line style.
_PLOT_STYLE = {
    "eager": dict(color="black", marker="o", linestyle="-"),
    "eager_masked": dict(color="gray", marker="o", linestyle="--"),
    "tape_full": dict(color="tab:blue", marker="s", linestyle="-"),
    "tape_breakable": dict(color="tab:orange", marker="^", linestyle="-"),
    "cuda_eager": dict(color="tab:green", marker="o", linestyle=":"),
    "cuda_full": dict(color="tab:purple", marker="s", linestyle=":"),
    "cuda_breakable": dict(color="tab:red", marker="^", linestyle=":"),
}


class BenchDirNotFoundError(FileNotFoundError):
    """The ``bench/`` scripts directory could not be found (e.g. a non-editable install)."""


# --------------------------------------------------------------------------- helpers for scripts
def _positive_ints(text: str) -> list[int]:
    try:
        vals = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        vals = []
    if not vals or any(v <= 0 for v in vals):
        raise argparse.ArgumentTypeError(f"expected comma-separated positive integers such as 1,2,4,8; got {text!r}")
    return vals


def parse_int_list(text: str) -> list[int]:
    """Parse ``"1,2,4"`` into sorted, distinct positive ints; raise
    ``argparse.ArgumentTypeError`` naming the text otherwise (for ``type=``)."""
    return sorted(set(_positive_ints(text)))


def parse_buckets(text: str) -> list[int]:
    """Parse a bucket list such as ``"1,2,4"`` (for ``type=``): positive ints,
    strictly increasing as written. Raise ``argparse.ArgumentTypeError`` naming
    the text for anything else: ``"4,2"`` or ``"2,2"`` is a mistake, not
    something to sort silently."""
    vals = _positive_ints(text)
    if any(a >= b for a, b in zip(vals, vals[1:])):
        raise argparse.ArgumentTypeError(
            f"buckets must be strictly increasing (no duplicates), such as 1,2,4,8; got {text!r}"
        )
    return vals


def target_note(value: float | None, target: float, at_most: bool = True) -> str:
    """``"target <= 3x: met"`` or ``"target <= 3x: MISSED"`` (``at_most=False``: ``>=``) for a ratio ``value``
    (``"target <= 3x: not measured"`` for ``None``). Every bench line that names a target says which."""
    sign = "<=" if at_most else ">="
    if value is None:
        return f"target {sign} {target:g}x: not measured"
    ok = value <= target if at_most else value >= target
    return f"target {sign} {target:g}x: {'met' if ok else 'MISSED'}"


def sync_device(device: str) -> None:
    """Wait for queued GPU work when ``device`` is ``"cuda"``, so wall-clock timings are honest."""
    if device == "cuda":
        torch.cuda.synchronize()


def decode_inputs(vocab_size: int | None = None, max_seq_len: int | None = None) -> dict[str, Any]:
    """The :class:`~graphrunner.runner.BatchInput` spec of the demo decoder's decode step:
    ``input_ids`` and ``positions``, both long ``[B]`` padded with 0, with the ``bounds`` of their real
    values when ``vocab_size`` / ``max_seq_len`` are given (the padding check then draws real token
    ids and positions from them, and says nothing about missing bounds)."""
    from graphrunner.runner import BatchInput

    def bounds(n: int | None) -> Any:
        return None if n is None else (0, int(n) - 1)

    return {
        "input_ids": BatchInput(trailing=(), dtype=torch.long, pad=0, bounds=bounds(vocab_size)),
        "positions": BatchInput(trailing=(), dtype=torch.long, pad=0, bounds=bounds(max_seq_len)),
    }


def decode_runner(model: Any, backend: str, device: str, buckets: Sequence[int], warmups: int = 2) -> Any:
    """A not-yet-captured :class:`~graphrunner.runner.GraphRunner` over ``model.decode_step``.

    ``backend`` is ``"full"``, ``"breakable"`` or ``"eager"``; ``device`` is
    ``"tape"``, ``"cuda"`` or ``"auto"``. The inputs carry the bounds of
    ``model.config`` (``vocab_size``, ``max_seq_len``). No progress bar. The
    caller times ``runner.capture()`` itself.
    """
    from graphrunner.runner import GraphRunner

    def step(input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return model.decode_step(input_ids, positions)

    cfg = model.config
    return GraphRunner(
        step,
        inputs=decode_inputs(cfg.vocab_size, cfg.max_seq_len),
        buckets=list(buckets),
        backend=backend,
        device=device,
        warmups=warmups,
        progress=False,
    )


def cpu_model() -> str | None:
    """The CPU's model name (``/proc/cpuinfo``'s ``model name``; ``platform.processor()`` elsewhere), or None."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


def environment() -> dict[str, Any]:
    """Facts about this process that make numbers comparable: versions, CPU, threads, GPU."""
    import graphrunner

    cuda = torch.cuda.is_available()
    return {
        "cpu_model": cpu_model(),
        "graphrunner": graphrunner.__version__,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "machine": platform.machine(),
        "cpu_count": os.cpu_count(),
        "cuda_available": cuda,
        "cuda_device": torch.cuda.get_device_name(0) if cuda else None,
        **thread_facts(),
    }


# --------------------------------------------------------------------------- finding and loading
def find_bench_dir(bench_dir: str | os.PathLike | None = None) -> Path:
    """Return the directory holding the benchmark scripts.

    Order: ``bench_dir`` if given, else ``$GRAPHRUNNER_BENCH_DIR``, else
    ``bench/`` of the source checkout this package was imported from
    (``<repo>/graphrunner_tools/../bench``: an editable install, or a checkout
    on ``sys.path``), used when it holds at least one script of :data:`SUITE`.
    Raises :class:`BenchDirNotFoundError` naming the place looked at and what
    to do when none is found: ``bench/`` is part of the source repository, not
    of an installed wheel.
    """
    if bench_dir is None:
        bench_dir = os.environ.get("GRAPHRUNNER_BENCH_DIR") or None
    if bench_dir is not None:
        path = Path(bench_dir).expanduser().resolve()
        if not path.is_dir():
            raise BenchDirNotFoundError(
                f"benchmark directory {str(path)!r} does not exist or is not a directory; pass --bench-dir "
                "(or set GRAPHRUNNER_BENCH_DIR) to the bench/ directory of a graphrunner checkout"
            )
        return path
    import graphrunner_tools

    pkg = Path(graphrunner_tools.__file__).resolve().parent
    path = pkg.parent / "bench"
    if path.is_dir() and any((path / f"{name}.py").is_file() for name in SUITE):
        return path
    found = (
        "it is not there"
        if not path.is_dir()
        else f"it holds none of the suite's scripts ({', '.join(f'{n}.py' for n in SUITE)})"
    )
    raise BenchDirNotFoundError(
        f"the benchmark scripts were not found: looked for {str(path)!r}, the bench/ directory next to the "
        f"graphrunner_tools package at {str(pkg)!r}, and {found}. bench/ is part of the source repository, "
        "not of an installed wheel: run from a clone installed with `pip install -e .`, or pass --bench-dir PATH "
        "(or set GRAPHRUNNER_BENCH_DIR) to a checkout's bench/ directory"
    )


def load_script(path: str | os.PathLike, name: str | None = None) -> Any:
    """Import the script at ``path`` as a fresh module (``graphrunner_bench_<name>``) and return it.

    The module is registered in ``sys.modules`` while it executes (dataclasses
    need that) and replaced on every call. Raises ``FileNotFoundError`` when the
    file does not exist; errors raised by the script's top level propagate.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"benchmark script {str(path)!r} does not exist")
    modname = f"graphrunner_bench_{name or path.stem}"
    spec = importlib.util.spec_from_file_location(modname, path)
    if spec is None or spec.loader is None:  # pragma: no cover - only for odd file names
        raise ImportError(f"cannot import benchmark script {str(path)!r}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[modname] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(modname, None)
        raise
    return module


def _quick_args(name: str, path: Path) -> list[str]:
    try:
        source = path.read_text()
    except OSError:
        source = ""
    if "--quick" in source:
        return ["--quick"]
    return list(_QUICK_FALLBACK.get(name, []))


# --------------------------------------------------------------------------- the suite
def run_suite(
    out: str | os.PathLike | None = None,
    plot: str | os.PathLike | None = "auto",
    quick: bool = False,
    only: Sequence[str] | None = None,
    skip: Sequence[str] = (),
    bench_dir: str | os.PathLike | None = None,
    extra_args: dict[str, list[str]] | None = None,
    echo: Callable[[str], Any] | None = None,
    threads: int | None = None,
) -> dict[str, Any]:
    """Run the benchmark scripts in this process and write the merged JSON (and the plot).

    Args:
        out: merged JSON path; each script writes ``<dirname(out)>/<name>.json``.
            ``None``: ``<bench dir>/results/bench.json`` (:data:`DEFAULT_OUT` in a checkout).
        plot: PNG path for the latency plot, ``"auto"`` for
            ``<dirname(out)>/latency_vs_batch.png``, or ``None`` for no plot.
        quick: smoke run: passes ``--quick`` to scripts that support it (or a
            small fixed argument list to the known scripts that do not).
        only: names to run (default: every script of :data:`SUITE`; a
            script whose file is absent is recorded in ``skipped``); an
            unknown name is an error.
        skip: names not to run.
        bench_dir: see :func:`find_bench_dir`.
        extra_args: ``{name: [args]}`` appended to that script's argv.
        echo: where progress lines go (default: stderr; stdout holds the
            scripts' tables and the summary only).
        threads: torch intra-op threads for the whole suite (``--threads N``
            is passed to every script that takes it, so each script's JSON
            records it); ``None`` leaves the caller's count. The caller's
            count is restored when the suite ends.

    Returns the merged dict (also written to ``out``): ``schema``,
    ``created``, ``quick``, ``environment``, ``bench_dir``, ``results``
    (``{name: the script's dict}``), ``seconds`` (wall time per script),
    ``argv`` (per script), ``threads`` (the count the scripts ran with), ``skipped`` (``{name: reason}``), ``errors``
    (``{name: traceback}``), ``summary`` (:func:`summarize`), ``plot`` (the
    PNG path or ``None``), ``plot_note`` and ``out`` (the JSON path).

    A script that raises is recorded in ``errors`` and the suite goes on.
    The JSON is rewritten after every script, so a run that is killed keeps
    the results of the scripts that finished.
    The process-wide torch thread count is restored after each script (a
    script may pin it for its own run). Raises
    :class:`BenchDirNotFoundError` when ``bench/`` cannot be found and
    ``ValueError`` for an unknown name in ``only``/``skip``.
    """
    bdir = find_bench_dir(bench_dir)
    with torch_threads(threads or torch.get_num_threads()) as n:
        return _run_suite(
            bdir, out, plot, quick, only, skip, dict(extra_args or {}), echo or progress_line, n if threads else None
        )


def _run_suite(
    bdir: Path,
    out: str | os.PathLike | None,
    plot: Any,
    quick: bool,
    only: Sequence[str] | None,
    skip: Sequence[str],
    extra_args: dict[str, list[str]],
    echo: Callable[[str], Any],
    threads: int | None,
) -> dict[str, Any]:
    names = list(SUITE)
    for label, given in (("only", only or ()), ("skip", skip)):
        unknown = [n for n in given if n not in SUITE]
        if unknown:
            raise ValueError(f"--{label}: unknown benchmark(s) {unknown}; known: {list(SUITE)}")
    if only:
        names = [n for n in names if n in only]
    names = [n for n in names if n not in skip]

    out = bdir / "results" / "bench.json" if out is None else Path(out)
    results_dir = out.parent
    if isinstance(plot, str) and plot == "auto":
        plot = results_dir / "latency_vs_batch.png"
    results_dir.mkdir(parents=True, exist_ok=True)
    merged: dict[str, Any] = {
        "schema": 1,
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "quick": bool(quick),
        "environment": environment(),
        "bench_dir": str(bdir),
        "results": {},
        "seconds": {},
        "argv": {},
        "threads": torch.get_num_threads(),
        "skipped": {},
        "errors": {},
        "plot": None,
        "plot_note": "not drawn yet (the run was cut short)",
        "out": str(out),
    }
    for name in SUITE:
        if name not in names:
            merged["skipped"][name] = "not selected (--only/--skip)"
    write_json(out, merged)
    echo(f"[bench] torch threads: {merged['threads']}, load average: {merged['environment']['load_average']}")
    for i, name in enumerate(names):
        path = bdir / f"{name}.py"
        if not path.is_file():
            merged["skipped"][name] = f"{path} does not exist"
            echo(f"[bench] {name}: skipped ({path} does not exist)")
            continue
        script_out = results_dir / f"{name}.json"
        argv = ["--out", str(script_out)]
        if quick:
            argv += _quick_args(name, path)
        if threads is not None and "--threads" in path.read_text():
            argv += ["--threads", str(threads)]
        argv += list(extra_args.get(name, []))
        merged["argv"][name] = argv
        if script_out.is_file():
            script_out.unlink()  # never read back a previous run's file
        echo(f"[bench] {name}: python {path} {' '.join(argv)}")
        if i:
            print(flush=True)  # stdout: a blank line between the scripts' tables
        threads = torch.get_num_threads()
        t0 = time.perf_counter()
        try:
            module = load_script(path, name)
            fn = getattr(module, "main", None)
            if not callable(fn):
                merged["skipped"][name] = f"{path} has no main(argv) function"
                echo(f"[bench] {name}: skipped (no main(argv))")
                continue
            result = fn(argv)
            if result is None and script_out.is_file():
                # Scripts that only write their JSON: read it back.
                result = json.loads(script_out.read_text())
            if not isinstance(result, dict):
                raise TypeError(
                    f"{name}.main(argv) returned {type(result).__name__}, expected a dict (or None after writing --out)"
                )
            merged["results"][name] = result
        except SystemExit as exc:  # argparse errors
            merged["errors"][name] = f"SystemExit({exc.code!r}) from {name}.main({argv})"
            echo(f"[bench] {name}: FAILED: exited with {exc.code}")
        except Exception:  # noqa: BLE001 - record and go on with the suite
            merged["errors"][name] = traceback.format_exc()
            echo(f"[bench] {name}: FAILED\n{merged['errors'][name]}")
        finally:
            merged["seconds"][name] = time.perf_counter() - t0
            if torch.get_num_threads() != threads:
                # A script changed the process-wide thread count: do not let it leak into the next.
                echo(f"[bench] {name}: restoring torch threads {torch.get_num_threads()} -> {threads}")
                torch.set_num_threads(threads)
        if name in merged["results"]:
            echo(f"[bench] {name}: done in {merged['seconds'][name]:.1f}s")
        # Write what we have after every script, so a run cut short keeps its finished results.
        merged["summary"] = summarize(merged["results"])
        write_json(out, merged)

    merged["plot_note"] = None
    lat = merged["results"].get("latency_vs_batch")
    if plot is None:
        merged["plot_note"] = "no plot requested"
    elif lat is None:
        merged["plot_note"] = "latency_vs_batch did not run; no plot"
    else:
        try:
            written = plot_latency(lat, plot)
        except Exception:  # noqa: BLE001 - a plot failure must not lose the numbers
            merged["plot_note"] = "plot failed:\n" + traceback.format_exc()
        else:
            if written is None:
                merged["plot_note"] = "matplotlib is not installed: no plot (pip install -e '.[bench]')"
            else:
                merged["plot"] = str(written)
        if merged["plot_note"]:
            echo(f"[bench] {merged['plot_note']}")
    sweep = merged["results"].get("loadtest_sweep")
    if plot is not None and sweep is not None:
        try:
            drawn = plot_loadtest(sweep, Path(plot).with_name("loadtest_sweep.png"))
        except Exception:  # noqa: BLE001 - a plot failure must not lose the numbers
            echo("[bench] loadtest plot failed:\n" + traceback.format_exc())
        else:
            merged["plots"] = {"loadtest_sweep": str(drawn) if drawn is not None else None}
    merged["summary"] = summarize(merged["results"])
    write_json(out, merged)
    return merged


def progress_line(text: str) -> None:
    """Print a progress line to stderr (stdout is for tables and the summary)."""
    print(text, file=sys.stderr, flush=True)


def write_json(path: str | os.PathLike, obj: dict[str, Any], announce: bool = False) -> None:
    """Write ``obj`` as JSON to ``path`` atomically (a run killed while writing
    leaves the previous complete file), creating its folder; with
    ``announce``, print ``wrote <path>`` to stderr. Every bench script writes through it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2, default=_json_default))
    os.replace(tmp, path)
    if announce:
        progress_line(f"wrote {path}")


def skipped_without_transformers(result: dict[str, Any], out: str | os.PathLike) -> bool:
    """``True`` (after recording ``result["skipped"]``, printing the reason under ``result["benchmark"]``
    and writing ``result`` to ``out``) when transformers is not installed: a bench script of ``gr.hf``
    then returns ``result`` as it is. ``False`` when it is installed."""
    try:
        import transformers  # noqa: F401
    except ImportError:
        result["skipped"] = "transformers is not installed (pip install -e '.[hf]')"
        print(f"{result['benchmark']}: skipped: {result['skipped']}")
        write_json(out, result, announce=True)
        return True
    return False


def _json_default(v: Any) -> Any:
    if isinstance(v, (torch.dtype, torch.device, Path)):
        return str(v)
    if isinstance(v, torch.Tensor) and v.numel() == 1:
        return v.item()
    return repr(v)


def summarize(results: dict[str, Any]) -> dict[str, Any]:
    """The headline numbers of a suite run, from each script's result dict.

    Keys (present when the script ran):

    - ``capture_vs_compile``: ``ratio`` (compile seconds / capture seconds on
      the same bucket sizes), ``target_ratio``, ``meets_target``,
      ``capture_seconds_all_buckets``, ``capture_seconds_same_buckets``,
      ``compile_seconds``, ``compile_buckets``, ``compile_skipped``.
    - ``latency_vs_batch``: ``batches``; ``speedup`` per graph method, one
      value per batch (its eager reference's latency / its latency);
      ``reference`` (that eager method, per graph method); ``latency_us`` per method.
    - ``runner_overhead``: ``ratio_runner_over_minimal`` and ``target_ratio`` (its demo-like step),
      ``overhead_us`` (its runner's per-call time minus the minimal loop's: the host cost of a call),
      ``tiny_per_call_us`` (``runner``, ``minimal``, ``eager``) and ``tiny_ratio_runner_over_eager``,
      ``tiny_ratio_runner_over_minimal`` and ``tiny_target_ratio`` (its tiny 2-input step),
      ``first_over_steady_max`` and ``first_target`` (first replay of a bucket vs a steady one),
      ``steps`` (the two steps' labels, as the script's own table prints them).
    - ``tape_vs_eager``: ``speedup`` per batch (its ``rows``: the demo decoder's
      TapeGraph replay vs eager) and ``speedup_inline`` (its ``rows_inline``).
    - ``loadtest_sweep``: ``levels`` (per concurrency: graph and eager tokens/s, their
      ratio, graph and eager p99 step ms) and ``failures`` (levels that were not clean).
    - ``hf_generate``: ``batches``, ``prompt``, ``new`` and per arch ``speedup`` (per batch:
      ``model.generate``'s ms / ``DecodeRunner.generate``'s), ``equal`` (tokens equal at every batch)
      and ``ms_per_call``.
    """
    s: dict[str, Any] = {}
    cvc = results.get("capture_vs_compile")
    if isinstance(cvc, dict):
        s["capture_vs_compile"] = {
            k: cvc.get(k)
            for k in (
                "ratio",
                "target_ratio",
                "meets_target",
                "capture_seconds_all_buckets",
                "capture_seconds_same_buckets",
                "compile_seconds",
                "compile_buckets",
                "compile_skipped",
            )
        }
    lat = results.get("latency_vs_batch")
    if isinstance(lat, dict):
        methods = lat.get("methods") or {}
        s["latency_vs_batch"] = {
            "batches": lat.get("batches"),
            "speedup": lat.get("speedup"),
            "reference": {m: (methods.get(m) or {}).get("reference") for m in (lat.get("speedup") or {})},
            "latency_us": {m: (methods.get(m) or {}).get("latency_us") for m in methods},
        }
    ro = results.get("runner_overhead")
    if isinstance(ro, dict):
        tiny = ro.get("tiny_two_inputs") or {}
        s["runner_overhead"] = {
            "ratio_runner_over_minimal": ro.get("ratio_runner_over_minimal"),
            "target_ratio": ro.get("target_ratio"),
            "overhead_us": ro.get("overhead_us"),
            "tiny_per_call_us": tiny.get("per_call_us"),
            "tiny_ratio_runner_over_eager": tiny.get("ratio_runner_over_eager"),
            "tiny_ratio_runner_over_minimal": tiny.get("ratio_runner_over_minimal"),
            "tiny_target_ratio": tiny.get("target_ratio"),
            "first_over_steady_max": tiny.get("first_over_steady_max"),
            "first_target": tiny.get("first_target"),
            "first_call": tiny.get("first_call"),
            "first_over_steady_later_max": tiny.get("first_over_steady_later_max"),
            "first_over_steady_bucket1": (tiny.get("first_over_steady") or [None])[0],
            "first_extra_us": tiny.get("first_extra_us"),
            "steps": ro.get("steps") or {},
        }
    tve = results.get("tape_vs_eager")
    if isinstance(tve, dict):
        t: dict[str, Any] = {}
        for key, rows_key in (("speedup", "rows"), ("speedup_inline", "rows_inline")):
            rows = tve.get(rows_key)
            if isinstance(rows, list) and rows:
                t[key] = {str(r.get("batch")): r.get("speedup") for r in rows if isinstance(r, dict)}
        s["tape_vs_eager"] = t
    hg = results.get("hf_generate")
    if isinstance(hg, dict) and not hg.get("skipped"):
        s["hf_generate"] = {
            "batches": hg.get("batches"),
            "new": hg.get("new"),
            "prompt": hg.get("prompt"),
            "archs": {
                r["arch"]: {
                    "speedup": r.get("speedup"),
                    "equal": all((r.get("equal") or {}).values()),
                    "ms_per_call": r.get("ms_per_call"),
                }
                for r in hg.get("results") or []
                if isinstance(r, dict) and "arch" in r
            },
        }
    sweep = results.get("loadtest_sweep")
    if isinstance(sweep, dict):
        s["loadtest_sweep"] = {
            "levels": [
                {
                    k: lv.get(k)
                    for k in (
                        "concurrency",
                        "tokens_per_s",
                        "eager_tokens_per_s",
                        "speedup",
                        "p99_step_ms",
                        "eager_p99_step_ms",
                    )
                }
                for lv in sweep.get("levels") or []
                if isinstance(lv, dict)
            ],
            "failures": sweep.get("failures"),
        }
    return s


def loadtest_table(levels: Sequence[dict[str, Any]]) -> list[str]:
    """The loadtest sweep as text rows: concurrency, graph and eager tokens/s, their ratio,
    graph and eager p99 decode-step ms (``-`` where not measured)."""

    def cell(v: Any, fmt: str) -> str:
        return format(v, fmt) if isinstance(v, (int, float)) else "-"

    rows = [f"{'C':>6} {'graph tok/s':>12} {'eager tok/s':>12} {'ratio':>6} {'graph p99 ms':>13} {'eager p99 ms':>13}"]
    for lv in levels:
        rows.append(
            f"{lv.get('concurrency')!s:>6} {cell(lv.get('tokens_per_s'), ',.0f'):>12} "
            f"{cell(lv.get('eager_tokens_per_s'), ',.0f'):>12} {cell(lv.get('speedup'), '.2f'):>6} "
            f"{cell(lv.get('p99_step_ms'), '.2f'):>13} {cell(lv.get('eager_p99_step_ms'), '.2f'):>13}"
        )
    return rows


def _save_figure(fig: Any, path: str | os.PathLike) -> Path:
    """Lay out ``fig``, write it to ``path`` (parent folders made), close it; the path written."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path


def plot_loadtest(sweep: dict[str, Any], path: str | os.PathLike) -> Path | None:
    """Draw a ``loadtest_sweep`` result: tokens/s (left) and p99 decode-step ms (right) against
    concurrency, graph and eager engines side by side; save a PNG. Returns the path, or
    ``None`` when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    levels = [lv for lv in sweep.get("levels") or [] if isinstance(lv, dict)]
    cs = [lv["concurrency"] for lv in levels]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4), dpi=110)
    for ax, (g, e, label) in zip(
        axes,
        (
            ("tokens_per_s", "eager_tokens_per_s", "generated tokens/s"),
            ("p99_step_ms", "eager_p99_step_ms", "p99 decode step (ms)"),
        ),
    ):
        for key, name, style in (
            (g, "graph", dict(color="tab:orange", marker="^")),
            (e, "eager", dict(color="black", marker="o")),
        ):
            pts = [(c, lv.get(key)) for c, lv in zip(cs, levels) if lv.get(key) is not None]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], label=name, **style)
        ax.set_xscale("log", base=2)
        ax.set_xticks(cs)
        ax.set_xticklabels([str(c) for c in cs])
        ax.set_xlabel("concurrency (max running requests)")
        ax.set_ylabel(label)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    cfg = sweep.get("config") or {}
    fig.suptitle(
        f"loadtest sweep: {cfg.get('ranks', '?')} rank(s), backend {cfg.get('backend', '?')}, "
        f"{cfg.get('requests', '?')} requests per level",
        fontsize=10,
    )
    return _save_figure(fig, path)


def plot_latency(latency: dict[str, Any], path: str | os.PathLike) -> Path | None:
    """Draw per-call latency against batch size from a ``latency_vs_batch`` result and save a PNG.

    One line per method in ``latency["methods"]`` (``latency_us`` aligned
    with ``latency["batches"]``; ``None`` entries are not drawn), log-log
    axes. Uses the ``Agg`` backend (no display needed). Returns the path
    written, or ``None`` when matplotlib is not installed.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    batches = list(latency["batches"])
    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=110)
    methods = latency["methods"]
    order = [m for m in _PLOT_STYLE if m in methods] + [m for m in methods if m not in _PLOT_STYLE]
    for name in order:
        ys = methods[name].get("latency_us") or []
        pts = [(b, y) for b, y in zip(batches, ys) if y is not None]
        if not pts:
            continue
        style = _PLOT_STYLE.get(name, dict(marker="x", linestyle="-"))
        ax.plot([p[0] for p in pts], [p[1] for p in pts], label=name, **style)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(batches)
    ax.set_xticklabels([str(b) for b in batches])
    ax.set_xlabel("batch size")
    ax.set_ylabel("per-call latency (µs, median)")
    env = latency.get("environment") or {}
    cfg = latency.get("config") or {}
    title = "demo decoder step: latency vs batch"
    sub = (
        f"{cfg.get('num_layers', '?')} layers, hidden {cfg.get('hidden_size', '?')}; "
        f"torch {env.get('torch', '?')}, {env.get('torch_threads', '?')} threads"
    )
    ax.set_title(f"{title}\n{sub}", fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    return _save_figure(fig, path)


# --------------------------------------------------------------------------- command line
#: the batch sizes of the speed table (:func:`speed_lines`)
SPEED_BATCHES = (1, 8, 32)


def _at(batches: Sequence[Any], values: Sequence[Any], b: int) -> Any:
    """``values`` at batch ``b`` of ``batches`` (None when ``b`` was not measured)."""
    for x, v in zip(batches or [], values or []):
        if int(x) == b:
            return v
    return None


def speed_lines(merged: dict[str, Any]) -> list[str]:
    """The speed table that opens the summary (and the README quotes): the machine and date, then per call at
    batch 1, 8 and 32 (``-`` where not measured): the demo decoder step eagerly, the breakable and the full
    backend against eager, ``DecodeRunner.generate`` against ``model.generate`` (static cache) per
    architecture, and the host cost of a ``GraphRunner`` call. Empty when none of those scripts ran."""
    s = merged.get("summary", {})
    lat, hg, ro = s.get("latency_vs_batch"), s.get("hf_generate"), s.get("runner_overhead")
    if not (lat or hg or ro):
        return []
    env = merged.get("environment") or {}
    gpu = env.get("cuda_device") or "no GPU: graphs are the CPU tape; GPU figures not yet measured"
    rows = [
        f"[bench] speed, {str(merged.get('created', '?'))[:10]}: {env.get('cpu_model') or env.get('machine')}, "
        f"{env.get('cpu_count')} cores, torch {env.get('torch')}, {merged.get('threads')} thread(s); {gpu}"
        + (" (--quick: few rounds, smaller sizes)" if merged.get("quick") else ""),
        f"  {'per call (median of interleaved rounds)':<58}" + "".join(f"{f'b{b}':>9}" for b in SPEED_BATCHES),
    ]

    def row(label: str, cells: list[Any], fmt: str, unit: str = "") -> None:
        rows.append(f"  {label:<58}" + "".join(f"{format(c, fmt) + unit if c is not None else '-':>9}" for c in cells))

    if lat:
        bs, us, sp = lat.get("batches") or [], lat.get("latency_us") or {}, lat.get("speedup") or {}
        if us.get("eager"):
            row("demo decoder step, eager (us)", [_at(bs, us["eager"], b) for b in SPEED_BATCHES], ".0f")
        for m, label in (
            ("tape_breakable", "  breakable (attention an eager break) vs eager"),
            ("tape_full", "  full (one graph, masked attention) vs eager masked"),
            ("cuda_breakable", "  CUDA breakable vs CUDA eager"),
            ("cuda_full", "  CUDA full vs CUDA eager"),
        ):
            if sp.get(m):
                row(label, [_at(bs, sp[m], b) for b in SPEED_BATCHES], ".2f", "x")
    if hg:
        for arch, r in (hg.get("archs") or {}).items():
            sp = r.get("speedup") or {}
            row(
                f"DecodeRunner.generate vs model.generate(static), {arch}",
                [sp.get(str(b)) for b in SPEED_BATCHES],
                ".2f",
                "x",
            )
            if not r.get("equal"):
                rows[-1] += "  TOKENS DIFFER"
    if ro and ro.get("overhead_us") is not None:
        steps, tiny = ro.get("steps") or {}, ro.get("tiny_per_call_us") or {}
        parts = []
        if tiny.get("runner") is not None and tiny.get("minimal") is not None:
            parts.append(
                f"{tiny['runner'] - tiny['minimal']:+.1f} us on the {steps.get('tiny', 'tiny step')} "
                f"({tiny['runner']:.1f} vs {tiny['minimal']:.1f} us)"
            )
        parts.append(f"{ro['overhead_us']:+.1f} us on the {steps.get('main', 'demo-like step')}")
        rows.append("  host cost of a GraphRunner call over a hand-written replay loop: " + "; ".join(parts))
        if tiny.get("eager") is not None:
            rows.append(
                f"  slower than eager: {steps.get('tiny', 'a tiny step')}: eager "
                f"{tiny['eager']:.1f} us, runner {tiny['runner']:.1f} us "
                f"({ro.get('tiny_ratio_runner_over_eager') or 0:.2f}x eager's time)"
            )
    rows.append("  (ratios: eager time / graph time; above 1.00x the graphs are faster)")
    return rows


def summary_lines(merged: dict[str, Any]) -> list[str]:
    """The suite's summary as text lines: each headline figure once, labelled as the script's own table
    labels it and with the same value, each target marked ``met`` or ``MISSED``; then what was skipped,
    what failed and where the numbers are."""
    s = merged.get("summary", {})
    env = merged.get("environment") or {}
    speed = speed_lines(merged)
    lines = (
        speed
        + ([""] if speed else [])
        + [
            f"[bench] summary: torch threads {merged.get('threads')}, load average "
            f"{', '.join(f'{x:.2f}' for x in env.get('load_average') or [])} (a shared machine is noisy; every "
            f"ratio is measured side by side in one run)"
        ]
    )
    cvc = s.get("capture_vs_compile")
    if cvc:
        if cvc.get("ratio") is not None:
            lines.append(
                f"  capture vs torch.compile, buckets {cvc.get('compile_buckets')}: {cvc['ratio']:.1f}x faster "
                f"({target_note(cvc['ratio'], cvc.get('target_ratio') or 0, at_most=False)})"
            )
        else:
            lines.append(f"  capture vs torch.compile: compile side skipped ({cvc.get('compile_skipped')})")
    lat = s.get("latency_vs_batch")
    if lat and lat.get("speedup"):
        for m, sp in lat["speedup"].items():
            cells = ", ".join(f"b{b}: {x:.2f}x" for b, x in zip(lat["batches"], sp) if x is not None)
            ref = (lat.get("reference") or {}).get(m) or "eager"
            lines.append(f"  latency_vs_batch, {m} speedup vs {ref}: {cells}")
    ro = s.get("runner_overhead")
    if ro and ro.get("ratio_runner_over_minimal") is not None:
        steps = ro.get("steps") or {}
        for key, ratio, target in (
            ("main", "ratio_runner_over_minimal", "target_ratio"),
            ("tiny", "tiny_ratio_runner_over_minimal", "tiny_target_ratio"),
        ):
            if ro.get(ratio) is not None:
                lines.append(
                    f"  runner vs minimal loop, {steps.get(key, key)}: {ro[ratio]:.3f}x "
                    f"({target_note(ro[ratio], ro.get(target) or 0)})"
                )
        if ro.get("first_over_steady_max") is not None:
            lines.append(
                f"  first call of a bucket vs a steady one, {steps.get('tiny', 'tiny')}: max "
                f"{ro['first_over_steady_max']:.2f}x ({target_note(ro['first_over_steady_max'], ro.get('first_target') or 0)})"
            )
            if ro.get("first_over_steady_later_max") is not None:
                # the one definition (bench/runner_overhead.py FIRST_CALL), and where the max comes from
                b1, later = ro.get("first_over_steady_bucket1") or 0.0, ro["first_over_steady_later_max"]
                where = (
                    f"the max is bucket 1's, the runner's first call after capture: nothing is built lazily, it "
                    f"pays {ro.get('first_extra_us') or 0:.0f} us once for CPU caches the capture left cold"
                    if b1 >= later
                    else "the max is a later bucket's"
                )
                lines.append(f"    ({ro.get('first_call')}; {where}; the other buckets' first calls: max {later:.2f}x)")
    tve = s.get("tape_vs_eager")
    for key, model in (("speedup", "llama"), ("speedup_inline", "inline")):
        if tve and tve.get(key):
            lines.append(
                f"  tape_vs_eager, TapeGraph replay vs eager, model {model}: "
                + ", ".join(f"b{b}: {x:.2f}x" for b, x in tve[key].items() if x is not None)
            )
    sweep = s.get("loadtest_sweep")
    if sweep and sweep.get("levels"):
        lines.append("  loadtest sweep (graph vs eager engine, same requests and batches):")
        lines.extend("    " + row for row in loadtest_table(sweep["levels"]))
        lines.extend(f"    NOT CLEAN: {f}" for f in sweep.get("failures") or [])
    for name, reason in merged.get("skipped", {}).items():
        lines.append(f"  skipped {name}: {reason}")
    for name in merged.get("errors", {}):
        lines.append(f"  FAILED {name} (traceback in the JSON under errors.{name})")
    if merged.get("plot_note") and merged["plot_note"] != "no plot requested":
        lines.append(f"  no plot: {merged['plot_note']}")
    lines.append(
        f"[bench] every figure, per round, in {merged.get('out')}"
        + (f"; plot {merged['plot']}" if merged.get("plot") else "")
    )
    return lines


def _print_summary(merged: dict[str, Any], out: Path) -> None:
    print()
    for line in summary_lines({**merged, "out": str(out)}):
        print(line)


def _compile_buckets(text: str) -> str:
    # validated here (one clear error before the suite starts), passed on as written
    if text not in ("all", "none"):
        parse_buckets(text)
    return text


def _add_arguments(p: argparse.ArgumentParser) -> None:
    add_threads_argument(p)
    p.add_argument(
        "--out",
        default=None,
        help=f"merged JSON path; per-script JSON files go next to it (default: {DEFAULT_OUT} "
        "in the repository, wherever the command runs)",
    )
    p.add_argument("--plot", default="auto", help="latency plot PNG path (default: latency_vs_batch.png next to --out)")
    p.add_argument("--no-plot", action="store_true", help="do not draw the plot")
    p.add_argument(
        "--quick",
        action="store_true",
        help="smoke run: few sizes and repetitions, torch.compile skipped (seconds, not minutes)",
    )
    p.add_argument("--only", default="", help=f"comma-separated subset of {','.join(SUITE)}")
    p.add_argument("--skip", default="", help="comma-separated benchmarks not to run")
    p.add_argument(
        "--bench-dir",
        default=None,
        help="directory holding the bench scripts (default: bench/ of the source checkout "
        "next to the graphrunner_tools package; an installed wheel has none)",
    )
    p.add_argument(
        "--compile-buckets",
        default=None,
        type=_compile_buckets,
        help="capture_vs_compile: bucket sizes torch.compile compiles, strictly increasing, "
        "e.g. 1,2,4,8, or 'all' or 'none' (default there: 1,2,4,8; with --quick: skipped)",
    )
    p.add_argument(
        "--device",
        default=None,
        choices=["cpu", "cuda"],
        help="capture_vs_compile: device of the comparison (default cpu)",
    )
    p.add_argument(
        "--step",
        default=None,
        metavar="TARGET",
        help="time your own step instead of the suite: FILE_OR_MODULE:FACTORY returning an uncaptured "
        "GraphRunner, or FILE_OR_MODULE:STEP with --inputs NAME; prints, per batch size, the eager "
        "step against the runner call (median us, speedup, max |graph - eager|)",
    )
    p.add_argument(
        "--inputs",
        default=None,
        metavar="NAME",
        help="--step with a step: its example inputs, a dict of tensors (batch on dim 0) next to it or "
        "FILE_OR_MODULE:NAME",
    )
    p.add_argument(
        "--batches",
        type=parse_int_list,
        default=None,
        help="--step: batch sizes to time, e.g. 1,8,32 (default: the runner's buckets; with --inputs "
        "they are the buckets)",
    )
    p.add_argument(
        "--backend",
        default=None,
        choices=["full", "breakable", "eager"],
        help="--step with --inputs: the runner's backend (default full)",
    )


_DESCRIPTION = (
    "Run the graphrunner benchmark suite (bench/*.py) in one process; write one merged JSON "
    "file and a latency-vs-batch plot. stdout: each script's tables, then the speed table (machine, date; "
    "per call at batch 1/8/32: the demo decoder eager, breakable and full, DecodeRunner.generate vs "
    "model.generate, a runner call's host cost; docs/speed.md), then a summary repeating the "
    "headline figures under the same labels, every target marked met or MISSED; progress on stderr; "
    "every figure (per round too) in the JSON. Timings are never assertions. --step TARGET times your "
    "own step instead: its GraphRunner call against the step eagerly, per batch size (docs/speed.md)."
)


def _split(s: str) -> list[str]:
    return [x.strip() for x in s.split(",") if x.strip()]


def _run_step(args: argparse.Namespace) -> int:
    """``--step TARGET``: time the target's runner against its step eagerly (:mod:`graphrunner_tools.steptime`)."""
    from graphrunner.checks.lint import CheckUsageError
    from graphrunner_tools.steptime import runner_for_target, step_table, time_runner

    try:
        runner = runner_for_target(args.step, args.inputs, args.batches if args.inputs else None, args.backend)
        with torch_threads(args.threads or torch.get_num_threads()):
            result = time_runner(runner, args.batches)
    except CheckUsageError as exc:
        print(f"graphrunner: error: {exc} (see 'graphrunner bench --help')", file=sys.stderr)
        return 2
    for line in step_table(args.step, result):
        print(line)
    if args.out:
        write_json(args.out, {"step": args.step, "environment": environment(), **result}, announce=True)
    return 0


def _run_from_args(args: argparse.Namespace) -> int:
    if args.step is not None:
        return _run_step(args)
    if args.inputs is not None or args.batches is not None or args.backend is not None:
        print(
            "graphrunner: error: --inputs, --batches and --backend go with --step TARGET (see 'graphrunner "
            "bench --help')",
            file=sys.stderr,
        )
        return 2
    extra: dict[str, list[str]] = {}
    if args.compile_buckets is not None:
        extra.setdefault("capture_vs_compile", []).extend(["--compile-buckets", args.compile_buckets])
    if args.device is not None:
        extra.setdefault("capture_vs_compile", []).extend(["--device", args.device])
    try:
        merged = run_suite(
            out=args.out,
            plot=None if args.no_plot else args.plot,
            quick=args.quick,
            only=_split(args.only) or None,
            skip=_split(args.skip),
            bench_dir=args.bench_dir,
            extra_args=extra,
            threads=args.threads,
        )
    except (BenchDirNotFoundError, ValueError) as exc:
        print(f"graphrunner: error: {exc}", file=sys.stderr)
        return 2
    _print_summary(merged, Path(merged["out"]))
    return 1 if merged["errors"] else 0


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``python -m graphrunner_tools.bench`` (same options as ``graphrunner bench``)."""
    p = argparse.ArgumentParser(prog="python -m graphrunner_tools.bench", description=_DESCRIPTION)
    _add_arguments(p)
    p.set_defaults(func=_run_from_args)
    return p


def add_bench_subparser(subparsers: Any) -> argparse.ArgumentParser:
    """Register the ``bench`` subcommand on ``subparsers`` (from ``parser.add_subparsers()``).

    Sets ``func`` so that ``args.func(args)`` runs the suite and returns the
    exit code (0 ok, 1 a script failed, 2 bad options or no ``bench/``).
    Returns the new subparser.
    """
    p = subparsers.add_parser(
        "bench", help="run the benchmark suite; write JSON and a latency plot", description=_DESCRIPTION
    )
    _add_arguments(p)
    p.set_defaults(func=_run_from_args)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``python -m graphrunner_tools.bench``; returns the exit code."""
    args = build_parser().parse_args(None if argv is None else list(argv))
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
