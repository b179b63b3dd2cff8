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
    assert internals.CHECKED_WITH in section and len(internals.INTERNALS) <= 4
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
    manager.stop(block=True)
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
    manager.destroy()


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
