"""The drift check at capture (graphrunner.checks.drift, step 4 of the capture protocol).

A step that reads Python state which changes between calls is refused at
capture with a CaptureError naming the op, the line and both values; each
case has a negative control (``drift_check=False``) showing that the graph
then silently differs from eager. No false alarm on the demo decoder and on
tiny random-weight transformers models of the architectures issue 9 lists.
"""

from __future__ import annotations

import functools
import inspect
import re

import pytest
import torch
from extras_util import require

import graphrunner as gr
from graphrunner.backends import BreakableGraphBackend, FullGraphBackend
from graphrunner.checks import drift
from graphrunner.errors import CaptureError
from graphrunner.recording import ops

X = {"x": gr.BatchInput(trailing=(3,), dtype=torch.float32)}


def _runner(step, backend="full", **kw):
    # the padding-leak check's extra forwards between the last warmup and the capture would shift
    # the counters these tests name; it has its own tests (test_leaks.py)
    kw.setdefault("checks", ("drift", "fingerprint"))
    return gr.GraphRunner(step, inputs=kw.pop("inputs", X), buckets=[2], backend=backend, progress=False, **kw)


def _line_of(fn, text: str) -> int:
    src, start = inspect.getsourcelines(fn)
    return start + next(i for i, s in enumerate(src) if text in s)


class Counter:
    """A step that multiplies by a Python counter bumped at every call."""

    def __init__(self):
        self.n = 0

    def __call__(self, x):
        self.n += 1
        return x * self.n


# --------------------------------------------------------------------------- plain Python state


@pytest.mark.parametrize("backend", ["full", "breakable"])
def test_python_counter_is_caught_with_its_line(backend):
    with pytest.raises(CaptureError) as info:
        _runner(Counter(), backend).capture()
    msg = str(info.value)
    line = _line_of(Counter.__call__, "return x * self.n")
    assert "argument 2 of aten.mul was 2 at warmup 2 and 3 at capture" in msg
    assert f"test_drift.py:{line} in __call__: `return x * self.n`" in msg
    assert "make the value a tensor input" in msg.lower() and "@no_graph the enclosing function (__call__)" in msg
    assert "drift_check=False" in msg


@pytest.mark.parametrize("backend", ["full", "breakable"])
def test_counter_negative_control_graph_silently_freezes_the_value(backend):
    step = Counter()
    runner = _runner(step, backend, checks=("fingerprint",))
    runner.capture()  # no error without the check
    x = torch.arange(6.0).reshape(2, 3)
    for _ in range(3):
        got = runner(x=x).clone()
        assert torch.equal(got, x * 3)  # the capture's value, forever
        want = Counter.__call__(step, x)  # eager: the counter moves on
        assert not torch.equal(got, want)


def test_python_value_in_a_tensor_literal_is_caught():
    n = {"v": 0}

    def step(x):
        n["v"] += 1
        return x + torch.tensor(n["v"])  # a graph holds the literal as a constant

    with pytest.raises(
        CaptureError,
        match=r"argument 1 of aten.lift_fresh was a int64 tensor of shape \(\) "
        r"holding 2 at warmup 2 and a int64 tensor of shape \(\) holding 3",
    ):
        _runner(step).capture()


def test_shape_drift_is_caught():
    n = {"v": 2}

    def step(x):
        n["v"] += 1
        return x + torch.zeros(n["v"]).sum()

    with pytest.raises(CaptureError, match=r"argument 1 of aten.zeros was \(4,\) at warmup 2 and \(5,\) at capture"):
        _runner(step).capture()


def test_a_different_path_is_caught():
    n = {"v": 0}

    def step(x):
        n["v"] += 1
        return x.exp() if n["v"] % 2 else x.sin()

    with pytest.raises(
        CaptureError,
        match=r"op 1 was aten.sin at warmup 2 .* but aten.exp at capture .*"
        r"the step took a different path",
    ):
        _runner(step).capture()


