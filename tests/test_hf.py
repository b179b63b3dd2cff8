"""gr.hf.DecodeRunner: graph-replayed decoding equals model.generate(..., cache_implementation="static").

Tiny random-weight models of every architecture family the issue names
(``graphrunner_tools.models.hf_tiny``: 2 layers, hidden 64, vocab 128,
seeded; nothing is downloaded), sliding windows and hybrids included;
max_batch=4 with buckets [1, 2, 4], so batch 3 replays the padded bucket 4.
Acceptance is the capture checks plus the self-test, never a list: the
refusal classes, the self-test's negative control, ragged prompts, seeded
sampling and the stats are tested here too. Skipped without ``transformers``.
"""

import pytest
from extras_util import require

transformers = require("transformers")

import torch  # noqa: E402

import graphrunner as gr  # noqa: E402
import graphrunner.hf.decode as hf_decode  # noqa: E402
from graphrunner.errors import CaptureError  # noqa: E402
from graphrunner.hf.cache import cache_tensors  # noqa: E402
from graphrunner_tools.models.hf_tiny import build_tiny  # noqa: E402

pytestmark = [pytest.mark.hf, pytest.mark.usefixtures("one_torch_thread")]

VOCAB = 128
MAX_BATCH = 4
BUCKETS = [1, 2, 4]
PROMPT_LEN = 5
NEW_TOKENS = 5
MAX_CACHE_LEN = 16

#: model_type -> config overrides on top of the tiny config.
# initializer_range 0.5: at the default a tiny random Mamba repeats one token, which would hide a wrong state.
ARCHS = {
    "llama": {},
    "qwen2": {},
    "qwen3": {},
    "qwen3_moe": {},
    "mistral": {},
    "phi3": {"pad_token_id": 0},
    "mixtral": {},
    "gemma": {},
    "gemma2": {},
    "gemma3_text": {},
    "gpt2": {},
    "falcon": {},
    "deepseek_v3": {},
    "olmo2": {},
    "qwen3_next": {},
    "gpt_oss": {},
    "lfm3": {},
    "mamba": {"initializer_range": 0.5},
    "mamba2": {"initializer_range": 0.5},
}
#: Architectures whose state is a conv/recurrent state (no K/V): model.generate's default cache is their own.
STATE_SPACE = {"mamba", "mamba2"}


def build_model(arch: str, seed: int = 0, **overrides):
    """A tiny eval-mode causal LM of ``arch`` with random weights from ``seed``."""
    return build_tiny(arch, seed=seed, **{**ARCHS.get(arch, {}), **overrides})


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
    runner = gr.hf.DecodeRunner(
        model, max_batch=MAX_BATCH, max_cache_len=MAX_CACHE_LEN, buckets=BUCKETS, backend="full", device="auto"
    )
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
    assert runner.stats.per_bucket == {1: NEW_TOKENS - 1, 4: 2 * (NEW_TOKENS - 1)}
    assert runner.stats.eager_steps == 0 and runner.runner.stats.fallbacks == 0
    runner.cleanup()


@pytest.mark.parametrize("arch", ["llama", "mamba"])
def test_negative_control_without_cache_reset(monkeypatch, arch):
    # The capture warmups really write K/V (Mamba: conv/recurrent states) and advance the StaticCache
    # write counter (Mamba: leave has_previous_state set, so the prefill would continue the stale
    # state). With the in-place reset turned into a no-op, the self-test at capture refuses the model,
    # and without the self-test the tokens differ: the equality above is evidence, not luck.
    model = build_model(arch)
    monkeypatch.setattr(gr.hf.DecodeRunner, "_reset_cache", lambda self: None)
    with pytest.raises(CaptureError, match="differs from the model's own eager decode"):
        gr.hf.DecodeRunner(model, max_batch=MAX_BATCH, max_cache_len=MAX_CACHE_LEN, buckets=BUCKETS).capture()
    runner = gr.hf.DecodeRunner(
        model, max_batch=MAX_BATCH, max_cache_len=MAX_CACHE_LEN, buckets=BUCKETS, self_test=False
    )
    runner.capture()
    ids = prompts(MAX_BATCH, seed=4)
    got = runner.generate(ids, max_new_tokens=NEW_TOKENS)
    assert not torch.equal(got, reference(model, ids))


