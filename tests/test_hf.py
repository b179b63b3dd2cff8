"""gr.hf.DecodeRunner: graph-replayed greedy decoding equals model.generate(..., cache_implementation="static").

Tiny random-weight configs (2 layers, hidden 64, vocab 128, seeded; nothing is
downloaded) of Llama, Qwen2, Mistral, Phi3, Mixtral, Mamba and Mamba2;
max_batch=4 with buckets [1, 2, 4], so batch 3 replays the padded bucket 4.
Mamba's conv/recurrent states live in the StaticCache's linear-attention
layers; its reference is plain ``model.generate`` (its default cache) and the
static one. Skipped without ``transformers``.
"""

import pytest
from extras_util import require

transformers = require("transformers")

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

_ATTENTION = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
# initializer_range 0.5: at the default 0.1 a tiny random Mamba repeats one token, which would hide a wrong state.
_MAMBA = dict(vocab_size=VOCAB, hidden_size=64, state_size=8, num_hidden_layers=2, initializer_range=0.5)

#: model_type -> (config class, model class, config kwargs)
ARCHS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", _ATTENTION),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", _ATTENTION),
    "mistral": ("MistralConfig", "MistralForCausalLM", {**_ATTENTION, "sliding_window": None}),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {**_ATTENTION, "pad_token_id": 0}),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM",
                {**_ATTENTION, "num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": None}),
    "mamba": ("MambaConfig", "MambaForCausalLM", _MAMBA),
    "mamba2": ("Mamba2Config", "Mamba2ForCausalLM",
               {**_MAMBA, "num_heads": 8, "head_dim": 16, "n_groups": 2, "expand": 2, "chunk_size": 16}),
}
#: Architectures whose state is a conv/recurrent state (no K/V): model.generate's default cache is their own.
STATE_SPACE = {"mamba", "mamba2"}


def build_model(arch: str, seed: int = 0, **overrides):
    """A tiny eval-mode ``*ForCausalLM`` of ``arch`` with random weights from ``seed``."""
    cfg_name, model_name, kwargs = ARCHS[arch]
    cfg = getattr(transformers, cfg_name)(**{**kwargs, **overrides})
    torch.manual_seed(seed)
    return getattr(transformers, model_name)(cfg).eval()


def prompts(batch: int, seed: int) -> torch.Tensor:
    # Ids >= 3: no bos/eos/pad id in the prompt, so model.generate infers an all-ones attention mask.
    return torch.randint(3, VOCAB, (batch, PROMPT_LEN), generator=torch.Generator().manual_seed(seed))


def reference(model, ids: torch.Tensor, n: int = NEW_TOKENS, **kwargs) -> torch.Tensor:
    """``model.generate`` greedy, static cache unless ``cache_implementation=None`` (the model's default) is given."""
    kwargs.setdefault("cache_implementation", "static")
    with torch.inference_mode():
        return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False, **kwargs)


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
        if arch in STATE_SPACE:  # and its own default cache, as a user calls model.generate
            assert torch.equal(got, reference(model, ids, cache_implementation=None)), f"{arch} batch {batch}"
    # Every decode step was a replay (bucket 1, padded bucket 4 twice), none an eager fallback.
    assert runner.runner.stats.replays.get(1, 0) == NEW_TOKENS - 1
    assert runner.runner.stats.replays.get(4, 0) == 2 * (NEW_TOKENS - 1)
    runner.cleanup()


@pytest.mark.parametrize("arch", ["llama", "mamba"])
def test_negative_control_without_cache_reset(monkeypatch, arch):
    # The capture warmups really write K/V (Mamba: conv/recurrent states) and advance the StaticCache
    # write counter (Mamba: leave has_previous_state set, so the prefill would continue the stale
    # state). With the in-place reset after capture (and before generate) turned into a no-op, the
    # tokens must differ: the equality above is evidence, not luck.
    model = build_model(arch)
    monkeypatch.setattr(gr.hf.DecodeRunner, "_reset_cache", lambda self: None)
    runner = gr.hf.DecodeRunner(model, max_batch=MAX_BATCH, max_cache_len=MAX_CACHE_LEN, buckets=BUCKETS)
    runner.capture()
    ids = prompts(MAX_BATCH, seed=4)
    got = runner.generate(ids, max_new_tokens=NEW_TOKENS)
    assert not torch.equal(got, reference(model, ids))


def _recording_past_cache(monkeypatch):
    """Make DecodeRunner build caches whose linear-attention layers record their past (conv states reassigned)."""
    make = gr.hf.make_static_cache

    def make_recording(*args, **kwargs):
        cache = make(*args, **kwargs)
        try:  # transformers >= 5.25 also records recurrent states; its default (None) breaks Mamba's min()
            cache.activate_past_recording(recurrent_states_to_keep=0)
        except TypeError:  # transformers 5.24: conv states only
            cache.activate_past_recording()
        return cache

    monkeypatch.setattr(gr.hf, "make_static_cache", make_recording)


def test_linear_cache_recording_past_is_refused_at_capture(monkeypatch):
    _recording_past_cache(monkeypatch)
    runner = gr.hf.DecodeRunner(build_model("mamba"), max_batch=2, max_cache_len=8, buckets=[1, 2])
    with pytest.raises(CaptureError, match=r"'mamba'.*records its past"):
        runner.capture()
    with pytest.raises(CaptureError, match="records its past"):  # generate() captures first: same error, no tokens
        runner.generate(prompts(1, seed=0), max_new_tokens=2)


