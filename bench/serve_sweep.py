"""The serving benchmark: ``graphrunner serve`` measured the way ``vllm bench serve`` measures a server.

Three columns, one after another in one invocation, each its own server process with the same engine
flags and the same requests: ``graphs`` (``graphrunner serve``: steps replayed from graphs),
``backend-eager`` (``graphrunner serve --backend eager``: graphrunner's own step and attention, no
graphs) and ``eager`` (``graphrunner serve --eager``: transformers' own engine). Each column is driven
with the ``openai`` client (streaming chat completions, greedy) through one run per ``--max-concurrency``
level: a seeded random dataset (prompts of ``--random-input-len`` tokens of the served model's
tokenizer, ``max_tokens`` of ``--random-output-len``, both spread by ``--random-range-ratio``), sent at
``--request-rate`` requests/s (Poisson arrivals, or gamma ones with ``--burstiness``; ``inf``: all at
once) with at most ``--max-concurrency`` in flight. Per run it reports what ``vllm bench serve``
reports, under its JSON names: ``completed``, ``failed``, ``duration``, ``request_throughput``,
``request_goodput`` (``--goodput ttft:MS tpot:MS e2el:MS``), ``output_throughput``,
``total_token_throughput``, and ``mean_/median_/std_/p99_`` of ``ttft_ms``, ``tpot_ms``, ``itl_ms``
and ``e2el_ms``; plus the share of steps replayed from graphs (``/metrics``). Greedy answers are
compared across the columns request by request (``mismatches``), and the graphs column reports its
time to full speed (docs/benchmarks.md defines it). ``--tp N`` runs every column on N tensor-parallel ranks
(``graphrunner serve --tp N``) but ``one-rank``, the one-rank ``--eager`` server, whose greedy answers are
reported as ``one_rank_agreement`` (tensor parallelism reorders sums), never as mismatches. Prints a table with the columns' ratios, writes
JSON (``--out``) and, with matplotlib, a plot next to it. Timings are never assertions.

    python bench/serve_sweep.py [--quick] [--max-concurrency 1,4,16,64] [--num-prompts 100,300,600,1000]
        [--request-rate inf] [--burstiness 1] [--random-input-len 48] [--random-output-len 32]
        [--random-range-ratio 0.75] [--num-warmups 64] [--goodput ttft:200 tpot:20]
        [--columns graphs,backend-eager,eager] [--flags "..."] [--graphs-flags "--capture-in-background"] [--tp 1]
        [--threads 1] [MODEL_DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import random
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from typing import Any

from graphrunner_tools.bench import environment, write_json
from graphrunner_tools.threads import add_threads_argument

#: The server's engine settings (a CPU machine): 512 blocks of 16 tokens, 256 tokens and 64 requests a step.
ENGINE = ["--cb-num-blocks", "512", "--cb-block-size", "16", "--cb-max-batch-tokens", "256", "--cb-max-requests", "64"]

#: The columns: name -> the flags that make the server (added to ``--flags``), in the order they run.
COLUMNS: dict[str, list[str]] = {
    "graphs": [],
    "backend-eager": ["--backend", "eager"],
    "eager": ["--eager"],
    "one-rank": ["--eager"],
}

#: Columns that run on one rank whatever ``--tp`` says: the reference of tensor parallelism's agreement
#: (its sums are reordered, so its greedy answers are compared as ``agreement``, never as mismatches).
ONE_RANK = ("one-rank",)

#: The latency metrics, as ``vllm bench serve`` names them (``mean_<m>_ms``, ``median_<m>_ms``, ...).
LATENCIES = ("ttft", "tpot", "itl", "e2el")

#: The percentiles reported besides the mean and the median (``vllm bench serve``'s default: 99).
PERCENTILES = (99.0,)

#: The service-level objectives ``--goodput`` takes (milliseconds).
SLO_NAMES = ("ttft", "tpot", "e2el")


# ----------------------------------------------------------------------------- statistics (no server)
def percentile(xs: Sequence[float], p: float) -> float | None:
    """The ``p``-th percentile of ``xs`` (0-100), interpolated linearly between the closest ranks (numpy's
    default, so ``vllm bench serve``'s ``np.percentile``); ``None`` for no values."""
    if not xs:
        return None
    s = sorted(xs)
    pos = (len(s) - 1) * p / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def summary_ms(name: str, seconds: Sequence[float]) -> dict[str, float | None]:
    """``mean_<name>_ms``, ``median_<name>_ms``, ``std_<name>_ms`` (population) and ``p99_<name>_ms``
    of ``seconds``, in milliseconds; ``None`` each for no values."""
    n = len(seconds)
    mean = sum(seconds) / n if n else None
    out: dict[str, float | None] = {
        f"mean_{name}_ms": None if mean is None else mean * 1e3,
        f"median_{name}_ms": _ms(percentile(seconds, 50)),
        f"std_{name}_ms": None if mean is None else math.sqrt(sum((x - mean) ** 2 for x in seconds) / n) * 1e3,
    }
    for p in PERCENTILES:
        out[f"p{p:g}_{name}_ms"] = _ms(percentile(seconds, p))
    return out


def parse_goodput(pairs: Sequence[str] | None) -> dict[str, float]:
    """``["ttft:200", "tpot:20"]`` -> ``{"ttft": 200.0, "tpot": 20.0}`` (milliseconds); ``ValueError`` for
    another name, a negative value or a pair without ``:``."""
    slos: dict[str, float] = {}
    for pair in pairs or ():
        name, sep, value = pair.partition(":")
        if not sep or name not in SLO_NAMES:
            raise ValueError(f"--goodput takes NAME:MS pairs with NAME one of {', '.join(SLO_NAMES)}; got {pair!r}")
        try:
            slos[name] = float(value)
        except ValueError:
            raise ValueError(f"--goodput {pair!r}: {value!r} is not a number of milliseconds") from None
        if slos[name] < 0:
            raise ValueError(f"--goodput {pair!r}: an objective is not negative")
    return slos


def request_tpot(r: dict[str, Any]) -> float:
    """A request's time per output token after the first: ``(e2el - ttft) / (output tokens - 1)``; 0 for
    a request of one token or none (as ``vllm bench serve`` counts it for goodput)."""
    n = r["output_tokens"]
    return (r["e2el"] - r["ttft"]) / (n - 1) if n > 1 and r["ttft"] is not None else 0.0


def metrics(results: Sequence[dict[str, Any]], duration: float, goodput: dict[str, float]) -> dict[str, Any]:
    """A run's figures under ``vllm bench serve``'s names from its requests' results (each ``ok``, and
    when ok ``prompt_tokens``, ``output_tokens``, ``ttft``, ``itl`` (a list), ``e2el``, seconds) and its
    ``duration`` (seconds). TPOT's statistics take the requests of 2 tokens or more; a request is good
    when it is ok and meets every objective of ``goodput`` (ms; its TPOT 0 below 2 tokens);
    ``request_goodput`` is ``None`` without objectives."""
    ok = [r for r in results if r["ok"]]
    total_in = sum(r["prompt_tokens"] for r in ok)
    total_out = sum(r["output_tokens"] for r in ok)
    good = 0
    for r in ok:
        got = {"ttft": r["ttft"] if r["ttft"] is not None else math.inf, "tpot": request_tpot(r), "e2el": r["e2el"]}
        good += all(got[k] <= ms / 1e3 for k, ms in goodput.items())
    out: dict[str, Any] = {
        "duration": duration,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": len(ok) / duration,
        "request_goodput": good / duration if goodput else None,
        "output_throughput": total_out / duration,
        "total_token_throughput": (total_in + total_out) / duration,
    }
    samples = {
        "ttft": [r["ttft"] for r in ok if r["ttft"] is not None],
        "tpot": [request_tpot(r) for r in ok if r["output_tokens"] > 1 and r["ttft"] is not None],
        "itl": [x for r in ok for x in r["itl"]],
        "e2el": [r["e2el"] for r in ok],
    }
    for name in LATENCIES:
        out.update(summary_ms(name, samples[name]))
    return out


def full_speed(
    stamps: Sequence[float], end: float, steady_from: float, window: float = 2.0, band: float = 0.1
) -> dict[str, Any]:
    """Time to full speed from token timestamps (seconds since the process started).

    The rolling rate at second ``s`` is the tokens stamped in ``[s, s + window)`` divided by ``window``,
    for every whole second ``s`` whose window ends by ``end``. The steady state is the median of the
    rates whose windows start at ``steady_from`` or later. ``full_speed_s`` is the first whole second
    from which every rate stays within ``band`` (10%) of the steady state up to ``end``. ``None`` each
    where there are no windows to tell."""
    rates = [(s, sum(s <= t < s + window for t in stamps) / window) for s in range(int(end - window) + 1)]
    rates = [(s, r) for s, r in rates if s >= 0]
    steady_rates = [r for s, r in rates if s >= steady_from]
    steady = percentile(steady_rates, 50)
    first: int | None = None
    if steady:
        for s, r in rates:
            if abs(r - steady) > band * steady:
                first = None
            elif first is None:
                first = s
    return {
        "steady_tokens_per_s": steady,
        "full_speed_s": first,
        "window_s": window,
        "band": band,
        "rolling_tokens_per_s": [r for _, r in rates],
    }


# ----------------------------------------------------------------------------- the dataset and the arrivals
def random_dataset(
    tokenizer: Any, n: int, input_len: int, output_len: int, range_ratio: float, seed: int
) -> list[dict[str, Any]]:
    """``n`` seeded requests as ``vllm bench serve``'s random dataset makes them: a prompt of a number of
    tokens drawn from ``[input_len * (1 - r), input_len * (1 + r)]`` (token ids drawn among the
    tokenizer's non-special ones, decoded, re-encoded and cut to that length) and ``max_tokens`` drawn
    from ``[output_len * (1 - r), output_len * (1 + r)]``, at least 1 each. Each request has ``prompt``,
    ``prompt_len`` (its tokens, re-encoded) and ``max_tokens``."""
    if not 0 <= range_ratio < 1:
        raise ValueError(f"--random-range-ratio must be in [0, 1); got {range_ratio}")
    rng = random.Random(seed)
    special = set(tokenizer.all_special_ids)
    ids = [i for i in range(len(tokenizer)) if i not in special]

    def span(x: int) -> tuple[int, int]:
        return max(1, math.floor(x * (1 - range_ratio))), max(1, math.ceil(x * (1 + range_ratio)))

    out = []
    for _ in range(n):
        want = rng.randint(*span(input_len))
        toks = [rng.choice(ids) for _ in range(want)]
        prompt = tokenizer.decode(toks)
        for _ in range(4):  # a decode and re-encode may merge or split tokens: cut to length again
            again = tokenizer.encode(prompt, add_special_tokens=False)
            if len(again) <= want:
                break
            prompt = tokenizer.decode(again[:want])
        if not prompt.strip():
            prompt = "x" + prompt
        out.append(
            {
                "prompt": prompt,
                "prompt_len": len(tokenizer.encode(prompt, add_special_tokens=False)),
                "max_tokens": rng.randint(*span(output_len)),
            }
        )
    return out


def arrivals(n: int, rate: float, burstiness: float, seed: int) -> list[float]:
    """When each of ``n`` requests is sent, in seconds from the run's start: all at 0 for an infinite
    ``rate``, else gaps drawn from a gamma distribution of shape ``burstiness`` and mean ``1 / rate``
    (``burstiness`` 1: exponential gaps, a Poisson process; below 1 burstier, above 1 more even),
    seeded, and scaled so the last is sent at ``n / rate`` (as ``vllm bench serve`` does, so the offered
    rate does not drift with the seed)."""
    if burstiness <= 0:
        raise ValueError(f"--burstiness must be positive; got {burstiness}")
    if math.isinf(rate):
        return [0.0] * n
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(n):
        t += rng.gammavariate(burstiness, 1.0 / (rate * burstiness))
        out.append(t)
    return [x * (n / rate) / out[-1] for x in out] if out and out[-1] > 0 else out


# ----------------------------------------------------------------------------- the client
async def _drive(
    url: str,
    model: str,
    requests: Sequence[dict[str, Any]],
    concurrency: int | None,
    send_at: Sequence[float] | None = None,
    keep_going: Any = None,
    timeout: float = 600,
) -> list[dict[str, Any]]:
    """Send ``requests`` (each at ``send_at[i]`` seconds from now, at most ``concurrency`` in flight;
    ``None``: no limit); each result: ``ok``, ``text``, ``prompt_tokens``, ``output_tokens``, ``start``
    (``perf_counter`` at the send), ``ttft``, ``itl``, ``e2el``, ``stamps`` (``perf_counter`` of each
    streamed piece of text), or ``error``. With ``keep_going`` (a callable), the requests are sent over
    and over, closed loop, while it returns true (warm-ups)."""
    import openai

    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=timeout)
    gate = asyncio.Semaphore(concurrency) if concurrency else None
    t0 = time.perf_counter()

    async def one(i: int, req: dict[str, Any]) -> dict[str, Any]:
        if send_at and send_at[i] > 0:
            await asyncio.sleep(max(0.0, t0 + send_at[i] - time.perf_counter()))
        if gate is not None:
            await gate.acquire()
        try:
            return await _one(client, model, req)
        finally:
            if gate is not None:
                gate.release()

    try:
        if keep_going is None:
            return list(await asyncio.gather(*(one(i, r) for i, r in enumerate(requests))))
        done: list[dict[str, Any]] = []

        async def loop(k: int) -> None:
            i = k
            while keep_going(len(done)):
                done.append(await _one(client, model, requests[i % len(requests)]))
                i += concurrency or 1

        await asyncio.gather(*(loop(k) for k in range(concurrency or 1)))
        return done
    finally:
        await client.close()


