"""Tests for the demo Llama decoder (graphrunner_tools.models).

Values are checked against hand formulas and against an uncached full-sequence causal forward;
invariant tests carry a negative control that shows the check fails when the invariant breaks.
"""

from __future__ import annotations

import math

import pytest
import torch
from extras_util import require
from torch.utils._python_dispatch import TorchDispatchMode

from graphrunner_tools.models import (
    LlamaConfig,
    RMSNorm,
    RotaryEmbedding,
    apply_rotary,
    build_model,
    repeat_kv,
    rope_cos_sin,
    rotate_half,
)
from graphrunner_tools.models import llama as llama_mod

ATOL = 2e-5
RTOL = 1e-5


def _tokens(b: int, t: int, vocab: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, vocab, (b, t), generator=torch.Generator().manual_seed(seed))


def _decode_all(model, tokens: torch.Tensor) -> torch.Tensor:
    """Feed ``tokens [B, T]`` one position at a time; return logits ``[B, T, V]``."""
    b, t = tokens.shape
    outs = [model.decode_step(tokens[:, i], torch.full((b,), i, dtype=torch.long)) for i in range(t)]
    return torch.stack(outs, dim=1)


# --------------------------------------------------------------------------- config


def test_config_presets_and_derived_sizes():
    demo = LlamaConfig()
    assert (demo.num_layers, demo.hidden_size, demo.num_heads, demo.num_kv_heads) == (4, 256, 8, 2)
    assert (demo.vocab_size, demo.max_seq_len, demo.max_batch_size) == (1024, 256, 64)
    assert demo.head_dim == 32 and demo.num_kv_groups == 4
    assert LlamaConfig.demo() == demo
    tiny = LlamaConfig.tiny(num_layers=1)
    assert tiny.num_layers == 1 and tiny.hidden_size == 64 and tiny.head_dim == 16
    assert tiny.replace(vocab_size=50).vocab_size == 50


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(hidden_size=60, num_heads=8), "divisible by num_heads"),
        (dict(num_heads=6, num_kv_heads=4, hidden_size=48), "divisible by num_kv_heads"),
        (dict(hidden_size=12, num_heads=4, num_kv_heads=2), "must be even"),
        (dict(num_layers=0), "num_layers"),
        (dict(vocab_size=1.5), "vocab_size"),
        (dict(attention="flash"), "attention"),
    ],
)
def test_config_rejects_bad_values(kw, match):
    with pytest.raises(ValueError, match=match):
        LlamaConfig(**kw)


# --------------------------------------------------------------------------- building blocks


def test_rmsnorm_matches_hand_formula():
    torch.manual_seed(0)
    norm = RMSNorm(8, eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(8))
    x = torch.randn(3, 5, 8)
    expected = torch.empty_like(x)
    for i in range(3):
        for j in range(5):
            v = x[i, j]
            rms = math.sqrt(sum(float(e) ** 2 for e in v) / 8 + 1e-5)
            expected[i, j] = norm.weight.detach() * v / rms
    torch.testing.assert_close(norm(x), expected, atol=1e-6, rtol=1e-6)
    # negative control: forgetting eps or the weight is detected
    assert not torch.allclose(norm(x), x / x.pow(2).mean(-1, keepdim=True).sqrt(), atol=1e-4)
    # scale invariance: RMSNorm(c * x) == RMSNorm(x) for c > 0 (up to eps)
    torch.testing.assert_close(norm(7.0 * x), norm(x), atol=2e-4, rtol=2e-4)


