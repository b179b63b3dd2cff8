"""Scratch memory of the out= check reused within a capture session (tape.state.scratch_storage).

The out= check (``bindings.Verifier._out_ok``) runs the binding with ``out=`` a
buffer prefilled with poison and compares.  Inside a session the buffer's
memory is reused from an earlier check (no page faults): it then holds that
check's result, which may be the very bits expected.  The prefill must still
happen, so that a kernel that does not write (or reads) its output is caught;
the negative control shows a skipped prefill lets such a kernel through.
"""

import torch

from graphrunner.tape import TapeGraph, bindings, state, tape_graph
from graphrunner.tape.state import reuse_snapshot_buffers


def _verifier():
    v = bindings.Verifier.__new__(bindings.Verifier)
    v.twin_st = {}
    return v


def _lazy(x, out=None):
    """A 'kernel' that writes nothing into its out= buffer."""
    return out


def test_scratch_is_reused_in_a_session_and_dropped_after():
    with reuse_snapshot_buffers():
        a = state.scratch_storage(1 << 20, torch.device("cpu"))
        p = a.data_ptr()
        state.give_back_scratch(a)
        del a
        b = state.scratch_storage(1 << 20, torch.device("cpu"))
        assert b.data_ptr() == p
        state.give_back_scratch(b)
    assert not state._SCRATCH_FREE
    c = state.scratch_storage(1 << 20, torch.device("cpu"))
    state.give_back_scratch(c)  # outside a session: not kept
    assert not state._SCRATCH_FREE


def test_out_check_prefills_reused_scratch(monkeypatch):
    monkeypatch.setattr(bindings, "_is_function", lambda fn: True)
    x = torch.randn(256, 128)
    out = torch.tanh(x)
    v = _verifier()
    with reuse_snapshot_buffers():
        assert v._out_ok(torch.tanh, [x], {}, out)  # the real kernel: its bits land in the scratch
        assert state._SCRATCH_FREE  # given back, holding tanh(x)
        assert not v._out_ok(_lazy, [x], {}, out)  # same memory, prefilled: writing nothing is caught


def test_negative_control_without_the_prefill_a_lazy_kernel_passes(monkeypatch):
    monkeypatch.setattr(bindings, "_is_function", lambda fn: True)
    monkeypatch.setattr(bindings, "poison_value", lambda dtype: None)
    x = torch.randn(256, 128)
    out = torch.tanh(x)
    v = _verifier()
    with reuse_snapshot_buffers():
        assert v._out_ok(torch.tanh, [x], {}, out)
        assert v._out_ok(_lazy, [x], {}, out)  # wrongly accepted: the reused scratch held tanh(x)


def test_session_captures_replay_like_eager():
    def step(x):
        return torch.tanh(x * 0.5) * 2 + x

    graphs = []
    with reuse_snapshot_buffers(), torch.inference_mode():
        for _ in range(3):
            x = torch.randn(300, 200)
            g = TapeGraph()
            with tape_graph(g):
                out = step(x)
            graphs.append((g, x, out))
    for g, x, out in graphs:
        for _ in range(2):
            with torch.inference_mode():
                x.copy_(torch.randn(300, 200))
            g.replay()
            with torch.inference_mode():
                assert torch.equal(out, step(x))
