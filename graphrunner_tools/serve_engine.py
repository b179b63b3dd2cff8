"""The part of ``graphrunner serve`` that runs in the model's process: the loader that gives transformers' engine a
model whose continuous-batching manager has graphs and samples per request, and the engine's figures for
``/metrics``.

transformers' serving app starts the model in a process of its own and loads it there with the server's
``ModelLoader`` (pickled; ``ModelManager(loader=...)``). :class:`GraphModelLoader` loads as transformers
does and hands the engine a :class:`ServedModel`: the model, whose ``init_continuous_batching`` (what the
engine calls to make its manager) makes the manager with :func:`graphrunner.hf.init_continuous_batching`
(or transformers' own, ``--eager``), its steps sampled per request
(:func:`graphrunner.hf.model_runner.sample_per_request`), and hands the engine's runner that manager as a
:class:`ServedManager`, which keeps each request's sampling settings and seed as it is added.
Nothing of transformers' is replaced or patched. ``/metrics`` asks the process for :func:`engine_metrics`
through transformers' ``EngineClient.submit``. Imports transformers' serving code (the ``serve`` extra).
"""

from __future__ import annotations

import copy
import itertools
import os
import sys
import time
from collections.abc import Callable
from typing import Any, TextIO

import torch
from transformers.cli.serving.model_manager import ModelLoader

from graphrunner.errors import CaptureError
from graphrunner.hf import graphs_of, init_continuous_batching
from graphrunner.hf.internals import REQUEST_SAMPLING_KEYS, engine_state, request_seed
from graphrunner.hf.model_runner import GraphModelRunner, sample_per_request
from graphrunner.hf.sampling import RequestSampler, SamplingParams
from graphrunner.progress import StatusLine

__all__ = [
    "FAULT_ENV",
    "SLOW_CAPTURE_ENV",
    "SLOW_CAPTURE_SECONDS",
    "GraphModelLoader",
    "ServedManager",
    "ServedModel",
    "RANK_FIGURES",
    "capture_before_serving",
    "engine_metrics",
    "loader_arguments",
]

#: Tests only: the environment variable naming a trigger file (:func:`_with_fault`); read in one place,
#: :meth:`ServedModel.init_continuous_batching`.
FAULT_ENV = "GRAPHRUNNER_SERVE_FAULT"

#: Tests only: the environment variable naming a trigger file: while the file exists, every forward of the model
#: first sleeps :data:`SLOW_CAPTURE_SECONDS` (:func:`_slowed_while`), so a background capture that starts with the
#: model's load is still under way when the server first answers (the negative control of ``--capture-first``);
#: read in one place, :meth:`ServedModel.init_continuous_batching`.
SLOW_CAPTURE_ENV = "GRAPHRUNNER_SERVE_SLOW_CAPTURE"

#: Seconds each forward sleeps while :data:`SLOW_CAPTURE_ENV`'s file exists (a key's capture runs 3 or 4 forwards).
SLOW_CAPTURE_SECONDS = 0.25


class _SamplingKeys:
    """What transformers serve's runner reads of a manager's logits processors: the sampling settings it may hand
    a request (``supported_keys``), all of them, whatever the model's generation config."""

    supported_keys = REQUEST_SAMPLING_KEYS


