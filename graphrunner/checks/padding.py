"""Padding-leak check at capture: padding cells must not change real results.

A graph computes every cell of its key, padding included, so a step whose
real outputs depend on the padding (a reduction over the batch such as
``h.sum()``, a mean, a norm across rows) replays with a silently wrong
result. For every key that a smaller call can replay, :class:`LeakCheck`
runs the step eagerly on seeded random real cells with the padding at its
pad value (run A: the protocol's last warmup, through the capture hook's
``before_warmup``/``after_warmup``), then, at ``after_warmups`` (the capture
order stays in :mod:`graphrunner.backends.base`), with the float padding
changed, with more real cells and without padding, and compares the real
cells of every output, 0-dim outputs whole, with run A's (see
:class:`LeakCheck`). Any difference raises
:class:`~graphrunner.errors.PaddingLeakError` naming the output path and the
key.

- Real sizes: per dim, the smallest size that still replays the key (on a
  full grid the dim's previous bucket + 1; ``max_padding_ratio`` and
  ``keys=`` are taken into account), see :func:`check_sizes`. A key no smaller call
  maps to (the smallest bucket) is not checked.
- Integer, bool and complex inputs keep their pad value: it must stay a
  safe index. A step whose only inputs are indices cannot be checked.
- Opt out per output with ``GraphRunner(checks=["drift", gr.PaddingCheck(exempt=("total",)),
  "fingerprint"])`` (an output meant to read the whole padded batch; its
  slicing by ``outputs=`` is unchanged), per runner by leaving ``"padding"``
  out of ``checks=``.

This module knows nothing about graphs; the runner builds one check per key
from its :class:`PaddingCheck` (the configuration in ``checks=``).
"""

from __future__ import annotations

import logging
import math
import re
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from graphrunner._pytree import flatten, leaf_paths
from graphrunner.recording.hooks import Capture, CaptureHook, Finding
from graphrunner.errors import PaddingLeakError
from graphrunner.keys import all_max_vector, region

__all__ = ["PaddingCheck", "exempt_prefixes", "check_sizes", "second_sizes", "real_cells", "difference", "LeakCheck"]

Sizes = Tuple[int, ...]


class PaddingCheck:
    """The padding-leak check as configured in ``GraphRunner(checks=[...])`` (``"padding"`` is
    ``PaddingCheck()``).

    ``exempt``: outputs the check does not compare, meant to read the whole
    padded batch: dict output keys (``("total",)``) or output paths as the
    error spells them (``"output[1]"``). Raises ``TypeError`` for anything
    but a string or a sequence of them.
    """

    name = "padding"

    def __init__(self, exempt: Any = ()) -> None:
        self.exempt = exempt_prefixes(exempt)
        #: Integer inputs already warned about (no bounds): one warning per runner.
        self.warned: set = set()

    def __repr__(self) -> str:
        return f"PaddingCheck(exempt={self.exempt!r})"


def exempt_prefixes(exempt: Any) -> Tuple[str, ...]:
    """``PaddingCheck(exempt=...)`` as leaf-path prefixes.

    Each entry is a dict output key (``"total"`` -> ``output['total']``) or a
    leaf path as messages spell it (``"output[1]"``, ``"output['aux'].loss"``).
    Raises ``TypeError`` for anything but a string or a sequence of them.
    """
    if isinstance(exempt, str):
        exempt = (exempt,)
    try:
        items = tuple(exempt)
    except TypeError:
        raise TypeError(f"PaddingCheck(exempt=...) must be a tuple of output names such as ('total',), got {exempt!r}") from None
    out = []
    for e in items:
        if not isinstance(e, str) or not e:
            raise TypeError(f"PaddingCheck(exempt=...) entries must be dict output keys or output paths (strings), got {e!r}")
        out.append(e if e == "output" or e.startswith("output[") or e.startswith("output.") else f"output[{e!r}]")
    return tuple(out)


def _exempt(path: str, prefixes: Tuple[str, ...]) -> bool:
    return any(path == p or path.startswith(p + "[") or path.startswith(p + ".") for p in prefixes)


