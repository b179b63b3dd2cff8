"""The part of ``graphrunner serve`` that runs in the model's process: the loader that puts graphs on the
model's continuous-batching managers, and the engine's figures for ``/metrics``.

transformers' serving app starts the model in a process of its own and hands it
the loader (pickled): :class:`GraphModelLoader` loads as transformers does, then
:func:`install_graphs`. ``/metrics`` asks the process for :func:`engine_metrics`
through transformers' own ``EngineClient.submit``. Imports transformers' serving
code (the ``serve`` extra).
"""

from __future__ import annotations

from typing import Any

from transformers.cli.serving.model_manager import ModelLoader

__all__ = ["GraphModelLoader", "engine_metrics", "install_graphs"]

#: The attribute of a served model that holds its current manager.
_MANAGER = "_graphrunner_serving_manager"


def install_graphs(model: Any, options: dict[str, Any] | None) -> None:
    """Make ``model.init_continuous_batching(...)`` (what transformers' serving engine calls) return a
    manager with :func:`graphrunner.hf.init_continuous_batching`'s graphs, ``autocapture=True`` plus
    ``options`` (``backend``, ``device``, ``buckets``, ``max_graphs``, ``replan_every``, ``replan_share``), or, with
    ``options=None`` (``--eager``), transformers' own manager. Either way the manager is kept on
    the model for :func:`engine_metrics`."""
    import graphrunner.hf as grhf

    cls_init = type(model).init_continuous_batching

    def init(
        generation_config: Any = None, continuous_batching_config: Any = None, workload_hints: Any = None, **kwargs: Any
    ) -> Any:
        if options is None:
            manager = cls_init(
                model,
                generation_config=generation_config,
                continuous_batching_config=continuous_batching_config,
                workload_hints=workload_hints,
                **kwargs,
            )
        else:
            # graphrunner's entry point calls model.init_continuous_batching: the class's, not this one
            del model.init_continuous_batching
            try:
                manager = grhf.init_continuous_batching(
                    model, generation_config, continuous_batching_config, workload_hints, autocapture=True, **options
                )
            finally:
                model.init_continuous_batching = init
        setattr(model, _MANAGER, manager)
        return manager

    model.init_continuous_batching = init


class GraphModelLoader(ModelLoader):
    """transformers serve's ``ModelLoader`` whose models serve their continuous-batching steps from graphs
    (:func:`install_graphs` with ``graph_options``; ``None``: transformers' own engine, for ``--eager``).
    ``GraphModelLoader(graph_options, **ModelLoader's arguments)``; picklable (it crosses to the model's
    process)."""

    def __init__(self, graph_options: dict[str, Any] | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.graph_options = graph_options

    def load_model_and_processor(self, model_id: str, on_progress: Any = None) -> Any:
        """transformers' loading, then :func:`install_graphs` on the model (in the model's process)."""
        model, processor = super().load_model_and_processor(model_id, on_progress=on_progress)
        install_graphs(model, self.graph_options)
        return model, processor


def engine_metrics(model: Any, processor: Any = None) -> dict[str, Any]:
    """What ``/metrics`` shows of the engine, read in the model's process (transformers'
    ``EngineClient.submit`` runs it there): the graphs' :class:`~graphrunner.hf.batching.BatchingStats`
    (steps replayed and eager, graphs planned and captured, capture seconds, padding, re-plans,
    fallbacks by reason), the requests the manager runs and holds, and the paged cache's blocks: free,
    held by requests, kept by the prefix cache."""
    manager = getattr(model, _MANAGER, None)
    out: dict[str, Any] = {"graphs_on": False}
    if manager is None:
        return out
    hook = getattr(manager, "graphs", None)
    if hook is not None:
        s = hook.stats
        runner = hook.runner
        out.update(
            graphs_on=True,
            steps=s.steps,
            replayed=s.replayed,
            eager_steps=s.eager_steps,
            real_tokens=s.real_tokens,
            padded_tokens=s.padded_tokens,
            real_keys=s.real_keys,
            padded_keys=s.padded_keys,
            graphs_planned=0 if runner is None else len(runner.keys),
            graphs_captured=hook.captured(),
            capture_seconds=s.capture_seconds,
            replans=s.replans,
            fallbacks=dict(runner.stats.fallback_reasons) if runner is not None else {},
        )
    bp = getattr(manager, "batch_processor", None)
    if bp is not None:
        sched = bp.scheduler
        cache = bp.cache
        held, cached = _request_blocks(cache)
        out.update(
            requests_active=len(sched.active_requests),
            requests_waiting=len(sched.waiting_requests),
            cache_blocks=int(cache.num_blocks),
            cache_free_blocks=_free_blocks(cache),
            cache_held_blocks=held,
            cache_cached_blocks=cached,
        )
    return out


def _request_blocks(cache: Any) -> tuple[int, int]:
    """``(blocks requests hold, blocks the prefix cache keeps)`` over the cache's allocators: a block a
    finished request wrote in full is kept for a later prompt that starts the same (reclaimable), the
    blocks of running requests are held. Read beside the engine's thread: retried if a table changes
    while it is read."""
    for _ in range(20):
        try:
            held = cached = 0
            for alloc in cache.cache_allocators.values():
                held += len({b for blocks in list(alloc.block_table.values()) for b in blocks})
                cached += len(alloc.ledger.cached_blocks)
            return held, cached
        except RuntimeError:  # "dictionary changed size during iteration"
            continue
    return -1, -1


def _free_blocks(cache: Any) -> int:
    """The paged cache's free blocks (of its first allocator: each attention type has its own)."""
    try:
        return int(round(float(cache.compute_free_capacity()) * int(cache.num_blocks)))
    except Exception:  # noqa: BLE001 - a transformers without this method: report none
        return -1
