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

    f[1][j] = cost(0, j),  f[k][j] = min over k-1 <= i < j of f[k-1][i] + cost(i, j),
    cost(i, j) = sum over l in i+1..j of count_l * (v_j - v_l)

(prefix sums of the counts and of the rows make ``cost`` O(1)); the answer is
``f[min(K, m)][m]``. That list is also the optimal one with the fewest
buckets: with fewer than ``m`` buckets some size is padded, and making it a
bucket lowers the padding, so ``f[k][m]`` falls strictly with ``k`` up to ``m``.

Speed: ``cost`` satisfies the quadrangle inequality (``cost(a, c) + cost(b,
d) <= cost(a, d) + cost(b, c)`` for ``a <= b <= c <= d``: the difference is
``(v_d - v_c)`` times the calls of sizes ``a+1..b``), so in each layer ``k``
the smallest minimising ``i`` (``opt(j)``) never decreases with ``j``. Each
layer is a divide and conquer over ``j``: ``opt`` of the middle row of a range
bounds the candidates of both halves, so every level of the recursion
evaluates about ``m`` candidates, all rows of a level at once in vectorised
NumPy. Time ``O(K m log m)`` (1.2 to 1.6 s of CPU for 100,000 distinct
sizes and ``K = 64``), memory ``O(K m)`` (the back pointers, 4 bytes each).
The rows and the tie-breaking (smallest ``i``) are those of the plain
``O(K m^2)`` program, so the answer is the same list.

Exact for any sizes and counts (the key space, :class:`graphrunner.keys.KeySpace`,
takes any int >= 1 as a bucket, so there is no size to refuse): the arithmetic
is integer, in int64 when ``calls * (v_m - v_1)``, which bounds every value the
program forms, is below ``2**63`` (every real traffic: a billion calls of
sizes up to a billion), and in Python ints otherwise (about 15 times slower;
never rounded or clamped). Planning that runs past a second draws a progress
bar on a terminal's stderr (``progress=False``: never).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from graphrunner.buckets import as_int, validate_buckets
from graphrunner.progress import TaskProgress

__all__ = ["plan_buckets", "padding_of"]

Sizes = Sequence[int]

#: Seconds of planning before the progress bar appears (on a terminal only).
_PROGRESS_AFTER_S = 1.0


def _counts(observed: Any, what: str) -> Counter:
    """``observed`` (an iterable of ints >= 0) as ``Counter({size: calls})`` without zeros.

    Raises ``TypeError``/``ValueError`` naming ``what`` and the entry for a
    non-int, a bool, a negative size or no size >= 1. A list of plain ints is
    counted in one C-level pass; anything else is checked entry by entry."""
    if isinstance(observed, (str, bytes)) or isinstance(observed, Mapping) or not hasattr(observed, "__iter__"):
        raise TypeError(
            f"{what} must be a list of observed batch sizes (ints >= 0, one per call), got {type(observed).__name__}"
        )
    if isinstance(observed, torch.Tensor) or (hasattr(observed, "tolist") and hasattr(observed, "reshape")):
        observed = observed.reshape(-1).tolist()  # a tensor or a NumPy array: Python scalars
    elif not isinstance(observed, (list, tuple)):
        observed = list(observed)  # one pass over an iterator: it is read twice below
    if all(type(n) is int for n in observed):
        out = Counter(observed)
        if not out or min(out) >= 0:
            out.pop(0, None)
            return _nonempty(out, what)
    return _nonempty(_counts_checked(observed, what), what)


def _counts_checked(observed: Sequence[Any], what: str) -> Counter:
    """:func:`_counts` entry by entry: the error names the first bad entry."""
    out: Counter = Counter()
    for i, n in enumerate(observed):
        n = as_int(n, f"{what}[{i}]", "observed batch sizes must be ints")
        if n < 0:
            raise ValueError(f"{what}[{i}] is {n}; a batch size is >= 0 (0, an idle step, carries no rows)")
        if n:
            out[n] += 1
    return out


def _nonempty(counts: Counter, what: str) -> Counter:
    if not counts:
        raise ValueError(
            f"{what} holds no batch size >= 1; pass the batch size of each served call "
            "(e.g. the loadtest's per-step schedule)"
        )
    return counts


def _limit(k: Any, what: str) -> int:
    k = as_int(k, what, "it must be an int >= 1 (the most graphs to capture)")
    if k < 1:
        raise ValueError(f"{what} must be >= 1 (the most graphs to capture), got {k}")
    return k


