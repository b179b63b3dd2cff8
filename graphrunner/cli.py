"""The ``graphrunner`` command line.

``graphrunner demo`` captures a small multi-layer step as a breakable graph on
the default device, replays it for several inputs, checks every replay against
eager PyTorch and prints a table; it exits 1 on any mismatch.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from graphrunner.breakable import BreakableGraph, breakable_graph, no_graph
from graphrunner.devices import get_device


def _demo(args: argparse.Namespace) -> int:
    device = get_device(args.device)
    tdev = device.torch_device
    gen = torch.Generator().manual_seed(args.seed)
    weights = [(torch.randn(64, 64, generator=gen) / 8).to(tdev) for _ in range(args.layers)]

    @no_graph
    def normalize(h: torch.Tensor) -> torch.Tensor:
        # Host-side work a graph cannot hold: runs eagerly as a break.
        return h / (1.0 + h.abs().max().item())

    def step(x: torch.Tensor) -> torch.Tensor:
        h = x
        for w in weights:
            h = normalize(torch.nn.functional.silu(h @ w))
        return h

    static_x = torch.zeros(args.batch, 64, device=tdev)
    graph = BreakableGraph(device=device)
    with torch.inference_mode():
        step(static_x)  # warmup
        device.synchronize()
        t0 = time.perf_counter()
        with breakable_graph(graph):
            out = step(static_x)
        capture_ms = (time.perf_counter() - t0) * 1e3
    print(f"graphrunner demo: {args.layers}-layer MLP, batch {args.batch}, device {device.kind} "
          f"({tdev}); captured {graph.num_segments} segments + {graph.num_breaks} breaks "
          f"in {capture_ms:.1f} ms")
    print(f"{'replay':>6} {'max |graph - eager|':>20} {'result':>8}")
    mismatches = 0
    for i in range(args.replays):
        x = torch.randn(args.batch, 64, generator=gen).to(tdev)
        static_x.copy_(x)
        graph.replay()
        with torch.inference_mode():
            ref = step(x)
        diff = (out - ref).abs().max().item()
        ok = torch.equal(out, ref)
        mismatches += not ok
        print(f"{i:>6} {diff:>20.3g} {'ok' if ok else 'MISMATCH':>8}")
    print(f"{args.replays - mismatches}/{args.replays} replays equal eager")
    return 1 if mismatches else 0


def build_parser() -> argparse.ArgumentParser:
    """Return the argument parser of the ``graphrunner`` command."""
    parser = argparse.ArgumentParser(prog="graphrunner", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="capture a step, replay it, check every replay against eager")
    demo.add_argument("--device", default="auto", choices=["auto", "tape", "cuda"],
                      help="graph kind: cuda when available, else tape (default: auto)")
    demo.add_argument("--layers", type=int, default=4, help="MLP layers, one eager break each")
    demo.add_argument("--batch", type=int, default=8, help="batch rows")
    demo.add_argument("--replays", type=int, default=5, help="replays to check against eager")
    demo.add_argument("--seed", type=int, default=0)
    demo.set_defaults(func=_demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``graphrunner`` console script; returns the exit code."""
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
