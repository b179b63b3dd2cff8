"""No silent wrong result across calls (issue 33): reproductions 1, 2, 3, 4 and 8, as tests.

Each reproduction either raises at capture naming the cause, or (its fix) replays exactly like eager
PyTorch for 20 calls; each has a negative control: with the check off the runner returns something
else than eager. References are eager twins (same weights, same starting state, no graph, no
padding) served the same calls.

1. A per-slot state (``self.state[slots] = h``) whose slot input pads with 0, a real slot: padding
   rows overwrite slot 0's state, which the request in slot 0 reads at its next call. Caught by the
   padding check's call sequences (a call after a padded call against the same call after the
   unpadded one).
2. The same state re-bound instead of written in place (``self.state = self.state.index_copy(...)``):
   every replay reads the tensor the capture froze. Caught by the stashed-state check.
3. The pad value as the winner: a padding row's id scores highest and wins a max over the batch.
   Caught by the padding check's runs without a real cell at the pad value.
4. A Python counter (drift) or a re-bound state next to a mean over the batch: the padding check's runs
   all start from the same Python state (:class:`~graphrunner.checks.padding.PythonNumbers`), so
   ``graphrunner check`` reports both findings instead of the first one hiding the leak.
8. A leak of a few percent in a small channel of a bfloat16 step, inside a tolerance that was 5% of
   the output's largest value. Caught by a tolerance that admits last-bit noise only.
"""

import inspect
import textwrap

import pytest
import torch

import graphrunner as gr
from graphrunner.checks import leak_runs as padding
from graphrunner.checks import tolerance
from graphrunner.checks.leak_check import LeakCheck
from graphrunner.checks.tolerance import Noise, difference
from graphrunner.tape import StashedTensorWarning

pytestmark = pytest.mark.usefixtures("one_torch_thread")

H = 4
SLOTS = 8
BUCKETS = [1, 2, 4, 8]
NO_PADDING_CHECK = ("drift", "fingerprint")
NO_DRIFT_CHECK = ("padding", "fingerprint")
CALLS = 20


def _line(obj, marker):
    lines, start = inspect.getsourcelines(obj)
    return start + next(i for i, text in enumerate(lines) if f"# {marker}" in text)


def _weights(seed=0):
    return torch.randn(H, H, generator=torch.Generator().manual_seed(seed)) / H**0.5


def _calls(seed=1, n=CALLS):
    """``n`` calls of 1..7 requests, each in its own slot: a long request in slot 0 (row 0) at every call,
    the others in slots drawn from 1..7."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        b = int(torch.randint(1, SLOTS, (1,), generator=g))
        slots = torch.cat([torch.zeros(1, dtype=torch.long), torch.randperm(SLOTS - 1, generator=g)[: b - 1] + 1])
        out.append({"x": torch.randn(b, H, generator=g), "slots": slots})
    return out


def _serve(step, calls):
    with torch.no_grad():
        return [step(**c).clone() for c in calls]


def _wrong(got, want, atol=1e-5):
    """How many of the calls differ from eager (beyond float noise)."""
    return sum(not torch.allclose(a, b, atol=atol, rtol=1e-5) for a, b in zip(got, want))


def _slot_inputs(pad):
    return {"x": gr.BatchInput(trailing=(H,)), "slots": gr.BatchInput(dtype=torch.long, pad=pad, bounds=(0, SLOTS - 1))}


# ------------------------------------------------------------------------------ reproduction 1
class SlotState(torch.nn.Module):
    """A recurrent state per request slot, written in place at the rows' slots."""

    def __init__(self, rows=SLOTS):
        super().__init__()
        self.w = torch.nn.Parameter(_weights(), requires_grad=False)
        self.register_buffer("state", torch.zeros(rows, H))

    def forward(self, x, slots):
        h = torch.tanh(x @ self.w + self.state[slots] + 0.5)
        self.state[slots] = h  # padding rows write their pad slot too
        return h


