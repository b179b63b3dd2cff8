"""Recording: what happens while a tape capture is in progress.

Owns :class:`TapeCapture`, the mutable state of one capture (names of the
tensors seen, externals vs internals, storages, snapshots of externals the
capture writes -- undone at capture end, since a CUDA capture launches
nothing --, saved generator states, the recorded :class:`RecordedOp` list), and
:class:`Recorder`, the ``TorchDispatchMode`` that checks each aten op
against the unsafe-op catalogue, runs it once and records it with argument
templates (:class:`Ref` placeholders for tensors).  What the recording is
turned into at capture end is :mod:`graphrunner.tape.codegen`'s job.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from graphrunner._aten import written_tensors
from graphrunner.errors import CaptureError

from .bindings import Verifier
from .collapse import COLLAPSIBLE, COLLAPSIBLE_FUNCTIONAL
from .proof import eager_tls
from .proof import stats as proof_stats
from .rng import drawn_generator, op_generator, redirected, stand_in_op
from .state import release_snapshot, snapshot_copy, storage_bytes, storage_of
from .streams import CLOCKS, current_stream
from .survivors import POISONED, SURVIVORS, EscapedTensorWarning, Poisoned
from .unsafe import check_safe, user_frame


class Ref:
    """Placeholder for a tensor inside a recorded argument template."""

    __slots__ = ("name",)

    def __init__(self, name: str):
        self.name = name

    def __repr__(self) -> str:
        return self.name


class RecordedOp:
    """One recorded aten op: callable, argument templates, output names."""

    __slots__ = (
        "func",
        "args",
        "kwargs",
        "outs",
        "new",
        "in_names",
        "writes",
        "pure",
        "collective",
        "seeded",
        "out_skeys",
        "in_skeys",
        "fast",
        "call",
        "cargs",
        "in_vers",
        "alias",
        "view",
        "out_ok",
        "seen",
        "stream",
    )

    # set by Recorder when it records the op (__init__ leaves them unset)
    func: torch._ops.OpOverload
    args: tuple  # argument templates (Ref for tensors)
    kwargs: dict[str, Any]
    outs: Any  # output template: a Ref, a list/tuple of them, or None
    new: list[str]  # names of the tensors this op created
    in_names: list[str]
    in_vers: tuple[int, ...]  # writes so far to each input's storage (for CSE)
    writes: list[str]
    collective: bool
    seeded: bool
    pure: bool
    in_skeys: set[int | None]  # storage keys (None: a tensor without storage)
    out_skeys: list[int | None]
    # set in __init__, changed by the recorder or codegen
    fast: str | None
    call: Callable[..., Any] | None
    cargs: tuple[Any, dict[str, Any]] | None
    alias: tuple[str, str] | None
    view: tuple[str, tuple[int, ...], tuple[int, ...], int | torch.SymInt] | None  # storage_offset()'s type
    out_ok: bool
    seen: dict[str, torch.Tensor] | None
    stream: int

    def __init__(self) -> None:
        # fast: None (replayed), "hoisted" (computed once at capture), "alias"
        # (a view with its input's exact metadata: replaced by its input) or
        # "cse" (recomputes an earlier op's value: replaced by that value).
        self.fast = None
        # call/cargs: a verified public binding (torch.mul, Tensor.view, ...) and
        # its argument templates, used at replay instead of func._op (None: aten).
        self.call = None
        self.cargs = None
        self.alias = None  # for "alias": (output name, input name)
        self.view = None  # a view of an internal storage: (base name, size, stride, offset)
        self.out_ok = False  # ``call`` verified to write its result into a preplanned buffer (out=)
        # for a call a rewrite may replace at capture end (a composite collapsed to its kernel):
        # {input name: the value that temporary held here}, for the rewrite's proof
        self.seen = None
        self.stream = 0  # id of the stream the op was issued on (graphrunner.tape.streams)


class TapeCapture:
    """Mutable state of one capture in progress (dropped at capture end)."""

    def __init__(self, graph: object, mode: str = "global"):
        # the TapeGraph capturing (graph.py, above this module, makes captures): only told apart by identity
        self.graph = graph
        self.mode = mode  # capture_error_mode
        self.thread = threading.get_ident()  # the capturing thread
        self.thread_name = threading.current_thread().name
        self.names: dict[int, str] = {}  # id(tensor) -> name
        self.strong: dict[str, torch.Tensor] = {}  # name -> tensor (keeps ids unique during capture)
        self.kind: dict[str, str] = {}  # name -> "ext" | "int"
        self.skey: dict[str, int | None] = {}  # name -> storage key (None: a tensor without storage)
        self.storages: dict[int, Any] = {}  # storage key -> storage (strong, during capture)
        self.internal_storages: dict[int, str] = {}  # storage key -> name of the allocating tensor
        self.alloc_meta: dict[str, tuple] = {}  # allocating name -> (dtype, device, size, stride, offset)
        self.alloc_bytes: dict[str, int] = {}  # allocating name -> bytes of its storage
        self.user_tensors: dict[str, torch.Tensor] = {}  # at capture end: internal tensors the user still holds
        self.written: set[int] = set()  # storage keys written by recorded ops
        self.ext_storages: set[int] = set()  # storage keys of externals
        self.snapshots: dict[int, tuple] = {}  # external storage key -> (storage, byte copy)
        self.ops: list[RecordedOp] = []
        self.n = 0
        self.failed: BaseException | None = None
        self.inference = torch.is_inference_mode_enabled()
        self.tls = eager_tls()  # dispatch-key state eager runs in (for rewrites' proofs)
        self.proofs_before = proof_stats.snapshot()  # this thread's proof counters at capture begin
        self.warned: set[int] = set()
        self.wcount: dict[int | None, int] = {}  # storage key -> writes so far (for CSE)
        self.scalars: dict[tuple, torch.Tensor] = {}  # Python scalar -> shared 0-dim tensor
        self.meta_mutated = False  # an inplace_view op (t_, unsqueeze_, ...) ran
        self.lifted: list[Poisoned] = []  # other graphs' poisoned survivors lifted for this capture
        self.generators: dict[int, tuple] = {}  # id(generator) -> (generator, state, initial seed) at first use
        self.drawn_from: list = []  # at capture end: the generators tracked (restored)
        #: Seeded ops that drew from a stand-in (a :func:`~graphrunner.tape.rng.redirect` was active).
        self.redirected_draws = 0
        if redirected() is None:  # redirected: the capture draws from stand-ins only, tracked at first use
            self.track_generator(torch.default_generator)
        # streams: the capture stream, its time at capture begin and every stream's last op then
        # (a stream forked from it during the capture must be joined back by capture end)
        self.stream = current_stream()
        self.stream_t0 = CLOCKS.now(self.stream.id)
        self.stream_last = dict(CLOCKS.last_op)

    def scalar_tensor(self, v, dtype=None) -> torch.Tensor:
        """One shared 0-dim tensor per Python scalar and dtype (default float64 /
        int64, the dtype of the wrapped number a binding makes).  Only ever read."""
        if dtype is None:
            dtype = torch.float64 if isinstance(v, float) else torch.int64
        key = (type(v), repr(v), dtype)  # repr tells -0.0 from 0.0
        t = self.scalars.get(key)
        if t is None:
            with torch.inference_mode(False):
                t = torch.tensor(v, dtype=dtype)
            self.scalars[key] = t
        return t

    # -- naming -----------------------------------------------------------
    def _skey(self, t):
        st = storage_of(t)
        if st is None:
            return None
        k = id(st)
        self.storages.setdefault(k, st)
        return k

    def name_in(self, t: torch.Tensor) -> str:
        n = self.names.get(id(t))
        if n is not None:
            return n
        k = self._skey(t)
        if k is not None and k in self.internal_storages:
            raise CaptureError(
                "a tensor aliasing memory created inside the capture appeared without being produced by a "
                f"recorded op (at {user_frame()}); create views with tensor ops, not with storage APIs"
            )
        n = f"e{self.n}"
        self.n += 1
        self.names[id(t)] = n
        self.strong[n] = t
        self.kind[n] = "ext"
        self.skey[n] = k
        if k is not None:
            if POISONED and k not in self.ext_storages:
                self.lift_poison(k)
            self.ext_storages.add(k)
        return n

    def lift_poison(self, k: int) -> None:
        """An external storage poisoned by another graph's capture end: give it
        its real values until this capture ends (then it is poisoned again).
        A CUDA capture never computes on it; the tape does, and poison could
        make an op raise (an out-of-range index) where the GPU would not."""
        w = POISONED.get(k)
        g = w() if w is not None else None
        if g is None:
            POISONED.pop(k, None)
            return
        ent = g._poisoned.get(k)
        if ent is None or storage_of(ent.raw) is not self.storages.get(k):
            return
        ent.lift()
        self.lifted.append(ent)

    def name_out(self, t: torch.Tensor) -> tuple[str, bool]:
        n = self.names.get(id(t))
        if n is not None:
            return n, False
        n = f"v{self.n}"
        self.n += 1
        self.names[id(t)] = n
        self.strong[n] = t
        self.kind[n] = "int"
        k = self._skey(t)
        self.skey[n] = k
        if k is not None and k not in self.internal_storages and k not in self.ext_storages:
            self.internal_storages[k] = n
            self.alloc_meta[n] = (t.dtype, t.device, tuple(t.shape), tuple(t.stride()), t.storage_offset())
            self.alloc_bytes[n] = self.storages[k].nbytes()
        return n, True

    def owns_storage(self, n: str) -> bool:
        """Whether internal tensor ``n`` allocated its storage (the first recorded tensor on it) at offset
        0 and spans all of it: the only results a preplanned ``out=`` buffer may stand in for
        (:func:`graphrunner.tape.codegen.plan_buffers`), so the only ones whose binding is checked
        with ``out=`` (:meth:`graphrunner.tape.bindings.Verifier.pick`)."""
        k = self.skey.get(n)
        meta = self.alloc_meta.get(n)
        return (
            k is not None
            and self.internal_storages.get(k) == n
            and meta is not None
            and meta[4] == 0
            and self.alloc_bytes[n] == extent(meta)
        )

    # -- templates --------------------------------------------------------
    def template_in(self, v, names: list):
        if isinstance(v, torch.Tensor):
            n = self.name_in(v)
            names.append(n)
            return Ref(n)
        if isinstance(v, (list, tuple)):
            return type(v)(self.template_in(x, names) for x in v)
        return v

    def template_out(self, v, new: list, allnames: list):
        if isinstance(v, torch.Tensor):
            n, is_new = self.name_out(v)
            allnames.append(n)
            if is_new:
                new.append(n)
            return Ref(n)
        if isinstance(v, (list, tuple)):
            return type(v)(self.template_out(x, new, allnames) for x in v)
        return None

    # -- writes to externals ----------------------------------------------
    def note_write(self, t: torch.Tensor, func) -> None:
        k = self._skey(t)
        if k is None:
            return
        self.written.add(k)
        if k in self.internal_storages or k in self.snapshots:
            return
        st = self.storages[k]
        # Snapshot the whole storage on first write: a CUDA capture launches
        # nothing, so the external must look untouched after capture_end.
        with torch.inference_mode():
            b = storage_bytes(st)
            self.snapshots[k] = (st, snapshot_copy(b))
        ent = SURVIVORS.get(k)
        if ent is not None and ent[0]() is st:
            g = ent[1]()
            if g is not None and g is not self.graph and k not in self.warned:
                self.warned.add(k)
                warnings.warn(
                    f"op {func} in this tape capture writes a tensor that was created inside another graph's "
                    f"capture and survived it (at {user_frame()}). That graph refreshes the tensor at each of "
                    "its replays, overwriting what is written here; allocate persistent buffers (caches, "
                    "counters) before capture.",
                    EscapedTensorWarning,
                    stacklevel=2,
                )

    # -- generators ---------------------------------------------------------
    def track_generator(self, g: torch.Generator | None) -> None:
        """Save ``g``'s state before the capture first draws from it."""
        if g is not None and id(g) not in self.generators:
            self.generators[id(g)] = (g, g.get_state(), g.initial_seed())

    def restore_generators(self) -> CaptureError | None:
        """Put every tracked generator back in its state before the capture
        (the capture consumed nothing); return an error for one re-seeded
        during the capture (``Generator.manual_seed`` called directly)."""
        err = None
        for g, state, seed in self.generators.values():
            if err is None and g.initial_seed() != seed:
                err = CaptureError(
                    f"a torch.Generator (on {g.device}) was re-seeded during a tape capture (its initial_seed "
                    f"changed from {seed} to {g.initial_seed()}): a device graph cannot re-seed a generator "
                    "(CUDA raises on manual_seed during capture), and the tape restores every generator's "
                    "state at capture end. Seed before capture_begin() (or between replays)."
                )
            owned = redirected()
            if owned is None or owned.owns(g):  # never set a generator owned elsewhere (another thread draws from it)
                g.set_state(state)
        owned = redirected()
        self.drawn_from = [g for g, _, _ in self.generators.values() if owned is None or owned.owns(g)]
        self.generators.clear()
        return err

    def restore(self) -> None:
        with torch.inference_mode():
            for st, snap in self.snapshots.values():
                storage_bytes(st).copy_(snap)
                release_snapshot(snap)
        self.snapshots.clear()


