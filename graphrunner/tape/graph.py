"""The public face of the tape: :class:`TapeGraph` and :func:`tape_graph`.

Owns the graph object's life cycle -- ``capture_begin`` (entering the
re-seed guard, the unsafe-op guard and the recorder), ``capture_end``
(undoing writes to externals, restoring generators, then hoisting, survivors
and code generation through :mod:`~graphrunner.tape.codegen` and
:mod:`~graphrunner.tape.survivors`, and the TorchScript trace of the replay,
:mod:`~graphrunner.tape.jit`, made there without a trace of its own run),
``replay`` (the generated function with
autograd and torch-function handling off, one replay at a time per pool),
``reset`` -- and :data:`EMPTY_GRAPH_MESSAGE`.  Memory placement in a pool is
:mod:`~graphrunner.tape.pool`'s job.
"""

from __future__ import annotations

import contextlib
import logging
import warnings
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import _disable_current_modes

from graphrunner.errors import CaptureError

from . import jit
from .bindings import NO_TORCH_FUNCTION
from .codegen import generate, hoist
from .jit import JitReplay, eligible, jit_default
from .pool import TRACING, TapePool, place
from .proof import stats as proof_stats
from .recording import Recorder, TapeCapture
from .rng import reseed_guard
from .state import ACTIVE, ACTIVE_LOCK, CAPTURE_ERROR_MODES, alias_of
from .streams import unjoined_error
from .survivors import (
    SURVIVORS,
    EscapedTensorWarning,
    Poisoned,
    find_survivors,
    forget_poisoned,
    poison_survivors,
    resolve_poison,
    unpoison,
    warn_stashed,
)
from .unsafe import Guard

# the replay's C entry points, bound once (one attribute lookup less each per replay)
_InferenceMode = torch._C._InferenceMode
_is_grad_enabled = torch.is_grad_enabled
_set_grad_enabled = torch._C._set_grad_enabled

logger = logging.getLogger("graphrunner")

#: The warning ``capture_end()`` gives when no aten op ran during the capture
#: (CUDA's is "The CUDA Graph is empty. This usually means that the graph was
#: attempted to be captured on wrong device or stream.").
EMPTY_GRAPH_MESSAGE = (
    "The tape graph is empty: no aten op ran between capture_begin() and capture_end(), so replay() does "
    "nothing. This usually means the work ran outside the capture (before capture_begin(), in another "
    "thread) or was not tensor work; check that the captured code really runs inside the capture."
)


