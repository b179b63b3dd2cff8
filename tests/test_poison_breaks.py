"""Steps with eager breaks, re-run with ``GRAPHRUNNER_TAPE_POISON=1`` in the normal suite (issue 23 item 3).

On a GPU, a tensor computed inside a graph segment holds uninitialised memory at capture time
until the first replay; an eager break that reads it on the host then fails at random. The
tape shows it deterministically when its survivors are poisoned. The whole suite under poison
costs minutes (``GRAPHRUNNER_TAPE_POISON=1 python -m pytest``), so CI runs these key breakable
scenarios with poison on instead: the verify loop (``graphrunner verify``, ``loadtest --spec``),
a breakable loadtest, and a break that reads a segment's result, with its negative control.
"""

from __future__ import annotations

import io

import pytest
import torch

import graphrunner as gr
from graphrunner.backends import BreakableGraphBackend
from graphrunner.breakable import no_graph
from graphrunner_tools import spec
from graphrunner_tools.loadtest import LoadtestConfig, run_loadtest
from graphrunner_tools.models import LlamaConfig, build_model

SMALL = dict(requests=3, max_new=6, k=3, reqs_buckets=(1, 2, 4), draft_buckets=(2, 4), layers=1, progress=False)


@pytest.fixture(autouse=True)
def poison(monkeypatch, one_torch_thread):
    monkeypatch.setenv("GRAPHRUNNER_TAPE_POISON", "1")
    assert gr.TapeDevice().poison_captured_values


def test_verify_loop_under_poison_equals_eager():
    """The verify step masks padded positions in an eager break: its attention break never
    reads positions computed inside a graph segment."""
    out = io.StringIO()
    res = spec.run_spec(backend="breakable", out=out, **SMALL)
    assert res.ok, out.getvalue()
    assert res.tokens == 3 * 6


def test_masking_inside_a_segment_is_read_as_garbage_by_the_attention_break():
    """Negative control: the verify step as it was (padding masked inside the segment, read on
    the host by the varlen attention break) fails at capture under poison."""
    config = LlamaConfig.tiny(num_layers=1, attention="varlen", max_seq_len=16, max_batch_size=3)
    model = build_model(config, seed=0)
    scratch = config.max_seq_len - 1

    def in_segment(tokens, positions, lens, slots):
        cells = torch.arange(tokens.shape[1])
        return model.verify_step(tokens, positions.masked_fill(cells[None, :] >= lens[:, None], scratch), slots)

    def fixed(tokens, positions, lens, slots):
        return model.verify_step(tokens, spec.mask_padding(positions, lens, scratch), slots)

    tokens = torch.tensor([[3, 4], [5, 0]])
    positions = torch.tensor([[2, 3], [4, 0]])
    lens, slots = torch.tensor([2, 1]), torch.tensor([0, 1])
    args = (tokens, positions, lens, slots)
    with torch.inference_mode():
        eager = fixed(*args)
    model.reset_cache()
    backend = BreakableGraphBackend(device=gr.TapeDevice())
    with torch.inference_mode():
        with pytest.raises(gr.CaptureError, match="positions must lie in"):
            with backend.capture_session():
                backend.capture_one(2, lambda: in_segment(*args))
        model.reset_cache()
        with backend.capture_session():
            backend.capture_one(2, lambda: fixed(*args))
        model.reset_cache()
        got = backend.replay(2)
    assert torch.equal(got, eager)


def test_breakable_loadtest_under_poison():
    cfg = LoadtestConfig(
        requests=4,
        concurrency=(2,),
        backend="breakable",
        device="tape",
        layers=1,
        prompt_len=(2, 6),
        output_len=(2, 5),
        progress=False,
    )
    res = run_loadtest(cfg)
    assert res.ok, res


def test_a_break_reading_a_segment_result_sees_real_values_at_replay():
    """A ``@no_graph`` function that reads a segment's output on the host: garbage (poison) at
    capture is caught by its own check; every replay gives the eager result."""
    seen = []

    @no_graph
    def host_scale(t):
        m = float(t.abs().max())
        seen.append(m)
        return t / (m + 1.0) if m == m else torch.zeros_like(t)  # NaN (poison) at capture

    w = torch.randn(8, 8, generator=torch.Generator().manual_seed(0))

    def step(x):
        return host_scale(x @ w) * 2

    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(1))
    backend = BreakableGraphBackend(device=gr.TapeDevice(), warmups=1, drift_check=False)
    with backend.capture_session():
        backend.capture_one(3, lambda: step(x))
    assert seen[-1] != seen[-1]  # the capture read NaN: what a GPU would hand it (garbage)
    fresh = torch.randn(3, 8, generator=torch.Generator().manual_seed(2))
    x.copy_(fresh)
    assert torch.equal(backend.replay(3), step(fresh))
