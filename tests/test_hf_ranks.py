"""gr.hf's manager on real tensor-parallel gloo ranks (``BatchingOptions.group``, as ``graphrunner serve --tp``
gives every rank's manager): the ladder captured while the loop is idle, and re-plans decided at the same step
on every rank, their keys granted in idle calls.

Each rank loads a tiny random-weight Llama with transformers' tensor parallelism (``tp_size=2``) and makes a
manager; rank 0 (transformers' driver) adds the prompts, rank 1 follows it step by step (transformers' loop
all-reduces its state at every iteration, idle ones included). The reference is transformers' own engine on the
same TP model (``generate_batch``), token for token. The TP server over HTTP: tests/test_serve_tp.py.
"""

import time

import pytest
from extras_util import require
from mp_util import run_ranks

require("transformers")

pytestmark = [pytest.mark.hf, pytest.mark.slow]

TIMEOUT, NEW = 20.0, 10


def _session(manager, rank, inputs):
    """One session: rank 0 adds ``inputs`` and collects their tokens (``req_<i>`` -> tokens); rank 1's loop
    follows until the driver's stop ends it (its outputs drained). Both stop keeping the cache."""
    manager.start()
    out = {}
    if rank == 0:
        ids = manager.add_requests(inputs=inputs, max_new_tokens=NEW)
        name = {rid: f"req_{i}" for i, rid in enumerate(ids)}
        while len(out) < len(inputs):
            r = manager.get_result(timeout=60)
            assert r is not None and r.error is None, r
            if r.is_finished():
                out[name[r.request_id]] = r.generated_tokens
        manager.stop(block=True, keep_for_next_session=True)
    else:
        while manager.is_running():
            manager.get_result(timeout=0.1)
        manager.stop(block=True, keep_for_next_session=True)
    return out


def _idle(manager, hook, done):
    """Both ranks: the loop runs with no request until ``done(hook)`` on rank 0 (at most 60 s; rank 0 stops
    the loop then, rank 1 follows)."""
    manager.start()
    if hook.options.group.rank == 0:
        deadline = time.monotonic() + 60
        while not done(hook) and time.monotonic() < deadline:
            time.sleep(0.05)
    else:
        while manager.is_running():
            time.sleep(0.05)
    manager.stop(block=True, keep_for_next_session=True)


