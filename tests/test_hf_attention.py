"""graphrunner.hf.attention: the step's attention through transformers' attention dispatch, in both forms.

The per-request form (``torch.ops.graphrunner.per_request_attention``, reached
through the function registered in transformers' ``AttentionInterface``) is
compared with an independent reference: transformers' own attention function of
the model (``sdpa``; ``paged|eager`` with gemma2's arguments and gpt_oss's
sinks) over a dense mask built here cell by cell from the rule (same request, key
position at most the query's, within the window), on random ragged layouts:
prefill chunks with a past, decode-only steps, sliding windows, padding rows and
keys, grouped heads. Negative controls plant an op that crosses a request
boundary or ignores the window. The routing is public and scoped (outside a
step the model is transformers' own). End to end, continuous batching on graphs
gives transformers' tokens with either form, the dense one also replayed under
the CUDA stand-in (what a GPU replays), and a planted window bug is refused at
capture.
"""

import pytest
from extras_util import require

transformers = require("transformers")  # graphrunner.hf needs it

import torch  # noqa: E402

import graphrunner as gr  # noqa: E402
import graphrunner.hf.attention as att  # noqa: E402
from graphrunner_tools.models.hf_tiny import build_tiny  # noqa: E402

pytestmark = [pytest.mark.hf, pytest.mark.usefixtures("one_torch_thread")]

TOK_PAD, KEY_PAD = -1, -2

#: arch -> the attention layer's own arguments transformers passes (besides the mask), beside its inner function
ARCH_KWARGS = {
    "llama": {},
    "gemma2": {"softcap": None},
    "gpt_oss": {},
}


def layout(gen, n_req, window=None, pad_tok=0, pad_key=0, decode=False, heads=4, kv_heads=2, d=16, max_q=6):
    """Random varlen metadata and q/k/v (``[1, heads, n, d]``): requests one after another, each with new
    tokens (1 for ``decode``) after a past; a sliding layer reads only the keys within the window of its
    first new token (as transformers' sliding cache does), padding after the real rows and keys."""
    tok_req, tok_pos, key_req, key_pos = [], [], [], []
    for r in range(n_req):
        q = 1 if decode else int(torch.randint(1, max_q + 1, (1,), generator=gen))
        past = int(torch.randint(0, 12, (1,), generator=gen))
        first = 0 if window is None else max(0, past - window + 1)
        tok_req += [r] * q
        tok_pos += list(range(past, past + q))
        key_req += [r] * (past + q - first)
        key_pos += list(range(first, past + q))
    tok_req += [TOK_PAD] * pad_tok
    tok_pos += [0] * pad_tok
    key_req += [KEY_PAD] * pad_key
    key_pos += [0] * pad_key
    t, k = len(tok_req), len(key_req)
    q = torch.randn(1, heads, t, d, generator=gen)
    key = torch.randn(1, kv_heads, k, d, generator=gen)
    value = torch.randn(1, kv_heads, k, d, generator=gen)
    meta = tuple(torch.tensor(v, dtype=torch.int32) for v in (tok_req, tok_pos, key_req, key_pos))
    return (q, key, value, *meta)


def dense_mask(tok_req, tok_pos, key_req, key_pos, window):
    """The dense ``[1, 1, tokens, kv]`` mask, cell by cell in Python from the rule; a padding row sees every key."""
    t, n = tok_req.shape[0], key_req.shape[0]
    mask = torch.full((t, n), float("-inf"))
    for i in range(t):
        for j in range(n):
            r, p, kr, kp = int(tok_req[i]), int(tok_pos[i]), int(key_req[j]), int(key_pos[j])
            if r < 0 or (kr == r and kp <= p and (window is None or kp > p - window)):
                mask[i, j] = 0.0
    return mask[None, None]


def attention_layer(arch):
    """A tiny ``arch`` model and its first attention layer, with 4 query heads over 2 key/value heads."""
    model = build_tiny(arch, seed=0, max_position_embeddings=512)
    layer = next(m for m in model.modules() if hasattr(m, "num_key_value_groups"))
    return model, layer


def inner_function(model):
    """transformers' attention function the model's continuous batching runs (``eager`` runs as paged|eager)."""
    from transformers import AttentionInterface

    impl = model.config._attn_implementation
    return AttentionInterface()["paged|eager" if impl == "eager" else impl]


