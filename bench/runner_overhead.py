"""Per-call overhead of GraphRunner against a hand-written minimal loop.

Both drive the SAME captured graphs (the runner's backend) on the same
sequence of random batch sizes, interleaved in one process:

- ``runner``:  ``runner(**inputs)`` (validation, bucket lookup, copy, padding,
  replay, slicing, stats).
- ``minimal``: bisect the bucket, copy each input into the static buffer,
  ``backend.replay(bucket)``, slice the output. No validation, no padding.
- ``debug``: the same step in a second runner with ``debug=True`` (bounds
  of both index inputs checked, externals checked before each replay); the
  ``runner`` variant declares the same bounds with debug off, so the pair
  shows what debug mode costs per call and that off costs nothing.

It also reports the capture-time cost of the padding-leak check: the
seconds its extra forwards took (``leak_check_seconds``) against the whole
capture, and a capture of the same runner without it (``checks=("drift", "fingerprint")``).

It also times the issue-20 target: a tiny step with 2 inputs, the runner against
the minimal loop (target <= 1.10x, JSON ``tiny_two_inputs``) and against the step run eagerly
(``ratio_runner_over_eager``: a step this small is faster eagerly), and the first call
of a bucket against a steady one (target <= 3x; :data:`FIRST_CALL` is the one definition,
used by ``graphrunner bench``, docs/benchmarks.md and the README too: the first runner call
of each bucket after capture, buckets in increasing order, so bucket 1's is the runner's
first call at all, against the median of that bucket's 11th-40th calls).

Prints tables (the per-call medians, each ratio once with its target, marked
``met`` or ``MISSED``) and writes everything, per-round times included, to JSON
(``--out``, default ``bench/results/runner_overhead.json``). Not a test: it
never fails on a timing.

With ``--agree-ranks N`` (N >= 2) it also runs N gloo processes, each serving
its own random batch sizes through a multi-rank runner, and times the per-call
cost of the agreement side by side, interleaved: ``one`` (today's one
``all_max_vector`` per call) against ``two`` (the same runner with the old
protocol's two scalar collectives per call, ``all_max`` then ``all_min``,
through a shim group), plus the bare collectives alone.

    python bench/runner_overhead.py [--backend full|breakable] [--hidden 256] [--reps 7] [--agree-ranks 2]
"""

from __future__ import annotations

import argparse
import bisect
import os
import platform
import random
import statistics
import time

import torch

import graphrunner
from graphrunner.breakable import no_graph
from graphrunner.runner import BatchInput, GraphRunner
from graphrunner_tools.bench import environment, target_note, write_json


