"""WriteGuard: what recorded code wrote outside itself is put back, cell by cell, from a write log.

Each case records a step under one :class:`OpRecorder` with a guard, restores, and compares every
tensor with a copy taken before (the reference); negative controls show the state really changed
and that a cell the step did not write keeps a value written outside the recording.
"""

from __future__ import annotations

import torch

from graphrunner.recording.ops import OpRecorder, WriteGuard


def _run(step, guard):
    with torch.inference_mode(), OpRecorder([guard]):
        return step()


def test_index_put_cells_are_put_back_and_other_cells_are_left_alone():
    cache = torch.randn(8, 16)
    before = cache.clone()
    rows, pos = torch.tensor([1, 3]), torch.tensor([4, 9])

    def step():
        cache.index_put_((rows, pos), torch.tensor([5.0, 6.0]))
        cache.index_put_((rows, pos), torch.tensor([1.0, 1.0]), accumulate=True)  # the same cells again
        return cache.sum()

    guard = WriteGuard()
    _run(step, guard)
    assert cache[1, 4] == 6.0 and cache[3, 9] == 7.0  # the step wrote (control)
    cache[0, 0] = 42.0  # a write outside the recording
    guard.restore()
    want = before.clone()
    want[0, 0] = 42.0
    assert torch.equal(cache, want)  # the step's cells back, the outside write kept
    assert guard._undo == []


def test_index_copy_cells_are_put_back():
    """HF StaticCache writes keys and values with index_copy_ along the sequence dim."""
    keys = torch.randn(2, 4, 10, 8)
    before = keys.clone()

    def step():
        keys.index_copy_(2, torch.tensor([3, 7]), torch.ones(2, 4, 2, 8))

    guard = WriteGuard()
    _run(step, guard)
    assert not torch.equal(keys, before)
    guard.restore()
    assert torch.equal(keys, before)


def test_in_place_on_views_and_out_arguments_are_put_back_in_reverse_order():
    state = torch.arange(12.0).reshape(3, 4)
    out = torch.zeros(5)
    before, out_before = state.clone(), out.clone()

    def step():
        state[1].mul_(3)  # a view, in place
        state[:, 2].add_(state[1, 2])  # overlaps the first write
        torch.add(torch.ones(5), 2, out=out)  # an out= argument: its storage whole
        state.zero_()  # the whole tensor, after the partial writes

    guard = WriteGuard()
    _run(step, guard)
    assert torch.equal(state, torch.zeros(3, 4)) and torch.equal(out, torch.full((5,), 3.0))
    guard.restore()
    assert torch.equal(state, before) and torch.equal(out, out_before)


def test_inputs_and_tensors_the_step_creates_are_not_put_back():
    inp, counter = torch.zeros(4), torch.zeros(())

    def step():
        inp.add_(1)  # a static input: the caller's business
        tmp = torch.zeros(4)
        tmp.add_(2)  # created by the step
        counter.add_(1)
        return tmp

    guard = WriteGuard([inp])
    _run(step, guard)
    guard.restore()
    assert torch.equal(inp, torch.ones(4))
    assert float(counter) == 0.0
    assert list(guard.snapshots.values()) == ["() torch.float32"]  # only the counter was put back


def test_a_guard_restores_each_run_and_leaves_the_generator_alone():
    # the default generator is the engine's (issue 42): the guard puts back tensors, never a generator's state
    counter = torch.zeros(())
    state = torch.default_generator.get_state()

    def step():
        counter.add_(torch.rand(()))

    guard = WriteGuard()
    draws = []
    for _ in range(3):
        _run(step, guard)
        draws.append(float(counter))
        guard.restore()
        assert float(counter) == 0.0
    torch.default_generator.set_state(state)
    expected = [float(torch.rand(())) for _ in range(3)]  # the same three draws, no guard
    assert draws == expected  # each run drew the engine's next number: no rewind


def test_negative_control_undoing_oldest_first_leaves_overlapping_writes_wrong():
    """The log must be undone newest first: oldest first, an earlier write's cells are overwritten
    by a later entry that logged the earlier write's result."""
    state = torch.arange(12.0).reshape(3, 4)
    before = state.clone()

    class OldestFirst(WriteGuard):
        def restore(self):
            with torch.inference_mode():
                for put, arg in self._undo:
                    put(*arg)

    def step():
        state[1].mul_(3)
        state.zero_()

    guard = OldestFirst()
    _run(step, guard)
    guard.restore()
    assert not torch.equal(state, before)
    assert torch.equal(state[1], before[1] * 3)  # the zero_ entry logged the mul_'s result


def test_writes_through_aliases_are_put_back_and_fresh_results_are_the_steps_own():
    """``reshape``/``contiguous`` return their argument's storage when they can (writes through them
    reach the state) and a fresh tensor otherwise; views always alias. Only writes that reach storage
    the step did not create are logged."""
    state = torch.arange(6.0).reshape(2, 3)
    before = state.clone()

    def step():
        state.reshape(-1).add_(1)  # an alias of the state: logged
        state.contiguous()[0].mul_(2)  # contiguous already: the state itself, logged
        state.view(3, 2)[1].sub_(5)  # a view: logged
        fresh = state.t().reshape(-1)  # a copy (not contiguous): the step's own tensor
        fresh.add_(100)
        (state * 1).add_(7)  # a fresh result
        return fresh

    guard = WriteGuard()
    _run(step, guard)
    assert not torch.equal(state, before)
    assert len(guard._undo) == 3  # the three writes that reach the state, none of the fresh ones
    guard.restore()
    assert torch.equal(state, before)
