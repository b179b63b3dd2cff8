"""What a step reaches: its objects, the tensors they hold, the Python numbers they re-bind.

Step introspection for the padding check: :func:`step_objects` lists the objects a step
reaches (the step, a bound method's object, a closure's cells, ``nn.Module`` children);
:func:`tensor_attributes` names the tensors they hold, :func:`named_cells` the cells a call
wrote in them (for messages); :class:`PythonNumbers` keeps and puts back the numbers and tensor
attributes they re-bind, so that the check's extra runs all start from the same Python state.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from graphrunner._aten import storage_key

__all__ = ["PythonNumbers", "Snapshot", "named_cells", "step_objects", "tensor_attributes"]

#: ``[(object or class, attribute, value)]``: the attributes :class:`PythonNumbers` keeps.
Snapshot = list[tuple[Any, str, Any]]


def named_cells(step: Callable[..., Any], cells: list[tuple[torch.Tensor, torch.Tensor]]) -> list[str]:
    """``["SlotState.state[0, :]", ...]``: the tensors (by attribute, when the step's objects hold
    them) and the cells only the padded call wrote."""
    named = tensor_attributes(step)
    out: list[str] = []
    for t, offs in cells:
        k = storage_key(t)
        hit = next(((n, v) for n, v in named if storage_key(v) == k and v.dtype == t.dtype), None)
        if hit is None:
            out.append(f"a {tuple(t.shape)} {str(t.dtype).replace('torch.', '')} tensor ({offs.numel()} cells)")
            continue
        name, v = hit
        out.append(name + _cells_text(v, offs))
    return out


def _cells_text(v: torch.Tensor, offs: torch.Tensor) -> str:
    """``[0, :]``: the cells at storage offsets ``offs`` in ``v``'s index space, dim by dim (``:``
    for a whole dim, a value or up to 3 values), or ``""`` when ``v`` is not contiguous."""
    if not v.is_contiguous() or v.dim() == 0:
        return ""
    rel = offs.to("cpu") - int(v.storage_offset())
    rel = rel[(rel >= 0) & (rel < v.numel())]
    if not rel.numel():
        return ""
    parts: list[Any] = []  # a dim's value, or its text
    for size, stride in zip(v.shape, v.stride()):
        vals = torch.unique((rel // stride) % size).tolist()
        if len(vals) == size and size > 1:
            parts.append(":")
        elif len(vals) <= 3:
            parts.append(vals[0] if len(vals) == 1 else "{" + ", ".join(map(str, vals)) + "}")
        else:
            parts.append("{" + ", ".join(map(str, vals[:3])) + ", ...}")
    return "[" + ", ".join(map(str, parts)) + "]"


def step_objects(step: Callable[..., Any]) -> list[tuple[str, Any]]:
    """``[(label, object)]`` the step reaches: the step, the object of a bound method, a closure's
    cells; ``nn.Module`` children by attribute (``TinyDecoder.layers``), plain objects' attributes
    one level down. What :func:`tensor_attributes` and :class:`PythonNumbers` look in."""
    roots: list[Any] = []
    seen: set[int] = set()
    out: list[tuple[str, Any]] = []
    for r in (step, getattr(step, "__self__", None), getattr(step, "func", None)):
        if r is not None:
            roots.append(r)
    for cell in getattr(step, "__closure__", None) or ():
        try:
            roots.append(cell.cell_contents)
        except ValueError:
            pass

    def visit(obj: Any, label: str, depth: int) -> None:
        if id(obj) in seen or depth > 2:
            return
        seen.add(id(obj))
        out.append((label, obj))
        attrs = getattr(obj, "__dict__", None)
        if not isinstance(attrs, dict) or isinstance(obj, type):
            return
        for n, v in list(attrs.items()):
            if isinstance(v, torch.nn.Module) and not n.startswith("_"):
                visit(v, f"{label}.{n}", depth + 1)
            elif (
                depth == 0
                and hasattr(v, "__dict__")
                and not callable(v)
                and not isinstance(v, type)
                and not isinstance(v, torch.Tensor)
            ):
                visit(v, f"{label}.{n}", depth + 1)

    for r in roots:
        if (
            isinstance(r, (torch.nn.Module,))
            or (hasattr(r, "__dict__") and not callable(r))
            or (callable(r) and hasattr(r, "__dict__") and not isinstance(r, type) and not hasattr(r, "__code__"))
        ):
            visit(r, type(r).__name__, 0)
    return out


def tensor_attributes(step: Callable[..., Any]) -> list[tuple[str, torch.Tensor]]:
    """``[(name, tensor)]`` of the tensors the step's objects hold (:func:`step_objects`);
    ``nn.Module`` buffers and parameters by their path (``TinyDecoder.layers.0.k_cache``)."""
    out: list[tuple[str, torch.Tensor]] = []
    for label, obj in step_objects(step):
        if isinstance(obj, torch.nn.Module):
            for n, t in list(obj.named_buffers()) + list(obj.named_parameters()):
                out.append((f"{label}.{n}", t))
        attrs = getattr(obj, "__dict__", None)
        if isinstance(attrs, dict) and not isinstance(obj, type):
            out.extend((f"{label}.{n}", v) for n, v in list(attrs.items()) if isinstance(v, torch.Tensor))
    return out


class PythonNumbers:
    """The Python state a step re-binds: the number (``int``, ``float``, ``bool``) and tensor
    attributes of the objects it reaches (:func:`step_objects`), kept so that the padding check's
    extra runs all start from the same Python state. A step that counts its calls in ``self.n``
    (drift) or re-binds ``self.state = f(self.state)`` (stashed state) then gives the same output in
    two identical runs, so the check measures padding leaks next to the drift or stashed-state
    finding instead of giving up on them (one finding never hides another), and the capture sees
    the attributes as if the check had not run.

    Contract: :meth:`snapshot` returns the attributes now (tensors by reference); :meth:`put`
    writes a snapshot's values back into the attributes whose value is no longer that object
    (straight into ``__dict__``, no ``__setattr__``; a class attribute through ``type.__setattr__``:
    the user's classes of the objects are followed too, so ``Step.calls += 1`` counts like
    ``self.calls += 1``). State elsewhere (module globals, closure cells, containers, a tensor's
    contents: those are the write guard's) is not followed."""

    def __init__(self, step: Callable[..., Any]) -> None:
        reached = [obj for _, obj in step_objects(step)]
        self.objects: list[Any] = [
            obj for obj in reached if isinstance(getattr(obj, "__dict__", None), dict) and not isinstance(obj, type)
        ]
        # the user's classes of those objects (and their bases): a counter kept in a class attribute
        # (``Step.calls += 1``) is Python state the step re-binds just like ``self.calls``
        classes: list[type] = []
        for obj in reached:
            for cls in getattr(obj if isinstance(obj, type) else type(obj), "__mro__", ()):
                mod = getattr(cls, "__module__", "") or ""
                if mod == "builtins" or mod.split(".")[0] in ("torch", "graphrunner") or cls in classes:
                    continue
                classes.append(cls)
        self.objects += classes

    def snapshot(self) -> Snapshot:
        """``[(object or class, attribute, value)]`` of every number and tensor attribute now."""
        return [
            (obj, n, v)
            for obj in self.objects
            for n, v in list(vars(obj).items())
            if type(v) in (int, float, bool) or isinstance(v, torch.Tensor)
        ]

    @staticmethod
    def put(snapshot: Snapshot | None) -> None:
        """Write ``snapshot``'s values back where they changed."""
        for obj, n, v in snapshot or ():
            if vars(obj).get(n, v) is v:
                continue
            if isinstance(obj, type):  # a class's __dict__ is read-only: set it as the class would
                type.__setattr__(obj, n, v)
            else:
                obj.__dict__[n] = v  # vars(obj): straight into the instance dict, no __setattr__