def _served(make_model, pad, checks=None, calls=None):
    """Capture a runner over ``make_model()`` and serve ``calls``; an eager twin serves the same calls
    from the same starting state. Returns ``(graph outputs, eager outputs)``."""
    model, twin = make_model(), make_model()
    r = gr.GraphRunner(model, _slot_inputs(pad), BUCKETS, backend="full", device="tape", progress=False, checks=checks)
    r.capture()
    with torch.inference_mode():
        model.state.copy_(twin.state)  # what the capture's warmups wrote at the pad slot: gone
    calls = calls or _calls()
    return _serve(r, calls), _serve(twin, calls)


def test_repro1_pad_slot_that_is_a_real_slot_is_refused_naming_the_input_the_state_and_the_cells():
    with pytest.raises(gr.PaddingLeakError) as info:
        gr.GraphRunner(SlotState(), _slot_inputs(0), BUCKETS, backend="full", device="tape", progress=False).capture()
    msg = str(info.value)
    assert "in a call after a padded call" in msg
    assert "slots (pad 0, also a real value: bounds (0, 7))" in msg  # the input whose padding did it
    assert "the padding rows wrote SlotState.state[0, :]" in msg  # the written tensor and its cells
    assert "Pad 'slots' with a scratch index outside the real range" in msg


def test_repro1_negative_control_without_the_check_every_call_after_a_padded_one_is_wrong():
    got, want = _served(SlotState, pad=0, checks=NO_PADDING_CHECK)
    assert _wrong(got, want) >= CALLS // 2


def test_repro1_negative_control_the_single_call_check_alone_does_not_see_it(monkeypatch):
    """The check as it was before the call sequences (one padded call against one unpadded call) passes
    the step: what the padding rows write is read by the *next* call."""
    monkeypatch.setattr(LeakCheck, "_wants_sequences", lambda self: False)
    got, want = _served(SlotState, pad=0)
    assert _wrong(got, want) >= CALLS // 2


def test_repro1_fix_a_scratch_slot_replays_exactly_like_eager_for_20_calls():
    got, want = _served(lambda: SlotState(rows=SLOTS + 1), pad=SLOTS)  # slot 8: no request's
    assert _wrong(got, want, atol=0) == 0
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def _with_reset_hook(model, pad):
    """A runner whose post-warmup hook resets the state (a cache reset: the hook's documented use)."""

    def reset(_bucket):
        with torch.inference_mode():
            model.state.zero_()

    return gr.GraphRunner(
        model, _slot_inputs(pad), BUCKETS, backend="full", device="tape", progress=False, post_warmup_hook=reset
    )


def test_repro1_with_a_post_warmup_hook_that_resets_the_state_it_is_still_refused():
    """The hook runs after every warmup, so run A and its padded follow-up are not split by it (run A
    is then the last warmup and the follow-up runs right after it): the leak is still measured."""
    with pytest.raises(gr.PaddingLeakError, match="in a call after a padded call"):
        _with_reset_hook(SlotState(), pad=0).capture()


def test_repro1_fix_with_a_reset_hook_has_no_false_alarm_and_replays_like_eager():
    model, twin = SlotState(rows=SLOTS + 1), SlotState(rows=SLOTS + 1)
    _with_reset_hook(model, pad=SLOTS).capture()
    r = _with_reset_hook(model, pad=SLOTS)
    r.capture()
    calls = _calls()
    got, want = _serve(r, calls), _serve(twin, calls)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_repro1_fix_with_a_reset_hook_negative_control_a_sequence_split_by_the_hook_is_a_false_alarm(monkeypatch):
    """Were the sequence's two padded calls the last two warmups with the hook between them, the hook's
    reset would wipe what run A wrote before the follow-up, and the fixed step would be refused (with
    the confirmation of a finding from the first warmup off: it runs A and the follow-up again,
    back to back)."""
    monkeypatch.setattr(LeakCheck, "_a_index", staticmethod(lambda cap: cap.warmups - 2))
    original = LeakCheck.before_warmup

    def unconfirmed(self, cap, i):
        original(self, cap, i)
        self._a_first = False

    monkeypatch.setattr(LeakCheck, "before_warmup", unconfirmed)
    with pytest.raises(gr.PaddingLeakError):
        _with_reset_hook(SlotState(rows=SLOTS + 1), pad=SLOTS).capture()