def test_backend_level_opt_out_and_validation():
    x = torch.ones(2, 3)
    for cls in (FullGraphBackend, BreakableGraphBackend):
        backend = cls(device="tape", drift_check=False)
        with torch.inference_mode(), backend.capture_session():
            backend.capture_one(2, functools.partial(Counter(), x), capture_inputs=x)
        assert backend.can_run(2)
        with pytest.raises(CaptureError, match="drift between warmup 2"):
            with torch.inference_mode(), cls(device="tape").capture_session() as b:
                b.capture_one(2, functools.partial(Counter(), x), capture_inputs=x)
    with pytest.raises(TypeError, match="drift_check must be True or False"):
        FullGraphBackend(device="tape", drift_check=1)
    instance = FullGraphBackend(device="tape", drift_check=False)
    with pytest.raises(ValueError, match="checks= asks for the drift check"):
        _runner(Counter(), backend=instance, checks=("drift",))
    assert _runner(Counter(), backend=instance, checks=None).backend.drift_check is False  # the default set follows it


def test_the_backends_drift_check_is_provided_by_the_checks(monkeypatch):
    """A backend attaches its drift check by name: graphrunner.checks provides it (a backend never
    imports a check), so a backend used without a runner runs it too."""
    from graphrunner.recording import hooks

    assert isinstance(hooks.provided_check("drift"), drift.DriftCheck)
    assert [type(h) for h in FullGraphBackend(device="tape").hooks] == [drift.DriftCheck]
    assert FullGraphBackend(device="tape", drift_check=False).hooks == []
    monkeypatch.setattr(hooks, "_PROVIDED", {})  # negative control: nothing provides it
    with pytest.raises(RuntimeError, match="no 'drift' check is provided"):
        FullGraphBackend(device="tape")


def test_eager_backend_freezes_nothing_and_checks_nothing():
    step = Counter()
    runner = _runner(step, "eager")
    runner.capture()
    x = torch.ones(2, 3)
    assert torch.equal(runner(x=x), x * 4)  # the forward runs again: the counter is live
    assert torch.equal(runner(x=x), x * 5)


# --------------------------------------------------------------------------- what is not a drift


def test_lazy_initialisation_in_the_first_warmup_is_not_a_drift():
    class Lazy:
        def __init__(self):
            self.table = None

        def __call__(self, x):
            if self.table is None:  # built on the first call only
                self.table = torch.linspace(0, 1, 3).exp()
            return x * self.table

    runner = _runner(Lazy())
    runner.capture()  # warmup 1 built the table; warmup 2 and the capture agree
    x = torch.arange(6.0).reshape(2, 3)
    assert torch.equal(runner(x=x), x * torch.linspace(0, 1, 3).exp())
    # Negative control: with one warmup, that warmup is the lazy one, and the message says so.
    with pytest.raises(CaptureError, match=r"warmups=1 the only warmup may be lazy initialisation.*warmups >= 2"):
        _runner(Lazy(), warmups=1).capture()


def test_zero_warmups_compare_nothing():
    runner = _runner(Counter(), warmups=0)
    runner.capture()  # nothing to compare the capture with
    assert runner.backend.can_run(2)


def test_no_graph_body_is_not_compared_on_breakable_but_is_on_full():
    calls = {"n": 0}

    @gr.no_graph
    def scale(x):  # runs eagerly at every replay of a breakable graph
        calls["n"] += 1
        return x * calls["n"]

    def step(x):
        return scale(x.sin()).cos()

    runner = _runner(step, "breakable")
    runner.capture()
    x = torch.arange(6.0).reshape(2, 3)
    for _ in range(2):
        got = runner(x=x).clone()
        assert torch.equal(got, (x.sin() * calls["n"]).cos())  # the live counter, not a frozen one
    # A full graph holds the body (no_graph is a plain call there), so the same step is a drift.
    with pytest.raises(CaptureError, match=r"argument 2 of aten.mul was \d+ at warmup 2 .* in scale"):
        _runner(step, "full").capture()


def test_one_hot_is_one_op_on_both_sides(monkeypatch):
    """The runner captures in inference mode, where eager CPU runs F.one_hot as one aten.one_hot; a
    tape capture runs it as zeros + scatter_: one F.one_hot record each."""

    def step(t):
        return torch.nn.functional.one_hot(t, 5).float()

    spec = {"t": gr.BatchInput(trailing=(2,), dtype=torch.long)}
    runner = _runner(step, inputs=spec)
    runner.capture()
    t = torch.tensor([[1, 4]])
    assert torch.equal(runner(t=t), torch.nn.functional.one_hot(t, 5).float())
    # Negative control: without the capture's mark on the tape's zeros + scatter_, the streams differ.
    monkeypatch.setattr(ops, "atomic_call", lambda: None)
    with pytest.raises(CaptureError, match="drift"):
        _runner(step, inputs=spec).capture()


