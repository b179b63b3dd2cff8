"""The capture protocol, observed on real calls, for every backend.

A recording device (its ``synchronize`` and ``new_graph`` append to a log), a
recording group (its ``barrier`` appends), a forward and a hook that append:
the log is the order things really happened in. Negative controls: backend
subclasses that break exactly one protocol step fail the same assertions and
are reported by ``check_capture_order``.
"""

import dataclasses
import gc
import weakref
from collections import namedtuple

import pytest
import torch

from graphrunner.backends import BreakableGraphBackend, EagerBackend, FullGraphBackend, GraphBackend
from graphrunner.backends.protocol import check_capture_order
from graphrunner.breakable import no_graph
from graphrunner.devices import TapeDevice
from graphrunner.errors import CaptureError, RankTimeoutError
from graphrunner.group import LocalGroup
from graphrunner.trace import EventKind, Trace


class RecordingDevice(TapeDevice):
    """A real tape device whose synchronize / new_graph also log."""

    def __init__(self, log):
        super().__init__("cpu")
        self.log = log

    def synchronize(self):
        self.log.append("sync")
        super().synchronize()

    def new_graph(self):
        self.log.append("new_graph")
        return super().new_graph()


class RecordingGroup(LocalGroup):
    """A one-rank group whose barrier logs (with its phase)."""

    def __init__(self, log, fail_phase=None):
        self.log = log
        self.phases = []
        self.fail_phase = fail_phase

    def barrier(self, phase="", key=None):
        self.log.append("barrier")
        self.phases.append((phase, key))
        if phase == self.fail_phase:
            raise RankTimeoutError(f"rank 0 of 2: barrier in phase {phase!r} for shape key {key!r} did not complete")


# The negative controls: each breaks one protocol step, nothing else.
class NoFinalSync(FullGraphBackend):
    def _final_sync(self, key):
        pass


class NoFinalBarrier(FullGraphBackend):
    def _final_barrier(self, key):
        pass


class BreakableNoFinalSync(BreakableGraphBackend):
    def _final_sync(self, key):
        pass


class BreakableNoFinalBarrier(BreakableGraphBackend):
    def _final_barrier(self, key):
        pass


class SyncInReplay(FullGraphBackend):
    def replay(self, key):
        with self.trace.span(EventKind.REPLAY, key=key, backend=self.name, rank=self.rank):
            self._sync(key, "replay")  # the bug: a device sync on the replay path
        return super().replay(key)


class HookAfterConstruction(FullGraphBackend):
    """Runs the post-warmup hook once more right after graph construction."""

    def _post_warmup_hook(self, key, hook, i):
        self._hook = hook
        super()._post_warmup_hook(key, hook, i)

    def _construct(self, key):
        graph = super()._construct(key)
        self._post_warmup_hook(key, self._hook, self.warmups)  # the bug
        return graph


class TwoCaptureForwards(FullGraphBackend):
    """Captures the forward twice (the second time into a fresh graph)."""

    def _capture_forward(self, key, graph, fn):
        super()._capture_forward(key, graph, fn)
        super()._capture_forward(key, self._make_graph(key), fn)  # the bug


class BarrierInReplay(FullGraphBackend):
    def replay(self, key):
        with self.trace.span(EventKind.REPLAY, key=key, backend=self.name, rank=self.rank):
            self._barrier(key, "replay")  # the bug: a group call on the replay path
        return super().replay(key)


W = torch.randn(6, 5)


def make_forward(log, x, rows, with_break=False):
    @no_graph
    def host_side(h):
        log.append("break")
        return h + 1.0

    def forward():
        log.append("forward")
        h = x[:rows] @ W
        if with_break:
            h = host_side(h)
        return torch.relu(h)

    return forward


def run_capture(cls, keys=(8,), with_break=False, warmups=2, **kw):
    log = []
    trace = Trace()
    dev, grp = RecordingDevice(log), RecordingGroup(log)
    backend = cls(device=dev, group=grp, warmups=warmups, trace=trace, **kw)
    x = torch.randn(8, 6)
    with torch.inference_mode(), backend.capture_session():
        for k in keys:
            backend.capture_one(
                k, make_forward(log, x, k, with_break), capture_inputs=x, post_warmup_hook=lambda: log.append("hook")
            )
    return backend, log, trace, x, grp


