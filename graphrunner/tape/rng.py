"""Random number generators on the tape, with CUDA's semantics, and the generators graphrunner owns.

Owns the re-seed guard (``torch.manual_seed`` / ``seed`` / ``set_rng_state``
raise while a capture is active, as ``manual_seed`` does during a CUDA
capture), :func:`op_generator`, the generator a seeded op draws from, and
:class:`OwnedGenerators` with :func:`redirect`: the one mechanism by which a
check, a verification or a background capture draws from generators of its
own instead of the engine's (the op recorder and the tape capture swap the
generator of every seeded op they see). Saving and restoring generator states
around a blocking tape capture is done by the capture itself
(:meth:`~graphrunner.tape.recording.TapeCapture.track_generator`,
``restore_generators``); under a redirect it only ever sets its stand-ins."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.random as trandom
from torch.utils._python_dispatch import TorchDispatchMode

from graphrunner.errors import CaptureError

from .state import ACTIVE, capture_here
from .unsafe import user_frame

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
        f"{what} during a tape capture (at {user_frame()}): a device graph cannot re-seed a generator "
        "(CUDA raises on manual_seed during capture), and the tape restores every generator's state at "
        "capture end, so the new seed would be lost. Seed before capture_begin() (or between replays)."
    )


def _guarded_reseed(name: str, fn: Callable) -> Callable:
    def guarded(*args, **kwargs):
        # This thread's capture, else a global-mode capture in another thread
        # (CUDA forbids unsafe calls from any thread only in global mode).
        cap = capture_here() or next((c for c in list(ACTIVE.values()) if c.mode == "global"), None)
        if cap is not None:
            err = _reseed_error(f"torch.{name}()")
            cap.failed = err
            raise err
        return fn(*args, **kwargs)

    guarded.__wrapped__ = fn  # type: ignore[attr-defined]  # a function attribute mypy's type of a def lacks
    guarded._graphrunner_reseed_guard = True  # type: ignore[attr-defined]  # likewise (read by reseed_guard)
    guarded.__name__ = guarded.__qualname__ = name
    guarded.__doc__ = fn.__doc__
    return guarded


@contextlib.contextmanager
def reseed_guard() -> Iterator[None]:
    """Make ``torch.manual_seed`` / ``torch.seed`` / ``torch.set_rng_state``
    (and their ``torch.random`` spellings) raise while a capture is active.
    Direct ``Generator.manual_seed`` calls are C methods that cannot be
    intercepted; :meth:`TapeCapture.restore_generators` catches those at capture
    end by the changed ``initial_seed()``."""

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
_RESEED_SAVED: list = []  # (module, name, original function) while guarded
_RESEED_USERS = [0]  # captures using the installation


def op_generator(args, kwargs) -> torch.Generator | None:
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


# ------------------------------------------------------------ generators a check or a capture owns
_SHARED = threading.local()


class OwnedGenerators:
    """Generators owned by a check, a verification or a background capture, standing in for the
    generators the step would draw from (the default generator of a device, an explicit
    ``generator=`` argument) while a :func:`redirect` is active on this thread.

    ``seed`` given: each stand-in is a fresh generator seeded from it (the source is never read);
    :meth:`reset` seeds them again, so every run of a check draws the same numbers (the padding
    check's runs, a background capture's warmups). ``seed=None``: each stand-in starts as a copy of
    its source's state, read once at its first draw on the calling thread (shadow verification,
    ``runner.compare``: the eager reference draws what the replay will draw from the engine's
    generator, and the engine's generator is never set). Either way the sources are never drawn
    from nor set."""

    def __init__(self, seed: int | None = None) -> None:
        self.seed = seed
        self._stand_ins: dict = {}  # id(source) -> (source, stand-in); the source kept alive: ids stay unique
        self._mine: set = set()  # ids of the stand-ins
        #: How many draws were redirected to a stand-in.
        self.draws = 0

    def stand_in(self, source: torch.Generator) -> torch.Generator:
        """The generator that draws instead of ``source`` (itself when ``source`` is a stand-in)."""
        if id(source) in self._mine:
            return source
        ent = self._stand_ins.get(id(source))
        if ent is None:
            g = torch.Generator(device=source.device)
            if self.seed is None:
                g.set_state(source.get_state())
            else:
                g.manual_seed(self.seed + len(self._stand_ins))
            ent = self._stand_ins[id(source)] = (source, g)
            self._mine.add(id(g))
        return ent[1]

    def owns(self, g: torch.Generator | None) -> bool:
        """True for one of this object's stand-ins."""
        return g is not None and id(g) in self._mine

    def reset(self) -> None:
        """The next run draws what the first did: seeded stand-ins seeded again; copies forgotten
        (copied again at their next first draw)."""
        if self.seed is None:
            self._stand_ins.clear()
            self._mine.clear()
            return
        for i, (_, g) in enumerate(self._stand_ins.values()):
            g.manual_seed(self.seed + i)


def _stack() -> list:
    st = getattr(_SHARED, "stack", None)
    if st is None:
        st = _SHARED.stack = []
    return st


@contextlib.contextmanager
def redirect(owned: OwnedGenerators) -> Iterator[OwnedGenerators]:
    """On this thread, for the body: every seeded op that a graphrunner dispatch mode sees (an op
    recorder's, a tape capture's) draws from ``owned``'s stand-ins instead of the generator it
    would draw from. Nested redirects: the innermost wins."""
    st = _stack()
    st.append(owned)
    try:
        yield owned
    finally:
        st.remove(owned)


