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
together). Keys with several named dims, the key choice, padding regions and
the agreement vector live in :mod:`graphrunner.keys`; the cross-rank capture
check in :mod:`graphrunner.fingerprint`. See ``docs/runner.md``.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import torch

from graphrunner.backends.base import GraphBackend
from graphrunner.backends.outputs import flatten as _flatten_out
from graphrunner.backends.outputs import unflatten as _unflatten_out
from graphrunner.buckets import default_buckets
from graphrunner import fingerprint
from graphrunner._pytree import describe
from graphrunner.errors import CaptureError, GraphRunnerError, PaddingLeakError, RankTimeoutError
from graphrunner.inputs import BatchInput, alias_error, diagnose
from graphrunner.keys import (CANNOT, LEGACY_DIM, KeySpace, agree, all_max_vector,
                              count_leaves, padding_regions, region, resolve_input_dims, resolve_output_dims,
                              slice_leaves)
from graphrunner import contracts
from graphrunner.leaks import LeakCheck, check_sizes, exempt_prefixes
from graphrunner.progress import CaptureProgress
from graphrunner.report import BucketReport, CaptureReport

__all__ = ["GraphRunner", "BatchInput", "RunnerStats", "default_buckets"]

logger = logging.getLogger("graphrunner")

_Tensor = torch.Tensor
_BACKENDS = ("full", "breakable", "eager")
_FALLBACKS = ("eager", "error")


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
                  drift_check: Optional[bool] = None, output_arena: Any = None) -> Any:
    if isinstance(backend, str):
        from graphrunner.backends import BreakableGraphBackend, EagerBackend, FullGraphBackend

        classes = {"full": FullGraphBackend, "breakable": BreakableGraphBackend, "eager": EagerBackend}
        if backend not in classes:
            raise ValueError(f"unknown backend {backend!r}: expected one of {_BACKENDS} or a backend instance")
        drift = True if drift_check is None else drift_check
        if backend == "eager":  # no graphs, no output buffer: the arena has nothing to hold
            return classes[backend](device=device, group=group, warmups=warmups, trace=trace, drift_check=drift)
        return classes[backend](device=device, group=group, warmups=warmups, trace=trace, drift_check=drift,
                                output_arena=output_arena)
    if output_arena is not None and output_arena is not getattr(backend, "output_arena", None):
        raise ValueError("output_arena= was given together with a backend instance that does not use it; "
                         "pass output_arena= to the backend instead")
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
            <graphrunner.buckets.default_buckets>` (one dim, the batch; int
            keys), or ``{dim: [sizes...]}`` for keys with several named dims
            (tuple keys in the dict's order), e.g. ``{"reqs": [1, 2, 4, 8],
            "draft": [1, 2, 4]}``; each input then declares
            ``BatchInput(dims=...)``. See :mod:`graphrunner.keys`.
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
            overridden per call with :meth:`run`. ``None`` (default) means
            ``False``, or ``True`` with an ``output_arena``.
        progress: draw a capture progress bar on rank 0 (stderr).
        agree_bucket: with a multi-rank group, agree the bucket across ranks
            on every call (default). ``False`` is UNSAFE, for tests only:
            ranks may replay different buckets and their collectives then
            mismatch (hang or garbage).
        inference_mode: run capture and eager fallbacks under
            ``torch.inference_mode()`` (default ``True``).
        outputs: the leading dims of the outputs, sliced on every one of
            them: a dims tuple for every tensor of the output, or ``{key:
            dims}`` for a dict output (``()`` returns that output whole).
            Unlisted keys and ``None`` take the first input's dims.
        keys: ``None`` (capture every combination of buckets) or a list of
            keys to capture; it must include the key that covers all others.
            A call takes the smallest captured key covering its sizes, else
            it falls back.
        output_arena: a :class:`graphrunner.OutputArena` shared with other
            runners of the same model (decode, verify, prefill): their
            output buffers are one memory, the max over runners instead of
            the sum. A replay of any of them overwrites the others' output
            views, so outputs are copies by default (``copy_outputs``).
        drift_check: compare the op stream of the last warmup with the
            capture's and raise :class:`~graphrunner.errors.CaptureError` on
            a difference (Python state a graph would freeze; see
            :mod:`graphrunner.drift`). ``None`` (default): on, or the
            backend instance's setting; ``False`` turns it off.
        leak_check: run the padding-leak check at capture (default ``True``;
            :mod:`graphrunner.leaks`): for every key a smaller call can
            replay, one extra eager forward after the last warmup with the
            padding cells of the floating-point inputs changed; a real
            output cell that changes raises
            :class:`~graphrunner.errors.PaddingLeakError`. The user's
            ``post_warmup_hook`` also runs before and after that forward.
        leak_check_exempt: outputs the leak check does not compare, meant
            to read the whole padded batch: dict output keys (``("total",)``)
            or output paths as the error spells them (``"output[1]"``).
        debug: debug mode (:mod:`graphrunner.contracts`); ``None`` (default)
            reads ``GRAPHRUNNER_DEBUG=1``. Every call then checks each
            input's ``BatchInput(bounds=...)`` (``ValueError`` naming input,
            row and value) and, before each replay, that every external
            tensor the graph reads (weights, buffers, KV cache; recorded in
            the last warmup of each key) keeps its storage, shape and
            strides (:class:`~graphrunner.errors.ContractError` naming its
            module path); the capture report lists the externals the graphs
            write. Off, none of it runs.

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
    trailing shapes and common sizes ``>= 1`` in every dim (``ValueError``/
    ``TypeError`` naming the input; the runner stays usable); pick the
    smallest captured key covering the sizes (with ``buckets=[...]``: the
    smallest bucket ``b >= n``); copy the inputs into the leading region of
    the static buffers and set the rest of the key's region to each input's
    pad value (where an earlier call left data); replay the key; return the
    outputs sliced to the sizes on their declared dims. No device sync.

    **Multi-rank agreement** (group with ``size > 1`` and
    ``agree_bucket=True``): each call makes exactly one collective on
    ``group`` and no other group traffic: ``group.all_max_vector([*sizes,
    invalid])`` (:func:`graphrunner.keys.agree`). The key is chosen from the
    agreed sizes; all ranks then replay it, or all fall back eagerly with
    their inputs padded to the agreed sizes so that collectives inside
    ``step`` see equal shapes (no key, padding ratio, or a key some rank
    cannot replay: exchanged once at capture), or all raise (``invalid``:
    the invalid rank its own error, the others
    :class:`~graphrunner.errors.GraphRunnerError`). An agreed size below
    this rank's own raises :class:`~graphrunner.keys.AgreementError`.
    :meth:`capture` first compares the ranks' configuration and then each
    captured key (:mod:`graphrunner.fingerprint`), raising
    :class:`~graphrunner.errors.CaptureError` on every rank on any
    difference. Size-1 groups make no group calls at all.
    """

    #: Exchange the capture fingerprint across ranks (False is UNSAFE, for the tests'
    #: negative controls only: mismatched ranks then replay mismatched graphs silently).
    _check_fingerprint = True

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
        copy_outputs: Optional[bool] = None,
        progress: bool = True,
        agree_bucket: bool = True,
        inference_mode: bool = True,
        outputs: Any = None,
        keys: Optional[Sequence[Any]] = None,
        output_arena: Any = None,
        drift_check: Optional[bool] = None,
        leak_check: bool = True,
        leak_check_exempt: Sequence[str] = (),
        debug: Optional[bool] = None,
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
        if fallback not in _FALLBACKS:
            raise ValueError(f"fallback must be one of {_FALLBACKS}, got {fallback!r}")
        self._space = KeySpace(buckets, keys, max_padding_ratio)
        space = self._space
        #: ``buckets`` as given: a list (one dim, int keys) or ``{dim: [sizes...]}`` (tuple keys).
        self.buckets: Any = space.buckets[LEGACY_DIM] if space.legacy else {d: list(v) for d, v in space.buckets.items()}
        #: The runner's dim names, in key order (``("batch",)`` with ``buckets=[...]``).
        self.dims: Tuple[str, ...] = space.dims
        #: Every key captured, smallest first (ints with ``buckets=[...]``, else tuples).
        self.keys: List[Any] = [space.external(k) for k in space.keys]
        self.max_padding_ratio = space.max_padding_ratio
        self._in_dims = resolve_input_dims(inputs, space)
        self._out_dims = resolve_output_dims(outputs, self._in_dims[next(iter(inputs))], space)
        self.leak_check = bool(leak_check)
        self._leak_exempt = exempt_prefixes(leak_check_exempt)
        #: Debug mode (``debug=`` or ``GRAPHRUNNER_DEBUG=1``): per-call contracts, see :mod:`graphrunner.contracts`.
        self.debug = contracts.debug_enabled(debug)
        self._bounded = tuple((i, n, s.bounds, len(self._in_dims[n])) for i, (n, s) in enumerate(inputs.items())
                              if s.bounds is not None)
        if post_warmup_hook is not None and not callable(post_warmup_hook):
            raise TypeError(f"post_warmup_hook must be callable as hook(bucket) or None, got {type(post_warmup_hook).__name__}")

        self.step = step
        self.inputs: Dict[str, BatchInput] = dict(inputs)
        self.fallback = fallback
        if output_arena is not None and not callable(getattr(output_arena, "carve", None)):
            raise TypeError(f"output_arena must be a gr.OutputArena or None, got {type(output_arena).__name__}")
        # views into a shared arena are overwritten by any runner on it: copies unless asked otherwise
        self.copy_outputs = (output_arena is not None) if copy_outputs is None else bool(copy_outputs)
        self.output_arena = output_arena
        self.progress = bool(progress)
        self.agree_bucket = bool(agree_bucket)
        self.inference_mode = bool(inference_mode)
        self.post_warmup_hook = post_warmup_hook
        self.backend = _make_backend(backend, device, group, warmups, trace, drift_check, output_arena)
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

        #: The largest bucket of the first dim (the batch with ``buckets=[...]``).
        self.max_batch = space.maxes[0]
        maxes = space.maxes
        tdev = getattr(self.device, "torch_device", torch.device("cpu"))
        self.torch_device = torch.device(tdev)
        with torch.inference_mode(False):  # normal tensors: writable outside inference mode
            self._buffers: Dict[str, torch.Tensor] = {
                name: torch.full((*(maxes[d] for d in self._in_dims[name]), *spec.trailing), spec.pad,
                                 dtype=spec.dtype, device=self.torch_device)
                for name, spec in self.inputs.items()
            }
        self._names = tuple(self.inputs)
        self._n_inputs = len(self._names)
        self._checks = tuple((s.dtype, s.trailing, len(s.trailing) + len(self._in_dims[n]), len(self._in_dims[n]),
                              self._in_dims[n]) for n, s in self.inputs.items())
        self._dim_idx = tuple(self._in_dims[n] for n in self._names)
        self._pads = tuple((self._buffers[n], s.pad) for n, s in self.inputs.items())
        # [start, end) byte address of every static buffer: an input that starts
        # inside one aliases the runner's own memory (checked before any write).
        self._ranges = tuple((buf.data_ptr(), buf.data_ptr() + buf.numel() * buf.element_size())
                             for buf, _ in self._pads)
        self._span = (min(lo for lo, _ in self._ranges), max(hi for _, hi in self._ranges))
        self._zero: Tuple[int, ...] = (0,) * len(self.dims)
        self._filled = self._zero  # outside [:_filled[0], :_filled[1], ...] every buffer holds its pad value
        self._in_views: Dict[Tuple[int, ...], List[torch.Tensor]] = {}  # sizes -> the inputs' real regions
        self._pad_views: Dict[Tuple[Any, ...], List[Tuple[torch.Tensor, Any]]] = {}  # (sizes, key) -> padding regions
        self.stats = RunnerStats(replays={k: 0 for k in self.keys})
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
        """The full static input buffers ``{name: (*largest key on its dims, *trailing)}``
        (``(max_batch, *trailing)`` with ``buckets=[...]``), for inspection; do not write them."""
        return dict(self._buffers)

    def bucket_for(self, batch: Any) -> Any:
        """The key a local call of ``batch`` replays, or ``None`` if it falls back
        (ignores multi-rank agreement and whether the key was captured).

        ``batch`` is the batch size (an int) with ``buckets=[...]``, else a
        tuple of sizes in :attr:`dims` order or a dict ``{dim: size}``.
        """
        sizes = self._sizes_of(batch)
        if sizes is None or min(sizes) < 1:
            return None
        key, _ = self._space.choose(sizes)
        return None if key is None else self._space.external(key)

    key_for = bucket_for

    def _sizes_of(self, batch: Any) -> Optional[Tuple[int, ...]]:
        if isinstance(batch, Mapping):
            unknown = [d for d in batch if d not in self.dims]
            if unknown or len(batch) != len(self.dims):
                raise ValueError(f"key_for: give one size per dim {self.dims}, got {dict(batch)!r}")
            return tuple(int(batch[d]) for d in self.dims)
        return self._space.internal(batch, what="key_for sizes")

    def __repr__(self) -> str:
        return (f"GraphRunner(backend={getattr(self.backend, 'name', type(self.backend).__name__)!r}, "
                f"buckets={self.buckets}, inputs={list(self._names)}, rank={self.rank}/{self.world_size}, "
                f"captured={self._captured})")

    def _grad_ctx(self):
        return torch.inference_mode() if self.inference_mode else contextlib.nullcontext()

    def _reset_replay_state(self) -> None:
        self._replayable: Dict[Tuple[int, ...], bool] = {}
        self._out_n: Dict[Tuple[int, ...], Any] = {}
        self._out_spec: Optional[tuple] = None
        self._last_output: Optional[str] = None  # the last captured forward's output, described
        self._out_trailing: Optional[List[Tuple[int, ...]]] = None
        self._cache_outputs = isinstance(self.backend, GraphBackend)
        self._replay = self.backend.replay
        self._guard: Optional[contracts.ExternalGuard] = None  # debug mode: checks externals before each replay

    # -------------------------------------------------------------- capture
    def _key_views(self, key: Tuple[int, ...]) -> Dict[str, torch.Tensor]:
        return {name: buf[region(key, self._in_dims[name])] for name, buf in self._buffers.items()}

    def _check_output(self, out: Any, key: Tuple[int, ...]) -> None:
        try:
            spec, leaves = _flatten_out(out, "step output")
        except TypeError as exc:
            raise _StepOutputError(
                f"step returned something that is not a pytree of tensors for {self._key_text(key)}: {exc}"
            ) from None
        idx = self._leaf_dims(spec, len(leaves))
        self._last_output = describe(spec, leaves)
        trailing = []
        for i, (t, dims) in enumerate(zip(leaves, idx)):
            want = tuple(key[d] for d in dims)
            if t.dim() == 0:
                trailing.append(())
                continue
            if tuple(t.shape[:len(want)]) != want:
                if self._space.legacy:
                    raise _StepOutputError(
                        f"step output tensor {i} has shape {list(t.shape)} for bucket {key[0]}: every output tensor "
                        f"must be batch-major (dim 0 == the {key[0]} input rows) or 0-dim, so the runner can slice "
                        "it to the real batch. Return per-row results, or compute batch-independent values outside "
                        "step.")
                names = tuple(self.dims[d] for d in dims)
                raise _StepOutputError(
                    f"step output tensor {i} has shape {list(t.shape)} for {self._key_text(key)}: its leading dims "
                    f"{names} (from outputs=) must be {list(want)}, so the runner can slice it to the real sizes. "
                    "Declare each output's leading dims with outputs= (a dims tuple, or {key: dims} for a dict).")
            trailing.append(tuple(t.shape[len(want):]))
        if self._out_trailing is None:
            self._out_trailing = trailing
        else:
            for i, (a, b) in enumerate(zip(self._out_trailing, trailing)):
                if a != b:
                    raise _StepOutputError(
                        f"step output tensor {i} has trailing shape {list(b)} after its leading dims for "
                        f"{self._key_text(key)}, but {list(a)} for the first key captured: only the dims declared "
                        "in outputs= may change between keys. Declare that dim in outputs=")

    def _leaf_dims(self, spec: tuple, n_leaves: int) -> List[Tuple[int, ...]]:
        """The runner-dim indices of the leading dims of every tensor leaf of an output with ``spec``."""
        default, per_key = self._out_dims
        if per_key and spec[0] == "dict":
            idx: List[Tuple[int, ...]] = []
            for k, child in zip(spec[2], spec[3]):
                idx.extend([per_key.get(k, default)] * count_leaves(child))
            return idx
        return [default] * n_leaves

    def _key_text(self, key: Tuple[int, ...]) -> str:
        return f"bucket {key[0]}" if self._space.legacy else f"key {key} ({self._space.describe(key)})"

    def _make_forward(self, key: Tuple[int, ...], views: Dict[str, torch.Tensor],
                      keep: Optional[List[Any]] = None,
                      record: Optional[contracts.KeyRecording] = None) -> Callable[[], Any]:
        step = self.step

        def forward() -> Any:
            out = step(**views) if record is None else record.call(lambda: step(**views))
            if self._capturing:
                self._check_output(out, key)
                if keep is not None:  # the leak check's reference: the last warmup's output
                    keep[0] = out
            return out

        forward.__qualname__ = f"GraphRunner.step[{'bucket' if self._space.legacy else 'key'}={self._space.external(key)}]"
        return forward

    def capture(self) -> CaptureReport:
        """Capture every key, largest first, and return a :class:`CaptureReport`.

        Runs inside one ``backend.capture_session()`` (garbage collected and
        frozen for its duration), under ``torch.inference_mode()`` unless
        disabled; all keys share the backend's pool and one output
        buffer. With a multi-rank group every rank must call ``capture()``
        (the protocol barriers). Draws a progress bar on rank 0 unless
        ``progress=False``. On any error the backend is cleaned up, the
        runner stays uncaptured, and the error propagates (a step output
        that is not a pytree of tensors with the declared leading dims as
        ``TypeError``, other failures as
        :class:`~graphrunner.errors.CaptureError` naming the key). Raises
        ``CaptureError`` if already captured (call :meth:`cleanup` first).
        """
        if self._captured:
            raise CaptureError("GraphRunner.capture() was already called; call runner.cleanup() before capturing again")
        self._enter("capture()")
        try:
            return self._capture()
        finally:
            self._leave()

    def _capture(self) -> CaptureReport:
        space = self._space
        order = space.capture_order()
        bar = CaptureProgress(len(order), enabled=self.progress and self.rank == 0)
        reports: List[BucketReport] = []
        t0 = time.perf_counter()
        ok = False
        self._capturing = True
        lead = max([len(self._out_dims[0])] + [len(v) for v in self._out_dims[1].values()])
        extra = {"lead_dims": lead} if lead > 1 else {}
        per_key: Dict[Any, List[contracts.External]] = {}
        storages = [b.untyped_storage().data_ptr() for b in self._buffers.values()]
        try:
            with self._grad_ctx(), self.backend.capture_session():
                check_fp = self._check_fingerprint and self.world_size > 1
                if check_fp:  # the first collective of the capture: before any barrier can mis-pair
                    fingerprint.check(self.group, self._config_fields(), "configurations", key="config")
                for i, key in enumerate(order):
                    ext = space.external(key)
                    bar.start(i, ext)
                    views = self._key_views(key)
                    hook = (functools.partial(self.post_warmup_hook, ext) if self.post_warmup_hook is not None else None)
                    keep: List[Any] = [None]
                    leak = self._leak_check_for(key, views, keep, hook)
                    rec = (contracts.KeyRecording(getattr(self.backend, "warmups", 0), storages)
                           if self.debug else None)
                    self.backend.capture_one(ext, self._make_forward(key, views, keep if leak else None, rec),
                                             capture_inputs=views,
                                             post_warmup_hook=leak.hook if leak is not None else hook, **extra)
                    keep[0] = None
                    info = dict(self.backend.info(ext))
                    if leak is not None:
                        info["leak_check_sizes"] = list(leak.sizes)
                        info["leak_check_seconds"] = leak.seconds
                    if rec is not None and rec.recorder is not None:
                        # named after the key's capture: what the warmups created lazily exists now
                        per_key[ext] = contracts.externals_of(rec.recorder, contracts.named_tensors(self.step))
                        info["externals_read"] = len(per_key[ext])
                        info["externals_written"] = [e.describe() for e in per_key[ext] if e.written]
                    if check_fp:
                        fingerprint.check(self.group, {
                            "output": self._last_output, "num_segments": info.get("num_segments"),
                            "num_breaks": info.get("num_breaks"), "tape_ops": info.get("num_ops")},
                            f"captures of key {ext!r}", key=ext)
                    reports.append(BucketReport(
                        bucket=ext,
                        capture_seconds=float(info.get("capture_seconds", 0.0)),
                        graph_capture_seconds=float(info.get("graph_capture_seconds", 0.0)),
                        num_segments=int(info.get("num_segments", 0)),
                        num_breaks=int(info.get("num_breaks", 0)),
                        bytes_held=int(info.get("bytes_held", 0)),
                        info=info,
                    ))
                self._replayable = self._agree_replayable()
            ok = True
        except CaptureError as exc:
            cause = exc.__cause__
            self._abort_capture()
            if isinstance(cause, _StepOutputError):
                raise TypeError(str(cause)) from None
            if isinstance(cause, PaddingLeakError):
                raise PaddingLeakError(str(cause)) from None
            raise
        except BaseException:
            self._abort_capture()
            raise
        finally:
            self._capturing = False
            bar.close(ok)
        self._captured = True
        if self.debug:
            self._guard = contracts.ExternalGuard(per_key, lambda k: self._key_text(self._space.internal(k)))
            if not self._agree:  # with agreement every key is checked before the agreement (_debug_checks)
                self._replay = self._guard.wrap(self.backend.replay)
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
            output_arena=self._arena_facts(),
            externals_written=self._guard.written() if self.debug else None,
        )
        logger.info("GraphRunner captured %d keys (%s) in %.3fs on rank %d", len(order),
                    self.report.backend, self.report.total_seconds, self.rank)
        return self.report

    def _arena_facts(self) -> Optional[Dict[str, Any]]:
        arena = self.output_arena
        if arena is None:
            return None
        return {"name": arena.name, "owners": arena.owners, "bytes_held": arena.bytes_held,
                "bytes_if_separate": arena.bytes_if_separate, "summary": arena.summary()}

    def _leak_check_for(self, key: Tuple[int, ...], views: Dict[str, torch.Tensor], keep: List[Any],
                        user_hook: Optional[Callable[[], Any]]) -> Optional[LeakCheck]:
        """The padding-leak check of ``key`` (:mod:`graphrunner.leaks`), or ``None`` when it is
        off, the backend does no warmups, no smaller call replays ``key`` or no input is floating-point."""
        warmups = getattr(self.backend, "warmups", 1)
        if not self.leak_check or not warmups:
            return None
        sizes = check_sizes(self._space, key)
        floats = [(n, views[n], self._in_dims[n]) for n, s in self.inputs.items() if s.dtype.is_floating_point]
        if sizes is None or not floats:
            return None
        step = self.step
        return LeakCheck(key, self._key_text(key), sizes, floats, lambda: step(**views), lambda: keep[0],
                         self._leaf_dims, self._leak_exempt, user_hook, warmups,
                         group=self.group if self.world_size > 1 else None, phase_key=self._space.external(key))

    def _config_fields(self) -> Dict[str, Any]:
        """What every rank must configure alike (the capture fingerprint, :mod:`graphrunner.fingerprint`)."""
        fp = self._space.fingerprint()
        fp["inputs"] = {n: {"dims": [self.dims[d] for d in self._in_dims[n]], "trailing": list(s.trailing),
                            "dtype": str(s.dtype), "pad": s.pad} for n, s in self.inputs.items()}
        default, per_key = self._out_dims
        fp["outputs"] = {"default": [self.dims[d] for d in default],
                         "per_key": {str(k): [self.dims[d] for d in v] for k, v in per_key.items()}}
        fp["backend"] = f"{type(self.backend).__module__}.{type(self.backend).__qualname__}"
        fp["warmups"] = getattr(self.backend, "warmups", None)
        fp["fallback"] = self.fallback
        fp["leak_check"] = self.leak_check  # its verdict is agreed by one collective per checked key
        return fp

    def _agree_replayable(self) -> Dict[Tuple[int, ...], bool]:
        """Which keys every rank can replay. With agreement on, one collective
        at the end of capture (a max over "cannot replay" bits, one per key),
        so that per call the agreed sizes alone decide replay or fallback."""
        keys = self._space.keys
        local = [bool(self.backend.can_run(self._space.external(k))) for k in keys]
        if self._agree:
            cannot = all_max_vector(self.group, [0 if ok else 1 for ok in local], "runner_replayable", "capture")
            local = [ok and not bad for ok, bad in zip(local, cannot)]
        return dict(zip(keys, local))

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
        sizes = [-1] * len(self.dims)
        try:
            if len(inputs) != self._n_inputs:
                raise KeyError
            tensors = [inputs[name] for name in self._names]
            lo_all, hi_all = self._span
            for name, t, (dtype, trailing, ndim, lead, didx), own in zip(self._names, tensors, self._checks,
                                                                         self._ranges):
                shape = t.shape
                if t.dtype != dtype or len(shape) != ndim or shape[lead:] != trailing or not isinstance(t, _Tensor):
                    raise KeyError
                for j, d in enumerate(didx):
                    v = shape[j]
                    if sizes[d] != v:
                        if sizes[d] >= 0:
                            raise KeyError
                        sizes[d] = v
                ptr = t.data_ptr()  # must hold data (not meta) and not point into a static buffer
                if ptr == 0:
                    if t.is_meta:
                        raise KeyError
                elif lo_all <= ptr < hi_all and (ptr != own[0] or not t.is_contiguous()):
                    # Between the static buffers' addresses and not exactly its own
                    # leading region (a harmless no-op copy): the slow path decides.
                    if self._alias_error(name, t) is not None:
                        raise KeyError
            if min(sizes) <= 0:
                raise KeyError
        except (KeyError, TypeError, AttributeError):
            err = self._input_error(inputs)
            if self._agree:
                self._agree_invalid()
            raise err from None
        if self.debug:
            self._debug_checks(tensors)
        if copy_outputs is None:
            copy_outputs = self.copy_outputs
        sz = tuple(sizes)
        # -- choose
        if self._agree:
            return self._run_agreed(tensors, sz, copy_outputs)
        key, reason = self._space.choose(sz)
        if key is None or not self._replayable[key]:
            return self._fallback(tensors, sz, sz, reason or CANNOT, copy_outputs)
        return self._replay_key(tensors, sz, key, copy_outputs)

    def _debug_checks(self, tensors: List[torch.Tensor]) -> None:
        """Debug mode, before anything is written: the ``ValueError`` for the first input outside
        its ``bounds``; with agreement also every key's externals (the key is not known yet, and a
        rank must not raise after its peers agreed to replay). Either failure takes part in the
        call's one collective as invalid, so peers raise too instead of hanging."""
        try:
            for i, name, bounds, lead in self._bounded:
                err = contracts.bounds_error(name, tensors[i], bounds, lead)
                if err is not None:
                    raise err
            if self._agree and self._guard is not None:
                for k in self._guard.per_key:
                    self._guard.check(k)
        except (ValueError, GraphRunnerError):
            if self._agree:
                self._agree_invalid()
            raise

    def _stage(self, tensors: List[torch.Tensor], sizes: Tuple[int, ...]) -> None:
        """Copy the (validated) inputs into the leading region ``sizes`` of the
        static buffers. If a copy fails, every buffer is reset to its pad value
        (no half-written cells stay behind) and :class:`GraphRunnerError`
        names the input."""
        views = self._in_views.get(sizes)
        if views is None:
            views = self._in_views[sizes] = [buf[region(sizes, didx)] for (buf, _), didx in
                                             zip(self._pads, self._dim_idx)]
        i = 0
        try:
            for i, (v, t) in enumerate(zip(views, tensors)):
                # detach: a copy from a tensor that requires grad would chain an
                # autograd history onto the static buffer at every call.
                v.copy_(t.detach() if t.requires_grad else t)
        except Exception as exc:
            self._restore_pads(tuple(map(max, self._filled, sizes)))
            t = tensors[i]
            raise GraphRunnerError(
                f"GraphRunner: copying input {self._names[i]!r} ({type(t).__name__} of shape {list(t.shape)}, "
                f"{t.dtype}, on {t.device}) into its static buffer failed: {type(exc).__name__}: {exc}. Nothing "
                "was replayed and the static buffers were reset to their pad values; the runner is still usable"
            ) from exc
        filled = self._filled
        self._filled = sizes if filled == self._zero else tuple(map(max, filled, sizes))

    def _restore_pads(self, extent: Tuple[int, ...]) -> None:
        """Set the leading region ``extent`` (all that may hold data) of every static buffer to its pad value."""
        for (buf, pad), didx in zip(self._pads, self._dim_idx):
            buf[region(extent, didx)].fill_(pad)
        self._filled = self._zero

    def _refill(self, sizes: Tuple[int, ...], key: Tuple[int, ...]) -> None:
        """Cells inside ``key`` but outside ``sizes`` may hold an earlier call's
        data (``_filled`` exceeds ``sizes`` in some dim): set them to the pad value."""
        pv = self._pad_views.get((sizes, key))
        if pv is None:
            pv = self._pad_views[(sizes, key)] = [
                (buf[r], pad) for (buf, pad), didx in zip(self._pads, self._dim_idx)
                for r in padding_regions(sizes, key, didx)]
        for view, pad in pv:
            view.fill_(pad)
        filled = self._filled
        # Outside ``key`` earlier data may remain: keep the bounding box.
        self._filled = sizes if all(f <= k for f, k in zip(filled, key)) else tuple(map(max, filled, sizes))

    def _replay_key(self, tensors: Optional[List[torch.Tensor]], sizes: Tuple[int, ...], key: Tuple[int, ...],
                    copy_outputs: bool) -> Any:
        """Copy (unless ``tensors`` is None: already staged), pad ``key`` outside ``sizes``, replay ``key``, slice."""
        if tensors is not None:
            self._stage(tensors, sizes)
        if self._filled != sizes:
            self._refill(sizes, key)
        ext = self._space.external(key)
        try:
            result = self._replay(ext)
        except Exception as exc:  # a failed collective on a multi-rank runner: RankTimeoutError
            err = RankTimeoutError.from_step(exc, self.group, "replay", ext)
            if err is None:
                raise
            raise err from exc
        stats = self.stats
        stats.replays[ext] += 1
        real = math.prod(sizes)
        stats.padding_rows += math.prod(key) - real
        stats.real_rows += real
        stats.last_bucket = ext
        if self._cache_outputs:
            out = self._out_n.get(sizes)
            if out is None:
                out = self._cache_output(sizes, result)
            if self._out_spec is not None:
                out = _unflatten_out(self._out_spec, out)
        else:
            out = self._slice_out(result, sizes)
        if copy_outputs:
            return _clone(out)
        return out

    def _cache_output(self, sizes: Tuple[int, ...], result: Any) -> Any:
        """Cache the ``sizes`` views of the shared output buffer. Every key's
        outputs are leading-corner views of the backend's one buffer, so the
        ``sizes`` view is the same tensor whichever key replayed."""
        spec, leaves = _flatten_out(result)
        sliced = slice_leaves(leaves, self._leaf_dims(spec, len(leaves)), sizes)
        if spec == ("T",):
            self._out_spec = None
            out: Any = sliced[0]
        else:
            self._out_spec = spec
            out = sliced
        self._out_n[sizes] = out
        return out

    def _slice_out(self, out: Any, sizes: Tuple[int, ...]) -> Any:
        """``out`` with every tensor leaf sliced to ``sizes`` on its declared leading dims."""
        spec, leaves = _flatten_out(out)
        sliced = slice_leaves(leaves, self._leaf_dims(spec, len(leaves)), sizes)
        return sliced[0] if spec == ("T",) else _unflatten_out(spec, sliced)

    def _run_agreed(self, tensors: List[torch.Tensor], sizes: Tuple[int, ...], copy_outputs: bool) -> Any:
        call = self._calls
        # Copy before agreeing, so that a copy that fails is reported to every
        # rank by the agreement itself (as invalid inputs) instead of leaving
        # this rank out of the step's collectives.
        if all(n <= m for n, m in zip(sizes, self._space.maxes)):
            try:
                self._stage(tensors, sizes)
            except GraphRunnerError:
                self._agree_invalid()
                raise
        agreed, invalid = agree(self.group, sizes, False, call)
        if invalid:
            raise GraphRunnerError(
                f"rank {self.rank}: another rank passed invalid inputs at call {call}, so every rank skipped this "
                "step (see that rank's error); the runner is still usable"
            )
        key, reason = self._space.choose(agreed)
        if key is not None and self._replayable[key]:
            return self._replay_key(None, sizes, key, copy_outputs)
        return self._fallback(tensors, sizes, agreed, reason or CANNOT, copy_outputs)

    def _agree_invalid(self) -> None:
        """This rank's inputs were invalid: still take part in the call's one
        collective (so peers do not hang) and tell them to skip the step."""
        agree(self.group, self._zero, True, self._calls)

    def _fallback(self, tensors: List[torch.Tensor], sizes: Tuple[int, ...], rows: Tuple[int, ...], reason: str,
                  copy_outputs: bool) -> Any:
        space = self._space
        if self.fallback == "error":
            raise ValueError(f"GraphRunner(fallback='error'): {space.why(sizes, rows, reason)}; "
                             + ("add a bucket" if space.legacy else "add a bucket or key")
                             + ", raise max_padding_ratio, or use fallback='eager'")
        kwargs: Dict[str, torch.Tensor] = {}
        dev = self.torch_device
        for (name, spec), t, didx in zip(self.inputs.items(), tensors, self._dim_idx):
            if rows != sizes:
                p = torch.full((*(rows[d] for d in didx), *spec.trailing), spec.pad, dtype=spec.dtype, device=dev)
                p[region(sizes, didx)].copy_(t)
                t = p
            elif t.device != dev:
                t = t.to(dev)
            kwargs[name] = t
        ext_rows = space.external(rows)
        try:
            with self._grad_ctx():
                out = self.step(**kwargs)
        except Exception as exc:  # a failed collective on a multi-rank runner: RankTimeoutError
            err = RankTimeoutError.from_step(exc, self.group, "fallback", ext_rows)
            if err is None:
                raise
            raise err from exc
        if rows != sizes:
            out = self._slice_out(out, sizes)
        stats = self.stats
        stats.fallbacks += 1
        stats.fallback_reasons[reason] = stats.fallback_reasons.get(reason, 0) + 1
        real = math.prod(sizes)
        stats.padding_rows += math.prod(rows) - real
        stats.real_rows += real
        stats.last_bucket = None
        logger.debug("GraphRunner: eager fallback (%s) for %s (padded to %s)", reason, space.describe(sizes),
                     space.describe(rows))
        return _clone(out) if copy_outputs else out

    def _alias_error(self, name: str, t: torch.Tensor) -> Optional[Exception]:
        """The error for an input that starts inside a static buffer, else ``None`` (:func:`alias_error`)."""
        return alias_error(self._ranges, self._names, name, t)

    def _input_error(self, inputs: Any) -> Exception:
        """Diagnose invalid call inputs (slow path) and return the error to raise."""
        return diagnose(inputs, self.inputs, self._in_dims, self.dims, self._space.legacy, self._alias_error)


def _clone(out: Any) -> Any:
    if isinstance(out, torch.Tensor):
        return out.clone()
    if out is None:
        return None
    spec, leaves = _flatten_out(out)
    return _unflatten_out(spec, [t.clone() for t in leaves])
