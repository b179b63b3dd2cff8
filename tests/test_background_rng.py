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


# ---------------------------------------------------------------- shadow verification (issue 34 item 9)
def test_verify_every_counts_replayed_calls_only():
    class Scaled:
        scale = 2.0

        def __call__(self, x):
            return x * self.scale

    step = Scaled()
    r = gr.GraphRunner(step, {"x": gr.BatchInput(trailing=(3,))}, [1, 2, 4], device="tape", progress=False,
                       verify_every=2)
    r.capture()
    step.scale = 3.0  # every replay is wrong from now on
    caught = 0
    for i in range(10):  # replayed and eager (5 rows: over the largest bucket) calls alternate
        n = 3 if i % 2 == 0 else 5
        try:
            r(x=torch.ones(n, 3))
        except gr.ContractError:
            caught += 1
    assert caught == 2  # the 2nd and 4th of the 5 replayed calls (counting every call: none, all are odd)


def test_a_step_with_its_own_generator_is_verified_like_with_like():
    gen = torch.Generator().manual_seed(3)

    def step(x):
        return x + torch.rand(x.shape, generator=gen)

    r = gr.GraphRunner(step, {"x": gr.BatchInput(trailing=(3,))}, [1, 2, 4], device="tape", progress=False,
                       verify_every=1)
    r.capture()
    gen.manual_seed(3)
    ref = torch.Generator().manual_seed(3)
    for _ in range(5):  # no false ContractError, and the replay draws what eager would
        out = r(x=torch.zeros(4, 3))
        assert torch.equal(out, torch.rand((4, 3), generator=ref))


def _random_step_runner():
    def step(x):
        return x + torch.rand(x.shape)  # the default generator

    r = gr.GraphRunner(step, {"x": gr.BatchInput(trailing=(3,))}, [1, 2, 4], device="tape", progress=False,
                       verify_every=1)
    r.capture()
    return r


def test_a_step_drawing_from_the_default_generator_is_verified_like_with_like():
    """docs/checks.md (shadow verification): the default generator is put back after the eager run,
    so the replay draws the numbers the eager run drew: no false ContractError, and the calls draw
    the default generator's sequence, as eager calls would."""
    r = _random_step_runner()
    torch.manual_seed(11)
    ref = torch.Generator().manual_seed(11)
    for _ in range(5):
        assert torch.equal(r(x=torch.zeros(4, 3)), torch.rand((4, 3), generator=ref))
    assert r.stats.replays[4] == 5


def test_negative_control_without_putting_the_default_generator_back_verification_fails(monkeypatch):
    import graphrunner.recording.ops as ops

    monkeypatch.setattr(ops, "generators_shared", lambda: True)  # as on a background capture's thread
    r = _random_step_runner()
    torch.manual_seed(11)
    with pytest.raises(gr.ContractError, match="shadow verification"):
        r(x=torch.zeros(4, 3))
