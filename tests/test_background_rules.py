"""Background capture beside an engine's behaviour (issue 34): timeouts validated, a bad request
never stops the capture, a scratch (state=True) input works with it."""

from __future__ import annotations

import math
import threading

import pytest
import torch

import graphrunner as gr


def _runner(step=lambda x: x * 2.0, inputs=None, buckets=(1, 2, 4, 8)):
    inputs = inputs or {"x": gr.BatchInput(trailing=(3,))}
    return gr.GraphRunner(step, inputs, list(buckets), device="tape", progress=False)


@pytest.mark.parametrize(
    "timeout, error", [(float("nan"), ValueError), (-1, ValueError), ("1", TypeError), (True, TypeError)]
)
def test_wait_captured_refuses_a_bad_timeout_and_the_capture_goes_on(timeout, error):
    r = _runner()
    r.capture(background=True)
    with pytest.raises(error, match=r"wait_captured\(timeout=...\)"):
        r.wait_captured(timeout=timeout)
    report = r.wait_captured(timeout=math.inf)  # inf: until done (was an OverflowError)
    assert report is not None and r.wait_captured(timeout=math.inf) is report  # and again: the same report
    assert r.captured_keys == [1, 2, 4, 8]
    x = torch.randn(3, 3)
    assert torch.equal(r(x=x), x * 2.0)


def test_a_bad_request_during_a_background_capture_does_not_stop_it():
    r = _runner()
    gate = threading.Event()
    r.capturer.background_gate = gate  # the thread waits before its first key: the bad call comes first
    r.capture(background=True)
    with pytest.raises(ValueError, match="input 'x' has shape"):
        r(x=torch.ones(3, 4))
    x = torch.randn(3, 3)
    assert torch.equal(r(x=x), x * 2.0)  # served (eagerly) right after it
    gate.set()
    assert r.wait_captured(timeout=60) is not None and r.captured_keys == [1, 2, 4, 8]
    before = r.stats.replays[4]
    assert torch.equal(r(x=x), x * 2.0) and r.stats.replays[4] == before + 1  # and replayed now


def test_a_scratch_state_input_works_with_a_background_capture():
    def step(x, scratch):
        scratch.copy_(x * 3.0)
        return scratch + 1.0

    r = _runner(step, {"x": gr.BatchInput(trailing=(3,)), "scratch": gr.BatchInput(trailing=(3,), state=True)})
    r.capture(background=True)
    x = torch.randn(2, 3)
    outs = [r(x=x, scratch=torch.zeros(2, 3)).clone()]
    assert r.wait_captured(timeout=60) is not None
    outs.append(r(x=x, scratch=torch.zeros(2, 3)).clone())
    for out in outs:
        assert torch.equal(out, x * 3.0 + 1.0)


def _call_inside_hold(r, out):
    with r.hold():
        out.append(r(x=torch.ones(3, 3)).clone())


def _in_thread(fn, *args, seconds):
    """True when ``fn`` returned within ``seconds``: a deadlock detector, not a timing claim (the
    bound is far above any call here; a thread still alive after it is stuck on a lock)."""
    t = threading.Thread(target=fn, args=args, daemon=True)
    t.start()
    t.join(seconds)
    return not t.is_alive()


def test_a_call_inside_hold_during_a_background_capture_is_served():
    r = _runner()
    r.capture(background=True)
    out = []
    assert _in_thread(_call_inside_hold, r, out, seconds=30), "a call inside runner.hold() deadlocked"
    assert torch.equal(out[0], torch.full((3, 3), 2.0))
    assert r.wait_captured(timeout=60) is not None
    assert r.stats.agreement_seconds == 0  # one rank: no agreement to wait in (several: test_background_multirank)


def test_negative_control_with_a_plain_lock_a_call_inside_hold_deadlocks(monkeypatch):
    from graphrunner import background

    real = background.BackgroundCapture.__init__

    def plain_lock(self, *a, **kw):
        real(self, *a, **kw)
        self.mutex = threading.Lock()

    monkeypatch.setattr(background.BackgroundCapture, "__init__", plain_lock)
    r = _runner()
    gate = threading.Event()
    r.capturer.background_gate = gate  # no key starts: the only holder of the lock is the stuck call
    r.capture(background=True)
    assert not _in_thread(_call_inside_hold, r, [], seconds=1.0)  # stuck for good (a daemon thread)


