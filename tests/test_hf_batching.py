"""gr.hf.generate_batch: transformers' continuous batching with its varlen step replayed from graphrunner graphs.

The reference is transformers' own eager ``model.generate_batch`` on the same
model, prompts and configs: every test compares the generated tokens of every
request, token for token. Tiny random-weight models (2 layers, hidden 64, vocab
128, seeded; nothing downloaded); 12 prompts of 1..39 tokens, 8 new tokens, a
64-token step budget and 8 requests per step, so steps mix prefills (split in
chunks) and decodes and many are padded. The planted metadata bugs (a padding
token writing a real cache slot, a stale ``cu_seq_lens_q``) are refused at
capture or raised at the call, each with a negative control that shows the
bug changes the tokens when the check is off. Skipped without ``transformers``.
"""

import dataclasses
import math
import threading

import pytest
from extras_util import require

transformers = require("transformers")

import torch  # noqa: E402
from transformers import GenerationConfig  # noqa: E402
from transformers.generation.configuration_utils import ContinuousBatchingConfig  # noqa: E402

import graphrunner as gr  # noqa: E402
import graphrunner.hf  # noqa: E402,F401
import graphrunner.hf.batch_step as batch_step  # noqa: E402
import graphrunner.hf.batching as batching  # noqa: E402
import graphrunner.hf.entrypoints as entrypoints  # noqa: E402
import graphrunner.hf.equivalence as equivalence  # noqa: E402
import graphrunner.hf.metadata as metadata  # noqa: E402
import graphrunner.hf.model_runner as model_runner  # noqa: E402
import graphrunner.hf.planning as planning  # noqa: E402
import graphrunner.hf.refusals as refusals  # noqa: E402
from graphrunner.errors import CaptureError  # noqa: E402
from graphrunner_tools.models.hf_tiny import build_tiny  # noqa: E402

pytestmark = [pytest.mark.hf, pytest.mark.usefixtures("one_torch_thread")]

#: model_type -> config overrides: sliding windows of 12 tokens, shorter than the longer prompts
ARCHS = {
    "llama": {},
    "qwen3": {},
    "mistral": {"sliding_window": 12},
    "qwen3_moe": {},
    "gemma2": {"sliding_window": 12},
    "olmo2": {},
    "gpt_oss": {"sliding_window": 12},
}


def model_of(arch, seed=0):
    return build_tiny(arch, seed=seed, max_position_embeddings=512, **ARCHS.get(arch, {}))


def prompts(n=12, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 128, (int(k),), generator=g).tolist() for k in torch.randint(1, 40, (n,), generator=g)]


def cb_config(seed=5, logprobs=False):
    return ContinuousBatchingConfig(
        page_size=16, num_blocks=64, max_batch_tokens=64, max_requests_per_batch=8, seed=seed, return_logprobs=logprobs
    )


def gen_config(sample=False, eos=-1, new=8):
    if sample:
        return GenerationConfig(
            max_new_tokens=new, do_sample=True, temperature=0.9, top_k=20, eos_token_id=eos, pad_token_id=0
        )
    return GenerationConfig(max_new_tokens=new, do_sample=False, eos_token_id=eos, pad_token_id=0)


def eager(model, inputs, gc, logprobs=False):
    return model.generate_batch(
        inputs=inputs, generation_config=gc, continuous_batching_config=cb_config(logprobs=logprobs)
    )


def logprob_gap(ref, out):
    """The largest difference of a sampled token's log-probability (requests whose tokens agree)."""
    gaps = [
        max(abs(a - b) for a, b in zip(ref[k].logprobs, out[k].logprobs))
        for k in ref
        if ref[k].generated_tokens == out[k].generated_tokens
    ]
    return max(gaps) if gaps else float("inf")


#: one key covering every step of the workload: every step but the 64-token ones is padded
ONE_KEY = {"tokens": [64], "kv": [256], "reqs": [8]}


def mismatches(ref, out):
    assert list(ref) == list(out), "the same request ids in the same order"
    assert all(r.error is None for r in ref.values())
    return [k for k in ref if ref[k].generated_tokens != out[k].generated_tokens]


@pytest.mark.slow
@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_greedy_tokens_equal_transformers_generate_batch(arch):
    model, inputs, gc = model_of(arch), prompts(), gen_config()
    ref = eager(model, inputs, gc)
    st = {}
    out = gr.hf.generate_batch(model, inputs, gc, cb_config(), device="tape", stats=st)
    assert mismatches(ref, out) == []
    assert all(len(o.generated_tokens) == 8 for o in out.values())
    s = st["stats"]
    assert s.replayed == s.steps > 10 and s.eager_steps == 0 and s.graphs == len(s.keys) >= 2
    assert s.padded_tokens + s.padded_keys > 0, "some steps replay a padded key: the padding is exercised"
    assert s.equivalence_checked == s.graphs, "the equivalence check replayed every key"


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["llama", "gemma2"])
def test_seeded_sampling_equals_transformers_generate_batch(arch):
    model, inputs, gc = model_of(arch), prompts(seed=2), gen_config(sample=True)
    ref = eager(model, inputs, gc)
    out = gr.hf.generate_batch(model, inputs, gc, cb_config(), device="tape")
    assert mismatches(ref, out) == []
    greedy = eager(model, inputs, gen_config())
    assert mismatches(greedy, out), "control: the sampler really sampled"