# ------------------------------------------------------------------------------ reproduction 2
class Rebound(SlotState):
    """The same state, re-bound to a new tensor at every call instead of written in place."""

    def forward(self, x, slots):
        h = torch.tanh(x @ self.w + self.state[slots] + 0.5)
        self.state = self.state.index_copy(0, slots, h)  # re-bound
        return h


def test_repro2_rebound_state_is_refused_naming_the_attribute_the_line_and_the_remedy():
    r = gr.GraphRunner(Rebound(SLOTS + 1), _slot_inputs(SLOTS), BUCKETS, backend="full", device="tape", progress=False)
    with pytest.raises(gr.CaptureError) as info:
        r.capture()
    msg = str(info.value)
    assert "is kept in Rebound.state after it" in msg
    assert (
        f"assigned at {__file__}:{_line(Rebound, 're-bound')} in forward: "
        "`self.state = self.state.index_copy(0, slots, h)  # re-bound`" in msg
    )
    assert "self.state.index_copy_(0, slots, h)" in msg and "or return the tensor as an output" in msg
    assert not r.captured


def test_repro2_negative_control_without_the_check_every_replay_reads_the_frozen_state():
    with pytest.warns(StashedTensorWarning, match=r"Rebound\.state"):  # what the tape says by itself
        got, want = _served(lambda: Rebound(SLOTS + 1), pad=SLOTS, checks=NO_DRIFT_CHECK)
    assert _wrong(got, want) >= CALLS // 2


def test_repro2_the_breakable_backend_and_the_cuda_stand_in_refuse_it_too(cuda_standin):
    """The check watches the captured forward's ops, as every graph kind feeds them to the one op
    recorder: a breakable graph's segments, and a CUDA capture (here the stand-in's)."""
    for device, backend in (("tape", "breakable"), ("cuda", "full")):
        with pytest.raises(gr.CaptureError, match=r"is kept in Rebound\.state after it \(assigned at"):
            gr.GraphRunner(
                Rebound(SLOTS + 1), _slot_inputs(SLOTS), [2, 4], backend=backend, device=device, progress=False
            ).capture()


CHECKED = textwrap.dedent("""
    import torch
    import graphrunner as gr

    class Rebound(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(4, 4), requires_grad=False)
            self.register_buffer("state", torch.zeros(9, 4))

        def forward(self, x, slots):
            h = torch.tanh(x @ self.w + self.state[slots])
            self.state = self.state.index_copy(0, slots, h)  # re-bound
            return h

    def make():
        return gr.GraphRunner(Rebound(), {"x": gr.BatchInput(trailing=(4,)),
                                          "slots": gr.BatchInput(dtype=torch.long, pad=8, bounds=(0, 7))},
                              buckets=[2, 4], progress=False)
""")


def test_repro2_graphrunner_check_reports_it_as_a_finding(tmp_path, capsys):
    from graphrunner_tools.cli import main

    path = tmp_path / "rebound_step.py"
    path.write_text(CHECKED)
    line = next(i for i, text in enumerate(CHECKED.splitlines(), 1) if "# re-bound" in text)
    report = gr.check_factory(lambda: _load(path).make())
    stashed = [f for f in report.findings if f.kind == "stashed-state"]
    assert stashed and (stashed[0].file, stashed[0].line, stashed[0].function) == (str(path), line, "forward")
    assert "Rebound.state" in stashed[0].what and "in place" in stashed[0].fix
    assert main(["check", f"{path}:make"]) == 1
    assert "stashed-state" in capsys.readouterr().out


