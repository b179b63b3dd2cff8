"""The tape's graph pools: graph memory handed out as CUDA's caching allocator would.

Owns :class:`TapePool` (what ``graph_pool_handle()`` returns and
``pool=`` takes) and the bookkeeping behind it.  Every capture into a pool
allocates its internal tensors (intermediates and survivors) from the pool's
blocks, in recording order, as a CUDA private pool would:

* a block is sized like a CUDA allocation (rounded up to 512 bytes) and is
  *in use* while any tensor outside the tape refers to its memory (the
  tape's own references -- a graph's static outputs, another graph's view of
  them, an eager break's argument -- do not count, as a CUDA graph holds
  addresses, not tensors); a capture's temporaries are free again after
  their last use in that capture;
* a later capture into the same pool takes the best-fitting free block
  (smallest first, then oldest).  When that block is memory another graph
  still writes or reads at replay (an output of an earlier graph that the
  user dropped), the new tensor really shares it: a survivor is moved onto
  that memory (same object, same values), and a temporary's value is also
  written there at each replay.  Graphs sharing a pool and replayed out of
  capture order therefore corrupt each other exactly where a CUDA graph
  would (PyTorch's ``test_graph_three_successive``);
* two graphs of one pool replaying at the same time (in two threads) raise
  :class:`~graphrunner.errors.CaptureError` naming both, where CUDA would
  corrupt nondeterministically (``test_graph_concurrent_replay``).

:attr:`TapePool.bytes_held` and :attr:`TapeGraph.pool_bytes
<graphrunner.tape.TapeGraph.pool_bytes>` estimate the graph pool memory a
CUDA capture would need (block bytes, before CUDA's 2 MiB / 20 MiB segment
granularity; a capture's temporaries are counted as freed at their last use).
"""

from __future__ import annotations

import bisect
import itertools
import threading
import weakref

import torch

from .state import OURS, ours
from .survivors import SURVIVORS

_ROUND = 512  # CUDA caching allocator: every block is a multiple of 512 bytes
_SEQ = itertools.count()
_USE_COUNT = torch._C._storage_Use_Count


