"""The entry points of continuous batching on graphs: a manager with graphs, ``generate_batch`` on graphs, ``release``.

:func:`init_continuous_batching` is ``model.init_continuous_batching(...)``
with a :class:`~graphrunner.hf.batching.GraphBatching` installed;
:func:`generate_batch` is ``model.generate_batch(...)`` whose steps replay
graphs planned from a dry run of transformers' scheduler, the manager and its
graphs kept on the model for the next call (:func:`release` frees them). Both
take the options of :class:`~graphrunner.hf.options.BatchingOptions` as
keywords and refuse a model through :func:`graphrunner.hf.refusals.check_served`.
"""

from __future__ import annotations

import copy
import dataclasses
import time
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from graphrunner.errors import GraphRunnerError
from graphrunner.hf.batching import GraphBatching
from graphrunner.hf.internals import forget_kept_manager, kept_manager
from graphrunner.hf.options import BatchingOptions
from graphrunner.hf.refusals import check_served

if TYPE_CHECKING:
    from transformers import GenerationConfig, PreTrainedModel
    from transformers.generation.configuration_utils import ContinuousBatchingConfig
    from transformers.generation.continuous_batching.continuous_api import ContinuousBatchingManager, ContinuousMixin
    from transformers.generation.continuous_batching.utils import WorkloadHints

    from graphrunner.runner import GraphRunner

__all__ = ["generate_batch", "graphs_of", "init_continuous_batching", "release"]


def init_continuous_batching(
    model: PreTrainedModel,
    generation_config: GenerationConfig | None = None,
    continuous_batching_config: ContinuousBatchingConfig | None = None,
    workload_hints: WorkloadHints | None = None,
    *,
    options: BatchingOptions | None = None,
    **fields: Any,
) -> ContinuousBatchingManager:
    """``model.init_continuous_batching(...)`` with a :class:`GraphBatching` installed: returns the manager,
    its graph step as ``gr.hf.graphs_of(manager)``.

    Use the manager as transformers documents it (``start()``, ``add_request(...)``,
    ``get_result()``, ``stop(keep_for_next_session=True)`` between sessions,
    ``destroy()``). Its steps run eagerly through the graph step (recording
    their sizes) until ``gr.hf.graphs_of(manager).capture()`` is called between two
    sessions (the manager stopped, its batch processor created by a first
    session): the keys are then planned from the sizes recorded (or from
    ``buckets``/``keys``), and every later session replays them. The cache keeps its
    tensors (and its prefix-cache blocks) across sessions: the capture puts
    back what it wrote, so every session before and after it generates what
    transformers' own manager does.

    ``autocapture=True`` is the form a server takes (it never stops its
    manager): from the first session on, the keys are planned from a ladder up
    to the configured cache and batch sizes and captured in the background
    while the steps are served (eagerly, padded, until their key is captured),
    then re-planned every ``replan_every`` steps from the sizes served when that
    cuts the padding (``stats.replans``), its captures taking at most
    ``replan_share`` of the serving time. Options: a
    :class:`~graphrunner.hf.options.BatchingOptions` (``options=``) and/or its
    fields as keywords (which replace ``options``' own); ``TypeError`` for an
    unknown one. Raises :class:`~graphrunner.errors.CaptureError` for a model
    :func:`~graphrunner.hf.refusals.refusal` refuses."""
    opts = BatchingOptions.of(options, **fields)
    check_served(model, continuous_batching_config, "init_continuous_batching")
    hook = GraphBatching(model, opts)  # checks the options against the model's dims before a manager exists
    manager = _continuous(model).init_continuous_batching(
        generation_config=generation_config,
        continuous_batching_config=continuous_batching_config,
        workload_hints=workload_hints,
    )
    try:
        hook.install(manager)
    except BaseException:
        manager.destroy()
        raise
    _GRAPHS[manager] = hook
    return manager


#: The graphs of each manager :func:`init_continuous_batching` made (weakly: they go with their manager).
_GRAPHS: weakref.WeakKeyDictionary[ContinuousBatchingManager, GraphBatching] = weakref.WeakKeyDictionary()


def graphs_of(manager: ContinuousBatchingManager) -> GraphBatching | None:
    """The :class:`~graphrunner.hf.batching.GraphBatching` (the graph step, its stats and :meth:`capture
    <graphrunner.hf.batching.GraphBatching.capture>`) of a manager :func:`init_continuous_batching` made;
    ``None`` for any other manager (transformers' own)."""
    return _GRAPHS.get(manager)


# --------------------------------------------------------------------------- generate_batch


