"""Named dims: keys with several dims, the key choice, padding and slicing per
dim. Every replay is compared bit for bit with eager PyTorch on the inputs
padded to the replayed key, for every size combination up to the largest
buckets, on both graph backends (tape)."""

from __future__ import annotations

import itertools
import math
import random

import pytest
import torch

import graphrunner as gr
from graphrunner.breakable import no_graph
from graphrunner.keys import KeySpace

H, V, VOCAB = 6, 5, 30
_g = torch.Generator().manual_seed(7)
EMB = torch.randn(VOCAB, H, generator=_g)
GATE = torch.randn(H, generator=_g)
W = torch.randn(V, H, generator=_g) / 3


@no_graph
def host_norm(h):  # an eager break: runs outside the graph at every replay
    return h / (1.0 + h.abs().amax(-1, keepdim=True))


def verify_step(ids, x, ctx):
    """A verify-like step: ids/x are [reqs, draft(, H)], ctx is [reqs, H].
    Elementwise ops and reductions only (no BLAS blocking that depends on the shape)."""
    h = EMB[ids] + x * GATE + ctx[:, None, :]
    h = host_norm(torch.tanh(h))
    logits = (h[:, :, None, :] * W).sum(-1)  # [reqs, draft, V]
    pooled = h.sum(1) * 0.5 + ctx  # [reqs, H]: reads the padded draft cells too
    return {"logits": logits, "pooled": pooled, "count": ids.sum() * 0}


VERIFY_INPUTS = {
    "ids": gr.BatchInput(dtype=torch.long, pad=0, dims=("reqs", "draft")),
    "x": gr.BatchInput(trailing=(H,), pad=0.0, dims=("reqs", "draft")),
    "ctx": gr.BatchInput(trailing=(H,), pad=0.0, dims=("reqs",)),
}
VERIFY_OUTPUTS = {"logits": ("reqs", "draft"), "pooled": ("reqs",), "count": ()}
VERIFY_BUCKETS = {"reqs": [1, 2, 4], "draft": [1, 3]}


def verify_inputs(r, d, seed):
    g = torch.Generator().manual_seed(seed)
    return {
        "ids": torch.randint(1, VOCAB, (r, d), generator=g),
        "x": torch.randn(r, d, H, generator=g),
        "ctx": torch.randn(r, H, generator=g),
    }


def pad_to(t, shape, value):
    out = torch.full((*shape, *t.shape[len(shape) :]), value, dtype=t.dtype)
    out[tuple(slice(0, n) for n in t.shape[: len(shape)])] = t
    return out


def verify_reference(inp, key):
    """Eager on the inputs padded to ``key`` = (reqs, draft), sliced back."""
    R, Dr = key
    r, d = inp["ids"].shape
    out = verify_step(pad_to(inp["ids"], (R, Dr), 0), pad_to(inp["x"], (R, Dr), 0.0), pad_to(inp["ctx"], (R,), 0.0))
    return {"logits": out["logits"][:r, :d], "pooled": out["pooled"][:r], "count": out["count"]}


def assert_bit_exact(out, ref, where):
    assert out.keys() == ref.keys(), where
    for k in ref:
        assert out[k].shape == ref[k].shape, (where, k, out[k].shape, ref[k].shape)
        assert torch.equal(out[k], ref[k]), (where, k, (out[k] - ref[k]).abs().max())


def verify_runner(backend, **kw):
    kw.setdefault("buckets", VERIFY_BUCKETS)
    kw.setdefault("outputs", VERIFY_OUTPUTS)
    kw.setdefault(
        "checks", ["drift", gr.PaddingCheck(exempt=("pooled",)), "fingerprint"]
    )  # pooled reads the padded draft cells on purpose
    return gr.GraphRunner(verify_step, VERIFY_INPUTS, backend=backend, device="tape", warmups=1, progress=False, **kw)


