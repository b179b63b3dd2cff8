"""``graphrunner serve --tp 2`` on real processes (gloo, 127.0.0.1) with the ``openai`` client.

Three servers start at once (module fixtures, each once): ``--tp 2 --eager`` (two ranks from torch's
elastic launcher: rank 0 serves HTTP and drives, rank 1 follows), the one-rank ``--eager`` server (the
reference answers), and ``--tp 2`` with graphs on every rank, whose rank 1 is SIGKILLed mid-serving at the
end. Greedy answers of the two-rank server equal the one-rank server's (streamed and not, one at a time and
from concurrent clients); the graphs' answers equal ``--tp 2 --eager``'s, streamed and not, from steps every
rank replayed (per-rank /metrics; the eager server's show none: the control), after the graphs' server
captured every key on both ranks while idle, before any request; /metrics shows every rank's
figures (the steps each rank synced equal the driver's; each rank's wait in collectives; the one-rank
server's are 0); SIGTERM stops every rank (exit 0, the follower's loop ended, not its process cut short); a
killed rank stops the server (exit 1 within 60 s, naming the rank), and the client in flight gets an error,
not a hang."""

from __future__ import annotations

import os
import re
import signal
import sys
import threading
import time
import types

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from extras_util import require  # noqa: E402

openai = require("openai")

from serve_util import ServerProcess, start_together  # noqa: E402

pytestmark = [pytest.mark.hf, pytest.mark.slow, pytest.mark.multirank]

ENGINE = ["--cb-num-blocks", "64", "--cb-block-size", "16", "--cb-max-batch-tokens", "64", "--cb-max-requests", "16"]
START = 240
PROMPTS = ["hello", "what is 2+2?", "tell me a story", "a", "The quick brown fox", "why?", "list three colors", "ok"]


class Server(ServerProcess):
    def __init__(self, log, *flags):
        try:
            super().__init__([*ENGINE, *flags], log, START, env={"OMP_NUM_THREADS": "1"}, probe=True)
        except RuntimeError as exc:
            raise AssertionError(str(exc)) from None
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0, timeout=60)
        self.model = self.client.models.list().data[0].id

    def chat(self, content, max_tokens=12, stream=False, seed=None):
        kw = {"model": self.model, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens}
        if seed is not None:  # sampled (temperature 1) with the request's own generator, seeded
            return self.client.chat.completions.create(temperature=1.0, seed=seed, **kw).choices[0].message.content
        if not stream:
            return self.client.chat.completions.create(temperature=0, **kw).choices[0].message.content
        chunks = self.client.chat.completions.create(temperature=0, stream=True, **kw)
        return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)

    def ranks(self):
        """The pids of the launcher's rank processes: ``{rank: pid}`` (rank 0 is the one with the model's
        process among its children)."""
        kids = _children(self.proc.pid)
        ranks = [p for p in kids if "multiprocessing.spawn" in _cmdline(p) and "resource_tracker" not in _cmdline(p)]
        driver = [p for p in ranks if any("multiprocessing.spawn" in _cmdline(c) for c in _children(p))]
        assert len(ranks) == 2 and len(driver) == 1, (kids, ranks, driver)
        return {0: driver[0], 1: next(p for p in ranks if p != driver[0])}


def _children(pid):
    out = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        out.append(int(name))
            except (OSError, ValueError, IndexError):
                pass
    return out


def _cmdline(pid):
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode()
    except OSError:
        return ""


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    from graphrunner_tools.models.tiny_chat import tiny_model_dir

    tiny_model_dir()  # built once, before three servers would race to build it
    tmp = str(tmp_path_factory.mktemp("serve_tp"))
    # graphs: the default capture before serving: every rank's idle loop grants the ladder's keys before /health
    flags = {"tp": ["--tp", "2", "--eager"], "one": ["--eager"], "graphs": ["--tp", "2", "--capture-share", "1"]}
    made = start_together(
        {name: (lambda name=name: Server(os.path.join(tmp, f"{name}.log"), *flags[name])) for name in flags}
    )
    yield made
    for s in made.values():
        if s.proc.poll() is None:
            s.stop()


@pytest.mark.timeout(600)  # includes the three servers' start (each a minute or two on a loaded 2-core machine)
def test_tp2_greedy_answers_equal_the_one_rank_servers(servers):
    tp, one = servers["tp"], servers["one"]
    got = [tp.chat(p) for p in PROMPTS]
    want = [one.chat(p) for p in PROMPTS]
    assert got == want
    assert len(set(got)) > 1  # not one answer for every prompt: the prompts reach the model
    # streamed: the same tokens
    assert [tp.chat(p, stream=True) for p in PROMPTS[:3]] == want[:3]