def worst_gap(arch, seed=0, n=40):
    """The largest |per-request form - transformers' function over the reference mask| over ragged layouts
    (padding rows, which nothing reads, against zeros); the dense form through the routing must be transformers'
    function itself."""
    model, layer = attention_layer(arch)
    heads, kv_heads = layer.config.num_attention_heads, layer.config.num_key_value_heads
    d = layer.head_dim
    inner = inner_function(model)
    gen = torch.Generator().manual_seed(seed)
    worst = 0.0
    with att.routed(model), torch.no_grad():
        for i in range(n):
            window = (None, 3, 5)[i % 3]
            args = layout(
                gen, 1 + i % 6, window, i % 3, (i * 7) % 5, decode=i % 4 == 0, heads=heads, kv_heads=kv_heads, d=d
            )
            q, k, v, tr, tp, kr, kp = args
            kw = dict(scaling=0.3, dropout=0.0, **ARCH_KWARGS[arch])
            want, _ = inner(layer, q, k, v, dense_mask(tr, tp, kr, kp, window), **kw)
            got, _ = att.step_attention(layer, q, k, v, att.per_request_mask(tr, tp, kr, kp, window), **kw)
            dense, _ = att.step_attention(layer, q, k, v, dense_mask(tr, tp, kr, kp, window), **kw)
            real = tr >= 0
            assert got.shape == want.shape == (1, tr.shape[0], heads, d) and got.dtype == want.dtype
            assert torch.equal(dense, want), "the dense form is transformers' function itself"
            pad_rows = float(got[:, ~real].abs().max()) if (~real).any() else 0.0  # padding rows are zeros
            worst = max(worst, float((got[:, real] - want[:, real]).abs().max()), pad_rows)
    return worst


@pytest.mark.parametrize("arch", sorted(ARCH_KWARGS))
def test_the_per_request_form_equals_transformers_attention_over_the_dense_mask(arch):
    """llama (sdpa), gemma2 and gpt_oss (paged|eager, gpt_oss with its sinks): float32 rounding apart."""
    assert worst_gap(arch) < 1e-5


def test_negative_control_an_op_that_crosses_a_request_boundary_fails_the_comparison(monkeypatch):
    """Planted: each key run reaches one key into the next request. The comparison above catches it."""
    runs = att.request_runs

    def one_too_far(ids):
        n = int(ids.shape[0])
        return [(r, a, min(b + 1, n)) for r, a, b in runs(ids)]

    monkeypatch.setattr(att, "request_runs", one_too_far)
    assert worst_gap("llama") > 1e-2 and worst_gap("gpt_oss") > 1e-2


def test_negative_control_an_op_that_ignores_the_window_fails_the_comparison(monkeypatch):
    """Planted: the window is not applied (a sliding layer attends its request's whole past)."""
    allowed = att._allowed
    monkeypatch.setattr(att, "_allowed", lambda q_pos, k_pos, window: allowed(q_pos, k_pos, None))
    assert worst_gap("llama") > 1e-2 and worst_gap("gemma2") > 1e-2


def test_non_contiguous_requests_are_exact_and_a_padding_only_step_is_zeros():
    """A request whose keys are not one run (two requests interleaved) is computed against every key with its
    full mask: the same cells."""
    model, layer = attention_layer("llama")
    inner = inner_function(model)
    gen = torch.Generator().manual_seed(3)
    heads, kv_heads, d = 4, 2, layer.head_dim
    q, k, v = (torch.randn(1, h, n, d, generator=gen) for h, n in ((heads, 4), (kv_heads, 6), (kv_heads, 6)))
    tr, tp = torch.tensor([0, 0, 1, TOK_PAD], dtype=torch.int32), torch.tensor([2, 3, 1, 0], dtype=torch.int32)
    kr = torch.tensor([0, 1, 0, 1, 0, 0], dtype=torch.int32)  # interleaved
    kp = torch.tensor([0, 0, 1, 1, 2, 3], dtype=torch.int32)
    with att.routed(model):
        for window in (None, 2):
            got, _ = att.step_attention(layer, q, k, v, att.per_request_mask(tr, tp, kr, kp, window), scaling=0.3)
            want, _ = inner(layer, q, k, v, dense_mask(tr, tp, kr, kp, window), scaling=0.3)
            assert torch.allclose(got[:, :3], want[:, :3], atol=1e-6)
        pad = torch.full((4,), TOK_PAD, dtype=torch.int32)
        got, _ = att.step_attention(layer, q, k, v, att.per_request_mask(pad, tp, kr, kp, None), scaling=0.3)
        assert torch.equal(got, torch.zeros_like(got))