class ServedManager:
    """A continuous-batching manager (:attr:`wrapped`) as transformers serve's runner (``CBGenerateRunner``)
    drives it, every request sampled per request by ``sampler`` (a :class:`~graphrunner.hf.sampling.RequestSampler`
    installed on the manager's steps). Every attribute it does not have itself is the manager's.

    It tells the runner it takes ``temperature``, ``top_k`` and ``top_p`` from every request
    (``logit_processor.supported_keys``: transformers' manager takes them only where its model's generation
    config makes their logits processors), and :meth:`add_request` keeps them, with the request's seed, in
    ``sampler`` before the manager sees the request (which gets none of them: its steps are sampled by
    ``sampler``); a request ends (:meth:`get_result`) or is cancelled: forgotten."""

    def __init__(self, manager: Any, sampler: RequestSampler) -> None:
        self.wrapped = manager
        self.sampler = sampler
        self.logit_processor = _SamplingKeys()
        self._ids = itertools.count()

    def __getattr__(self, name: str) -> Any:  # called only for names this object does not have
        if name == "wrapped":  # not set yet (a copy being made): no recursion
            raise AttributeError(name)
        return getattr(self.wrapped, name)

    def add_request(self, input_ids: list[int], request_id: str | None = None, *args: Any, **kwargs: Any) -> str | None:
        """The manager's ``add_request`` (its arguments), the request's sampling settings (``temperature``: 0 or
        none is greedy, ``top_k``, ``top_p``) and seed kept first: the seed is the one transformers' runner set
        for the request just before (:func:`~graphrunner.hf.internals.request_seed`). ``ValueError`` for a
        setting out of range or another one."""
        sampling = {name: kwargs.pop(name) for name in list(kwargs) if name in REQUEST_SAMPLING_KEYS}
        unknown = sorted(set(kwargs) - {"max_new_tokens", "streaming", "record_timestamps", "eos_token_id"})
        if unknown:
            raise ValueError(f"continuous batching takes no {', '.join(unknown)} from a request")
        params = SamplingParams(
            temperature=float(sampling.get("temperature") or 0.0),
            top_k=int(sampling.get("top_k") or 0),
            top_p=float(sampling.get("top_p") or 1.0),
            seed=request_seed(),
        )
        if request_id is None:
            request_id = f"served_{next(self._ids)}"
        self.sampler.add(request_id, params)
        try:
            added = self.wrapped.add_request(input_ids, request_id, *args, **kwargs)
        except BaseException:
            self.sampler.forget(request_id)
            raise
        if added is None:  # not taken (the manager stops)
            self.sampler.forget(request_id)
        return added

    def start(self) -> None:
        """The manager's ``start``, and nothing when its loop already runs (a tensor-parallel rank starts it to
        capture before serving: its keys are granted at the loop's iterations)."""
        if not self.wrapped.is_running():
            self.wrapped.start()

    def get_result(self, request_id: str | None = None, timeout: float | None = None) -> Any:
        """The manager's ``get_result``; a request's last result (finished or failed) forgets its settings."""
        output = self.wrapped.get_result(request_id=request_id, timeout=timeout)
        if output is not None and output.is_finished():
            self.sampler.forget(output.request_id)
        return output

    def cancel_request(self, request_id: str) -> None:
        """The manager's ``cancel_request``; the request's settings forgotten (a step of it still running
        samples it greedily: its token is dropped)."""
        self.wrapped.cancel_request(request_id)
        self.sampler.forget(request_id)


def greedy_config(generation_config: Any) -> Any:
    """A copy of ``generation_config`` that does not sample (``do_sample=False``): the manager made with it runs
    no sampling logits processor (temperature, top-k, top-p, ...) of the model's own, as each request samples
    with its own settings (:class:`ServedManager`); the model's other logits processors stay."""
    config = copy.deepcopy(generation_config)
    config.do_sample = False
    return config


