"""Sampling per request (issue 52 item 3): each request samples with its own temperature, top-k, top-p and a
generator of its own seeded from its ``seed``, whatever the model's generation config says, so that a seed
reproduces a request's text under concurrency too, on the graph server and on ``--eager`` alike.

The sampler (:mod:`graphrunner.hf.sampling`) against independent references: transformers' own logits warpers
and a hand computation for the masks, the exponential race drawn by hand with a generator seeded alike, and the
old sampler (transformers' ``ModelRunner._sample``: one ``multinomial`` over the batch from one generator) as the
negative control whose rows depend on the batch. Then two real servers (``graphrunner serve`` and ``--eager``,
the built-in tiny model, started side by side), driven by the ``openai`` client: a seeded request alone and
among 16 concurrent ones (greedy ones among them equal the greedy answer), different seeds, the two servers
against each other.
"""

import concurrent.futures
import json
import os
import time
import types

import pytest
import torch
from extras_util import require
from serve_util import ServerProcess, start_together

require("transformers")

from graphrunner.hf.sampling import GREEDY, RequestSampler, SamplingParams, draw, warp  # noqa: E402

pytestmark = [pytest.mark.hf]

# ---- the sampler, without a server ----


def _reference_probs(logits, t, k, p):
    """transformers' own warpers in ``generate``'s order, then the softmax: an independent reference."""
    from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    x = TemperatureLogitsWarper(t)(None, logits[None].clone())
    if k:
        x = TopKLogitsWarper(k)(None, x)
    if p < 1:
        x = TopPLogitsWarper(p)(None, x)
    return x.softmax(-1)[0]


def test_warp_is_temperature_top_k_and_top_p_as_a_hand_computation_and_transformers_warpers():
    logits = torch.tensor([1.0, 2.0, 3.0, 4.0])
    # temperature 2: softmax of logits / 2
    e = [torch.exp(torch.tensor(v / 2)) for v in (1.0, 2.0, 3.0, 4.0)]
    want = torch.stack(e) / sum(e)
    assert torch.allclose(warp(logits, SamplingParams(temperature=2.0)), want)
    # top_k 2: only the two largest, renormalised
    got = warp(logits, SamplingParams(temperature=1.0, top_k=2))
    e3, e4 = torch.exp(torch.tensor(3.0)), torch.exp(torch.tensor(4.0))
    assert torch.allclose(got, torch.stack([torch.tensor(0.0), torch.tensor(0.0), e3 / (e3 + e4), e4 / (e3 + e4)]))
    # top_p: probabilities 0.1, 0.2, 0.3, 0.4 -> 0.65 keeps the smallest set reaching it, {0.4, 0.3}
    probs = torch.tensor([0.1, 0.2, 0.3, 0.4])
    got = warp(probs.log(), SamplingParams(temperature=1.0, top_p=0.65))
    assert torch.allclose(got, torch.tensor([0.0, 0.0, 0.3 / 0.7, 0.4 / 0.7]))
    # the largest is always kept, however small top_p
    assert torch.equal(warp(probs.log(), SamplingParams(temperature=1.0, top_p=0.01)), torch.tensor([0.0, 0, 0, 1]))
    # against transformers' warpers on random logits of a real vocabulary's size
    g = torch.Generator().manual_seed(0)
    for t, k, p in [(0.7, 0, 1.0), (1.3, 20, 1.0), (0.9, 0, 0.8), (0.5, 50, 0.95), (2.0, 1, 0.5)]:
        row = torch.randn(1000, generator=g) * 3
        assert torch.allclose(
            warp(row, SamplingParams(temperature=t, top_k=k, top_p=p)), _reference_probs(row, t, k, p)
        )


def test_draw_is_the_exponential_race_with_the_generator_and_samples_the_distribution():
    probs = torch.tensor([0.1, 0.2, 0.3, 0.4])
    g, ref = torch.Generator().manual_seed(7), torch.Generator().manual_seed(7)
    for _ in range(20):  # by hand: argmax(p / e), e ~ Exp(1) from a generator seeded alike
        e = torch.empty(4).exponential_(generator=ref)
        assert draw(probs, g) == int(torch.argmax(probs / e))
    counts = torch.bincount(torch.tensor([draw(probs, g) for _ in range(4000)]), minlength=4).float() / 4000
    assert torch.allclose(counts, probs, atol=0.03), counts
    assert draw(torch.tensor([0.0, 1.0, 0.0]), g) == 1  # a masked token is never drawn


def _steps(sampler, batches):
    """Each step's batch (request ids) sampled from fixed logits per (request, step): ``{request: [tokens]}``."""
    out: dict[str, list[int]] = {}
    for step, ids in enumerate(batches):
        rows = torch.stack([_logits(r, step) for r in ids])
        tokens, _ = sampler.sample(rows, ids)
        for r, tok in zip(ids, tokens.tolist()):
            out.setdefault(r, []).append(tok)
    return out


