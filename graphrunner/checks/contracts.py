"""Contracts checked in debug mode: input bounds, and externals that keep their storage.

Debug mode is ``GraphRunner(..., debug=True)`` or the environment variable
``GRAPHRUNNER_DEBUG=1`` (:func:`debug_enabled`). When it is off nothing here
runs: the runner's call path is unchanged but for one attribute test.

- **Bounds.** ``gr.BatchInput(..., bounds=(lo, hi))``: every call checks
  ``lo <= value <= hi`` on every real cell of the input before anything is
  copied or replayed (:func:`bounds_error`), so an out-of-range index (a
  slot beyond the KV cache, a ragged index past its end) is a
  ``ValueError`` naming the input, the row and the value instead of an
  illegal memory access far from its cause.
- **Externals.** Tensors the step reads that are not runner inputs
  (weights, buffers, the KV cache) are recorded during the last capture
  warmup of each key (:class:`ExternalRecorder`, an op consumer)
  with ``(data_ptr, shape, stride)``, and named by their path from the step
  (:func:`named_tensors`: ``self.model.layers.0.weight`` for a bound
  method, a closure variable or global name for a plain function). Before
  each replay :class:`ExternalGuard` checks that every one still resolves
  to the same storage, shape and strides: a re-bound
  ``layer.weight = nn.Parameter(...)`` or a re-allocated or resized cache
  raises :class:`~graphrunner.errors.ContractError` naming the tensor.
  The externals the graph writes (the KV cache) are listed in the capture
  report.

The externals are recorded by the one op recorder
(:mod:`graphrunner.recording.ops`) that the drift check also feeds from; the
check attaches to capture as the hook :class:`ExternalsCheck`.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._pytree import tree_leaves

from graphrunner._env import env_flag
from graphrunner._frames import where as where_text
from graphrunner.checks.findings import finding_at
from graphrunner.errors import CaptureError, ContractError, GraphRunnerError
from graphrunner.recording.hooks import Capture, CaptureHook
from graphrunner.recording.ops import OpConsumer, OpEvent, storage_key

__all__ = [
    "debug_enabled",
    "bounds_error",
    "check_bounds",
    "check_call",
    "ExternalRecorder",
    "named_tensors",
    "External",
    "ExternalGuard",
    "ExternalsCheck",
    "InputWritesCheck",
    "externals_of",
]


def debug_enabled(debug: bool | None) -> bool:
    """``debug`` if given, else ``GRAPHRUNNER_DEBUG`` read as every ``GRAPHRUNNER_*`` switch is
    (:func:`graphrunner._env.env_flag`): ``1``/``true``/``yes``/``on`` on, unset/``0``/``false``/``no``/
    ``off`` off, anything else (``2``, ``debug``, ``enabled``) a ``ValueError`` saying what to set."""
    if debug is not None:
        if not isinstance(debug, bool):
            raise TypeError(f"debug must be True, False or None (read GRAPHRUNNER_DEBUG), got {debug!r}")
        return debug
    return env_flag(
        "GRAPHRUNNER_DEBUG",
        "set it to 1 (or true/yes/on) to check every call of every runner "
        "(debug mode), or 0 / unset it for none; GraphRunner(debug=...) overrides it per runner",
    )


# ----------------------------------------------------------------- bounds
def bounds_error(name: str, t: torch.Tensor, bounds: tuple[Any, Any], lead: int) -> ValueError | None:
    """``None`` if every cell of ``t`` lies in ``[lo, hi]`` (inclusive; ``None`` is unbounded),
    else the ``ValueError`` naming input ``name``, the first offending row (an index tuple with
    several leading dims ``lead``), its cell and value. A NaN cell of a floating input lies in no
    range (``nan < lo`` and ``nan > hi`` are both False): it is out of bounds whenever bounds are
    declared. Synchronises the device (debug mode only)."""
    lo, hi = bounds
    bad = None
    if lo is not None:
        bad = t < lo
    if hi is not None:
        above = t > hi
        bad = above if bad is None else bad | above
    if bad is not None and (t.is_floating_point() or t.is_complex()):
        bad = bad | t.isnan()
    if bad is None or not bool(bad.any()):
        return None
    idx = [int(i) for i in bad.nonzero()[0]]
    value = t[tuple(idx)].item()
    row: Any = idx[0] if lead == 1 else tuple(idx[:lead])
    cell = f" (cell {tuple(idx)})" if len(idx) > lead else ""
    n_bad = int(bad.sum())
    want = f"[{'-inf' if lo is None else lo}, {'inf' if hi is None else hi}]"
    return ValueError(
        f"GraphRunner (debug): input {name!r} row {row}{cell} holds {value!r}, outside its bounds {want} "
        f"(BatchInput(bounds=...); {n_bad} cell(s) out of bounds). Nothing was copied or replayed: an "
        "out-of-range index would read or write outside its table inside the graph. Fix the value, or "
        "widen the bounds if it is valid"
    )


def check_bounds(bounded: Sequence[tuple[int, str, tuple[Any, Any], int]], tensors: Sequence[torch.Tensor]) -> None:
    """Raise the :func:`bounds_error` of the first bounded input out of its bounds; ``bounded``:
    ``(position in tensors, name, bounds, leading dims)`` of every input with bounds."""
    for i, name, bounds, lead in bounded:
        err = bounds_error(name, tensors[i], bounds, lead)
        if err is not None:
            raise err


def check_call(
    bounded: Sequence[tuple[int, str, tuple[Any, Any], int]],
    tensors: Sequence[torch.Tensor],
    externals: ExternalsCheck | None = None,
) -> None:
    """Debug mode's per-call checks, before anything is written: :func:`check_bounds`, then, when
    ``externals`` is given (a multi-rank runner, which must not raise after its peers agreed),
    every key's externals."""
    check_bounds(bounded, tensors)
    if externals is not None:
        for k in externals.guard.per_key:
            externals.before_replay(k)


