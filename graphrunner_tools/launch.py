"""The ranks of the multi-rank tools: started by torch's elastic launcher, or joined from torchrun's environment.

Two ways a tool (``graphrunner loadtest``, ``graphrunner verify``) gets its ranks:

* ``--ranks N`` on one machine: :func:`launch_ranks` starts ``N`` processes through
  ``torch.distributed.launcher.api.elastic_launch`` (the launcher behind ``torchrun``; a c10d
  rendezvous on ``127.0.0.1``, port 0, so nothing can collide on a port)::

      outcomes = launch_ranks(fn, world_size=2, args=(config,), timeout=600)
      outcomes = launch_ranks(fn, world_size=2, args=(config,), backend="nccl")  # one GPU per rank

  Every rank is a worker exactly as under ``torchrun``: its environment holds ``RANK``,
  ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``; it sets one torch thread
  (unless told otherwise), makes GPU ``LOCAL_RANK % device_count()`` its current CUDA device when
  there is one (:func:`bind_gpu`), joins ``torch.distributed`` from that environment (``env://``;
  ``backend``: gloo by default, NCCL with one GPU per rank), calls ``fn(rank, world_size, *args)``
  and writes what it returned (or the exception it raised, with a partial result:
  :class:`PartialResult`) to a report file of its own. A rank that succeeded destroys the process
  group; one that raised leaves it (a collective may still be pending) and exits with code 1
  (``sys.exit``; never ``os._exit``). The launcher then stops every other rank (SIGTERM, SIGKILL
  after 5 s): one failed rank ends the run on every rank. The whole run is bounded by ``timeout``:
  ranks still running then are stopped (SIGTERM, SIGKILL after 5 s) and reported as timed out, and the launcher
  returns (the elastic agent's own shutdown, through its SIGTERM handler: ``launch_ranks`` runs in
  the main thread). Every rank's outcome is one :class:`RankOutcome`.

* Under ``torchrun`` (one node or several): :func:`torchrun_env` reads the worker's environment and
  :func:`run_joined` runs this rank's part in this process: it joins torchrun's group
  (``env://``), runs ``fn(rank, world_size, *args)`` and exchanges the ranks' outcomes through
  the group's store, so every rank returns every rank's :class:`RankOutcome` (a failed rank's
  error and partial result included) and rank 0 prints the summary; every rank exits 1 when any
  rank failed. A rank that died never reports: its peers fail in their next collective (the
  peer's connection closed) or at their group's timeout, wait ``exchange_timeout`` seconds for
  its outcome, and report it as gone.
"""

from __future__ import annotations

import datetime
import logging
import os
import pickle
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = [
    "PartialResult",
    "RankOutcome",
    "TorchrunEnv",
    "bind_gpu",
    "join_group",
    "launch_ranks",
    "run_joined",
    "torchrun_env",
]

#: The environment a torchrun worker has (``torchrun`` and ``elastic_launch`` set them all).
TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
#: Seconds between the launcher's SIGTERM to the remaining ranks (after one failed) and its SIGKILL.
STOP_GRACE = 5


class PartialResult(Exception):
    """Raise ``PartialResult(value)`` from a rank's function to report a failure together with
    what the rank got done: the outcome is a failed one (``ok`` False, the process group is
    not destroyed) whose ``value`` is ``value`` and ``error`` the message."""

    def __init__(self, value: Any, message: str = "the rank failed") -> None:
        super().__init__(message)
        self.value = value


@dataclass
class RankOutcome:
    """What one rank did.

    ``ok``: ``fn`` returned ``value``. Otherwise ``error`` is ``"<ExcType>: <message>"`` (or
    why it never reported: it died, was stopped by the launcher after another rank failed, or
    was killed at the deadline: ``timed_out``) and ``traceback`` the formatted traceback when
    it raised; ``value`` is a :class:`PartialResult`'s value, else ``None``. ``exitcode`` is the
    process's exit code where the launcher knows it (0 for a rank of a run that succeeded, the
    failed rank's code), else ``None``.
    """

    rank: int
    ok: bool = False
    value: Any = None
    error: str | None = None
    traceback: str | None = None
    exitcode: int | None = None
    timed_out: bool = False