async def _one(client: Any, model: str, req: dict[str, Any]) -> dict[str, Any]:
    start = time.perf_counter()
    stamps: list[float] = []
    parts: list[str] = []
    usage = None
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
                usage = chunk.usage
            if chunk.choices and chunk.choices[0].delta.content:
                stamps.append(time.perf_counter())
                parts.append(chunk.choices[0].delta.content)
    except Exception as exc:  # noqa: BLE001 - a failed request is counted, not raised
        cause = exc.__cause__ or exc.__context__  # the openai client's "Connection error." hides what failed
        why = f"{type(exc).__name__}: {exc}" + (f" ({type(cause).__name__}: {cause})" if cause is not None else "")
        return {"ok": False, "error": why[:300], "start": start}
    end = time.perf_counter()
    return {
        "ok": True,
        "text": "".join(parts),
        "prompt_tokens": req["prompt_len"],  # the dataset's count, as vllm's: the chat template's tokens not in it
        "output_tokens": usage.completion_tokens if usage is not None else len(parts),
        "start": start,
        "ttft": (stamps[0] - start) if stamps else None,
        "itl": [b - a for a, b in zip(stamps, stamps[1:])],
        "e2el": end - start,
        "stamps": stamps,
    }


# ----------------------------------------------------------------------------- one column
class _CapturePoller(threading.Thread):
    """Polls ``/metrics`` until ``graphrunner_graphs_captured == graphrunner_graphs_planned > 0``; keeps the
    first ``perf_counter`` it saw that at in :attr:`at`."""

    def __init__(self, server: Any, period: float = 0.25) -> None:
        super().__init__(daemon=True)
        self.server, self.period, self.at = server, period, None
        self.stop_event = threading.Event()

    def run(self) -> None:
        while not self.stop_event.is_set():
            try:
                m = self.server.metrics()
                planned = sum(v for k, v in m.items() if k.startswith("graphrunner_graphs_planned"))
                captured = sum(v for k, v in m.items() if k.startswith("graphrunner_graphs_captured"))
                if captured >= planned > 0:
                    self.at = time.perf_counter()
                    return
            except OSError:
                pass
            self.stop_event.wait(self.period)