def _load(path):
    import importlib.util

    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class Normalized(torch.nn.Module):
    """A value computed inside the step and kept on ``self`` (re-bound every call), read only inside it."""

    def __init__(self, mark):
        super().__init__()
        self.w = torch.nn.Parameter(_weights(), requires_grad=False)
        self.mark = mark

    def forward(self, x):
        wn = self.w / self.w.norm(dim=0)
        self.wn = gr.checks.captured_cache(wn) if self.mark else wn
        return x @ self.wn


def test_repro2_a_deliberate_cache_is_let_through_when_marked():
    inputs = {"x": gr.BatchInput(trailing=(H,))}
    with pytest.raises(gr.CaptureError, match=r"kept in Normalized\.wn after it"):
        gr.GraphRunner(Normalized(False), inputs, [2, 4], device="tape", progress=False).capture()
    model = Normalized(True)
    r = gr.GraphRunner(model, inputs, [2, 4], device="tape", progress=False)
    r.capture()
    for x in (torch.randn(3, H), torch.randn(1, H), torch.randn(4, H)):
        torch.testing.assert_close(r(x=x), Normalized(True)(x))


# ------------------------------------------------------------------------------ reproduction 3
def _scorer(pad_row_wins):
    """``step(ids) -> ids whose score is the batch's highest``: id 0 scores highest (its embedding is the
    query, scaled), or, with ``pad_row_wins=False``, a dedicated padding id 10 scores lowest."""
    g = torch.Generator().manual_seed(3)
    q = torch.randn(H, generator=g)
    emb = torch.randn(11, H, generator=g) * 0.1
    emb[0] = q * 10
    emb[10] = -q * 10

    def step(ids):
        s = emb[ids] @ q
        return s == s.max(0).values  # the padding rows take part in the max

    return step


def _id_calls(n=CALLS, seed=4):
    g = torch.Generator().manual_seed(seed)
    return [
        {"ids": torch.randperm(9, generator=g)[: int(torch.randint(1, 8, (1,), generator=g))] + 1} for _ in range(n)
    ]  # real ids 1..9: never the winner 0


def _id_runner(step, pad, **kw):
    return gr.GraphRunner(
        step,
        {"ids": gr.BatchInput(dtype=torch.long, pad=pad, bounds=(0, 9))},
        BUCKETS,
        backend="full",
        device="tape",
        progress=False,
        **kw,
    )


def test_repro3_the_pad_value_as_the_winner_is_refused():
    with pytest.raises(
        gr.PaddingLeakError,
        match=r"against eager PyTorch on the same real batch without padding.*"
        r"wins a max.*ids \(pad 0\)",
    ):
        _id_runner(_scorer(True), 0).capture()


def test_repro3_negative_controls_without_the_check_or_with_a_real_cell_at_the_pad_it_replays_wrong(monkeypatch):
    step, calls = _scorer(True), _id_calls()
    r = _id_runner(step, 0, checks=NO_PADDING_CHECK)
    r.capture()
    got, want = _serve(r, calls), _serve(step, calls)
    assert sum(not torch.equal(a, b) for a, b in zip(got, want)) >= CALLS // 2  # padded calls: every flag 0
    # the old placement (one real cell always at the pad, which then ties with the padding row): accepted
    real = padding._distinct_ints
    monkeypatch.setattr(padding, "_distinct_ints", lambda lo, hi, shape, pad, g, at=0: real(lo, hi, shape, pad, g, 0))
    r = _id_runner(step, 0)
    r.capture()
    got = _serve(r, calls)
    assert sum(not torch.equal(a, b) for a, b in zip(got, want)) >= CALLS // 2


def test_repro3_fix_a_padding_id_that_never_wins_replays_exactly_like_eager_for_20_calls():
    step, calls = _scorer(False), _id_calls()
    r = _id_runner(step, 10)  # id 10: outside the real ids 0..9, scores lowest
    r.capture()
    assert all(torch.equal(a, b) for a, b in zip(_serve(r, calls), _serve(step, calls)))


