"""``graphrunner loadtest`` and ``graphrunner verify`` under torch's own launcher, ``torchrun``: on one
node (``--standalone``), on two "nodes" on 127.0.0.1 (``--nnodes 2 --node-rank R --master-addr``),
DP x TP, and one node's worker killed mid-run.

The reference of a torchrun run is the same command with ``--ranks N`` (its tokens are checked
against the unsharded model in ``tests/test_loadtest.py``): every field of the JSON but the
timings must be equal. Every process here is a real ``torchrun`` (``python -m
torch.distributed.run``) with its workers; a marker in their environment finds any left behind.
"""

from __future__ import annotations

import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import time
import uuid

import pytest

pytestmark = [pytest.mark.multirank, pytest.mark.slow]

ROOT = pathlib.Path(__file__).resolve().parent.parent
SMALL = [
    "--requests",
    "6",
    "--concurrency",
    "3",
    "--layers",
    "1",
    "--prompt-len",
    "2,8",
    "--output-len",
    "1,8",
    "--no-progress",
]
TIMINGS = {"tokens_per_s", "eager_tokens_per_s", "p50_step_ms", "p99_step_ms", "first_decode_s"}


def _env(mark):
    path = str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")
    return dict(os.environ, PYTHONPATH=path, GRAPHRUNNER_TEST_MARK=mark, OMP_NUM_THREADS="1")


def _torchrun(*args):
    return [sys.executable, "-m", "torch.distributed.run", *args]


def _tool(*args):
    return ["-m", "graphrunner_tools", *args]


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _marked(mark):
    """Pids of live processes whose environment carries ``mark`` (ours and our children's)."""
    found = []
    for d in os.listdir("/proc"):
        if not d.isdigit() or int(d) == os.getpid():
            continue
        try:
            with open(f"/proc/{d}/environ", "rb") as f:
                env = f.read().split(b"\0")
            with open(f"/proc/{d}/stat") as f:
                zombie = f.read().rsplit(")", 1)[1].split()[0] == "Z"
        except OSError:
            continue
        if f"GRAPHRUNNER_TEST_MARK={mark}".encode() in env and not zombie:
            found.append((int(d), any(e.startswith(b"RANK=") for e in env)))
    return found


def _two_nodes(port, mark, tool):
    """Two torchrun "nodes" on 127.0.0.1, one worker each, running ``tool(node_rank)``'s argv; their
    output merged into ``stdout``."""
    return [
        subprocess.Popen(
            _torchrun(
                *("--nnodes", "2", "--node-rank", str(n), "--nproc-per-node", "1"),
                *("--master-addr", "127.0.0.1", "--master-port", str(port)),
                *tool(n),
            ),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=_env(mark),
            cwd=str(ROOT),
        )
        for n in (0, 1)
    ]


def _rank_worker(mark, rank, argv_has):
    """The pid of the marked process of ``rank`` whose command line has ``argv_has`` (a worker, not the
    processes it spawned, which inherit its ``RANK``), or None."""
    for pid, is_worker in _marked(mark):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = f.read().split(b"\0")
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if is_worker and f"RANK={rank}".encode() in env and argv_has in argv and "torch.distributed.run" not in argv:
            return pid
    return None


def _levels(path):
    doc = json.loads(pathlib.Path(path).read_text())
    doc["levels"] = [{k: v for k, v in lv.items() if k not in TIMINGS} for lv in doc["levels"]]
    return doc


def _run(cmd, mark, timeout=300):
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=_env(mark), cwd=str(ROOT))
    return proc, proc.stdout + proc.stderr


def test_loadtest_under_torchrun_equals_ranks_n(tmp_path):
    mark = uuid.uuid4().hex
    ref, out = _run(
        [sys.executable, *_tool("loadtest", "--ranks", "2", *SMALL, "--json", str(tmp_path / "r.json"))], mark
    )
    assert ref.returncode == 0, out[-3000:]
    # the console script as a user types it (torchrun --no-python graphrunner ...), where it is installed
    script = pathlib.Path(sys.executable).parent / "graphrunner"
    tool = ["--no-python", str(script)] if script.exists() else _tool()
    run, out = _run(
        _torchrun(
            "--standalone", "--nproc-per-node", "2", *tool, "loadtest", *SMALL, "--json", str(tmp_path / "t.json")
        ),
        mark,
    )
    assert run.returncode == 0, out[-3000:]
    assert run.stdout.count("graphrunner loadtest: 2 rank(s) over gloo") == 1  # rank 0 alone prints the summary
    assert run.stdout.count("PASS in") == 1 and "C3: 6/6 requests, 0 faults, 0 mismatches" in run.stdout
    got, want = _levels(tmp_path / "t.json"), _levels(tmp_path / "r.json")
    assert got == want and got["levels"][0]["replays"] > 0 and (got["ranks"], got["dist_backend"]) == (2, "gloo")
    assert _marked(mark) == []


