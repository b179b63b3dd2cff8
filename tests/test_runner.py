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
    assert r.stats.padding_rows == expected_padding == sum(b - n for n in range(1, 17) for b in [min(x for x in BUCKETS if x >= n)])
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
    inputs = {"x": BatchInput(trailing=(2,), dtype=torch.float32, pad=-1.5),
              "i": BatchInput(trailing=(), dtype=torch.int32, pad=7)}

    def total(x, i):
        return (x.sum(0, keepdim=True).expand(x.shape[0], 2) + i.sum().float()).contiguous()

    r = GraphRunner(total, inputs, [4], backend="full", device="tape", warmups=1, progress=False,
                    checks=("drift", "fingerprint"))  # deliberately leaky: it shows which pad values the graph sees
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
        r = GraphRunner(fn, {"x": BatchInput(trailing=(3,))}, [2, 4], backend="full", device="tape",
                        warmups=1, progress=False)
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
    "batch 0": (lambda b: {k: v[:0] for k, v in b.items()}, ValueError, "batch 0"),
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


@pytest.mark.parametrize("buckets,exc,needle", [
    ([], ValueError, "empty"),
    ([4, 2], ValueError, "sorted"),
    ([1, 2, 2], ValueError, "duplicate"),
    ([0, 1], ValueError, ">= 1"),
    ([-2, 1], ValueError, ">= 1"),
    ([1, 2.5], TypeError, "int"),
    ([True, 2], TypeError, "bool"),
    ("1,2", TypeError, "list"),
])
def test_bad_buckets(buckets, exc, needle):
    with pytest.raises(exc, match=needle):
        make_runner("full", buckets=buckets)


@pytest.mark.parametrize("kw,exc,needle", [
    ({"backend": "cudagraph"}, ValueError, "unknown backend"),
    ({"backend": object()}, TypeError, "backend"),
    ({"fallback": "skip"}, ValueError, "fallback"),
    ({"max_padding_ratio": 1.0}, ValueError, "max_padding_ratio"),
    ({"max_padding_ratio": -0.1}, ValueError, "max_padding_ratio"),
    ({"warmups": -1}, ValueError, "warmups"),
    ({"post_warmup_hook": 3}, TypeError, "post_warmup_hook"),
])
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


@pytest.mark.parametrize("bad_out,needle", [
    (lambda x: {"y": x, "n": 3}, "pytree of tensors"),
    (lambda x: "text", "pytree of tensors"),
    (lambda x: x.sum(0, keepdim=True).expand(5, 3), "batch-major"),
])
def test_step_output_not_a_pytree_of_tensors(bad_out, needle):
    r = GraphRunner(bad_out, {"x": BatchInput(trailing=(3,))}, [2, 4], backend="breakable", device="tape",
                    progress=False)
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


# --------------------------------------------------------------------------- capture report


@pytest.mark.parametrize("backend,segments,breaks", [
    ("breakable", STEP_SEGMENTS, STEP_BREAKS), ("full", 1, 0), ("eager", 0, 1)])
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
    assert report.static_input_bytes == 8 * (8 + 8 + 4 * D)
    assert report.output_buffer_bytes == 8 * (4 * V + 8 + 4)
    data = json.loads(report.to_json())
    assert [b["num_segments"] for b in data["buckets"]] == [segments] * 3
    assert [b["num_breaks"] for b in data["buckets"]] == [breaks] * 3
    assert data["total_bytes_held"] == report.static_input_bytes + report.output_buffer_bytes
    table = str(report)
    assert "segments" in table and "breaks" in table
    rows = [line.split() for line in table.splitlines() if line.split() and line.split()[0] in {"8", "4", "2"}]
    assert [(int(x[0]), int(x[3]), int(x[4])) for x in rows] == [(8, segments, breaks), (4, segments, breaks),
                                                                  (2, segments, breaks)]
    batch = make_batch(7)
    assert_same(r(**batch), eager(batch))


def test_capture_is_gc_frozen_and_hooks_see_the_bucket():
    frozen, hooks = [], []

    def f(x):
        frozen.append(gc.get_freeze_count() > 0)
        return x + 1

    r = GraphRunner(f, {"x": BatchInput(trailing=(2,))}, [1, 4], backend="breakable", device="tape", warmups=2,
                    post_warmup_hook=hooks.append, progress=False)
    before = gc.get_freeze_count()
    r.capture()
    # 2 warmups + 1 capture per bucket, + the padding-leak check's extra forward for bucket 4; all frozen
    assert len(frozen) == 7 and all(frozen)
    assert gc.get_freeze_count() == before  # unfrozen again after capture
    frozen.clear()
    r(x=torch.ones(3, 2))
    assert frozen == []  # replay does not call the step
    assert hooks == [4, 4, 4, 1, 1]  # after each warmup (and the leak check's forward), largest bucket first


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
        if phase == "runner_agree":
            return [max(v[0], self.peer_batch), max(v[1], self.peer_invalid)]
        if phase == "runner_replayable":
            return [max(x, 1 if i in self.peer_cannot else 0) for i, x in enumerate(v)]
        return list(v)  # the capture fingerprint: the peer configured the same runner


class ScalarOnlyGroup:
    """A group with only the scalar collectives (an older third-party group)."""

    rank, size = 0, 2

    def __init__(self, peer_batch):
        self.calls, self.peer_batch = [], peer_batch

    def barrier(self, **kw):
        pass

    def all_max(self, v, **kw):
        self.calls.append(("all_max", kw.get("phase"), v))
        return max(v, self.peer_batch) if kw.get("phase") == "runner_agree" and v > 1 else v

    def all_min(self, v, **kw):  # pragma: no cover - the runner only takes maxima
        raise AssertionError("the runner agrees with maxima only")


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
    assert g.calls == [("all_max_vector", "runner_agree", [2, 0])]
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
    assert g.calls == [("all_max_vector", "runner_agree", [0, 1])]


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
    assert g.calls == [("all_max", "runner_agree", 2), ("all_max", "runner_agree", 0)]
    assert r.stats.last_bucket == 8


def test_agreement_below_own_size_raises():
    class Shrinking(RecordingGroup):
        def all_max_vector(self, v, **kw):
            out = super().all_max_vector(v, **kw)
            return [1, out[1]] if kw.get("phase") == "runner_agree" else out

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