# ------------------------------------------------------------------ KeySpace
def test_keyspace_choice_full_grid_and_explicit_keys():
    s = KeySpace({"reqs": [1, 2, 4, 8], "draft": [1, 2, 4]})
    assert s.dims == ("reqs", "draft") and len(s.keys) == 12 and s.maxes == (8, 4)
    assert s.choose((3, 1)) == ((4, 1), None)
    assert s.choose((8, 3)) == ((8, 4), None)
    assert s.choose((9, 1)) == (None, "over_max_bucket") and s.choose((1, 5)) == (None, "over_max_bucket")
    assert s.capture_order()[0] == (8, 4)
    k = KeySpace({"reqs": [1, 2, 4, 8], "draft": [1, 2, 4]}, keys=[(8, 4), (2, 4), (4, 1)])
    assert k.choose((2, 2)) == ((2, 4), None)  # (2, 2) not captured: smallest covering key
    assert k.choose((3, 1)) == ((4, 1), None)
    assert k.choose((3, 2)) == ((8, 4), None)
    # per-dim padding ratio: (3, 1) -> (4, 1) pads reqs by 1/4 <= 0.3; (1, 1) -> (2, 4) pads draft by 3/4
    r = KeySpace({"reqs": [1, 2, 4, 8], "draft": [1, 2, 4]}, keys=[(8, 4), (2, 4), (4, 1)], max_padding_ratio=0.3)
    assert r.choose((3, 1)) == ((4, 1), None) and r.choose((1, 1)) == (None, "padding_ratio")
    # bucket lists: int keys, one dim named "batch"
    batch = KeySpace([1, 2, 4])
    assert batch.one_batch_dim and batch.dims == ("batch",) and batch.external((4,)) == 4


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(buckets={"reqs": [1, 2], "draft": [2, 1]}), r"buckets\['draft'\].*sorted"),
        (dict(buckets={}), "empty dict"),
        (dict(buckets={"reqs": [1, 2]}, keys=[(2, 1)]), "one int per dim"),
        (dict(buckets={"reqs": [1, 2], "d": [1, 2]}, keys=[(2, 3)]), "3 is not a bucket of dim 'd'"),
        (dict(buckets={"reqs": [1, 2], "d": [1, 2]}, keys=[(2, 1), (1, 2)]), r"must include the key \(2, 2\)"),
        (dict(buckets={"reqs": [1, 2], "d": [1, 2]}, keys=[(2, 2), (2, 2)]), "listed twice"),
    ],
)
def test_keyspace_errors(kw, match):
    with pytest.raises((ValueError, TypeError), match=match):
        KeySpace(**kw)


def test_configuration_errors_name_the_input_and_dim():
    with pytest.raises(ValueError, match=r"inputs\['ids'\] must declare its leading dims"):
        gr.GraphRunner(verify_step, {"ids": gr.BatchInput(dtype=torch.long)}, VERIFY_BUCKETS, device="tape")
    with pytest.raises(ValueError, match=r"names \['drafts'\], which buckets does not list"):
        gr.GraphRunner(
            verify_step,
            {"ids": gr.BatchInput(dtype=torch.long, dims=("reqs", "drafts"))},
            VERIFY_BUCKETS,
            device="tape",
        )
    with pytest.raises(ValueError, match=r"dim\(s\) \['draft'\] that no input declares"):
        gr.GraphRunner(
            verify_step, {"ids": gr.BatchInput(dtype=torch.long, dims=("reqs",))}, VERIFY_BUCKETS, device="tape"
        )
    with pytest.raises(ValueError, match=r"outputs\['logits'\].*\['tok'\]"):
        verify_runner("full", outputs={"logits": ("tok",)})
    with pytest.raises(TypeError, match="got the string 'reqs'"):
        gr.BatchInput(dims="reqs")
    with pytest.raises(ValueError, match="names a dim twice"):
        gr.BatchInput(dims=("reqs", "reqs"))


def test_wrong_output_dims_fail_at_capture_naming_the_output():
    r = verify_runner("full", outputs={"pooled": ("reqs",), "count": ()})  # logits defaults to ("reqs", "draft")
    r.capture()
    # draft undeclared (the leak check would report logits' padded draft cells first: off to reach the dims error)
    bad = verify_runner(
        "full", outputs={"logits": ("reqs",), "pooled": ("reqs",), "count": ()}, checks=("drift", "fingerprint")
    )
    with pytest.raises(TypeError, match="only the dims declared in outputs= may change"):
        bad.capture()
    worse = verify_runner("full", outputs={"pooled": ("reqs", "draft"), "count": ()})
    with pytest.raises(TypeError, match=r"leading dims \('reqs', 'draft'\)"):
        worse.capture()