def _recording_past_cache(monkeypatch):
    """Make DecodeRunner build caches whose linear-attention layers record their past (conv states reassigned)."""
    make = hf_decode.make_static_cache

    def make_recording(*args, **kwargs):
        cache = make(*args, **kwargs)
        try:  # transformers >= 5.25 also records recurrent states; its default (None) breaks Mamba's min()
            cache.activate_past_recording(recurrent_states_to_keep=0)
        except TypeError:  # transformers 5.24: conv states only
            cache.activate_past_recording()
        return cache

    monkeypatch.setattr(hf_decode, "make_static_cache", make_recording)


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
    monkeypatch.setattr(hf_decode, "layer_problem", lambda layer, batch: None)
    model = build_model("mamba")
    runner = gr.hf.DecodeRunner(model, max_batch=2, max_cache_len=MAX_CACHE_LEN, buckets=[1, 2])
    with pytest.raises(CaptureError, match=r"drift between warmup 2 and the capture.*update_conv_state"):
        runner.capture()
    # ... and with both checks off, a cache that reassigns its conv states decodes silently wrong tokens.
    real = hf_decode.GraphRunner
    monkeypatch.setattr(hf_decode, "GraphRunner", lambda *a, **kw: real(*a, checks=("padding", "fingerprint"), **kw))
    runner = gr.hf.DecodeRunner(model, max_batch=2, max_cache_len=MAX_CACHE_LEN, buckets=[1, 2], self_test=False)
    ids = prompts(2, seed=2)
    assert not torch.equal(runner.generate(ids, max_new_tokens=NEW_TOKENS), reference(model, ids))


def test_linear_cache_with_too_few_rows_is_refused_at_capture(monkeypatch):
    # The cache allocates its states lazily at the first forward; one of a single row cannot hold bucket 2.
    prefill = hf_decode.prefill
    monkeypatch.setattr(hf_decode, "prefill", lambda model, cache, ids, mask=None: prefill(model, cache, ids[:1]))
    runner = gr.hf.DecodeRunner(build_model("mamba"), max_batch=2, max_cache_len=8, buckets=[1, 2])
    with pytest.raises(CaptureError, match=r"'mamba'.*conv/recurrent states with 2 rows"):
        runner.capture()


def _fill_rows_after_prefill(monkeypatch, runner, rows):
    """After each eager prefill, overwrite ``rows(batch)`` of every cache tensor of ``runner`` with large noise."""
    prefill = gr.hf.DecodeRunner._prefill

    def prefill_then_fill(self, input_ids, attention_mask=None):
        logits = prefill(self, input_ids, attention_mask)
        noise = torch.Generator().manual_seed(0)
        for t in cache_tensors(runner.cache).values():
            if t.is_floating_point() and t.dim() > 1:
                block = t[rows(input_ids.shape[0])]
                block.copy_(torch.randn(block.shape, generator=noise, dtype=t.dtype) * 10)
        return logits

    monkeypatch.setattr(gr.hf.DecodeRunner, "_prefill", prefill_then_fill)


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
    runner.capture()  # the self-test at capture would see the noise too: plant it afterwards
    _fill_rows_after_prefill(monkeypatch, runner, lambda batch: slice(batch - 1, batch))
    ids = prompts(3, seed=3)
    assert not torch.equal(runner.generate(ids, max_new_tokens=NEW_TOKENS), reference(model, ids))


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
    with pytest.raises(ValueError, match="left padding"):  # right padding
        runner.generate(ids, max_new_tokens=2, attention_mask=torch.tensor([[1, 1, 1, 1, 0], [1] * 5]))
    with pytest.raises(ValueError, match="only 0 and 1"):
        runner.generate(ids, max_new_tokens=2, attention_mask=torch.tensor([[2, 1, 1, 1, 1], [1] * 5]))
    with pytest.raises(ValueError, match="prompt's shape"):
        runner.generate(ids, max_new_tokens=2, attention_mask=torch.ones((2, 4), dtype=torch.long))
    # invalid sampling values: transformers' own processors refuse them, as in model.generate
    with pytest.raises(ValueError, match="temperature.*strictly positive"):
        runner.generate(ids, max_new_tokens=2, do_sample=True, temperature=0.0)
    with pytest.raises(ValueError, match="top_k.*strictly positive integer"):
        runner.generate(ids, max_new_tokens=2, do_sample=True, top_k=-1)
    with pytest.raises(TypeError, match="second argument is generation_config, as in model.generate"):
        runner.generate(ids, 2)
    with pytest.raises(ValueError, match="inputs or input_ids, not both"):
        runner.generate(ids, input_ids=ids, max_new_tokens=2)
    assert torch.equal(
        runner.generate(input_ids=ids, max_new_tokens=2, attention_mask=torch.ones_like(ids)), reference(model, ids, 2)
    )


