"""Fast replay calls: public bindings verified against the recorded aten op.

Owns the choice, made once per recorded op at capture, of what the generated
replay calls: the public C binding (``torch.mul``, ``Tensor.view``, ...) or a
cheaper rewrite (``slice`` -> ``torch.narrow``, ``linear`` -> ``matmul`` with
the weight transposed once), with Python scalars as shared 0-dim tensors,
kept only when its result is bit-identical to the aten op's on the capture's
data (:class:`Verifier`).  Anything else replays through the aten op.  A
rewrite that computes values with another call (``linear`` as ``matmul``, a
composite's ``out=`` form) must also be proven equal on random data
(:func:`graphrunner.tape.proof.proven`, the gate of every rewrite).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from .proof import bits_equal, eager_context, equal_ints, proven
from .state import give_back_scratch, scratch_storage, storage_bytes, storage_of
from .survivors import poison_value


class VerifiedCapture(Protocol):
    """What :class:`Verifier` reads of the capture it verifies a call for
    (:class:`graphrunner.tape.recording.TapeCapture`, which sits above this module)."""

    names: dict[int, str]  #: id(tensor) -> name
    kind: dict[str, str]  #: name -> "ext" | "int"
    scalars: dict[tuple, torch.Tensor]  #: Python scalar -> shared 0-dim tensor
    inference: bool
    tls: tuple

    def scalar_tensor(self, v, dtype=None) -> torch.Tensor:
        """One shared 0-dim tensor per Python scalar and dtype."""
        ...


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

NO_TORCH_FUNCTION = torch._C.DisableTorchFunction
VF = torch._C._VariableFunctions
_NN = torch._C._nn
_TB = torch._C.TensorBase
_BUILTIN_TYPES = ("builtin_function_or_method", "method_descriptor")
_BINDINGS: dict[Any, tuple] = {}
_use_count = getattr(torch._C, "_storage_Use_Count", None)  # tensors holding a storage
#: Binding candidates answered by :class:`_SameCall` (the binding dispatched the recorded call itself,
#: nothing computed again) and those computed and compared on the capture's data: ``[same_call, computed]``,
#: for tests and the capture profile.
SAME_CALL_STATS = [0, 0]
# Ops writing a storage larger than this (a KV cache, ...) replay through the
# aten op: verifying a binding needs a copy of every storage it writes, which
# would cost more capture time (and memory) than the ~1 us per call it saves.
_MAX_TWIN_BYTES = 1 << 20


def _bindings(func) -> tuple:
    """Public C bindings named like aten op ``func`` (in-place ops: Tensor methods only)."""
    got = _BINDINGS.get(func)
    if got is None:
        name = func._schema.name.split("::", 1)[-1]
        found: list = []
        if func.namespace == "aten":
            for src in (_TB,) if name.endswith("_") else (VF, _NN, _TB):
                c = getattr(src, name, None)
                if c is not None and type(c).__name__ in _BUILTIN_TYPES and c not in found:
                    found.append(c)
        got = _BINDINGS[func] = tuple(found)
    return got


_bits_equal = bits_equal


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
    st = storage_of(t)
    if st is None or st.nbytes() == 0:
        return ()
    p = st.data_ptr()
    out = []
    for i, x in enumerate(inputs):
        xs = storage_of(x)
        if xs is not None and xs.nbytes() and xs.data_ptr() == p:
            out.append(i)
    return tuple(out)


def _same_result(ref, got, ref_in: list, got_in: list) -> bool:
    """``got`` (binding result on ``got_in``) is indistinguishable from ``ref``
    (aten result on ``ref_in``): structure, metadata, bits and aliasing."""
    if isinstance(ref, torch.Tensor):
        if type(got) is not type(ref):
            return False
        if (
            got.dtype != ref.dtype
            or got.device != ref.device
            or got.layout != ref.layout
            or ref.layout != torch.strided
            or got.shape != ref.shape
            or got.stride() != ref.stride()
            or got.storage_offset() != ref.storage_offset()
            or got.is_inference() != ref.is_inference()
            or got.requires_grad != ref.requires_grad
        ):
            return False
        if _alias_index(ref, ref_in) != _alias_index(got, got_in):
            return False
        return _bits_equal(ref, got)
    if isinstance(ref, (list, tuple)):
        return (
            isinstance(got, (list, tuple))
            and len(got) == len(ref)
            and all(_same_result(r, g, ref_in, got_in) for r, g in zip(ref, got))
        )
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
    return [(VF.narrow, [x, dim, start, out.size(dim)], {})]


def _linear_as_matmul(args, kwargs, out):
    """aten.linear(x, w) without bias as torch.matmul(x, w.t()), with w.t() taken
    once at capture (linear re-derives it at every call).  Only for an external
    weight (checked by the caller): the view then stays valid at replay."""
    x, w = args[0], args[1]
    bias = args[2] if len(args) > 2 else kwargs.get("bias")
    if bias is not None or w.dim() != 2:
        return []
    return [(VF.matmul, [x, w.t()], {})]


# Ops without a public binding of their own name: functions returning
# [(binding, args, kwargs)] to try first (verified like the others).
_REWRITES: dict[Any, Callable] = {
    torch.ops.aten.slice.Tensor: _slice_as_narrow,
    torch.ops.aten.linear.default: _linear_as_matmul,
}
# rewrites that take a view of an argument at capture: only when that argument is external
_REWRITE_NEEDS_EXTERNAL = {torch.ops.aten.linear.default: 1}


class _NotTheCall(Exception):
    """A binding dispatched something other than the recorded call (see :class:`_SameCall`)."""


def _same_value(a, b) -> bool:
    """``a`` and ``b`` are the same argument: the same tensor object, or equal values of the same type
    (lists and tuples element by element)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return a is b
    if type(a) is not type(b):
        return False
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same_value(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same_value(a[k], b[k]) for k in a)
    return a == b