class HealthPoller(threading.Thread):
    """Asks ``GET /health`` every ``period`` seconds until :meth:`finish`: :attr:`polls` answers asked for,
    :attr:`not_ok` of them not a 200 (another status, a refused or timed-out connection), :attr:`first_failure`
    the first of those as text."""

    def __init__(self, url: str, period: float = 0.5, timeout: float = 10.0) -> None:
        super().__init__(daemon=True)
        self.url, self.period, self.timeout = url.rstrip("/") + "/health", period, timeout
        self.polls = self.not_ok = 0
        self.first_failure: str | None = None
        self.stop_event = threading.Event()

    def run(self) -> None:
        import urllib.error
        import urllib.request

        while not self.stop_event.is_set():
            failure = None
            try:
                with urllib.request.urlopen(self.url, timeout=self.timeout) as r:
                    if r.status != 200:
                        failure = f"HTTP {r.status}"
            except urllib.error.HTTPError as exc:
                failure = f"HTTP {exc.code}"
            except OSError as exc:
                failure = f"{type(exc).__name__}: {exc}"
            self.polls += 1
            if failure is not None:
                self.not_ok += 1
                self.first_failure = self.first_failure or failure
            self.stop_event.wait(self.period)

    def finish(self) -> dict[str, Any]:
        """Stops the polling; ``health_polls``, ``health_not_ok`` and ``health_first_failure``."""
        self.stop_event.set()
        self.join(self.timeout + 5)
        return {"health_polls": self.polls, "health_not_ok": self.not_ok, "health_first_failure": self.first_failure}


