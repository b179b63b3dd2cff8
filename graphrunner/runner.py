"""GraphRunner: everything between "here is a batch" and "here are the outputs".

::

    runner = gr.GraphRunner(step, inputs={"x": gr.BatchInput(trailing=(64,))}, buckets=[1, 2, 4, 8])
    print(runner.capture())          # largest bucket first; a CaptureReport table
    y = runner(x=torch.randn(3, 64))  # copy into static buffers, pad to 4, replay, slice to 3 rows

The runner owns the static input buffers (allocated once at the largest
bucket), picks the smallest bucket that holds a batch, pads, replays through a
backend (:mod:`graphrunner.backends`), slices the outputs back to the real
batch and falls back to eager PyTorch when no bucket fits. With a multi-rank
``group`` every call makes all ranks replay the same bucket (or all fall back
together). See ``docs/runner.md``.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

import torch

from graphrunner.backends.base import GraphBackend
from graphrunner.backends.outputs import flatten as _flatten_out
from graphrunner.backends.outputs import unflatten as _unflatten_out
from graphrunner.buckets import _check_ratio, bucket_table, default_buckets, validate_buckets
from graphrunner.errors import CaptureError, GraphRunnerError, RankTimeoutError
from graphrunner.progress import CaptureProgress
from graphrunner.report import BucketReport, CaptureReport

__all__ = ["GraphRunner", "BatchInput", "RunnerStats", "default_buckets"]

logger = logging.getLogger("graphrunner")

_Tensor = torch.Tensor
_BACKENDS = ("full", "breakable", "eager")
_FALLBACKS = ("eager", "error")


@dataclass(frozen=True)
class BatchInput:
    """Declares one batch-major input of the step.

    A tensor passed for this input has shape ``(batch, *trailing)`` and
    exactly ``dtype`` (no implicit casts). The runner keeps one static buffer
    of shape ``(largest_bucket, *trailing)``; rows beyond the real batch
    (padding rows) are set to ``pad`` before a replay, so pick a value the
    step handles harmlessly (token id 0, position 0, zeros).
    """

    trailing: Tuple[int, ...] = ()
    dtype: torch.dtype = torch.float32
    pad: Any = 0

    def __post_init__(self) -> None:
        trailing = self.trailing
        if isinstance(trailing, int) and not isinstance(trailing, bool):
            trailing = (trailing,)
        try:
            trailing = tuple(trailing)
        except TypeError:
            raise TypeError(f"BatchInput.trailing must be a tuple of ints, got {self.trailing!r}") from None
        for d in trailing:
            if isinstance(d, bool) or not isinstance(d, int) or d < 0:
                raise ValueError(f"BatchInput.trailing must hold ints >= 0, got {self.trailing!r}")
        object.__setattr__(self, "trailing", trailing)
        if not isinstance(self.dtype, torch.dtype):
            raise TypeError(f"BatchInput.dtype must be a torch.dtype such as torch.long, got {self.dtype!r}")
        if isinstance(self.pad, torch.Tensor) or not isinstance(self.pad, (bool, int, float)):
            raise TypeError(f"BatchInput.pad must be a Python number, got {type(self.pad).__name__} ({self.pad!r})")
        if (not self.dtype.is_floating_point and not self.dtype.is_complex and isinstance(self.pad, float)
                and not float(self.pad).is_integer()):
            raise ValueError(f"BatchInput.pad {self.pad!r} is not representable in {self.dtype}")


@dataclass
class RunnerStats:
    """Counters of a :class:`GraphRunner` (``runner.stats``).

    ``replays`` maps each bucket to the number of calls that replayed it;
    ``fallbacks`` counts calls that ran eagerly, ``fallback_reasons`` splits
    them by reason (``"over_max_bucket"``, ``"padding_ratio"``,
    ``"cannot_replay"``: this or, with agreement, another rank cannot replay
    the agreed bucket); ``padding_rows`` counts the padding rows computed
    (replays, and multi-rank eager fallbacks padded to the agreed batch) and
    ``real_rows`` the caller's rows. ``last_bucket`` is the bucket the most
    recent call replayed, ``None`` when it fell back. Calls that raised
    (invalid inputs, ``fallback="error"``) are not counted.
    """

    replays: Dict[int, int] = field(default_factory=dict)
    fallbacks: int = 0
    fallback_reasons: Dict[str, int] = field(default_factory=dict)
    padding_rows: int = 0
    real_rows: int = 0
    last_bucket: Optional[int] = None

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

    def to_dict(self) -> Dict[str, Any]:
        """A JSON-ready copy of the counters."""
        return {
            "calls": self.calls,
            "replays": {str(k): v for k, v in self.replays.items()},
            "fallbacks": self.fallbacks,
            "fallback_reasons": dict(self.fallback_reasons),
            "padding_rows": self.padding_rows,
            "real_rows": self.real_rows,
            "last_bucket": self.last_bucket,
        }


class _StepOutputError(TypeError):
    """The step returned something the runner cannot slice (raised during capture)."""


def _make_backend(backend: Any, device: Any, group: Any, warmups: int, trace: Any,
                  drift_check: Optional[bool] = None) -> Any:
    if isinstance(backend, str):
        from graphrunner.backends import BreakableGraphBackend, EagerBackend, FullGraphBackend

        classes = {"full": FullGraphBackend, "breakable": BreakableGraphBackend, "eager": EagerBackend}
        if backend not in classes:
            raise ValueError(f"unknown backend {backend!r}: expected one of {_BACKENDS} or a backend instance")
        return classes[backend](device=device, group=group, warmups=warmups, trace=trace,
                                drift_check=True if drift_check is None else drift_check)
    missing = [m for m in ("capture_session", "capture_one", "replay", "can_run", "cleanup", "info")
               if not callable(getattr(backend, m, None))]
    if missing:
        raise TypeError(
            f"backend must be one of {_BACKENDS} or a backend instance (a graphrunner.backends.GraphBackend); "
            f"{type(backend).__name__} lacks {', '.join(missing)}"
        )
    if device not in ("auto", None) and device is not getattr(backend, "device", None):
        raise ValueError("device= was given together with a backend instance; configure the device on the backend")
    if group is not None and group is not getattr(backend, "group", None):
        raise ValueError("group= differs from the backend instance's group; the runner must agree buckets over the "
                         "group the backend captures with: pass the same object, or configure it on the backend only")
    if trace is not None:
        raise ValueError("trace= was given together with a backend instance; configure the trace on the backend")
    if drift_check is not None and drift_check != getattr(backend, "drift_check", drift_check):
        raise ValueError("drift_check= differs from the backend instance's drift_check; configure it on the backend")
    return backend


class GraphRunner:
    """Capture ``step`` once per batch bucket and serve calls by replay.

    Args:
        step: ``step(**static_inputs) -> output``. Called with one keyword
            per declared input, each a ``(bucket, *trailing)`` tensor. It must
            only read its inputs (never write them), be row-independent
            (padding rows must not change real rows), and return a pytree
            (tensor, tuple, list, dict, dataclass, ``None``) of tensors whose
            dim 0 is the batch (0-dim tensors are returned whole).
        inputs: ``{name: BatchInput(...)}``; the names are the keywords of
            ``step`` and of every call.
        buckets: strictly increasing positive batch sizes, e.g.
            ``[1, 2, 4, 8]`` or :func:`default_buckets(max_batch)
            <graphrunner.buckets.default_buckets>`.
        backend: ``"full"``, ``"breakable"`` (default), ``"eager"``, or a
            backend instance (then ``device``, ``group``, ``warmups`` and
            ``trace`` come from it).
        device: ``"auto"``, ``"tape"``, ``"cuda"`` or a device object; the
            static buffers live on its ``torch_device``.
        group: a rank group (``graphrunner.LocalGroup`` when ``None``); with
            more than one rank every call agrees on the bucket (below).
        warmups: eager warmup forwards per bucket before its capture.
        post_warmup_hook: ``hook(bucket)``, called after each warmup forward
            of a bucket (e.g. to reset a KV cache the warmup wrote).
        max_padding_ratio: ``None`` (always pad) or a float in ``[0, 1)``:
            a batch whose padding rows would exceed this share of the bucket
            falls back.
        fallback: ``"eager"`` (run ``step`` eagerly on the batch when no
            bucket fits) or ``"error"`` (raise ``ValueError`` instead).
        trace: a :class:`graphrunner.Trace` handed to the backend. It keeps
            every capture event and the most recent replay events (10,000 by
            default, ``Trace(max_replay_events=...)``), so it stays bounded
            on a long-running server; ``trace.replays_recorded`` counts them all.
        copy_outputs: return clones instead of views (see below); can be
            overridden per call with :meth:`run`.
        progress: draw a capture progress bar on rank 0 (stderr).
        agree_bucket: with a multi-rank group, agree the bucket across ranks
            on every call (default). ``False`` is UNSAFE, for tests only:
            ranks may replay different buckets and their collectives then
            mismatch (hang or garbage).
        inference_mode: run capture and eager fallbacks under
            ``torch.inference_mode()`` (default ``True``).
        drift_check: compare the op stream of the last warmup with the
            capture's and raise :class:`~graphrunner.errors.CaptureError` on
            a difference (Python state a graph would freeze; see
            :mod:`graphrunner.drift`). ``None`` (default): on, or the
            backend instance's setting; ``False`` turns it off.

    Every configuration error (buckets, backend name, fallback, padding
    ratio, inputs) raises ``ValueError``/``TypeError`` here, before any
    capture; a step output that is not a pytree of batch-major tensors
    raises ``TypeError`` during the first warmup of :meth:`capture`.

    **Outputs are views.** After a replay the returned tensors are views of
    the backend's one static output buffer: the next call of this runner
    (any bucket) overwrites them in place. Clone what you keep, or pass
    ``copy_outputs=True``. Eager-fallback outputs are whatever ``step``
    returned (fresh tensors), sliced to the batch.

    **Per call** (:meth:`__call__` / :meth:`run`): validate names, dtypes,
    trailing shapes and a common batch ``n >= 1`` (``ValueError``/
    ``TypeError`` naming the input; the runner stays usable); pick the
    smallest bucket ``b >= n``; copy the inputs into rows ``[0, n)`` of the
    static buffers and set rows ``[n, b)`` to each input's pad value; replay
    ``b``; return the outputs sliced to ``n`` rows. No device sync.

    **Multi-rank agreement** (group with ``size > 1`` and
    ``agree_bucket=True``): each call makes exactly two scalar collectives
    on ``group`` and no other group traffic: ``N = group.all_max(n)``, then
    ``ok = group.all_min(e)`` where ``e`` is 1 if this rank can replay the
    bucket chosen for ``N``, 0 if not, and -1 if this rank's inputs were
    invalid. All ranks then replay the same bucket (``ok == 1``), all fall
    back eagerly with their inputs padded to ``N`` rows so that collectives
    inside ``step`` see equal shapes (``ok == 0``), or all raise
    (``ok == -1``: the invalid rank its own error, the others
    :class:`~graphrunner.errors.GraphRunnerError`). Size-1 groups make no
    group calls at all.
    """

    def __init__(
        self,
        step: Callable[..., Any],
        inputs: Mapping[str, BatchInput],
        buckets: Any,
        backend: Any = "breakable",
        device: Any = "auto",
        group: Any = None,
        warmups: int = 2,
        post_warmup_hook: Optional[Callable[[int], Any]] = None,
        max_padding_ratio: Optional[float] = None,
        fallback: str = "eager",
        trace: Any = None,
        *,
        copy_outputs: bool = False,
        progress: bool = True,
        agree_bucket: bool = True,
        inference_mode: bool = True,
        drift_check: Optional[bool] = None,
    ) -> None:
        if not callable(step):
            raise TypeError(f"step must be callable as step(**inputs), got {type(step).__name__}")
        if not isinstance(inputs, Mapping) or not inputs:
            raise ValueError("inputs must be a non-empty dict {name: gr.BatchInput(...)} naming every input of step")
        for name, spec in inputs.items():
            if not isinstance(name, str) or not name.isidentifier():
                raise ValueError(f"input name {name!r} must be a Python identifier (it is passed as a keyword)")
            if not isinstance(spec, BatchInput):
                raise TypeError(f"inputs[{name!r}] must be a gr.BatchInput(trailing=..., dtype=..., pad=...), "
                                f"got {type(spec).__name__}")
        self.buckets: List[int] = validate_buckets(buckets)
        if fallback not in _FALLBACKS:
            raise ValueError(f"fallback must be one of {_FALLBACKS}, got {fallback!r}")
        self.max_padding_ratio = _check_ratio(max_padding_ratio)
        if post_warmup_hook is not None and not callable(post_warmup_hook):
            raise TypeError(f"post_warmup_hook must be callable as hook(bucket) or None, got {type(post_warmup_hook).__name__}")

        self.step = step
        self.inputs: Dict[str, BatchInput] = dict(inputs)
        self.fallback = fallback
        self.copy_outputs = bool(copy_outputs)
        self.progress = bool(progress)
        self.agree_bucket = bool(agree_bucket)
        self.inference_mode = bool(inference_mode)
        self.post_warmup_hook = post_warmup_hook
        self.backend = _make_backend(backend, device, group, warmups, trace, drift_check)
        self.device = self.backend.device
        from graphrunner.group import LocalGroup

        self.group = getattr(self.backend, "group", None) or LocalGroup()
        self.rank = int(getattr(self.group, "rank", 0))
        self.world_size = int(getattr(self.group, "size", 1))
        self._agree = self.world_size > 1 and self.agree_bucket
        if self._agree and "nccl" in str(getattr(self.group, "backend_name", "")):
            logger.warning("GraphRunner: bucket agreement over an NCCL group waits for the GPU on every call "
                           "(its result is read on the host); pass TorchDistGroup(torch.distributed.new_group("
                           "backend='gloo')) as group= for a host-only agreement")
        if self.world_size > 1 and not self.agree_bucket:
            logger.warning("GraphRunner(agree_bucket=False) on a %d-rank group: ranks may replay different "
                           "buckets (unsafe; for tests only)", self.world_size)

        self.max_batch = self.buckets[-1]
        self._table = bucket_table(self.buckets, self.max_padding_ratio)
        tdev = getattr(self.device, "torch_device", torch.device("cpu"))
        self.torch_device = torch.device(tdev)
        with torch.inference_mode(False):  # normal tensors: writable outside inference mode
            self._buffers: Dict[str, torch.Tensor] = {
                name: torch.full((self.max_batch, *spec.trailing), spec.pad, dtype=spec.dtype, device=self.torch_device)
                for name, spec in self.inputs.items()
            }
        self._names = tuple(self.inputs)
        self._n_inputs = len(self._names)
        self._checks = tuple((s.dtype, s.trailing, len(s.trailing) + 1) for s in self.inputs.values())
        self._pads = tuple((self._buffers[n], s.pad) for n, s in self.inputs.items())
        # [start, end) byte address of every static buffer: an input that starts
        # inside one aliases the runner's own memory (checked before any write).
        self._ranges = tuple((buf.data_ptr(), buf.data_ptr() + buf.numel() * buf.element_size())
                             for buf, _ in self._pads)
        self._span = (min(lo for lo, _ in self._ranges), max(hi for _, hi in self._ranges))
        self._filled = 0  # rows >= _filled of every buffer hold their pad value
        self._in_views: List[Optional[List[torch.Tensor]]] = [None] * (self.max_batch + 1)
        self._pad_views: Dict[Tuple[int, int], List[Tuple[torch.Tensor, Any]]] = {}  # (n, bucket) -> rows [n, bucket)
        self.stats = RunnerStats(replays={b: 0 for b in self.buckets})
        self.report: Optional[CaptureReport] = None
        self._captured = False
        self._capturing = False
        self._cleaned_up = False
        self._calls = 0
        # One call (or capture) at a time: the static buffers serve one batch.
        self._busy = threading.Lock()
        self._busy_thread: Optional[int] = None
        self._reset_replay_state()

    # ----------------------------------------------------------- properties
    @property
    def captured(self) -> bool:
        """True after a successful :meth:`capture` (until :meth:`cleanup`)."""
        return self._captured

    @property
    def static_inputs(self) -> Dict[str, torch.Tensor]:
        """The full static input buffers ``{name: (max_batch, *trailing)}``, for inspection; do not write them."""
        return dict(self._buffers)

    def bucket_for(self, batch: int) -> Optional[int]:
        """The bucket a local batch of ``batch`` rows replays, or ``None`` if it falls back
        (ignores multi-rank agreement and whether the bucket was captured)."""
        if 1 <= batch <= self.max_batch:
            return self._table[batch]
        return None

    def __repr__(self) -> str:
        return (f"GraphRunner(backend={getattr(self.backend, 'name', type(self.backend).__name__)!r}, "
                f"buckets={self.buckets}, inputs={list(self._names)}, rank={self.rank}/{self.world_size}, "
                f"captured={self._captured})")

    def _grad_ctx(self):
        return torch.inference_mode() if self.inference_mode else contextlib.nullcontext()

    def _reset_replay_state(self) -> None:
        self._replayable: Dict[int, bool] = {}
        self._out_n: List[Any] = [None] * (self.max_batch + 1)
        self._out_spec: Optional[tuple] = None
        self._cache_outputs = isinstance(self.backend, GraphBackend)
        self._replay = self.backend.replay

    # -------------------------------------------------------------- capture
    def _bucket_views(self, b: int) -> Dict[str, torch.Tensor]:
        return {name: buf[:b] for name, buf in self._buffers.items()}

    def _check_output(self, out: Any, b: int) -> None:
        try:
            _, leaves = _flatten_out(out, "step output")
        except TypeError as exc:
            raise _StepOutputError(
                f"step returned something that is not a pytree of tensors for bucket {b}: {exc}"
            ) from None
        for i, t in enumerate(leaves):
            if t.dim() >= 1 and t.shape[0] != b:
                raise _StepOutputError(
                    f"step output tensor {i} has shape {list(t.shape)} for bucket {b}: every output tensor must be "
                    f"batch-major (dim 0 == the {b} input rows) or 0-dim, so the runner can slice it to the real "
                    "batch. Return per-row results, or compute batch-independent values outside step."
                )

    def _make_forward(self, b: int, views: Dict[str, torch.Tensor]) -> Callable[[], Any]:
        step = self.step

        def forward() -> Any:
            out = step(**views)
            if self._capturing:
                self._check_output(out, b)
            return out

        forward.__qualname__ = f"GraphRunner.step[bucket={b}]"
        return forward

    def capture(self) -> CaptureReport:
        """Capture every bucket, largest first, and return a :class:`CaptureReport`.

        Runs inside one ``backend.capture_session()`` (garbage collected and
        frozen for its duration), under ``torch.inference_mode()`` unless
        disabled; all buckets share the backend's pool and one output
        buffer. With a multi-rank group every rank must call ``capture()``
        (the protocol barriers). Draws a progress bar on rank 0 unless
        ``progress=False``. On any error the backend is cleaned up, the
        runner stays uncaptured, and the error propagates (a step output
        that is not a pytree of batch-major tensors as ``TypeError``, other
        failures as :class:`~graphrunner.errors.CaptureError` naming the
        bucket). Raises ``CaptureError`` if already captured (call
        :meth:`cleanup` first).
        """
        if self._captured:
            raise CaptureError("GraphRunner.capture() was already called; call runner.cleanup() before capturing again")
        self._enter("capture()")
        try:
            return self._capture()
        finally:
            self._leave()

    def _capture(self) -> CaptureReport:
        order = list(reversed(self.buckets))
        bar = CaptureProgress(len(order), enabled=self.progress and self.rank == 0)
        reports: List[BucketReport] = []
        t0 = time.perf_counter()
        ok = False
        self._capturing = True
        try:
            with self._grad_ctx(), self.backend.capture_session():
                for i, b in enumerate(order):
                    bar.start(i, b)
                    views = self._bucket_views(b)
                    hook = (functools.partial(self.post_warmup_hook, b) if self.post_warmup_hook is not None else None)
                    self.backend.capture_one(b, self._make_forward(b, views), capture_inputs=views,
                                             post_warmup_hook=hook)
                    info = dict(self.backend.info(b))
                    reports.append(BucketReport(
                        bucket=b,
                        capture_seconds=float(info.get("capture_seconds", 0.0)),
                        graph_capture_seconds=float(info.get("graph_capture_seconds", 0.0)),
                        num_segments=int(info.get("num_segments", 0)),
                        num_breaks=int(info.get("num_breaks", 0)),
                        bytes_held=int(info.get("bytes_held", 0)),
                        info=info,
                    ))
            ok = True
        except CaptureError as exc:
            cause = exc.__cause__
            self._abort_capture()
            if isinstance(cause, _StepOutputError):
                raise TypeError(str(cause)) from None
            raise
        except BaseException:
            self._abort_capture()
            raise
        finally:
            self._capturing = False
            bar.close(ok)
        self._replayable = {b: bool(self.backend.can_run(b)) for b in self.buckets}
        self._captured = True
        out_bytes = max((int(r.info.get("output_buffer_bytes", 0)) for r in reports), default=0)
        self.report = CaptureReport(
            backend=str(getattr(self.backend, "name", type(self.backend).__name__)),
            device=str(getattr(self.device, "kind", self.device)),
            rank=self.rank,
            world_size=self.world_size,
            buckets=reports,
            total_seconds=time.perf_counter() - t0,
            static_input_bytes=sum(t.numel() * t.element_size() for t in self._buffers.values()),
            output_buffer_bytes=out_bytes,
        )
        logger.info("GraphRunner captured %d buckets (%s) in %.3fs on rank %d", len(order),
                    self.report.backend, self.report.total_seconds, self.rank)
        return self.report

    def _abort_capture(self) -> None:
        try:
            self.backend.cleanup()
        except Exception:  # noqa: BLE001 - the capture error is what the caller needs
            logger.exception("GraphRunner: backend cleanup after a failed capture raised")
        self._reset_replay_state()

    def cleanup(self) -> None:
        """Release every graph and the output buffer (``backend.cleanup()``);
        the runner can :meth:`capture` again. Static input buffers are kept."""
        self.backend.cleanup()
        self._captured = False
        self._cleaned_up = True
        self.report = None
        self._reset_replay_state()

    def compare(self, **inputs: torch.Tensor) -> Any:
        """Run the graph and an eager reference on ``inputs`` and localise any
        difference; returns a :class:`graphrunner.compare.CompareReport`
        (``.equal``; ``str()`` names the first differing op, its line and the
        segment or eager break). State the step writes (a KV cache) is put
        back. See :func:`graphrunner.compare.compare_runner`."""
        from graphrunner.compare import compare_runner

        return compare_runner(self, inputs)

    # ------------------------------------------------------- thread ownership
    def _enter(self, what: str) -> None:
        """Take the runner for one call or capture, or raise at once if
        another one is in progress (another thread, or re-entrantly)."""
        if not self._busy.acquire(blocking=False):
            me, owner = threading.get_ident(), self._busy_thread
            if owner == me:
                raise GraphRunnerError(
                    f"GraphRunner.{what} called re-entrantly (from inside step or a hook of the same runner): "
                    "its static buffers hold the batch in progress; do not call a runner from its own step")
            raise GraphRunnerError(
                f"GraphRunner.{what} called from thread {threading.current_thread().name} (id {me}) while thread "
                f"id {owner} is inside a call of the same runner: one runner serves one call at a time (its static "
                "buffers hold one batch). Use one runner per thread, or serialize the calls with a lock")
        self._busy_thread = threading.get_ident()

    def _leave(self) -> None:
        self._busy_thread = None
        self._busy.release()

    # ----------------------------------------------------------------- call
    def __call__(self, **inputs: torch.Tensor) -> Any:
        """``runner(**inputs)``: same as :meth:`run` with the runner's ``copy_outputs``."""
        return self.run(inputs)

    def run(self, inputs: Mapping[str, torch.Tensor], copy_outputs: Optional[bool] = None) -> Any:
        """Serve one batch: validate, pick a bucket, copy + pad, replay, slice.

        ``inputs`` maps every declared name to a ``(n, *trailing)`` tensor of
        the declared dtype (any device; copied into the static buffers). The
        result has the structure ``step`` returns, each batch-major tensor
        sliced to ``n`` rows. After a replay they are views of static memory
        that the next call overwrites, unless ``copy_outputs`` (default: the
        runner's setting) is true. Raises ``ValueError``/``TypeError`` for
        invalid inputs and, with ``fallback="error"``, when no bucket fits;
        the runner stays usable. Raises :class:`CaptureError` before
        :meth:`capture` (or after :meth:`cleanup`). Every input is validated
        (names, dtype, shape, a real device, no aliasing of the runner's own
        static buffers) before anything is written; a copy that still fails
        resets the static buffers to their pad values and raises
        :class:`GraphRunnerError`. Raises :class:`GraphRunnerError` when
        another call of this runner is in progress (another thread, or from
        inside ``step``). See the class docstring for multi-rank agreement.
        """
        if not self._captured:
            if self._cleaned_up:
                raise CaptureError("GraphRunner called after cleanup(): its graphs were released; call "
                                   "runner.capture() again before serving")
            raise CaptureError("GraphRunner called before capture(): call runner.capture() once first")
        self._enter("run()")
        try:
            return self._run(inputs, copy_outputs)
        finally:
            self._leave()

    def _run(self, inputs: Mapping[str, torch.Tensor], copy_outputs: Optional[bool]) -> Any:
        self._calls += 1
        # -- validate (fast path: one pass; any mismatch goes to the slow diagnosis)
        n = -1
        try:
            if len(inputs) != self._n_inputs:
                raise KeyError
            tensors = [inputs[name] for name in self._names]
            lo_all, hi_all = self._span
            for name, t, (dtype, trailing, ndim), own in zip(self._names, tensors, self._checks, self._ranges):
                shape = t.shape
                if t.dtype != dtype or len(shape) != ndim or shape[1:] != trailing or not isinstance(t, _Tensor):
                    raise KeyError
                if shape[0] != n:
                    if n >= 0:
                        raise KeyError
                    n = shape[0]
                ptr = t.data_ptr()  # must hold data (not meta) and not point into a static buffer
                if ptr == 0:
                    if t.is_meta:
                        raise KeyError
                elif lo_all <= ptr < hi_all and (ptr != own[0] or not t.is_contiguous()):
                    # Between the static buffers' addresses and not exactly its own
                    # rows [0, n) (a harmless no-op copy): the slow path decides.
                    if self._alias_error(name, t) is not None:
                        raise KeyError
            if n <= 0:
                raise KeyError
        except (KeyError, TypeError, AttributeError):
            err = self._input_error(inputs)
            if self._agree:
                self._agree_invalid()
            raise err from None
        if copy_outputs is None:
            copy_outputs = self.copy_outputs
        # -- choose
        if self._agree:
            return self._run_agreed(tensors, n, copy_outputs)
        b = self._table[n] if n <= self.max_batch else None
        if b is None or not self._replayable[b]:
            reason = "over_max_bucket" if n > self.max_batch else ("padding_ratio" if b is None else "cannot_replay")
            return self._fallback(tensors, n, n, reason, copy_outputs)
        return self._replay_bucket(tensors, n, b, copy_outputs)

    def _stage(self, tensors: List[torch.Tensor], n: int) -> None:
        """Copy the (validated) inputs into rows ``[0, n)`` of the static
        buffers. If a copy fails, every buffer is reset to its pad value
        (no half-written rows stay behind) and :class:`GraphRunnerError`
        names the input."""
        views = self._in_views[n]
        if views is None:
            views = self._in_views[n] = [buf[:n] for buf, _ in self._pads]
        i = 0
        try:
            for i, (v, t) in enumerate(zip(views, tensors)):
                # detach: a copy from a tensor that requires grad would chain an
                # autograd history onto the static buffer at every call.
                v.copy_(t.detach() if t.requires_grad else t)
        except Exception as exc:
            self._restore_pads(max(self._filled, n))
            t = tensors[i]
            raise GraphRunnerError(
                f"GraphRunner: copying input {self._names[i]!r} ({type(t).__name__} of shape {list(t.shape)}, "
                f"{t.dtype}, on {t.device}) into its static buffer failed: {type(exc).__name__}: {exc}. Nothing "
                "was replayed and the static buffers were reset to their pad values; the runner is still usable"
            ) from exc

    def _restore_pads(self, rows: int) -> None:
        """Set rows ``[0, rows)`` of every static buffer to its pad value."""
        for buf, pad in self._pads:
            buf[:rows].fill_(pad)
        self._filled = 0

    def _replay_bucket(self, tensors: Optional[List[torch.Tensor]], n: int, b: int, copy_outputs: bool) -> Any:
        """Copy (unless ``tensors`` is None: already staged), pad rows ``[n, b)``, replay ``b``, slice."""
        if tensors is not None:
            self._stage(tensors, n)
        filled = self._filled
        if filled > n:  # rows [n, filled) may hold an earlier call's data: pad rows [n, b)
            pv = self._pad_views.get((n, b))
            if pv is None:
                pv = self._pad_views[(n, b)] = [(buf[n:b], pad) for buf, pad in self._pads]
            for view, pad in pv:
                view.fill_(pad)
            self._filled = filled if filled > b else n
        else:
            self._filled = n
        try:
            result = self._replay(b)
        except Exception as exc:  # a failed collective on a multi-rank runner: RankTimeoutError
            err = RankTimeoutError.from_step(exc, self.group, "replay", b)
            if err is None:
                raise
            raise err from exc
        stats = self.stats
        stats.replays[b] += 1
        stats.padding_rows += b - n
        stats.real_rows += n
        stats.last_bucket = b
        if self._cache_outputs:
            out = self._out_n[n]
            if out is None:
                out = self._cache_output(n, result)
            if self._out_spec is not None:
                out = _unflatten_out(self._out_spec, out)
        else:
            out = _slice_rows(result, n)
        if copy_outputs:
            return _clone(out)
        return out

    def _cache_output(self, n: int, result: Any) -> Any:
        """Cache the ``n``-row views of the shared output buffer. Every bucket's
        outputs are leading-rows views of the backend's one buffer, so the
        ``n``-row view is the same tensor whichever bucket replayed."""
        spec, leaves = _flatten_out(result)
        sliced = [t[:n] if t.dim() >= 1 else t for t in leaves]
        if spec == ("T",):
            self._out_spec = None
            out: Any = sliced[0]
        else:
            self._out_spec = spec
            out = sliced
        self._out_n[n] = out
        return out

    def _run_agreed(self, tensors: List[torch.Tensor], n: int, copy_outputs: bool) -> Any:
        group, key = self.group, self._calls
        # Copy before agreeing, so that a copy that fails is reported to every
        # rank by the agreement itself (as invalid inputs) instead of leaving
        # this rank out of the step's collectives.
        if n <= self.max_batch:
            try:
                self._stage(tensors, n)
            except GraphRunnerError:
                self._agree_invalid()
                raise
            if self._filled < n:
                self._filled = n  # rows [0, n) now hold this call's data, whatever the agreement decides
        big_n = group.all_max(n, phase="runner_batch", key=key)
        b = self._table[big_n] if big_n <= self.max_batch else None
        code = 1 if (b is not None and self._replayable[b]) else 0
        agreed = group.all_min(code, phase="runner_eligible", key=key)
        if agreed < 0:
            raise GraphRunnerError(
                f"rank {self.rank}: another rank passed invalid inputs at call {key}, so every rank skipped this "
                "step (see that rank's error); the runner is still usable"
            )
        if agreed == 1:
            return self._replay_bucket(None, n, b, copy_outputs)
        if big_n > self.max_batch:
            reason = "over_max_bucket"
        elif b is None:
            reason = "padding_ratio"
        else:
            reason = "cannot_replay"
        return self._fallback(tensors, n, big_n, reason, copy_outputs)

    def _agree_invalid(self) -> None:
        """This rank's inputs were invalid: still take part in the call's two
        collectives (so peers do not hang) and tell them to skip the step."""
        key = self._calls
        self.group.all_max(0, phase="runner_batch", key=key)
        self.group.all_min(-1, phase="runner_eligible", key=key)

    def _fallback(self, tensors: List[torch.Tensor], n: int, rows: int, reason: str, copy_outputs: bool) -> Any:
        if self.fallback == "error":
            where = f"the agreed batch {rows} (max over ranks; this rank has {n})" if rows != n else f"batch {n}"
            if reason == "over_max_bucket":
                why = f"{where} exceeds the largest bucket {self.max_batch}"
            elif reason == "padding_ratio":
                b = self.buckets[next(i for i, x in enumerate(self.buckets) if x >= rows)]
                why = (f"{where} would pad bucket {b} with {b - rows} rows, more than max_padding_ratio="
                       f"{self.max_padding_ratio}")
            else:
                why = f"bucket for {where} cannot be replayed on every rank"
            raise ValueError(f"GraphRunner(fallback='error'): {why}; add a bucket, raise max_padding_ratio, "
                             "or use fallback='eager'")
        kwargs: Dict[str, torch.Tensor] = {}
        dev = self.torch_device
        for (name, spec), t in zip(self.inputs.items(), tensors):
            if rows != n:
                p = torch.full((rows, *spec.trailing), spec.pad, dtype=spec.dtype, device=dev)
                p[:n].copy_(t)
                t = p
            elif t.device != dev:
                t = t.to(dev)
            kwargs[name] = t
        try:
            with self._grad_ctx():
                out = self.step(**kwargs)
        except Exception as exc:  # a failed collective on a multi-rank runner: RankTimeoutError
            err = RankTimeoutError.from_step(exc, self.group, "fallback", rows)
            if err is None:
                raise
            raise err from exc
        if rows != n:
            out = _slice_rows(out, n)
        stats = self.stats
        stats.fallbacks += 1
        stats.fallback_reasons[reason] = stats.fallback_reasons.get(reason, 0) + 1
        stats.padding_rows += rows - n
        stats.real_rows += n
        stats.last_bucket = None
        logger.debug("GraphRunner: eager fallback (%s) for batch %d (rows %d)", reason, n, rows)
        return _clone(out) if copy_outputs else out

    def _alias_error(self, name: str, t: torch.Tensor) -> Optional[Exception]:
        """The error for an input whose memory starts inside one of the
        runner's static buffers (other than exactly its own rows ``[0, n)``),
        else ``None``. Copying from such a tensor would read rows that this
        same call overwrites."""
        ptr = t.data_ptr()
        for (lo, hi), other in zip(self._ranges, self._names):
            if lo <= ptr < hi and not (other == name and ptr == lo and t.is_contiguous()):
                return ValueError(
                    f"GraphRunner: input {name!r} aliases the runner's static buffer of input {other!r} (a view of "
                    f"runner.static_inputs[{other!r}] or of its memory): the call would overwrite what it reads. "
                    "Pass a separate tensor (e.g. .clone())")
        return None

    def _input_error(self, inputs: Any) -> Exception:
        """Diagnose invalid call inputs (slow path) and return the error to raise."""
        if not isinstance(inputs, Mapping):
            return TypeError(f"GraphRunner inputs must be passed as keywords {list(self._names)}, got {type(inputs).__name__}")
        missing = [k for k in self._names if k not in inputs]
        extra = [k for k in inputs if k not in self.inputs]
        if missing or extra:
            parts = []
            if missing:
                parts.append(f"missing input(s) {missing}")
            if extra:
                parts.append(f"unexpected input(s) {extra}")
            return ValueError(f"GraphRunner: {' and '.join(parts)}; the step takes exactly {list(self._names)}")
        n = None
        first = None
        for name, spec in self.inputs.items():
            t = inputs[name]
            if not isinstance(t, torch.Tensor):
                return TypeError(f"GraphRunner: input {name!r} must be a torch.Tensor, got {type(t).__name__}")
            if t.dtype != spec.dtype:
                return ValueError(f"GraphRunner: input {name!r} has dtype {t.dtype}, expected {spec.dtype}; "
                                  f"convert it with .to({spec.dtype})")
            if t.dim() != len(spec.trailing) + 1 or tuple(t.shape[1:]) != spec.trailing:
                return ValueError(f"GraphRunner: input {name!r} has shape {list(t.shape)}, expected "
                                  f"[batch, {', '.join(map(str, spec.trailing))}]".replace(", ]", "]")
                                  + f" (trailing shape {spec.trailing})")
            if t.is_meta:
                return ValueError(f"GraphRunner: input {name!r} is on the meta device (shape only, no data); "
                                  "pass a tensor that holds its values")
            err = self._alias_error(name, t)
            if err is not None:
                return err
            if n is None:
                n, first = t.shape[0], name
            elif t.shape[0] != n:
                return ValueError(f"GraphRunner: input {name!r} has batch {t.shape[0]} but input {first!r} has "
                                  f"batch {n}; all inputs share dim 0")
        if n == 0:
            return ValueError("GraphRunner: batch 0 (every input has 0 rows); call the runner only with >= 1 row")
        return ValueError("GraphRunner: invalid inputs")  # pragma: no cover - the fast check found a mismatch


def _slice_rows(out: Any, n: int) -> Any:
    if isinstance(out, torch.Tensor):
        return out[:n] if out.dim() >= 1 else out
    spec, leaves = _flatten_out(out)
    return _unflatten_out(spec, [t[:n] if t.dim() >= 1 else t for t in leaves])


def _clone(out: Any) -> Any:
    if isinstance(out, torch.Tensor):
        return out.clone()
    if out is None:
        return None
    spec, leaves = _flatten_out(out)
    return _unflatten_out(spec, [t.clone() for t in leaves])