def _meta(v):
    """What a binding could change on a returned tensor without dispatching an op."""
    if isinstance(v, torch.Tensor):
        return (v.dtype, v.shape, v.stride(), v.storage_offset(), v.requires_grad, v.is_inference())
    if isinstance(v, (list, tuple)):
        return tuple(_meta(x) for x in v)
    return None


def _same_objects(a, b) -> bool:
    """``b`` is ``a`` itself (a tensor), or the same container of the same objects."""
    if isinstance(a, (list, tuple)):
        return type(b) is type(a) and len(a) == len(b) and all(_same_objects(x, y) for x, y in zip(a, b))
    return a is b


class _SameCall(TorchDispatchMode):
    """Proof that a binding *is* the recorded aten call, without computing it again.

    Active (innermost) around one call of the binding: the first op the binding dispatches must be
    the recorded ``func`` on the very same arguments (the same tensor objects, equal non-tensor values
    of the same types), and it is answered with the capture's own result ``out``; any other op, or a
    second one, raises :class:`_NotTheCall` before anything runs. When the binding then returns
    ``out`` itself, unchanged, it runs the recorded aten call and nothing else, so at replay it
    computes what the aten op computes, on any data: the comparison on the capture's data (a second
    run of the op and a comparison of its bits) would only repeat that."""

    def __init__(self, func, args, kwargs, out):
        super().__init__()
        self.func, self.args, self.kwargs, self.out = func, args, kwargs, out
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls += 1
        if (
            self.calls == 1
            and func is self.func
            and _same_value(tuple(args), tuple(self.args))
            and _same_value(dict(kwargs or {}), dict(self.kwargs))
        ):
            return self.out
        raise _NotTheCall(func)


#: The bytes an op reads and returns from which a binding is first asked to prove itself the recorded
#: call (:class:`_SameCall`, about 25-50 us) rather than computed again and compared (a few us for a
#: small op, milliseconds for an attention's scores). Either way decides the same (see ``pick``).
_SAME_CALL_MIN_BYTES = 128 << 10


def _bytes_touched(out, inputs: list) -> int:
    """The bytes of ``out``'s tensors and of ``inputs`` (their extents: a cost estimate, not memory)."""
    return sum(t.numel() * t.element_size() for t in _flat_tensors(out, list(inputs)))


