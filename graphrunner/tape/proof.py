"""Rewrites proven bit-equal to the call they replace, by measurement.

Owns the one gate every rewrite of the tape goes through (:func:`proven`):
a call the generated replay makes *instead of* the call that was recorded
(a composite collapsed to the kernel it reaches, :mod:`~graphrunner.tape.collapse`;
``linear(x, w)`` replayed as ``matmul(x, w.t())`` and a composite's ``out=``
form, :mod:`~graphrunner.tape.bindings`) is kept only when it leaves the same
bits as the call it replaces

* on the capture's own data: the inputs' values at capture (the weights and
  caches as they are, the values a temporary held when the op ran, where the
  recording kept them), and
* on fresh random data (:data:`RANDOM_TRIALS` draws): every input storage
  filled anew (floating: normal; integers: ``[0, 4)``; bool: 0/1), with
  the same shapes, dtypes, strides and aliasing,

where "the same bits" means the same result (dtype, shape, strides, bytes)
and the same bytes in every storage either call writes (its ``out=``
buffer), each call running on its own copy of those storages, prefilled
alike.  Anything else, an exception included, drops the rewrite: the graph
replays the recorded call.

Why measure: a rewrite is derived from what a composite *would* do, and that
derivation can be wrong.  The tape finds a composite's kernel by logging it
under a dispatch mode, where ``matmul`` runs its Python decomposition; for a
``[B, 1, C]`` input with strides ``(C, 1, 1)`` (``x.unsqueeze(-1).transpose(1, 2)``)
that decomposition folds to ``mm`` while eager's C++ ``matmul`` runs ``bmm``:
another summation order, other bits (issue 21).  The calls run here outside
every dispatch mode, as eager and replay run them, with the generator of the
proof's own (the global RNG is not touched), under the capture's
``inference_mode`` and dispatch-key state (:func:`eager_tls`): a proof made
inside the recorder's handler would otherwise run below autograd, where a
view of a weight does not require grad and ``matmul`` takes another path
than in eager (it folds a batch into ``mm`` for a weight that requires grad).

:data:`stats` counts proofs, refusals and the seconds spent, per thread
(``TapeGraph.rewrite_proofs`` gives one capture's share).
"""

from __future__ import annotations

import contextlib
import ctypes
import struct
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.utils._python_dispatch import _disable_current_modes

from .state import in_session, on_session_end, storage_bytes, storage_of
from .survivors import poison_value

# Off only in negative-control tests: every rewrite is then taken on trust.
ENABLED = True
# Draws of fresh random data per proof (besides the capture's own data).
RANDOM_TRIALS = 1
# Random integers are drawn from [0, _INT_HIGH): valid as small indices and counts.
_INT_HIGH = 4
_SEED = 0x7A9E

_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


_PY_KEYS = tuple(
    getattr(torch._C.DispatchKey, k)
    for k in ("Python", "PythonTLSSnapshot", "PreDispatch")
    if hasattr(torch._C.DispatchKey, k)
)


def eager_tls() -> tuple:
    """The calling context's thread-local dispatch key sets, less the keys
    of Python dispatch modes: the context eager code (and replay) runs in.
    Take it outside any mode's handler (at capture begin)."""
    inc = torch._C._dispatch_tls_local_include_set()
    for k in _PY_KEYS:
        inc = inc.remove(k)
    return inc, torch._C._dispatch_tls_local_exclude_set()


def eager_context(tls: tuple | None):
    """Run in dispatch-key state ``tls`` (from :func:`eager_tls`), e.g. from
    inside a dispatch mode's handler, where the keys above Python are off."""
    return torch._C._ForceDispatchKeyGuard(*tls) if tls is not None else contextlib.nullcontext()


class _Stats(threading.local):
    """Proofs run, rewrites refused and seconds spent, in this thread."""

    def __init__(self):
        self.proofs = 0
        self.refused = 0
        self.seconds = 0.0
        self.reused = 0  # proofs whose random trials were answered by the session's memo (_MEMO)

    def snapshot(self) -> tuple:
        return (self.proofs, self.refused, self.seconds)


stats = _Stats()


def _load_memcmp():
    try:
        fn = ctypes.CDLL(None).memcmp
    except (OSError, AttributeError, TypeError):  # no C library to load by name (Windows): torch.equal
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
    fn.restype = ctypes.c_int
    return fn


_MEMCMP = _load_memcmp()
_MEMCMP_MIN_BYTES = 4096  # below, torch.equal costs what memcmp does


