"""graphrunner.hf.varlen_attention: per-request attention over transformers' varlen batch.

The op (``torch.ops.graphrunner.varlen_sdpa``) is compared with an independent
reference, a dense masked ``scaled_dot_product_attention`` whose mask is built
here from the same rule (same request, key position at most the query's, within
the window), on random ragged layouts: prefill chunks with a past, decode-only
steps, sliding windows, padding query rows and padding keys, grouped-query
heads. Negative controls plant an op that ignores a request boundary or the
window and show the comparison catches it. The mask subclass routes sdpa to the
op and hands every other use the dense mask. End to end, transformers'
continuous batching on graphs (the tape) produces the eager engine's tokens
with the op running at every replayed step, and a planted window bug changes
them.
"""

import pytest
from extras_util import require

transformers = require("transformers")  # graphrunner.hf needs it

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import graphrunner as gr  # noqa: E402
import graphrunner.hf.varlen_attention as va  # noqa: E402
import graphrunner.hf.varlen_eager as ve  # noqa: E402

pytestmark = [pytest.mark.hf, pytest.mark.usefixtures("one_torch_thread")]

TOK_PAD, KEY_PAD = -1, -2


def layout(gen, n_req, window=None, pad_tok=0, pad_key=0, decode=False, heads=4, kv_heads=4, d=8, max_q=6):
    """Random varlen metadata and q/k/v: requests laid out one after another, each with new tokens (1 for
    ``decode``) after a past; a sliding layer reads only the keys within the window of its first new token
    (as transformers' sliding cache does), padding after the real rows and keys."""
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


def reference(q, k, v, tok_req, tok_pos, key_req, key_pos, window, scale=None, enable_gqa=False):
    """Dense masked sdpa in eager PyTorch, its mask built cell by cell in Python from the rule."""
    t, n = tok_req.shape[0], key_req.shape[0]
    mask = torch.full((t, n), float("-inf"))
    for i in range(t):
        for j in range(n):
            r, p, kr, kp = int(tok_req[i]), int(tok_pos[i]), int(key_req[j]), int(key_pos[j])
            if r < 0 or (kr == r and kp <= p and (window is None or kp > p - window)):
                mask[i, j] = 0.0
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=enable_gqa)
    return out.masked_fill((tok_req < 0)[:, None], 0.0)


def cases(seed=0, n=60):
    """``(name, args, window, enable_gqa)``: ragged layouts of every kind."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        window = (None, 3, 5)[i % 3]
        decode = i % 4 == 0
        gqa = i % 5 == 0
        args = layout(
            gen, 1 + i % 6, window, pad_tok=i % 3, pad_key=(i * 7) % 5, decode=decode, kv_heads=2 if gqa else 4
        )
        out.append((f"{i}:w={window},decode={decode},gqa={gqa}", args, window, gqa))
    return out


def worst_gap(op=None):
    """The largest |op - reference| over :func:`cases` (default op: ``torch.ops.graphrunner.varlen_sdpa``)."""
    op = op or torch.ops.graphrunner.varlen_sdpa
    worst = 0.0
    for _, (q, k, v, tr, tp, kr, kp), window, gqa in cases():
        got = op(q, k, v, tr, tp, kr, kp, window, 0.3, gqa)
        want = reference(q, k, v, tr, tp, kr, kp, window, scale=0.3, enable_gqa=gqa)
        assert got.shape == want.shape and got.dtype == want.dtype
        worst = max(worst, float((got - want).abs().max()))
    return worst


SCALE, CAP = 0.25, 50.0
#: transformers' eager attention forms as varlen_eager_attention chains: paged|eager, gemma2's softcapping,
#: gpt_oss's sinks (its own and paged|eager's: centred, sink column dropped after the softmax)
CHAINS = {
    "paged": f"mul={SCALE!r},mask,softmax=float32,to=float32",
    "softcap": f"mul={SCALE!r},div={CAP!r},tanh,mul={CAP!r},mask,softmax=float32,to=float32",
    "sinks": f"mul={SCALE!r},mask,sinks,center,softmax=float32,drop,to=float32",
}


def eager_reference(form, q, k, v, tr, tp, kr, kp, window, sinks):
    """The dense eager attention of ``form`` in eager PyTorch over the cell-by-cell mask (as :func:`reference`
    builds it), padding rows zeroed."""
    t, n = tr.shape[0], kr.shape[0]
    mask = torch.full((t, n), float("-inf"))
    for i in range(t):
        for j in range(n):
            r, p, kr_j, kp_j = int(tr[i]), int(tp[i]), int(kr[j]), int(kp[j])
            if r < 0 or (kr_j == r and kp_j <= p and (window is None or kp_j > p - window)):
                mask[i, j] = 0.0
    w = q @ k.transpose(2, 3) * SCALE
    if form == "softcap":
        w = torch.tanh(w / CAP) * CAP
    w = w + mask
    if form == "sinks":
        w = torch.cat([w, sinks], dim=-1)
        w = w - w.max(dim=-1, keepdim=True).values
    p = torch.softmax(w, dim=-1, dtype=torch.float32)
    if form == "sinks":
        p = p[..., :-1]
    return (p @ v).masked_fill((tr < 0)[:, None], 0.0)


def worst_eager_gap():
    """The largest |varlen_eager_attention - eager_reference| over :func:`cases` and every form."""
    worst = 0.0
    for _, (q, k, v, tr, tp, kr, kp), window, gqa in cases(n=30):
        if gqa:  # eager attention repeats the key/value heads first
            k, v = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)
        sinks = torch.randn(1, q.shape[1], 1, 1).expand(1, -1, q.shape[2], -1)
        for form, chain in CHAINS.items():
            s = sinks if form == "sinks" else None
            got = torch.ops.graphrunner.varlen_eager_attention(
                q, k.transpose(2, 3), v, tr, tp, kr, kp, window, chain, s
            )
            want = eager_reference(form, q, k, v, tr, tp, kr, kp, window, sinks)
            assert got.shape == want.shape and got.dtype == want.dtype
            worst = max(worst, float((got - want).abs().max()))
    return worst


def test_the_op_equals_dense_masked_attention_on_ragged_layouts():
    """Prefill chunks with a past, decode-only steps, sliding windows, padding rows and keys, GQA: the op's
    values equal the dense masked sdpa's to float32 rounding (different split sizes), padding rows zero."""
    assert worst_gap() < 1e-5


