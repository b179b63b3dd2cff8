"""Stream ownership (issue 27): streams on the tape, and unjoined side-stream work refused at capture.

Every value is checked against plain eager PyTorch (no streams: what a correct
program computes); the check's tests have negative controls (the check off,
on the tape, shows the stale read an unjoined side stream gives).
"""

from __future__ import annotations

import threading

import pytest
import torch

import graphrunner as gr
from graphrunner.checks.stream_use import StreamCheck
from graphrunner.errors import CaptureError
from graphrunner.tape import TapeEvent, TapeStream
from graphrunner.tape.streams import CLOCKS


@pytest.fixture
def dev():
    return gr.TapeDevice()


# --------------------------------------------------------------------------- the tape's streams


def test_unjoined_side_write_is_invisible_until_a_join(dev):
    side = dev.new_stream(name="side")
    x, y = torch.arange(3.0), torch.zeros(3)
    cur = dev.current_stream()
    assert cur is dev.default_stream() and cur.id == 0
    side.wait_stream(cur)
    with dev.stream(side) as s:
        assert s is side and dev.current_stream() is side
        y.copy_(x * 2)
        assert torch.equal(y, x * 2)  # a stream sees its own writes
    assert dev.current_stream() is cur
    assert torch.equal(y, torch.zeros(3))  # the default stream has not waited: the value from before
    assert not side.query()
    cur.wait_stream(side)
    assert torch.equal(y, x * 2) and side.query()


@pytest.mark.parametrize("join", ["event_wait", "stream_sync", "event_sync", "device_sync"])
def test_every_kind_of_join_lands_the_write(dev, join):
    side = dev.new_stream()
    y = torch.zeros(4)
    side.wait_stream(dev.current_stream())
    with dev.stream(side):
        y.add_(5)
        ev = side.record_event()
    assert torch.equal(y, torch.zeros(4)) and not ev.query()
    {
        "event_wait": lambda: dev.current_stream().wait_event(ev),
        "stream_sync": side.synchronize,
        "event_sync": ev.synchronize,
        "device_sync": dev.synchronize,
    }[join]()
    assert torch.equal(y, torch.full((4,), 5.0)) and ev.query()


def test_event_join_lands_only_work_recorded_before_it(dev):
    side = dev.new_stream()
    a, b = torch.zeros(2), torch.zeros(2)
    with dev.stream(side):
        a.fill_(1)
        ev = TapeEvent()
        ev.record()
        b.fill_(2)  # after the event: a wait on it does not cover this
    ev.wait()
    assert torch.equal(a, torch.ones(2)) and torch.equal(b, torch.zeros(2))
    dev.synchronize()
    assert torch.equal(b, torch.full((2,), 2.0))


def test_other_streams_writes_to_the_same_storage_survive_the_join(dev):
    side = dev.new_stream()
    buf = torch.zeros(4)
    with dev.stream(side):
        buf[2:].fill_(7)
    buf[:2].fill_(1)  # the default stream writes the other half meanwhile
    dev.current_stream().wait_stream(side)
    assert torch.equal(buf, torch.tensor([1.0, 1.0, 7.0, 7.0]))


def test_reentering_a_stream_sees_its_own_deferred_writes(dev):
    side = dev.new_stream()
    y = torch.zeros(2)
    with dev.stream(side):
        y.add_(1)
    assert torch.equal(y, torch.zeros(2))
    with dev.stream(side):
        assert torch.equal(y, torch.ones(2))
        y.add_(1)
    dev.synchronize()
    assert torch.equal(y, torch.full((2,), 2.0))


def test_current_stream_is_per_thread(dev):
    side = dev.new_stream()
    seen = []
    with dev.stream(side):
        t = threading.Thread(target=lambda: seen.append(dev.current_stream()))
        t.start()
        t.join()
        assert dev.current_stream() is side
    assert seen == [dev.default_stream()]


