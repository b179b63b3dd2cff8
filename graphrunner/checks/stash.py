"""Stashed-state check: a tensor made during a capture and kept on an object.

A step that keeps state by re-binding an attribute (``self.state =
self.state.index_copy(0, slots, h)``, ``self.last = h``, a module global, a
list on an attribute) works eagerly: Python re-binds the attribute at every
call. A graph does not run Python at replay, so the attribute keeps the one
tensor the capture made: the next call reads the state of the capture (or of
the warmup before it), forever, and the tensor the graph updates is one
nobody reads. Every call after the first replays wrong, silently.

:class:`StashCheck` watches the captured forward through the one op recorder
(:mod:`graphrunner.recording.ops`): it keeps a weak reference to every tensor an
op of the capture returns on new memory (a view of such memory too), except
constants (made from Python data and other constants only: the same at every
replay). After the capture, a tensor still alive is held by someone; the ones
an object keeps as an attribute (looked for from the step down: its objects,
their attributes, ``nn.Module`` buffers and submodules, lists and dicts, and
the globals of the modules it ran, :func:`attribute_names`) are reported: a
:class:`~graphrunner.errors.CaptureError` naming the attribute, the line of
the user's code that assigns it (found in the source of the files the step
ran, by the attribute's name) and the remedy: write the state in place, or
return the tensor. In collect mode (``graphrunner check``) a
``"stashed-state"`` finding.

It works on every graph kind: the ops of a CUDA capture reach the recorder as
the tape's do. On the breakable backend only the graph segments are watched,
and an assignment inside a ``@no_graph`` function (which runs at every
replay) is not reported.

Opt out for a deliberate cache (a tensor computed on first use inside the
step and read only there): ``self.table = captured_cache(t)`` (it returns
``t``); the tape's own :class:`~graphrunner.tape.StashedTensorWarning` honours
the mark too. The check is part of the drift check (``"drift"`` in
``GraphRunner(checks=...)``, ``drift_check=`` of a backend): both find Python
state a graph freezes.
"""

from __future__ import annotations

import ast
import os
import re
import sys
import types
import weakref
from collections.abc import Collection, Sequence
from typing import Any, Literal

import torch

from graphrunner._aten import storage_key, tensors_in
from graphrunner._frames import is_library
from graphrunner.errors import CaptureError
from graphrunner.recording.hooks import Capture, CaptureHook, Finding
from graphrunner.recording.ops import FRESH_RETURNS as _FRESH
from graphrunner.recording.ops import UNKNOWN, OpConsumer, OpEvent, fresh_returns
from graphrunner.tape.survivors import is_deliberate_cache, mark_cache, stash_reported_elsewhere

__all__ = ["StashCheck", "StashWatch", "attribute_names", "captured_cache"]

Where = tuple[str, int, str]


def captured_cache(t: torch.Tensor) -> torch.Tensor:
    """Mark ``t``, a tensor made during a capture and kept on an object, as a deliberate cache; returns ``t``.

    The stashed-state check (part of the drift check) then lets the capture keep it: use it for a value
    computed on first use inside the step and read only inside the step (``self.table =
    captured_cache(build(...))``). What a graph replay leaves in it is what that graph computed; other
    graphs, eager calls and the caller never see it updated, so never use it for state that a later call
    reads (write such state in place into a tensor allocated before capture).
    """

    return mark_cache(t)


class StashWatch(OpConsumer):
    """Op consumer of the captured forward: weak references to the tensors its ops return on new
    memory (not constants), with the user's line that made each."""

    def __init__(self) -> None:
        self.made: list[tuple[weakref.ref, Where | None]] = []
        self.created: set = set()  # storages the capture's ops made
        self.const: set = set()  # ... of those, the ones made from constants only
        self.files: set[str] = set()  # the user's source files the ops ran in

    def after(self, ev: OpEvent) -> None:
        out = ev.out
        if isinstance(out, torch.Tensor):
            outs: Sequence[torch.Tensor] = (out,)
        elif isinstance(out, (tuple, list)):
            outs = list(tensors_in(out))
            if not outs:
                return
        else:
            return
        func = ev.func
        created, const = self.created, self.const
        tens = [t for v in ev.args for t in tensors_in(v)]
        if ev.kwargs:
            tens += [t for v in ev.kwargs.values() for t in tensors_in(v)]
        arg_keys = None
        if const:
            arg_keys = {storage_key(t) for t in tens}
            arg_keys.discard(None)
            from_const = arg_keys <= const
            if func._schema.is_mutable and not from_const:  # a constant written with other data: no more
                for t in ev.written:
                    const.discard(storage_key(t))
        else:
            from_const = not tens
        fresh = _FRESH.get(func, UNKNOWN)
        if fresh is UNKNOWN:
            fresh = _FRESH[func] = fresh_returns(func)
        where = None
        for t in outs:
            k = storage_key(t)
            if k is None:
                continue
            if k not in created:
                if fresh is False:
                    continue
                if fresh is None:
                    if arg_keys is None:
                        arg_keys = {storage_key(a) for a in tens}
                    if k in arg_keys:
                        continue
                created.add(k)
                if from_const:
                    const.add(k)
            if k not in const:
                if where is None:
                    where = ev.where
                    if where is not None:
                        self.files.add(where[0])
                self.made.append((weakref.ref(t), where))

    def alive(self) -> list[tuple[torch.Tensor, Where | None]]:
        """The tensors it saw made that are still alive (not constants), each once."""
        out, seen = [], set()
        for w, where in self.made:
            t = w()
            if t is None or id(t) in seen or storage_key(t) in self.const:
                continue
            seen.add(id(t))
            out.append((t, where))
        return out


