"""The padding check measures the promise itself (issue 21): padded replay == eager on the real batch.

Each class of silent wrong result has a negative control (the check off: the
runner returns something else than eager PyTorch on the same real batch) and
the check on (a clear error at capture, or the right result). References are
eager PyTorch on the unpadded batch.
"""

import inspect

import pytest
import torch

import graphrunner as gr
from graphrunner.checks.contracts import InputWritesCheck

pytestmark = pytest.mark.usefixtures("one_torch_thread")

H = 8
NO_PADDING_CHECK = ("drift", "fingerprint")


def _runner(step, inputs, checks=None, buckets=(2, 4, 8), **kw):
    return gr.GraphRunner(
        step, inputs, list(buckets), backend="full", device="tape", progress=False, checks=checks, **kw
    )


def _line(fn, marker):
    lines, start = inspect.getsourcelines(fn)
    return start + next(i for i, text in enumerate(lines) if f"# {marker}" in text)


# --------------------------------------------------------------- float leaks
def rms_over_batch(x):
    # a multiplicative leak: at capture the old check saw zeros in the real rows too (pad 0)
    return x * torch.rsqrt(x.pow(2).mean(0, keepdim=True) + 1e-6)


def test_multiplicative_leak_with_pad_zero_is_caught():
    inputs = {"x": gr.BatchInput(trailing=(H,), pad=0.0)}
    with pytest.raises(gr.PaddingLeakError, match=r"bucket 8: output changed .* against eager PyTorch"):
        _runner(rms_over_batch, inputs).capture()
    r = _runner(rms_over_batch, inputs, NO_PADDING_CHECK)  # negative control: silently wrong
    r.capture()
    x = torch.randn(5, H)
    assert (r(x=x) - rms_over_batch(x)).abs().max() > 0.1


# ------------------------------------------------------- padded-count leaks
def per_count(x):
    return x / x.shape[0]  # padded count


def position_scale(x):
    return x * torch.linspace(0, 1, x.shape[0])[:, None]


@pytest.mark.parametrize("step", [per_count, position_scale])
def test_padded_count_dependence_is_caught(step):
    inputs = {"x": gr.BatchInput(trailing=(H,), pad=0.0)}
    with pytest.raises(gr.PaddingLeakError, match="depends on the padded size"):
        _runner(step, inputs).capture()
    r = _runner(step, inputs, NO_PADDING_CHECK)
    r.capture()
    x = torch.randn(3, H)
    assert not torch.allclose(r(x=x), step(x))  # the graph divides by 4, eager by 3


def test_row_independent_step_passes_with_integers_and_floats():
    emb = torch.randn(20, H)
    w = torch.randn(H, H)

    def step(ids, h):
        return torch.tanh((emb[ids] + h) @ w)

    inputs = {"ids": gr.BatchInput(dtype=torch.long, pad=0, bounds=(0, 19)), "h": gr.BatchInput(trailing=(H,))}
    r = _runner(step, inputs)
    rep = r.capture()
    # every bucket: padded (the one but last warmup: run A), the follow-up after it (the last warmup),
    # random float padding, eager unpadded (D), the follow-up after it: 3 extra forwards (a second real
    # size runs only without D)
    assert {b.bucket: b.info.get("leak_check_forwards") for b in rep.buckets} == {8: 3, 4: 3, 2: 3}
    ids, h = torch.randint(0, 20, (5,)), torch.randn(5, H)
    torch.testing.assert_close(r(ids=ids, h=h), step(ids, h))