def test_eos_finishes_requests_early_and_outputs_still_equal():
    # EOS = a token the tiny llama emits: requests end before max_new_tokens, so the real steps are smaller
    # than the dry run's (which samples a fixed non-EOS token) and still replay covering keys
    model, inputs = model_of("llama"), prompts(seed=3)
    first = eager(model, inputs, gen_config())
    eos = first["req_0"].generated_tokens[2]
    gc = gen_config(eos=eos)
    ref = eager(model, inputs, gc)
    assert any(len(r.generated_tokens) < 8 for r in ref.values())
    assert mismatches(ref, gr.hf.generate_batch(model, inputs, gc, cb_config(), device="tape")) == []


def test_declared_buckets_and_steps_beyond_them_run_eagerly():
    model, inputs, gc = model_of("llama"), prompts(), gen_config()
    ref = eager(model, inputs, gc)
    st = {}
    out = gr.hf.generate_batch(
        model, inputs, gc, cb_config(), device="tape", stats=st, buckets={"tokens": [8, 32], "kv": [128], "reqs": [8]}
    )
    assert mismatches(ref, out) == []
    s = st["stats"]
    assert s.graphs == 2 and s.eager_steps > 0 and s.replayed > 0 and s.replayed + s.eager_steps == s.steps
    assert st["runner"].stats.fallback_reasons.get("over_max_bucket") == s.eager_steps


def test_debug_mode_compares_masks_and_bounds_every_step():
    model, inputs, gc = model_of("mistral"), prompts(n=6), gen_config(new=4)
    ref = eager(model, inputs, gc)
    assert mismatches(ref, gr.hf.generate_batch(model, inputs, gc, cb_config(), device="tape", debug=True)) == []


def _session(manager, inputs):
    manager.start()
    ids = [manager.add_request(x, request_id=f"req_{i}", max_new_tokens=8) for i, x in enumerate(inputs)]
    out = {}
    while len(out) < len(ids):
        r = manager.get_result(timeout=30)
        assert r is not None and r.error is None
        if r.is_finished():
            out[r.request_id] = r.generated_tokens
    manager.stop(block=True, keep_for_next_session=True)
    return out


def test_manager_form_captures_between_sessions():
    model, inputs, gc = model_of("qwen3"), prompts(n=8), gen_config()
    ref = eager(model, inputs, gc)
    manager = gr.hf.init_continuous_batching(model, gc, cb_config(), device="tape")
    try:
        first = _session(manager, inputs)  # eager through the graph step, recording the step sizes
        hook = gr.hf.graphs_of(manager)
        assert hook.runner is None and hook.stats.eager_steps == hook.stats.steps > 0
        hook.batch_processor.cache.reset()
        hook.capture()
        second = _session(manager, inputs)
        assert hook.stats.replayed > 0
    finally:
        model.destroy_cached_continuous_batching_manager()
    for out in (first, second):
        assert {k: ref[k].generated_tokens for k in ref} == out


def test_planned_keys_cover_every_step():
    sizes = [(64, 64, 5), (8, 136, 8), (8, 144, 8), (4, 70, 4), (1, 8, 1), (64, 158, 7)]
    buckets, keys = planning.plan_keys(sizes, {"tokens": 2, "kv": 2, "reqs": 2})
    assert all(len(buckets[d]) <= 2 for d in buckets)
    assert buckets == {"tokens": [8, 64], "kv": [70, 158], "reqs": [5, 8]}
    for s in sizes:
        assert any(all(k[i] >= s[i] for i in range(3)) for k in keys)
    assert (64, 158, 8) in keys, "the largest key allocates the buffers"
    with pytest.raises(ValueError, match="no step sizes"):
        planning.plan_keys([])


# ---------------------------------------------------------------- refusals


def test_hybrid_linear_attention_model_is_refused_with_the_reason():
    model = build_tiny("qwen3_next", seed=0)
    with pytest.raises(ValueError, match="linear_attention"):  # transformers' own continuous batching cannot run it
        eager(model, prompts(n=2), gen_config())
    with pytest.raises(CaptureError, match=r"'qwen3_next'.*no allocator for its layer types.*linear_attention"):
        gr.hf.generate_batch(model, prompts(n=2), gen_config(), cb_config(), device="tape")