def extent(meta) -> int:
    """Bytes spanned by a tensor of metadata ``(dtype, device, size, stride, offset)``."""
    dtype, _, size, stride, off = meta
    if any(s == 0 for s in size):
        return 0
    return (off + 1 + sum((s - 1) * st for s, st in zip(size, stride))) * dtype.itemsize


# Temporaries read by a call a rewrite may replace are kept (copied) up to this
# size each, for the rewrite's proof on the capture's data; larger ones are
# stood in for by random data there (graphrunner.tape.proof).
_KEEP_SEEN_BYTES = 1 << 20


def _kept_values(cap: TapeCapture, templates, values) -> dict:
    """{name: copy} of the temporaries (recorded outputs) among ``values``, as they are now."""
    kept = {}
    for a, v in zip(templates, values):
        if (
            isinstance(a, Ref)
            and cap.kind.get(a.name) == "int"
            and type(v) is torch.Tensor
            and v.layout == torch.strided
            and v.numel() * v.element_size() <= _KEEP_SEEN_BYTES
        ):
            with (
                _disable_current_modes(),
                torch._C.DisableTorchFunction(),
                torch.inference_mode(v.is_inference()),
                torch.no_grad(),
            ):
                kept[a.name] = v.clone()
    return kept


#: The op namespaces of the functional collectives (``torch.distributed._functional_collectives``: DTensor's
#: redistribution, transformers' tensor parallelism): ``all_reduce`` and the others return a new tensor that
#: a collective fills asynchronously, and a later ``wait_tensor`` on that tensor waits for it.  Recorded as
#: collectives: issued once at capture, re-issued at replay in recorded order on the recorded group (its
#: name is an argument), never run by a binding proof, never merged, hoisted, dropped or treated as an alias
#: (``wait_tensor`` returns its input unchanged: as a pure op it was an alias, and its replay dropped the wait;
#: a later op could then read the result before the collective had written it), and their results are read
#: only after their wait (:func:`graphrunner.tape.codegen.generate`).
FUNCTIONAL_COLLECTIVES = ("_c10d_functional", "c10d_functional")
#: Ops of those namespaces that issue nothing: ``_wrap_tensor_autograd`` wraps its (recorded) input in an
#: ``AsyncCollectiveTensor``, whose ops come back here unwrapped; it is run and not recorded.
_WRAPS = ("_c10d_functional::_wrap_tensor_autograd",)
_FAKE = torch._C._TorchDispatchModeKey.FAKE


