"""Every use gr.hf and ``graphrunner serve`` make of a transformers internal (a name transformers does not
document as its API), in one place.

Each function below reads or touches one entry of :data:`INTERNALS`; nothing
else in graphrunner does. They were checked on transformers
:data:`CHECKED_WITH`; where one is missing or changed they raise
:class:`TransformersChanged` naming the entry and those versions, at the start
(a manager's install, the server's first ``/metrics`` snapshot), not
mid-serving. ``docs/continuous-batching.md`` ("transformers internals") lists
them with the test that fails when transformers changes each
(``tests/test_hf_internals.py``).

Everything else gr.hf uses of transformers is public: ``AttentionInterface``
and ``set_attn_implementation`` (the attention), ``init_continuous_batching``,
the manager's ``warmup``, ``start``, ``add_requests``, ``get_result``,
``stop`` and ``pause``, the batch processor's ``model_runner`` (a
``ModelRunner`` built through its constructor), the paged cache's
``cache_allocators``, and the step's inputs as ``ContinuousBatchingIOs`` holds
them.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from graphrunner.errors import GraphRunnerError

__all__ = [
    "CHECKED_WITH",
    "INTERNALS",
    "REQUEST_SAMPLING_KEYS",
    "AllocatorLayout",
    "TransformersChanged",
    "allocator_layout",
    "attention_implementation",
    "check_sampling_step",
    "config_attention_implementation",
    "engine_state",
    "fail_step",
    "forget_kept_manager",
    "kept_manager",
    "loop_goes_on",
    "request_seed",
    "step_rows",
    "sync_sampled_ids",
    "wrap_step_methods",
]

#: The transformers versions these internals were checked on.
CHECKED_WITH = "5.25"

#: ``name -> what gr.hf uses it for``: every transformers internal gr.hf and ``graphrunner serve`` use.
INTERNALS = {
    "PretrainedConfig._attn_implementation": (
        "the attention implementation a model runs, read (no public getter; set_attn_implementation is the "
        "public setter)"
    ),
    "ContinuousMixin._cached_continuous_batching_manager": (
        "where manager.stop(keep_for_next_session=True) keeps a manager for the model's next generate_batch: "
        "gr.hf.generate_batch keeps its own managers, so it takes them out of that slot"
    ),
    "the paged cache's allocators and scheduler": (
        "each allocator's per-token K/V views (_kv_token_views), trash, sentinel and sector indices (the slots "
        "the step pads with and checks writes against), block_table and ledger.cached_blocks, and the "
        "scheduler's active_requests / waiting_requests (the server's /metrics)"
    ),
    "ContinuousBatchProcessor.prepare_next_batch / _generation_step / update_batch / handle_batch_error": (
        "wrapped on the batch processor of a server's manager (autocapture), so that no background key "
        "capture runs beside transformers' cache writes outside the forward (prefix-cache forks, offloading) "
        "and its sampling, and so that a step that raised fails only its own requests (handle_batch_error, the "
        "scheduler's block_new_requests cleared as update_batch clears it when a request ends, that step's "
        "update_batch skipped) instead of stopping the engine; on several ranks an iteration whose "
        "prepare_next_batch found no request is an idle tick while background_thread_status.tp_status (the stop "
        "status the TP group agreed in that call) says the loop goes on"
    ),
    "CBGenerateRunner's request settings / ModelRunner._sample": (
        "sampling per request: transformers serve's continuous-batching runner hands a request's seed to the "
        "model's process only as torch.manual_seed(seed), called right before manager.add_request in the same "
        "thread (read there: request_seed), and its temperature, top_k and top_p only where "
        "manager.logit_processor.supported_keys names them; ModelRunner._sample(scores, output_ids) is the "
        "step's sampling, whose rows are the step's requests that get a token (requests_in_batch, "
        "has_new_token), in order"
    ),
    "the batch processor's tensor-parallel step": (
        "_generation_step wrapped on every rank of graphrunner serve --tp, after which the sampled ids "
        "(inputs_and_outputs.output_ids, num_request_in_batch, requests_in_batch) are broadcast from the driver "
        "over distributed_helper.cpu_comm_group (tp_root_global_rank), so that every rank takes the same token"
    ),
}


class TransformersChanged(GraphRunnerError):
    """A transformers internal that gr.hf relies on (an entry of :data:`INTERNALS`) is missing or changed in
    the installed transformers: the message names it and the versions it was checked on."""


def _changed(name: str, detail: object = "") -> TransformersChanged:
    import transformers

    extra = f" ({detail})" if detail else ""
    return TransformersChanged(
        f"transformers {transformers.__version__} changed {name}{extra}: gr.hf uses it for {INTERNALS[name]}. "
        f"Install transformers {CHECKED_WITH} (pip install 'transformers=={CHECKED_WITH}.*'), the version it "
        "was checked on"
    )


# --------------------------------------------------------------------------- 1. the attention implementation


def config_attention_implementation(config: Any) -> str | None:
    """The attention implementation a model config names (its ``_attn_implementation``); ``None`` for no config.
    Raises :class:`TransformersChanged` for a config without the attribute."""
    if config is None:
        return None
    if not hasattr(config, "_attn_implementation"):
        raise _changed("PretrainedConfig._attn_implementation", f"a {type(config).__name__} has none")
    return config._attn_implementation


def attention_implementation(model: Any) -> str | None:
    """The attention implementation ``model`` runs (``sdpa``, ``paged|eager``, ...), ``None`` for an object
    without a config (see :func:`config_attention_implementation`)."""
    return config_attention_implementation(getattr(model, "config", None))


# --------------------------------------------------------------------------- 2. the kept manager


def kept_manager(model: Any) -> Any:
    """The manager transformers keeps on ``model`` for its next ``generate_batch`` (``None``: none)."""
    return getattr(model, "_cached_continuous_batching_manager", None)


def forget_kept_manager(model: Any, manager: Any) -> None:
    """Take ``manager`` out of the slot where ``manager.stop(keep_for_next_session=True)`` keeps it on ``model``
    (``model.generate_batch`` and ``model.init_continuous_batching`` would run it); another manager stays.
    Raises :class:`TransformersChanged` when ``manager`` was not put there (transformers keeps it elsewhere:
    its next ``generate_batch`` could run graphrunner's manager)."""
    if kept_manager(model) is not manager:
        raise _changed(
            "ContinuousMixin._cached_continuous_batching_manager",
            "a manager stopped with keep_for_next_session=True is not there",
        )
    del model._cached_continuous_batching_manager


# --------------------------------------------------------------------------- 3. the cache and the scheduler


@dataclass(frozen=True)
class AllocatorLayout:
    """The slots of one paged-cache allocator (an attention type) the step needs: ``index`` (its position in
    the step's read/write index lists), ``write_trash``, ``read_trash``, ``sentinel`` (slots no request owns),
    ``sector`` (slots of one sector), ``last_index`` (the last slot its K/V views hold) and ``window``."""

    index: int
    write_trash: int
    read_trash: int
    sentinel: int
    sector: int
    last_index: int
    window: int | None


def allocator_layout(alloc: Any, sliding: bool) -> AllocatorLayout:
    """The :class:`AllocatorLayout` of paged-cache allocator ``alloc`` (``sliding``: its layers are sliding
    ones, whose ``sliding_window`` is read). Raises :class:`TransformersChanged` naming what is missing."""
    name = "the paged cache's allocators and scheduler"
    try:
        views = list(alloc._kv_token_views.values())
        if not views:
            raise _changed(name, f"{type(alloc).__name__}._kv_token_views is empty: not an index-based paged cache")
        return AllocatorLayout(
            index=int(alloc.index),
            write_trash=int(alloc.write_trash_index),
            read_trash=int(alloc.read_trash_index),
            sentinel=int(alloc.sentinel_index),
            sector=int(alloc.block_physical_stride) * int(alloc.blocks_per_sector),
            last_index=min(min(k.shape[0], v.shape[0]) for k, v in views) - 1,
            window=alloc.sliding_window if sliding else None,
        )
    except AttributeError as exc:
        raise _changed(name, f"{type(alloc).__name__} has no {exc.name!r}") from exc


def engine_state(manager: Any) -> dict[str, int]:
    """The requests a continuous-batching ``manager`` runs and holds, and its paged cache's blocks: all, free
    (of the first allocator: each attention type has its own), held by running requests, kept by the prefix
    cache for a later prompt (reclaimable). Read it with the manager's loop paused (``manager.pause()``).
    Raises :class:`TransformersChanged` naming what is missing."""
    try:
        bp = manager.batch_processor
        sched, cache = bp.scheduler, bp.cache
        total = int(cache.num_blocks)
        held = cached = 0
        for alloc in cache.cache_allocators.values():
            held += len({b for blocks in alloc.block_table.values() for b in blocks})
            cached += len(alloc.ledger.cached_blocks)
        return {
            "requests_active": len(sched.active_requests),
            "requests_waiting": len(sched.waiting_requests),
            "cache_blocks": total,
            "cache_free_blocks": int(round(float(cache.compute_free_capacity()) * total)),
            "cache_held_blocks": held,
            "cache_cached_blocks": cached,
        }
    except AttributeError as exc:
        raise _changed("the paged cache's allocators and scheduler", f"no {exc.name!r}: {exc}") from exc


# --------------------------------------------------------------------------- 4. the processor's step methods

#: The batch processor's methods that run transformers' work around the forward, in the order of a step.
STEP_METHODS = ("prepare_next_batch", "_generation_step", "update_batch")

_STEP_ENTRY = "ContinuousBatchProcessor.prepare_next_batch / _generation_step / update_batch / handle_batch_error"


def wrap_step_methods(bp: Any, wrap: Callable[[str, Callable[..., Any]], Callable[..., Any]]) -> None:
    """Replace each of :data:`STEP_METHODS` on batch processor ``bp`` by ``wrap(name, method)``. Raises
    :class:`TransformersChanged` (before wrapping any) when one is missing, or ``handle_batch_error``
    (what :func:`fail_step` calls)."""
    missing = [m for m in (*STEP_METHODS, "handle_batch_error") if not callable(getattr(bp, m, None))]
    if missing or not hasattr(getattr(bp, "scheduler", None), "block_new_requests"):
        detail = f"{type(bp).__name__} has no {missing}" if missing else "its scheduler has no block_new_requests"
        raise _changed(_STEP_ENTRY, detail)
    loop_goes_on(bp)  # raises now, not at the first idle iteration
    for m in STEP_METHODS:
        setattr(bp, m, wrap(m, getattr(bp, m)))


def loop_goes_on(bp: Any) -> bool:
    """Whether the generation loop of batch processor ``bp`` goes on after an iteration whose
    ``prepare_next_batch`` returned no batch: the stop status its TP group agreed in that call
    (``background_thread_status.tp_status``) is ``DONT_STOP``. The same on every rank of the group (it is the
    max of every rank's status). Raises :class:`TransformersChanged` where the status is not there."""
    status = getattr(bp, "background_thread_status", None)
    running = getattr(type(status), "DONT_STOP", None)
    if status is None or running is None or not hasattr(status, "tp_status"):
        raise _changed(_STEP_ENTRY, f"{type(bp).__name__}.background_thread_status has no tp_status / DONT_STOP")
    return bool(status.tp_status == running)


# --------------------------------------------------------------------------- 5. the request's sampling

#: What transformers serve's continuous-batching runner (``CBGenerateRunner``) hands a manager of a request's
#: sampling settings, with their types: the names of ``manager.logit_processor.supported_keys`` it passes on
#: to ``manager.add_request`` (cast to these types); the seed comes apart (:func:`request_seed`).
REQUEST_SAMPLING_KEYS: dict[str, type] = {"temperature": float, "top_k": int, "top_p": float}

_SAMPLING = "CBGenerateRunner's request settings / ModelRunner._sample"


def request_seed() -> int:
    """The seed of the request being added, inside ``manager.add_request`` as transformers serve's
    ``CBGenerateRunner.generate`` calls it: it sets a request's seed as the default generator's
    (``torch.manual_seed(seed)``) in the thread that calls ``add_request`` next, and hands it no other way
    (``torch.initial_seed()``: draws from the generator do not change it; a seed of ``torch.manual_seed``'s
    negative range reads as its 64-bit two's complement)."""
    return int(torch.initial_seed())


def check_sampling_step(runner_class: type) -> None:
    """Raise :class:`TransformersChanged` unless ``runner_class`` (transformers' ``ModelRunner``) samples a step
    in ``_sample(scores, output_ids)``."""
    fn = getattr(runner_class, "_sample", None)
    params = list(inspect.signature(fn).parameters) if callable(fn) else None
    if params != ["self", "scores", "output_ids"]:
        raise _changed(_SAMPLING, f"{runner_class.__name__}._sample{'' if params is None else tuple(params)}")


def step_rows(io: Any) -> list[str]:
    """The request ids of a step's logits rows, in order: the step's requests (``io.requests_in_batch``, of
    transformers' ``ContinuousBatchingIOs``) that get a new token this step. Raises
    :class:`TransformersChanged` naming what is missing."""
    try:
        return [fs.state.request_id for fs in io.requests_in_batch if fs.has_new_token]
    except AttributeError as exc:
        raise _changed(_SAMPLING, f"no {exc.name!r} on the step's requests: {exc}") from exc


class SampledIdSync:
    """What :func:`sync_sampled_ids` measured on one rank: ``steps`` synchronised and ``seconds`` spent in their
    collectives (the broadcast, waiting for the driver included; the debug comparison too)."""

    def __init__(self) -> None:
        self.steps = 0
        self.seconds = 0.0


def sync_sampled_ids(bp: Any, debug: bool = False) -> SampledIdSync:
    """Every rank of a tensor-parallel batch processor ``bp`` takes the tokens its driver sampled: its
    ``_generation_step`` is wrapped so that, after the step, the driver's sampled ids (``output_ids``
    of the step's requests) are broadcast over transformers' CPU group of the TP ranks. transformers
    seeds a request's sampling on the driver only (``seed``), so the ranks would otherwise sample
    different tokens and the next step's all-reduce would mix different sequences, silently.
    ``debug``: first compare every rank's own sampled ids (an all-gather) and raise
    ``RuntimeError`` naming the step and the requests whose token differs. A no-op on one rank. Returns the
    :class:`SampledIdSync` it counts its steps and seconds in.
    Raises :class:`TransformersChanged` (before wrapping) when an entry it reads is missing."""
    name = "the batch processor's tensor-parallel step"
    helper = getattr(bp, "distributed_helper", None)
    io = getattr(bp, "inputs_and_outputs", None)
    missing = [
        n
        for n, obj, attr in (
            ("distributed_helper", bp, "distributed_helper"),
            ("_generation_step", bp, "_generation_step"),
            ("inputs_and_outputs.output_ids", io, "output_ids"),
            ("inputs_and_outputs.requests_in_batch", io, "requests_in_batch"),
            ("inputs_and_outputs.num_request_in_batch", io, "num_request_in_batch"),
            ("distributed_helper.cpu_comm_group", helper, "cpu_comm_group"),
            ("distributed_helper.tp_root_global_rank", helper, "tp_root_global_rank"),
        )
        if obj is None or not hasattr(obj, attr)
    ]
    if missing:
        raise _changed(name, f"{type(bp).__name__} has no {missing}")
    assert helper is not None and io is not None  # checked above
    sync = SampledIdSync()
    if int(getattr(helper, "tp_size", 1)) <= 1:
        return sync
    import time

    import torch
    import torch.distributed as dist

    step_fn = bp._generation_step
    steps = [0]

    def step(*args: Any, **kwargs: Any) -> Any:
        out = step_fn(*args, **kwargs)
        steps[0] += 1
        began = time.perf_counter()
        try:
            _sync(steps[0])
        finally:
            sync.steps += 1
            sync.seconds += time.perf_counter() - began
        return out

    def _sync(at: int) -> None:
        n = int(io.num_request_in_batch)
        ids = io.output_ids[:, :n]
        group = helper.cpu_comm_group
        if debug:
            mine = ids[0].to("cpu", torch.int64).contiguous()
            every = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
            dist.all_gather(every, mine, group=group)
            apart = sorted({i for other in every for i in (other != every[0]).nonzero().flatten().tolist()})
            if apart:
                requests = [getattr(getattr(r, "state", r), "request_id", "?") for r in io.requests_in_batch]
                names = [str(requests[i]) if i < len(requests) else f"#{i}" for i in apart]
                raise RuntimeError(
                    f"graphrunner serve --tp: the ranks sampled different tokens at step {at} for request(s) "
                    f"{', '.join(names)} ({[[int(t[i]) for t in every] for i in apart]} by rank): their next "
                    "all-reduce would mix different sequences. Every rank must sample alike: seed every rank "
                    "(--default-seed) or leave the sampling to the driver (the default)"
                )
        host = ids.to("cpu").contiguous()
        dist.broadcast(host, src=int(helper.tp_root_global_rank), group=group)
        if host.data_ptr() != ids.data_ptr():
            ids.copy_(host)

    bp._generation_step = step
    return sync


def tp_process_groups(manager: Any) -> list[Any]:
    """The process groups a tensor-parallel ``manager``'s generation loop makes collectives on: transformers' CPU
    group of the TP ranks (``distributed_helper.cpu_comm_group``, its per-step state and the driver's requests)
    and the model's TP group (``distributed_helper.tp_group``, the forward's all-reduces); none on one rank."""
    helper = getattr(manager, "distributed_helper", None)
    groups = [getattr(helper, "cpu_comm_group", None), getattr(helper, "tp_group", None)]
    return [g for g in groups if g is not None]


def fail_step(bp: Any, error: Exception) -> None:
    """Fail the requests of the step batch processor ``bp`` just ran (its ``_generation_step`` raised) with
    ``error``, as transformers fails a request: each gets its tokens so far and the error
    (``handle_batch_error``) and its cache blocks are freed; the scheduler admits new requests again, as
    ``update_batch`` lets it when a request ends. The caller skips that step's ``update_batch``: its
    requests are over. Raises :class:`TransformersChanged` naming what is missing."""
    try:
        bp.handle_batch_error(error)
        bp.scheduler.block_new_requests = False
    except AttributeError as exc:
        raise _changed(_STEP_ENTRY, f"no {exc.name!r}") from exc