# ------------------------------------------------------- 2 dims, bit-exact
@pytest.mark.parametrize("backend", ["full", "breakable"])
def test_two_dims_bit_exact_for_every_size_combination(backend):
    r = verify_runner(backend)
    report = r.capture()
    assert [b.bucket for b in report.buckets] == [(4, 3), (2, 3), (4, 1), (1, 3), (2, 1), (1, 1)]
    assert "4x3" in report.table()
    combos = list(itertools.product(range(1, 5), range(1, 4)))
    order = combos + combos[::-1] + random.Random(0).sample(combos, len(combos))  # stale cells in every pattern
    for i, (rq, dr) in enumerate(order):
        inp = verify_inputs(rq, dr, seed=i)
        key = r.key_for((rq, dr))
        out = r(**inp)
        assert r.stats.last_bucket == key == (next(b for b in (1, 2, 4) if b >= rq), next(b for b in (1, 3) if b >= dr))
        assert_bit_exact(out, verify_reference(inp, key), (rq, dr))
    assert r.stats.fallbacks == 0 and sum(r.stats.replays.values()) == len(order)
    if backend == "breakable":
        assert {(b.num_segments, b.num_breaks) for b in report.buckets} == {(2, 1)}


def test_negative_control_without_the_refill_stale_cells_leak():
    """With the refill of stale cells turned off, a smaller call after a larger
    one reads the larger call's draft cells as padding (pooled sums them)."""
    r = verify_runner("full")
    r.capture()
    r.server.inputs.pad_to = lambda sizes, key: None
    r(**verify_inputs(4, 3, seed=1))
    inp = verify_inputs(3, 2, seed=2)  # key (4, 3): cells [3:4, :] and [:3, 2:3] are padding
    out = r(**inp)
    assert not torch.equal(out["pooled"], verify_reference(inp, (4, 3))["pooled"])


def test_explicit_keys_smallest_covering_key_and_fallback():
    r = verify_runner("breakable", buckets={"reqs": [1, 2, 4], "draft": [1, 3]}, keys=[(4, 3), (2, 1)])
    report = r.capture()
    assert [b.bucket for b in report.buckets] == [(4, 3), (2, 1)]
    for rq, dr in itertools.product(range(1, 5), range(1, 4)):
        inp = verify_inputs(rq, dr, seed=rq * 10 + dr)
        want = (2, 1) if rq <= 2 and dr == 1 else (4, 3)
        assert_bit_exact(r(**inp), verify_reference(inp, want), (rq, dr))
        assert r.stats.last_bucket == want
    # over the largest key in one dim: eager fallback on the real sizes
    inp = verify_inputs(5, 2, seed=3)
    assert_bit_exact(r(**inp), verify_reference(inp, (5, 2)), "fallback")
    assert r.stats.fallback_reasons == {"over_max_bucket": 1}
    r2 = verify_runner("full", keys=[(4, 3), (2, 1)], fallback="error")
    r2.capture()
    with pytest.raises(ValueError, match=r"no captured key covers sizes \(reqs=4, draft=4\)"):
        r2(**verify_inputs(4, 4, seed=0))


def test_padding_ratio_applies_per_dim():
    r = verify_runner("full", max_padding_ratio=0.5)
    r.capture()
    inp = verify_inputs(3, 1, seed=0)  # reqs 3 -> 4 pads 1/4: replays
    assert_bit_exact(r(**inp), verify_reference(inp, (4, 1)), "ok")
    inp = verify_inputs(4, 1, seed=1)
    r(**inp)
    inp = verify_inputs(1, 1, seed=2)
    assert r(**inp) is not None and r.stats.last_bucket == (1, 1)
    inp = verify_inputs(2, 1, seed=3)  # draft 1 -> 1, reqs 2 -> 2: fine
    r(**inp)
    inp = verify_inputs(4, 2, seed=4)  # draft 2 -> 3 pads 1/3 <= 0.5
    assert_bit_exact(r(**inp), verify_reference(inp, (4, 3)), "draft")
    r3 = verify_runner("full", max_padding_ratio=0.2)
    r3.capture()
    inp = verify_inputs(4, 2, seed=5)  # draft pads 1/3 > 0.2: falls back
    assert_bit_exact(r3(**inp), verify_reference(inp, (4, 2)), "fallback")
    assert r3.stats.fallback_reasons == {"padding_ratio": 1}


def test_invalid_multi_dim_inputs_name_the_dim():
    r = verify_runner("full")
    r.capture()
    inp = verify_inputs(2, 2, seed=0)
    inp["x"] = torch.randn(2, 3, H)
    with pytest.raises(ValueError, match=r"input 'x' has draft=3 \(dim 1\) but input 'ids' has draft=2"):
        r(**inp)
    inp = verify_inputs(2, 2, seed=0)
    inp["ctx"] = torch.randn(3, H)
    with pytest.raises(ValueError, match="has reqs=3"):
        r(**inp)
    inp = verify_inputs(2, 2, seed=0)
    assert_bit_exact(r(**inp), verify_reference(inp, (2, 3)), "still usable")


