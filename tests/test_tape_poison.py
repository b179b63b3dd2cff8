"""Poisoned survivors: a TapeGraph that emulates what a CUDA capture leaves behind.

A CUDA capture launches nothing, so until the first replay every tensor a
capture produced holds uninitialised pool memory. With
``poison_captured_values`` a tape graph fills those survivors with a poison
value at capture end (NaN / the integer maximum / True), so code that reads
them before the first replay (an eager break of a breakable capture, a check
of capture-time outputs) fails on CPU as it would on a GPU. Replay is
unaffected. Every check runs against eager on real values, with negative
controls showing the option is what makes the difference.
"""

from __future__ import annotations

import io
import warnings

import pytest
import torch

import graphrunner as gr
import graphrunner_tools.demo as demo
from graphrunner.devices import TapeDevice, get_device
from graphrunner.tape import POISON_ENV_VAR, TapeGraph, poison_default, poison_value, tape_graph
from graphrunner_tools.models import llama


@pytest.fixture(autouse=True)
def _no_env_poison(monkeypatch):
    """These tests choose poisoning explicitly; the suite-wide switch must not interfere."""
    monkeypatch.delenv(POISON_ENV_VAR, raising=False)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32) if t.dtype == torch.float32 else t


def _step(x, w):
    """A step with float, int, bool survivors, a survivor view and a constant."""
    h = x @ w
    idx = (x.abs() * 3).long()  # int64 survivor
    big = h > 0  # bool survivor
    row = h[1]  # a view: poisons (and refreshes) its base h
    ar = torch.arange(4)  # a constant the tape computes once at capture
    return h, idx, big, row, ar


# ---------------------------------------------------------------------------
# values


def test_poison_value_per_dtype():
    assert poison_value(torch.float32) != poison_value(torch.float32)  # NaN
    assert poison_value(torch.bfloat16) != poison_value(torch.bfloat16)
    assert poison_value(torch.int64) == torch.iinfo(torch.int64).max
    assert poison_value(torch.int32) == torch.iinfo(torch.int32).max
    assert poison_value(torch.uint8) == 255
    assert poison_value(torch.bool) is True


@pytest.mark.parametrize("inference", [True, False])
def test_survivors_hold_poison_after_capture_and_eager_values_after_replay(inference):
    w = torch.randn(4, 4)
    x = torch.randn(4, 4)
    g = TapeGraph(poison_captured_values=True)
    with torch.inference_mode(inference), torch.no_grad(), tape_graph(g):
        h, idx, big, row, ar = _step(x, w)
    # what a GPU would show before the first replay: garbage, here poison
    assert torch.isnan(h).all() and torch.isnan(row).all()
    assert (idx == torch.iinfo(torch.int64).max).all()
    assert big.all()
    assert (ar == torch.iinfo(torch.int64).max).all()
    # replay recomputes every survivor: bit-exact with eager on new inputs
    for _ in range(2):
        x.copy_(torch.randn(4, 4))
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # poisoning is not an outside write (no EscapedTensorWarning)
            g.replay()
        with torch.inference_mode(inference), torch.no_grad():
            ref = _step(x, w)
        for got, want in zip((h, idx, big, row, ar), ref):
            assert got.dtype == want.dtype and torch.equal(_bits(got), _bits(want))


def test_without_poisoning_survivors_hold_capture_time_values():
    """Negative control: the default tape leaves real values (what the option exists to hide)."""
    w, x = torch.randn(4, 4), torch.randn(4, 4)
    g = TapeGraph(poison_captured_values=False)
    with torch.inference_mode(), tape_graph(g):
        got = _step(x, w)
    with torch.inference_mode():
        ref = _step(x, w)
    for a, b in zip(got, ref):
        assert torch.equal(a, b)


def test_externals_are_never_poisoned():
    w = torch.randn(4, 4)
    x = torch.randn(4, 4)
    cache = torch.randn(4, 4)
    w0, x0, cache0 = w.clone(), x.clone(), cache.clone()
    g = TapeGraph(poison_captured_values=True)
    with torch.inference_mode(), tape_graph(g):
        h = x @ w
        cache.copy_(h)  # a write to an external: undone at capture end, as before
        view = x[1:]  # a view of an external survives with the external's storage
    assert torch.equal(w, w0) and torch.equal(x, x0) and torch.equal(cache, cache0)
    assert torch.equal(view, x0[1:])
    assert torch.isnan(h).all()
    g.replay()
    assert torch.equal(cache, x0 @ w0) and torch.equal(h, x0 @ w0)