# -------------------------------------------------------------- externals
class ExternalRecorder(OpConsumer):
    """Records the tensors a forward reads and writes that it did not make (an op consumer).

    ``input_storages``: storage keys of the runner's static inputs (not
    externals). A tensor argument of an aten op whose storage was not
    produced by an earlier op of this forward, and is not an input, is an
    external (``externals``: one entry per distinct tensor object, in
    first-read order); an external whose storage an op writes (a mutable
    schema argument, e.g. ``index_copy_`` into a view of the cache) is
    listed in ``written`` (storage keys).
    """

    def __init__(self, input_storages: Sequence[int]) -> None:
        self.inputs = set(input_storages)
        self.produced: set = set()
        self.ext_storage: set = set()
        self.externals: dict[int, torch.Tensor] = {}
        self.written: set = set()
        self.made: set = set()  # ids of tensors the forward's ops returned (views of externals included)

    def before(self, ev: OpEvent) -> None:
        for t in tree_leaves((ev.args, ev.kwargs)):
            if isinstance(t, torch.Tensor):
                s = storage_key(t)
                if s is not None and s not in self.inputs and s not in self.produced and id(t) not in self.made:
                    self.ext_storage.add(s)
                    self.externals.setdefault(id(t), t)
        for t in ev.written:
            s = storage_key(t)
            if s in self.ext_storage:
                self.written.add(s)

    def after(self, ev: OpEvent) -> None:
        for t in tree_leaves(ev.out):
            if isinstance(t, torch.Tensor):
                # ids of live externals cannot be reused by tensors made here
                self.made.add(id(t))
                s = storage_key(t)
                if s is not None and s not in self.ext_storage and s not in self.inputs:
                    self.produced.add(s)


Step = tuple[str, Any]  # ("attr", name) or ("item", key)


