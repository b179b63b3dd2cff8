"""Buckets planned from traffic: :func:`plan_buckets` and :func:`padding_of`.

Every engine ships a fixed ladder of capture sizes (vLLM: 1, 2, 4, then
multiples of 8, then of 16: :func:`graphrunner.default_buckets`). Each padded
row is computed for nothing and each graph costs capture time and memory; the
best ladder for a given number of graphs depends on the batch sizes the engine
actually serves. :func:`plan_buckets` finds it exactly.

The problem: observed batch sizes ``n_1..n_N`` (a call of ``n`` rows replays
the smallest bucket ``b >= n`` and computes ``b - n`` padding rows); choose at
most ``K`` buckets, the largest observed size among them (so every observed
call replays), minimising the total padding ``sum(b(n_i) - n_i)``, i.e. the
expected padded rows per call under the observed distribution. Some optimal
list uses observed sizes only (lowering a bucket to the largest observed size
below it never adds padding), so with the ``m`` distinct sizes ``v_1 < ... <
v_m`` and their counts, ``f[k][j]`` = the least padding of the sizes up to
``v_j`` with ``k`` buckets, the last at ``v_j``, satisfies

    f[1][j] = cost(1, j),  f[k][j] = min over i < j of f[k-1][i] + cost(i+1, j),
    cost(i, j) = sum over l in i..j of count_l * (v_j - v_l)

(prefix sums make ``cost`` O(1)); the answer is ``f[min(K, m)][m]``. Time
``O(K m^2)`` in vectorised integer arithmetic (exact, no rounding), ``O(K m)``
memory: a few milliseconds for a few hundred distinct sizes.
"""

from __future__ import annotations

from collections import Counter
from typing import Any, Dict, List, Mapping, Sequence, Union

import torch

from graphrunner.buckets import as_int

__all__ = ["plan_buckets", "padding_of"]

Sizes = Sequence[int]


def _counts(observed: Any, what: str) -> Counter:
    """``observed`` (an iterable of ints >= 0) as ``Counter({size: calls})`` without zeros."""
    if isinstance(observed, (str, bytes)) or isinstance(observed, Mapping) or not hasattr(observed, "__iter__"):
        raise TypeError(f"{what} must be a list of observed batch sizes (ints >= 0, one per call), "
                        f"got {type(observed).__name__}")
    if isinstance(observed, torch.Tensor):
        observed = observed.reshape(-1).tolist()
    out: Counter = Counter()
    for i, n in enumerate(observed):
        n = as_int(n, f"{what}[{i}]", "observed batch sizes must be ints")
        if n < 0:
            raise ValueError(f"{what}[{i}] is {n}; a batch size is >= 0 (0, an idle step, carries no rows)")
        if n:
            out[n] += 1
    if not out:
        raise ValueError(f"{what} holds no batch size >= 1; pass the batch size of each served call "
                         "(e.g. the loadtest's per-step schedule)")
    return out


def _limit(k: Any, what: str) -> int:
    k = as_int(k, what, "it must be an int >= 1 (the most graphs to capture)")
    if k < 1:
        raise ValueError(f"{what} must be >= 1 (the most graphs to capture), got {k}")
    return k


#: Cells of one block of the cost matrix (bounds the planner's memory: 8 bytes each, a few of them live).
_BLOCK = 1 << 22