def _is_same_call(fn, va, vk, func, args, kwargs, out) -> bool:
    """``fn(*va, **vk)`` dispatches exactly ``func(*args, **kwargs)`` and returns its result ``out`` as
    it is (:class:`_SameCall`); computes nothing."""
    if not isinstance(out, (torch.Tensor, list, tuple)):
        return False
    before = _meta(out)
    mode = _SameCall(func, args, kwargs, out)
    try:
        with mode, torch._C.DisableTorchFunction():
            got = fn(*va, **vk)
    except Exception:  # _NotTheCall, or the binding refused its arguments: not proven this way
        return False
    return mode.calls == 1 and _same_objects(out, got) and _meta(out) == before


class Verifier:
    """Prepared before an aten op runs (copies of the storages it writes), then
    asked after it ran for the fastest binding computing the same thing."""

    def __init__(self, cap: VerifiedCapture, func, args, kwargs, written: list, fresh: dict):
        self.ok = False
        self.out_ok = False  # the picked binding also takes a preplanned out= buffer (see _out_ok)
        self.twin_st: dict[int, tuple] = {}  # storage key -> (storage, its bytes before the op)
        self.work: dict[int, torch.Tensor] = {}
        if func.namespace != "aten" or not (_bindings(func) or func in _REWRITES):
            return
        for t in written:
            st = storage_of(t)
            if st is None or st.nbytes() > _MAX_TWIN_BYTES:
                return
            k = id(st)
            if k not in self.twin_st:
                b = fresh.get(k)  # the capture's snapshot, taken just now (never modified)
                if b is None:
                    with torch.inference_mode():
                        b = storage_bytes(st).clone()
                self.twin_st[k] = (st, b)
        self.ok = True

    def _twin(self, v):
        """``v`` with every tensor on a written storage replaced by the same view of its copy."""
        if isinstance(v, torch.Tensor):
            st = storage_of(v)
            work = self.work.get(id(st)) if st is not None else None
            if work is None:
                return v
            with torch.inference_mode(v.is_inference()), torch.no_grad():
                return torch.empty(0, dtype=v.dtype, device=v.device).set_(
                    work.untyped_storage(), v.storage_offset(), v.size(), v.stride()
                )
        if isinstance(v, (list, tuple)):
            return type(v)(self._twin(x) for x in v)
        if isinstance(v, dict):
            return {k: self._twin(x) for k, x in v.items()}
        return v

    def _same_writes(self) -> bool:
        """Every written storage holds the same bytes as its copy written by the binding."""
        with torch.inference_mode():
            for k, (st, _) in self.twin_st.items():
                real = storage_bytes(st)
                if not equal_ints(real, self.work[k]):
                    return False
        return True

    def pick(self, cap: VerifiedCapture, func, args, kwargs, out, plannable: bool = True):
        """Return (binding, args, kwargs) verified equal to ``func`` on this data, or None. ``plannable``:
        whether a preplanned buffer may stand in for ``out`` (:meth:`TapeCapture.owns_storage
        <graphrunner.tape.recording.TapeCapture.owns_storage>`); only then is the binding's ``out=``
        form checked (:attr:`out_ok`), since no other result is ever given one."""
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
        dtypes: list[torch.dtype | None] = []
        if slots and res is not None:
            dt = res.dtype
            if dt in (torch.float16, torch.bfloat16):
                dt = torch.float32
            if dt.is_floating_point or (
                not dt.is_complex and dt != torch.bool and all(isinstance(v, int) for _, v in slots)
            ):
                dtypes.append(dt)
        if slots:
            dtypes += [None]  # None: float64 / int64, like a wrapped scalar
        for sdt in dict.fromkeys(dtypes):
            sargs, skw = list(args), dict(kwargs)
            for key, v in slots:
                t = cap.scalar_tensor(v, sdt)
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
        n_rewrites = 0
        if rewrite is not None:
            try:
                with eager_context(cap.tls):  # views taken here as eager takes them (requires_grad kept)
                    rw = rewrite(args, kwargs, out)
                tries[:0] = rw
                n_rewrites = len(rw)
            except Exception:
                pass
        ref_in = _flat_tensors((args, kwargs), [])
        scalar_ids = {id(t) for t in cap.scalars.values()}
        # the arguments as recorded (the last variant): a binding may be proven to be the recorded call itself,
        # for an op big enough that running it again costs more than the proof (about 25-50 us)
        exact = variants[-1] if not self.twin_st and _bytes_touched(out, ref_in) >= _SAME_CALL_MIN_BYTES else None
        for i_try, (fn, va, vk) in enumerate(tries):
            if (
                exact is not None
                and i_try >= n_rewrites
                and va is exact[0]
                and vk is exact[1]
                and _is_same_call(fn, va, vk, func, args, kwargs, out)
            ):
                SAME_CALL_STATS[0] += 1
                self.out_ok = plannable and _out_same_kernel(func, fn) and self._out_ok(fn, va, vk, out)
                self.out_ok = self.out_ok and (not _needs_proof(func, fn) or self._proven_out(fn, va, vk, out, cap))
                return fn, tuple(va), vk
            SAME_CALL_STATS[1] += 1
            try:
                if self.twin_st:
                    # a fresh copy of the written storages, as they were before the op
                    with torch.inference_mode():
                        self.work = {k: b.clone() for k, (_, b) in self.twin_st.items()}
                    ca, ck = self._twin(va), self._twin(vk)
                else:  # the op writes nothing: the arguments as they are (what _twin would give)
                    ca, ck = va, vk
                with torch._C.DisableTorchFunction():
                    got = fn(*ca, **ck)
                # Inputs in the same order as ref_in: our 0-dim scalars (Python
                # numbers in the aten call) left out, and aliased by no output.
                got_all = _flat_tensors((ca, ck), [])
                got_in = [t for t in got_all if id(t) not in scalar_ids]
                if len(got_in) != len(got_all) and any(
                    _alias_index(o, [t for t in got_all if id(t) in scalar_ids]) for o in _flat_tensors(got, [])
                ):
                    continue
                if not _same_result(out, got, ref_in, got_in):
                    continue
                if not self._same_writes():
                    continue
                if (
                    i_try < n_rewrites
                    and isinstance(out, torch.Tensor)
                    and not _alias_index(out, ref_in)
                    and not self._proven_rewrite(cap, func, args, kwargs, fn, ca, ck, ref_in)
                ):
                    continue
            except Exception:
                continue
            self.out_ok = plannable and _out_same_kernel(func, fn) and self._out_ok(fn, ca, ck, out)
            self.out_ok = self.out_ok and (not _needs_proof(func, fn) or self._proven_out(fn, ca, ck, out, cap))
            return fn, tuple(va), vk
        return None

    def _proven_rewrite(self, cap, func, args, kwargs, fn, ca, ck, ref_in) -> bool:
        """A rewrite computing values (not a view), equal to the aten op on
        the capture's data (just compared), proven equal on random data too."""

        def recorded(tw):
            return func(*tw(args), **tw(kwargs))

        def rewritten(tw):
            return fn(*tw(ca), **tw(ck))

        return proven(
            recorded,
            rewritten,
            ref_in,
            capture=False,
            inference=cap.inference,
            tls=cap.tls,
            memo=("rewrite", func, fn, args, kwargs, ca, ck),
        )

    def _proven_out(self, fn, ca, ck, out, cap) -> bool:
        """``fn(..., out=buf)`` of a composite ``fn``, equal to ``fn(...)`` on the
        capture's data (just compared), proven equal on random data too."""
        with torch.inference_mode(out.is_inference()):
            buf = torch.empty_strided(out.size(), out.stride(), dtype=out.dtype, device=out.device)

        def functional(tw):
            return tw(buf).copy_(fn(*tw(ca), **tw(ck)))

        def into_buffer(tw):
            fn(*tw(ca), **tw(ck), out=tw(buf))
            return tw(buf)

        return proven(
            functional,
            into_buffer,
            _flat_tensors((ca, ck), []),
            [buf],
            capture=False,
            inference=cap.inference,
            tls=cap.tls,
            memo=("out", fn, ca, ck, buf),
        )

    def _out_ok(self, fn, ca, ck, out) -> bool:
        """``fn(*ca, **ck, out=buf)`` writes ``out``'s bits into a preplanned
        ``buf`` of ``out``'s metadata (prefilled with poison, so that a kernel
        reading its output is caught), keeping ``buf`` where it is.  Only for
        functions of the torch / torch._C._nn namespaces, ops writing nothing,
        and a plain strided tensor result that owns its storage from offset 0."""
        if (
            self.twin_st
            or "out" in ck
            or not isinstance(out, torch.Tensor)
            or type(out) is not torch.Tensor
            or out.layout != torch.strided
            or out.requires_grad
            or out.storage_offset() != 0
            or out.is_conj()
            or out.is_neg()
            or out.is_quantized
            or not _is_function(fn)
        ):
            return False
        # buf's memory: scratch reused within a capture session (no page faults), prefilled all the same
        st = scratch_storage(_extent_bytes(out), out.device)
        buf: torch.Tensor | None = None  # (dropped below, before the storage's use count is read)
        try:
            with torch.inference_mode(out.is_inference()):
                buf = torch.empty(0, dtype=out.dtype, device=out.device).set_(st, 0, out.size(), out.stride())
                v = poison_value(out.dtype)
                if v is not None and buf.numel():
                    buf.fill_(v)
            ptr, size, stride = buf.data_ptr(), buf.size(), buf.stride()
            with torch._C.DisableTorchFunction():
                got = fn(*ca, **ck, out=buf)
            ok = (
                got is buf
                and buf.data_ptr() == ptr
                and buf.size() == size
                and buf.stride() == stride
                and _bits_equal(buf, out)
            )
        except Exception:
            ok = False
        got = buf = None
        if _use_count is not None and _use_count(st._cdata) == 1:  # no tensor left on it
            give_back_scratch(st)
        return ok