def test_the_last_two_warmups_are_the_padded_sequence_and_one_warmup_runs_it_apart():
    """With warmups >= 2 the one but last warmup runs on run A's data (real ids within bounds, pad rows
    at the pad), the last one is the padded follow-up after it, and the capture runs on the static
    buffers as they were (the padding; poisoned under GRAPHRUNNER_TAPE_POISON); with warmups=1 the one
    warmup may be lazy initialisation, so the check runs A and the follow-up itself: two eager forwards
    more (the control)."""
    emb = torch.randn(20, H)
    seen = []

    def step(ids):
        seen.append(ids.clone())
        return emb[ids] * 2

    inputs = {"ids": gr.BatchInput(dtype=torch.long, pad=0, bounds=(0, 19))}
    rep = gr.GraphRunner(step, inputs, [2, 4], backend="full", device="tape", progress=False).capture()
    # bucket 4: warmup 1 (run A), warmup 2 (the follow-up padded, after A), eager unpadded (D), the
    # follow-up unpadded (after D), capture; bucket 2's after
    key4 = seen[:5]
    assert [len(t) for t in key4] == [4, 4, 3, 3, 4]
    assert key4[0][3] == 0 and 0 not in key4[0][:3].tolist()  # warmup 1: run A, 3 real rows (none at
    #                                                                       the pad) + the padding row
    assert key4[1][3] == 0 and key4[1][0] == 0  # warmup 2: the follow-up, a real row at the pad
    assert torch.equal(key4[2], key4[0][:3])  # D: A's real rows, unpadded
    assert torch.equal(key4[3], key4[1][:3])  # ... the follow-up's rows unpadded after D
    assert not torch.equal(key4[4][:3], key4[0][:3])  # the capture is not on A's data
    assert rep.buckets[0].info["leak_check_forwards"] == 2
    one = gr.GraphRunner(step, inputs, [2, 4], backend="full", device="tape", progress=False, warmups=1).capture()
    assert one.buckets[0].info["leak_check_forwards"] == 4


# --------------------------------------------------------- integer leaks
class SlotDecoder:
    """Writes each row's key into a slot-indexed cache, then reads its slot back (a KV cache in one line)."""

    def __init__(self, slots):
        self.emb = torch.randn(16, H)
        self.cache = torch.zeros(slots, H)

    def __call__(self, ids, slots):
        self.cache.index_copy_(0, slots, self.emb[ids])  # padding rows write their pad slot too
        return self.cache[slots] * 2


def test_pad_slot_that_is_a_real_slot_is_caught():
    """pad=0 on the slot input: padding rows overwrite slot 0, which a real request uses."""
    inputs = {
        "ids": gr.BatchInput(dtype=torch.long, pad=0, bounds=(0, 15)),
        "slots": gr.BatchInput(dtype=torch.long, pad=0, bounds=(0, 7)),
    }
    with pytest.raises(gr.PaddingLeakError, match=r"a real row holds the pad value.*slots \(pad 0, also a real value"):
        _runner(SlotDecoder(8), inputs).capture()
    dec = SlotDecoder(8)
    r = _runner(dec, inputs, NO_PADDING_CHECK)
    r.capture()
    ids, slots = torch.tensor([3, 5, 7]), torch.tensor([0, 1, 2])
    want = dec.emb[ids] * 2
    assert not torch.equal(r(ids=ids, slots=slots)[0], want[0])  # request 0's K/V overwritten by padding
    assert torch.equal(r(ids=ids, slots=slots)[1:], want[1:])


def test_scratch_pad_slot_outside_the_real_range_passes():
    """The fix: a dedicated padding slot (8, outside the real slots 0..7) never meets a real row."""
    dec = SlotDecoder(9)
    inputs = {
        "ids": gr.BatchInput(dtype=torch.long, pad=0, bounds=(0, 15)),
        "slots": gr.BatchInput(dtype=torch.long, pad=8, bounds=(0, 7)),
    }
    r = _runner(dec, inputs)
    r.capture()
    ids, slots = torch.tensor([3, 5, 7]), torch.tensor([0, 1, 2])
    assert torch.equal(r(ids=ids, slots=slots), dec.emb[ids] * 2)


def test_check_restores_the_cache_it_writes():
    dec = SlotDecoder(9)
    inputs = {
        "ids": gr.BatchInput(dtype=torch.long, pad=0, bounds=(0, 15)),
        "slots": gr.BatchInput(dtype=torch.long, pad=8, bounds=(0, 7)),
    }
    r = _runner(dec, inputs, warmups=1)
    before = dec.cache.clone()
    dec_calls = []
    r.post_warmup_hook = lambda key: dec_calls.append(dec.cache.clone())
    r.capture()
    # the check's forwards write random slots: every one is put back; what remains is the warmups' writes
    assert torch.equal(dec.cache, dec_calls[-1]) and not torch.equal(dec.cache, before)


