"""What :meth:`GraphRunner.capture` returns: per-bucket capture facts.

``print(report)`` shows a table; ``report.to_json()`` / ``report.to_dict()``
give the same data for tooling.
"""

from __future__ import annotations

import json
import math
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any

from graphrunner.trace import jsonable

__all__ = ["BucketReport", "CaptureReport", "format_bytes"]


def format_bytes(n: int) -> str:
    """``1536 -> '1.5 KiB'`` (binary units)."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024 or unit == "GiB":
            return f"{int(value)} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} TiB"  # pragma: no cover


@dataclass
class BucketReport:
    """One captured bucket.

    ``capture_seconds`` is the whole protocol for the bucket (warmups +
    checks + graph capture), ``graph_capture_seconds`` only the graph
    construction and capture, ``checks_seconds`` the checks' share of
    ``capture_seconds`` (their extra forwards, comparisons and op recording:
    ``info["checks_seconds"]``, 0 without checks). ``num_segments`` / ``num_breaks`` are the backend's counts (a
    full graph is 1 / 0, eager 0 / 1, a breakable graph one segment per
    graph-able stretch and one break per ``@no_graph`` call).
    ``graph_pool_bytes`` is what this key's graph construction and capture
    added to the graph pool every key shares (exact on the tape; on CUDA the
    growth of the caching allocator's reserved memory around the capture;
    ``None`` where the device does not measure it): keys are captured largest
    first and smaller ones reuse the memory larger ones left free, so the rows
    do not overlap and sum to the pool. ``bytes_held`` is the backend's
    ``info(key)["bytes_held"]`` (views into the static inputs and the shared
    output buffer: rows overlap, do not sum it; kept for tooling, not printed).
    ``info`` is the backend's full ``info(key)`` dict.
    """

    bucket: Any
    capture_seconds: float
    graph_capture_seconds: float
    num_segments: int
    num_breaks: int
    bytes_held: int
    info: dict[str, Any] = field(default_factory=dict, repr=False)
    graph_pool_bytes: int | None = None
    checks_seconds: float = 0.0

    @classmethod
    def from_info(cls, bucket: Any, info: dict[str, Any]) -> BucketReport:
        """The report of ``bucket`` from the backend's ``info(bucket)`` dict."""
        info = dict(info)
        return cls(
            bucket=bucket,
            capture_seconds=float(info.get("capture_seconds", 0.0)),
            graph_capture_seconds=float(info.get("graph_capture_seconds", 0.0)),
            num_segments=int(info.get("num_segments", 0)),
            num_breaks=int(info.get("num_breaks", 0)),
            bytes_held=int(info.get("bytes_held", 0)),
            info=info,
            graph_pool_bytes=None if info.get("graph_pool_bytes") is None else int(info["graph_pool_bytes"]),
            checks_seconds=float(info.get("checks_seconds", 0.0)),
        )

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (``info`` included, values made JSON-safe)."""
        return {
            "bucket": list(self.bucket) if isinstance(self.bucket, tuple) else self.bucket,
            "capture_seconds": self.capture_seconds,
            "graph_capture_seconds": self.graph_capture_seconds,
            "checks_seconds": self.checks_seconds,
            "num_segments": self.num_segments,
            "num_breaks": self.num_breaks,
            "bytes_held": self.bytes_held,
            "graph_pool_bytes": self.graph_pool_bytes,
            "info": {k: jsonable(v) for k, v in self.info.items()},
        }


@dataclass
class CaptureReport:
    """The result of :meth:`GraphRunner.capture`.

    ``buckets`` lists :class:`BucketReport` in capture order (largest
    first). Memory, in rows that do not overlap: :attr:`graph_pool_bytes`
    (the graphs' shared pool, the sum of the keys' ``graph_pool_bytes``),
    ``static_input_bytes`` (the runner's static input buffers, allocated
    once at the largest key) and ``output_buffer_bytes`` (the backend's one
    shared output buffer); :attr:`total_bytes` is their sum and
    :attr:`total_bytes_held` the last two (what the runner holds outside the
    pool). ``total_seconds`` is the wall time of the capture of every key;
    ``one_time_seconds`` what the first capture in a process paid once
    before its first key (``one_time_what`` says for what: PyTorch's
    ``torch._dynamo`` import), 0 for later captures. ``memory_budget`` is the
    runner's ``memory_budget`` and ``left_to_eager`` the keys it left out
    (largest first; their calls run the step eagerly).
    ``externals_written`` (debug mode only, else ``None``) lists the
    tensors outside the runner's inputs that the graphs write, e.g. the KV
    cache: ``[{"path", "shape", "dtype"}]``. ``after_capture`` lists what
    the runner's owner ran after the keys' capture, each
    ``{"name", "seconds", "summary"}`` (``gr.hf.DecodeRunner``'s self-test);
    ``total_seconds`` does not include them.
    """

    backend: str
    device: str
    rank: int
    world_size: int
    buckets: list[BucketReport]
    total_seconds: float
    static_input_bytes: int
    output_buffer_bytes: int
    #: With ``GraphRunner(output_arena=...)``: the arena's ``name``, ``owners``,
    #: ``bytes_held``, ``bytes_if_separate`` and one-line ``summary`` at capture end.
    output_arena: dict[str, Any] | None = None
    externals_written: list[dict[str, Any]] | None = None
    one_time_seconds: float = 0.0
    one_time_what: str = ""
    memory_budget: int | None = None
    left_to_eager: list[Any] = field(default_factory=list)
    after_capture: list[dict[str, Any]] = field(default_factory=list)

    @property
    def graph_pool_bytes(self) -> int | None:
        """The graphs' pool: the sum of the keys' ``graph_pool_bytes`` (``None`` if not measured)."""
        sizes = [b.graph_pool_bytes for b in self.buckets]
        measured = [s for s in sizes if s is not None]
        return None if len(measured) < len(sizes) else sum(measured)

    @property
    def total_bytes_held(self) -> int:
        """Static input buffers + the shared output buffer, in bytes (outside the graph pool)."""
        return self.static_input_bytes + self.output_buffer_bytes

    @property
    def total_bytes(self) -> int:
        """Graph pool + static inputs + output buffer, in bytes (the pool counted 0 if not measured)."""
        return (self.graph_pool_bytes or 0) + self.total_bytes_held

    @property
    def num_buckets(self) -> int:
        """Number of captured buckets."""
        return len(self.buckets)

    def bucket(self, size: int) -> BucketReport:
        """The :class:`BucketReport` of bucket ``size`` (``KeyError`` if absent)."""
        for b in self.buckets:
            if b.bucket == size:
                return b
        raise KeyError(f"bucket {size} is not in this report (buckets: {[b.bucket for b in self.buckets]})")

    @classmethod
    def of(
        cls,
        backend: Any,
        rank: int,
        world_size: int,
        buckets: list[BucketReport],
        total_seconds: float,
        static_input_bytes: int,
        output_arena: Any = None,
        externals_written: list[dict[str, Any]] | None = None,
    ) -> CaptureReport:
        """The report of a runner's capture with ``backend`` (its name, device and output buffer)."""
        return cls(
            backend=str(getattr(backend, "name", type(backend).__name__)),
            device=str(getattr(backend.device, "kind", backend.device)),
            rank=rank,
            world_size=world_size,
            buckets=buckets,
            total_seconds=total_seconds,
            static_input_bytes=static_input_bytes,
            output_buffer_bytes=max((int(r.info.get("output_buffer_bytes", 0)) for r in buckets), default=0),
            output_arena=None if output_arena is None else output_arena.facts(),
            externals_written=externals_written,
        )

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict with every field and one entry per bucket."""
        return {
            "backend": self.backend,
            "device": self.device,
            "rank": self.rank,
            "world_size": self.world_size,
            "total_seconds": self.total_seconds,
            "one_time_seconds": self.one_time_seconds,
            "one_time_what": self.one_time_what,
            "graph_pool_bytes": self.graph_pool_bytes,
            "static_input_bytes": self.static_input_bytes,
            "output_buffer_bytes": self.output_buffer_bytes,
            "total_bytes_held": self.total_bytes_held,
            "total_bytes": self.total_bytes,
            "memory_budget": self.memory_budget,
            "left_to_eager": [jsonable(k) for k in self.left_to_eager],
            "output_arena": self.output_arena,
            "buckets": [b.to_dict() for b in self.buckets],
            "externals_written": self.externals_written,
            "after_capture": list(self.after_capture),
        }

    def to_json(self, indent: int | None = 2) -> str:
        """``json.dumps(self.to_dict())``."""
        return json.dumps(self.to_dict(), indent=indent)

    def table(self) -> str:
        """A fixed-width text table: one row per key, a totals row, memory, and a legend.

        The header gives the wall time of the capture and, on its own, the
        one-time cost the first capture in a process paid before its first
        key. The totals row holds true sums of the rows (``graph_pool`` is
        ``-`` when the device does not measure it). The ``memory:`` line
        splits what the runner holds into rows that do not overlap: graph
        pool + static inputs + output buffer. With a ``memory_budget`` a
        line names the keys left to eager; each ``after_capture`` step gets a
        line with its time. The last line is the legend.
        """
        head = (
            f"graphrunner capture: backend={self.backend} device={self.device} "
            f"rank={self.rank}/{self.world_size} buckets={self.num_buckets} wall={self.total_seconds:.3f}s"
        )
        if self.one_time_seconds:
            head += f" (+{self.one_time_seconds:.2f}s one-time before the first key: {self.one_time_what})"
        cols = (
            f"{'bucket':>7} {'capture_s':>10} {'checks_s':>9} {'graph_s':>9} {'segments':>9} {'breaks':>7} "
            f"{'graph_pool':>11}"
        )
        lines = [head, cols, "-" * len(cols)]
        for b in self.buckets:
            lines.append(
                f"{key_text(b.bucket):>7} {b.capture_seconds:>10.4f} {b.checks_seconds:>9.4f} "
                f"{b.graph_capture_seconds:>9.4f} "
                f"{b.num_segments:>9} {b.num_breaks:>7} {_bytes_cell(b.graph_pool_bytes):>11}"
            )
        lines.append("-" * len(cols))
        lines.append(
            f"{'total':>7} {sum(b.capture_seconds for b in self.buckets):>10.4f} "
            f"{sum(b.checks_seconds for b in self.buckets):>9.4f} "
            f"{sum(b.graph_capture_seconds for b in self.buckets):>9.4f} "
            f"{sum(b.num_segments for b in self.buckets):>9} {sum(b.num_breaks for b in self.buckets):>7} "
            f"{_bytes_cell(self.graph_pool_bytes):>11}"
        )
        rest = (
            f"static inputs {format_bytes(self.static_input_bytes)} + output buffer "
            f"{format_bytes(self.output_buffer_bytes)}"
        )
        if self.graph_pool_bytes is None:
            lines.append(f"memory: {rest} = {format_bytes(self.total_bytes_held)} (graph pool not measured)")
        else:
            lines.append(
                f"memory: graph pool {format_bytes(self.graph_pool_bytes)} + {rest} = {format_bytes(self.total_bytes)}"
            )
        if self.memory_budget is not None:
            left = ", ".join(key_text(k) for k in self.left_to_eager) or "none"
            lines.append(f"memory_budget {format_bytes(self.memory_budget)}: left to eager: {left}")
        if self.output_arena is not None:
            lines.append(f"{self.output_arena['summary']}; this runner's output buffer is part of it")
        if self.externals_written is not None:
            written = ", ".join(f"{e['path']} {e['shape']} {e['dtype']}" for e in self.externals_written)
            lines.append(f"externals the graphs write (debug): {written or 'none'}")
        for step in self.after_capture:
            lines.append(f"after capture: {step['name']} {step['seconds']:.3f}s ({step['summary']})")
        lines.append(LEGEND)
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()


#: The last line of :meth:`CaptureReport.table`.
LEGEND = (
    "legend: capture_s = warmups + checks + capture; checks_s = the checks' part; graph_s = capture alone; "
    "graph_pool = pool memory the key added"
)


def _bytes_cell(n: int | None) -> str:
    return "-" if n is None else format_bytes(n)


def key_text(key: Any) -> str:
    """A shape key for a table cell: ``8`` for an int, ``8x4`` for a tuple."""
    return "x".join(map(str, key)) if isinstance(key, tuple) else str(key)


@dataclass
class RunnerStats:
    """Counters of a :class:`GraphRunner` (``runner.stats``).

    ``replays`` maps each bucket (each key: a tuple with several named
    dims) to the number of calls that replayed it;
    ``fallbacks`` counts calls that ran eagerly, ``fallback_reasons`` splits
    them by reason (``"over_max_bucket"``, ``"padding_ratio"``,
    ``"cannot_replay"``: this or, with agreement, another rank cannot replay
    the agreed bucket); ``padding_rows`` counts the padding rows computed
    (replays, and multi-rank eager fallbacks padded to the agreed batch) and
    ``real_rows`` the caller's rows (with several dims: cells, the product
    of the sizes). ``last_bucket`` is the bucket (key) the most
    recent call replayed, ``None`` when it fell back. Calls that raised
    (invalid inputs, ``fallback="error"``) are not counted.
    ``agreement_seconds``: the seconds the calls spent in their agreement
    with the other ranks (the one collective per call: waiting for the
    slowest rank included; 0 on one rank).
    """

    replays: dict[Hashable, int] = field(default_factory=dict)  # int keys, or tuples with dims
    fallbacks: int = 0
    fallback_reasons: dict[str, int] = field(default_factory=dict)
    padding_rows: int = 0
    real_rows: int = 0
    last_bucket: Hashable | None = None
    agreement_seconds: float = 0.0

    def count(self, bucket: Any, sizes: Any, rows: Any, reason: str | None = None) -> None:
        """Count one call of real ``sizes`` computed at ``rows`` (a key, or the padded fallback):
        a replay of ``bucket``, or with ``bucket=None`` a fallback for ``reason``."""
        if bucket is None and reason is None:
            raise ValueError(
                "RunnerStats.count: a fallback (bucket=None) is counted under its reason; "
                "pass reason= (e.g. 'over_max_bucket')"
            )
        real = math.prod(sizes)
        self.padding_rows += math.prod(rows) - real
        self.real_rows += real
        self.last_bucket = bucket
        if bucket is None:
            assert reason is not None  # checked above, before any counter moved
            self.fallbacks += 1
            self.fallback_reasons[reason] = self.fallback_reasons.get(reason, 0) + 1
        else:
            self.replays[bucket] += 1

    @property
    def calls(self) -> int:
        """Successful calls: replays plus fallbacks."""
        return sum(self.replays.values()) + self.fallbacks

    def reset(self) -> None:
        """Zero every counter (buckets stay listed in ``replays``)."""
        for b in self.replays:
            self.replays[b] = 0
        self.fallbacks = 0
        self.fallback_reasons.clear()
        self.padding_rows = 0
        self.real_rows = 0
        self.last_bucket = None
        self.agreement_seconds = 0.0

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready copy of the counters."""
        return {
            "calls": self.calls,
            "replays": {str(k): v for k, v in self.replays.items()},
            "fallbacks": self.fallbacks,
            "fallback_reasons": dict(self.fallback_reasons),
            "padding_rows": self.padding_rows,
            "real_rows": self.real_rows,
            "last_bucket": self.last_bucket,
            "agreement_seconds": self.agreement_seconds,
        }
