"""A background capture never touches the engine's random numbers (issue 34 item 1, issue 42 item 1):
the engine samples with the default generator while keys are captured on another thread; no
capture, check or verification there reads, draws from or sets a generator the engine owns."""

from __future__ import annotations

import contextlib
import threading

import pytest
import torch

import graphrunner as gr
from graphrunner.checks.leak_check import LeakCheck

V, H = 11, 8


_HOLD: dict = {}


def _sampled(background, calls=40, seed=1234, monkeypatch=None, redirect=True):
    """Tokens an engine samples with ``torch.multinomial`` (the default generator) from the runner's
    logits after each call, and every ``torch.rand`` it draws, with a background capture or eagerly.
    The step draws too (noise from the default generator on its logits); sizes are buckets (the
    padding rows of a replay would draw as well). Background: the capture thread's first run of
    the step (a warmup of the first key) draws, then is held while the engine draws (``overlap``:
    what the engine drew then), so the capture and the engine's draws overlap on every run.
    ``redirect=False``: the planted fault of REVIEW item 6 (``shared_generators`` without its
    redirect: the capture thread draws from the engine's generator)."""
    w = torch.randn(H, V, generator=torch.Generator().manual_seed(0))
    # a module global, not a closure cell: the padding check puts back the Python values a step's
    # objects re-bind (an Event's flag among them) before each of its runs
    _HOLD.clear()
    _HOLD.update(capturing=threading.Event(), drawn=threading.Event(), draws=[])
    capturing, drawn, capture_thread_draws = _HOLD["capturing"], _HOLD["drawn"], _HOLD["draws"]

    def step(x):
        logits = x @ w + torch.rand(x.shape[0], V)  # the default generator (a stand-in on the capture thread)
        if threading.current_thread() is not threading.main_thread():
            _HOLD["draws"].append(threading.current_thread().name)
            capturing, drawn = _HOLD["capturing"], _HOLD["drawn"]
            if not capturing.is_set():
                capturing.set()  # the capture thread drew (its first run of the step)
                assert drawn.wait(60)  # held until the engine drew meanwhile
        return torch.softmax(logits, dim=-1)

    if not redirect:
        import graphrunner.background as background_module

        @contextlib.contextmanager
        def shared_without_redirect(seed=0):
            yield

        monkeypatch.setattr(background_module, "shared_generators", shared_without_redirect)
    r = gr.GraphRunner(step, {"x": gr.BatchInput(trailing=(H,))}, [1, 2, 4, 8, 16], device="tape", progress=False)
    gate = threading.Event()
    if background:
        r.capturer.background_gate = gate
        r.capture(background=True)
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(5)
    tokens, draws, overlap = [], [], []
    for i in range(calls):
        n = (1, 2, 4, 8, 16)[int(torch.randint(0, 5, (1,), generator=g))]
        x = torch.randn(n, H, generator=g)
        probs = r(x=x) if background else step(x)
        tokens.append(torch.multinomial(probs, 1).reshape(-1))
        draws.append(torch.rand(8))
        if i == 5:
            if background:
                gate.set()
                assert capturing.wait(60)  # the capture thread is inside its first warmup, having drawn
            for _ in range(10):  # the engine draws while the capture thread is held inside its capture
                overlap.append(torch.rand(4))
                tokens.append(torch.multinomial(probs, 1).reshape(-1))
            drawn.set()
        if background and i == 25:
            assert r.wait_captured(timeout=120) is not None
    stats = r.stats if background else None
    if background:
        r.cleanup()
    return torch.cat(tokens), torch.cat(draws + overlap), stats, capture_thread_draws


def test_the_engine_samples_exactly_what_it_samples_without_a_capture():
    want_tokens, want_draws, _, _ = _sampled(background=False)
    got_tokens, got_draws, stats, capture_draws = _sampled(background=True)
    # the capture drew on its own thread, overlapping the engine's draws (held there while the engine
    # drew 10 times), and calls were served both eagerly (before) and by replay (after)
    assert capture_draws and set(capture_draws) == {"graphrunner-background-capture"}
    assert stats.fallbacks > 0 and sum(stats.replays.values()) > 0
    assert torch.equal(got_tokens, want_tokens)
    assert torch.equal(got_draws, want_draws)


