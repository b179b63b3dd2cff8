"""Run a function on N real processes joined by a gloo process group, with a
hard timeout, for multi-rank tests.

    from mp_util import run_ranks, assert_all_ok

    def worker(rank, world_size, tmpdir):      # top level of a test module
        ...                                     # torch.distributed is initialised (gloo)
        return {"anything": "picklable"}

    results = run_ranks(worker, world_size=2, args=(str(tmp_path),), timeout=30)
    assert_all_ok(results)                      # fails with every rank's traceback
    results[0].value                            # what rank 0 returned

Each rank runs in a fresh process (forked from a forkserver that preloaded
torch, or spawned): environment ``MASTER_ADDR``/
``MASTER_PORT`` (a free port, for workers that set up their own group),
``RANK``, ``WORLD_SIZE``, then
``torch.distributed.init_process_group(backend, init_method="file://...")``
unless ``init=False``, then ``worker(rank, world_size, *args)``. The group
meets through a fresh file in a fresh temporary directory per run (a
FileStore), not a TCP port: no run can collide with another's port. The result or exception (type,
message, traceback, and the exception object itself when picklable) comes
back through a queue. A rank that failed leaves without destroying the
process group (a collective may still be pending on it), with a normal
interpreter exit (``sys.exit(1)``; never ``os._exit``, which would hide a
shutdown hang; ``exit_seconds`` measures it; pass ``start_method="spawn"``
for a full interpreter shutdown including ``atexit``). After ``timeout`` seconds every process still alive is
killed and reported as ``timed_out``: nothing can hang the test session.
"""

from __future__ import annotations

import os
import pickle
import queue as queue_mod
import shutil
import socket
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch.multiprocessing as mp

__all__ = ["CountingGroup", "RankResult", "free_port", "run_ranks", "assert_all_ok", "format_results"]


@dataclass
class RankResult:
    """What one rank did.

    ``ok``: the worker returned (``value`` holds its return value).
    Otherwise ``exc_type`` (class name), ``exc_message``, ``traceback`` and
    ``exception`` (the exception object if it could be pickled, else
    ``None``) describe what it raised. ``exitcode``: the process's exit code
    (``None`` if it had to be killed). ``timed_out``: it had not finished
    when the timeout expired and was killed. ``seconds``: the worker's own
    run time (init to return/raise), if it reported. ``exit_seconds``: an
    upper bound on the time from its report to its process's exit (workers
    leave with a normal interpreter exit, never ``os._exit``).
    """

    rank: int
    ok: bool = False
    value: Any = None
    exc_type: str | None = None
    exc_message: str | None = None
    traceback: str | None = None
    exception: BaseException | None = None
    exitcode: int | None = None
    timed_out: bool = False
    reported: bool = False
    seconds: float | None = None
    exit_seconds: float | None = None


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_PRELOAD = ["torch", "torch.distributed", "graphrunner", "graphrunner.backends"]


def _context(start_method: str | None):
    import multiprocessing

    if start_method is None:
        start_method = "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"
    ctx = mp.get_context(start_method)
    if start_method == "forkserver":
        ctx.set_forkserver_preload(_PRELOAD)
    return ctx