def test_the_eager_op_equals_dense_eager_attention_on_ragged_layouts():
    """The same layouts through the eager op, for transformers' three eager forms (paged|eager, gemma2's
    softcapping, gpt_oss's sinks): equal to the dense computation to float32 rounding."""
    assert worst_eager_gap() < 1e-5
    with pytest.raises(ValueError, match="not an attention chain"):
        ve._parse_chain("mask,tanh,softmax=float32")  # an elementwise step after the mask: not per-request exact


def test_the_op_reruns_on_new_metadata_and_keeps_non_contiguous_requests_exact():
    """A request whose keys are not one run (keys of two requests interleaved) is computed against every key
    with its full mask: the same cells. A padding-only step is all zeros."""
    gen = torch.Generator().manual_seed(3)
    q, k, v = torch.randn(1, 2, 4, 8, generator=gen), torch.randn(1, 2, 6, 8, generator=gen), None
    v = torch.randn(1, 2, 6, 8, generator=gen)
    tr, tp = torch.tensor([0, 0, 1, TOK_PAD], dtype=torch.int32), torch.tensor([2, 3, 1, 0], dtype=torch.int32)
    kr = torch.tensor([0, 1, 0, 1, 0, 0], dtype=torch.int32)  # interleaved
    kp = torch.tensor([0, 0, 1, 1, 2, 3], dtype=torch.int32)
    for window in (None, 2):
        got = torch.ops.graphrunner.varlen_sdpa(q, k, v, tr, tp, kr, kp, window, None, False)
        assert torch.allclose(got, reference(q, k, v, tr, tp, kr, kp, window), atol=1e-6)
    pad = torch.full((4,), TOK_PAD, dtype=torch.int32)
    assert torch.equal(torch.ops.graphrunner.varlen_sdpa(q, k, v, pad, tp, kr, kp, None, None, False), q * 0)


def test_negative_control_an_op_that_crosses_a_request_boundary_fails_the_comparison(monkeypatch):
    """Planted: each key run reaches one key into the next request. The comparison above catches it."""
    runs = va.request_runs

    def one_too_far(ids):
        n = int(ids.shape[0])
        return [(r, a, min(b + 1, n)) for r, a, b in runs(ids)]

    monkeypatch.setattr(va, "request_runs", one_too_far)
    assert worst_gap() > 1e-2 and worst_eager_gap() > 1e-2