def _roots(step: Callable[..., Any]) -> Iterator[tuple[str, Callable[[], Any]]]:
    """``(name, get_value)`` of what the step can reach: ``self`` of a bound method, closure
    variables and referenced globals (of the function and of functions it closes over, one level)."""

    fn = step
    while isinstance(fn, functools.partial):
        fn = fn.func
    if inspect.ismethod(fn):
        obj = fn.__self__
        yield "self", (lambda: obj)
        fn = fn.__func__
    funcs = [fn]
    seen = set()
    while funcs:
        f = funcs.pop(0)
        if id(f) in seen or not hasattr(f, "__code__"):
            continue
        seen.add(id(f))
        code = f.__code__
        for name, cell in zip(code.co_freevars, f.__closure__ or ()):
            try:
                v = cell.cell_contents
            except ValueError:
                continue
            if inspect.isfunction(v) and len(seen) < 4:
                funcs.append(v)
            yield name, functools.partial(getattr, cell, "cell_contents")  # read at call time
        g = getattr(f, "__globals__", {})
        for name in code.co_names:
            if name in g and isinstance(g[name], (torch.Tensor, torch.nn.Module, list, tuple, dict)):
                yield name, functools.partial(g.get, name)


def _walk(
    obj: Any, steps: tuple[Step, ...], out: list[tuple[tuple[Step, ...], torch.Tensor]], seen: set, depth: int
) -> None:
    if isinstance(obj, torch.Tensor):
        out.append((steps, obj))
        return
    if id(obj) in seen or depth > 6 or len(seen) > 20000:
        return
    seen.add(id(obj))
    if isinstance(obj, torch.nn.Module):
        for n, p in obj.named_parameters(remove_duplicate=False):
            out.append((steps + tuple(("attr", x) for x in n.split(".")), p))
        for n, b in obj.named_buffers(remove_duplicate=False):
            out.append((steps + tuple(("attr", x) for x in n.split(".")), b))
        for mn, m in obj.named_modules(remove_duplicate=False):
            pre = steps + tuple(("attr", x) for x in mn.split(".") if mn)
            for k, v in vars(m).items():
                if (
                    not k.startswith("_")
                    and isinstance(v, (torch.Tensor, list, tuple, dict))
                    or (
                        not k.startswith("_")
                        and hasattr(v, "__dict__")
                        and not callable(v)
                        and not isinstance(v, torch.nn.Module)
                        and type(v).__module__ != "builtins"
                    )
                ):
                    _walk(v, pre + (("attr", k),), out, seen, depth + 1)
        return
    if isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj[:4096]):
            _walk(v, steps + (("item", i),), out, seen, depth + 1)
        return
    if isinstance(obj, dict):
        for k, v in list(obj.items())[:4096]:
            if isinstance(k, (str, int)):
                _walk(v, steps + (("item", k),), out, seen, depth + 1)
        return
    d = getattr(obj, "__dict__", None)
    if d is not None and not callable(obj) and not isinstance(obj, type):
        for k, v in list(d.items()):
            if not k.startswith("__"):
                _walk(v, steps + (("attr", k),), out, seen, depth + 1)


def _path_text(root: str, steps: tuple[Step, ...]) -> str:
    return root + "".join(f".{k}" if kind == "attr" else f"[{k!r}]" for kind, k in steps)


def _resolver(get_root: Callable[[], Any], steps: tuple[Step, ...]) -> Callable[[], Any]:
    def resolve() -> Any:
        v = get_root()
        for kind, k in steps:
            v = getattr(v, k) if kind == "attr" else v[k]
        return v

    return resolve