def assert_protocol_order(log, warmups=2):
    """The order of real calls for one key: what the issue requires."""
    warm = ["sync", "barrier", "forward", "hook"] * warmups
    assert log[: len(warm)] == warm, log
    rest = log[len(warm) :]
    last_hook = len(warm) - 1
    # final hook < synchronize < barrier < graph construction
    assert rest[:3] == ["sync", "barrier", "new_graph"], f"after the last hook (index {last_hook}): {rest}"
    assert log.count("forward") == warmups + 1, log  # 2 warmups + 1 captured
    assert log.count("hook") == warmups, log  # never for the capture
    assert "new_graph" not in log[: len(warm) + 2]


GRAPH_BACKENDS = [FullGraphBackend, BreakableGraphBackend]


@pytest.mark.parametrize("cls", GRAPH_BACKENDS)
def test_protocol_order_observed(cls):
    backend, log, trace, x, _ = run_capture(cls)
    assert_protocol_order(log)
    assert check_capture_order(trace) == []
    # replay: no synchronize, no barrier, no new graph, no python forward
    del log[:]
    with torch.inference_mode():
        for _ in range(3):
            backend.replay(8)
    assert log == []
    assert check_capture_order(trace) == []


@pytest.mark.parametrize("bad", [NoFinalSync, BreakableNoFinalSync])
def test_negative_control_no_final_sync(bad):
    _, log, trace, _, _ = run_capture(bad)
    with pytest.raises(AssertionError):
        assert_protocol_order(log)
    v = check_capture_order(trace)
    assert any("no synchronize between the last warmup/hook and graph construction" in s for s in v), v


@pytest.mark.parametrize("bad", [NoFinalBarrier, BreakableNoFinalBarrier])
def test_negative_control_no_final_barrier(bad):
    _, log, trace, _, _ = run_capture(bad)
    with pytest.raises(AssertionError):
        assert_protocol_order(log)
    v = check_capture_order(trace)
    assert any("no barrier between the last warmup/hook and graph construction" in s for s in v), v


def test_negative_control_sync_in_replay():
    backend, log, trace, _, _ = run_capture(SyncInReplay)
    del log[:]
    with torch.inference_mode():
        backend.replay(8)
    assert "sync" in log  # what the replay assertion above would catch
    v = check_capture_order(trace)
    assert any("synchronize inside replay" in s for s in v), v


def test_negative_control_hook_after_construction():
    _, log, trace, _, _ = run_capture(HookAfterConstruction)
    assert log.index("hook", log.index("new_graph")) > log.index("new_graph")  # the bug really ran
    with pytest.raises(AssertionError):
        assert_protocol_order(log)
    v = check_capture_order(trace)
    assert any("post-warmup hook ran after graph construction" in s for s in v), v
    assert any("3 post-warmup hooks for 2 warmup forwards" in s for s in v), v


def test_negative_control_two_capture_forwards():
    # The drift check sees the doubled capture (twice the warmup's ops) and refuses it ...
    with pytest.raises(CaptureError, match="drift between warmup 2 and the capture.*capture ran 6 ops and warmup 2 3"):
        run_capture(TwoCaptureForwards)
    # ... without it, the trace checker is what catches it.
    _, log, trace, _, _ = run_capture(TwoCaptureForwards, drift_check=False)
    assert log.count("forward") == 4  # 2 warmups + 2 captures
    with pytest.raises(AssertionError):
        assert_protocol_order(log)
    v = check_capture_order(trace)
    assert any("2 capture forwards, expected exactly 1" in s for s in v), v


def test_negative_control_barrier_in_replay():
    backend, log, trace, _, _ = run_capture(BarrierInReplay)
    assert check_capture_order(trace) == []  # capture itself is fine
    del log[:]
    with torch.inference_mode():
        backend.replay(8)
    assert log == ["barrier"]  # what test_protocol_order_observed's `log == []` would catch
    v = check_capture_order(trace)
    assert any("barrier inside replay" in s for s in v), v


def test_protocol_order_several_keys_and_zero_warmups():
    backend, log, trace, _, _ = run_capture(FullGraphBackend, keys=(8, 4, 2))
    per_key = len(log) // 3
    for i in range(3):
        assert_protocol_order(log[i * per_key : (i + 1) * per_key])
    assert check_capture_order(trace) == []
    backend, log, trace, _, _ = run_capture(FullGraphBackend, keys=(8,), warmups=0)
    assert log == ["sync", "barrier", "new_graph", "forward"]
    assert check_capture_order(trace) == []


