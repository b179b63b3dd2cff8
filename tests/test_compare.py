"""runner.compare(**inputs): the graph against eager PyTorch on the same inputs, localised to an op and a line.

References are independent: eager PyTorch on cloned state, and the marker
comments of this file for the expected lines. Negative controls: the
divergences below replay silently wrong without compare (no error at
capture or call), and without the state restore a compare would advance
the cache.
"""

import inspect

import pytest
import torch
from torch import nn

import graphrunner as gr
from graphrunner.errors import CaptureError
from graphrunner.recording.ops import WriteGuard

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _line(obj, marker: str) -> int:
    lines, start = inspect.getsourcelines(obj)
    return start + next(i for i, text in enumerate(lines) if f"# {marker}" in text)


class Mlp(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        h = torch.relu(self.a(x))
        return self.b(h) * 2  # second linear


class Cached(nn.Module):
    """Adds each call's activations into a cache and counts calls in a tensor."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(8, 8)
        self.register_buffer("cache", torch.zeros(4, 8))
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def forward(self, x):
        h = self.a(x)
        self.cache[: x.shape[0]].add_(h)
        self.calls.add_(1)
        return self.cache[: x.shape[0]] * self.calls


def _runner(step, trailing=8, backend="full", buckets=(2, 4)):
    r = gr.GraphRunner(
        step, {"x": gr.BatchInput(trailing=(trailing,))}, buckets=list(buckets), backend=backend, progress=False
    )
    r.capture()
    return r


@pytest.mark.parametrize("backend", ["full", "breakable"])
def test_unchanged_runner_is_equal(backend):
    r = _runner(Mlp().eval(), backend=backend)
    rep = r.compare(x=torch.randn(3, 8))
    assert rep.equal and rep.max_abs_diff == 0.0 and rep.bucket == 4 and rep.batch == 3
    assert str(rep).startswith("equal:")


def test_weight_rebound_after_capture_is_localised_to_its_line():
    m = Mlp().eval()
    r = _runner(m)
    x = torch.randn(3, 8)
    m.b.weight = nn.Parameter(torch.randn(8, 8))
    with torch.inference_mode():
        want = m(x)
        stale = r(x=x).clone()  # negative control: the call raises nothing and returns the stale result
    assert not torch.allclose(stale, want)
    rep = r.compare(x=x)
    assert not rep.equal
    assert rep.where[0] == __file__ and rep.where[1] == _line(Mlp.forward, "second linear")
    assert rep.context == "graph segment 1" and rep.op in ("aten.linear", "aten.addmm")
    assert rep.max_abs_diff == pytest.approx(float((stale - want).abs().max()), rel=1e-6)
    assert rep.op_diff > 0 and rep.output == "output"
    text = str(rep)
    assert f"{__file__}:{rep.where[1]}" in text and "re-bound" in text


class Scaled:
    """Counts calls in segment Python code, which at replay does not run; the eager break reads the count."""

    def __init__(self):
        self.calls = 0

        @gr.no_graph
        def scale(h):
            return h * self.calls  # eager break

        self.scale = scale

    def step(self, x):
        self.calls += 1
        return self.scale(x * 2) + 1


def test_eager_break_relying_on_a_capture_time_value_is_localised():
    s = Scaled()
    r = _runner(s.step, trailing=4, backend="breakable", buckets=[2])
    x = torch.ones(2, 4)
    calls_at_capture = s.calls
    got = r(x=x).clone()  # negative control: capture (drift check on) and call raise nothing
    assert torch.equal(got, x * 2 * calls_at_capture + 1)  # the segment's `calls += 1` did not run
    rep = r.compare(x=x)
    assert not rep.equal
    assert rep.context.startswith("eager break") and "scale" in rep.context
    assert rep.where[1] == _line(Scaled.__init__, "eager break") and rep.op == "aten.mul"
    assert rep.op_diff == 2.0  # 2 * (calls + 1) against 2 * calls
    assert "eager break" in str(rep) and f":{rep.where[1]} in scale" in str(rep)


def test_state_the_step_writes_is_restored():
    m = Cached().eval()
    r = _runner(m)
    x = torch.randn(3, 8)
    cache, calls = m.cache.clone(), m.calls.clone()
    rep = r.compare(x=x)
    assert rep.equal
    assert torch.equal(m.cache, cache) and torch.equal(m.calls, calls)
    assert "(4, 8) torch.float32" in rep.restored and "() torch.int64" in rep.restored
    # the runner still serves: a smaller batch after compare equals eager on a copy of the state
    ref = Cached().eval()
    ref.load_state_dict(m.state_dict())
    y = torch.randn(1, 8)
    with torch.inference_mode():
        want = ref(torch.cat([y, torch.zeros(1, 8)]))[:1]  # bucket 2, padded with zeros
    assert torch.equal(r(x=y), want)


def test_negative_control_without_restore_compare_advances_the_cache(monkeypatch):
    monkeypatch.setattr(WriteGuard, "restore", lambda self: None)
    m = Cached().eval()
    r = _runner(m)
    cache = m.cache.clone()
    r.compare(x=torch.randn(3, 8))
    assert not torch.equal(m.cache, cache)


def test_compare_errors():
    r = gr.GraphRunner(Mlp().eval(), {"x": gr.BatchInput(trailing=(8,))}, buckets=[2], progress=False)
    with pytest.raises(CaptureError, match="capture"):
        r.compare(x=torch.randn(2, 8))
    r.capture()
    with pytest.raises(ValueError, match="falls back"):
        r.compare(x=torch.randn(3, 8))
    with pytest.raises(ValueError, match=r"missing input\(s\) \[.x.\]"):  # the same error as a call
        r.compare(y=torch.randn(2, 8))


def test_compare_on_a_named_dims_runner_localises_the_stale_value():
    """compare stages through the runner's own stager, so it works for every key space (it raised
    ``key_for sizes (1,) must hold one int per dim`` on named dims before)."""
    w = torch.randn(4, 4)
    box = {"scale": 2.0}

    def step(tokens):  # (reqs, draft, 4) -> same; the Python float is frozen at capture
        return (tokens @ w) * box["scale"]  # stale scale

    r = gr.GraphRunner(
        step,
        {"tokens": gr.BatchInput(trailing=(4,), dims=("reqs", "draft"))},
        buckets={"reqs": [2, 4], "draft": [1, 3]},
        device="tape",
        progress=False,
    )
    r.capture()
    x = torch.randn(3, 2, 4)
    rep = r.compare(tokens=x)
    assert rep.equal and rep.bucket == (4, 3) and rep.batch == (3, 2)
    box["scale"] = 3.0  # eager now differs from the graph, which holds 2.0
    rep = r.compare(tokens=x)
    want = (x @ w) * 3.0
    got = r(tokens=x)
    assert not torch.equal(got, want)  # the silent wrong result compare explains
    assert rep.max_abs_diff == pytest.approx(float((got - want).abs().max()), rel=1e-6)
    assert rep.op is not None and rep.where[1] == _line(step, "stale scale")
    # the runner's static buffers and its padding are as before: the next call still equals the graph's math
    assert torch.equal(r(tokens=x), (x @ w) * 2.0)