def test_clocks_follow_waits_and_events():
    a, b, c = TapeStream(), TapeStream(), TapeStream()
    t = CLOCKS.note_op(a.id)
    assert not CLOCKS.knows(b.id, a.id, t)
    b.wait_stream(a)
    assert CLOCKS.knows(b.id, a.id, t) and not CLOCKS.knows(c.id, a.id, t)
    c.wait_stream(b)  # transitively
    assert CLOCKS.knows(c.id, a.id, t)
    t2 = CLOCKS.note_op(a.id)
    assert not CLOCKS.knows(c.id, a.id, t2)
    a.synchronize()  # the host waited: every stream's later work is ordered after it
    assert CLOCKS.knows(c.id, a.id, t2)
    with pytest.raises(TypeError, match="TapeStream"):
        a.wait_stream(object())


def test_ops_record_their_stream_in_a_capture(dev):
    from graphrunner.recording.ops import OpConsumer, OpRecorder

    class Streams(OpConsumer):
        seen: list = []

        def before(self, ev):
            self.seen.append((ev.name, ev.stream))

    side = dev.new_stream()
    x = torch.ones(3)
    g = dev.new_graph()
    with dev.capture(g), OpRecorder([Streams()]):
        y = x + 1
        side.wait_stream(dev.current_stream())
        with dev.stream(side):
            z = y * 2
        dev.current_stream().wait_stream(side)
        out = z + y
    assert Streams.seen == [
        ("aten::add", dev.default_stream()),
        ("aten::mul", side),
        ("aten::add", dev.default_stream()),
    ]
    x.fill_(2)
    g.replay()
    assert torch.equal(out, (x + 1) * 3)


# --------------------------------------------------------------------------- capture: full graph


def test_fork_inside_a_full_capture_must_be_joined_before_it_ends(dev):
    side = dev.new_stream(name="comm")
    x = torch.ones(4)

    def forward():
        h = x + 1
        side.wait_stream(dev.current_stream())
        with dev.stream(side):
            h.mul_(2)  # forked, never joined
        return h

    b = gr.backends.FullGraphBackend(device=dev, warmups=1)
    with pytest.raises(CaptureError, match=r"side stream was not joined.*'comm'.*id \d+") as ei:
        with b.capture_session():
            b.capture_one(4, forward)
    assert "test_streams.py" in str(ei.value) and "h.mul_(2)" in str(ei.value)
    assert dev.current_stream() is dev.default_stream()


def test_full_capture_fork_joined_replays_equal_to_eager(dev):
    side = dev.new_stream()
    x = torch.ones(4)

    def forward():
        h = x + 1
        side.wait_stream(dev.current_stream())
        with dev.stream(side):
            g = h * 3
        dev.current_stream().wait_stream(side)
        return g + h

    b = gr.backends.FullGraphBackend(device=dev, warmups=1, hooks=[StreamCheck()])
    with b.capture_session():
        b.capture_one(4, forward)
    for v in (2.0, -1.5):
        x.fill_(v)
        assert torch.equal(b.replay(4), (x + 1) * 3 + (x + 1))


def test_full_capture_late_join_is_a_hazard_naming_both_lines(dev):
    side = dev.new_stream(name="side")
    x = torch.ones(4)
    acc = torch.zeros(4)

    def forward():
        side.wait_stream(dev.current_stream())
        with dev.stream(side):
            acc.copy_(x * 2)
        out = acc + 1  # read before the join
        dev.current_stream().wait_stream(side)
        return out

    b = gr.backends.FullGraphBackend(device=dev, warmups=1, hooks=[StreamCheck()])
    with pytest.raises(CaptureError, match="stream ownership") as ei:
        with b.capture_session():
            b.capture_one(4, forward)
    msg = str(ei.value)
    assert "'side'" in msg and "acc (" in msg and "acc.copy_(x * 2)" in msg and "out = acc + 1" in msg


# --------------------------------------------------------------------------- capture: breakable


def _fork_in_break(dev, side, meta, join):
    @gr.no_graph
    def fill_meta(h):
        cur = dev.current_stream()
        side.wait_stream(cur)
        with dev.stream(side):
            meta.copy_(h * 2)
        if join:
            cur.wait_stream(side)

    return fill_meta


