"""Tape captures in several threads at once (capture_error_mode), against eager PyTorch."""

from __future__ import annotations

import threading

import pytest
import torch

from graphrunner.breakable import BreakableGraph, breakable_graph, no_graph
from graphrunner.devices import TapeDevice
from graphrunner.errors import CaptureError
from graphrunner.tape import TapeGraph, is_tape_capturing, tape_graph


def _step(x, w):
    return torch.relu(x @ w) * 2 + 1


def _run_threads(targets):
    errors = []

    def wrap(fn):
        def run():
            try:
                fn()
            except BaseException as exc:  # reported to the main thread
                errors.append(exc)

        return run

    threads = [threading.Thread(target=wrap(fn), name=f"capturer-{i}") for i, fn in enumerate(targets)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads), "a capture thread hung"
    return errors


@pytest.mark.parametrize("mode", ["thread_local", "relaxed"])
def test_concurrent_captures_in_two_threads_replay_equal_to_eager(mode):
    barrier = threading.Barrier(2, timeout=30)
    results = {}

    def capturer(i):
        def run():
            gen = torch.Generator().manual_seed(i)
            w = torch.randn(8, 8, generator=gen)
            static_x = torch.randn(4, 8, generator=gen)
            g = TapeGraph()
            with torch.inference_mode():
                with tape_graph(g, capture_error_mode=mode):
                    barrier.wait()  # both threads are inside a capture now
                    out = _step(static_x, w)
                    barrier.wait()  # and stay in it until both recorded their op
                    assert is_tape_capturing()
            results[i] = (g, static_x, w, out)

        return run

    errors = _run_threads([capturer(0), capturer(1)])
    assert errors == []
    assert not is_tape_capturing()
    for i, (g, static_x, w, out) in results.items():
        assert g.num_ops > 0
        for seed in range(3):
            fresh = torch.randn(4, 8, generator=torch.Generator().manual_seed(100 * i + seed))
            static_x.copy_(fresh)
            g.replay()
            with torch.inference_mode():
                expected = _step(fresh, w)
            assert torch.equal(out, expected), f"thread {i} replay {seed} differs from eager"


def test_concurrent_breakable_captures_in_two_threads_thread_local():
    barrier = threading.Barrier(2, timeout=30)
    results = {}

    @no_graph
    def brk(t):
        return t / (1.0 + t.abs().max().item())

    def capturer(i):
        def run():
            w = torch.randn(8, 8, generator=torch.Generator().manual_seed(i))
            static_x = torch.randn(4, 8)
            graph = BreakableGraph(device=TapeDevice())
            with torch.inference_mode(), breakable_graph(graph, capture_error_mode="thread_local"):
                barrier.wait()
                out = brk(static_x @ w) + 1
                barrier.wait()
            results[i] = (graph, static_x, w, out)

        return run

    assert _run_threads([capturer(0), capturer(1)]) == []
    for i, (graph, static_x, w, out) in results.items():
        fresh = torch.randn(4, 8, generator=torch.Generator().manual_seed(7 + i))
        static_x.copy_(fresh)
        graph.replay()
        with torch.inference_mode():
            expected = brk(fresh @ w) + 1
        assert torch.equal(out, expected)


@pytest.mark.parametrize("modes", [("global", "global"), ("global", "thread_local"), ("thread_local", "global")])
def test_global_mode_refuses_a_concurrent_capture_in_another_thread(modes):
    first_in = threading.Event()
    second_done = threading.Event()
    outcome = {}

    def first():
        g = TapeGraph()
        with torch.inference_mode(), tape_graph(g, capture_error_mode=modes[0]):
            _step(torch.ones(2, 2), torch.ones(2, 2))
            first_in.set()
            assert second_done.wait(30)

    def second():
        assert first_in.wait(30)
        g = TapeGraph()
        try:
            with torch.inference_mode(), tape_graph(g, capture_error_mode=modes[1]):
                _step(torch.ones(2, 2), torch.ones(2, 2))
            outcome["error"] = None
        except CaptureError as exc:
            outcome["error"] = exc
        finally:
            second_done.set()

    assert _run_threads([first, second]) == []
    err = outcome["error"]
    assert err is not None, "a capture overlapping a global-mode capture was allowed"
    assert "concurrent capture in another thread" in str(err)
    assert "capturer-0" in str(err) and "nest" not in str(err)
    assert not is_tape_capturing()
    # both threads left no state behind: a new capture here works
    g = TapeGraph()
    with torch.inference_mode(), tape_graph(g):
        _step(torch.ones(2, 2), torch.ones(2, 2))
    assert g.num_ops > 0


@pytest.mark.parametrize("mode", ["global", "thread_local", "relaxed"])
def test_nested_capture_in_the_same_thread_still_reports_nesting(mode):
    outer, inner = TapeGraph(), TapeGraph()
    with torch.inference_mode(), tape_graph(outer, capture_error_mode=mode):
        torch.ones(2) + 1
        with pytest.raises(CaptureError, match="cannot nest") as info:
            inner.capture_begin(capture_error_mode=mode)
        assert "another thread" not in str(info.value)
    assert not is_tape_capturing() and outer.num_ops > 0


def test_reseed_guard_survives_the_first_of_two_concurrent_captures_ending():
    # Both captures install the manual_seed guard; the one ending first must not
    # take it away from the other.
    first_done = threading.Event()
    second_in = threading.Event()
    outcome = {}

    def first():
        g = TapeGraph()
        with torch.inference_mode(), tape_graph(g, capture_error_mode="thread_local"):
            torch.ones(2) + 1
            assert second_in.wait(30)
        first_done.set()

    def second():
        g = TapeGraph()
        try:
            with torch.inference_mode(), tape_graph(g, capture_error_mode="thread_local"):
                torch.ones(2) + 1
                second_in.set()
                assert first_done.wait(30)
                torch.manual_seed(0)
            outcome["error"] = None
        except CaptureError as exc:
            outcome["error"] = exc

    assert _run_threads([first, second]) == []
    assert outcome["error"] is not None and "manual_seed" in str(outcome["error"])
    assert not getattr(torch.manual_seed, "_graphrunner_reseed_guard", False)