def test_negative_control_an_op_that_ignores_the_window_fails_the_comparison(monkeypatch):
    """Planted: the window is not applied (a sliding layer attends its request's whole past)."""
    allowed = va._allowed
    monkeypatch.setattr(va, "_allowed", lambda q_pos, k_pos, window: allowed(q_pos, k_pos, None))
    assert worst_gap() > 1e-2 and worst_eager_gap() > 1e-2


def mask_of(tr, tp, kr, kp, window, built=None):
    """A VarlenMask whose dense builder is the reference rule (counted in ``built``)."""

    def dense():
        if built is not None:
            built.append(1)
        ok = (tr[:, None] == kr[None, :]) & (kp[None, :] <= tp[:, None]) | (tr < 0)[:, None]
        if window is not None:
            ok &= (kp[None, :] > tp[:, None] - window) | (tr < 0)[:, None]
        return torch.zeros(ok.shape).masked_fill_(~ok, float("-inf"))[None, None]

    return va.VarlenMask.make(tr, tp, kr, kp, window, torch.float32, dense)


def test_the_mask_routes_sdpa_to_the_op_and_gives_every_other_use_the_dense_mask():
    """sdpa with the mask runs the op (no dense mask built); metadata queries build nothing; ``scores +
    mask``, indexing and ``.to`` get the dense mask, built once; a query whose rows are not the mask's tokens
    (transformers' ``pack_gqa`` of a one-token step) falls back to dense sdpa: the same values."""
    gen = torch.Generator().manual_seed(1)
    q, k, v, tr, tp, kr, kp = layout(gen, 3, window=4, pad_tok=2, pad_key=3)
    built: list = []
    mask = mask_of(tr, tp, kr, kp, 4, built)
    assert mask.shape == (1, 1, tr.shape[0], kr.shape[0]) and mask.dim() == 4 and mask.dtype == torch.float32
    assert mask.size(-1) == kr.shape[0] and mask.device.type == "cpu" and built == []
    got = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.5)
    assert built == [], "sdpa ran the op, not the dense mask"
    real = tr >= 0
    want = reference(q, k, v, tr, tp, kr, kp, 4, scale=0.5)
    assert torch.allclose(got[:, :, real], want[:, :, real], atol=1e-6)
    scores = torch.randn(1, 4, tr.shape[0], kr.shape[0], generator=gen)
    dense = mask.dense()
    assert torch.equal(scores + mask, scores + dense) and torch.equal(mask[:, :, :, :3], dense[..., :3])
    assert torch.equal(mask.to(torch.float64), dense.double()) and type(mask + 0) is torch.Tensor
    assert built == [1], "built once per mask"
    one = mask_of(tr[:1], tp[:1], kr, kp, None)
    packed = torch.randn(1, 2, 2, 8, generator=gen)  # 2 heads of one token as rows
    k2, v2 = k[:, :2], v[:, :2]
    got = F.scaled_dot_product_attention(packed, k2, v2, attn_mask=one)
    assert torch.equal(got, F.scaled_dot_product_attention(packed, k2, v2, attn_mask=one.dense()))


def test_the_op_replays_from_a_graph_reading_each_calls_metadata():
    """A GraphRunner step (sdpa with the mask) captured on the tape over ``tokens`` and ``kv`` dims, with
    its padding check and equivalence: each call, with its own requests and boundaries and padded to the
    key, equals the reference on that call's metadata (the op reads it at every replay)."""
    import graphrunner as gr

    heads, d = 2, 8

    def step(q, k, v, tok_req, tok_pos, key_req, key_pos):
        mask = mask_of(tok_req, tok_pos, key_req, key_pos, 3)
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], attn_mask=mask
        )
        return out[0].transpose(0, 1)

    tok, kv = ("tokens",), ("kv",)
    spec = {
        "q": gr.BatchInput(trailing=(heads, d), dims=tok),
        "k": gr.BatchInput(trailing=(heads, d), dims=kv),
        "v": gr.BatchInput(trailing=(heads, d), dims=kv),
        "tok_req": gr.BatchInput(dtype=torch.int32, dims=tok, pad=TOK_PAD, bounds=(0, 7)),
        "tok_pos": gr.BatchInput(dtype=torch.int32, dims=tok, pad=0, bounds=(0, 63)),
        "key_req": gr.BatchInput(dtype=torch.int32, dims=kv, pad=KEY_PAD, bounds=(0, 7)),
        "key_pos": gr.BatchInput(dtype=torch.int32, dims=kv, pad=0, bounds=(0, 63)),
    }
    runner = gr.GraphRunner(
        step, spec, buckets={"tokens": [32], "kv": [96]}, outputs=("tokens",), device="tape", progress=False
    )
    runner.capture()
    gen = torch.Generator().manual_seed(4)
    for i in range(6):
        q, k, v, tr, tp, kr, kp = layout(gen, 1 + i, window=3, heads=heads, kv_heads=heads, d=d, max_q=4)
        feeds = dict(q=q[0].transpose(0, 1), k=k[0].transpose(0, 1), v=v[0].transpose(0, 1))
        got = runner(**feeds, tok_req=tr, tok_pos=tp, key_req=kr, key_pos=kp)
        want = reference(q, k, v, tr, tp, kr, kp, 3)[0].transpose(0, 1)
        assert torch.allclose(got, want, atol=1e-6), i
    assert sum(runner.stats.replays.values()) == 6, "every call replayed the graph"