def _died(code: int) -> str:
    """Why a rank that never reported is gone, from its exit code (negative: the signal)."""
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return (
            f"killed by {name} without reporting (gloo aborts a process on a collective whose sizes differ "
            "between ranks: see the other ranks' errors)"
        )
    return f"exited with code {code} without reporting"


def bind_gpu(rank: int) -> int | None:
    """Make GPU ``rank % device_count()`` this process's current CUDA device (``torch.cuda.set_device``)
    when CUDA is available, so that ranks on one machine do not all land on ``cuda:0`` (pass the
    local rank: ``LOCAL_RANK`` under torchrun); return its index, or ``None`` without CUDA. Under
    ``$GRAPHRUNNER_CUDA_STANDIN=1`` the CUDA stand-in of :mod:`graphrunner.testing.cuda_standin` is
    installed first (a rank of a command run under it)."""
    import torch

    from graphrunner.testing.cuda_standin import install_from_env

    install_from_env()
    if not torch.cuda.is_available():
        return None
    count = torch.cuda.device_count()
    if count < 1:
        return None
    index = rank % count
    torch.cuda.set_device(index)
    return index


# --------------------------------------------------------------------------- torchrun's environment
@dataclass(frozen=True)
class TorchrunEnv:
    """A torchrun worker's place in the job, from its environment (:func:`torchrun_env`):
    global ``rank`` and ``world_size``, ``local_rank`` and ``local_world_size`` (this node's
    ranks), and the group's ``master_addr``/``master_port``."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    master_addr: str
    master_port: int


def torchrun_env(environ: Mapping[str, str] | None = None) -> TorchrunEnv | None:
    """This process's :class:`TorchrunEnv` when its environment (default ``os.environ``) says it is
    a torchrun worker (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT`` all set), else
    ``None``. ``LOCAL_RANK``/``LOCAL_WORLD_SIZE`` default to the rank and the world size (one node).
    Raises ``ValueError`` naming the variables when only some are set or a number is malformed
    (an environment left half-set by a script would otherwise start a rank of nobody's job)."""
    env = os.environ if environ is None else environ
    present = [k for k in TORCHRUN_VARS if env.get(k, "") != ""]
    if not present:
        return None
    if len(present) < len(TORCHRUN_VARS):
        missing = [k for k in TORCHRUN_VARS if k not in present]
        raise ValueError(
            f"the environment sets {', '.join(present)} but not {', '.join(missing)}: a torchrun worker "
            f"has all of {', '.join(TORCHRUN_VARS)}; run the command under torchrun, or unset "
            f"{', '.join(present)} to run it on its own (--ranks N starts its own ranks)"
        )
    try:
        rank, world, port = int(env["RANK"]), int(env["WORLD_SIZE"]), int(env["MASTER_PORT"])
        local_rank = int(env.get("LOCAL_RANK", rank))
        local_world = int(env.get("LOCAL_WORLD_SIZE", world))
    except ValueError as exc:
        raise ValueError(
            f"a torchrun variable is not an integer ({exc}): RANK={env.get('RANK')!r}, WORLD_SIZE="
            f"{env.get('WORLD_SIZE')!r}, MASTER_PORT={env.get('MASTER_PORT')!r}, LOCAL_RANK="
            f"{env.get('LOCAL_RANK')!r}; run the command under torchrun, or unset them"
        ) from None
    if world < 1 or not 0 <= rank < world:
        raise ValueError(
            f"RANK={rank} is not in [0, WORLD_SIZE={world}): run the command under torchrun, or unset "
            "RANK and WORLD_SIZE"
        )
    return TorchrunEnv(rank, world, local_rank, local_world, env["MASTER_ADDR"], port)


def _join(backend: str, local_rank: int, threads: int | None, init_timeout: float) -> Any:
    """Join torchrun's (or the elastic launcher's) group from the environment and return the group's
    key-value store (a ``torch.distributed.TCPStore``), or ``None`` when the group was already joined.

    The store is made here with the public ``TCPStore``, as ``env://`` makes it: a client of the
    elastic agent's store when the agent hosts it (``TORCHELASTIC_USE_AGENT_STORE=True``: torchrun,
    ``elastic_launch``), else hosted by rank 0; the group is initialised on it
    (``init_process_group(store=...)``), so the outcomes can travel through it without reaching into
    torch's private default store."""
    import torch
    import torch.distributed as dist

    if threads is not None:
        os.environ["OMP_NUM_THREADS"] = str(threads)
        torch.set_num_threads(threads)
    bind_gpu(local_rank)  # before NCCL's init: its communicator uses the current device
    if dist.is_initialized():
        return None
    env = torchrun_env()
    if env is None:  # not a worker's environment: env:// names what is missing
        dist.init_process_group(backend, init_method="env://", timeout=datetime.timedelta(seconds=init_timeout))
        return None
    timeout = datetime.timedelta(seconds=init_timeout)
    agent_hosts = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == str(True)
    store = dist.TCPStore(
        env.master_addr,
        env.master_port,
        world_size=env.world_size,
        is_master=env.rank == 0 and not agent_hosts,
        timeout=timeout,
        multi_tenant=True,
    )
    dist.init_process_group(
        backend,
        store=dist.PrefixStore("default_pg", store),
        rank=env.rank,
        world_size=env.world_size,
        timeout=timeout,
    )
    return store


def join_group(backend: str = "gloo", init_timeout: float = 60.0, threads: int | None = None) -> Any:
    """Join torchrun's (or :func:`launch_ranks`') group from this process's environment (a torchrun
    worker's, or inherited from one: the model's process a rank of ``graphrunner serve --tp`` starts)
    and return its key-value store (``None`` when the group was joined already). ``backend``:
    ``"gloo"`` or ``"nccl"``; ``init_timeout`` bounds the rendezvous and every collective of the
    group. Raises ``ValueError`` when the environment is not a torchrun worker's."""
    env = torchrun_env()
    if env is None:
        raise ValueError(
            f"join_group: not a torchrun worker ({', '.join(TORCHRUN_VARS)} are not set); run it under torchrun, "
            "or start ranks with launch_ranks"
        )
    return _join(backend, env.local_rank, threads, init_timeout)


def _failure(exc: BaseException) -> tuple[str, str, Any]:
    """``(error, traceback, partial value)`` of a rank's exception (the value only when picklable)."""
    partial = exc.value if isinstance(exc, PartialResult) else None
    try:
        pickle.dumps(partial)
    except Exception:  # noqa: BLE001
        partial = None
    return f"{type(exc).__name__}: {exc}", traceback.format_exc(), partial


def run_joined(
    fn: Callable[..., Any],
    args: Sequence[Any] = (),
    backend: str = "gloo",
    init_timeout: float = 60.0,
    threads: int | None = None,
    env: TorchrunEnv | None = None,
    exchange_timeout: float = 60.0,
) -> tuple[TorchrunEnv, list[RankOutcome]]:
    """This torchrun worker's part of a multi-rank run: join torchrun's group (``env://``, ``backend``,
    ``init_timeout`` bounding the rendezvous and every collective of the default group), run
    ``fn(rank, world_size, *args)``, and exchange the ranks' outcomes; returns ``(env, outcomes)``,
    one :class:`RankOutcome` per rank, the same on every rank.

    The outcomes travel through the group's key-value store, not a collective, so a rank whose
    ``fn`` raised (its group may be unusable after a failed collective) still publishes its error
    and partial result, and every rank sees every rank's outcome. Each rank waits for its peers'
    outcomes at most ``exchange_timeout`` seconds after publishing its own (a peer that failed
    reports within its group's timeout of the failure); a peer that never reported by then is
    gone (its node reports why) or stuck, and its outcome says so. Raises ``ValueError`` when
    the environment is not a torchrun worker's (:func:`torchrun_env`)."""
    env = env or torchrun_env()
    if env is None:
        raise ValueError(
            f"run_joined: not a torchrun worker ({', '.join(TORCHRUN_VARS)} are not set); run it under "
            "torchrun, or start ranks with launch_ranks"
        )
    import torch.distributed as dist

    store = _join(backend, env.local_rank, threads, init_timeout)
    mine = RankOutcome(rank=env.rank)
    try:
        mine.value = fn(env.rank, env.world_size, *args)
        pickle.dumps(mine.value)  # an unpicklable result is this rank's error
        mine.ok = True
    except Exception as exc:  # noqa: BLE001 - reported as this rank's outcome
        mine.error, mine.traceback, mine.value = _failure(exc)
    outcomes = _exchange(mine, env, exchange_timeout, store)
    if mine.ok:
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - the results are exchanged
            pass
    return env, outcomes


def _exchange(mine: RankOutcome, env: TorchrunEnv, timeout: float, store: Any = None) -> list[RankOutcome]:
    """Every rank's outcome, through the group's store (no collective: none can be left in flight at
    exit, and a rank whose group failed can still report). ``store``: the one :func:`_join` made;
    ``None`` (the group was joined before) opens a client of torchrun's store."""
    import torch.distributed as dist

    prefix = f"graphrunner/outcome/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    outcomes: list[RankOutcome | None] = [None] * env.world_size
    outcomes[env.rank] = mine
    try:
        if store is None:
            store = dist.TCPStore(
                env.master_addr,
                env.master_port,
                is_master=False,
                timeout=datetime.timedelta(seconds=timeout),
            )
        store.set(f"{prefix}/{env.rank}", pickle.dumps(mine))
        deadline = time.monotonic() + timeout
        missing = [r for r in range(env.world_size) if r != env.rank]
        while missing and time.monotonic() < deadline:
            for r in list(missing):
                if store.check([f"{prefix}/{r}"]):
                    outcomes[r] = pickle.loads(store.get(f"{prefix}/{r}"))
                    missing.remove(r)
            if missing:
                time.sleep(0.05)
        store.set(f"{prefix}/read/{env.rank}", b"1")
        if env.rank == 0:  # a store hosted by rank 0 (plain env://) must outlive its readers
            others = [f"{prefix}/read/{r}" for r in range(1, env.world_size) if outcomes[r] is not None]
            while others and time.monotonic() < deadline:
                others = [k for k in others if not store.check([k])]
                if others:
                    time.sleep(0.05)
        why = (
            f"never reported: rank {env.rank} waited {timeout:g}s for its outcome after finishing; the rank is "
            "gone (its node's torchrun reports why) or stuck"
        )
    except Exception as exc:  # noqa: BLE001 - the store is gone with its host
        why = f"not gathered: the store of torchrun's group failed on rank {env.rank} ({type(exc).__name__}: {exc})"
    return [o if o is not None else RankOutcome(rank=r, error=f"rank {r} {why}") for r, o in enumerate(outcomes)]


# --------------------------------------------------------------------------- ranks through elastic_launch
def _rank_main(
    fn: Callable[..., Any],
    args: tuple,
    report_dir: str,
    backend: str | None,
    threads: int,
    init_timeout: float,
) -> None:
    """One rank started by :func:`launch_ranks` (a worker of ``elastic_launch``, environment as under torchrun);
    ``backend=None``: ``fn`` joins the group itself (or has a process of its own join it)."""
    rank = int(os.environ["RANK"])
    _write(report_dir, f"rank{rank}.pid", os.getpid())
    ok = False
    try:
        if backend is None:
            import torch

            os.environ["OMP_NUM_THREADS"] = str(threads)
            torch.set_num_threads(threads)
        else:
            _join(backend, int(os.environ.get("LOCAL_RANK", rank)), threads, init_timeout)
        value = fn(rank, int(os.environ["WORLD_SIZE"]), *args)
        pickle.dumps(value)  # an unpicklable result is this rank's error, reported below
        report: tuple[Any, ...] = ("ok", value)
        ok = True
    except BaseException as exc:  # noqa: BLE001 - report everything, SystemExit included
        report = ("err",) + _failure(exc)
    _write(report_dir, f"rank{rank}.report", report)
    if ok:
        import torch.distributed as dist

        try:
            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - the result is already reported
            pass
    else:
        sys.exit(1)  # a normal exit: the launcher stops the other ranks


def _write(folder: str, name: str, obj: Any) -> None:
    """Pickle ``obj`` to ``folder/name`` atomically (a rank stopped mid-write leaves no half file)."""
    tmp = os.path.join(folder, f".{name}.{os.getpid()}")
    with open(tmp, "wb") as f:
        pickle.dump(obj, f)
    os.replace(tmp, os.path.join(folder, name))


def _read(folder: str, name: str) -> Any:
    try:
        with open(os.path.join(folder, name), "rb") as f:
            return pickle.load(f)
    except (OSError, EOFError, pickle.UnpicklingError):
        return None


class _Deadline:
    """Stops a :func:`launch_ranks` run still going ``timeout`` seconds after it starts (elastic_launch
    has no deadline of its own) through the elastic agent's own shutdown: a SIGTERM to this process,
    which the agent's handler (``LaunchConfig.signals_to_handle``) turns into its ``SignalException``,
    stopping every rank (SIGTERM, SIGKILL after the config's ``shutdown_timeout``). ``fired``: whether
    it did (so that the launcher tells the deadline from a SIGTERM of the user's)."""

    def __init__(self, timeout: float | None) -> None:
        self.timeout = timeout
        self.fired = False
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="graphrunner-launch-deadline", daemon=True)

    def __enter__(self) -> _Deadline:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._done.set()
        self._thread.join()

    def _run(self) -> None:
        if self._done.wait(self.timeout):  # None: until the run ends
            return
        self.fired = True
        os.kill(os.getpid(), signal.SIGTERM)


