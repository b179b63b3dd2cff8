"""Debug-mode contracts (graphrunner.checks.contracts): input bounds and stable externals, with negative controls."""

import pytest
import torch
from extras_util import require

import graphrunner as gr
from graphrunner.checks.contracts import debug_enabled

H, SLOTS = 4, 8


class Decoder(torch.nn.Module):
    """A toy step with a weight and a KV-like cache it writes at slot indices."""

    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.proj = torch.nn.Linear(H, H)
        with torch.no_grad():
            self.proj.weight.copy_(torch.randn(H, H, generator=g))
        self.cache = torch.zeros(SLOTS, H)  # a plain tensor attribute, not a buffer

    def step(self, x, slot):
        self.cache.index_copy_(0, slot, x)
        return self.proj(x) + self.cache[:4].sum(0)

    def eager(self, x, slot):
        with torch.no_grad():
            c = self.cache.clone()
            c.index_copy_(0, slot, x)
            return self.proj(x) + c[:4].sum(0)


def _runner(m, **kw):
    return gr.GraphRunner(
        m.step,
        inputs={
            "x": gr.BatchInput(trailing=(H,), pad=0.0),
            "slot": gr.BatchInput(dtype=torch.long, pad=SLOTS - 1, bounds=(0, SLOTS - 1)),
        },
        buckets=[2, 4],
        device="tape",
        progress=False,
        **kw,
    )


