"""graphrunner.hf.internals: each transformers internal gr.hf uses, read on the installed transformers, and the
clear error when it is gone (the test of each entry of ``INTERNALS``; docs/continuous-batching.md lists them).

Each test reads its internal from a real transformers object (a tiny Llama's
manager, batch processor and paged cache) and checks the value against an
independent one (the config it was built from, a session's results); a
negative control removes the internal and sees :class:`TransformersChanged`
name it and the version checked.
"""

import time
import types

import pytest
from extras_util import require

transformers = require("transformers")  # graphrunner.hf needs it

from transformers import GenerationConfig  # noqa: E402
from transformers.generation.configuration_utils import ContinuousBatchingConfig  # noqa: E402

import graphrunner.hf.internals as internals  # noqa: E402
from graphrunner_tools.models.hf_tiny import build_tiny  # noqa: E402

pytestmark = [pytest.mark.hf, pytest.mark.usefixtures("one_torch_thread")]

CHECKED = r"transformers 5\.25"


def manager_of(arch="llama", **cb):
    model = build_tiny(arch, seed=0, max_position_embeddings=512)
    gc = GenerationConfig(max_new_tokens=4, do_sample=False, eos_token_id=-1, pad_token_id=0)
    cfg = ContinuousBatchingConfig(page_size=16, num_blocks=32, max_batch_tokens=32, max_requests_per_batch=4, **cb)
    manager = model.init_continuous_batching(generation_config=gc, continuous_batching_config=cfg)
    manager.warmup()  # makes the batch processor
    return model, manager


def test_every_entry_is_documented_with_its_test():
    doc = open("docs/continuous-batching.md").read()
    section = doc[doc.index("## transformers internals") :]
    assert internals.CHECKED_WITH in section and len(internals.INTERNALS) <= 6
    for name in internals.INTERNALS:
        assert f"`{name}`" in section, name
    assert section.count("tests/test_hf_internals.py::") >= len(internals.INTERNALS)


def test_the_attention_implementation_is_read_from_the_config():
    model = build_tiny("llama", seed=0)
    assert internals.attention_implementation(model) == "sdpa"
    model.set_attn_implementation("eager")
    assert internals.attention_implementation(model) == "eager"
    assert internals.attention_implementation(object()) is None
    with pytest.raises(internals.TransformersChanged, match=rf"_attn_implementation.*{CHECKED}"):
        internals.config_attention_implementation(types.SimpleNamespace(model_type="llama"))


def test_a_kept_manager_is_taken_out_of_the_models_slot():
    model, manager = manager_of()
    manager.start()
    manager.stop(block=True, keep_for_next_session=True)
    assert internals.kept_manager(model) is manager  # where transformers' stop() keeps it
    assert model.init_continuous_batching() is manager, "transformers itself would run it"
    internals.forget_kept_manager(model, manager)
    assert internals.kept_manager(model) is None
    # negative control: a manager that is not in the slot (transformers kept it elsewhere) is a loud error
    with pytest.raises(internals.TransformersChanged, match=rf"_cached_continuous_batching_manager.*{CHECKED}"):
        internals.forget_kept_manager(model, manager)
    manager.destroy()


def test_the_allocator_layout_matches_the_cache_it_was_built_for():
    """Trash and sentinel slots lie below the first real sector, the views hold every slot of the cache's
    blocks (num_blocks * page_size past the reserved sectors), and a sliding layer's window is the config's."""
    _, manager = manager_of("gemma2")
    cache = manager.batch_processor.cache
    text = manager.model.config.get_text_config()
    seen = set()
    for layer_type, alloc in cache.cache_allocators.items():
        lay = internals.allocator_layout(alloc, sliding=layer_type == "sliding_attention")
        seen.add(lay.index)
        assert 0 <= lay.write_trash < 2 * lay.sector and 0 <= lay.read_trash < 2 * lay.sector
        assert lay.last_index + 1 >= 2 * lay.sector + cache.num_blocks * 16 // 2
        assert lay.window == (text.sliding_window if layer_type == "sliding_attention" else None)
    assert seen == set(range(len(cache.cache_allocators)))
    bare = types.SimpleNamespace(index=0)
    with pytest.raises(internals.TransformersChanged, match=rf"_kv_token_views.*{CHECKED}"):
        internals.allocator_layout(bare, sliding=False)
    manager.destroy()


