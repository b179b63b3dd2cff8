"""Run one function on N local processes joined by a process group (gloo, or NCCL with one GPU per rank), with deadlines.

For commands that need real ranks on one machine (``graphrunner loadtest --ranks N``,
``graphrunner verify --ranks N``)::

    outcomes = spawn_ranks(fn, world_size=2, args=(config,), timeout=600, grace=10)
    outcomes = spawn_ranks(fn, world_size=2, args=(config,), backend="nccl")  # one GPU per rank

Each rank is a fresh ``spawn`` process that sets one torch thread per rank (unless told
otherwise), makes GPU ``rank % device_count()`` its current CUDA device when there is one
(:func:`bind_gpu`), joins ``torch.distributed`` (``backend``: gloo by default; NCCL, whose
collectives a CUDA graph can capture, needs a GPU per rank; through a FileStore in a fresh
temporary directory: no TCP port to collide on), calls ``fn(rank, world_size, *args)`` and sends what it
returned (or the exception it raised, with a partial result: :class:`PartialResult`) back through a queue. A rank that succeeded destroys the
process group; one that raised leaves it (a collective may still be pending) and exits with
``sys.exit(1)``; never ``os._exit``. Nothing hangs the caller: the whole run is bounded by
``timeout``, and once any rank has failed the others get ``grace`` seconds more to report and
exit; every process still alive then is killed and reported as timed out.
"""

from __future__ import annotations

import datetime
import os
import pickle
import queue as queue_mod
import shutil
import signal
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable, List, Optional, Sequence

__all__ = ["PartialResult", "RankOutcome", "bind_gpu", "spawn_ranks"]


class PartialResult(Exception):
    """Raise ``PartialResult(value)`` from a rank's function to report a failure together with
    what the rank got done: the outcome is a failed one (``ok`` False, the process group is
    not destroyed) whose ``value`` is ``value`` and ``error`` the message."""

    def __init__(self, value: Any, message: str = "the rank failed") -> None:
        super().__init__(message)
        self.value = value


@dataclass
class RankOutcome:
    """What one spawned rank did.

    ``ok``: ``fn`` returned ``value``. Otherwise ``error`` is ``"<ExcType>: <message>"`` (or
    why it never reported: it died, or was killed at the deadline: ``timed_out``) and
    ``traceback`` the formatted traceback when it raised. ``exitcode`` is the process's exit
    code (``None`` if it had to be killed).
    """

    rank: int
    ok: bool = False
    value: Any = None
    error: Optional[str] = None
    traceback: Optional[str] = None
    exitcode: Optional[int] = None
    timed_out: bool = False


def _died(code: int) -> str:
    """Why a rank that never reported is gone, from its exit code (negative: the signal)."""
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return (f"killed by {name} without reporting (gloo aborts a process on a collective whose sizes differ "
                "between ranks: see the other ranks' errors)")
    return f"exited with code {code} without reporting"


def bind_gpu(rank: int) -> "int | None":
    """Make GPU ``rank % device_count()`` this process's current CUDA device (``torch.cuda.set_device``)
    when CUDA is available, so that ranks on one machine do not all land on ``cuda:0``; return its
    index, or ``None`` without CUDA. Under ``$GRAPHRUNNER_CUDA_STANDIN=1`` the CUDA stand-in of
    :mod:`graphrunner.testing.cuda_standin` is installed first (a rank of a command run under it)."""
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


def _entry(fn: Callable[..., Any], rank: int, world_size: int, store_file: str, init_timeout: float,
           threads: int, args: tuple, q: Any, backend: str = "gloo") -> None:
    os.environ["OMP_NUM_THREADS"] = str(threads)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(threads)
    ok = False
    try:
        bind_gpu(rank)  # before NCCL's init: its communicator uses the current device
        dist.init_process_group(backend, init_method=f"file://{store_file}", rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=init_timeout))
        value = fn(rank, world_size, *args)
        pickle.dumps(value)  # an unpicklable result is this rank's error, reported below
        q.put(("ok", rank, value))
        ok = True
    except BaseException as exc:  # noqa: BLE001 - report everything, SystemExit included
        partial = exc.value if isinstance(exc, PartialResult) else None
        try:
            pickle.dumps(partial)
        except Exception:  # noqa: BLE001
            partial = None
        q.put(("err", rank, (f"{type(exc).__name__}: {exc}", traceback.format_exc(), partial)))
    finally:
        q.close()
        q.join_thread()  # the report is flushed before the process leaves
    if ok:
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - the result is already reported
            pass
    else:
        sys.exit(1)


def spawn_ranks(fn: Callable[..., Any], world_size: int, args: Sequence[Any] = (), timeout: float = 600.0,
                grace: float = 10.0, init_timeout: float = 60.0, threads: int = 1,
                backend: str = "gloo") -> List[RankOutcome]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` spawned processes; one :class:`RankOutcome` per rank.

    ``fn`` must be a top-level importable function and ``args`` picklable; torch.distributed
    (``backend``: ``"gloo"`` or ``"nccl"``; rank ``r`` on GPU ``r`` either way when there are
    GPUs) is initialised before ``fn`` runs (``init_timeout`` bounds the rendezvous).
    ``timeout`` bounds the whole run; after the first failed rank the rest have ``grace``
    seconds. Never raises for a failing rank: read the outcomes. Raises ``ValueError`` for
    ``world_size < 1``, a non-positive ``timeout`` or another backend.
    """
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"spawn_ranks: backend must be 'gloo' or 'nccl', got {backend!r}")
    if world_size < 1:
        raise ValueError(f"spawn_ranks: world_size must be >= 1, got {world_size}")
    if not timeout > 0 or grace < 0:
        raise ValueError(f"spawn_ranks: timeout must be > 0 and grace >= 0, got {timeout}, {grace}")
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    store_dir = tempfile.mkdtemp(prefix="graphrunner-launch-")
    store_file = os.path.join(store_dir, "store")  # must not exist yet: FileStore creates it
    outcomes = [RankOutcome(rank=r) for r in range(world_size)]
    procs = [ctx.Process(target=_entry, args=(fn, r, world_size, store_file, init_timeout, threads, tuple(args), q,
                                              backend), daemon=True) for r in range(world_size)]
    try:
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        pending = set(range(world_size))
        dead_since: dict = {}
        while pending and time.monotonic() < deadline:
            try:
                status, rank, payload = q.get(timeout=0.2)
            except queue_mod.Empty:
                now = time.monotonic()
                for r in list(pending):  # died without a report (killed, segfault): give it a second
                    if procs[r].exitcode is not None and now - dead_since.setdefault(r, now) > 1.0:
                        pending.discard(r)
                        outcomes[r].error = f"rank {r} {_died(procs[r].exitcode)}"
                        deadline = min(deadline, now + grace)
                continue
            pending.discard(rank)
            if status == "ok":
                outcomes[rank].ok, outcomes[rank].value = True, payload
            else:
                outcomes[rank].error, outcomes[rank].traceback, outcomes[rank].value = payload
                deadline = min(deadline, time.monotonic() + grace)
        deadline = min(deadline, time.monotonic() + grace)  # every rank reported (or ran out of time): exit now
        for r, p in enumerate(procs):
            p.join(timeout=max(deadline - time.monotonic(), 0.0))
            if p.is_alive():
                outcomes[r].timed_out = True
                p.kill()
                p.join(5)
                if r in pending:
                    outcomes[r].error = f"rank {r} still running at the deadline: killed"
            else:
                outcomes[r].exitcode = p.exitcode
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)
        q.close()
        shutil.rmtree(store_dir, ignore_errors=True)
    return outcomes
