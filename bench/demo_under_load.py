"""Wall time of ``graphrunner demo`` idle and beside one competing process, per thread count.

The issue this answers: PyTorch's default intra-op thread count is the number
of cores, and OpenMP workers busy-wait on cores they do not get. With one
other single-threaded PyTorch process on a 2-core machine, the demo ran 9x
slower with the default than with one thread.

For each ``--threads`` value (default: ``1`` and the machine's core count,
PyTorch's default), the demo runs as a subprocess, once on an otherwise idle
machine and once beside a competing process (a single-threaded PyTorch
matmul loop), interleaved round by round. Prints the medians and the ratio
loaded/idle per thread count, and writes JSON::

    python bench/demo_under_load.py --steps 100 --rounds 2 --out bench/results/demo_under_load.json

Not part of ``graphrunner bench`` (it runs minutes of whole demos); a
reported ratio is only as good as the machine was idle: the JSON records the
load average before each run.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

from graphrunner_tools.bench import environment, write_json

_COMPETITOR = """
import torch
torch.set_num_threads(1)
a = torch.randn(512, 512)
while True:
    a = (a @ a).tanh_()
"""


def _demo_seconds(threads: int, steps: int, env: dict) -> float:
    argv = [
        sys.executable,
        "-m",
        "graphrunner_tools.cli",
        "demo",
        "--steps",
        str(steps),
        "--threads",
        str(threads),
        "--trace-out",
        "",
        "--no-progress",
    ]
    t0 = time.perf_counter()
    proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=1800)
    seconds = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} exited {proc.returncode}:\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
    return seconds


def main(argv=None):
    """Run the measurement (see the module docstring) and return the JSON dict."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--threads",
        default=f"1,{os.cpu_count() or 1}",
        help="comma-separated thread counts to compare (default: 1 and the core count)",
    )
    ap.add_argument("--steps", type=int, default=100, help="demo steps per run (default 100)")
    ap.add_argument("--rounds", type=int, default=2, help="interleaved rounds (default 2)")
    ap.add_argument("--out", default=os.path.join("bench", "results", "demo_under_load.json"))
    args = ap.parse_args(argv)
    counts = [int(t) for t in args.threads.split(",") if t.strip()]
    # The child's env must not pin OpenMP: --threads alone decides.
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    runs = []
    for r in range(args.rounds):
        for loaded in (False, True):
            competitor = subprocess.Popen([sys.executable, "-c", _COMPETITOR]) if loaded else None
            try:
                if competitor is not None:
                    time.sleep(1.0)  # let it reach its loop
                for t in counts:
                    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
                    s = _demo_seconds(t, args.steps, env)
                    runs.append(
                        {
                            "round": r,
                            "threads": t,
                            "competing_process": loaded,
                            "seconds": s,
                            "load_average_1m_before": load,
                        }
                    )
                    print(
                        f"round {r}: threads={t} {'with one competing process' if loaded else 'idle'}: {s:.1f} s",
                        flush=True,
                    )
            finally:
                if competitor is not None:
                    competitor.kill()
                    competitor.wait()
    summary = {}
    for t in counts:
        idle = statistics.median(x["seconds"] for x in runs if x["threads"] == t and not x["competing_process"])
        busy = statistics.median(x["seconds"] for x in runs if x["threads"] == t and x["competing_process"])
        summary[str(t)] = {"idle_s": idle, "loaded_s": busy, "loaded_over_idle": busy / idle}
        print(f"threads={t}: idle {idle:.1f} s, with one competing process {busy:.1f} s: {busy / idle:.2f}x")
    result = {
        "benchmark": "demo_under_load",
        "environment": environment(),
        "steps": args.steps,
        "rounds": args.rounds,
        "runs": runs,
        "summary": summary,
    }
    write_json(args.out, result, announce=True)
    return result


if __name__ == "__main__":
    main()
