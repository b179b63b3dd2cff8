"""The static-input stager: the runner's input buffers, the per-call copy and the re-pad.

:class:`StaticInputs` owns one buffer per declared input, allocated once at
the largest key and filled with the input's pad value. A call is validated
(:meth:`StaticInputs.validate`: names, dtype, trailing shape, shared sizes,
no aliasing of the buffers), copied into the leading region of its sizes
(:meth:`StaticInputs.stage`), and the cells inside the replayed key but
outside the call's sizes are reset to the pad value only where an earlier
call left data (:meth:`StaticInputs.pad_to`: the ``filled`` extent tracks
the bounding box of cells that may hold data). Eager fallbacks get copies
padded to agreed sizes (:meth:`StaticInputs.padded`). ``runner.compare``,
the checks and the runner all stage through this one object.
"""

from __future__ import annotations

from typing import Any, Dict, List, Mapping, Optional, Tuple

import torch

from graphrunner.errors import GraphRunnerError
from graphrunner.inputs import BatchInput, alias_error, diagnose
from graphrunner.keys import padding_regions, region

__all__ = ["StaticInputs"]

Sizes = Tuple[int, ...]
_Tensor = torch.Tensor


class StaticInputs:
    """The static input buffers of one runner and everything that writes them.

    ``specs``: ``{name: BatchInput}``; ``in_dims[name]``: indices of the
    input's leading dims among the runner's ``dims``; ``maxes``: the largest
    size of each dim (the buffers' leading shape); ``legacy``: one batch dim
    given as ``buckets=[...]`` (messages speak of the batch).
    """

    def __init__(self, specs: Mapping[str, BatchInput], in_dims: Mapping[str, Tuple[int, ...]],
                 dims: Tuple[str, ...], maxes: Tuple[int, ...], legacy: bool, device: torch.device) -> None:
        self.specs: Dict[str, BatchInput] = dict(specs)
        self.in_dims = dict(in_dims)
        self.dims, self.maxes, self.legacy, self.device = dims, tuple(maxes), legacy, device
        with torch.inference_mode(False):  # normal tensors: writable outside inference mode
            #: ``{name: (*largest size of each of its dims, *trailing)}``.
            self.buffers: Dict[str, torch.Tensor] = {
                name: torch.full((*(maxes[d] for d in self.in_dims[name]), *spec.trailing), spec.pad,
                                 dtype=spec.dtype, device=device)
                for name, spec in self.specs.items()}
        self.names = tuple(self.specs)
        self._n = len(self.names)
        self._checks = tuple((s.dtype, s.trailing, len(s.trailing) + len(self.in_dims[n]), len(self.in_dims[n]),
                              self.in_dims[n]) for n, s in self.specs.items())
        self.dim_idx = tuple(self.in_dims[n] for n in self.names)
        self._pads = tuple((self.buffers[n], s.pad) for n, s in self.specs.items())
        # [start, end) byte address of every buffer: an input that starts inside
        # one aliases the runner's own memory (checked before any write).
        self._ranges = tuple((b.data_ptr(), b.data_ptr() + b.numel() * b.element_size()) for b, _ in self._pads)
        self._span = (min(lo for lo, _ in self._ranges), max(hi for _, hi in self._ranges))
        self._own = tuple(lo for lo, _ in self._ranges)
        self.zero: Sizes = (0,) * len(dims)
        self.filled: Sizes = self.zero  # outside [:filled[0], :filled[1], ...] every buffer holds its pad value
        self._views: Dict[Sizes, List[torch.Tensor]] = {}
        self._pad_views: Dict[Tuple[Sizes, Sizes], List[Tuple[torch.Tensor, Any]]] = {}

    # ------------------------------------------------------------ facts
    @property
    def storages(self) -> List[int]:
        """The storage keys of the buffers (they are inputs, not externals, to the checks)."""
        return [b.untyped_storage().data_ptr() for b in self.buffers.values()]

    @property
    def nbytes(self) -> int:
        """Bytes held by the buffers."""
        return sum(t.numel() * t.element_size() for t in self.buffers.values())

    def key_views(self, key: Sizes) -> Dict[str, torch.Tensor]:
        """``{name: the key's region of its buffer}``: what the step reads for ``key``."""
        return {name: buf[region(key, self.in_dims[name])] for name, buf in self.buffers.items()}

    def fits(self, sizes: Sizes) -> bool:
        """True when ``sizes`` fit the buffers (every size at most the dim's largest)."""
        return all(n <= m for n, m in zip(sizes, self.maxes))

    # ----------------------------------------------------------- per call
    def validate(self, inputs: Mapping[str, Any]) -> Tuple[List[torch.Tensor], Sizes]:
        """``(tensors in declaration order, sizes per dim)`` of valid call ``inputs``; raises the
        ``ValueError``/``TypeError`` naming the input otherwise (nothing is written)."""
        sizes = [-1] * len(self.dims)
        try:
            if len(inputs) != self._n:
                raise KeyError
            tensors = [inputs[name] for name in self.names]
            lo_all, hi_all = self._span
            for name, t, (dtype, trailing, ndim, lead, didx), own in zip(self.names, tensors, self._checks,
                                                                          self._own):
                shape = t.shape
                if t.dtype != dtype or len(shape) != ndim or shape[lead:] != trailing or not isinstance(t, _Tensor):
                    raise KeyError
                for j, d in enumerate(didx):
                    v = shape[j]
                    if sizes[d] != v:
                        if sizes[d] >= 0:
                            raise KeyError
                        sizes[d] = v
                ptr = t.data_ptr()  # must hold data (not meta) and not point into a static buffer
                if ptr == 0:
                    if t.is_meta:
                        raise KeyError
                elif lo_all <= ptr < hi_all and (ptr != own or not t.is_contiguous()):
                    # Between the buffers' addresses and not exactly its own leading
                    # region (a harmless no-op copy): the slow path decides.
                    if self._alias_error(name, t) is not None:
                        raise KeyError
            if min(sizes) <= 0:
                raise KeyError
        except (KeyError, TypeError, AttributeError):
            raise self.error(inputs) from None
        return tensors, tuple(sizes)

    def error(self, inputs: Any) -> Exception:
        """The error for invalid call ``inputs`` (slow path): names the input and what was expected."""
        return diagnose(inputs, self.specs, self.in_dims, self.dims, self.legacy, self._alias_error)

    def _alias_error(self, name: str, t: torch.Tensor) -> Optional[Exception]:
        return alias_error(self._ranges, self.names, name, t)

    def stage(self, tensors: List[torch.Tensor], sizes: Sizes) -> None:
        """Copy the (validated) inputs into the leading region ``sizes`` of the buffers. If a copy
        fails, every buffer is reset to its pad value (no half-written cells stay behind) and
        :class:`GraphRunnerError` names the input."""
        views = self._views.get(sizes)
        if views is None:
            views = self._views[sizes] = [buf[region(sizes, didx)] for (buf, _), didx in
                                          zip(self._pads, self.dim_idx)]
        i = 0
        try:
            for i, (v, t) in enumerate(zip(views, tensors)):
                # detach: a copy from a tensor that requires grad would chain an
                # autograd history onto the static buffer at every call.
                v.copy_(t.detach() if t.requires_grad else t)
        except Exception as exc:
            self.restore_pads(tuple(map(max, self.filled, sizes)))
            t = tensors[i]
            raise GraphRunnerError(
                f"GraphRunner: copying input {self.names[i]!r} ({type(t).__name__} of shape {list(t.shape)}, "
                f"{t.dtype}, on {t.device}) into its static buffer failed: {type(exc).__name__}: {exc}. Nothing "
                "was replayed and the static buffers were reset to their pad values; the runner is still usable"
            ) from exc
        filled = self.filled
        self.filled = sizes if filled == self.zero else tuple(map(max, filled, sizes))

    def pad_to(self, sizes: Sizes, key: Sizes) -> None:
        """Make the cells inside ``key`` but outside ``sizes`` hold the pad value: a no-op unless
        an earlier call left data there (``filled`` exceeds ``sizes`` in some dim)."""
        if self.filled == sizes:
            return
        pv = self._pad_views.get((sizes, key))
        if pv is None:
            pv = self._pad_views[(sizes, key)] = [
                (buf[r], pad) for (buf, pad), didx in zip(self._pads, self.dim_idx)
                for r in padding_regions(sizes, key, didx)]
        for view, pad in pv:
            view.fill_(pad)
        filled = self.filled
        # Outside ``key`` earlier data may remain: keep the bounding box.
        self.filled = sizes if all(f <= k for f, k in zip(filled, key)) else tuple(map(max, filled, sizes))

    def restore_pads(self, extent: Optional[Sizes] = None) -> None:
        """Set the leading region ``extent`` (default: all that may hold data) of every buffer to
        its pad value."""
        extent = self.filled if extent is None else extent
        for (buf, pad), didx in zip(self._pads, self.dim_idx):
            buf[region(extent, didx)].fill_(pad)
        self.filled = self.zero

    def padded(self, tensors: List[torch.Tensor], sizes: Sizes, rows: Sizes) -> Dict[str, torch.Tensor]:
        """The step's keyword inputs for an eager run of ``tensors`` (sizes ``sizes``) padded to
        ``rows`` with each input's pad value (fresh tensors on the runner's device)."""
        kwargs: Dict[str, torch.Tensor] = {}
        dev = self.device
        for (name, spec), t, didx in zip(self.specs.items(), tensors, self.dim_idx):
            if rows != sizes:
                p = torch.full((*(rows[d] for d in didx), *spec.trailing), spec.pad, dtype=spec.dtype, device=dev)
                p[region(sizes, didx)].copy_(t)
                t = p
            elif t.device != dev:
                t = t.to(dev)
            kwargs[name] = t
        return kwargs