def test_import_graphrunner_does_not_import_transformers():
    import subprocess
    import sys

    code = (
        "import sys, graphrunner; assert 'transformers' not in sys.modules, 'eager import'; "
        "assert 'graphrunner.hf' not in sys.modules; graphrunner.hf; assert 'transformers' in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_every_public_name_has_a_docstring():
    for name in gr.hf.__all__:
        obj = getattr(gr.hf, name)
        if callable(obj):
            assert obj.__doc__ and obj.__doc__.strip(), name
    assert not hasattr(gr.hf, "SUPPORTED_MODEL_TYPES"), "the tombstone is gone with the name"
    for name in ("capture", "generate", "cleanup"):
        assert getattr(gr.hf.DecodeRunner, name).__doc__, name


def test_older_transformers_is_refused_at_capture(monkeypatch):
    """A transformers major older than the verified one fails at capture, before any graph exists."""
    model = build_model("llama")
    runner = gr.hf.DecodeRunner(model, max_batch=1, max_cache_len=8, buckets=[1])
    monkeypatch.setattr(hf_decode, "_transformers_version", lambda: "4.57.1")
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
    import graphrunner.checks.leak_check as padding

    exact = padding.difference
    monkeypatch.setattr(padding, "difference", lambda a, b, tolerant=False: exact(a, b, False))
    with pytest.raises(gr.CaptureError, match="padding leaks into real results at bucket 8"):
        gr.hf.DecodeRunner(build_model("mixtral"), max_batch=8, max_cache_len=MAX_CACHE_LEN).capture()


# ---------------------------------------------------------------- acceptance by measurement


@pytest.mark.parametrize("arch", ["mistral", "gemma2", "gpt_oss"])
def test_sliding_window_past_the_window_equals_model_generate(arch):
    """A window of 4 with 5 prompt + 10 new tokens: transformers rolls its window cache; the runner keeps
    full-length layers and masks the window inside the step. Every token equal, every decode step a replay."""
    model = build_model(arch, sliding_window=4)
    runner = gr.hf.DecodeRunner(model, max_batch=MAX_BATCH, max_cache_len=MAX_CACHE_LEN, buckets=BUCKETS)
    runner.capture()
    assert runner.stats.masks == "step"
    for batch in (1, 3):
        ids = prompts(batch, seed=batch)
        assert torch.equal(runner.generate(ids, max_new_tokens=10), reference(model, ids, n=10)), (arch, batch)
    assert runner.stats.replays == 2 * 9 and runner.stats.eager_steps == 0


def test_negative_control_sliding_window_needs_the_window_mask(monkeypatch):
    """With the step's sliding mask made causal, the capture self-test refuses the model (window 2: the self-test's
    few steps already pass it); without the self-test, tokens past the window differ from model.generate."""
    from graphrunner.hf import masks

    model = build_model("mistral", sliding_window=2)
    real = masks.plan_masks
    monkeypatch.setattr(
        hf_decode,
        "plan_masks",
        lambda cfg: masks.MaskPlan(
            "explicit", layers={k: "causal" for k in real(cfg).layers}, keyed=real(cfg).keyed, window=2
        ),
    )
    with pytest.raises(CaptureError, match=r"'mistral' differs from the model's own eager decode"):
        gr.hf.DecodeRunner(model, max_batch=MAX_BATCH, max_cache_len=MAX_CACHE_LEN, buckets=BUCKETS).capture()
    runner = gr.hf.DecodeRunner(
        model, max_batch=MAX_BATCH, max_cache_len=MAX_CACHE_LEN, buckets=BUCKETS, self_test=False
    )
    ids = prompts(3, seed=3)
    assert not torch.equal(runner.generate(ids, max_new_tokens=10), reference(model, ids, n=10))


def _ragged(batch: int, seed: int):
    """Left-padded prompts (row 0: 2 pad slots, row 2: 1); the pad slots hold random tokens, which the mask hides."""
    ids = prompts(batch, seed)
    mask = torch.ones_like(ids)
    mask[0, :2] = 0
    if batch > 2:
        mask[2, :1] = 0
    return ids, mask


@pytest.mark.parametrize("arch", ["llama", "gemma2", "qwen3_next"])
def test_ragged_prompts_equal_model_generate(arch):
    """Left-padded prompts of lengths 3, 5 and 4 (a padded bucket): the step masks each row's pad slots."""
    overrides = {"sliding_window": 4} if arch == "gemma2" else {}
    model = build_model(arch, **overrides)
    runner = gr.hf.DecodeRunner(model, max_batch=MAX_BATCH, max_cache_len=MAX_CACHE_LEN, buckets=BUCKETS)
    ids, mask = _ragged(3, seed=7)
    got = runner.generate(ids, max_new_tokens=8, attention_mask=mask)
    with torch.inference_mode():
        want = model.generate(
            ids, attention_mask=mask, max_new_tokens=8, do_sample=False, cache_implementation="static", pad_token_id=0
        )
    assert torch.equal(got, want), f"{arch}:\n{got}\n{want}"
    # control: the same prompts without the mask (pad tokens read as real ones) decode other tokens
    assert not torch.equal(runner.generate(ids, max_new_tokens=8), want)


def test_ragged_prompts_need_step_built_masks():
    model = build_model("mamba")
    runner = gr.hf.DecodeRunner(model, max_batch=2, max_cache_len=MAX_CACHE_LEN, buckets=[1, 2])
    runner.capture()
    assert runner.stats.masks.startswith("model (its forward does not take 4D attention masks")
    ids, mask = _ragged(2, seed=1)
    with pytest.raises(ValueError, match=r"'mamba' builds its attention masks itself.*equal-length prompts"):
        runner.generate(ids, max_new_tokens=2, attention_mask=mask)


@pytest.mark.parametrize("arch", ["llama", "qwen3_moe"])
def test_seeded_sampling_equals_model_generate(arch):
    """Sampling outside the graph: with the generator at model.generate's seed, the same tokens."""
    model = build_model(arch)
    runner = gr.hf.DecodeRunner(model, max_batch=MAX_BATCH, max_cache_len=MAX_CACHE_LEN, buckets=BUCKETS)
    ids = prompts(3, seed=5)
    kw = dict(do_sample=True, temperature=0.8, top_k=40, top_p=0.9)
    got = runner.generate(ids, max_new_tokens=8, generator=torch.Generator().manual_seed(11), **kw)
    torch.manual_seed(11)
    with torch.inference_mode():
        want = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, cache_implementation="static", **kw
        )
    assert torch.equal(got, want), f"{got}\n{want}"
    other = runner.generate(ids, max_new_tokens=8, generator=torch.Generator().manual_seed(12), **kw)
    assert not torch.equal(other, want)  # control: another seed draws other tokens


