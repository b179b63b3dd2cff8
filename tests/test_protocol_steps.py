"""The protocol's named steps (graphrunner.backends.protocol.Step) are the order capture_one runs.

One capture with one warmup, a post-warmup hook and a hook with work after the warmups records
exactly one event per step that records one, in the order of ``Step``; the hooks' points are
called in that order too; a capture error names its step by the step's phrase.
"""

from __future__ import annotations

import pytest
import torch

from graphrunner.backends import FullGraphBackend
from graphrunner.backends.protocol import Step, check_capture_order
from graphrunner.errors import CaptureError
from graphrunner.recording.hooks import CaptureHook
from graphrunner.trace import EventKind, Trace


class _Points(CaptureHook):
    """Records the hook points it sees, and makes an ``after_warmups`` (``check``) span."""

    name = "points"

    def __init__(self) -> None:
        self.seen: list = []

    def begin(self, cap):
        self.seen.append(Step.BEGIN)

    def before_warmup(self, cap, i):
        self.seen.append(Step.WARMUP_FORWARD)

    def after_warmups(self, cap):
        self.seen.append(Step.AFTER_WARMUPS)

    def after_capture(self, cap):
        self.seen.append(Step.AFTER_CAPTURE)

    def end(self, cap):
        self.seen.append(Step.END)


def _capture(**kw):
    x = torch.ones(2)
    trace, hook = Trace(), _Points()
    backend = FullGraphBackend(device="tape", warmups=1, trace=trace, drift_check=False, hooks=[hook], **kw)
    with backend.capture_session():
        backend.capture_one(2, lambda: x * 2, post_warmup_hook=lambda: None)
    return trace, hook


def test_a_capture_records_the_steps_in_the_order_of_step():
    trace, hook = _capture()
    kinds = [e.kind for e in trace.events if e.kind not in (EventKind.SESSION_BEGIN, EventKind.SESSION_END)]
    assert kinds == [s.event for s in Step if s.event is not None]
    assert hook.seen == [s for s in Step if s in hook.seen]  # the hooks' points in Step's order
    assert hook.seen[0] is Step.BEGIN and hook.seen[-1] is Step.END
    assert check_capture_order(trace) == []


def test_step_order_is_the_documented_one():
    assert [s.name for s in Step] == [
        "BEGIN",
        "WARMUP_SYNC",
        "WARMUP_BARRIER",
        "WARMUP_FORWARD",
        "POST_WARMUP_HOOK",
        "AFTER_WARMUPS",
        "FINAL_SYNC",
        "FINAL_BARRIER",
        "GRAPH_CONSTRUCT",
        "CAPTURE_FORWARD",
        "AFTER_CAPTURE",
        "END",
    ]


def test_a_capture_error_names_its_step():
    class NoBarrier(FullGraphBackend):
        def _final_barrier(self, key):
            raise RuntimeError("boom")

    x = torch.ones(2)
    backend = NoBarrier(device="tape", warmups=1)
    with (
        backend.capture_session(),
        pytest.raises(CaptureError, match=f"during {Step.FINAL_BARRIER.value}: RuntimeError"),
    ):
        backend.capture_one(2, lambda: x * 2)
    # negative control: the same backend without the broken step captures
    ok = FullGraphBackend(device="tape", warmups=1)
    with ok.capture_session():
        ok.capture_one(2, lambda: x * 2)
    assert ok.can_run(2)
