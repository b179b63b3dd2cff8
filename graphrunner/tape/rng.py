"""Random number generators on the tape, with CUDA's semantics.

Owns the re-seed guard (``torch.manual_seed`` / ``seed`` / ``set_rng_state``
raise while a capture is active, as ``manual_seed`` does during a CUDA
capture) and :func:`_op_generator`, the generator a seeded op draws from.
Saving and restoring generator states around a capture is done by the
capture itself (:meth:`~graphrunner.tape.recording._Capture.track_generator`,
``restore_generators``).
"""

from __future__ import annotations

import contextlib
import threading
from typing import Callable, Iterator

import torch

from graphrunner.errors import CaptureError

from .state import _ACTIVE, _capture_here
from .unsafe import _user_frame

# ---------------------------------------------------------------------------
# random number generators (TAPE-NOTES item 6)
#
# A CUDA capture consumes nothing from a generator: it records the Philox
# offset increments, and each replay advances the generator as the eager step
# would.  The tape runs the RNG ops at capture (they really draw), so it saves
# the state of every generator the capture may draw from -- the default CPU
# generator at capture begin, any other (an explicit ``generator=``, a CUDA
# default generator) before the first op that uses it -- and restores them at
# capture end.  Replay runs each seeded op again on the same generator
# (``generator=None``: the default one), so replay k draws what eager step k
# would from the same state.  Re-seeding during capture raises, as
# ``manual_seed`` does during a CUDA capture.

_RESEED_FUNCTIONS = ("manual_seed", "seed", "set_rng_state")


def _reseed_error(what: str) -> CaptureError:
    return CaptureError(
        f"{what} during a tape capture (at {_user_frame()}): a device graph cannot re-seed a generator "
        "(CUDA raises on manual_seed during capture), and the tape restores every generator's state at "
        "capture end, so the new seed would be lost. Seed before capture_begin() (or between replays)."
    )


def _guarded_reseed(name: str, fn: Callable) -> Callable:
    def guarded(*args, **kwargs):
        # This thread's capture, else a global-mode capture in another thread
        # (CUDA forbids unsafe calls from any thread only in global mode).
        cap = _capture_here() or next((c for c in list(_ACTIVE.values()) if c.mode == "global"), None)
        if cap is not None:
            err = _reseed_error(f"torch.{name}()")
            cap.failed = err
            raise err
        return fn(*args, **kwargs)

    guarded.__wrapped__ = fn
    guarded._graphrunner_reseed_guard = True
    guarded.__name__ = guarded.__qualname__ = name
    guarded.__doc__ = fn.__doc__
    return guarded


@contextlib.contextmanager
def _reseed_guard() -> Iterator[None]:
    """Make ``torch.manual_seed`` / ``torch.seed`` / ``torch.set_rng_state``
    (and their ``torch.random`` spellings) raise while a capture is active.
    Direct ``Generator.manual_seed`` calls are C methods that cannot be
    intercepted; :meth:`_Capture.restore_generators` catches those at capture
    end by the changed ``initial_seed()``."""
    import torch.random as trandom

    # Concurrent captures (other threads) share one installation: the last
    # capture to end restores the originals.
    with _RESEED_LOCK:
        if not _RESEED_SAVED:
            for mod in (torch, trandom):
                for name in _RESEED_FUNCTIONS + ("_manual_seed_impl",):
                    fn = mod.__dict__.get(name)
                    if fn is None or getattr(fn, "_graphrunner_reseed_guard", False):
                        continue
                    _RESEED_SAVED.append((mod, name, fn))
                    setattr(mod, name, _guarded_reseed(name.lstrip("_").replace("_impl", ""), fn))
        _RESEED_USERS[0] += 1
    try:
        yield
    finally:
        with _RESEED_LOCK:
            _RESEED_USERS[0] -= 1
            if _RESEED_USERS[0] == 0:
                for mod, name, fn in _RESEED_SAVED:
                    setattr(mod, name, fn)
                _RESEED_SAVED.clear()


_RESEED_LOCK = threading.Lock()
_RESEED_SAVED: list = []   # (module, name, original function) while guarded
_RESEED_USERS = [0]        # captures using the installation


def _op_generator(args, kwargs) -> "torch.Generator | None":
    """The generator a seeded op draws from: its explicit generator argument,
    else the default generator of its tensors' (or ``device=``) device."""
    device = kwargs.get("device")
    for v in list(args) + list(kwargs.values()):
        if isinstance(v, torch.Generator):
            return v
        if device is None and isinstance(v, torch.Tensor):
            device = v.device
    device = torch.device(device) if device is not None else torch.device("cpu")
    if device.type == "cpu":
        return torch.default_generator
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return torch.cuda.default_generators[index]
    return None  # meta and other devices: nothing to restore


# ------------------------------------------------------------ a generator shared with another thread
_SHARED = threading.local()


def generators_shared() -> bool:
    """True on a thread inside :func:`shared_generators`: nothing that runs there may put a
    generator's state back (tape captures, write guards)."""
    return getattr(_SHARED, "on", False)


@contextlib.contextmanager
def shared_generators() -> Iterator[None]:
    """On this thread, for the body: generators are shared with another thread that keeps drawing
    from them (a background capture while the engine samples with the default generator), so
    setting a generator's state back would rewind the other thread's draws and repeat its
    numbers. Inside, a tape capture and a :class:`~graphrunner.recording.ops.WriteGuard` leave
    every generator as it is: what the step draws here is drawn from the shared stream, once."""
    before = generators_shared()
    _SHARED.on = True
    try:
        yield
    finally:
        _SHARED.on = before