def ready_at_start(probe: dict[str, Any] | None) -> dict[str, Any]:
    """A column's readiness when its ``/health`` first answered 200, from the server harness's probe
    (``serve_util.ServerProcess.at_health``: ``/ready``'s status and body, read right after that 200):
    ``ready_at_start`` (``/ready`` was 200: every planned graph captured, or no graphs) and
    ``graphs_captured_at_start`` (``None`` where ``/ready`` did not answer)."""
    ready = (probe or {}).get("ready") or {}
    status = (probe or {}).get("ready_status")
    return {
        "ready_at_start": None if status is None else status == 200,
        "graphs_captured_at_start": ready.get("graphs_captured"),
    }


def column_flags(name: str, base: list[str], graphs_flags: list[str], tp: list[str]) -> list[str]:
    """The ``graphrunner serve`` flags of column ``name``: ``base`` (the model and ``--flags``), the column's own
    (:data:`COLUMNS`), ``graphs_flags`` (``--graphs-flags``) for the ``graphs`` column only, and ``tp`` (``--tp N``)
    but for the one-rank columns."""
    own = COLUMNS[name] + (graphs_flags if name == "graphs" else [])
    return base + own + ([] if name in ONE_RANK else tp)


def start_line(columns: dict[str, dict[str, Any]]) -> str:
    """One line: each column's start (seconds from the launch to its first ``/health`` 200) and whether its
    ``/ready`` was 200 then."""
    parts = []
    for name, col in columns.items():
        ready = col.get("ready_at_start")
        state = "" if ready is None else " ready" if ready else " not ready"
        parts.append(f"{name} {col['start_seconds']:.1f} s{state}")
        if ready is False and col.get("graphs_captured_at_start") is not None:
            parts[-1] += f" ({col['graphs_captured_at_start']:.0f} graphs captured)"
    return "[serve_sweep] start (launch to /health 200; /ready then): " + ", ".join(parts)


def _steps(path: str, m: dict[str, float]) -> float:
    return sum(v for k, v in m.items() if k.startswith("graphrunner_steps_total") and f'path="{path}"' in k)


def _labels(key: str) -> dict[str, str]:
    """``name{a="x",b="y"}`` -> ``{"a": "x", "b": "y"}``."""
    inner = key.partition("{")[2].rstrip("}")
    return dict((k, v.strip('"')) for k, _, v in (part.partition("=") for part in inner.split(",") if part))


#: ``/metrics``' per-rank counters :func:`rank_figures` reads.
_RANK_COUNTERS = (
    "graphrunner_rank_steps_total",
    "graphrunner_rank_synced_steps_total",
    "graphrunner_rank_collective_wait_seconds_total",
)


def rank_figures(before: dict[str, float], after: dict[str, float], output_tokens: int) -> dict[str, dict[str, Any]]:
    """Per rank (``/metrics``' ``graphrunner_rank_*{rank}`` families), what a run added: ``steps`` (replayed and
    eager; for transformers' engine, which counts neither, the steps whose sampled ids were synced), ``replayed``, ``collective_s`` (seconds its steps waited in collectives with the other ranks),
    ``collective_ms_per_step`` and ``tokens_per_step`` (the run's output tokens over the rank's steps: the mean
    running batch of a decode step; the ranks run the same steps). Empty for a server without the families."""
    ranks: dict[str, dict[str, Any]] = {}
    for key in set(before) | set(after):
        name = key.partition("{")[0]
        if name not in _RANK_COUNTERS:
            continue
        labels = _labels(key)
        fig = ranks.setdefault(labels["rank"], {"steps": 0.0, "replayed": 0.0, "collective_s": 0.0, "synced": 0.0})
        delta = after.get(key, 0.0) - before.get(key, 0.0)
        if name == "graphrunner_rank_steps_total":
            fig["steps"] += delta
            if labels.get("path") == "replayed":
                fig["replayed"] += delta
        elif name == "graphrunner_rank_synced_steps_total":
            fig["synced"] += delta
        else:
            fig["collective_s"] += delta
    for fig in ranks.values():
        # transformers' engine (--eager) counts no step by path: its steps are the ones whose sampled ids synced
        synced = fig.pop("synced")
        steps = fig["steps"] = fig["steps"] or synced
        fig["collective_ms_per_step"] = fig["collective_s"] * 1000 / steps if steps else None
        fig["tokens_per_step"] = output_tokens / steps if steps else None
    return dict(sorted(ranks.items(), key=lambda kv: int(kv[0])))


