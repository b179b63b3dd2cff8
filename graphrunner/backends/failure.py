"""The error a failed key capture raises (the protocol's ``END`` after an error).

:meth:`~graphrunner.backends.base.GraphBackend.capture_one` cleans up the key's capture state and
then raises what :func:`raise_capture_failure` decides: errors every rank raises alike pass through
unchanged (so every rank reports the same thing), a rank's collective that failed becomes a
``RankTimeoutError`` naming the step, and anything else becomes a ``CaptureError`` naming the
backend, the shape key, the rank and the step, with the original as its cause."""

from __future__ import annotations

from typing import Any, NoReturn

from graphrunner.errors import AgreementError, CaptureError, RankFailedError, RanksDisagreeError, RankTimeoutError

__all__ = ["raise_capture_failure"]


def raise_capture_failure(exc: BaseException, *, backend: str, rank: int, group: Any, step: str, key: Any) -> NoReturn:
    """Raise the error a capture of ``key`` that failed with ``exc`` during ``step`` reports: a
    ``RankTimeoutError`` found in ``exc``'s chain unchanged, ``exc`` itself when every rank raises it
    (``RanksDisagreeError``, the channel's ``AgreementError`` or ``RankFailedError``, or not an
    ``Exception``), a rank's collective that failed as a ``RankTimeoutError``, else a ``CaptureError``
    naming ``backend``, ``key``, ``rank`` and ``step``, with ``exc`` as its cause."""
    rte = _find_rank_timeout(exc)
    if rte is not None:
        if rte is exc:
            raise exc
        raise rte from None
    if not isinstance(exc, Exception) or isinstance(exc, (RanksDisagreeError, AgreementError, RankFailedError)):
        raise exc  # every rank raises this same error: unchanged
    collective = RankTimeoutError.from_step(exc, group, step, key)
    if collective is not None:
        raise collective from exc
    raise CaptureError(
        f"{backend} backend: capture of shape key {key!r} failed on rank {rank} during {step}: "
        f"{type(exc).__name__}: {exc}{_unsafe_hint(backend, exc)}"
    ) from exc


def _find_rank_timeout(exc: BaseException) -> RankTimeoutError | None:
    """The first ``RankTimeoutError`` in ``exc``'s chain of causes and contexts, or None."""
    seen = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        if isinstance(e, RankTimeoutError):
            return e
        seen.add(id(e))
        e = e.__cause__ or e.__context__
    return None


def _unsafe_hint(backend: str, exc: BaseException) -> str:
    """What the unsafe-op error's "@no_graph" advice means on this backend (the full backend
    captures a @no_graph function like any code: only a breakable graph runs it eagerly)."""
    if backend == "full" and type(exc).__name__ == "CaptureUnsafeOpError" and "no_graph" in str(exc):
        return (
            " (on the full backend a @no_graph function is captured like any code: use "
            "backend='breakable' for an eager break, or a capturable rewrite)"
        )
    return ""