def test_one_hot_with_autograd_on_is_one_op(monkeypatch):
    """With autograd on (a backend driven directly), eager CPU runs F.one_hot as aminmax, two host
    reads, zeros, unsqueeze, scatter_: recognised as the one F.one_hot call the capture made."""
    t = torch.tensor([[1, 4], [0, 2]])

    def capture():
        backend = gr.backends.FullGraphBackend(device="tape")
        with backend.capture_session():
            backend.capture_one(2, lambda: torch.nn.functional.one_hot(t, 5).float())
        return backend

    assert torch.equal(capture().replay(2), torch.nn.functional.one_hot(t, 5).float())
    monkeypatch.setattr(drift, "_ONE_HOT_DECOMPOSED", ())  # negative control: op by op, the streams differ
    with pytest.raises(CaptureError, match="drift"):
        capture()


def test_one_hot_differing_class_count_is_a_drift():
    """The one F.one_hot record still carries its class count: a count read from Python state drifts
    (3 + one per forward: 5 at the second warmup, 6 at the capture)."""
    calls = {"n": 3}

    def step(t):
        calls["n"] += 1
        return torch.nn.functional.one_hot(t, calls["n"]).float().sum(-1)

    with pytest.raises(CaptureError, match=r"argument 2 of F.one_hot was 5 at warmup 2 and 6 at capture"):
        _runner(step, inputs={"t": gr.BatchInput(trailing=(2,), dtype=torch.long)}).capture()


def test_factory_detach_under_a_tape_capture_is_ignored(monkeypatch):
    def step(x):
        return x + torch.ones(3)

    _runner(step).capture()
    # Negative control: a tape capture dispatches an extra aten.detach after a factory call.
    monkeypatch.setattr(drift, "_IGNORED_OPS", frozenset())
    monkeypatch.setattr(drift, "_KINDS", {})  # the per-op cache of what to ignore
    with pytest.raises(CaptureError, match="but aten.detach at capture"):
        _runner(step).capture()


def test_find_drift_on_hand_built_streams():
    a, b = drift.OpStream("warmup 2"), drift.OpStream("capture")
    with a.recorder():
        torch.ones(2).mul(2.0)
    with b.recorder():
        torch.ones(2).mul(2.0)
    assert drift.find_drift(a, b) is None
    assert [r.op for r in a.ops] == ["aten.ones.default", "aten.mul.Tensor"]
    with b.recorder():
        torch.ones(2)
    assert re.search(r"capture ran 3 ops and warmup 2 2; the first extra op is aten.ones", drift.find_drift(a, b))
    nan_a, nan_b = drift.OpStream("w"), drift.OpStream("c")
    for r in (nan_a, nan_b):
        with r.recorder():
            torch.ones(2).add(float("nan"))
    assert drift.find_drift(nan_a, nan_b) is None  # NaN == NaN for the check


# --------------------------------------------------------------------------- the demo decoder


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["full", "breakable"])
def test_no_false_alarm_on_the_demo_decoder(backend):
    import io

    from graphrunner_tools.demo import run_demo

    result = run_demo(
        backend=backend,
        device="tape",
        steps=6,
        buckets=(1, 2, 4),
        max_batch=4,
        layers=2,
        trace_out=None,
        progress=False,
        out=io.StringIO(),
    )
    assert result.ok and result.graph_mismatches == 0


# --------------------------------------------------------------------------- transformers

V = 128
_C = dict(
    vocab_size=V,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
)
_MOE = dict(num_experts_per_tok=2)

