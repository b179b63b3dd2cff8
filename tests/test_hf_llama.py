"""examples/hf_llama.py: a Hugging Face LlamaForCausalLM decoded through gr.hf.DecodeRunner.

Needs the ``hf`` extra (``pip install -e '.[hf]'``); skipped without ``transformers``.
The example is imported here, so the example and the test check the same
thing: 20 generated tokens (19 graph replays) equal ``model.generate(...,
cache_implementation="static")``. The cache helpers it relies on live in
``graphrunner.hf`` and are checked at the end.
"""

import importlib.util
import sys
from pathlib import Path

import pytest
from extras_util import require

require("transformers")

import torch  # noqa: E402

pytestmark = [pytest.mark.hf, pytest.mark.usefixtures("one_torch_thread")]

_EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "hf_llama.py"


def _load_example():
    name = "graphrunner_example_hf_llama"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, _EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses resolve their module by name
    spec.loader.exec_module(module)
    return module


hf = _load_example()


@pytest.mark.parametrize("backend,batch", [("breakable", 1), ("full", 1), ("breakable", 2)])
def test_twenty_decode_steps_equal_model_generate(backend, batch):
    result = hf.run(steps=20, batch=batch, backend=backend, device="auto")
    assert result.ok, result.summary()
    assert result.got.shape == (batch, 6 + 20)
    assert result.replays == 19  # every step after the prefill's token was a graph replay, no eager fallback
    assert (result.num_segments, result.num_breaks) == (1, 0)  # HF Llama decode needs no break
    assert result.capture_ms > 0 and result.generate_ms > 0 and result.reference_ms > 0


def test_eager_backend_matches_too():
    # Same protocol, no graph: the comparison machinery itself is sound.
    result = hf.run(steps=5, batch=1, backend="eager", device="auto")
    assert result.ok, result.summary()
    assert (result.replays, result.num_segments, result.num_breaks) == (4, 0, 1)


def test_warmup_writes_are_caught_without_the_cache_restore():
    # Negative control: the capture protocol's eager warmups really write the
    # StaticCache. Skipping the in-place reset after capture must show up as
    # different tokens, so a passing run above is evidence, not luck.
    result = hf.run(steps=3, batch=1, backend="breakable", device="auto", restore_after_capture=False)
    assert not result.ok


def test_cache_helpers_snapshot_restore_in_place():
    from graphrunner.hf.cache import (
        cache_tensors,
        compare_caches,
        make_static_cache,
        restore_cache,
        snapshot_cache,
        zero_cache,
    )
    from graphrunner.hf.steps import make_decode_step, prefill

    with torch.inference_mode():
        model = hf.build_model(seed=3)
        cache = make_static_cache(model, batch_size=1, max_cache_len=8)
        if not _allocated_at_construction(cache):  # transformers >= 4.56 allocates at the first write
            with pytest.raises(ValueError, match="prefill"):
                cache_tensors(cache)
        logits = prefill(model, cache, torch.tensor([[1, 2, 3]]))
        assert logits.shape == (1, 3, model.config.vocab_size)
        tensors = cache_tensors(cache)
        ids = {name: id(t) for name, t in tensors.items()}
        saved = snapshot_cache(cache)
        step = make_decode_step(model, cache)
        step(input_ids=torch.tensor([[4]]), position_ids=torch.tensor([[3]]))
        twin = make_static_cache(model, batch_size=1, max_cache_len=8)
        prefill(model, twin, torch.tensor([[1, 2, 3]]))
        assert compare_caches(cache, twin), "a decode step must change the cache"
        restore_cache(cache, saved)
        assert compare_caches(cache, twin) == []
        assert {name: id(t) for name, t in cache_tensors(cache).items()} == ids  # restored in place
        zero_cache(cache)
        assert all(not t.any() for t in cache_tensors(cache).values())


def _allocated_at_construction(cache) -> bool:
    from graphrunner.hf.cache import cache_tensors

    try:
        cache_tensors(cache)
        return True
    except ValueError:
        return False


def test_main_prints_summary_and_exit_code(capsys):
    assert hf.main(["--steps", "3", "--batch", "1"]) == 0
    out = capsys.readouterr().out
    assert "OK: tokens equal model.generate" in out and "steps=3" in out


def test_main_exits_1_on_a_mismatch(monkeypatch, capsys):
    # main() has no restore switch: route its run() through the negative
    # control above (no cache reset after capture), which must exit 1.
    real_run = hf.run
    monkeypatch.setattr(hf, "run", lambda **kw: real_run(**kw, restore_after_capture=False))
    assert hf.main(["--steps", "3", "--batch", "1"]) == 1
    out = capsys.readouterr().out
    assert "MISMATCH" in out and "OK:" not in out
