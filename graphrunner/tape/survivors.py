"""Survivors and poison: what a capture leaves behind for the user.

Owns the rules for tensors created inside a capture and still referenced
after it (*survivors*, TAPE-NOTES item 7): :func:`find_survivors` decides per
storage, at capture end, which internal tensors stay alive (and so are
refreshed in place by every replay); ``SURVIVORS`` remembers them so that a
write from outside the graph warns (:class:`EscapedTensorWarning`, item 8);
one kept on an object's attribute and not returned warns at capture end,
named (:class:`StashedTensorWarning`, :func:`warn_stashed`).
Also owns poisoning (``poison_captured_values``): filling survivors at
capture end with :func:`poison_value` as a CUDA graph leaves them holding
uninitialised pool memory, the ``$GRAPHRUNNER_TAPE_POISON`` default
(:func:`poison_default`), and ``POISONED``, the poisoned storages another
capture may need to read with their real values.
"""

from __future__ import annotations

import contextvars
import dataclasses
import gc
import re
import sys
import warnings
import weakref
from types import FrameType

import torch

from graphrunner._env import env_flag

from .state import alias_of, ours

# Survivor storages a poisoning graph filled with poison and that it has not
# replayed since: id(storage) -> weakref(graph); the graph holds the entry
# (see TapeGraph._poisoned).  Another tape capture that reads one gets its real
# values while it captures (a CUDA capture runs nothing, so its ops can never
# fail on the garbage; the tape runs them): see TapeCapture.lift_poison.
POISONED: dict[int, weakref.ref] = {}

# Storages that survived some capture: id(storage) -> (weakref(storage), weakref(graph)).
# Used to warn when another graph writes a survivor (TAPE-NOTES item 8).
SURVIVORS: dict[int, tuple[weakref.ref, weakref.ref]] = {}

#: Environment variable giving the default of ``poison_captured_values`` for
#: :class:`TapeGraph` and :class:`~graphrunner.devices.TapeDevice`.
POISON_ENV_VAR = "GRAPHRUNNER_TAPE_POISON"


def poison_default() -> bool:
    """The default of ``poison_captured_values``: ``$GRAPHRUNNER_TAPE_POISON``.

    ``1``/``true``/``yes``/``on`` (any case) enable poisoning; unset, empty,
    ``0``/``false``/``no``/``off`` disable it; anything else raises
    ``ValueError``.  Read each time a graph or device is made without an
    explicit value, so a test suite can set it once for every graph.
    """
    return env_flag(
        POISON_ENV_VAR,
        "set it to 1/true/yes/on to poison the values a capture leaves behind, or 0/false/no/off or unset it not to",
    )


def poison_value(dtype: torch.dtype) -> float | int | bool | None:
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


def resolve_poison(flag: bool | None, who: str) -> bool:
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


class StashedTensorWarning(EscapedTensorWarning):
    """A tensor created inside a tape capture is still referenced after it
    from an object's attribute (``self.last = h`` in the step, a module
    global, a container on an attribute) and is not among the capture's
    outputs.

    Python code does not run at replay, so the attribute is never re-bound:
    it keeps the one tensor this graph refreshes in place at its own
    replays, while eager calls, other graphs (other shape buckets) and
    checks leave it alone or re-bind it, and a recurrent state kept that
    way reads a stale value (on a CUDA graph the tensor also lives in the
    graph's private pool).  Return the tensor as an output, or keep the
    state in a tensor allocated before capture and update it in place
    (``self.last.copy_(h)``).
    """


#: Tensors marked as deliberate caches (:func:`mark_cache`): kept on an object after a capture on
#: purpose, so neither :func:`warn_stashed` nor a stashed-state check reports them.
_DELIBERATE: dict[int, weakref.ref] = {}  # id(tensor) -> weakref(tensor) (a WeakSet would compare tensors)