@pytest.mark.timeout(120)
def test_tp2_seeded_sampling_equals_the_one_rank_servers(servers):
    """Seeded sampling on two ranks: each request's own generator on the driver, its tokens broadcast to the
    follower, equals the one-rank server's with the same seeds (tensor parallelism reorders sums: equal on
    nearly every prompt; here on 3 of 4 at least), and it really samples (other seeds, other texts; not the
    greedy answer)."""
    tp, one = servers["tp"], servers["one"]
    prompts = PROMPTS[:4]
    got = [tp.chat(p, seed=7 + i) for i, p in enumerate(prompts)]
    want = [one.chat(p, seed=7 + i) for i, p in enumerate(prompts)]
    assert sum(g == w for g, w in zip(got, want)) >= 3, (got, want)
    assert [tp.chat(p, seed=7 + i) for i, p in enumerate(prompts)] == got  # the seed reproduces it
    assert got != [tp.chat(p, seed=1000 + i) for i, p in enumerate(prompts)]  # other seeds: other texts
    assert got != [one.chat(p) for p in prompts]  # not greedy


@pytest.mark.timeout(120)
def test_tp2_serves_16_concurrent_clients_their_own_answers(servers):
    tp, one = servers["tp"], servers["one"]
    prompts = [f"{PROMPTS[i % len(PROMPTS)]} {i}" for i in range(16)]
    want = [one.chat(p) for p in prompts]
    got = [None] * 16

    def ask(i):
        got[i] = tp.chat(prompts[i])

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(90)
    assert got == want


def _by_rank(server, name):
    """``{rank: value}`` of the per-rank family ``name`` on ``server``'s /metrics."""
    out = {}
    for key, value in server.metrics().items():
        if key.startswith(name + "{"):
            out[int(re.search(r'rank="(\d+)"', key).group(1))] = value
    return out


@pytest.mark.timeout(120)
def test_metrics_show_every_ranks_figures(servers):
    tp, one = servers["tp"], servers["one"]
    assert tp.chat("hello") and one.chat("hello")
    # rank 1 publishes its figures every second: poll (bounded) until it has counted the driver's steps
    for _ in range(60):
        synced = _by_rank(tp, "graphrunner_rank_synced_steps_total")
        if synced.get(1) == synced.get(0):
            break
        time.sleep(0.5)
    assert set(synced) == {0, 1} and synced[0] > 0
    assert synced[1] == synced[0]  # every rank took the driver's ids at every step: the same steps
    waited = _by_rank(tp, "graphrunner_rank_collective_wait_seconds_total")
    assert set(waited) == {0, 1} and all(v > 0 for v in waited.values())  # the broadcast each step
    for name in ("graphrunner_rank_graphs_captured", "graphrunner_rank_capture_seconds"):
        assert _by_rank(tp, name) == {0: 0.0, 1: 0.0}  # --eager: no graphs on any rank
    steps = [k for k in tp.metrics() if k.startswith("graphrunner_rank_steps_total{")]
    assert {re.search(r'rank="(\d+)"', k).group(1) for k in steps} == {"0", "1"}
    # the control: one rank has no peer to wait for, and syncs nothing
    assert _by_rank(one, "graphrunner_rank_synced_steps_total") == {0: 0.0}
    assert _by_rank(one, "graphrunner_rank_collective_wait_seconds_total") == {0: 0.0}


def _rank_steps(server):
    """``{rank: (replayed, eager)}`` of ``server``'s per-rank step counts, once rank 1's published figures have
    caught up with the driver's (it publishes every second: the same number of steps on both ranks)."""
    for _ in range(60):
        out = {}
        for key, value in server.metrics().items():
            if key.startswith("graphrunner_rank_steps_total{"):
                rank, path = int(re.search(r'rank="(\d+)"', key).group(1)), re.search(r'path="(\w+)"', key).group(1)
                out.setdefault(rank, {})[path] = value
        steps = {r: (v.get("replayed", 0.0), v.get("eager", 0.0)) for r, v in out.items()}
        if set(steps) == {0, 1} and sum(steps[0]) == sum(steps[1]):
            return steps
        time.sleep(0.5)
    raise AssertionError(f"rank 1's figures did not catch up with rank 0's: {steps}")


def _steps_at_health(probe):
    """``(replayed, eager)`` steps of rank 0 in the ``/metrics`` read at the first ``/health`` 200."""
    m = probe["metrics"]
    return tuple(
        sum(v for k, v in m.items() if k.startswith("graphrunner_steps_total{") and f'path="{path}"' in k)
        for path in ("replayed", "eager")
    )


