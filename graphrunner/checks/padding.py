"""Padding-leak check at capture: padding cells must not change real results, now or later.

A graph computes every cell of its key, padding included, and runs every write
of the padding rows, so a step whose real outputs depend on the padding (a
reduction over the batch such as ``h.sum()``, a mean, a norm across rows, a
padding row that wins a max) replays a silently wrong result, and a step whose
padding rows write state (a KV cache, a recurrent state) where a real request
reads later replays right for the padded call and wrong for that request's
next one. For every key that a smaller call can replay, :class:`~graphrunner.checks.leak_check.LeakCheck`
runs the step eagerly on seeded random real cells with the padding at its pad
value (run A: the protocol's one but last warmup, through the capture hook's
``before_warmup``/``after_warmup``), then, at ``after_warmups`` (the capture
order stays in :mod:`graphrunner.backends.base`), with the float padding
changed and without padding, and compares the real cells of every output, 0-dim
outputs whole, with run A's; and it runs call sequences: a follow-up call
after the padded call against the same follow-up after the unpadded one (see
:class:`~graphrunner.checks.leak_check.LeakCheck`). Equal means within :func:`~graphrunner.checks.tolerance.difference`'s tolerance, which
admits last-bit noise only (:func:`~graphrunner.checks.tolerance.admitted`). Any difference raises
:class:`~graphrunner.errors.PaddingLeakError` naming the output path and the
key, for a sequence the input whose pad did it and the cells the padding rows
wrote.

- Real sizes: per dim, the smallest size that still replays the key (on a
  full grid the dim's previous bucket + 1; ``max_padding_ratio`` and
  ``keys=`` are taken into account), see :func:`check_sizes`. A key no smaller call
  maps to (the smallest bucket) is not checked.
- Integer, bool and complex inputs keep their pad value in the padding cells:
  it must stay a safe index. Integer inputs without bounds keep it in the real
  cells too: a step whose only inputs are such indices cannot be checked.
- Opt out per output with ``GraphRunner(checks=["drift", gr.PaddingCheck(exempt=("total",)),
  "fingerprint"])`` (an output meant to read the whole padded batch; its
  slicing by ``outputs=`` is unchanged), per runner by leaving ``"padding"``
  out of ``checks=``.

The check in modules (none knows about graphs; the runner builds one check per key from its
:class:`PaddingCheck`, the configuration in ``checks=``):

- here: the configuration (:class:`PaddingCheck`, :func:`exempt_prefixes`) and the real sizes
  a key is checked at (:func:`check_sizes`, :func:`second_sizes`, :func:`real_cells`);
- :mod:`graphrunner.checks.leak_check`: :class:`~graphrunner.checks.leak_check.LeakCheck`, the
  capture hook (its phases and comparisons); :mod:`graphrunner.checks.leak_runs`: one check's
  runs and their seeded data; :mod:`graphrunner.checks.leak_messages`: what its errors say;
- :mod:`graphrunner.checks.tolerance`: :func:`~graphrunner.checks.tolerance.difference` and
  :func:`~graphrunner.checks.tolerance.admitted`; :mod:`graphrunner.checks.op_work`: the
  matmul work that scales the tolerance; :mod:`graphrunner.checks.written_cells`: what a run
  wrote, cell by cell; :mod:`graphrunner.checks.step_objects`: what the step reaches (its
  Python numbers, the tensors it holds).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from graphrunner.keys import region

if TYPE_CHECKING:
    from graphrunner.keys import KeySpace

__all__ = [
    "PaddingCheck",
    "PerRunner",
    "FollowValues",
    "exempt_prefixes",
    "is_exempt",
    "check_sizes",
    "second_sizes",
    "real_cells",
]

Sizes = tuple[int, ...]


class PaddingCheck:
    """The padding-leak check as configured in ``GraphRunner(checks=[...])`` (``"padding"`` is
    ``PaddingCheck()``).

    ``exempt``: outputs the check does not compare, meant to read the whole
    padded batch: dict output keys (``("total",)``) or output paths as the
    error spells them (``"output[1]"``). Raises ``TypeError`` for anything
    but a string or a sequence of them.
    """

    name = "padding"

    def __init__(self, exempt: str | Sequence[str] = ()) -> None:
        self.exempt = exempt_prefixes(exempt)
        #: Integer inputs already warned about (no bounds): one warning per runner; it also carries
        #: the follow-up values the runner's keys have drawn (:class:`PerRunner`).
        self.warned = PerRunner()

    def __repr__(self) -> str:
        return f"PaddingCheck(exempt={self.exempt!r})"


class PerRunner(set[str]):
    """What the padding checks of one runner's keys share: the names of the integer inputs already
    warned about (the set), and per integer input the follow-up values drawn so far
    (:attr:`follow`: ``name -> (permutation of its real values but the pad, next offset)``), so the
    keys' follow-ups use each value of a small range once before any repeats."""

    def __init__(self) -> None:
        super().__init__()
        self.follow: dict[str, FollowValues] = {}


@dataclass
class FollowValues:
    """One integer input's follow-up values across a runner's keys: a permutation of its real values
    but the pad (``perm``), and where the next key's follow-up continues in it (``offset``)."""

    perm: torch.Tensor
    offset: int = 0


def exempt_prefixes(exempt: str | Sequence[str]) -> tuple[str, ...]:
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
        raise TypeError(
            f"PaddingCheck(exempt=...) must be a tuple of output names such as ('total',), got {exempt!r}"
        ) from None
    out: list[str] = []
    for e in items:
        if not isinstance(e, str) or not e:
            raise TypeError(
                f"PaddingCheck(exempt=...) entries must be dict output keys or output paths (strings), got {e!r}"
            )
        out.append(e if e == "output" or e.startswith("output[") or e.startswith("output.") else f"output[{e!r}]")
    return tuple(out)


def is_exempt(path: str, prefixes: tuple[str, ...]) -> bool:
    """Whether output leaf ``path`` is one of ``prefixes`` (:func:`exempt_prefixes`) or inside one."""
    return any(path == p or path.startswith(p + "[") or path.startswith(p + ".") for p in prefixes)


def check_sizes(space: KeySpace, key: Sizes) -> Sizes | None:
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
            trial = tuple(sizes[:j] + [n] + sizes[j + 1 :])
            if space.choose(trial)[0] == key:
                sizes[j] = n
                break
    return None if tuple(sizes) == key else tuple(sizes)


def second_sizes(space: KeySpace, key: Sizes, sizes: Sizes) -> Sizes | None:
    """Real sizes between ``sizes`` (:func:`check_sizes`) and ``key`` that still pad and still
    replay ``key`` (``key - 1`` in every dim that pads), or ``None`` when there are none: the
    padding check's second real size, so that the padded count varies."""
    s2 = tuple(max(s, k - 1) for s, k in zip(sizes, key))
    if s2 == tuple(sizes) or s2 == tuple(key) or space.choose(s2)[0] != tuple(key):
        return None
    return s2


def real_cells(t: torch.Tensor, didx: tuple[int, ...], sizes: Sizes) -> torch.Tensor:
    """The real cells ``sizes`` of output leaf ``t`` on its leading dims ``didx`` (a 0-dim leaf whole)."""
    return t if t.dim() == 0 or not didx else t[region(sizes, didx)]