def _continuous(model: PreTrainedModel) -> ContinuousMixin:
    """``model`` as the transformers generation model that runs continuous batching (``refusal`` refuses
    any other first)."""
    from transformers.generation.continuous_batching.continuous_api import ContinuousMixin

    if not isinstance(model, ContinuousMixin):
        raise TypeError(f"{type(model).__name__} is not a transformers generation model (no continuous batching)")
    return model


def _workload_hints(
    inputs: Sequence[Sequence[int]], generation_config: GenerationConfig, max_new_tokens: int | None
) -> WorkloadHints:
    """The workload hints ``model.generate_batch`` sizes its manager by, for these prompts."""
    from transformers.generation.continuous_batching.utils import WorkloadHints

    n_ret = generation_config.num_return_sequences if generation_config.num_return_sequences is not None else 1
    return WorkloadHints(
        max_prompt_length=max(len(x) for x in inputs),
        max_generated_length=max_new_tokens if max_new_tokens is not None else 0,
        num_requests=len(inputs) * n_ret,
    )


#: Options of a manager that is never stopped: :func:`init_continuous_batching` takes them, not :func:`generate_batch`.
_MANAGER_ONLY = ("autocapture", "replan_every", "replan_share")


def generate_batch(
    model: PreTrainedModel,
    inputs: list[list[int]],
    generation_config: GenerationConfig | None = None,
    continuous_batching_config: ContinuousBatchingConfig | None = None,
    *,
    options: BatchingOptions | None = None,
    stats: dict[str, Any] | None = None,
    reuse: bool = True,
    **kwargs: Any,
) -> dict[str, Any]:
    """``model.generate_batch(inputs, generation_config, continuous_batching_config, **kwargs)`` with the varlen
    steps' forward replayed from graphrunner graphs; returns exactly what it returns.

    ``inputs``: a list of prompts (lists of token ids); ``generation_config``,
    ``continuous_batching_config`` and ``**kwargs`` (``max_new_tokens``,
    ``record_timestamps``, ``progress_bar``) as for ``model.generate_batch``.
    The result maps each request id (``req_0``, ...) to transformers'
    ``GenerationOutput`` (``generated_tokens``). Greedy outputs equal
    ``model.generate_batch`` token for token; sampled ones too with a
    ``continuous_batching_config.seed`` (or after the same ``torch.manual_seed``).

    How: a manager is built as ``model.generate_batch`` builds it (the same
    workload hints). Unless ``buckets=`` is given, a dry run of transformers'
    own scheduler over ``inputs`` (no forward; a fixed non-EOS token sampled)
    records the step sizes (``(tokens, kv, reqs)``; a keys dim per attention type), and ``gr.plan_buckets`` plans
    at most ``max_graphs[dim]`` buckets per dim (default
    :data:`~graphrunner.hf.planning.DEFAULT_MAX_GRAPHS`); the keys captured are those the steps land
    on. Then the step is captured (``backend``, ``device``: as
    :class:`~graphrunner.GraphRunner`), checked (:class:`~graphrunner.hf.batching.GraphBatching`), the cache
    emptied and the generation run. Steps larger than every key run
    eagerly. ``reuse=True`` (the default) keeps the manager and its graphs on
    the model: a later call with the same settings (generation and batching
    configs, the workload hints of its prompts, these options) captures
    nothing and starts from an empty cache, as a new manager does; another
    setting replaces them. :func:`release` frees them (or ``reuse=False``).
    Options: a :class:`~graphrunner.hf.options.BatchingOptions` (``options=``)
    and/or its fields as keywords, but a server's ``autocapture``,
    ``replan_every`` and ``replan_share`` (a ``TypeError``). ``stats``: a dict that receives
    :class:`~graphrunner.hf.batching.BatchingStats` (``"stats"``),
    the capture report (``"report"``) and the runner (``"runner"``; released already with ``reuse=False``).

    Raises :class:`~graphrunner.errors.CaptureError` naming the architecture and the reason when the
    model cannot be served (see :func:`~graphrunner.hf.refusals.refusal`), ``ValueError``/``TypeError``
    for bad arguments."""
    if not _check_call(inputs, stats):
        return {}
    opts = _batch_options(options, kwargs)
    check_served(model, continuous_batching_config, "generate_batch")
    gen_cfg, cb_cfg, hints = _configs(
        model, inputs, generation_config, continuous_batching_config, kwargs.get("max_new_tokens", None)
    )
    settings = repr((sorted(gen_cfg.to_dict().items()), sorted(vars(cb_cfg).items()), vars(hints), opts))
    held = _held_for(model, settings, reuse)
    run_kwargs = dict(kwargs)
    if held is None:
        hook = GraphBatching(model, opts)  # checks the options against the model's dims first
        manager = _continuous(model).init_continuous_batching(
            generation_config=generation_config, continuous_batching_config=cb_cfg, workload_hints=hints
        )
    else:
        manager, hook = held.manager, held.hook
    ok = False
    try:
        if held is None:
            _dry_run(hook, manager, inputs, gen_cfg, run_kwargs)
        bp = hook.processor
        bp.cache.reset()  # empty, as a new manager's: the dry run's blocks hold no real K/V
        if held is None:
            hook.capture()
        # as transformers seeds a new processor
        bp.distributed_helper.set_tp_seed(cb_cfg.seed, torch.device(bp.cache.device))
        out = _serve_requests(manager, inputs, gen_cfg, run_kwargs)
        _reraise(hook)
        ok = True
    finally:
        runner = _keep_or_destroy(model, manager, hook, settings, keep=ok and reuse)
    if stats is not None:
        stats.update({"stats": hook.stats, "report": hook.report, "runner": runner, "hook": hook})
    return out