def named_tensors(step: Callable[..., Any]) -> dict[int, tuple[str, Callable[[], Any], torch.Tensor]]:
    """``{id(tensor): (path, resolve, tensor)}`` for the tensors reachable from ``step``: parameters and
    buffers of the modules it reaches (``named_parameters``/``named_buffers``), plain tensor
    attributes, list/dict items. ``resolve()`` re-reads the path (to see a re-bound attribute)."""
    found: dict[int, tuple[str, Callable[[], Any], torch.Tensor]] = {}
    for root, get in _roots(step):
        try:
            obj = get()
        except Exception:  # noqa: BLE001
            continue
        hits: list[tuple[tuple[Step, ...], torch.Tensor]] = []
        _walk(obj, (), hits, set(), 0)
        for steps, t in hits:
            if id(t) not in found:
                found[id(t)] = (_path_text(root, steps), _resolver(get, steps), t)
    return found


@dataclass
class External:
    """One tensor a captured graph reads that is not a runner input."""

    path: str  #: module/closure path, or ``"an unnamed tensor"``
    tensor: torch.Tensor  #: the object the graph read (kept alive in debug mode)
    ptr: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    resolve: Callable[[], Any] | None  #: re-reads ``path``; ``None`` when unnamed
    written: bool = False

    def describe(self) -> dict[str, Any]:
        """JSON-ready ``{"path", "shape", "dtype"}``."""
        return {"path": self.path, "shape": list(self.shape), "dtype": str(self.tensor.dtype).replace("torch.", "")}


def externals_of(
    rec: ExternalRecorder, names: dict[int, tuple[str, Callable[[], Any], torch.Tensor]]
) -> list[External]:
    """The :class:`External` list of one recorded forward, named from :func:`named_tensors`.

    A tensor not named itself but sharing the storage of a named one is "a view [shape] of
    <path>"; the named tensor with the most elements on an external's storage (its base, e.g.
    the whole cache) is checked as well, so re-binding the base is caught too."""
    by_storage: dict[int | None, tuple[str, Callable[[], Any], torch.Tensor]] = {}
    for path, res, t in names.values():  # per storage the named tensor with the most elements: the base
        sp = storage_key(t)
        if sp not in by_storage or t.numel() > by_storage[sp][2].numel():
            by_storage[sp] = (path, res, t)
    out: list[External] = []
    seen = set()

    def add(path: str, t: torch.Tensor, res: Callable[[], Any] | None) -> None:
        if id(t) in seen:
            return
        seen.add(id(t))
        out.append(
            External(path, t, t.data_ptr(), tuple(t.shape), tuple(t.stride()), res, storage_key(t) in rec.written)
        )

    for i, t in enumerate(rec.externals.values()):
        named = names.get(id(t))
        base = by_storage.get(storage_key(t))
        desc = f"{list(t.shape)} {str(t.dtype).replace('torch.', '')}"
        if named is not None and named[0] is not None:
            add(named[0], t, named[1])
        elif base is None:
            add(f"an unnamed tensor #{i} {desc}", t, None)
        else:
            add(f"a view {desc} of {base[0]}", t, None)
        if base is not None and base[2] is not t:
            add(base[0], base[2], base[1])
    return out


class _InputWrites(OpConsumer):
    """Records the first op of a forward that writes each static input buffer."""

    def __init__(self, storages: dict[int, tuple[str, bool]]) -> None:
        self.storages = storages
        self.found: dict[str, Any] = {}

    def before(self, ev: OpEvent) -> None:
        for t in ev.written:
            k = storage_key(t)
            hit = self.storages.get(k) if k is not None else None
            if hit is not None and not hit[1] and hit[0] not in self.found:
                self.found[hit[0]] = (ev.op, ev.where)


class _LastWarmupRecording(CaptureHook):
    """A hook that records the last warmup forward of each key with a fresh consumer from
    :meth:`_consumer`, kept in ``self._rec[key]`` until the hook's own step reads it or ``end``."""

    def __init__(self) -> None:
        self._rec: dict[Any, Any] = {}

    def _consumer(self) -> OpConsumer:
        raise NotImplementedError

    def warmup_consumers(self, cap: Capture, i: int) -> Sequence[Any]:
        if i != cap.warmups - 1:
            return ()
        rec = self._rec[cap.key] = self._consumer()
        return (rec,)

    def end(self, cap: Capture) -> None:
        self._rec.pop(cap.key, None)