def test_the_engine_state_counts_a_running_sessions_requests_and_blocks():
    model, manager = manager_of()
    manager.start()
    try:
        with manager.pause():
            idle = internals.engine_state(manager)
        assert idle["requests_active"] == idle["requests_waiting"] == 0 and idle["cache_held_blocks"] == 0
        assert idle["cache_blocks"] == 32 and idle["cache_free_blocks"] == 32
        manager.add_request(list(range(3, 40)), request_id="long", max_new_tokens=200)
        for _ in range(50):
            with manager.pause():
                busy = internals.engine_state(manager)
            if busy["requests_active"]:
                break
            time.sleep(0.05)
        assert busy["requests_active"] == 1 and busy["cache_held_blocks"] >= 3  # 37 prompt tokens, 16 a block
        with pytest.raises(internals.TransformersChanged, match=rf"'scheduler'.*{CHECKED}"):
            internals.engine_state(types.SimpleNamespace(batch_processor=types.SimpleNamespace(cache=None)))
    finally:
        manager.stop(block=True)
        manager.destroy()


def test_the_step_methods_are_wrapped_and_run_through_the_wrapper():
    model, manager = manager_of()
    bp = manager.batch_processor
    calls: list[str] = []

    def wrap(name, fn):
        def run(*a, **k):
            calls.append(name)
            return fn(*a, **k)

        return run

    internals.wrap_step_methods(bp, wrap)
    manager.start()
    manager.add_request([5, 6, 7], request_id="r", max_new_tokens=3)
    result = None
    while result is None or not result.is_finished():
        result = manager.get_result(timeout=30)
        assert result is not None
    assert internals.loop_goes_on(bp), "the loop runs: its agreed stop status is DONT_STOP"
    manager.stop(block=True)
    assert not internals.loop_goes_on(bp), "stopped: an idle iteration now ends the loop, no tick follows"
    assert set(calls) == set(internals.STEP_METHODS), "transformers ran every wrapped method in its steps"

    def original():
        return None

    bare = types.SimpleNamespace(prepare_next_batch=original, update_batch=original)
    with pytest.raises(internals.TransformersChanged, match=rf"_generation_step.*{CHECKED}"):
        internals.wrap_step_methods(bare, wrap)
    assert bare.prepare_next_batch is original, "nothing wrapped when one is missing"
    bare = types.SimpleNamespace(prepare_next_batch=original, update_batch=original, _generation_step=original)
    with pytest.raises(internals.TransformersChanged, match=rf"handle_batch_error.*{CHECKED}"):
        internals.wrap_step_methods(bare, wrap)
    bare = types.SimpleNamespace(background_thread_status=types.SimpleNamespace(local_status=0))
    with pytest.raises(internals.TransformersChanged, match=rf"tp_status.*{CHECKED}"):
        internals.loop_goes_on(bare)
    manager.destroy()