def _batch(seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(3, H, generator=g), torch.tensor([0, 1, 2])


def test_debug_flag_and_env(monkeypatch):
    monkeypatch.delenv("GRAPHRUNNER_DEBUG", raising=False)
    assert debug_enabled(None) is False and debug_enabled(True) is True
    monkeypatch.setenv("GRAPHRUNNER_DEBUG", "1")
    assert debug_enabled(None) is True and debug_enabled(False) is False
    assert _runner(Decoder()).debug is True
    with pytest.raises(TypeError, match="debug must be"):
        debug_enabled("yes")


@pytest.mark.parametrize("env", ["1", "0"], ids=["debug", "negative-control-off"])
def test_the_debug_switch_runs_the_bounds_check_before_the_step(monkeypatch, env):
    """REVIEW item 8: GRAPHRUNNER_DEBUG=1 (no debug= argument) does run a debug check: a slot index out
    of its bounds is refused before the step with a ValueError naming the input, the row and the
    value; nothing ran (no replay, the cache as before) and the next call is served. Negative
    control: with GRAPHRUNNER_DEBUG=0 nothing checks it first: the call reaches the replay, where
    the step's own index_copy_ fails on it (an IndexError raised by the replay)."""
    monkeypatch.setenv("GRAPHRUNNER_DEBUG", env)
    m = Decoder()
    r = _runner(m)
    r.capture()
    assert r.debug is (env == "1")
    x, slot = _batch()
    torch.testing.assert_close(r(x=x, slot=slot), m.eager(x, slot))
    before, replays = m.cache.clone(), dict(r.stats.replays)
    bad = torch.tensor([0, 9, 2])
    if env == "1":
        with pytest.raises(ValueError, match=r"input 'slot' row 1 holds 9, outside its bounds \[0, 7\]") as err:
            r(x=x, slot=bad)
        assert "raised by the replay" not in str(err.value)
        assert torch.equal(m.cache, before) and r.stats.replays == replays  # refused before the step
    else:
        with pytest.raises(IndexError, match="out of bounds") as err:
            r(x=x, slot=bad)
        assert "raised by the replay of bucket 4" in "\n".join(getattr(err.value, "__notes__", []))
    torch.testing.assert_close(r(x=x, slot=slot), m.eager(x, slot))  # still served


@pytest.mark.parametrize("value", ["2", "debug", "enabled", "On please"])
def test_a_debug_switch_value_not_understood_is_refused_not_read_as_off(monkeypatch, value):
    """Issue 42 item 5: GRAPHRUNNER_DEBUG is spelled like GRAPHRUNNER_DISABLE; a value it does not
    understand raises naming the value and what to set (it silently meant off)."""
    monkeypatch.setenv("GRAPHRUNNER_DEBUG", value)
    with pytest.raises(ValueError, match=rf"GRAPHRUNNER_DEBUG={value!r} is not understood: set it to 1"):
        debug_enabled(None)
    with pytest.raises(ValueError, match="GRAPHRUNNER_DEBUG"):
        _runner(Decoder())
    assert debug_enabled(False) is False  # an explicit debug= does not read it
    for on in ("1", " TRUE ", "yes", "on"):
        monkeypatch.setenv("GRAPHRUNNER_DEBUG", on)
        assert debug_enabled(None) is True
    for off in ("", "0", "False", "no", "off"):
        monkeypatch.setenv("GRAPHRUNNER_DEBUG", off)
        assert debug_enabled(None) is False


def test_bounds_spec_is_validated():
    # a pad outside the real range is a scratch value (a dedicated cache slot): allowed since issue 21
    assert gr.BatchInput(dtype=torch.long, pad=8, bounds=(0, 7)).bounds == (0, 7)
    with pytest.raises(ValueError, match="lo > hi"):
        gr.BatchInput(dtype=torch.long, bounds=(3, 1))
    with pytest.raises(TypeError, match="pair"):
        gr.BatchInput(dtype=torch.long, bounds=5)
    assert gr.BatchInput(dtype=torch.long, bounds=(0, None)).bounds == (0, None)


def test_out_of_bounds_index_raises_before_replay_naming_input_row_value():
    m = Decoder()
    r = _runner(m, debug=True)
    r.capture()
    x, slot = _batch()
    torch.testing.assert_close(r(x=x, slot=slot), m.eager(x, slot))
    replays = dict(r.stats.replays)
    before = m.cache.clone()
    with pytest.raises(ValueError, match=r"input 'slot' row 1 holds 9, outside its bounds \[0, 7\]"):
        r(x=x, slot=torch.tensor([0, 9, 2]))
    assert r.stats.replays == replays and torch.equal(m.cache, before)  # nothing ran
    torch.testing.assert_close(r(x=x, slot=slot), m.eager(x, slot))  # still usable


def test_lookup_index_bounds_and_negative_control():
    table = torch.randn(10, H)

    def step(ids):
        return table[ids] * 2

    def build(debug):
        r = gr.GraphRunner(
            step,
            inputs={"ids": gr.BatchInput(dtype=torch.long, pad=0, bounds=(0, 9))},
            buckets=[4],
            device="tape",
            progress=False,
            debug=debug,
        )
        r.capture()
        return r

    ids = torch.tensor([1, -1, 2])
    with pytest.raises(ValueError, match=r"input 'ids' row 1 holds -1"):
        build(True)(ids=ids)
    out = build(False)(ids=ids)  # without debug: no error ...
    torch.testing.assert_close(out[1], table[9] * 2)  # ... row 1 silently reads the last row of the table
    with pytest.raises((IndexError, RuntimeError)) as ei:  # past the end: the engine's own error, its own type,
        build(False)(ids=torch.tensor([1, 10, 2]))  # explained in a note (issue 33, 42): the input, the row, debug mode
    notes = "\n".join(getattr(ei.value, "__notes__", []))
    assert "input 'ids' row 1 holds 10" in notes and "debug=True" in notes
    assert not isinstance(ei.value, gr.GraphRunnerError)


def test_multi_dim_bounds_name_the_index_tuple():
    def step(ids):
        return ids.float() * 2

    r = gr.GraphRunner(
        step,
        inputs={"ids": gr.BatchInput(dtype=torch.long, pad=0, bounds=(0, 5), dims=("r", "d"))},
        buckets={"r": [2], "d": [3]},
        device="tape",
        progress=False,
        debug=True,
    )
    r.capture()
    with pytest.raises(ValueError, match=r"input 'ids' row \(1, 2\) holds 6"):
        r(ids=torch.tensor([[0, 1, 2], [3, 4, 6]]))


def test_rebound_weight_raises_naming_module_path_and_control():
    m = Decoder()
    r = _runner(m, debug=True)
    r.capture()
    x, slot = _batch()
    m.proj.weight = torch.nn.Parameter(torch.randn(H, H))
    with pytest.raises(gr.ContractError, match=r"self\.proj\.weight .*re-bound"):
        r(x=x, slot=slot)

    m2 = Decoder()
    r2 = _runner(m2, debug=False)
    r2.capture()
    m2.proj.weight = torch.nn.Parameter(torch.randn(H, H))
    out = r2(x=x, slot=slot)  # no error ...
    assert (out - m2.eager(x, slot)).abs().max() > 0.1  # ... and silently the old weight


def test_reallocated_cache_raises_and_control():
    m = Decoder()
    r = _runner(m, debug=True)
    rep = r.capture()
    assert {"path": "self.cache", "shape": [SLOTS, H], "dtype": "float32"} in rep.externals_written
    assert "self.proj.weight" not in str(rep.externals_written)
    assert "externals the graphs write (debug): self.cache [8, 4] float32" in rep.table()
    x, slot = _batch()
    m.cache = torch.zeros(2 * SLOTS, H)  # "grow the cache"
    with pytest.raises(gr.ContractError, match=r"self\.cache \(\[8, 4\].*now \[16, 4\]"):
        r(x=x, slot=slot)

    m2 = Decoder()
    r2 = _runner(m2)
    r2.capture()
    m2.cache = torch.zeros(2 * SLOTS, H)
    r2(x=x, slot=slot)
    assert torch.equal(m2.cache, torch.zeros(2 * SLOTS, H))  # the graph silently wrote the old cache


def test_cache_resized_in_place_is_caught():
    m = Decoder()
    r = _runner(m, debug=True)
    r.capture()
    m.cache.resize_(SLOTS * 2, H)
    with pytest.raises(gr.ContractError, match="changed in place"):
        r(x=_batch()[0], slot=torch.tensor([0, 1, 2]))


def test_closure_and_global_tensors_are_named():
    w = torch.randn(H, H)

    def step(x):
        return x @ w

    r = gr.GraphRunner(
        step, inputs={"x": gr.BatchInput(trailing=(H,))}, buckets=[2], device="tape", progress=False, debug=True
    )
    r.capture()
    assert [e.path for e in r.server.externals.guard.per_key[2]] == ["w"]
    with torch.no_grad():
        w.copy_(torch.randn(H, H))  # in place: allowed, and replays see it
    x = torch.randn(2, H)
    torch.testing.assert_close(r(x=x), x @ w)


def test_debug_off_records_nothing():
    m = Decoder()
    r = _runner(m)
    rep = r.capture()
    assert rep.externals_written is None and r.server.externals is None


@pytest.mark.hf
def test_hf_decode_runner_in_debug_mode_names_weights_and_cache(monkeypatch):
    require("transformers")
    from test_hf import BUCKETS, MAX_BATCH, MAX_CACHE_LEN, NEW_TOKENS, build_model, prompts, reference

    def build(debug):
        monkeypatch.setenv("GRAPHRUNNER_DEBUG", "1" if debug else "0")
        model = build_model("llama")
        runner = gr.hf.DecodeRunner(
            model, max_batch=MAX_BATCH, max_cache_len=MAX_CACHE_LEN, buckets=BUCKETS, backend="full", device="auto"
        )
        return model, runner, runner.capture()

    model, runner, rep = build(True)
    assert runner.runner.debug
    written = [e["path"] for e in rep.externals_written]
    assert "self.cache.layers[0].keys" in written and "self.cache.layers[1].values" in written
    assert not any("weight" in p for p in written)
    ids = prompts(3, seed=3)
    assert torch.equal(runner.generate(ids, max_new_tokens=NEW_TOKENS), reference(model, ids))  # no false alarm
    layer = model.model.layers[0].mlp.down_proj
    layer.weight = torch.nn.Parameter(torch.randn_like(layer.weight))
    with pytest.raises(gr.ContractError, match=r"model\.model\.layers\.0\.mlp\.down_proj\.weight"):
        runner.generate(ids, max_new_tokens=NEW_TOKENS)

    model, runner, rep = build(False)  # negative control: debug off
    assert rep.externals_written is None
    layer = model.model.layers[0].mlp.down_proj
    layer.weight = torch.nn.Parameter(torch.randn_like(layer.weight) * 10)
    assert not torch.equal(runner.generate(ids, max_new_tokens=NEW_TOKENS), reference(model, ids))  # silently stale


def _bounds_error_without_nan(name, t, bounds, lead):
    """bounds_error as it was before issue 21: only ``t < lo`` / ``t > hi`` (False for NaN)."""
    lo, hi = bounds
    bad = (t < lo) if lo is not None else torch.zeros_like(t, dtype=torch.bool)
    if hi is not None:
        bad = bad | (t > hi)
    if not bool(bad.any()):
        return None
    return ValueError(f"GraphRunner (debug): input {name!r} out of bounds")  # (not reached for NaN)


def test_nan_in_a_bounded_float_input_is_out_of_bounds_and_negative_control(monkeypatch):
    from graphrunner.checks import contracts

    def step(x):
        return x * 2 + 1

    def build():
        r = gr.GraphRunner(
            step,
            inputs={"x": gr.BatchInput(trailing=(H,), pad=0.0, bounds=(-10.0, 10.0))},
            buckets=[4],
            device="tape",
            progress=False,
            debug=True,
        )
        r.capture()
        return r

    x = torch.randn(3, H)
    x[1, 2] = float("nan")
    # the function itself: NaN lies in no range
    err = contracts.bounds_error("x", x, (-10.0, 10.0), 1)
    assert err is not None and "input 'x' row 1 (cell (1, 2)) holds nan" in str(err)
    assert contracts.bounds_error("x", x, (None, None), 1) is None  # no bounds declared: not checked
    assert contracts.bounds_error("x", torch.randn(3, H), (-10.0, 10.0), 1) is None
    r = build()
    replays = dict(r.stats.replays)
    with pytest.raises(ValueError, match=r"input 'x' row 1 \(cell \(1, 2\)\) holds nan, outside its bounds"):
        r(x=x)
    assert r.stats.replays == replays  # nothing ran
    ok = torch.randn(3, H)
    torch.testing.assert_close(r(x=ok), step(ok))  # still usable
    # negative control: the old comparisons (t < lo, t > hi) let the NaN through into the graph
    monkeypatch.setattr(contracts, "bounds_error", _bounds_error_without_nan)
    out = build()(x=x)
    assert out[1, 2].isnan()