def _unwrapping_subclasses() -> tuple[type, ...]:
    """The tensor subclasses whose own dispatch the tape lets run, recording the plain-tensor ops it issues
    (DTensor: sharding propagation, the local op, redistributions as functional collectives;
    ``AsyncCollectiveTensor``: ``wait_tensor``, then the op on the plain result).  Empty without
    ``torch.distributed``."""
    global _UNWRAPPING
    if _UNWRAPPING is None:
        found: list[type] = []
        if torch.distributed.is_available():
            # imported when a capture first meets a tensor subclass: DTensor's package is heavy to import
            from torch.distributed._functional_collectives import AsyncCollectiveTensor
            from torch.distributed.tensor import DTensor  # (the same: imported at first use)

            found = [DTensor, AsyncCollectiveTensor]
        _UNWRAPPING = tuple(found)
    return _UNWRAPPING


_UNWRAPPING: tuple[type, ...] | None = None


def _subclass_op(func: Any, subclasses: list) -> CaptureError:
    names = ", ".join(sorted({t.__name__ for t in subclasses}))
    return CaptureError(
        f"the tape does not record ops on tensor subclasses other than DTensor: {func} on a {names} at "
        f"{user_frame()}. Capture a step whose tensors are plain torch.Tensors, or run it eagerly"
    )