def test_the_serving_runner_hands_a_requests_seed_and_sampling_to_the_served_manager():
    """transformers serve's ``CBGenerateRunner.generate`` (its own code; the object made without its threads)
    seeds the default generator with a request's seed right before ``manager.add_request`` (read there:
    ``request_seed``) and passes the sampling settings ``logit_processor.supported_keys`` names; the step's
    sampling is ``ModelRunner._sample(scores, output_ids)`` over the requests that get a token."""
    import threading

    from transformers.cli.serving.utils import CBGenerateRunner
    from transformers.generation.continuous_batching.model_runner import ModelRunner

    from graphrunner.hf.sampling import RequestSampler, SamplingParams
    from graphrunner_tools.serve_engine import ServedManager

    added = []

    class Manager:  # what the served manager hands on
        background_thread_status = types.SimpleNamespace(fatal_error=None)
        logit_processor = types.SimpleNamespace(supported_keys={})  # a model config that does not sample

        def add_request(self, input_ids, request_id=None, **kwargs):
            added.append((request_id, kwargs))
            return request_id

    def runner_over(manager):
        runner = object.__new__(CBGenerateRunner)  # its generate() alone, without its threads and manager
        runner.manager, runner.lock, runner.active_requests = manager, threading.Lock(), {}
        runner.prompt_tokens = runner.generated_tokens = 0
        return runner

    sampler = RequestSampler()
    runner = runner_over(ServedManager(Manager(), sampler))
    base = {"max_new_tokens": 4, "eos_token_id": -1}
    sample = {**base, "do_sample": True, "temperature": 0.5, "top_k": 3, "top_p": 0.9}
    runner.generate(7, {"input_ids": [1, 2, 3]}, {**sample, "seed": 1234}, False)
    greedy = {**base, "do_sample": False, "temperature": 1.0, "top_k": 50, "top_p": 1.0}
    runner.generate(8, {"input_ids": [1, 2]}, {**greedy, "seed": 2**64 - 9}, True)
    assert sampler.params("7") == SamplingParams(temperature=0.5, top_k=3, top_p=0.9, seed=1234)
    assert sampler.params("8") == SamplingParams(top_k=1, seed=2**64 - 9)  # greedy: transformers says top_k=1
    assert added == [("7", {"streaming": False, **base}), ("8", {"streaming": True, **base})]
    # negative control: transformers' own manager of a model that does not sample gets no setting at all
    added.clear()
    runner_over(Manager()).generate(9, {"input_ids": [1]}, {**sample, "seed": 5}, False)
    assert added == [("9", {"streaming": False, **base})]
    # the sampling step and its rows
    internals.check_sampling_step(ModelRunner)
    with pytest.raises(internals.TransformersChanged, match=rf"ModelRunner._sample.*{CHECKED}"):
        internals.check_sampling_step(type("Runner", (), {"_sample": lambda self, scores: None}))
    _, manager = manager_of()
    io = manager.batch_processor.inputs_and_outputs
    assert internals.step_rows(io) == []
    req = types.SimpleNamespace
    io.requests_in_batch = [req(state=req(request_id=r), has_new_token=r != "b") for r in "abc"]
    assert internals.step_rows(io) == ["a", "c"]
    with pytest.raises(internals.TransformersChanged, match=rf"'requests_in_batch'.*{CHECKED}"):
        internals.step_rows(types.SimpleNamespace())
    manager.destroy()


def _tp_step(rank, world, debug):
    """A rank of a fake two-rank batch processor whose step 'samples' a token of its own (rank 1's differs on
    request r1): :func:`internals.sync_sampled_ids` over the real gloo group."""
    import torch
    import torch.distributed as dist

    io = types.SimpleNamespace(
        output_ids=torch.tensor([[7, 8 + rank, 0]]),
        num_request_in_batch=2,
        requests_in_batch=[types.SimpleNamespace(state=types.SimpleNamespace(request_id=f"r{i}")) for i in range(2)],
    )
    helper = types.SimpleNamespace(tp_size=world, cpu_comm_group=dist.group.WORLD, tp_root_global_rank=0)
    bp = types.SimpleNamespace(distributed_helper=helper, inputs_and_outputs=io, _generation_step=lambda: None)
    internals.sync_sampled_ids(bp, debug=debug)
    try:
        bp._generation_step()
    except RuntimeError as exc:
        return str(exc)
    return io.output_ids[0, :2].tolist()