class _QuietElastic:
    """While a launch runs: the elastic launcher's own log lines (its worker-failure traceback,
    'Closing process ... via signal') off, since every rank's outcome is reported by the caller;
    its signal handlers (it installs SIGTERM/SIGINT/... handlers in the main thread and leaves
    them) and ``TORCHELASTIC_SIGNALS_TO_HANDLE`` put back afterwards."""

    SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT")

    def __enter__(self) -> None:
        self.levels: dict[str, int] = {}
        for name in list(logging.root.manager.loggerDict):
            if name.startswith(("torch.distributed.elastic", "torch.distributed.launcher", "torch.multiprocessing")):
                log = logging.getLogger(name)
                self.levels[name] = log.level
                log.setLevel(logging.CRITICAL + 1)
        self.env = os.environ.get("TORCHELASTIC_SIGNALS_TO_HANDLE")
        self.handlers = {}
        if threading.current_thread() is threading.main_thread():
            self.handlers = {s: signal.getsignal(getattr(signal, s)) for s in self.SIGNALS if hasattr(signal, s)}

    def __exit__(self, *exc: Any) -> None:
        for name, level in self.levels.items():
            logging.getLogger(name).setLevel(level)
        if self.env is None:
            os.environ.pop("TORCHELASTIC_SIGNALS_TO_HANDLE", None)
        else:
            os.environ["TORCHELASTIC_SIGNALS_TO_HANDLE"] = self.env
        for s, handler in self.handlers.items():
            if handler is not None:
                signal.signal(getattr(signal, s), handler)


