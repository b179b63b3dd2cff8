"""One output arena shared by several runners of one model (``gr.OutputArena``).

A serving engine captures a decode runner, a verify runner and a prefill
runner of one model. Each backend copies its graphs' outputs into one static
output buffer (:class:`graphrunner.backends.outputs.OutputBuffer`). Those
runners never replay at the same time, so their buffers can be the same
memory: with ``GraphRunner(..., output_arena=arena)`` every buffer is carved
from the arena's block at offset 0, and the arena holds the *max* of the
buffers' sizes instead of their sum.

The price is the lifetime of views: a replay of any runner on the arena
overwrites the outputs of every other. Runners given an arena therefore
return copies by default (``copy_outputs=None`` means True there); with an
explicit ``copy_outputs=False`` a returned view is valid only until the next
call of *any* runner on the arena.

Growth: a buffer larger than the current block gets a new, larger block.
Buffers carved earlier keep the old one (their graphs hold its address), so
capture the runner with the largest outputs first to hold only the max;
:attr:`OutputArena.bytes_held` always counts the blocks actually alive and
:meth:`OutputArena.summary` says when a block was outgrown.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any

import torch

from graphrunner.report import format_bytes

__all__ = ["OutputArena"]

#: Byte alignment of every tensor carved from a block (covers every dtype's element size).
ALIGN = 64


def _round_up(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


class OutputArena:
    """Memory shared by the output buffers of several runners (one block per device).

    ``carve(owner, layouts)`` returns tensors for ``layouts`` (a list of
    ``(shape, dtype, device)``), laid out from offset 0 of the device's
    block, growing the block when it is too small; ``release(owner)`` forgets
    an owner. ``owner`` is any object (the backend's output buffer); it is
    held weakly. Several owners' tensors overlap by design: only one owner's
    graph may be replayed at a time, and its outputs are valid until another
    owner replays.
    """

    def __init__(self, name: str = "arena") -> None:
        self.name = str(name)
        self._blocks: dict[str, torch.Tensor] = {}
        self._needs: weakref.WeakKeyDictionary[Any, tuple[str, int]] = weakref.WeakKeyDictionary()
        self._held: weakref.WeakKeyDictionary[Any, list[torch.Tensor]] = weakref.WeakKeyDictionary()
        self.outgrown = 0

    def carve(self, owner: Any, layouts: Sequence[tuple[Sequence[int], torch.dtype, Any]]) -> list[torch.Tensor]:
        """Tensors for ``layouts``, carved from offset 0 of each device's block (uninitialised)."""
        sizes: dict[str, int] = {}
        offsets = []
        for shape, dtype, device in layouts:
            dev = str(torch.device(device))
            off = sizes.get(dev, 0)
            numel = 1
            for s in shape:
                numel *= int(s)
            nbytes = numel * torch.empty((), dtype=dtype).element_size()
            offsets.append((dev, off, nbytes))
            sizes[dev] = off + _round_up(max(nbytes, 1))
        for dev, need in sizes.items():
            block = self._blocks.get(dev)
            if block is None or block.numel() < need:
                if block is not None:
                    self.outgrown += 1
                self._blocks[dev] = torch.empty(need, dtype=torch.uint8, device=dev)
        out = []
        for (shape, dtype, _), (dev, off, nbytes) in zip(layouts, offsets):
            raw = self._blocks[dev][off : off + nbytes]
            out.append(raw.view(dtype).view(tuple(int(s) for s in shape)))
        self._needs[owner] = (", ".join(sorted(sizes)), sum(sizes.values()))
        self._held[owner] = [self._blocks[d] for d in sizes]
        return out

    def release(self, owner: Any) -> None:
        """Forget ``owner``'s claim (its tensors stay valid while referenced)."""
        self._needs.pop(owner, None)
        self._held.pop(owner, None)

    @property
    def owners(self) -> int:
        """Number of output buffers carved from the arena and not released."""
        return len(self._needs)

    @property
    def bytes_needed(self) -> list[int]:
        """Bytes each live owner needs (with alignment), in no particular order."""
        return [n for _, n in self._needs.values()]

    @property
    def bytes_held(self) -> int:
        """Bytes of the distinct blocks live owners hold: the max of their needs unless a block was outgrown."""
        seen = {}
        for blocks in self._held.values():
            for b in blocks:
                seen[b.data_ptr()] = b.numel()
        return sum(seen.values())

    @property
    def bytes_if_separate(self) -> int:
        """Bytes the live owners would hold with one buffer each (the sum of their needs)."""
        return sum(self.bytes_needed)

    def summary(self) -> str:
        """One line: owners, bytes held, what separate buffers would hold, and any outgrown block."""

        line = (
            f"output arena {self.name!r}: {self.owners} runner output buffers share "
            f"{format_bytes(self.bytes_held)} (separate buffers would hold {format_bytes(self.bytes_if_separate)})"
        )
        if self.bytes_held > max(self.bytes_needed, default=0):
            line += (
                "; a block was outgrown after an earlier runner captured: capture the runner with the "
                "largest outputs first to hold only the largest"
            )
        return line

    def facts(self) -> dict[str, Any]:
        """What a capture report says of the arena: ``name``, ``owners``, ``bytes_held``,
        ``bytes_if_separate`` and the :meth:`summary` line."""
        return {
            "name": self.name,
            "owners": self.owners,
            "bytes_held": self.bytes_held,
            "bytes_if_separate": self.bytes_if_separate,
            "summary": self.summary(),
        }

    def __repr__(self) -> str:
        return f"OutputArena(name={self.name!r}, owners={self.owners}, bytes_held={self.bytes_held})"
