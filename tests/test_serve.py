"""``graphrunner serve``: a real server process on 127.0.0.1, driven by the real ``openai`` client.

The reference is the same command with ``--eager`` (transformers' own continuous-batching engine, no
graphs): greedy answers must be equal, text for text, one request at a time and 16 at once. The
server under test has small cache and batch settings, so its capture before serving (the default)
takes seconds and its keys are re-planned (``--replan-every 32 --replan-share 1``) during the tests. Skipped without the
``serve`` extra (``pip install -e '.[serve]'``).
"""

import json
import os
import pathlib
import signal
import threading
import time
import urllib.error
import urllib.request

import pytest
from extras_util import require

require("transformers")
require("fastapi")
require("uvicorn")
require("prometheus_client")
openai = require("openai")

from serve_util import ServerProcess, start_together  # noqa: E402

pytestmark = [pytest.mark.hf, pytest.mark.slow]

#: Small engine settings: 64 cache blocks of 16 tokens, 64 tokens and 16 requests a step.
ENGINE = ["--cb-num-blocks", "64", "--cb-block-size", "16", "--cb-max-batch-tokens", "64", "--cb-max-requests", "16"]

#: Seconds a server may take to load and listen (it builds the tiny model, loads it, starts its engine).
START = 180


class Server(ServerProcess):
    """A ``graphrunner serve`` process (:class:`serve_util.ServerProcess`) with the small
    :data:`ENGINE` settings, a tiny model built under the test's temp dir, and an ``openai`` client."""

    def __init__(self, tmp, *flags, env=None, name=None):
        log = os.path.join(tmp, f"serve-{name or len(os.listdir(tmp))}.log")
        cache = os.path.join(os.path.dirname(tmp), "cache")
        try:
            super().__init__(
                [*ENGINE, *flags],
                log,
                START,
                env={"GRAPHRUNNER_CACHE": cache, "OMP_NUM_THREADS": "1", **(env or {})},
                probe=True,  # /ready and /metrics read at the first /health 200: at_health
            )
        except RuntimeError as exc:
            raise AssertionError(str(exc)) from None
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0, timeout=120)
        self.model = self.client.models.list().data[0].id

    def chat(self, content, max_tokens=12, **kw):
        r = self.client.chat.completions.create(
            model=self.model,
            messages=[{"role": "user", "content": content}],
            max_tokens=max_tokens,
            temperature=0,
            **kw,
        )
        return r.choices[0].message.content


#: The module's servers, started side by side once: name -> (flags, extra environment).
FLEET = {
    "graphs": (("--replan-every", "32", "--replan-share", "1"), {}),  # re-plans without rest: during the tests
    "eager": (("--eager",), {}),
    "dense": (("--attention", "dense", "--max-graphs", "tokens=3,kv=2,reqs=2"), {}),  # its own test only
    # stopped by its test; answers at once, its capture slowed until the fleet listens: the negative control of the
    # default capture before serving
    "sigterm": (("--capture-in-background",), {"GRAPHRUNNER_SERVE_SLOW_CAPTURE": "{tmp}/slow"}),
    "first": ((), {}),  # the default flags: every key captured before /health answers
    # one graph (the ladder's largest key): little capture beside the steps; steps raise while the file exists
    "fault": (("--max-graphs", "1"), {"GRAPHRUNNER_SERVE_FAULT": "{tmp}/fault"}),
}


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    from graphrunner_tools.models.tiny_chat import tiny_model_dir

    tmp = str(tmp_path_factory.mktemp("serve"))
    tiny_model_dir(os.path.join(os.path.dirname(tmp), "cache", "tiny-chat-3"))  # built once, before they load it

    def maker(name):
        flags, env = FLEET[name]
        return lambda: Server(tmp, *flags, env={k: v.format(tmp=tmp) for k, v in env.items()}, name=name)

    slow = pathlib.Path(tmp) / "slow"
    slow.write_text("")  # the sigterm server's capture is slowed while it exists
    try:
        made = start_together({name: maker(name) for name in FLEET})
    finally:
        slow.unlink()
    made["tmp"] = tmp
    yield made
    codes = {name: made[name].stop() for name in ("graphs", "eager", "first")}
    want = {"graphs": 0, "eager": 0, "first": 0}
    assert codes == want, f"SIGTERM: each exits 0, got {codes}\n{made['graphs'].output()}"
    for name in ("dense", "sigterm", "fault"):
        made[name].stop(signal.SIGKILL)  # stopped by their tests, unless one failed first