def test_fork_join_across_a_break_replays_equal_to_eager(dev):
    side = dev.new_stream(name="alltoall")
    x, meta = torch.ones(4), torch.zeros(4)
    fill_meta = _fork_in_break(dev, side, meta, join=True)

    def forward():
        h = x + 1
        fill_meta(h)
        return h + meta

    b = gr.backends.BreakableGraphBackend(device=dev, hooks=[StreamCheck()])
    with b.capture_session():
        b.capture_one(4, forward)
    assert b.info(4)["num_breaks"] == 1
    for xs in (torch.arange(4.0), torch.randn(4)):
        x.copy_(xs)
        ref = (xs + 1) + (xs + 1) * 2  # eager, no streams
        assert torch.equal(b.replay(4), ref)


def test_unjoined_fork_in_a_break_is_refused_with_names(dev):
    side = dev.new_stream(name="alltoall")
    x, meta = torch.ones(4), torch.zeros(4)
    fill_meta = _fork_in_break(dev, side, meta, join=False)

    def forward():
        h = x + 1
        fill_meta(h)
        return h + meta

    b = gr.backends.BreakableGraphBackend(device=dev, hooks=[StreamCheck()])
    with pytest.raises(CaptureError) as ei:
        with b.capture_session():
            b.capture_one(4, forward)
    msg = str(ei.value)
    assert "stream ownership" in msg and "'alltoall'" in msg  # the stream
    assert "reads meta ((4,) float32)" in msg  # the tensor, by its name in the step
    assert "meta.copy_(h * 2)" in msg and "return h + meta" in msg  # the lines of the write and the read
    assert "in eager break" in msg and "wait_stream" in msg  # where, and what to do
    assert not b.can_run(4)


def test_negative_control_check_off_replays_the_stale_value(dev):
    """Without the check the capture succeeds, and the tape shows what a GPU may do: the graph
    segment after the break reads ``meta`` from before the side-stream write."""
    side = dev.new_stream()
    x, meta = torch.ones(4), torch.zeros(4)
    fill_meta = _fork_in_break(dev, side, meta, join=False)

    def forward():
        h = x + 1
        fill_meta(h)
        return h + meta

    b = gr.backends.BreakableGraphBackend(device=dev)
    with b.capture_session():
        b.capture_one(4, forward)
    dev.synchronize()
    meta.fill_(4.0)  # a known value (under GRAPHRUNNER_TAPE_POISON the capture left NaN)
    dev.synchronize()
    before = meta.clone()
    assert torch.equal(before, torch.full((4,), 4.0))
    x.copy_(torch.arange(4.0))
    out = b.replay(4).clone()
    ref = (x + 1) + (x + 1) * 2
    assert not torch.equal(out, ref)
    assert torch.equal(out, (x + 1) + before)  # the stale read
    dev.synchronize()  # the side stream's write lands at the next join
    assert torch.equal(meta, (x + 1) * 2)


def test_side_stream_never_joined_and_never_read_is_refused_at_capture_end(dev):
    side = dev.new_stream(name="prefetch")
    x, scratch = torch.ones(4), torch.zeros(4)

    @gr.no_graph
    def prefetch(h):
        side.wait_stream(dev.current_stream())
        with dev.stream(side):
            scratch.copy_(h)

    def forward():
        h = x + 1
        prefetch(h)
        return h * 2

    b = gr.backends.BreakableGraphBackend(device=dev, hooks=[StreamCheck()])
    with pytest.raises(CaptureError, match=r"'prefetch'.*still runs unjoined work.*scratch.copy_\(h\)"):
        with b.capture_session():
            b.capture_one(4, forward)
    b2 = gr.backends.BreakableGraphBackend(device=dev)  # negative control: without the check it captures
    with b2.capture_session():
        b2.capture_one(4, forward)
    x.fill_(3)
    assert torch.equal(b2.replay(4), (x + 1) * 2)


def test_side_stream_reading_segment_output_without_waiting_is_a_hazard(dev):
    side = dev.new_stream(name="side")
    x, out = torch.ones(4), torch.zeros(4)

    @gr.no_graph
    def consume(h):
        with dev.stream(side):  # no side.wait_stream(current): reads h racing its producer
            out.copy_(h * 2)
        dev.current_stream().wait_stream(side)

    def forward():
        h = x + 1
        consume(h)
        return out + 0

    b = gr.backends.BreakableGraphBackend(device=dev, hooks=[StreamCheck()])
    with pytest.raises(CaptureError, match=r"'side'.* reads .*h = x \+ 1"):
        with b.capture_session():
            b.capture_one(4, forward)