# ------------------------------------------------------------------------------ reproduction 8
def _channels(dtype, leak):
    w = _weights(8).to(dtype)

    def step(x):
        h = x @ w
        small = h[:, 1:] - h[:, 1:].mean(0) if leak else h[:, 1:]  # the mean reads the padding rows
        return torch.cat([h[:, :1] * 30, small], 1)

    return step


DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def _x_runner(step, dtype, **kw):
    return gr.GraphRunner(
        step,
        {"x": gr.BatchInput(trailing=(H,), dtype=dtype, pad=0.0)},
        BUCKETS,
        backend="full",
        device="tape",
        progress=False,
        **kw,
    )


def _x_calls(dtype, n=CALLS, seed=5):
    g = torch.Generator().manual_seed(seed)
    return [{"x": torch.randn(int(torch.randint(1, 8, (1,), generator=g)), H, generator=g).to(dtype)} for _ in range(n)]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_repro8_a_leak_of_a_few_percent_in_a_small_channel_is_refused(dtype):
    with pytest.raises(gr.PaddingLeakError, match=r"output changed"):
        _x_runner(_channels(dtype, leak=True), dtype).capture()


def _old_tolerance(b, noise=None):
    """The tolerance before issue 33: 5% (at most 1024 eps) of the output's largest value, for every element."""
    eps = torch.finfo(b.dtype).eps
    scale = float(b.detach().abs().to(torch.float64).nan_to_num(0.0, 0.0, 0.0).max()) if b.numel() else 0.0
    return torch.full(b.shape, scale * min(0.05, 1024 * eps) + 1e-30, dtype=torch.float64)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_repro8_negative_control_the_old_tolerance_accepts_it_and_replays_differ_by_percents(dtype, monkeypatch):
    monkeypatch.setattr(tolerance, "admitted", _old_tolerance)  # where difference() reads it
    step, calls = _channels(dtype, leak=True), _x_calls(dtype)
    r = _x_runner(step, dtype)
    r.capture()
    worst = 0.0
    for c in calls:
        got, want = r(**c).float(), step(**c).float()
        small = (got[:, 1:] - want[:, 1:]).abs() / want[:, 1:].abs().mean()
        worst = max(worst, float(small.max()))
    assert worst > 0.05  # percents of the small channels' scale


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_repro8_fix_the_row_independent_step_replays_like_eager_for_20_calls(dtype):
    step, calls = _channels(dtype, leak=False), _x_calls(dtype)
    r = _x_runner(step, dtype)
    r.capture()
    for c in calls:
        got, want = r(**c), step(**c)
        assert difference(got, want, tolerant=Noise(reduction=H, matmuls=1)) is None


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_the_tolerance_admits_last_bits_and_not_a_few_percent(dtype):
    """Per element: a flip of the last bit passes, in a small channel next to a large one too; 3% of
    an element does not, in every dtype (the old tolerance let 5% of the largest value pass)."""
    g = torch.Generator().manual_seed(0)
    b = torch.randn(6, 8, generator=g).to(dtype)
    b[:, 0] *= 30
    eps = torch.finfo(dtype).eps
    last_bit = (b.to(torch.float64) * (1 + eps)).to(dtype)
    assert difference(last_bit, b, tolerant=True) is None
    assert difference(last_bit, b) is not None  # not bit-equal: the tolerance let it through
    leak = b.clone()
    leak[:, 3] = (b[:, 3].to(torch.float64) * 1.03 + 0.03 * b[:, 3].abs().mean()).to(dtype)
    assert difference(leak, b, tolerant=True) is not None
    if dtype != torch.float32:  # negative control: the old tolerance (5% of the largest value) admits it
        assert bool(((leak.double() - b.double()).abs() <= _old_tolerance(b)).all())


# ------------------------------------------------------------------------------ reproduction 4
class CountingLeak:
    """A Python call counter the graph freezes (drift) *and* a mean over the batch (a padding leak)."""

    def __init__(self, rebind=False):
        self.n = 0
        self.rebind = rebind
        self.state = torch.zeros(H)
        self.w = _weights()

    def __call__(self, x):
        if self.rebind:
            h = x @ self.w + self.state
            self.state = self.state + 1  # stashed state instead of the counter
        else:
            self.n += 1
            h = x @ self.w * self.n
        return h - h.mean(0)