def equal_ints(a: torch.Tensor, b: torch.Tensor) -> bool:
    """``torch.equal(a, b)`` for tensors of one integer dtype (bitwise equality): on CPU, for two
    contiguous tensors of the same shape and dtype, a ``memcmp`` of their bytes (3-9x faster than
    ``torch.equal``'s element loop on large tensors; the capture compares every op's results
    this way); otherwise ``torch.equal`` itself."""
    if (
        _MEMCMP is not None
        and a.dtype == b.dtype
        and not a.dtype.is_floating_point
        and not a.is_complex()
        and a.dtype != torch.bool
        and a.device.type == "cpu"
        and b.device.type == "cpu"
        and a.shape == b.shape
        and a.layout == torch.strided
        and b.layout == torch.strided
        and not (a.is_neg() or b.is_neg() or a.is_conj() or b.is_conj())
        and a.is_contiguous()
        and b.is_contiguous()
    ):
        n = a.numel() * a.element_size()
        if n >= _MEMCMP_MIN_BYTES:
            return _MEMCMP(a.data_ptr(), b.data_ptr(), n) == 0
    return torch.equal(a, b)


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
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
    return equal_ints(a, b)


def _key(t: torch.Tensor):
    st = storage_of(t)
    if st is None or st.nbytes() == 0:
        return None
    return (st.device, st.data_ptr())


class _Twins:
    """Copies of some storages, and the map of a tensor (or a nest of them)
    to the same view (size, strides, offset, dtype) of its storage's copy;
    tensors on other storages map to themselves."""

    def __init__(self, storages: dict):
        self.st = storages  # key -> twin untyped storage

    def __call__(self, v):
        if isinstance(v, torch.Tensor):
            k = _key(v)
            twin = self.st.get(k) if k is not None else None
            if twin is None:
                return v
            with torch.inference_mode(v.is_inference()), torch.no_grad():
                t = torch.empty(0, dtype=v.dtype, device=v.device).set_(twin, v.storage_offset(), v.size(), v.stride())
            # requires_grad steers kernels (matmul folds a batch into mm for a weight that requires grad)
            return t.requires_grad_() if v.requires_grad else t
        if isinstance(v, (list, tuple)):
            return type(v)(self(x) for x in v)
        if isinstance(v, dict):
            return {k: self(x) for k, x in v.items()}
        return v


def _draw(flat: torch.Tensor, gen: torch.Generator) -> bool:
    """Fill ``flat`` with fresh random values of its dtype (False: a dtype without a draw)."""
    dt = flat.dtype
    if dt.is_complex:
        torch.view_as_real(flat).normal_(generator=gen)
    elif dt.is_floating_point:
        if dt.itemsize == 1:  # float8: draw in float32
            flat.copy_(torch.empty(flat.shape, device=flat.device).normal_(generator=gen))
        else:
            flat.normal_(generator=gen)
    elif dt == torch.bool:
        flat.view(torch.uint8).random_(0, 2, generator=gen)
    elif dt in _INT_OF_SIZE.values() or dt == torch.int8:
        flat.random_(0, _INT_HIGH, generator=gen)
    else:  # quantized, bits, ... : no way to draw
        return False
    return True


# Drawing is the proofs' main cost (~0.6 ms per MiB, every input of every
# proof), so values are drawn once into a pool per dtype and device and each
# storage copies a window of it, at an offset that differs between the
# storages and the draws of one proof: i.i.d. within a storage, shifted
# between storages.  The pool grows to the largest request (up to
# _POOL_MAX elements; larger storages draw their own values).
_POOL: dict = {}
_POOL_GEN = 0  # bumped at every (re)draw of a pool
_SPREAD = 4099  # a prime: window offsets in [0, _SPREAD)
_POOL_MAX = 1 << 23


def _fill_random(flat: torch.Tensor, salt: int) -> bool:
    """Fill ``flat`` (a 1-d tensor over a whole storage) with random values of its dtype."""
    n = flat.numel()
    if n > _POOL_MAX:
        return _draw(flat, torch.Generator(device="cpu").manual_seed(_SEED + salt))
    key = (flat.dtype, flat.device)
    pool = _POOL.get(key)
    if pool is None or pool.numel() < n + _SPREAD:
        global _POOL_GEN
        _POOL_GEN += 1  # the values a window holds may change: memoized proofs no longer apply
        size = 1 << max(12, (n + _SPREAD - 1).bit_length())
        pool = torch.empty(size, dtype=flat.dtype, device=flat.device)
        if not _draw(pool, torch.Generator(device="cpu").manual_seed(_SEED)):
            return False
        _POOL[key] = pool
    off = (salt * 2731) % _SPREAD
    flat.copy_(pool[off : off + n])
    return True