def build_step(hidden: int, vocab: int, layers: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    emb = torch.randn(vocab, hidden, generator=g) / 4
    ws = [torch.randn(hidden, hidden, generator=g) / hidden**0.5 for _ in range(layers)]

    @no_graph
    def host_part(h):  # one eager break (used by the breakable backend)
        return h

    def step(input_ids, positions, hidden_in):
        h = emb[input_ids] + hidden_in + positions[:, None].to(hidden_in.dtype) * 1e-3
        for i, w in enumerate(ws):
            h = torch.nn.functional.silu(h @ w)
            if i == 0:
                h = host_part(h)
        return h

    return step


def tiny_overhead(args) -> dict:
    """The issue-20 target: a tiny step with 2 inputs (``x * w + y``, 16 floats a row), the runner
    against the minimal hand loop on the same graphs and against the step run eagerly (a step this
    small is faster eagerly: copying inputs in and replaying cost more than its two element-wise ops), interleaved
    rounds, under ``no_grad`` as an engine serves; and the first call of a bucket (:data:`FIRST_CALL`)."""
    w = torch.randn(16, generator=torch.Generator().manual_seed(args.seed))

    def step(x, y):
        return x * w + y

    buckets = [1, 2, 4, 8, 16, 32]
    inputs = {"x": BatchInput(trailing=(16,)), "y": BatchInput(trailing=(16,))}
    runner = GraphRunner(step, inputs, buckets, backend=args.backend, device=args.device, progress=False)
    runner.capture()
    # The first call of a bucket (FIRST_CALL): the runner's first call of each bucket after capture, timed
    # alone, buckets in increasing order (so bucket 1's is also the runner's first call at all), against
    # the median of that bucket's steady calls (its 11th to 40th call).
    first, steady = [], []
    for b in buckets:
        x, y = torch.randn(b, 16), torch.randn(b, 16)
        t0 = time.perf_counter()
        runner(x=x, y=y)
        first.append(time.perf_counter() - t0)
        ts = []
        for _ in range(39):
            t0 = time.perf_counter()
            runner(x=x, y=y)
            ts.append(time.perf_counter() - t0)
        steady.append(statistics.median(ts[9:]))
    bufs, backend = runner.static_inputs, runner.backend

    def minimal(batch):
        n = batch["x"].shape[0]
        b = buckets[bisect.bisect_left(buckets, n)]
        bufs["x"][:n].copy_(batch["x"])
        bufs["y"][:n].copy_(batch["y"])
        return backend.replay(b)[:n]

    rng = random.Random(args.seed + 1)
    batches = []
    for _ in range(args.calls):
        n = rng.randint(1, buckets[-1])
        batches.append({"x": torch.randn(n, 16), "y": torch.randn(n, 16)})
    times = {"runner": [], "minimal": [], "eager": []}
    with torch.no_grad():
        for batch in batches[:20]:
            assert torch.equal(runner(**batch), minimal(batch)), "runner and minimal loop disagree"
            assert torch.equal(runner(**batch), step(**batch)), "runner and eager disagree"
        variants = {
            "runner": lambda: [runner(**b) for b in batches],
            "minimal": lambda: [minimal(b) for b in batches],
            "eager": lambda: [step(**b) for b in batches],
        }
        for fn in variants.values():
            fn()
        for rep in range(max(args.reps, 9)):
            for name in list(variants) if rep % 2 == 0 else list(reversed(variants)):
                t0 = time.perf_counter()
                variants[name]()
                times[name].append((time.perf_counter() - t0) / len(batches))
    med = {k: statistics.median(v) * 1e6 for k, v in times.items()}
    ratios = [f / s for f, s in zip(first, steady)]
    later = ratios[1:]
    return {
        "first_call": FIRST_CALL,
        "first_over_steady_later_max": max(later),
        "first_extra_us": (first[0] - steady[0]) * 1e6,
        "per_call_us": med,
        "ratio_runner_over_minimal": med["runner"] / med["minimal"],
        "target_ratio": 1.10,
        "ratio_runner_over_eager": med["runner"] / med["eager"],
        "per_call_us_all_rounds": {k: [x * 1e6 for x in v] for k, v in times.items()},
        "first_replay_us": [f * 1e6 for f in first],
        "steady_replay_us": [s * 1e6 for s in steady],
        "first_over_steady": ratios,
        "first_over_steady_max": max(ratios),
        "first_target": 3.0,
    }


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backend", default="full", choices=["full", "breakable", "eager"])
    ap.add_argument("--device", default="auto")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--calls", type=int, default=300, help="calls per timed round")
    ap.add_argument("--reps", type=int, default=7, help="interleaved rounds per variant")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch intra-op threads (default 1: per-call timings on a shared CPU stay stable)",
    )
    ap.add_argument(
        "--agree-ranks",
        type=int,
        default=0,
        help="also time the multi-rank agreement (one vs two collectives per call) on N gloo ranks",
    )
    ap.add_argument("--out", default=os.path.join("bench", "results", "runner_overhead.json"))
    args = ap.parse_args(argv)
    if args.agree_ranks == 1 or args.agree_ranks < 0:
        ap.error("--agree-ranks must be 0 (off) or >= 2")

    torch.set_num_threads(max(1, args.threads))
    vocab, buckets = 1000, [1, 2, 4, 8, 16, 32]
    step = build_step(args.hidden, vocab, args.layers, args.seed)
    inputs = {
        "input_ids": BatchInput(trailing=(), dtype=torch.long, pad=0, bounds=(0, vocab - 1)),
        "positions": BatchInput(trailing=(), dtype=torch.long, pad=0, bounds=(0, 4095)),
        "hidden_in": BatchInput(trailing=(args.hidden,), dtype=torch.float32, pad=0.0),
    }
    # Capture once without the leak check first (the first capture of a process also pays lazy
    # initialisation), then the runner with it: the two totals compare like with like.
    plain = GraphRunner(
        step,
        inputs,
        buckets,
        backend=args.backend,
        device=args.device,
        progress=False,
        debug=False,
        checks=("drift", "fingerprint"),
    )
    plain.capture()
    plain.cleanup()
    plain_s = plain.capture().total_seconds
    plain.cleanup()
    runner = GraphRunner(step, inputs, buckets, backend=args.backend, device=args.device, progress=False, debug=False)
    report = runner.capture()
    leak_s = sum(float(b.info.get("leak_check_seconds", 0.0)) for b in report.buckets)
    debug_runner = GraphRunner(
        step, inputs, buckets, backend=args.backend, device=args.device, progress=False, debug=True
    )
    debug_report = debug_runner.capture()
    tdev = runner.torch_device

    rng = random.Random(args.seed)
    gen = torch.Generator().manual_seed(args.seed)
    batches = []
    for _ in range(args.calls):
        n = rng.randint(1, buckets[-1])
        batches.append(
            {
                "input_ids": torch.randint(0, vocab, (n,), generator=gen).to(tdev),
                "positions": torch.randint(0, 4096, (n,), generator=gen).to(tdev),
                "hidden_in": torch.randn(n, args.hidden, generator=gen).to(tdev),
            }
        )

    # The hand-written loop over the runner's own captured graphs and buffers.
    bufs = runner.static_inputs
    names = list(inputs)
    backend = runner.backend

    def minimal(batch):
        n = batch["input_ids"].shape[0]
        b = buckets[bisect.bisect_left(buckets, n)]
        for name in names:
            bufs[name][:n].copy_(batch[name])
        return backend.replay(b)[:n]

    def run_runner():
        for batch in batches:
            runner(**batch)
        runner.device.synchronize()

    def run_minimal():
        for batch in batches:
            minimal(batch)
        runner.device.synchronize()

    def run_debug():
        for batch in batches:
            debug_runner(**batch)
        runner.device.synchronize()

    # Same results (sanity) and warm both paths.
    for batch in batches[:20]:
        a = runner(**batch).clone()
        bmin = minimal(batch)
        assert torch.equal(a, bmin), "runner and minimal loop disagree"
        assert torch.equal(a, debug_runner(**batch)), "debug runner disagrees"
    run_runner()
    run_minimal()
    run_debug()

    times = {"runner": [], "minimal": [], "debug": []}
    for rep in range(args.reps):
        order = [("runner", run_runner), ("minimal", run_minimal), ("debug", run_debug)]
        if rep % 2:
            order.reverse()
        for name, fn in order:
            t0 = time.perf_counter()
            fn()
            times[name].append((time.perf_counter() - t0) / args.calls)

    med = {k: statistics.median(v) for k, v in times.items()}
    ratio = med["runner"] / med["minimal"]
    best = {k: min(v) for k, v in times.items()}
    result = {
        "benchmark": "runner_overhead",
        "graphrunner": graphrunner.__version__,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "device": report.device,
        "backend": report.backend,
        "hidden": args.hidden,
        "layers": args.layers,
        "buckets": buckets,
        "calls_per_round": args.calls,
        "rounds": args.reps,
        "per_call_us": {k: v * 1e6 for k, v in med.items()},
        "per_call_us_all_rounds": {k: [x * 1e6 for x in v] for k, v in times.items()},
        "overhead_us": (med["runner"] - med["minimal"]) * 1e6,
        "ratio_runner_over_minimal": ratio,
        "per_call_us_best_round": {k: v * 1e6 for k, v in best.items()},
        "ratio_best_rounds": best["runner"] / best["minimal"],
        "threads": args.threads,
        "environment": environment(),
        "target_ratio": 1.25,
        "debug_mode": {
            "per_call_us_off": med["runner"] * 1e6,
            "per_call_us_on": med["debug"] * 1e6,
            "ratio_on_over_off": med["debug"] / med["runner"],
            "externals_checked_per_replay": max(int(b.info.get("externals_read", 0)) for b in debug_report.buckets),
            "capture_seconds_off": report.total_seconds,
            "capture_seconds_on": debug_report.total_seconds,  # + recording the externals in the last warmups
        },
        "leak_check": {
            "capture_seconds_with": report.total_seconds,
            "capture_seconds_without": plain_s,
            "leak_check_seconds": leak_s,
            "keys_checked": sum(1 for b in report.buckets if b.info.get("leak_check_sizes")),
        },
    }
    result["tiny_two_inputs"] = tiny_overhead(args)
    result["steps"] = {"main": LABELS["main"].format(layers=args.layers, hidden=args.hidden), "tiny": LABELS["tiny"]}
    print_tables(result, args)
    if args.agree_ranks:
        agreement = run_agreement(args)
        result["agreement"] = agreement
        us = agreement["per_call_us"]
        print(
            f"\nagreement on {args.agree_ranks} gloo ranks ({args.calls} calls x {args.reps} interleaved rounds, rank 0)"
        )
        print(f"  runner, two collectives/call (old) : {us['runner_two']:9.1f} us/call")
        print(
            f"  runner, one collective/call (now)  : {us['runner_one']:9.1f} us/call  "
            f"ratio now/old {agreement['ratio_runner_one_over_two']:.3f}x"
        )
        print(f"  bare all_max + all_min             : {us['bare_two']:9.1f} us/call")
        print(
            f"  bare all_max_vector                : {us['bare_one']:9.1f} us/call  "
            f"ratio {agreement['ratio_bare_one_over_two']:.3f}x"
        )
    write_json(args.out, result, announce=True)
    return result