@pytest.fixture(scope="module")
def servers(fleet):
    return fleet["graphs"], fleet["eager"]


PROMPTS = [
    "hello there",
    "what is a graph?",
    "x",
    "count: 1 2 3 4 5 6 7 8 9",
    "tell me a story about a cat " * 3,
    "ok",
    "The quick brown fox jumps over the lazy dog.",
    "?" * 40,
]


def _replayed(server):
    return server.metrics()[f'graphrunner_steps_total{{model="{server.model}",path="replayed"}}']


def _warm(server, timeout=120):
    """Calls ``server`` until its planned keys are captured (a background capture's keys start replaying
    at a call); the graphs captured."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        server.chat("warm up", max_tokens=2)
        captured, planned = server.metric("graphrunner_graphs_captured"), server.metric("graphrunner_graphs_planned")
        if captured >= planned > 0:
            return captured
        time.sleep(0.2)
    raise AssertionError(f"the keys were not captured within {timeout} s:\n{server.output()}")


def test_greedy_chat_completions_equal_the_eager_server(servers):
    graphs, eager = servers
    _warm(graphs)
    steps, replayed = graphs.metric("graphrunner_steps_total"), _replayed(graphs)
    got = [graphs.chat(p) for p in PROMPTS]
    steps, replayed = graphs.metric("graphrunner_steps_total") - steps, _replayed(graphs) - replayed
    want = [eager.chat(p) for p in PROMPTS]
    assert got == want
    assert len(set(want)) > 1 and all(len(w) == 12 for w in want), "12 characters each, differing by prompt"
    # graphs answered, not eager steps on both sides: 12 steps a request at least (one token a step)
    assert steps >= 12 * len(PROMPTS) and replayed >= steps / 2, (steps, replayed)
    assert graphs.metric("graphrunner_graphs_enabled") == 1 and eager.metric("graphrunner_graphs_enabled") == 0
    assert _replayed(eager) == 0


def _ready(server, timeout=120):
    """``GET /ready``'s status and body once it answers 200, or the last 503's after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(server.url + "/ready", timeout=30) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as exc:
            if time.monotonic() > deadline:
                return exc.code, json.loads(exc.read())
        time.sleep(0.2)


def test_the_dense_attention_cuda_replays_serves_the_eager_servers_answers(servers, fleet):
    """``--attention dense``: the step's dense masks (what CUDA graphs replay) on the tape; greedy answers equal
    the eager server's, from replayed steps. The server captures its keys from the start: ``/ready`` turns 200
    with every planned key captured before any request was served (no step run)."""
    _, eager = servers
    dense = fleet["dense"]
    try:
        status, body = _ready(dense)
        assert status == 200 and body["ready"] and body["graphs_captured"] == body["graphs_planned"] > 0, body
        assert dense.metric("graphrunner_steps_total") == 0 and dense.metric("graphrunner_ready") == 1
        _warm(dense)
        replayed = _replayed(dense)
        got = [dense.chat(p) for p in PROMPTS[:4]]
        assert got == [eager.chat(p) for p in PROMPTS[:4]]
        assert _replayed(dense) - replayed >= 12 * 4 / 2
    finally:
        assert dense.stop() == 0, dense.output()


def _steps_at(metrics, model):
    """``(replayed, eager)`` steps in a ``/metrics`` snapshot."""
    return tuple(metrics[f'graphrunner_steps_total{{model="{model}",path="{path}"}}'] for path in ("replayed", "eager"))


