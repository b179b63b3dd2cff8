"""Rank groups: the barrier and integer agreement the capture protocol needs.

A *group* is any object with ``rank``, ``size``, ``barrier(phase=, key=)``,
``all_max(value, phase=, key=)`` and ``all_min(value, phase=, key=)``, and
optionally ``all_max_vector(values, phase=, key=)`` (an element-wise max of a
list of ints in ONE collective: the runner's per-call agreement; without it the
runner issues one ``all_max`` per element). Callers
in graphrunner always pass ``phase=`` and ``key=`` as keywords (they only name
the step in error messages); a test fake must accept them (``**kwargs``).

Two implementations:

- :class:`LocalGroup`: one process, every call returns at once.
- :class:`TorchDistGroup`: the ranks of a ``torch.distributed`` process group
  (gloo on CPU, nccl on GPU). Every call is a collective with a deadline: if
  it does not complete within ``timeout`` seconds (a peer died, raised, or is
  stuck) it raises :class:`~graphrunner.errors.RankTimeoutError` naming this
  rank, the phase and the shape key, so a failure on one rank makes every
  other rank fail loudly instead of hanging. Every call goes through the
  process group's one collective channel (:mod:`graphrunner.channel`):
  fixed-size frames carrying the phase and a sequence number, so ranks that
  are out of step (a barrier of one meets a vector of another) raise
  :class:`~graphrunner.errors.AgreementError` on every rank instead of gloo
  aborting the process.
"""

from __future__ import annotations

import datetime
import logging
import operator
import time
from collections.abc import Hashable
from typing import Any

import torch

from graphrunner.channel import channel_for
from graphrunner.errors import RankTimeoutError

__all__ = ["LocalGroup", "TorchDistGroup"]

#: Seconds of one slice of a collective's wait (:meth:`TorchDistGroup._wait`).
WAIT_SLICE = 0.25

logger = logging.getLogger("graphrunner")