def redirected() -> OwnedGenerators | None:
    """The innermost :func:`redirect` active on this thread, or None."""
    st = getattr(_SHARED, "stack", None)
    return st[-1] if st else None


def _generator_overload(func: Any) -> Any:
    """The overload of seeded op ``func`` that takes a ``generator=`` argument with the same other
    arguments (``aten.rand.default`` -> ``aten.rand.generator``), or None."""
    hit = _OVERLOADS.get(func, _MISSING)
    if hit is not _MISSING:
        return hit
    names = [a.name for a in func._schema.arguments]
    hit = None
    if "generator" in names:
        hit = func
    else:
        packet = getattr(torch.ops.aten, func._schema.name.split("::")[-1], None)
        for o in packet.overloads() if packet is not None else ():
            cand = getattr(packet, o)
            cnames = [a.name for a in cand._schema.arguments]
            if "generator" in cnames and [n for n in cnames if n != "generator"] == names:
                hit = cand
                break
    _OVERLOADS[func] = hit
    return hit


_OVERLOADS: dict = {}
_MISSING = object()


def stand_in_op(func: Any, args: tuple, kwargs: dict) -> tuple[Any, dict]:
    """``(func, kwargs)`` to run seeded op ``func`` with under the active :func:`redirect`: its
    generator argument the stand-in of the generator it would draw from. A seeded op without a
    generator overload (``aten.dropout``, ``aten.feature_dropout``, ``aten.rrelu``, ``aten.lstm``
    with dropout, ``aten.native_dropout`` on the CPU: whatever a dispatch mode sees under
    ``torch.inference_mode()``) runs as its decomposition (its ``CompositeImplicitAutograd``
    kernel, or for ``native_dropout`` the CPU kernel's own steps) with every seeded part drawing
    from the stand-in: the same numbers the op would draw, from the stand-in's state. Unchanged
    without a redirect, for an op that is not seeded, or one with neither (it draws from its
    generator as before: a fused GPU kernel, which the host cannot redirect)."""
    owned = redirected()
    if owned is None or torch.Tag.nondeterministic_seeded not in func.tags:
        return func, kwargs
    target = _generator_overload(func)
    if target is None:
        parts = _decomposition(func, args, kwargs)
        return (func, kwargs) if parts is None else (parts, {**kwargs})
    source = op_generator(args, kwargs)
    if source is None:
        return func, kwargs
    owned.draws += 1
    return target, {**kwargs, "generator": owned.stand_in(source)}


def drawn_generator(args: tuple, kwargs: dict) -> torch.Generator | None:
    """The generator a seeded op called with ``args``/``kwargs`` draws from: under a
    :func:`redirect` the stand-in of :func:`op_generator`'s, else that generator itself."""
    source, owned = op_generator(args, kwargs), redirected()
    return source if owned is None or source is None else owned.stand_in(source)


class _Parts(TorchDispatchMode):
    """While a decomposed seeded op runs (:func:`stand_in_op`): each of its parts through
    :func:`stand_in_op` again, so a seeded part draws from the active redirect's stand-in."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        run, run_kwargs = stand_in_op(func, args, kwargs or {})
        return run(*args, **run_kwargs)


def _native_dropout_cpu(x: torch.Tensor, p: float, train: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``aten.native_dropout`` as ATen's CPU kernel computes it (``native_dropout_cpu``): a
    ``bernoulli_(1 - p)`` mask, the input times it, scaled; the same draws, bit for bit."""
    p1m = 1.0 - p
    mask = torch.empty_like(x, memory_format=torch.contiguous_format).bernoulli_(p1m)
    return x.mul(mask).mul_(0.0 if p1m == 0 else 1.0 / p1m), mask.to(torch.bool)


def _decomposition(func: Any, args: tuple, kwargs: dict) -> Callable | None:
    """A function computing seeded op ``func`` (no generator overload) from parts that each draw
    from the active redirect's stand-in, or None (it has no such decomposition here)."""
    run: Callable | None = None
    if func is torch.ops.aten.native_dropout.default:
        x = args[0] if args else kwargs.get("input")
        train = args[2] if len(args) > 2 else kwargs.get("train")
        if isinstance(x, torch.Tensor) and x.device.type == "cpu" and x.numel() and train is not False:
            run = _native_dropout_cpu
    elif torch._C._dispatch_has_kernel_for_dispatch_key(func.name(), "CompositeImplicitAutograd"):
        run = func.decompose
    if run is None:
        return None
    parts = run

    def decomposed(*a: Any, **kw: Any) -> Any:
        with _Parts():
            return parts(*a, **kw)

    return decomposed


def generators_shared() -> bool:
    """True on a thread inside :func:`shared_generators` (a background capture's thread)."""
    return getattr(_SHARED, "on", False)


@contextlib.contextmanager
def shared_generators(seed: int = 0x62677267) -> Iterator[None]:
    """On this thread, for the body: generators are shared with another thread that keeps drawing
    from them (a background capture while the engine samples with the default generator). Every
    seeded op recorded here (warmups, the post-warmup hook, a tape capture, a check's runs) draws
    from generators owned by the body (:func:`redirect`), so the engine's generators are never
    drawn from, read or set on this thread."""
    before = generators_shared()
    _SHARED.on = True
    try:
        with redirect(OwnedGenerators(seed)):
            yield
    finally:
        _SHARED.on = before
