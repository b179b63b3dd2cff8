"""Time to the first served call: a blocking capture against ``capture(background=True)`` (issue 25).

The demo decoder's decode step (``graphrunner_tools.models``, ``--layers``
layers, masked attention on the full backend or varlen attention on the
breakable one) is captured for ``--buckets`` in fresh runners, interleaved
over ``--rounds`` rounds in one process, and for each variant it times:

* ``first_call_s``: from the start of ``capture()`` to the return of the first
  call (a batch of ``--batch`` rows): with a blocking capture every bucket is
  captured first; in the background the call is served at once (eagerly,
  padded to its bucket) or waits for at most the bucket being captured;
* ``all_captured_s``: until every bucket replays (``wait_captured()``);
* ``calls_before_captured``: calls served (one every ``--interval`` ms, as
  an engine's steps) while the background capture ran;
* ``keys_replaying``: after the capture, every key called at its own size:
  how many replay (``stats.last_bucket``), of ``keys``;
* ``mismatches``: every call above (the first, those served while capturing,
  one per key at the end) against eager PyTorch on the same batch: the calls
  whose output is not ``allclose`` (``--rtol``, ``--atol``) to eager's, of
  ``calls_checked`` (and ``max_abs_diff``).

Prints the medians of the times, the counts summed over the rounds and the
ratio blocking/background of the time to the first call, and writes JSON
(``--out``). Not a test: nothing gates on a timing. Uses the runner's public
surface only, so it also runs on older checkouts.

    python bench/background_capture.py [--rounds 5] [--layers 2] [--buckets 1,2,4,8,16] [--backend full] [--threads 1]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from graphrunner.runner import BatchInput, GraphRunner
from graphrunner_tools.bench import environment, write_json
from graphrunner_tools.models import LlamaConfig, build_model


def make_runner(backend: str, layers: int, buckets):
    """A fresh uncaptured runner over the demo decoder's decode step, and the step itself."""
    attention = "masked" if backend == "full" else "varlen"
    config = LlamaConfig.demo(num_layers=layers, attention=attention, max_batch_size=max(buckets))
    model = build_model(config, seed=0)

    def step(input_ids, positions):
        return model.decode_step(input_ids, positions)

    runner = GraphRunner(
        step,
        inputs={
            "input_ids": BatchInput(trailing=(), dtype=torch.long, pad=0, bounds=(0, config.vocab_size - 1)),
            "positions": BatchInput(trailing=(), dtype=torch.long, pad=0, bounds=(0, 7)),
        },
        buckets=list(buckets),
        backend=backend,
        progress=False,
    )
    return runner, step, config


def _capturing(runner) -> bool:
    """Whether a background capture is still under way: some key does not replay yet (public
    surface only, so the script also runs on older checkouts)."""
    return len(runner.captured_keys) < len(runner.keys)


