"""Process-wide state of the tape: which captures are in progress.

Owns the per-thread registry of active captures (``ACTIVE``: thread id ->
capture, at most one per thread, changed only under ``ACTIVE_LOCK``),
:func:`is_tape_capturing`, the accepted ``capture_error_mode`` values, and
``storage_of`` (a tensor's untyped storage, or None), the key every other tape
module uses to tell tensors' memory apart, and :func:`alias_of` (a new tensor
object on the same memory, so holding memory need not hold a user's object)
with ``OURS``, the registry of such tensors the tape holds, and the
snapshot buffers reused within a capture session (:func:`reuse_snapshot_buffers`).
Imports nothing from the package.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Iterator
from typing import Protocol

import torch


class ActiveCapture(Protocol):
    """What the modules below the recorder need of a capture in progress
    (:class:`graphrunner.tape.recording.TapeCapture`, which sits above them): its
    ``capture_error_mode``, its thread, and where an error the capture must end with is kept."""

    mode: str
    thread: int
    thread_name: str
    failed: BaseException | None


CAPTURE_ERROR_MODES = ("global", "thread_local", "relaxed")

# The captures in progress: thread id -> capture (at most one per thread).
# Like CUDA, captures in different threads may overlap when neither uses
# capture_error_mode="global"; a global-mode capture is the only one while it
# lasts.  Changed only under ACTIVE_LOCK.
ACTIVE: dict[int, ActiveCapture] = {}
ACTIVE_LOCK = threading.Lock()


def capture_here() -> ActiveCapture | None:
    """The capture in progress in the calling thread, if any."""
    return ACTIVE.get(threading.get_ident())


def is_tape_capturing() -> bool:
    """True while any :class:`TapeGraph` capture is active in this process
    (in any thread; with ``capture_error_mode="thread_local"`` or
    ``"relaxed"`` several threads may be capturing at once)."""
    return bool(ACTIVE)


def storage_of(t: torch.Tensor):
    try:
        return t.untyped_storage()
    except Exception:  # tensors without storage (sparse, nested, ...)
        return None


def storage_bytes(st) -> torch.Tensor:
    """A uint8 tensor over every byte of untyped storage ``st`` (a view, not
    a copy: ``.clone()`` it to snapshot, ``.copy_(snap)`` into it to restore).
    Call it under ``torch.inference_mode()`` as the tape's snapshots do."""
    return torch.empty(0, dtype=torch.uint8, device=st.device).set_(st)


# Snapshot buffers reused within a capture session (reuse_snapshot_buffers):
# (numel, device) -> byte copies no snapshot holds any more.  A fresh copy of
# a large storage (a paged KV cache) costs its allocation's page faults, 3-5x
# the copy itself; inside a session every capture snapshots the same storages.
_BUF_LOCK = threading.Lock()
_BUF_FREE: dict[tuple, list[torch.Tensor]] = {}
_BUF_DEPTH = 0
_BUF_MIN_BYTES = 1 << 20  # smaller copies are cheap to allocate
_BUF_PER_SIZE = 4


@contextlib.contextmanager
def reuse_snapshot_buffers() -> Iterator[None]:
    """Within: the byte copies the tape takes to put storages back (the
    externals a capture writes, the storages :meth:`JitReplay.prepare
    <graphrunner.tape.jit.JitReplay.prepare>` writes) are copied into buffers
    a restore gave back earlier instead of fresh allocations.  What is copied
    and put back is unchanged: only where the copy lives.  A backend's
    ``capture_session()`` enters it; the buffers are dropped when the
    outermost one exits."""
    global _BUF_DEPTH
    with _BUF_LOCK:
        _BUF_DEPTH += 1
    try:
        yield
    finally:
        with _BUF_LOCK:
            _BUF_DEPTH -= 1
            last = _BUF_DEPTH == 0
            if last:
                _BUF_FREE.clear()
                _SCRATCH_FREE.clear()
        if last:
            for clear in _SESSION_CLEARS:
                clear()


