"""``GraphRunner(memory_budget=bytes)``: capture the keys whose graphs fit, serve the rest eagerly.

The budget caps the **graph pool**: the sum of the capture report's per-key
``graph_pool_bytes`` (what each key's graph construction and capture added to
the one pool every graph of the runner shares, measured on that pool alone:
``device.pool_bytes()``, exact on the tape, the pool's segments in
``torch.cuda.memory_snapshot()`` on CUDA). It is exact on a device shared by
several runners: a runner with a budget given a device object captures into a
pool of its own (``device.with_own_pool()``; runners given one device object
otherwise share its pool and reuse each other's memory), so its figure neither
counts nor hides in another runner's graphs, and a restart releases only its
own pool (memory its left-out keys took does not stay in a shared pool). The
static input buffers and the shared output buffer are not counted: eager
serving needs them too, and the report lists them on their own rows.

Keys are captured largest first, as always (smaller graphs reuse the memory the
larger ones left free, so the total is close to the largest key's need). When a
key's capture brings the pool over the budget, the capture is undone
(``backend.cleanup()`` releases the pool), the key is *left to eager* and the
capture starts again without it: the keys kept are exactly those a greedy
largest-first pass keeps, and the pool finally held is within the budget. A call
whose key was left out is served by the eager fallback (reason
``"cannot_replay"``, padded to nothing: the step runs on the call's own rows).
The report names the keys left out (:attr:`CaptureReport.left_to_eager
<graphrunner.report.CaptureReport.left_to_eager>`).

One rank only for now: ranks that measured different pools would leave different
keys out and restart their captures at different times (unpaired collectives).
"""

from __future__ import annotations

import operator
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from graphrunner.errors import CaptureError
from graphrunner.report import CaptureReport, format_bytes

__all__ = ["MemoryBudget", "OverBudget", "one_time_imports"]

#: What the first capture in a process pays once, before the first key (see :func:`one_time_imports`).
ONE_TIME_WHAT = "torch._dynamo import, once per process"


def one_time_imports() -> float:
    """Import ``torch._dynamo`` if it is not imported yet and return the seconds it took (0.0
    if it was). Every capture imports it (PyTorch's dispatch modes do, about 1.4 s on a busy
    machine); importing it before the first key keeps that one-time cost out of the key's
    ``capture_seconds``, and the report shows it on its own."""
    if "torch._dynamo" in sys.modules:
        return 0.0
    t0 = time.perf_counter()
    import torch._dynamo  # noqa: F401  # heavy and optional: this function times its one-time import

    return time.perf_counter() - t0


class OverBudget(Exception):
    """Raised inside a capture when ``key``'s graph brought the pool over the budget (internal:
    :meth:`MemoryBudget.capture` catches it, leaves the key out and captures again)."""

    def __init__(self, key: Any, total: int) -> None:
        super().__init__(f"key {key!r}: the graph pool would hold {total} bytes")
        self.key, self.total = key, total


class MemoryBudget:
    """A runner's ``memory_budget``: ``None`` (capture every key) or a byte count ``>= 0``.

    Raises ``TypeError``/``ValueError`` naming ``memory_budget`` for anything else, and
    ``ValueError`` for a budget on a runner with more than one rank."""

    def __init__(self, budget: Any, world_size: int = 1) -> None:
        if budget is not None:
            if isinstance(budget, bool):
                raise TypeError("memory_budget must be a number of bytes (an int >= 0) or None, got a bool")
            try:
                budget = operator.index(budget)
            except TypeError:
                raise TypeError(
                    f"memory_budget must be a number of bytes (an int >= 0, e.g. 2 << 30) or None, "
                    f"got {type(budget).__name__} ({budget!r})"
                ) from None
            if budget < 0:
                raise ValueError(f"memory_budget must be >= 0 bytes, got {budget}; use None for no budget")
            if world_size > 1:
                raise ValueError(
                    f"memory_budget={budget} is supported on one rank only (this runner has "
                    f"{world_size}): ranks could leave different keys out; pass keys= to choose "
                    "the captured keys on every rank, or memory_budget=None"
                )
        #: The budget in bytes, or ``None``.
        self.budget: int | None = budget
        #: Keys (external form) left to eager by the last capture, largest first.
        self.left_out: list[Any] = []

    def keep(self, order: Sequence[Any], external: Callable[[Any], Any]) -> list[Any]:
        """``order`` (internal keys, largest first) without the keys left out so far. The first key
        kept allocates the output buffer every key shares, so a key larger than it in some dim (named
        dims, once a larger key was left out) cannot be captured either: it is left out too (its
        calls fall back), never a failed capture."""
        kept = [k for k in order if external(k) not in self.left_out]
        if kept and self.left_out:
            top = kept[0]
            over = [k for k in kept if any(a > b for a, b in zip(k, top))]
            self.left_out.extend(external(k) for k in over)
            kept = [k for k in kept if k not in over]
        return kept

    def append(self, key: Any, reports: list[Any], report: Any) -> None:
        """After ``key``'s capture: append its ``report`` to ``reports``, then raise
        :class:`OverBudget` when the pool now exceeds the budget (``CaptureError`` when the
        device does not measure its graph memory)."""
        reports.append(report)
        if self.budget is None:
            return
        sizes = [r.graph_pool_bytes for r in reports]
        if any(s is None for s in sizes):
            raise CaptureError(
                f"memory_budget={self.budget}: the device does not report its graph memory "
                "(no memory_reserved()), so the budget cannot be applied; use memory_budget=None"
            )
        total = sum(sizes)
        if total > self.budget:
            raise OverBudget(key, total)

    def capture(self, run: Callable[[Any], CaptureReport], one_time: float = 0.0) -> CaptureReport:
        """``run(None)`` (the runner's capture) until its graphs fit: each :class:`OverBudget`
        (the capture was undone) leaves that key out and captures again. Sets the report's
        one-time cost (``one_time`` seconds), budget and keys left to eager."""
        self.left_out = []
        while True:
            try:
                report = run(None)
                break
            except OverBudget as over:
                self.left_out.append(over.key)
        report.one_time_seconds, report.one_time_what = one_time, ONE_TIME_WHAT if one_time else ""
        report.memory_budget, report.left_to_eager = self.budget, list(self.left_out)
        return report

    def __repr__(self) -> str:
        return "MemoryBudget(None)" if self.budget is None else f"MemoryBudget({format_bytes(self.budget)})"