def _typed(st, dtype: torch.dtype) -> torch.Tensor:
    """A flat tensor of ``dtype`` over the whole of storage ``st``."""
    return torch.empty(0, dtype=dtype, device=st.device).set_(st, 0, (st.nbytes() // dtype.itemsize,), (1,))


def _storages(tensors: Iterable) -> dict:
    """key -> (storage, dtype of the first tensor seen on it), in order."""
    out: dict = {}
    for t in tensors:
        if isinstance(t, torch.Tensor):
            k = _key(t)
            if k is not None and k not in out:
                out[k] = (storage_of(t), t.dtype)
    return out


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return (
            isinstance(b, torch.Tensor)
            and a.stride() == b.stride()
            and a.storage_offset() == b.storage_offset()
            and bits_equal(a, b)
        )
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


# The random trials' verdicts, within a capture session (memo=, see proven):
# signature -> bool.  Emptied when the outermost session exits.
_MEMO: dict = {}
on_session_end(_MEMO.clear)
# Random trials salt their storages from here (the capture trial from 0), so
# that the random data of a proof does not depend on its capture trial.
_RANDOM_SALT = 1 << 16


class _NoMemo(Exception):
    """A value :func:`_sig` cannot describe exactly: no memo for this proof."""


_SIG_LITERALS = (type(None), bool, int, str, torch.dtype, torch.device, torch.layout, torch.memory_format)


def _sig(v, stores: dict):
    """Hashable description of ``v`` (a nest of tensors, literals and C
    callables) that leaves out the tensors' values only: a tensor is its
    storage's number in order of first appearance (aliasing), that storage's
    size, and the tensor's dtype, device, shape, strides, offset,
    requires_grad, inference, neg / conj bits and type."""
    if isinstance(v, torch.Tensor):
        if type(v) not in (torch.Tensor, torch.nn.Parameter) or v.layout != torch.strided:
            raise _NoMemo
        k = _key(v)
        st = storage_of(v)
        return (
            "T",
            stores.setdefault(k, len(stores)) if k is not None else -1,
            st.nbytes() if st is not None else 0,
            v.dtype,
            v.device,
            tuple(v.shape),
            v.stride(),
            v.storage_offset(),
            v.requires_grad,
            v.is_inference(),
            v.is_neg(),
            v.is_conj(),
            type(v),
        )
    if isinstance(v, (list, tuple)):
        return (type(v).__name__,) + tuple(_sig(x, stores) for x in v)
    if isinstance(v, dict):
        return ("D",) + tuple((k, _sig(x, stores)) for k, x in v.items())
    if isinstance(v, float):
        return ("F", struct.pack("<d", v))  # its bits: -0.0 != 0.0, NaN payloads told apart
    if isinstance(v, _SIG_LITERALS):
        return (type(v).__name__, v)
    if type(v).__name__ in ("builtin_function_or_method", "method_descriptor") or isinstance(v, torch._ops.OpOverload):
        return ("C", v)
    raise _NoMemo


def _memo_key(memo, inputs: list, outputs: list, inference: bool, tls) -> tuple | None:
    """The key of a proof's random trials in :data:`_MEMO`, or None (no memo)."""
    try:
        sig = _sig((inputs, outputs, memo), {})
    except _NoMemo:
        return None
    tls_s = (repr(tls[0]), repr(tls[1])) if tls is not None else None
    return (
        sig,
        inference,
        tls_s,
        torch.get_num_threads(),
        torch.are_deterministic_algorithms_enabled(),
        ENABLED,
        RANDOM_TRIALS,
    )


def proven(
    ref: Callable[[_Twins], Any],
    test: Callable[[_Twins], Any],
    inputs: Iterable,
    outputs: Iterable = (),
    seen: dict | None = None,
    *,
    capture: bool = True,
    inference: bool = False,
    tls: tuple | None = None,
    memo: Any = None,
) -> bool:
    """True when ``test`` (the rewrite) leaves the same bits as ``ref`` (the
    call it replaces) on the capture's data and on :data:`RANDOM_TRIALS`
    draws of random data (always True when :data:`ENABLED` is off).

    ``ref(tw)`` and ``test(tw)`` make their call on ``tw(t)`` for every
    tensor ``t`` they use (``tw`` maps a tensor on a copied storage to the
    same view of the copy) and return what is compared (the result, or the
    ``out=`` buffer they wrote).  ``inputs``: the tensors the calls read
    (views of their storages need not be listed); ``outputs``: the tensors
    (``out=`` buffers) they write, copied for each call and prefilled alike
    (NaN / the integer max, so that a call reading its output differs),
    then compared byte for byte.  ``seen``: ``{id(input): value}``, the value
    an input held when the capture ran the op (a temporary, whose buffer
    holds nothing yet), or None where it is unknown (random then);
    inputs not in ``seen`` are read as they are.  ``capture=False`` when
    the caller has just compared both calls on the capture's data itself.
    ``inference`` and ``tls`` (:func:`eager_tls` at capture begin): the
    capture's context, which replay reproduces.  Nothing is written to the
    inputs' or outputs' own storages.

    ``memo``: within a capture session, a description of the two calls
    (a nest of the callables and of every argument they pass, tensors
    included): the random trials' verdict is then kept under the exact
    signature of the proof (``memo``, ``inputs`` and ``outputs`` with every
    tensor's metadata and aliasing but not its values, the context, the
    thread count and the random pool's generation) and a later proof of the
    same signature in the session reuses it instead of running them again:
    it would draw the very same random values into the very same layouts
    and run the same calls, so its verdict is the same.  The capture trial
    (``capture=True``), which reads this capture's data, always runs."""
    if not ENABLED:
        return True
    t0 = time.perf_counter()
    ok = False
    known = None
    inputs, outputs = list(inputs), list(outputs)
    try:
        with (
            _disable_current_modes(),
            torch._C.DisableTorchFunction(),
            torch.inference_mode(inference),
            torch.no_grad(),
            eager_context(tls),
        ):  # as replay runs
            key = _memo_key(memo, inputs, outputs, inference, tls) if memo is not None and in_session() else None
            gen = _POOL_GEN
            known = _MEMO.get((key, gen)) if key is not None else None
            ok = known is not False and (not capture or _prove(ref, test, inputs, outputs, seen or {}, True))
            if ok and known is None:
                ok = _prove(ref, test, inputs, outputs, {}, False)
                if key is not None and _POOL_GEN == gen:  # (a pool redrawn meanwhile: another draw next time)
                    _MEMO[(key, gen)] = ok
    except Exception:  # noqa: BLE001 - a proof that cannot run proves nothing
        ok = False
    stats.proofs += 1
    stats.refused += not ok
    stats.reused += known is not None
    stats.seconds += time.perf_counter() - t0
    return ok


def _prove(ref, test, inputs: list, outputs: list, seen: dict, capture_trial: bool) -> bool:
    """The capture trial (``capture_trial``) or the :data:`RANDOM_TRIALS` random ones."""
    outs = _storages(outputs)
    ins = {k: v for k, v in _storages(inputs).items() if k not in outs}
    trials = [True] if capture_trial else [False] * RANDOM_TRIALS
    salt = 0 if capture_trial else _RANDOM_SALT
    for on_capture_data in trials:
        in_twins: dict = {}
        if on_capture_data:
            # inputs as they are, except those whose capture-time value is kept (or unknown)
            for t in inputs:
                if not isinstance(t, torch.Tensor) or id(t) not in seen:
                    continue
                k = _key(t)
                if k is None or k in outs:
                    continue
                if k not in in_twins:
                    st, dt = ins[k]
                    in_twins[k] = storage_bytes(st).clone().untyped_storage()
                    salt += 1
                    if seen[id(t)] is None and not _fill_random(_typed(in_twins[k], dt), salt):
                        return False
                v = seen[id(t)]
                if v is not None:
                    _Twins(in_twins)(t).copy_(v)
        else:
            for k, (st, dt) in ins.items():
                tw = torch.empty(st.nbytes(), dtype=torch.uint8, device=st.device).untyped_storage()
                salt += 1
                if not _fill_random(_typed(tw, dt), salt):
                    return False
                in_twins[k] = tw
        results = []
        written = []
        for call in (ref, test):
            twins = dict(in_twins)
            mine = {}
            for k, (st, dt) in outs.items():
                tw = torch.empty(st.nbytes(), dtype=torch.uint8, device=st.device).untyped_storage()
                _fill_poison(_typed(tw, dt))
                twins[k] = mine[k] = tw
            results.append(call(_Twins(twins)))
            written.append(mine)
        if not _same(results[0], results[1]):
            return False
        for k in outs:
            a = torch.empty(0, dtype=torch.uint8, device=written[0][k].device).set_(written[0][k])
            b = torch.empty(0, dtype=torch.uint8, device=written[1][k].device).set_(written[1][k])
            if not equal_ints(a, b):
                return False
    return True


def _fill_poison(flat: torch.Tensor) -> None:
    v = poison_value(flat.dtype)
    if v is not None and flat.numel():
        flat.fill_(v)