def test_a_step_that_calls_its_own_runner_during_a_background_capture_is_refused_clearly():
    box = {}

    def step(x):
        if "runner" in box:
            with pytest.raises(gr.GraphRunnerError, match="called re-entrantly"):
                box["runner"](x=x)
            box["refused"] = True
        return x * 2.0

    r = gr.GraphRunner(step, {"x": gr.BatchInput(trailing=(3,))}, [1, 2, 4], device="tape", progress=False, checks=())
    gate = threading.Event()
    r.capturer.background_gate = gate
    r.capture(background=True)
    box["runner"] = r
    out = []
    assert _in_thread(lambda: out.append(r(x=torch.ones(3, 3)).clone()), seconds=30), "a re-entrant call hung"
    assert box.get("refused") and torch.equal(out[0], torch.full((3, 3), 2.0))
    del box["runner"]
    gate.set()
    assert r.wait_captured(timeout=60) is not None


def test_cleanup_while_a_call_is_in_progress_is_refused_and_the_call_is_right():
    started, release = threading.Event(), threading.Event()

    def step(x):
        if x.shape[0] == 16:  # the eager fallback (over the largest bucket): a slow call in progress
            started.set()
            release.wait(10)
        return x * 2.0

    r = _runner(step)
    r.capture()
    x = torch.randn(16, 3)
    out = []
    t = threading.Thread(target=lambda: out.append(r(x=x).clone()), daemon=True)
    t.start()
    assert started.wait(10)
    with pytest.raises(gr.GraphRunnerError, match=r"cleanup\(\) called from thread .* inside a call"):
        r.cleanup()
    release.set()
    t.join(10)
    assert torch.equal(out[0], x * 2.0) and r.captured  # the call's result is right, the graphs are kept
    y = torch.randn(3, 3)
    assert torch.equal(r(x=y), y * 2.0)
    r.cleanup()  # between calls: fine
    assert not r.captured


class _Engine:
    """A cache indexed by slot, reset by its post-warmup hook (the hook's documented use), and a
    counter tensor the hook bumps."""

    def __init__(self):
        self.cache, self.count = torch.zeros(8, 3), torch.zeros(())

    def step(self, x, slot):
        self.cache.index_copy_(0, slot, x)
        return self.cache.index_select(0, slot) * 2.0

    def hook(self, key):
        self.cache.zero_()
        self.count.add_(1)


def _live_rows_after_background_capture():
    e = _Engine()
    inputs = {"x": gr.BatchInput(trailing=(3,)), "slot": gr.BatchInput(dtype=torch.long, pad=7, bounds=(0, 6))}
    r = gr.GraphRunner(e.step, inputs, [1, 2, 4], device="tape", progress=False, post_warmup_hook=e.hook, checks=())
    gate = threading.Event()
    r.capturer.background_gate = gate  # the real requests' rows land before any key is captured
    r.capture(background=True)
    x = torch.randn(2, 3)
    r(x=x, slot=torch.tensor([0, 1]))
    gate.set()
    assert r.wait_captured(timeout=60) is not None
    return e, x


def test_a_hook_that_resets_the_cache_during_a_background_capture_leaves_live_rows_alone():
    e, x = _live_rows_after_background_capture()
    assert torch.equal(e.cache[:2], x)  # the rows the real request wrote
    assert float(e.count) == 0.0  # the hook's counter tensor is put back too (a Python counter is not)


def test_negative_control_without_putting_back_the_hooks_writes_live_rows_are_wiped(monkeypatch):
    from graphrunner.background import PutBack

    monkeypatch.setattr(PutBack, "around", lambda self, hook: hook)
    e, x = _live_rows_after_background_capture()
    assert not torch.equal(e.cache[:2], x) and float(e.count) > 0


# ------------------------------------------------------------------ memory budget (issue 34 item 7)
def _named_dims_runner(budget):
    x2 = {"x": gr.BatchInput(trailing=(64,), dims=("r", "d"))}
    return gr.GraphRunner(
        lambda x: x * 2.0 + 1.0,
        x2,
        {"r": [1, 2, 4], "d": [1, 8, 16]},
        device="tape",
        progress=False,
        memory_budget=budget,
    )


def test_a_budget_that_leaves_out_the_largest_named_key_keeps_every_call_servable():
    r = _named_dims_runner(20000)  # the largest key (4, 16) alone is over it
    report = r.capture()
    assert (4, 16) in report.left_to_eager
    # the keys wider than the largest kept key (4, 8) in dim d cannot share its output buffer: left out too
    assert set(report.left_to_eager) == {(4, 16), (2, 16), (1, 16)}
    for sizes, replayed in [((4, 16), None), ((3, 12), None), ((2, 8), (2, 8)), ((1, 1), (1, 1))]:
        x = torch.randn(*sizes, 64)
        assert torch.equal(r(x=x), x * 2.0 + 1.0)
        assert r.stats.last_bucket == replayed


