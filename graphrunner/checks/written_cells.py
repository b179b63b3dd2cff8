"""What a run wrote, cell by cell, and the cells only the padded call wrote given other values.

From a :class:`~graphrunner.recording.ops.WriteGuard` log, :func:`written` tells the storage
offsets each write reached (an ``index_put_``'s indexed cells, an in-place op's view);
:class:`PerturbedCells` gives the cells that only the padded call wrote (its padding rows'
writes) other values for the unpadded call sequence of the padding check, and puts them back.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

import torch
from torch.utils._python_dispatch import _disable_current_modes

from graphrunner._aten import storage_key
from graphrunner.recording import ops

__all__ = ["MAX_CELLS", "PerturbedCells", "index_offsets", "no_modes", "strided_offsets", "written"]

#: One entry of a :class:`~graphrunner.recording.ops.WriteGuard` log: ``(put-back function, its arguments)``.
LogEntry = tuple[Any, tuple]
#: ``(storage key, dtype)`` -> ``(a tensor on that storage, element offsets written)``.
Written = dict[tuple[int | None, torch.dtype], tuple[torch.Tensor, torch.Tensor]]

#: Written cells of one logged write larger than this are not followed (a whole KV cache).
MAX_CELLS = 1 << 24


def strided_offsets(shape: Sequence[int], stride: Sequence[int], offset: int, device: torch.device) -> torch.Tensor:
    """Element offsets of every cell of a strided view (``shape``, ``stride``, ``offset``), flat."""
    off = torch.full((), offset, dtype=torch.long, device=device)
    for size, st in zip(shape, stride):
        off = off[..., None] + torch.arange(size, device=device) * st
    return off.reshape(-1)


def index_offsets(t: torch.Tensor, index: Sequence[Any]) -> torch.Tensor | None:
    """Element offsets (in ``t``'s storage) of the cells ``t[index] = ...`` writes (``None`` entries
    are whole dims, as ``index_put_`` takes them); ``None`` when they cannot be told."""
    adv: list[tuple[int, torch.Tensor]] = []  # (dim, index) of the advanced indices
    d = 0
    for i in index:
        if i is None:
            d += 1
            continue
        if i.dtype == torch.bool:
            nz = i.nonzero()
            adv.extend((d + j, nz[:, j]) for j in range(i.dim()))
            d += i.dim()
        else:
            adv.append((d, i.long()))
            d += 1
    if not adv or d > t.dim():
        return strided_offsets(t.shape, t.stride(), int(t.storage_offset()), t.device) if not adv else None
    idx = torch.broadcast_tensors(*[i for _, i in adv])
    base = torch.full((), int(t.storage_offset()), dtype=torch.long, device=t.device)
    for (dim, _), i in zip(adv, idx):
        base = base + (i.to(t.device) % max(1, t.shape[dim])) * t.stride(dim)
    done = {dim for dim, _ in adv}
    rest = [k for k in range(t.dim()) if k not in done]
    rest_off = strided_offsets([t.shape[k] for k in rest], [t.stride(k) for k in rest], 0, t.device)
    if base.numel() * rest_off.numel() > MAX_CELLS:
        return None
    return (base.reshape(-1, 1) + rest_off.reshape(1, -1)).reshape(-1)


def written(log: Sequence[LogEntry]) -> Written:
    """``{(storage, dtype): (a tensor on it, element offsets written)}`` of a
    :class:`~graphrunner.recording.ops.WriteGuard` log (writes of whole storages, ``out=``, are not
    followed)."""
    parts: dict[tuple[int | None, torch.dtype], tuple[torch.Tensor, list[torch.Tensor]]] = {}
    with torch.inference_mode():
        for put, args in log:
            t = args[0]
            if put is ops._put_index:
                off = index_offsets(t, args[1])
            elif put is ops._put_index_copy:
                off = index_offsets(t, [None] * (args[1] % max(1, t.dim())) + [args[2]])
            elif put is ops._put_view and t.numel() <= MAX_CELLS:
                off = strided_offsets(t.shape, t.stride(), int(t.storage_offset()), t.device)
            else:
                continue
            if off is None:
                continue
            k = (storage_key(t), t.dtype)
            parts.setdefault(k, (t, []))[1].append(off)
        return {k: (t, torch.cat(offs).unique()) for k, (t, offs) in parts.items()}


class PerturbedCells:
    """The cells that only the padded call wrote (written by run A, not by run D), given new
    values in the unpadded sequence for its follow-up and put back afterwards."""

    def __init__(self, a_log: Sequence[LogEntry], d_log: Sequence[LogEntry]) -> None:
        #: ``[(a tensor on the storage, flat typed view, offsets, old values)]``
        self.cells: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]] = []
        wa, wd = written(a_log), written(d_log)
        g = torch.Generator().manual_seed(0x73657121)
        with no_modes(), torch.inference_mode():
            for k, (t, offs) in wa.items():
                if not (t.dtype.is_floating_point or t.dtype.is_complex):
                    continue  # an integer state could become an index: left as it is
                if k in wd:
                    offs = offs[~torch.isin(offs, wd[k][1])]
                if not offs.numel():
                    continue
                st = t.untyped_storage()
                flat = torch.empty(0, dtype=t.dtype, device=t.device).set_(
                    st, 0, (st.nbytes() // t.element_size(),), (1,)
                )
                offs = offs[offs < flat.numel()]
                old = flat[offs].clone()
                mag = torch.nan_to_num(old.abs().to(torch.float32), nan=0.0, posinf=0.0).pow(2).mean().sqrt()
                scale = float(mag) if float(mag) > 0 else 1.0
                noise = torch.randn(offs.numel(), generator=g) * scale
                flat[offs] = old + noise.to(device=t.device, dtype=t.dtype)
                self.cells.append((t, flat, offs, old))

    def restore(self) -> None:
        """Put the cells' old values back, newest first."""
        with no_modes(), torch.inference_mode():
            for _, flat, offs, old in reversed(self.cells):
                flat[offs] = old


def no_modes() -> contextlib.AbstractContextManager[None]:
    """Run without the active dispatch modes (the op recorder's): the put-backs are not the step's ops."""

    return _disable_current_modes()