#: What "the first call of a bucket" means in this script, ``graphrunner bench``, docs/benchmarks.md and the
#: README (one definition): the first ``runner(...)`` call of each bucket after ``capture()``, timed alone,
#: buckets in increasing order (bucket 1's is also the runner's first call at all), against the median of
#: that bucket's steady calls (its 11th to 40th). Nothing is built lazily at it: the replay engines are
#: traced and run once at capture, the routes, views and expected shapes are prepared at capture end,
#: and torch's copy kernels are warmed then. What remains is the runner's very first call paying for CPU
#: caches the capture left cold (tens of microseconds, once); the first calls of the other buckets show
#: what a bucket costs the first time (``first_over_steady_later_max``).
FIRST_CALL = (
    "the first runner call of each bucket after capture (buckets in increasing order: bucket 1's is the "
    "runner's first call at all) vs the median of its 11th-40th calls"
)

#: the labels of the two runner-vs-minimal-loop steps (the JSON's ``steps``): this script's table and
#: ``graphrunner bench``'s summary print the same label with the same figure
LABELS = {"main": "demo-like step ({layers} layers, hidden {hidden})", "tiny": "tiny 2-input step (x * w + y)"}


def print_tables(result: dict, args) -> None:
    """The run as tables (stdout): per-call time of the runner against the minimal loop for both steps, each
    ratio once with its target (met or MISSED), debug mode's cost, the first replay per bucket, capture costs.
    The per-round times and the best rounds are in the JSON only."""
    tiny, us = result["tiny_two_inputs"], result["per_call_us"]
    dm, lc = result["debug_mode"], result["leak_check"]
    print(
        f"runner_overhead: GraphRunner per call vs a minimal hand loop over the same graphs ({result['backend']} "
        f"backend on {result['device']}; medians of {result['rounds']} (tiny: {max(args.reps, 9)}) interleaved "
        f"rounds of {args.calls} calls)"
    )
    steps = result["steps"]
    rows = [
        (steps["main"], us["minimal"], us["runner"], result["ratio_runner_over_minimal"], result["target_ratio"]),
        (
            steps["tiny"],
            tiny["per_call_us"]["minimal"],
            tiny["per_call_us"]["runner"],
            tiny["ratio_runner_over_minimal"],
            tiny["target_ratio"],
        ),
    ]
    print(f"  {'step':<40} {'minimal us':>10} {'runner us':>10} {'ratio':>7}")
    for label, minimal, runner, ratio, target in rows:
        print(f"  {label:<40} {minimal:>10.1f} {runner:>10.1f} {ratio:>6.3f}x  {target_note(ratio, target)}")
    if tiny["per_call_us"].get("eager") is not None:
        print(
            f"  {'  the same step eagerly (no graph)':<40} {'':>10} {tiny['per_call_us']['eager']:>10.1f}  the "
            f"runner takes {tiny['ratio_runner_over_eager']:.2f}x eager's time: a step this small is faster eagerly"
        )
    print(
        f"  {'demo-like step, debug=True':<40} {'':>10} {dm['per_call_us_on']:>10.1f} "
        f"{dm['ratio_on_over_off']:>6.2f}x  of debug off; {dm['externals_checked_per_replay']} externals checked "
        f"per replay"
    )
    print(f"  first call of a bucket: {FIRST_CALL}; {steps['tiny']}:")
    print(f"  {'bucket':>8} {'first us':>9} {'steady us':>10} {'ratio':>7}")
    for b, f, st, r in zip(
        [1, 2, 4, 8, 16, 32], tiny["first_replay_us"], tiny["steady_replay_us"], tiny["first_over_steady"]
    ):
        print(f"  {b:>8} {f:>9.1f} {st:>10.1f} {r:>6.2f}x")
    print(
        f"  {'max':>8} {'':>9} {'':>10} {tiny['first_over_steady_max']:>6.2f}x  "
        f"{target_note(tiny['first_over_steady_max'], tiny['first_target'])}"
    )
    print(f"  {'':>8} {'':>9} {'':>10} {'':>7}  {first_call_note(tiny)}")
    print(
        f"  capture: debug off {dm['capture_seconds_off']:.3f}s, on {dm['capture_seconds_on']:.3f}s; with the "
        f"padding check {lc['capture_seconds_with']:.3f}s (its extra forwards on {lc['keys_checked']} keys "
        f"{lc['leak_check_seconds']:.3f}s), without {lc['capture_seconds_without']:.3f}s"
    )