#: True while something else reports the tensors a capture leaves on objects (the stashed-state
#: check of :mod:`graphrunner.checks.stash`, which raises naming the assignment): the tape's own
#: :class:`StashedTensorWarning` is then not issued as well.
stash_reported_elsewhere: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "stash_reported_elsewhere", default=False
)


def mark_cache(t: torch.Tensor) -> torch.Tensor:
    """Mark ``t`` as a deliberate cache made during a capture and kept on an object; returns ``t``."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"a deliberate cache must be a tensor, got {type(t).__name__}")
    k = id(t)

    def forget(_: object) -> None:  # the tensor is gone: its id may be reused
        _DELIBERATE.pop(k, None)

    _DELIBERATE[k] = weakref.ref(t, forget)
    return t


def is_deliberate_cache(t: torch.Tensor) -> bool:
    """True for a tensor marked with :func:`mark_cache` (the tensor object itself, not its views)."""
    w = _DELIBERATE.get(id(t))
    return w is not None and w() is t


class Poisoned:
    """One poisoned survivor storage of a graph: its bytes as a uint8 view, its
    real (capture-time) bytes, a flat view in its dtype and the poison value."""

    __slots__ = ("raw", "real", "typed", "value", "once")

    def __init__(self, st, dtype: torch.dtype, value, once: bool):
        with torch.inference_mode():
            self.raw = ours(torch.empty(0, dtype=torch.uint8, device=st.device).set_(st))
            self.real = self.raw.clone()
            self.typed = ours(
                torch.empty(0, dtype=dtype, device=st.device).set_(st, 0, (st.nbytes() // dtype.itemsize,), (1,))
            )  # the contiguous stride set_ defaults to
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
    ent = SURVIVORS.get(id(st))
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
    survivor in ``SURVIVORS`` for ``graph``.  Clears ``cap.strong``,
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
        SURVIVORS[k] = (weakref.ref(st), weakref.ref(graph))
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
    for k in [k for k, (w, _) in list(SURVIVORS.items()) if w() is None]:
        SURVIVORS.pop(k, None)
    return survivors, versioned, targets


def poison_survivors(graph, targets: list) -> None:
    """Fill each survivor storage in ``targets`` with the poison value of its
    dtype (the whole storage: a survivor view's base too), keeping its real
    bytes in ``graph._poisoned`` for later tape captures that read it and for
    constants, which replay never recomputes."""
    for k in [k for k, w in list(POISONED.items()) if w() is None]:
        POISONED.pop(k, None)  # graphs dropped before their first replay
    me = weakref.ref(graph)
    for st, dtype, once in targets:
        v = poison_value(dtype)
        if v is None or st.nbytes() < dtype.itemsize:
            continue
        ent = Poisoned(st, dtype, v, once)
        ent.poison()
        graph._poisoned[id(st)] = ent
        POISONED[id(st)] = me


def unpoison(graph) -> None:
    """First replay of ``graph``: forget its poisoned storages (replay
    refreshes them), giving constants (not recomputed by replay) their real
    values back."""
    for k, ent in graph._poisoned.items():
        if ent.once:
            ent.lift()
        POISONED.pop(k, None)
    graph._poisoned = {}


def forget_poisoned(graph) -> None:
    """``graph`` dropped its recording: its poisoned storages are no longer tracked."""
    for k in graph._poisoned:
        POISONED.pop(k, None)
    graph._poisoned = {}


# How deep the frames' locals are searched for the capture's outputs
# (containers: list, tuple, dict, set; dataclass instances), and how many
# objects at most.
_OUTPUT_DEPTH = 4
_OUTPUT_ITEMS = 10_000


def _held_by_frames(skip_prefix: str) -> set:
    """ids of the tensors reachable from the locals of the calling frames
    (outside modules named ``skip_prefix*``) through containers: what the
    capture's callers hold when it ends, its outputs among them."""
    found: set = set()
    budget = [_OUTPUT_ITEMS]
    seen: set = set()

    def walk(v, depth: int) -> None:
        if budget[0] <= 0 or id(v) in seen:
            return
        budget[0] -= 1
        if isinstance(v, torch.Tensor):
            found.add(id(v))
            return
        if depth <= 0:
            return
        seen.add(id(v))
        if isinstance(v, dict):
            for x in list(v.values()):
                walk(x, depth - 1)
        elif isinstance(v, (list, tuple, set, frozenset)):
            for x in list(v):
                walk(x, depth - 1)
        elif dataclasses.is_dataclass(v) and not isinstance(v, type):
            for x in list(vars(v).values()) if hasattr(v, "__dict__") else ():
                walk(x, depth - 1)

    f: FrameType | None = sys._getframe(1)
    while f is not None:
        if not str(f.f_globals.get("__name__", "")).startswith(skip_prefix):
            for v in list(f.f_locals.values()):
                walk(v, _OUTPUT_DEPTH)
        f = f.f_back
    return found


def _ours_type(o) -> bool:
    m = getattr(type(o), "__module__", "") or ""
    return m == "graphrunner" or m.startswith("graphrunner.")


def _is_attribute_dict(d: dict, o) -> bool:
    """``d`` is ``o``'s attribute dict: its ``__dict__``, or an ``nn.Module``'s
    ``_buffers`` / ``_parameters`` (attributes too, for ``getattr``)."""
    try:
        if object.__getattribute__(o, "__dict__") is d:
            return True
    except AttributeError:
        return False
    return isinstance(o, torch.nn.Module) and (o.__dict__.get("_buffers") is d or o.__dict__.get("_parameters") is d)


def _label(o) -> str:
    if isinstance(o, type(sys)):
        return o.__name__
    return type(o).__name__


# How many objects up from a tensor the owner of an attribute is looked for
# (tensor -> list -> __dict__ -> module is three), one heap walk each.
_OWNER_HOPS = 4
_OWNER_FRONTIER = 256


def stashed_attributes(tensors: list) -> dict:
    """``{id(tensor): ["Owner.attr", ...]}``: where each of ``tensors`` is kept
    as an attribute of an object (``obj.attr``, ``obj.attr[i]['k']`` through
    lists, tuples and dicts; a module's global: ``module.NAME``), found by
    walking ``gc.get_referrers`` up from the tensors; objects of
    graphrunner's own modules do not count (the library's bookkeeping).
    :data:`_OWNER_HOPS` heap walks at most: call it only for the few
    tensors that need it.  Objects frozen with ``gc.freeze()`` (a
    capture session freezes the heap) are invisible to ``gc.get_referrers``:
    they are unfrozen for the walk and frozen again after it (with the
    objects made since, as the session's own freeze would have)."""
    frozen = gc.get_freeze_count() > 0
    if frozen:
        gc.unfreeze()
    try:
        return _stashed_attributes(tensors)
    finally:
        if frozen:
            gc.freeze()


def _stashed_attributes(tensors: list) -> dict:
    names: dict = {}
    # the frontier: objects one more hop up, id -> object and id -> how each
    # target is reached below it: [(id(target), pending dict key or _NO_KEY, path)]
    objs = {id(t): t for t in tensors}
    entries = {id(t): [(id(t), _NO_KEY, "")] for t in tensors}
    for _ in range(_OWNER_HOPS):
        if not objs:
            break
        objs, entries = _hop(objs, entries, names)
    return names


def _hop(objs: dict, entries: dict, names: dict) -> tuple:
    """One heap walk: the referrers of the objects in ``objs``.  An object
    referring to one by attribute names its target(s); a dict, list or
    tuple is the next hop's frontier.  (A function, so that no local of a
    previous hop refers to the objects of the next.)"""
    nxt_objs: dict = {}
    nxt_entries: dict = {}
    own = (objs, entries, nxt_objs, nxt_entries, names)
    refs = gc.get_referrers(*objs.values())
    for r in refs:
        if any(r is o for o in own) or type(r).__name__ == "frame" or _ours_type(r):
            continue
        if isinstance(r, (dict, list, tuple)):
            items = r.items() if isinstance(r, dict) else enumerate(r)
            for k, v in list(items):
                if objs.get(id(v), _NO_KEY) is not v:
                    continue
                for tid, key, path in entries[id(v)]:
                    below = _below(key, path)
                    entry = (tid, k, below) if isinstance(r, dict) else (tid, _NO_KEY, f"[{k}]{below}")
                    lst = nxt_entries.setdefault(id(r), [])
                    if entry not in lst:
                        lst.append(entry)
                    nxt_objs[id(r)] = r
            continue
        # an object: the owner of an attribute dict below, or attributes of its own
        for o_id, o in objs.items():
            if isinstance(o, dict) and _is_attribute_dict(o, r):
                for tid, key, path in entries[o_id]:
                    if key is not _NO_KEY:
                        _add(names, tid, f"{_label(r)}.{key}{path}")
        try:
            d = object.__getattribute__(r, "__dict__")
        except AttributeError:
            continue
        if isinstance(d, dict):
            for k, v in list(d.items()):
                if objs.get(id(v), _NO_KEY) is v and not (isinstance(v, dict) and _is_attribute_dict(v, r)):
                    for tid, key, path in entries[id(v)]:
                        _add(names, tid, f"{_label(r)}.{k}{_below(key, path)}")
    del refs
    keep = list(nxt_objs)[:_OWNER_FRONTIER]
    return {k: nxt_objs[k] for k in keep}, {k: nxt_entries[k] for k in keep}


_NO_KEY = object()


def _below(key, path: str) -> str:
    """The access path below an object reached through dict key ``key`` (or none)."""
    return path if key is _NO_KEY else f"[{key!r}]{path}"


def _add(names: dict, tid: int, name: str) -> None:
    # an nn.Module's registered buffer or parameter is an attribute too
    name = re.sub(r"\._(?:buffers|parameters)\['([A-Za-z_][A-Za-z0-9_]*)'\]", r".\1", name)
    lst = names.setdefault(tid, [])
    if name not in lst:
        lst.append(name)


def warn_stashed(cap, const_storages: set) -> None:
    """Warn (:class:`StashedTensorWarning`) for each tensor created inside
    the capture, still alive at its end (``cap.user_tensors``), that the
    calling frames do not hold (not an output) and that an object keeps as
    an attribute; constants (computed once, never refreshed) excepted.
    Cheap when nothing escapes: the heap is walked only for tensors the
    frames do not hold."""
    if stash_reported_elsewhere.get():
        return
    cands = [
        t for n, t in cap.user_tensors.items() if cap.skey.get(n) not in const_storages and not is_deliberate_cache(t)
    ]
    if not cands:
        return
    held = _held_by_frames("graphrunner.tape")
    cands = [t for t in cands if id(t) not in held]
    if not cands:
        return
    named = stashed_attributes(cands)
    f: FrameType | None
    level, f = 1, sys._getframe()  # point at the user's code: the first frame outside graphrunner, contextlib
    while f is not None and str(f.f_globals.get("__name__", "")).startswith(("graphrunner.", "contextlib")):
        f, level = f.f_back, level + 1
    for t in cands:
        where = named.get(id(t))
        if not where:
            continue
        shown = ", ".join(where[:3]) + (", ..." if len(where) > 3 else "")
        warnings.warn(
            f"a tensor created inside this TapeGraph's capture ({tuple(t.shape)} {t.dtype}) is kept in {shown} "
            "after it and is not among the capture's outputs. Python code does not run at replay, so the "
            "attribute is never re-bound: it stays the tensor this graph refreshes in place at its own replays, "
            "while eager calls and other graphs (other shape buckets) do not update it, and state kept that way "
            "goes stale (on a CUDA graph the tensor also lives in the graph's private pool). Return it as an "
            "output, or keep the state in a tensor allocated before capture and update it in place "
            "(e.g. self.last.copy_(h)).",
            StashedTensorWarning,
            stacklevel=level,
        )
