"""Survivors and poison: what a capture leaves behind for the user.

Owns the rules for tensors created inside a capture and still referenced
after it (*survivors*, TAPE-NOTES item 7): :func:`find_survivors` decides per
storage, at capture end, which internal tensors stay alive (and so are
refreshed in place by every replay); ``_SURVIVORS`` remembers them so that a
write from outside the graph warns (:class:`EscapedTensorWarning`, item 8).
Also owns poisoning (``poison_captured_values``): filling survivors at
capture end with :func:`poison_value` as a CUDA graph leaves them holding
uninitialised pool memory, the ``$GRAPHRUNNER_TAPE_POISON`` default
(:func:`poison_default`), and ``_POISONED``, the poisoned storages another
capture may need to read with their real values.
"""

from __future__ import annotations

import os
import weakref

import torch

from .state import alias_of, ours

# Survivor storages a poisoning graph filled with poison and that it has not
# replayed since: id(storage) -> weakref(graph); the graph holds the entry
# (see TapeGraph._poisoned).  Another tape capture that reads one gets its real
# values while it captures (a CUDA capture runs nothing, so its ops can never
# fail on the garbage; the tape runs them): see _Capture.lift_poison.
_POISONED: dict[int, weakref.ref] = {}

# Storages that survived some capture: id(storage) -> (weakref(storage), weakref(graph)).
# Used to warn when another graph writes a survivor (TAPE-NOTES item 8).
_SURVIVORS: dict[int, tuple[weakref.ref, weakref.ref]] = {}

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


class _Poisoned:
    """One poisoned survivor storage of a graph: its bytes as a uint8 view, its
    real (capture-time) bytes, a flat view in its dtype and the poison value."""

    __slots__ = ("raw", "real", "typed", "value", "once")

    def __init__(self, st, dtype: torch.dtype, value, once: bool):
        with torch.inference_mode():
            self.raw = ours(torch.empty(0, dtype=torch.uint8, device=st.device).set_(st))
            self.real = self.raw.clone()
            self.typed = ours(torch.empty(0, dtype=dtype, device=st.device).set_(
                st, 0, (st.nbytes() // dtype.itemsize,)))
        self.value = value
        self.once = once  # computed once at capture (a hoisted constant): never refreshed by replay

    def poison(self) -> None:
        with torch.inference_mode():
            self.typed.fill_(self.value)

    def lift(self) -> None:
        with torch.inference_mode():
            self.raw.copy_(self.real)


def survivor_graph(t: torch.Tensor):
    """The live tape graph whose capture ``t``'s memory survived (the graph
    that refreshes it at each replay and holds it), or None."""
    try:
        st = t.untyped_storage()
    except Exception:
        return None
    ent = _SURVIVORS.get(id(st))
    if ent is None or ent[0]() is not st:
        return None
    g = ent[1]()
    return g if g is not None and g._fn is not None else None


def find_survivors(cap, graph, const_storages: set) -> tuple[dict, list, list]:
    """Drop the capture's own references to its internal tensors and see which
    storages are still alive (keyed by storage, so a kept view keeps -- and
    refreshes -- its base).

    Returns ``(survivors, versioned, targets)``: allocating name -> static
    tensor refreshed by replay (constants excluded: computed once);
    ``(weakref, _version)`` of one user-visible tensor per survivor storage,
    to detect writes from outside the graph; ``(storage, dtype, computed
    once)`` of every survivor storage, for poisoning.  Registers every
    survivor in ``_SURVIVORS`` for ``graph``.  Clears ``cap.strong``,
    ``cap.storages`` and ``cap.names``."""
    kind = cap.kind
    alloc_w = {n: weakref.ref(cap.strong[n]) for n in cap.alloc_meta}
    st_w = {k: weakref.ref(cap.storages[k]) for k in cap.internal_storages}
    int_w = {n: weakref.ref(t) for n, t in cap.strong.items() if kind[n] == "int"}
    cap.strong.clear()
    cap.storages.clear()
    cap.names.clear()
    # the user's tensors still alive (held until the arena has placed them)
    cap.user_tensors = {n: u for n, w in int_w.items() if (u := w()) is not None}
    survivors: dict[str, torch.Tensor] = {}  # allocating name -> static tensor
    versioned = []
    targets = []
    for k, alloc in cap.internal_storages.items():
        st = st_w[k]()
        if st is None:
            continue
        # every survivor (a hoisted constant too) is registered for item 8
        _SURVIVORS[k] = (weakref.ref(st), weakref.ref(graph))
        targets.append((st, cap.alloc_meta[alloc][0], k in const_storages))
        if k in const_storages:
            continue  # computed once at capture, nothing to refresh
        t = alloc_w[alloc]()
        if t is None:  # only a view survives: rebuild the allocating tensor on the storage
            dtype, device, size, stride, off = cap.alloc_meta[alloc]
            with torch.inference_mode(cap.inference):
                t = torch.empty(0, dtype=dtype, device=device).set_(st, off, size, stride)
        # The graph holds an alias, not the user's object: a CUDA graph keeps
        # the memory, never the tensor, and the pool arena tells "dropped by
        # the user" by weak references to the user's objects.
        survivors[alloc] = alias_of(t) if not t.requires_grad else t
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
    return survivors, versioned, targets


def poison_survivors(graph, targets: list) -> None:
    """Fill each survivor storage in ``targets`` with the poison value of its
    dtype (the whole storage: a survivor view's base too), keeping its real
    bytes in ``graph._poisoned`` for later tape captures that read it and for
    constants, which replay never recomputes."""
    for k in [k for k, w in list(_POISONED.items()) if w() is None]:
        _POISONED.pop(k, None)  # graphs dropped before their first replay
    me = weakref.ref(graph)
    for st, dtype, once in targets:
        v = poison_value(dtype)
        if v is None or st.nbytes() < dtype.itemsize:
            continue
        ent = _Poisoned(st, dtype, v, once)
        ent.poison()
        graph._poisoned[id(st)] = ent
        _POISONED[id(st)] = me


def unpoison(graph) -> None:
    """First replay of ``graph``: forget its poisoned storages (replay
    refreshes them), giving constants (not recomputed by replay) their real
    values back."""
    for k, ent in graph._poisoned.items():
        if ent.once:
            ent.lift()
        _POISONED.pop(k, None)
    graph._poisoned = {}


def forget_poisoned(graph) -> None:
    """``graph`` dropped its recording: its poisoned storages are no longer tracked."""
    for k in graph._poisoned:
        _POISONED.pop(k, None)
    graph._poisoned = {}
