"""The ``graphrunner`` command line: ``graphrunner demo``, ``verify``, ``loadtest``, ``check``, ``bench``, ``plan``,
``serve`` and ``graphrunner --version``.

A bad command line is one line on stderr, ``graphrunner: error: ...``, and exit code 2.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

import torch

import graphrunner
from graphrunner.errors import GraphRunnerError
from graphrunner_tools.bench import add_bench_subparser, parse_buckets
from graphrunner_tools.loadtest import add_loadtest_subparser
from graphrunner_tools.plan import add_plan_subparser
from graphrunner_tools.serve import add_serve_subparser
from graphrunner_tools.threads import add_threads_argument, positive_int, torch_threads


class _ArgumentParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose usage errors are one line on stderr,
    ``graphrunner: error: <message> (see '<prog> --help')``, and exit code 2
    (subcommand parsers inherit it)."""

    def error(self, message: str) -> None:  # type: ignore[override]
        """Print the one-line error and exit 2 (``SystemExit``)."""
        self.exit(2, f"graphrunner: error: {message} (see '{self.prog} --help')\n")


def _check_device(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    # --device cuda (demo and bench) on a machine without CUDA is a user error, found before any work.
    if getattr(args, "device", None) == "cuda" and not torch.cuda.is_available():
        other = "tape (or auto)" if args.command in ("demo", "loadtest") else "cpu"
        parser.error(
            "argument --device: cuda was requested but torch.cuda.is_available() is False on this "
            f"machine; use --device {other}"
        )
    trace_out = getattr(args, "trace_out", "")
    if trace_out:
        # The trace is written at the end of the run: find an unwritable path now, not after the work.
        folder = os.path.dirname(os.path.abspath(trace_out))
        try:
            os.makedirs(folder, exist_ok=True)
            with tempfile.TemporaryFile(dir=folder):
                pass
        except OSError as exc:
            parser.error(
                f"argument --trace-out: cannot write the trace files under {folder!r} "
                f"({exc.strerror or exc}); pass another prefix, or '' to write none"
            )


def _check_loadtest(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    # A level above --requests never runs more requests at once than there are, but sizes the
    # engine (KV-cache rows, buckets) for it: --concurrency 100000 with --requests 1 grew past 9 GB.
    requests, levels = getattr(args, "requests", None), getattr(args, "concurrency", None)
    if requests is None or not levels:
        return
    over = [c for c in levels if c > requests]
    if over:
        fit = sorted({min(c, requests) for c in levels})
        parser.exit(
            2,
            f"graphrunner: error: argument --concurrency: level{'s' if len(over) > 1 else ''} "
            f"{','.join(map(str, over))} exceed{'' if len(over) > 1 else 's'} --requests {requests} (a "
            f"level is the most requests running together); pass --concurrency "
            f"{','.join(map(str, fit))}, or more --requests (see 'graphrunner loadtest --help')\n",
        )


def _demo(args: argparse.Namespace) -> int:
    from graphrunner_tools.demo import run_demo

    with torch_threads(args.threads):
        result = run_demo(
            backend=args.backend,
            device=args.device,
            steps=args.steps,
            buckets=args.buckets,
            max_batch=args.max_batch,
            seed=args.seed,
            layers=args.layers,
            trace_out=args.trace_out or None,
            progress=not args.no_progress,
        )
    return 0 if result.ok else 1


def _verify(args: argparse.Namespace) -> int:
    from graphrunner_tools.launch import torchrun_env
    from graphrunner_tools.spec import MLP_WIDTH, run_spec, run_spec_joined, run_spec_ranks

    problem = None
    try:
        env = torchrun_env()
    except ValueError as exc:
        env, problem = None, str(exc)
    joined = env is not None and env.world_size > 1
    if env is not None and args.ranks not in (None, env.world_size):
        problem = (
            f"argument --ranks: {args.ranks}, but this process is a torchrun worker of WORLD_SIZE="
            f"{env.world_size}, and under torchrun the ranks are torchrun's; drop --ranks (or pass --ranks "
            f"{env.world_size})"
        )
    args.ranks = env.world_size if env is not None else (args.ranks or 1)
    if problem is None and max(args.reqs_buckets) < args.requests:
        problem = (
            f"argument --reqs-buckets: the largest ({max(args.reqs_buckets)}) must hold all "
            f"{args.requests} requests; add a bucket or pass fewer --requests"
        )
    elif problem is None and MLP_WIDTH % args.ranks:
        problem = f"argument --ranks: {args.ranks} does not divide the MLP width {MLP_WIDTH}; use 1, 2, 3, 4, 6 or 8"
    if problem:
        print(f"graphrunner: error: {problem} (see 'graphrunner verify --help')", file=sys.stderr)
        return 2
    kwargs = dict(
        requests=args.requests,
        max_new=args.max_new,
        k=args.k,
        reqs_buckets=args.reqs_buckets,
        draft_buckets=args.draft_buckets,
        backend=args.backend,
        seed=args.seed,
        layers=args.layers,
        agree=not args.unsafe_no_agreement,
        group_timeout=args.group_timeout,
        plant_mismatch=args.plant_mismatch,
        progress=not args.no_progress,
    )
    if args.ranks == 1:
        with torch_threads(args.threads):
            return 0 if run_spec(**kwargs).ok else 1
    if joined:  # under torchrun: this process is one rank; rank 0 prints the summary
        rank, results = run_spec_joined(threads=args.threads, **kwargs)
        failed = [o for o in results if not o.ok or not o.value.ok]
        if rank != 0:
            if not results[rank].ok:
                print(f"graphrunner verify: rank {rank} failed: {results[rank].error}", file=sys.stderr)
            return 1 if failed else 0
    else:
        results = run_spec_ranks(args.ranks, timeout=args.timeout, threads=args.threads, **kwargs)
        failed = [o for o in results if not o.ok or not o.value.ok]
    for o in results:
        if not o.ok:
            print(f"graphrunner verify: rank {o.rank} failed: {o.error}", file=sys.stderr)
        else:
            r = o.value
            print(f"rank {r.rank}: {r.mismatches} mismatches, replays {r.replays}, fallbacks {r.fallbacks}")
    print(f"verify on {args.ranks} ranks: " + ("OK" if not failed else f"FAILED ({len(failed)} rank(s))"))
    return 1 if failed else 0


def _check(args: argparse.Namespace) -> int:
    from graphrunner.checks.lint import CheckUsageError, check_factory
    from graphrunner_tools.targets import check_step, load_factory, load_target

    try:
        if args.inputs is None:
            if args.buckets is not None or args.backend is not None:
                raise CheckUsageError(
                    "--buckets and --backend configure a step checked with --inputs; a factory "
                    "configures its GraphRunner itself (drop them, or pass --inputs NAME)"
                )
            report = check_factory(load_factory(args.target), args.target)
        else:
            module, step = load_target(args.target)
            if not callable(step):
                raise CheckUsageError(f"{args.target} is {type(step).__name__}, not a callable step")
            if ":" in args.inputs:
                inputs, what = load_target(args.inputs)[1], args.inputs
            else:
                source = args.target.rpartition(":")[0]
                if not hasattr(module, args.inputs):
                    raise CheckUsageError(
                        f"argument --inputs: {source!r} has no attribute {args.inputs!r}; name a "
                        "dict of example tensors defined next to the step, or FILE_OR_MODULE:NAME"
                    )
                inputs, what = getattr(module, args.inputs), args.inputs
            report = check_step(
                step, inputs, args.buckets, args.backend or "breakable", args.target, what=f"--inputs {what}"
            )
    except CheckUsageError as exc:  # a target that cannot be checked: a usage error, one line
        print(f"graphrunner: error: {exc} (see 'graphrunner check --help')", file=sys.stderr)
        return 2
    print(report.to_json() if args.json else report.table())
    return 0 if report.ok else 1


def build_parser() -> argparse.ArgumentParser:
    """Return the argument parser of the ``graphrunner`` command."""
    parser = _ArgumentParser(prog="graphrunner", description="Graph capture and replay for PyTorch inference steps.")
    parser.add_argument(
        "--version",
        action="version",
        version=f"graphrunner {graphrunner.__version__}",
        help="print 'graphrunner <version>' and exit",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser(
        "demo",
        help="capture a Llama-style decoder per bucket, serve decode steps checked against eager, graphs vs eager",
        description="Build a small Llama-style decoder (random weights), capture its decode step through "
        "GraphRunner once per bucket, serve decode steps with random batch sizes (by default 1 to the "
        "largest bucket, so every call replays a graph; --max-batch above it shows the eager fallback), "
        "check every call against eager PyTorch, print the capture report (with a legend line), the "
        "fallbacks, a latency table of graphs vs eager per bucket with a speed line saying what the ratio "
        "means on this device, the trace checker's verdict, and write the trace. Exits 1 on any mismatch "
        "or protocol violation, 2 (one line on stderr) for a bad command line.",
    )
    demo.add_argument(
        "--backend",
        default="full",
        choices=["full", "breakable", "eager"],
        help="full: one graph per bucket, capturable masked attention (default); breakable: attention is "
        "an eager break between graph segments; eager: no graph",
    )
    demo.add_argument(
        "--device",
        default="auto",
        choices=["auto", "tape", "cuda"],
        help="graph kind: cuda when available, else tape (default: auto); cuda without a GPU is an error",
    )
    demo.add_argument("--steps", type=positive_int, default=200, help="decode steps to serve (default: 200)")
    demo.add_argument(
        "--buckets",
        type=parse_buckets,
        default=[1, 2, 4, 8, 16, 32],
        help="comma-separated batch buckets, strictly increasing (default: 1,2,4,8,16,32)",
    )
    demo.add_argument(
        "--max-batch",
        type=positive_int,
        default=None,
        help="largest batch size drawn (default: the largest bucket, so no call falls back); above the "
        "largest bucket a call runs eagerly, an eager fallback",
    )
    demo.add_argument("--layers", type=positive_int, default=4, help="decoder layers (default: 4)")
    demo.add_argument("--seed", type=int, default=0, help="seed of weights and batches (default: 0)")
    demo.add_argument(
        "--trace-out",
        default="graphrunner-demo-trace",
        help="path prefix of the trace files <prefix>.jsonl and <prefix>.chrome.json "
        "(default: graphrunner-demo-trace; '' writes none)",
    )
    demo.add_argument(
        "--no-progress",
        action="store_true",
        help="no progress output on stderr (redrawn in place on a terminal, plain lines otherwise)",
    )
    add_threads_argument(demo)
    demo.set_defaults(func=_demo)
    add_loadtest_subparser(sub)
    verify = sub.add_parser(
        "verify",
        help="speculative decoding: capture the verify step per (reqs, draft) tier, check against eager",
        description="Serve the demo decoder (random weights) with a draft-and-verify loop: each step every request "
        "proposes 1..K draft tokens (seeded), the verify step over [reqs, draft] cells (padding masked) "
        "is captured per (reqs, draft) tier and replayed, and accepted tokens (greedy) are checked "
        "against an independent eager model token for token and against plain greedy decoding. With "
        "--ranks N, N gloo processes split the MLP tensor-parallel (an all_reduce inside the captured "
        "step); each rank pads to its own local tier and the runner's agreement makes them replay the "
        "same key. Under torchrun (one node or several) every process runs its own rank in torchrun's "
        "group (env://) and rank 0 prints the summary. Prints requests, steps, tokens, replays per "
        "tier, fallbacks and mismatches; exits 1 on any mismatch or failed rank, 2 for a bad command "
        "line.",
    )
    verify.add_argument(
        "--backend",
        default="breakable",
        choices=["full", "breakable"],
        help="breakable: attention is an eager break (default); full: one graph per tier",
    )
    verify.add_argument("--requests", type=positive_int, default=6, help="requests served (default: 6)")
    verify.add_argument("--max-new", type=positive_int, default=16, help="new tokens per request (default: 16)")
    verify.add_argument("--k", type=positive_int, default=4, help="most draft tokens per request and step (default: 4)")
    verify.add_argument(
        "--reqs-buckets",
        type=parse_buckets,
        default=[1, 2, 4, 8],
        help="requests tiers, strictly increasing; the largest must hold --requests (default: 1,2,4,8)",
    )
    verify.add_argument(
        "--draft-buckets",
        type=parse_buckets,
        default=[2, 4, 6],
        help="cells per request (last token + drafts) tiers; more cells than the largest means "
        "eager fallback (default: 2,4,6)",
    )
    verify.add_argument(
        "--ranks",
        type=positive_int,
        default=None,
        help="gloo processes started by torch's elastic launcher, tensor-parallel MLP (default: 1; "
        "under torchrun: torchrun's WORLD_SIZE, each process running its own rank); must divide "
        "the MLP width 192",
    )
    verify.add_argument("--layers", type=positive_int, default=2, help="decoder layers (default: 2)")
    verify.add_argument("--seed", type=int, default=0, help="seed of weights, prompts and drafts (default: 0)")
    verify.add_argument(
        "--group-timeout", type=float, default=30.0, help="seconds a collective may take before it fails (default: 30)"
    )
    verify.add_argument(
        "--timeout",
        type=float,
        default=600.0,
        help="seconds the whole --ranks N run may take before the ranks are killed (default: 600; "
        "under torchrun the deadline is torchrun's, each collective bounded by --group-timeout)",
    )
    verify.add_argument("--no-progress", action="store_true", help="no progress line (shown only on a terminal)")
    # test-only: break the run on purpose (the tests' negative controls)
    verify.add_argument("--unsafe-no-agreement", action="store_true", help=argparse.SUPPRESS)
    verify.add_argument("--plant-mismatch", action="store_true", help=argparse.SUPPRESS)
    add_threads_argument(verify)
    verify.set_defaults(func=_verify)
    add_bench_subparser(sub)
    add_plan_subparser(sub)
    check = sub.add_parser(
        "check",
        help="lint a GraphRunner for capture safety on a CPU: every unsafe op, drift, padding leak and capture error",
        description="Call FACTORY (a zero-argument callable returning an uncaptured GraphRunner) once, or build "
        "a runner from STEP and example inputs (--inputs NAME), and capture it on its device (the "
        "tape on a CPU) with every check collecting findings instead of raising, in one pass: every "
        "capture-unsafe op (host reads such as .item(), data-dependent shapes; one extra warmup is "
        "linted), every @no_graph function that returns a Python value (frozen into the graph after "
        "the break), every drift (Python state that changes between calls and that a graph would "
        "freeze), padding leaking into real outputs, a step that raises, and any other capture "
        "error, each with its source file:line and a fix (@no_graph the enclosing function and "
        "return tensors from it, or make the value an input when the line is inside a library). "
        "Exits 1 on any finding, 0 on none, 2 (one line on stderr) when the target cannot be "
        "checked: not found, a directory, a step without --inputs, a factory that raises, calls "
        "sys.exit or returns no runner.",
    )
    check.add_argument(
        "target",
        metavar="FILE_OR_MODULE:FACTORY",
        help="a .py file or an importable module, then ':' and the factory's name "
        "(e.g. model.py:make_runner or mypkg.serve:make_runner), or a step's name with "
        "--inputs",
    )
    check.add_argument(
        "--inputs",
        metavar="NAME",
        default=None,
        help="the target is a step (it takes the inputs as arguments): NAME is a dict {argument: "
        "example tensor with the batch on dim 0} (or a zero-argument function returning one) "
        "in the target's module, or FILE_OR_MODULE:NAME; integer inputs are bounded by the "
        "examples' min and max",
    )
    check.add_argument(
        "--buckets",
        type=parse_buckets,
        default=None,
        help="with --inputs: batch buckets, strictly increasing (default: the examples' batch size)",
    )
    check.add_argument(
        "--backend",
        choices=["breakable", "full"],
        default=None,
        help="with --inputs: the backend to check against (default: breakable)",
    )
    check.add_argument("--json", action="store_true", help="print the findings as JSON instead of a table")
    check.set_defaults(func=_check)
    add_serve_subparser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``graphrunner`` console script; returns the exit code.

    A bad command line (unknown option, bad value, buckets not strictly
    increasing, ``--threads`` above 4 per usable core, ``--device cuda``
    without CUDA, a ``--trace-out`` or loadtest ``--json`` that cannot be
    written, a loadtest ``--ranks`` that does not divide the decoder, a
    loadtest ``--concurrency`` level above ``--requests``, ``--inject-fault
    stall`` on one rank) returns 2 after one line on stderr,
    ``graphrunner: error: ...``; no traceback. A run that fails with a
    graphrunner error (a :class:`~graphrunner.errors.CaptureError` such as a
    drift, a rank timeout) returns 1 after ``graphrunner <command>: <error
    type>: <message>`` on stderr. A closed stdout pipe
    (``graphrunner demo | head``) returns 1 quietly.
    """
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
        _check_device(parser, args)
        check = getattr(args, "check", None)
        if check is not None:  # a subcommand's own post-parse usage checks (exit 2 via parser.error)
            check(parser, args)
        if args.command == "loadtest":
            _check_loadtest(parser, args)
    except SystemExit as exc:  # argparse: --help (0) or a usage error (2)
        return int(exc.code or 0)
    try:
        return int(args.func(args) or 0)
    except GraphRunnerError as exc:  # the run failed for a reason the message states; no traceback
        print(f"graphrunner {args.command}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    except BrokenPipeError:  # e.g. `graphrunner demo | head`: the reader left; not an error of ours
        # Point stdout at devnull so the interpreter's final flush does not raise again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


if __name__ == "__main__":
    sys.exit(main())