def _check_int(value: Any, what: str) -> int:
    """``value`` as an int (Python, numpy or 0-dim integer tensor); TypeError otherwise."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if not isinstance(value, bool):
        try:
            return operator.index(value)
        except TypeError:
            pass
    raise TypeError(f"{what} expects a Python int, got {type(value).__name__} ({value!r})")


def _check_ints(values: Any, what: str) -> list[int]:
    """``values`` as a non-empty list of ints; TypeError/ValueError otherwise."""
    if isinstance(values, (str, bytes, torch.Tensor)) or not hasattr(values, "__iter__"):
        raise TypeError(f"{what} expects a list of Python ints, got {type(values).__name__} ({values!r:.60})")
    out = [_check_int(v, what) for v in values]
    if not out:
        raise ValueError(f"{what} expects at least one value")
    return out


def _bound_timeout(process_group: Any, seconds: float) -> None:
    """Set ``process_group``'s own collective timeout to ``seconds`` (torch's
    ``_set_pg_timeout``); warn and go on where this PyTorch has no such call."""
    try:
        # a private c10d helper, absent from some PyTorch versions (the except below)
        from torch.distributed.distributed_c10d import _set_pg_timeout

        _set_pg_timeout(datetime.timedelta(seconds=seconds), process_group)
    except Exception as exc:  # noqa: BLE001 - a missing private API must not stop the run
        logger.warning(
            "TorchDistGroup: could not set the process group's timeout to %gs (%s: %s); collectives "
            "inside the step keep the process group's own timeout",
            seconds,
            type(exc).__name__,
            exc,
        )


def _group_store(process_group: Any) -> Any:
    """``process_group``'s rendezvous store (prefixed per group), where a rank that fails alone reports
    it (:func:`graphrunner.channel.fail_ranks`); ``None`` where this PyTorch does not say."""
    try:
        # private c10d state, absent from some PyTorch versions (the except below)
        from torch.distributed.distributed_c10d import _world

        return _world.pg_map[process_group][1]
    except Exception:  # noqa: BLE001 - no store: a failure is then seen by the peers as a RankTimeoutError
        return None


class LocalGroup:
    """A group of exactly one rank (``rank == 0``, ``size == 1``).

    ``barrier`` returns immediately; ``all_max(v)`` and ``all_min(v)`` return
    ``v``. Used when no process group is given. The ``phase`` and ``key``
    keywords are accepted and ignored.
    """

    rank: int = 0
    size: int = 1

    def barrier(self, phase: str = "", key: Hashable | None = None) -> None:
        """Return immediately (there is no other rank to wait for)."""

    def all_max(self, value: int, phase: str = "", key: Hashable | None = None) -> int:
        """Return ``value`` (the maximum over a single rank)."""
        return _check_int(value, "all_max")

    def all_min(self, value: int, phase: str = "", key: Hashable | None = None) -> int:
        """Return ``value`` (the minimum over a single rank)."""
        return _check_int(value, "all_min")

    def all_max_vector(self, values, phase: str = "", key: Hashable | None = None) -> list[int]:
        """Return ``values`` as a list of ints (the element-wise maximum over a single rank)."""
        return _check_ints(values, "all_max_vector")

    def __repr__(self) -> str:
        return "LocalGroup(rank=0, size=1)"


class TorchDistGroup:
    """The ranks of a ``torch.distributed`` process group, with deadlines.

    Args:
        process_group: the process group to use; ``None`` means the default
            (world) group. ``torch.distributed`` must be initialised.
        timeout: seconds each ``barrier`` / ``all_max`` / ``all_min`` may take
            before it raises :class:`~graphrunner.errors.RankTimeoutError`.
        bound_process_group: also make ``timeout`` the process group's own
            timeout (default ``True``), so that every collective on it,
            including the ones inside a captured step, its eager breaks and
            the eager fallback, fails after ``timeout`` seconds instead of the
            process group's (torch's default: 30 minutes for gloo);
            :class:`~graphrunner.GraphRunner` turns such a failure into
            ``RankTimeoutError``. Collectives on *another* process group
            (e.g. a separate tensor-parallel group) keep that group's timeout:
            wrap it in a ``TorchDistGroup`` too.
        tensor_parallel: the ranks run shards of one model (tensor
            parallelism), not replicas (default ``False``): their captures of
            a key may record different numbers of ops (uneven shards, e.g. a
            vocabulary that does not divide by the ranks), so the capture
            fingerprint (:mod:`graphrunner.checks.fingerprint`) compares the
            collectives they recorded instead of their op counts; everything
            else (configuration, keys, outputs, segments and breaks) is
            compared as for replicas.

    Every method is a collective: all ranks of the group must call the same
    methods in the same order. Each is one collective of the process group's
    :class:`~graphrunner.channel.Channel` (:attr:`channel`): one or more frames
    of 16 int64 values (phase, sequence number, payload), each an asynchronous
    ``all_reduce`` (max) waited on with ``timeout``. Ranks whose collectives
    differ (phase, kind, sequence number or length) raise
    :class:`~graphrunner.errors.AgreementError` on every rank in that frame;
    a timeout *or any other failure of the collective* (gloo reports a dead
    peer as a ``RuntimeError`` such as "Connection closed by peer") is
    re-raised as ``RankTimeoutError`` naming this rank, the phase and the
    shape key, with the original error as ``__cause__``. After such an error
    the process group is in an undefined state: do not issue further
    collectives on it; let the process fail.

    The reduction tensor lives on CPU for gloo and on the current CUDA device
    for nccl (whose completion is polled against the deadline; for a cheap
    per-step agreement on GPUs prefer a gloo group,
    ``TorchDistGroup(torch.distributed.new_group(backend="gloo"))``). ``rank`` and ``size`` are this process's rank and the group
    size within ``process_group``.
    """

    def __init__(
        self,
        process_group: Any = None,
        timeout: float = 60.0,
        bound_process_group: bool = True,
        *,
        tensor_parallel: bool = False,
    ):
        # torch.distributed only where a process group is used (absent from some builds)
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "TorchDistGroup needs an initialised torch.distributed: call "
                "torch.distributed.init_process_group(...) first, or use LocalGroup() for one process"
            )
        timeout = float(timeout)
        if not timeout > 0:
            raise ValueError(f"TorchDistGroup timeout must be > 0 seconds, got {timeout}")
        self._dist = dist
        self.process_group = process_group
        self.timeout = timeout
        #: The ranks run shards of one model (``tensor_parallel=``): the fingerprint compares their collectives,
        #: not their op counts.
        self.tensor_parallel = bool(tensor_parallel)
        if bound_process_group:
            _bound_timeout(process_group, timeout)
        self.rank: int = dist.get_rank(process_group)
        self.size: int = dist.get_world_size(process_group)
        backend = str(dist.get_backend(process_group)).lower()
        self.backend_name = backend
        if "nccl" in backend:
            self._device = torch.device("cuda", torch.cuda.current_device())
        else:
            self._device = torch.device("cpu")
        #: The group's :class:`~graphrunner.channel.Channel` (shared by every group over this process group).
        pg = process_group if process_group is not None else dist.distributed_c10d._get_default_group()
        self.channel = channel_for(pg, self.rank, self.size, _group_store(pg))

    def __repr__(self) -> str:
        return (
            f"TorchDistGroup(rank={self.rank}, size={self.size}, backend={self.backend_name!r}, timeout={self.timeout})"
        )

    def _exchange(self, kind: str, values: list[int], phase: str, key: Hashable | None) -> list[int]:
        """``values``' element-wise max over the ranks, as one collective of the group's channel."""
        where = f"{kind} in phase {phase or '<unnamed>'!r} for shape key {key!r}"
        return self.channel.exchange(lambda frame: self._all_reduce_max(frame, where), kind, values, phase, key)

    def _all_reduce_max(self, values: list[int], where: str) -> list[int]:
        """One element-wise max of ``values`` over the ranks (one channel frame), with the deadline."""
        dist = self._dist
        t = torch.tensor(values, dtype=torch.int64, device=self._device)
        try:
            deadline = time.monotonic() + self.timeout
            work = dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.process_group, async_op=True)
            self._wait(work, deadline)
            if self._device.type == "cuda":
                # NCCL's wait() only orders the current stream after the
                # collective (unless blocking wait is on): poll for completion
                # so that reading the result cannot block past the deadline.
                while not work.is_completed():
                    if time.monotonic() > deadline:
                        raise TimeoutError("the NCCL all_reduce did not complete")
                    if self.channel.failure is not None:  # this rank failed the group meanwhile (its runner went away)
                        raise RuntimeError(f"the process group was aborted: {self.channel.failure}")
                    time.sleep(0.0001)
        except Exception as exc:  # noqa: BLE001 - every failure of the collective means the ranks diverged
            msg = (
                f"rank {self.rank} of {self.size}: {where} did not complete within {self.timeout:g}s "
                f"(a peer rank died, raised, or is stuck): {type(exc).__name__}: {str(exc).strip()[:500]}"
            )
            logger.error(msg)
            raise RankTimeoutError(msg) from exc
        return [int(v) for v in t.tolist()]

    def _wait(self, work: Any, deadline: float) -> None:
        """Wait for ``work`` until ``deadline``, in slices of :data:`WAIT_SLICE` s (a completed collective
        returns at once): between slices, a failure of the group on this rank (another thread failed it,
        :meth:`graphrunner.channel.Channel.fail`: the process group is aborted, which does not wake a
        wait on this rank) ends the wait with an error, so no thread stays inside a collective."""
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("the all_reduce did not complete")
            try:
                ok = work.wait(timeout=datetime.timedelta(seconds=min(left, WAIT_SLICE)))
            except Exception:
                if time.monotonic() >= deadline:
                    raise
                if work.is_completed():  # it failed (or completed) meanwhile: its own outcome
                    work.wait(timeout=datetime.timedelta(seconds=max(left, 0.001)))
                    return
                ok = False
            if ok is not False:  # some backends report a timeout by returning False
                return
            if self.channel.failure is not None:
                raise RuntimeError(f"the process group was aborted: {self.channel.failure}")

    def barrier(self, phase: str = "", key: Hashable | None = None) -> None:
        """Block until every rank of the group reached this barrier.

        Raises ``RankTimeoutError`` (naming this rank, ``phase`` and ``key``)
        if that does not happen within ``timeout`` seconds or a peer failed.
        """
        self._exchange("barrier", [], phase, key)

    def all_max(self, value: int, phase: str = "", key: Hashable | None = None) -> int:
        """Return the maximum of ``value`` over all ranks (a collective).

        Raises ``RankTimeoutError`` like :meth:`barrier`.
        """
        return self._exchange("all_max", [_check_int(value, "all_max")], phase, key)[0]

    def all_min(self, value: int, phase: str = "", key: Hashable | None = None) -> int:
        """Return the minimum of ``value`` over all ranks (a collective).

        Raises ``RankTimeoutError`` like :meth:`barrier`.
        """
        return -self._exchange("all_min", [-_check_int(value, "all_min")], phase, key)[0]

    def all_max_vector(self, values, phase: str = "", key: Hashable | None = None) -> list[int]:
        """Return the element-wise maximum of the int list ``values`` over all
        ranks, in ONE collective (every rank passes a list of the same length).

        Raises ``RankTimeoutError`` like :meth:`barrier`.
        """
        return self._exchange("all_max_vector", _check_ints(values, "all_max_vector"), phase, key)
