"""One padding check's runs: what they keep, put back and run on.

A :class:`LeakRuns` lives from the check's preparation (before its run A) to its end: the
static buffers as they were, the write guard that puts back what each run writes (its
generators the check's own), the step's Python numbers (:class:`~graphrunner.checks.step_objects.PythonNumbers`),
the seeded real data of every input (:func:`real_data`), the phase a warmup runs in
(:class:`Phase`) and what the runs kept (run A's output and writes, the padded follow-up's
output). :class:`~graphrunner.checks.leak_check.LeakCheck` makes one per key and compares.
"""

from __future__ import annotations

import enum
import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from graphrunner._pytree import flatten, leaf_paths
from graphrunner.checks.padding import FollowValues, PerRunner, Sizes, is_exempt
from graphrunner.checks.step_objects import PythonNumbers, Snapshot
from graphrunner.checks.written_cells import LogEntry
from graphrunner.keys import region
from graphrunner.recording.ops import OpConsumer, OpRecorder, WriteGuard
from graphrunner.tape.rng import OwnedGenerators

if TYPE_CHECKING:
    from graphrunner.inputs import BatchInput
    from graphrunner.recording.hooks import Capture

__all__ = ["KeyInput", "Leaves", "LeakRuns", "Phase", "SequenceRuns", "real_data", "shared_pad"]

logger = logging.getLogger("graphrunner.checks.padding")  # the padding check's logger, in all its modules

#: ``(name, the key's view of its static buffer, leading-dim indices, BatchInput)`` of one input.
KeyInput = tuple[str, torch.Tensor, tuple[int, ...], "BatchInput"]
#: The output leaves of one run, cloned (``None`` for exempt ones).
Leaves = list[torch.Tensor | None]
#: A ``BatchInput``'s pad value.
Pad = bool | int | float


class Phase(enum.Enum):
    """Which of the check's runs the warmup now running is (with ``warmups >= 2`` the last two
    warmups are run A and the padded follow-up)."""

    NONE = "none"  # no warmup runs as one of the check's runs
    RUN_A = "run A"  # the warmup running is run A, on the check's data
    FOLLOW_UP = "follow-up"  # the last warmup is running as the padded follow-up, after run A


@dataclass
class SequenceRuns:
    """The unpadded call sequence: its follow-up's output leaves, and the cells only the padded
    call wrote (``(a tensor on the storage, storage offsets)``), which it gave other values."""

    unpadded: Leaves
    cells: list[tuple[torch.Tensor, torch.Tensor]]