#: model_type -> (config class, model class, config kwargs): tiny, random weights, nothing downloaded.
HF_ARCHS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", _C),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", _C),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {**_C, "head_dim": 16}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {**_C, "sliding_window": None}),
    "gemma": ("GemmaConfig", "GemmaForCausalLM", {**_C, "head_dim": 16}),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {**_C, "pad_token_id": 0}),
    "gpt2": ("GPT2Config", "GPT2LMHeadModel", dict(vocab_size=V, n_embd=64, n_layer=2, n_head=4, n_positions=64)),
    "gpt_neox": (
        "GPTNeoXConfig",
        "GPTNeoXForCausalLM",
        dict(
            vocab_size=V,
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=128,
            max_position_embeddings=64,
        ),
    ),
    "falcon": (
        "FalconConfig",
        "FalconForCausalLM",
        dict(vocab_size=V, hidden_size=64, num_hidden_layers=2, num_attention_heads=4),
    ),
    "stablelm": ("StableLmConfig", "StableLmForCausalLM", _C),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", _C),
    "cohere": ("CohereConfig", "CohereForCausalLM", _C),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", {**_C, **_MOE, "num_local_experts": 4, "sliding_window": None}),
    "qwen2_moe": (
        "Qwen2MoeConfig",
        "Qwen2MoeForCausalLM",
        {**_C, **_MOE, "num_experts": 4, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32},
    ),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        {**_C, **_MOE, "num_experts": 4, "moe_intermediate_size": 32, "head_dim": 16},
    ),
    "deepseek_v3": (
        "DeepseekV3Config",
        "DeepseekV3ForCausalLM",
        {
            **_C,
            **_MOE,
            "num_key_value_heads": 4,
            "n_routed_experts": 4,
            "moe_intermediate_size": 32,
            "kv_lora_rank": 16,
            "q_lora_rank": 32,
            "qk_rope_head_dim": 8,
            "qk_nope_head_dim": 8,
            "v_head_dim": 16,
            "n_group": 1,
            "topk_group": 1,
            "first_k_dense_replace": 1,
            "n_shared_experts": 1,
        },
    ),
    "granitemoe": ("GraniteMoeConfig", "GraniteMoeForCausalLM", {**_C, **_MOE, "num_local_experts": 4}),
    "mamba": ("MambaConfig", "MambaForCausalLM", dict(vocab_size=V, hidden_size=64, state_size=8, num_hidden_layers=2)),
    "mamba2": (
        "Mamba2Config",
        "Mamba2ForCausalLM",
        dict(
            vocab_size=V,
            hidden_size=64,
            state_size=8,
            num_hidden_layers=2,
            num_heads=4,
            head_dim=32,
            n_groups=1,
            chunk_size=8,
        ),
    ),
}
#: More model types, built by ``graphrunner_tools.models.hf_tiny.build_tiny`` (the tiny configs of
#: bench/hf_architectures.py): with HF_ARCHS, 36 architectures.
HF_TINY_ARCHS = (
    "phi",
    "starcoder2",
    "granite",
    "olmo",
    "helium",
    "glm",
    "smollm3",
    "arcee",
    "seed_oss",
    "nemotron",
    "persimmon",
    "ernie4_5",
    "hunyuan_v1_dense",
    "apertus",
    "bitnet",
    "codegen",
    "gptj",
)
#: Recurrent models keep no StaticCache: their no-cache forward over a fixed length is captured.
_NO_STATIC_CACHE = ("mamba", "mamba2")
B, PROMPT, CACHE_LEN = 2, 4, 16


def _hf_model(arch: str):
    transformers = require("transformers")
    if arch in HF_TINY_ARCHS:
        from graphrunner_tools.models.hf_tiny import build_tiny

        model = build_tiny(arch)
        assert model.config.vocab_size >= V
        return model
    cfg_name, model_name, kw = HF_ARCHS[arch]
    cfg = getattr(transformers, cfg_name)(**kw)
    torch.manual_seed(0)
    return getattr(transformers, model_name)(cfg).eval()


def _decode_setup(model):
    """A prefilled StaticCache, its decode step, and a hook restoring the cache tensors after each warmup."""
    from graphrunner.hf.cache import make_static_cache, restore_cache, snapshot_cache
    from graphrunner.hf.steps import make_decode_step, prefill

    cache = make_static_cache(model, B, CACHE_LEN)
    prefill(model, cache, torch.randint(3, V, (B, PROMPT), generator=torch.Generator().manual_seed(0)))
    snap = snapshot_cache(cache)
    return cache, make_decode_step(model, cache), lambda _b: restore_cache(cache, snap), snap