def _logits(request, step):
    g = torch.Generator().manual_seed(1000 * ord(request) + step)
    return torch.randn(99, generator=g) * 2


#: Request "a" alone, then among others, in other places of the batch, one step each.
ALONE = [["a"]] * 12
BATCHED = [["b", "a", "c"], ["a", "c"], ["c", "b", "a"]] * 4


def test_a_requests_tokens_are_its_own_whatever_the_batch_and_the_old_shared_generator_is_not():
    def sampler():
        s = RequestSampler()
        s.add("a", SamplingParams(temperature=1.0, seed=42))
        s.add("b", SamplingParams(temperature=0.8, top_k=5, seed=1))
        s.add("c", SamplingParams(temperature=1.5, top_p=0.9, seed=2))
        return s

    alone, batched = _steps(sampler(), ALONE)["a"], _steps(sampler(), BATCHED)["a"]
    assert alone == batched
    assert alone != [int(_logits("a", i).argmax()) for i in range(12)], "sampled, not greedy"
    # negative control: transformers' own sampling step (one multinomial over the batch, one generator seeded
    # as the request came): request "a"'s tokens change with the requests beside it
    from transformers.generation.continuous_batching.model_runner import ModelRunner

    old = types.SimpleNamespace(do_sample=True, return_logprobs=False)

    def shared(batches):
        torch.manual_seed(42)
        got = []
        for step, ids in enumerate(batches):
            out = torch.zeros(2, len(ids), dtype=torch.int32)
            ModelRunner._sample(old, torch.stack([_logits(r, step) for r in ids])[None], out)
            got.append(int(out[0, ids.index("a")]))
        return got

    with torch.random.fork_rng():
        assert shared(ALONE) == shared(ALONE), "seeded alike, alone: reproduced"
        assert shared(ALONE) != shared(BATCHED), "the old sampler: a's tokens depend on the batch"


def test_greedy_unknown_and_padding_rows_are_the_argmax_and_logprobs_are_the_drawn_distributions():
    s = RequestSampler()
    s.add("g", GREEDY)
    s.add("t", SamplingParams(temperature=0.7, top_k=3, seed=3))
    scores = torch.randn(4, 99, generator=torch.Generator().manual_seed(1))
    tokens, lp = s.sample(scores, ["g", "t", "unknown"], logprobs=True)  # row 3: padding past the requests
    assert tokens[[0, 2, 3]].tolist() == scores[[0, 2, 3]].argmax(-1).tolist()
    probs = warp(scores[1], SamplingParams(temperature=0.7, top_k=3))
    assert probs[tokens[1]] > 0 and torch.allclose(lp[1], probs[tokens[1]].log())
    assert torch.allclose(lp[0], torch.log_softmax(scores[0], -1)[tokens[0]])
    s.forget("t")
    assert s.params("t") is None and len(s) == 1
    for bad in (dict(temperature=-1), dict(top_k=-1), dict(top_p=0), dict(top_p=1.5), dict(seed=2**64)):
        with pytest.raises(ValueError, match=next(iter(bad))):
            SamplingParams(**bad)


def test_sample_per_request_refuses_a_runner_that_would_capture_the_sampling():
    from transformers.generation.continuous_batching.model_runner import ModelRunner

    from graphrunner.hf.model_runner import sample_per_request

    padded = object.__new__(ModelRunner)
    padded.pad_inputs = True
    with pytest.raises(ValueError, match="use_cuda_graph=False"):
        sample_per_request(types.SimpleNamespace(model_runner=padded, inputs_and_outputs=None), RequestSampler())
    other = object.__new__(type("TheirRunner", (ModelRunner,), {}))
    with pytest.raises(TypeError, match="TheirRunner"):
        sample_per_request(types.SimpleNamespace(model_runner=other), RequestSampler())