def run_column(
    name: str,
    flags: list[str],
    plan: Sequence[dict[str, Any]],
    warmup: list[dict[str, Any]],
    num_warmups: int,
    settle: float,
    window: float,
    goodput: dict[str, float],
    log: str,
    threads: int,
) -> dict[str, Any]:
    """One server (``flags``) through every run of ``plan`` (each ``max_concurrency``, ``requests``,
    ``send_at``), after ``num_warmups`` warm-up requests (the graphs column: and then on until its graphs
    are captured and ``settle`` seconds more, the time to full speed measured over that load)."""
    import openai

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
    from serve_util import ServerProcess  # the tests' server harness

    graphs = name == "graphs"
    t0 = time.perf_counter()
    env = {"OMP_NUM_THREADS": str(threads)}
    server = ServerProcess([*ENGINE, *flags], log, start_timeout=300, env=env, probe=True)
    poller = _CapturePoller(server) if graphs else None
    if poller:
        poller.start()
    model = openai.OpenAI(base_url=server.url + "/v1", api_key="none").models.list().data[0].id
    out: dict[str, Any] = {"name": name, "flags": flags, "start_seconds": server.start_seconds}
    out.update(ready_at_start(server.at_health))
    try:
        conc = plan[0]["max_concurrency"] or 16
        wait_capture = graphs and settle > 0
        if num_warmups or wait_capture:
            w0 = time.perf_counter()
            stop_at: list[float] = []

            def keep_going(done: int) -> bool:
                now = time.perf_counter()
                if now - w0 > 600:
                    return False
                if done < num_warmups:
                    return True
                if not wait_capture:
                    return False
                if poller is not None and poller.at is not None:
                    if not stop_at:
                        stop_at.append(now + settle)
                    return now < stop_at[0]
                return True

            warm = asyncio.run(_drive(server.url, model, warmup, conc, keep_going=keep_going))
            out["warmup_requests"] = len(warm)
            out["warmup_failed"] = sum(not r["ok"] for r in warm)
            if wait_capture and stop_at:
                stamps = [t - t0 for r in warm if r["ok"] for t in r["stamps"]]
                end = stop_at[0] - t0
                out["time_to_full_speed"] = full_speed(stamps, end, end - settle, window)
        runs = []
        for step in plan:
            before = server.metrics()
            health = HealthPoller(server.url)
            health.start()
            r0 = time.perf_counter()
            results = asyncio.run(
                _drive(server.url, model, step["requests"], step["max_concurrency"], send_at=step["send_at"])
            )
            duration = time.perf_counter() - r0
            polled = health.finish()
            after = server.metrics()
            run = {
                "max_concurrency": step["max_concurrency"],
                "request_rate": step["request_rate"],
                "burstiness": step["burstiness"],
                "num_prompts": len(step["requests"]),
                **metrics(results, duration, goodput),
            }
            replayed = _steps("replayed", after) - _steps("replayed", before)
            eager = _steps("eager", after) - _steps("eager", before)
            run["replayed_steps"], run["eager_steps"] = replayed, eager
            run["replayed_share"] = replayed / (replayed + eager) if replayed + eager else None
            run.update(polled)
            run["ranks"] = rank_figures(before, after, sum(r.get("output_tokens", 0) for r in results))
            run["input_lens"] = [q["prompt_len"] for q in step["requests"]]
            run["output_lens"] = [r.get("output_tokens", 0) for r in results]
            run["ttfts"] = [r.get("ttft") for r in results]
            run["itls"] = [r.get("itl", []) for r in results]
            run["latencies"] = [r.get("e2el") for r in results]
            run["generated_texts"] = [r.get("text") for r in results]
            run["errors"] = [r.get("error", "") for r in results]
            print(
                f"[serve_sweep] {name:<13} c={step['max_concurrency'] or 'inf'!s:<4} {run['completed']}/"
                f"{run['num_prompts']} ok, {run['output_throughput']:.0f} tok/s, replayed "
                f"{(run['replayed_share'] or 0) * 100:.0f}%, /health {run['health_polls'] - run['health_not_ok']}/"
                f"{run['health_polls']} ok" + "".join(f"; {line}" for line in rank_lines(run["ranks"])),
                file=sys.stderr,
                flush=True,
            )
            runs.append(run)
        out["runs"] = runs
        if poller:
            poller.stop_event.set()
            poller.join(5)
            out["graphs_ready_s"] = None if poller.at is None else poller.at - t0
        for key, metric in (
            ("graphs_captured", "graphrunner_graphs_captured"),
            ("graphs_planned", "graphrunner_graphs_planned"),
            ("capture_seconds", "graphrunner_capture_seconds"),
            ("replans", "graphrunner_replans_total"),
        ):
            out[key] = server.metric(metric)
    finally:
        if poller:
            poller.stop_event.set()
        s0 = time.perf_counter()
        out["exit_code"] = server.stop()
        out["stop_seconds"] = time.perf_counter() - s0
    return out