def test_negative_control_a_capture_thread_drawing_from_the_engines_generator_shifts_its_numbers(monkeypatch):
    want_tokens, want_draws, _, _ = _sampled(background=False)
    got_tokens, got_draws, _, _ = _sampled(background=True, monkeypatch=monkeypatch, redirect=False)
    assert not torch.equal(got_draws, want_draws)


# ---------------------------------------------------------------- issue 42 item 1: the padding check's follow-up
VOCAB, D = 50, 16


def _embedding_runner(cache=False):
    """The issue's deterministic step: ``h = E[ids]``, ten ``tanh(h @ W)``, ``h @ E.T``; ``ids``'s pad
    (0) lies inside its bounds, so the padding check runs its follow-up call (the path that set the
    default generator's state back). ``cache``: the step also writes a cache through ``ids`` (REVIEW
    item 1: state written through an integer slot input whose pad lies inside its bounds)."""
    g = torch.Generator().manual_seed(0)
    E, W = torch.randn(VOCAB, D, generator=g), torch.randn(D, D, generator=g) * 0.3
    store = torch.zeros(VOCAB, D)

    def step(ids):
        h = E[ids]
        for _ in range(10):
            h = torch.tanh(h @ W)
        if cache:
            store.index_add_(0, ids, h)
        return h @ E.T

    ids = gr.BatchInput(dtype=torch.long, pad=0, bounds=(0, VOCAB - 1))
    return gr.GraphRunner(step, {"ids": ids}, [1, 2, 4, 8, 16, 32], device="tape", progress=False)


def _draws_around_a_follow_up(monkeypatch, rewind=False, n=100, cache=False):
    """The serving thread's ``torch.rand(1)`` draws, ``n`` while the capture thread is held right after
    the padding check prepared its runs (before its follow-up call) and ``n`` after the key's check
    ended: a deterministic interleaving. ``rewind``: the negative control, the check's old follow-up
    (the default generator's state set back to what it was when the check began) restored here."""
    at_follow, go, key_done = threading.Event(), threading.Event(), threading.Event()
    before_warmup, after_warmups = LeakCheck.before_warmup, LeakCheck.after_warmups
    saved = {}

    def held_before_warmup(self, cap, i):
        first = i == self._a_index(cap) and not at_follow.is_set()
        if first and rewind:
            saved["state"] = torch.default_generator.get_state()
        before_warmup(self, cap, i)
        if i == cap.warmups - 1 and rewind and "state" in saved:
            torch.default_generator.set_state(saved["state"])  # the rewinding path, as it was
        if first:
            at_follow.set()
            assert go.wait(60)

    def noted_after_warmups(self, cap):
        try:
            after_warmups(self, cap)
        finally:
            key_done.set()

    monkeypatch.setattr(LeakCheck, "before_warmup", held_before_warmup)
    monkeypatch.setattr(LeakCheck, "after_warmups", noted_after_warmups)
    r = _embedding_runner(cache)
    torch.manual_seed(0)
    r.capture(background=True)
    assert at_follow.wait(60)  # the check began (its run A is next, then the follow-up)
    draws = [torch.rand(1) for _ in range(n)]
    go.set()
    assert key_done.wait(60)  # the check's follow-up ran
    draws += [torch.rand(1) for _ in range(n)]
    r.wait_captured(timeout=120)
    r.cleanup()
    return torch.cat(draws)


@pytest.mark.parametrize("cache", [False, True], ids=["pure", "writes-a-cache"])
def test_the_padding_checks_follow_up_never_rewinds_the_engines_generator(monkeypatch, cache):
    torch.manual_seed(0)
    want = torch.rand(200)
    got = _draws_around_a_follow_up(monkeypatch, cache=cache)
    assert torch.equal(got, want)


@pytest.mark.parametrize("cache", [False, True], ids=["pure", "writes-a-cache"])
def test_negative_control_the_rewinding_follow_up_repeats_the_engines_numbers(monkeypatch, cache):
    torch.manual_seed(0)
    want = torch.rand(200)
    got = _draws_around_a_follow_up(monkeypatch, rewind=True, cache=cache)
    assert not torch.equal(got, want)
    assert torch.equal(got[100:], got[:100])  # the second hundred repeats the first: a rewind


def test_the_issues_reproduction_200_draws_1ms_apart_equal_those_without_a_capture():
    import time

    torch.manual_seed(0)
    want = torch.cat([torch.rand(1) for _ in range(200)])
    r = _embedding_runner()
    torch.manual_seed(0)
    r.capture(background=True)
    got = []
    for _ in range(200):
        got.append(torch.rand(1))
        time.sleep(0.001)
    assert r.wait_captured(timeout=300) is not None
    assert torch.equal(torch.cat(got), want)