def test_the_front_door_spells_out_each_requests_sampling_and_seed_whatever_the_models_config():
    from graphrunner_tools.serve_admission import Sampling, admitted_body, request_sampling

    hi = {"messages": [{"role": "user", "content": "hi"}]}
    cases = [  # (body, how it samples)
        ({}, Sampling(0.0, 0, 1.0)),  # no temperature: greedy, not the model's default
        ({"temperature": 0}, Sampling(0.0, 0, 1.0)),
        ({"temperature": 0.7, "top_p": 0.9, "top_k": -1}, Sampling(0.7, 0, 0.9)),
        ({"temperature": 1, "top_k": 5}, Sampling(1.0, 5, 1.0)),
        ({"generation_config": '{"do_sample": true, "top_k": 3}'}, Sampling(1.0, 3, 1.0)),
        ({"temperature": 1.2, "generation_config": '{"temperature": 0.5, "top_p": 0.5}'}, Sampling(1.2, 0, 0.5)),
        ({"temperature": 1.2, "generation_config": '{"do_sample": false}'}, Sampling(0.0, 0, 1.0)),
    ]
    for extra, want in cases:
        body = {**hi, **extra}
        assert request_sampling(body) == want, extra
        out = admitted_body(body, seed=99)
        config = json.loads(out["generation_config"])
        assert "top_k" not in out and out["seed"] == 99 and out["messages"] == hi["messages"]
        if want.temperature:
            assert config == {
                "do_sample": True,
                "temperature": want.temperature,
                "top_k": want.top_k,
                "top_p": want.top_p,
            }
        else:
            assert config == {"do_sample": False}
    out = admitted_body({**hi, "seed": 5, "generation_config": '{"eos_token_id": -1, "max_new_tokens": 3}'}, seed=99)
    assert out["seed"] == 5 and json.loads(out["generation_config"]) == {
        "eos_token_id": -1,
        "max_new_tokens": 3,
        "do_sample": False,
    }


def test_the_front_door_hands_the_app_the_spelled_out_body_a_seed_drawn_only_for_a_request_without_one():
    import asyncio
    import random

    from graphrunner_tools.serve_admission import FrontDoor, Limits

    got = []

    async def app(scope, receive, send):  # transformers' app: what it reads
        got.append(json.loads((await receive())["body"]))
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    async def count(path, body):
        return 5

    def post(door, body):
        raw = json.dumps(body).encode()
        scope = {"type": "http", "method": "POST", "path": "/v1/chat/completions", "headers": [], "query_string": b""}
        messages = [{"type": "http.request", "body": raw, "more_body": False}]

        async def receive():
            return messages.pop(0) if messages else {"type": "http.disconnect"}

        async def send(message):
            pass

        asyncio.run(door(scope, receive, send))
        return got[-1]

    hi = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    doors = [FrontDoor(app, limits=Limits(max_model_len=100), count_prompt=count, seeds=random.Random(3)) for _ in "ab"]
    first = [post(doors[0], {**hi, "temperature": 0.5, "top_k": 4}), post(doors[0], hi)]
    assert first[0]["seed"] != first[1]["seed"] and "top_k" not in first[0]
    assert json.loads(first[0]["generation_config"])["top_k"] == 4
    # the same default seed: the same seeds for the requests without one; a seeded request draws none
    assert post(doors[1], {**hi, "seed": 8})["seed"] == 8
    assert [post(doors[1], {**hi, "temperature": 0.5, "top_k": 4})["seed"], post(doors[1], hi)["seed"]] == [
        first[0]["seed"],
        first[1]["seed"],
    ]


# ---- two real servers (the serve extra; the tests above need transformers only) ----

ENGINE = ["--cb-num-blocks", "64", "--cb-block-size", "16", "--cb-max-batch-tokens", "64", "--cb-max-requests", "16"]
#: Tokens a request generates; no end-of-sequence token, so each answer has them all.
NEW = 14
ENDLESS = json.dumps({"eos_token_id": -1})
PROMPT = "tell me a story"


class Server(ServerProcess):
    """A ``graphrunner serve`` process with small engine settings and an ``openai`` client: :meth:`chat` and
    :meth:`complete` return an answer of :data:`NEW` tokens (no end-of-sequence token)."""

    def __init__(self, tmp, name, *flags):
        import openai

        try:
            super().__init__(
                [*ENGINE, *flags],
                os.path.join(tmp, f"{name}.log"),
                240,
                env={"GRAPHRUNNER_CACHE": os.path.join(tmp, "cache"), "OMP_NUM_THREADS": "1"},
            )
        except RuntimeError as exc:
            raise AssertionError(str(exc)) from None
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0, timeout=120)
        self.model = self.client.models.list().data[0].id

    def chat(self, content=PROMPT, generation=None, **kw):
        extra = {
            **kw.pop("extra_body", {}),
            "generation_config": json.dumps({"eos_token_id": -1, **(generation or {})}),
        }
        r = self.client.chat.completions.create(
            model=self.model,
            messages=[{"role": "user", "content": content}],
            max_tokens=NEW,
            extra_body=extra,
            **kw,
        )
        assert r.usage.completion_tokens == NEW, r
        return r.choices[0].message.content

    def complete(self, prompt, **kw):
        r = self.client.completions.create(
            model=self.model, prompt=prompt, max_tokens=NEW, extra_body={"generation_config": ENDLESS}, **kw
        )
        assert r.usage.completion_tokens == NEW, r
        return r.choices[0].text


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """A graph server and an ``--eager`` one, started side by side (each takes tens of seconds to start)."""
    for module in ("fastapi", "uvicorn", "prometheus_client", "openai"):
        require(module)
    from graphrunner_tools.models.tiny_chat import tiny_model_dir

    tmp = str(tmp_path_factory.mktemp("sampling"))
    tiny_model_dir(os.path.join(tmp, "cache", "tiny-chat-3"))  # built once, before both servers load it
    flags = {"graphs": ("--max-graphs", "tokens=3,kv=2,reqs=3"), "eager": ("--eager",)}
    started = start_together({name: (lambda name=name: Server(tmp, name, *flags[name])) for name in flags})
    yield started
    codes = {name: s.stop() for name, s in started.items()}
    assert codes == {"graphs": 0, "eager": 0}, codes


