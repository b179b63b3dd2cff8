"""The serving sweep: ``graphrunner serve`` with graphs against the same server with ``--eager``, over HTTP.

Starts the server (graphs), drives it with the ``openai`` client (streaming chat completions, greedy)
at each concurrency level, stops it, then does the same with ``--eager`` (transformers' own engine;
same command, same flags, same requests). Reports per level what ``vllm bench serve`` and SGLang's
``bench_serving`` report: requests ok and failed, output tokens/s, time to first token (TTFT) and
inter-token latency (ITL) p50 and p99, plus the share of engine steps replayed from graphs (from
``/metrics``), and compares the two servers' answers request by request (greedy: they must be equal).
Prompts and output lengths are seeded. Prints a table, writes JSON (``--out``) and, with
matplotlib, a plot next to it. Timings are never assertions.

    python bench/serve_sweep.py [--quick] [--concurrency 1,4,16,64] [--requests 100,300,600,1000] [--threads 1] [MODEL_DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import Any

from graphrunner_tools.bench import environment, parse_int_list, write_json
from graphrunner_tools.threads import add_threads_argument

#: The server's engine settings for the sweep (a CPU machine): 512 blocks of 16 tokens, 256 tokens and
#: 64 requests a step.
ENGINE = ["--cb-num-blocks", "512", "--cb-block-size", "16", "--cb-max-batch-tokens", "256", "--cb-max-requests", "64"]

#: Characters prompts are drawn from.
ALPHABET = "abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.,?!"


def workload(n: int, seed: int, prompt_chars: Sequence[int], output_tokens: Sequence[int]) -> list[dict[str, Any]]:
    """``n`` requests: a seeded prompt of ``prompt_chars[0]..[1]`` characters and ``max_tokens`` in
    ``output_tokens[0]..[1]`` each."""
    rng = random.Random(seed)
    return [
        {
            "prompt": "".join(rng.choice(ALPHABET) for _ in range(rng.randint(*prompt_chars))),
            "max_tokens": rng.randint(*output_tokens),
        }
        for _ in range(n)
    ]


def _pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


async def _drive(
    url: str, model: str, requests: list[dict[str, Any]], concurrency: int, timeout: float
) -> list[dict[str, Any]]:
    import openai

    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=timeout)
    gate = asyncio.Semaphore(concurrency)

    async def one(req: dict[str, Any]) -> dict[str, Any]:
        async with gate:
            t0 = time.perf_counter()
            stamps: list[float] = []
            parts: list[str] = []
            tokens = None
            try:
                stream = await client.chat.completions.create(
                    model=model,
                    messages=[{"role": "user", "content": req["prompt"]}],
                    max_tokens=req["max_tokens"],
                    temperature=0,
                    stream=True,
                    stream_options={"include_usage": True},
                )
                async for chunk in stream:
                    if chunk.usage is not None:
                        tokens = chunk.usage.completion_tokens
                    if chunk.choices and chunk.choices[0].delta.content:
                        stamps.append(time.perf_counter())
                        parts.append(chunk.choices[0].delta.content)
            except Exception as exc:  # noqa: BLE001 - a failed request is counted, not raised
                return {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:300]}
            end = time.perf_counter()
            return {
                "ok": True,
                "text": "".join(parts),
                "tokens": tokens if tokens is not None else len(parts),
                "ttft": (stamps[0] - t0) if stamps else None,
                "itl": [b - a for a, b in zip(stamps, stamps[1:])],
                "seconds": end - t0,
            }

    try:
        return list(await asyncio.gather(*(one(r) for r in requests)))
    finally:
        await client.close()


def run_level(server: Any, model: str, requests: list[dict[str, Any]], concurrency: int) -> dict[str, Any]:
    """Drive ``server`` with ``requests`` at ``concurrency``; the level's figures and its answers."""
    before = server.metrics()
    t0 = time.perf_counter()
    results = asyncio.run(_drive(server.url, model, requests, concurrency, timeout=600))
    wall = time.perf_counter() - t0
    after = server.metrics()

    def steps(path: str, m: dict[str, float]) -> float:
        return sum(v for k, v in m.items() if k.startswith("graphrunner_steps_total") and f'path="{path}"' in k)

    replayed = steps("replayed", after) - steps("replayed", before)
    eager = steps("eager", after) - steps("eager", before)
    ok = [r for r in results if r["ok"]]
    ttft = [r["ttft"] for r in ok if r["ttft"] is not None]
    itl = [x for r in ok for x in r["itl"]]
    tokens = sum(r["tokens"] for r in ok)
    return {
        "concurrency": concurrency,
        "requests": len(requests),
        "ok": len(ok),
        "failed": len(results) - len(ok),
        "errors": sorted({r["error"] for r in results if not r["ok"]})[:5],
        "seconds": wall,
        "output_tokens": tokens,
        "tokens_per_s": tokens / wall if wall > 0 else None,
        "ttft_p50_ms": _ms(_pct(ttft, 0.5)),
        "ttft_p99_ms": _ms(_pct(ttft, 0.99)),
        "itl_p50_ms": _ms(_pct(itl, 0.5)),
        "itl_p99_ms": _ms(_pct(itl, 0.99)),
        "replayed_steps": replayed,
        "eager_steps": eager,
        "replayed_share": replayed / (replayed + eager) if replayed + eager else None,
        "answers": [r.get("text") for r in results],
    }


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1000.0


