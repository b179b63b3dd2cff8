"""Error classes raised by graphrunner.

Every error a user can cause is a ``ValueError``/``TypeError`` or one of the
classes below, with a message that names what was wrong and what to do.
"""

from __future__ import annotations

from typing import Any


def add_note(exc: BaseException, note: str) -> BaseException:
    """Add graphrunner's context to an exception raised by the user's code (PEP 678:
    ``exc.add_note``, shown under the traceback; on Python 3.10, which has no ``add_note``, the
    note is appended to ``exc.__notes__`` as 3.11 does). The exception keeps its type and
    message, so an engine catches its own types; returns ``exc``."""
    adder = getattr(exc, "add_note", None)
    if adder is not None:
        adder(note)
    else:
        notes = getattr(exc, "__notes__", None)
        try:
            exc.__notes__ = [*(notes or []), note]  # type: ignore[attr-defined]  # typeshed has __notes__ from 3.11 only
        except AttributeError:  # an exception type that refuses attributes: no note
            pass
    return exc


class GraphRunnerError(RuntimeError):
    """Base class of graphrunner's own errors (a ``RuntimeError``): ``except
    GraphRunnerError`` catches every error the library raises itself about
    capture, replay, checks and ranks. Usage errors (bad arguments, a step
    whose output cannot be laid out) are ``ValueError``/``TypeError`` (or
    subclasses) instead. Every message names what went wrong and what to do."""


class CaptureUnsafeOpError(GraphRunnerError):
    """An operation that a device graph cannot hold ran during capture.

    Raised by a tape capture for host-synchronising or data-dependent-shape
    operations (``.item()``, ``nonzero``, boolean masking, ``.cpu()``, ...),
    the way CUDA stream capture fails on a GPU. The message names the op and
    the user's source line; move that code into a ``@no_graph`` function.
    """


class CaptureError(GraphRunnerError):
    """Capture was misused (nested capture, replay of an empty graph, autograd
    recording during capture), or a forward failed during capture; in the
    latter case the message names the shape key and the original exception
    is chained as ``__cause__``."""


class RanksDisagreeError(CaptureError):
    """The ranks found, together, that they configured or captured different things (the
    capture fingerprint, :mod:`graphrunner.checks.fingerprint`). Every rank raises the same
    error, unchanged by the backend (like :class:`RankTimeoutError`); nothing was replayed."""


class PaddingLeakError(CaptureError):
    """The padding-leak check at capture (:mod:`graphrunner.checks.padding`) found a
    real output cell that changes when only padding cells change: replays of
    that key would return results that include the padding. The message
    names the output path (e.g. ``output['total']``) and the key."""


class RankFailedError(CaptureError):
    """A rank failed where its peers may be inside the step's own collectives (its capture or its
    step raised on that rank alone), so the ranks' collectives can no longer pair.

    The failed rank sent nothing more on the process group: it wrote what happened to the
    rendezvous store (out of band) and aborted the process group (gloo closes its connections,
    NCCL aborts its communicator), so a peer's pending collective ends at once in an error, and
    every rank raises this error, with the same message, naming the failed rank (:attr:`failed_rank`)
    and its cause (:attr:`cause_text`); the first failure reported wins when several ranks fail.
    Every collective of the runner's group then raises it again, without sending anything: the
    runner stops on every rank (:mod:`graphrunner.channel`, ``docs/multirank.md``)."""

    def __init__(self, message: str, failed_rank: int = -1, cause_text: str = "") -> None:
        super().__init__(message)
        #: The rank that failed first (the one whose report is in the store).
        self.failed_rank = int(failed_rank)
        #: What it raised, as ``"Type: message"``.
        self.cause_text = cause_text

    def __reduce__(self):  # picklable with its fields
        return (type(self), (str(self), self.failed_rank, self.cause_text))


class ContractError(GraphRunnerError):
    """A debug-mode contract failed before a replay (:mod:`graphrunner.checks.contracts`):
    an external tensor the graph reads (a weight, buffer, KV cache) was
    re-bound or changed storage, shape or strides since capture. The message
    names the tensor, with its module path where known."""


class AgreementError(GraphRunnerError):
    """Ranks that must act alike did not: the per-call agreement found the ranks' calls unpaired
    (their call numbers or configuration digests differ: every rank raises it for the same call,
    and :attr:`calls`/:attr:`digests` are set), the collective channel found the ranks'
    collectives out of step (another phase, kind or sequence number on another rank: every rank
    raises it in the same collective, :attr:`collectives` is set; :mod:`graphrunner.channel`), the
    engine's own step numbers (``runner.run(inputs, step=n)``) differ (:attr:`steps`), or
    the group returned an agreement that cannot be right (an agreed size below this rank's own in
    some dim: a broken group implementation). Nothing was replayed."""

    def __init__(
        self,
        message: str,
        calls: tuple[int, int, int] | None = None,
        digests: tuple[int, int, int] | None = None,
        collectives: tuple[int, int, int] | None = None,
        steps: tuple[int, int, int] | None = None,
    ) -> None:
        super().__init__(message)
        #: ``(this rank's call number, lowest, highest over the ranks)`` when the call numbers differ.
        self.calls = calls
        #: ``(this rank's configuration digest, lowest, highest)`` when the digests differ.
        self.digests = digests
        #: ``(this rank's collective sequence number, lowest, highest)`` when the channel found the
        #: ranks' collectives out of step.
        self.collectives = collectives
        #: ``(this rank's engine step number, lowest, highest)`` when the ranks' ``run(..., step=)`` differ.
        self.steps = steps

    @property
    def unpaired(self) -> bool:
        """True when the ranks were found out of step (every rank raised it for this collective)."""
        return any(f is not None for f in (self.calls, self.digests, self.collectives, self.steps))

    def __reduce__(self):  # picklable with its fields (errors travel between processes in tests and tools)
        return (type(self), (str(self), self.calls, self.digests, self.collectives, self.steps))


class RankTimeoutError(GraphRunnerError):
    """A barrier, agreement or collective across ranks did not complete
    within the group's timeout: a peer rank died, raised, or is stuck. The
    message names this rank, the phase and the shape key."""

    @classmethod
    def from_step(cls, exc: BaseException, group: Any, phase: str, key: Any) -> RankTimeoutError | None:
        """The error for ``exc``, raised by the step (warmup, capture, replay,
        eager break or fallback) of a multi-rank ``group``, if ``exc`` is a
        failed collective (gloo/NCCL/c10d report a dead or stuck peer as a
        ``RuntimeError``); ``None`` for any other exception or a one-rank group."""
        size = int(getattr(group, "size", 1))
        if size <= 1 or isinstance(exc, GraphRunnerError) or not isinstance(exc, RuntimeError):
            return None
        text = str(exc)
        if not any(m in text for m in _COLLECTIVE_FAILURES):
            return None
        timeout = getattr(group, "timeout", None)
        within = f" within {timeout:g}s" if isinstance(timeout, (int, float)) else ""
        return cls(
            f"rank {int(getattr(group, 'rank', 0))} of {size}: a collective inside the step did not complete{within} "
            f"in phase {phase!r} for shape key {key!r} (a peer rank died, raised, or is stuck): "
            f"{type(exc).__name__}: {text.strip()[:300]}. The process group is no longer usable: let this process "
            "exit"
        )


#: Words in a ``RuntimeError`` that mark a failed collective (gloo, NCCL, c10d).
_COLLECTIVE_FAILURES = (
    "Timed out",
    "timed out",
    "Connection closed",
    "Connection reset",
    "gloo",
    "NCCL",
    "ProcessGroup",
    "c10d",
)
