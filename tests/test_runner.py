"""GraphRunner on the tape device: replay == eager for every batch size, inputs,
outputs, fallback, stats, configuration errors and the capture report."""

from __future__ import annotations

import gc
import json
import random

import pytest
import torch

import graphrunner.runner as runner_mod
from graphrunner.breakable import no_graph
from graphrunner.buckets import default_buckets
from graphrunner.errors import CaptureError, GraphRunnerError
from graphrunner.keys import agreement_vector
from graphrunner.runner import BatchInput, GraphRunner

D, V, VOCAB = 16, 12, 50
BUCKETS = [1, 2, 4, 8, 16]

_gen = torch.Generator().manual_seed(1234)
EMB = torch.randn(VOCAB, D, generator=_gen)
POS = torch.randn(64, D, generator=_gen)
GATE = torch.randn(D, generator=_gen)
W = torch.randn(V, D, generator=_gen) / 4

INPUTS = {
    "input_ids": BatchInput(trailing=(), dtype=torch.long, pad=0),
    "positions": BatchInput(trailing=(), dtype=torch.long, pad=0),
    "hidden": BatchInput(trailing=(D,), dtype=torch.float32, pad=0.0),
}


@no_graph
def rownorm(h: torch.Tensor) -> torch.Tensor:
    # An eager break (host-side work in a real engine). Row-wise, so padding rows cannot leak.
    return h / (1.0 + h.abs().amax(-1, keepdim=True))


@no_graph
def rescale(h: torch.Tensor) -> torch.Tensor:
    return h * 0.5 + 0.25


def step(input_ids, positions, hidden):
    """Row-independent step with two @no_graph breaks (3 segments) reading three
    inputs of two dtypes. No matmul: a BLAS kernel may block rows differently
    for different batch sizes, elementwise ops and last-dim sums do not, so
    replay on the padded bucket is bit-identical to eager on the real batch."""
    h = EMB[input_ids] + POS[positions] + hidden * GATE
    h = rownorm(torch.tanh(h))
    h = rescale(h * GATE + 1.0)
    logits = (h[:, None, :] * W[None]).sum(-1)
    return {"logits": logits, "ids2": input_ids * 2 + 1, "norm": h.abs().sum(-1)}


STEP_SEGMENTS, STEP_BREAKS = 3, 2


def make_batch(n, gen=None):
    g = gen or torch.Generator().manual_seed(n)
    return {
        "input_ids": torch.randint(0, VOCAB, (n,), generator=g),
        "positions": torch.randint(0, 64, (n,), generator=g),
        "hidden": torch.randn(n, D, generator=g),
    }


def eager(batch):
    with torch.inference_mode():
        return step(**batch)


def assert_same(out, ref):
    assert set(out) == set(ref)
    for k in ref:
        assert out[k].shape == ref[k].shape, k
        assert out[k].dtype == ref[k].dtype, k
        assert torch.equal(out[k], ref[k]), f"{k}: max diff {(out[k].double() - ref[k].double()).abs().max()}"


def make_runner(backend="breakable", buckets=BUCKETS, **kw):
    kw.setdefault("progress", False)
    kw.setdefault("warmups", 1)
    return GraphRunner(step, INPUTS, buckets, backend=backend, device="tape", **kw)


@pytest.fixture(scope="module")
def breakable_runner():
    r = make_runner("breakable")
    r.capture()
    yield r
    r.cleanup()


@pytest.fixture(scope="module", params=["full", "breakable"])
def graph_runner(request):
    r = make_runner(request.param)
    r.capture()
    yield r
    r.cleanup()


# --------------------------------------------------------------------------- replay == eager


@pytest.mark.parametrize("backend", ["full", "breakable"])
def test_replay_equals_eager_for_every_batch_size(backend):
    r = make_runner(backend)
    report = r.capture()
    assert [b.bucket for b in report.buckets] == sorted(BUCKETS, reverse=True)  # largest first
    expected_padding = 0
    for n in range(1, BUCKETS[-1] + 5):  # 17..20 take the eager fallback
        batch = make_batch(n)
        out = r(**batch)
        assert_same(out, eager(batch))
        want = next((b for b in BUCKETS if b >= n), None)
        assert r.stats.last_bucket == want, n
        expected_padding += (want - n) if want else 0
    assert r.stats.replays == {1: 1, 2: 1, 4: 2, 8: 4, 16: 8}
    assert r.stats.fallbacks == 4 and r.stats.fallback_reasons == {"over_max_bucket": 4}
    assert (
        r.stats.padding_rows
        == expected_padding
        == sum(b - n for n in range(1, 17) for b in [min(x for x in BUCKETS if x >= n)])
    )
    assert r.stats.calls == BUCKETS[-1] + 4
    r.cleanup()


def test_replay_really_replays_graphs(graph_runner):
    # Negative control for the equality test: a replayed graph keeps the
    # capture's frozen Python state. Changing a Python global the step reads
    # after capture changes eager results but not the replay (proves the
    # outputs come from the graph, not from calling step eagerly).
    global GATE
    batch = make_batch(5)
    before = graph_runner(**batch)["logits"].clone()
    assert torch.equal(before, eager(batch)["logits"])
    old = GATE
    try:
        GATE = old * 3.0  # a new tensor object: eager sees it, the captured graph does not
        assert not torch.equal(eager(batch)["logits"], before)
        assert torch.equal(graph_runner(**batch)["logits"], before)
        assert graph_runner.stats.last_bucket == 8  # a replay, not the eager fallback
    finally:
        GATE = old