def first_call_note(tiny: dict) -> str:
    """The line under the first-call row: where the max comes from (``graphrunner bench`` prints it too)."""
    later = tiny.get("first_over_steady_later_max")
    if later is None:
        return ""
    where = (
        "the max is bucket 1's, the runner's first call after capture: nothing is built lazily there, it "
        f"pays {tiny['first_extra_us']:.0f} us once for CPU caches the capture left cold"
        if tiny["first_over_steady"][0] >= later
        else "the max is a later bucket's"
    )
    return f"{where}; the first calls of the other buckets: max {later:.2f}x"


class _TwoCollectives:
    """The old per-call agreement on a real group: ``all_max`` of the batch,
    then ``all_min`` of the flag (two collectives), behind ``all_max_vector``."""

    def __init__(self, inner):
        self.inner, self.rank, self.size = inner, inner.rank, inner.size

    def barrier(self, **kw):
        return self.inner.barrier(**kw)

    def all_max(self, v, **kw):
        return self.inner.all_max(v, **kw)

    def all_min(self, v, **kw):
        return self.inner.all_min(v, **kw)

    def all_max_vector(self, v, **kw):
        sizes = [self.inner.all_max(x, **kw) for x in v[:-1]]
        return sizes + [-self.inner.all_min(-v[-1], **kw)]