class InputWritesCheck(_LastWarmupRecording):
    """Refuses, at capture, a step that writes into one of its inputs (in place, ``out=``) unless
    the input is declared ``BatchInput(state=True)``.

    A graph writes the runner's static buffer, never the caller's tensor: a
    step doing ``state.add_(delta)`` replays 1, 1, 1 where eager gives 1, 2,
    3, and an index input advanced in place (``pos.add_(1)``) shifts the
    padding every call. The last warmup forward's ops are watched (the one op
    recorder); the error names the input, the op and the source line.
    ``storages``: :meth:`graphrunner.staging.StaticInputs.storage_names`.
    """

    name = "input-writes"

    def __init__(self, storages: dict[int, tuple[str, bool]]) -> None:
        super().__init__()
        self.storages = storages

    def _consumer(self) -> OpConsumer:
        return _InputWrites(self.storages)

    def after_warmups(self, cap: Capture) -> None:
        rec = self._rec.pop(cap.key, None)
        if rec is None or not rec.found:
            return

        name, (op, loc) = next(iter(rec.found.items()))
        msg = (
            f"the step writes into its input {name!r} ({op} at {where_text(loc)}) at the capture of shape key "
            f"{cap.key!r}: a graph writes the runner's static buffer, never your tensor, so every call would "
            "start again from the tensor you pass (eager would have updated it) and the padding cells would "
            "drift. Return the new value as an output instead, or declare "
            f"BatchInput(state=True) for {name!r} if the write is scratch the step does not need to see again "
            "(the runner then re-pads it after every call and never writes your tensor)"
        )
        cap.fail(
            CaptureError(msg),
            finding_at(
                "input-write",
                msg,
                loc,
                fix=f"return the new value of {name!r} as an output, or declare BatchInput(state=True)",
            ),
        )


class ExternalsCheck(_LastWarmupRecording):
    """Debug mode's externals contract as a capture hook, for one runner.

    Records the externals of the last warmup forward of each key
    (:class:`ExternalRecorder`), names them after the capture
    (:func:`externals_of` over :func:`named_tensors` of ``step``: what the
    warmups created lazily exists by then) and adds ``externals_read`` and
    ``externals_written`` to the key's report. Before each replay
    (``replay_check``) it checks that every external of the key still
    resolves to the same storage, shape and strides (:meth:`ExternalGuard.check`).
    ``input_storages``: the runner's static input storages (not externals);
    ``key_text(key)`` names a key in messages.
    """

    name = "externals"
    replay_check = True

    def __init__(self, step: Callable[..., Any], input_storages: Sequence[int], key_text: Callable[[Any], str]) -> None:
        self.step = step
        self.inputs = list(input_storages)
        self.guard = ExternalGuard({}, key_text)
        super().__init__()

    def _consumer(self) -> OpConsumer:
        return ExternalRecorder(self.inputs)

    def after_capture(self, cap: Capture) -> None:
        rec = self._rec.get(cap.key)
        if rec is None:
            return
        exts = externals_of(rec, named_tensors(self.step))
        self.guard.per_key[cap.key] = exts
        cap.info["externals_read"] = len(exts)
        cap.info["externals_written"] = [e.describe() for e in exts if e.written]

    def before_replay(self, key: Any) -> None:
        self.guard.check(key)


