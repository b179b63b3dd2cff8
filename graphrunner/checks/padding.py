"""Padding-leak check at capture: padding cells must not change real results.

A graph computes every cell of its key, padding included, so a step whose
real outputs depend on the padding (a reduction over the batch such as
``h.sum()``, a mean, a norm across rows) replays with a silently wrong
result. For every key that a smaller call can replay, :class:`LeakCheck`
runs one extra eager forward after the capture protocol's last warmup (a
capture hook's ``after_warmups``: the capture order stays in
:mod:`graphrunner.backends.base`) with the padding cells of every
floating-point input set to other values, and compares the real cells of
every output, 0-dim outputs whole, with the last warmup's. Any difference
raises :class:`~graphrunner.errors.PaddingLeakError` naming the output path
and the key.

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
from typing import Any, Callable, List, Optional, Sequence, Tuple

import torch

from graphrunner._pytree import flatten, leaf_paths
from graphrunner.backends.hooks import Capture, CaptureHook, Finding
from graphrunner.errors import PaddingLeakError
from graphrunner.keys import all_max_vector, padding_regions, region

__all__ = ["PaddingCheck", "exempt_prefixes", "check_sizes", "LeakCheck"]

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


def _real(t: torch.Tensor, didx: Tuple[int, ...], sizes: Sizes) -> torch.Tensor:
    return t if t.dim() == 0 or not didx else t[region(sizes, didx)]


def _diff(a: torch.Tensor, b: torch.Tensor) -> Optional[float]:
    """``None`` if equal (NaN equals NaN), else the max abs difference (inf for a shape change)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return math.inf
    if a.dtype.is_floating_point or a.dtype.is_complex:
        same = (a == b) | (torch.isnan(a) & torch.isnan(b))
        if bool(same.all()):
            return None
        d = (a.to(torch.complex128 if a.dtype.is_complex else torch.float64)
             - b.to(torch.complex128 if b.dtype.is_complex else torch.float64)).abs()
        return float(torch.nan_to_num(d, nan=math.inf).max())
    if torch.equal(a, b):
        return None
    return float((a.to(torch.float64) - b.to(torch.float64)).abs().max())


logger = logging.getLogger("graphrunner.checks.padding")