def launch_ranks(
    fn: Callable[..., Any],
    world_size: int,
    args: Sequence[Any] = (),
    timeout: float | None = 600.0,
    init_timeout: float = 60.0,
    threads: int = 1,
    backend: str = "gloo",
    join: bool = True,
    stop_grace: float = STOP_GRACE,
) -> list[RankOutcome]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` processes started by torch's elastic
    launcher; one :class:`RankOutcome` per rank (module docstring).

    ``fn`` must be a top-level importable function and ``args`` picklable (the ranks are
    ``spawn`` processes). torch.distributed (``backend``: ``"gloo"`` or ``"nccl"``; local rank
    ``r`` on GPU ``r`` either way when there are GPUs) is initialised from the environment before
    ``fn`` runs; ``init_timeout`` bounds the rendezvous and every collective of the default group.
    ``timeout`` bounds the whole run: ranks that have not reported by then are killed (``None``: no
    deadline, a server's). ``join=False``: the ranks do not join torch.distributed before ``fn``, which
    joins it itself (:func:`join_group`), or has a process it starts join it in its place (the environment
    is a torchrun worker's either way). ``stop_grace``: seconds the launcher's SIGTERM to the ranks
    (one failed, Ctrl-C, SIGTERM, the deadline) waits before its SIGKILL. The first
    rank that fails ends the run: the launcher stops the others, whose outcomes say so. Never
    raises for a failing rank: read the outcomes. Raises ``ValueError`` for ``world_size < 1``,
    a non-positive ``timeout`` or another backend; ``KeyboardInterrupt`` on Ctrl-C (SIGINT) and
    the launcher's ``SignalException`` on SIGTERM/SIGHUP/SIGQUIT, after the ranks are stopped.
    """
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"launch_ranks: backend must be 'gloo' or 'nccl', got {backend!r}")
    if world_size < 1:
        raise ValueError(f"launch_ranks: world_size must be >= 1, got {world_size}")
    if timeout is not None and not timeout > 0:
        raise ValueError(f"launch_ranks: timeout must be > 0 seconds (or None: no deadline), got {timeout}")
    if threading.current_thread() is not threading.main_thread():
        raise ValueError(
            "launch_ranks: call it from the main thread: torch's elastic agent stops the ranks (on a failure, "
            "Ctrl-C, SIGTERM or the deadline) through signal handlers, which only the main thread can install"
        )
    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    report_dir = tempfile.mkdtemp(prefix="graphrunner-launch-")
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=world_size,
        run_id=f"graphrunner-{uuid.uuid4().hex}",
        rdzv_backend="c10d",
        rdzv_endpoint="127.0.0.1:0",
        local_addr="127.0.0.1",
        rdzv_configs={"timeout": int(max(init_timeout, 1))},
        max_restarts=0,
        start_method="spawn",
        monitor_interval=0.1,
        shutdown_timeout=int(max(1, stop_grace)),
    )
    outcomes = [RankOutcome(rank=r) for r in range(world_size)]
    failures: dict[int, Any] = {}
    launch_error: str | None = None
    interrupted: BaseException | None = None
    t0 = time.monotonic()
    try:
        with _QuietElastic(), _Deadline(timeout) as deadline:
            try:
                elastic_launch(config, _rank_main)(
                    fn, tuple(args), report_dir, backend if join else None, threads, init_timeout
                )
            except ChildFailedError as exc:
                failures = dict(exc.failures)
            except SignalException as exc:  # the deadline, Ctrl-C or a kill of this process: the ranks are stopped
                if not (deadline.fired and exc.sigval == signal.SIGTERM):
                    interrupted = KeyboardInterrupt() if exc.sigval == signal.SIGINT else exc
            except Exception as exc:  # noqa: BLE001 - the launcher itself failed (e.g. its rendezvous)
                launch_error = f"torch's elastic launcher failed: {type(exc).__name__}: {exc}"
        for r, out in enumerate(outcomes):
            report = _read(report_dir, f"rank{r}.report")
            failure = failures.get(r)
            if failure is not None:
                out.exitcode = failure.exitcode
            elif not failures and launch_error is None:
                out.exitcode = 0
            if report is not None and report[0] == "ok":
                out.ok, out.value = True, report[1]
            elif report is not None:
                out.error, out.traceback, out.value = report[1], report[2], report[3]
            elif deadline.fired:
                out.timed_out = True
                out.error = f"rank {r} still running at the deadline ({timeout:g}s after the start): killed"
            elif launch_error is not None:
                out.error = launch_error
            elif failure is not None:
                out.error = f"rank {r} {_died(failure.exitcode)}"
            else:
                first = ", ".join(map(str, sorted(failures))) or "another rank"
                out.error = f"rank {r} was stopped by torch's launcher before it reported, after rank {first} failed"
    finally:
        shutil.rmtree(report_dir, ignore_errors=True)
    if interrupted is not None:
        raise interrupted
    logging.getLogger("graphrunner").debug("launch_ranks: %d ranks in %.1fs", world_size, time.monotonic() - t0)
    return outcomes