def sweep(
    flags: list[str],
    levels: Sequence[int],
    work: list[list[dict[str, Any]]],
    log: str,
    warmup: int,
    prompt_chars: Sequence[int],
    output_tokens: Sequence[int],
    threads: int,
) -> dict[str, Any]:
    """One server (``flags``) through every level; returns its levels and start/stop facts."""
    import openai

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
    from serve_util import ServerProcess  # the tests' server harness

    t0 = time.perf_counter()
    server = ServerProcess([*ENGINE, *flags], log, start_timeout=300, env={"OMP_NUM_THREADS": str(threads)})
    start = time.perf_counter() - t0
    model = openai.OpenAI(base_url=server.url + "/v1", api_key="none").models.list().data[0].id
    try:
        ready = 0.0
        if warmup:  # the same warm-up on both servers: the first requests' one-time costs are not a level's
            asyncio.run(_drive(server.url, model, workload(warmup, 99, prompt_chars, output_tokens), 16, 600))
            # the levels measure serving with the graphs captured: the capture (in the background from the
            # first request on) is reported apart, as its seconds and the time to full speed
            t1 = time.perf_counter()
            while "--eager" not in flags and time.perf_counter() - t1 < 600:
                asyncio.run(_drive(server.url, model, workload(1, 98, (8, 16), (2, 2)), 1, 600))  # keys switch at calls
                if server.metric("graphrunner_graphs_captured") >= server.metric("graphrunner_graphs_planned") > 0:
                    break
                time.sleep(0.5)
            ready = time.perf_counter() - t0
        out = []
        for c, reqs in zip(levels, work):
            level = run_level(server, model, reqs, c)
            print(
                f"[serve_sweep] {'eager ' if '--eager' in flags else 'graphs'} c={c:<3} {level['ok']}/"
                f"{level['requests']} ok, {level['tokens_per_s'] or 0:.0f} tok/s, replayed "
                f"{(level['replayed_share'] or 0) * 100:.0f}%",
                file=sys.stderr,
                flush=True,
            )
            out.append(level)
        captured = server.metric("graphrunner_graphs_captured")
        capture_s = server.metric("graphrunner_capture_seconds")
        replans = server.metric("graphrunner_replans_total")
    finally:
        code = server.stop()
    return {
        "levels": out,
        "start_seconds": start,
        "ready_seconds": ready,
        "exit_code": code,
        "graphs_captured": captured,
        "capture_seconds": capture_s,
        "replans": replans,
    }


def table(result: dict[str, Any]) -> list[str]:
    """The sweep as text lines: one row per level, graphs then eager."""
    lines = ["conc  server  ok/failed   tok/s   TTFT p50/p99 ms   ITL p50/p99 ms   replayed  same answers"]
    for g, e, same in zip(result["graphs"]["levels"], result["eager"]["levels"], result["same"]):
        for name, lv in (("graphs", g), ("eager", e)):
            share = "" if name == "eager" else f"{(lv['replayed_share'] or 0) * 100:5.1f}%"
            lines.append(
                f"{lv['concurrency']:>4}  {name:<6}  {lv['ok']:>4}/{lv['failed']:<4} {lv['tokens_per_s'] or 0:>7.0f}"
                f"   {_f(lv['ttft_p50_ms'])}/{_f(lv['ttft_p99_ms']):<8}   {_f(lv['itl_p50_ms'])}/"
                f"{_f(lv['itl_p99_ms']):<8}   {share:>7}  {same if name == 'graphs' else ''}"
            )
        lines.append(f"      graphs / eager tokens/s: {(g['tokens_per_s'] or 0) / (e['tokens_per_s'] or 1):.2f}x")
    return lines


def _f(v: float | None) -> str:
    return "-" if v is None else f"{v:.1f}"


