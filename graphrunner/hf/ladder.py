"""Keys for a server that has seen no step yet, and when to re-plan them from the steps it has seen.

A server cannot run a dry run of its workload first (``gr.hf.generate_batch``
does): its keys start from a *ladder*, a few sizes per dim from 1 up to what
the configured cache and batch allow, and are re-planned by
:func:`graphrunner.plan_buckets` from the sizes of the steps served once that
would cut the padding the graphs compute (:func:`replan`). Pure functions of
sizes: :class:`graphrunner.hf.batching.GraphBatching` applies them, :mod:`graphrunner.hf.planning` (its
neighbour) plans the keys of a dry run's workload.
"""

from __future__ import annotations

import collections
import itertools
import math
from collections.abc import Sequence

from graphrunner.hf.planning import dim_limits, plan_keys

__all__ = [
    "LADDER_GRAPHS",
    "REPLAN_GAIN",
    "REPLAN_SHARE",
    "WEIGHTS",
    "ladder",
    "ladder_keys",
    "padding",
    "replan",
]

#: Sizes per dim of the starting ladder (a keys dim not named takes ``kv``'s).
LADDER_GRAPHS = {"tokens": 5, "kv": 4, "reqs": 3}

#: A re-plan is taken when its keys compute at most this share of the current keys' padding.
REPLAN_GAIN = 0.6

#: The share of the serving time a server's background captures (the ladder's, then each re-plan's) may
#: take: a re-plan starts no sooner than :func:`graphrunner.pacing.rest_after` the last capture ended.
REPLAN_SHARE = 0.1

Sizes = tuple[int, ...]


def ladder(top: int, count: int, low: int = 1) -> list[int]:
    """Up to ``count`` sizes from ``low`` to ``top`` (both included when ``count >= 2``): powers of two
    between them, thinned evenly when there are more, and ``top`` itself. Raises ``ValueError`` for
    ``top < 1`` or ``count < 1``."""
    top, low, count = int(top), max(1, int(low)), int(count)
    if top < 1 or count < 1:
        raise ValueError(f"a ladder needs top >= 1 and count >= 1, got top={top}, count={count}")
    low = min(low, top)
    steps = sorted({low} | {1 << i for i in range(top.bit_length()) if low < (1 << i) < top} | {top})
    if len(steps) <= count:
        return steps
    if count == 1:
        return [top]
    picked = {steps[int(i * (len(steps) - 1) / (count - 1) + 0.5)] for i in range(count)}
    return sorted(picked)


def ladder_keys(
    maxima: dict[str, int], dims: Sequence[str], counts: dict[str, int] | None = None
) -> tuple[dict[str, list[int]], list[Sizes]]:
    """``(buckets, keys)`` of the starting ladder: :func:`ladder` per dim up to ``maxima[dim]`` with
    ``counts[dim]`` sizes (default :data:`LADDER_GRAPHS`; a keys dim ``kv_*`` falls back on ``kv``),
    and every key a step can land on: no more requests than tokens (a request has a token in the
    step) and, for the keys dims, at least as many keys as the smallest ladder size of tokens. The
    ``dims`` are ``("tokens", <keys dims>..., "reqs")``."""
    per_dim = dim_limits(dims, counts, LADDER_GRAPHS)
    buckets: dict[str, list[int]] = {}
    for d in dims:
        n = per_dim[d]
        low = 16 if d.startswith("kv") else 1
        top = min(int(maxima[d]), int(maxima[dims[0]])) if d == dims[-1] else int(maxima[d])  # reqs <= tokens
        buckets[d] = ladder(top, n, low)
    keys = [k for k in itertools.product(*(buckets[d] for d in dims)) if k[-1] <= k[0]]
    return buckets, sorted(keys)


def padding(sizes: Sequence[Sizes], keys: Sequence[Sizes], weigh: str = "cells") -> tuple[int, int]:
    """``(padding, steps no key covers)`` of serving ``sizes`` on ``keys``: each step lands on the key the
    runner chooses (the covering key of the smallest product); its padding is, by ``weigh``:

    - ``"cells"``: that key's cells (the product of its sizes but ``reqs``: tokens x keys) minus the
      step's: what a dense ``[tokens, kv]`` attention computes for padding;
    - ``"tokens"``: that key's query tokens minus the step's: what a step whose attention skips padding
      keys (the per-request attention, :mod:`graphrunner.hf.attention`) computes for padding
      (its projections and MLP run per token; a padding key only costs its gather)."""
    if weigh not in WEIGHTS:
        raise ValueError(f"weigh must be one of {sorted(WEIGHTS)}, got {weigh!r}")
    size = WEIGHTS[weigh]
    pad, missed = 0, 0
    ordered = sorted((tuple(k) for k in keys), key=lambda k: (math.prod(k), k))  # as the runner chooses
    for s, n in collections.Counter(tuple(s) for s in sizes).items():  # a server's steps repeat their sizes
        for k in ordered:
            if all(a >= b for a, b in zip(k, s)):
                pad += n * (size(k) - size(s))
                break
        else:
            missed += n
    return pad, missed


def _cells(key: Sizes) -> int:
    return math.prod(int(v) for v in key[:-1])


def _tokens(key: Sizes) -> int:
    return int(key[0])


#: What :func:`padding` counts, by its ``weigh`` argument.
WEIGHTS = {"cells": _cells, "tokens": _tokens}


def replan(
    sizes: Sequence[Sizes],
    keys: Sequence[Sizes],
    dims: Sequence[str],
    max_graphs: dict[str, int] | None = None,
    gain: float = REPLAN_GAIN,
    weigh: str = "cells",
) -> tuple[dict[str, list[int]], list[Sizes]] | None:
    """New ``(buckets, keys)`` for the steps ``sizes`` served so far on ``keys``, or ``None`` when they
    would not cut the padding (:func:`padding` by ``weigh``) to ``gain`` of today's or would leave a step uncovered
    that today's keys cover. The plan is :func:`graphrunner.hf.planning.plan_keys` over ``sizes``
    with ``max_graphs`` sizes per dim (default :data:`LADDER_GRAPHS`, as many as the ladder: a re-plan
    captures about as many keys as the ladder did), plus the key of today's largest size in every dim, so a step larger than every step seen still
    replays."""
    if not sizes or not keys:
        return None
    buckets, planned = plan_keys(sizes, dim_limits(dims, max_graphs, LADDER_GRAPHS), dims)
    chosen = set(planned) | {tuple(max(int(k[i]) for k in keys) for i in range(len(dims)))}
    chosen.add(tuple(max(k[i] for k in chosen) for i in range(len(dims))))  # the key covering every other one
    new = sorted(chosen)
    buckets = {d: sorted({int(k[i]) for k in new}) for i, d in enumerate(dims)}
    old_pad, old_missed = padding(sizes, keys, weigh)
    new_pad, new_missed = padding(sizes, new, weigh)
    if new_missed > old_missed or sorted(new) == sorted(tuple(k) for k in keys):
        return None
    if old_pad == 0 or new_pad > gain * old_pad:
        return None
    return buckets, new
