"""The part of ``graphrunner serve`` that runs in the model's process: the loader that gives transformers' engine a
model whose continuous-batching manager has graphs, and the engine's figures for ``/metrics``.

transformers' serving app starts the model in a process of its own and loads it there with the server's
``ModelLoader`` (pickled; ``ModelManager(loader=...)``). :class:`GraphModelLoader` loads as transformers
does and hands the engine a :class:`ServedModel`: the model, whose ``init_continuous_batching`` (what the
engine calls to make its manager) makes the manager with :func:`graphrunner.hf.init_continuous_batching`.
Nothing of transformers' is replaced or patched. ``/metrics`` asks the process for :func:`engine_metrics`
through transformers' ``EngineClient.submit``. Imports transformers' serving code (the ``serve`` extra).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from transformers.cli.serving.model_manager import ModelLoader

from graphrunner.hf import graphs_of, init_continuous_batching
from graphrunner.hf.internals import engine_state
from graphrunner.hf.model_runner import GraphModelRunner

__all__ = ["FAULT_ENV", "GraphModelLoader", "ServedModel", "engine_metrics"]

#: Tests only: the environment variable naming a trigger file (:func:`_with_fault`); read in one place,
#: :meth:`ServedModel.init_continuous_batching`.
FAULT_ENV = "GRAPHRUNNER_SERVE_FAULT"


class ServedModel:
    """A loaded transformers model as :class:`GraphModelLoader` hands it to transformers' serving engine: the
    model (:attr:`wrapped`; every attribute it does not have itself is the model's), whose
    :meth:`init_continuous_batching` makes a manager with graphs and keeps it (:attr:`manager`, for
    :func:`engine_metrics`). It does not own the model or change it: the manager is made on the model
    itself, by :func:`graphrunner.hf.init_continuous_batching` (or, with ``graph_options=None``,
    transformers' own ``init_continuous_batching``)."""

    def __init__(self, model: Any, graph_options: dict[str, Any] | None) -> None:
        self.wrapped = model
        self.graph_options = graph_options
        self.manager: Any = None

    def __getattr__(self, name: str) -> Any:  # called only for names this object does not have
        if name == "wrapped":  # not set yet (a copy being made): no recursion
            raise AttributeError(name)
        return getattr(self.wrapped, name)

    def init_continuous_batching(
        self, generation_config: Any = None, continuous_batching_config: Any = None, workload_hints: Any = None
    ) -> Any:
        """The model's manager (transformers' ``init_continuous_batching`` signature) with
        :func:`graphrunner.hf.init_continuous_batching`'s graphs, ``autocapture=True`` plus the options
        (``backend``, ``device``, ``buckets``, ``max_graphs``, ``replan_every``, ``replan_share``), or, with
        ``graph_options=None`` (``--eager``), transformers' own."""
        if self.graph_options is None:
            self.manager = self.wrapped.init_continuous_batching(
                generation_config, continuous_batching_config, workload_hints
            )
        else:
            self.manager = init_continuous_batching(
                self.wrapped,
                generation_config,
                continuous_batching_config,
                workload_hints,
                autocapture=True,
                **self.graph_options,
            )
        trigger = os.environ.get(FAULT_ENV)
        if trigger:  # tests only
            hook = graphs_of(self.manager)
            model_runner = None if hook is None else hook.processor.model_runner
            if not isinstance(model_runner, GraphModelRunner):
                raise ValueError(f"{FAULT_ENV} needs the graphs: it faults graphrunner's step (not with --eager)")
            model_runner.serve = _with_fault(model_runner.serve, trigger)
        return self.manager


def _with_fault(serve: Callable[..., Any], trigger: str) -> Callable[..., Any]:
    """Tests only (:data:`FAULT_ENV`): ``serve`` (graphrunner's step, ``GraphModelRunner.serve``), but while
    the file ``trigger`` exists the step raises ``RuntimeError`` naming the fault, as a step that fails does:
    the file holds how many steps raise (empty: 1), counted down, and is removed when they have."""

    def serve_or_raise(*args: Any) -> Any:
        try:
            with open(trigger) as f:
                text = f.read().strip()
        except FileNotFoundError:
            return serve(*args)
        left = int(text or 1) - 1
        if left > 0:
            with open(trigger, "w") as f:
                f.write(str(left))
        else:
            os.remove(trigger)
        raise RuntimeError(f"a fault injected for a test ({FAULT_ENV}={trigger})")

    return serve_or_raise


class GraphModelLoader(ModelLoader):
    """transformers serve's ``ModelLoader`` whose models serve their continuous-batching steps from graphs
    (:class:`ServedModel` with ``graph_options``; ``None``: transformers' own engine, for ``--eager``).
    ``GraphModelLoader(graph_options, **ModelLoader's arguments)``; picklable (it crosses to the model's
    process)."""

    def __init__(self, graph_options: dict[str, Any] | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.graph_options = graph_options

    def load_model_and_processor(self, model_id: str, on_progress: Any = None) -> Any:
        """transformers' loading, the model handed on as a :class:`ServedModel` (in the model's process).

        Its progress bars write under a thread lock, not tqdm's default, which adds a named multiprocessing
        semaphore: the model's process is stopped with SIGTERM (transformers' ``EngineClient.shutdown``),
        never unlinks it, and the resource tracker it shares with the server warned of a leaked semaphore
        at every stop."""
        import threading

        from tqdm import tqdm

        tqdm.set_lock(threading.RLock())  # tqdm's public seam; the model's process is its only writer
        model, processor = super().load_model_and_processor(model_id, on_progress=on_progress)
        return ServedModel(model, self.graph_options), processor


def engine_metrics(model: Any, processor: Any = None) -> dict[str, Any]:
    """What ``/metrics`` shows of the engine, read in the model's process (transformers'
    ``EngineClient.submit`` runs it there; ``model``: a :class:`ServedModel`): the graphs'
    :class:`~graphrunner.hf.batching.BatchingStats` (steps replayed and eager, graphs planned and captured,
    capture seconds, padding, re-plans, fallbacks by reason), and the engine's state
    (:func:`engine_state`), read with the generation loop paused between two steps (transformers'
    ``manager.pause()``), so every figure is of the same moment; ``ready``: 1 once every planned graph is
    captured (the capture starts when the model is loaded, before any request), or at once without graphs. The server calls it once at its start,
    where a transformers whose engine :func:`engine_state` cannot read fails it."""
    manager = getattr(model, "manager", None)
    out: dict[str, Any] = {"graphs_on": False}
    if manager is None:
        return out
    if not manager.is_running():  # its loop is gone (the engine died): nothing to pause, nothing to read
        return out
    with manager.pause():
        hook = graphs_of(manager)
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
                failed_steps=s.failed_steps,
                fallbacks=dict(runner.stats.fallback_reasons) if runner is not None else {},
            )
        out.update(engine_state(manager))
    # full speed: every planned graph captured (transformers' own engine, --eager: once it runs)
    out["ready"] = int(not out["graphs_on"] or 0 < out["graphs_captured"] == out["graphs_planned"])
    return out