def test_eager_backend_same_protocol_and_runs_forward_at_replay():
    backend, log, trace, x, _ = run_capture(EagerBackend)
    assert log == ["sync", "barrier", "forward", "hook"] * 2 + ["sync", "barrier", "forward"]
    assert check_capture_order(trace) == []
    del log[:]
    with torch.inference_mode():
        out = backend.replay(8)
    assert log == ["forward"]
    torch.testing.assert_close(out, torch.relu(x @ W))


def test_breakable_barrier_before_each_eager_break_during_capture_only():
    backend, log, trace, x, grp = run_capture(BreakableGraphBackend, with_break=True)
    assert_protocol_order([e for e in log if e != "break"])
    assert log[:10] == ["sync", "barrier", "forward", "break", "hook"] * 2
    tail = log[10:]  # after the warmups
    # sync, barrier, [segment 1: new_graph, forward], barrier, break, [segment 2: new_graph]
    assert tail == ["sync", "barrier", "new_graph", "forward", "barrier", "break", "new_graph"], tail
    assert [p for p, _ in grp.phases] == ["warmup", "warmup", "pre_capture", "capture_break"]
    assert check_capture_order(trace) == []  # the nested barrier is not a protocol violation
    info = backend.info(8)
    assert (info["num_segments"], info["num_breaks"]) == (2, 1)
    del log[:]
    with torch.inference_mode():
        out = backend.replay(8)
    assert log == ["break"]  # the eager break runs at replay; no barrier, no sync
    torch.testing.assert_close(out, torch.relu(x @ W + 1.0))
    kinds = [e.kind for e in trace.events]
    assert EventKind.SEGMENT_BEGIN in kinds and EventKind.EAGER_BREAK in kinds


def test_breakable_debug_eager_is_one_eager_break():
    backend, log, trace, x, _ = run_capture(BreakableGraphBackend, with_break=True, debug_eager=True)
    info = backend.info(8)
    assert (info["num_segments"], info["num_breaks"]) == (0, 1)
    assert check_capture_order(trace) == []
    del log[:]
    with torch.inference_mode():
        x.copy_(torch.randn(8, 6))
        out = backend.replay(8)
    assert log == ["forward", "break"]  # the whole forward runs eagerly at replay
    torch.testing.assert_close(out, torch.relu(x @ W + 1.0))


# ------------------------------------------------------------------ misuse
def test_bad_warmups():
    with pytest.raises(ValueError, match="warmups must be >= 0"):
        FullGraphBackend(device=TapeDevice(), warmups=-1)
    with pytest.raises(TypeError, match="warmups must be an int"):
        FullGraphBackend(device=TapeDevice(), warmups=1.5)


def test_capture_outside_session_and_replay_unknown_key():
    b = FullGraphBackend(device=TapeDevice())
    with pytest.raises(CaptureError, match="outside a capture session"):
        b.capture_one(8, lambda: torch.ones(8))
    assert not b.can_run(8) and not b.can_run([8])
    with pytest.raises(CaptureError, match="replay of shape key 8, which this FullGraphBackend never captured"):
        b.replay(8)
    with pytest.raises(KeyError):
        b.info(8)


def test_duplicate_key_nested_session_unhashable_key():
    b = FullGraphBackend(device=TapeDevice(), warmups=0)
    x = torch.ones(4)
    with b.capture_session():
        b.capture_one(4, lambda: x * 2)
        with pytest.raises(CaptureError, match="already captured"):
            b.capture_one(4, lambda: x * 2)
        with pytest.raises(TypeError, match="hashable"):
            b.capture_one([4], lambda: x * 2)
        with pytest.raises(CaptureError, match="do not nest"):
            with b.capture_session():
                pass


def test_capture_session_freezes_gc_and_records_events():
    trace = Trace()
    b = FullGraphBackend(device=TapeDevice(), trace=trace)
    before = gc.get_freeze_count()
    with pytest.raises(RuntimeError, match="inside"):
        with b.capture_session():
            assert gc.get_freeze_count() > before
            raise RuntimeError("inside")
    assert gc.get_freeze_count() == before
    assert [e.kind for e in trace.events] == [EventKind.SESSION_BEGIN, EventKind.SESSION_END]