def _entry(fn, rank, world_size, port, store_file, backend, init, init_timeout, args, kwargs, q) -> None:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    os.environ["RANK"] = str(rank)
    os.environ["WORLD_SIZE"] = str(world_size)
    os.environ["OMP_NUM_THREADS"] = "1"  # ranks share the cores: one thread each
    import datetime

    import torch

    torch.set_num_threads(1)
    ok = False
    t0 = time.monotonic()
    try:
        if init:
            import torch.distributed as dist

            dist.init_process_group(
                backend,
                init_method=f"file://{store_file}",
                rank=rank,
                world_size=world_size,
                timeout=datetime.timedelta(seconds=init_timeout),
            )
        value = fn(rank, world_size, *args, **kwargs)
        msg = ("ok", rank, value, time.monotonic() - t0)
        try:
            pickle.dumps(msg)
        except Exception as exc:  # noqa: BLE001
            raise TypeError(f"worker of rank {rank} returned an unpicklable value: {exc}") from exc
        q.put(msg)
        ok = True
    except BaseException as exc:  # noqa: BLE001 - report everything, including SystemExit
        try:
            pickle.dumps(exc)
            exc_obj = exc
        except Exception:  # noqa: BLE001
            exc_obj = None
        q.put(("err", rank, (type(exc).__name__, str(exc), traceback.format_exc(), exc_obj), time.monotonic() - t0))
    finally:
        q.close()
        q.join_thread()  # flush the report before leaving
    if ok and init:
        try:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception:  # noqa: BLE001
            pass
    # A normal exit (no os._exit): a process that cannot shut down after a
    # failed collective must show up as a slow exit, not be hidden.
    if not ok:
        sys.exit(1)


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    args: Sequence[Any] = (),
    kwargs: dict | None = None,
    timeout: float = 60.0,
    backend: str = "gloo",
    init: bool = True,
    init_timeout: float = 30.0,
    start_method: str | None = None,
) -> list[RankResult]:
    """Run ``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` spawned
    processes and return one :class:`RankResult` per rank (index = rank).

    ``fn`` must be a top-level, importable function; ``args`` picklable.
    ``timeout`` bounds the whole run, from process start to exit: processes
    still alive then are killed (``timed_out=True``). ``init=False`` skips
    ``init_process_group`` (the worker does its own setup). Never raises for
    a failing worker: check the results, e.g. with :func:`assert_all_ok`.
    """
    ctx = _context(start_method)
    q = ctx.Queue()
    port = free_port()
    store_dir = tempfile.mkdtemp(prefix="graphrunner-ranks-")
    store_file = os.path.join(store_dir, "store")  # must not exist yet: FileStore creates it
    results = [RankResult(rank=r) for r in range(world_size)]
    procs = []
    for r in range(world_size):
        p = ctx.Process(
            target=_entry,
            args=(fn, r, world_size, port, store_file, backend, init, init_timeout, tuple(args), dict(kwargs or {}), q),
            daemon=True,
        )
        p.start()
        procs.append(p)
    deadline = time.monotonic() + timeout
    pending = set(range(world_size))
    dead_since: dict = {}
    reported_at: dict = {}
    try:
        while pending and time.monotonic() < deadline:
            try:
                status, rank, payload, secs = q.get(timeout=min(0.2, max(deadline - time.monotonic(), 0.01)))
            except queue_mod.Empty:
                # A rank that died without reporting (os._exit, segfault,
                # kill): give a queued report a second to arrive, then stop waiting.
                now = time.monotonic()
                for r in list(pending):
                    if procs[r].exitcode is not None:
                        dead_since.setdefault(r, now)
                        if now - dead_since[r] > 1.0:
                            pending.discard(r)
                            results[r].exc_type = "ProcessDied"
                            results[r].exc_message = f"rank {r} exited with code {procs[r].exitcode} without reporting"
                continue
            _store(results, status, rank, payload, secs)
            reported_at[rank] = time.monotonic()
            pending.discard(rank)
        for r, p in enumerate(procs):
            p.join(timeout=max(deadline - time.monotonic(), 0.0))
            if p.is_alive():
                results[r].timed_out = True
                p.kill()
                p.join(5)
            results[r].exitcode = p.exitcode if not results[r].timed_out else None
            if r in reported_at and not results[r].timed_out:
                results[r].exit_seconds = time.monotonic() - reported_at[r]
            if results[r].timed_out and not results[r].reported:
                results[r].exc_type = results[r].exc_type or "Timeout"
                results[r].exc_message = results[r].exc_message or f"rank {r} still running after {timeout:g}s: killed"
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)
        q.close()
        shutil.rmtree(store_dir, ignore_errors=True)
    return results


def _store(results: list[RankResult], status: str, rank: int, payload: Any, secs: float) -> None:
    res = results[rank]
    res.reported = True
    res.seconds = secs
    if status == "ok":
        res.ok = True
        res.value = payload
    else:
        res.exc_type, res.exc_message, res.traceback, res.exception = payload


def format_results(results: Sequence[RankResult]) -> str:
    """A readable report of every rank's outcome (for assertion messages)."""
    lines = []
    for r in results:
        state = "ok" if r.ok else ("TIMED OUT (killed)" if r.timed_out else f"FAILED {r.exc_type}: {r.exc_message}")
        lines.append(f"--- rank {r.rank}: {state} (exitcode={r.exitcode}, seconds={r.seconds})")
        if r.traceback and not r.ok:
            lines.append(r.traceback.rstrip())
    return "\n".join(lines)


def assert_all_ok(results: Sequence[RankResult]) -> None:
    """Fail with every rank's outcome and traceback unless all ranks returned
    and exited with code 0."""
    if not all(r.ok and r.exitcode == 0 and not r.timed_out for r in results):
        raise AssertionError("not every rank succeeded:\n" + format_results(results))


class CountingGroup:
    """A rank's group (e.g. ``graphrunner.TorchDistGroup``) that counts its calls per method in
    ``counts`` (``barrier``, ``all_max``, ``all_min``, ``all_max_vector``) and delegates them."""

    def __init__(self, inner):
        self.inner, self.rank, self.size = inner, inner.rank, inner.size
        self.counts = {"barrier": 0, "all_max": 0, "all_min": 0, "all_max_vector": 0}

    def barrier(self, **kw):
        self.counts["barrier"] += 1
        return self.inner.barrier(**kw)

    def all_max(self, v, **kw):
        self.counts["all_max"] += 1
        return self.inner.all_max(v, **kw)

    def all_min(self, v, **kw):
        self.counts["all_min"] += 1
        return self.inner.all_min(v, **kw)

    def all_max_vector(self, v, **kw):
        self.counts["all_max_vector"] += 1
        return self.inner.all_max_vector(v, **kw)