class TapeGraph:
    """CPU emulation of ``torch.cuda.CUDAGraph``: record aten ops once, replay them.

    Contract:
      * ``capture_begin()`` ... ``capture_end()`` (or ``with tape_graph(g):``)
        records every aten op run in between, on any device.  Only one tape
        capture may be active at a time (:class:`CaptureError` otherwise).
      * ``replay()`` re-runs the recorded ops: externals (tensors not created
        in the capture) are read/written in place; tensors created in the
        capture and still referenced afterwards are refreshed in place; the
        results are bit-identical to running the captured code eagerly on the
        current contents of the externals.
      * RNG: the capture consumes nothing from any generator; each replay
        draws (and advances the generator) exactly as running the captured
        code eagerly would, from the generator's current state.  Re-seeding a
        generator during capture raises :class:`CaptureError`.
      * ``reset()`` drops the recording (and aborts a capture in progress).
      * ``num_ops`` is the number of aten ops recorded (0 when empty);
        ``num_collectives`` the number of those that are collectives (c10d and
        functional ones, their waits included).
      * Pools (``pool=``): graphs captured into one pool share its memory as
        CUDA graphs do (:mod:`graphrunner.tape.pool`): replayed out of
        capture order they corrupt each other as on CUDA; replaying two of
        them at once (two threads) raises :class:`CaptureError` naming both.
        ``pool_bytes`` estimates the pool memory the capture added.

    ``jit_replay`` (default: ``$GRAPHRUNNER_TAPE_JIT``, on unless ``0``):
    replay through a TorchScript trace of the generated code, where the
    program allows and replays at least ``jit.JIT_MIN_OPS`` ops (a smaller
    one replays faster in Python, untraced) (:mod:`graphrunner.tape.jit`);
    the results are the same bits.  The trace is made at ``capture_end()``, so the first replay costs
    what a steady one does; making it runs the replay, and that run leaves
    nothing behind (externals, survivors and generators get back what they
    held: the capture still launches nothing, as on CUDA, and poisoned
    survivors stay poisoned).  ``replay_engine`` says which engine runs:
    ``"jit"`` right after a capture that could be traced.

    ``poison_captured_values`` (default: ``$GRAPHRUNNER_TAPE_POISON``, see
    :func:`poison_default`) emulates what a CUDA capture leaves in the
    survivors: it launches nothing, so until the first replay they hold
    whatever the pool memory held.  When true, ``capture_end()`` fills every
    survivor's storage with :func:`poison_value` of its dtype (NaN, the
    integer maximum, ``True``); code that reads a survivor before the first
    replay (an eager break of a breakable capture reading a segment's
    output, a test checking the capture-time output) sees the poison.
    Replay is unaffected: it refreshes every survivor, so replays stay
    bit-identical to eager.  (A survivor the tape computes once at capture
    instead of at each replay, a constant such as ``torch.arange(n)``, gets
    its value back at the first replay, as a CUDA graph would compute it.)
    Until that first replay the graph keeps a copy of each poisoned
    survivor's real bytes: another tape capture that reads the survivor
    computes on them (a CUDA capture never computes, so it cannot fail on
    the garbage), and the survivor is poisoned again when that capture ends.
    """

    def __init__(self, poison_captured_values: bool | None = None, jit_replay: bool | None = None):
        self.poison_captured_values: bool = resolve_poison(poison_captured_values, "TapeGraph")
        if jit_replay is not None and not isinstance(jit_replay, bool):
            raise TypeError(f"jit_replay must be True, False or None, got {type(jit_replay).__name__}")
        #: Replay through a TorchScript trace when the program allows (:mod:`~graphrunner.tape.jit`).
        self.jit_replay: bool = jit_default() if jit_replay is None else jit_replay
        self._jit: JitReplay | None = None
        self._pool: TapePool | None = None
        self._cap: TapeCapture | None = None
        self._modes: tuple | None = None
        self._fn: Callable[[], None] | None = None
        self._num_ops = 0
        self._num_collectives = 0
        self._inference = False
        self._statics: list[torch.Tensor] = []
        self._versioned: list[tuple[weakref.ref, int]] = []
        self._surv_storages: list[tuple] = []  # (storage, dtype, computed once) of each survivor, for poisoning
        self._poisoned: dict[int, Poisoned] = {}  # storage key -> survivor poisoned since capture end
        self.source: str | None = None  # generated replay source, for debugging
        #: ``(proofs, refused, seconds)`` of the last capture's rewrite proofs (:mod:`~graphrunner.tape.proof`):
        #: rewrites proven bit-equal to the call they replace, or dropped, and the capture time spent on it.
        self.rewrite_proofs: tuple = (0, 0, 0.0)
        self._pool_bytes = 0
        self._pool_index = 0
        self._self_ref = weakref.ref(self)

    # -- capture ------------------------------------------------------------
    def capture_begin(self, pool: TapePool | None = None, capture_error_mode: str = "global") -> None:
        """Start recording in the calling thread.

        Raises CaptureError if this graph already holds a capture (call
        ``reset()`` first), if this thread is already capturing (captures do
        not nest), or if another thread is capturing and either capture uses
        ``capture_error_mode="global"``. As with CUDA, captures in different
        threads may overlap when both use ``"thread_local"`` or ``"relaxed"``;
        only the calling thread's tensor work is recorded."""
        if capture_error_mode not in CAPTURE_ERROR_MODES:
            raise ValueError(f"capture_error_mode must be one of {CAPTURE_ERROR_MODES}, got {capture_error_mode!r}")
        if pool is not None and not isinstance(pool, TapePool):
            raise TypeError(f"pool must be a TapePool from graph_pool_handle() or None, got {type(pool).__name__}")
        if self._cap is not None:
            raise CaptureError("this TapeGraph is already capturing; call capture_end() (or reset()) first")
        if self._fn is not None:
            raise CaptureError("this TapeGraph already holds a capture; call reset() before capturing again")
        cap = TapeCapture(self, capture_error_mode)
        with ACTIVE_LOCK:
            if cap.thread in ACTIVE:
                raise CaptureError(
                    "another TapeGraph capture is active in this thread; tape captures cannot nest. End it "
                    "(capture_end) first."
                )
            other = next(iter(ACTIVE.values()), None)
            if other is not None and "global" in (capture_error_mode, other.mode):
                raise CaptureError(
                    f"concurrent capture in another thread: thread {other.thread_name!r} is capturing a "
                    f"TapeGraph (capture_error_mode={other.mode!r}), and a capture_error_mode='global' capture "
                    f"cannot overlap another one (this one asked for {capture_error_mode!r}). Capture one "
                    "after the other, or use capture_error_mode='thread_local' (or 'relaxed') for both."
                )
            ACTIVE[cap.thread] = cap
        try:
            self._pool = pool if pool is not None else (self._pool or TapePool())
            modes = (reseed_guard(), Guard(cap), Recorder(cap))
            self._cap = cap
            entered = []
            try:
                for m in modes:
                    m.__enter__()
                    entered.append(m)
            except BaseException:
                for m in reversed(entered):
                    m.__exit__(None, None, None)
                self._cap = None
                raise
            self._modes = modes
        except BaseException:
            with ACTIVE_LOCK:
                if ACTIVE.get(cap.thread) is cap:
                    del ACTIVE[cap.thread]
            raise

    def _stop(self, repoison: bool = True) -> TapeCapture:
        """Leave the modes, restore externals; return the capture state.
        ``repoison=False`` leaves other graphs' poisoned survivors that the
        capture read with their real values (the caller calls
        :meth:`_repoison` once it is done computing on them)."""
        cap, modes = self._cap, self._modes
        if cap is None:  # (its callers check first)
            raise CaptureError("this TapeGraph is not capturing")
        self._cap = self._modes = None
        with ACTIVE_LOCK:
            if ACTIVE.get(cap.thread) is cap:
                del ACTIVE[cap.thread]
        try:
            if modes is not None:
                for m in reversed(modes):
                    m.__exit__(None, None, None)
        except BaseException:
            repoison = True
            raise
        finally:
            cap.restore()
            reseeded = cap.restore_generators()
            if reseeded is not None and cap.failed is None:
                cap.failed = reseeded
            if repoison:
                self._repoison(cap)
        return cap

    @staticmethod
    def _repoison(cap: TapeCapture) -> None:
        for ent in cap.lifted:  # other graphs' survivors: garbage again until those graphs replay
            ent.poison()
        cap.lifted.clear()

    def capture_end(self) -> None:
        """Finish recording and generate the replay function.

        Writes made to externals during capture are undone here, and every
        generator the capture drew from gets back its state from before the
        capture (a capture consumes no random numbers).  If an op failed
        during capture, or a generator was re-seeded, the graph is left empty
        and CaptureError is raised (chaining the original error).  A capture
        that recorded no op warns with :data:`EMPTY_GRAPH_MESSAGE` (a
        ``UserWarning``, like CUDA's "The CUDA Graph is empty") and replays as
        a no-op."""
        self._end(warn_empty=True)

    def _end(self, warn_empty: bool) -> None:
        if self._cap is None:
            raise CaptureError("capture_end() called on a TapeGraph that is not capturing")
        # A stream forked from the capture stream must be joined back (cudaErrorStreamCaptureUnjoined).
        c = self._cap
        unjoined = unjoined_error(c.stream, c.stream_t0, c.stream_last) if c.failed is None else None
        # Other graphs' poisoned survivors read by the capture keep their real
        # values until the trace has run (it computes on them, as the capture did).
        cap = self._stop(repoison=False)
        try:
            if cap.failed is not None:
                self._clear()
                raise CaptureError(f"tape capture failed earlier: {cap.failed}") from cap.failed
            if unjoined is not None:
                self._clear()
                raise unjoined
            try:
                self._finalize(cap)
            except BaseException:
                self._clear()
                raise
        finally:
            self._repoison(cap)
        if not cap.ops and warn_empty:
            warnings.warn(EMPTY_GRAPH_MESSAGE, UserWarning, stacklevel=3)
        targets, self._surv_storages = self._surv_storages, []
        if self.poison_captured_values:
            self._poison(targets)

    def _poison(self, targets: list) -> None:
        poison_survivors(self, targets)

    def _unpoison(self) -> None:
        unpoison(self)

    def _abort(self) -> None:
        if self._cap is not None:
            self._stop()
        self._clear()

    def _clear(self) -> None:
        self._fn = None
        self._jit = None
        self._num_ops = 0
        self._num_collectives = 0
        self._statics = []
        self._versioned = []
        self._surv_storages = []
        forget_poisoned(self)
        self.source = None
        self.rewrite_proofs = (0, 0, 0.0)

    def reset(self) -> None:
        """Drop the recording (aborting a capture in progress, undoing its writes
        to externals); the graph can capture again."""
        self._abort()

    def pool(self) -> TapePool:
        """Return this graph's pool handle: pass it as ``pool=`` to capture
        another graph into the same memory (see :class:`TapePool`)."""
        if self._pool is None:
            self._pool = TapePool()
        return self._pool

    @property
    def num_ops(self) -> int:
        """Number of aten ops recorded by the last capture (0 when empty)."""
        return self._num_ops

    @property
    def num_collectives(self) -> int:
        """Number of collectives among the ops recorded by the last capture (c10d and functional ones, their
        ``wait_tensor`` included; 0 when empty): what the ranks of a tensor-parallel step must record alike,
        whatever their op counts (uneven shards)."""
        return self._num_collectives

    # -- replay ---------------------------------------------------------------
    def replay(self) -> None:
        """Re-run the captured ops with autograd off (under inference_mode when
        the capture was).  Raises CaptureError on an empty or capturing graph."""
        fn = self._fn
        if fn is None:
            if self._cap is not None:
                raise CaptureError("cannot replay a TapeGraph while it is capturing; call capture_end() first")
            raise CaptureError("cannot replay an empty TapeGraph: capture something first")
        # set whenever _fn is (capture_begin sets it, nothing unsets it): no check per replay
        pool: TapePool = self._pool  # type: ignore[assignment]
        lock = pool._replay_lock
        if not lock.acquire(False):
            self._concurrent(pool)
        pool._replaying = self._self_ref
        try:
            if self._versioned or self._poisoned:
                self._run(fn)
            elif self._inference:  # the common case, what _run does in one frame (its checks do nothing here)
                with NO_TORCH_FUNCTION():
                    guard = _InferenceMode(True)
                    try:
                        fn()
                    finally:
                        del guard
            else:
                with NO_TORCH_FUNCTION():
                    prev = _is_grad_enabled()
                    _set_grad_enabled(False)
                    try:
                        fn()
                    finally:
                        _set_grad_enabled(prev)
        finally:
            pool._replaying = None
            lock.release()

    def _concurrent(self, pool) -> None:
        """The pool's replay lock is taken: by the capture end of another of
        its graphs tracing its replay (wait: it is short and leaves nothing
        behind), else by a replay in another thread (raise)."""
        w = pool._replaying
        if w is TRACING:
            pool._replay_lock.acquire()
            return
        other = w() if w is not None else None
        raise CaptureError(
            f"concurrent replay in one memory pool: {self!r} was replayed while {other!r} is replaying in "
            "another thread. Graphs captured into one pool reuse each other's memory, so on CUDA concurrent "
            "replays corrupt each other. Replay them one after the other, or capture them into separate "
            "pools (a graph_pool_handle() each, or pool=None)."
        )

    def _run(self, fn) -> None:
        if self._versioned:
            self._check_versions()
        if self._poisoned:
            self._unpoison()
        # The generated code calls public bindings (torch.mul, Tensor.view, ...):
        # with torch-function handling disabled they go straight to the
        # dispatcher, as the recorded aten ops did (no mode or tensor-subclass
        # __torch_function__ can intercept them).
        with NO_TORCH_FUNCTION():
            if self._inference:
                guard = torch._C._InferenceMode(True)
                try:
                    fn()
                finally:
                    del guard
            else:
                prev = torch.is_grad_enabled()
                torch._C._set_grad_enabled(False)
                try:
                    fn()
                finally:
                    torch._C._set_grad_enabled(prev)
        if self._versioned:  # (one call of each ref: a tensor freed between two would raise)
            self._versioned = [(w, (t._version if (t := w()) is not None else v)) for w, v in self._versioned]

    def _check_versions(self) -> None:
        for w, v in self._versioned:
            t = w()
            if t is not None and t._version != v:
                warnings.warn(
                    "a tensor created inside this TapeGraph's capture (a survivor, refreshed in place at "
                    "each replay) was written by code outside the graph since the last replay; the replay "
                    "overwrites it. Allocate persistent buffers before capture.",
                    EscapedTensorWarning,
                    stacklevel=4,
                )
                break

    # -- capture end: survivors, hoisting, code generation ---------------------
    def _finalize(self, cap: TapeCapture) -> None:
        const_storages, consts = hoist(cap)
        survivors, versioned, targets = find_survivors(cap, self, const_storages)
        warn_stashed(cap, const_storages)
        # Other graphs' memory read here is held through an alias, not the
        # user's object (a CUDA graph holds addresses, not tensors).
        for n, t in consts.items():
            if type(t) is torch.Tensor and not t.requires_grad and t.layout == torch.strided:
                st = t.untyped_storage()
                ent = SURVIVORS.get(id(st))
                if ent is not None and ent[0]() is st:
                    consts[n] = alias_of(t)
        pool = self._pool
        if pool is None:  # (capture_begin set it)
            raise CaptureError("internal error: a TapeGraph capture ended without a pool")
        spills, self._surv_storages, self._pool_bytes = place(pool, self, cap, survivors, targets)
        self._pool_index = pool._captures
        cap.user_tensors = {}
        # moving a survivor onto reused pool memory (set_) bumps its version
        versioned = [(w, t._version) for w, _ in versioned if (t := w()) is not None]
        prog, n_ops = generate(cap, consts, survivors, spills, scratch=pool.scratch)
        self._fn = prog.fn
        self._jit = None
        if self.jit_replay and prog.lines:  # (an empty replay has nothing to trace)
            why = eligible(prog.env, any(op.collective for op in cap.ops))
            if why is None and n_ops < jit.JIT_MIN_OPS:
                why = f"it replays {n_ops} ops (< JIT_MIN_OPS = {jit.JIT_MIN_OPS}: the Python replay is faster)"
            if why is None:
                # (an nn.Parameter too: a trace at capture end must give back what it writes)
                written = [
                    t
                    for n, t in consts.items()
                    if cap.kind.get(n) == "ext" and isinstance(t, torch.Tensor) and cap.skey.get(n) in cap.written
                ]
                self._jit = self._fn = JitReplay(prog.fn, prog.lines, prog.env, written)
            else:
                logger.debug("tape replay in Python: %s", why)
        self.source = prog.source
        self._env = prog.env
        self._labels = prog.labels
        self._num_ops = len(cap.ops)
        self._num_collectives = sum(1 for op in cap.ops if op.collective)
        self._num_replayed = n_ops
        self.rewrite_proofs = tuple(a - b for a, b in zip(proof_stats.snapshot(), cap.proofs_before))
        self._inference = cap.inference
        self._statics = list(survivors.values())
        self._versioned = versioned
        if self._jit is not None and not cap.redirected_draws and not jit.traced_at_first_replay():
            # (a capture whose draws went to stand-ins: the trace would draw from the engine's own
            # generators, which replays draw from; it is traced at the first replay, which it is;
            # so is one inside jit.traces_at_first_replay(), whose caller replays it right away)
            self._prepare_jit(list(survivors.values()) + list(spills.values()), cap.drawn_from)
        logger.debug(
            "tape capture: %d ops recorded, %d replayed, %d survivors, %d externals; %d rewrites proven "
            "(%d dropped) in %.1f ms",
            len(cap.ops),
            n_ops,
            len(survivors),
            sum(1 for k in cap.kind.values() if k == "ext"),
            self.rewrite_proofs[0] - self.rewrite_proofs[1],
            self.rewrite_proofs[1],
            self.rewrite_proofs[2] * 1e3,
        )

    def _prepare_jit(self, keep: list, generators: list) -> None:
        """Trace the replay now, at capture end (:meth:`JitReplay.prepare
        <graphrunner.tape.jit.JitReplay.prepare>`): under the replay's grad /
        inference mode with torch-function handling off, as :meth:`_run`
        runs it, holding the pool's replay lock (the trace writes pool memory
        and then puts it back, which a replay of another graph of the pool in
        another thread must not see: such a replay waits), and with the
        dispatch modes active here disabled.  Those modes (a check's op recorder around the capture, a
        user's mode) watch the user's step; the trace is the tape's own work,
        which leaves nothing behind, as a CUDA ``capture_end`` launches
        nothing a mode could see: a recorder must not count its ops as the
        step's (deferring to the first replay instead would bring back the
        first-replay spike for every graph captured under a check).  A replay
        under a mode still runs the Python replay, so that the mode sees its
        ops.  When the pool is replaying in another thread the trace is left
        to the first replay (``replay_engine == "jit-pending"``)."""
        pool, jit_ = self._pool, self._jit
        if pool is None or jit_ is None:  # (_finalize calls it with both set)
            raise CaptureError("internal error: tracing the replay of a TapeGraph with no pool or no trace")
        if not pool._replay_lock.acquire(False):
            logger.debug("tape replay traced at the first replay: the pool is replaying at capture end")
            return
        # Left set after the release: a replay that finds the lock taken before
        # the next holder sets its own mark waits rather than raising.
        pool._replaying = TRACING
        try:
            with (
                _disable_current_modes(),
                NO_TORCH_FUNCTION(),
                torch.inference_mode() if self._inference else torch.no_grad(),
            ):
                jit_.prepare(keep, generators)
        finally:
            pool._replay_lock.release()
        if jit_.engine == "python":
            logger.debug("tape replay in Python: %s", jit_.why_python)
        if self._versioned:  # the trace wrote the survivors (their bytes are back)
            self._versioned = [(w, (t._version if (t := w()) is not None else v)) for w, v in self._versioned]

    @property
    def replay_engine(self) -> str | None:
        """What replays this graph: ``"jit"`` (a TorchScript trace of the
        generated code, made at capture end), ``"jit-pending"`` (to be traced
        at the first replay: the graph's pool was replaying in another thread
        at capture end), ``"python"`` (the generated code itself), None before
        a capture."""
        if self._fn is None:
            return None
        return self._jit.engine if self._jit is not None else "python"

    @property
    def pool_bytes(self) -> int:
        """Bytes this graph's capture added to its pool's arena (0 before a
        capture): the estimate of the graph memory it needs on CUDA beyond
        what earlier captures into the same pool left free.  The pool's
        total is ``graph.pool().bytes_held``."""
        return self._pool_bytes if self._fn is not None else 0

    def __repr__(self) -> str:
        if self._fn is None:
            return f"<TapeGraph at {id(self):#x}: empty>"
        return (
            f"<TapeGraph at {id(self):#x}: capture #{self._pool_index} of pool {id(self._pool):#x}, "
            f"{self._num_ops} ops>"
        )

    @property
    def num_replayed_ops(self) -> int:
        """Ops the generated replay function runs (after hoisting and dead-code elimination)."""
        return getattr(self, "_num_replayed", 0) if self._fn is not None else 0