def _ranks(rank, world, path, shares, agree_rest):
    """On each rank: the TP model, the reference tokens of prompts a and b, then a manager (autocapture, a
    re-plan due every 8 steps, this rank's ``replan_share`` from ``shares``) over the ranks' group: an idle
    start (the ladder captured before any request), then sessions a, b, a, an idle spell (a re-plan's keys), b.
    ``agree_rest=False``: the negative control, each rank's own rest decides whether a re-plan starts."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig
    from transformers.distributed import DistributedConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    import graphrunner as gr
    import graphrunner.hf  # noqa: F401
    import graphrunner.hf.batching as batching

    torch.set_num_threads(1)
    if not agree_rest:
        batching.GraphBatching._resting = lambda self: time.perf_counter() < self._rest_until
    kw = {"dtype": torch.float32, "attn_implementation": "sdpa"}
    model = AutoModelForCausalLM.from_pretrained(path, distributed_config=DistributedConfig(tp_size=world), **kw)
    gc = GenerationConfig(max_new_tokens=NEW, do_sample=False, eos_token_id=-1, pad_token_id=0)

    def cb():
        return ContinuousBatchingConfig(page_size=16, num_blocks=64, max_batch_tokens=64, max_requests_per_batch=8)

    g = torch.Generator().manual_seed(4)
    a, b = (
        [torch.randint(3, 96, (int(k),), generator=g).tolist() for k in torch.randint(2, 30, (8,), generator=g)]
        for _ in range(2)
    )
    ref = {}
    for name, inputs in (("a", a), ("b", b)):
        out = model.generate_batch(inputs=inputs, generation_config=gc, continuous_batching_config=cb())
        ref[name] = {k: v.generated_tokens for k, v in out.items()}
    group = gr.TorchDistGroup(timeout=TIMEOUT, tensor_parallel=True)
    manager = gr.hf.init_continuous_batching(
        model, gc, cb(), device="tape", autocapture=True, replan_every=8, replan_share=shares[rank], group=group
    )
    hook = gr.hf.graphs_of(manager)
    got, idle_captured = [], None
    try:
        _idle(manager, hook, lambda h: h.captured() == len(h.runner.keys))
        idle_captured = (hook.captured(), len(hook.runner.keys), hook.stats.steps)
        ladder_keys = sorted(tuple(k) for k in hook.runner.keys)
        for name in ("a", "b", "a"):
            got.append((name, _session(manager, rank, a if name == "a" else b)))
        _idle(manager, hook, lambda h: h._pending is None)
        got.append(("b", _session(manager, rank, b)))
        keys = sorted(tuple(k) for k in hook.runner.keys)
    finally:
        manager.destroy()
        hook.release()
    same = [sum(ref[name][k] == out.get(k) for k in ref[name]) for name, out in got] if rank == 0 else None
    return {
        "idle": idle_captured,
        "same": same,
        "replans": hook.stats.replans,
        "ladder": ladder_keys,
        "keys": keys,
        "replayed": hook.stats.replayed,
        "steps": hook.stats.steps,
        "failed_steps": hook.stats.failed_steps,
    }


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    from tp_util import tiny_llama_dir

    return tiny_llama_dir(tmp_path_factory.mktemp("llama"), vocab_size=96, num_hidden_layers=2)


def test_tp_ranks_capture_the_ladder_idle_and_replan_at_the_same_step(llama):
    """Both ranks rest for nothing (``replan_share=1``): the ladder is captured in the loop's idle iterations
    with no step served; the re-plans start at the same steps on both ranks and their keys take over on both;
    every token is transformers' own TP engine's."""
    res = run_ranks(_ranks, world_size=2, timeout=400, args=(llama, (1.0, 1.0), True))
    for r in res:
        assert r.ok and r.exitcode == 0 and not r.timed_out, r
    v0, v1 = res[0].value, res[1].value
    assert v0["idle"] == v1["idle"] and v0["idle"][0] == v0["idle"][1] > 1 and v0["idle"][2] == 0
    assert v0["same"] == [8, 8, 8, 8], "every token transformers' own"
    assert v0["replans"] == v1["replans"] >= 1, "the same re-plans on both ranks"
    assert v0["keys"] == v1["keys"] != v0["ladder"], "the re-planned keys took over on both ranks"
    assert v0["replayed"] == v1["replayed"] > 0 and v0["steps"] == v1["steps"] and v0["failed_steps"] == 0


def test_a_rank_still_resting_holds_every_ranks_replan_and_without_the_agreement_they_part(llama):
    """Rank 1 rests a thousand times its capture after the ladder's (``replan_share=0.001``), rank 0 not at
    all: with the agreed rest no rank re-plans, both serve the ladder's keys, every token transformers'. The
    negative control removes the agreement: rank 0 starts a re-plan alone, the ranks' collectives no longer
    pair, and steps fail instead of serving on."""
    res = run_ranks(_ranks, world_size=2, timeout=400, args=(llama, (1.0, 0.001), True))
    for r in res:
        assert r.ok and r.exitcode == 0 and not r.timed_out, r
    v0, v1 = res[0].value, res[1].value
    assert v0["same"] == [8, 8, 8, 8] and v0["failed_steps"] == v1["failed_steps"] == 0
    assert v0["replans"] == v1["replans"] == 0 and v0["keys"] == v1["keys"] == v0["ladder"]

    bad = run_ranks(_ranks, world_size=2, timeout=400, args=(llama, (1.0, 0.001), False))
    parted = [not r.ok or r.value["failed_steps"] > 0 or r.value["same"] not in (None, [8, 8, 8, 8]) for r in bad]
    assert any(parted), bad
