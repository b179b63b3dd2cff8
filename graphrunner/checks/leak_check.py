"""The padding-leak check of one key as a capture hook: its phases, runs and comparisons.

See :mod:`graphrunner.checks.padding` for what the check measures and how it is configured;
:class:`LeakCheck`'s docstring for its runs. One check's state lives in a
:class:`~graphrunner.checks.leak_runs.LeakRuns` from its preparation to its end; this module
decides which warmup is which run (:class:`~graphrunner.checks.leak_runs.Phase`), runs the
extra forwards and compares their real cells (:func:`~graphrunner.checks.tolerance.difference`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import torch

from graphrunner._pytree import leaf_paths
from graphrunner.checks.leak_messages import Found, LeakSubject, SequenceCause, leak_fix, leak_message
from graphrunner.checks.leak_runs import KeyInput, LeakRuns, Leaves, Phase, SequenceRuns, logger, shared_pad
from graphrunner.checks.op_work import OpWork
from graphrunner.checks.padding import PerRunner, Sizes, real_cells
from graphrunner.checks.step_objects import named_cells
from graphrunner.checks.tolerance import Noise, admitted, difference
from graphrunner.checks.written_cells import PerturbedCells
from graphrunner.errors import PaddingLeakError
from graphrunner.keys import all_max_vector
from graphrunner.recording.hooks import Capture, CaptureHook, Finding
from graphrunner.recording.ops import OpConsumer

__all__ = ["LeakCheck"]

#: The leading-dim indices of an output leaf.
Dims = tuple[int, ...]


class LeakCheck(CaptureHook):
    """The padded-vs-eager equivalence check of one key, as a capture hook (the last two warmups, ``after_warmups``).

    Args:
        key: the key (runner-dim tuple); ``key_text`` how messages name it.
        sizes: the smallest real sizes that replay ``key`` (:func:`~graphrunner.checks.padding.check_sizes`);
            ``sizes2``: larger real sizes that still pad (or ``None``), so the
            padded count varies.
        inputs: ``[(name, the key's view of its static buffer, leading-dim
            indices, BatchInput)]`` of every input.
        step: the step (``step(**inputs)``), for the eager runs without padding.
        leaf_dims: ``leaf_dims(spec, n) ->`` leading-dim indices of each output leaf.
        exempt: leaf-path prefixes not compared (:func:`~graphrunner.checks.padding.exempt_prefixes`).
        group: the rank group; with several ranks the verdict is agreed (one
            ``all_max`` of one flag), so every rank raises or none does.
        phase_key: the key as the agreement's collective names it.
        warned: names of integer inputs already warned about (one warning per runner), and the
            follow-up values the runner's keys have drawn (:class:`~graphrunner.checks.padding.PerRunner`).

    Real cells get seeded random data (floats: normal; integers: all different, within
    ``BatchInput(bounds=)``; integers without bounds keep their pad value, with one warning),
    padding cells the pad value, as at replay. Two placements of the integers: in the data of
    runs A to D **no real cell holds its input's pad value** (a padding row alone there: the pad
    value as the winner of a max); in the follow-up's data **one real cell per input holds the
    pad** (where the pad is also a real value: a real request at the padding row's index).
    Eager forwards, what they write outside themselves put back after each
    (:class:`~graphrunner.recording.ops.WriteGuard`):

    - **A**: real sizes ``sizes``, padding = pad values (what the graph computes); with
      ``warmups >= 2`` this is the protocol's one but last warmup and the padded follow-up
      its last (their writes put back before the post-warmup hook; when A was the key's first
      warmup, which may initialise lazily, a finding is confirmed by running both again), with
      ``warmups=1`` extra forwards;
    - **B**: as A with the padding of floating-point inputs random: real cells must not move;
    - **D**: ``step`` eagerly on the unpadded real batch (no padding at all):
      A's real cells must equal it (a dependence on the padded size, ``x / x.shape[0]``, or a
      pad value reaching real rows);
    - **C**, only when D cannot run (a step that only runs at its keys' sizes): real sizes
      ``sizes2`` (more real cells, the first ones as in A): A's real cells must not move (the
      padded count varied);
    - **sequences**: the call after A (its writes kept) against the call after D: a follow-up
      ``F`` of ``sizes`` real rows (its own data, the pad among them), padded through the key's
      buffers after A, eagerly without padding after D. Before ``F`` of the unpadded sequence,
      the cells that only A wrote (its padding rows' writes) get other values, as a real request's
      history would have there: so a padding row that writes state a later real request reads
      (a pad slot that is also a real slot) changes ``F``'s real cells, also when the warmups
      left the padding rows' values there already. Run when the step writes state, or when an
      integer input's pad lies inside its bounds. Everything is put back after ``F``.

    A and B, A and D (or C), the two ``F``s must agree within :func:`difference`'s tolerance
    (:class:`Noise`: per element, the dtype's last bits, scaled by the step's matmul reductions,
    measured in run A): bit for bit on the tape for a row-independent step. When an integer input
    has no bounds its real cells keep the pad, so real rows meet padding rows by construction:
    only B is compared then (and a warning says what to declare). A difference raises
    :class:`PaddingLeakError` naming the output path, the key and the inputs; for the sequences
    the input whose pad the changed rows hold, and the cells the padding rows wrote (in collect
    mode: a ``"padding-leak"`` finding). An output that changes between two identical runs
    (state the step keeps in Python) is named in a warning instead. The static buffers are put
    back afterwards.
    """

    name = "padding"

    def __init__(
        self,
        key: Sizes,
        key_text: str,
        sizes: Sizes,
        sizes2: Sizes | None,
        inputs: Sequence[KeyInput],
        step: Callable[..., Any],
        leaf_dims: Callable[[tuple, int], list[Dims]],
        exempt: tuple[str, ...],
        group: Any = None,
        phase_key: Hashable | None = None,
        warned: PerRunner | None = None,
    ) -> None:
        self.key, self.key_text, self.sizes, self.sizes2 = key, key_text, sizes, sizes2
        self.inputs = list(inputs)
        self.floats = [(n, v, d) for n, v, d, spec in self.inputs if spec.dtype.is_floating_point]
        #: Integer inputs whose pad is also a real value (inside their bounds): ``[(name, spec)]``.
        self.shared = [(n, spec) for n, _, _, spec in self.inputs if shared_pad(spec)]
        self.step, self.leaf_dims, self.exempt = step, leaf_dims, exempt
        self.group, self.phase_key = group, phase_key
        self.warned = warned if warned is not None else PerRunner()
        #: Seconds the check itself took (its forwards and the comparisons).
        self.seconds = 0.0
        #: Eager forwards it ran.
        self.forwards = 0
        #: The check's runs, from its preparation (before run A) to its end; ``None`` outside.
        self._runs: LeakRuns | None = None
        self._work = OpWork()  # run A's matmuls, for the tolerance
        #: Run A was the key's first warmup, which may initialise lazily: a finding is confirmed.
        self._a_first = False
        #: What a sequence finding needs to name its cause (kept for the message after the runs end).
        self._explained = SequenceCause()
        self._subject = LeakSubject(key_text, sizes, sizes2, [n for n, _, _ in self.floats], self.shared)

    # ------------------------------------------------------------ the hook points
    @staticmethod
    def _a_index(cap: Capture) -> int:
        """The warmup that is run A: the one but last, so that the last one is the padded
        follow-up; the last when the user's post-warmup hook (which runs after every warmup: a
        cache reset) would come between the two."""
        return cap.warmups - (2 if cap.post_warmup_hook is None else 1)

    def before_warmup(self, cap: Capture, i: int) -> None:
        """With ``warmups >= 2`` the last two warmups are the padded sequence (without a post-warmup
        hook; with one, the last warmup is run A and the follow-up runs right after it): before run
        A's warmup the static buffers get A's data; before the last, when the sequences run, the
        follow-up's data (A's writes in place). Eager forwards fewer; every write of both is put
        back right after the last warmup, before the post-warmup hook."""
        if cap.warmups < 2:
            return
        t0 = time.perf_counter()
        runs = self._runs
        if i == self._a_index(cap):
            runs = self._prepare()
            if runs.checkable(self.floats):
                runs.generators.reset()
                runs.fill(runs.data, self.sizes)
                runs.phase = Phase.RUN_A
                self._a_first = i == 0  # the first warmup may be lazy initialisation: a finding is confirmed
        elif i == cap.warmups - 1 and runs is not None and runs.a is not None and self._wants_sequences():
            runs.generators.reset()  # the check's own generators: never the engine's
            runs.fill(runs.follow(), self.sizes)
            runs.phase = Phase.FOLLOW_UP
        self.seconds += time.perf_counter() - t0

    def warmup_consumers(self, cap: Capture, i: int) -> Sequence[OpConsumer]:
        runs = self._runs
        if runs is None:
            return ()
        if runs.phase is Phase.RUN_A and i == self._a_index(cap):
            return (runs.guard, self._work)
        return (runs.guard,) if runs.a is not None and i == cap.warmups - 1 else ()

    def after_warmup(self, cap: Capture, i: int, out: Any) -> None:
        last = i == cap.warmups - 1
        runs = self._runs
        if runs is None:
            return
        if runs.phase is Phase.RUN_A and i == self._a_index(cap):
            runs.phase = Phase.NONE
            self._after_run_a_warmup(cap, runs, out, last)
            return
        if runs.a is None or not last:
            return
        t0 = time.perf_counter()
        try:
            if runs.phase is Phase.FOLLOW_UP:
                runs.f_padded = runs.leaves(out)
        finally:
            runs.phase = Phase.NONE
            runs.numbers_last = runs.numbers.snapshot()  # what the capture sees, as without the check
            runs.put_back()  # before the post-warmup hook, as after any run of the check
            self.seconds += time.perf_counter() - t0

    def _after_run_a_warmup(self, cap: Capture, runs: LeakRuns, out: Any, last: bool) -> None:
        """Run A's warmup returned ``out``: keep it, and (when it is the last warmup) run the
        padded follow-up right away and put everything back."""
        t0 = time.perf_counter()
        try:
            runs.a = runs.leaves(out)
            if last:  # run A is the last warmup: the capture sees the numbers as it left them
                runs.numbers_last = runs.numbers.snapshot()
            self._after_a(cap, runs, follow=last)
        except BaseException:
            runs.put_back()
            raise
        finally:
            if last:
                runs.put_back()  # before the post-warmup hook, as after any run of the check
            self.seconds += time.perf_counter() - t0

    def after_warmups(self, cap: Capture) -> None:
        if cap.warmups < 1:
            return
        t0 = time.perf_counter()
        try:
            # warmups=1: the one warmup may be lazy initialisation, A runs here
            runs = self._runs if self._runs is not None else self._prepare()
            found = self._check(cap, runs)
        finally:
            self._finish()
        leaked = bool(found)
        if self.group is not None and int(getattr(self.group, "size", 1)) > 1:
            leaked = bool(all_max_vector(self.group, [1 if found else 0], "leak_check", self.phase_key)[0])
        self.seconds += time.perf_counter() - t0
        cap.info["leak_check_sizes"] = list(self.sizes)
        cap.info["leak_check_seconds"] = self.seconds
        cap.info["leak_check_forwards"] = self.forwards
        if leaked:
            msg = leak_message(self._subject, found, self._explained)
            cap.fail(
                PaddingLeakError(msg),
                Finding("padding-leak", msg, None, None, None, fix=leak_fix(self._subject, found, self._explained)),
            )

    def end(self, cap: Capture) -> None:
        """After an error between the last warmup and the check: its writes and the static buffers
        put back."""
        if self._runs is not None:
            self._runs.put_back()
            self._finish()

    def _prepare(self) -> LeakRuns:
        """Keep the static buffers, make the runs' write guard and seeded data (:class:`LeakRuns`)."""
        self._runs = LeakRuns(self.inputs, self.step, self.sizes, self.sizes2, self.exempt, self.warned)
        return self._runs

    def _finish(self) -> None:
        """Drop what the check held (the guard's log, the data, run A) and put the static buffers back."""
        runs, self._runs = self._runs, None
        self._a_first = False
        if runs is not None:
            runs.finish()

    # ------------------------------------------------------------ the runs
    def _run(
        self,
        cap: Capture,
        runs: LeakRuns,
        fn: Callable[[], Any],
        restore: bool = True,
        consumers: Sequence[OpConsumer] = (),
    ) -> Leaves:
        """One eager forward of the check (:meth:`LeakRuns.run`), counted."""
        self.forwards += 1
        return runs.run(cap, fn, restore=restore, consumers=consumers)

    def _wants_sequences(self) -> bool:
        """The follow-up runs when the step wrote state in run A (a later call may read what the
        padding rows wrote) or an integer input's pad is also a real value (a real row at the pad
        meets the padding rows)."""
        runs = self._runs
        return runs is not None and runs.follow_data is not None and bool(self.shared or runs.a_log)

    def _after_a(self, cap: Capture, runs: LeakRuns, follow: bool = True) -> None:
        """Right after run A, its writes not yet put back: keep what it wrote, and (``follow``) run
        the padded sequence's follow-up (else the last warmup is that follow-up)."""
        runs.a_log = runs.log()
        if follow and self._wants_sequences():
            runs.f_padded = self._follow(cap, runs, padded=True)

    def _follow(self, cap: Capture, runs: LeakRuns, padded: bool) -> Leaves:
        """The follow-up call on its own data (the check's own generators reset, as for run A): through the
        key's static buffers (padded) or eagerly on the real rows alone. Its writes stay logged."""
        runs.generators.reset()
        data = runs.follow()
        if padded:
            runs.fill(data, self.sizes)
            return self._run(cap, runs, cap.forward_fn, restore=False)
        inputs = {name: data[name].clone() for name, _, _, _ in self.inputs}
        return self._run(cap, runs, lambda: self.step(**inputs), restore=False)

    # ------------------------------------------------------------ the comparisons
    def _check(self, cap: Capture, runs: LeakRuns) -> Found:
        """``[(which comparison, output path, max abs diff)]`` of the outputs that moved."""
        data, sizes = runs.data, self.sizes
        if not runs.checkable(self.floats):
            return []  # only integer inputs, some without bounds: nothing to vary (the warning says so)
        if runs.a is None:  # the last warmup was not run A (warmups=1)
            runs.fill(data, sizes)
            try:
                runs.a = self._run(cap, runs, cap.forward_fn, restore=False, consumers=(self._work,))
                self._after_a(cap, runs)
            finally:
                runs.put_back()
        a = runs.a
        paths = leaf_paths(runs.spec)
        dims = self.leaf_dims(runs.spec, len(a))
        compare = _Comparisons(paths, dims, sizes, self._noise)
        if self.floats:
            runs.fill(data, sizes, random_float_padding=True)
            compare("padding", a, self._run(cap, runs, cap.forward_fn))
        if runs.blind:
            # an integer input without bounds keeps the pad in its real cells too: real rows then
            # meet padding rows by construction, so only the floating-point padding is measured
            return self._control(cap, runs, a, compare.found, paths, dims)
        unpadded = runs.unpadded(data, sizes)
        try:
            ref = self._run(cap, runs, lambda: self.step(**unpadded), restore=False)
        except Exception as exc:  # noqa: BLE001 - a step that only runs at its keys' sizes
            runs.put_back()
            logger.info(
                "padding check of %s: the step did not run on the unpadded batch (%s: %s); compared padded runs only",
                self.key_text,
                type(exc).__name__,
                exc,
            )
            if self.sizes2 is not None:  # C: without D, the padded count varied at least
                runs.fill(data, self.sizes2)
                compare("count", a, self._run(cap, runs, cap.forward_fn))
            return self._control(cap, runs, a, compare.found, paths, dims)
        if len(ref) == len(a):
            compare("eager", a, ref, other_sliced=True)
        if runs.f_padded is not None and len(ref) == len(a):
            self._unpadded_sequence(cap, runs, runs.f_padded, compare)
        else:
            runs.put_back()
        if compare.found and self._a_first:
            # run A was the key's first warmup, which may initialise lazily (a table, a cache): the
            # finding counts only if run A and its follow-up, run again as extra forwards, agree
            self._a_first = False
            runs.a = runs.f_padded = None
            runs.seq = None
            return self._check(cap, runs)
        return self._control(cap, runs, a, compare.found, paths, dims)

    def _unpadded_sequence(self, cap: Capture, runs: LeakRuns, f_padded: Leaves, compare: _Comparisons) -> None:
        """Run D's writes still in place: give the cells only A wrote other values, run the
        follow-up eagerly without padding, put everything back, compare with the padded sequence."""
        pert = PerturbedCells(runs.a_log, runs.log())
        try:
            f_unpadded = self._follow(cap, runs, padded=False)
        except Exception as exc:  # noqa: BLE001 - a step that only runs at its keys' sizes
            logger.info(
                "padding check of %s: the follow-up call did not run without padding (%s: %s); sequences not compared",
                self.key_text,
                type(exc).__name__,
                exc,
            )
            return
        finally:
            runs.put_back()
            pert.restore()
        runs.seq = SequenceRuns(f_unpadded, [(t, offs) for t, _, offs, _ in pert.cells])
        compare("sequence", f_padded, f_unpadded, other_sliced=True)

    def _noise(self, d: Dims) -> Noise:
        return Noise(lead=len(d), reduction=self._work.reduction, matmuls=self._work.matmuls)

    def _control(
        self, cap: Capture, runs: LeakRuns, a: Leaves, found: Found, paths: list[str], dims: list[Dims]
    ) -> Found:
        """``found`` without the outputs that also move between two identical runs (warned about);
        for a sequence finding, what it needs to name its cause."""
        if not found:
            return found
        # Control: A again. An output that moves between identical runs depends on state the
        # step keeps in Python (a counter, an attribute re-bound to a new tensor): not a padding
        # leak, and not checkable this way.
        runs.fill(runs.data, self.sizes)
        again = self._run(cap, runs, cap.forward_fn)
        unstable = {
            p
            for p, x, y, d in zip(paths, a, again, dims)
            if x is not None and y is not None and difference(x, y) is not None
        }
        if any(k == "sequence" for k, _, _ in found):
            unstable |= self._sequence_control(cap, runs, paths)
        if unstable:
            logger.warning(
                "padding check of %s: %s changed between two identical calls (the step's output depends "
                "on state it keeps in Python: a counter, or an attribute re-bound to a new tensor), so padding "
                "leaks into it cannot be checked",
                self.key_text,
                ", ".join(sorted(unstable)),
            )
        found = [f for f in found if f[1] not in unstable]
        if any(k == "sequence" for k, _, _ in found):
            self._explain_sequence(cap, runs, dims)
        return found

    def _sequence_control(self, cap: Capture, runs: LeakRuns, paths: list[str]) -> set[str]:
        """The unpadded sequence again: the outputs of its follow-up that move between two identical
        sequences (state the step keeps in Python)."""
        unstable: set[str] = set()
        again = self._sequence_again(cap, runs, padded_first=False)
        if again is None:
            return set(paths)
        for p, x, y in zip(paths, runs.sequence().unpadded, again):
            if x is not None and y is not None and difference(x, y) is not None:
                unstable.add(p)
        return unstable

    def _sequence_again(self, cap: Capture, runs: LeakRuns, padded_first: bool) -> Leaves | None:
        """[A, F] (``padded_first``) or [D, F] with the unpadded follow-up, as the check ran it; every
        write put back."""
        data, sizes = runs.data, self.sizes
        pert = None
        try:
            if padded_first:
                runs.fill(data, sizes)
                self._run(cap, runs, cap.forward_fn, restore=False)
            else:
                unpadded = runs.unpadded(data, sizes)
                self._run(cap, runs, lambda: self.step(**unpadded), restore=False)
                pert = PerturbedCells(runs.a_log, runs.log())
            return self._follow(cap, runs, padded=False)
        except Exception:  # noqa: BLE001 - the diagnosis is a bonus
            return None
        finally:
            runs.put_back()
            if pert is not None:
                pert.restore()

    def _explain_sequence(self, cap: Capture, runs: LeakRuns, dims: list[Dims]) -> None:
        """What a sequence finding needs to name its cause: the follow-up rows that changed and the
        inputs whose pad they hold, whether the earlier padded call did it (its padding rows' writes)
        or the follow-up's own padding, the written tensors and cells."""
        seq = runs.sequence()
        fu = seq.unpadded
        rows = sorted(self._changed_rows(runs.f_padded or [], fu, dims))
        by_input = []
        follow = runs.follow()
        for name, spec in self.shared:
            vals = follow[name].reshape(follow[name].shape[0], -1) if follow[name].dim() else follow[name].reshape(1, 1)
            at_pad = [r for r in rows if r < vals.shape[0] and bool((vals[r] == spec.pad).any())]
            if at_pad:
                by_input.append((name, spec, at_pad))
        again = self._sequence_again(cap, runs, padded_first=True)
        earlier = again is not None and any(
            x is not None and y is not None and difference(x, y, tolerant=self._noise(d)) is not None
            for x, y, d in zip(again, fu, dims)
        )
        named = named_cells(self.step, seq.cells) if earlier else []
        self._explained = SequenceCause(rows=rows, inputs=by_input, earlier=earlier, named=named)

    def _changed_rows(self, padded: Leaves, unpadded: Leaves, dims: list[Dims]) -> set[int]:
        """The rows of the follow-up's real cells where the padded sequence's differs from the
        unpadded one's beyond the tolerance."""
        rows: set[int] = set()
        for x, y, d in zip(padded, unpadded, dims):
            if x is None or y is None or not d:
                continue
            x = real_cells(x, d, self.sizes)
            if x.shape != y.shape or x.dim() == 0:
                continue
            if x.dtype.is_floating_point or x.dtype.is_complex:
                wide = torch.complex128 if x.dtype.is_complex else torch.float64
                bad = ~((x.to(wide) - y.to(wide)).abs() <= admitted(y, self._noise(d))) & ~(x == y)
            else:
                bad = x != y
            bad = bad.reshape(bad.shape[0], -1).any(-1) if bad.dim() > 1 else bad
            rows.update(int(r) for r in bad.nonzero().reshape(-1).tolist())
        return rows


class _Comparisons:
    """The comparisons of one check: each output leaf of a run against the same leaf of another,
    real cells only, within the last-bit tolerance (the kernels CPU and GPU libraries choose depend
    on row counts: an MoE expert's rows change when padding rows become real, which moves the
    last bits). Called as ``compare(kind, got, other)``; what moved is in :attr:`found`."""

    def __init__(self, paths: list[str], dims: list[Dims], sizes: Sizes, noise: Callable[[Dims], Noise]) -> None:
        self.paths, self.dims, self.sizes, self.noise = paths, dims, sizes, noise
        self.found: Found = []

    def __call__(
        self, kind: str, got: Leaves, other: Leaves, got_sliced: bool = False, other_sliced: bool = False
    ) -> None:
        for p, x, y, d in zip(self.paths, got, other, self.dims):
            if x is None or y is None:
                continue
            x = x if got_sliced else real_cells(x, d, self.sizes)
            y = y if other_sliced else real_cells(y, d, self.sizes)
            diff = difference(x, y, tolerant=self.noise(d))
            if diff is not None:
                self.found.append((kind, p, diff))