def _findings(step):
    from graphrunner.checks.lint import check_factory

    def make():
        return gr.GraphRunner(
            step, {"x": gr.BatchInput(trailing=(H,))}, [2, 4], backend="full", device="tape", progress=False
        )

    return {f.kind for f in check_factory(make).findings}, make


@pytest.mark.parametrize("rebind", [False, True], ids=["counter", "rebound"])
def test_repro4_one_finding_does_not_hide_the_next(rebind):
    """``graphrunner check`` reports the drift (or the stashed state) and the mean's padding leak: the
    padding check's runs start from the same Python state, so a counter does not make it give up."""
    kinds, make = _findings(CountingLeak(rebind))
    assert kinds == {"stashed-state" if rebind else "drift", "padding-leak"}
    # independent reference for each: the row-independent step (no mean) has no leak finding, and the
    # step without the counter / re-binding has no drift or stashed-state finding
    assert "padding-leak" not in _findings(lambda x: x @ _weights())[0]
    assert _findings(lambda x: x - x.mean(0))[0] == {"padding-leak"}


def test_repro4_negative_control_without_the_put_back_the_leak_is_hidden(monkeypatch):
    monkeypatch.setattr(padding.PythonNumbers, "put", staticmethod(lambda snapshot: None))
    kinds, _ = _findings(CountingLeak())
    assert kinds == {"drift"}  # the old behaviour: the counter made the padding check give up


class Bumping:
    """Counts its calls in a Python attribute; its output does not depend on the count."""

    def __init__(self):
        self.n = 0
        self.w = _weights()

    def __call__(self, x):
        self.n += 1
        return x @ self.w


def _counter_after_capture(checks):
    step = Bumping()
    gr.GraphRunner(
        step, {"x": gr.BatchInput(trailing=(H,))}, [2, 4], backend="full", device="tape", progress=False, checks=checks
    ).capture()
    return step.n


def test_repro4_the_capture_sees_the_counter_as_without_the_check():
    """The padding check's extra forwards leave the step's Python numbers as the last warmup left them:
    the counter after capture is the same with the check as without it (reference: checks=())."""
    assert _counter_after_capture(("padding",)) == _counter_after_capture(()) > 0


def test_repro4_negative_control_without_the_put_back_the_check_advances_the_counter(monkeypatch):
    monkeypatch.setattr(padding.PythonNumbers, "put", staticmethod(lambda snapshot: None))
    assert _counter_after_capture(("padding",)) > _counter_after_capture(())


# ------------------------------------------------------------------------------ the docs table
def test_the_docs_table_of_what_the_check_catches_names_tests_that_exist():
    """docs/checks.md's table "What the padding check catches" is checked against the tests: every test
    file it names exists, every reproduction it cites has its test and its negative control here, and
    every reproduction tested here is in the table."""
    import pathlib
    import re

    root = pathlib.Path(__file__).resolve().parents[1]
    doc = (root / "docs" / "checks.md").read_text()
    section = doc.split("### What the padding check catches, and what it cannot", 1)[1].split("What it cannot see", 1)[
        0
    ]
    rows = [line for line in section.splitlines() if line.startswith("| ") and not line.startswith("| a step")]
    assert len(rows) >= 8
    here = pathlib.Path(__file__).read_text()
    cited = set()
    for row in rows:
        files = re.findall(r"`(tests/[\w/]+\.py)`", row)
        assert files, row
        for f in files:
            assert (root / f).is_file(), f"{f} named in docs/checks.md does not exist"
        for n in re.findall(r"reproduction (\d+)", row):
            cited.add(n)
            assert f"def test_repro{n}_" in here and f"def test_repro{n}_negative_control" in here, n
    tested = set(re.findall(r"def test_repro(\d+)_", here))
    assert tested <= cited, f"reproductions tested but not in the docs table: {sorted(tested - cited)}"