def test_capture_first_answers_health_only_once_every_graph_is_captured_then_replays_every_step(servers, fleet):
    """The default on one rank (``--capture-first``): the first time ``/health`` answers 200, ``/ready`` is already
    200 with every planned key captured and no step run (``/metrics``), and the server printed its last progress
    line; then greedy answers equal the ``--eager`` server's, every step of them replayed from graphs (none
    eager). The negative control: the same probe of a ``--capture-in-background`` server (the ``sigterm`` server,
    its capture slowed by ``GRAPHRUNNER_SERVE_SLOW_CAPTURE`` until every server listens) sees ``/ready`` 503 with
    fewer keys captured than planned: ``/health`` there does not wait for the graphs."""
    _, eager = servers
    first, default = fleet["first"], fleet["sigterm"]
    probe = first.at_health
    assert probe["ready_status"] == 200, probe["ready"]
    ready = probe["ready"]
    assert ready["ready"] and ready["graphs_captured"] == ready["graphs_planned"] > 1, ready
    assert _steps_at(probe["metrics"], first.model) == (0, 0), "no step ran before the server answered"
    planned = ready["graphs_planned"]
    log = first.output(tail=100_000)
    assert f"captured {planned}/{planned} keys in " in log, log  # its last progress line
    # negative control: a --capture-in-background server answers /health while its keys are still being captured
    control = default.at_health
    assert control["ready_status"] == 503, control
    assert control["ready"]["graphs_captured"] < control["ready"]["graphs_planned"], control
    # from the first request on, every step replays
    got = [first.chat(p) for p in PROMPTS]
    replayed, eager_steps = _steps_at(first.metrics(), first.model)
    assert got == [eager.chat(p) for p in PROMPTS]
    assert eager_steps == 0, f"{eager_steps:.0f} steps ran eagerly: a key was not captured at the start"
    assert replayed >= len(PROMPTS) * 2, replayed  # at least a prefill and a decode step each


def _capture_first_session(model):
    """A tiny model's manager made as ``graphrunner serve --capture-first`` makes it (``ServedModel``, in this
    process), over a short ladder."""
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    from graphrunner_tools.serve_engine import ServedModel

    options = {"device": "tape", "replan_every": 0, "max_graphs": {"tokens": 2, "kv": 2, "reqs": 1}}
    config = ContinuousBatchingConfig(
        page_size=16, num_blocks=32, max_batch_tokens=32, max_requests_per_batch=4, use_cuda_graph=False
    )
    generation = GenerationConfig(max_new_tokens=4, do_sample=False, eos_token_id=-1, pad_token_id=0)
    return ServedModel(model, options, capture_first=True).init_continuous_batching(generation, config)


def test_capture_first_a_capture_that_fails_at_the_start_raises_naming_it(capsys):
    """``--capture-first`` in the model's process: a key's capture that fails makes the model's load raise a
    ``CaptureError`` naming the error and the keys captured (transformers' loader then fails the server's start,
    exit 1), at once, not a wait for ever; the control, the same model without the fault, returns its manager
    with every key captured and no step run."""
    import graphrunner as gr
    from graphrunner.errors import CaptureError
    from graphrunner_tools.models.hf_tiny import build_tiny

    served = _capture_first_session(build_tiny("llama", seed=0, max_position_embeddings=512))
    hook = gr.hf.graphs_of(served.wrapped)
    try:
        planned = len(hook.runner.keys)
        assert hook.captured() == planned > 1 and hook.stats.steps == 0
        assert f"captured {planned}/{planned} keys in " in capsys.readouterr().err
    finally:
        served.wrapped.destroy()
        hook.release()
    model = build_tiny("llama", seed=0, max_position_embeddings=512)

    def broken(module, args):  # every forward of the capture raises (the manager's own warm-up runs none)
        raise RuntimeError("a fault of the test")

    model.register_forward_pre_hook(broken)
    t0 = time.monotonic()
    with pytest.raises(CaptureError, match=rf"failed after 0 of {planned} keys .*RuntimeError: a fault of the test"):
        _capture_first_session(model)
    assert time.monotonic() - t0 < 60
    assert f"the capture failed after 0/{planned} keys" in capsys.readouterr().err


def test_streaming_equals_non_streaming(servers):
    graphs, _ = servers
    for p in PROMPTS[:4]:
        stream = graphs.client.chat.completions.create(
            model=graphs.model, messages=[{"role": "user", "content": p}], max_tokens=12, temperature=0, stream=True
        )
        text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        assert text == graphs.chat(p)