class LeakRuns:
    """One check's runs, from its preparation to its end (see the module docstring).

    Args:
        inputs: every input of the key (:data:`KeyInput`).
        step: the step, whose Python numbers every run starts from.
        sizes: the real sizes of the runs; ``sizes2``: the larger ones, or ``None``.
        exempt: output leaf-path prefixes not kept (:func:`~graphrunner.checks.padding.exempt_prefixes`).
        warned: what the runner's padding checks share (:class:`~graphrunner.checks.padding.PerRunner`).
    """

    def __init__(
        self,
        inputs: Sequence[KeyInput],
        step: Callable[..., Any],
        sizes: Sizes,
        sizes2: Sizes | None,
        exempt: tuple[str, ...],
        warned: PerRunner,
    ) -> None:
        self.inputs = inputs
        self.exempt = exempt
        #: The static buffers as they were before the check filled them.
        self.saved = [(v, v.clone()) for _, v, _, _ in inputs]
        # one guard for every run: what a run wrote is put back after it
        # the step's draws during the runs come from generators the check owns (reset before each
        # run): the engine's generators are never read, drawn from or set, on any thread
        self.generators = OwnedGenerators(0x636B6563)
        self.guard = WriteGuard([v for _, v, _, _ in inputs], generators=self.generators)
        # the step's Python numbers: every run starts from them; the capture sees them as after run A
        self.numbers = PythonNumbers(step)
        self.numbers0: Snapshot = self.numbers.snapshot()
        #: The numbers after the last warmup: what the capture sees (``None``: as before the runs).
        self.numbers_last: Snapshot | None = None
        #: The seeded real data of every input (runs A to D); ``blind``: an integer input has no
        #: bounds (its real cells keep the pad).
        self.data, self.blind = real_data(inputs, 0x6C65616B, sizes2 or sizes, False, warned)
        #: The follow-up's real data (the pad among it), ``None`` when blind.
        self.follow_data = None if self.blind else real_data(inputs, 0x666F6C6C, sizes, True, warned)[0]
        self.phase = Phase.NONE
        self.a: Leaves | None = None  # run A's output leaves
        self.a_log: list[LogEntry] = []  # what run A wrote (the guard's log)
        self.f_padded: Leaves | None = None  # the follow-up's output leaves after A (padded through the key)
        self.spec: tuple = ()  # the output structure of the last run (:func:`~graphrunner._pytree.flatten`)
        self.seq: SequenceRuns | None = None  # the unpadded sequence, once it ran

    def checkable(self, floats: Sequence[object]) -> bool:
        """False when there is nothing to vary: only integer inputs (no ``floats``), some without
        bounds (the warning says so)."""
        return not (self.blind and not floats)

    def follow(self) -> dict[str, torch.Tensor]:
        """The follow-up's data (it runs only when there is some: not blind)."""
        assert self.follow_data is not None, "the follow-up runs only with its data (not blind)"
        return self.follow_data

    def sequence(self) -> SequenceRuns:
        """The unpadded sequence (a sequence finding exists only once it ran)."""
        assert self.seq is not None, "a sequence finding comes from the unpadded sequence"
        return self.seq

    def fill(self, data: dict[str, torch.Tensor], sizes: Sizes, random_float_padding: bool = False) -> None:
        """Real cells ``sizes`` of every key view from ``data``, the rest the pad value (floats
        random with ``random_float_padding``)."""
        g = torch.Generator().manual_seed(0x70616464)
        for name, view, didx, spec in self.inputs:
            view.fill_(spec.pad)
            if random_float_padding and spec.dtype.is_floating_point:
                noise = torch.randn(view.shape, generator=g, dtype=torch.float32) * 3.0 + 1.0
                view.copy_(noise.to(device=view.device, dtype=view.dtype))
            r = region(sizes, didx)
            view[r].copy_(data[name][r])

    def unpadded(self, data: dict[str, torch.Tensor], sizes: Sizes) -> dict[str, torch.Tensor]:
        """The real cells ``sizes`` of ``data``, per input: a call without padding."""
        return {name: data[name][region(sizes, didx)].clone() for name, _, didx, _ in self.inputs}

    def run(
        self, cap: Capture, fn: Callable[[], Any], restore: bool = True, consumers: Sequence[OpConsumer] = ()
    ) -> Leaves:
        """``fn()`` eagerly, what it wrote outside itself logged (and put back, with ``restore``);
        its output leaves cloned (``None`` for exempt ones). The output's structure is kept in
        :attr:`spec`."""
        try:
            with OpRecorder([self.guard, *consumers]):
                out = cap.eager(fn)
            return self.leaves(out)
        finally:
            if restore:
                self.put_back()

    def leaves(self, out: Any) -> Leaves:
        """The output leaves of one run, cloned (``None`` for exempt ones); the structure in :attr:`spec`."""
        self.spec, leaves = flatten(out, "step output")
        skip = [is_exempt(p, self.exempt) for p in leaf_paths(self.spec)]
        return [None if s else t.detach().clone() for t, s in zip(leaves, skip)]

    def log(self) -> list[LogEntry]:
        """What the runs wrote since the last put-back (the guard's log, oldest first)."""
        return list(self.guard._undo)

    def put_back(self) -> None:
        """After a run or a sequence: what it wrote put back, and the step's Python numbers."""
        self.guard.restore()
        PythonNumbers.put(self.numbers0)

    def finish(self) -> None:
        """The end of the check: the step's Python numbers as the capture sees them (as after the
        last warmup), the static buffers as they were."""
        PythonNumbers.put(self.numbers_last if self.numbers_last is not None else self.numbers0)
        for v, old in self.saved:
            v.copy_(old)