def plot(result: dict[str, Any], path: str) -> str | None:
    """tokens/s and ITL p99 against concurrency, graphs and eager (needs matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    for name in ("graphs", "eager"):
        lv = result[name]["levels"]
        xs = [x["concurrency"] for x in lv]
        a.plot(xs, [x["tokens_per_s"] for x in lv], marker="o", label=name)
        b.plot(xs, [x["itl_p99_ms"] for x in lv], marker="o", label=name)
    for ax, title in ((a, "output tokens/s"), (b, "inter-token latency p99 (ms)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent clients")
        ax.set_title(title)
        ax.legend()
    fig.suptitle("graphrunner serve: graphs vs --eager (transformers' engine)")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the sweep; return (and write to ``--out``) the result: ``environment``, ``config``, ``graphs``
    and ``eager`` (per server: ``levels``, start seconds, exit code, graphs captured), ``same`` (per
    level: requests whose answers are equal on both servers), ``mismatches`` (their total) and
    ``failed`` (failed requests, both servers)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", nargs="?", default=None, help="a local model directory (default: the built-in tiny one)")
    ap.add_argument("--out", default=os.path.join("bench", "results", "serve_sweep.json"))
    ap.add_argument("--quick", action="store_true", help="smoke run: levels 1,4 with 6 and 12 requests")
    ap.add_argument("--concurrency", type=parse_int_list, default=None, help="levels (default 1,4,16,64)")
    ap.add_argument(
        "--requests",
        type=parse_int_list,
        default=None,
        help="requests per level (default 100,300,600,1000: 2,000 in all)",
    )
    ap.add_argument("--prompt-chars", type=parse_int_list, default=[8, 160], help="prompt length range (chars)")
    ap.add_argument("--output-tokens", type=parse_int_list, default=[8, 64], help="max_tokens range")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--warmup",
        type=int,
        default=64,
        help="requests before the first level, at concurrency 16 (default 64); then the graph server's "
        "levels wait until its keys are captured",
    )
    ap.add_argument("--flags", default="", help="more graphrunner serve flags for both servers")
    add_threads_argument(ap)  # the servers' torch threads (OMP_NUM_THREADS of their processes)
    args = ap.parse_args(argv)
    levels = args.concurrency or ([1, 4] if args.quick else [1, 4, 16, 64])
    counts = args.requests or ([6, 12] if args.quick else [100, 300, 600, 1000])
    if len(counts) != len(levels):
        ap.error(f"--requests gives {len(counts)} counts for {len(levels)} levels")
    work = [workload(n, args.seed + i, args.prompt_chars, args.output_tokens) for i, n in enumerate(counts)]
    base = ([args.model] if args.model else []) + args.flags.split()
    logs = tempfile.mkdtemp(prefix="serve-sweep-")
    result: dict[str, Any] = {
        "benchmark": "serve_sweep",
        "environment": environment(),
        "config": {
            "levels": levels,
            "requests": counts,
            "engine": ENGINE,
            "flags": base,
            "prompt_chars": args.prompt_chars,
            "output_tokens": args.output_tokens,
            "seed": args.seed,
            "warmup": args.warmup,
            "threads": args.threads,
            "logs": logs,
        },
    }
    warm = 0 if args.quick else args.warmup
    shape = (args.prompt_chars, args.output_tokens, args.threads)
    result["graphs"] = sweep(base, levels, work, os.path.join(logs, "graphs.log"), warm, *shape)
    result["eager"] = sweep(base + ["--eager"], levels, work, os.path.join(logs, "eager.log"), warm, *shape)
    result["same"] = [
        sum(a == b and a is not None for a, b in zip(g["answers"], e["answers"]))
        for g, e in zip(result["graphs"]["levels"], result["eager"]["levels"])
    ]
    result["mismatches"] = sum(lv["ok"] for lv in result["eager"]["levels"]) - sum(result["same"])
    result["failed"] = sum(lv["failed"] for s in ("graphs", "eager") for lv in result[s]["levels"])
    for s in ("graphs", "eager"):
        for lv in result[s]["levels"]:
            lv["answers_sample"] = lv.pop("answers")[:3]
    for line in table(result):
        print(line)
    print(
        f"[serve_sweep] {sum(counts)} requests a server; failed {result['failed']}, mismatches "
        f"{result['mismatches']}; graphs captured {result['graphs']['graphs_captured']:.0f} in "
        f"{result['graphs']['capture_seconds']:.1f} s (full speed {result['graphs']['ready_seconds']:.0f} s after "
        f"the start), re-planned {result['graphs']['replans']:.0f}x; exit codes "
        f"{result['graphs']['exit_code']}, {result['eager']['exit_code']}"
    )
    write_json(args.out, result, announce=True)
    picture = plot(result, os.path.splitext(args.out)[0] + ".png")
    if picture:
        print(f"[serve_sweep] plot: {picture}")
    return result


if __name__ == "__main__":
    res = main()
    sys.exit(0 if res["failed"] == 0 and res["mismatches"] == 0 else 1)