def test_sixteen_concurrent_clients_are_all_answered_and_equal(servers):
    graphs, eager = servers
    prompts = [f"request {i}: " + "abc" * i for i in range(16)]
    want = [eager.chat(p, max_tokens=16) for p in prompts]
    before = graphs.metric("graphrunner_steps_total")
    got, errors = [None] * 16, []

    def ask(i):
        try:
            got[i] = graphs.chat(prompts[i], max_tokens=16)
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(repr(exc))

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    assert errors == [] and got == want
    steps = graphs.metric("graphrunner_steps_total") - before
    # one request a step would take 16 x 17 = 272 steps (35 were seen batched): several requests a step
    assert 16 <= steps <= 100, f"{steps} steps: the 16 requests were not batched together"
    assert _replayed(graphs) > 0


@pytest.mark.parametrize(
    "bad, status, words",
    [
        ({"model": "no-such-model"}, 400, "no-such-model"),
        ({"max_tokens": 0}, 400, "max_tokens must be at least 1"),
        ({"max_tokens": -3}, 400, "got -3"),
        ({"messages": [{"role": "user", "content": "y" * 2000}]}, 400, "maximum context length is 1024 tokens"),
    ],
)
def test_bad_input_is_a_4xx_naming_it_and_the_next_request_is_right(servers, bad, status, words):
    graphs, eager = servers
    body = {"model": graphs.model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, **bad}
    with pytest.raises(openai.APIStatusError) as err:
        graphs.client.chat.completions.create(**body)
    assert err.value.status_code == status and words in str(err.value.body)
    assert graphs.chat("after a bad request") == eager.chat("after a bad request")


@pytest.mark.parametrize(
    "path, body",
    [
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 0}),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 0}),
        ("/v1/responses", {"input": "hi", "max_output_tokens": -1}),
    ],
)
def test_fewer_than_one_token_is_a_400_naming_the_field_on_every_route(servers, path, body):
    graphs, _ = servers
    field = next(k for k in body if k.startswith("max_"))
    req = urllib.request.Request(
        graphs.url + path,
        data=json.dumps({"model": graphs.model, **body}).encode(),
        headers={"content-type": "application/json"},
    )
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(req, timeout=30)
    assert err.value.code == 400
    error = json.loads(err.value.read())["error"]
    assert error["param"] == field and error["type"] == "invalid_request_error"
    assert error["message"].startswith(f"{field} must be at least 1")


def test_malformed_json_is_a_422_and_the_next_request_is_right(servers):
    graphs, eager = servers
    for raw in (b'{"model": ', b"[1, 2]"):
        req = urllib.request.Request(
            graphs.url + "/v1/chat/completions", data=raw, headers={"content-type": "application/json"}
        )
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(req, timeout=30)
        assert err.value.code == 422
        assert json.loads(err.value.read())["detail"], "the answer says what was wrong"
    assert graphs.chat("after malformed json") == eager.chat("after malformed json")


def _wait_for(server, name, predicate, timeout=30):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = server.metric(name)
        if predicate(value):
            return value
        time.sleep(0.2)
    return server.metric(name)


#: A request that cannot end by itself: no end-of-sequence token (transformers' ``generation_config`` field).
ENDLESS = {"generation_config": json.dumps({"eos_token_id": -1})}


def test_a_client_that_disconnects_mid_stream_frees_its_cache_blocks(servers):
    graphs, _ = servers
    assert _wait_for(graphs, "graphrunner_requests_active", lambda v: v == 0) == 0
    stream = graphs.client.chat.completions.create(
        model=graphs.model,
        messages=[{"role": "user", "content": "go"}],
        max_tokens=900,
        temperature=0,
        stream=True,
        extra_body=ENDLESS,
    )
    chunks = iter(stream)
    for _ in range(3):
        next(chunks)
    # control: the request runs (it would for 900 steps) and holds cache blocks when the client leaves
    assert graphs.metric("graphrunner_requests_active") == 1
    assert graphs.metric("graphrunner_kv_cache_held_blocks") >= 1
    left = graphs.metric("graphrunner_steps_total")
    stream.close()  # the client goes away mid-stream
    assert _wait_for(graphs, "graphrunner_requests_active", lambda v: v == 0) == 0
    steps = graphs.metric("graphrunner_steps_total") - left
    assert steps < 300, f"the request ran {steps:.0f} steps after its client left: not cancelled"
    assert graphs.metric("graphrunner_kv_cache_held_blocks") == 0
    total = graphs.metric("graphrunner_kv_cache_blocks")
    free, cached = (
        graphs.metric("graphrunner_kv_cache_free_blocks"),
        graphs.metric("graphrunner_kv_cache_cached_blocks"),
    )
    assert free + cached == total, "every block is free or kept by the prefix cache for a later prompt"


