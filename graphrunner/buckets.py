"""Batch-size buckets: validation, the default ladder and the O(1) lookup table.

A *bucket* is a padded batch size the runner captures a graph for. A call
with ``n`` real rows replays the smallest bucket ``>= n`` with ``bucket - n``
padding rows.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Iterable, Sequence
from typing import Any

__all__ = ["default_buckets", "validate_buckets", "bucket_table"]


#: The largest ``max_batch`` :func:`default_buckets` takes: its ladder then holds 1,048,594
#: buckets (a graph each). Above it the list alone would take gigabytes (``10**12``: a
#: ``MemoryError``); no engine captures that many graphs.
MAX_LADDER_BATCH = 1 << 24


def default_buckets(max_batch: int) -> list[int]:
    """Return the default bucket ladder up to ``max_batch`` (inclusive).

    vLLM's current default capture sizes: ``[1, 2, 4]``, then every multiple
    of 8 below 256, then every multiple of 16 from 256 up to ``max_batch``
    (``VllmConfig._set_cudagraph_sizes`` in ``vllm/config/vllm.py``, vLLM's
    main branch since ``compilation_config.max_cudagraph_capture_size``, late
    2025). One difference: ``max_batch`` itself is appended when it is not on
    the ladder (vLLM truncates to the ladder's last size instead), so a batch
    of ``max_batch`` always replays. A call pays at most 7 padding rows below
    256 and 15 above; ``default_buckets(512)`` has 51 buckets (an 8-step
    ladder has 67). ``default_buckets(1) == [1]``;
    ``default_buckets(6) == [1, 2, 4, 6]``; ``default_buckets(300) == [1, 2,
    4, 8, ..., 248, 256, 272, 288, 300]``. Raises ``ValueError`` for
    ``max_batch < 1`` and above :data:`MAX_LADDER_BATCH` (``2**24``).
    """
    try:
        max_batch = operator.index(max_batch)
    except TypeError:
        raise TypeError(f"default_buckets(max_batch) expects an int, got {type(max_batch).__name__}") from None
    if max_batch < 1:
        raise ValueError(f"default_buckets(max_batch): max_batch must be >= 1, got {max_batch}")
    if max_batch > MAX_LADDER_BATCH:
        raise ValueError(
            f"default_buckets(max_batch): max_batch={max_batch:,} is above {MAX_LADDER_BATCH:,}: the "
            f"ladder would hold about {max_batch // 16:,} buckets, one graph each. Pass the largest batch "
            "you serve, or list the buckets you need (gr.plan_buckets plans them from traffic)"
        )
    ladder = [b for b in (1, 2, 4) if b <= max_batch] + list(range(8, min(max_batch + 1, 256), 8))
    ladder += list(range(256, max_batch + 1, 16))
    if ladder[-1] != max_batch:
        ladder.append(max_batch)
    return ladder


def as_int(value: Any, what: str, expected: str) -> int:
    """``value`` as an int (``operator.index``); a bool or a non-integer is a ``TypeError``
    ``"{what} is a {type} ({value!r}); {expected}"``. Shared by every size a user passes
    (buckets, observed batch sizes, graph counts)."""
    if isinstance(value, bool):
        raise TypeError(f"{what} is a bool ({value!r}); {expected}")
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{what} is a {type(value).__name__} ({value!r}); {expected}") from None


def validate_buckets(buckets: Iterable[int]) -> list[int]:
    """Return ``buckets`` as a list of ints, or raise a clear error.

    Buckets must be a non-empty, strictly increasing sequence of positive
    ints (no duplicates, no bools). ``TypeError`` for non-int entries,
    ``ValueError`` for everything else; the message names the offending
    entry and what to pass instead (e.g. ``gr.default_buckets(max_batch)``).
    """
    if isinstance(buckets, (str, bytes)) or not hasattr(buckets, "__iter__"):
        raise TypeError(f"buckets must be a list of ints such as [1, 2, 4, 8], got {type(buckets).__name__}")
    out: list[int] = []
    for i, b in enumerate(buckets):
        b = as_int(b, f"buckets[{i}]", "buckets must be ints")
        if b <= 0:
            raise ValueError(f"buckets[{i}] is {b}; every bucket must be a batch size >= 1")
        out.append(b)
    if not out:
        raise ValueError("buckets is empty; pass at least one batch size, e.g. gr.default_buckets(max_batch)")
    for i in range(1, len(out)):
        if out[i] == out[i - 1]:
            raise ValueError(
                f"buckets has the duplicate {out[i]} (positions {i - 1} and {i}); list each batch size once"
            )
        if out[i] < out[i - 1]:
            raise ValueError(
                f"buckets must be sorted in increasing order: {out[i - 1]} at position {i - 1} comes before "
                f"{out[i]}; pass sorted(buckets)"
            )
    return out


def bucket_table(buckets: Sequence[int], max_padding_ratio: float | None) -> list[int | None]:
    """Return ``table`` with ``table[n]`` = the bucket a batch of ``n`` rows replays.

    ``table[n]`` is the smallest bucket ``>= n``, or ``None`` when padding to
    it would exceed ``max_padding_ratio`` (padding rows / bucket rows) and
    the batch must fall back. ``table[0]`` is ``None``; the table has
    ``buckets[-1] + 1`` entries (larger batches always fall back).
    """
    table: list[int | None] = [None] * (buckets[-1] + 1)
    j = 0
    for n in range(1, buckets[-1] + 1):
        while buckets[j] < n:
            j += 1
        b = buckets[j]
        if max_padding_ratio is not None and (b - n) / b > max_padding_ratio + 1e-12:
            table[n] = None
        else:
            table[n] = b
    return table


def check_ratio(r) -> float | None:
    if r is None:
        return None
    if isinstance(r, bool) or not isinstance(r, (int, float)):
        raise TypeError(f"max_padding_ratio must be a float in [0, 1) or None, got {type(r).__name__} ({r!r})")
    r = float(r)
    if math.isnan(r) or not 0.0 <= r < 1.0:
        raise ValueError(
            f"max_padding_ratio must be in [0, 1) (the largest allowed share of padding rows in a bucket), got {r}; "
            "use None to always pad"
        )
    return r
