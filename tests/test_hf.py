"""gr.hf.DecodeRunner: graph-replayed greedy decoding equals model.generate(..., cache_implementation="static").

Tiny random-weight configs (2 layers, hidden 64, vocab 128, seeded; nothing is
downloaded) of Llama, Qwen2, Mistral, Phi3 and Mixtral; max_batch=4 with
buckets [1, 2, 4], so batch 3 replays the padded bucket 4. Mamba has no
StaticCache: capture() must refuse it with a clear error. Skipped without
``transformers``.
"""

import pytest

transformers = pytest.importorskip("transformers")

import torch  # noqa: E402

import graphrunner as gr  # noqa: E402
from graphrunner.errors import CaptureError  # noqa: E402

pytestmark = [pytest.mark.hf, pytest.mark.usefixtures("one_torch_thread")]

VOCAB = 128
MAX_BATCH = 4
BUCKETS = [1, 2, 4]
PROMPT_LEN = 5
NEW_TOKENS = 5
MAX_CACHE_LEN = 16

_COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)

#: model_type -> (config class, model class, config overrides)
ARCHS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": None}),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {"pad_token_id": 0}),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM",
                {"num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": None}),
}


def build_model(arch: str, seed: int = 0, **overrides):
    """A tiny eval-mode ``*ForCausalLM`` of ``arch`` with random weights from ``seed``."""
    cfg_name, model_name, extra = ARCHS[arch]
    cfg = getattr(transformers, cfg_name)(**{**_COMMON, **extra, **overrides})
    torch.manual_seed(seed)
    return getattr(transformers, model_name)(cfg).eval()


def prompts(batch: int, seed: int) -> torch.Tensor:
    # Ids >= 3: no bos/eos/pad id in the prompt, so model.generate infers an all-ones attention mask.
    return torch.randint(3, VOCAB, (batch, PROMPT_LEN), generator=torch.Generator().manual_seed(seed))


def reference(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                              do_sample=False, cache_implementation="static")




@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_generate_equals_model_generate(arch):
    model = build_model(arch)
    runner = gr.hf.DecodeRunner(model, max_batch=MAX_BATCH, max_cache_len=MAX_CACHE_LEN, buckets=BUCKETS,
                                backend="full", device="auto")
    report = runner.capture()
    assert isinstance(report, gr.CaptureReport)
    assert sorted(b.bucket for b in report.buckets) == BUCKETS
    for batch in (1, 3, MAX_BATCH):
        ids = prompts(batch, seed=batch)
        got = runner.generate(ids, max_new_tokens=NEW_TOKENS)
        want = reference(model, ids)
        assert torch.equal(got, want), f"{arch} batch {batch}:\n{got}\n{want}"
    # Every decode step was a replay (bucket 1, padded bucket 4 twice), none an eager fallback.
    assert runner.runner.stats.replays.get(1, 0) == NEW_TOKENS - 1
    assert runner.runner.stats.replays.get(4, 0) == 2 * (NEW_TOKENS - 1)
    runner.cleanup()


def test_negative_control_without_cache_reset(monkeypatch):
    # The capture warmups really write K/V and advance the StaticCache write counter. With the
    # in-place reset after capture (and before generate) turned into a no-op, the tokens must differ:
    # the equality above is evidence, not luck.
    model = build_model("llama")
    monkeypatch.setattr(gr.hf.DecodeRunner, "_reset_cache", lambda self: None)
    runner = gr.hf.DecodeRunner(model, max_batch=MAX_BATCH, max_cache_len=MAX_CACHE_LEN, buckets=BUCKETS)
    runner.capture()
    ids = prompts(MAX_BATCH, seed=4)
    got = runner.generate(ids, max_new_tokens=NEW_TOKENS)
    assert not torch.equal(got, reference(model, ids))


def test_mamba_is_refused_at_capture():
    cfg = transformers.MambaConfig(vocab_size=VOCAB, hidden_size=64, state_size=8, num_hidden_layers=2)
    torch.manual_seed(0)
    model = transformers.MambaForCausalLM(cfg).eval()
    runner = gr.hf.DecodeRunner(model, max_batch=2, max_cache_len=8, buckets=[1, 2])
    with pytest.raises(CaptureError, match=r"'mamba'.*MambaCache.*StaticCache"):
        runner.capture()
    with pytest.raises(CaptureError, match="mamba"):  # generate() captures first: same error, no tokens
        runner.generate(prompts(1, seed=0), max_new_tokens=2)


def test_sliding_window_cache_is_refused_at_capture():
    model = build_model("mistral", sliding_window=8)
    runner = gr.hf.DecodeRunner(model, max_batch=2, max_cache_len=8, buckets=[1, 2])
    with pytest.raises(CaptureError, match=r"'mistral'.*sliding"):
        runner.capture()


def test_input_validation():
    model = build_model("llama")
    with pytest.raises(ValueError, match="largest bucket"):
        gr.hf.DecodeRunner(model, max_batch=4, max_cache_len=8, buckets=[1, 2])
    runner = gr.hf.DecodeRunner(model, max_batch=2, max_cache_len=8, buckets=[1, 2])
    with pytest.raises(ValueError, match="max_cache_len"):
        runner.generate(prompts(1, seed=0), max_new_tokens=8)
    with pytest.raises(ValueError, match="max_batch"):
        runner.generate(prompts(3, seed=0), max_new_tokens=2)
    ids = prompts(2, seed=0)
    with pytest.raises(ValueError, match="attention_mask"):
        runner.generate(ids, max_new_tokens=2, attention_mask=torch.tensor([[0, 1, 1, 1, 1], [1] * 5]))
    assert torch.equal(runner.generate(ids, 2, attention_mask=torch.ones_like(ids)), reference_n(model, ids, 2))


def reference_n(model, ids, n):
    with torch.inference_mode():
        return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                              cache_implementation="static")


def test_import_graphrunner_does_not_import_transformers():
    import subprocess
    import sys
    code = ("import sys, graphrunner; assert 'transformers' not in sys.modules, 'eager import'; "
            "assert 'graphrunner.hf' not in sys.modules; graphrunner.hf; assert 'transformers' in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_every_public_name_has_a_docstring():
    for name in gr.hf.__all__:
        obj = getattr(gr.hf, name)
        if callable(obj):
            assert obj.__doc__ and obj.__doc__.strip(), name
    for name in ("capture", "generate", "cleanup"):
        assert getattr(gr.hf.DecodeRunner, name).__doc__, name


def test_unverified_architecture_is_refused_at_capture():
    cfg = transformers.GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=32)
    model = transformers.GPT2LMHeadModel(cfg).eval()
    runner = gr.hf.DecodeRunner(model, max_batch=1, max_cache_len=8, buckets=[1])
    with pytest.raises(CaptureError, match=r"not verified architecture 'gpt2'.*Supported: llama"):
        runner.capture()