def test_sigterm_with_a_request_in_flight_exits_0_within_seconds(fleet):
    server = fleet["sigterm"]
    done = []

    def ask():
        try:
            stream = server.client.chat.completions.create(
                model=server.model,
                messages=[{"role": "user", "content": "long"}],
                max_tokens=900,
                temperature=0,
                stream=True,
                extra_body=ENDLESS,
            )
            done.append(sum(1 for _ in stream))
        except Exception as exc:  # noqa: BLE001 - the server went away: expected
            done.append(exc)

    t = threading.Thread(target=ask)
    t.start()
    # in flight when SIGTERM comes: it runs for 900 steps, SIGTERM follows this read at once
    assert _wait_for(server, "graphrunner_requests_active", lambda v: v == 1) == 1, server.output()
    t0 = time.monotonic()
    code = server.stop(signal.SIGTERM, timeout=60)
    seconds = time.monotonic() - t0
    t.join(60)
    assert code == 0, server.output()
    assert seconds < 20, f"SIGTERM took {seconds:.1f} s (bounds a hang: the shutdown waits at most 5 s for requests)"
    assert done, "the client got an answer or an error, not a hang"


FAULT = "a fault injected for a test"


def _fails(call):
    """The 5xx error ``call()`` raises (``openai.APIError``: a status error, or a stream's error event)."""
    with pytest.raises(openai.APIError) as info:
        call()
    exc = info.value
    assert getattr(exc, "status_code", 500) >= 500, exc
    return f"{exc} {exc.body}"


def test_a_step_that_raises_fails_its_request_the_engine_serves_on_and_a_broken_engine_exits_1(fleet):
    """``GRAPHRUNNER_SERVE_FAULT`` (tests only) names a file: while it exists, the steps raise (the count it
    holds). One step raises: its request is a 500 naming the error (a stream: an error event), the next
    greedy request is answered as before, ``/health`` is 200. Three steps in a row raise (the engine's fault):
    the engine stops and the server exits 1 within seconds, naming the cause, not a process answering 503."""
    fault = pathlib.Path(fleet["tmp"]) / "fault"
    server = fleet["fault"]
    try:
        before = server.chat("hello there")
        fault.write_text("1")
        error = _fails(lambda: server.chat("what is a graph?"))
        assert "500" in error and FAULT in error and "the step serving this request raised" in error, error
        assert not fault.exists(), "the step that raised took the fault"
        assert server.chat("hello there") == before, "the engine serves on, its answers as before"
        stream = server.client.chat.completions.create(
            model=server.model,
            messages=[{"role": "user", "content": "long"}],
            max_tokens=900,
            temperature=0,
            stream=True,
            extra_body=ENDLESS,
        )
        chunks = iter(stream)
        next(chunks)
        fault.write_text("1")  # mid-stream: the request's next step raises
        assert FAULT in _fails(lambda: [None for _ in chunks])
        with urllib.request.urlopen(server.url + "/health", timeout=30) as r:
            assert r.status == 200
        assert server.chat("hello there") == before
        assert server.metric("graphrunner_failed_steps_total") == 2
        # a broken engine (every step raises): the third failed step in a row stops it
        fault.write_text("3")
        errors = [_fails(lambda p=p: server.chat(p)) for p in ("a", "b", "c")]
        assert all(FAULT in e for e in errors), errors
        t0 = time.monotonic()
        code = server.proc.wait(timeout=60)
        seconds = time.monotonic() - t0
    finally:
        server.stop()
    with open(server.log_path) as f:
        output = f.read()
    assert code == 1, output
    assert seconds < 10, f"the server took {seconds:.1f} s to exit after the engine died"
    assert "graphrunner serve: the engine died" in output and FAULT in output, output


