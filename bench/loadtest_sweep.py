"""Tokens/s and p99 decode-step time against concurrency, graph engine vs eager engine.

Runs ``graphrunner loadtest`` (:func:`graphrunner_tools.loadtest.run_loadtest`) ``--rounds`` times
over the concurrency levels and reports, per level, the medians over rounds of: generated
tokens per second and the p50/p99 decode-step time of the graph engine and of the eager engine
(same requests, same scheduling decisions, same padded batches; every token compared). Prints a
table, writes JSON (``--out``); ``graphrunner bench`` draws ``loadtest_sweep.png`` from it when
matplotlib is installed. A run that is not clean (a lost request, a fault, a mismatch) is
recorded under ``failures``; timings are never assertions.

    python bench/loadtest_sweep.py [--quick] [--ranks 1] [--requests 100] [--concurrency 1,4,16,64]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from typing import Any

from graphrunner_tools.bench import environment, loadtest_table, parse_int_list, write_json
from graphrunner_tools.loadtest import LoadtestConfig, run_loadtest

#: Per-level fields reported (medians over rounds), graph then eager.
FIELDS = ("tokens_per_s", "eager_tokens_per_s", "p50_step_ms", "eager_p50_step_ms", "p99_step_ms", "eager_p99_step_ms")


def _median(xs: list[float | None]) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the sweep; return (and write to ``--out``) the result dict.

    Keys: ``benchmark``, ``environment``, ``config`` (the :class:`LoadtestConfig` fields and
    ``rounds``), ``concurrency``, ``levels`` (one dict per level: ``concurrency`` and the
    medians of :data:`FIELDS`, plus ``speedup`` = tokens_per_s / eager_tokens_per_s),
    ``failures`` (one line per level of a round that was not clean), ``seconds`` (per round).
    """
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.path.join("bench", "results", "loadtest_sweep.json"))
    ap.add_argument("--quick", action="store_true", help="smoke run: 12 requests, levels 2,8, 1 layer, 1 round")
    ap.add_argument("--ranks", type=int, default=1, help="ranks (default 1: in process)")
    ap.add_argument("--requests", type=int, default=None, help="requests per level (default 100)")
    ap.add_argument("--concurrency", type=parse_int_list, default=None, help="levels (default 1,4,16,64)")
    ap.add_argument("--backend", default="breakable", choices=["full", "breakable"])
    ap.add_argument("--layers", type=int, default=None, help="decoder layers (default 2)")
    ap.add_argument("--rounds", type=int, default=None, help="whole sweeps; medians reported (default 3)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (per rank)")
    args = ap.parse_args(argv)
    cfg = LoadtestConfig(
        ranks=args.ranks,
        requests=args.requests or (12 if args.quick else 100),
        concurrency=tuple(args.concurrency or ((2, 8) if args.quick else (1, 4, 16, 64))),
        backend=args.backend,
        layers=args.layers or (1 if args.quick else 2),
        threads=args.threads,
        progress=False,
    )
    rounds = args.rounds or (1 if args.quick else 3)
    per_level: dict[int, dict[str, list[float | None]]] = {c: {f: [] for f in FIELDS} for c in cfg.concurrency}
    failures: list[str] = []
    seconds: list[float] = []
    for r in range(rounds):
        res = run_loadtest(cfg)
        seconds.append(res.seconds)
        failures += [f"round {r}: {e}" for e in res.errors]
        for lv in res.levels:
            if not lv.ok:
                failures.append(f"round {r}: {lv.line()}" + "".join(f"; {e}" for e in lv.errors))
            for f in FIELDS:
                per_level[lv.concurrency][f].append(getattr(lv, f))
    levels = []
    for c in cfg.concurrency:
        row: dict[str, Any] = {"concurrency": c, **{f: _median(per_level[c][f]) for f in FIELDS}}
        g, e = row["tokens_per_s"], row["eager_tokens_per_s"]
        row["speedup"] = g / e if g and e else None
        levels.append(row)

    print(
        f"loadtest sweep: {cfg.ranks} rank(s), backend={cfg.backend}, {cfg.requests} requests per level, "
        f"{cfg.layers} layers, medians of {rounds} round(s)"
    )
    for line in loadtest_table(levels):
        print(line)
    for f in failures:
        print(f"NOT CLEAN: {f}")
    cfg_dict = {k: getattr(cfg, k) for k in cfg.__dataclass_fields__}
    result = {
        "benchmark": "loadtest_sweep",
        "environment": environment(),
        "config": {**cfg_dict, "rounds": rounds},
        "concurrency": list(cfg.concurrency),
        "levels": levels,
        "failures": failures,
        "seconds": seconds,
    }
    write_json(args.out, result, announce=True)
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