def test_stats_count_what_generate_did():
    model = build_model("llama")
    runner = gr.hf.DecodeRunner(model, max_batch=MAX_BATCH, max_cache_len=MAX_CACHE_LEN, buckets=BUCKETS)
    assert runner.stats.self_test is None
    runner.capture()
    before = dict(runner.runner.stats.replays)  # the self-test's replays
    runner.generate(prompts(1, seed=1), max_new_tokens=4)
    runner.generate(prompts(3, seed=3), max_new_tokens=3)
    st = runner.stats
    assert st.generate_calls == 2 and st.tokens == 1 * 4 + 3 * 3
    assert st.replays == 3 + 2 and st.per_bucket == {1: 3, 4: 2} and st.eager_steps == 0
    after = runner.runner.stats.replays  # the runner's own count agrees
    assert {b: after[b] - before.get(b, 0) for b in after if after[b] != before.get(b, 0)} == st.per_bucket
    assert st.self_test.sizes == (1, 2, 4, 3) and st.self_test.worst < 1e-4


def test_known_bad_architecture_is_refused_with_its_reason(monkeypatch):
    model = build_model("gpt_neo", window_size=4)
    with pytest.raises(CaptureError, match=r"'gpt_neo'.*window_size.*gr\.hf\.KNOWN_BAD"):
        gr.hf.DecodeRunner(model, max_batch=1, max_cache_len=MAX_CACHE_LEN, buckets=[1]).capture()
    # why it is listed: the step's mask ignores the local window; with a window as short as the self-test the
    # self-test sees it, with the default window (256) it could not.
    monkeypatch.setattr(hf_decode, "KNOWN_BAD", {})
    with pytest.raises(CaptureError, match="differs from the model's own eager decode"):
        gr.hf.DecodeRunner(model, max_batch=1, max_cache_len=MAX_CACHE_LEN, buckets=[1]).capture()