class ExternalGuard:
    """Checks, before each replay, that every external of the key is unchanged (debug mode).

    ``per_key``: ``{key: [External, ...]}``; ``key_text(key)`` names a key in
    messages. :class:`ExternalsCheck` calls :meth:`check` before each replay.
    """

    def __init__(self, per_key: dict[Any, list[External]], key_text: Callable[[Any], str]) -> None:
        self.per_key = per_key
        self.key_text = key_text

    def check(self, key: Any) -> None:
        """Raise :class:`ContractError` for the first external of ``key`` that moved, was
        re-bound, or changed shape or strides since capture."""
        for e in self.per_key.get(key, ()):
            cur = e.tensor
            if e.resolve is not None:
                try:
                    cur = e.resolve()
                except Exception as exc:  # noqa: BLE001 - the path no longer resolves
                    raise ContractError(
                        self._msg(e, key, f"no longer resolves ({type(exc).__name__}: {exc})")
                    ) from None
            if not isinstance(cur, torch.Tensor):
                raise ContractError(self._msg(e, key, f"was re-bound to a {type(cur).__name__}"))
            if cur.data_ptr() != e.ptr or tuple(cur.shape) != e.shape or tuple(cur.stride()) != e.stride:
                how = "was re-bound to another tensor" if cur is not e.tensor else "changed in place"
                raise ContractError(
                    self._msg(
                        e, key, f"{how}: now {list(cur.shape)} stride {list(cur.stride())} at 0x{cur.data_ptr():x}"
                    )
                )

    def _msg(self, e: External, key: Any, change: str) -> str:
        return (
            f"GraphRunner (debug): before replaying {self.key_text(key)}: the graph reads {e.path} "
            f"({list(e.shape)} stride {list(e.stride)} at 0x{e.ptr:x} at capture), which {change}. The graph "
            "still reads the memory it was captured with, so this replay would silently use stale (or freed) "
            "data. Update captured tensors in place (`with torch.no_grad(): param.copy_(new)`, "
            "`cache.zero_()`), allocate caches at their final size before capture, or call "
            "runner.cleanup() and runner.capture() again"
        )

    def written(self) -> list[dict[str, Any]]:
        """The externals any key's graph writes, once each: ``[{"path", "shape", "dtype"}]``."""
        seen, out = set(), []
        for exts in self.per_key.values():
            for e in exts:
                if e.written and e.path not in seen:
                    seen.add(e.path)
                    out.append(e.describe())
        return out


# -------------------------------------------------------------- a failed call, explained
def step_note(
    exc: BaseException,
    where: str,
    key_text: str,
    bounded: Sequence[tuple[int, str, tuple[Any, Any], int]],
    names: Sequence[str],
    tensors: Sequence[torch.Tensor],
    debug: bool,
) -> str | None:
    """The note (PEP 678, :func:`~graphrunner.errors.add_note`) graphrunner adds to ``exc``, raised by a
    call's ``where`` (``"replay"`` or ``"eager fallback"``) of ``key_text``, which reaches the caller
    with its own type: it names the call's input whose value lies outside its
    ``BatchInput(bounds=)`` when one does (an index out of range is the usual cause of a failure
    inside the tape's engine), else the inputs without bounds, and says how to check every call
    (``debug=True``). ``None`` for a ``GraphRunnerError`` (already explained) or an exception that
    is not an ``Exception``."""
    if isinstance(exc, GraphRunnerError) or not isinstance(exc, Exception):
        return None
    cause = None
    for i, name, bounds, lead in bounded:
        err = bounds_error(name, tensors[i], bounds, lead)
        if err is not None:
            cause = f"the likely cause: {str(err).split('. Nothing was copied')[0]}"
            break
    if cause is None:
        declared = {name for _, name, _, _ in bounded}
        free = [n for n in names if n not in declared]
        cause = "every input with bounds= lies within them" + (
            f"; inputs without bounds=: {free} (declare "
            "BatchInput(bounds=(lo, hi)) for index inputs so that a value out of range is named)"
            if free
            else ""
        )
    check = "" if debug else "; GraphRunner(debug=True) checks every call's inputs against bounds= before anything runs"
    return (
        f"GraphRunner: raised by the {where} of {key_text} ({cause}{check}); the runner is still usable "
        "for the next call"
    )