# ----------------------------------------------------------------------------- comparing and printing
def rank_lines(ranks: dict[str, dict[str, Any]]) -> list[str]:
    """One short text per rank of :func:`rank_figures`: its steps, the share replayed, collective ms a step and
    output tokens a step."""
    return [
        f"rank {rank}: {f['steps']:.0f} steps, {f['replayed'] / f['steps'] * 100 if f['steps'] else 0:.0f}% replayed, "
        f"collectives {_f(f['collective_ms_per_step'], 2)} ms/step, {_f(f['tokens_per_step'], 1)} tokens/step"
        for rank, f in ranks.items()
    ]


def compare_answers(result: dict[str, Any], names: Sequence[str]) -> None:
    """Per run, each column's greedy answers against the first column's, request by request: ``same``
    and ``mismatches`` (requests answered by both, with different text) per column and run, and
    ``mismatches`` in all."""
    ref = names[0]
    total = 0
    agreement = [0, 0]
    for name in names[1:]:
        col = result["columns"][name]
        col["same_as"] = ref
        for a, b in zip(result["columns"][ref]["runs"], col["runs"]):
            pairs = [
                (x, y) for x, y in zip(a["generated_texts"], b["generated_texts"]) if x is not None and y is not None
            ]
            b["same"] = sum(x == y for x, y in pairs)
            if name in ONE_RANK and ref not in ONE_RANK:
                agreement[0] += b["same"]
                agreement[1] += len(pairs)
                continue
            b["mismatches"] = len(pairs) - b["same"]
            total += b["mismatches"]
    result["mismatches"] = total
    if agreement[1]:
        result["one_rank_agreement"] = {"same": agreement[0], "compared": agreement[1]}
    result["failed"] = sum(r["failed"] for c in result["columns"].values() for r in c["runs"])


def table(result: dict[str, Any]) -> list[str]:
    """The runs as text lines: one row per run and column, then the columns' ratios per run."""
    names = list(result["columns"])
    cols = result["columns"]
    lines = [
        f"{'conc':>4} {'rate':>5}  {'column':<13} {'ok/fail':>8} {'dur s':>6} {'req/s':>6} {'good/s':>6} "
        f"{'out tok/s':>9} {'tot tok/s':>9}  {'TTFT mean/med/p99 ms':>20}  {'TPOT mean/med/p99 ms':>20}  "
        f"{'ITL mean/med/p99 ms':>20}  {'E2EL mean/med/p99 ms':>22}  {'replayed':>8}  {'same':>9}"
    ]
    for i, first in enumerate(cols[names[0]]["runs"]):
        for name in names:
            r = cols[name]["runs"][i]
            share = "" if name != "graphs" or r["replayed_share"] is None else f"{r['replayed_share'] * 100:.0f}%"
            same = f"{r['same']}/{r['num_prompts']}" if "same" in r else "(ref)" if len(names) > 1 else ""
            lat = "  ".join(
                f"{_f(r[f'mean_{m}_ms'])}/{_f(r[f'median_{m}_ms'])}/{_f(r[f'p99_{m}_ms'])}".rjust(
                    22 if m == "e2el" else 20
                )
                for m in LATENCIES
            )
            lines.append(
                f"{first['max_concurrency'] or 'inf'!s:>4} {_rate(first['request_rate']):>5}  {name:<13} "
                f"{str(r['completed']) + '/' + str(r['failed']):>8} {r['duration']:>6.1f} "
                f"{r['request_throughput']:>6.2f} {_f(r['request_goodput'], 2):>6} {r['output_throughput']:>9.0f} "
                f"{r['total_token_throughput']:>9.0f}  {lat}  {share:>8}  {same:>9}"
            )
        for name in names:
            r = cols[name]["runs"][i]
            if r.get("health_polls") is not None and (r["health_not_ok"] or r.get("ranks")):
                detail = [f"/health {r['health_polls'] - r['health_not_ok']}/{r['health_polls']} ok"]
                if r["health_first_failure"]:
                    detail.append(f"first failure: {r['health_first_failure']}")
                lines.append(f"      {name}: " + "; ".join(detail + rank_lines(r.get("ranks", {}))))
        ratios = [
            (a, b)
            for a, b in (("graphs", "backend-eager"), ("backend-eager", "eager"), ("graphs", "eager"))
            if a in cols and b in cols
        ]
        if ratios:
            lines.append(
                "      output tok/s: "
                + ", ".join(
                    f"{a} / {b} {cols[a]['runs'][i]['output_throughput'] / (cols[b]['runs'][i]['output_throughput'] or 1):.2f}x"
                    for a, b in ratios
                )
            )
    return lines


def _rate(r: float | str) -> str:
    return r if isinstance(r, str) else f"{r:g}"


def _json_rate(r: float) -> float | str:
    """A request rate for the JSON: ``"inf"`` for no limit (as ``vllm bench serve`` writes it)."""
    return "inf" if math.isinf(r) else r


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1000.0