def test_flash_attention_and_async_batching_are_refused_with_the_reason(monkeypatch):
    model = model_of("llama")
    monkeypatch.setattr(model.config, "_attn_implementation", "flash_attention_2", raising=False)
    with pytest.raises(CaptureError, match="not mask-based: flash varlen attention"):
        gr.hf.generate_batch(model, prompts(n=2), gen_config(), cb_config(), device="tape")
    monkeypatch.undo()
    cfg = cb_config()
    cfg.use_async_batching = True
    with pytest.raises(CaptureError, match="asynchronous batching"):
        gr.hf.generate_batch(model, prompts(n=2), gen_config(), cfg, device="tape")


def test_user_mistakes_are_clear_errors():
    model = model_of("llama")
    with pytest.raises(TypeError, match="list of prompts"):
        gr.hf.generate_batch(model, torch.tensor([[1, 2]]))
    with pytest.raises(ValueError, match="at least one token"):
        gr.hf.generate_batch(model, [[1, 2], []])
    with pytest.raises(ValueError, match="buckets must be a dict with the dims"):
        gr.hf.generate_batch(model, [[1, 2]], gen_config(), cb_config(), buckets=[1, 2])
    with pytest.raises(ValueError, match="buckets must be a dict with the dims"):
        gr.hf.generate_batch(model, [[1, 2]], gen_config(), cb_config(), buckets=5)
    with pytest.raises(ValueError, match=r"buckets must be a dict with the dims \['tokens', 'kv', 'reqs'\]"):
        gr.hf.generate_batch(model, [[1, 2]], gen_config(), cb_config(), buckets={"tokens": [8], "reqs": [4]})
    with pytest.raises(ValueError, match=r"keys must be tuples of one size per dim \['tokens', 'kv', 'reqs'\]"):
        gr.hf.generate_batch(model, [[1, 2]], gen_config(), cb_config(), buckets=ONE_KEY, keys=[(64, 256)])
    with pytest.raises(ValueError, match="unknown dims"):
        gr.hf.generate_batch(model, [[1, 2]], gen_config(), cb_config(), max_graphs={"batch": 3})
    with pytest.raises(TypeError, match="GenerationConfig"):
        gr.hf.generate_batch(model, [[1, 2]], {"max_new_tokens": 2})
    assert gr.hf.generate_batch(model, []) == {}


def test_the_options_are_one_frozen_keyword_only_dataclass():
    """gr.hf.BatchingOptions: frozen, keyword-only, checked; both entry points take it (options=) or its fields as
    keywords, and the same options serve the same tokens either way; generate_batch refuses a server's options."""
    with pytest.raises(TypeError):
        gr.hf.BatchingOptions("tape")  # keyword-only
    opts = gr.hf.BatchingOptions(device="tape", buckets=ONE_KEY)
    with pytest.raises(dataclasses.FrozenInstanceError):
        opts.device = "auto"
    with pytest.raises(ValueError, match="replan_every must be a number of steps"):
        gr.hf.BatchingOptions(replan_every=-1)
    assert gr.hf.BatchingOptions.of(opts, debug=True) == gr.hf.BatchingOptions(
        device="tape", buckets=ONE_KEY, debug=True
    )
    model, inputs, gc = model_of("llama"), prompts(n=4), gen_config()
    with pytest.raises(TypeError, match="unknown continuous batching option"):
        gr.hf.init_continuous_batching(model, gc, cb_config(), devise="tape")
    with pytest.raises(TypeError, match=r"\['autocapture'\] are options of a manager"):
        gr.hf.generate_batch(model, inputs, gc, cb_config(), device="tape", autocapture=True)
    ref = eager(model, inputs, gc)
    st = {}
    assert mismatches(ref, gr.hf.generate_batch(model, inputs, gc, cb_config(), options=opts, stats=st)) == []
    first = st["hook"]
    assert first.options == opts and st["stats"].replayed > 0
    assert (
        mismatches(ref, gr.hf.generate_batch(model, inputs, gc, cb_config(), device="tape", buckets=ONE_KEY, stats=st))
        == []
    )
    assert st["hook"] is first, "the same options as keywords: the kept manager and graphs serve again"
    assert gr.hf.release(model)


def test_every_public_name_has_a_docstring():
    for module, name in (
        (entrypoints, "generate_batch"),
        (entrypoints, "init_continuous_batching"),
        (entrypoints, "graphs_of"),
        (batching, "GraphBatching"),
        (batching, "BatchingStats"),
        (metadata, "MetadataError"),
        (refusals, "refusal"),
        (metadata, "step_feeds"),
        (batch_step, "step_inputs"),
        (batch_step, "make_step"),
        (planning, "plan_keys"),
        (metadata, "check_trash"),
    ):
        obj = getattr(module, name)
        assert obj.__doc__ and len(obj.__doc__.strip()) > 40, name
    for name in ("install", "serve_step", "recording", "plan", "capture", "release"):
        assert getattr(batching.GraphBatching, name).__doc__, name