@pytest.mark.slow
def test_randomised_sweep_2000_calls(graph_runner):
    rng = random.Random(7)
    gen = torch.Generator().manual_seed(7)
    mismatches = 0
    seen = set()
    for _ in range(2000):
        n = rng.randint(1, BUCKETS[-1] + 3)
        batch = make_batch(n, gen)
        out = graph_runner(**batch)
        ref = eager(batch)
        seen.add(graph_runner.stats.last_bucket)
        mismatches += sum(not torch.equal(out[k], ref[k]) for k in ref)
    assert mismatches == 0
    assert seen == set(BUCKETS) | {None}


def test_padding_rows_hold_pad_values(breakable_runner):
    r = breakable_runner
    r(**make_batch(16))  # fill every row
    r(**make_batch(3))  # bucket 4: row 3 must be re-padded
    bufs = r.static_inputs
    assert int(bufs["input_ids"][3]) == 0 and int(bufs["positions"][3]) == 0
    assert torch.equal(bufs["hidden"][3], torch.zeros(D))
    batch = make_batch(3)
    r(**batch)
    assert torch.equal(bufs["hidden"][:3], batch["hidden"])


def test_pad_values_are_used_for_padding_rows():
    # A non-row-independent step (sums over the batch) sees exactly the pad rows.
    inputs = {
        "x": BatchInput(trailing=(2,), dtype=torch.float32, pad=-1.5),
        "i": BatchInput(trailing=(), dtype=torch.int32, pad=7),
    }

    def total(x, i):
        return (x.sum(0, keepdim=True).expand(x.shape[0], 2) + i.sum().float()).contiguous()

    r = GraphRunner(
        total, inputs, [4], backend="full", device="tape", warmups=1, progress=False, checks=("drift", "fingerprint")
    )  # deliberately leaky: it shows which pad values the graph sees
    r.capture()
    x = torch.ones(4, 2)
    r(x=x, i=torch.ones(4, dtype=torch.int32))
    out = r(x=torch.ones(1, 2), i=torch.ones(1, dtype=torch.int32))
    # 1 real row + 3 pad rows: x column sums 1 - 4.5, i sum 1 + 21
    assert torch.equal(out, torch.full((1, 2), 1 - 4.5 + 22.0))


# --------------------------------------------------------------------------- outputs


def test_default_outputs_are_views_the_next_call_overwrites(breakable_runner):
    r = breakable_runner
    a, b = make_batch(4, torch.Generator().manual_seed(1)), make_batch(4, torch.Generator().manual_seed(2))
    out_a = r(**a)
    ref_a = eager(a)
    assert torch.equal(out_a["logits"], ref_a["logits"])
    out_b = r(**b)
    # Documented contract: out_a aliases static memory and now holds b's results.
    assert torch.equal(out_a["logits"], eager(b)["logits"])
    assert not torch.equal(out_a["logits"], ref_a["logits"])
    assert out_a["logits"].data_ptr() == out_b["logits"].data_ptr()


def test_copy_outputs_survive_the_next_call():
    r = make_runner("breakable", buckets=[2, 4], copy_outputs=True)
    r.capture()
    a, b = make_batch(3, torch.Generator().manual_seed(1)), make_batch(3, torch.Generator().manual_seed(2))
    out_a = r(**a)
    r(**b)
    assert_same(out_a, eager(a))
    # per-call override
    v = r.run(a, copy_outputs=False)
    r(**b)
    assert torch.equal(v["logits"], eager(b)["logits"])


def test_single_tensor_and_tuple_outputs():
    def f(x):
        return x * 2

    def g(x):
        return (x + 1, None, x.sum(-1))

    for fn in (f, g):
        r = GraphRunner(
            fn, {"x": BatchInput(trailing=(3,))}, [2, 4], backend="full", device="tape", warmups=1, progress=False
        )
        r.capture()
        for n in (1, 2, 3, 4, 5):
            x = torch.randn(n, 3)
            out, ref = r(x=x), fn(x)
            if isinstance(ref, tuple):
                assert isinstance(out, tuple) and out[1] is None
                assert torch.equal(out[0], ref[0]) and torch.equal(out[2], ref[2])
            else:
                assert torch.equal(out, ref)


# --------------------------------------------------------------------------- bad inputs

