"""RNG on the tape matches CUDA graphs (TAPE-NOTES item 6).

A capture consumes nothing from a generator; each replay draws what the eager
step would draw from the same generator state (PyTorch's
``test_graph_rng_functional``); re-seeding during capture raises; an empty
capture warns.
"""

import warnings

import pytest
import torch
import torch.nn.functional as F

import graphrunner as gr
from graphrunner.errors import CaptureError
from graphrunner.tape import recording as tape_recording
from graphrunner.tape import tape_graph

SEED = 1234
STEPS = 4

x = torch.ones(64, 8)

OPS = {
    "dropout": lambda: F.dropout(x, p=0.5, training=True) * 2.0,
    "randn_like": lambda: x + torch.randn_like(x),
    "rand": lambda: torch.rand(5, 3) * x[:5, :3],
    "bernoulli": lambda: torch.bernoulli(torch.full((16,), 0.3)),
    "normal_inplace": lambda: torch.empty(7).normal_(2.0, 3.0) + 1,
    "randint": lambda: torch.randint(0, 100, (9,)) * 2,
    "multinomial": lambda: torch.multinomial(torch.softmax(x[0], 0), 3, replacement=True),
}


def _eager(step, n):
    torch.manual_seed(SEED)
    outs = [step().clone() for _ in range(n)]
    return outs, torch.get_rng_state()


def _graphed(step, n, interleave=None, ctx=torch.inference_mode):
    torch.manual_seed(SEED)
    g = gr.tape.TapeGraph()
    with ctx(), tape_graph(g):
        out = step()
    outs = []
    for _ in range(n):
        g.replay()
        outs.append(out.clone())
        if interleave is not None:
            outs.append(interleave())
    return outs, torch.get_rng_state()


@pytest.mark.parametrize("ctx", [torch.inference_mode, torch.no_grad])
@pytest.mark.parametrize("name", sorted(OPS))
def test_replays_draw_the_eager_sequence(name, ctx):
    """Capture + N replays == N eager steps from the same seed, and the
    generator ends in the same state (inference_mode and no_grad reach the
    tape differently: composite ops whole, or decomposed)."""
    step = OPS[name]
    with ctx():
        ref, ref_state = _eager(step, STEPS)
    got, state = _graphed(step, STEPS, ctx=ctx)
    assert len(got) == STEPS
    for a, b in zip(ref, got):
        assert torch.equal(a, b)
    assert not torch.equal(ref[0], ref[1])  # the op really is random: replays draw fresh numbers
    assert torch.equal(state, ref_state)


def test_replays_interleaved_with_eager_draws():
    """Replays and eager RNG ops interleaved reproduce the eager sequence."""
    step = OPS["randn_like"]
    draw = lambda: torch.rand(3)  # noqa: E731
    with torch.inference_mode():
        torch.manual_seed(SEED)
        ref = []
        for _ in range(STEPS):
            ref += [step().clone(), draw()]
        ref_state = torch.get_rng_state()
    got, state = _graphed(step, STEPS, interleave=draw)
    assert all(torch.equal(a, b) for a, b in zip(ref, got)) and len(got) == len(ref)
    assert torch.equal(state, ref_state)


def _draw_after_capture():
    torch.manual_seed(SEED)
    g = gr.tape.TapeGraph()
    with torch.no_grad(), tape_graph(g):
        OPS["dropout"]()
        torch.randn(10)
    return torch.rand(6)


def test_capture_consumes_nothing_from_the_generator():
    reference = torch.rand(6, generator=torch.Generator().manual_seed(SEED))  # a fresh generator, no capture
    assert torch.equal(_draw_after_capture(), reference)


def test_negative_control_without_restore_the_capture_advances_the_generator(monkeypatch):
    """Without the state restore the same check fails: the tape really draws at capture."""
    reference = torch.rand(6, generator=torch.Generator().manual_seed(SEED))

    def forget(self):
        self.generators.clear()

    monkeypatch.setattr(tape_recording.TapeCapture, "restore_generators", forget)
    assert not torch.equal(_draw_after_capture(), reference)