class LeakCheck(CaptureHook):
    """The padding-leak check of one key, as a capture hook (``after_warmups``).

    Args:
        key: the key (runner-dim tuple); ``key_text`` how messages name it.
        sizes: the real sizes (:func:`check_sizes`).
        floats: ``[(input name, static buffer, leading-dim indices)]`` of the
            floating-point inputs (their padding cells are changed).
        leaf_dims: ``leaf_dims(spec, n) ->`` leading-dim indices of each output leaf.
        exempt: leaf-path prefixes not compared (:func:`exempt_prefixes`).
        group: the rank group; with several ranks the verdict is agreed (one
            ``all_max`` of one flag), so every rank raises or none does.
        phase_key: the key as the agreement's collective names it.

    After the last warmup and its post-warmup hook: reference = the last
    warmup's real cells (``cap.last_output``), padding cells of ``floats``
    set to seeded random values, one forward (:meth:`Capture.eager`),
    padding restored, the post-warmup hook again (reset state the forward
    wrote), compare. Raises :class:`PaddingLeakError` naming every output
    path that changed (in collect mode: a ``"padding-leak"`` finding).
    """

    name = "padding"

    def __init__(self, key: Sizes, key_text: str, sizes: Sizes,
                 floats: Sequence[Tuple[str, torch.Tensor, Tuple[int, ...]]],
                 leaf_dims: Callable[[tuple, int], List[Tuple[int, ...]]],
                 exempt: Tuple[str, ...], group: Any = None, phase_key: Any = None) -> None:
        self.key, self.key_text, self.sizes = key, key_text, sizes
        self.floats = list(floats)
        self.leaf_dims = leaf_dims
        self.exempt = exempt
        self.group, self.phase_key = group, phase_key
        #: Seconds the check itself took (the extra forward and the comparison).
        self.seconds = 0.0

    def after_warmups(self, cap: Capture) -> None:
        if cap.warmups < 1:
            return
        import time

        t0 = time.perf_counter()
        found = self._check(cap)
        leaked = bool(found)
        if int(getattr(self.group, "size", 1)) > 1:
            leaked = bool(all_max_vector(self.group, [1 if found else 0], "leak_check", self.phase_key)[0])
        self.seconds = time.perf_counter() - t0
        cap.info["leak_check_sizes"] = list(self.sizes)
        cap.info["leak_check_seconds"] = self.seconds
        if leaked:
            first = found[0][0] if found else None
            cap.fail(PaddingLeakError(self._message(found)),
                     Finding("padding-leak", self._message(found), None, None, None,
                             fix=f"make the step row-independent, or exempt {first} if it is meant to cover the "
                                 "whole padded batch" if first else "see the other rank's finding"))

    def _check(self, cap: Capture) -> List[Tuple[str, float]]:
        key, sizes = self.key, self.sizes
        user_hook = cap.post_warmup_hook
        spec, leaves = flatten(cap.last_output, "step output")
        dims = self.leaf_dims(spec, len(leaves))
        paths = leaf_paths(spec)
        skip = [_exempt(p, self.exempt) for p in paths]
        ref = [None if s else _real(t, d, sizes).clone() for t, d, s in zip(leaves, dims, skip)]
        del leaves
        cap.last_output = None
        g = torch.Generator().manual_seed(0x6C65616B)
        saved = []
        try:
            for _, buf, didx in self.floats:
                for r in padding_regions(sizes, key, didx):
                    v = buf[r]
                    saved.append((v, v.clone()))
                    noise = torch.randn(v.shape, generator=g, dtype=torch.float32) * 3.0 + 1.0
                    v.copy_(noise.to(device=v.device, dtype=v.dtype))
            new = cap.eager(cap.forward_fn)
        finally:
            for v, old in saved:
                v.copy_(old)
        found = self._changed(paths, ref, new, sizes)
        del new
        if user_hook is not None:
            user_hook()
        if found:
            # Control: the same forward with the padding untouched. An output that changes
            # then too depends on state the step updates (a counter, an accumulating cache),
            # not on padding: it cannot be checked this way; say so instead of a false alarm.
            control = cap.eager(cap.forward_fn)
            unstable = {p for p, _ in self._changed(paths, ref, control, sizes)}
            del control
            if user_hook is not None:
                user_hook()
            if unstable:
                logger.warning(
                    "padding-leak check of %s: %s changed between two identical calls (the step's output depends "
                    "on state it updates), so padding leaks into it cannot be checked; reset that state in "
                    "post_warmup_hook(bucket) to have it checked, or exempt it with gr.PaddingCheck(exempt=...)",
                    self.key_text, ", ".join(sorted(unstable)))
            found = [(p, d) for p, d in found if p not in unstable]
        return found

    def _changed(self, paths: List[str], ref: List[Optional[torch.Tensor]], new: Any,
                 sizes: Sizes) -> List[Tuple[str, float]]:
        """``[(path, max abs diff)]`` of the compared outputs whose real cells in ``new`` differ from ``ref``."""
        nspec, nleaves = flatten(new, "step output")
        found = []
        for p, r, t, d in zip(paths, ref, nleaves, self.leaf_dims(nspec, len(nleaves))):
            if r is None:
                continue
            diff = _diff(r, _real(t, d, sizes))
            if diff is not None:
                found.append((p, diff))
        return found

    def _message(self, found: List[Tuple[str, float]]) -> str:
        if not found:
            return (f"padding-leak check of {self.key_text}: another rank found padding leaking into a real "
                    "output (see its error); every rank stops the capture")
        names = [n for n, _, _ in self.floats]
        what = "; ".join(f"{p} changed (max abs diff {d:.4g})" for p, d in found)
        first = found[0][0]
        m = re.fullmatch(r"output\[('[^']*')\]", first)
        optout = f"checks=[..., gr.PaddingCheck(exempt=({m.group(1) if m else repr(first)},))]"
        real = ", ".join(map(str, self.sizes))
        return (f"padding leaks into real results at {self.key_text}: {what} when only the padding cells of the "
                f"floating-point input(s) {names} were changed (real sizes ({real}), the smallest call that "
                "replays this key). The graph computes the padding cells too, so at replay these outputs would "
                "include them. Make the step row-independent (e.g. reduce over the real rows only, with the "
                "count or a mask as an input); if the output is meant to cover the whole padded batch, declare "
                f"{optout}. At capture the real cells of index inputs hold their pad value too: if the "
                "step writes state at an index (a cache slot) that the real rows then read, real and padding rows "
                "meet at the pad index only at capture; if your real indices never equal the pad, "
                "leaving \"padding\" out of GraphRunner(checks=...) turns the check off.")
