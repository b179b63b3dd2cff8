"""``graphrunner serve --tp N``: the server on N tensor-parallel ranks (transformers' tensor parallelism).

The topology. Rank 0 is the server of ``--tp 1``, unchanged: transformers' HTTP app, and the model's process
it spawns (transformers' ``EngineClient``), which is the TP *driver*: it joins the ranks' group
(torch.distributed, from the rank's torchrun environment it inherits), loads the model with
``from_pretrained(..., distributed_config=DistributedConfig(tp_size=N))`` and runs transformers'
continuous-batching manager, to which the HTTP app adds the requests. Every other rank is a *follower*: it
joins the group, loads the model the same way, makes the same manager (the same batching config and
workload hints as transformers' ``CBGenerateRunner`` makes on the driver) and starts it: transformers'
manager on a non-driver rank follows the driver step by step (a small all-reduce per step, then the
driver's new requests broadcast). Nobody reads a follower's outputs: a thread drains them.

The ranks come from torch's elastic launcher (:func:`graphrunner_tools.launch.launch_ranks`: ``graphrunner
serve MODEL --tp N``), or from torchrun (``torchrun --nproc-per-node N -m graphrunner_tools serve MODEL
--tp N``, one node or several): each worker runs its rank's part here.

Every rank takes the same token: after each step the driver's sampled ids are broadcast to the followers
(:func:`graphrunner.hf.internals.sync_sampled_ids`; ``--tp-debug`` first compares every rank's own and
raises naming the step and the requests that differ).

Faults: a rank that dies ends its launcher's run: torch's launcher stops every other rank (SIGTERM, then
SIGKILL) and ``graphrunner serve`` exits 1 naming the rank and its cause; the driver's requests in flight
fail at its next collective (the peer's connection closed). A follower whose driver went away without a
stop (SIGTERM) raises. SIGTERM stops every rank: rank 0 as the one-rank server (requests in flight get
``--shutdown-timeout`` seconds), then its model's process, after which each follower's manager loop ends
(a loop still inside a collective with the gone driver leaves it when its process groups are aborted) and
the follower returns 0.

Graphs (no ``--eager``): every rank's manager serves its steps from ``gr.hf``'s graphs over a group of the TP ranks
(``BatchingOptions.group``, a ``TorchDistGroup(tensor_parallel=True)`` over the world): each step's agreement decides
its key on every rank, the background capture's keys are granted at a step (or at an idle iteration of the loop:
an idle server captures its ladder from the start) and captured on every rank before the next; a re-plan is
decided at the same step on every rank. By default (``--capture-first``) every rank starts its loop in its
model's load and waits there until every key of the ladder is captured on every rank
(:meth:`TPServedModel.init_continuous_batching`), so rank 0 builds its HTTP server only then.
docs/serving.md, "Graphs on TP ranks".

``/metrics`` shows every rank: a follower puts its figures in the ranks' rendezvous store every second
(:meth:`TPServedModel.publish_figures`), the driver reads them at each scrape (:meth:`TPServedModel.rank_figures`).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import logging
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from graphrunner.group import TorchDistGroup
from graphrunner_tools.launch import join_group, launch_ranks, torchrun_env
from graphrunner_tools.serve_engine import (
    GraphModelLoader,
    ServedModel,
    capture_before_serving,
    engine_metrics,
    loader_arguments,
)

__all__ = ["TPModelLoader", "TPServedModel", "serve_tp"]

logger = logging.getLogger("graphrunner")


def _backend(device: str) -> str:
    """gloo on CPUs, NCCL on GPUs."""
    import torch

    return "nccl" if device != "cpu" and torch.cuda.is_available() else "gloo"


class TPServedModel(ServedModel):
    """A :class:`ServedModel` on one of ``tp`` ranks: its manager's every rank takes the driver's sampled
    tokens (:func:`~graphrunner.hf.internals.sync_sampled_ids`, ``debug``: compared first). ``capture_first``
    (graphs only): :meth:`init_continuous_batching` starts the manager's loop and returns once every planned key
    is captured on every rank (:func:`~graphrunner_tools.serve_engine.capture_before_serving`; progress on rank
    0's stderr); a capture that fails stops the loop (which stops the other ranks) and raises."""

    #: The keys are granted by the running loop: captured once :meth:`init_continuous_batching` started it.
    capture_before_loop = False

    def __init__(
        self,
        model: Any,
        graph_options: dict[str, Any] | None,
        debug: bool = False,
        timeout: float = 60.0,
        *,
        capture_first: bool = False,
    ) -> None:
        super().__init__(model, graph_options, capture_first=capture_first)
        self.debug = debug
        #: Seconds each of graphrunner's collectives may take (``--tp-timeout``).
        self.timeout = timeout
        #: The sampled ids' broadcast: its steps and seconds (set by :meth:`init_continuous_batching`).
        self.sync: Any = None
        #: The ranks' group (graphrunner's, over the world: the TP ranks), made by :meth:`init_continuous_batching`.
        self.group: Any = None

    @contextlib.contextmanager
    def read_beside(self) -> Iterator[None]:
        """What :func:`~graphrunner_tools.serve_engine.engine_metrics` reads the engine in: not transformers'
        pause, which every rank must enter (the followers never would), so the figures are read beside the
        running loop (each a moment apart; a read that raced the loop is retried by the caller)."""
        yield

    def init_continuous_batching(
        self, generation_config: Any = None, continuous_batching_config: Any = None, workload_hints: Any = None
    ) -> Any:
        from graphrunner.hf.internals import sync_sampled_ids

        # the ranks' group (the world: the TP ranks): its store carries the followers' figures to the driver, and
        # with graphs every runner of the manager agrees over it (each step's key, the keys granted to the
        # background capture; the fingerprint compares the ranks' collectives, not their op counts: the shards
        # differ); the process group's own timeouts stay transformers' (the channel has its deadline)
        self.group = TorchDistGroup(timeout=self.timeout, bound_process_group=False, tensor_parallel=True)
        if self.graph_options is not None:
            self.graph_options = {**self.graph_options, "group": self.group}
        manager = super().init_continuous_batching(generation_config, continuous_batching_config, workload_hints)
        manager.warmup()  # makes the batch processor (a no-op when gr.hf's install made it)
        self.sync = sync_sampled_ids(manager.batch_processor, debug=self.debug)
        # self.manager stays the manager ServedModel keeps (transformers', not the ServedManager handed on): what
        # engine_metrics reads, graphs_of(self.manager) its graphs
        if self.capture_first:
            # every rank: the loop started (the followers' start, the driver's before the HTTP server is built),
            # its idle iterations grant the keys; the engine's own start() later finds it running
            manager.start()
            try:
                capture_before_serving(self.manager, None if self.group.rank == 0 else io.StringIO())
            except BaseException:
                self.manager.stop(block=True, timeout=self.timeout)  # its last iteration stops the other ranks
                raise
        return manager

    def _figures_key(self, rank: int) -> str:
        return f"graphrunner/serve/figures/rank{rank}"

    def publish_figures(self) -> None:
        """A follower: put this rank's :data:`~graphrunner_tools.serve_engine.RANK_FIGURES` (read by
        :func:`~graphrunner_tools.serve_engine.engine_metrics`) in the group's store, where the driver's
        :meth:`rank_figures` reads them."""
        store = self.group.channel.store if self.group is not None else None
        if store is not None:
            figures = engine_metrics(self)["ranks"][self.group.rank]
            store.set(self._figures_key(self.group.rank), json.dumps(figures))

    def rank_figures(self, own: dict[str, Any]) -> dict[int, dict[str, Any]]:
        """Every rank's figures: ``own`` (this rank's), and each other rank's last published ones
        (:meth:`publish_figures`, a second old at most; zeros before its first)."""
        rank = 0 if self.group is None else self.group.rank
        out: dict[int, dict[str, Any]] = {rank: own}
        store = None if self.group is None else self.group.channel.store
        if store is None:
            return out
        for r in range(self.group.size):
            key = self._figures_key(r)
            if r != rank:
                out[r] = json.loads(store.get(key)) if store.check([key]) else dict.fromkeys(own, 0)
        return out

    def stop_cleanly_on_sigterm(self, timeout: float = 4.0) -> None:
        """On the driver (the model's process of rank 0, its main thread): SIGTERM, which transformers' server
        sends this process as it stops, first stops the manager (up to ``timeout`` s, within the 5 s it
        waits before a SIGKILL), whose last step tells every follower to stop (transformers' stop status,
        all-reduced each step), then exits 0. Without it the process dies at once and each follower sees
        its group's connection closed: a failure, on every node that is not the driver's."""

        def stop(*_: Any) -> None:
            manager = getattr(self, "manager", None)
            if manager is not None and manager.is_running():
                manager.stop(block=True, timeout=timeout)
            raise SystemExit(0)

        signal.signal(signal.SIGTERM, stop)


class TPModelLoader(GraphModelLoader):
    """:class:`GraphModelLoader` for a rank of ``graphrunner serve --tp``: in the process that loads (the
    model's process of rank 0, a follower rank itself) it joins the ranks' group (``backend``, from the
    torchrun environment) and loads the model with transformers' tensor parallelism
    (``distributed_config=DistributedConfig(tp_size=tp)``). Picklable."""

    def __init__(
        self,
        graph_options: dict[str, Any] | None = None,
        *,
        tp: int,
        backend: str,
        init_timeout: float,
        debug: bool = False,
        **kwargs: Any,
    ) -> None:
        super().__init__(graph_options, **kwargs)
        self.tp, self.backend, self.init_timeout, self.debug = tp, backend, init_timeout, debug

    def load_model_and_processor(self, model_id: str, on_progress: Any = None) -> Any:
        import threading

        from tqdm import tqdm
        from transformers import AutoModelForCausalLM
        from transformers.distributed import DistributedConfig

        tqdm.set_lock(threading.RLock())  # as GraphModelLoader: no named semaphore left behind
        join_group(self.backend, init_timeout=self.init_timeout)
        processor = self.load_processor(model_id)
        kwargs: dict[str, Any] = {"attn_implementation": self.attn_implementation, "dtype": self.dtype}
        model = AutoModelForCausalLM.from_pretrained(
            model_id.split("@")[0], distributed_config=DistributedConfig(tp_size=self.tp), **kwargs
        )
        model.eval()
        served = TPServedModel(
            model, self.graph_options, self.debug, self.init_timeout, capture_first=self.capture_first
        )
        import torch.distributed as dist

        if dist.get_rank() == 0:  # the driver: the model's process of the HTTP server
            served.stop_cleanly_on_sigterm()
        return served, processor


# --------------------------------------------------------------------------- the ranks
#: ``(args) -> exit code``: rank 0's HTTP server (``graphrunner_tools.serve.serve_http``), and ``(args) ->
#: (model_dir, cb_config, generation_state, graph_options)`` (``graphrunner_tools.serve.engine_parts``): handed in
#: by ``graphrunner_tools.serve``, which imports this module (not the other way round).
EngineParts = Callable[[argparse.Namespace], tuple[str, Any, Any, Any]]
Parts = tuple[Callable[[argparse.Namespace], int], EngineParts]


def serve_tp(args: argparse.Namespace, parts: Parts) -> int:
    """``graphrunner serve --tp N``: under torchrun this process is one rank (its part: :func:`run_rank`);
    otherwise N ranks are started with torch's elastic launcher and this process waits for them: exit 0
    after a stop (SIGTERM, Ctrl+C), 1 naming the rank that failed and its cause."""
    env = torchrun_env()
    if env is not None:
        if env.world_size != args.tp:
            print(
                f"graphrunner serve: --tp {args.tp}, but torchrun started WORLD_SIZE={env.world_size} ranks: "
                f"start it with torchrun --nproc-per-node {args.tp} (over all its nodes), or pass --tp "
                f"{env.world_size}",
                file=sys.stderr,
            )
            return 2
        return run_rank(env.rank, env.world_size, args, parts)
    from torch.distributed.elastic.multiprocessing import SignalException

    print(f"graphrunner serve: starting {args.tp} tensor-parallel ranks", file=sys.stderr, flush=True)
    try:
        outcomes = launch_ranks(
            run_rank,
            args.tp,
            args=(args, parts),
            timeout=None,
            init_timeout=args.tp_timeout,
            backend=_backend(args.device),
            join=False,
            stop_grace=args.shutdown_timeout + 10,
        )
    except (KeyboardInterrupt, SignalException):  # a stop: the launcher stopped every rank
        return 0
    failed = [o for o in outcomes if not o.ok or (o.value or 0) != 0]
    if not failed:
        return 0
    # the cause: a rank that died or raised, before one that returned non-zero because its peer was gone
    first = next((o for o in failed if not o.ok), failed[0])
    for o in outcomes:
        if o.ok and o.value:
            print(f"graphrunner serve: rank {o.rank} exited with {o.value}", file=sys.stderr)
        elif not o.ok:
            print(f"graphrunner serve: rank {o.rank}: {o.error}", file=sys.stderr)
    print(
        f"graphrunner serve: stopped: rank {first.rank} failed ({first.error or f'exit {first.value}'})",
        file=sys.stderr,
        flush=True,
    )
    return 1


def run_rank(rank: int, world_size: int, args: argparse.Namespace, parts: Parts) -> int:
    """One rank's part: rank 0 serves HTTP (its model's process drives), the others follow. Returns the
    exit code."""
    serve_http, engine_parts = parts
    if rank == 0:
        return serve_http(args)
    return _follow(rank, world_size, args, engine_parts)


def make_loader(args: argparse.Namespace, options: dict[str, Any] | None) -> TPModelLoader:
    """The loader every rank uses (the driver's model's process and each follower): the same model, dtype,
    attention and graph options on every rank."""
    return TPModelLoader(
        options,
        tp=args.tp,
        backend=_backend(args.device),
        init_timeout=args.tp_timeout,
        debug=args.tp_debug,
        capture_first=bool(getattr(args, "capture_first", False)),
        **loader_arguments(args),
    )


def _follow(rank: int, world_size: int, args: argparse.Namespace, engine_parts: EngineParts) -> int:
    """A follower rank: the driver's manager, made and started here, follows the driver until it stops."""
    from transformers.generation.continuous_batching.utils import WorkloadHints

    stopping = threading.Event()

    def stop(*_: Any) -> None:
        stopping.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, stop)
    model_dir, cb_config, state, options = engine_parts(args)
    if state.seed is not None:
        import torch

        torch.manual_seed(state.seed)  # as transformers' model's process does on the driver
    loader = make_loader(args, options)
    served, _ = loader.load_model_and_processor(model_dir)
    context_length = state.context_length(served.config)
    cb_config.per_request_processors = True  # as transformers' CBGenerateRunner sets it on the driver
    hints = WorkloadHints(max_prompt_length=context_length) if context_length else None
    manager = served.init_continuous_batching(continuous_batching_config=cb_config, workload_hints=hints)
    manager.warmup()  # as CBGenerateRunner on the driver: the same steps (and collectives) on every rank
    manager.start()
    logger.info("graphrunner serve: rank %d of %d follows the driver", rank, world_size)

    def drain() -> None:  # nobody reads a follower's outputs: they must not pile up; the figures published
        published = 0.0
        while manager.is_running():
            manager.get_result(timeout=0.5)
            if time.monotonic() - published > 1.0:
                published = time.monotonic()
                try:
                    served.publish_figures()
                except Exception as exc:  # noqa: BLE001 - /metrics shows the last figures; the serving goes on
                    logger.warning("graphrunner serve: rank %d could not publish its figures: %s", rank, exc)

    threading.Thread(target=drain, name="graphrunner-tp-drain", daemon=True).start()
    grace = None
    while manager.is_running():
        if stopping.is_set() and grace is None:  # the driver stops too: its end ends this manager's loop
            grace = time.monotonic() + args.shutdown_timeout + 5
        if grace is not None and time.monotonic() > grace:
            manager.stop(block=False)
            break
        time.sleep(0.1)
    error = manager.background_thread_status.fatal_error
    if error is None and not stopping.is_set():  # the driver stopped and told this rank so: a clean stop
        logger.info("graphrunner serve: rank %d: the driver stopped; exiting", rank)
        return 0
    if stopping.is_set():
        _end_loop(manager, rank, args.shutdown_timeout + 5)
        return 0
    raise RuntimeError(
        f"rank {rank}: the tensor-parallel group stopped without a stop (SIGTERM): {error or 'the driver went away'}"
    )


def _end_loop(manager: Any, rank: int, grace: float) -> None:
    """A stopped follower's manager: its loop ends at its next step, or, still inside a collective with a driver
    that is gone after ``grace`` seconds, when that collective fails: the loop's process groups (transformers'
    CPU group and the TP group) are aborted, and the loop is joined. ``RuntimeError`` when it still runs."""
    import torch.distributed as dist

    from graphrunner.hf.internals import tp_process_groups

    if manager.is_running():
        manager.stop(block=True, timeout=grace)
    if not manager.is_running():
        return
    logger.warning("graphrunner serve: rank %d: the driver is gone mid-collective; aborting the TP groups", rank)
    groups = tp_process_groups(manager)
    if dist.is_initialized():
        groups.append(dist.group.WORLD)
    for group in {id(g): g for g in groups}.values():  # the TP group may be the world's: each aborted once
        group.abort()  # ProcessGroup.abort(): its pending collectives fail at once (gloo closes its connections)
    manager.join(time.perf_counter(), timeout=grace)
    if manager.is_running():
        raise RuntimeError(
            f"rank {rank}: the generation loop did not end {grace:.0f} s after its process groups were aborted"
        )
