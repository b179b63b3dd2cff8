"""A background capture never rewinds the engine's random numbers (issue 34 item 1): the engine
samples with the default generator after each call while keys are captured on another thread."""

from __future__ import annotations

import pytest
import torch

import graphrunner as gr

V, H = 11, 8


def _sampled(background, calls=40, seed=1234):
    """Tokens an engine samples with ``torch.multinomial`` (the default generator) from the runner's
    logits after each call, and every ``torch.rand`` it draws, with a background capture or eagerly."""
    w = torch.randn(H, V, generator=torch.Generator().manual_seed(0))

    def step(x):  # no randomness in the step
        return torch.softmax(x @ w, dim=-1)

    r = gr.GraphRunner(step, {"x": gr.BatchInput(trailing=(H,))}, [1, 2, 4, 8, 16], device="tape",
                       progress=False)
    torch.manual_seed(seed)
    if background:
        r.capture(background=True)
    g = torch.Generator().manual_seed(5)
    tokens, draws = [], []
    for _ in range(calls):
        n = int(torch.randint(1, 17, (1,), generator=g))
        x = torch.randn(n, H, generator=g)
        probs = r(x=x) if background else step(x)
        tokens.append(torch.multinomial(probs, 1).reshape(-1))
        draws.append(torch.rand(8))
    if background:
        r.wait_captured(timeout=60)
    return torch.cat(tokens), torch.cat(draws)


def test_the_engine_samples_exactly_what_it_samples_without_a_capture():
    want_tokens, want_draws = _sampled(background=False)
    got_tokens, got_draws = _sampled(background=True)
    assert torch.equal(got_tokens, want_tokens)
    assert torch.equal(got_draws, want_draws)
    assert len(set(got_draws.tolist())) == got_draws.numel()  # no number repeated


def test_negative_control_putting_generators_back_rewinds_the_engine(monkeypatch):
    import contextlib

    from graphrunner.tape import rng

    monkeypatch.setattr(rng, "shared_generators", contextlib.nullcontext)
    want_tokens, want_draws = _sampled(background=False)
    differ = 0
    for _ in range(3):  # the rewind lands wherever a key ends between two draws: some run shows it
        got_tokens, got_draws = _sampled(background=True)
        differ += not torch.equal(got_draws, want_draws)
    assert differ >= 1