def _agreement_rank(rank, world, init, args, queue):
    import torch.distributed as dist

    from graphrunner.group import TorchDistGroup

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        group = TorchDistGroup(timeout=60)
        buckets = [1, 2, 4, 8, 16, 32]
        inputs = {"x": BatchInput(trailing=(args.hidden,), dtype=torch.float32, pad=0.0)}
        runner = GraphRunner(
            lambda x: x * 2.0, inputs, buckets, backend=args.backend, device="tape", group=group, progress=False
        )
        runner.capture()
        rng = random.Random(args.seed * 100 + rank)
        batches = [torch.randn(rng.randint(1, buckets[-1]), args.hidden) for _ in range(args.calls)]
        two = _TwoCollectives(group)

        def runner_with(g):
            def run():
                runner.server.agreement.group = g  # the runner's one agreement object (graphrunner.agreement)
                for b in batches:
                    runner(x=b)

            return run

        def bare_two():
            for b in batches:
                group.all_max(b.shape[0], phase="bench", key=0)
                group.all_min(1, phase="bench", key=0)

        def bare_one():
            for b in batches:
                group.all_max_vector([b.shape[0], 0], phase="bench", key=0)

        variants = {
            "runner_one": runner_with(group),
            "runner_two": runner_with(two),
            "bare_one": bare_one,
            "bare_two": bare_two,
        }
        for fn in variants.values():  # warm up
            fn()
        times = {k: [] for k in variants}
        for rep in range(args.reps):
            names = list(variants) if rep % 2 == 0 else list(reversed(variants))
            for name in names:
                group.barrier(phase="bench", key=rep)
                t0 = time.perf_counter()
                variants[name]()
                times[name].append((time.perf_counter() - t0) / args.calls)
        runner.group = group
        queue.put((rank, times))
    finally:
        dist.destroy_process_group()


def run_agreement(args) -> dict:
    """Time the agreement on ``args.agree_ranks`` gloo processes; rank 0's medians."""
    import tempfile

    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init = "file://" + os.path.join(tmp, "store")
        procs = [
            ctx.Process(target=_agreement_rank, args=(r, args.agree_ranks, init, args, queue))
            for r in range(args.agree_ranks)
        ]
        for p in procs:
            p.start()
        got = dict(queue.get(timeout=600) for _ in procs)
        for p in procs:
            p.join(timeout=60)
    times = got[0]
    med = {k: statistics.median(v) * 1e6 for k, v in times.items()}
    return {
        "ranks": args.agree_ranks,
        "per_call_us": med,
        "per_call_us_all_rounds": {k: [x * 1e6 for x in v] for k, v in times.items()},
        "ratio_runner_one_over_two": med["runner_one"] / med["runner_two"],
        "ratio_bare_one_over_two": med["bare_one"] / med["bare_two"],
    }


if __name__ == "__main__":
    main()