# ---------------------------------------------------------------------------
# switches


def test_device_flag_reaches_every_graph_it_makes(monkeypatch):
    monkeypatch.delenv("GRAPHRUNNER_TAPE_JIT", raising=False)  # the repr names a jit_replay=False device
    on, off = TapeDevice(poison_captured_values=True), TapeDevice()
    assert on.poison_captured_values and on.new_graph().poison_captured_values
    assert not off.poison_captured_values and not off.new_graph().poison_captured_values
    assert repr(on) == "TapeDevice('cpu', poison_captured_values=True)" and repr(off) == "TapeDevice('cpu')"
    with pytest.raises(TypeError, match="poison_captured_values"):
        TapeDevice(poison_captured_values=1)
    assert TapeDevice(jit_replay=False).new_graph().jit_replay is False
    assert repr(TapeDevice(jit_replay=False)) == "TapeDevice('cpu', jit_replay=False)"
    with pytest.raises(TypeError, match="jit_replay"):
        TapeDevice(jit_replay=1)
    with pytest.raises(TypeError, match="poison_captured_values"):
        TapeGraph(poison_captured_values="yes")


def test_environment_variable_sets_the_default(monkeypatch):
    assert poison_default() is False
    for v in ("1", "true", "ON", " yes "):
        monkeypatch.setenv(POISON_ENV_VAR, v)
        assert poison_default() is True
        assert TapeDevice().poison_captured_values and TapeGraph().poison_captured_values
        assert get_device("tape").poison_captured_values
        assert gr.BreakableGraph(device="tape").device.new_graph().poison_captured_values
        # an explicit value wins over the environment
        assert not TapeDevice(poison_captured_values=False).new_graph().poison_captured_values
    for v in ("0", "", "false", "off", "No"):
        monkeypatch.setenv(POISON_ENV_VAR, v)
        assert poison_default() is False and not TapeDevice().poison_captured_values
    monkeypatch.setenv(POISON_ENV_VAR, "maybe")
    with pytest.raises(ValueError, match=POISON_ENV_VAR):
        TapeDevice()
    assert TapeDevice(poison_captured_values=True).poison_captured_values  # explicit: env not read


# ---------------------------------------------------------------------------
# breakable graphs: the eager break sees what a GPU would give it


TABLE = torch.randn(16, 8)


@gr.no_graph
def _lookup(idx):
    """An eager break that uses a segment's output as an index."""
    return TABLE[idx.long()]


def _index_step(x):
    idx = (x * 2).long()  # segment: an int64 result read by the break
    return _lookup(idx) * 3  # break, then a segment


@pytest.mark.parametrize("poison", [True, False])
def test_break_indexing_with_a_segment_output(poison):
    x = torch.tensor([1.0, 3.0, 5.0])
    graph = gr.BreakableGraph(device=TapeDevice(poison_captured_values=poison))
    if poison:
        # on a GPU the break reads an uninitialised index: a device-side assert
        with pytest.raises((IndexError, RuntimeError), match="out of"):
            with torch.inference_mode(), gr.breakable_graph(graph):
                _index_step(x)
        assert not graph.captured
    else:
        # negative control: the plain tape computed the index at capture, so it passes
        with torch.inference_mode(), gr.breakable_graph(graph):
            out = _index_step(x)
        x.copy_(torch.tensor([2.0, 0.0, 7.0]))
        graph.replay()
        with torch.inference_mode():
            assert torch.equal(out, _index_step(x))


@gr.no_graph
def _double(h):
    return h * 2


def _reuse_step(x, table):
    idx = (x + 1).long()  # segment 1
    h = _double(table.index_select(0, idx))  # break: reads poison (floats), harmless
    return h + table.index_select(0, idx)  # segment 2 indexes with idx again


def test_later_segment_captures_compute_on_real_values():
    """A segment reading an earlier segment's poisoned survivor does not fail at
    capture: a CUDA capture never computes, so the tape gives the survivor its
    real values while it captures (and poisons it again after)."""
    x, table = torch.tensor([1.0, 4.0, 7.0]), torch.randn(10, 3)
    graph = gr.BreakableGraph(device=TapeDevice(poison_captured_values=True))
    with torch.inference_mode(), gr.breakable_graph(graph):
        out = _reuse_step(x, table)
    assert graph.num_segments == 2 and torch.isnan(out).all()
    for new in ([0.0, 2.0, 8.0], [3.0, 3.0, 1.0]):
        x.copy_(torch.tensor(new))
        graph.replay()
        with torch.inference_mode():
            assert torch.equal(out, _reuse_step(x, table))