def _rounded(nbytes: int) -> int:
    return max(_ROUND, -(-nbytes // _ROUND) * _ROUND)


def user_refs(st) -> int:
    """Tensors outside the tape that refer to storage ``st``."""
    s = OURS.get(id(st))
    # only tensors really on ``st`` (an id can outlive its storage and be reused)
    mine = sum(1 for t in s if t.untyped_storage() is st) if s is not None else 0
    # one count is the storage's Python object (the one we hold to ask)
    return _USE_COUNT(st._cdata) - 1 - mine


class _Block:
    __slots__ = ("size", "seq", "storage", "shared", "pinned")

    def __init__(self, size: int, storage=None):
        self.size = size
        self.seq = next(_SEQ)
        self.storage = weakref.ref(storage) if storage is not None else None  # the memory, while it exists
        self.shared = False  # some graph reads or writes this memory at replay
        self.pinned = False  # a constant the tape computed once: never reused while it exists

    def live_storage(self):
        return self.storage() if self.storage is not None else None


#: ``TapePool._replaying`` while a graph's ``capture_end`` holds the pool's
#: replay lock to trace its replay (:mod:`graphrunner.tape.jit`): that takes
#: milliseconds and leaves the memory as it found it, so a replay of another
#: graph of the pool waits for it instead of raising.
TRACING = object()


class TapePool:
    """Memory-pool handle (mirrors ``torch.cuda.graph_pool_handle()``).

    Graphs captured with the same pool share its arena: memory freed after
    one capture (a temporary, an output the user dropped) is reused by the
    next capture into the pool, and replaying such graphs out of capture
    order corrupts as on CUDA (see :mod:`graphrunner.tape.pool`).
    ``bytes_held`` is the pool's estimated size in bytes.

    The temporaries the generated replay writes into planned buffers
    (:func:`graphrunner.tape.codegen.plan_buffers`) are views of the pool's
    scratch storages (:meth:`scratch`): the ``j``-th buffer of every graph of
    the pool is the same memory, as a CUDA capture reuses the blocks an earlier
    capture into the pool freed. Safe because a graph's temporaries are dead
    when its replay ends and two graphs of a pool never replay at once; the
    host memory of many graphs is then their largest graph's temporaries, not
    their sum. ``scratch_bytes``: the bytes of the current scratch storages."""

    __slots__ = (
        "__weakref__",
        "_lock",
        "_replay_lock",
        "_replaying",
        "_free",
        "_used",
        "bytes_held",
        "_captures",
        "_scratch",
    )

    def __init__(self) -> None:
        self._lock = threading.Lock()  # arena bookkeeping (captures in several threads)
        self._replay_lock = threading.Lock()  # one replay at a time among the pool's graphs
        self._replaying: object = None  # weakref to the graph replaying now, or TRACING
        self._free: list[tuple] = []  # sorted (size, seq, block)
        self._used: list[_Block] = []  # blocks holding survivors
        #: Estimated bytes of graph memory this pool holds (sum of its blocks).
        self.bytes_held = 0
        self._captures = 0
        self._scratch: dict = {}  # (device, j) -> untyped storage of the graphs' j-th temporary buffer
        _POOLS.add(self)

    def __repr__(self) -> str:
        return f"<TapePool at {id(self):#x}: {self._captures} captures, {self.bytes_held} bytes>"

    def scratch(self, j: int, nbytes: int, device) -> torch.UntypedStorage:
        """The storage of the ``j``-th planned temporary buffer of this pool's graphs on ``device``, at least
        ``nbytes`` long. A larger request replaces it with a larger storage (graphs already viewing the
        smaller one keep it alive; captures run largest key first, so this is rare)."""
        key = (torch.device(device), j)
        with self._lock:
            st = self._scratch.get(key)
            if st is None or st.nbytes() < nbytes:
                st = self._scratch[key] = torch.empty(
                    max(nbytes, 1), dtype=torch.uint8, device=device
                ).untyped_storage()
            return st

    @property
    def scratch_bytes(self) -> int:
        """Bytes of the scratch storages the pool's graphs' planned temporaries view now."""
        return sum(st.nbytes() for st in list(self._scratch.values()))

    # -- blocks ------------------------------------------------------------
    def _release(self, b: _Block) -> None:
        bisect.insort(self._free, (b.size, b.seq, b))

    def _collect(self) -> None:
        """Blocks whose memory no tensor outside the tape refers to are free."""
        keep = []
        for b in self._used:
            st = b.live_storage()
            if st is None or (not b.pinned and user_refs(st) <= 0):
                b.shared = st is not None
                self._release(b)
            else:
                keep.append(b)
        self._used = keep

    def _take(self, size: int) -> _Block:
        i = bisect.bisect_left(self._free, (size, -1))
        if i < len(self._free):
            return self._free.pop(i)[2]
        self.bytes_held += size
        return _Block(size)


_POOLS: weakref.WeakSet[TapePool] = weakref.WeakSet()  # every live pool (what memory_reserved() counts)


def pools_bytes() -> int:
    """Estimated bytes held by every live :class:`TapePool` of the process, as
    ``torch.cuda.memory_reserved`` counts every pool of the caching allocator (a runner with
    ``memory_budget=`` or ``with_own_pool()`` has a pool of its own)."""
    return sum(int(p.bytes_held) for p in list(_POOLS))


def graph_pool_handle() -> TapePool:
    """Return a new :class:`TapePool`, to pass as ``pool=`` to several captures
    (mirrors ``torch.cuda.graph_pool_handle``)."""
    return TapePool()


def place(pool: TapePool, graph, cap, survivors: dict, targets: list) -> tuple[dict, list, int]:
    """Allocate ``cap``'s internal storages from ``pool`` in recording order.

    A survivor that lands on memory another graph uses at replay is moved
    onto it (``set_`` of every tensor on its storage, values copied); a
    temporary there gets a view of it in the returned ``spills`` (allocating
    name -> tensor: the replay writes the value there too).  Returns
    ``(spills, targets, bytes_added)``, ``targets`` with moved storages
    replaced."""

    spills: dict = {}
    alive = {id(st): st for st, _, _ in targets}
    once = {id(st) for st, _, o in targets if o}
    last: dict[int, int] = {}
    for i, op in enumerate(cap.ops):
        for k in op.in_skeys:
            last[k] = i
        for k in op.out_skeys:
            last[k] = i
    with pool._lock:
        before = pool.bytes_held
        pool._collect()
        # Free memory that this capture still reads (an earlier graph's output
        # it takes as input) is reusable only after that read, as CUDA frees
        # a tensor when the capture drops it, not before.
        deferred: dict[int, list] = {}
        keep = []
        for ent in pool._free:
            st = ent[2].live_storage()
            j = last.get(id(st), -1) if st is not None else -1
            if j >= 0:
                deferred.setdefault(j, []).append(ent[2])
            else:
                keep.append(ent)
        pool._free = keep
        live: dict[int, _Block] = {}
        moved: dict[int, object] = {}
        for i, op in enumerate(cap.ops):
            for n in op.new:
                k = cap.skey.get(n)
                if k is None or cap.internal_storages.get(k) != n or k in live:
                    continue
                nbytes = cap.alloc_bytes[n]
                b = pool._take(_rounded(nbytes))
                live[k] = b
                old = b.live_storage() if b.shared else None
                if old is not None and old.nbytes() < nbytes:
                    old = None
                st = alive.get(k)
                if st is None:  # a temporary
                    if old is not None:
                        dtype, device, size, stride, off = cap.alloc_meta[n]
                        with torch.inference_mode(cap.inference):
                            spills[n] = ours(torch.empty(0, dtype=dtype, device=device).set_(old, off, size, stride))
                    continue
                b.pinned = k in once
                if old is not None and not b.pinned and _move(cap, survivors, k, st, old):
                    moved[k] = old
                    st = old
                    SURVIVORS[id(old)] = (weakref.ref(old), weakref.ref(graph))
                b.storage = weakref.ref(st)
            for k in set(op.in_skeys) | set(op.out_skeys):
                held = live.get(k)
                if held is not None and last.get(k) == i and k not in alive:
                    pool._release(held)  # a temporary after its last use
                    del live[k]
            for b in deferred.pop(i, ()):
                pool._release(b)
        for bs in deferred.values():
            for b in bs:
                pool._release(b)
        for k, b in live.items():
            if k in alive:
                b.shared = True
                pool._used.append(b)
            else:
                pool._release(b)
        pool._captures += 1
        added = pool.bytes_held - before
    if moved:
        targets = [(moved.get(id(st), st), dtype, once) for st, dtype, once in targets]
    return spills, targets, added


def _move(cap, survivors: dict, k: int, st, old) -> bool:
    """Put every tensor on survivor storage ``st`` onto storage ``old``
    instead (values copied); False, changing nothing, if some holder of
    ``st`` is unknown (then the two would part)."""
    holders = [t for n, t in cap.user_tensors.items() if cap.skey.get(n) == k]
    holders += [t for t in survivors.values() if t.untyped_storage() is st]
    holders = list({id(t): t for t in holders}.values())
    if _USE_COUNT(st._cdata) - 1 != len(holders):
        return False
    with torch.inference_mode():
        n = st.nbytes()
        dst = torch.empty(0, dtype=torch.uint8, device=old.device).set_(old, 0, (n,), (1,))
        dst.copy_(torch.empty(0, dtype=torch.uint8, device=st.device).set_(st, 0, (n,), (1,)))
        del dst
    for t in holders:
        with torch.inference_mode(t.is_inference()), torch.no_grad():
            t.set_(old, t.storage_offset(), t.size(), t.stride())
    _reregister(st, holders)
    return True


def _reregister(st, moved: list) -> None:
    """The tape's own tensors among ``moved`` (now on another storage) are
    registered under that storage, no longer under ``st``'s id (which a later
    storage may get: its user would then look absent)."""
    was = OURS.get(id(st))
    if not was:
        return
    mine = {id(t) for t in was}
    OURS[id(st)] = weakref.WeakSet([t for t in was if not any(t is m for m in moved)])
    for t in moved:
        if id(t) in mine:
            ours(t)