def check_sizes(space: Any, key: Sizes) -> Optional[Sizes]:
    """The real sizes the leak check of ``key`` uses, or ``None`` when no smaller call replays ``key``.

    Dim by dim, in key order: the smallest size that still replays ``key``
    (the runner's own key choice, :meth:`KeySpace.choose`, so
    ``max_padding_ratio`` and ``keys=`` count), among 1, every bucket of
    that dim below the key's plus 1, and ``ceil(bucket * (1 -
    max_padding_ratio))``. On a full grid of keys that is the
    dim's previous bucket + 1 in every dim.
    """
    key = tuple(key)
    sizes = list(key)
    ratio = space.max_padding_ratio
    for j, d in enumerate(space.dims):
        cands = {1} | {b + 1 for b in space.buckets[d] if b < key[j]}
        if ratio is not None:
            cands.add(math.ceil(key[j] * (1 - ratio) - 1e-9))
        for n in sorted(cands):
            if n >= key[j]:
                break
            trial = tuple(sizes[:j] + [n] + sizes[j + 1:])
            if space.choose(trial)[0] == key:
                sizes[j] = n
                break
    return None if tuple(sizes) == key else tuple(sizes)


def second_sizes(space: Any, key: Sizes, sizes: Sizes) -> Optional[Sizes]:
    """Real sizes between ``sizes`` (:func:`check_sizes`) and ``key`` that still pad and still
    replay ``key`` (``key - 1`` in every dim that pads), or ``None`` when there are none: the
    padding check's second real size, so that the padded count varies."""
    s2 = tuple(max(s, k - 1) for s, k in zip(sizes, key))
    if s2 == tuple(sizes) or s2 == tuple(key) or space.choose(s2)[0] != tuple(key):
        return None
    return s2


def _distinct_ints(lo: int, hi: int, shape: Tuple[int, ...], pad: Any, g: torch.Generator,
                   at: int = 0) -> torch.Tensor:
    """Random integers in ``[lo, hi]`` of ``shape``, all different where the range allows (real
    requests use different cache slots; two real rows at one slot would be a collision the runner
    never makes), cell ``at`` (flat, modulo the size) at ``pad`` when it lies in the range (where
    padding rows meet a real one; each input at its own cell, so that a padding row, which holds
    every input's pad at once, differs from that real row in the other inputs)."""
    n = math.prod(shape)
    span = hi - lo + 1
    inside = lo <= pad <= hi
    if span - inside >= n > 0:
        perm = torch.randperm(span, generator=g)[: n + inside] + lo
        if inside:
            perm = perm[perm != pad][:n]
        t = perm.reshape(shape)
    else:
        t = torch.randint(lo, hi + 1, shape, generator=g, dtype=torch.int64)
    if inside and n:
        flat = t.reshape(-1)
        j = at % n
        flat[flat == pad] = flat[j].clone()  # at most one cell holds the pad ...
        flat[j] = pad                          # ... this one: a real cell at the pad index
    return t


def real_cells(t: torch.Tensor, didx: Tuple[int, ...], sizes: Sizes) -> torch.Tensor:
    """The real cells ``sizes`` of output leaf ``t`` on its leading dims ``didx`` (a 0-dim leaf whole)."""
    return t if t.dim() == 0 or not didx else t[region(sizes, didx)]