def test_a_zero_size_dim_runs_the_smallest_key_when_an_output_is_not_empty():
    # draft=0 (SGLang picks its smallest bucket): logits [reqs, draft] are empty, but pooled [reqs]
    # and the 0-dim count are not, so the step runs at the smallest key covering draft=1, every
    # draft cell padding; the result equals eager on the inputs padded to that key.
    r = verify_runner("full")
    r.capture()
    for reqs in (2, 3):
        inp = verify_inputs(reqs, 2, seed=reqs)
        inp["ids"], inp["x"] = inp["ids"][:, :0], inp["x"][:, :0]
        before = dict(r.stats.replays)
        out = r(**inp)
        key = (2 if reqs == 2 else 4, 1)
        assert out["logits"].shape == (reqs, 0, V) and out["pooled"].shape == (reqs, H)
        assert_bit_exact(out, verify_reference(inp, key), f"reqs={reqs}, draft=0")
        assert r.stats.replays[key] == before[key] + 1 and r.stats.last_bucket == key
        # Negative control: the pooled rows differ from eager padded to a draft of 3 (the padding is seen)
        assert not torch.equal(out["pooled"], verify_reference(inp, (key[0], 3))["pooled"])
    inp = verify_inputs(2, 2, seed=0)
    assert_bit_exact(r(**inp), verify_reference(inp, (2, 3)), "a full call after draft=0 calls")


# ------------------------------------------------------- 3 dims, bit-exact
def cube_step(a, b):
    """a: [p, q, s, H]; b: [p, s]."""
    h = torch.tanh(a * GATE + b[:, None, :, None])
    h = host_norm(h)
    return {"y": h.sum(-1) + b[:, None, :], "z": h.sum(1)}


CUBE_INPUTS = {
    "a": gr.BatchInput(trailing=(H,), pad=0.0, dims=("p", "q", "s")),
    "b": gr.BatchInput(pad=0.0, dims=("p", "s")),
}
CUBE_BUCKETS = {"p": [1, 2], "q": [1, 3], "s": [2, 4]}


@pytest.mark.parametrize("backend", ["full", "breakable"])
def test_three_dims_bit_exact_for_every_size_combination(backend):
    r = gr.GraphRunner(
        cube_step,
        CUBE_INPUTS,
        CUBE_BUCKETS,
        backend=backend,
        device="tape",
        warmups=1,
        outputs={"z": ("p", "s")},
        progress=False,  # "y" takes the default: a's dims
        checks=["drift", gr.PaddingCheck(exempt=("z",)), "fingerprint"],
    )  # z sums over the padded q cells on purpose
    assert len(r.capture().buckets) == 8
    combos = list(itertools.product(range(1, 3), range(1, 4), range(1, 5)))
    order = combos[::-1] + random.Random(1).sample(combos, len(combos))
    for i, (p, q, s) in enumerate(order):
        g = torch.Generator().manual_seed(i)
        a, b = torch.randn(p, q, s, H, generator=g), torch.randn(p, s, generator=g)
        key = r.key_for({"p": p, "q": q, "s": s})
        out = r(a=a, b=b)
        assert r.stats.last_bucket == key
        ref = cube_step(pad_to(a, key, 0.0), pad_to(b, (key[0], key[2]), 0.0))
        assert out["y"].shape == (p, q, s) and torch.equal(out["y"], ref["y"][:p, :q, :s]), (p, q, s)
        assert out["z"].shape == (p, s, H) and torch.equal(out["z"], ref["z"][:p, :s]), (p, q, s)
    assert r.stats.real_rows == sum(math.prod(c) for c in order)