class _FakeCache:
    """A paged cache's surface for :class:`ve.VarlenCache`: ``update`` returns the keys and values it holds."""

    def __init__(self, k, v):
        self.k, self.v = k, v
        self.layer_to_allocator = {0: type("Alloc", (), {"layer_type": "full_attention"})()}

    def update(self, key_states, value_states, layer_idx, kwargs=None):
        return self.k, self.v


@pytest.mark.parametrize("form", ["paged|eager", "paged|eager+sinks", "gemma2", "gpt_oss", "unknown"])
def test_transformers_eager_attention_runs_the_eager_op_on_marked_keys(form, monkeypatch):
    """transformers' own eager attention functions, given the keys and values a VarlenCache marks and the
    VarlenMask: the output equals the same function on plain tensors and the dense mask (real rows), the op
    ran and no dense mask was built; an attention with a step the op does not know (a bias added to the
    scores: ``unknown``) computes densely, the same values, no op."""
    from transformers.integrations.eager_paged import eager_paged_attention_forward
    from transformers.models.gemma2.modeling_gemma2 import eager_attention_forward as gemma2_eager
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward as gpt_oss_eager

    gen = torch.Generator().manual_seed(6)
    q, k, v, tr, tp, kr, kp = layout(gen, 4, window=5, pad_tok=2, pad_key=3, kv_heads=2, d=16)
    module = type("Attn", (), {"num_key_value_groups": 2, "training": False, "head_dim": 16})()
    if "sinks" in form or form == "gpt_oss":
        module.sinks = torch.randn(4, generator=gen)
    bias = torch.randn(1, 4, tr.shape[0], kr.shape[0], generator=gen)

    def unknown(module, q, k, v, mask, scaling):
        from transformers.integrations.eager_paged import repeat_kv

        w = torch.matmul(q, repeat_kv(k, 2).transpose(2, 3)) * scaling + bias
        out = torch.matmul(torch.softmax(w + mask, dim=-1), repeat_kv(v, 2))
        return out.transpose(1, 2).contiguous(), None

    fn, extra = {
        "paged|eager": (eager_paged_attention_forward, {}),
        "paged|eager+sinks": (eager_paged_attention_forward, {}),
        "gemma2": (gemma2_eager, {"softcap": 50.0}),
        "gpt_oss": (gpt_oss_eager, {}),
        "unknown": (unknown, {}),
    }[form]
    built: list = []
    mask = mask_of(tr, tp, kr, kp, 5, built)
    calls: list = []
    runs = va.request_runs
    monkeypatch.setattr(va, "request_runs", lambda ids: calls.append(1) or runs(ids))
    mk, mv = ve.VarlenCache(_FakeCache(k, v), {"full_attention": mask}).update(k, v, 0)
    with torch.no_grad():
        got = fn(module, q, mk, mv, mask, scaling=SCALE, **extra)[0]
        if form != "unknown":
            assert calls and built == [], "the op ran, no dense mask"
        else:
            assert not calls and built == [1], "computed densely"
        want = fn(module, q, k, v, mask.dense(), scaling=SCALE, **extra)[0]
    real = tr >= 0
    assert got.shape == want.shape
    assert torch.allclose(got[:, real], want[:, real], atol=1e-5)  # [1, tokens, heads, d]: the real rows