def test_a_mismatch_under_torchrun_fails_every_rank(tmp_path):
    """Negative control of the run above: a planted mismatch on rank 0 is reported once, and torchrun
    exits 1 (every rank exits 1: rank 1's own tokens were fine)."""
    mark = uuid.uuid4().hex
    run, out = _run(
        _torchrun("--standalone", "--nproc-per-node", "2", *_tool("loadtest", *SMALL, "--inject-fault", "mismatch")),
        mark,
    )
    assert run.returncode == 1, out[-3000:]
    assert "C3: 6/6 requests, 0 faults, 1 mismatches" in run.stdout and run.stdout.count("FAIL in") == 1
    assert _marked(mark) == []


def test_loadtest_spec_on_two_torchrun_nodes(tmp_path):
    """Two torchrun "nodes" on 127.0.0.1 (one worker each), verify steps (``--spec 2``): equal to
    ``--ranks 2 --spec 2``."""
    mark, port = uuid.uuid4().hex, _free_port()
    ref, out = _run(
        [sys.executable, *_tool("loadtest", "--ranks", "2", "--spec", "2", *SMALL, "--json", str(tmp_path / "r.json"))],
        mark,
    )
    assert ref.returncode == 0, out[-3000:]
    procs = _two_nodes(
        port, mark, lambda n: _tool("loadtest", "--spec", "2", *SMALL, "--json", str(tmp_path / f"n{n}.json"))
    )
    outs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], "\n".join(o[-2000:] for o in outs)
    assert "PASS in" in outs[0] and "PASS in" not in outs[1]  # rank 0 (node 0) prints and writes the JSON
    assert not (tmp_path / "n1.json").exists()
    doc = _levels(tmp_path / "n0.json")
    assert doc == _levels(tmp_path / "r.json")
    lv = doc["levels"][0]
    assert (lv["completed"], lv["faults"], lv["mismatches"]) == (6, 0, 0) and (doc["ranks"], doc["spec"]) == (2, 2)
    assert lv["tier_replays"] and all("x" in t for t in lv["tier_replays"])  # (reqs, draft) tiers were replayed
    assert _marked(mark) == []


def test_loadtest_dp2_tp2_under_torchrun(tmp_path):
    mark = uuid.uuid4().hex
    args = [
        "--dp",
        "2",
        "--tp",
        "2",
        "--requests",
        "8",
        "--concurrency",
        "2",
        "--layers",
        "1",
        "--prompt-len",
        "2,8",
        "--output-len",
        "1,8",
        "--no-progress",
    ]
    ref, out = _run([sys.executable, *_tool("loadtest", *args, "--json", str(tmp_path / "r.json"))], mark)
    assert ref.returncode == 0, out[-3000:]
    run, out = _run(
        _torchrun(
            "--standalone", "--nproc-per-node", "4", *_tool("loadtest", *args, "--json", str(tmp_path / "t.json"))
        ),
        mark,
    )
    assert run.returncode == 0, out[-3000:]
    got = _levels(tmp_path / "t.json")
    assert got == _levels(tmp_path / "r.json")
    assert (got["ranks"], got["dp"], got["tp"]) == (4, 2, 2)
    lv = got["levels"][0]
    assert (lv["completed"], lv["faults"], lv["mismatches"]) == (8, 0, 0) and lv["idle_rank_steps"] > 0
    assert _marked(mark) == []


def test_verify_under_torchrun_equals_ranks_n():
    mark = uuid.uuid4().hex
    args = ["--requests", "3", "--max-new", "4", "--reqs-buckets", "1,2,4", "--layers", "1", "--no-progress"]
    ref, out = _run([sys.executable, *_tool("verify", *args, "--ranks", "2")], mark)
    assert ref.returncode == 0, out[-3000:]
    run, out = _run(_torchrun("--standalone", "--nproc-per-node", "2", *_tool("verify", *args)), mark)
    assert run.returncode == 0, out[-3000:]

    def ranks(text):
        return [line for line in text.splitlines() if line.startswith(("rank ", "verify on"))]

    assert ranks(run.stdout) == ranks(ref.stdout) and ranks(run.stdout)[-1] == "verify on 2 ranks: OK"
    assert _marked(mark) == []