# ---------------------------------------------------------------- a step that samples: 120 seeded steps
def _sampling_loop(background, steps=120, redirect=True, monkeypatch=None):
    """A seeded sampling engine: the step samples one token per row inside itself (Gumbel-max on
    ``torch.rand``, the default generator) and returns its logits; the engine then samples a second
    token from them with ``torch.multinomial``. Background: the capture thread starts at step 10,
    and every key is captured by step 60 (so steps are served eagerly and by replay).
    ``redirect=False``: the negative control (a capture's own draws go to the engine's generator)."""
    if not redirect:
        from graphrunner.tape import rng

        monkeypatch.setattr(rng, "stand_in_op", lambda func, args, kwargs: (func, kwargs))
        import graphrunner.recording.ops as ops
        import graphrunner.tape.recording as trec

        monkeypatch.setattr(ops, "stand_in_op", rng.stand_in_op)
        monkeypatch.setattr(trec, "stand_in_op", rng.stand_in_op)
    g = torch.Generator().manual_seed(0)
    E, W = torch.randn(VOCAB, D, generator=g), torch.randn(D, D, generator=g) * 0.3

    def step(ids):
        logits = torch.tanh(E[ids] @ W) @ E.T
        gumbel = -torch.log(-torch.log(torch.rand(logits.shape).clamp_min(1e-9)))
        return (logits + gumbel).argmax(-1), torch.softmax(logits, -1)

    r = gr.GraphRunner(
        step,
        {"ids": gr.BatchInput(dtype=torch.long, pad=0, bounds=(0, VOCAB - 1))},
        [1, 2, 4, 8],
        device="tape",
        progress=False,
    )
    gate = threading.Event()
    if background:
        r.capturer.background_gate = gate
        r.capture(background=True)
    torch.manual_seed(42)
    sizes = torch.Generator().manual_seed(7)
    ids = torch.randint(0, VOCAB, (8,), generator=sizes)
    out = []
    for i in range(steps):
        n = (1, 2, 4, 8)[int(torch.randint(0, 4, (1,), generator=sizes))]  # a bucket: no padding rows draw
        call = r if background else step
        inside, probs = call(ids=ids[:n])
        outside = torch.multinomial(probs, 1).reshape(-1)
        out += [inside.clone(), outside]
        ids = torch.cat([inside, outside, ids])[:8] % VOCAB
        if background and i == 10:
            gate.set()
        if background and i == 60:
            assert r.wait_captured(timeout=120) is not None
    stats = r.stats if background else None
    if background:
        r.cleanup()
    return torch.cat(out), stats


def test_a_seeded_sampling_loop_of_120_steps_equals_eager_token_for_token():
    want, _ = _sampling_loop(background=False)
    got, stats = _sampling_loop(background=True)
    replayed = sum(stats.replays.values())
    assert replayed > 0 and stats.fallbacks > 0  # both ways of serving took part
    assert torch.equal(got, want)


def test_negative_control_a_capture_drawing_from_the_engines_generator_changes_the_tokens(monkeypatch):
    want, _ = _sampling_loop(background=False)
    got, _ = _sampling_loop(background=True, redirect=False, monkeypatch=monkeypatch)
    assert not torch.equal(got, want)


# ---------------------------------------------------------------- shadow verification (issue 34 item 9)
def test_verify_every_counts_replayed_calls_only():
    class Scaled:
        scale = 2.0

        def __call__(self, x):
            return x * self.scale

    step = Scaled()
    r = gr.GraphRunner(
        step, {"x": gr.BatchInput(trailing=(3,))}, [1, 2, 4], device="tape", progress=False, verify_every=2
    )
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

    r = gr.GraphRunner(
        step, {"x": gr.BatchInput(trailing=(3,))}, [1, 2, 4], device="tape", progress=False, verify_every=1
    )
    r.capture()
    gen.manual_seed(3)
    ref = torch.Generator().manual_seed(3)
    for _ in range(5):  # no false ContractError, and the replay draws what eager would
        out = r(x=torch.zeros(4, 3))
        assert torch.equal(out, torch.rand((4, 3), generator=ref))