def _plan_1d(counts: Counter, k_max: int) -> List[int]:
    """The exact dynamic program of the module docstring; the fewest buckets among the optimal lists."""
    sizes = sorted(counts)
    m = len(sizes)
    k_max = min(k_max, m)
    v = torch.tensor(sizes, dtype=torch.int64)
    c = torch.tensor([counts[s] for s in sizes], dtype=torch.int64)
    zero = torch.zeros(1, dtype=torch.int64)
    C = torch.cat([zero, c.cumsum(0)])        # C[j]: calls with the first j sizes
    S = torch.cat([zero, (c * v).cumsum(0)])  # S[j]: their rows
    vj = torch.cat([zero, v])                  # vj[j] = v[j-1], the bucket that ends at size j
    inf = torch.iinfo(torch.int64).max // 4
    rows = torch.arange(m + 1)
    f = vj * C - S                             # k = 1: one bucket at v[j-1] covers sizes 0..j-1
    f[0] = inf
    best, back = [int(f[m])], []
    width = max(1, _BLOCK // (m + 1))
    starts = range(0, m + 1, width)

    def block(j0: int) -> torch.Tensor:
        """cost(i, j) for every i and the columns j0.. of one block (inf where i >= j)."""
        cols = torch.arange(j0, min(m + 1, j0 + width))
        cost = vj[cols][None, :] * (C[cols][None, :] - C[:, None]) - (S[cols][None, :] - S[:, None])
        return cost.masked_fill_(rows[:, None] >= cols[None, :], inf)

    kept = [block(j0) for j0 in starts] if len(starts) <= 4 else None  # small problems: computed once
    for _ in range(2, k_max + 1):
        g = torch.empty_like(f)
        arg = torch.empty(m + 1, dtype=torch.int64)
        for n, j0 in enumerate(starts):       # f[i] + cost(i, j): the previous bucket ends at size i
            cost = kept[n] if kept is not None else block(j0)
            g[j0:j0 + cost.shape[1]], arg[j0:j0 + cost.shape[1]] = (f[:, None] + cost).min(0)  # smallest i on ties
        f = g.clamp_(max=inf)
        back.append(arg)
        best.append(int(f[m]))
    k = 1 + min(range(len(best)), key=lambda i: (best[i], i))  # fewest buckets at the least padding
    out, j = [sizes[m - 1]], m
    for kk in range(k, 1, -1):
        j = int(back[kk - 2][j])
        out.append(sizes[j - 1])
    return sorted(out)


def plan_buckets(observed_sizes: Any, max_graphs: Any) -> Union[List[int], Dict[str, List[int]]]:
    """The bucket list with the fewest padded rows over ``observed_sizes`` for at most ``max_graphs`` graphs.

    ``observed_sizes``: the batch size of every served call (a list, tuple,
    tensor or any iterable of ints; repeats are the distribution: a size seen
    twice as often weighs twice as much; 0, an idle step, is ignored).
    ``max_graphs``: an int >= 1. Returns a strictly increasing list of at most
    ``max_graphs`` buckets, all observed sizes, the largest observed size last
    (every observed call replays; larger calls take the eager fallback),
    minimising the total padding ``sum(bucket(n) - n)`` over the observations
    (equivalently the expected padded rows per call), found by an exact
    dynamic program (see :mod:`graphrunner.planning`); among optimal lists the
    one with the fewest buckets (with ``max_graphs`` >= the number of distinct
    sizes: every distinct size, no padding). Pass it as ``GraphRunner(buckets=...)``.

    Named dims: ``observed_sizes={dim: [sizes...]}`` and ``max_graphs={dim:
    K}`` plan each dim on its own and return ``{dim: [buckets...]}`` for
    ``GraphRunner(buckets=...)`` (the runner captures every combination: the
    product of the ``K``'s graphs). Each dim's padded rows are minimised
    separately, not the padded cells of their product.

    Raises ``TypeError``/``ValueError`` naming the argument (and the entry) for
    anything else: a size that is not an int or is negative, no size >= 1, a
    ``max_graphs`` below 1, dims that differ between the two dicts.

    >>> plan_buckets([1, 1, 1, 3, 7, 8, 8], max_graphs=2)
    [1, 8]
    """
    if isinstance(observed_sizes, Mapping):
        if not observed_sizes:
            raise ValueError("observed_sizes is an empty dict; pass {dim: [sizes...]} or a list of sizes")
        if not isinstance(max_graphs, Mapping):
            raise TypeError(f"observed_sizes names dims {list(observed_sizes)}: give max_graphs per dim, e.g. "
                            f"{ {d: 4 for d in observed_sizes} } (the runner captures the product of the counts)")
        if set(max_graphs) != set(observed_sizes):
            raise ValueError(f"max_graphs names dims {sorted(max_graphs)} but observed_sizes names "
                             f"{sorted(observed_sizes)}; give one limit per observed dim")
        out: Dict[str, List[int]] = {}
        for d, sizes in observed_sizes.items():
            if not isinstance(d, str) or not d.isidentifier():
                raise ValueError(f"observed_sizes: dim name {d!r} must be an identifier such as 'reqs'")
            out[d] = _plan_1d(_counts(sizes, f"observed_sizes[{d!r}]"), _limit(max_graphs[d], f"max_graphs[{d!r}]"))
        return out
    if isinstance(max_graphs, Mapping):
        raise TypeError("max_graphs is a dict but observed_sizes is a list: pass an int, or observed_sizes="
                        "{dim: [sizes...]} to plan named dims")
    return _plan_1d(_counts(observed_sizes, "observed_sizes"), _limit(max_graphs, "max_graphs"))


def padding_of(observed_sizes: Any, buckets: Sequence[int]) -> Dict[str, Any]:
    """What ``buckets`` (a strictly increasing list) do to ``observed_sizes`` (as in :func:`plan_buckets`).

    Returns ``{"graphs", "calls", "real_rows", "padded_rows", "padded_fraction",
    "eager_calls"}``: ``padded_rows`` is the sum of ``bucket(n) - n`` over the
    calls that replay, ``padded_fraction`` = padded rows / rows computed by
    replays (0.0 when none), ``eager_calls`` the calls above the largest bucket
    (the eager fallback, no padding). ``TypeError``/``ValueError`` naming the
    argument for invalid input."""
    from graphrunner.buckets import validate_buckets

    counts = _counts(observed_sizes, "observed_sizes")
    bl = validate_buckets(buckets)
    padded = replayed_rows = eager = real = 0
    j = 0
    for n in sorted(counts):
        c = counts[n]
        real += c * n
        while j < len(bl) and bl[j] < n:
            j += 1
        if j == len(bl):
            eager += c
            continue
        padded += c * (bl[j] - n)
        replayed_rows += c * bl[j]
    return {"graphs": len(bl), "calls": sum(counts.values()), "real_rows": real, "padded_rows": padded,
            "padded_fraction": padded / replayed_rows if replayed_rows else 0.0, "eager_calls": eager}