class StashCheck(CaptureHook):
    """The stashed-state check of every key, as a capture hook (composed into the drift check).

    Watches the captured forward (:class:`StashWatch`), and after the capture reports each tensor
    it made that an object keeps as an attribute: :class:`CaptureError` naming the attribute, the
    line that assigns it and the remedy, or in collect mode a ``"stashed-state"`` finding.
    Deliberate caches (:func:`captured_cache`) and constants are let through. While it watches,
    the tape's own :class:`~graphrunner.tape.StashedTensorWarning` is not issued as well.
    """

    name = "stash"

    def __init__(self) -> None:
        self._watch: dict[Any, StashWatch] = {}
        self._tokens: dict[Any, Any] = {}

    def capture_consumers(self, cap: Capture) -> Sequence[Any]:
        if cap.freezes is None:
            return ()

        w = self._watch[cap.key] = StashWatch()
        self._tokens[cap.key] = stash_reported_elsewhere.set(True)
        return (w,)

    def after_capture(self, cap: Capture) -> None:
        self._reset(cap)
        w = self._watch.pop(cap.key, None)
        if w is None or not w.made:
            return

        alive = [(t, where) for t, where in w.alive() if not is_deliberate_cache(t)]
        if not alive:
            return
        named = attribute_names({id(t): t for t, _ in alive}, [cap.forward_fn], w.files)
        del w
        for t, where in alive:
            for attr in named.get(id(t), ()):
                site = _assignment(attr, where, cap.freezes == "segments")
                if site is False:
                    continue  # assigned inside a @no_graph function: re-bound at every replay
                self._report(cap, t, attr, where, site)
                return  # one per key: the first names the pattern

    def end(self, cap: Capture) -> None:
        self._reset(cap)
        self._watch.pop(cap.key, None)

    def _reset(self, cap: Capture) -> None:
        token = self._tokens.pop(cap.key, None)
        if token is not None:
            try:
                stash_reported_elsewhere.reset(token)
            except ValueError:  # set in another context (a hook run elsewhere): leave it
                stash_reported_elsewhere.set(False)

    def _report(
        self, cap: Capture, t: torch.Tensor, attr: str, made: Where | None, site: tuple[str, int, str, str] | None
    ) -> None:
        desc = f"{tuple(t.shape)} {str(t.dtype).replace('torch.', '')}"
        if site is not None:
            file, line, func, text = site
            at = f"assigned at {file}:{line} in {func}: `{text}`"
            loc: Where | None = (file, line, func)
        elif made is not None:
            at = f"made at {made[0]}:{made[1]} in {made[2]}"
            loc = made
        else:
            at, loc = "the line is unknown", None
        m = _ATTR.match(attr)

        on_module = m is not None and m.group("owner") in sys.modules
        short = (m.group("attr") + m.group("rest")) if m else attr
        short = short if on_module else f"self.{short}"
        what = (
            f"a tensor made during the capture of shape key {cap.key!r} ({desc}) is kept in {attr} after it "
            f"({at}). A graph does not run Python at replay, so {attr} is never re-bound: every later call, "
            "replayed or eager, of any bucket, reads the tensor this capture left there, and the tensor the "
            "graph updates is not the one the next call reads: state kept this way replays stale"
        )
        fix = (
            f"write the state in place into a tensor allocated before capture ({short}.copy_(new), "
            f"{short}.index_copy_(0, slots, h), {short}[slots] = h), or return the tensor as an "
            f"output; if it is a deliberate cache read only inside the step, mark it: "
            f"graphrunner.checks.captured_cache(tensor)"
        )
        cap.fail(
            CaptureError(f"{what}. Fix: {fix}."),
            Finding(
                "stashed-state",
                what,
                loc[0] if loc else None,
                loc[1] if loc else None,
                loc[2] if loc else None,
                fix=fix,
                in_library=bool(loc and is_library(loc[0])),
            ),
        )