def test_metrics_show_graphs_steps_and_requests(servers):
    graphs, _ = servers
    m = graphs.metrics()
    names = {k.partition("{")[0] for k in m}
    for name in (
        "graphrunner_steps_total",
        "graphrunner_graphs_planned",
        "graphrunner_graphs_captured",
        "graphrunner_capture_seconds",
        "graphrunner_padded_tokens_total",
        "graphrunner_fallbacks_total",
        "graphrunner_replans_total",
        "graphrunner_kv_cache_free_blocks",
        "graphrunner_http_requests_total",
    ):
        assert name in names or name == "graphrunner_fallbacks_total", name
    planned = graphs.metric("graphrunner_graphs_planned")
    graphs.chat("one more call")  # a re-plan's keys start replaying at a call
    assert _wait_for(graphs, "graphrunner_graphs_captured", lambda v: v == planned > 0, timeout=60) == planned > 0
    assert graphs.metric("graphrunner_capture_seconds") > 0
    # the per-rank families: one rank, rank "0", the same figures as the server's own (one snapshot)
    m = graphs.metrics()
    label = f'{{model="{graphs.model}",rank="0"}}'
    assert m["graphrunner_rank_graphs_captured" + label] == planned
    assert m["graphrunner_rank_capture_seconds" + label] == m[f'graphrunner_capture_seconds{{model="{graphs.model}"}}']
    for path in ("replayed", "eager"):
        own = f'graphrunner_steps_total{{model="{graphs.model}",path="{path}"}}'
        assert m[f'graphrunner_rank_steps_total{{model="{graphs.model}",path="{path}",rank="0"}}'] == m[own]
    assert m["graphrunner_rank_collective_wait_seconds_total" + label] == 0  # no other rank to wait for
    ok = sum(v for k, v in m.items() if k.startswith("graphrunner_http_requests_total") and 'status="200"' in k)
    assert ok >= len(PROMPTS)


def test_a_model_dir_that_is_not_a_directory_is_a_usage_error(tmp_path, capsys):
    from graphrunner_tools.cli import main

    assert main(["serve", str(tmp_path / "no-such-model")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no-such-model" in err and "is not a directory" in err


@pytest.mark.parametrize(
    "flags, words",
    [
        (["--capture-first", "--eager"], ["--capture-first", "--eager", "nothing to capture"]),
        (["--capture-in-background", "--eager"], ["--capture-in-background", "--eager", "nothing to capture"]),
        (["--capture-first", "--capture-in-background"], ["--capture-in-background", "not allowed with"]),
    ],
)
def test_capture_first_or_in_background_with_eager_is_a_usage_error(flags, words, capsys):
    """``--capture-first`` or ``--capture-in-background`` with ``--eager`` (no graphs), or both: one line naming
    them, exit 2, before anything starts."""
    from graphrunner_tools.cli import main

    assert main(["serve", *flags]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and all(w in err for w in words), err


@pytest.mark.parametrize(
    "flags, first",
    [
        ([], True),  # one rank with graphs: capture before serving
        (["--capture-first"], True),
        (["--capture-in-background"], False),
        (["--eager"], False),  # nothing to capture
        (["--backend", "eager"], False),  # graphrunner's step without graphs: nothing replays
        (["--tp", "2"], True),  # every rank's loop runs, granting the keys, before the server answers
        (["--tp", "2", "--capture-in-background"], False),
        (["--tp", "2", "--eager"], False),
    ],
)
def test_the_capture_before_serving_is_the_default_with_a_graph_backend(flags, first):
    """Where the ladder is captured, as the checks resolve it: before the server answers by default with a graph
    backend, on one rank or several (or with ``--capture-first``), beside the first requests with
    ``--capture-in-background``, not before serving with ``--eager`` or ``--backend eager`` (no graph to wait
    for)."""
    from graphrunner_tools.cli import build_parser

    parser = build_parser()
    args = parser.parse_args(["serve", *flags])
    args.check(parser, args)  # no usage error
    assert args.capture_first is first


@pytest.mark.parametrize("share", ["0", "1.5", "-0.1"])
def test_a_replan_share_outside_0_1_is_a_usage_error(share, capsys):
    from graphrunner_tools.cli import main

    assert main(["serve", "--replan-share", share]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--replan-share" in err and "(0, 1]" in err