def _f(v: float | None, digits: int = 1) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def plot(result: dict[str, Any], path: str) -> str | None:
    """Output tokens/s and ITL p99 against the concurrency per column (needs matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    for name, col in result["columns"].items():
        xs = [r["max_concurrency"] or 0 for r in col["runs"]]
        a.plot(xs, [r["output_throughput"] for r in col["runs"]], marker="o", label=name)
        b.plot(xs, [r["p99_itl_ms"] for r in col["runs"]], marker="o", label=name)
    for ax, title in ((a, "output tokens/s"), (b, "inter-token latency p99 (ms)")):
        ax.set_xscale("symlog", base=2)
        ax.set_xlabel("--max-concurrency (0: no limit)")
        ax.set_title(title)
        ax.legend()
    fig.suptitle("graphrunner serve: graphs, --backend eager, --eager (transformers' engine)")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


# ----------------------------------------------------------------------------- the command line
def _ordered_ints(text: str) -> list[int]:
    try:
        vals = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        vals = []
    if not vals or any(v <= 0 for v in vals):
        raise argparse.ArgumentTypeError(f"expected comma-separated positive integers such as 100,300; got {text!r}")
    return vals


def _levels(text: str) -> list[int | None]:
    out: list[int | None] = []
    for x in text.split(","):
        x = x.strip().lower()
        if x in ("inf", "none", "0"):
            out.append(None)
        elif x.isdigit():
            out.append(int(x))
        else:
            raise argparse.ArgumentTypeError(
                f"expected comma-separated concurrency levels such as 1,4,inf; got {text!r}"
            )
    return out


def _columns(text: str) -> list[str]:
    names = [x.strip() for x in text.split(",") if x.strip()]
    bad = [n for n in names if n not in COLUMNS]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"columns are among {', '.join(COLUMNS)}; got {text!r}")
    return names


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the benchmark; return (and write to ``--out``) the result: ``environment``, ``config``,
    ``columns`` (per column: its ``runs``, each with ``vllm bench serve``'s names, and its server's start
    (``start_seconds``, ``ready_at_start``, ``graphs_captured_at_start``), exit code, graphs captured,
    ``graphs_ready_s`` and ``time_to_full_speed`` for the graphs column),
    ``mismatches`` (greedy answers different from the first column's) and ``failed`` (failed requests)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", nargs="?", default=None, help="a local model directory (default: the built-in tiny one)")
    ap.add_argument("--out", default=os.path.join("bench", "results", "serve_sweep.json"))
    ap.add_argument(
        "--quick", action="store_true", help="smoke run: levels 1,4 with 6 and 12 prompts, no warm-up, short lengths"
    )
    ap.add_argument(
        "--columns",
        type=_columns,
        default=["graphs", "backend-eager", "eager"],
        help="the servers, in order: graphs (graphrunner serve), backend-eager (--backend eager), eager "
        "(--eager: transformers' engine), one-rank (--eager on one rank whatever --tp says: answers compared "
        "as agreement); default graphs,backend-eager,eager",
    )
    ap.add_argument(
        "--max-concurrency",
        "--concurrency",
        dest="max_concurrency",
        type=_levels,
        default=None,
        help="most requests in flight, one run per level, e.g. 1,4,16,64 (default; inf: no limit)",
    )
    ap.add_argument(
        "--num-prompts",
        "--requests",
        dest="num_prompts",
        type=_ordered_ints,
        default=None,
        help="prompts per run: one count for every level or one per level (default 100,300,600,1000)",
    )
    ap.add_argument(
        "--request-rate", type=float, default=math.inf, help="requests sent per second (default inf: all at once)"
    )
    ap.add_argument(
        "--burstiness",
        type=float,
        default=1.0,
        help="the shape of the gamma distribution of the gaps between arrivals (default 1: Poisson)",
    )
    ap.add_argument("--random-input-len", type=int, default=48, help="prompt tokens (default 48)")
    ap.add_argument("--random-output-len", type=int, default=32, help="max_tokens (default 32)")
    ap.add_argument(
        "--random-range-ratio",
        type=float,
        default=0.75,
        help="lengths drawn from [len * (1 - r), len * (1 + r)], r in [0, 1) (default 0.75)",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--num-warmups",
        "--warmup",
        dest="num_warmups",
        type=int,
        default=None,
        help="warm-up requests before the runs, at the first level's concurrency (default 64; --quick 0)",
    )
    ap.add_argument(
        "--goodput",
        nargs="+",
        default=None,
        metavar="NAME:MS",
        help="service-level objectives of a good request, e.g. ttft:200 tpot:20 e2el:2000 (milliseconds)",
    )
    ap.add_argument(
        "--full-speed-settle",
        type=float,
        default=None,
        help="the graphs column's warm-up load goes on until its graphs are captured and this many seconds "
        "more, the steady state of its time to full speed (default 6; --quick 0: no wait, not measured)",
    )
    ap.add_argument("--full-speed-window", type=float, default=2.0, help="the rolling window, seconds (default 2)")
    ap.add_argument("--flags", default="", help="more graphrunner serve flags for every column")
    ap.add_argument(
        "--graphs-flags",
        default="",
        help="more graphrunner serve flags for the graphs column only, e.g. --graphs-flags=--capture-in-background "
        "(which --eager refuses; the = form for a single flag)",
    )
    ap.add_argument(
        "--tp",
        type=int,
        default=1,
        help="tensor-parallel ranks of every column (graphrunner serve --tp N) but one-rank, the one-rank "
        "--eager server whose greedy answers are compared as agreement (default 1)",
    )
    add_threads_argument(ap)  # the servers' torch threads (OMP_NUM_THREADS of their processes)
    args = ap.parse_args(argv)
    levels = args.max_concurrency or ([1, 4] if args.quick else [1, 4, 16, 64])
    counts = args.num_prompts or ([6, 12] if args.quick else [100, 300, 600, 1000])
    if len(counts) == 1:
        counts = counts * len(levels)
    if len(counts) != len(levels):
        ap.error(f"--num-prompts gives {len(counts)} counts for {len(levels)} levels")
    if args.tp < 1:
        ap.error(f"--tp must be >= 1, got {args.tp}")
    if "--tp" in args.flags.split() + args.graphs_flags.split():
        ap.error("pass --tp N to the benchmark itself, not in --flags: the one-rank column runs without it")
    if args.columns[0] in ONE_RANK:
        ap.error(f"--columns: {args.columns[0]} is the agreement reference, not the first column; put it last")
    try:
        goodput = parse_goodput(args.goodput)
        arrivals(1, args.request_rate, args.burstiness, 0)
    except ValueError as exc:
        ap.error(str(exc))
    if args.quick and args.random_input_len == 48 and args.random_output_len == 32:
        args.random_input_len, args.random_output_len = 16, 8
    num_warmups = args.num_warmups if args.num_warmups is not None else (0 if args.quick else 64)
    settle = args.full_speed_settle if args.full_speed_settle is not None else (0.0 if args.quick else 6.0)

    from transformers import AutoTokenizer

    if args.model is None:
        from graphrunner_tools.models.tiny_chat import tiny_model_dir

        args.model = tiny_model_dir()
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    shape = (args.random_input_len, args.random_output_len, args.random_range_ratio)
    try:
        plan = [
            {
                "max_concurrency": c,
                "request_rate": _json_rate(args.request_rate),
                "burstiness": args.burstiness,
                "requests": random_dataset(tokenizer, n, *shape, seed=args.seed + i),
                "send_at": arrivals(n, args.request_rate, args.burstiness, args.seed + 1000 + i),
            }
            for i, (c, n) in enumerate(zip(levels, counts))
        ]
    except ValueError as exc:
        ap.error(str(exc))
    warmup = random_dataset(tokenizer, max(num_warmups, 16), *shape, seed=args.seed + 999)
    base = ([args.model] if args.model else []) + args.flags.split()
    # C64..C1024 need more requests in flight than the server's default bound: queued in the engine, not refused
    most = max((c or counts[i] for i, c in enumerate(levels)), default=1)
    if "--max-concurrent-requests" not in base:
        base += ["--max-concurrent-requests", str(max(256, most))]
    tp = ["--tp", str(args.tp)] if args.tp > 1 else []
    logs = tempfile.mkdtemp(prefix="serve-sweep-")
    result: dict[str, Any] = {
        "benchmark": "serve_sweep",
        "environment": environment(),
        "config": {
            "columns": args.columns,
            "max_concurrency": levels,
            "num_prompts": counts,
            "request_rate": _json_rate(args.request_rate),
            "burstiness": args.burstiness,
            "random_input_len": args.random_input_len,
            "random_output_len": args.random_output_len,
            "random_range_ratio": args.random_range_ratio,
            "num_warmups": num_warmups,
            "goodput": goodput,
            "full_speed_settle_s": settle,
            "full_speed_window_s": args.full_speed_window,
            "engine": ENGINE,
            "flags": base,
            "graphs_flags": args.graphs_flags.split(),
            "seed": args.seed,
            "threads": args.threads,
            "tp": args.tp,
            "logs": logs,
        },
        "columns": {},
    }
    for name in args.columns:
        result["columns"][name] = run_column(
            name,
            column_flags(name, base, args.graphs_flags.split(), tp),
            plan,
            warmup,
            num_warmups,
            settle,
            args.full_speed_window,
            goodput,
            os.path.join(logs, f"{name}.log"),
            args.threads,
        )
    compare_answers(result, args.columns)
    for line in table(result):
        print(line)
    codes = ", ".join(f"{n} {c['exit_code']}" for n, c in result["columns"].items())
    print(
        f"[serve_sweep] {sum(counts)} prompts a column; failed {result['failed']}, mismatches "
        f"{result['mismatches']} (against {args.columns[0]}); exit codes {codes}"
    )
    print(start_line(result["columns"]))
    if "one_rank_agreement" in result:
        agree = result["one_rank_agreement"]
        print(
            f"[serve_sweep] greedy answers equal to the one-rank --eager server's: {agree['same']} of "
            f"{agree['compared']} (tensor parallelism reorders sums)"
        )
    g = result["columns"].get("graphs")
    if g is not None:
        tfs = g.get("time_to_full_speed") or {}
        print(
            f"[serve_sweep] graphs: listening {g['start_seconds']:.1f} s after the start, graphs captured "
            f"{g['graphs_captured']:.0f}/{g['graphs_planned']:.0f} at {_f(g.get('graphs_ready_s'))} s "
            f"({g['capture_seconds']:.1f} s of capture), full speed at {_f(tfs.get('full_speed_s'), 0)} s "
            f"(steady {_f(tfs.get('steady_tokens_per_s'), 0)} tok/s, {args.full_speed_window:g} s window), "
            f"re-planned {g['replans']:.0f}x"
        )
    write_json(args.out, result, announce=True)
    picture = plot(result, os.path.splitext(args.out)[0] + ".png")
    if picture:
        print(f"[serve_sweep] plot: {picture}")
    return result


if __name__ == "__main__":
    res = main()
    sys.exit(0 if res["failed"] == 0 and res["mismatches"] == 0 else 1)
