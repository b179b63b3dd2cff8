"""Capture per key on the continuous-batching manager workload, this tree against another, interleaved.

The workload (issue 53 item 3; ``tests/test_hf_sessions.py``'s): the issue's tiny random-weight Qwen2
(vocab 256, hidden 64, 2 layers, 4 heads, 2 kv heads; nothing downloaded), transformers' manager with
gr.hf's graph step (``gr.hf.init_continuous_batching(..., device="tape")``; paged cache of 64 blocks of
16, at most 64 tokens and 8 requests a step), one session of 10 prompts (2-40 tokens, 12 new tokens,
greedy), then ``gr.hf.graphs_of(manager).capture()`` (timed): the keys planned from that session,
each with its warmups, tape capture, checks and gr.hf's equivalence check.

Each capture runs in a fresh child process (one torch thread unless ``--threads``), so that the trees
never share a module: ``--baseline-path`` names another checkout of graphrunner (e.g. a worktree of
``main``), whose child runs next to this tree's in every round, the order alternating (ABBA), so a
busy stretch of a shared machine moves both. Prints per tree the median over the rounds of the
wall-clock and CPU milliseconds per key and where they go (from the capture report: ``warmup``: a
key's capture less the two below, its warmups mostly; ``graph``: the tape capture, recording and
binding verification to code generation; ``checks``: the capture checks' part; ``rest``: the call's
time outside the keys' captures, gr.hf's equivalence check (its replays, which trace, and eager
steps) most of it, then the session's set-up), and
the median of the rounds' ``this / baseline`` ratios (wall and CPU; issue 53 item 3's target: at
most 0.5). Not a test, no timed assertion.

Writes JSON (``--out``, default ``bench/results/manager_capture.json``).

    python bench/manager_capture.py [--baseline-path ../wt-capture-base] [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

#: Issue 53 item 3: capture per key at most half of the baseline's (same run).
TARGET_RATIO = 0.5


def child(tree: str, threads: int) -> dict[str, Any]:
    """One capture of the manager workload with ``tree``'s graphrunner (run in a child process)."""
    sys.path.insert(0, tree)
    import time

    import torch

    torch.set_num_threads(threads)
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    import graphrunner as gr
    import graphrunner.hf  # noqa: F401
    from graphrunner_tools.models.hf_tiny import build_tiny

    assert os.path.abspath(gr.__file__).startswith(os.path.abspath(tree)), (gr.__file__, tree)
    torch.manual_seed(0)
    model = build_tiny(
        "qwen2", vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2
    )
    gen = GenerationConfig(max_new_tokens=12, do_sample=False, eos_token_id=-1, pad_token_id=0)
    cb = ContinuousBatchingConfig(page_size=16, num_blocks=64, max_batch_tokens=64, max_requests_per_batch=8)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 256, (int(k),), generator=g).tolist() for k in torch.randint(2, 41, (10,), generator=g)]
    manager = gr.hf.init_continuous_batching(model, gen, cb, device="tape")
    try:
        manager.start()
        ids = manager.add_requests(inputs=prompts, max_new_tokens=12)
        done = 0
        while done < len(ids):
            r = manager.get_result(timeout=60)
            assert r is not None and r.error is None
            done += r.is_finished()
        manager.stop(block=True, keep_for_next_session=True)
        hook = gr.hf.graphs_of(manager)
        t0, c0 = time.perf_counter(), time.process_time()
        report = hook.capture()
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        n = len(hook.runner.keys)
        rows = report.buckets
        keyed = sum(r.capture_seconds for r in rows)
        graph = sum(r.graph_capture_seconds for r in rows)
        checks = sum(r.checks_seconds for r in rows)
        return {
            "tree": tree,
            "keys": n,
            "equivalence_checked": hook.stats.equivalence_checked,
            "wall_ms_per_key": 1e3 * wall / n,
            "cpu_ms_per_key": 1e3 * cpu / n,
            "warmup_ms_per_key": 1e3 * (keyed - graph - checks) / n,
            "graph_ms_per_key": 1e3 * graph / n,
            "checks_ms_per_key": 1e3 * checks / n,
            "rest_ms_per_key": 1e3 * (wall - keyed) / n,
        }
    finally:
        manager.destroy()


def run_child(tree: str, threads: int) -> dict[str, Any]:
    """:func:`child` in a fresh interpreter; its one JSON line."""
    cmd = [sys.executable, os.path.abspath(__file__), "--child", tree, "--threads", str(threads)]
    env = dict(os.environ, PYTHONPATH=tree)
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"the capture with {tree} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


FIELDS = (
    "wall_ms_per_key",
    "cpu_ms_per_key",
    "warmup_ms_per_key",
    "graph_ms_per_key",
    "checks_ms_per_key",
    "rest_ms_per_key",
)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the rounds, print the table and the ratios, write the JSON; returns it."""
    from graphrunner_tools.bench import environment, target_note, write_json

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--baseline-path", default=None, help="another graphrunner checkout, captured in the same rounds")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=1, help="torch threads in each child (default 1)")
    p.add_argument("--out", default=os.path.join(HERE, "results", "manager_capture.json"))
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.child is not None:
        print(json.dumps(child(a.child, a.threads)))
        return {}
    trees = {"this": ROOT}
    if a.baseline_path:
        trees["baseline"] = os.path.abspath(a.baseline_path)
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in trees}
    names = list(trees)
    for i in range(a.rounds):
        order = names if i % 2 == 0 else names[::-1]
        for name in order:
            got = run_child(trees[name], a.threads)
            runs[name].append(got)
            print(f"[manager_capture] round {i + 1} {name}: {got['wall_ms_per_key']:.1f} ms/key", file=sys.stderr)
    result: dict[str, Any] = {"benchmark": "manager_capture", "environment": environment(), "rounds": a.rounds}
    result["trees"] = trees
    result["runs"] = runs
    med = {name: {f: statistics.median(r[f] for r in rs) for f in FIELDS} for name, rs in runs.items()}
    result["median"] = med
    print(
        f"manager workload (tiny Qwen2, tape), {runs['this'][0]['keys']} keys, {a.rounds} rounds, medians (ms per key)"
    )
    print(f"{'tree':10s} " + " ".join(f"{f.split('_ms')[0]:>8s}" for f in FIELDS))
    for name in names:
        print(f"{name:10s} " + " ".join(f"{med[name][f]:8.1f}" for f in FIELDS))
    if "baseline" in runs:
        ratios = {
            f: [t[f] / b[f] for t, b in zip(runs["this"], runs["baseline"])]
            for f in ("wall_ms_per_key", "cpu_ms_per_key")
        }
        result["ratios"] = ratios
        result["ratio_median"] = {f: statistics.median(v) for f, v in ratios.items()}
        wall, cpu = result["ratio_median"]["wall_ms_per_key"], result["ratio_median"]["cpu_ms_per_key"]
        result["target"] = TARGET_RATIO
        print(
            f"this / baseline per key: wall {wall:.2f}x, cpu {cpu:.2f}x (median of the rounds' ratios; "
            f"rounds {', '.join(f'{r:.2f}' for r in ratios['wall_ms_per_key'])}) "
            f"{target_note(wall, TARGET_RATIO)}"
        )
    write_json(a.out, result, announce=True)
    return result


if __name__ == "__main__":
    main()
