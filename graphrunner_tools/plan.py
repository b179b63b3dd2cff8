"""``graphrunner plan``: buckets planned from observed batch sizes (:func:`graphrunner.plan_buckets`).

Reads the batch size of every served call from a file and prints the bucket list
with the fewest padded rows for a number of graphs, next to vLLM's ladder
(:func:`graphrunner.default_buckets`) with the same number of graphs
(:func:`ladder_with`). Files:

- text: one int per line (blank lines and ``#`` comments ignored);
- JSON: a list of ints; ``{"schedule": [...]}``; a loadtest JSON whose levels
  carry their per-step ``schedule`` (``{"levels": [{"concurrency": C,
  "schedule": [...]}, ...]}``; ``--level C`` takes one level, else all); or
  named dims ``{dim: [sizes...]}`` (``--max-graphs dim=K,...``).

Exit codes: 0, or 2 with one line on stderr for a file that cannot be read or
planned; the file is read and validated by :mod:`graphrunner_tools.plan_input`
(every error names the file and the line).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from graphrunner.buckets import default_buckets
from graphrunner.planning import padding_of, plan_buckets
from graphrunner_tools.plan_input import PlanInputError, load_sizes  # the input: read and validated there

__all__ = [
    "load_sizes",
    "PlanInputError",
    "ladder_with",
    "compare_with_ladder",
    "graphs_to_match",
    "plan_table",
    "add_plan_subparser",
]


def ladder_with(top: int, graphs: int) -> list[int]:
    """vLLM's ladder up to ``top`` (:func:`graphrunner.default_buckets`) with ``graphs`` graphs: its first
    ``graphs - 1`` sizes and ``top``, so that every call replays, as with the planned buckets (the
    whole ladder when it has no more than ``graphs`` sizes)."""
    full = default_buckets(top)
    return full if graphs >= len(full) else full[: graphs - 1] + [top]


def compare_with_ladder(sizes: list[int], max_graphs: int | None = None) -> dict[str, Any]:
    """The plan for ``max_graphs`` (default: as many graphs as vLLM's whole ladder up to the largest size)
    next to vLLM's ladder with the same number of graphs (:func:`ladder_with`):
    ``{"max_graphs": k, "planned": buckets, "ladder": buckets, "planned_padding": padding_of(...),
    "ladder_padding": ..., "ratio": planned / ladder padded fraction, "graphs_to_match": the fewest
    planned graphs with at most the ladder's padded rows}``."""
    top = max(sizes)
    k = len(default_buckets(top)) if max_graphs is None else max_graphs
    ladder = ladder_with(top, k)
    planned = plan_buckets(sizes, max_graphs=k)
    pp, lp = padding_of(sizes, planned), padding_of(sizes, ladder)
    return {
        "max_graphs": k,
        "planned": planned,
        "ladder": ladder,
        "planned_padding": pp,
        "ladder_padding": lp,
        "ratio": pp["padded_fraction"] / lp["padded_fraction"] if lp["padded_fraction"] else None,
        "graphs_to_match": graphs_to_match(sizes, lp["padded_rows"], len(ladder)),
    }


def graphs_to_match(sizes: list[int], padded_rows: int, most: int) -> int:
    """The fewest planned graphs whose padding is at most ``padded_rows`` (binary search; at most ``most``)."""
    lo, hi = 1, most
    while lo < hi:
        mid = (lo + hi) // 2
        if padding_of(sizes, plan_buckets(sizes, mid))["padded_rows"] <= padded_rows:
            hi = mid
        else:
            lo = mid + 1
    return lo


def plan_table(result: dict[str, Any], path: str, sizes: list[int]) -> list[str]:
    """``graphrunner plan``'s output for one list of sizes: a header, one table row each for the plan and
    vLLM's ladder (graphs, buckets, padded rows), their ratio, and the ``GraphRunner`` line to use."""
    pp, lp = result["planned_padding"], result["ladder_padding"]
    real = [n for n in sizes if n]
    lines = [
        f"graphrunner plan: {pp['calls']} calls from {path}, sizes {min(real)}..{max(real)}",
        f"  {'':<14} {'graphs':>6} {'padded rows':>12}  buckets",
    ]
    for name, buckets, pad in (("planned", result["planned"], pp), ("vLLM's ladder", result["ladder"], lp)):
        lines.append(f"  {name:<14} {len(buckets):>6} {pad['padded_fraction']:>12.2%}  {','.join(map(str, buckets))}")
    if lp["graphs"] < result["max_graphs"]:
        lines.append(f"  (vLLM's ladder up to {max(real)} has only {lp['graphs']} sizes)")
    ratio = f"{result['ratio']:.2f}x the ladder's" if result["ratio"] is not None else "the ladder pads none"
    lines.append(
        f"planned padded rows: {ratio}; the planner matches the ladder's padding with "
        f"{result['graphs_to_match']} graphs"
    )
    return lines


def parse_max_graphs(text: str) -> Any:
    """``--max-graphs`` (``graphrunner plan``, ``serve``): ``8`` or ``reqs=4,draft=3`` (a dict)."""
    if "=" not in text:
        try:
            return int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an int (or dim=K,... for named dims)") from None
    out = {}
    for part in text.split(","):
        dim, _, k = part.partition("=")
        try:
            out[dim.strip()] = int(k)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{part!r}: expected dim=K with an int K, e.g. reqs=4,draft=3") from None
    return out


def _run(args: argparse.Namespace) -> int:
    try:
        sizes = load_sizes(args.file, args.level)
        if isinstance(sizes, dict):
            if args.max_graphs is None or not isinstance(args.max_graphs, dict):
                raise PlanInputError(
                    f"{args.file!r} names dims {list(sizes)}: pass --max-graphs " + ",".join(f"{d}=K" for d in sizes)
                )
            plan = plan_buckets(sizes, max_graphs=args.max_graphs)
            result: dict[str, Any] = {
                "file": args.file,
                "dims": {d: {"planned": plan[d], "padding": padding_of(sizes[d], plan[d])} for d in sizes},
            }
        else:
            if isinstance(args.max_graphs, dict):
                raise PlanInputError(f"--max-graphs names dims but {args.file!r} holds one list of sizes; pass an int")
            plan_buckets(sizes, max_graphs=args.max_graphs or 1)  # validates the sizes, naming the bad entry
            result = {"file": args.file, **compare_with_ladder([n for n in sizes if n], args.max_graphs)}
    except (PlanInputError, ValueError, TypeError) as exc:
        print(f"graphrunner: error: {exc} (see 'graphrunner plan --help')", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    if "dims" in result:
        for d, r in result["dims"].items():
            p = r["padding"]
            print(
                f"{d}: {len(r['planned'])} buckets {','.join(map(str, r['planned']))}; padded rows "
                f"{p['padded_fraction']:.1%} ({p['padded_rows']} over {p['calls']} calls)"
            )
        return 0
    for line in plan_table(result, args.file, sizes):
        print(line)
    print("use: GraphRunner(..., buckets=[" + ", ".join(map(str, result["planned"])) + "])")
    return 0


def add_plan_subparser(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``graphrunner plan`` to ``subparsers``."""
    p = subparsers.add_parser(
        "plan",
        help="buckets planned from observed batch sizes (exact: fewest padded rows for K graphs)",
        description="Read the batch size of every served call from FILE (one int per line; a JSON list; "
        "{'schedule': [...]}; a loadtest JSON with per-level schedules; or {dim: [sizes]} for named "
        "dims) and print the bucket list with the fewest padded rows for --max-graphs graphs (an exact "
        "dynamic program: gr.plan_buckets), its padded-row fraction next to vLLM's ladder "
        "(gr.default_buckets) with the same number of graphs (its first K-1 sizes and the largest "
        "size, so every call replays), and how many planned graphs match the ladder's padding. Sizes "
        "are ints from 0 (an idle step) to 16777216. Exits 2 with one line on stderr naming the file "
        "and the line for a file that cannot be read or planned.",
    )
    p.add_argument("file", metavar="FILE", help="the observed batch sizes (see above)")
    p.add_argument(
        "--max-graphs",
        type=parse_max_graphs,
        default=None,
        help="most graphs, for the plan and for vLLM's ladder it is compared with (default: as many as "
        "vLLM's ladder up to the largest size); dim=K,... for named dims",
    )
    p.add_argument(
        "--level",
        type=int,
        default=None,
        help="a loadtest JSON: plan for the level of this concurrency only (default: every level)",
    )
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.set_defaults(func=_run)
    return p