@pytest.mark.timeout(600)
def test_tp2_graphs_answer_as_tp2_eager_from_steps_every_rank_replayed(servers):
    graphs, tp = servers["graphs"], servers["tp"]
    want = [tp.chat(p) for p in PROMPTS]
    assert len(set(want)) > 1  # the prompts reach the model
    # the default capture before serving: every rank's loop ran before the HTTP server was built, its idle
    # iterations granting the keys (a call without rows on every rank), so the first /health 200 came with /ready
    # 200, every key captured on every rank (/ready counts a key once every rank has it) and no step served
    probe = graphs.at_health
    assert probe["ready_status"] == 200, probe
    assert probe["ready"]["graphs_captured"] == probe["ready"]["graphs_planned"] > 1, probe
    assert _steps_at_health(probe) == (0.0, 0.0), probe
    log = graphs.output(tail=200_000)
    planned = probe["ready"]["graphs_planned"]
    assert f"captured {planned}/{planned} keys in " in log, log  # rank 0's last progress line, before it listened
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and not (
        graphs.metric("graphrunner_ready") == 1
        and _by_rank(graphs, "graphrunner_rank_graphs_captured") == {0: planned, 1: planned}  # rank 1's: 1 s late
    ):
        time.sleep(1)
    assert planned > 0 and _by_rank(graphs, "graphrunner_rank_graphs_captured") == {0: planned, 1: planned}
    assert _rank_steps(graphs) == {0: (0.0, 0.0), 1: (0.0, 0.0)}, "captured before any step"
    assert [graphs.chat(p) for p in PROMPTS] == want
    before = _rank_steps(graphs)
    again = [graphs.chat(p) for p in PROMPTS]
    streamed = [graphs.chat(p, stream=True) for p in PROMPTS[:4]]
    after = _rank_steps(graphs)
    assert again == want and streamed == want[:4]
    # every step of these answers was replayed from a graph on both ranks, the same steps on each
    replayed = {r: after[r][0] - before[r][0] for r in (0, 1)}
    eager = {r: after[r][1] - before[r][1] for r in (0, 1)}
    assert replayed[0] == replayed[1] >= len(again) + len(streamed) and eager == {0: 0.0, 1: 0.0}, (before, after)
    # the control: the same check on the --tp 2 --eager server finds no replayed step on any rank
    control = _rank_steps(tp)
    assert control[0][0] == control[1][0] == 0.0, control


@pytest.mark.timeout(120)
def test_sigterm_stops_every_rank_and_exits_0(servers):
    tp = servers["tp"]
    ranks = tp.ranks()
    assert tp.stop(signal.SIGTERM, timeout=60) == 0, tp.output()
    time.sleep(0.5)
    assert not any(os.path.exists(f"/proc/{p}") and _alive(p) for p in ranks.values())


def _alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.timeout(120)
def test_a_rank_killed_mid_serving_stops_the_server_non_zero_within_60s(servers):
    doomed = servers["graphs"]  # the graphs' server, last: its rank 1 is killed
    assert doomed.chat("hello")  # it serves
    rank1 = doomed.ranks()[1]
    outcome = {}

    def ask():  # a request in flight when the rank dies: an error, never a hang
        try:
            outcome["answer"] = doomed.chat("tell me a long story", max_tokens=400)
        except Exception as exc:  # noqa: BLE001
            outcome["error"] = exc

    client = threading.Thread(target=ask)
    client.start()
    time.sleep(0.3)
    os.kill(rank1, signal.SIGKILL)
    t0 = time.monotonic()
    code = doomed.proc.wait(60)
    assert time.monotonic() - t0 < 60
    client.join(60)
    assert not client.is_alive()
    assert code == 1, doomed.output()
    assert "rank 1 failed (rank 1 killed by SIGKILL" in doomed.output(tail=1 << 20)
    assert outcome  # answered before the kill, or failed: it returned


class _StuckLoop:
    """A follower's manager whose loop is inside a collective with a driver that is gone: a stop is not seen
    (``leaves_on="stop"``: it is), and an abort of one of its groups fails the collective, ending the loop
    (``leaves_on=None``: nothing ends it)."""

    def __init__(self, leaves_on):
        self.running, self.leaves_on, self.aborted = True, leaves_on, []
        group = lambda name: types.SimpleNamespace(abort=lambda: self._abort(name))  # noqa: E731
        self.distributed_helper = types.SimpleNamespace(cpu_comm_group=group("cpu"), tp_group=group("tp"))

    def _abort(self, name):
        self.aborted.append(name)
        self.running = self.leaves_on != "abort" and self.running

    def is_running(self):
        return self.running

    def stop(self, block, timeout):
        self.running = self.running and self.leaves_on != "stop"

    def join(self, stop_trigger_time, timeout):
        pass


def test_a_stopped_follower_aborts_its_groups_only_when_its_loop_is_stuck():
    from graphrunner_tools.serve_tp import _end_loop

    stuck = _StuckLoop("abort")
    _end_loop(stuck, 1, grace=0.1)  # returns: the aborted groups failed the loop's collective
    assert stuck.aborted == ["cpu", "tp"] and not stuck.running
    ends = _StuckLoop("stop")
    _end_loop(ends, 1, grace=0.1)
    assert ends.aborted == []  # the loop ended at the stop: nothing aborted
    # the control: a loop that nothing ends is an error naming the rank, not a hang nor a silent exit 0
    never = _StuckLoop(None)
    with pytest.raises(RuntimeError, match="rank 1: the generation loop did not end"):
        _end_loop(never, 1, grace=0.1)