class ServedModel:
    """A loaded transformers model as :class:`GraphModelLoader` hands it to transformers' serving engine: the
    model (:attr:`wrapped`; every attribute it does not have itself is the model's), whose
    :meth:`init_continuous_batching` makes a manager with graphs, its steps sampled per request by
    :attr:`sampler`, and keeps it (:attr:`manager`, for :func:`engine_metrics`). It does not own the model or
    change it: the manager is made on the model itself, by :func:`graphrunner.hf.init_continuous_batching`
    (or, with ``graph_options=None``, transformers' own ``init_continuous_batching``). ``capture_first``
    (``graphrunner serve --capture-first``; graphs only): :meth:`init_continuous_batching` returns the manager
    only once every planned key is captured (:func:`capture_before_serving`), so the engine starts, and the
    server answers, at full speed."""

    #: Whether :meth:`init_continuous_batching` captures (``capture_first``) before the manager's loop starts: one
    #: rank. A subclass whose keys are granted by the running loop (several ranks) sets it ``False`` and captures
    #: once it started the loop.
    capture_before_loop = True

    def __init__(self, model: Any, graph_options: dict[str, Any] | None, *, capture_first: bool = False) -> None:
        if capture_first and graph_options is None:
            raise ValueError(
                "capture_first=True needs graph_options: without graphs (--eager) there is nothing to capture"
            )
        self.wrapped = model
        self.graph_options = graph_options
        #: Capture every planned key before the manager is handed to the engine (``--capture-first``).
        self.capture_first = capture_first
        self.manager: Any = None
        #: Each request's sampling settings and generator (:class:`ServedManager` keeps them).
        self.sampler = RequestSampler()

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
        ``graph_options=None`` (``--eager``), transformers' own; either way made with the generation config
        (default: the model's) less its sampling (:func:`greedy_config`), its steps sampled per request
        (:func:`graphrunner.hf.model_runner.sample_per_request`), handed on as a :class:`ServedManager`. With
        :attr:`capture_first`, returns once every planned key is captured (:func:`capture_before_serving`,
        progress on stderr), before the engine's loop starts; a capture that fails raises
        :class:`~graphrunner.errors.CaptureError` naming it (transformers' loader then fails the server's
        start)."""
        config = greedy_config(generation_config if generation_config is not None else self.wrapped.generation_config)
        if self.graph_options is None:
            manager = self.wrapped.init_continuous_batching(config, continuous_batching_config, workload_hints)
            manager.warmup()  # makes its batch processor (the engine's runner calls it again: it is made once)
        else:
            manager = init_continuous_batching(
                self.wrapped,
                config,
                continuous_batching_config,
                workload_hints,
                autocapture=True,
                **self.graph_options,
            )
        try:
            slow = os.environ.get(SLOW_CAPTURE_ENV)
            if slow:  # tests only: after the manager's own warm-up, so only the capture's forwards are slowed
                self.wrapped.register_forward_pre_hook(_slowed_while(slow))
            sample_per_request(manager.batch_processor, self.sampler)
            if self.capture_first and self.capture_before_loop:
                capture_before_serving(manager)
        except BaseException:
            manager.destroy()
            hook = graphs_of(manager)
            if hook is not None:  # its capture thread goes with it, not at the process's exit
                hook.release()
            raise
        self.manager = manager
        trigger = os.environ.get(FAULT_ENV)
        if trigger:  # tests only
            hook = graphs_of(manager)
            model_runner = None if hook is None else hook.processor.model_runner
            if not isinstance(model_runner, GraphModelRunner):
                raise ValueError(f"{FAULT_ENV} needs the graphs: it faults graphrunner's step (not with --eager)")
            model_runner.serve = _with_fault(model_runner.serve, trigger)
        return ServedManager(manager, self.sampler)


def capture_before_serving(manager: Any, stream: TextIO | None = None, interval: float = 1.0) -> tuple[int, float]:
    """Wait until every key the graphs of ``manager`` planned is captured (``graphrunner serve --capture-first``):
    ``manager`` is one :func:`graphrunner.hf.init_continuous_batching` made with ``autocapture=True`` (its ladder's
    background capture started when it was made). On one rank it is not started yet, so no step runs beside the
    capture and the capture never rests (its pacing rests only while steps come): its keys are captured back to
    back, with the process's torch threads. On several ranks (its graphs agree over a group of several) its loop
    runs, on every rank, with no request: its keys are granted at the loop's idle iterations, captured on every
    rank at full speed, and a key counts once every rank has it (never granted from here, which would leave the
    ranks' collectives). Shows ``keys captured of planned, seconds`` on ``stream`` (default ``sys.stderr``) every
    ``interval`` seconds (in place on a terminal) and a last line; returns ``(keys captured, seconds)``.

    Raises :class:`~graphrunner.errors.CaptureError` naming the error (its type, message and notes) and how many
    keys were captured when a key's capture fails, when the capture ends with keys not replayable, or when a
    several-rank manager's loop stops meanwhile; ``ValueError`` for a manager without graphs (``--eager``:
    nothing to capture) or a several-rank one whose loop does not run."""
    hook = graphs_of(manager)
    runner = None if hook is None else hook.runner
    if hook is None or runner is None:
        raise ValueError(
            "capture_before_serving needs a manager made by gr.hf.init_continuous_batching(..., autocapture=True): "
            "this one has no graphs to capture (--eager serves without graphs: drop --capture-first)"
        )
    group = getattr(hook.options, "group", None)
    several = group is not None and getattr(group, "size", 1) > 1
    if several and not manager.is_running():
        raise ValueError(
            "capture_before_serving on several ranks needs the manager's loop running on every rank: its keys are "
            "granted at the loop's iterations (manager.start() first)"
        )
    planned = len(runner.keys)
    line = StatusLine(stream if stream is not None else sys.stderr)
    threads = torch.get_num_threads()
    t0 = time.perf_counter()

    def done() -> int:  # keys whose graph exists (they replay once the capture ends)
        return sum(1 for k in runner.keys if runner.backend.can_run(k))

    def finished() -> bool:  # within ``interval`` s
        if not several:
            return runner.wait_captured(timeout=interval) is not None
        until = time.perf_counter() + interval
        while hook.captured() < planned and runner.capture_error is None and manager.is_running():
            if time.perf_counter() > until:
                return False
            time.sleep(0.02)
        return hook.captured() == planned

    while not finished():
        if several and not manager.is_running():
            raise CaptureError(
                f"--capture-first: the engine's loop stopped after {done()} of {planned} keys were captured on "
                f"rank {group.rank} ({time.perf_counter() - t0:.1f} s): "
                f"{manager.background_thread_status.fatal_error or 'stopped'}; the server does not start"
            )
        error = runner.capture_error
        if error is not None:
            notes = "".join(f"; {n}" for n in getattr(error, "__notes__", ()))
            line.write(f"graphrunner serve: the capture failed after {done()}/{planned} keys", final=True)
            raise CaptureError(
                f"--capture-first: capturing the graphs before serving failed after {done()} of {planned} keys "
                f"({time.perf_counter() - t0:.1f} s): {type(error).__name__}: {error}{notes}. The server does not "
                "start; drop --capture-first to serve with the keys that capture (the others eagerly), or fix "
                "the model's step"
            ) from error
        line.write(
            f"graphrunner serve: capturing the graphs before serving: {done()}/{planned} keys, "
            f"{time.perf_counter() - t0:.1f} s ({threads} torch threads)"
        )
    seconds = time.perf_counter() - t0
    captured = hook.captured()  # the keys that replay now (the capture's end made them replayable)
    if captured != planned:
        raise CaptureError(
            f"--capture-first: the capture ended with {captured} of {planned} keys replayable (backend "
            f"{getattr(runner.backend, 'name', type(runner.backend).__name__)!r}): the server would not start at "
            "full speed; drop --capture-first, or use a backend that captures graphs (--backend full or breakable)"
        )
    line.write(
        f"graphrunner serve: captured {captured}/{planned} keys in {seconds:.1f} s before serving "
        f"({threads} torch threads): every step replays from the first request",
        final=True,
    )
    return captured, seconds


def _slowed_while(trigger: str) -> Callable[..., None]:
    """Tests only (:data:`SLOW_CAPTURE_ENV`): a forward pre-hook that sleeps :data:`SLOW_CAPTURE_SECONDS` while the
    file ``trigger`` exists (Python around the forward: a graph captured meanwhile records none of it)."""

    def slow(module: Any, args: Any) -> None:
        if os.path.exists(trigger):
            time.sleep(SLOW_CAPTURE_SECONDS)

    return slow


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


def loader_arguments(args: Any) -> dict[str, Any]:
    """transformers' ``ModelLoader`` arguments of ``graphrunner serve``'s parsed ``args`` (device, dtype, attention
    implementation; no remote code, no quantization, continuous batching): what every loader of the server takes
    (:class:`GraphModelLoader`, and ``graphrunner_tools.serve_tp.TPModelLoader`` on every TP rank)."""
    return {
        "device": args.device,
        "dtype": args.dtype,
        "trust_remote_code": False,
        "attn_implementation": args.attn_implementation,
        "quantization": None,
        "continuous_batching": True,
    }


class GraphModelLoader(ModelLoader):
    """transformers serve's ``ModelLoader`` whose models serve their continuous-batching steps from graphs
    (:class:`ServedModel` with ``graph_options``; ``None``: transformers' own engine, for ``--eager``).
    ``GraphModelLoader(graph_options, capture_first=False, **ModelLoader's arguments)``; ``capture_first``
    (``--capture-first``): the model's load ends once every planned key is captured (:class:`ServedModel`);
    picklable (it crosses to the model's process)."""

    def __init__(
        self, graph_options: dict[str, Any] | None = None, *, capture_first: bool = False, **kwargs: Any
    ) -> None:
        if capture_first and graph_options is None:
            raise ValueError(
                "capture_first=True needs graph_options: without graphs (--eager) there is nothing to capture"
            )
        super().__init__(**kwargs)
        self.graph_options = graph_options
        #: Capture every planned key before the engine starts (``--capture-first``).
        self.capture_first = capture_first

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
        return ServedModel(model, self.graph_options, capture_first=self.capture_first), processor


#: The figures ``/metrics`` shows per rank (``graphrunner_rank_*{rank}``), of :func:`engine_metrics`' keys.
RANK_FIGURES = ("graphs_captured", "capture_seconds", "replayed", "eager_steps", "collective_seconds", "synced_steps")


def engine_metrics(model: Any, processor: Any = None) -> dict[str, Any]:
    """What ``/metrics`` shows of the engine, read in the model's process (transformers'
    ``EngineClient.submit`` runs it there; ``model``: a :class:`ServedModel`): the graphs'
    :class:`~graphrunner.hf.batching.BatchingStats` (steps replayed and eager, graphs planned and captured,
    capture seconds, padding, re-plans, fallbacks by reason), and the engine's state
    (:func:`engine_state`), read with the generation loop paused between two steps (transformers'
    ``manager.pause()``), so every figure is of the same moment; ``ready``: 1 once every planned graph is
    captured (the capture starts when the model is loaded, before any request), or at once without graphs;
    ``collective_seconds``: the seconds the steps waited in collectives with other ranks (the graphs' agreement
    per step, and on TP ranks the sampled ids' broadcast; 0 on one rank); ``synced_steps``: TP ranks, the steps
    whose sampled ids were broadcast (0 on one rank); ``ranks``: ``{rank: {figure: value}}``
    of :data:`RANK_FIGURES`, every rank's (the model's ``rank_figures``; one rank: its own). The server calls
    it once at its start, where a transformers whose engine :func:`engine_state` cannot read fails it."""
    manager = getattr(model, "manager", None)
    out: dict[str, Any] = {"graphs_on": False}
    if manager is None:
        return out
    if not manager.is_running():  # its loop is gone (the engine died): nothing to pause, nothing to read
        return out
    # transformers' pause is the TP group's (every rank must enter it): on tensor-parallel ranks the figures
    # are read beside the loop (graphrunner_tools.serve_tp.TPServedModel.read_beside)
    with getattr(model, "read_beside", manager.pause)():
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
                collective_seconds=0.0 if runner is None else runner.stats.agreement_seconds,
            )
        sync = getattr(model, "sync", None)  # TP ranks: the sampled ids' broadcast
        out["collective_seconds"] = out.get("collective_seconds", 0.0) + (0.0 if sync is None else sync.seconds)
        out["synced_steps"] = 0 if sync is None else sync.steps
        for attempt in range(5):  # beside a running loop (tensor-parallel ranks) a read may race a step
            try:
                out.update(engine_state(manager))
                break
            except RuntimeError:
                if attempt == 4:
                    raise
    # full speed: every planned graph captured (transformers' own engine, --eager: once it runs)
    out["ready"] = int(not out["graphs_on"] or 0 < out["graphs_captured"] == out["graphs_planned"])
    own = {k: out.get(k, 0) for k in RANK_FIGURES}
    rank_figures = getattr(model, "rank_figures", None)
    out["ranks"] = rank_figures(own) if rank_figures is not None else {0: own}
    return out