class Recorder(TorchDispatchMode):
    """Records every aten op of a capture (and runs it, once)."""

    def __init__(self, cap: TapeCapture):
        super().__init__()
        self.cap = cap

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        cap = self.cap
        kwargs = kwargs or {}
        if torch._C._get_dispatch_mode(_FAKE) is not None:
            # metadata only (DTensor's sharding propagation runs the op on fake tensors): nothing to replay
            return func(*args, **kwargs)
        subclasses = [t for t in types if t is not torch.Tensor and t is not torch.nn.Parameter]
        if subclasses:
            if all(issubclass(t, _unwrapping_subclasses()) for t in subclasses):
                # A DTensor-level op is never recorded: its dispatch runs once, with this mode still active, and
                # the ops it issues on plain tensors (the local op, its redistributions' collectives) come back
                # here and are recorded.  Recorded as it is, the proof of its binding ran DTensor's Python (a
                # MaskPartial's mask, its collectives) a second time.
                return NotImplemented
            cap.failed = _subclass_op(func, subclasses)
            raise cap.failed
        functional = func.namespace in FUNCTIONAL_COLLECTIVES
        if functional and func._schema.name in _WRAPS:
            return func(*args, **kwargs)
        collective = functional or func.namespace == "c10d"
        try:
            if not collective:
                check_safe(func, args, kwargs)
            schema = func._schema
            if torch.is_grad_enabled():
                for a in list(args) + list(kwargs.values()):
                    ts = a if isinstance(a, (list, tuple)) else (a,)
                    if any(isinstance(t, torch.Tensor) and t.requires_grad for t in ts):
                        raise CaptureError(
                            f"autograd is recording during tape capture: {func} received a tensor that "
                            f"requires grad while grad mode is enabled (at {user_frame()}). Graphs are for "
                            "inference: capture under torch.no_grad() or torch.inference_mode()."
                        )
            tags = func.tags
            seeded = torch.Tag.nondeterministic_seeded in tags
            if torch.Tag.inplace_view in tags or func._schema.name in (
                "aten::set_",
                "aten::resize_",
                "aten::resize_as_",
            ):
                cap.meta_mutated = True
            # which arguments does the op write?
            mutable = collective or schema.is_mutable
            # (a c10d collective writes its buffers in place; a functional one writes what its schema says)
            written = written_tensors(func, args, kwargs, every_argument=collective and not functional)
            in_names: list[str] = []
            targs = cap.template_in(tuple(args), in_names)
            tkwargs = {k: cap.template_in(v, in_names) for k, v in kwargs.items()}
            in_vers = tuple(cap.wcount.get(cap.skey[n], 0) for n in in_names)
            had_snapshot = set(cap.snapshots)
            for t in written:
                cap.note_write(t, func)
            # storages first written by this op: their snapshot is their state before it
            fresh = {k: cap.snapshots[k][1] for k in cap.snapshots.keys() - had_snapshot}
            # RNG ops would draw twice; collectives are re-issued as recorded.
            verifier = None
            if not collective and not seeded:
                verifier = Verifier(cap, func, args, kwargs, written, fresh)
            run, run_kwargs = func, kwargs
            if seeded:  # under a redirect (a background capture) it draws from a stand-in
                run, run_kwargs = stand_in_op(func, args, kwargs)
                if run_kwargs is not kwargs:
                    cap.redirected_draws += 1
                    cap.track_generator(drawn_generator(args, kwargs))  # the stand-in
                elif redirected() is None:
                    cap.track_generator(op_generator(args, kwargs))
        except BaseException as e:
            cap.failed = e
            raise
        out = run(*args, **run_kwargs)
        try:
            op = RecordedOp()
            op.func, op.args, op.kwargs = func, targs, tkwargs
            op.stream = current_stream().id
            op.in_names = in_names
            op.in_vers = in_vers
            allout: list[str]
            op.new, allout = [], []
            op.outs = cap.template_out(out, op.new, allout)
            op.writes = [cap.names[id(t)] for t in written]
            op.collective = collective
            op.seeded = seeded
            op.pure = not mutable and not collective and not seeded
            op.in_skeys = {cap.skey[n] for n in in_names}
            op.out_skeys = [cap.skey[n] for n in op.new]
            for t in written:
                k = cap.skey.get(cap.names[id(t)])
                cap.wcount[k] = cap.wcount.get(k, 0) + 1
            # A pure op returning a tensor with exactly its single tensor
            # input's storage and metadata (view to the same shape, full slice,
            # alias, detach, ...) can be replaced by that input at replay.
            if (
                op.pure
                and len(set(in_names)) == 1
                and isinstance(op.outs, Ref)
                and op.new
                and isinstance(out, torch.Tensor)
            ):
                src = cap.strong[in_names[0]]
                if (
                    storage_of(out) is not None
                    and storage_of(src) is not None
                    and storage_of(out).data_ptr() == storage_of(src).data_ptr()
                    and out.dtype == src.dtype
                    and out.shape == src.shape
                    and out.stride() == src.stride()
                    and out.storage_offset() == src.storage_offset()
                ):
                    op.alias = (op.new[0], in_names[0])
            # Any other view of an internal storage is replayable as one
            # as_strided call on the tensor that allocated that storage: it is
            # cheaper than view / narrow / transpose, and the intermediate
            # views of a chain (view -> transpose -> reshape) become dead code.
            if (
                op.alias is None
                and op.pure
                and len(set(in_names)) == 1
                and isinstance(op.outs, Ref)
                and op.new
                and isinstance(out, torch.Tensor)
                and out.layout == torch.strided
                and not (out.is_conj() or out.is_neg() or out.is_quantized)
            ):
                k = cap.skey.get(op.new[0])
                base = cap.internal_storages.get(k) if k is not None else None
                if base is not None and base != op.new[0] and k in op.in_skeys:
                    b = cap.strong.get(base)
                    if b is not None and b.dtype == out.dtype and not (b.is_conj() or b.is_neg()):
                        op.view = (base, tuple(out.size()), tuple(out.stride()), out.storage_offset())
            # A view of an internal storage replays as that as_strided call (codegen), whatever binding
            # would be picked, unless an in-place metadata change came first or comes later: then as
            # picked here if one came first, else as the recorded aten op itself.
            if verifier is not None and op.alias is None and (op.view is None or cap.meta_mutated):
                # (out= is checked only for a result a preplanned buffer may stand in for)
                plannable = isinstance(op.outs, Ref) and op.outs.name in op.new and cap.owns_storage(op.outs.name)
                got = verifier.pick(cap, func, args, kwargs, out, plannable)
                if got is not None:
                    fn, cargs, ckwargs = got
                    op.call = fn
                    op.out_ok = verifier.out_ok
                    scratch: list = []  # 0-dim scalar tensors become externals (constants)
                    op.cargs = (
                        cap.template_in(cargs, scratch),
                        {k: cap.template_in(v, scratch) for k, v in ckwargs.items()},
                    )
                    if fn in COLLAPSIBLE or fn in COLLAPSIBLE_FUNCTIONAL:
                        op.seen = _kept_values(cap, op.cargs[0], cargs)
            cap.ops.append(op)
        except BaseException as e:
            cap.failed = e
            raise
        return out
