"""Zero-row calls on one rank (issue 24): an idle call is valid, returns empty outputs and
replays nothing; a positional call and a bucket too big to allocate are clear user errors.

The step counts its replays in an external tensor it writes (``hits``), so "nothing ran" is
observed from the step itself, not from the runner's own stats. The multi-rank half (an idle
rank joins its peers' padded step) is tests/test_idle_ranks_multirank.py.
"""

from __future__ import annotations

import pytest
import torch

import graphrunner as gr

D = 4


def make(backend, **kw):
    hits = torch.zeros((), dtype=torch.long)
    w = torch.randn(D, D, generator=torch.Generator().manual_seed(0))

    def step(x):
        hits.add_(1)  # captured: every replay (and every eager run) counts once
        return torch.tanh(x @ w)

    r = gr.GraphRunner(
        step,
        {"x": gr.BatchInput(trailing=(D,))},
        [1, 2, 4],
        backend=backend,
        device="tape",
        warmups=1,
        progress=False,
        checks=(),
        **kw,
    )
    r.capture()
    return r, hits, (lambda x: torch.tanh(x @ w))


@pytest.mark.parametrize("backend", ["full", "breakable", "eager"])
def test_a_zero_row_call_returns_empty_outputs_and_replays_nothing(backend):
    r, hits, eager = make(backend)
    x3 = torch.randn(3, D)
    assert torch.allclose(r(x=x3), eager(x3), atol=1e-6)
    before, replays = int(hits), dict(r.stats.replays)
    out = r(x=torch.zeros(0, D))
    ref = eager(torch.zeros(0, D))
    assert out.shape == ref.shape == (0, D) and out.dtype == ref.dtype
    assert int(hits) == before, "the idle call ran the step"
    assert r.stats.replays == replays and r.stats.fallbacks == 0 and r.stats.last_bucket is None
    # Negative control: a one-row call does run the step (the counter sees replays).
    x1 = torch.randn(1, D)
    assert torch.allclose(r(x=x1), eager(x1), atol=1e-6) and int(hits) == before + 1
    # The runner is unchanged by the idle call: a padded call after it equals eager.
    r(x=torch.zeros(0, D))
    x2 = torch.randn(2, D)
    assert torch.allclose(r(x=x2), eager(x2), atol=1e-6)


def test_zero_rows_with_copy_outputs_and_dict_outputs():
    hits = torch.zeros((), dtype=torch.long)

    def step(x):
        hits.add_(1)
        return {"y": x * 2.0, "z": x.sum(-1)}

    r = gr.GraphRunner(
        step,
        {"x": gr.BatchInput(trailing=(D,))},
        [2, 4],
        backend="full",
        device="tape",
        warmups=1,
        progress=False,
        copy_outputs=True,
    )
    r.capture()
    before = int(hits)
    out = r(x=torch.zeros(0, D))
    assert out["y"].shape == (0, D) and out["z"].shape == (0,) and int(hits) == before


def test_a_zero_dim_output_makes_the_idle_call_run_the_smallest_bucket():
    # A 0-dim leaf is not empty at 0 rows: the step runs on one bucket of padding rows (the smallest
    # bucket) so that leaf is computed like any padded call's; the batch-major leaf has 0 rows.
    hits = torch.zeros((), dtype=torch.long)

    def step(x):
        hits.add_(1)
        return x * 3.0, (x + 1.0).sum()

    r = gr.GraphRunner(
        step,
        {"x": gr.BatchInput(trailing=(D,), pad=0.0)},
        [2, 4],
        backend="full",
        device="tape",
        warmups=1,
        progress=False,
        checks=(),
    )
    r.capture()
    before = int(hits)
    rows, total = r(x=torch.zeros(0, D))
    assert rows.shape == (0, D) and int(hits) == before + 1 and r.stats.last_bucket == 2
    assert total.item() == (torch.zeros(2, D) + 1.0).sum().item() == 2 * D  # two padding rows of zeros
    # Negative control: a full bucket of real rows gives another total.
    _, total4 = r(x=torch.ones(4, D))
    assert total4.item() == 2.0 * 4 * D


def test_zero_rows_on_a_runner_without_replayable_keys_runs_nothing():
    r, hits, _ = make("full", max_padding_ratio=0.0)
    before = int(hits)
    assert r(x=torch.zeros(0, D)).shape == (0, D) and int(hits) == before
    # Negative control: 3 rows fall back (bucket 4 pads 1/4 > 0) and do run the step eagerly.
    r(x=torch.randn(3, D))
    assert int(hits) == before + 1 and r.stats.fallbacks == 1


def test_bucket_for_zero_rows_is_none():
    r, _, _ = make("full")
    assert r.bucket_for(0) is None and r.bucket_for(1) == 1


# ------------------------------------------------------------------------ bad inputs (issue 26)
def test_a_positional_call_names_the_keyword_inputs():
    r, hits, eager = make("full")
    with pytest.raises(TypeError, match=r"by keyword.*1 positional.*Tensor of shape \[2, 4\].*runner\(x=\.\.\.\)"):
        r(torch.randn(2, D))
    x = torch.randn(2, D)
    assert torch.allclose(r(x=x), eager(x), atol=1e-6)  # still usable


def test_a_bucket_too_big_to_allocate_is_a_value_error_naming_bucket_and_bytes():
    with pytest.raises(ValueError) as info:
        gr.GraphRunner(lambda x: x, {"x": gr.BatchInput(trailing=(64,))}, [1, 2**30], progress=False)
    msg = str(info.value)
    need = 2**30 * 64 * 4
    assert "bucket 1073741824" in msg and f"{need:,} bytes" in msg and "smaller buckets" in msg


def test_an_allocator_failure_is_a_value_error_naming_the_key(monkeypatch):
    # A size the device's total allows but the allocator refuses (e.g. a GPU already full):
    # the allocator's own error becomes the ValueError.
    real_full = torch.full

    def failing_full(shape, *a, **k):
        if shape and shape[0] == 8:
            raise RuntimeError("DefaultCPUAllocator: not enough memory: you tried to allocate 8 bytes")
        return real_full(shape, *a, **k)

    monkeypatch.setattr(torch, "full", failing_full)
    with pytest.raises(ValueError, match=r"key \(reqs=8, draft=2\).*allocating them failed.*RuntimeError"):
        gr.GraphRunner(
            lambda x: x,
            {"x": gr.BatchInput(trailing=(3,), dims=("reqs", "draft"))},
            {"reqs": [8], "draft": [2]},
            progress=False,
        )
    monkeypatch.undo()
    # Negative control: the same runner builds when the allocator works.
    gr.GraphRunner(
        lambda x: x,
        {"x": gr.BatchInput(trailing=(3,), dims=("reqs", "draft"))},
        {"reqs": [8], "draft": [2]},
        progress=False,
    )