# ----------------------------------------------------------------- which attribute keeps it
#: How deep :func:`attribute_names` follows objects from its roots, how deep into containers, and
#: how many objects it visits at most.
_OBJECT_DEPTH = 4
_CONTAINER_DEPTH = 3
_MAX_OBJECTS = 50_000


def attribute_names(
    tensors: dict[int, torch.Tensor], roots: Sequence[Any], files: Collection[str] = ()
) -> dict[int, list[str]]:
    """``{id(tensor): ["Owner.attr", "Owner.attr[0]['k']", "module.NAME", ...]}``: where each of
    ``tensors`` is kept, looked for from ``roots`` down (a callable's closure cells, bound object and
    wrapped function; objects' attributes, ``nn.Module`` buffers, parameters and submodules, lists,
    tuples and dicts) and in the globals of the modules whose source ``files`` the step ran. Objects
    of graphrunner's own modules do not count (the library's bookkeeping). Cheap: no heap walk, a
    bounded number of objects; a tensor kept where none of these reach (another module's registry,
    a cache of ``functools``) is not named."""
    walk = _AttributeWalk(tensors)
    for r in roots:
        walk.obj(r, 0)
    if files:
        by_file = _modules_by_file()
        for f in {os.path.abspath(f) for f in files}:
            for m in by_file.get(f, ()):
                for k, v in list(vars(m).items()):
                    if isinstance(v, (torch.Tensor, list, tuple, dict)):
                        walk.value(v, f"{m.__name__}.{k}", 0, 0)
    return walk.found


class _AttributeWalk:
    """One walk of :func:`attribute_names`: the names ``found`` so far, the objects ``seen``, and
    the ``budget`` of objects left to visit."""

    def __init__(self, tensors: dict[int, torch.Tensor]) -> None:
        self.tensors = tensors
        self.found: dict[int, list[str]] = {}
        self.seen: set[int] = set()
        self.budget = _MAX_OBJECTS

    def add(self, t: Any, path: str) -> None:
        if id(t) in self.tensors and self.tensors[id(t)] is t:
            lst = self.found.setdefault(id(t), [])
            if path not in lst:
                lst.append(path)

    def value(self, v: Any, path: str, depth: int, cdepth: int) -> None:
        """A value at ``path``: a tensor, a container (``cdepth`` deep in containers) or an object."""
        if isinstance(v, torch.Tensor):
            self.add(v, path)
            return
        if self.budget <= 0:
            return
        if isinstance(v, (list, tuple)):
            if cdepth < _CONTAINER_DEPTH and id(v) not in self.seen:
                self.seen.add(id(v))
                self.budget -= 1
                for i, x in enumerate(v[:1000]):
                    self.value(x, f"{path}[{i}]", depth, cdepth + 1)
            return
        if isinstance(v, dict):
            if cdepth < _CONTAINER_DEPTH and id(v) not in self.seen:
                self.seen.add(id(v))
                self.budget -= 1
                for k, x in list(v.items())[:1000]:
                    self.value(x, f"{path}[{k!r}]", depth, cdepth + 1)
            return
        self.obj(v, depth + 1)

    def obj(self, o: Any, depth: int) -> None:
        """An object ``depth`` objects down: a callable's closure cells, bound object and wrapped
        function; an object's attributes (an ``nn.Module``'s buffers, parameters and submodules)."""
        if depth > _OBJECT_DEPTH or id(o) in self.seen or self.budget <= 0 or o is None:
            return
        if isinstance(o, (str, bytes, int, float, complex, bool, type, types.ModuleType)) or _ours(o):
            return
        self.seen.add(id(o))
        self.budget -= 1
        if callable(o) and not isinstance(o, torch.nn.Module):
            for c in getattr(o, "__closure__", None) or ():
                try:
                    self.obj(c.cell_contents, depth) if not isinstance(c.cell_contents, torch.Tensor) else None
                except ValueError:
                    pass
            for a in ("__self__", "__wrapped__", "func"):
                inner = getattr(o, a, None)
                if inner is not None and not isinstance(inner, types.ModuleType):
                    self.obj(inner, depth)
            if isinstance(o, (types.FunctionType, types.MethodType, types.BuiltinFunctionType)):
                return
        try:
            attrs = object.__getattribute__(o, "__dict__")
        except AttributeError:
            return
        if not isinstance(attrs, dict):
            return
        label = type(o).__name__
        for k, v in list(attrs.items()):
            if k in ("_buffers", "_parameters", "_modules") and isinstance(o, torch.nn.Module) and isinstance(v, dict):
                for n, x in list(v.items()):
                    self.value(x, f"{label}.{n}", depth, 1)
                continue
            self.value(v, f"{label}.{k}", depth, 0)