def tape_graph(
    graph: TapeGraph, pool: TapePool | None = None, stream: Any = None, capture_error_mode: str = "global"
) -> contextlib.AbstractContextManager[TapeGraph]:
    """Capture the body into ``graph`` (mirrors ``torch.cuda.graph``).

    ``stream`` is accepted for API parity and ignored.  If the body raises, the
    capture is aborted (no mode stays active, writes to externals and
    generator states are restored, the graph is left empty) and the exception
    propagates unchanged; the next capture works normally.  An empty body
    warns as :meth:`TapeGraph.capture_end` does.
    """
    return capturing_into(graph, pool, capture_error_mode, warn_empty=True)


@contextlib.contextmanager
def capturing_into(
    graph: TapeGraph, pool: TapePool | None, capture_error_mode: str, warn_empty: bool
) -> Iterator[TapeGraph]:
    """:func:`tape_graph`; ``warn_empty=False`` for callers that drop empty
    captures themselves (a device capturing breakable-graph segments)."""
    if not isinstance(graph, TapeGraph):
        raise TypeError(f"tape_graph() needs a TapeGraph, got {type(graph).__name__}")
    graph.capture_begin(pool=pool, capture_error_mode=capture_error_mode)
    try:
        yield graph
    except BaseException:
        graph._abort()
        raise
    graph._end(warn_empty=warn_empty)