def test_killing_one_nodes_worker_ends_the_other_node():
    """Node 1's only worker is SIGKILLed mid-run: node 0's rank fails in its next collective (or at
    the group's 5 s timeout), waits for rank 1's outcome (5 + 10 s at most), reports and exits 1;
    node 1's torchrun exits non-zero; no process is left."""
    mark, port = uuid.uuid4().hex, _free_port()
    args = ["--requests", "400", "--concurrency", "4,8", "--layers", "1", "--timeout", "5", "--no-progress"]
    procs = _two_nodes(port, mark, lambda n: _tool("loadtest", *args))
    try:
        victim = None
        deadline = time.monotonic() + 120
        while victim is None and time.monotonic() < deadline:
            victim = _rank_worker(mark, 1, "graphrunner_tools loadtest")
            time.sleep(0.2)
        assert victim is not None, "node 1's worker never started"
        time.sleep(8)  # past the start-up and capture: the ranks serve (the outcome must not depend on where)
        assert procs[0].poll() is None and procs[1].poll() is None, "the run ended before the kill"
        killed_at = time.monotonic()
        os.kill(victim, signal.SIGKILL)
        out0 = procs[0].communicate(timeout=120)[0]
        # bounds node 0's own end: a failed collective (at once, or the 5 s group timeout) plus its wait
        # for rank 1's outcome (15 s), far below the 120 s this test would wait
        assert time.monotonic() - killed_at < 80
        out1 = procs[1].communicate(timeout=60)[0]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert procs[0].returncode == 1 and procs[1].returncode != 0, out0[-3000:] + out1[-3000:]
    assert "PASS in" not in out0 and "FAIL in" in out0
    assert "rank 1 never reported" in out0, out0[-3000:]  # the dead rank is named ...
    assert "fault: rank 0:" in out0, out0[-3000:]  # ... and rank 0's own failed collective is reported
    assert _marked(mark) == []


def _greedy_reference(model_dir, prompts, max_tokens):
    """Each prompt's greedy answer from the one-rank model in this process, with transformers' own
    ``generate`` (the chat template, as the server applies it): the reference of the served answers."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    out = []
    for p in prompts:
        ids = tok.apply_chat_template(
            [{"role": "user", "content": p}], add_generation_prompt=True, return_tensors="pt", return_dict=True
        )
        got = model.generate(**ids, max_new_tokens=max_tokens, do_sample=False)
        out.append(tok.decode(got[0, ids["input_ids"].shape[1] :], skip_special_tokens=True))
    return out


@pytest.mark.hf
@pytest.mark.timeout(400)
def test_serve_on_two_torchrun_nodes_answers_and_stops_with_sigterm(tmp_path):
    """``graphrunner serve --tp 2`` from two torchrun "nodes" on 127.0.0.1 (one worker each, node 0's is
    the HTTP server and the driver): the ``openai`` client's greedy answers equal the one-rank model's
    (``generate``, in this process); SIGTERM to the server stops every rank: both torchruns exit 0 and no
    process is left."""
    from extras_util import require

    openai = require("openai")
    require("transformers")
    from graphrunner_tools.models.tiny_chat import tiny_model_dir

    model_dir = tiny_model_dir()
    prompts, max_tokens = ["hello", "what is 2+2?", "tell me a story"], 8
    mark, port, http = uuid.uuid4().hex, _free_port(), _free_port()
    engine = ["--cb-num-blocks", "64", "--cb-block-size", "16", "--cb-max-batch-tokens", "64"]
    serve = _tool("serve", model_dir, "--tp", "2", "--eager", "--port", str(http), *engine)
    procs = _two_nodes(port, mark, lambda n: serve)
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{http}/v1", api_key="none", max_retries=0, timeout=60)
        deadline = time.monotonic() + 240
        while True:
            try:
                model = client.models.list().data[0].id
                break
            except openai.APIConnectionError:
                assert time.monotonic() < deadline and all(p.poll() is None for p in procs), "never served"
                time.sleep(1)
        got = [
            client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": p}], max_tokens=max_tokens, temperature=0
            )
            .choices[0]
            .message.content
            for p in prompts
        ]
        server = _rank_worker(mark, 0, "graphrunner_tools serve")
        assert server is not None
        os.kill(server, signal.SIGTERM)
        outs = [p.communicate(timeout=90)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert [p.returncode for p in procs] == [0, 0], "\n".join(o[-3000:] for o in outs)
    assert got == _greedy_reference(model_dir, prompts, max_tokens)
    assert len(set(got)) > 1  # the prompts reach the model
    assert _marked(mark) == []