def _random_step_runner():
    def step(x):
        return x + torch.rand(x.shape)  # the default generator

    r = gr.GraphRunner(
        step, {"x": gr.BatchInput(trailing=(3,))}, [1, 2, 4], device="tape", progress=False, verify_every=1
    )
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


def test_negative_control_without_stand_in_generators_verification_fails(monkeypatch):
    """The shadow reference drawing from the engine's generator itself (no stand-ins): the replay
    then draws the next numbers, and verification fails."""
    import graphrunner.recording.ops as ops

    monkeypatch.setattr(ops, "stand_in_op", lambda func, args, kwargs: (func, kwargs))
    r = _random_step_runner()
    torch.manual_seed(11)
    with pytest.raises(gr.ContractError, match="shadow verification"):
        r(x=torch.zeros(4, 3))


def test_shadow_verification_under_a_background_capture_draws_what_eager_draws():
    """verify_every=1 while keys are captured on another thread: the engine's numbers as without
    a runner (the reference draws from copies, the capture from its own generators)."""

    def step(x):
        return x + torch.rand(x.shape)

    r = gr.GraphRunner(
        step, {"x": gr.BatchInput(trailing=(3,))}, [1, 2, 4], device="tape", progress=False, verify_every=1
    )
    gate = threading.Event()
    r.capturer.background_gate = gate
    r.capture(background=True)
    torch.manual_seed(11)
    ref = torch.Generator().manual_seed(11)
    for i in range(12):
        n = (1, 2, 4)[i % 3]  # buckets: the padding rows would draw too
        assert torch.equal(r(x=torch.zeros(n, 3)), torch.rand((n, 3), generator=ref))
        if i == 3:
            gate.set()
            assert r.wait_captured(timeout=60) is not None
    assert sum(r.stats.replays.values()) > 0


def test_compare_draws_nothing_from_the_engines_generator_and_compares_like_with_like():
    """runner.compare (after a background capture) on a step that draws from the default generator,
    between two of the engine's draws: equal (both runs draw from one copy of the generator), and
    the engine's numbers are as if compare had not run (it never drew from, nor set, the generator)."""

    def step(x):
        return x + torch.rand(x.shape)

    r = gr.GraphRunner(step, {"x": gr.BatchInput(trailing=(3,))}, [1, 2, 4], device="tape", progress=False)
    gate = threading.Event()
    r.capturer.background_gate = gate
    r.capture(background=True)
    gate.set()
    assert r.wait_captured(timeout=60) is not None
    torch.manual_seed(3)
    want = torch.rand(10)
    torch.manual_seed(3)
    got = [torch.rand(5)]
    report = r.compare(x=torch.zeros(4, 3))
    got.append(torch.rand(5))
    assert report.equal, report
    assert torch.equal(torch.cat(got), want)


def test_negative_control_compare_without_stand_ins_differs(monkeypatch):
    import graphrunner.recording.ops as ops

    monkeypatch.setattr(ops, "stand_in_op", lambda func, args, kwargs: (func, kwargs))

    def step(x):
        return x + torch.rand(x.shape)

    r = gr.GraphRunner(step, {"x": gr.BatchInput(trailing=(3,))}, [1, 2, 4], device="tape", progress=False)
    r.capture()
    torch.manual_seed(3)
    assert not r.compare(x=torch.zeros(4, 3)).equal  # the two runs drew different numbers


# ---------------------------------------------------------------- issue 52 item 7: dropout under shadow verification
# aten.dropout (and the other seeded ops a dispatch mode sees under inference_mode without a
# generator= overload) drew from the engine's generator under a redirect: the shadow reference
# advanced it and the replay drew the next numbers (a false ContractError, first op aten.dropout).
P = 0.5


class _Dropper(torch.nn.Module):
    """A layer, then a random op of ``kind`` in train mode (the default generator), times ``scale``."""

    def __init__(self, kind):
        super().__init__()
        self.lin = torch.nn.Linear(6, 6)
        with torch.no_grad():
            g = torch.Generator().manual_seed(0)
            self.lin.weight.copy_(torch.randn(6, 6, generator=g))
            self.lin.bias.copy_(torch.randn(6, generator=g))
        self.kind, self.scale = kind, 1.0
        self.drop = torch.nn.Dropout(P)

    def forward(self, x):
        h = self.lin(x)
        if self.kind == "dropout":
            h = self.drop(h)
        elif self.kind == "dropout1d":
            h = torch.nn.functional.dropout1d(h.unsqueeze(-1), P, training=True).squeeze(-1)
        elif self.kind == "alpha_dropout":
            h = torch.nn.functional.alpha_dropout(h, P, training=True)
        elif self.kind == "rrelu":
            h = torch.nn.functional.rrelu(h, training=True)
        elif self.kind == "native_dropout":
            h = torch.native_dropout(h, P, True)[0]
        return h * self.scale


