"""What an aten op writes, and what identifies a storage: the facts every op recorder shares.

Used by the checks' one op recorder (:mod:`graphrunner.recording.ops`) and by the
tape's own recording (:mod:`graphrunner.tape.recording`), so that "which
arguments does this op write" and "is this the same storage" have one answer.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import torch

__all__ = ["storage_key", "tensors_in", "written_tensors"]


def storage_key(t: torch.Tensor) -> int | None:
    """The identity of ``t``'s storage (its data pointer), ``None`` for a tensor without
    one (meta, sparse, wrapper subclasses) or an empty storage. Every check compares storages
    with this one function."""
    try:
        p = t.untyped_storage().data_ptr()
    except Exception:  # noqa: BLE001 - tensors without a storage
        return None
    return p or None


def tensors_in(v: Any) -> Iterator[torch.Tensor]:
    """The tensors in ``v`` (a tensor, or nested lists/tuples of them)."""
    if isinstance(v, torch.Tensor):
        yield v
    elif isinstance(v, (list, tuple)):
        for x in v:
            yield from tensors_in(x)


def written_tensors(func: Any, args: Sequence[Any], kwargs: dict, every_argument: bool = False) -> list[torch.Tensor]:
    """The tensors the aten op ``func`` writes: every argument its schema marks as written
    (``Tensor(a!)``: in-place ``self``, ``out=``), lists of tensors included; with
    ``every_argument`` (a collective, which writes its buffers in place) every tensor argument."""
    slots = _WRITTEN.get((func, every_argument))
    if slots is None:
        slots = _WRITTEN[(func, every_argument)] = _written_slots(func, every_argument)
    if not slots:
        return []
    out: list[torch.Tensor] = []
    for i, name in slots:
        v = args[i] if i < len(args) else kwargs.get(name)
        out.extend(tensors_in(v))
    return out


def _written_slots(func: Any, every_argument: bool) -> tuple[tuple[int, str], ...]:
    """``(position, name)`` of the arguments :func:`written_tensors` reads for ``func``."""
    schema = func._schema
    if not every_argument and not schema.is_mutable:
        return ()
    return tuple(
        (i, a.name)
        for i, a in enumerate(schema.arguments)
        if every_argument or (a.alias_info is not None and a.alias_info.is_write)
    )


# (op, every_argument) -> _written_slots: a schema's arguments are asked once per op, not per call
_WRITTEN: dict = {}
