"""The hook on transformers' continuous batching: :class:`GraphBatching`, which serves each step's forward from graphs.

transformers (>= 5) ships a continuous-batching engine: a scheduler that mixes
prefills and decodes of many requests in one varlen step, a paged KV cache
(:class:`~transformers.generation.continuous_batching.cache.PagedAttentionCache`)
and per-step metadata tensors (``cu_seq_lens_q/k``, ``read_index``,
``write_index``, ``logits_indices``, a block-diagonal attention mask). One
method runs the model for a step: ``ModelRunner.compute_batch(model,
batch_data)`` (forward, logits processors, sampling into ``output_ids``).

:class:`GraphBatching` puts a :class:`~graphrunner.hf.model_runner.GraphModelRunner`
(that class, built through its constructor) on the batch processor: it turns
each step's metadata into the graph step's inputs and asks
:meth:`GraphBatching.serve_step` for the logits, which transformers' own
``compute_batch`` then processes and samples. Everything else is transformers'
own code: the manager, the scheduler, the cache and its allocators,
``prepare_batch_tensors`` (which builds the metadata), the logits processors
and the sampler; the attention goes through transformers' attention dispatch
(:mod:`~graphrunner.hf.attention`), and the few transformers internals used
stand in :mod:`~graphrunner.hf.internals`. The forward of
each varlen step goes through one :class:`graphrunner.GraphRunner` with three
named dims, ``tokens`` (query tokens), ``kv`` (keys read, per attention type,
the longest of them) and ``reqs`` (requests), whose inputs are the step's
metadata, each declared with bounds and a pad (the write index of a padding
token is the allocator's write-trash slot, which no request owns). The
attention mask is not an input: the step builds it in the graph from integer
coordinates (each token's request and position, each key's request and
position) that are derived from transformers' ``cu_seq_lens`` and validated
against them at every call. See ``docs/continuous-batching.md``.

The parts: :mod:`~graphrunner.hf.refusals` (which models are served),
:mod:`~graphrunner.hf.batch_step` (the step, its dims and inputs),
:mod:`~graphrunner.hf.metadata` (the metadata checked at every call),
:mod:`~graphrunner.hf.planning` and :mod:`~graphrunner.hf.ladder` (the keys),
:mod:`~graphrunner.hf.equivalence` (the check after capture),
:mod:`~graphrunner.hf.options` (:class:`~graphrunner.hf.options.BatchingOptions`)
and :mod:`~graphrunner.hf.entrypoints` (``generate_batch``,
``init_continuous_batching``, ``release``); this module holds the hook and its stats.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import logging
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from graphrunner.devices import CudaDevice, get_device
from graphrunner.errors import CaptureError, GraphRunnerError, RankFailedError
from graphrunner.hf.attention import routed
from graphrunner.hf.batch_step import (
    CacheGroup,
    attends_per_request,
    batch_dims,
    cache_groups,
    for_dim,
    make_step,
    step_inputs,
)
from graphrunner.hf.equivalence import EquivalenceCheck
from graphrunner.hf.internals import fail_step, loop_goes_on, wrap_step_methods
from graphrunner.hf.ladder import ladder_keys, replan
from graphrunner.hf.metadata import check_trash
from graphrunner.hf.model_runner import GraphModelRunner
from graphrunner.hf.options import BatchingOptions
from graphrunner.hf.planning import plan_keys
from graphrunner.hf.refusals import RefusedError, check_served, refused
from graphrunner.pacing import rest_after
from graphrunner.runner import GraphRunner
from graphrunner.tape.jit import traces_at_first_replay
from graphrunner.tape.state import reuse_snapshot_buffers

if TYPE_CHECKING:
    from transformers import PreTrainedModel
    from transformers.generation.continuous_batching.continuous_api import (
        ContinuousBatchingManager,
        ContinuousBatchProcessor,
    )
    from transformers.generation.continuous_batching.input_outputs import ContinuousBatchingIOs

    from graphrunner.report import CaptureReport

__all__ = ["FAILED_STEPS_IN_A_ROW", "BatchingStats", "GraphBatching", "StepError"]

logger = logging.getLogger("graphrunner")

Keys = tuple[dict[str, list[int]], list[tuple[int, ...]]]

#: Why a manager that pads its inputs (transformers' own CUDA graphs or torch.compile) is refused.
_PADDED_MANAGER = (
    "the manager pads its inputs for its own CUDA graphs or torch.compile: build it with "
    "use_cuda_graph=False and no compile config (graphrunner captures the step)"
)


#: ``autocapture`` (a server's manager): a step that raises fails only its own requests, but this many steps
#: in a row that raise stop the engine (a device error that fails every step): transformers' generation
#: loop then fails every request, and ``graphrunner serve`` exits.
FAILED_STEPS_IN_A_ROW = 3


#: Several ranks: steps between two agreements on whether a re-plan's rest still runs (one collective each).
RECHECK_STEPS = 64


class StepError(GraphRunnerError):
    """What fails the requests of a step that raised, with ``autocapture``: the message names the step's
    exception (the engine serves on)."""


@dataclass
class BatchingStats:
    """What a :class:`GraphBatching` served: ``steps`` (forward steps), ``replayed`` (served by a graph),
    ``eager_steps`` (served eagerly: GraphRunner fallbacks, steps before capture, decode fast-path steps),
    ``real_tokens`` / ``padded_tokens`` (query tokens of replayed steps: real, and padding the graphs computed),
    ``real_keys`` / ``padded_keys`` (the same for the ``kv`` dim),
    ``graphs`` (keys captured), ``capture_seconds``, ``dry_run_seconds`` (the planning run of the scheduler),
    ``step_sizes`` (``(tokens, kv..., reqs)``: a size per dim of :func:`batch_dims`, of every varlen step seen, dry run included), ``engine_sizes``
    (the same steps as transformers' own graph keys count them: ``(query tokens, max_kv_read, max_length_k
    per attention type)``, unpadded), ``keys`` (the keys captured), ``equivalence_checked`` (keys the
    equivalence check replayed), ``replans`` (re-plans that took over) and ``failed_steps`` (``autocapture``:
    steps that raised, their requests failed)."""

    steps: int = 0
    replayed: int = 0
    eager_steps: int = 0
    real_tokens: int = 0
    padded_tokens: int = 0
    real_keys: int = 0
    padded_keys: int = 0
    graphs: int = 0
    capture_seconds: float = 0.0
    dry_run_seconds: float = 0.0
    step_sizes: list[tuple[int, ...]] = field(default_factory=list)
    engine_sizes: list[tuple[int, int, tuple[int, ...]]] = field(default_factory=list)
    keys: list[tuple[int, ...]] = field(default_factory=list)
    equivalence_checked: int = 0
    replans: int = 0
    failed_steps: int = 0


def _sync_io(bp: ContinuousBatchProcessor) -> ContinuousBatchingIOs:
    """``bp``'s inputs and outputs: synchronous batching's (asynchronous batching is refused at install)."""
    from transformers.generation.continuous_batching.input_outputs import ContinuousBatchingIOs

    io = bp.inputs_and_outputs
    if not isinstance(io, ContinuousBatchingIOs):
        raise CaptureError(
            "asynchronous batching double-buffers the step's inputs; run it with use_async_batching=False"
        )
    return io


def _declared(
    dims: tuple[str, ...], opts: BatchingOptions
) -> tuple[dict[str, list[int]] | None, list[tuple[int, ...]] | None]:
    """``(buckets, keys)`` as declared in ``opts`` for the model's ``dims`` (``kv`` given for every keys dim it
    stands for), ``None`` where they are planned; ``ValueError`` for ``buckets``, ``keys`` or ``max_graphs``
    that do not name ``dims``."""
    names = set(dims) | {"kv"}
    buckets, keys, max_graphs = opts.buckets, opts.keys, opts.max_graphs
    if buckets is not None:
        missing = [d for d in dims if for_dim(buckets, d, ()) == ()] if isinstance(buckets, dict) else list(dims)
        if not isinstance(buckets, dict) or set(buckets) - names or missing:
            raise ValueError(
                f"buckets must be a dict with the dims {list(dims)} (kv stands for a keys dim "
                f"not named), got {buckets!r}"
            )
    if max_graphs is not None:
        unknown = set(max_graphs) - names
        if unknown:
            raise ValueError(f"max_graphs names unknown dims {sorted(unknown)}; the dims are {list(dims)}")
    if keys is not None and any(len(k) != len(dims) for k in keys):
        raise ValueError(f"keys must be tuples of one size per dim {list(dims)}, got {list(keys)!r}")
    planned = None if buckets is None else {d: sorted(int(b) for b in for_dim(buckets, d)) for d in dims}
    return planned, None if keys is None else [tuple(int(v) for v in k) for k in keys]


class GraphBatching:
    """The graph-served step of one transformers ``ContinuousBatchingManager``.

    ``GraphBatching(model, options=BatchingOptions())``; :meth:`install` it on a manager
    (``model.init_continuous_batching(...)``) before the manager starts: it makes the manager's batch
    processor (``manager.warmup()``) and puts a :class:`~graphrunner.hf.model_runner.GraphModelRunner` on it,
    which serves every varlen step through :meth:`serve_step`: the forward through
    :attr:`runner` (a :class:`~graphrunner.GraphRunner` over the dims :attr:`dims`:
    ``tokens``, a keys dim per attention type (``kv``, and ``kv_sliding`` for a
    model that mixes sliding and full layers: :func:`~graphrunner.hf.batch_step.batch_dims`), ``reqs``) once
    :meth:`capture` has run, and eagerly before. Steps
    larger than every key take GraphRunner's eager fallback (counted in
    ``stats.eager_steps``). Everything but the forward (logits processors,
    sampling, scheduling) is transformers' own code.

    The options (:class:`~graphrunner.hf.options.BatchingOptions`, one object:
    ``buckets``, ``keys``, ``max_graphs``, ``backend``, ``device``, ``debug``,
    ``checks``, ``equivalence``, ``validate``, ``background``, ``autocapture``,
    ``replan_every``, ``replan_share``, ``attention``) say how the keys are planned (:meth:`plan`), captured
    (:meth:`capture`; in the background with ``background`` or
    ``autocapture``), checked (:class:`~graphrunner.hf.equivalence.EquivalenceCheck`
    after a blocking capture) and served (every step's metadata checked by
    :func:`~graphrunner.hf.metadata.step_feeds` unless ``validate=False``).
    With ``autocapture`` the background capture starts at :meth:`install` (the model loaded, before any
    request), over keys from
    :func:`graphrunner.hf.ladder.ladder_keys` (``buckets``/``keys`` when given),
    and every ``replan_every`` steps (0: never) the keys are re-planned from the
    recent step sizes (:func:`graphrunner.hf.ladder.replan`); the manager's
    cache-writing and sampling work never runs beside a key's capture, and a step that raises fails
    only its own requests (:class:`StepError` naming the exception; ``stats.failed_steps``) while the engine
    serves on, up to :data:`FAILED_STEPS_IN_A_ROW` steps in a row (then transformers stops the engine).
    Raises ``ValueError`` for ``buckets``, ``keys`` or ``max_graphs`` that do not
    name the model's dims, :class:`~graphrunner.errors.CaptureError` at
    :meth:`install` for a model :func:`~graphrunner.hf.refusals.refusal` refuses
    and at capture for padding tokens that would write a real cache slot."""

    def __init__(self, model: PreTrainedModel, options: BatchingOptions | None = None) -> None:
        opts = BatchingOptions() if options is None else options
        #: The step's dims: ``tokens``, one keys dim per attention type, ``reqs``
        #: (:func:`~graphrunner.hf.batch_step.batch_dims`).
        self.dims = batch_dims(model)
        self.model = model
        #: How the graphs are planned, captured, checked and served.
        self.options = opts
        #: The declared buckets per dim (``kv`` given for every keys dim it stands for), or ``None``: planned.
        self.buckets, self.keys = _declared(self.dims, opts)
        # the recent step sizes a re-plan reads (autocapture)
        self._window: collections.deque[tuple[int, ...]] = collections.deque(maxlen=4 * max(opts.replan_every, 256))
        self._since_plan = 0
        self._replan_due = False
        self._capture_began: float | None = None
        #: No re-plan starts before this ``time.perf_counter()``: the rest after the last background
        #: capture (:func:`graphrunner.pacing.rest_after`, ``replan_share``).
        self._rest_until = 0.0
        #: A re-plan's runner while its keys are captured (the current one serves meanwhile).
        self._pending: GraphRunner | None = None
        self._pending_began = 0.0
        self._recording = False
        # runners whose idle ticks ended (several ranks: an agreed capture failure); weak, so that a later
        # runner is never taken for a released one (an id can be reused)
        self._ticks_off: weakref.WeakSet[GraphRunner] = weakref.WeakSet()
        self._logits_to_keep = False
        self.runner: GraphRunner | None = None
        self.report: CaptureReport | None = None
        self.stats = BatchingStats()
        #: The manager's batch processor, once the manager created it (:attr:`processor` raises before).
        self.batch_processor: ContinuousBatchProcessor | None = None
        self._manager: weakref.ref[ContinuousBatchingManager] | None = None
        self.groups: list[CacheGroup] = []
        self.record_token = 0
        self._step_fn: Callable[..., torch.Tensor] | None = None
        self._eos: list[int] = []
        #: The first exception the step raised inside transformers' generation thread (re-raised by generate_batch).
        self.error: BaseException | None = None
        # autocapture: the last step raised and its requests were failed (its update_batch is skipped), and
        # how many steps in a row raised
        self._failed_step = False
        self._failures_in_a_row = 0

    # ----------------------------------------------------------------- installation
    def install(self, manager: ContinuousBatchingManager) -> None:
        """Hook this object into ``manager`` (a ``ContinuousBatchingManager``, not started): its batch processor,
        made now (``manager.warmup()``), serves each step through :meth:`serve_step` (a :class:`GraphModelRunner` on
        ``bp.model_runner``). Raises
        :class:`~graphrunner.errors.CaptureError` when :func:`~graphrunner.hf.refusals.refusal` refuses the model."""
        check_served(self.model, manager.continuous_batching_config)
        eos = manager.generation_config.eos_token_id
        self._eos = [eos] if isinstance(eos, int) else list(eos or [])
        vocab = self._vocab()
        self.record_token = next(t for t in range(vocab) if t not in self._eos)
        self._manager = weakref.ref(manager)
        cfg = manager.continuous_batching_config
        if (
            any(cfg.cuda_graph_booleans)
            or cfg.varlen_compile_config is not None
            or cfg.decode_compile_config is not None
        ):
            # refused before manager.warmup(), which would capture transformers' own graphs first
            raise CaptureError(_PADDED_MANAGER)
        # the batch processor is made now (manager.warmup, public), with the model's attention routed through
        # graphrunner's so that transformers allocates no host mask it would fill at every step (the step builds
        # its own), but in debug mode, whose check compares transformers' mask with the step's
        with routed(self.model) if not self.options.debug else contextlib.nullcontext():
            manager.warmup()
        bp = manager.batch_processor
        if bp is None:
            raise GraphRunnerError("transformers' manager.warmup() made no batch processor")
        self._attach(bp)
        # the graphs (and a background capture's thread) go with their manager: released when it is collected,
        # or by release() (gr.hf.release, generate_batch and the server call it when they destroy a manager)
        weakref.finalize(manager, self.release)

    def release(self) -> None:
        """Stop a background capture and release the graphs: a capture thread must not outlive its manager.
        Runs when the manager is garbage collected; call it when you destroy the manager
        (``manager.destroy(); gr.hf.graphs_of(manager).release()``). The steps run eagerly again until
        :meth:`capture`."""
        runners, self.runner, self._pending = (self.runner, self._pending), None, None
        for runner in runners:
            if runner is not None:
                runner.cleanup()

    @property
    def processor(self) -> ContinuousBatchProcessor:
        """The manager's batch processor; :class:`~graphrunner.errors.GraphRunnerError` before the manager
        created it (it runs once first)."""
        bp = self.batch_processor
        if bp is None:
            raise GraphRunnerError(
                "the manager's batch processor does not exist yet: run the manager once first "
                "(gr.hf.generate_batch does a dry run of the scheduler)"
            )
        return bp

    def _attach(self, bp: ContinuousBatchProcessor) -> None:
        self.batch_processor = bp
        mr = bp.model_runner
        if mr.pad_inputs:
            raise CaptureError(_PADDED_MANAGER)
        self.groups = cache_groups(bp.cache)
        if tuple(g.dim for g in self.groups) != self.dims[1:-1]:
            raise CaptureError(
                f"the cache's attention types {[g.layer_type for g in self.groups]} do not match the "
                f"model config's keys dims {list(self.dims[1:-1])}"
            )
        _sync_io(bp)
        self._logits_to_keep = mr.supports_logits_to_keep(self.model)
        # the one place graphrunner enters the processor
        bp.model_runner = GraphModelRunner(
            bp,
            self.groups,
            self.serve_step,
            debug=self.options.debug,
            validate=self.options.validate,
            on_error=self._keep_error,
        )
        if self.options.autocapture:
            # transformers writes the cache outside the forward too (prefix-cache forks, offloading) and
            # samples from the default generator after it: a background key capture, which puts back
            # what it wrote when it ends, must not run beside any of that
            wrap_step_methods(bp, self._guarded)
            self.capture()

    def _guarded(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        """Batch processor method ``name`` (``fn``) run while no background key capture runs
        (``runner.hold()`` of the runner serving and of a re-plan's runner being captured); a re-plan found
        due by a step is started after it, outside the holds, and a re-plan's runner takes over once every key
        of it is captured. A step that raises (``_generation_step``) fails its own requests and the engine
        serves on (:meth:`_step_failed`); an exception that is no ``Exception`` is raised as a
        ``RuntimeError``, which transformers' generation loop records (it would end the loop silently, every
        request in flight left waiting)."""

        def run(*args: Any, **kwargs: Any) -> Any:
            if name == "update_batch" and self._failed_step:
                self._failed_step = False
                return None  # the step's requests were failed: nothing to update
            try:
                with contextlib.ExitStack() as held:
                    for runner in (self.runner, self._pending):
                        if runner is not None:
                            held.enter_context(runner.hold())
                    out = fn(*args, **kwargs)
            except Exception as exc:
                if name != "_generation_step":
                    raise  # transformers' own scheduling and bookkeeping: its loop stops the engine
                self._step_failed(exc)
                out = None
            except BaseException as exc:
                raise RuntimeError(f"the engine's {name} raised {type(exc).__name__}: {exc}") from exc
            else:
                if name == "_generation_step":
                    self._failures_in_a_row = 0
            if name == "prepare_next_batch" and self.shared:
                self._tick(idle=not out)
            runner = self.runner
            if self.shared:
                # several ranks: the keys replay from the step whose agreement found them captured on every rank
                # (runner.wait_captured would grant every remaining key at once and hold the next step for them)
                self.captured()
            elif self._capture_began is not None and runner is not None and runner.wait_captured(timeout=0) is not None:
                # the background capture is done: its keys replay from now (and count as captured) whether or not
                # a step was served meanwhile (an idle server); outside the holds, in the engine's thread
                self.captured()
            if self._pending is not None:
                self._settle_replan()
            elif self._replan_due:
                self._replan_due = False
                self._replan()
            return out

        return run

    def _tick(self, idle: bool) -> None:
        """Several ranks, after each ``prepare_next_batch`` (the same loop iteration on every rank; ``idle``: it
        found no request, so no step follows): keys are granted without steps too. A runner with keys left to
        capture agrees in a call without rows, whose agreement grants its next key (captured before the next step,
        which holds both runners): the serving runner when no step follows (an idle server captures its ladder
        from the start, as one rank does), a re-plan's runner at every iteration (it serves no step until it
        takes over). Nothing when the loop stops (its agreed stop status) or every key is captured. A capture
        failure the ranks agreed on (raised by that call on every rank) ends the runner's ticks; a re-plan's
        runner is dropped then, the current keys serve on."""
        if not loop_goes_on(self.processor):
            return
        for runner in (self.runner if idle else None, self._pending):
            if runner is None or runner in self._ticks_off or len(runner.captured_keys) == len(runner.keys):
                continue
            try:
                runner(**{name: buf[:0] for name, buf in runner.static_inputs.items()})
            except RankFailedError:
                raise  # a rank failed: the runner stops on every rank, the engine with it
            except CaptureError as exc:  # agreed: raised by this call on every rank
                self._ticks_off.add(runner)
                if runner is self._pending:
                    self._drop_replan(exc)
                else:
                    logger.warning("gr.hf: a key's background capture failed, its steps are served eagerly: %s", exc)

    def _step_failed(self, exc: Exception) -> None:
        """The step raised ``exc``: its requests fail with an error naming it (transformers' own way,
        :func:`~graphrunner.hf.internals.fail_step`; a step cannot tell whose input raised) and the engine
        serves on; its ``update_batch`` is skipped. The :data:`FAILED_STEPS_IN_A_ROW`-th step in a row that
        raises is the engine's fault (a sticky device error fails every step): ``exc`` is raised on, and
        transformers' generation loop stops the engine and fails every request."""
        self._failures_in_a_row += 1
        self.stats.failed_steps += 1
        if self._failures_in_a_row >= FAILED_STEPS_IN_A_ROW:
            logger.error(
                "gr.hf: %d steps in a row raised, the engine stops: %s: %s",
                self._failures_in_a_row,
                type(exc).__name__,
                exc,
            )
            raise exc
        logger.error("gr.hf: a step raised %s: %s; its requests fail, the engine serves on", type(exc).__name__, exc)
        fail_step(self.processor, StepError(f"the step serving this request raised {type(exc).__name__}: {exc}"))
        self._failed_step = True

    def _max_position(self) -> int:
        """An upper bound on positions: the model's max_position_embeddings or what the cache can hold, the larger."""
        text = self.model.config.get_text_config()
        cache = self.processor.cache
        return max(int(getattr(text, "max_position_embeddings", 0) or 0), int(cache.max_tokens_read) + 1)

    def _max_requests(self) -> int:
        """The most requests in a step (transformers resolves it when it sizes the cache)."""
        n = _sync_io(self.processor).max_requests_per_batch
        if n is None:
            raise GraphRunnerError("transformers' batch processor left max_requests_per_batch unresolved")
        return int(n)

    def _vocab(self) -> int:
        emb = self.model.get_input_embeddings() if hasattr(self.model, "get_input_embeddings") else None
        return int(getattr(emb, "num_embeddings", None) or self.model.config.get_text_config().vocab_size)

    # ----------------------------------------------------------------- the step's forward
    @contextlib.contextmanager
    def recording(self) -> Iterator[None]:
        """Within the block the steps run no forward: their sizes are recorded (``stats.step_sizes``, what
        :meth:`plan` reads) and each request is handed a fixed token that is no end-of-sequence one, so a
        dry run of transformers' scheduler sees every request run its full length."""
        self._recording = True
        try:
            yield
        finally:
            self._recording = False

    def _keep_error(self, exc: BaseException) -> None:
        """Keep the first exception a step raised in :attr:`error` (transformers' generation thread only logs it
        and fails the step's requests; gr.hf.generate_batch re-raises it)."""
        if self.error is None:
            self.error = exc

    def serve_step(self, feeds: dict[str, torch.Tensor], size: tuple[int, ...]) -> torch.Tensor:
        """The logits ``[reqs, vocab]`` of one varlen step of ``size`` (its :class:`GraphModelRunner` hands it the
        step's ``feeds``): replayed from :attr:`runner`'s graphs once it serves (GraphRunner's eager fallback for
        a step larger than every key), eagerly before; inside :meth:`recording`, no forward. Counted in
        :attr:`stats`."""
        self._record(size)
        if self._recording:
            # every request's only possible token is record_token, whatever transformers' sampling does
            logits = torch.full((size[-1], self._vocab()), float("-inf"), device=feeds["input_ids"].device)
            return logits.index_fill_(1, torch.tensor([self.record_token], device=logits.device), 0.0)
        self.stats.steps += 1
        runner = self.runner
        if runner is None:
            self.stats.eager_steps += 1
            return self._step()(**feeds)
        before = runner.stats.fallbacks
        logits = runner(**feeds)
        if runner.stats.fallbacks > before:
            self.stats.eager_steps += 1
        else:
            self.stats.replayed += 1
            key = runner.stats.last_bucket
            self.stats.real_tokens += size[0]
            self.stats.padded_tokens += int(key[0]) - size[0]
            self.stats.real_keys += sum(size[1:-1])
            self.stats.padded_keys += sum(int(k) for k in key[1:-1]) - sum(size[1:-1])
        return logits

    def _record(self, size: tuple[int, ...]) -> None:
        """Count a step of ``size`` (and transformers' own sizes of it) in ``stats``; ``autocapture``: in
        the window a re-plan reads, a re-plan due every ``replan_every`` steps."""
        self.stats.step_sizes.append(size)
        if self.options.autocapture:
            self._window.append(size)
            keep = self._window.maxlen or 0  # set at construction: never None
            if len(self.stats.step_sizes) > 2 * keep:  # a server runs for ever: keep the recent ones
                del self.stats.step_sizes[:-keep]
                del self.stats.engine_sizes[:-keep]
            self._since_plan += 1
            if self.replans and self._since_plan >= self.options.replan_every:
                self._since_plan = 0
                self._replan_due = True
        io = _sync_io(self.processor)  # transformers' own sizes of the step, for stats.engine_sizes
        self.stats.engine_sizes.append((size[0], int(io.max_kv_read), tuple(int(v) for v in io.max_length_k.values())))

    @property
    def shared(self) -> bool:
        """Whether the runners agree over several ranks (``options.group``): every step's key, and the keys a
        background capture captures, decided in each step's agreement on every rank alike."""
        return int(getattr(self.options.group, "size", 1)) > 1

    @property
    def replans(self) -> bool:
        """Whether the keys are re-planned (``autocapture`` with ``replan_every`` > 0). On several ranks a
        re-plan is decided at the same step on every rank (:meth:`_replan`: the steps' sizes are the same on
        every rank, and whether any rank's rest is still running is agreed), and its runner's keys are granted
        in idle calls (:meth:`_tick`)."""
        return bool(self.options.autocapture and self.options.replan_every)

    def _step(self) -> Callable[..., torch.Tensor]:
        """The step's forward (:func:`~graphrunner.hf.batch_step.make_step`), built once."""
        if self._step_fn is None:
            self._step_fn = self._make_step(per_request=self.per_request)
        return self._step_fn

    @property
    def per_request(self) -> bool:
        """Whether the step's attention runs per request (``options.attention``, ``auto`` resolved by where the
        graphs are: :func:`~graphrunner.hf.batch_step.attends_per_request`)."""
        return attends_per_request(self.options.attention, isinstance(get_device(self.options.device), CudaDevice))

    def _make_step(self, per_request: bool) -> Callable[..., torch.Tensor]:
        """:func:`~graphrunner.hf.batch_step.make_step` over this manager's cache; ``per_request=False``: the
        dense masks (what CUDA graphs replay, and the equivalence check's reference)."""
        bp = self.processor
        return make_step(
            self.model,
            bp.cache,
            self.groups,
            self._logits_to_keep,
            self._max_position(),
            self._max_requests(),
            per_request=per_request,
        )

    # ----------------------------------------------------------------- planning and capture
    def plan(self) -> Keys:
        """Buckets and keys: the declared ones, else :func:`plan_keys` over the step sizes recorded so far,
        else (``autocapture``, no step yet) the ladder up to the configured sizes
        (:func:`graphrunner.hf.ladder.ladder_keys`)."""
        if self.buckets is not None:
            if self.keys is not None:
                return self.buckets, self.keys
            return self.buckets, sorted(itertools.product(*(self.buckets[d] for d in self.dims)))
        if self.options.autocapture and not self.stats.step_sizes:
            return ladder_keys(self._maxima(), self.dims, self.options.max_graphs)
        return plan_keys(self.stats.step_sizes, self.options.max_graphs, self.dims)

    def _maxima(self) -> dict[str, int]:
        """The largest size of each dim the configured cache and batch allow."""
        bp = self.processor
        cache = bp.cache
        tokens = int(cache.max_batch_tokens)
        out = {"tokens": tokens, "reqs": self._max_requests()}
        for g in self.groups:
            out[g.dim] = int(cache.max_tokens_read) + tokens
        return out

    def _new_runner(self, buckets: dict[str, list[int]], keys: Sequence[tuple[int, ...]]) -> GraphRunner:
        """A runner of the step over ``keys``, not captured yet."""
        bp = self.processor
        spec = step_inputs(
            self.groups, self._vocab(), self._max_position(), self._max_requests(), int(bp.cache.max_batch_tokens)
        )
        return GraphRunner(
            self._step(),
            inputs=spec,
            buckets=buckets,
            keys=keys,
            outputs=("reqs",),
            backend=self.options.backend,
            device=self.options.device,
            progress=False,
            checks=self.options.checks,
            debug=self.options.debug,
            fallback="eager",
            group=self.options.group,
        )

    def _background(self, buckets: dict[str, list[int]], keys: Sequence[tuple[int, ...]]) -> None:
        """Serve through a new runner over ``keys`` at once, its keys captured on a thread."""
        runner = self._new_runner(buckets, keys)
        runner.capture(
            background=True, share=self.options.capture_share
        )  # puts back what each key's capture writes: no cache reset
        self._capture_began = time.perf_counter()
        self._serve_through(runner)

    def _serve_through(self, runner: GraphRunner) -> None:
        """Every step goes through ``runner`` from now on; its keys in ``stats``."""
        self.runner = runner
        self.stats.graphs = len(runner.keys)
        self.stats.keys = [tuple(k) for k in runner.keys]

    def captured(self) -> int:
        """Keys that replay now (all of :attr:`runner`'s after a blocking capture; during a background
        one, those captured so far); adds a finished background capture's time to ``stats.capture_seconds``."""
        runner = self.runner
        if runner is None:
            return 0
        n = len(runner.captured_keys)
        if self._capture_began is not None and n == len(runner.keys):
            self._captured_for(time.perf_counter() - self._capture_began)
            self._capture_began = None
        return n

    def _captured_for(self, seconds: float) -> None:
        """A background capture (the ladder's or a re-plan's) ended after ``seconds``: counted in
        ``stats.capture_seconds``, and no re-plan starts during the rest it earns (``replan_share``)."""
        self.stats.capture_seconds += seconds
        self._rest_until = time.perf_counter() + rest_after(seconds, self.options.replan_share)

    def _replan(self) -> None:
        """``autocapture``: once the current keys are all captured and the last capture's rest is over
        (``replan_share``), re-plan them from the recent step sizes (:func:`graphrunner.hf.ladder.replan`) and, when that cuts the padding, capture a runner
        over the new keys in the background while the current one serves on; it takes over when all
        its keys are captured (:meth:`_settle_replan`), so a re-plan never serves a step eagerly."""
        old = self.runner
        if not self.replans or old is None or self._pending is not None or self.buckets is not None:
            return
        if self.captured() < len(old.keys):
            return
        if self._resting():  # the last capture's rest: due again at the next step (several ranks: an agreement
            if self.shared:  # each time, so once in at most RECHECK_STEPS steps)
                self._since_plan = self.options.replan_every - min(RECHECK_STEPS, self.options.replan_every)
            else:
                self._replan_due = True
            return
        # the padding that costs: padded query tokens where the attention skips padding keys, else cells
        weigh = "tokens" if self.per_request else "cells"
        plan = replan(list(self._window), [tuple(k) for k in old.keys], self.dims, self.options.max_graphs, weigh=weigh)
        if plan is None:
            return
        logger.info(
            "gr.hf: re-planning the keys from %d recent steps: %d keys -> %d",
            len(self._window),
            len(old.keys),
            len(plan[1]),
        )
        self._pending = self._new_runner(*plan)
        self._pending.capture(background=True, share=self.options.capture_share)
        self._pending_began = time.perf_counter()

    def _resting(self) -> bool:
        """Whether the rest after the last background capture still runs (``replan_share``). Each rank keeps its
        own clock, so on several ranks whether any rank still rests is agreed (one collective, at the same step on
        every rank: a re-plan is due after the same steps everywhere), and a re-plan starts on every rank or on
        none."""
        resting = time.perf_counter() < self._rest_until
        if self.shared:
            resting = bool(self.options.group.all_max_vector([int(resting)], phase="re-plan", key="rest")[0])
        return resting

    def wait_captured(self, timeout: float | None = None) -> bool:
        """Wait up to ``timeout`` s (each) for the background capture of :attr:`runner`'s keys and of a
        re-plan's keys (which take over at the step after); True when both are done."""
        done = True
        for runner in (self.runner, self._pending):
            if runner is not None and runner.wait_captured(timeout) is None:
                done = False
        return done

    def _settle_replan(self) -> None:
        """The re-plan's runner serves from now on once all its keys are captured (the old one is
        released); a failed re-plan capture is dropped, the current keys serve on."""
        pending = self._pending
        if pending is None:
            return
        if self.shared:  # the keys every rank has captured (agreed): the same step on every rank; failures: _tick
            if len(pending.captured_keys) < len(pending.keys):
                return
        elif pending.capture_error is not None:
            self._drop_replan(pending.capture_error)
            return
        elif pending.wait_captured(timeout=0) is None:
            return
        old, self._pending = self.runner, None
        self._serve_through(pending)
        self._captured_for(time.perf_counter() - self._pending_began)
        self.stats.replans += 1
        if old is not None:
            old.cleanup()

    def _drop_replan(self, error: BaseException) -> None:
        """The re-plan's runner failed its capture (``error``): released, the current keys serve on."""
        pending, self._pending = self._pending, None
        logger.warning("gr.hf: the re-planned keys' capture failed, serving on with the current keys: %s", error)
        if pending is not None:
            pending.cleanup()

    def capture(self) -> CaptureReport | None:
        """Build :attr:`runner` over the planned keys and capture it (blocking); return GraphRunner's report
        (``None`` with ``background=True``: the capture runs on a thread, ``runner.wait_captured()`` waits).

        Needs the batch processor (the manager has run once). Checks the trash
        slots first, runs the equivalence check after, and puts back the paged
        cache and the default generator's state as they were before (the
        capture's forwards write the cache; the prefix-cache blocks of earlier
        sessions stay valid for later ones). With ``background=True`` or
        ``autocapture=True`` the keys are captured on a thread while the steps
        are served (each key's capture puts back what it wrote). Raises
        :class:`~graphrunner.errors.CaptureError` naming the architecture and the reason."""
        bp = self.batch_processor
        if bp is None:
            raise GraphRunnerError(
                "capture() needs the manager's batch processor: run the manager once first "
                "(gr.hf.generate_batch does a dry run of the scheduler)"
            )
        try:
            check_trash(bp.cache, self.groups)
        except CaptureError as exc:
            raise refused(self.model, exc) from exc
        buckets, keys = self.plan()
        if self.options.background or self.options.autocapture:
            self._background(buckets, keys)
            return None
        cache = bp.cache
        t0 = time.perf_counter()
        try:
            with self._put_back(cache.cache_tensor):
                runner = self.runner = self._new_runner(buckets, keys)
                # the equivalence check replays every key right after the capture: that replay traces the
                # key's replay (graphrunner.tape.jit), not a run of its own at each capture's end; the
                # copies those first replays take go to reused buffers (the capture's own are freed by then)
                with torch.inference_mode():
                    with traces_at_first_replay() if self.options.equivalence else contextlib.nullcontext():
                        self.report = runner.capture()
                    if self.options.equivalence:
                        with reuse_snapshot_buffers():
                            self.stats.equivalence_checked = self._equivalence(runner).run()
        except RefusedError:
            raise
        except GraphRunnerError as exc:
            raise refused(self.model, exc) from exc
        self.stats.capture_seconds += time.perf_counter() - t0
        self._serve_through(runner)
        return self.report

    @staticmethod
    @contextlib.contextmanager
    def _put_back(cache_tensor: torch.Tensor) -> Iterator[None]:
        """The paged cache and the default generator as they were before the block, whatever it raised: a
        blocking capture's forwards write the cache, whose blocks the prefix cache gives to later sessions,
        and may draw from the generator."""
        saved = cache_tensor.to("cpu", copy=True)
        rng = torch.get_rng_state()
        try:
            yield
        finally:
            cache_tensor.copy_(saved)
            torch.set_rng_state(rng)

    def _equivalence(self, runner: GraphRunner) -> EquivalenceCheck:
        """The equivalence check of ``runner``'s keys over this manager's cache. Its eager steps build the
        dense masks (``per_request=False``): the replayed per-request attention is compared with the dense masked
        attention, not with itself, so a bug in those ops is refused at capture."""
        bp = self.processor
        return EquivalenceCheck(
            runner=runner,
            step=self._make_step(per_request=False),
            dims=self.dims,
            groups=self.groups,
            cache=bp.cache.cache_tensor,
            vocab=self._vocab(),
            device=_sync_io(bp).input_ids.device,
            model=self.model,
        )
