"""Replay equals eager, for every backend on the tape device, several keys,
fresh inputs at every step, with eager breaks."""

import pytest
import torch
from torch import nn

from graphrunner.backends import BreakableGraphBackend, EagerBackend, FullGraphBackend
from graphrunner.backends.protocol import check_capture_order
from graphrunner.breakable import no_graph
from graphrunner.devices import TapeDevice
from graphrunner.errors import CaptureError, CaptureUnsafeOpError
from graphrunner.trace import Trace

MAX_ROWS, D = 8, 16
KEYS = (8, 5, 2, 1)


class Tiny(nn.Module):
    """Two linears around a @no_graph step; the step reads a host value when
    ``host_read`` (capture-unsafe: only legal in an eager break)."""

    def __init__(self, host_read=False):
        super().__init__()
        self.lin1 = nn.Linear(D, 32)
        self.lin2 = nn.Linear(32, D)
        self.host_read = host_read

    @no_graph
    def mid(self, h, scale):
        if self.host_read:
            return h * float(scale.item())  # a host sync: breaks a full graph
        return h * scale

    def forward(self, x, scale):
        h = self.mid(torch.nn.functional.gelu(self.lin1(x)), scale)
        logits = self.lin2(h)
        return {"logits": logits, "stats": (h.mean(dim=1), logits.sum())}


def _capture(backend, model, static_x, static_scale, keys=KEYS):
    with torch.inference_mode(), backend.capture_session():
        for k in keys:
            backend.capture_one(
                k, lambda k=k: model(static_x[:k], static_scale), capture_inputs=(static_x, static_scale)
            )


def _check_steps(backend, model, static_x, static_scale, steps=6, seed=1):
    g = torch.Generator().manual_seed(seed)
    order = [KEYS[i % len(KEYS)] for i in (0, 3, 1, 2, 2, 0, 1, 3)][:steps]
    for k in order:
        new_x = torch.randn(k, D, generator=g)
        new_scale = torch.rand(1, generator=g) + 0.5
        with torch.inference_mode():
            static_x[:k].copy_(new_x)
            static_scale.copy_(new_scale)
            out = backend.replay(k)
            ref = model(new_x, new_scale)
        torch.testing.assert_close(out["logits"], ref["logits"], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(out["stats"][0], ref["stats"][0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(out["stats"][1], ref["stats"][1], rtol=1e-4, atol=1e-4)
        assert out["logits"].shape == (k, D)


@pytest.mark.parametrize(
    "make",
    [
        lambda tr: FullGraphBackend(device=TapeDevice(), trace=tr),
        lambda tr: BreakableGraphBackend(device=TapeDevice(), trace=tr),
        lambda tr: BreakableGraphBackend(device=TapeDevice(), trace=tr, debug_eager=True),
        lambda tr: EagerBackend(device=TapeDevice(), trace=tr),
    ],
    ids=["full", "breakable", "breakable_debug_eager", "eager"],
)
def test_replay_equals_eager_several_keys(make):
    torch.manual_seed(0)
    model = Tiny().eval()
    static_x = torch.zeros(MAX_ROWS, D)
    static_scale = torch.ones(1)
    trace = Trace()
    backend = make(trace)
    _capture(backend, model, static_x, static_scale)
    assert all(backend.can_run(k) for k in KEYS)
    _check_steps(backend, model, static_x, static_scale)
    assert check_capture_order(trace) == []
    if isinstance(backend, BreakableGraphBackend) and not backend.debug_eager:
        assert (backend.info(2)["num_segments"], backend.info(2)["num_breaks"]) == (2, 1)
    backend.cleanup()
    assert not any(backend.can_run(k) for k in KEYS)


def test_breakable_runs_a_host_sync_eagerly_and_full_graph_rejects_it():
    torch.manual_seed(0)
    model = Tiny(host_read=True).eval()
    static_x = torch.zeros(MAX_ROWS, D)
    static_scale = torch.ones(1)

    backend = BreakableGraphBackend(device=TapeDevice())
    _capture(backend, model, static_x, static_scale)
    _check_steps(backend, model, static_x, static_scale)  # the .item() reruns at every replay

    # Negative control: the same model in one full graph cannot be captured.
    full = FullGraphBackend(device=TapeDevice())
    with pytest.raises(CaptureError, match="shape key 8") as ei:
        _capture(full, model, torch.zeros(MAX_ROWS, D), torch.ones(1))
    assert isinstance(ei.value.__cause__, CaptureUnsafeOpError)
    assert not full.can_run(8)


def test_replay_outputs_are_views_overwritten_by_the_next_replay():
    torch.manual_seed(0)
    model = Tiny().eval()
    static_x = torch.randn(MAX_ROWS, D)
    static_scale = torch.ones(1)
    backend = FullGraphBackend(device=TapeDevice())
    _capture(backend, model, static_x, static_scale, keys=(8, 4))
    with torch.inference_mode():
        a = backend.replay(4)["logits"]
        kept = a.clone()
        static_x.mul_(2)
        b = backend.replay(8)["logits"]
    assert a.data_ptr() == b.data_ptr()
    assert not torch.allclose(a, kept)  # overwritten: clone to keep
    torch.testing.assert_close(b, model(static_x, static_scale)["logits"])