# ------------------------------------------------ key_for is what a call replays (issue 33 item 5)
def _key_for_runners():
    """Captured runners of each kind: int keys, named dims (grid), named dims with ``keys=``, and a
    step whose 0-dim output makes an all-idle call run the step."""
    import graphrunner as gr

    x1 = {"x": gr.BatchInput(trailing=(3,))}
    x2 = {"x": gr.BatchInput(trailing=(3,), dims=("r", "d"))}
    yield "int keys", gr.GraphRunner(lambda x: x * 2.0, x1, [1, 2, 4, 8], device="tape", progress=False), 1
    yield (
        "named dims",
        gr.GraphRunner(lambda x: x * 2.0, x2, {"r": [1, 2, 4], "d": [1, 8, 16]}, device="tape", progress=False),
        2,
    )
    yield (
        "keys=",
        gr.GraphRunner(
            lambda x: x * 2.0,
            x2,
            {"r": [1, 2, 4], "d": [1, 8, 16]},
            keys=[(1, 16), (2, 8), (4, 16)],
            device="tape",
            progress=False,
        ),
        2,
    )
    yield (
        "output on one dim",
        gr.GraphRunner(
            lambda x: x[:, 0] * 2.0,
            x2,
            {"r": [1, 2, 4], "d": [1, 8, 16]},
            outputs=("r",),
            device="tape",
            progress=False,
        ),
        2,
    )
    yield (
        "0-dim output",
        gr.GraphRunner(lambda x: (x * 2.0, x.sum() * 0.0), x1, [1, 2, 4], device="tape", progress=False),
        1,
    )


@pytest.mark.parametrize("kind", ["int keys", "named dims", "keys=", "output on one dim", "0-dim output"])
def test_key_for_is_the_key_a_call_replays_for_random_sizes_zeros_included(kind):
    runner, ndims = next((r, n) for k, r, n in _key_for_runners() if k == kind)
    runner.capture()
    g = torch.Generator().manual_seed(11)
    maxes = [max(v) for v in runner.buckets.values()] if isinstance(runner.buckets, dict) else [runner.max_batch]
    cases = [tuple(0 for _ in range(ndims))] + [
        tuple(int(torch.randint(0, m + 2, (1,), generator=g)) for m in maxes) for _ in range(40)
    ]
    for sizes in cases:
        batch = sizes[0] if ndims == 1 else sizes
        replays = sum(runner.stats.replays.values())
        runner(x=torch.randn(*sizes, 3))
        replayed = runner.stats.last_bucket if sum(runner.stats.replays.values()) > replays else None
        assert runner.key_for(batch) == replayed, (kind, sizes)


def _scan(space, sizes):
    """The choice by a scan of every key (smallest by volume covering ``sizes`` within the ratio)."""
    return KeySpace._choose(space, sizes)


@pytest.mark.parametrize("ratio", [None, 0.5], ids=["per-bucket-memo", "padding-ratio"])
def test_the_choice_memoised_on_the_per_dim_buckets_is_the_scan_of_the_keys(ratio):
    """KeySpace.choose, memoised on the tuple of per-dim buckets (a bisect per dim: the route of varlen
    sizes that never repeat), picks what a scan of every key picks, for random sparse key sets (three dims,
    sizes over the largest bucket and zeros included); with a padding ratio the choice depends on the exact
    sizes and is made from them."""
    rng = random.Random(11)
    for _ in range(20):
        buckets = {d: sorted(rng.sample(range(1, 300), rng.randint(1, 6))) for d in ("tokens", "kv", "reqs")}
        grid = list(itertools.product(*buckets.values()))
        keys = set(rng.sample(grid, rng.randint(1, len(grid)))) | {tuple(b[-1] for b in buckets.values())}
        space = KeySpace(buckets, keys=sorted(keys), max_padding_ratio=ratio)
        for _ in range(300):
            sizes = tuple(rng.randint(0, b[-1] + 3) for b in buckets.values())
            assert space.choose(sizes) == _scan(space, sizes), (buckets, sorted(keys), sizes)
            assert space.choose(sizes) == _scan(space, sizes)  # memoised: the same again


def test_negative_control_with_a_padding_ratio_one_bucket_holds_sizes_of_different_choices():
    """Why the per-bucket memo is only used without a padding ratio: two sizes in the same buckets, one
    within the ratio, one padding too much."""
    space = KeySpace({"tokens": [8, 64]}, max_padding_ratio=0.5)
    assert space.bucket_of((40,)) == space.bucket_of((20,)) == (64,)
    assert _scan(space, (40,)) == ((64,), None) and _scan(space, (20,)) == (None, "padding_ratio")


def test_the_choice_memo_stays_bounded_for_sizes_that_never_repeat():
    from graphrunner import keys as keys_mod

    space = KeySpace({"tokens": [16, 256], "kv": [1024, 8192]})
    for n in range(1, 3 * keys_mod.MEMO_LIMIT):
        assert space.choose((n % 256 + 1, n))[0] == space.bucket_of((n % 256 + 1, n))
    assert len(space._memo) <= keys_mod.MEMO_LIMIT and len(space._by_bucket) <= 4