def _tp_steps(rank, world):
    """:func:`_tp_step` without debug, then with it (a fresh processor each), in one pair of rank processes."""
    return _tp_step(rank, world, False), _tp_step(rank, world, True)


@pytest.mark.multirank
@pytest.mark.timeout(120)
def test_the_tp_ranks_take_the_drivers_sampled_ids_and_debug_names_the_request_that_differs():
    from graphrunner_tools.launch import launch_ranks

    outcomes = launch_ranks(_tp_steps, 2, timeout=90)
    assert all(o.ok for o in outcomes), [o.error for o in outcomes]
    taken, compared = zip(*(o.value for o in outcomes))
    assert list(taken) == [[7, 8], [7, 8]]  # rank 1 took the driver's
    for message in compared:  # debug: every rank raises, naming the step and the request
        assert "at step 1 for request(s) r1" in message and "[[8, 9]]" in message, message
    bare = types.SimpleNamespace(distributed_helper=types.SimpleNamespace(), inputs_and_outputs=None)
    with pytest.raises(internals.TransformersChanged, match=rf"tensor-parallel step.*{CHECKED}"):
        internals.sync_sampled_ids(bare)


def test_a_failed_step_fails_its_requests_and_the_engine_serves_the_next():
    """fail_step in the wrapped _generation_step (that step's update_batch skipped): the step's request ends with
    the error and its tokens so far, its blocks are freed, and the next request is served; negative control:
    without fail_step (the exception goes on to transformers' loop) the engine stops."""
    model, manager = manager_of()
    bp = manager.batch_processor
    fail = {"next": 0, "failed": False}

    def wrap(name, fn):
        def run(*a, **k):
            if name == "update_batch" and fail["failed"]:
                fail["failed"] = False
                return None
            if name == "_generation_step" and fail["next"]:
                fail["next"] -= 1
                internals.fail_step(bp, RuntimeError("step fault for the test"))
                fail["failed"] = True
                return None
            return fn(*a, **k)

        return run

    internals.wrap_step_methods(bp, wrap)
    manager.start()
    try:
        fail["next"] = 1
        manager.add_request(list(range(3, 40)), request_id="bad", max_new_tokens=3)
        bad = manager.get_result(timeout=30)
        assert bad is not None and bad.request_id == "bad" and "step fault for the test" in str(bad.error)
        assert bad.generated_tokens == [] and manager.is_running()
        manager.add_request([5, 6, 7], request_id="good", max_new_tokens=3)
        good = None
        while good is None or not good.is_finished():
            good = manager.get_result(timeout=30)
            assert good is not None and good.error is None
        assert len(good.generated_tokens) == 3
        with manager.pause():
            state = internals.engine_state(manager)
        assert state["cache_held_blocks"] == 0 and state["requests_active"] == 0, "the failed request's blocks freed"
        with pytest.raises(internals.TransformersChanged, match=rf"handle_batch_error.*{CHECKED}"):
            internals.fail_step(types.SimpleNamespace(), RuntimeError("x"))
    finally:
        manager.stop(block=True)
        manager.destroy()


def test_negative_control_a_step_that_raises_stops_transformers_engine():
    model, manager = manager_of()
    bp = manager.batch_processor

    def wrap(name, fn):
        def run(*a, **k):
            if name == "_generation_step":
                raise RuntimeError("step fault for the test")
            return fn(*a, **k)

        return run

    internals.wrap_step_methods(bp, wrap)
    manager.start()
    try:
        manager.add_request(list(range(3, 40)), request_id="bad", max_new_tokens=3)
        bad = manager.get_result(timeout=30)
        assert bad is not None and "step fault for the test" in str(bad.error)
        deadline = time.monotonic() + 30
        while manager.is_running() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not manager.is_running(), "transformers' loop stops the engine on a step's exception"
    finally:
        manager.stop(block=True)
        manager.destroy()