_BY_FILE: list[Any] = [-1, {}]  # [len(sys.modules) when built, {absolute source path: [module]}]


def _modules_by_file() -> dict[str, list[Any]]:
    """``{absolute source path: [module]}`` of the imported modules (not graphrunner's own), rebuilt
    only when the number of imported modules changed: a scan of ``sys.modules`` (thousands of
    modules with torch and transformers) per captured key cost ~10 ms."""

    if _BY_FILE[0] != len(sys.modules):
        table: dict[str, list[Any]] = {}
        for m in list(sys.modules.values()):
            f = getattr(m, "__file__", None)
            name = getattr(m, "__name__", "") or ""
            if isinstance(f, str) and f and not name.startswith("graphrunner."):
                table.setdefault(os.path.abspath(f), []).append(m)
        _BY_FILE[0], _BY_FILE[1] = len(sys.modules), table
    return _BY_FILE[1]


def _ours(o: Any) -> bool:
    mod = getattr(type(o), "__module__", "") or ""
    return mod == "graphrunner" or mod.startswith("graphrunner.")


# ----------------------------------------------------------------- where the attribute is assigned
_ATTR = re.compile(r"^(?P<owner>.*)\.(?P<attr>[A-Za-z_]\w*)(?P<rest>(?:\[[^\]]*\])*)$")
_TREES: dict[str, tuple[float, ast.AST | None, list[str]]] = {}


def _tree(file: str) -> tuple[ast.AST | None, list[str]]:
    try:
        mtime = os.path.getmtime(file)
    except OSError:
        return None, []
    hit = _TREES.get(file)
    if hit is not None and hit[0] == mtime:
        return hit[1], hit[2]
    try:
        with open(file, encoding="utf-8") as fh:
            src = fh.read()
        tree: ast.AST | None = ast.parse(src)
    except (OSError, SyntaxError, ValueError):
        tree, src = None, ""
    lines = src.splitlines()
    _TREES[file] = (mtime, tree, lines)
    return tree, lines


def _assignment(attr: str, made: Where | None, segments: bool) -> tuple[str, int, str, str] | None | Literal[False]:
    """``(file, line, function, source)`` of the assignment of ``attr`` (``"Owner.name[...]"``) in
    the file the tensor was made in, nearest after that line in the same function first; ``None``
    when not found; ``False`` when ``segments`` and it lies in a ``@no_graph`` function."""
    m = _ATTR.match(attr)
    if m is None or made is None:
        return None
    name = m.group("attr")
    tree, lines = _tree(made[0])
    if tree is None:
        return None
    sites: list[tuple[int, str, bool]] = []  # (line, function, inside a @no_graph function)

    def visit(node: ast.AST, func: str, in_break: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                brk = in_break or any("no_graph" in ast.unparse(d) for d in child.decorator_list)
                visit(child, child.name, brk)
                continue
            if isinstance(child, ast.stmt) and _assigns(child, name):  # _assigns: statements only
                sites.append((child.lineno, func, in_break))
            visit(child, func, in_break)

    visit(tree, "<module>", False)
    if not sites:
        return None
    same = [s for s in sites if s[1] == made[2]]
    pick = sorted(same or sites, key=lambda s: (s[0] < made[1], abs(s[0] - made[1])))[0]
    if segments and pick[2]:
        return False
    text = lines[pick[0] - 1].strip() if 0 < pick[0] <= len(lines) else ""
    return made[0], pick[0], pick[1], text


def _assigns(node: ast.AST, name: str) -> bool:
    """``node`` binds attribute or global ``name``: ``x.name = ...`` (also augmented, annotated,
    through a subscript), ``name[...] = ...``, ``setattr(x, "name", ...)``, ``x.register_buffer("name", ...)``."""
    targets: list[ast.AST] = []
    if isinstance(node, ast.Assign):
        targets = list(node.targets)
    elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
        targets = [node.target]
    elif isinstance(node, ast.Expr) and isinstance(node.value, ast.Call):
        call = node.value
        fn = call.func
        fname = fn.attr if isinstance(fn, ast.Attribute) else fn.id if isinstance(fn, ast.Name) else ""
        args = call.args
        if fname == "setattr" and len(args) >= 2:
            return isinstance(args[1], ast.Constant) and args[1].value == name
        if fname in ("register_buffer", "register_parameter") and args:
            return isinstance(args[0], ast.Constant) and args[0].value == name
        return False
    for tgt in targets:
        for t in ast.walk(tgt):
            if isinstance(t, ast.Attribute) and t.attr == name:
                return True
            if isinstance(t, ast.Subscript) and isinstance(t.value, ast.Name) and t.value.id == name:
                return True
    return False