def _numpy() -> Any:
    """NumPy (a dependency of graphrunner, imported on first use), or an ImportError saying what to install."""
    try:
        # numpy on first use (the ImportError below says what to install)
        import numpy
    except ImportError:  # pragma: no cover - numpy is a declared dependency
        raise ImportError("gr.plan_buckets needs NumPy: pip install numpy") from None
    return numpy


def _tables(sizes: list[int], calls: list[int]) -> tuple[Any, Any, Any, Any]:
    """``(U, C, S, F1)``: arrays of ``m + 1`` entries over the sorted distinct ``sizes`` (entry 0: none):
    ``U[j] = v_j - v_1`` (the cost is the same for sizes shifted by ``v_1``), ``C[j]`` the calls and
    ``S[j]`` the shifted rows of the sizes up to ``v_j``, ``F1[j] = f[1][j] = U[j] * C[j] - S[j]``.
    int64 when every value the program forms fits (see the module docstring), else Python ints."""
    np = _numpy()
    u = [0] + [s - sizes[0] for s in sizes]
    c = [0] + calls
    wide = u[-1] * sum(calls) >= 1 << 63  # bounds |every value| of the program (prefix sums, f, candidates)
    dtype = object if wide else np.int64
    U, counts = np.array(u, dtype=dtype), np.array(c, dtype=dtype)
    C, S = np.cumsum(counts), np.cumsum(counts * U)
    return U, C, S, U * C - S


def _segment_argmin(val: Any, i: Any, starts: Any, lengths: Any) -> tuple[Any, Any]:
    """For the contiguous segments ``val[starts[s]: starts[s] + lengths[s]]`` (none empty):
    ``(the least value, the candidate i of its first occurrence)`` per segment."""
    np = _numpy()
    best = np.minimum.reduceat(val, starts)
    hits = np.flatnonzero(val == np.repeat(best, lengths))
    return best, i[hits[np.searchsorted(hits, starts)]]


def _layer(f_prev: Any, tables: tuple[Any, Any, Any, Any], k: int) -> tuple[Any, Any]:
    """``(f[k], opt[k])`` from ``f[k-1]`` (arrays of ``m + 1``; rows below ``k`` are 0, unused).

    Divide and conquer over the rows ``j`` in ``k..m``, every range of one
    recursion level at once: a range ``lo..hi`` whose ``opt`` lies in
    ``olo..ohi`` evaluates its middle row over ``olo..min(ohi, mid - 1)``,
    then its halves search ``olo..opt(mid)`` and ``opt(mid)..ohi``. Ranges
    stay in row order, so the candidates of a level are one sorted array."""
    np = _numpy()
    U, C, S, F1 = tables
    m = len(U) - 1
    a = f_prev + S  # f[k-1][i] + cost(i, j) = a[i] - U[j] * C[i] + F1[j]
    f = np.zeros(m + 1, dtype=U.dtype)
    opt = np.zeros(m + 1, dtype=np.int32 if m < 1 << 31 else np.int64)
    ranges = np.array([[k], [m], [k - 1], [m - 1]], dtype=np.int64)  # rows lo, hi, olo, ohi; one range a column
    while ranges.shape[1]:
        lo, hi, olo, ohi = ranges
        mid = (lo + hi) >> 1
        lengths = np.minimum(ohi, mid - 1) - olo + 1
        starts = np.zeros_like(lengths)
        np.cumsum(lengths[:-1], out=starts[1:])
        i = np.arange(int(starts[-1] + lengths[-1])) + np.repeat(olo - starts, lengths)
        best, at = _segment_argmin(a[i] - np.repeat(U[mid], lengths) * C[i], i, starts, lengths)
        f[mid], opt[mid] = best + F1[mid], at
        ranges = _halves(ranges, mid, at)
    return f, opt


def _halves(ranges: Any, mid: Any, at: Any) -> Any:
    """The non-empty halves of every range (a column ``lo, hi, olo, ohi`` of ``ranges``), in row order:
    ``lo..mid-1`` with opt in ``olo..at`` and ``mid+1..hi`` with opt in ``at..ohi``."""
    np = _numpy()
    lo, hi, olo, ohi = ranges
    out = np.empty((4, 2 * lo.size), dtype=np.int64)
    out[:, 0::2] = lo, mid - 1, olo, at
    out[:, 1::2] = mid + 1, hi, at, ohi
    return out[:, out[0] <= out[1]]