# --------------------------------------------------------------------------- the runner


def _runner_step(dev, side, join):
    meta = torch.zeros(8)

    @gr.no_graph
    def fill(h):
        cur = dev.current_stream()
        side.wait_stream(cur)
        with dev.stream(side):
            meta[: h.shape[0]].copy_(h.sum(-1))
        if join:
            cur.wait_stream(side)
        return meta[: h.shape[0]]

    def step(x):
        h = x * 2
        m = fill(h)
        return h + m.unsqueeze(-1)

    return step


@pytest.mark.parametrize("how", [{"checks": ("drift", "streams")}, {"debug": True}])
def test_runner_refuses_an_unjoined_fork_by_name_or_in_debug_mode(dev, how):
    side = dev.new_stream(name="side")
    r = gr.GraphRunner(
        _runner_step(dev, side, join=False),
        {"x": gr.BatchInput(trailing=(3,))},
        [4],
        backend="breakable",
        device=dev,
        warmups=1,
        progress=False,
        **how,
    )
    with pytest.raises(CaptureError, match=r"stream ownership.*'side'"):
        r.capture()


def test_runner_with_a_joined_fork_matches_eager(dev):
    side = dev.new_stream()
    step = _runner_step(dev, side, join=True)
    r = gr.GraphRunner(
        step,
        {"x": gr.BatchInput(trailing=(3,))},
        [4],
        backend="breakable",
        device=dev,
        warmups=1,
        progress=False,
        checks=("drift", "streams"),
    )
    r.capture()
    assert "streams" in gr.checks.resolve_checks(("streams",)).names()
    for n in (4, 3):
        x = torch.randn(n, 3)
        ref = x * 2 + (x * 2).sum(-1, keepdim=True)
        assert torch.allclose(r(x=x), ref)


def test_unknown_check_name_still_refused():
    with pytest.raises(ValueError, match="streams"):
        gr.checks.resolve_checks(("stream",))


# --------------------------------------------------------------------------- CUDA (debug-mode bookkeeping)


@pytest.mark.parametrize("join", [True, False])
@pytest.mark.parametrize("backend", ["breakable", "full"])
def test_cuda_streams_checked_through_torch_cuda(cuda_device, join, backend):
    """The same bookkeeping over ``torch.cuda`` streams (the CUDA stand-in without a GPU): a fork
    joined in the break replays equal to eager; an unjoined one is refused, naming the CUDA stream."""
    dev = cuda_device
    side = torch.cuda.Stream()
    x = torch.ones(4, device=dev.torch_device)
    meta = torch.zeros(4, device=dev.torch_device)

    @gr.no_graph
    def fill_meta(h):
        cur = torch.cuda.current_stream()
        side.wait_stream(cur)
        with torch.cuda.stream(side):
            meta.copy_(h * 2)
        if join:
            cur.wait_stream(side)

    def forward():
        h = x + 1
        fill_meta(h)
        return h + meta

    cls = gr.backends.BreakableGraphBackend if backend == "breakable" else gr.backends.FullGraphBackend
    b = cls(device=dev, warmups=1, hooks=[StreamCheck()])
    if not join:
        import re

        from graphrunner.checks.stream_use import _CudaLedger

        with pytest.raises(
            CaptureError,
            match=rf"stream ownership: CUDA stream \S+ reads meta .*meta.copy_.*"
            rf"ran on {re.escape(_CudaLedger.name(side.cuda_stream))},",
        ):
            with b.capture_session():
                b.capture_one(4, forward)
        return
    with b.capture_session():
        b.capture_one(4, forward)
    x.copy_(torch.arange(4.0))
    out = b.replay(4)
    torch.cuda.synchronize()
    assert torch.equal(out.cpu(), (torch.arange(4.0) + 1) * 3)