@pytest.fixture(scope="module", params=["graphs", "eager"])
def server(request, servers):
    return servers[request.param]


#: The requests sent 16 at once: (kind, arguments); the seeded one of the test is first.
SEEDED = dict(temperature=1.0, seed=1234)


def _mix():
    mix = [("chat", dict(SEEDED))]
    mix += [("chat", dict(content=f"q{i} {PROMPT}", temperature=0)) for i in range(4)]  # greedy
    mix += [("chat", dict(content=f"q{i} {PROMPT}")) for i in range(4, 6)]  # greedy: no temperature
    mix += [("chat", dict(temperature=0.7, top_p=0.9, seed=i)) for i in range(3)]
    mix += [("chat", dict(temperature=1.3, extra_body={"top_k": 8}, seed=9))]
    mix += [("chat", dict(temperature=1.0))] * 2  # unseeded
    mix += [("complete", dict(prompt="once upon a time", temperature=0.9, seed=77))]
    mix += [("chat", dict(SEEDED))]  # the seeded request again, in the same batch
    mix += [("chat", dict(generation={"do_sample": True, "temperature": 0.6, "top_k": 4}, seed=5))]
    assert len(mix) == 16
    return mix


def _send(server, kind, kw):
    kw = dict(kw)
    return server.complete(kw.pop("prompt"), **kw) if kind == "complete" else server.chat(**kw)


@pytest.mark.slow
def test_a_seeded_request_gives_its_text_alone_and_among_16_concurrent_requests(server):
    mix = _mix()
    alone = [_send(server, kind, kw) if "seed" in kw or kw.get("temperature", 0) == 0 else None for kind, kw in mix]
    with concurrent.futures.ThreadPoolExecutor(len(mix)) as pool:
        together = list(pool.map(lambda m: _send(server, *m), mix))
    for (kind, kw), a, b in zip(mix, alone, together):
        if a is not None:
            assert a == b, (kind, kw, a, b)
    assert together[0] == together[-2] == alone[0]
    # the greedy ones are the greedy answers: temperature 0 and no temperature alike
    for i in range(1, 7):
        assert together[i] == server.chat(f"q{i - 1} {PROMPT}", temperature=0)
    # the sampled ones all differ but the seeded request sent twice; the unseeded ones each a fresh generator
    sampled = [together[i] for i in (0, 7, 8, 9, 10, 11, 12, 13, 15)]
    assert len(set(sampled)) == len(sampled), sampled


@pytest.mark.slow
def test_seeds_differ_greedy_is_temperature_0_and_do_sample_false(server):
    texts = {s: server.chat(temperature=1.0, seed=s) for s in range(5)}
    assert len(set(texts.values())) == 5, texts
    assert server.chat(temperature=1.0, seed=3) == texts[3]
    greedy = server.chat(temperature=0)
    assert greedy == server.chat() == server.chat(temperature=1.2, generation={"do_sample": False}, seed=3)
    assert greedy not in texts.values()
    # top_k 1 at any temperature is the greedy answer; the seed changes nothing there
    assert server.chat(temperature=1.5, extra_body={"top_k": 1}, seed=11) == greedy


@pytest.mark.slow
def test_the_graph_and_eager_servers_sample_alike_the_graph_server_from_graphs(servers):
    graphs, eager = servers["graphs"], servers["eager"]
    deadline = time.monotonic() + 60
    while graphs.metric("graphrunner_ready") < 1:  # its keys captured: the next steps replay graphs
        assert time.monotonic() < deadline, graphs.output()
        time.sleep(0.5)
    replayed = f'graphrunner_steps_total{{model="{graphs.model}",path="replayed"}}'
    before = graphs.metrics()[replayed]
    asks = [dict(temperature=1.0, seed=s) for s in (1, 2)] + [dict(temperature=0.8, top_p=0.8, seed=3)]
    asks += [dict(temperature=0)]
    got = [graphs.chat(**kw) for kw in asks]
    assert graphs.metrics()[replayed] - before >= NEW * len(asks), "every step replayed from a graph"
    assert got == [eager.chat(**kw) for kw in asks]