@pytest.mark.parametrize("cls", [FullGraphBackend, BreakableGraphBackend, EagerBackend])
@pytest.mark.parametrize("when", ["warmup2", "capture"])
def test_failure_in_capture_is_capture_error_with_key_and_cause(cls, when):
    calls = {"n": 0}
    x = torch.ones(4, 2)

    def forward():
        calls["n"] += 1
        if (when == "warmup2" and calls["n"] == 2) or (when == "capture" and calls["n"] == 3):
            raise ZeroDivisionError("model bug")
        return x * 3

    trace = Trace()
    b = cls(device=TapeDevice(), trace=trace)
    with b.capture_session():
        with pytest.raises(CaptureError) as ei:
            b.capture_one(4, forward)
    msg = str(ei.value)
    assert "shape key 4" in msg and "ZeroDivisionError: model bug" in msg
    assert ("warmup 2/2 forward" if when == "warmup2" else "during capture") in msg
    assert isinstance(ei.value.__cause__, ZeroDivisionError)
    # state cleaned: nothing captured, buffer released, the same key captures fine afterwards
    assert not b.can_run(4) and b._out.allocated is False
    with b.capture_session():
        b.capture_one(4, lambda: x * 5)
    torch.testing.assert_close(b.replay(4), x * 5)


def test_rank_timeout_passes_through_unchanged():
    log = []
    grp = RecordingGroup(log, fail_phase="pre_capture")
    b = FullGraphBackend(device=RecordingDevice(log), group=grp)
    with b.capture_session():
        with pytest.raises(RankTimeoutError, match="pre_capture") as ei:
            b.capture_one(4, lambda: torch.ones(4))
    assert type(ei.value) is RankTimeoutError
    assert "new_graph" not in log  # never constructed a graph
    assert not b.can_run(4)


def test_hook_failure_is_capture_error_naming_the_hook():
    b = FullGraphBackend(device=TapeDevice())

    def hook():
        raise KeyError("cache")

    with b.capture_session():
        with pytest.raises(CaptureError, match=r"post-warmup hook 1/2") as ei:
            b.capture_one(2, lambda: torch.ones(2), post_warmup_hook=hook)
    assert isinstance(ei.value.__cause__, KeyError)


# ----------------------------------------------------------------- outputs
@dataclasses.dataclass
class Out:
    logits: torch.Tensor
    aux: object = None


Pair = namedtuple("Pair", "a b")


@pytest.mark.parametrize("cls", [FullGraphBackend, BreakableGraphBackend, EagerBackend])
def test_pytree_outputs_share_one_buffer(cls):
    x = torch.randn(8, 3)

    def fwd(k):
        def f():
            h = x[:k] * 2
            return {"out": Out(logits=h + 1, aux=[h.sum(), None]), "pair": Pair(h, (h - 1,)), "none": None}

        return f

    b = cls(device=TapeDevice())
    with torch.inference_mode(), b.capture_session():
        for k in (8, 5, 1):
            b.capture_one(k, fwd(k), capture_inputs=x)
    with torch.inference_mode():
        x.copy_(torch.randn(8, 3))
        outs = {}
        for k in (8, 5, 1):
            o = b.replay(k)
            h = x[:k] * 2
            assert isinstance(o["out"], Out) and isinstance(o["pair"], Pair) and o["none"] is None
            torch.testing.assert_close(o["out"].logits, h + 1)
            torch.testing.assert_close(o["out"].aux[0], h.sum())  # 0-dim: the whole shared scalar
            assert o["out"].aux[1] is None
            torch.testing.assert_close(o["pair"].a, h)
            torch.testing.assert_close(o["pair"].b[0], h - 1)
            assert o["pair"].a.shape[0] == k
            outs[k] = o
    # leading-rows views of one buffer, allocated at the first (largest) key
    assert outs[5]["pair"].a.data_ptr() == outs[8]["pair"].a.data_ptr()
    assert outs[1]["out"].logits.data_ptr() == outs[8]["out"].logits.data_ptr()
    assert outs[1]["out"].aux[0].data_ptr() == outs[8]["out"].aux[0].data_ptr()
    info8, info1 = b.info(8), b.info(1)
    assert info8["output_buffer_bytes"] == info1["output_buffer_bytes"] == 4 * (3 * 8 * 3 + 1)
    assert info1["output_bytes"] == 4 * (3 * 1 * 3 + 1)
    assert info1["capture_input_bytes"] == x.numel() * 4
    assert info1["bytes_held"] == info1["output_bytes"] + info1["capture_input_bytes"]
    assert info1["capture_seconds"] > 0 and info1["backend"] == b.name and info1["key"] == 1