def test_the_routing_is_public_scoped_and_nests():
    """Inside ``routed`` the model names graphrunner's function (registered in transformers' AttentionInterface),
    a call without the step's mask is transformers' own computation, and nested blocks keep it; after the
    last block the model's own implementation is back (transformers' continuous batching accepts only its own
    names). Outside a block, graphrunner's function refuses to guess the inner one."""
    from transformers import AttentionInterface

    model, layer = attention_layer("llama")
    ids = torch.randint(0, 100, (1, 9))
    ref = model(ids).logits
    with att.routed(model):
        assert model.config._attn_implementation == att.NAME and att.NAME in AttentionInterface()
        with att.routed(model):
            assert torch.equal(model(ids).logits, ref)
        assert model.config._attn_implementation == att.NAME
    assert model.config._attn_implementation == "sdpa"
    q = torch.randn(1, 4, 2, layer.head_dim)
    with pytest.raises(RuntimeError, match="outside graphrunner.hf.attention.routed"):
        att.step_attention(layer, q, q[:, :2], q[:, :2], None, scaling=1.0)


def test_the_per_request_form_replays_from_a_graph_reading_each_calls_metadata():
    """A GraphRunner step (the registered function on the per-request mask) captured on the tape over ``tokens``
    and ``kv`` dims: each call, with its own requests and boundaries and padded to the key, equals
    transformers' function over the reference mask on that call's metadata (the op reads it at every replay)."""
    model, layer = attention_layer("llama")
    inner = inner_function(model)
    heads, kv_heads, d = 4, 2, layer.head_dim

    def step(q, k, v, tok_req, tok_pos, key_req, key_pos):
        mask = att.per_request_mask(tok_req, tok_pos, key_req, key_pos, 3)
        out, _ = att.step_attention(
            layer, q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], mask, scaling=0.3
        )
        return out[0]

    tok, kv = ("tokens",), ("kv",)
    spec = {
        "q": gr.BatchInput(trailing=(heads, d), dims=tok),
        "k": gr.BatchInput(trailing=(kv_heads, d), dims=kv),
        "v": gr.BatchInput(trailing=(kv_heads, d), dims=kv),
        "tok_req": gr.BatchInput(dtype=torch.int32, dims=tok, pad=TOK_PAD, bounds=(0, 7)),
        "tok_pos": gr.BatchInput(dtype=torch.int32, dims=tok, pad=0, bounds=(0, 63)),
        "key_req": gr.BatchInput(dtype=torch.int32, dims=kv, pad=KEY_PAD, bounds=(0, 7)),
        "key_pos": gr.BatchInput(dtype=torch.int32, dims=kv, pad=0, bounds=(0, 63)),
    }
    gen = torch.Generator().manual_seed(4)
    with att.routed(model):
        runner = gr.GraphRunner(
            step, spec, buckets={"tokens": [32], "kv": [96]}, outputs=("tokens",), device="tape", progress=False
        )
        runner.capture()
        for i in range(6):
            q, k, v, tr, tp, kr, kp = layout(gen, 1 + i, window=3, heads=heads, kv_heads=kv_heads, d=d, max_q=4)
            feeds = dict(q=q[0].transpose(0, 1), k=k[0].transpose(0, 1), v=v[0].transpose(0, 1))
            got = runner(**feeds, tok_req=tr, tok_pos=tp, key_req=kr, key_pos=kp)
            want, _ = inner(layer, q, k, v, dense_mask(tr, tp, kr, kp, 3), scaling=0.3)
            real = tr >= 0
            assert torch.allclose(got[real], want[0][real], atol=1e-5), i
    assert sum(runner.stats.replays.values()) == 6, "every call replayed the graph"


# --------------------------------------------------------------------------- end to end


def cb_run(arch, sample=False, monkeypatch=None, **options):
    """transformers' eager engine and gr.hf.generate_batch on the tape (``options``) over one workload:
    12 prompts of 1..39 tokens, 8 new tokens, 64-token steps of up to 8 requests (chunked prefills, decodes,
    padded steps); the tiny ``arch`` with a 12-token sliding window where it has one. Returns the two
    results, gr.hf's stats and how often the per-request op's run finder ran."""
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    window = {"sliding_window": 12} if arch in ("mistral", "gemma2", "gpt_oss") else {}
    model = build_tiny(arch, seed=0, max_position_embeddings=512, **window)
    g = torch.Generator().manual_seed(1)
    inputs = [torch.randint(3, 128, (int(k),), generator=g).tolist() for k in torch.randint(1, 40, (12,), generator=g)]
    extra = {"do_sample": True, "temperature": 0.9, "top_k": 20} if sample else {"do_sample": False}
    gc = GenerationConfig(max_new_tokens=8, eos_token_id=-1, pad_token_id=0, **extra)

    def cb():
        return ContinuousBatchingConfig(
            page_size=16, num_blocks=64, max_batch_tokens=64, max_requests_per_batch=8, seed=5
        )

    ref = model.generate_batch(inputs=inputs, generation_config=gc, continuous_batching_config=cb())
    calls = []
    if monkeypatch is not None:
        runs = att.request_runs
        monkeypatch.setattr(att, "request_runs", lambda ids: calls.append(1) or runs(ids))
    st: dict = {}
    out = gr.hf.generate_batch(model, inputs, gc, cb(), stats=st, **{"device": "tape", **options})
    assert list(ref) == list(out)
    assert model.config._attn_implementation == ref_impl(arch), "the model is transformers' own again"
    return ref, out, st["stats"], len(calls)