def cb_run(arch, sample=False, monkeypatch=None):
    """(transformers' eager engine's outputs, graphrunner's on the tape, op calls during the graph session):
    12 prompts of 1..39 tokens, 8 new tokens, 64-token steps of up to 8 requests (chunked prefills, decodes,
    padded steps); the tiny ``arch`` with a 12-token sliding window where it has one."""
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    import graphrunner as gr
    import graphrunner.hf  # noqa: F401
    from graphrunner_tools.models.hf_tiny import build_tiny

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
    runs = va.request_runs
    if monkeypatch is not None:
        monkeypatch.setattr(va, "request_runs", lambda ids: calls.append(1) or runs(ids))
    st: dict = {}
    out = gr.hf.generate_batch(model, inputs, gc, cb(), device="tape", stats=st)
    assert list(ref) == list(out)
    return ref, out, st["stats"], len(calls)


def mismatched(ref, out):
    return [k for k in ref if ref[k].generated_tokens != out[k].generated_tokens]


@pytest.mark.parametrize(
    "arch,sample", [("llama", False), ("mistral", False), ("qwen3", True), ("gemma2", False), ("gpt_oss", True)]
)
def test_continuous_batching_on_graphs_runs_the_op_and_equals_eager_tokens(arch, sample, monkeypatch):
    """Greedy and sampled tokens equal transformers' eager engine's; every step replays a graph, each key
    passed the equivalence check, and the op ran (two calls of its run finder per attention layer and step:
    varlen_sdpa on sdpa models, varlen_eager_attention on gemma2 and gpt_oss's eager attention)."""
    ref, out, stats, calls = cb_run(arch, sample, monkeypatch)
    assert mismatched(ref, out) == []
    assert stats.replayed == stats.steps > 10 and stats.eager_steps == 0
    assert stats.equivalence_checked == stats.graphs
    assert calls >= 2 * 2 * stats.steps, "the op ran at every replayed step, in both layers"


def test_negative_control_a_window_bug_in_the_op_is_refused_at_capture(monkeypatch):
    """Planted: the op ignores the sliding window (mistral, 12-token window, prompts up to 39). The
    equivalence check's eager steps build the dense masks, not the op, so it refuses the capture, naming
    the key, before a step is served."""
    allowed = va._allowed
    monkeypatch.setattr(va, "_allowed", lambda q_pos, k_pos, window: allowed(q_pos, k_pos, None))
    with pytest.raises(gr.CaptureError, match=r"differs from the eager steps"):
        cb_run("mistral")


def test_negative_control_with_the_check_off_the_window_bug_changes_the_tokens(monkeypatch):
    """The same planted bug with the equivalence check's reference swapped for the op itself (what the
    check compared with before): nothing refuses it, and the tokens differ from transformers' eager ones."""
    import graphrunner.hf.batching as batching

    allowed = va._allowed
    monkeypatch.setattr(va, "_allowed", lambda q_pos, k_pos, window: allowed(q_pos, k_pos, None))
    make = batching.GraphBatching._make_step
    monkeypatch.setattr(batching.GraphBatching, "_make_step", lambda self, varlen: make(self, True))
    ref, out, _, _ = cb_run("mistral")
    assert mismatched(ref, out), "the planted window bug changed the tokens"


def test_every_public_name_has_a_docstring_stating_its_contract():
    for module in (va, ve):
        for name in module.__all__:
            obj = getattr(module, name)
            assert obj.__doc__ and len(obj.__doc__.strip()) > 60, name
    for name in ("make", "dense", "applies"):
        assert getattr(va.VarlenMask, name).__doc__, name


def test_celless_tensors_are_made_by_their_classmethods_and_never_reach_the_dispatcher():
    """Both deferred tensors share one base: calling the class is a TypeError, and an op that reaches the
    dispatcher with one (their torch-function handling switched off here) raises, naming the op."""
    tr = torch.tensor([0, 0, 1], dtype=torch.int32)
    kr = torch.tensor([0, 0, 1, 1], dtype=torch.int32)
    mask = va.VarlenMask.make(tr, tr, kr, kr, None, torch.float32, lambda: torch.zeros(1, 1, 3, 4))
    assert isinstance(mask, va.CellessTensor) and issubclass(ve._Lazy, va.CellessTensor)
    assert mask.shape == (1, 1, 3, 4) and mask.dtype == torch.float32  # answered without cells
    for cls in (va.VarlenMask, ve._Lazy):
        with pytest.raises(TypeError, match="made by its classmethods"):
            cls()
    with pytest.raises(RuntimeError, match=r"VarlenMask reached the dispatcher \(aten\.add"):
        with torch._C.DisableTorchFunctionSubclass():
            torch.add(mask, 1)
    assert torch.equal(mask + 1, torch.ones(1, 1, 3, 4)), "with its handling on, an op gets the dense mask"