def test_check_reports_a_budget_as_one_finding():
    from graphrunner.checks.lint import check_runner

    report = check_runner(_named_dims_runner(20000), "budget")
    budget = [f for f in report.findings if f.kind == "memory-budget"]
    assert len(budget) == 1 and "memory_budget=19.5 KiB" in budget[0].what and budget[0].bucket == (4, 16)


# ---------------------------------------------------------------- issue 42 items 3 and 4: the capture's own inputs
class BadRequest(ValueError):
    """An engine's per-request validation error."""


@gr.no_graph
def _no_nan(x):
    if torch.isnan(x).any():
        raise BadRequest("a request carries a NaN row")
    return x


def _validating_step(x):
    _no_nan(x)
    return torch.tanh(x) * 2.0


def _old_put_back(monkeypatch):
    """The negative control: a background key's warmups run on what the last call left in the
    static buffers (the hook's input handling removed)."""
    from graphrunner.background import PutBack

    for point in ("begin", "after_warmup", "after_warmups"):
        monkeypatch.setattr(PutBack, point, lambda self, *args: None)
    real_end = PutBack.end
    monkeypatch.setattr(PutBack, "end", lambda self, cap: (setattr(self, "_kept", None), real_end(self, cap)))


def _serve_a_bad_request_first():
    r = _runner(_validating_step)
    gate = threading.Event()
    r.capturer.background_gate = gate  # the bad call comes before any key's capture
    r.capture(background=True)
    bad = torch.ones(3, 3)
    bad[1, 0] = float("nan")
    with pytest.raises(BadRequest):  # the engine catches its own error type
        r(x=bad)
    gate.set()
    return r


def test_a_bad_request_leaves_no_trace_the_background_capture_reads():
    r = _serve_a_bad_request_first()
    assert r.wait_captured(timeout=60) is not None and r.captured_keys == [1, 2, 4, 8]
    x = torch.randn(3, 3, generator=torch.Generator().manual_seed(0))
    before = r.stats.replays[4]
    assert torch.equal(r(x=x), _validating_step(x)) and r.stats.replays[4] == before + 1


def test_negative_control_warmups_on_the_last_calls_buffers_stop_the_capture(monkeypatch):
    _old_put_back(monkeypatch)
    r = _serve_a_bad_request_first()
    assert r.wait_captured(timeout=60) is None  # the key's warmups met the NaN row
    with pytest.raises(gr.CaptureError, match="background capture failed"):
        r(x=torch.ones(3, 3))


TABLE = torch.arange(8 * 2, dtype=torch.float32).reshape(8, 2)


def _advancing(pos):
    out = TABLE[pos] * 2
    pos.add_(1)
    return out


def _positions_runner():
    pos = gr.BatchInput(dtype=torch.long, pad=0, bounds=(0, 6), state=True)
    return _runner(_advancing, {"pos": pos})


@pytest.mark.parametrize("background", [False, True])
def test_a_state_input_the_step_advances_works_with_a_background_capture(background):
    """The issue's step: ``pos`` advanced in place, ``state=True``; the first call leaves 6 (advanced
    to 7) in the static buffer. Blocking and background captures alike: every key captured, every
    call right (the background warmups start from the pad value, restored around each warmup)."""
    r = _positions_runner()
    gate = threading.Event()
    if background:
        r.capturer.background_gate = gate
        r.capture(background=True)
    else:
        r.capture()
    calls = [[6], [6, 1], [6, 5, 4], [0, 1, 2, 3, 4, 5, 6], [6, 6]]
    for i, values in enumerate(calls):
        pos = torch.tensor(values)
        assert torch.equal(r(pos=pos), TABLE[pos] * 2)
        assert torch.equal(pos, torch.tensor(values))  # the caller's tensor is never written
        if background and i == 0:
            gate.set()
            assert r.wait_captured(timeout=60) is not None
    assert r.captured_keys == [1, 2, 4, 8]
    assert sum(r.stats.replays.values()) >= 4


def test_negative_control_a_state_input_left_by_a_call_breaks_the_background_capture(monkeypatch):
    _old_put_back(monkeypatch)
    r = _positions_runner()
    gate = threading.Event()
    r.capturer.background_gate = gate
    r.capture(background=True)
    r(pos=torch.tensor([6]))
    gate.set()
    assert r.wait_captured(timeout=60) is None  # the warmups indexed past the table
    with pytest.raises(gr.CaptureError, match="background capture failed"):
        r(pos=torch.tensor([1]))
