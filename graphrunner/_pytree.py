"""Flatten and rebuild pytrees of tensors: the one structure walker of graphrunner.

Used for backend outputs (the shared output buffer) and for the results of
eager breaks, so both accept the same containers and reject the same leaves.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

__all__ = ["flatten", "unflatten", "describe", "structure", "leaf_paths"]

# A spec is a nested tuple:
#   ("T",)                                   tensor leaf
#   ("N",)                                   None
#   ("tuple", type, (child specs...))        tuple / namedtuple
#   ("list", (child specs...))
#   ("dict", type, (keys...), (child specs...))
#   ("dc", type, (field names...), (child specs...))   dataclass instance
#   ("S", value)                             Python scalar (only with scalars=True)


_SCALARS = (bool, int, float, complex, str, bytes)


def flatten(obj: Any, path: str = "output", scalars: bool = False) -> tuple[tuple, list[torch.Tensor]]:
    """Return ``(spec, tensor_leaves)`` of a pytree of tensors.

    Containers: tuple (and namedtuple), list, dict, dataclass instance;
    leaves: tensors and ``None``, and with ``scalars=True`` Python scalars,
    whose value is part of the spec (so comparing specs compares them). Any
    other leaf raises ``TypeError`` naming its path (``path`` names the root),
    because a graph would freeze it silently.
    """
    leaves: list[torch.Tensor] = []
    spec = _flatten(obj, path, leaves, scalars)
    return spec, leaves


def _flatten(obj: Any, path: str, leaves: list, scalars: bool) -> tuple:
    if isinstance(obj, torch.Tensor):
        leaves.append(obj)
        return ("T",)
    if obj is None:
        return ("N",)
    if isinstance(obj, tuple):
        return ("tuple", type(obj), tuple(_flatten(x, f"{path}[{i}]", leaves, scalars) for i, x in enumerate(obj)))
    if isinstance(obj, list):
        return ("list", tuple(_flatten(x, f"{path}[{i}]", leaves, scalars) for i, x in enumerate(obj)))
    if isinstance(obj, dict):
        keys = tuple(obj.keys())
        return ("dict", type(obj), keys, tuple(_flatten(obj[k], f"{path}[{k!r}]", leaves, scalars) for k in keys))
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        names = tuple(f.name for f in dataclasses.fields(obj))
        return ("dc", type(obj), names, tuple(_flatten(getattr(obj, n), f"{path}.{n}", leaves, scalars) for n in names))
    if scalars and isinstance(obj, _SCALARS):
        return ("S", obj)
    who = (
        "an eager break (@no_graph) may return only tensors, None, Python scalars"
        if scalars
        else "a captured forward may return only tensors, None"
    )
    raise TypeError(
        f"{path} is a {type(obj).__name__} ({obj!r:.60}); {who}, and tuples/lists/dicts/dataclasses of them "
        "(a graph would freeze any other value silently). Return its tensors in one of those containers, "
        "or compute it outside the graph."
    )


def unflatten(spec: tuple, leaves: list[torch.Tensor]) -> Any:
    """Rebuild the pytree described by ``spec`` from its tensor leaves."""
    it = iter(leaves)
    return _unflatten(spec, it)


def _unflatten(spec: tuple, it) -> Any:
    tag = spec[0]
    if tag == "T":
        return next(it)
    if tag == "N":
        return None
    if tag == "S":
        return spec[1]
    if tag == "tuple":
        items = [_unflatten(s, it) for s in spec[2]]
        cls = spec[1]
        if cls is tuple:
            return tuple(items)
        if hasattr(cls, "_fields"):  # namedtuple
            return cls(*items)
        return cls(items)
    if tag == "list":
        return [_unflatten(s, it) for s in spec[1]]
    if tag == "dict":
        d = {k: _unflatten(s, it) for k, s in zip(spec[2], spec[3])}
        return d if spec[1] is dict else spec[1](d)
    if tag == "dc":
        cls = spec[1]
        values = {n: _unflatten(s, it) for n, s in zip(spec[2], spec[3])}
        obj = object.__new__(cls)
        for n, v in values.items():
            object.__setattr__(obj, n, v)  # works for frozen dataclasses too
        return obj
    raise AssertionError(f"bad output spec {spec!r}")


def describe(spec: tuple, leaves: list[torch.Tensor] | None = None) -> str:
    """A readable one-line description, e.g. ``tuple(Tensor[8, 16] float32, None)``."""
    it = iter(leaves) if leaves is not None else None
    return _describe(spec, it)


def _leaf(it) -> str:
    if it is None:
        return "Tensor"
    t = next(it)
    return f"Tensor{list(t.shape)} {str(t.dtype).replace('torch.', '')}"


def _describe(spec: tuple, it) -> str:
    tag = spec[0]
    if tag == "T":
        return _leaf(it)
    if tag == "N":
        return "None"
    if tag == "S":
        return repr(spec[1])
    if tag == "tuple":
        name = spec[1].__name__
        return f"{name}(" + ", ".join(_describe(s, it) for s in spec[2]) + ")"
    if tag == "list":
        return "list[" + ", ".join(_describe(s, it) for s in spec[1]) + "]"
    if tag == "dict":
        return "dict(" + ", ".join(f"{k!r}: {_describe(s, it)}" for k, s in zip(spec[2], spec[3])) + ")"
    if tag == "dc":
        return f"{spec[1].__name__}(" + ", ".join(f"{n}={_describe(s, it)}" for n, s in zip(spec[2], spec[3])) + ")"
    return repr(spec)


def structure(spec: tuple) -> tuple:
    """``spec`` with the values of Python scalar leaves blanked: two specs
    with equal structures differ at most in those values."""
    tag = spec[0]
    if tag == "S":
        return ("S",)
    if tag in ("T", "N"):
        return spec
    return spec[:-1] + (tuple(structure(child) for child in spec[-1]),)


def leaf_paths(spec: tuple, root: str = "output") -> list[str]:
    """The path of every tensor leaf of ``spec``, in leaf order, e.g.
    ``["output['hidden']", "output['total']"]`` (the spelling of :func:`flatten`'s errors)."""
    out: list[str] = []
    _paths(spec, root, out)
    return out


def _paths(spec: tuple, path: str, out: list[str]) -> None:
    tag = spec[0]
    if tag == "T":
        out.append(path)
    elif tag == "tuple":
        for i, s in enumerate(spec[2]):
            _paths(s, f"{path}[{i}]", out)
    elif tag == "list":
        for i, s in enumerate(spec[1]):
            _paths(s, f"{path}[{i}]", out)
    elif tag == "dict":
        for k, s in zip(spec[2], spec[3]):
            _paths(s, f"{path}[{k!r}]", out)
    elif tag == "dc":
        for n, s in zip(spec[2], spec[3]):
            _paths(s, f"{path}.{n}", out)