# Scratch memory for the capture's checks (the out= check's buffer,
# graphrunner.tape.bindings), reused within a capture session: (nbytes,
# device) -> untyped storages given back.  A fresh allocation of a large
# buffer costs its page faults, more than the fill and the kernel writing it.
_SCRATCH_FREE: dict[tuple, list] = {}
_SCRATCH_MIN_BYTES = 1 << 16
_SCRATCH_PER_SIZE = 2


def scratch_storage(nbytes: int, device: torch.device):
    """An untyped storage of ``nbytes`` (its bytes: whatever was there),
    inside a capture session one given back earlier (:func:`give_back_scratch`)."""
    if _BUF_DEPTH and nbytes >= _SCRATCH_MIN_BYTES:
        with _BUF_LOCK:
            free = _SCRATCH_FREE.get((nbytes, device))
            st = free.pop() if free else None
        if st is not None:
            return st
    return torch.empty(nbytes, dtype=torch.uint8, device=device).untyped_storage()


def give_back_scratch(st) -> None:
    """Give back a storage from :func:`scratch_storage` that nothing holds or reads any more."""
    n = st.nbytes()
    if _BUF_DEPTH and n >= _SCRATCH_MIN_BYTES:
        with _BUF_LOCK:
            if _BUF_DEPTH:
                free = _SCRATCH_FREE.setdefault((n, st.device), [])
                if len(free) < _SCRATCH_PER_SIZE:
                    free.append(st)


# Other session-scoped caches (the proofs' memo, graphrunner.tape.proof): each
# registers a function emptying it, called when the outermost session exits.
_SESSION_CLEARS: list = []


def in_session() -> bool:
    """Whether a capture session (:func:`reuse_snapshot_buffers`) is active."""
    return _BUF_DEPTH > 0


def on_session_end(clear) -> None:
    """Call ``clear()`` whenever the outermost capture session exits."""
    _SESSION_CLEARS.append(clear)


def snapshot_copy(b: torch.Tensor) -> torch.Tensor:
    """A copy of the byte view ``b`` (:func:`storage_bytes`), in a reused
    buffer inside :func:`reuse_snapshot_buffers`.  Call it under
    ``torch.inference_mode()``; give the copy back with
    :func:`release_snapshot` once nothing reads it."""
    if _BUF_DEPTH and b.numel() >= _BUF_MIN_BYTES:
        with _BUF_LOCK:
            free = _BUF_FREE.get((b.numel(), b.device))
            buf = free.pop() if free else None
        if buf is not None:
            return buf.copy_(b)
    return b.clone()


def release_snapshot(buf: torch.Tensor) -> None:
    """Give back a copy from :func:`snapshot_copy` that nothing reads any more."""
    if _BUF_DEPTH and buf.numel() >= _BUF_MIN_BYTES:
        with _BUF_LOCK:
            if _BUF_DEPTH:
                free = _BUF_FREE.setdefault((buf.numel(), buf.device), [])
                if len(free) < _BUF_PER_SIZE:
                    free.append(buf)


# Tensors the tape itself holds on some storage: id(storage) -> WeakSet of them.
# They do not count as references to the memory (a CUDA graph holds
# addresses, not tensors): see graphrunner.tape.pool.
OURS: dict[int, weakref.WeakSet] = {}


def ours(t: torch.Tensor) -> torch.Tensor:
    """Register ``t`` as a tensor the tape (not its user) holds; returns ``t``."""
    k = id(t.untyped_storage())
    s = OURS.get(k)
    if s is None:
        s = OURS[k] = weakref.WeakSet()
    s.add(t)
    return t


def alias_of(t: torch.Tensor) -> torch.Tensor:
    """A new tensor object viewing ``t``'s memory with ``t``'s dtype, shape,
    strides and offset (and inference-ness), registered with :func:`ours`: it
    keeps the storage alive, not the object ``t``, so whether the user still
    refers to the memory can be told.  ``t`` must not require grad."""
    with torch.inference_mode(t.is_inference()), torch.no_grad():
        return ours(
            torch.empty(0, dtype=t.dtype, device=t.device).set_(
                t.untyped_storage(), t.storage_offset(), t.size(), t.stride()
            )
        )