class _NoCacheLlama(transformers.LlamaForCausalLM):
    """A model that ignores the cache it is given (recomputes nothing: a decode step would see one token)."""

    def forward(self, *args, past_key_values=None, cache=None, use_cache=None, **kwargs):
        return super().forward(*args, use_cache=False, **kwargs)


def test_model_that_ignores_the_cache_is_refused():
    model = _NoCacheLlama(build_model("llama").config).eval()
    with pytest.raises(CaptureError, match="keeps no state in it"):
        gr.hf.DecodeRunner(model, max_batch=1, max_cache_len=8, buckets=[1]).capture()


def _plant_state_bug(model, marked=True):
    """A state bug: the final norm adds a tensor its previous call *replaced* (re-bound, not updated in
    place), which a replay never re-binds. The stashed-state check refuses it at capture; ``marked`` hides
    it from that check (a deliberate cache, wrongly: it is state a later call reads), so that only the
    self-test can see it."""
    norm = model.model.norm
    norm.carry = torch.zeros(())

    def hook(mod, args, out):
        bias = mod.carry
        carry = out.detach().float()[0].mean().reshape(()).clone()  # row 0: real at every call, no padding in it
        mod.carry = gr.checks.captured_cache(carry) if marked else carry  # re-bound
        return out + bias

    norm.register_forward_hook(hook)
    return model