@pytest.mark.hf
@pytest.mark.usefixtures("one_torch_thread")
@pytest.mark.parametrize("arch", list(HF_ARCHS) + list(HF_TINY_ARCHS))
def test_no_false_alarm_on_transformers_architectures(arch):
    from graphrunner.hf.steps import decode_inputs

    model = _hf_model(arch)
    with torch.inference_mode():
        if arch in _NO_STATIC_CACHE:
            cache, hook = None, None

            def step(input_ids):
                return model(input_ids=input_ids, use_cache=False).logits

            spec = {"input_ids": gr.BatchInput(trailing=(6,), dtype=torch.long, pad=0)}
        else:
            cache, step, hook, snap = _decode_setup(model)
            spec = decode_inputs()
        runner = gr.GraphRunner(step, inputs=spec, buckets=[B], backend="full", progress=False, post_warmup_hook=hook)
        runner.capture()  # drift check on (the default): must not raise
        for i in range(2):
            if cache is None:
                args = {"input_ids": torch.randint(0, V, (B, 6), generator=torch.Generator().manual_seed(i))}
            else:
                hook(B)
                args = {"input_ids": torch.full((B, 1), 5 + i), "position_ids": torch.full((B, 1), PROMPT)}
            got = runner(**args).clone()
            if cache is not None:
                hook(B)
            assert torch.equal(got, step(**args)), arch  # the replay equals eager: nothing was frozen


def _gemma2():
    transformers = require("transformers")
    cfg = transformers.Gemma2Config(
        vocab_size=V,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=64,
        sliding_window=4,
    )
    torch.manual_seed(0)
    return transformers.Gemma2ForCausalLM(cfg).eval()


@pytest.mark.hf
@pytest.mark.usefixtures("one_torch_thread")
@pytest.mark.parametrize("backend", ["full", "breakable"])
def test_gemma2_sliding_window_cache_is_caught(backend):
    from graphrunner.hf.steps import decode_inputs

    model = _gemma2()
    with torch.inference_mode():
        cache, step, hook, _ = _decode_setup(model)
        assert any(type(layer).__name__ == "StaticSlidingWindowLayer" for layer in cache.layers)
        runner = gr.GraphRunner(
            step, inputs=decode_inputs(), buckets=[B], backend=backend, progress=False, post_warmup_hook=hook
        )
        with pytest.raises(CaptureError) as info:
            runner.capture()
    msg = str(info.value)
    # The cache layer's Python length (cumulative_length_int) moved on between warmup 2 and the capture.
    assert re.search(
        r"drift between warmup 2 and the capture of shape key 2: argument \d+ of aten\.\w+ was \d+ "
        r"at warmup 2 and \d+ at capture, at \S*transformers\S*\.py:\d+ in \w+",
        msg,
    ), msg


@pytest.mark.hf
@pytest.mark.usefixtures("one_torch_thread")
def test_gemma2_negative_control_graph_differs_from_eager_without_the_check():
    from graphrunner.hf.cache import make_static_cache, restore_cache, snapshot_cache
    from graphrunner.hf.steps import decode_inputs, make_decode_step, prefill

    model = _gemma2()
    with torch.inference_mode():
        # Captured after a 6-token prompt (past the window of 4: the layer's rolling path) ...
        cache = make_static_cache(model, B, CACHE_LEN)
        prefill(model, cache, torch.randint(3, V, (B, 6), generator=torch.Generator().manual_seed(1)))
        runner = gr.GraphRunner(
            make_decode_step(model, cache),
            inputs=decode_inputs(),
            buckets=[B],
            backend="full",
            progress=False,
            checks=("padding", "fingerprint"),
        )
        runner.capture()  # no error: the cache length of the capture is frozen silently
        # ... then serving a new 2-token prompt; the eager reference is a fresh cache with that prompt.
        twin = make_static_cache(model, B, CACHE_LEN)
        prefill(model, twin, torch.randint(3, V, (B, 2), generator=torch.Generator().manual_seed(0)))
        restore_cache(cache, snapshot_cache(twin))  # the graph's cache tensors hold the same prompt
        eager_step = make_decode_step(model, twin)
        diffs = []
        for i in range(3):
            args = {"input_ids": torch.full((B, 1), 5 + i), "position_ids": torch.full((B, 1), 2 + i)}
            got = runner(**args).clone()
            diffs.append((got - eager_step(**args)).abs().max().item())
    assert min(diffs) > 0.05, diffs  # wrong logits from the first step on, and nothing raised