def one(background: bool, args, buckets) -> dict:
    """One fresh runner: the times of the first call and of the last capture, the calls served
    meanwhile, whether every key replays at the end, and every call's output against eager."""
    runner, step, config = make_runner(args.backend, args.layers, buckets)
    g = torch.Generator().manual_seed(0)
    checked = {"calls": 0, "mismatches": 0, "worst": 0.0}

    def check(got, x, p) -> None:
        with torch.inference_mode():
            want = step(x, p)
        checked["calls"] += 1
        checked["worst"] = max(checked["worst"], float((got - want).abs().max()))
        if not torch.allclose(got, want, rtol=args.rtol, atol=args.atol):
            checked["mismatches"] += 1

    ids = torch.randint(0, config.vocab_size, (args.batch,), generator=g)
    pos = torch.zeros(args.batch, dtype=torch.long)
    t0 = time.perf_counter()
    runner.capture(background=background)
    out = runner(input_ids=ids, positions=pos)
    first = time.perf_counter() - t0
    check(out, ids, pos)
    served = 0
    if background:
        deadline = time.perf_counter() + args.deadline
        while _capturing(runner) and time.perf_counter() < deadline:
            time.sleep(args.interval / 1000)
            n = int(torch.randint(1, max(buckets) + 1, (1,), generator=g))
            x, p = torch.randint(0, config.vocab_size, (n,), generator=g), torch.zeros(n, dtype=torch.long)
            check(runner(input_ids=x, positions=p), x, p)
            served += 1
        runner.wait_captured()
    done = time.perf_counter() - t0
    replaying = 0  # every key, called at its own size once the capture is done: does it replay?
    for key in runner.keys:
        x = torch.randint(0, config.vocab_size, (key,), generator=g)
        p = torch.zeros(key, dtype=torch.long)
        check(runner(input_ids=x, positions=p), x, p)
        replaying += runner.stats.last_bucket == key
    runner.cleanup()
    return {
        "first_call_s": first,
        "all_captured_s": done,
        "calls_before_captured": served,
        "keys": len(runner.keys),
        "keys_replaying": replaying,
        "calls_checked": checked["calls"],
        "mismatches": checked["mismatches"],
        "max_abs_diff": checked["worst"],
    }


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--buckets", default="1,2,4,8,16")
    ap.add_argument("--backend", default="full", choices=["full", "breakable"])
    ap.add_argument("--batch", type=int, default=3, help="rows of the first call")
    ap.add_argument("--interval", type=float, default=5.0, help="ms between calls while capturing")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default: 1)")
    ap.add_argument("--rtol", type=float, default=1e-5, help="a call's output equals eager's within this (and --atol)")
    ap.add_argument("--atol", type=float, default=1e-5)
    ap.add_argument("--deadline", type=float, default=300.0, help="s to serve calls while capturing, at most")
    ap.add_argument("--out", default="bench/results/background_capture.json")
    args = ap.parse_args(argv)
    torch.set_num_threads(max(1, args.threads))
    buckets = [int(b) for b in args.buckets.split(",")]
    one(False, args, buckets)  # the process's one-time costs (torch._dynamo import, first recordings)
    rows = {False: [], True: []}
    for _ in range(args.rounds):
        for background in (False, True):
            rows[background].append(one(background, args, buckets))
    med = {bg: {k: statistics.median(r[k] for r in rows[bg]) for k in rows[bg][0]} for bg in rows}
    ratio = med[False]["first_call_s"] / med[True]["first_call_s"]
    print(
        f"demo decoder, {args.layers} layers, {args.backend} backend, buckets {buckets}, {args.rounds} rounds "
        f"(medians; counts summed over the rounds), {torch.get_num_threads()} thread(s)"
    )
    for bg, name in ((False, "blocking  "), (True, "background")):
        m, r = med[bg], rows[bg]
        print(
            f"  {name} capture: first call served after {m['first_call_s'] * 1000:8.1f} ms, every key "
            f"replaying after {m['all_captured_s'] * 1000:8.1f} ms "
            f"({sum(x['keys_replaying'] for x in r)} of {sum(x['keys'] for x in r)} keys replay at the end), "
            f"{sum(x['calls_before_captured'] for x in r)} calls served while capturing, still equal to eager: "
            f"{sum(x['mismatches'] for x in r)} mismatches in {sum(x['calls_checked'] for x in r)} calls "
            f"(max |diff| {max(x['max_abs_diff'] for x in r):.2e})"
        )
    print(f"  time to the first served call: {ratio:.1f}x shorter in the background")
    doc = {
        "backend": args.backend,
        "layers": args.layers,
        "buckets": buckets,
        "rounds": args.rounds,
        "batch": args.batch,
        "threads": args.threads,
        "environment": environment(),
        "blocking": rows[False],
        "background": rows[True],
        "median": {"blocking": med[False], "background": med[True]},
        "first_call_ratio": ratio,
        "rtol": args.rtol,
        "atol": args.atol,
        "totals": {
            ("background" if bg else "blocking"): {
                k: sum(x[k] for x in rows[bg])
                for k in ("keys", "keys_replaying", "calls_before_captured", "calls_checked", "mismatches")
            }
            for bg in rows
        },
    }
    write_json(args.out, doc)
    print(f"wrote {args.out}")
    return doc


if __name__ == "__main__":
    main()