def test_a_rebound_state_is_refused_by_the_stashed_state_check():
    with pytest.raises(
        CaptureError,
        match=r"kept in LlamaRMSNorm\.carry after it \(assigned at .*test_hf\.py:\d+ "
        r"in hook: `mod\.carry = ",
    ):
        gr.hf.DecodeRunner(
            _plant_state_bug(build_model("llama"), marked=False),
            max_batch=MAX_BATCH,
            max_cache_len=MAX_CACHE_LEN,
            buckets=BUCKETS,
        ).capture()


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_self_test_refuses_a_planted_state_bug():
    with pytest.raises(CaptureError, match=r"'llama' differs from the model's own eager decode at batch 1"):
        gr.hf.DecodeRunner(
            _plant_state_bug(build_model("llama")), max_batch=MAX_BATCH, max_cache_len=MAX_CACHE_LEN, buckets=BUCKETS
        ).capture()


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_negative_control_without_the_self_test_the_planted_bug_replays_wrong_tokens():
    runner = gr.hf.DecodeRunner(
        _plant_state_bug(build_model("llama")),
        max_batch=MAX_BATCH,
        max_cache_len=MAX_CACHE_LEN,
        buckets=BUCKETS,
        self_test=False,
    )
    runner.capture()  # every capture check passes
    ids = prompts(3, seed=3)
    got = runner.generate(ids, max_new_tokens=8)
    assert not torch.equal(got, reference(_plant_state_bug(build_model("llama")), ids, n=8))


def test_generation_config_processors_are_applied_as_model_generate_applies_them():
    """model.generate forces EOS at the last position (BART's default forced_eos_token_id); DecodeRunner applies the
    same processor outside the graph. Control: with the field reset, the last token is the model's own again."""
    model = build_model("llama")
    model.generation_config.forced_eos_token_id = 5
    runner = gr.hf.DecodeRunner(model, max_batch=2, max_cache_len=MAX_CACHE_LEN, buckets=[1, 2])
    ids = prompts(2, seed=2)
    forced = reference(model, ids, n=4)
    assert (forced[:, -1] == 5).all()  # what model.generate does with it
    assert torch.equal(runner.generate(ids, max_new_tokens=4), forced)
    model.generation_config.forced_eos_token_id = None
    plain = runner.generate(ids, max_new_tokens=4)
    assert torch.equal(plain, reference(model, ids, n=4)) and not (plain[:, -1] == 5).all()


def test_an_op_a_graph_cannot_hold_is_refused_with_the_architecture():
    """A host read inside the step (``.item()``) is a capture check's refusal, named with the architecture."""
    model = build_model("llama")
    model.model.norm.register_forward_hook(lambda mod, args, out: out * (1.0 + 0.0 * out.abs().max().item()))
    with pytest.raises(CaptureError, match=r"cannot capture architecture 'llama'.*CaptureUnsafeOpError.*item"):
        gr.hf.DecodeRunner(model, max_batch=1, max_cache_len=8, buckets=[1]).capture()


class _StaticCacheRefusingLlama(transformers.LlamaForCausalLM):
    """A model whose forward rejects a StaticCache (as MiniMax does: it keeps a cache of its own)."""

    def forward(self, *args, **kwargs):
        raise ValueError("this model uses a cache of its own")


def test_a_forward_that_rejects_the_static_cache_is_refused():
    model = _StaticCacheRefusingLlama(build_model("llama").config).eval()
    with pytest.raises(CaptureError, match=r"forward over a StaticCache failed \(ValueError: this model uses"):
        gr.hf.DecodeRunner(model, max_batch=1, max_cache_len=8, buckets=[1]).capture()


def test_a_bidirectional_lm_head_is_refused_by_the_self_test_and_accepted_as_a_decoder():
    """BERT's LM head without ``is_decoder`` attends every cache slot (transformers warns); the step's causal
    masks differ from that, and the self-test (not a list) refuses it. Configured as a decoder it is accepted
    and equals model.generate."""
    model = build_model("bert", is_decoder=False)
    with pytest.raises(CaptureError, match=r"'bert' differs from the model's own eager decode"):
        gr.hf.DecodeRunner(model, max_batch=2, max_cache_len=MAX_CACHE_LEN, buckets=[1, 2]).capture()
    model = build_model("bert")  # is_decoder=True, as its causal-LM class asks
    assert model.config.is_decoder
    runner = gr.hf.DecodeRunner(model, max_batch=2, max_cache_len=MAX_CACHE_LEN, buckets=[1, 2])
    ids = prompts(2, seed=2)
    assert torch.equal(runner.generate(ids, max_new_tokens=NEW_TOKENS), reference(model, ids))