def _check_call(inputs: Any, stats: Any) -> bool:
    """Raise ``TypeError``/``ValueError`` for :func:`generate_batch`'s ``inputs`` or ``stats`` of the wrong
    kind; False for no prompts (nothing to run)."""
    if not isinstance(inputs, (list, tuple)) or not all(isinstance(x, (list, tuple)) for x in inputs):
        raise TypeError("inputs must be a list of prompts, each a list of token ids (as model.generate_batch takes)")
    if not inputs:
        return False
    if any(len(x) == 0 for x in inputs):
        raise ValueError("every prompt in inputs needs at least one token")
    if stats is not None and not isinstance(stats, dict):
        raise TypeError(f"stats must be a dict to fill, got {type(stats).__name__}")
    return True


def _configs(
    model: PreTrainedModel,
    inputs: list[list[int]],
    generation_config: GenerationConfig | None,
    continuous_batching_config: ContinuousBatchingConfig | None,
    max_new_tokens: int | None,
) -> tuple[GenerationConfig, ContinuousBatchingConfig, WorkloadHints]:
    """The generation config, a copy of the batching config and the workload hints of a :func:`generate_batch`
    call, as ``model.generate_batch`` resolves them; ``TypeError`` for a generation config of another type."""
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    gen_cfg = model.generation_config if generation_config is None else generation_config
    if not isinstance(gen_cfg, GenerationConfig):
        raise TypeError(f"generation_config must be a transformers GenerationConfig, got {type(gen_cfg).__name__}")
    # transformers fills the batching config in when it sizes the cache: it gets a copy, the user's stays as given
    cb_cfg = (
        ContinuousBatchingConfig() if continuous_batching_config is None else copy.deepcopy(continuous_batching_config)
    )
    max_new_tokens = gen_cfg.max_new_tokens if max_new_tokens is None else max_new_tokens
    if kept_manager(model) is not None:
        raise GraphRunnerError(
            "the model holds a persistent continuous batching manager; call "
            "model.destroy_cached_continuous_batching_manager() first"
        )
    return gen_cfg, cb_cfg, _workload_hints(inputs, gen_cfg, max_new_tokens)


def _held_for(model: PreTrainedModel, settings: str, reuse: bool) -> _Held | None:
    """What :func:`generate_batch` kept on ``model`` for a call of ``settings``; anything else kept is released."""
    held: _Held | None = getattr(model, _HELD, None)
    if held is not None and (held.settings != settings or not reuse):
        release(model)
        return None
    return held


def _batch_options(options: BatchingOptions | None, kwargs: dict[str, Any]) -> BatchingOptions:
    """The options of :func:`generate_batch`: ``options`` with the option fields among ``kwargs``
    (taken out of it; the rest are ``model.generate_batch``'s)."""
    names = {f.name for f in dataclasses.fields(BatchingOptions)}
    given = {k: kwargs.pop(k) for k in list(kwargs) if k in names}
    opts = BatchingOptions.of(options, **given)
    manager_only = [n for n in _MANAGER_ONLY if getattr(opts, n) != getattr(BatchingOptions(), n)]
    if manager_only:
        raise TypeError(
            f"generate_batch plans its keys from a dry run of its prompts: {manager_only} are options "
            "of a manager that is never stopped (gr.hf.init_continuous_batching)"
        )
    return opts


