"""gr.hf.refusal on hybrid and state-space models: refused with the layer kind named.

transformers' paged cache pages attention keys and values only; it has no
allocator for layers that keep a recurrent state per request (mamba
state-space, linear attention, short convolutions, RWKV / xLSTM cells). The
reference is the model's own ``model.generate`` (greedy, one prompt at a time)
and the evidence transformers' own eager ``model.generate_batch``: it raises on
mamba and falcon_h1 (their ``layer_types`` name the layer kind), and on RWKV,
whose config names no layers, it raises without head counts and, given them,
runs and returns tokens that differ from ``model.generate`` without an error
(the recurrent state restarts at every step): the silent wrong result the
refusal prevents. Controls: lfm2 with attention layers only (its config has
convolution attributes) is served and its continuous batching equals
``model.generate``; the served architectures are not refused. Tiny random-weight
models (nothing downloaded). Skipped without ``transformers``.
"""

import re

import pytest
from extras_util import require

transformers = require("transformers")

import torch  # noqa: E402
from transformers import GenerationConfig  # noqa: E402
from transformers.generation.configuration_utils import ContinuousBatchingConfig  # noqa: E402

import graphrunner as gr  # noqa: E402
import graphrunner.hf  # noqa: E402,F401
from graphrunner.errors import CaptureError  # noqa: E402
from graphrunner.hf.refusals import refusal  # noqa: E402
from graphrunner_tools.models.hf_tiny import build_tiny  # noqa: E402

pytestmark = [pytest.mark.hf, pytest.mark.usefixtures("one_torch_thread")]

PROMPTS = [[5, 6, 7], [8, 9, 10, 11]]
#: RWKV's attention width and feed-forward size are not among the sizes build_tiny shrinks
RWKV = {"attention_hidden_size": 64, "intermediate_size": 128}


def gen_config():
    return GenerationConfig(do_sample=False, max_new_tokens=5, eos_token_id=-1, pad_token_id=0)


def cb_config():
    return ContinuousBatchingConfig(
        use_cuda_graph=False, page_size=16, num_blocks=64, max_batch_tokens=64, max_requests_per_batch=8
    )


def reference(model):
    """Greedy ``model.generate`` on each prompt alone: the new tokens."""
    out = []
    with torch.no_grad():
        for p in PROMPTS:
            ids = model.generate(
                torch.tensor([p]),
                attention_mask=torch.ones(1, len(p), dtype=torch.long),
                generation_config=gen_config(),
            )
            out.append(ids[0, len(p) :].tolist())
    return out


def batched(model):
    """transformers' own eager continuous batching: the new tokens per request, in request order."""
    out = model.generate_batch(inputs=PROMPTS, generation_config=gen_config(), continuous_batching_config=cb_config())
    assert all(r.error is None for r in out.values())
    return [out[k].generated_tokens for k in sorted(out, key=lambda k: int(k.rsplit("_", 1)[-1]))]


@pytest.mark.parametrize(
    "arch, kind",
    [
        ("mamba", r"its linear_attention layers \(mamba state-space\)"),
        ("falcon_h1", r"its hybrid layers \(mamba state-space\)"),
    ],
    ids=["mamba", "falcon_h1"],
)
def test_state_space_layers_are_refused_and_transformers_cannot_batch_them(arch, kind):
    model = build_tiny(arch, seed=0)
    why = refusal(model)
    assert why is not None
    assert re.search(kind + " keep a recurrent state per request", why), why
    assert "paged cache has no allocator for its layer types" in why
    with pytest.raises(ValueError, match="Invalid layer type"):  # transformers' own continuous batching
        batched(model)
    with pytest.raises(CaptureError, match=f"'{arch}'.*" + kind):
        gr.hf.generate_batch(model, PROMPTS, gen_config(), cb_config(), device="tape")


def test_rwkv_is_refused_though_transformers_batches_it_wrongly():
    model = build_tiny("rwkv", seed=0, **RWKV)
    why = refusal(model)
    assert why is not None and "its rwkv layers (RWKV recurrent) keep a recurrent state per request" in why
    assert "wrong tokens without an error" in why
    with pytest.raises(ValueError, match="num_key_value_heads or num_attention_heads"):
        batched(model)  # its config has no head counts: transformers cannot size a paged cache
    with pytest.raises(CaptureError, match="'rwkv'.*rwkv layers"):
        gr.hf.generate_batch(model, PROMPTS, gen_config(), cb_config(), device="tape")
    # negative control: given head counts, transformers' continuous batching runs RWKV as full-attention layers
    # and drops its state between steps: no error, wrong tokens (the first token of each request, from the whole
    # prompt, still agrees)
    ref = reference(model)
    model.config.num_attention_heads, model.config.num_key_value_heads, model.config.head_dim = 4, 4, 16
    out = batched(model)
    assert [o[:1] for o in out] == [r[:1] for r in ref]
    assert out != ref, "transformers' continuous batching of RWKV equals model.generate: the state is kept after all"
    assert refusal(model) == why


def test_served_architectures_are_not_refused():
    # lfm2 with attention layers only (its default layer_types; its config still has conv_* attributes): served,
    # and transformers' continuous batching equals model.generate
    model = build_tiny("lfm2", seed=0)
    assert set(model.config.layer_types) == {"full_attention"}
    assert refusal(model) is None
    assert batched(model) == reference(model)
    conv = build_tiny("lfm2", seed=0, layer_types=["conv", "full_attention"])
    assert "its conv layers (short-convolution) keep a recurrent state" in refusal(conv)
    for arch, extra in [
        ("llama", {}),
        ("qwen3", {}),
        ("qwen3_moe", {}),
        ("mistral", {"sliding_window": 12}),
        ("gemma2", {"sliding_window": 12}),
        ("gpt_oss", {"sliding_window": 12}),
        ("olmo2", {}),
    ]:
        assert refusal(build_tiny(arch, seed=0, **extra)) is None, arch