def test_explicit_generator_is_restored_and_replays_draw_from_it():
    gen = torch.Generator().manual_seed(7)
    before = gen.get_state()
    default_before = torch.get_rng_state()
    g = gr.tape.TapeGraph()
    with torch.no_grad(), tape_graph(g):
        out = torch.randn(5, generator=gen) * 2
    assert torch.equal(gen.get_state(), before)
    assert torch.equal(torch.get_rng_state(), default_before)
    ref_gen = torch.Generator().manual_seed(7)
    for _ in range(3):
        g.replay()
        assert torch.equal(out, torch.randn(5, generator=ref_gen) * 2)
    assert torch.equal(gen.get_state(), ref_gen.get_state())


def test_failed_capture_restores_the_generator():
    torch.manual_seed(SEED)
    before = torch.get_rng_state()
    with pytest.raises(ZeroDivisionError):
        with torch.no_grad(), tape_graph(gr.tape.TapeGraph()):
            torch.randn(100)
            1 / 0  # noqa: B018 - raises ZeroDivisionError inside the capture
    assert torch.equal(torch.get_rng_state(), before)


RESEEDS = {
    "torch.manual_seed": lambda: torch.manual_seed(5),
    "torch.random.manual_seed": lambda: torch.random.manual_seed(5),
    "torch.seed": lambda: torch.seed(),
    "torch.set_rng_state": lambda: torch.set_rng_state(torch.get_rng_state()),
}


@pytest.mark.parametrize("name", sorted(RESEEDS))
def test_reseeding_during_capture_raises(name):
    originals = (torch.manual_seed, torch.random.manual_seed, torch.seed, torch.set_rng_state)
    torch.manual_seed(SEED)
    before = torch.get_rng_state()
    g = gr.tape.TapeGraph()
    with pytest.raises(CaptureError, match=r"during a tape capture.*Seed before capture_begin"):
        with tape_graph(g):
            torch.ones(3) + 1
            RESEEDS[name]()
    # the functions are themselves again, the generator untouched, the graph empty and reusable
    assert (torch.manual_seed, torch.random.manual_seed, torch.seed, torch.set_rng_state) == originals
    assert torch.equal(torch.get_rng_state(), before)
    with tape_graph(g):
        out = torch.ones(3) + 1
    g.replay()
    assert torch.equal(out, torch.full((3,), 2.0))
    torch.manual_seed(SEED)  # allowed outside a capture


def test_reseeding_the_generator_object_during_capture_raises_at_capture_end():
    torch.manual_seed(SEED)
    before = torch.get_rng_state()
    g = gr.tape.TapeGraph()
    g.capture_begin()
    torch.default_generator.manual_seed(SEED + 1)
    torch.rand(2)
    with pytest.raises(CaptureError, match="re-seeded during a tape capture"):
        g.capture_end()
    assert torch.equal(torch.get_rng_state(), before) and torch.initial_seed() == SEED
    with pytest.raises(CaptureError, match="empty"):
        g.replay()


def test_reseeding_check_negative_control():
    """Drawing from the generator during capture is not mistaken for re-seeding it."""
    torch.manual_seed(SEED)
    g = gr.tape.TapeGraph()
    g.capture_begin()
    out = torch.rand(2)
    g.capture_end()
    g.replay()
    assert g.num_ops >= 1 and out.shape == (2,)


def test_empty_capture_warns_like_cuda():
    g = gr.tape.TapeGraph()
    with pytest.warns(UserWarning, match="The tape graph is empty"):
        with tape_graph(g):
            pass
    assert g.num_ops == 0
    g.replay()  # a no-op, as on an empty CUDA graph


def test_non_empty_capture_and_device_segments_do_not_warn():
    dev = gr.TapeDevice()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with tape_graph(gr.tape.TapeGraph()):
            torch.ones(2) + 1
        g = dev.new_graph()
        with dev.capture(g):  # a device drops empty segments itself (is_empty)
            pass
    assert dev.is_empty(g)