# ---------------------------------------------------------------- planted metadata bugs


def _plant_real_write_trash(monkeypatch):
    """Plant: every allocator's write-trash index (the slot padding tokens write) is a real request's slot."""
    from transformers.generation.continuous_batching.cache_allocators.cache_allocator import CacheAllocator

    original = CacheAllocator._after_cache_tensor_init

    def planted(self, *args, **kwargs):
        original(self, *args, **kwargs)
        # the first slot of the last block: the pool hands blocks out from the end, so a request owns it
        self.write_trash_index = self.block_physical_stride * (self.num_blocks + 2 * self.blocks_per_sector - 1)

    monkeypatch.setattr(CacheAllocator, "_after_cache_tensor_init", planted)


@pytest.fixture
def padding_writes_a_real_slot(monkeypatch):
    _plant_real_write_trash(monkeypatch)


def test_padding_write_into_a_real_slot_is_refused_at_capture(padding_writes_a_real_slot):
    with pytest.raises(
        CaptureError,
        match=r"'llama'.*padding tokens .* would write cache slot \d+, which is not in the write-trash sector",
    ):
        gr.hf.generate_batch(model_of("llama"), prompts(), gen_config(), cb_config(), device="tape")


def test_padding_write_into_a_real_slot_is_caught_by_the_equivalence_check(monkeypatch, padding_writes_a_real_slot):
    monkeypatch.setattr(batching, "check_trash", lambda cache, groups: None)  # the static check off
    with pytest.raises(
        CaptureError,
        match="or the step after it, differs from the eager steps on the same valid batches without padding",
    ):
        gr.hf.generate_batch(model_of("llama"), prompts(), gen_config(), cb_config(), device="tape")


def test_negative_control_padding_write_into_a_real_slot_changes_results(monkeypatch, padding_writes_a_real_slot):
    model, inputs, gc = model_of("llama"), prompts(), gen_config()
    monkeypatch.undo()  # the reference and the control run on a correct cache
    ref = eager(model, inputs, gc, logprobs=True)
    good = gr.hf.generate_batch(model, inputs, gc, cb_config(logprobs=True), device="tape", buckets=ONE_KEY)
    assert mismatches(ref, good) == [] and logprob_gap(ref, good) < 1e-4
    _plant_real_write_trash(monkeypatch)
    monkeypatch.setattr(batching, "check_trash", lambda cache, groups: None)
    out = gr.hf.generate_batch(
        model, inputs, gc, cb_config(logprobs=True), device="tape", equivalence=False, buckets=ONE_KEY
    )
    # without the checks the padding tokens overwrite a real request's K/V: its later tokens see another key
    assert mismatches(ref, out) or logprob_gap(ref, out) > 1e-3


def _single_call_comparison(monkeypatch):
    """Turn the equivalence check's follow-up step into a repeat of the checked step (which reads back no slot the
    padding wrote that it did not read the first time): what a check of one call at a time sees."""
    made = {}
    original = equivalence.EquivalenceCheck._synthetic

    def synthetic(self, key, sizes, gen):
        out = original(self, key, sizes, gen)
        if out is not None:
            made["feeds"] = {k: v.clone() for k, v in out[0].items()}
        return out

    monkeypatch.setattr(equivalence.EquivalenceCheck, "_synthetic", synthetic)
    monkeypatch.setattr(equivalence.EquivalenceCheck, "_follow_up", lambda self, plan, gen: made["feeds"])


def test_only_the_follow_up_step_catches_a_padding_write_its_step_does_not_read(
    monkeypatch, padding_writes_a_real_slot
):
    """Sliding layers read a step's own new keys through the sentinel, not back from the cache: a padding token
    that overwrites a new token's slot changes nothing in that step, only in the next one that reads the slot."""
    monkeypatch.setattr(batching, "check_trash", lambda cache, groups: None)  # the static check off
    with pytest.raises(CaptureError, match="or the step after it, differs from the eager steps"):
        gr.hf.generate_batch(model_of("mistral"), prompts(), gen_config(), cb_config(), device="tape", buckets=ONE_KEY)


def test_negative_control_a_single_call_comparison_accepts_that_padding_write(monkeypatch):
    model, inputs, gc = model_of("mistral"), prompts(), gen_config()
    ref = eager(model, inputs, gc, logprobs=True)  # on a correct cache
    _plant_real_write_trash(monkeypatch)
    monkeypatch.setattr(batching, "check_trash", lambda cache, groups: None)
    _single_call_comparison(monkeypatch)
    st = {}
    out = gr.hf.generate_batch(model, inputs, gc, cb_config(logprobs=True), device="tape", buckets=ONE_KEY, stats=st)
    assert st["stats"].equivalence_checked == 1, "the one-call check ran and accepted the key"
    # and the bug it missed is real: a request reads a K/V that a padding token overwrote
    assert mismatches(ref, out) or logprob_gap(ref, out) > 1e-3