def difference(a: torch.Tensor, b: torch.Tensor, tolerant: bool = False) -> Optional[float]:
    """``None`` if equal (NaN equals NaN; with ``tolerant``, floating-point values within
    ``max|b| * min(0.05, 1024 * eps)``: what kernels chosen for another shape may change), else
    the max abs difference (inf for a shape change)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return math.inf
    if a.dtype.is_floating_point or a.dtype.is_complex:
        same = (a == b) | (torch.isnan(a) & torch.isnan(b))
        if bool(same.all()):
            return None
        if tolerant:
            scale = float(torch.nan_to_num(b.abs().to(torch.float64), nan=0.0, posinf=0.0).max()) if b.numel() else 0.0
            eps = torch.finfo(a.real.dtype if a.dtype.is_complex else a.dtype).eps
            d = (a.to(torch.complex128 if a.dtype.is_complex else torch.float64)
                 - b.to(torch.complex128 if b.dtype.is_complex else torch.float64)).abs()
            worst = float(torch.nan_to_num(d, nan=math.inf).max())
            return None if worst <= scale * min(0.05, 1024 * eps) + 1e-30 else worst
        d = (a.to(torch.complex128 if a.dtype.is_complex else torch.float64)
             - b.to(torch.complex128 if b.dtype.is_complex else torch.float64)).abs()
        return float(torch.nan_to_num(d, nan=math.inf).max())
    if torch.equal(a, b):
        return None
    return float((a.to(torch.float64) - b.to(torch.float64)).abs().max())


logger = logging.getLogger("graphrunner.checks.padding")


class LeakCheck(CaptureHook):
    """The padded-vs-eager equivalence check of one key, as a capture hook (the last warmup, ``after_warmups``).

    Args:
        key: the key (runner-dim tuple); ``key_text`` how messages name it.
        sizes: the smallest real sizes that replay ``key`` (:func:`check_sizes`);
            ``sizes2``: larger real sizes that still pad (or ``None``), so the
            padded count varies.
        inputs: ``[(name, the key's view of its static buffer, leading-dim
            indices, BatchInput)]`` of every input.
        step: the step (``step(**inputs)``), for the eager run on the unpadded batch.
        leaf_dims: ``leaf_dims(spec, n) ->`` leading-dim indices of each output leaf.
        exempt: leaf-path prefixes not compared (:func:`exempt_prefixes`).
        group: the rank group; with several ranks the verdict is agreed (one
            ``all_max`` of one flag), so every rank raises or none does.
        phase_key: the key as the agreement's collective names it.
        warned: names of integer inputs already warned about (one warning per runner).

    After the last warmup: real cells get seeded random data (floats:
    normal; integers: uniform within ``BatchInput(bounds=)``, one real cell
    set to the pad value when the pad is a valid real value, so a padding row
    that writes state at the pad index meets a real row; integers without
    bounds keep their pad value, with one warning), padding cells the pad
    value, as at replay. Then eager forwards, each followed by a restore of
    what it wrote outside itself (:class:`~graphrunner.recording.ops.WriteGuard`):

    - **A**: real sizes ``sizes``, padding = pad values (what the graph computes); with
      ``warmups >= 2`` this is the protocol's last warmup (its writes put back before the
      post-warmup hook), with ``warmups=1`` an extra forward;
    - **B**: as A with the padding of floating-point inputs random: real cells must not move;
    - **C**: real sizes ``sizes2`` (more real cells, the first ones as in A):
      A's real cells must not move (the padded count varied);
    - **D**: ``step`` eagerly on the unpadded real batch (no padding at all):
      A's real cells must equal it within a float tolerance (a dependence on
      the padded size, ``x / x.shape[0]``, or a pad value reaching real rows).

    A and B, A and C must agree as A and D do: bit for bit on the tape for a
    row-independent step, within the float tolerance where the kernel a library
    picks depends on a row count (an MoE expert's share of the rows moves when
    padding rows become real: last-bit changes, not a leak). When an integer input has no
    bounds its real cells keep the pad, so real rows meet padding rows by
    construction: only B is compared then (and a warning says what to declare). A difference raises
    :class:`PaddingLeakError` naming the output path, the key and the inputs
    (in collect mode: a ``"padding-leak"`` finding). An output that changes
    between two identical runs (state the step updates in Python) is named in
    a warning instead. The static buffers are put back afterwards.
    """

    name = "padding"

    def __init__(self, key: Sizes, key_text: str, sizes: Sizes, sizes2: Optional[Sizes],
                 inputs: Sequence[Tuple[str, torch.Tensor, Tuple[int, ...], Any]], step: Callable[..., Any],
                 leaf_dims: Callable[[tuple, int], List[Tuple[int, ...]]], exempt: Tuple[str, ...],
                 group: Any = None, phase_key: Any = None, warned: Optional[set] = None) -> None:
        self.key, self.key_text, self.sizes, self.sizes2 = key, key_text, sizes, sizes2
        self.inputs = list(inputs)
        self.floats = [(n, v, d) for n, v, d, spec in self.inputs if spec.dtype.is_floating_point]
        self.step, self.leaf_dims, self.exempt = step, leaf_dims, exempt
        self.group, self.phase_key = group, phase_key
        self.warned = warned if warned is not None else set()
        #: Seconds the check itself took (its forwards and the comparisons).
        self.seconds = 0.0
        #: Eager forwards it ran.
        self.forwards = 0
        self._guard: Any = None  # the WriteGuard of the runs, during the check
        self._saved: Any = None  # the static buffers as they were before the check filled them
        self._data: Any = None  # the seeded real data of every input
        self._a: Any = None  # run A's output leaves
        self._a_in_warmup = False  # the last warmup is running as run A

    # ------------------------------------------------------------ the hook points
    def before_warmup(self, cap: Capture, i: int) -> None:
        """Before the last warmup (with ``warmups >= 2``): the static buffers hold run A's data, so
        that warmup is run A (one eager forward fewer); its writes are put back right after it."""
        if i != cap.warmups - 1 or cap.warmups < 2:
            return
        t0 = time.perf_counter()
        if self._prepare():
            self._fill(self._data, self.sizes)
            self._a_in_warmup = True
        self.seconds += time.perf_counter() - t0

    def warmup_consumers(self, cap: Capture, i: int) -> Sequence[Any]:
        return (self._guard,) if self._a_in_warmup and i == cap.warmups - 1 else ()

    def after_warmup(self, cap: Capture, i: int, out: Any) -> None:
        if not self._a_in_warmup or i != cap.warmups - 1:
            return
        self._a_in_warmup = False
        try:
            self._a = self._leaves(out)
        finally:
            self._guard.restore()  # before the post-warmup hook, as after any run of the check

    def after_warmups(self, cap: Capture) -> None:
        if cap.warmups < 1:
            return
        t0 = time.perf_counter()
        try:
            if self._saved is None:  # warmups=1: the one warmup may be lazy initialisation, A runs here
                self._prepare()
            found = self._check(cap)
        finally:
            self._finish()
        leaked = bool(found)
        if int(getattr(self.group, "size", 1)) > 1:
            leaked = bool(all_max_vector(self.group, [1 if found else 0], "leak_check", self.phase_key)[0])
        self.seconds += time.perf_counter() - t0
        cap.info["leak_check_sizes"] = list(self.sizes)
        cap.info["leak_check_seconds"] = self.seconds
        cap.info["leak_check_forwards"] = self.forwards
        if leaked:
            first = found[0][1] if found else None
            cap.fail(PaddingLeakError(self._message(found)),
                     Finding("padding-leak", self._message(found), None, None, None,
                             fix=f"make the step row-independent, or exempt {first} if it is meant to cover the "
                                 "whole padded batch" if first else "see the other rank's finding"))

    def end(self, cap: Capture) -> None:
        """After an error between the last warmup and the check: its writes and the static buffers
        put back."""
        if self._saved is not None:
            self._guard.restore()
            self._finish()

    def _prepare(self) -> bool:
        """Keep the static buffers, make the runs' write guard and seeded data; False when there is
        nothing to vary (only integer inputs, some without bounds: the warning says so)."""
        from graphrunner.recording.ops import WriteGuard

        self._saved = [(v, v.clone()) for _, v, _, _ in self.inputs]
        # one guard for every run: what a run wrote is put back after it
        self._guard = WriteGuard([v for _, v, _, _ in self.inputs])
        self._data = self._real_data()
        return not (self._blind and not self.floats)

    def _finish(self) -> None:
        """Drop what the check held (the guard's log, the data, run A) and put the static buffers back."""
        saved, self._saved = self._saved or [], None
        self._guard = self._data = self._a = None
        self._a_in_warmup = False
        for v, old in saved:
            v.copy_(old)

    # ------------------------------------------------------------ the runs
    def _real_data(self) -> Dict[str, torch.Tensor]:
        """Seeded random real cells of every input at the largest real sizes used (``sizes2``)."""
        g = torch.Generator().manual_seed(0x6C65616B)
        self._blind = False
        top = self.sizes2 or self.sizes
        data = {}
        forced = 0  # integer inputs whose pad is a real value: each meets the padding at its own cell
        unbounded: List[str] = []
        for name, view, didx, spec in self.inputs:
            shape = (*(top[d] for d in didx), *spec.trailing)
            dt = spec.dtype
            if dt.is_floating_point or dt.is_complex:
                t = torch.randn(shape, generator=g, dtype=torch.float32).to(dt)
            elif dt == torch.bool:
                t = torch.randint(0, 2, shape, generator=g).bool()
            else:
                lo, hi = spec.bounds if spec.bounds is not None else (None, None)
                if lo is None or hi is None:
                    self._blind = True
                    unbounded.append(name)
                    t = torch.full(shape, spec.pad, dtype=dt)
                else:
                    t = _distinct_ints(int(lo), int(hi), shape, spec.pad, g, forced).to(dt)
                    forced += lo <= spec.pad <= hi
            data[name] = t.to(view.device)
        if unbounded and not self.warned:  # one warning per runner
            self.warned.update(unbounded)
            logger.warning(
                "padding check: integer input(s) %s have no BatchInput(bounds=(lo, hi)), so their real cells keep "
                "the pad value and only the padding of floating-point inputs is measured (not leaks through "
                "integer inputs, nor a dependence on the padded count); declare the range of their real values, "
                "e.g. bounds=(0, vocab_size - 1) for token ids or (0, num_slots - 1) for cache slots (the pad may "
                "lie outside: a scratch index)", ", ".join(repr(n) for n in unbounded))
        return data

    def _fill(self, data: Dict[str, torch.Tensor], sizes: Sizes, random_float_padding: bool = False) -> None:
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

    def _run(self, cap: Capture, fn: Callable[[], Any]) -> List[Optional[torch.Tensor]]:
        """``fn()`` eagerly, what it wrote outside itself put back; its output leaves cloned
        (``None`` for exempt ones). The output's structure is kept in ``self._spec``."""
        from graphrunner.recording.ops import OpRecorder

        guard = self._guard
        self.forwards += 1
        try:
            with OpRecorder([guard]):
                out = cap.eager(fn)
            return self._leaves(out)
        finally:
            guard.restore()

    def _leaves(self, out: Any) -> List[Optional[torch.Tensor]]:
        """The output leaves of one run, cloned (``None`` for exempt ones); the structure in ``self._spec``."""
        self._spec, leaves = flatten(out, "step output")
        skip = [_exempt(p, self.exempt) for p in leaf_paths(self._spec)]
        return [None if s else t.detach().clone() for t, s in zip(leaves, skip)]

    def _check(self, cap: Capture) -> List[Tuple[str, str, float]]:
        """``[(which comparison, output path, max abs diff)]`` of the outputs that moved."""
        data, sizes = self._data, self.sizes
        if self._blind and not self.floats:
            return []  # only integer inputs, some without bounds: nothing to vary (the warning says so)
        a = self._a
        if a is None:  # the last warmup was not run A (warmups=1)
            self._fill(data, sizes)
            a = self._run(cap, cap.forward_fn)
        spec = self._spec
        paths, dims = leaf_paths(spec), self.leaf_dims(spec, len(a))
        found = []

        def compare(kind: str, other: List[Optional[torch.Tensor]], unpadded: bool = False) -> None:
            # within a float tolerance: the kernels CPU and GPU libraries choose depend on row counts
            # (an MoE expert's rows change when padding rows become real), which moves the last bits
            for p, x, y, d in zip(paths, a, other, dims):
                if x is None or y is None:
                    continue
                diff = difference(real_cells(x, d, sizes), y if unpadded else real_cells(y, d, sizes), tolerant=True)
                if diff is not None:
                    found.append((kind, p, diff))

        if self.floats:
            self._fill(data, sizes, random_float_padding=True)
            compare("padding", self._run(cap, cap.forward_fn))
        if self._blind:
            # an integer input without bounds keeps the pad in its real cells too: real rows then
            # meet padding rows by construction, so only the floating-point padding is measured
            return self._control(cap, data, a, found, paths, dims)
        if self.sizes2 is not None:
            self._fill(data, self.sizes2)
            compare("count", self._run(cap, cap.forward_fn))
        unpadded = {name: data[name][region(sizes, didx)].clone() for name, _, didx, _ in self.inputs}
        try:
            ref = self._run(cap, lambda: self.step(**unpadded))
        except Exception as exc:  # noqa: BLE001 - a step that only runs at its keys' sizes
            logger.info("padding check of %s: the step did not run on the unpadded batch (%s: %s); compared "
                        "padded runs only", self.key_text, type(exc).__name__, exc)
        else:
            if len(ref) == len(a):
                compare("eager", ref, unpadded=True)
        return self._control(cap, data, a, found, paths, dims)

    def _control(self, cap: Capture, data: Dict[str, torch.Tensor], a: List[Optional[torch.Tensor]],
                 found: List[Tuple[str, str, float]], paths: List[str], dims: List[Tuple[int, ...]]) -> list:
        """``found`` without the outputs that also move between two identical runs (warned about)."""
        if found:
            # Control: A again. An output that moves between identical runs depends on state the
            # step keeps in Python (a counter): not a padding leak, and not checkable this way.
            self._fill(data, self.sizes)
            again = self._run(cap, cap.forward_fn)
            unstable = {p for p, x, y, d in zip(paths, a, again, dims)
                        if x is not None and y is not None and difference(x, y) is not None}
            if unstable:
                logger.warning(
                    "padding check of %s: %s changed between two identical calls (the step's output depends "
                    "on state it keeps in Python), so padding leaks into it cannot be checked; exempt it with "
                    "gr.PaddingCheck(exempt=...)", self.key_text, ", ".join(sorted(unstable)))
            found = [f for f in found if f[1] not in unstable]
        return found

    def _message(self, found: List[Tuple[str, str, float]]) -> str:
        if not found:
            return (f"padding check of {self.key_text}: another rank found padding leaking into a real "
                    "output (see its error); every rank stops the capture")
        real = ", ".join(map(str, self.sizes))
        what = {
            "padding": "when only the padding cells of the floating-point input(s) "
                       f"{[n for n, _, _ in self.floats]} were changed",
            "count": f"when the cells after the real ones held real data instead of padding (real sizes "
                     f"({', '.join(map(str, self.sizes2 or ()))}) against ({real}))",
            "eager": f"against eager PyTorch on the same real batch without padding (real sizes ({real})): the step "
                     "depends on the padded size (x.shape[0], arange, a mean or norm over the batch) or a pad value "
                     "reaches real rows" + self._pad_hint(),
        }
        parts = "; ".join(f"{p} changed (max abs diff {d:.4g}) {what[k]}" for k, p, d in found)
        first = found[0][1]
        m = re.fullmatch(r"output\[('[^']*')\]", first)
        optout = f"checks=[..., gr.PaddingCheck(exempt=({m.group(1) if m else repr(first)},))]"
        return (f"padding leaks into real results at {self.key_text}: {parts}. The graph computes the padding "
                "cells too, so at replay these outputs would include them. Make the step row-independent (e.g. "
                "reduce over the real rows only, with the count or a mask as an input; use the real count, not "
                f"the padded shape); if the output is meant to cover the whole padded batch, declare {optout}; "
                'leaving "padding" out of GraphRunner(checks=...) turns the check off.')

    def _pad_hint(self) -> str:
        shared = [f"{n} (pad {spec.pad!r})" for n, _, _, spec in self.inputs
                  if not (spec.dtype.is_floating_point or spec.dtype.is_complex) and spec.bounds is not None
                  and None not in spec.bounds and spec.bounds[0] <= spec.pad <= spec.bounds[1]]
        if not shared:
            return ""
        return (f" (integer input(s) {', '.join(shared)}: the pad is also a real value, so padding rows write or "
                "read what a real row uses; pad with a scratch index outside the real range, e.g. a dedicated "
                "cache slot, and declare bounds= as the real range)")
