"""What the padding check's errors say: the output, the comparison, the cause, what to do.

:func:`leak_message` and :func:`leak_fix` word a finding of
:class:`~graphrunner.checks.leak_check.LeakCheck` from its :class:`LeakSubject` (the key and
the inputs) and, for a call sequence, its :class:`SequenceCause`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from graphrunner.checks.padding import Sizes

if TYPE_CHECKING:
    from graphrunner.inputs import BatchInput

__all__ = ["Found", "LeakSubject", "SequenceCause", "leak_fix", "leak_message"]

#: ``[(which comparison, output path, max abs diff)]`` of the outputs that moved.
Found = list[tuple[str, str, float]]


@dataclass(frozen=True)
class LeakSubject:
    """What a message names: the key, its real sizes (``sizes2``: the larger ones or ``None``),
    the floating-point inputs' names, and the integer inputs whose pad is also a real value."""

    key_text: str
    sizes: Sizes
    sizes2: Sizes | None
    floats: list[str]
    shared: list[tuple[str, BatchInput]]


@dataclass(frozen=True)
class SequenceCause:
    """What a call-sequence finding needs to name its cause: the follow-up's ``rows`` that
    changed; the integer ``inputs`` whose pad they hold (``(name, BatchInput, rows)``); whether
    the ``earlier`` padded call did it (its padding rows' writes) rather than the follow-up's own
    padding; the cells the padding rows wrote, ``named`` (``"SlotState.state[0, :]"``). The
    defaults: not explained (another rank's finding)."""

    rows: list[int] = field(default_factory=list)
    inputs: list[tuple[str, BatchInput, list[int]]] = field(default_factory=list)
    earlier: bool = True
    named: list[str] = field(default_factory=list)


def leak_message(s: LeakSubject, found: Found, cause: SequenceCause) -> str:
    """The :class:`~graphrunner.errors.PaddingLeakError` of ``found`` (empty: another rank's finding)."""
    if not found:
        return (
            f"padding check of {s.key_text}: another rank found padding leaking into a real "
            "output (see its error); every rank stops the capture"
        )
    real = ", ".join(map(str, s.sizes))
    what = {
        "padding": f"when only the padding cells of the floating-point input(s) {list(s.floats)} were changed",
        "count": f"when the cells after the real ones held real data instead of padding (real sizes "
        f"({', '.join(map(str, s.sizes2 or ()))}) against ({real}))",
        "eager": f"against eager PyTorch on the same real batch without padding (real sizes ({real})): the step "
        "depends on the padded size (x.shape[0], arange, a mean or norm over the batch) or a pad value "
        "reaches real rows (a padding row's value wins a max or a sort over the batch)" + _pad_hint(s),
        "sequence": _sequence_text(s, cause),
    }
    single = [f for f in found if f[0] != "sequence"]
    parts = "; ".join(f"{p} changed (max abs diff {d:.4g}) {what[k]}" for k, p, d in found)
    if not single:
        return (
            f"padding leaks into real results at {s.key_text}: {parts}. The graph computes the padding "
            "rows too, their writes included, and a call replays with whatever they left behind. "
            + _sequence_fix(s, cause)
            + '; leaving "padding" out of GraphRunner(checks=...) turns the check off.'
        )
    first = single[0][1]
    m = re.fullmatch(r"output\[('[^']*')\]", first)
    optout = f"checks=[..., gr.PaddingCheck(exempt=({m.group(1) if m else repr(first)},))]"
    return (
        f"padding leaks into real results at {s.key_text}: {parts}. The graph computes the padding "
        "cells too, so at replay these outputs would include them. Make the step row-independent (e.g. "
        "reduce over the real rows only, with the count or a mask as an input; use the real count, not "
        f"the padded shape); if the output is meant to cover the whole padded batch, declare {optout}; "
        'leaving "padding" out of GraphRunner(checks=...) turns the check off.'
    )


def leak_fix(s: LeakSubject, found: Found, cause: SequenceCause) -> str:
    """The finding's ``fix`` for ``found``."""
    single = [f for f in found if f[0] != "sequence"]
    if not found:
        return "see the other rank's finding"
    if not single:
        return _sequence_fix(s, cause)
    return f"make the step row-independent, or exempt {single[0][1]} if it is meant to cover the whole padded batch"


def _sequence_text(s: LeakSubject, cause: SequenceCause) -> str:
    real = ", ".join(map(str, s.sizes))
    rows = cause.rows
    shown = ", ".join(map(str, rows[:6])) + (", ..." if len(rows) > 6 else "")
    if cause.earlier:
        head = (
            "in a call after a padded call, against the same call after the same first call without "
            f"padding (real sizes ({real}) in both)"
        )
    else:
        head = (
            "in a padded call where a real row holds the pad value, against the same call without "
            f"padding (real sizes ({real}))"
        )
    text = f"{head}: rows [{shown}] of that call changed" if rows else head
    ins = cause.inputs
    if ins:
        text += "; they hold the pad of integer input(s) " + ", ".join(
            f"{n} (pad {spec.pad!r}, also a real value: bounds {tuple(spec.bounds or ())})" for n, spec, _ in ins
        )
    named = cause.named
    if named:
        text += (
            "; the padding rows wrote "
            + ", ".join(named[:3])
            + (", ..." if len(named) > 3 else "")
            + ", which a real request reads later"
        )
    elif cause.earlier:
        text += "; the padding rows wrote state that a later real request reads"
    else:
        text += "; within that call the padding rows overwrote what the real row at the pad index wrote or read"
    return text


def _sequence_fix(s: LeakSubject, cause: SequenceCause) -> str:
    ins = cause.inputs or [(n, spec, []) for n, spec in s.shared]
    if ins:
        names = ", ".join(repr(n) for n, _, _ in ins)
        return (
            f"Pad {names} with a scratch index outside the real range (e.g. a dedicated cache slot no "
            f"request owns: one more slot, pad=num_slots, bounds=(0, num_slots - 1)), so that padding rows "
            "only write where no real request reads"
        )
    return (
        "Make padding rows write only where no real request reads (a scratch slot outside the real range "
        "as their pad, or a mask that skips their writes)"
    )


def _pad_hint(s: LeakSubject) -> str:
    shared = [f"{n} (pad {spec.pad!r})" for n, spec in s.shared]
    if not shared:
        return ""
    return (
        f" (integer input(s) {', '.join(shared)}: the pad is also a real value, so padding rows write or "
        "read what a real row uses, or win against it; pad with a scratch index outside the real range, "
        "e.g. a dedicated cache slot, and declare bounds= as the real range)"
    )