def test_each_attention_type_gets_its_own_keys_dim():
    """gemma2 mixes sliding (window 12) and full layers: the sliding layers' keys are a dim of their own, padded to
    their own buckets (a sliding layer reads at most window - 1 past keys of a request)."""
    model, inputs, gc = model_of("gemma2"), prompts(), gen_config()
    assert batch_step.batch_dims(model) == ("tokens", "kv", "kv_sliding", "reqs")
    assert batch_step.batch_dims(model_of("llama")) == ("tokens", "kv", "reqs")
    assert batch_step.batch_dims(model_of("mistral")) == ("tokens", "kv", "reqs"), "one attention type: kv"
    ref = eager(model, inputs, gc)
    st = {}
    out = gr.hf.generate_batch(model, inputs, gc, cb_config(), device="tape", stats=st)
    assert mismatches(ref, out) == []
    s = st["stats"]
    assert all(len(k) == 4 for k in s.keys) and all(len(z) == 4 for z in s.step_sizes)
    for tokens, kv, kv_sliding, reqs in s.step_sizes:
        assert kv_sliding <= tokens + reqs * (12 - 1) <= tokens + kv, (tokens, kv, kv_sliding, reqs)
    assert any(z[2] < z[1] for z in s.step_sizes), "the sliding layers read fewer keys than the full ones"
    # `kv` stands for every keys dim not named itself
    st = {}
    out = gr.hf.generate_batch(model, inputs, gc, cb_config(), device="tape", stats=st, buckets=ONE_KEY)
    assert mismatches(ref, out) == [] and st["stats"].keys == [(64, 256, 256, 8)]
    with pytest.raises(
        ValueError,
        match=r"max_graphs names unknown dims \['kv_full'\]; the dims are "
        r"\['tokens', 'kv', 'kv_sliding', 'reqs'\]",
    ):
        gr.hf.generate_batch(model, inputs, gc, cb_config(), device="tape", max_graphs={"kv_full": 2})


def _plant_stale_cu_seq_lens_q(monkeypatch):
    """Plant: prepare_batch_tensors leaves the previous step's cu_seq_lens_q in place, its last entry fixed up to
    the step's token count (a stale tensor of the right total: the silent kind)."""
    from transformers.generation.continuous_batching.input_outputs import ContinuousBatchingIOs

    original = ContinuousBatchingIOs.prepare_batch_tensors

    def planted(self, *args, **kwargs):
        before = self.cumulative_seqlens_q.clone()
        original(self, *args, **kwargs)
        r, t = self.num_request_in_batch, self.total_seqlen_q
        stale = before[: r + 1].clamp(max=t)
        stale[0], stale[r] = 0, t
        if bool((stale[1:] > stale[:-1]).all()) and not torch.equal(stale, self.cumulative_seqlens_q[: r + 1]):
            self.cumulative_seqlens_q[: r + 1] = stale
            ContinuousBatchingIOs.planted += 1

    monkeypatch.setattr(ContinuousBatchingIOs, "prepare_batch_tensors", planted)
    monkeypatch.setattr(ContinuousBatchingIOs, "planted", 0, raising=False)
    return ContinuousBatchingIOs


def test_stale_cu_seq_lens_is_raised_at_the_call(monkeypatch):
    _plant_stale_cu_seq_lens_q(monkeypatch)
    with pytest.raises(
        gr.hf.MetadataError,
        match=r"cu_seq_lens_q .*(stale or inconsistent|logits_indices)|"
        r"logits_indices .* do not point",
    ):
        gr.hf.generate_batch(model_of("llama"), prompts(), gen_config(), cb_config(), device="tape")


def test_negative_control_stale_cu_seq_lens_changes_results(monkeypatch):
    model, inputs, gc = model_of("llama"), prompts(), gen_config()
    ref = eager(model, inputs, gc, logprobs=True)  # transformers' sdpa path does not read cu_seq_lens: it stays right
    ios = _plant_stale_cu_seq_lens_q(monkeypatch)
    out = gr.hf.generate_batch(model, inputs, gc, cb_config(logprobs=True), device="tape", validate=False)
    assert ios.planted > 0
    # without the call's checks a stale cu_seq_lens_q builds wrong masks silently
    assert mismatches(ref, out) or logprob_gap(ref, out) > 1e-3