def real_data(
    inputs: Sequence[KeyInput], seed: int, top: Sizes, pad_cell: bool, warned: PerRunner
) -> tuple[dict[str, torch.Tensor], bool]:
    """Seeded random real cells of every input at sizes ``top``; with ``pad_cell`` one real
    cell of each integer input at its pad (where the pad is a real value), else none. Also
    whether an integer input has no bounds (its real cells keep the pad: one warning per runner)."""
    g = torch.Generator().manual_seed(seed)
    blind = False
    data = {}
    forced = 0  # integer inputs whose pad is a real value: each meets the padding at its own cell
    unbounded: list[str] = []
    for name, view, didx, spec in inputs:
        shape = (*(top[d] for d in didx), *spec.trailing)
        dt = spec.dtype
        if dt.is_floating_point or dt.is_complex:
            t = torch.randn(shape, generator=g, dtype=torch.float32).to(dt)
        elif dt == torch.bool:
            t = torch.randint(0, 2, shape, generator=g).bool()
        else:
            lo, hi = spec.bounds if spec.bounds is not None else (None, None)
            if lo is None or hi is None:
                blind = True
                unbounded.append(name)
                t = torch.full(shape, spec.pad, dtype=dt)
            else:
                if pad_cell:
                    t = _follow_ints(int(lo), int(hi), shape, spec.pad, forced, name, warned, seed).to(dt)
                else:
                    t = _distinct_ints(int(lo), int(hi), shape, spec.pad, g, None).to(dt)
                forced += lo <= spec.pad <= hi
        data[name] = t.to(view.device)
    if unbounded and not warned:  # one warning per runner
        warned.update(unbounded)
        logger.warning(
            "padding check: integer input(s) %s have no BatchInput(bounds=(lo, hi)), so their real cells keep "
            "the pad value and only the padding of floating-point inputs is measured (not leaks through "
            "integer inputs, nor a dependence on the padded count, nor what padding rows leave for later "
            "calls); declare the range of their real values, e.g. bounds=(0, vocab_size - 1) for token ids "
            "or (0, num_slots - 1) for cache slots (the pad may lie outside: a scratch index)",
            ", ".join(repr(n) for n in unbounded),
        )
    return data, blind


def shared_pad(spec: BatchInput) -> bool:
    """An integer input whose pad is also a real value (inside its bounds)."""
    if spec.dtype.is_floating_point or spec.dtype.is_complex or spec.dtype == torch.bool or spec.bounds is None:
        return False
    lo, hi = spec.bounds
    return lo is not None and hi is not None and lo <= spec.pad <= hi


def _follow_ints(
    lo: int, hi: int, shape: tuple[int, ...], pad: Pad, at: int, name: str, shared: PerRunner, seed: int
) -> torch.Tensor:
    """The follow-up's integers: cell ``at`` (flat, modulo the size) at ``pad`` when it lies in
    ``[lo, hi]``, the others the next values of a runner-wide permutation of the range without the
    pad (all different where the range allows), continuing where the runner's previous key stopped."""
    n = math.prod(shape)
    inside = lo <= pad <= hi
    entry = shared.follow.get(name)
    if entry is None:
        perm = torch.randperm(hi - lo + 1, generator=torch.Generator().manual_seed(seed)) + lo
        if inside and perm.numel() > 1:
            perm = perm[perm != pad]
        entry = shared.follow[name] = FollowValues(perm)
    perm, off = entry.perm, entry.offset
    m = perm.numel()
    need = n - int(inside and n > 0)
    if need > 0 and m:
        idx = (torch.arange(need) + off) % m
        vals = perm[idx]
        entry.offset = (off + need) % m
    else:
        vals = torch.empty(0, dtype=torch.long)
    t = torch.empty(n, dtype=torch.long)
    if inside and n:
        j = at % n
        t[j] = pad
        keep = torch.ones(n, dtype=torch.bool)
        keep[j] = False
        t[keep] = vals
    else:
        t[:] = vals
    return t.reshape(shape)


def _distinct_ints(
    lo: int, hi: int, shape: tuple[int, ...], pad: Pad, g: torch.Generator, at: int | None = 0
) -> torch.Tensor:
    """Random integers in ``[lo, hi]`` of ``shape``, all different where the range allows (real
    requests use different cache slots; two real rows at one slot would be a collision the runner
    never makes), none at ``pad`` (while other values exist) except cell ``at`` (flat, modulo the
    size) when ``at`` is given and the pad lies in the range: where padding rows meet a real one;
    each input at its own cell, so that a padding row, which holds every input's pad at once,
    differs from that real row in the other inputs. ``at=None``: no real cell at the pad (where
    the padding row alone holds the pad value: the pad value as the winner of a max)."""
    n = math.prod(shape)
    span = hi - lo + 1
    inside = lo <= pad <= hi
    avoid = int(inside and span > 1)
    if span - avoid >= n > 0:
        perm = torch.randperm(span, generator=g)[: n + avoid] + lo
        if avoid:
            perm = perm[perm != pad][:n]
        t = perm.reshape(shape)
    else:
        t = torch.randint(lo, hi + 1 - avoid, shape, generator=g, dtype=torch.int64)
        if avoid:
            t = t + (t >= pad).long()  # skip the pad
    if inside and n and at is not None:
        t.reshape(-1)[at % n] = pad  # a real cell at the pad index
    return t