def test_rotary_hand_computed_pairs():
    theta, d = 10000.0, 4
    x = torch.tensor([1.0, 2.0, 3.0, 4.0])
    for p in (0, 1, 5):
        cos, sin = rope_cos_sin(torch.tensor(p), d, theta)
        out = apply_rotary(x, cos, sin)
        # pair (j, j + d/2) is rotated by p * theta^(-2j/d)
        expected = torch.empty(4)
        for j in range(d // 2):
            ang = p * theta ** (-2 * j / d)
            a, b = float(x[j]), float(x[j + d // 2])
            expected[j] = a * math.cos(ang) - b * math.sin(ang)
            expected[j + d // 2] = b * math.cos(ang) + a * math.sin(ang)
        torch.testing.assert_close(out, expected, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(rotate_half(x), torch.tensor([-3.0, -4.0, 1.0, 2.0]))


def test_rotary_identity_at_zero_preserves_norm_and_is_relative():
    d = 16
    rope = RotaryEmbedding(d, max_seq_len=64)
    torch.manual_seed(0)
    q, k = torch.randn(d), torch.randn(d)
    cos0, sin0 = rope(torch.tensor([0]))
    torch.testing.assert_close(apply_rotary(q, cos0[0], sin0[0]), q)  # position 0: identity
    pos = torch.arange(64)
    cos, sin = rope(pos)
    rq = apply_rotary(q.expand(64, d), cos, sin)
    torch.testing.assert_close(rq.norm(dim=-1), q.norm().expand(64), atol=1e-5, rtol=1e-5)
    assert not torch.allclose(rq[3], q, atol=1e-3)  # it does rotate
    # <R_p q, R_s k> depends only on p - s
    rk = apply_rotary(k.expand(64, d), cos, sin)
    dots = [float(rq[p] @ rk[p - 4]) for p in (4, 10, 37, 63)]
    assert max(dots) - min(dots) < 1e-4
    # the gathered table equals the formula
    cf, sf = rope_cos_sin(pos, d)
    torch.testing.assert_close(cos, cf)
    torch.testing.assert_close(sin, sf)


def test_gqa_shapes_and_repeat_kv_mapping():
    cfg = LlamaConfig.tiny(num_heads=4, num_kv_heads=2, hidden_size=64)
    m = build_model(cfg)
    attn = m.model.layers[0].self_attn
    d = cfg.head_dim
    assert attn.q_proj.weight.shape == (4 * d, 64)
    assert attn.k_proj.weight.shape == (2 * d, 64)
    assert attn.v_proj.weight.shape == (2 * d, 64)
    assert attn.o_proj.weight.shape == (64, 4 * d)
    assert attn.k_cache.shape == (cfg.max_batch_size, 2, cfg.max_seq_len, d)
    assert len(m.kv_cache_tensors()) == 2 * cfg.num_layers
    x = torch.arange(2).float().view(1, 2, 1, 1).expand(1, 2, 3, d)
    r = repeat_kv(x, 2)
    assert r.shape == (1, 4, 3, d)
    assert r[0, :, 0, 0].tolist() == [0.0, 0.0, 1.0, 1.0]  # kv head h serves q heads 2h, 2h+1


def test_gqa_equals_mha_with_repeated_kv_weights():
    """A GQA model equals the MHA model whose K/V projections repeat each KV head per group."""
    gqa_cfg = LlamaConfig.tiny(num_heads=4, num_kv_heads=2)
    gqa = build_model(gqa_cfg, seed=3)
    mha = build_model(gqa_cfg.replace(num_kv_heads=4), seed=3)
    sd = gqa.state_dict()
    d, g = gqa_cfg.head_dim, gqa_cfg.num_kv_groups
    for name in list(sd):
        if name.endswith(("k_proj.weight", "v_proj.weight")):
            w = sd[name].view(gqa_cfg.num_kv_heads, d, -1)
            sd[name] = w.repeat_interleave(g, dim=0).reshape(gqa_cfg.num_heads * d, -1)
    mha.load_state_dict(sd)
    toks = _tokens(2, 6, gqa_cfg.vocab_size)
    torch.testing.assert_close(mha.forward_full(toks), gqa.forward_full(toks), atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(_decode_all(mha, toks), _decode_all(gqa, toks), atol=ATOL, rtol=RTOL)
    # negative control: the other head grouping (repeat instead of repeat_interleave) differs
    for name in list(sd):
        if name.endswith(("k_proj.weight", "v_proj.weight")):
            w = gqa.state_dict()[name].view(gqa_cfg.num_kv_heads, d, -1)
            sd[name] = w.repeat(g, 1, 1).reshape(gqa_cfg.num_heads * d, -1)
    mha.load_state_dict(sd)
    assert not torch.allclose(mha.forward_full(toks), gqa.forward_full(toks), atol=1e-3)


# --------------------------------------------------------------------------- decode vs reference


@pytest.mark.parametrize("attention", ["varlen", "masked"])
def test_decode_steps_match_full_causal_forward(attention):
    cfg = LlamaConfig.tiny(attention=attention)
    m = build_model(cfg, seed=0)
    toks = _tokens(3, 12, cfg.vocab_size)
    ref = m.forward_full(toks)
    assert ref.shape == (3, 12, cfg.vocab_size)
    dec = _decode_all(m, toks)
    torch.testing.assert_close(dec, ref, atol=ATOL, rtol=RTOL)
    # negative control: a step that forgot earlier tokens (fresh cache at the last step) differs
    m.reset_cache()
    last = m.decode_step(toks[:, -1], torch.full((3,), 11, dtype=torch.long))
    assert not torch.allclose(last, ref[:, -1], atol=1e-3)


@pytest.mark.parametrize("attention", ["varlen", "masked"])
def test_ragged_batch_rows_at_different_positions(attention):
    """Each row prefilled to its own length, then decoded together with per-row positions."""
    cfg = LlamaConfig.tiny(attention=attention)
    m = build_model(cfg, seed=1)
    lens = [3, 7, 1, 5]
    steps = 4
    seqs = [_tokens(1, n + steps, cfg.vocab_size, seed=10 + i)[0] for i, n in enumerate(lens)]
    for i, n in enumerate(lens):
        m.prefill(seqs[i][:n][None], slot_ids=torch.tensor([i]))
    got = []
    for s in range(steps):
        ids = torch.stack([seqs[i][n + s] for i, n in enumerate(lens)])
        pos = torch.tensor([n + s for n in lens])
        got.append(m.decode_step(ids, pos))
    for i, n in enumerate(lens):
        ref = m.forward_full(seqs[i][None])[0]
        for s in range(steps):
            torch.testing.assert_close(got[s][i], ref[n + s], atol=ATOL, rtol=RTOL)


def test_prefill_and_chunked_prefill_match_full_forward():
    cfg = LlamaConfig.tiny()
    m = build_model(cfg, seed=2)
    toks = _tokens(2, 10, cfg.vocab_size)
    ref = m.forward_full(toks)
    torch.testing.assert_close(m.prefill(toks), ref, atol=ATOL, rtol=RTOL)
    m.reset_cache()
    a = m.prefill(toks[:, :4])
    b = m.prefill(toks[:, 4:], start_pos=4)
    torch.testing.assert_close(torch.cat([a, b], 1), ref, atol=ATOL, rtol=RTOL)
    # decode continues from the prefilled cache
    nxt = _tokens(2, 1, cfg.vocab_size, seed=9)[:, 0]
    step = m.decode_step(nxt, torch.full((2,), 10, dtype=torch.long))
    full = m.forward_full(torch.cat([toks, nxt[:, None]], 1))
    torch.testing.assert_close(step, full[:, -1], atol=ATOL, rtol=RTOL)


def test_forward_full_does_not_touch_cache_and_reset_keeps_addresses():
    m = build_model(LlamaConfig.tiny(), seed=0)
    ptrs = [t.data_ptr() for t in m.kv_cache_tensors()]
    m.forward_full(_tokens(2, 5, 128))
    assert all(t.abs().sum() == 0 for t in m.kv_cache_tensors())
    _decode_all(m, _tokens(2, 5, 128))
    assert any(t.abs().sum() > 0 for t in m.kv_cache_tensors())  # decode wrote the cache
    m.prefill(_tokens(3, 4, 128))
    m.reset_cache()
    assert all(t.abs().sum() == 0 for t in m.kv_cache_tensors())
    assert [t.data_ptr() for t in m.kv_cache_tensors()] == ptrs  # written in place only


# --------------------------------------------------------------------------- padding rows


@pytest.mark.parametrize("attention", ["varlen", "masked"])
def test_padding_rows_do_not_affect_real_rows(attention):
    cfg = LlamaConfig.tiny(attention=attention)
    real, padded = 3, 8
    toks = _tokens(real, 6, cfg.vocab_size)

    def run(pad_fill_ids: int, pad_fill_pos: int, slot_ids=None):
        m = build_model(cfg, seed=4)
        outs = []
        for t in range(toks.shape[1]):
            ids = torch.full((padded,), pad_fill_ids, dtype=torch.long)
            pos = torch.full((padded,), pad_fill_pos, dtype=torch.long)
            ids[:real], pos[:real] = toks[:, t], t
            outs.append(m.decode_step(ids, pos, slot_ids)[:real])
        caches = [c[:real].clone() for c in m.kv_cache_tensors()]
        return torch.stack(outs, 1), caches

    unpadded_model = build_model(cfg, seed=4)
    unpadded = _decode_all(unpadded_model, toks)
    zero_pad, zero_caches = run(0, 0)
    junk_pad, junk_caches = run(97, 5)
    torch.testing.assert_close(zero_pad, unpadded, atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(junk_pad, zero_pad, atol=0, rtol=0)  # rows independent
    for c0, cu, cj in zip(zero_caches, [c[:real] for c in unpadded_model.kv_cache_tensors()], junk_caches):
        torch.testing.assert_close(c0, cu, atol=ATOL, rtol=RTOL)
        torch.testing.assert_close(cj, c0, atol=0, rtol=0)
    # negative control: padding rows pointed at a real request's slot (slot 0) corrupt it
    bad_slots = torch.tensor([0, 1, 2] + [0] * (padded - real))
    bad, _ = run(97, 5, bad_slots)
    assert not torch.allclose(bad[0], unpadded[0], atol=1e-3)


# --------------------------------------------------------------------------- capture safety


class _UnsafeOpGuard(TorchDispatchMode):
    """Raises on host-reading / data-dependent-shape ops unless paused (an eager break)."""

    def __init__(self):
        super().__init__()
        self.paused = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        tags = getattr(func, "tags", ())
        unsafe = (
            torch.Tag.data_dependent_output in tags
            or torch.Tag.dynamic_output_shape in tags
            or func.overloadpacket in (torch.ops.aten.nonzero, torch.ops.aten._local_scalar_dense)
        )
        if unsafe and not self.paused:
            raise RuntimeError(f"capture-unsafe op {func}")
        return func(*args, **(kwargs or {}))


def test_everything_but_the_attention_break_is_capture_safe(monkeypatch):
    m_masked = build_model(LlamaConfig.tiny(attention="masked"), seed=0)
    m_varlen = build_model(LlamaConfig.tiny(attention="varlen"), seed=0)
    ids, pos = torch.tensor([1, 2, 3]), torch.tensor([0, 4, 2])
    guard = _UnsafeOpGuard()
    with guard:
        m_masked.decode_step(ids, pos)  # whole step safe: fits a full graph
    # negative control: the varlen core reads lengths on the host
    with pytest.raises(RuntimeError, match="capture-unsafe"):
        with _UnsafeOpGuard():
            m_varlen.decode_step(ids, pos)
    # ...but only inside the break: pause the guard there and the rest of the step is safe
    inner = llama_mod.varlen_attention

    def paused(*a, **k):
        guard.paused = True
        try:
            return inner(*a, **k)
        finally:
            guard.paused = False

    monkeypatch.setattr(llama_mod, "varlen_attention", paused)
    with guard:
        out = m_varlen.decode_step(ids, pos)
    assert out.shape == (3, 128)


def test_varlen_attention_is_a_no_graph_break():
    assert getattr(llama_mod.varlen_attention, "__graphrunner_no_graph__", False)


def test_decode_step_in_breakable_graph_replays_like_eager():
    pytest.importorskip("graphrunner.tape")
    from graphrunner.breakable import BreakableGraph, breakable_graph
    from graphrunner.devices import TapeDevice

    cfg = LlamaConfig.tiny()
    m, ref_m = build_model(cfg, seed=5), build_model(cfg, seed=5)
    b = 4
    toks = _tokens(b, 6, cfg.vocab_size)
    ids, pos = torch.zeros(b, dtype=torch.long), torch.zeros(b, dtype=torch.long)
    with torch.inference_mode():
        graph = BreakableGraph(device=TapeDevice())
        with breakable_graph(graph):
            out = m.decode_step(ids, pos)
        assert graph.num_breaks == cfg.num_layers
        m.reset_cache()
        for t in range(toks.shape[1]):
            ids.copy_(toks[:, t])
            pos.fill_(t)
            graph.replay()
            expected = ref_m.decode_step(toks[:, t], torch.full((b,), t, dtype=torch.long))
            torch.testing.assert_close(out, expected, atol=ATOL, rtol=RTOL)


def test_masked_decode_step_captures_whole_in_a_tape_graph():
    tape = pytest.importorskip("graphrunner.tape")
    from graphrunner.errors import CaptureUnsafeOpError

    cfg = LlamaConfig.tiny(attention="masked")
    m, ref_m = build_model(cfg, seed=5), build_model(cfg, seed=5)
    b = 4
    toks = _tokens(b, 6, cfg.vocab_size)
    ids, pos = torch.zeros(b, dtype=torch.long), torch.zeros(b, dtype=torch.long)
    with torch.inference_mode():
        graph = tape.TapeGraph()
        with tape.tape_graph(graph):
            out = m.decode_step(ids, pos)
        m.reset_cache()
        for t in range(toks.shape[1]):
            ids.copy_(toks[:, t])
            pos.fill_(t)
            graph.replay()
            expected = ref_m.decode_step(toks[:, t], torch.full((b,), t, dtype=torch.long))
            torch.testing.assert_close(out, expected, atol=ATOL, rtol=RTOL)
        # negative control: the varlen core reads lengths on the host, so a full capture fails
        varlen = build_model(cfg.replace(attention="varlen"), seed=5)
        with pytest.raises(CaptureUnsafeOpError):
            with tape.tape_graph(tape.TapeGraph()):
                varlen.decode_step(ids, pos)


# --------------------------------------------------------------------------- determinism / dtype / errors


def test_seed_determinism():
    cfg = LlamaConfig.tiny()
    torch.manual_seed(123)
    before = torch.rand(3)
    torch.manual_seed(123)
    a, b, c = build_model(cfg, seed=7), build_model(cfg, seed=7), build_model(cfg, seed=8)
    assert torch.equal(torch.rand(3), before)  # global RNG untouched
    for (na, pa), (nb, pb), (_, pc) in zip(a.state_dict().items(), b.state_dict().items(), c.state_dict().items()):
        assert na == nb and torch.equal(pa, pb)
        if "norm" not in na:
            assert not torch.equal(pa, pc), na
    toks = _tokens(2, 4, cfg.vocab_size)
    assert torch.equal(a.forward_full(toks), b.forward_full(toks))


def test_hf_style_parameter_names_and_inference_mode():
    m = build_model(LlamaConfig.tiny(num_layers=1))
    names = set(m.state_dict())
    assert names == {
        "model.embed_tokens.weight",
        "model.norm.weight",
        "lm_head.weight",
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.0.self_attn.k_proj.weight",
        "model.layers.0.self_attn.v_proj.weight",
        "model.layers.0.self_attn.o_proj.weight",
        "model.layers.0.mlp.gate_proj.weight",
        "model.layers.0.mlp.up_proj.weight",
        "model.layers.0.mlp.down_proj.weight",
        "model.layers.0.input_layernorm.weight",
        "model.layers.0.post_attention_layernorm.weight",
    }
    assert not m.training and not any(p.requires_grad for p in m.parameters())
    with torch.inference_mode():
        m2 = build_model(LlamaConfig.tiny(num_layers=1))
    assert not m2.kv_cache_tensors()[0].is_inference()  # built under inference_mode, still a normal tensor
    m2.reset_cache()  # cache is a normal tensor, writable anywhere


def test_bfloat16_runs_and_tracks_float32():
    cfg = LlamaConfig.tiny()
    m32, m16 = build_model(cfg, seed=0), build_model(cfg, seed=0, dtype=torch.bfloat16)
    toks = _tokens(2, 5, cfg.vocab_size)
    out16 = _decode_all(m16, toks)
    assert out16.dtype == torch.bfloat16 and m16.kv_cache_tensors()[0].dtype == torch.bfloat16
    ref = m32.forward_full(toks)
    assert (out16.float() - ref).abs().max() < 0.1 * ref.abs().max()


def test_input_validation():
    cfg = LlamaConfig.tiny()
    m = build_model(cfg)
    ok = torch.zeros(2, dtype=torch.long)
    with pytest.raises(TypeError, match="input_ids"):
        m.decode_step(ok.float(), ok)
    with pytest.raises(ValueError, match="positions shape"):
        m.decode_step(ok, torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match="max_batch_size"):
        big = torch.zeros(cfg.max_batch_size + 1, dtype=torch.long)
        m.decode_step(big, big)
    with pytest.raises(ValueError, match="slot_ids"):
        m.decode_step(ok, ok, torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match="max_seq_len"):
        m.prefill(torch.zeros(1, cfg.max_seq_len + 1, dtype=torch.long))
    with pytest.raises((ValueError, IndexError)):
        m.decode_step(ok, torch.tensor([0, cfg.max_seq_len]))
    with pytest.raises(TypeError, match="LlamaConfig"):
        build_model({"num_layers": 2})


@pytest.mark.hf
def test_matches_hugging_face_llama_with_same_weights():
    """Optional: with ``transformers`` installed, HF ``LlamaForCausalLM`` loaded with our state
    dict gives the same logits (same layout, rotate_half rotary, GQA grouping, RMSNorm)."""
    transformers = require("transformers")
    cfg = LlamaConfig.tiny()
    ours = build_model(cfg, seed=6)
    hf_cfg = transformers.LlamaConfig(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        max_position_embeddings=cfg.max_seq_len,
        rms_norm_eps=cfg.rms_norm_eps,
        rope_theta=cfg.rope_theta,
        tie_word_embeddings=False,
        attention_bias=False,
    )
    hf_cfg._attn_implementation = "eager"
    hf = transformers.LlamaForCausalLM(hf_cfg).eval()
    missing, unexpected = hf.load_state_dict(ours.state_dict(), strict=False)
    assert not unexpected and all("rotary" in k for k in missing)
    toks = _tokens(2, 9, cfg.vocab_size)
    with torch.no_grad():
        expected = hf(input_ids=toks).logits
    torch.testing.assert_close(ours.forward_full(toks), expected, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(_decode_all(ours, toks), expected, atol=1e-4, rtol=1e-4)