@pytest.mark.slow
def test_bench_quick_run_writes_its_table(tmp_path):
    """bench/hf_continuous_batching.py --quick on one architecture: 0 mismatches, every step replayed, JSON rows
    (no timing asserted)."""
    import json
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = tmp_path / "cb.json"
    proc = subprocess.run(
        [
            sys.executable,
            os.path.join(root, "bench", "hf_continuous_batching.py"),
            "--quick",
            "--only",
            "llama,qwen3_next",
            "--repeat",
            "1",
            "--device",
            "tape",
            "--max-graphs",
            "tokens=4,kv=4,reqs=2",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    rows = {r["arch"]: r for r in json.loads(out.read_text())["rows"]}
    llama = rows["llama"]
    assert llama["mismatches"] == 0 and llama["eager_steps"] == 0 and 2 <= llama["graphs"] == len(llama["keys"])
    assert llama["transformers"]["graphs"] >= 1 and 0 <= llama["transformers"]["padded_token_share"] < 1
    assert "no allocator for its layer types" in rows["qwen3_next"]["refused"]
    assert "llama" in proc.stdout and "refused" in proc.stdout


def test_example_runs_and_matches():
    """examples/hf_continuous_batching.py: its run() on a few requests equals model.generate_batch."""
    import importlib.util
    import os

    path = os.path.join(
        os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "hf_continuous_batching.py"
    )
    spec = importlib.util.spec_from_file_location("graphrunner_example_hf_cb", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    r = example.run(requests=6, new=3, device="tape")
    assert r["mismatches"] == [] and r["requests"] == 6 and r["tokens"] == 18
    assert r["replayed"] + r["eager_steps"] == r["steps"] > 0 and r["graphs"] >= 1


def _held_background(monkeypatch, calls_before=3):
    """Hold every runner's background thread until its ``calls_before``-th call, then capture every
    key before the next: a deterministic share of eager and replayed steps (no timing)."""
    from graphrunner.capturing import Capturer
    from graphrunner.runner import GraphRunner

    real_init, real_run = Capturer.__init__, GraphRunner.run
    calls = {}

    def init(self, *args, **kwargs):
        real_init(self, *args, **kwargs)
        self.background_gate = threading.Event()

    def run(self, *args, **kwargs):
        out = real_run(self, *args, **kwargs)
        n = calls[id(self)] = calls.get(id(self), 0) + 1
        gate = self.capturer.background_gate
        if n == calls_before and gate is not None and not gate.is_set():
            gate.set()
            assert self.wait_captured(timeout=300) is not None
        return out

    monkeypatch.setattr(Capturer, "__init__", init)
    monkeypatch.setattr(GraphRunner, "run", run)


@pytest.mark.parametrize("sample", [False, True], ids=["greedy", "seeded-sampling"])
def test_background_capture_serves_from_the_first_step(monkeypatch, sample):
    """REVIEW item 3: the first steps are served eagerly while the capture thread is held, the rest
    by replay (both counts > 0), and the tokens equal transformers' own, greedy and under seeded
    sampling (the capture thread never draws from the engine's generator: issue 42 item 1)."""
    _held_background(monkeypatch)
    model, inputs, gc = model_of("llama"), prompts(seed=2 if sample else 1), gen_config(sample=sample)
    ref = eager(model, inputs, gc)
    st = {}
    out = gr.hf.generate_batch(model, inputs, gc, cb_config(), device="tape", background=True, stats=st)
    assert mismatches(ref, out) == []
    s, runner = st["stats"], st["runner"]
    assert s.replayed > 0 and s.eager_steps > 0, (s.replayed, s.eager_steps)
    assert s.replayed + s.eager_steps == s.steps and s.graphs == len(runner.keys)
    assert runner.wait_captured() is not None and sorted(runner.captured_keys) == sorted(runner.keys)
    if sample:
        assert mismatches(eager(model, inputs, gen_config()), out), "control: the sampler really sampled"
    runner.cleanup()


def test_the_generic_padding_check_misreads_the_varlen_step():
    """Why the default checks replace GraphRunner's "padding" check: it draws every integer input on its own, so its
    batches break the request structure the step reads (a logits index past the real tokens, keys of no request
    that a run with more real cells turns into attended ones); documented in docs/continuous-batching.md."""
    model = model_of("llama")
    st = {}  # the keys the planner makes of this workload's dry run (the default checks accept them)
    gr.hf.generate_batch(model, prompts(), gen_config(), cb_config(), device="tape", stats=st, reuse=False)
    planned = st["stats"].keys
    largest = max(planned, key=lambda k: (math.prod(k), k))  # captured first, so checked first
    with pytest.raises(
        CaptureError, match=rf"padding leaks into real results at key \({', '.join(map(str, largest))}\)"
    ):
        gr.hf.generate_batch(model, prompts(), gen_config(), cb_config(), device="tape", checks=None)


# ---------------------------------------------------------------- every metadata check of step_feeds, one breach each

_IO_FIELDS = (
    "num_request_in_batch",
    "total_seqlen_q",
    "input_ids",
    "position_ids",
    "cumulative_seqlens_q",
    "cumulative_seqlens_k",
    "total_seqlen_k",
    "logits_indices",
    "max_kv_read",
    "write_index_storage",
    "read_index_storage",
    "true_write_sizes",
    "true_read_sizes",
    "requests_in_batch",
    "attention_mask",
)


def _copy_io(io):
    import copy
    import types

    return types.SimpleNamespace(**{f: copy.deepcopy(getattr(io, f)) for f in _IO_FIELDS})


@pytest.fixture(scope="module")
def real_step():
    """A real varlen step of transformers' scheduler (llama: 2+ requests, keys read from the cache): a copy of
    its IO, the cache and the groups, taken inside gr.hf.generate_batch."""
    taken = {}
    original = model_runner.step_feeds

    def spy(io, cache, groups, **kw):
        if (
            "io" not in taken
            and int(io.num_request_in_batch) >= 3
            and int(io.max_kv_read) > 0
            and int(io.total_seqlen_q) > int(io.num_request_in_batch)
        ):
            taken.update(io=_copy_io(io), cache=cache, groups=list(groups))
        return original(io, cache, groups, **kw)

    model_runner.step_feeds = spy
    try:
        gr.hf.generate_batch(model_of("llama"), prompts(), gen_config(), cb_config(), device="tape", buckets=ONE_KEY)
    finally:
        model_runner.step_feeds = original
    assert "io" in taken, "the workload has a mixed step that reads the cache"
    return taken


def _breach(io, what, g):
    """Break one piece of ``io``'s metadata the way a stale or buggy scheduler would."""
    n_req, n_tok = int(io.num_request_in_batch), int(io.total_seqlen_q)
    if what == "cu_seq_lens_q":  # a request boundary moved, the total kept
        cu = io.cumulative_seqlens_q
        i = next(i for i in range(1, n_req) if cu[i + 1] - cu[i] > 1)
        cu[i] += 1
    elif what == "positions":  # a request's tokens skip a position
        cu = io.cumulative_seqlens_q
        i = next(i for i in range(n_req) if cu[i + 1] - cu[i] > 1)
        io.position_ids[int(cu[i]) + 1] += 1
    elif what == "logits_indices":
        io.logits_indices[0] += 1
    elif what == "cu_seq_lens_k":
        io.cumulative_seqlens_k[g.layer_type][n_req] -= 1
    elif what == "read_index":
        io.true_read_sizes[g.index] += 1
    elif what == "write_index":  # a real token writes the read-trash slot
        io.write_index_storage[g.index, n_tok - 1] = g.read_trash
    return io


BREACHES = {
    "cu_seq_lens_q": r"cu_seq_lens_q .* stale or inconsistent",
    "positions": r"positions are not consecutive inside a request",
    "logits_indices": r"logits_indices .* do not point at the last token",
    "cu_seq_lens_k": r"cu_seq_lens_k\['full_attention'\] .* stale or inconsistent",
    "read_index": r"read_index\[0\] has \d+ entries, cu_seq_lens_k",
    "write_index": r"write_index\[0\] \(full_attention\) holds .* never a trash slot",
}


@pytest.mark.parametrize("what", sorted(BREACHES))
def test_each_metadata_breach_is_raised_naming_the_tensor(real_step, what):
    io, cache, groups = real_step["io"], real_step["cache"], real_step["groups"]
    good = metadata.step_feeds(_copy_io(io), cache, groups)  # the untouched step passes
    assert sorted(good) == sorted(batch_step.step_inputs(groups, 128, 512, 8, 64))
    with pytest.raises(gr.hf.MetadataError, match=BREACHES[what]):
        metadata.step_feeds(_breach(_copy_io(io), what, groups[0]), cache, groups)


@pytest.mark.parametrize("what", ["cu_seq_lens_q", "positions", "cu_seq_lens_k", "write_index"])
def test_negative_control_without_the_checks_each_breach_feeds_the_graph_silently(real_step, what):
    """validate=False: the same breaches go through, and the step's inputs (the mask's coordinates, the slots
    written) differ from the untouched step's: a wrong result, no error."""
    io, cache, groups = real_step["io"], real_step["cache"], real_step["groups"]
    good = metadata.step_feeds(_copy_io(io), cache, groups)
    bad = metadata.step_feeds(_breach(_copy_io(io), what, groups[0]), cache, groups, validate=False)
    assert any(not torch.equal(good[k], bad[k]) for k in good if good[k].shape == bad[k].shape) or any(
        good[k].shape != bad[k].shape for k in good
    )


class _MaskSpy:
    """A stand-in model for :func:`batch_step.make_step`: records the attention masks it is given."""

    dtype = torch.float32

    def __call__(self, **kw):
        self.masks = kw["attention_mask"]
        n = kw["logits_indices"].shape[0]
        return type("Out", (), {"logits": torch.zeros(1, n, 4)})()


def _mask_case(gen, n_req=5, window=3, pad_tok=3, pad_key=7):
    """Random valid varlen metadata: requests with a past and new tokens, padded queries and keys."""
    lens_q = torch.randint(1, 5, (n_req,), generator=gen).tolist()
    past = torch.randint(0, 9, (n_req,), generator=gen).tolist()
    tok_req, pos, key_req, key_pos = [], [], [], []
    for r, (q, p) in enumerate(zip(lens_q, past)):
        tok_req += [r] * q
        pos += list(range(p, p + q))
        key_req += [r] * (p + q)
        key_pos += list(range(p + q))
    tok_req += [batch_step.TOKEN_PAD_REQUEST] * pad_tok
    pos += [0] * pad_tok
    key_req += [batch_step.KEY_PAD_REQUEST] * pad_key
    key_pos += [0] * pad_key
    return tuple(torch.tensor(v, dtype=torch.int32) for v in (tok_req, pos, key_req, key_pos))


def _reference_mask(tok_req, pos, key_req, key_pos, window, own=True):
    """Query t may see key j: the same request, a position at most its own (``own=False``: below its own, a
    planted off-by-one), within the window; a padding query sees every key."""
    same = tok_req[:, None] == key_req[None, :]
    before = key_pos[None, :] <= pos[:, None] if own else key_pos[None, :] < pos[:, None]
    ok = same & before
    if window is not None:
        ok &= key_pos[None, :] > pos[:, None] - window
    return ok | (tok_req < 0)[:, None]


@pytest.mark.parametrize("max_requests", [8, 1 << 20], ids=["int32-codes", "int64-codes"])
def test_the_step_builds_the_reference_mask(max_requests):
    """make_step's in-graph masks (one range test per cell on request/position codes) allow exactly the keys
    of the query's request at or before its position (sliding layers: within the window), and nothing for a
    padding key; a padding query sees every key. -inf where masked, 0 where allowed; random metadata, full and
    sliding layers; int32 and int64 codes. Negative control: the reference with an off-by-one differs."""
    gen = torch.Generator().manual_seed(7)
    groups = [
        batch_step.CacheGroup(0, "full_attention", "kv", 0, 0, 0, 0, 0, 0, None),
        batch_step.CacheGroup(1, "sliding_attention", "kv_sliding", 0, 0, 0, 0, 0, 0, 3),
    ]
    spy = _MaskSpy()
    step = batch_step.make_step(
        spy, None, groups, use_logits_to_keep=True, max_position=64, max_requests=max_requests, per_request=False
    )
    for _ in range(20):
        tok_req, pos, key_req, key_pos = _mask_case(gen)
        feeds = {
            "input_ids": torch.zeros_like(tok_req),
            "position_ids": pos,
            "tok_req": tok_req,
            "logits_indices": torch.zeros(2, dtype=torch.int32),
        }
        for g in groups:
            feeds.update(
                {
                    f"read_index_{g.index}": torch.zeros_like(key_req),
                    f"write_index_{g.index}": tok_req,
                    f"key_req_{g.index}": key_req,
                    f"key_pos_{g.index}": key_pos,
                }
            )
        step(**feeds)
        for g in groups:
            mask = spy.masks[g.layer_type][0, 0]
            want = _reference_mask(tok_req, pos, key_req, key_pos, g.window)
            assert torch.equal(mask == 0, want) and torch.equal(mask != 0, mask == float("-inf"))
            assert not torch.equal(mask == 0, _reference_mask(tok_req, pos, key_req, key_pos, g.window, own=False))


def test_a_manager_that_pads_for_its_own_graphs_is_refused_before_its_warmup(monkeypatch):
    """A manager set for transformers' own CUDA graphs (``use_cuda_graph``, which pad the step's inputs; on this
    CPU transformers resolves it off, so it is set on the resolved config here) is refused at install, before
    ``manager.warmup()`` would capture them: its model runner's warmup is never entered."""
    from transformers.generation.continuous_batching.model_runner import ModelRunner

    warmed = []
    monkeypatch.setattr(ModelRunner, "warmup", lambda self, model: warmed.append(1))
    model = model_of("llama")
    manager = model.init_continuous_batching(generation_config=gen_config(), continuous_batching_config=cb_config())
    manager.continuous_batching_config.use_cuda_graph = True
    with pytest.raises(CaptureError, match="pads its inputs for its own CUDA graphs"):
        batching.GraphBatching(model).install(manager)
    assert warmed == [] and manager.batch_processor is None
    # control: without transformers' graphs it installs, and the warmup runs
    manager.continuous_batching_config.use_cuda_graph = False
    batching.GraphBatching(model).install(manager)
    assert warmed == [1] and manager.batch_processor is not None
    manager.destroy()