BAD = {
    "missing input": (lambda b: {k: v for k, v in b.items() if k != "positions"}, ValueError, "positions"),
    "extra input": (lambda b: {**b, "mask": torch.ones(3)}, ValueError, "mask"),
    "wrong dtype": (lambda b: {**b, "input_ids": b["input_ids"].int()}, ValueError, "input_ids"),
    "wrong trailing": (lambda b: {**b, "hidden": torch.randn(3, D + 1)}, ValueError, "hidden"),
    "wrong ndim": (lambda b: {**b, "positions": b["positions"][:, None]}, ValueError, "positions"),
    "batch mismatch": (lambda b: {**b, "hidden": torch.randn(2, D)}, ValueError, "hidden"),
    "not a tensor": (lambda b: {**b, "positions": [1, 2, 3]}, TypeError, "positions"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_inputs_raise_clear_errors_and_runner_stays_usable(breakable_runner, case):
    mutate, exc_type, needle = BAD[case]
    r = breakable_runner
    before = r.stats.calls
    with pytest.raises(exc_type, match=needle):
        r(**mutate(make_batch(3)))
    assert r.stats.calls == before  # a failed call is not counted
    batch = make_batch(3, torch.Generator().manual_seed(99))
    assert_same(r(**batch), eager(batch))


def test_batch_above_largest_bucket_with_fallback_error():
    r = make_runner("full", buckets=[2, 4], fallback="error")
    r.capture()
    with pytest.raises(ValueError, match="exceeds the largest bucket 4"):
        r(**make_batch(5))
    assert r.stats.fallbacks == 0
    batch = make_batch(3)
    assert_same(r(**batch), eager(batch))


def test_call_before_capture_and_double_capture():
    r = make_runner("full", buckets=[2])
    with pytest.raises(CaptureError, match="capture"):
        r(**make_batch(1))
    r.capture()
    with pytest.raises(CaptureError, match="already"):
        r.capture()
    r.cleanup()
    assert not r.captured
    r.capture()
    assert_same(r(**make_batch(2)), eager(make_batch(2)))


# --------------------------------------------------------------------------- padding ratio


def test_max_padding_ratio_falls_back():
    r = make_runner("breakable", buckets=[1, 8], max_padding_ratio=0.5)
    r.capture()
    got = {}
    for n in range(1, 10):
        batch = make_batch(n)
        assert_same(r(**batch), eager(batch))
        got[n] = r.stats.last_bucket
    # (8 - n) / 8 > 0.5  <=>  n < 4
    assert got == {1: 1, 2: None, 3: None, 4: 8, 5: 8, 6: 8, 7: 8, 8: 8, 9: None}
    assert r.stats.fallback_reasons == {"padding_ratio": 2, "over_max_bucket": 1}
    assert r.stats.replays == {1: 1, 8: 5}
    assert r.stats.padding_rows == 4 + 3 + 2 + 1
    # Negative control: without the ratio, 2 and 3 replay bucket 8.
    assert r.bucket_for(3) is None
    r2 = make_runner("breakable", buckets=[1, 8])
    assert r2.bucket_for(3) == 8

    r3 = make_runner("breakable", buckets=[1, 8], max_padding_ratio=0.5, fallback="error")
    r3.capture()
    with pytest.raises(ValueError, match="max_padding_ratio"):
        r3(**make_batch(2))
    assert_same(r3(**make_batch(4)), eager(make_batch(4)))


# --------------------------------------------------------------------------- configuration


@pytest.mark.parametrize(
    "buckets,exc,needle",
    [
        ([], ValueError, "empty"),
        ([4, 2], ValueError, "sorted"),
        ([1, 2, 2], ValueError, "duplicate"),
        ([0, 1], ValueError, ">= 1"),
        ([-2, 1], ValueError, ">= 1"),
        ([1, 2.5], TypeError, "int"),
        ([True, 2], TypeError, "bool"),
        ("1,2", TypeError, "list"),
    ],
)
def test_bad_buckets(buckets, exc, needle):
    with pytest.raises(exc, match=needle):
        make_runner("full", buckets=buckets)


@pytest.mark.parametrize(
    "kw,exc,needle",
    [
        ({"backend": "cudagraph"}, ValueError, "unknown backend"),
        ({"backend": object()}, TypeError, "backend"),
        ({"fallback": "skip"}, ValueError, "fallback"),
        ({"max_padding_ratio": 1.0}, ValueError, "max_padding_ratio"),
        ({"max_padding_ratio": -0.1}, ValueError, "max_padding_ratio"),
        ({"warmups": -1}, ValueError, "warmups"),
        ({"post_warmup_hook": 3}, TypeError, "post_warmup_hook"),
    ],
)
def test_bad_configuration(kw, exc, needle):
    with pytest.raises(exc, match=needle):
        make_runner(**{"backend": "full", **kw})


def test_bad_input_declarations():
    with pytest.raises(ValueError, match="non-empty"):
        GraphRunner(step, {}, [1])
    with pytest.raises(TypeError, match="BatchInput"):
        GraphRunner(step, {"x": (3,)}, [1])
    with pytest.raises(TypeError, match="dtype"):
        BatchInput(trailing=(2,), dtype="float32")
    with pytest.raises(ValueError, match="trailing"):
        BatchInput(trailing=(-1,))
    with pytest.raises(TypeError, match="callable"):
        GraphRunner(None, INPUTS, [1])


@pytest.mark.parametrize(
    "bad_out,needle",
    [
        (lambda x: {"y": x, "n": 3}, "pytree of tensors"),
        (lambda x: "text", "pytree of tensors"),
        (lambda x: x.sum(0, keepdim=True).expand(5, 3), "batch-major"),
    ],
)
def test_step_output_not_a_pytree_of_tensors(bad_out, needle):
    r = GraphRunner(
        bad_out, {"x": BatchInput(trailing=(3,))}, [2, 4], backend="breakable", device="tape", progress=False
    )
    with pytest.raises(TypeError, match=needle):
        r.capture()
    assert not r.captured and r.backend.keys() == []  # nothing was captured


def test_default_buckets():
    assert default_buckets(1) == [1]
    assert default_buckets(6) == [1, 2, 4, 6]
    assert default_buckets(32) == [1, 2, 4, 8, 16, 24, 32]
    assert default_buckets(20) == [1, 2, 4, 8, 16, 20]
    with pytest.raises(ValueError):
        default_buckets(0)


def test_default_buckets_follow_vllm_ladder_above_256():
    # vLLM's ladder written out by hand: 1, 2, 4, multiples of 8 below 256, then multiples of 16.
    eights = [
        8,
        16,
        24,
        32,
        40,
        48,
        56,
        64,
        72,
        80,
        88,
        96,
        104,
        112,
        120,
        128,
        136,
        144,
        152,
        160,
        168,
        176,
        184,
        192,
        200,
        208,
        216,
        224,
        232,
        240,
        248,
    ]
    sixteens = [256, 272, 288, 304, 320, 336, 352, 368, 384, 400, 416, 432, 448, 464, 480, 496, 512]
    assert default_buckets(512) == [1, 2, 4] + eights + sixteens
    assert len(default_buckets(512)) == 51
    assert default_buckets(256) == [1, 2, 4] + eights + [256]
    assert default_buckets(255) == [1, 2, 4] + eights + [255]  # off the ladder: max_batch appended
    assert default_buckets(300) == [1, 2, 4] + eights + [256, 272, 288, 300]
    # Negative control: the old 8-step ladder would put 264 between 256 and 272.
    assert 264 not in default_buckets(512) and 264 in [1, 2, 4] + list(range(8, 513, 8))


# --------------------------------------------------------------------------- capture report


@pytest.mark.parametrize(
    "backend,segments,breaks", [("breakable", STEP_SEGMENTS, STEP_BREAKS), ("full", 1, 0), ("eager", 0, 1)]
)
def test_capture_report_matches_backend_info(backend, segments, breaks):
    r = make_runner(backend, buckets=[2, 4, 8])
    report = r.capture()
    assert report.backend == backend and report.device == "tape" and report.world_size == 1
    assert [b.bucket for b in report.buckets] == [8, 4, 2] == r.backend.keys()
    for b in report.buckets:
        info = r.backend.info(b.bucket)
        assert (b.num_segments, b.num_breaks) == (segments, breaks) == (info["num_segments"], info["num_breaks"])
        assert b.bytes_held == info["bytes_held"] > 0
        assert b.capture_seconds == info["capture_seconds"] > 0
        assert b.checks_seconds == info["checks_seconds"] < b.capture_seconds
    assert report.static_input_bytes == 8 * (8 + 8 + 4 * D)
    assert report.output_buffer_bytes == 8 * (4 * V + 8 + 4)
    data = json.loads(report.to_json())
    assert [b["num_segments"] for b in data["buckets"]] == [segments] * 3
    assert [b["num_breaks"] for b in data["buckets"]] == [breaks] * 3
    assert data["total_bytes_held"] == report.static_input_bytes + report.output_buffer_bytes
    table = str(report)
    assert "segments" in table and "breaks" in table
    rows = [line.split() for line in table.splitlines() if line.split() and line.split()[0] in {"8", "4", "2"}]
    assert [(int(x[0]), int(x[4]), int(x[5])) for x in rows] == [
        (8, segments, breaks),
        (4, segments, breaks),
        (2, segments, breaks),
    ]
    batch = make_batch(7)
    assert_same(r(**batch), eager(batch))


def test_capture_is_gc_frozen_and_hooks_see_the_bucket():
    frozen, hooks = [], []

    def f(x):
        frozen.append(gc.get_freeze_count() > 0)
        return x + 1

    r = GraphRunner(
        f,
        {"x": BatchInput(trailing=(2,))},
        [1, 4],
        backend="breakable",
        device="tape",
        warmups=2,
        post_warmup_hook=hooks.append,
        progress=False,
    )
    before = gc.get_freeze_count()
    rep = r.capture()
    # 2 warmups + 1 capture per bucket, + the padding check's forwards for bucket 4 (the last warmup is its
    # padded run; random padding, unpadded eager; no follow-up: the step writes no state and has no integer
    # input); all frozen
    assert rep.buckets[0].info["leak_check_forwards"] == 2
    assert len(frozen) == 8 and all(frozen)
    assert gc.get_freeze_count() == before  # unfrozen again after capture
    frozen.clear()
    r(x=torch.ones(3, 2))
    assert frozen == []  # replay does not call the step
    assert hooks == [4, 4, 1, 1]  # after each warmup, largest bucket first


def test_progress_bar_on_stderr_and_disable(capsys):
    r = make_runner("full", buckets=[1, 2], progress=True)
    r.capture()
    err = capsys.readouterr().err
    assert "graphrunner capture" in err
    r2 = make_runner("full", buckets=[1, 2], progress=False)
    r2.capture()
    captured = capsys.readouterr()
    assert captured.err == "" and captured.out == ""


def test_progress_plain_fallback_without_tqdm():
    import io

    from graphrunner.progress import CaptureProgress

    s = io.StringIO()
    p = CaptureProgress(2, stream=s, use_tqdm=False)
    p.start(0, 8)
    p.start(1, 4)
    p.close()
    lines = s.getvalue().splitlines()
    assert "bucket     8 (1/2)" in lines[0] and "bucket     4 (2/2)" in lines[1] and "2 buckets in" in lines[2]


# --------------------------------------------------------------------------- group traffic (in-process fakes)


def peer_vector(v, batch, invalid=0, lag=0, digest=None):
    """The agreement vector of a one-dim peer with ``batch`` rows, given this rank's vector ``v``
    (only its first element is read): at this rank's call minus ``lag``, with this rank's
    configuration digest unless ``digest`` is given."""
    from graphrunner.keys import _DIGEST_MOD, _SIZE_BITS

    tag = -(v[0] >> _SIZE_BITS)
    call, own_digest = divmod(tag, _DIGEST_MOD)
    return agreement_vector((batch,), bool(invalid), call - lag, own_digest if digest is None else digest)


class RecordingGroup:
    """A fake group: records every call; peers are simulated by the values
    they contribute to the element-wise max of the one per-call agreement
    (`peer_batch`, `peer_invalid`) and of the capture-time replayability
    exchange (`peer_cannot`: the indices, in `runner.keys` order, of keys a
    peer cannot replay)."""

    def __init__(self, size=2, peer_batch=0, peer_invalid=0, peer_cannot=()):
        self.rank, self.size = 0, size
        self.calls = []
        self.peer_batch, self.peer_invalid, self.peer_cannot = peer_batch, peer_invalid, set(peer_cannot)

    def barrier(self, **kw):
        self.calls.append(("barrier", kw.get("phase")))

    def all_max_vector(self, v, **kw):
        phase = kw.get("phase")
        self.calls.append(("all_max_vector", phase, list(v)))
        if self.size == 1:
            return list(v)
        if phase == "runner_agree":  # the peer, at the same call, contributes its batch and invalid flag
            return [max(a, b) for a, b in zip(v, peer_vector(v, self.peer_batch, self.peer_invalid))]
        if phase == "runner_replayable":
            return [max(x, 1 if i in self.peer_cannot else 0) for i, x in enumerate(v)]
        return list(v)  # the capture fingerprint: the peer configured the same runner


class ScalarOnlyGroup:
    """A group with only the scalar collectives (an older third-party group)."""

    rank, size = 0, 2

    def __init__(self, peer_batch):
        self.calls, self.peer_batch, self._peer = [], peer_batch, None

    def barrier(self, **kw):
        pass

    def all_max(self, v, **kw):
        self.calls.append(("all_max", kw.get("phase"), v))
        if kw.get("phase") != "runner_agree":
            return v
        if self._peer is None:  # the first element of the vector: the peer's whole vector follows from it
            self._peer = peer_vector([v], self.peer_batch)
            return max(v, self._peer[0])
        out, self._peer = max(v, self._peer[1]), None
        return out

    def all_min(self, v, **kw):  # pragma: no cover - the runner only takes maxima
        raise AssertionError("the runner agrees with maxima only")


def _digest(runner):
    """The configuration digest a multi-rank runner's per-call agreement carries (graphrunner.agreement)."""
    from graphrunner.agreement import config_digest

    return config_digest(runner._config_fields())


def _group_runner(group, **kw):
    from graphrunner.backends import BreakableGraphBackend

    backend = BreakableGraphBackend(device="tape", group=group, warmups=1)
    return GraphRunner(step, INPUTS, [2, 4, 8], backend=backend, group=group, progress=False, **kw)


def test_size1_group_makes_no_group_calls_on_the_replay_path():
    g = RecordingGroup(size=1)
    r = _group_runner(g)
    r.capture()
    assert g.calls and all(c[0] == "barrier" for c in g.calls)  # capture protocol only
    g.calls.clear()
    for n in (1, 3, 8, 9):
        r(**make_batch(n))
    assert g.calls == []


def test_multirank_agreement_makes_exactly_one_collective_per_call():
    g = RecordingGroup(size=2, peer_batch=7)
    r = _group_runner(g)
    r.capture()
    # Capture ends with one exchange of which keys each rank can replay (keys [2, 4, 8]).
    assert g.calls[-1] == ("all_max_vector", "runner_replayable", [0, 0, 0])
    g.calls.clear()
    batch = make_batch(2)
    out = r(**batch)
    # The peer has 7 rows: both replay bucket 8, this rank's outputs are sliced to its 2 rows.
    assert g.calls == [
        ("all_max_vector", "runner_agree", agreement_vector((2,), False, 1, digest=_digest(r)))
    ]  # batch 2, call 1
    assert r.stats.last_bucket == 8 and r.stats.padding_rows == 6
    assert_same(out, eager(batch))

    # A peer with more rows than the largest bucket: everyone falls back.
    g.peer_batch = 11
    out = r(**batch)
    assert r.stats.last_bucket is None and r.stats.fallback_reasons["over_max_bucket"] == 1
    assert_same(out, eager(batch))

    # A peer with invalid inputs: this rank raises too, without replaying.
    g.peer_batch, g.peer_invalid = 0, 1
    calls = r.stats.calls
    with pytest.raises(GraphRunnerError, match="another rank passed invalid inputs"):
        r(**batch)
    assert r.stats.calls == calls
    # Invalid inputs here: still takes part in the one collective, then raises its own error.
    g.calls.clear()
    g.peer_invalid = 0
    with pytest.raises(ValueError, match="missing"):
        r(input_ids=batch["input_ids"], hidden=batch["hidden"])
    assert g.calls == [
        ("all_max_vector", "runner_agree", agreement_vector((0,), True, 4, digest=_digest(r)))
    ]  # call 4, invalid


def test_multirank_peer_that_cannot_replay_a_key_makes_every_rank_fall_back_for_it():
    g = RecordingGroup(size=2, peer_batch=7, peer_cannot={2})  # the peer cannot replay bucket 8
    r = _group_runner(g)
    r.capture()
    g.calls.clear()
    batch = make_batch(2)
    seen = []
    orig = r.step
    r.step = lambda **kw: (seen.append(kw["hidden"].shape[0]), orig(**kw))[1]
    out = r(**batch)
    r.step = orig
    # everyone falls back, padded to the agreed 7 rows, with one collective
    assert seen == [7] and r.stats.last_bucket is None
    assert r.stats.fallback_reasons == {"cannot_replay": 1}
    assert len(g.calls) == 1
    assert_same(out, eager(batch))
    g.peer_batch = 3  # bucket 4 is replayable on both
    assert_same(r(**batch), eager(batch)) and r.stats.last_bucket == 4


def test_group_without_all_max_vector_gets_one_all_max_per_element():
    g = ScalarOnlyGroup(peer_batch=7)
    r = _group_runner(g)
    r.capture()
    g.calls.clear()
    batch = make_batch(2)
    assert_same(r(**batch), eager(batch))
    assert g.calls == [("all_max", "runner_agree", v) for v in agreement_vector((2,), False, 1, digest=_digest(r))]
    assert r.stats.last_bucket == 8


def test_agreement_below_own_size_raises():
    class Shrinking(RecordingGroup):
        def all_max_vector(self, v, **kw):
            out = super().all_max_vector(v, **kw)
            return [out[0] - 2, *out[1:]] if kw.get("phase") == "runner_agree" else out  # 3 rows agreed as 1

    r = _group_runner(Shrinking(size=2))
    r.capture()
    with pytest.raises(GraphRunnerError, match="below this rank's own"):
        r(**make_batch(3))


def test_agree_bucket_false_makes_no_group_calls():
    g = RecordingGroup(size=2, peer_batch=7)
    r = _group_runner(g)
    r.agree_bucket = False
    r.capture()
    g.calls.clear()
    r(**make_batch(2))
    assert g.calls == [] and r.stats.last_bucket == 2  # local choice, unlike the agreed 8 above


def test_backend_instance_conflicts():
    from graphrunner.backends import FullGraphBackend

    b = FullGraphBackend(device="tape")
    with pytest.raises(ValueError, match="group"):
        GraphRunner(step, INPUTS, [1], backend=b, group=RecordingGroup(size=1))
    with pytest.raises(ValueError, match="trace"):
        GraphRunner(step, INPUTS, [1], backend=b, trace=object())
    assert GraphRunner(step, INPUTS, [1], backend=b).backend is b


def test_public_names_have_docstrings():
    for name in runner_mod.__all__:
        obj = getattr(runner_mod, name)
        assert obj.__doc__ and len(obj.__doc__) > 40, name
    for meth in ("capture", "run", "cleanup", "__call__", "bucket_for"):
        assert getattr(GraphRunner, meth).__doc__, meth


# --------------------------------------------------------------------------- CUDA (skipped without a GPU)


@pytest.mark.cuda
@pytest.mark.parametrize("backend", ["full", "breakable"])
def test_cuda_graphs_replay_equals_eager(backend):
    dev = torch.device("cuda")
    emb, pos, gate, w = EMB.to(dev), POS.to(dev), GATE.to(dev), W.to(dev)

    def cuda_step(input_ids, positions, hidden):
        h = emb[input_ids] + pos[positions] + hidden * gate
        h = rownorm(torch.tanh(h))
        h = rescale(h * gate + 1.0)
        return {"logits": (h[:, None, :] * w[None]).sum(-1), "ids2": input_ids * 2 + 1}

    r = GraphRunner(cuda_step, INPUTS, [1, 2, 4, 8], backend=backend, device="cuda", warmups=2, progress=False)
    report = r.capture()
    assert report.device == "cuda"
    for n in range(1, 11):
        batch = {k: v.to(dev) for k, v in make_batch(n).items()}
        out = r(**batch)
        with torch.inference_mode():
            ref = cuda_step(**batch)
        for k in ref:
            assert torch.equal(out[k], ref[k]), (n, k)


# --------------------------------------------------------------------------- paired calls across ranks (issue 21)


class PeerAtCall(RecordingGroup):
    """A fake 2-rank group whose peer is ``lag`` calls behind this rank and runs a runner of
    configuration digest ``peer_digest`` (``None``: the same as this rank's)."""

    def __init__(self, lag=0, peer_digest=None, **kw):
        super().__init__(size=2, **kw)
        self.lag, self.peer_digest = lag, peer_digest

    def all_max_vector(self, v, **kw):
        if kw.get("phase") != "runner_agree":
            return super().all_max_vector(v, **kw)
        self.calls.append(("all_max_vector", "runner_agree", list(v)))
        peer = peer_vector(v, self.peer_batch, self.peer_invalid, self.lag, self.peer_digest)
        return [max(a, b) for a, b in zip(v, peer)]


def test_agreement_vector_packs_the_call_number_as_max_and_min_without_growing():
    from graphrunner.keys import agree

    # One element per dim plus one, as before the call number: [n0 - tag * 2**32, n1, ..., tag * 2 + invalid].
    tag = 7 * 2**14 + 5
    assert agreement_vector((3, 2), False, 7, digest=5) == [3 - tag * 2**32, 2, tag * 2]
    assert agreement_vector((0,), True, 7, digest=5) == [-tag * 2**32, tag * 2 + 1]

    class Peers:  # ranks at the same call with other sizes and flags: the max decodes to the agreed sizes
        rank, size = 0, 3

        def __init__(self, *peers):
            self.peers = peers

        def all_max_vector(self, v, **kw):
            return [max(col) for col in zip(v, *self.peers)]

    g = Peers(agreement_vector((5, 1), False, 9), agreement_vector((0, 0), True, 9))
    assert agree(g, (3, 4), False, 9) == ((5, 4), True)
    assert agree(Peers(agreement_vector((2, 6), False, 9)), (3, 4), False, 9) == ((3, 6), False)
    # Call numbers are compared modulo 2**16: a rank past the wrap is still one call ahead.
    from graphrunner.keys import AgreementError

    with pytest.raises(AgreementError, match="rank 0 is at call 65535 but another rank is at call 65536") as ei:
        agree(Peers(agreement_vector((1, 1), False, 65536)), (3, 4), False, 65535)
    assert ei.value.calls == (65535, 65535, 65536)
    g = RecordingGroup(size=2)
    r = _group_runner(g)
    r.capture()
    g.calls.clear()
    for i, n in enumerate((2, 3, 5), start=1):
        batch = make_batch(n)
        assert_same(r(**batch), eager(batch))
        assert g.calls[-1] == ("all_max_vector", "runner_agree", agreement_vector((n,), False, i, digest=_digest(r)))
        assert len(g.calls[-1][2]) == 2  # one dim: two elements, exactly as before
    assert len(g.calls) == 3  # still exactly one collective per call


def test_unpaired_call_numbers_raise_agreement_error_and_the_runner_refuses_later_calls():
    from graphrunner.keys import AgreementError

    g = PeerAtCall(lag=0)
    r = _group_runner(g)
    r.capture()
    batch = make_batch(3)
    assert_same(r(**batch), eager(batch))  # call 1 on both ranks
    g.lag = 1  # the peer lost a call: this rank's call 2 meets the peer's call 1
    seen = []
    orig = r.step
    r.step = lambda **kw: (seen.append(1), orig(**kw))[1]
    replays = dict(r.stats.replays)
    with pytest.raises(
        AgreementError,
        match=r"rank 0 is at call 2 but another rank is at call 1 \(lowest 1, "
        r"highest 2 over the 2 ranks\): a rank skipped or added a call",
    ) as ei:
        r(**batch)
    assert ei.value.calls == (2, 1, 2) and ei.value.unpaired
    assert "every rank must call the runner the same number of times" in str(ei.value)
    assert r.stats.replays == replays and seen == []  # nothing replayed, no eager fallback
    # From now on the runner refuses every call on this rank, without a collective (every
    # rank saw the same mismatch, so no rank waits for another).
    g.calls.clear()
    g.lag = 0
    with pytest.raises(AgreementError, match="refused without a collective.*call 2 but another rank is at call 1"):
        r(**batch)
    with pytest.raises(AgreementError, match="refused"):  # invalid inputs too: the desync comes first
        r(input_ids=batch["input_ids"], hidden=batch["hidden"])
    assert g.calls == [] and seen == []
    # A new runner re-pairs the ranks (after the caller re-synchronised its steps).
    r.step = orig
    g2 = PeerAtCall(lag=0)
    r2 = _group_runner(g2)
    r2.capture()
    assert_same(r2(**batch), eager(batch))


def test_the_lowest_and_highest_call_numbers_are_named_on_a_rank_in_between():
    from graphrunner.keys import AgreementError, agree

    class ThreeRanks:
        rank, size = 1, 3

        def all_max_vector(self, v, **kw):  # peers at calls 6 and 8, this rank at 7
            peers = agreement_vector((2,), False, 6), agreement_vector((2,), False, 8)
            return [max(col) for col in zip(v, *peers)]

    with pytest.raises(
        AgreementError,
        match=r"rank 1 is at call 7 but other ranks are at calls 6 and 8 "
        r"\(lowest 6, highest 8 over the 3 ranks\)",
    ) as ei:
        agree(ThreeRanks(), (2,), False, 7)
    assert ei.value.calls == (7, 6, 8)


def test_invalid_inputs_on_an_unpaired_call_raise_agreement_error_on_that_rank_too():
    from graphrunner.keys import AgreementError

    g = PeerAtCall(lag=0)
    r = _group_runner(g)
    r.capture()
    batch = make_batch(2)
    g.lag = -1  # the peer is one call ahead
    with pytest.raises(AgreementError, match="rank 0 is at call 1 but another rank is at call 2") as ei:
        r(input_ids=batch["input_ids"], hidden=batch["hidden"])  # missing 'positions'
    assert isinstance(ei.value.__context__, ValueError) and "missing" in str(ei.value.__context__)
    assert g.calls[-1] == (
        "all_max_vector",
        "runner_agree",
        agreement_vector((0,), True, 1, digest=_digest(r)),
    )  # it took part


def test_configuration_digests_that_differ_raise_agreement_error():
    from graphrunner.agreement import RankAgreement, config_digest
    from graphrunner.keys import AgreementError

    r = _group_runner(RecordingGroup(size=2))
    d1 = config_digest(r._config_fields())
    assert d1 == config_digest(r._config_fields()) and 0 < d1 < 2**62
    other = GraphRunner(step, INPUTS, [2, 4], backend="breakable", device="tape", progress=False)
    d2 = config_digest(other._config_fields())
    m1, m2 = d1 % 2**14, d2 % 2**14  # the vector carries the digest modulo 2**14
    assert m1 != m2
    same = RankAgreement(PeerAtCall(peer_digest=d1), digest=d1)
    assert same.agree((3,), 1) == (3,)
    crossed = RankAgreement(PeerAtCall(peer_digest=d2), digest=d1)  # the peer called another runner
    with pytest.raises(AgreementError, match="met a call of a runner with another configuration") as ei:
        crossed.agree((3,), 1)
    assert ei.value.digests == (m1, min(m1, m2), max(m1, m2)) and ei.value.calls is None
    with pytest.raises(AgreementError, match="refused"):
        crossed.agree((3,), 2)


@pytest.mark.parametrize("make", [lambda t: t.to_sparse(), lambda t: t.to_sparse_csr()], ids=["coo", "csr"])
def test_sparse_input_is_invalid_input_named_and_agreed_as_invalid(make):
    g = RecordingGroup(size=2)
    r = _group_runner(g)
    r.capture()
    g.calls.clear()
    batch = make_batch(3)
    bad = dict(batch, hidden=make(batch["hidden"]))
    layout = bad["hidden"].layout
    with pytest.raises(
        ValueError,
        match=rf"input 'hidden' is a sparse tensor \(layout {layout}\); pass a dense "
        r"\(strided\) tensor, e.g. hidden.to_dense\(\)",
    ):
        r(**bad)
    # It took part in the call's one collective as invalid (never a skipped collective).
    assert g.calls == [("all_max_vector", "runner_agree", agreement_vector((0,), True, 1, digest=_digest(r)))]
    assert_same(r(**batch), eager(batch))  # the runner is still usable: call 2, paired
    assert g.calls[-1] == ("all_max_vector", "runner_agree", agreement_vector((3,), False, 2, digest=_digest(r)))


def test_storage_less_inputs_on_the_generic_validation_path_are_named():
    specs = {"x": BatchInput(trailing=(4,), dims=("a", "b"))}
    r = GraphRunner(lambda x: x * 2.0, specs, {"a": [1, 2], "b": [2, 4]}, device="tape", progress=False)
    r.capture()
    x = torch.randn(2, 3, 4)
    with pytest.raises(ValueError, match=r"input 'x' is a sparse tensor \(layout torch.sparse_coo\)"):
        r(x=x.to_sparse())
    with pytest.raises(ValueError, match="input 'x' is on the meta device"):
        r(x=torch.empty(2, 3, 4, device="meta"))

    class Exploding(dict):  # an inputs mapping that fails while it is read: invalid input, not a raw error
        def __getitem__(self, k):
            raise RuntimeError("lazy input could not be materialised")

    with pytest.raises(ValueError, match="inspecting input 'x' raised RuntimeError: lazy input could not"):
        r.run(Exploding(x=x))
    assert torch.equal(r(x=x), x * 2.0)


def test_a_first_dim_size_too_large_to_pack_takes_part_as_invalid():
    from graphrunner.keys import agree

    class Peer:
        rank, size, sent = 0, 2, []

        def all_max_vector(self, v, **kw):
            self.sent.append(list(v))
            return [max(a, b) for a, b in zip(v, agreement_vector((1,), False, 3))]

    with pytest.raises(ValueError, match="size 4294967296 in the first dim is too large to agree"):
        agree(Peer(), (2**32,), False, 3)
    assert Peer.sent == [agreement_vector((0,), True, 3)]  # the peers see an invalid rank, nothing hangs
    assert agree(Peer(), (2**32 - 1,), False, 3) == ((2**32 - 1,), False)