# ---------------------------------------------------------------------------
# the demo decoder through GraphRunner


def _run_demo(poison: bool, **kw):
    out = io.StringIO()
    result = demo.run_demo(
        backend="breakable",
        device=TapeDevice(poison_captured_values=poison),
        steps=6,
        buckets=(1, 2, 4),
        max_batch=5,
        layers=kw.pop("layers", 1),
        trace_out=None,
        progress=False,
        out=out,
        **kw,
    )
    return result, out.getvalue()


def test_demo_passes_with_poisoning_and_its_attention_break_sees_poison(monkeypatch):
    """The demo decoder writes K/V inside its graph segments and only reads the
    cache in the varlen attention break, so nothing it serves depends on
    capture-time values; the break does receive poisoned queries."""
    seen = []
    real = llama.varlen_attention.__wrapped__

    @gr.no_graph
    def spy(q, *args):
        if gr.breakable.is_in_breakable_graph():
            seen.append(bool(torch.isnan(q).all()))
        return real(q, *args)

    monkeypatch.setattr(llama, "varlen_attention", spy)
    result, text = _run_demo(True, layers=2)
    assert result.ok, text
    assert seen and all(seen)  # 3 buckets x 2 layers, each saw only NaN queries at capture


def _write_kv_in_break(monkeypatch):
    """Patch the demo decoder to write K/V inside the attention break (as
    engines whose attention op also fills the cache do) and record whether
    the cache held NaN when the demo reset it after capture."""

    @gr.no_graph
    def write_kv_and_attend(attn, q, k, v, positions, slot_ids, attn_positions):
        rows = slot_ids if slot_ids is not None else torch.arange(q.shape[0])
        heads = torch.arange(attn.num_kv_heads)
        index = (rows[:, None, None], heads[None, None, :], positions[:, :, None])
        attn.k_cache.index_put_(index, k.to(attn.k_cache.dtype))
        attn.v_cache.index_put_(index, v.to(attn.v_cache.dtype))
        return llama.varlen_attention(q, attn.k_cache, attn.v_cache, attn_positions, slot_ids)

    def forward(self, x, cos, sin, positions, rows, slot_ids, attn_positions):
        b, t, _ = x.shape
        q, k, v = self._project(x, cos, sin)
        out = write_kv_and_attend(self, q, k, v, positions, slot_ids, attn_positions)
        return self.o_proj(out.reshape(b, t, self.num_heads * self.head_dim))

    monkeypatch.setattr(llama.LlamaAttention, "forward", forward)
    seen = {}
    real_build = demo.build_model

    def build(*args, **kwargs):
        model = real_build(*args, **kwargs)
        reset = model.reset_cache

        def recording_reset():
            seen["nan_in_cache_after_capture"] = any(bool(torch.isnan(t).any()) for t in model.kv_cache_tensors())
            if not seen.get("skip_reset"):
                reset()

        model.reset_cache = recording_reset
        return model

    monkeypatch.setattr(demo, "build_model", build)
    return seen


def test_demo_kv_written_in_break_is_garbage_until_reset(monkeypatch):
    seen = _write_kv_in_break(monkeypatch)
    result, text = _run_demo(True)
    assert seen["nan_in_cache_after_capture"]  # the break wrote poisoned K/V, as garbage on a GPU
    assert result.ok, text  # reset_cache() after capture: replays equal eager


def test_demo_kv_written_in_break_without_reset_reports_mismatches(monkeypatch):
    """Negative control: with reset_cache() a no-op, the poisoned K/V stay in
    the cache, later steps attend to them, and the demo reports it."""
    seen = _write_kv_in_break(monkeypatch)
    seen["skip_reset"] = True
    result, text = _run_demo(True)
    assert seen["nan_in_cache_after_capture"]
    assert not result.ok and result.graph_mismatches > 0, text
    assert "demo: FAILED" in text


def test_demo_kv_written_in_break_without_reset_passes_on_a_plain_tape(monkeypatch):
    """Negative control for the option: without poisoning the same missing
    reset goes unnoticed on CPU (the capture wrote real K/V), as it would not on a GPU."""
    seen = _write_kv_in_break(monkeypatch)
    seen["skip_reset"] = True
    result, text = _run_demo(False)
    assert not seen["nan_in_cache_after_capture"]
    assert result.ok, text