# ---------------------------------------------------------------- input writes
def accumulate(state, delta):
    state.add_(delta)  # writes its input
    return state * 2


def test_step_writing_its_input_is_refused_naming_input_and_line():
    inputs = {"state": gr.BatchInput(trailing=(H,)), "delta": gr.BatchInput(trailing=(H,))}
    with pytest.raises(gr.CaptureError) as info:
        _runner(accumulate, inputs).capture()
    msg = str(info.value)
    assert (
        "writes into its input 'state'" in msg and f"test_equivalence.py:{_line(accumulate, 'writes its input')}" in msg
    )
    assert "BatchInput(state=True)" in msg


def test_negative_control_input_writes_replay_wrong(monkeypatch):
    """Without the refusal: eager updates the caller's tensor (1, 2, 3), the graph never does (1, 1, 1)."""
    monkeypatch.setattr(InputWritesCheck, "after_warmups", lambda self, cap: None)
    inputs = {"state": gr.BatchInput(trailing=(H,)), "delta": gr.BatchInput(trailing=(H,))}
    r = _runner(accumulate, inputs, NO_PADDING_CHECK)
    r.capture()
    state, delta = torch.zeros(2, H), torch.ones(2, H)
    got = [float(r(state=state, delta=delta)[0, 0]) / 2 for _ in range(3)]
    eager_state = torch.zeros(2, H)
    want = [float(accumulate(eager_state, delta)[0, 0]) / 2 for _ in range(3)]
    assert got == [1.0, 1.0, 1.0] and want == [1.0, 2.0, 3.0]


def test_input_declared_as_state_captures_and_never_writes_the_callers_tensor():
    inputs = {"state": gr.BatchInput(trailing=(H,), state=True), "delta": gr.BatchInput(trailing=(H,))}
    r = _runner(accumulate, inputs, buckets=(2, 4))
    r.capture()
    for n in (3, 1, 2, 6):  # 6: over the largest bucket, the eager fallback
        state, delta = torch.randn(n, H), torch.randn(n, H)
        keep = state.clone()
        out = r(state=state, delta=delta)
        assert torch.equal(state, keep)  # the caller's tensor is never written
        assert torch.equal(out, accumulate(keep.clone(), delta))  # the same values as eager on a copy
    # the step wrote the padding rows of its state buffer: they are re-padded before the next call
    assert torch.equal(r.static_inputs["state"][1:4], torch.zeros(3, H)) or r.server.inputs.filled != (1,)


def index_advance(pos, h):
    pos.add_(1)  # advances its index input in place
    return h + pos[:, None].float()


def test_index_input_advanced_in_place_is_refused():
    inputs = {"pos": gr.BatchInput(dtype=torch.long, bounds=(0, 100)), "h": gr.BatchInput(trailing=(H,))}
    with pytest.raises(gr.CaptureError, match="writes into its input 'pos'"):
        _runner(index_advance, inputs).capture()


# ------------------------------------------------------ shadow verification
def test_python_value_changed_after_capture_is_caught_by_shadow_verification(monkeypatch):
    w = torch.randn(H, H)
    cfg = {"scale": 2.0}

    def step(x):
        return (x @ w) * cfg["scale"]  # a Python value the graph freezes

    inputs = {"x": gr.BatchInput(trailing=(H,))}
    r = _runner(step, inputs, verify_every=1)
    r.capture()
    x = torch.randn(3, H)
    assert torch.equal(r(x=x), step(x))  # verified, equal
    cfg["scale"] = 3.0  # changed after capture
    with pytest.raises(gr.ContractError, match=r"shadow verification of call 2.*bucket 4") as info:
        r(x=x)
    assert f"test_equivalence.py:{_line(step, 'a Python value')}" in str(info.value)  # from compare: the line
    # negative control: without verification the same call is silently wrong
    monkeypatch.delenv("GRAPHRUNNER_VERIFY_EVERY", raising=False)
    cfg["scale"] = 2.0
    quiet = _runner(step, inputs)
    quiet.capture()
    cfg["scale"] = 3.0
    assert quiet.verify_every == 0 and not torch.allclose(quiet(x=x), step(x))