def test_structure_change_between_keys_names_both_structures():
    x = torch.randn(8, 3)
    b = FullGraphBackend(device=TapeDevice())
    with b.capture_session():
        b.capture_one(8, lambda: (x, x.sum(0)))
        with pytest.raises(CaptureError) as ei:
            b.capture_one(4, lambda: {"a": x[:4]})
    msg = str(ei.value)
    assert "dict('a': Tensor[4, 3] float32)" in msg and "tuple(Tensor[8, 3] float32, Tensor[3] float32)" in msg
    assert "shape key 8" in msg and "shape key 4" in msg
    with b.capture_session():
        with pytest.raises(CaptureError, match="more than the 8 rows"):
            b.capture_one(16, lambda: (torch.zeros(16, 3), torch.zeros(3)))
        with pytest.raises(CaptureError, match="only dim 0"):
            b.capture_one(2, lambda: (x[:2].double(), x.sum(0)))
        with pytest.raises(CaptureError, match="a captured forward may return only tensors"):
            b.capture_one(3, lambda: (x[:3], 7))
    assert b.keys() == [8]


def test_output_buffer_views_before_allocate_is_a_capture_error():
    # was a TypeError from describe(None) (found by mypy: the buffer's spec is None until allocate)
    from graphrunner.backends.outputs import OutputBuffer

    buf = OutputBuffer()
    with pytest.raises(CaptureError, match="shared output buffer is not allocated"):
        buf.views(torch.zeros(2, 3), 8)
    buf.allocate(torch.zeros(2, 3), 8)
    buf.release()
    with pytest.raises(CaptureError, match=r"shape key 4 returned Tensor\[1, 3\] float32, .* not allocated"):
        buf.views(torch.zeros(1, 3), 4)


def test_capture_inputs_live_until_cleanup():
    b = FullGraphBackend(device=TapeDevice())
    inp = torch.randn(4, 2)
    ref = weakref.ref(inp)
    with b.capture_session():
        b.capture_one(4, lambda: torch.ones(4), capture_inputs={"x": inp})
    del inp
    gc.collect()
    assert ref() is not None
    b.cleanup()
    gc.collect()
    assert ref() is None
    assert not b.can_run(4) and b.keys() == []


def test_base_class_is_abstract():
    b = GraphBackend(device=TapeDevice(), warmups=0)
    with b.capture_session():
        with pytest.raises(CaptureError, match="graph construction") as ei:
            b.capture_one(1, lambda: torch.ones(1))
    assert isinstance(ei.value.__cause__, NotImplementedError)


def test_full_backend_unsafe_op_advice_says_no_graph_needs_a_breakable_graph():
    """The tape's advice ("into a function decorated with @no_graph") does nothing on a full graph:
    the full backend's error says to use the breakable backend; the breakable one does not add it."""
    import graphrunner as gr
    from graphrunner.backends import BreakableGraphBackend, FullGraphBackend

    x = torch.ones(2, 3)

    def step():
        return x * float(x.sum())  # a host read

    for backend, hinted in ((FullGraphBackend(), True), (BreakableGraphBackend(), False)):
        with backend.capture_session(), pytest.raises(gr.CaptureError) as err:
            backend.capture_one(2, step)
        assert ("use backend='breakable'" in str(err.value)) is hinted, str(err.value)


@pytest.mark.parametrize("cls", [EagerBackend, FullGraphBackend, BreakableGraphBackend])
def test_a_hook_sees_the_ops_of_the_capture_only_not_of_replays(cls):
    """The hooks' op recorder feeds the captured forward's ops to ``capture_consumers`` during the
    capture; the forward a graph holds does not keep it: an eager backend's replay (which runs
    that forward again) records nothing."""
    from graphrunner.recording.hooks import CaptureHook
    from graphrunner.recording.ops import OpConsumer

    class Count(OpConsumer):
        n = 0

        def before(self, ev):
            self.n += 1

    class Watch(CaptureHook):
        def __init__(self):
            self.ops = Count()

        def capture_consumers(self, cap):
            return (self.ops,)

    x = torch.ones(2, 3)
    hook = Watch()
    b = cls(device=TapeDevice(), hooks=[hook])
    with b.capture_session():
        b.capture_one(2, lambda: (x * 2).sin())
    assert hook.ops.n == 2  # mul, sin
    for _ in range(3):
        assert torch.equal(b.replay(2), (x * 2).sin())
    assert hook.ops.n == 2
    if cls is EagerBackend:  # negative control: a held forward that kept the recorder records every replay
        from graphrunner.recording.ops import OpRecorder

        b._entries[2].graph.fn.recorder = OpRecorder([hook.ops])
        b.replay(2)
        assert hook.ops.n == 4