def _plan_1d(counts: Counter, k_max: int, progress: bool = True, what: str = "observed_sizes") -> list[int]:
    """The dynamic program of the module docstring: the optimal list, of ``min(k_max, m)`` buckets.

    That is also the optimal list with the fewest buckets: below ``m``
    buckets some size is padded, and making it a bucket lowers the padding,
    so ``f[k][m]`` falls strictly with ``k`` up to ``m``."""
    sizes = sorted(counts)
    m = len(sizes)
    if k_max >= m:  # every distinct size a bucket: no padding, and no fewer buckets pad nothing
        return sizes
    tables = _tables(sizes, [counts[s] for s in sizes])
    f, opts = tables[3], []
    bar = TaskProgress(
        k_max,
        f"graphrunner plan_buckets ({what}: {m} distinct sizes)",
        unit="buckets",
        enabled=progress,
        after=_PROGRESS_AFTER_S,
    )
    try:
        for k in range(2, k_max + 1):
            f, opt = _layer(f, tables, k)
            opts.append(opt)
            bar.update(k)
    finally:
        bar.close()
    return _trace(sizes, opts, k_max)


def _trace(sizes: list[int], opts: list[Any], k: int) -> list[int]:
    """The ``k`` buckets ending at the largest size, following ``opts[kk - 2][j]`` (``opt`` of layer ``kk``)."""
    out, j = [sizes[-1]], len(sizes)
    for kk in range(k, 1, -1):
        j = int(opts[kk - 2][j])
        out.append(sizes[j - 1])
    return out[::-1]


def plan_buckets(observed_sizes: Any, max_graphs: Any, *, progress: bool = True) -> list[int] | dict[str, list[int]]:
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

    Exact for sizes and call counts of any magnitude (integer arithmetic,
    never rounded or clamped). Time ``O(K m log m)`` for ``m`` distinct sizes
    and ``K = min(max_graphs, m)``: under 2 s of CPU for 100,000 distinct sizes
    and ``max_graphs=64``. ``progress``: past a second of planning, a
    progress bar on stderr when it is a terminal (never on a log file or a
    pipe); ``False``: never.

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
            raise TypeError(
                f"observed_sizes names dims {list(observed_sizes)}: give max_graphs per dim, e.g. "
                f"{ {d: 4 for d in observed_sizes} } (the runner captures the product of the counts)"
            )
        if set(max_graphs) != set(observed_sizes):
            raise ValueError(
                f"max_graphs names dims {sorted(max_graphs)} but observed_sizes names "
                f"{sorted(observed_sizes)}; give one limit per observed dim"
            )
        out: dict[str, list[int]] = {}
        for d, sizes in observed_sizes.items():
            if not isinstance(d, str) or not d.isidentifier():
                raise ValueError(f"observed_sizes: dim name {d!r} must be an identifier such as 'reqs'")
            what = f"observed_sizes[{d!r}]"
            out[d] = _plan_1d(_counts(sizes, what), _limit(max_graphs[d], f"max_graphs[{d!r}]"), progress, what)
        return out
    if isinstance(max_graphs, Mapping):
        raise TypeError(
            "max_graphs is a dict but observed_sizes is a list: pass an int, or observed_sizes="
            "{dim: [sizes...]} to plan named dims"
        )
    return _plan_1d(_counts(observed_sizes, "observed_sizes"), _limit(max_graphs, "max_graphs"), progress)


def padding_of(observed_sizes: Any, buckets: Sequence[int]) -> dict[str, Any]:
    """What ``buckets`` (a strictly increasing list) do to ``observed_sizes`` (as in :func:`plan_buckets`).

    Returns ``{"graphs", "calls", "real_rows", "padded_rows", "padded_fraction",
    "eager_calls"}``: ``padded_rows`` is the sum of ``bucket(n) - n`` over the
    calls that replay, ``padded_fraction`` = padded rows / rows computed by
    replays (0.0 when none), ``eager_calls`` the calls above the largest bucket
    (the eager fallback, no padding). ``TypeError``/``ValueError`` naming the
    argument for invalid input."""

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
    return {
        "graphs": len(bl),
        "calls": sum(counts.values()),
        "real_rows": real,
        "padded_rows": padded,
        "padded_fraction": padded / replayed_rows if replayed_rows else 0.0,
        "eager_calls": eager,
    }