RANDOM_KINDS = ["dropout", "dropout1d", "alpha_dropout", "rrelu", "native_dropout"]


def _dropout_calls(step, runner=None, calls=8, seed=21):
    """``calls`` outputs of ``step`` (through ``runner`` when given) from seed ``seed``: bucket sizes
    only (padding rows draw too, so the eager reference runs the bucket's rows)."""
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(1))
    torch.manual_seed(seed)
    out = []
    for i in range(calls):
        n = (4, 2, 1)[i % 3]
        with torch.inference_mode():
            y = runner(x=x[:n]) if runner is not None else step(x[:n])
        out.append(y.clone())
    return out


@pytest.mark.parametrize("kind", RANDOM_KINDS)
def test_a_dropout_step_under_verify_every_1_serves_what_eager_serves(kind):
    step = _Dropper(kind).train()
    want = _dropout_calls(step)
    r = gr.GraphRunner(
        step, {"x": gr.BatchInput(trailing=(6,))}, [1, 2, 4], device="tape", progress=False, verify_every=1
    )
    r.capture()
    got = _dropout_calls(step, r)  # no ContractError
    assert sum(r.stats.replays.values()) == len(got) and r.stats.fallbacks == 0
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    assert not torch.equal(got[0], _dropout_calls(step, calls=1, seed=22)[0])  # the step is random


def test_negative_control_without_the_decomposition_dropouts_verification_fails_falsely(monkeypatch):
    """The seeded op run as it is under the redirect (the old path: aten.dropout drew from the
    engine's generator in the shadow reference): a false ContractError naming aten.dropout."""
    from graphrunner.tape import rng

    monkeypatch.setattr(rng, "_decomposition", lambda func, args, kwargs: None)
    step = _Dropper("dropout").train()
    r = gr.GraphRunner(
        step, {"x": gr.BatchInput(trailing=(6,))}, [1, 2, 4], device="tape", progress=False, verify_every=1
    )
    r.capture()
    with pytest.raises(gr.ContractError, match="aten.dropout"):
        _dropout_calls(step, r)


def test_negative_control_a_dropout_step_whose_replay_differs_is_still_caught():
    """A random step whose replay really differs from eager (a Python scale changed after capture):
    shadow verification still raises, at the first call."""
    step = _Dropper("dropout").train()
    r = gr.GraphRunner(
        step, {"x": gr.BatchInput(trailing=(6,))}, [1, 2, 4], device="tape", progress=False, verify_every=1
    )
    r.capture()
    step.scale = 3.0
    with pytest.raises(gr.ContractError, match="shadow verification of call 1"):
        _dropout_calls(step, r)


def test_a_background_capture_of_a_dropout_step_leaves_the_engines_numbers_alone():
    """A dropout step captured on another thread (its warmups, checks and capture draw from stand-ins)
    while the engine serves it with verify_every=1 and draws itself: every output and every draw
    as without a runner, served both eagerly and by replay."""

    def run(background):
        step = _Dropper("dropout").train()
        x = torch.randn(4, 6, generator=torch.Generator().manual_seed(1))
        r = None
        if background:
            r = gr.GraphRunner(
                step, {"x": gr.BatchInput(trailing=(6,))}, [1, 2, 4], device="tape", progress=False, verify_every=1
            )
            gate = threading.Event()
            r.capturer.background_gate = gate
            r.capture(background=True)
        torch.manual_seed(5)
        out = []
        for i in range(12):
            n = (4, 2, 1)[i % 3]
            with torch.inference_mode():
                out += [(r(x=x[:n]) if r is not None else step(x[:n])).clone().reshape(-1), torch.rand(3)]
            if r is not None and i == 3:
                gate.set()
                assert r.wait_captured(timeout=120) is not None
        return torch.cat(out), r

    want, _ = run(background=False)
    got, r = run(background=True)
    assert r.stats.fallbacks > 0 and sum(r.stats.replays.values()) > 0
    assert torch.equal(got, want)