def test_negative_control_recording_past_without_the_check(monkeypatch):
    # Without the layer check, the capture's drift check still refuses it (the conv state grows
    # between the last warmup and the capture: a second guard) ...
    _recording_past_cache(monkeypatch)
    monkeypatch.setattr(gr.hf.DecodeRunner, "_check_linear_layer", lambda self, layer: None)
    model = build_model("mamba")
    runner = gr.hf.DecodeRunner(model, max_batch=2, max_cache_len=MAX_CACHE_LEN, buckets=[1, 2])
    with pytest.raises(CaptureError, match=r"drift between warmup 2 and the capture.*update_conv_state"):
        runner.capture()
    # ... and with both checks off, a cache that reassigns its conv states decodes silently wrong tokens.
    real = gr.hf.GraphRunner
    monkeypatch.setattr(gr.hf, "GraphRunner", lambda *a, **kw: real(*a, checks=("padding", "fingerprint"), **kw))
    runner = gr.hf.DecodeRunner(model, max_batch=2, max_cache_len=MAX_CACHE_LEN, buckets=[1, 2])
    ids = prompts(2, seed=2)
    assert not torch.equal(runner.generate(ids, max_new_tokens=NEW_TOKENS), reference(model, ids))


def test_linear_cache_with_too_few_rows_is_refused_at_capture(monkeypatch):
    # The cache allocates its states lazily at the first forward; one of a single row cannot hold bucket 2.
    prefill = gr.hf.prefill
    monkeypatch.setattr(gr.hf, "prefill", lambda model, cache, ids: prefill(model, cache, ids[:1]))
    runner = gr.hf.DecodeRunner(build_model("mamba"), max_batch=2, max_cache_len=8, buckets=[1, 2])
    with pytest.raises(CaptureError, match=r"'mamba'.*conv/recurrent states with 2 rows"):
        runner.capture()


def _fill_rows_after_prefill(monkeypatch, runner, rows):
    """After each eager prefill, overwrite ``rows(batch)`` of every cache tensor of ``runner`` with large noise."""
    prefill = gr.hf.prefill

    def prefill_then_fill(model, cache, input_ids):
        logits = prefill(model, cache, input_ids)
        noise = torch.Generator().manual_seed(0)
        for name, t in gr.hf.cache_tensors(runner.cache).items():
            if t.is_floating_point() and t.dim() > 1:
                block = t[rows(input_ids.shape[0])]
                block.copy_(torch.randn(block.shape, generator=noise, dtype=t.dtype) * 10)
        return logits

    monkeypatch.setattr(gr.hf, "prefill", prefill_then_fill)


@pytest.mark.parametrize("arch", ["llama", "mamba"])
def test_padding_rows_never_affect_real_rows(monkeypatch, arch):
    # Batch 3 replays bucket 4: noise in row 3 of every K/V (Mamba: conv/recurrent state) tensor
    # must leave the 3 real rows' tokens unchanged.
    model = build_model(arch)
    runner = gr.hf.DecodeRunner(model, max_batch=MAX_BATCH, max_cache_len=MAX_CACHE_LEN, buckets=BUCKETS)
    _fill_rows_after_prefill(monkeypatch, runner, lambda batch: slice(batch, None))
    ids = prompts(3, seed=3)
    assert torch.equal(runner.generate(ids, max_new_tokens=NEW_TOKENS), reference(model, ids))


@pytest.mark.parametrize("arch", ["llama", "mamba"])
def test_negative_control_noise_in_a_real_row(monkeypatch, arch):
    # The same noise in a real row (row 2) changes the tokens: the test above would see a leak.
    model = build_model(arch)
    runner = gr.hf.DecodeRunner(model, max_batch=MAX_BATCH, max_cache_len=MAX_CACHE_LEN, buckets=BUCKETS)
    _fill_rows_after_prefill(monkeypatch, runner, lambda batch: slice(batch - 1, batch))
    ids = prompts(3, seed=3)
    assert not torch.equal(runner.generate(ids, max_new_tokens=NEW_TOKENS), reference(model, ids))


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
    assert torch.equal(runner.generate(ids, 2, attention_mask=torch.ones_like(ids)), reference(model, ids, 2))


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


def test_older_transformers_is_refused_at_capture(monkeypatch):
    """A transformers major older than the verified one fails at capture, before any graph exists."""
    model = build_model("llama")
    runner = gr.hf.DecodeRunner(model, max_batch=1, max_cache_len=8, buckets=[1])
    monkeypatch.setattr(gr.hf, "_transformers_version", lambda: "4.57.1")
    with pytest.raises(CaptureError, match=r"verified on transformers 5\.x, found 4\.57\.1"):
        runner.capture()
    assert not runner.runner.captured
    # control: the installed version (the one the equality tests run on) is accepted
    monkeypatch.undo()
    runner.capture()
    assert runner.runner.captured


def test_moe_decode_runner_captures_with_buckets_up_to_8_no_false_alarm(monkeypatch):
    """An MoE layer's expert matmuls change kernel with their row count (CPU: M <= 2 vs M >= 3), so the
    padding check's runs move the last bits when padding rows become real: no leak, no alarm (the check
    compares every run within the float tolerance). Reference: eager on the real batch."""
    model = build_model("mixtral")
    dr = gr.hf.DecodeRunner(model, max_batch=8, max_cache_len=MAX_CACHE_LEN)
    dr.capture()
    ids = prompts(5, seed=3)
    out = dr.generate(ids, max_new_tokens=3)
    ref = reference(model, ids, n=3)
    assert torch.equal(out, ref)
    # negative control: compared bit for bit, the row-count-dependent kernels read as a leak
    import graphrunner.checks.padding as padding

    exact = padding.difference
    monkeypatch.setattr(padding, "difference", lambda a, b, tolerant=False: exact(a, b, False))
    with pytest.raises(gr.CaptureError, match="padding leaks into real results at bucket 8"):
        gr.hf.DecodeRunner(build_model("mixtral"), max_batch=8, max_cache_len=MAX_CACHE_LEN).capture()