def _extent_bytes(t: torch.Tensor) -> int:
    """Bytes a tensor of ``t``'s size and strides spans from offset 0."""
    if t.numel() == 0:
        return 0
    return (1 + sum((n - 1) * s for n, s in zip(t.size(), t.stride()))) * t.element_size()


def _is_function(fn) -> bool:
    """``fn`` is a function of torch._C._VariableFunctions or torch._C._nn (these take ``out=``)."""
    name = getattr(fn, "__name__", None)
    return name is not None and (fn is getattr(VF, name, None) or fn is getattr(_NN, name, None))


# Composite bindings whose out= variant runs the very kernels of the functional
# one (matmul and matmul_out share at::native::_matmul_impl).
_OUT_SAME_PATH = {"matmul"}


def _needs_proof(func, fn) -> bool:
    """Replacing ``fn(...)`` by ``fn(..., out=)`` is a rewrite to prove
    (:mod:`~graphrunner.tape.proof`) unless ``fn`` is the binding of
    ``func`` itself and ``func`` has a kernel of its own (functional and
    ``out=`` forms of a structured kernel share one implementation)."""
    if getattr(fn, "__name__", None) != func._schema.name.split("::", 1)[-1]:
        return True
    return _composite(func)


def _composite(func) -> bool:
    """``func`` is a CompositeImplicitAutograd decomposition (no kernel of its own); asked of the
    dispatcher once per op (twice per recorded op otherwise, a measurable share of the capture)."""
    got = _COMPOSITE.get(func)
    if got is None:
        got = _COMPOSITE[func] = torch._C._dispatch_has_kernel_for_dispatch_key(
            func.name(), "CompositeImplicitAutograd"
        )
    return got


_COMPOSITE: dict = {}


def _out_same_kernel(func, fn) -> bool:
    """``fn(..., out=)`` computes with the kernel ``fn(...)`` uses, so that a
    result equal on the capture's data is equal on any data: ``fn`` is the
    binding of ``func`` itself and ``func`` has a kernel of its own (not a
    CompositeImplicitAutograd decomposition, whose out= path may differ:
    ``linear(x, w, b, out=)`` is matmul then add, ``linear(x, w, b)`` one
    addmm), or ``fn`` is in ``_OUT_SAME_PATH``."""
    name = getattr(fn, "__name__", None)
    if name in _OUT_SAME_PATH:
        return True
    if name != func._schema.name.split("::", 1)[-1]:
        return False
    return not _composite(func)
