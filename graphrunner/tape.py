"""TapeGraph: a CUDA graph you can run on a CPU.

A :class:`TapeGraph` records every aten op that runs during capture (through a
``TorchDispatchMode``) and replays the recorded ops against the same tensors.
It mirrors ``torch.cuda.CUDAGraph`` closely enough that capture code written for
one runs on the other:

* Tensors not produced inside the capture are *external* (static inputs,
  weights, KV cache); replay reads and writes them in place.  Writes to
  externals made while capturing are undone at capture end, because a CUDA
  capture launches nothing.
* Python control flow, Python scalars and shapes are frozen at capture.
* Tensors produced inside the capture that are still referenced after it
  (*survivors*: returned, stored on an object, ...) keep their identity and are
  refreshed in place at every replay; everything else is a temporary.
* Host-synchronising and data-dependent-shape operations raise
  :class:`~graphrunner.errors.CaptureUnsafeOpError` during capture.
* RNG as on CUDA: a capture consumes nothing from any generator (the default
  CPU generator and every generator the capture drew from get their state
  back at capture end); each replay draws what the eager step would draw from
  the generator's current state.  Re-seeding (``torch.manual_seed``, ...)
  during capture raises :class:`~graphrunner.errors.CaptureError`.  An empty
  capture warns (:data:`EMPTY_GRAPH_MESSAGE`).
* Collectives (``c10d`` ops) are re-issued and waited on.
* Optionally (``TapeGraph(poison_captured_values=True)``, or the environment
  variable ``GRAPHRUNNER_TAPE_POISON=1``), survivors are filled with a poison
  value at capture end (NaN, the integer dtype's max, ``True``), because on a
  CUDA graph they hold uninitialised pool memory until the first replay: code
  that reads them between capture and replay (an eager break, a check of the
  capture-time output) then fails on CPU as it would on the GPU.
* Replay runs straight-line Python generated once at ``capture_end``; it never
  goes through a dispatch mode.  To make it cheap: views of externals and
  constant factories are hoisted (computed once); each op calls the public
  binding (``torch.mul``, ``Tensor.view``, ...) verified at capture to match
  the aten op bit for bit, with Python scalars as shared 0-dim tensors; views
  with their input's exact metadata are dropped; a pure op repeating an
  earlier one on unchanged inputs reuses its result (CSE); dead ops are
  dropped.  Torch-function handling is disabled during replay, so no mode or
  tensor subclass intercepts the bindings (the recorded aten ops never saw one
  either).

Limits (as on a CUDA graph, the graph holds tensors, not names): ``resize_``,
``set_``, or re-assigning a module attribute / cache tensor after capture
silently invalidates the graph; re-capture after such a change.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
import warnings
import weakref
from typing import Any, Callable, Iterator

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from graphrunner.errors import CaptureError, CaptureUnsafeOpError

__all__ = [
    "TapeGraph",
    "POISON_ENV_VAR",
    "poison_default",
    "poison_value",
    "TapePool",
    "tape_graph",
    "graph_pool_handle",
    "is_tape_capturing",
    "EscapedTensorWarning",
    "EMPTY_GRAPH_MESSAGE",
]

logger = logging.getLogger("graphrunner")

_THIS_FILE = os.path.abspath(__file__)
_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
_CAPTURE_ERROR_MODES = ("global", "thread_local", "relaxed")

# The captures in progress: thread id -> capture (at most one per thread).
# Like CUDA, captures in different threads may overlap when neither uses
# capture_error_mode="global"; a global-mode capture is the only one while it
# lasts.  Changed only under _ACTIVE_LOCK.
_ACTIVE: "dict[int, _Capture]" = {}
_ACTIVE_LOCK = threading.Lock()


def _capture_here() -> "_Capture | None":
    """The capture in progress in the calling thread, if any."""
    return _ACTIVE.get(threading.get_ident())

# Survivor storages a poisoning graph filled with poison and that it has not
# replayed since: id(storage) -> weakref(graph); the graph holds the entry
# (see TapeGraph._poisoned).  Another tape capture that reads one gets its real
# values while it captures (a CUDA capture runs nothing, so its ops can never
# fail on the garbage; the tape runs them): see _Capture.lift_poison.
_POISONED: dict[int, weakref.ref] = {}

# Storages that survived some capture: id(storage) -> (weakref(storage), weakref(graph)).
# Used to warn when another graph writes a survivor (TAPE-NOTES item 8).
_SURVIVORS: dict[int, tuple[weakref.ref, weakref.ref]] = {}


#: The warning ``capture_end()`` gives when no aten op ran during the capture
#: (CUDA's is "The CUDA Graph is empty. This usually means that the graph was
#: attempted to be captured on wrong device or stream.").
EMPTY_GRAPH_MESSAGE = (
    "The tape graph is empty: no aten op ran between capture_begin() and capture_end(), so replay() does "
    "nothing. This usually means the work ran outside the capture (before capture_begin(), in another "
    "thread) or was not tensor work; check that the captured code really runs inside the capture."
)

#: Environment variable giving the default of ``poison_captured_values`` for
#: :class:`TapeGraph` and :class:`~graphrunner.devices.TapeDevice`.
POISON_ENV_VAR = "GRAPHRUNNER_TAPE_POISON"
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("", "0", "false", "no", "off")


def poison_default() -> bool:
    """The default of ``poison_captured_values``: ``$GRAPHRUNNER_TAPE_POISON``.

    ``1``/``true``/``yes``/``on`` (any case) enable poisoning; unset, empty,
    ``0``/``false``/``no``/``off`` disable it; anything else raises
    ``ValueError``.  Read each time a graph or device is made without an
    explicit value, so a test suite can set it once for every graph.
    """
    v = os.environ.get(POISON_ENV_VAR, "").strip().lower()
    if v in _TRUE:
        return True
    if v in _FALSE:
        return False
    raise ValueError(f"${POISON_ENV_VAR} must be one of {_TRUE + _FALSE[1:]} or empty, "
                     f"got {os.environ[POISON_ENV_VAR]!r}")


def poison_value(dtype: torch.dtype) -> "float | int | bool | None":
    """The value a poisoning :class:`TapeGraph` fills survivors of ``dtype`` with.

    Floating and complex dtypes: NaN (it propagates through arithmetic);
    integer dtypes: the dtype's maximum (out of range as an index or a length);
    ``bool``: ``True``.  ``None`` for dtypes that cannot be filled (quantized).
    """
    if dtype == torch.bool:
        return True
    if dtype.is_floating_point or dtype.is_complex:
        return float("nan")
    try:
        return torch.iinfo(dtype).max
    except TypeError:
        return None


def _resolve_poison(flag: "bool | None", who: str) -> bool:
    if flag is None:
        return poison_default()
    if not isinstance(flag, bool):
        raise TypeError(f"{who}: poison_captured_values must be a bool or None, got {type(flag).__name__}")
    return flag


class EscapedTensorWarning(UserWarning):
    """A tensor created inside one tape capture and still referenced after it
    (a *survivor*, refreshed in place at each replay of its graph) was written
    by code outside that graph: by another graph's capture or by eager code.

    Such a tensor is usually a persistent buffer allocated lazily on first use
    inside a capture; its contents are overwritten whenever the producing graph
    replays, so state written from outside is lost (on CUDA the memory belongs
    to the graph's private pool, wrong in a different way).  Allocate the
    buffer before capture instead.
    """


class TapePool:
    """Opaque memory-pool handle, for API parity with ``torch.cuda.graph_pool_handle()``.

    Graphs given the same pool share this handle; a tape graph allocates from
    the ordinary CPU allocator, so the pool carries no memory.
    """

    __slots__ = ("__weakref__",)

    def __repr__(self) -> str:
        return f"<TapePool at {id(self):#x}>"


def graph_pool_handle() -> TapePool:
    """Return a new :class:`TapePool`, to pass as ``pool=`` to several captures
    (mirrors ``torch.cuda.graph_pool_handle``)."""
    return TapePool()


def is_tape_capturing() -> bool:
    """True while any :class:`TapeGraph` capture is active in this process
    (in any thread; with ``capture_error_mode="thread_local"`` or
    ``"relaxed"`` several threads may be capturing at once)."""
    return bool(_ACTIVE)


# ---------------------------------------------------------------------------
# capture-unsafe op detection

_INDEX_OPS = {"index", "_unsafe_index", "index_put", "index_put_", "_index_put_impl_", "_unsafe_index_put"}

# ops returning non-tensors that only read metadata (safe to freeze)
_METADATA_OPS = {
    "sym_size", "sym_stride", "sym_numel", "sym_storage_offset", "size", "stride", "numel", "dim",
    "is_same_size", "_has_compatible_shallow_copy_type", "is_contiguous", "is_strides_like_format",
    "is_non_overlapping_and_dense", "is_complex", "is_floating_point", "is_signed", "is_conj", "is_neg",
    "is_inference", "is_set_to", "_nnz", "output_nr", "_version", "is_leaf", "retains_grad", "storage_offset",
    "is_coalesced", "dense_dim", "sparse_dim", "_is_zerotensor", "is_pinned", "_debug_has_internal_overlap",
}

_FRIENDLY = {
    "item": "Tensor.item() / float(t) / int(t) of a tensor (reads a value on the host)",
    "_local_scalar_dense": "Tensor.item() / float(t) / int(t) / bool(t) of a tensor (reads a value on the host)",
    "is_nonzero": "bool(t) / `if t:` on a tensor (reads a value on the host)",
    "nonzero": "torch.nonzero / 1-argument torch.where (output shape depends on data)",
    "masked_select": "torch.masked_select (output shape depends on data)",
    "equal": "torch.equal (returns a host bool)",
    "allclose": "torch.allclose (returns a host bool)",
    "bincount": "torch.bincount (output shape depends on data)",
    "repeat_interleave": "torch.repeat_interleave with tensor repeats (output shape depends on data)",
    "_unique2": "torch.unique (output shape depends on data)",
    "_unique": "torch.unique (output shape depends on data)",
    "unique_dim": "torch.unique with dim (output shape depends on data)",
    "unique_consecutive": "torch.unique_consecutive (output shape depends on data)",
    "argwhere": "torch.argwhere (output shape depends on data)",
    "one_hot": "F.one_hot without num_classes (or num_classes=-1: the class count is read on the host; "
               "pass num_classes, a Python int >= 1, and it is capturable, as on CUDA)",
}

# Composite ops that reach the mode whole under inference_mode, untagged.
_EXPLICIT_UNSAFE = {
    "where.default": "1-argument torch.where (a nonzero: output shape depends on data)",
    "nonzero_numpy": "nonzero (output shape depends on data)",
    "argwhere": "torch.argwhere (output shape depends on data)",
    "unique_dim": "torch.unique (output shape depends on data)",
    "_unique": "torch.unique (output shape depends on data)",
    "is_nonzero": _FRIENDLY["is_nonzero"],
}

# Host-reading idioms that reach the dispatcher as nothing (or as an innocuous
# op), caught by a TorchFunctionMode guard instead.  Keyed by __qualname__.
_UNSAFE_FUNCTIONS = {
    "TensorBase.tolist": "Tensor.tolist() (copies data to a Python list on the host)",
    "TensorBase.numpy": "Tensor.numpy() (hands host memory to NumPy)",
    "TensorBase.cpu": "Tensor.cpu() (a device-to-host copy)",
    "Tensor.__repr__": "printing / repr() of a tensor (reads data on the host)",
    "Tensor.__format__": "formatting a tensor (f-string / print) (reads data on the host)",
    "Tensor.__array__": "converting a tensor to a NumPy array",
    "TensorBase.item": "Tensor.item() (reads a value on the host)",
    "TensorBase.__bool__": "bool(t) / `if t:` on a tensor (reads a value on the host)",
    "TensorBase.__float__": "float(t) of a tensor (reads a value on the host)",
    "TensorBase.__int__": "int(t) of a tensor (reads a value on the host)",
    "TensorBase.__index__": "using a tensor as a Python index (reads a value on the host)",
    "TensorBase.__complex__": "complex(t) of a tensor (reads a value on the host)",
    "TensorBase.equal": "Tensor.equal (returns a host bool)",
    "TensorBase.allclose": "Tensor.allclose (returns a host bool)",
    "equal": "torch.equal (returns a host bool)",
    "allclose": "torch.allclose (returns a host bool)",
}


def _user_frame() -> str:
    """Describe the innermost stack frame outside torch and this module."""
    f = sys._getframe(1)
    while f is not None:
        fn = os.path.abspath(f.f_code.co_filename)
        if fn != _THIS_FILE and not fn.startswith(_TORCH_DIR) and not fn.startswith("<frozen"):
            import linecache

            src = linecache.getline(f.f_code.co_filename, f.f_lineno).strip()
            where = f"{f.f_code.co_filename}:{f.f_lineno} in {f.f_code.co_name}"
            return f"{where}: `{src}`" if src else where
        f = f.f_back
    return "<unknown location>"


def _unsafe(what: str, op: str) -> CaptureUnsafeOpError:
    return CaptureUnsafeOpError(
        f"capture-unsafe operation during tape capture: {what} [op: {op}] at {_user_frame()}. "
        "A device graph cannot hold a host synchronisation or a data-dependent shape. "
        "Move this code out of the captured region, e.g. into a function decorated with "
        "@no_graph (graphrunner.no_graph) so it runs eagerly between graph segments, "
        "or rewrite it with static shapes."
    )


def _returns_only_tensors(schema) -> bool:
    for r in schema.returns:
        s = str(r.type)
        if s not in ("Tensor", "Tensor?", "List[Tensor]", "List[Optional[Tensor]]", "Tensor[]", "Tensor?[]"):
            return False
    return True


def _check_safe(func, args, kwargs) -> None:
    """Raise CaptureUnsafeOpError if ``func`` cannot be held by a device graph."""
    name = func._schema.name.split("::", 1)[-1]
    tags = func.tags
    # index.Tensor is tagged dynamic_output_shape, but only a bool/uint8 mask
    # index makes it so (checked below): no false alarm on long-index indexing.
    # repeat_interleave.Tensor is tagged too, but is static given output_size
    # (also checked below).
    if name not in _INDEX_OPS and name != "repeat_interleave" and (
        torch.Tag.dynamic_output_shape in tags or torch.Tag.data_dependent_output in tags
    ):
        raise _unsafe(_FRIENDLY.get(name, f"{name} (output shape or value read on the host)"), str(func))
    if not _returns_only_tensors(func._schema) and name not in _METADATA_OPS:
        raise _unsafe(_FRIENDLY.get(name, f"{name} (returns a host value computed from tensor data)"), str(func))
    if name in _EXPLICIT_UNSAFE or f"{name}.{func._overloadname}" in _EXPLICIT_UNSAFE:
        what = _EXPLICIT_UNSAFE.get(name) or _EXPLICIT_UNSAFE[f"{name}.{func._overloadname}"]
        raise _unsafe(what, str(func))
    if name == "repeat_interleave" and func._overloadname in ("Tensor", "self_Tensor"):
        if kwargs.get("output_size") is None:  # with output_size the shape is static
            raise _unsafe(_FRIENDLY[name], str(func))
    if name in _INDEX_OPS:
        idx = args[1] if len(args) > 1 else kwargs.get("indices")
        for t in idx or ():
            if isinstance(t, torch.Tensor) and t.dtype in (torch.bool, torch.uint8):
                what = (
                    "boolean-mask assignment x[mask] = v (index_put with a bool mask; data-dependent)"
                    if "put" in name
                    else "boolean-mask indexing x[mask] (output shape depends on data)"
                )
                raise _unsafe(what, str(func))


_ONE_HOT = torch.nn.functional.one_hot


def _one_hot_static(args, kwargs) -> "torch.Tensor | None":
    """``F.one_hot(t, num_classes)`` as PyTorch runs it on CUDA when
    ``num_classes >= 1`` is given: zeros, then a scatter of ones, with no host
    read of the class values (CUDA relies on the scatter's device assert; on
    the tape an out-of-range class makes the scatter raise).  Raises
    CaptureUnsafeOpError without ``num_classes`` (or with -1: the class count
    is read on the host); returns None for any other call (a non-int64
    input, ...), which then runs as is."""
    t = args[0] if args else kwargs.get("input")
    n = args[1] if len(args) > 1 else kwargs.get("num_classes", -1)
    if type(t) is not torch.Tensor or t.dtype != torch.int64 or len(args) + len(kwargs) > 2:
        return None
    if isinstance(n, int) and not isinstance(n, bool) and n == -1:
        raise _unsafe(_FRIENDLY["one_hot"], "one_hot")
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        return None
    out = torch.zeros(*t.shape, n, dtype=t.dtype, device=t.device)
    return out.scatter_(-1, t.unsqueeze(-1), 1)


class _Guard(TorchFunctionMode):
    """Rejects host-reading Tensor methods that never reach the dispatcher,
    and runs ``F.one_hot`` with ``num_classes`` without its CPU-only host read."""

    def __init__(self, cap: "_Capture"):
        super().__init__()
        self.cap = cap

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        what = _UNSAFE_FUNCTIONS.get(getattr(func, "__qualname__", None))
        if what is not None:
            err = _unsafe(what, getattr(func, "__qualname__", str(func)))
            self.cap.failed = err
            raise err
        if func is _ONE_HOT:
            try:
                out = _one_hot_static(args, kwargs)
            except CaptureUnsafeOpError as err:
                self.cap.failed = err
                raise
            if out is not None:
                return out
        return func(*args, **kwargs)


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


# ---------------------------------------------------------------------------
# recording


class _Ref:
    """Placeholder for a tensor inside a recorded argument template."""

    __slots__ = ("name",)

    def __init__(self, name: str):
        self.name = name

    def __repr__(self) -> str:
        return self.name


class _Op:
    """One recorded aten op: callable, argument templates, output names."""

    __slots__ = ("func", "args", "kwargs", "outs", "new", "in_names", "writes", "pure", "collective", "seeded",
                 "out_skeys", "in_skeys", "fast", "call", "cargs", "in_vers", "alias", "view")

    def __init__(self):
        # fast: None (replayed), "hoisted" (computed once at capture), "alias"
        # (a view with its input's exact metadata: replaced by its input) or
        # "cse" (recomputes an earlier op's value: replaced by that value).
        self.fast = None
        # call/cargs: a verified public binding (torch.mul, Tensor.view, ...) and
        # its argument templates, used at replay instead of func._op (None: aten).
        self.call = None
        self.cargs = None
        self.alias = None  # for "alias": (output name, input name)
        self.view = None   # a view of an internal storage: (base name, size, stride, offset)


def _storage(t: torch.Tensor):
    try:
        return t.untyped_storage()
    except Exception:  # tensors without storage (sparse, nested, ...)
        return None


class _Poisoned:
    """One poisoned survivor storage of a graph: its bytes as a uint8 view, its
    real (capture-time) bytes, a flat view in its dtype and the poison value."""

    __slots__ = ("raw", "real", "typed", "value", "once")

    def __init__(self, st, dtype: torch.dtype, value, once: bool):
        with torch.inference_mode():
            self.raw = torch.empty(0, dtype=torch.uint8, device=st.device).set_(st)
            self.real = self.raw.clone()
            self.typed = torch.empty(0, dtype=dtype, device=st.device).set_(st, 0, (st.nbytes() // dtype.itemsize,))
        self.value = value
        self.once = once  # computed once at capture (a hoisted constant): never refreshed by replay

    def poison(self) -> None:
        with torch.inference_mode():
            self.typed.fill_(self.value)

    def lift(self) -> None:
        with torch.inference_mode():
            self.raw.copy_(self.real)


class _Capture:
    """Mutable state of one capture in progress (dropped at capture end)."""

    def __init__(self, graph: "TapeGraph", mode: str = "global"):
        self.graph = graph
        self.mode = mode                           # capture_error_mode
        self.thread = threading.get_ident()        # the capturing thread
        self.thread_name = threading.current_thread().name
        self.names: dict[int, str] = {}            # id(tensor) -> name
        self.strong: dict[str, torch.Tensor] = {}  # name -> tensor (keeps ids unique during capture)
        self.kind: dict[str, str] = {}             # name -> "ext" | "int"
        self.skey: dict[str, int] = {}             # name -> storage key
        self.storages: dict[int, Any] = {}         # storage key -> storage (strong, during capture)
        self.internal_storages: dict[int, str] = {}  # storage key -> name of the allocating tensor
        self.alloc_meta: dict[str, tuple] = {}     # allocating name -> (dtype, device, size, stride, offset)
        self.written: set[int] = set()             # storage keys written by recorded ops
        self.ext_storages: set[int] = set()        # storage keys of externals
        self.snapshots: dict[int, tuple] = {}      # external storage key -> (storage, byte copy)
        self.ops: list[_Op] = []
        self.n = 0
        self.failed: BaseException | None = None
        self.inference = torch.is_inference_mode_enabled()
        self.warned: set[int] = set()
        self.wcount: dict[int, int] = {}           # storage key -> writes so far (for CSE)
        self.scalars: dict[tuple, torch.Tensor] = {}  # Python scalar -> shared 0-dim tensor
        self.meta_mutated = False                  # an inplace_view op (t_, unsqueeze_, ...) ran
        self.lifted: list[_Poisoned] = []          # other graphs' poisoned survivors lifted for this capture
        self.generators: dict[int, tuple] = {}     # id(generator) -> (generator, state, initial seed) at first use
        self.track_generator(torch.default_generator)

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
        st = _storage(t)
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
                f"recorded op (at {_user_frame()}); create views with tensor ops, not with storage APIs"
            )
        n = f"e{self.n}"
        self.n += 1
        self.names[id(t)] = n
        self.strong[n] = t
        self.kind[n] = "ext"
        self.skey[n] = k
        if k is not None:
            if _POISONED and k not in self.ext_storages:
                self.lift_poison(k)
            self.ext_storages.add(k)
        return n

    def lift_poison(self, k: int) -> None:
        """An external storage poisoned by another graph's capture end: give it
        its real values until this capture ends (then it is poisoned again).
        A CUDA capture never computes on it; the tape does, and poison could
        make an op raise (an out-of-range index) where the GPU would not."""
        w = _POISONED.get(k)
        g = w() if w is not None else None
        if g is None:
            _POISONED.pop(k, None)
            return
        ent = g._poisoned.get(k)
        if ent is None or _storage(ent.raw) is not self.storages.get(k):
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
        return n, True

    # -- templates --------------------------------------------------------
    def template_in(self, v, names: list):
        if isinstance(v, torch.Tensor):
            n = self.name_in(v)
            names.append(n)
            return _Ref(n)
        if isinstance(v, (list, tuple)):
            return type(v)(self.template_in(x, names) for x in v)
        return v

    def template_out(self, v, new: list, allnames: list):
        if isinstance(v, torch.Tensor):
            n, is_new = self.name_out(v)
            allnames.append(n)
            if is_new:
                new.append(n)
            return _Ref(n)
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
            b = torch.empty(0, dtype=torch.uint8, device=st.device).set_(st)
            self.snapshots[k] = (st, b.clone())
        ent = _SURVIVORS.get(k)
        if ent is not None and ent[0]() is st:
            g = ent[1]()
            if g is not None and g is not self.graph and k not in self.warned:
                self.warned.add(k)
                warnings.warn(
                    f"op {func} in this tape capture writes a tensor that was created inside another graph's "
                    f"capture and survived it (at {_user_frame()}). That graph refreshes the tensor at each of "
                    "its replays, overwriting what is written here; allocate persistent buffers (caches, "
                    "counters) before capture.",
                    EscapedTensorWarning,
                    stacklevel=2,
                )

    # -- generators ---------------------------------------------------------
    def track_generator(self, g: "torch.Generator | None") -> None:
        """Save ``g``'s state before the capture first draws from it."""
        if g is not None and id(g) not in self.generators:
            self.generators[id(g)] = (g, g.get_state(), g.initial_seed())

    def restore_generators(self) -> "CaptureError | None":
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
            g.set_state(state)
        self.generators.clear()
        return err

    def restore(self) -> None:
        with torch.inference_mode():
            for st, snap in self.snapshots.values():
                torch.empty(0, dtype=torch.uint8, device=st.device).set_(st).copy_(snap)
        self.snapshots.clear()


# ---------------------------------------------------------------------------
# fast replay calls: public bindings verified against the aten op
#
# Calling an OpOverload from Python (``aten.mul.Tensor._op(x, y)``) costs about
# 1.5x the public binding (``torch.mul(x, y)``), and a Python scalar argument
# costs more than a 0-dim tensor (the binding wraps it in a fresh float64
# tensor at every call, which the kernel then casts).  At capture we therefore
# try, per recorded op, a few candidates, in order:
#   * a rewrite for ops without a binding of their own name or with a cheaper
#     equivalent (slice -> torch.narrow; linear(x, w) -> torch.matmul(x, w.t())
#     with w.t() taken once, for an external weight);
#   * the public C binding of the same name (torch.X, torch._C._nn.X, or the
#     Tensor method; in-place ops: the Tensor method), with Python scalars
#     replaced by one shared 0-dim tensor per value (in the result's dtype,
#     then float64 / int64), then with the scalars as they were;
# and keep the first one whose result is identical to the aten op's on the
# capture-time data: same bits, dtype, shape, strides, storage offset and
# aliasing (and, for ops that write, the same bytes written, checked on a
# copy of the written storages).  Anything else replays through the aten op.

_NO_TORCH_FUNCTION = torch._C.DisableTorchFunction
_VF = torch._C._VariableFunctions
_NN = torch._C._nn
_TB = torch._C.TensorBase
_BUILTIN_TYPES = ("builtin_function_or_method", "method_descriptor")
_BINDINGS: dict[Any, tuple] = {}
_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
# Ops writing a storage larger than this (a KV cache, ...) replay through the
# aten op: verifying a binding needs a copy of every storage it writes, which
# would cost more capture time (and memory) than the ~1 us per call it saves.
_MAX_TWIN_BYTES = 1 << 20


def _bindings(func) -> tuple:
    """Public C bindings named like aten op ``func`` (in-place ops: Tensor methods only)."""
    got = _BINDINGS.get(func)
    if got is None:
        name = func._schema.name.split("::", 1)[-1]
        got = []
        if func.namespace == "aten":
            for src in (_TB,) if name.endswith("_") else (_VF, _NN, _TB):
                c = getattr(src, name, None)
                if c is not None and type(c).__name__ in _BUILTIN_TYPES and c not in got:
                    got.append(c)
        got = _BINDINGS[func] = tuple(got)
    return got


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (NaNs with the same payload equal, -0.0 != 0.0)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.is_complex():
        a, b = torch.view_as_real(a), torch.view_as_real(b)
    if a.dtype != torch.bool:
        it = _INT_OF_SIZE.get(a.element_size())
        if it is None:
            return False
        a, b = a.view(it), b.view(it)
    return torch.equal(a, b)


def _flat_tensors(v, acc: list) -> list:
    if isinstance(v, torch.Tensor):
        acc.append(v)
    elif isinstance(v, (list, tuple)):
        for x in v:
            _flat_tensors(x, acc)
    elif isinstance(v, dict):
        for x in v.values():
            _flat_tensors(x, acc)
    return acc


def _alias_index(t: torch.Tensor, inputs: list) -> tuple:
    """Indices of the inputs whose storage ``t`` shares."""
    st = _storage(t)
    if st is None or st.nbytes() == 0:
        return ()
    p = st.data_ptr()
    out = []
    for i, x in enumerate(inputs):
        xs = _storage(x)
        if xs is not None and xs.nbytes() and xs.data_ptr() == p:
            out.append(i)
    return tuple(out)


def _same_result(ref, got, ref_in: list, got_in: list) -> bool:
    """``got`` (binding result on ``got_in``) is indistinguishable from ``ref``
    (aten result on ``ref_in``): structure, metadata, bits and aliasing."""
    if isinstance(ref, torch.Tensor):
        if type(got) is not type(ref):
            return False
        if (got.dtype != ref.dtype or got.device != ref.device or got.layout != ref.layout
                or ref.layout != torch.strided or got.shape != ref.shape or got.stride() != ref.stride()
                or got.storage_offset() != ref.storage_offset() or got.is_inference() != ref.is_inference()
                or got.requires_grad != ref.requires_grad):
            return False
        if _alias_index(ref, ref_in) != _alias_index(got, got_in):
            return False
        return _bits_equal(ref, got)
    if isinstance(ref, (list, tuple)):
        return (isinstance(got, (list, tuple)) and len(got) == len(ref)
                and all(_same_result(r, g, ref_in, got_in) for r, g in zip(ref, got)))
    return type(got) is type(ref) and got == ref


def _tupled(v):
    """Lists of literals become tuples (a constant in the generated code, not a
    list built at each call); bindings take either for int[] / float[]."""
    if isinstance(v, list) and all(isinstance(x, (int, float, bool)) for x in v):
        return tuple(v)
    return v


def _slice_as_narrow(args, kwargs, out):
    """aten.slice.Tensor (no public binding) as torch.narrow with the same result."""
    x, dim = args[0], (args[1] if len(args) > 1 else kwargs.get("dim", 0))
    step = args[4] if len(args) > 4 else kwargs.get("step", 1)
    if step != 1 or not isinstance(out, torch.Tensor) or kwargs:
        return []
    dim %= x.dim()
    start = (out.storage_offset() - x.storage_offset()) // x.stride(dim) if out.numel() and x.stride(dim) else 0
    return [(_VF.narrow, [x, dim, start, out.size(dim)], {})]


def _linear_as_matmul(args, kwargs, out):
    """aten.linear(x, w) without bias as torch.matmul(x, w.t()), with w.t() taken
    once at capture (linear re-derives it at every call).  Only for an external
    weight (checked by the caller): the view then stays valid at replay."""
    x, w = args[0], args[1]
    bias = args[2] if len(args) > 2 else kwargs.get("bias")
    if bias is not None or w.dim() != 2:
        return []
    return [(_VF.matmul, [x, w.t()], {})]


# Ops without a public binding of their own name: functions returning
# [(binding, args, kwargs)] to try first (verified like the others).
_REWRITES: dict[Any, Callable] = {torch.ops.aten.slice.Tensor: _slice_as_narrow,
                                  torch.ops.aten.linear.default: _linear_as_matmul}
# rewrites that take a view of an argument at capture: only when that argument is external
_REWRITE_NEEDS_EXTERNAL = {torch.ops.aten.linear.default: 1}


class _Verifier:
    """Prepared before an aten op runs (copies of the storages it writes), then
    asked after it ran for the fastest binding computing the same thing."""

    def __init__(self, cap: "_Capture", func, args, kwargs, written: list, fresh: dict):
        self.ok = False
        self.twin_st: dict[int, tuple] = {}  # storage key -> (storage, its bytes before the op)
        self.work: dict[int, torch.Tensor] = {}
        if func.namespace != "aten" or not (_bindings(func) or func in _REWRITES):
            return
        for t in written:
            st = _storage(t)
            if st is None or st.nbytes() > _MAX_TWIN_BYTES:
                return
            k = id(st)
            if k not in self.twin_st:
                b = fresh.get(k)  # the capture's snapshot, taken just now (never modified)
                if b is None:
                    with torch.inference_mode():
                        b = torch.empty(0, dtype=torch.uint8, device=st.device).set_(st).clone()
                self.twin_st[k] = (st, b)
        self.ok = True

    def _twin(self, v):
        """``v`` with every tensor on a written storage replaced by the same view of its copy."""
        if isinstance(v, torch.Tensor):
            st = _storage(v)
            work = self.work.get(id(st)) if st is not None else None
            if work is None:
                return v
            with torch.inference_mode(v.is_inference()), torch.no_grad():
                return torch.empty(0, dtype=v.dtype, device=v.device).set_(
                    work.untyped_storage(), v.storage_offset(), v.size(), v.stride())
        if isinstance(v, (list, tuple)):
            return type(v)(self._twin(x) for x in v)
        if isinstance(v, dict):
            return {k: self._twin(x) for k, x in v.items()}
        return v

    def _same_writes(self) -> bool:
        """Every written storage holds the same bytes as its copy written by the binding."""
        with torch.inference_mode():
            for k, (st, _) in self.twin_st.items():
                real = torch.empty(0, dtype=torch.uint8, device=st.device).set_(st)
                if not torch.equal(real, self.work[k]):
                    return False
        return True

    def pick(self, cap: "_Capture", func, args, kwargs, out):
        """Return (binding, args, kwargs) verified equal to ``func`` on this data, or None."""
        if not self.ok:
            return None
        schema_args = func._schema.arguments
        variants = []
        # Python scalars passed for Tensor / Scalar parameters -> shared 0-dim
        # tensors.  Tried first in the op's result dtype (float32 for half /
        # bfloat16 results, whose kernels compute in float32): a float64 0-dim
        # tensor (what a wrapped scalar is) costs a cast (_to_copy) per call.
        slots = []
        for i, a in enumerate(schema_args):
            if str(a.type) not in ("Tensor", "Scalar"):
                continue
            key = i if i < len(args) else a.name
            v = args[i] if i < len(args) else kwargs.get(a.name)
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                slots.append((key, v))
        res = out if isinstance(out, torch.Tensor) else None
        dtypes = []
        if slots and res is not None:
            dt = res.dtype
            if dt in (torch.float16, torch.bfloat16):
                dt = torch.float32
            if dt.is_floating_point or (not dt.is_complex and dt != torch.bool
                                         and all(isinstance(v, int) for _, v in slots)):
                dtypes.append(dt)
        if slots:
            dtypes += [None]  # None: float64 / int64, like a wrapped scalar
        for dt in dict.fromkeys(dtypes):
            sargs, skw = list(args), dict(kwargs)
            for key, v in slots:
                t = cap.scalar_tensor(v, dt)
                if isinstance(key, int):
                    sargs[key] = t
                else:
                    skw[key] = t
            variants.append(([_tupled(v) for v in sargs], {k: _tupled(v) for k, v in skw.items()}))
        variants.append(([_tupled(v) for v in args], {k: _tupled(v) for k, v in kwargs.items()}))
        tries = [(fn, va, vk) for fn in _bindings(func) for va, vk in variants]
        rewrite = _REWRITES.get(func)
        ext_arg = _REWRITE_NEEDS_EXTERNAL.get(func)
        if ext_arg is not None:
            a = args[ext_arg] if ext_arg < len(args) else None
            n = cap.names.get(id(a)) if isinstance(a, torch.Tensor) else None
            if n is None or cap.kind.get(n) != "ext":
                rewrite = None
        if rewrite is not None:
            try:
                tries[:0] = rewrite(args, kwargs, out)
            except Exception:
                pass
        ref_in = _flat_tensors((args, kwargs), [])
        scalar_ids = {id(t) for t in cap.scalars.values()}
        for fn, va, vk in tries:
            try:
                # a fresh copy of the written storages, as they were before the op
                with torch.inference_mode():
                    self.work = {k: b.clone() for k, (_, b) in self.twin_st.items()}
                ca, ck = self._twin(va), self._twin(vk)
                with torch._C.DisableTorchFunction():
                    got = fn(*ca, **ck)
                # Inputs in the same order as ref_in: our 0-dim scalars (Python
                # numbers in the aten call) left out, and aliased by no output.
                got_all = _flat_tensors((ca, ck), [])
                got_in = [t for t in got_all if id(t) not in scalar_ids]
                if len(got_in) != len(got_all) and any(
                        _alias_index(o, [t for t in got_all if id(t) in scalar_ids])
                        for o in _flat_tensors(got, [])):
                    continue
                if not _same_result(out, got, ref_in, got_in):
                    continue
                if not self._same_writes():
                    continue
            except Exception:
                continue
            return fn, tuple(va), vk
        return None


class _Recorder(TorchDispatchMode):
    """Records every aten op of a capture (and runs it, once)."""

    def __init__(self, cap: _Capture):
        super().__init__()
        self.cap = cap

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        cap = self.cap
        kwargs = kwargs or {}
        collective = func.namespace == "c10d"
        try:
            if not collective:
                _check_safe(func, args, kwargs)
            schema = func._schema
            if torch.is_grad_enabled():
                for a in list(args) + list(kwargs.values()):
                    ts = a if isinstance(a, (list, tuple)) else (a,)
                    if any(isinstance(t, torch.Tensor) and t.requires_grad for t in ts):
                        raise CaptureError(
                            f"autograd is recording during tape capture: {func} received a tensor that "
                            f"requires grad while grad mode is enabled (at {_user_frame()}). Graphs are for "
                            "inference: capture under torch.no_grad() or torch.inference_mode()."
                        )
            tags = func.tags
            seeded = torch.Tag.nondeterministic_seeded in tags
            if torch.Tag.inplace_view in tags or func._schema.name in ("aten::set_", "aten::resize_", "aten::resize_as_"):
                cap.meta_mutated = True
            # which arguments does the op write?
            written = []
            mutable = collective or schema.is_mutable
            if mutable:
                for i, a in enumerate(schema.arguments):
                    if not collective and not (a.alias_info is not None and a.alias_info.is_write):
                        continue
                    v = args[i] if i < len(args) else kwargs.get(a.name)
                    for t in v if isinstance(v, (list, tuple)) else (v,):
                        if isinstance(t, torch.Tensor):
                            written.append(t)
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
                verifier = _Verifier(cap, func, args, kwargs, written, fresh)
            if seeded:
                cap.track_generator(_op_generator(args, kwargs))
        except BaseException as e:
            cap.failed = e
            raise
        out = func(*args, **kwargs)
        try:
            op = _Op()
            op.func, op.args, op.kwargs = func, targs, tkwargs
            op.in_names = in_names
            op.in_vers = in_vers
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
            if (op.pure and len(set(in_names)) == 1 and isinstance(op.outs, _Ref) and op.new
                    and isinstance(out, torch.Tensor)):
                src = cap.strong[in_names[0]]
                if (_storage(out) is not None and _storage(src) is not None
                        and _storage(out).data_ptr() == _storage(src).data_ptr()
                        and out.dtype == src.dtype and out.shape == src.shape and out.stride() == src.stride()
                        and out.storage_offset() == src.storage_offset()):
                    op.alias = (op.new[0], in_names[0])
            # Any other view of an internal storage is replayable as one
            # as_strided call on the tensor that allocated that storage: it is
            # cheaper than view / narrow / transpose, and the intermediate
            # views of a chain (view -> transpose -> reshape) become dead code.
            if (op.alias is None and op.pure and len(set(in_names)) == 1 and isinstance(op.outs, _Ref)
                    and op.new and isinstance(out, torch.Tensor) and out.layout == torch.strided
                    and not (out.is_conj() or out.is_neg() or out.is_quantized)):
                k = cap.skey.get(op.new[0])
                base = cap.internal_storages.get(k)
                if base is not None and base != op.new[0] and k in op.in_skeys:
                    b = cap.strong.get(base)
                    if b is not None and b.dtype == out.dtype and not (b.is_conj() or b.is_neg()):
                        op.view = (base, tuple(out.size()), tuple(out.stride()), out.storage_offset())
            if verifier is not None and op.alias is None:
                got = verifier.pick(cap, func, args, kwargs, out)
                if got is not None:
                    fn, cargs, ckwargs = got
                    op.call = fn
                    scratch: list = []  # 0-dim scalar tensors become externals (constants)
                    op.cargs = (cap.template_in(cargs, scratch), {k: cap.template_in(v, scratch)
                                                                  for k, v in ckwargs.items()})
            cap.ops.append(op)
        except BaseException as e:
            cap.failed = e
            raise
        return out


# ---------------------------------------------------------------------------
# code generation


def _literal(v) -> str | None:
    """Source text for a constant that round-trips exactly, else None."""
    if v is None or isinstance(v, (bool, str)):
        return repr(v)
    if isinstance(v, int):
        return repr(v)
    if isinstance(v, float):
        if v != v or v in (float("inf"), float("-inf")):
            return None
        return repr(v)
    if isinstance(v, (tuple, list)):
        parts = [_literal(x) for x in v]
        if any(p is None for p in parts):
            return None
        if isinstance(v, tuple):
            return "(" + "".join(p + ", " for p in parts) + ")"
        return "[" + ", ".join(parts) + "]"
    return None


class _Program:
    """The generated replay function and what it binds."""

    def __init__(self):
        self.env: dict[str, Any] = {}
        self.lines: list[str] = []
        self._consts: dict[int, str] = {}

    def const(self, v, prefix="c") -> str:
        key = id(v)
        n = self._consts.get(key)
        if n is None:
            n = f"{prefix}{len(self.env)}"
            self.env[n] = v
            self._consts[key] = n
        return n

    def build(self) -> Callable[[], None]:
        names = list(self.env)
        body = "\n".join("        " + ln for ln in self.lines) or "        pass"
        # Bound values become closure cells of _replay (LOAD_DEREF: no per-call setup).
        src = f"def _make({', '.join(names)}):\n    def _replay():\n{body}\n    return _replay\n"
        self.source = src
        code = compile(src, "<tape replay>", "exec")
        ns: dict[str, Any] = {}
        exec(code, ns)
        return ns["_make"](**self.env)


# ---------------------------------------------------------------------------
# public API


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
      * ``num_ops`` is the number of aten ops recorded (0 when empty).

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

    def __init__(self, poison_captured_values: bool | None = None):
        self.poison_captured_values: bool = _resolve_poison(poison_captured_values, "TapeGraph")
        self._pool: TapePool | None = None
        self._cap: _Capture | None = None
        self._modes: tuple | None = None
        self._fn: Callable[[], None] | None = None
        self._num_ops = 0
        self._inference = False
        self._statics: list[torch.Tensor] = []
        self._versioned: list[tuple[weakref.ref, int]] = []
        self._surv_storages: list[tuple] = []  # (storage, dtype, computed once) of each survivor, for poisoning
        self._poisoned: dict[int, _Poisoned] = {}  # storage key -> survivor poisoned since capture end
        self.source: str | None = None  # generated replay source, for debugging

    # -- capture ------------------------------------------------------------
    def capture_begin(self, pool: TapePool | None = None, capture_error_mode: str = "global") -> None:
        """Start recording in the calling thread.

        Raises CaptureError if this graph already holds a capture (call
        ``reset()`` first), if this thread is already capturing (captures do
        not nest), or if another thread is capturing and either capture uses
        ``capture_error_mode="global"``. As with CUDA, captures in different
        threads may overlap when both use ``"thread_local"`` or ``"relaxed"``;
        only the calling thread's tensor work is recorded."""
        if capture_error_mode not in _CAPTURE_ERROR_MODES:
            raise ValueError(f"capture_error_mode must be one of {_CAPTURE_ERROR_MODES}, got {capture_error_mode!r}")
        if pool is not None and not isinstance(pool, TapePool):
            raise TypeError(f"pool must be a TapePool from graph_pool_handle() or None, got {type(pool).__name__}")
        if self._cap is not None:
            raise CaptureError("this TapeGraph is already capturing; call capture_end() (or reset()) first")
        if self._fn is not None:
            raise CaptureError("this TapeGraph already holds a capture; call reset() before capturing again")
        cap = _Capture(self, capture_error_mode)
        with _ACTIVE_LOCK:
            if cap.thread in _ACTIVE:
                raise CaptureError(
                    "another TapeGraph capture is active in this thread; tape captures cannot nest. End it "
                    "(capture_end) first."
                )
            other = next(iter(_ACTIVE.values()), None)
            if other is not None and "global" in (capture_error_mode, other.mode):
                raise CaptureError(
                    f"concurrent capture in another thread: thread {other.thread_name!r} is capturing a "
                    f"TapeGraph (capture_error_mode={other.mode!r}), and a capture_error_mode='global' capture "
                    f"cannot overlap another one (this one asked for {capture_error_mode!r}). Capture one "
                    "after the other, or use capture_error_mode='thread_local' (or 'relaxed') for both."
                )
            _ACTIVE[cap.thread] = cap
        try:
            self._pool = pool if pool is not None else (self._pool or TapePool())
            modes = (_reseed_guard(), _Guard(cap), _Recorder(cap))
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
            with _ACTIVE_LOCK:
                if _ACTIVE.get(cap.thread) is cap:
                    del _ACTIVE[cap.thread]
            raise

    def _stop(self) -> _Capture:
        """Leave the modes, restore externals; return the capture state."""
        cap, modes = self._cap, self._modes
        self._cap = self._modes = None
        with _ACTIVE_LOCK:
            if _ACTIVE.get(cap.thread) is cap:
                del _ACTIVE[cap.thread]
        try:
            if modes is not None:
                for m in reversed(modes):
                    m.__exit__(None, None, None)
        finally:
            cap.restore()
            reseeded = cap.restore_generators()
            if reseeded is not None and cap.failed is None:
                cap.failed = reseeded
            for ent in cap.lifted:  # other graphs' survivors: garbage again until those graphs replay
                ent.poison()
            cap.lifted.clear()
        return cap

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
        cap = self._stop()
        if cap.failed is not None:
            self._clear()
            raise CaptureError(f"tape capture failed earlier: {cap.failed}") from cap.failed
        try:
            self._finalize(cap)
        except BaseException:
            self._clear()
            raise
        if not cap.ops and warn_empty:
            warnings.warn(EMPTY_GRAPH_MESSAGE, UserWarning, stacklevel=3)
        targets, self._surv_storages = self._surv_storages, []
        if self.poison_captured_values:
            self._poison(targets)

    def _poison(self, targets: list) -> None:
        """Fill each survivor storage with the poison value of its dtype (the
        whole storage: a survivor view's base too), keeping its real bytes for
        later tape captures that read it and for constants, which replay
        never recomputes."""
        for k in [k for k, w in list(_POISONED.items()) if w() is None]:
            _POISONED.pop(k, None)  # graphs dropped before their first replay
        me = weakref.ref(self)
        for st, dtype, once in targets:
            v = poison_value(dtype)
            if v is None or st.nbytes() < dtype.itemsize:
                continue
            ent = _Poisoned(st, dtype, v, once)
            ent.poison()
            self._poisoned[id(st)] = ent
            _POISONED[id(st)] = me

    def _unpoison(self) -> None:
        """First replay: forget the poisoned storages (replay refreshes them),
        giving constants (not recomputed by replay) their real values back."""
        for k, ent in self._poisoned.items():
            if ent.once:
                ent.lift()
            _POISONED.pop(k, None)
        self._poisoned = {}

    def _abort(self) -> None:
        if self._cap is not None:
            self._stop()
        self._clear()

    def _clear(self) -> None:
        self._fn = None
        self._num_ops = 0
        self._statics = []
        self._versioned = []
        self._surv_storages = []
        for k in self._poisoned:
            _POISONED.pop(k, None)
        self._poisoned = {}
        self.source = None

    def reset(self) -> None:
        """Drop the recording (aborting a capture in progress, undoing its writes
        to externals); the graph can capture again."""
        self._abort()

    def pool(self) -> TapePool:
        """Return this graph's pool handle (opaque; for API parity)."""
        if self._pool is None:
            self._pool = TapePool()
        return self._pool

    @property
    def num_ops(self) -> int:
        """Number of aten ops recorded by the last capture (0 when empty)."""
        return self._num_ops

    # -- replay ---------------------------------------------------------------
    def replay(self) -> None:
        """Re-run the captured ops with autograd off (under inference_mode when
        the capture was).  Raises CaptureError on an empty or capturing graph."""
        fn = self._fn
        if fn is None:
            if self._cap is not None:
                raise CaptureError("cannot replay a TapeGraph while it is capturing; call capture_end() first")
            raise CaptureError("cannot replay an empty TapeGraph: capture something first")
        if self._versioned:
            self._check_versions()
        if self._poisoned:
            self._unpoison()
        # The generated code calls public bindings (torch.mul, Tensor.view, ...):
        # with torch-function handling disabled they go straight to the
        # dispatcher, as the recorded aten ops did (no mode or tensor-subclass
        # __torch_function__ can intercept them).
        with _NO_TORCH_FUNCTION():
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
        if self._versioned:
            self._versioned = [(w, (w()._version if w() is not None else v)) for w, v in self._versioned]

    def _check_versions(self) -> None:
        for w, v in self._versioned:
            t = w()
            if t is not None and t._version != v:
                warnings.warn(
                    "a tensor created inside this TapeGraph's capture (a survivor, refreshed in place at "
                    "each replay) was written by code outside the graph since the last replay; the replay "
                    "overwrites it. Allocate persistent buffers before capture.",
                    EscapedTensorWarning,
                    stacklevel=3,
                )
                break

    # -- capture end: survivors, hoisting, code generation ---------------------
    def _finalize(self, cap: _Capture) -> None:
        ops = cap.ops
        kind = cap.kind
        ext_storages = {cap.skey[n] for n, k in kind.items() if k == "ext"}
        # 1. Hoisting (TAPE-NOTES item 2): a pure op whose inputs are all
        #    externals/constants and whose outputs really share storage with an
        #    input is a view of an external: keep the capture-time tensor.  A
        #    pure factory (no tensor input) is constant if nothing ever writes
        #    its storage.
        for op in ops:
            if not op.pure or not op.new:
                continue
            if any(kind[n] != "ext" and kind[n] != "const" for n in op.in_names):
                continue
            if op.in_names:
                ok = all(k is not None and k in op.in_skeys for k in op.out_skeys)
            else:
                ok = all(k is not None and k not in cap.written for k in op.out_skeys)
            if ok:
                op.fast = "hoisted"
                for n in op.new:
                    kind[n] = "const"
        const_storages = {cap.skey[n] for n, k in kind.items() if k == "const"}
        consts = {n: cap.strong[n] for n, k in kind.items() if k in ("ext", "const")}

        # 2. Survivors (TAPE-NOTES item 7): drop our own references to the
        #    internal tensors and see which storages are still alive.  Keyed by
        #    storage, so a kept view keeps (and refreshes) its base.
        alloc_w = {n: weakref.ref(cap.strong[n]) for n in cap.alloc_meta}
        st_w = {k: weakref.ref(cap.storages[k]) for k in cap.internal_storages}
        int_w = {n: weakref.ref(t) for n, t in cap.strong.items() if kind[n] == "int"}
        cap.strong.clear()
        cap.storages.clear()
        cap.names.clear()
        survivors: dict[str, torch.Tensor] = {}  # allocating name -> static tensor
        versioned = []
        for k, alloc in cap.internal_storages.items():
            st = st_w[k]()
            if st is None:
                continue
            # every survivor (a hoisted constant too) is registered for item 8
            _SURVIVORS[k] = (weakref.ref(st), weakref.ref(self))
            self._surv_storages.append((st, cap.alloc_meta[alloc][0], k in const_storages))
            if k in const_storages:
                continue  # computed once at capture, nothing to refresh
            t = alloc_w[alloc]()
            if t is None:  # only a view survives: rebuild the allocating tensor on the storage
                dtype, device, size, stride, off = cap.alloc_meta[alloc]
                with torch.inference_mode(cap.inference):
                    t = torch.empty(0, dtype=dtype, device=device).set_(st, off, size, stride)
            survivors[alloc] = t
            if not t.is_inference():
                # remember one user-visible tensor per storage to detect outside writes
                for n, w in int_w.items():
                    u = w()
                    if u is not None and cap.skey[n] == k and not u.is_inference():
                        versioned.append((w, u._version))
                        break
        del st_w, alloc_w
        for k in [k for k, (w, _) in list(_SURVIVORS.items()) if w() is None]:
            _SURVIVORS.pop(k, None)

        # 3. Aliases and common subexpressions.  canon maps a value's name to
        #    the name of an equal value computed earlier.
        canon: dict[str, str] = {}

        def cn(n: str) -> str:
            while n in canon:
                n = canon[n]
            return n

        def unify(later: str, earlier: str) -> None:
            a, b = cn(later), cn(earlier)
            if a != b:
                canon[a] = b

        surv_storages = {k for k, alloc in cap.internal_storages.items() if alloc in survivors}
        if not cap.meta_mutated:  # an in-place metadata change (unsqueeze_, ...) breaks "same metadata"
            # Externals / hoisted views that are the same view of the same
            # storage (e.g. `positions[:, None]` taken in every layer) are
            # interchangeable: one name, so that CSE sees equal inputs.
            by_meta: dict[tuple, str] = {}
            for n, t in consts.items():
                if type(t) is torch.Tensor and t.layout == torch.strided and cap.skey.get(n) is not None:
                    mk = (cap.skey[n], t.dtype, t.device, tuple(t.shape), t.stride(), t.storage_offset(),
                          t.is_inference())
                    unify(n, by_meta.setdefault(mk, n))
            # Hoisted ops repeating an earlier hoisted op (the same constant
            # factory, e.g. `torch.arange(L)` in every layer, or the same view)
            # give equal constants: never written, so one will do.
            seen_h: dict[tuple, _Op] = {}
            for op in ops:
                if op.fast != "hoisted":
                    continue
                try:
                    first = seen_h.setdefault((op.func, _key(op.args, cn), _key(op.kwargs, cn)), op)
                except TypeError:
                    continue
                if first is not op and len(first.new) == len(op.new):
                    for a, b in zip(op.new, first.new):
                        unify(a, b)
            for op in ops:
                if op.fast is None and op.alias is not None:
                    out_n, in_n = op.alias
                    op.fast = "alias"
                    unify(out_n, in_n)
        # CSE: a pure op repeating an earlier one (same op, same inputs not
        # written in between, same literal arguments) reuses its result, unless
        # a result is written later (then the two differ) or survives.
        seen: dict[tuple, _Op] = {}
        for op in ops:
            if op.fast is not None or not op.pure or not op.new or torch.Tag.nondeterministic_bitwise in op.func.tags:
                continue
            refs = [r.name for _, r in _ref_paths(op.outs)]
            if refs != op.new or any(
                k is None or k in surv_storages or (k in cap.internal_storages and k in cap.written)
                for k in op.out_skeys
            ):
                continue
            try:
                key = (op.func, _key(op.args, cn), _key(op.kwargs, cn), op.in_vers)
                first = seen.setdefault(key, op)
            except TypeError:  # an unhashable argument
                continue
            if first is not op:
                op.fast = "cse"
                for a, b in zip(op.new, first.new):
                    unify(a, b)

        # Views of internal storages -> as_strided on the allocating tensor (its
        # layout is the same at every replay, shapes being frozen).  Not after
        # set_ / resize_, which can swap a storage.
        if not cap.meta_mutated:
            for op in ops:
                if op.fast is None and op.view is not None:
                    base, size, stride, offset = op.view
                    op.call = _VF.as_strided
                    op.cargs = ((_Ref(base), size, stride, offset), {})
                    op.in_names = [base]

        # 4. Dead-code elimination: keep ops with effects, ops producing
        #    survivors, and ops whose outputs feed kept ops.
        keep = [False] * len(ops)
        needed: set[str] = set()
        for i in range(len(ops) - 1, -1, -1):
            op = ops[i]
            if op.fast is not None:
                continue
            live = (not op.pure) or any(n in needed or n in survivors for n in op.new)
            if live and op.pure and not op.new:
                live = False  # returns its input unchanged (e.g. .to() no-op)
            if live:
                keep[i] = True
                needed.update(cn(n) for n in op.in_names)

        # 5. Generate straight-line code.
        prog = _Program()
        ref_expr: dict[str, str] = {}
        for n, t in consts.items():
            ref_expr[n] = prog.const(t, "k")
        static_names = {}
        for n, t in survivors.items():
            static_names[n] = prog.const(t, "s")
        last_use: dict[str, int] = {}
        for i, op in enumerate(ops):
            if keep[i]:
                for n in op.in_names:
                    last_use[cn(n)] = i

        def expr(v) -> str:
            if isinstance(v, _Ref):
                return ref_expr[cn(v.name)]
            lit = _literal(v)
            if lit is not None:
                return lit
            if isinstance(v, (list, tuple)):
                if v and all(isinstance(x, _Ref) and cn(x.name) in consts for x in v):
                    # only constants: build the list once (ops do not modify their list arguments)
                    return prog.const(type(v)(consts[cn(x.name)] for x in v))
                inner = ", ".join(expr(x) for x in v)
                return f"[{inner}]" if isinstance(v, list) else f"({inner},)"
            return prog.const(v)

        n_ops = 0
        for i, op in enumerate(ops):
            if not keep[i]:
                continue
            n_ops += 1
            if op.call is not None:
                f = prog.const(op.call, "f")
                cargs, ckwargs = op.cargs
            else:
                f = prog.const(op.func._op, "f")
                cargs, ckwargs = op.args, op.kwargs
            call = f"{f}(" + ", ".join(
                [expr(a) for a in cargs] + [f"{k}={expr(v)}" for k, v in ckwargs.items()]
            ) + ")"
            lines = prog.lines
            newset = set(op.new)
            paths = list(_ref_paths(op.outs))
            if op.collective:
                lines.append(f"_o = {call}")
                for path in _work_paths(op.outs):
                    lines.append(f"_o{path}.wait()")
                bind_src = "_o"
            elif not newset:
                lines.append(call)
                bind_src = None
            elif isinstance(op.outs, _Ref):
                lines.append(f"{op.outs.name} = {call}")
                bind_src = None
            elif isinstance(op.outs, (list, tuple)) and all(isinstance(x, _Ref) for x in op.outs):
                # a flat tuple of tensors: unpack in one statement
                lhs = [x.name if x.name in newset else "_" for x in op.outs]
                lines.append(", ".join(lhs) + (", = " if len(lhs) == 1 else " = ") + call)
                bind_src = None
            else:
                lines.append(f"_o = {call}")
                bind_src = "_o"
            if bind_src is not None:
                for path, ref in paths:
                    if ref.name in newset:
                        lines.append(f"{ref.name} = {bind_src}{path}")
            for n in op.new:
                if n in static_names:
                    s = static_names[n]
                    lines.append(f"{s}.copy_({n})")
                    ref_expr[n] = s
                    lines.append(f"del {n}")
                else:
                    ref_expr[n] = n
            dead = [cn(n) for n in set(op.in_names) if last_use.get(cn(n)) == i and ref_expr.get(cn(n)) == cn(n)]
            dead += [n for n in op.new if ref_expr[n] == n and n not in last_use]
            if dead:
                lines.append("del " + ", ".join(sorted(set(dead))))
            if bind_src == "_o":
                lines.append("del _o")
        self._fn = prog.build()
        self.source = prog.source
        self._env = prog.env
        self._num_ops = len(ops)
        self._num_replayed = n_ops
        self._inference = cap.inference
        self._statics = list(survivors.values())
        self._versioned = versioned
        logger.debug(
            "tape capture: %d ops recorded, %d replayed, %d survivors, %d externals",
            len(ops), n_ops, len(survivors), sum(1 for k in kind.values() if k == "ext"),
        )

    @property
    def num_replayed_ops(self) -> int:
        """Ops the generated replay function runs (after hoisting and dead-code elimination)."""
        return getattr(self, "_num_replayed", 0) if self._fn is not None else 0


def _key(v, cn):
    """Hashable form of an argument template (names through ``cn``); floats by
    repr so that 0.0 / -0.0 and NaNs stay distinct.  TypeError if unhashable."""
    if isinstance(v, _Ref):
        return ("R", cn(v.name))
    if isinstance(v, float):
        return ("F", repr(v))
    if isinstance(v, (list, tuple)):
        return (type(v).__name__,) + tuple(_key(x, cn) for x in v)
    if isinstance(v, dict):
        return ("D",) + tuple((k, _key(x, cn)) for k, x in v.items())
    hash(v)
    return (type(v).__name__, v)


def _ref_paths(v, path=""):
    if isinstance(v, _Ref):
        yield path, v
    elif isinstance(v, (list, tuple)):
        for i, x in enumerate(v):
            yield from _ref_paths(x, f"{path}[{i}]")


def _work_paths(v, path=""):
    # outputs of c10d ops that are not tensors are Work objects (recorded as None)
    if isinstance(v, (list, tuple)):
        for i, x in enumerate(v):
            if x is None:
                yield f"{path}[{i}]"
            elif isinstance(x, (list, tuple)):
                yield from _work_paths(x, f"{path}[{i}]")


def tape_graph(
    graph: TapeGraph, pool: TapePool | None = None, stream: Any = None, capture_error_mode: str = "global"
) -> "contextlib.AbstractContextManager[TapeGraph]":
    """Capture the body into ``graph`` (mirrors ``torch.cuda.graph``).

    ``stream`` is accepted for API parity and ignored.  If the body raises, the
    capture is aborted (no mode stays active, writes to externals and
    generator states are restored, the graph is left empty) and the exception
    propagates unchanged; the next capture works normally.  An empty body
    warns as :meth:`TapeGraph.capture_end` does.
    """
    return _capturing(graph, pool, capture_error_mode, warn_empty=True)


@contextlib.contextmanager
def _capturing(graph: TapeGraph, pool: TapePool | None, capture_error_mode: str,
               warn_empty: bool) -> Iterator[TapeGraph]:
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