def ref_impl(arch):
    return "eager" if arch in ("gemma2", "gpt_oss") else "sdpa"


def mismatched(ref, out):
    return [k for k in ref if ref[k].generated_tokens != out[k].generated_tokens]


@pytest.mark.parametrize(
    "arch,sample,attention",
    [
        *((a, s, "dense") for a, s in (("llama", False), ("mistral", False), ("qwen3", True), ("gemma2", False))),
        ("gpt_oss", True, "dense"),
        # the per-request form (auto on the tape) also runs every test of test_hf_batching.py's 7 architectures
        ("mistral", False, "per_request"),
        ("gpt_oss", True, "per_request"),
    ],
)
def test_continuous_batching_on_graphs_equals_eager_tokens_in_both_forms(arch, sample, attention, monkeypatch):
    """Greedy and sampled tokens equal transformers' eager engine's with either attention form; every step
    replays a graph and each key passed the equivalence check; the per-request op ran at every replayed step
    in both layers (its run finder twice a call) with ``per_request``, and never with ``dense``."""
    import graphrunner.hf.attention  # noqa: F401

    ref, out, stats, calls = cb_run(arch, sample, monkeypatch, attention=attention)
    assert mismatched(ref, out) == []
    assert stats.replayed == stats.steps > 10 and stats.eager_steps == 0
    assert stats.equivalence_checked == stats.graphs
    if attention == "per_request":
        assert calls >= 2 * 2 * stats.steps, "the op ran at every replayed step, in both layers"
    else:
        assert calls == 0, "the dense masks: no per-request op"


@pytest.mark.parametrize("arch", ["mistral", "gemma2"])
def test_the_dense_form_replays_under_the_cuda_standin_and_equals_eager_tokens(arch, cuda_standin):
    """What a GPU replays: ``device='cuda'`` (CUDA graphs through the stand-in, which enforces their capture
    rules), ``attention='auto'`` resolving to the dense masks there; tokens equal transformers' engine and
    every step replays."""
    ref, out, stats, calls = cb_run(arch, device="cuda")
    assert mismatched(ref, out) == []
    assert stats.replayed == stats.steps > 10 and stats.equivalence_checked == stats.graphs


def test_negative_control_a_window_bug_in_the_op_is_refused_at_capture(monkeypatch):
    """Planted: the op ignores the sliding window (mistral, 12-token window, prompts up to 39). The
    equivalence check's eager steps take the dense form, not the op, so it refuses the capture, naming
    the key, before a step is served."""
    allowed = att._allowed
    monkeypatch.setattr(att, "_allowed", lambda q_pos, k_pos, window: allowed(q_pos, k_pos, None))
    with pytest.raises(gr.CaptureError, match=r"differs from the eager steps"):
        cb_run("mistral")


def test_negative_control_with_the_check_off_the_window_bug_changes_the_tokens(monkeypatch):
    """The same planted bug with the equivalence check's reference swapped for the per-request form itself:
    nothing refuses it, and the tokens differ from transformers' eager ones."""
    import graphrunner.hf.batching as batching

    allowed = att._allowed
    monkeypatch.setattr(att, "_allowed", lambda q_pos, k_pos, window: allowed(q_pos, k_pos, None))
    make = batching.GraphBatching._make_step
    monkeypatch.setattr(batching.GraphBatching, "_make_step", lambda self, per_request: make(self, True))
    ref, out, _, _ = cb_run("mistral")
    assert mismatched(ref, out), "the planted window bug changed the tokens"


def test_an_unknown_attention_form_is_a_clear_error():
    with pytest.raises(ValueError, match=r"attention must be one of \['auto', 'per_request', 'dense'\]"):
        gr.hf.BatchingOptions(attention="flash")


def test_every_public_name_has_a_docstring_stating_its_contract():
    for name in att.__all__:
        obj = getattr(att, name)
        if not isinstance(obj, str):
            assert obj.__doc__ and len(obj.__doc__.strip()) > 60, name