class Recurrent(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.prev = torch.zeros(1, H)

    def forward(self, x):
        h = x + self.prev
        self.prev = h[:1].detach()  # re-bound: the graph keeps reading the capture-time tensor
        return h


def test_rebound_recurrent_state_is_caught_every_second_call():
    inputs = {"x": gr.BatchInput(trailing=(H,))}
    # one bucket: with several, a later key's capture would read an earlier key's capture tensor
    r = _runner(Recurrent(), inputs, checks=("padding", "fingerprint"), verify_every=2, buckets=(2,))
    r.capture()
    x = torch.randn(2, H)
    r(x=x)  # call 1: not verified
    with pytest.raises(gr.ContractError, match="shadow verification of call 2"):
        r(x=x)


def test_debug_mode_verifies_every_call_and_the_env_sets_the_period(monkeypatch):
    inputs = {"x": gr.BatchInput(trailing=(H,))}
    assert _runner(lambda x: x * 2, inputs, debug=True).verify_every == 1
    monkeypatch.setenv("GRAPHRUNNER_VERIFY_EVERY", "5")
    assert _runner(lambda x: x * 2, inputs).verify_every == 5
    with pytest.raises(ValueError, match="verify_every must be >= 0"):
        _runner(lambda x: x * 2, inputs, verify_every=-1)
    # a stateful step (a KV-cache-like write) verifies clean: what the eager run writes is put back
    cache = torch.zeros(8, H)

    def step(x):
        cache[: x.shape[0]].add_(x)
        return cache[: x.shape[0]] * 1.0

    r = _runner(step, inputs, verify_every=1)
    r.capture()
    snap = cache.clone()
    out = r(x=torch.ones(3, H))
    assert torch.equal(
        cache[:4], snap[:4] + torch.cat([torch.ones(3, H), torch.zeros(1, H)])
    )  # one write: the replay's
    assert torch.equal(out, cache[:3])


class LazyScale:
    """Initialises a Python scale at its first call, which returns something else (a lazy table)."""

    def __init__(self):
        self.scale = None
        self.w = torch.randn(H, H)

    def __call__(self, x):
        if self.scale is None:
            self.scale = 2.0
            return x @ self.w  # the first call only: before the scale exists
        return (x @ self.w) * self.scale


UNCHECKABLE = "changed between two identical calls"


def test_run_a_at_a_lazy_first_warmup_is_confirmed_before_a_finding(caplog):
    """Run A is the key's first warmup (warmups=2): a step that initialises lazily at its first call gives
    run A another output than the unpadded run; the check runs A again before it reports, so there is
    no false alarm and the output is checked (no "cannot be checked" warning), and the replay equals
    eager (the reference)."""
    step = LazyScale()
    r = gr.GraphRunner(step, {"x": gr.BatchInput(trailing=(H,))}, [2, 4], backend="full", device="tape", progress=False)
    with caplog.at_level("WARNING", logger="graphrunner"):
        r.capture()
    assert UNCHECKABLE not in caplog.text
    x = torch.randn(3, H)
    assert torch.allclose(r(x=x), (x @ step.w) * 2.0, atol=1e-6)


def test_run_a_at_a_lazy_first_warmup_negative_control_without_the_confirmation(monkeypatch, caplog):
    """Without the confirmation the check compares the lazy first call and gives up on the output."""
    from graphrunner.checks.leak_check import LeakCheck

    original = LeakCheck.before_warmup

    def unconfirmed(self, cap, i):
        original(self, cap, i)
        self._a_first = False

    monkeypatch.setattr(LeakCheck, "before_warmup", unconfirmed)
    with caplog.at_level("WARNING", logger="graphrunner"):
        gr.GraphRunner(
            LazyScale(), {"x": gr.BatchInput(trailing=(H,))}, [2, 4], backend="full", device="tape", progress=False
        ).capture()
    assert UNCHECKABLE in caplog.text


def test_the_confirmation_does_not_hide_a_leak():
    """A leak found with run A at the first warmup is still reported after run A is run again."""
    with pytest.raises(gr.PaddingLeakError, match="bucket 4"):
        gr.GraphRunner(
            lambda x: x - x.mean(0),
            {"x": gr.BatchInput(trailing=(H,))},
            [2, 4],
            backend="full",
            device="tape",
            progress=False,
        ).capture()
