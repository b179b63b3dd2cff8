"""The shared static output buffer of a backend (internal helper).

A forward may return any pytree of tensors: a tensor, ``tuple``, ``list``,
``dict``, dataclass instance, ``None``, nested. All keys of one backend share
one buffer, allocated at the first captured key (which must be the largest):

- every tensor leaf with ``ndim >= 1`` is *batch-major*: dim 0 is the row
  dimension. Its buffer has the first key's shape; a later key's output must
  have the same dtype, device, ``ndim`` and trailing dims, and at most as
  many rows. That key's output is the leading-rows view ``buffer[:rows]``.
- a 0-dim leaf (a scalar tensor: a loss, a counter) is not batch-major: every
  key shares the whole 0-dim buffer leaf; it holds the value of the most
  recent replay, whichever key that was.
- ``None`` is kept as ``None``; any other non-tensor leaf is rejected with a
  ``TypeError`` naming its path (a graph would freeze it silently).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from graphrunner._pytree import describe, flatten, unflatten  # noqa: F401 (re-exported)
from graphrunner.errors import CaptureError


class OutputBuffer:
    """The static buffer every key's output is copied into.

    ``allocate(out, key)`` makes it from a (warmup) output; ``views(out, key)``
    validates another output against it and returns the leading-rows views;
    ``copy_into(views, out)`` copies an output into views (inside the graph).
    With an ``arena`` (:class:`graphrunner.arena.OutputArena`) the leaves are
    carved from the arena's shared block instead of allocated on their own.
    """

    def __init__(self, arena: Any = None) -> None:
        self.spec: tuple | None = None
        self.leaves: list[torch.Tensor] = []
        self.first_key: Any = None
        self.arena = arena

    @property
    def allocated(self) -> bool:
        """True once the buffer exists."""
        return self.spec is not None

    @property
    def nbytes(self) -> int:
        """Bytes held by the whole shared buffer."""
        return sum(t.numel() * t.element_size() for t in self.leaves)

    def allocate(self, out: Any, key: Any) -> None:
        """Allocate an uninitialised buffer shaped like ``out`` (contiguous)."""
        spec, leaves = flatten(out)
        self.spec = spec
        if self.arena is not None:
            self.leaves = self.arena.carve(self, [(t.shape, t.dtype, t.device) for t in leaves])
        else:
            self.leaves = [torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in leaves]
        self.first_key = key

    def release(self) -> None:
        """Drop the buffer (next ``allocate`` starts over)."""
        if self.arena is not None:
            self.arena.release(self)
        self.spec = None
        self.leaves = []
        self.first_key = None

    def views(self, out: Any, key: Any, lead: int = 1) -> tuple[tuple, list[torch.Tensor]]:
        """Validate ``out`` against the buffer and return ``(spec, views)``.

        The first ``lead`` dims of a tensor leaf (rows, and with several
        named dims the next ones) may be smaller than the buffer's; its view
        is the buffer's leading corner. Raises ``CaptureError`` naming both
        structures if the pytree structure differs, or naming the leaf if a
        dtype, device, ndim or later dim differs or a leading dim is larger
        than the buffer's.
        """
        spec, leaves = flatten(out)
        if self.spec is None:
            raise CaptureError(
                f"forward for shape key {key!r} returned {describe(spec, leaves)}, but the shared output buffer "
                "is not allocated (allocate() it from a warmup's output first, and again after release())"
            )
        if spec != self.spec:
            raise CaptureError(
                f"forward for shape key {key!r} returned {describe(spec, leaves)}, but the shared output buffer "
                f"was allocated at shape key {self.first_key!r} for {describe(self.spec, self.leaves)}: every "
                "shape key must return the same structure (same containers, keys and number of tensors)"
            )
        views = []
        for i, (t, b) in enumerate(zip(leaves, self.leaves)):
            k = min(lead, t.dim())
            if (
                t.dtype != b.dtype
                or t.device != b.device
                or t.dim() != b.dim()
                or tuple(t.shape[k:]) != tuple(b.shape[k:])
            ):
                which = "only dim 0 (rows) may differ" if lead == 1 else f"only the leading {lead} dims may differ"
                raise CaptureError(
                    f"forward for shape key {key!r}: output tensor {i} is {list(t.shape)} {t.dtype} on {t.device}, "
                    f"but the shared output buffer (allocated at shape key {self.first_key!r}) holds "
                    f"{list(b.shape)} {b.dtype} on {b.device}; {which} between keys"
                )
            if t.dim() == 0:
                views.append(b)
                continue
            for d in range(k):
                if t.shape[d] > b.shape[d]:
                    what = (
                        f"{t.shape[0]} rows, more than the {b.shape[0]} rows"
                        if d == 0
                        else f"{t.shape[d]} in dim {d}, more than the {b.shape[d]}"
                    )
                    raise CaptureError(
                        f"forward for shape key {key!r}: output tensor {i} has {what} of the shared output buffer "
                        f"allocated at shape key {self.first_key!r}; capture the largest key first"
                    )
            if tuple(t.shape[:k]) == tuple(b.shape[:k]):
                views.append(b)
            elif k == 1:
                views.append(b[: t.shape[0]])
            else:
                views.append(b[tuple(slice(0, n) for n in t.shape[:k])])
        return spec, views

    @staticmethod
    def copy_into(views: list[torch.Tensor], out: Any) -> None:
        """Copy the tensor leaves of ``out`` into ``views`` (no autograd)."""
        _, leaves = flatten(out)
        with torch.no_grad():
            for v, t in zip(views, leaves):
                if v is not t:
                    v.copy_(t)


def tensor_bytes(obj: Any) -> int:
    """Bytes of the distinct storages of all tensors reachable through
    tuples, lists, dicts, sets and dataclasses in ``obj``."""
    seen = set()
    total = 0
    ident: tuple  # a storage's (data_ptr, nbytes, device), or (id(tensor),) without a storage
    stack = [obj]
    visited = set()
    while stack:
        x = stack.pop()
        if isinstance(x, torch.Tensor):
            try:
                st = x.untyped_storage()
                ident = (st.data_ptr(), st.nbytes(), str(x.device))
                n = st.nbytes()
            except Exception:  # noqa: BLE001 - tensors without storage (meta, sparse)
                ident, n = (id(x),), x.numel() * x.element_size()
            if ident not in seen:
                seen.add(ident)
                total += n
        elif isinstance(x, (list, tuple, set, frozenset)):
            if id(x) not in visited:
                visited.add(id(x))
                stack.extend(x)
        elif isinstance(x, dict):
            if id(x) not in visited:
                visited.add(id(x))
                stack.extend(x.values())
        elif dataclasses.is_dataclass(x) and not isinstance(x, type):
            if id(x) not in visited:
                visited.add(id(x))
                stack.extend(getattr(x, f.name) for f in dataclasses.fields(x))
    return total