def _dry_run(
    hook: GraphBatching,
    manager: ContinuousBatchingManager,
    inputs: list[list[int]],
    gen_cfg: GenerationConfig,
    run_kwargs: dict[str, Any],
) -> None:
    """Install ``hook`` on ``manager`` and run transformers' scheduler over ``inputs`` without a forward,
    recording the step sizes (``hook.stats.step_sizes``) the keys are planned from."""
    hook.install(manager)
    t0 = time.perf_counter()
    with hook.recording():
        _serve_requests(manager, inputs, gen_cfg, {**run_kwargs, "progress_bar": False})
    _reraise(hook)
    hook.stats.dry_run_seconds = time.perf_counter() - t0


def _serve_requests(
    manager: ContinuousBatchingManager, inputs: list[list[int]], gen_cfg: GenerationConfig, kwargs: dict[str, Any]
) -> dict[str, Any]:
    """One session of ``manager`` over ``inputs`` through its public API, as ``model.generate_batch`` runs one:
    request ids ``req_0``, ... (the children of ``num_return_sequences`` right after their parent), results in
    the order of the inputs; the manager stopped and kept for the next session, not cached on the model.
    ``kwargs``: ``max_new_tokens``, ``record_timestamps``, ``progress_bar`` (``TypeError`` for another)."""
    from tqdm.auto import tqdm

    unknown = sorted(set(kwargs) - {"max_new_tokens", "record_timestamps", "progress_bar"})
    if unknown:
        raise TypeError(f"generate_batch got unexpected keyword argument(s) {unknown}")
    n_ret = gen_cfg.num_return_sequences if gen_cfg.num_return_sequences is not None else 1
    results: dict[str, Any] = {}
    manager.start()  # then the requests, as generate_batch adds them (add_requests orders them for prefix sharing)
    try:
        ids = manager.add_requests(
            inputs,
            max_new_tokens=kwargs.get("max_new_tokens"),
            record_timestamps=bool(kwargs.get("record_timestamps", False)),
        )
        with tqdm(total=len(ids) * n_ret, disable=not kwargs.get("progress_bar"), unit="request") as bar:
            while len(results) < len(ids) * n_ret:
                result = manager.get_result(timeout=1)
                if result is None:
                    if not manager.is_running():
                        break  # the generation thread died: the step's error is re-raised by the caller
                    continue
                if result.is_finished():
                    results[result.request_id] = result
                    bar.update(1)
    finally:
        manager.stop(block=True, keep_for_next_session=True)
        forget_kept_manager(manager.model, manager)
    # a kept manager counts its request ids on from its last session: each call names them req_0, ... again
    out = {}
    for i, rid in enumerate(ids):
        for k in range(n_ret):
            theirs = f"{rid}__child#{k}" if k < n_ret - 1 else rid
            ours = f"req_{i}__child#{k}" if k < n_ret - 1 else f"req_{i}"
            if theirs in results:
                out[ours] = dataclasses.replace(results[theirs], request_id=ours)
    return out


def _keep_or_destroy(
    model: PreTrainedModel, manager: ContinuousBatchingManager, hook: GraphBatching, settings: str, keep: bool
) -> GraphRunner | None:
    """After a :func:`generate_batch` call: keep ``manager`` and its graphs on ``model`` for the next call of
    ``settings`` (``keep``), else destroy them; the runner that served, for the stats."""
    if hook.runner is not None and hook.options.background:
        hook.runner.wait_captured()
    runner = hook.runner  # for stats: destroying the manager releases it
    if keep:
        setattr(model, _HELD, _Held(settings, manager, hook))
    else:
        held = getattr(model, _HELD, None)
        if held is not None and held.manager is manager:
            delattr(model, _HELD)
        manager.destroy()
        hook.release()
    return runner


@dataclass
class _Held:
    """A manager and its graphs kept on a model for the next :func:`generate_batch` call of ``settings``."""

    settings: str
    manager: ContinuousBatchingManager
    hook: GraphBatching


def release(model: PreTrainedModel) -> bool:
    """Free the manager, cache and graphs :func:`generate_batch` keeps on ``model`` for its next call (a
    background capture is stopped first). Returns True when there were some."""
    held = getattr(model, _HELD, None)
    if held is None:
        return False
    delattr(model, _HELD)
    held.manager.destroy()
    held.hook.release()
    return True


#: graphrunner's attribute on a model that holds what :func:`generate_batch` keeps for its next call (an
#: attribute, so it goes with the model: the manager it holds refers to the model).
_HELD = "_graphrunner_generate_batch"


def _reraise(hook: GraphBatching) -> None:
    """Raise the step's first exception (transformers' generation thread only logs it and fails the requests)."""
    if hook.error is not None:
        err, hook.error = hook.error, None
        raise err
