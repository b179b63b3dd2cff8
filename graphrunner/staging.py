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
the checks and the runner all stage through this one object. A size of 0
is valid (an idle rank: nothing is copied, every cell of the key is padding).
Buffers too large for the device are a ``ValueError`` naming the largest key
and the bytes needed, before or instead of the allocator's own error.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from typing import Any

import torch

from graphrunner.errors import GraphRunnerError
from graphrunner.inputs import BatchInput, Pad, alias_error, diagnose
from graphrunner.keys import MEMO_LIMIT, padding_regions, region

__all__ = ["StaticInputs"]

_set_grad_enabled = torch._C._set_grad_enabled

Sizes = tuple[int, ...]
_Tensor = torch.Tensor


class StaticInputs:
    """The static input buffers of one runner and everything that writes them.

    Keywords: ``specs``: ``{name: BatchInput}``; ``in_dims[name]``: indices of the
    input's leading dims among the runner's ``dims``; ``maxes``: the largest
    size of each dim (the buffers' leading shape); ``one_batch_dim``: the runner was
    built with ``buckets=[...]``, one dim, the batch (messages speak of the batch).
    """

    def __init__(
        self,
        *,
        specs: Mapping[str, BatchInput],
        in_dims: Mapping[str, tuple[int, ...]],
        dims: tuple[str, ...],
        maxes: tuple[int, ...],
        one_batch_dim: bool,
        device: torch.device,
    ) -> None:
        self.specs: dict[str, BatchInput] = dict(specs)
        self.in_dims: dict[str, tuple[int, ...]] = dict(in_dims)
        self.dims, self.maxes, self.one_batch_dim, self.device = dims, tuple(maxes), one_batch_dim, device
        #: ``{name: (*largest size of each of its dims, *trailing)}``.
        self.buffers: dict[str, torch.Tensor] = self._allocate()
        self.names = tuple(self.specs)
        #: Some input is ``BatchInput(state=True)``: the step writes it, so its padding is re-padded
        #: after every call (:meth:`written_by_step`).
        self.stateful = any(s.state for s in self.specs.values())
        #: ``(position, name, (lo, hi), leading dims)`` of every input with ``BatchInput(bounds=...)``.
        self.bounded = tuple(
            (i, n, s.bounds, len(self.in_dims[n]))
            for i, (n, s) in enumerate(self.specs.items())
            if s.bounds is not None
        )
        self._n = len(self.names)
        self._checks = tuple(
            (s.dtype, s.trailing, len(s.trailing) + len(self.in_dims[n]), len(self.in_dims[n]), self.in_dims[n])
            for n, s in self.specs.items()
        )
        self.dim_idx = tuple(self.in_dims[n] for n in self.names)
        self._pads = tuple((self.buffers[n], s.pad) for n, s in self.specs.items())
        # [start, end) byte address of every buffer: an input that starts inside
        # one aliases the runner's own memory (checked before any write).
        self._ranges = tuple((b.data_ptr(), b.data_ptr() + b.numel() * b.element_size()) for b, _ in self._pads)
        self._span = (min(lo for lo, _ in self._ranges), max(hi for _, hi in self._ranges))
        self._own = tuple(lo for lo, _ in self._ranges)
        # every input is (rows, *trailing) of one dim: the fast validation (shapes cached per row count)
        self._rows_only = len(dims) == 1 and all(self.in_dims[n] == (0,) for n in self.names)
        self._fast = tuple(zip((s.dtype for s in self.specs.values()), self._own, self.names))
        self._shapes: dict[int, tuple[torch.Size, ...]] = {}
        self.zero: Sizes = (0,) * len(dims)
        self._one_dim = len(dims) == 1
        self.filled: Sizes = self.zero  # outside [:filled[0], :filled[1], ...] every buffer holds its pad value
        # The views a call of given sizes copies into (and re-pads), cached per sizes (and key) and
        # started over at keys.MEMO_LIMIT entries: varlen sizes rarely repeat.
        self._views: dict[Sizes, list[torch.Tensor]] = {}
        #: ``{(sizes, key): (views whose pad is +0, [(view, pad) for the other views])}``: what pad_to resets.
        self._pad_views: dict[tuple[Sizes, Sizes], tuple[list[torch.Tensor], list[tuple[torch.Tensor, Pad]]]] = {}

    def _allocate(self) -> dict[str, torch.Tensor]:
        """One buffer per input at the largest key, filled with its pad value; a ``ValueError``
        naming the largest bucket and the bytes needed when they cannot be allocated."""
        shapes = {n: (*(self.maxes[d] for d in self.in_dims[n]), *s.trailing) for n, s in self.specs.items()}
        sizes = {
            n: math.prod(shape) * torch.empty((), dtype=self.specs[n].dtype).element_size()
            for n, shape in shapes.items()
        }
        need, dev = sum(sizes.values()), torch.device(self.device)
        total = _memory_of(dev)

        def error(what: str) -> ValueError:
            biggest = max(sizes, key=sizes.__getitem__)
            where = (
                f"bucket {self.maxes[0]}"
                if self.one_batch_dim
                else f"key ({', '.join(f'{d}={n}' for d, n in zip(self.dims, self.maxes))})"
            )
            return ValueError(
                f"buckets: the largest {where} needs {need:,} bytes of static input buffers on {dev} (input "
                f"{biggest!r}: {list(shapes[biggest])} {self.specs[biggest].dtype}, {sizes[biggest]:,} bytes), and "
                f"{what}. The largest bucket sets the leading size of every static input: use smaller buckets, "
                "e.g. gr.default_buckets(max_batch) with the largest batch you serve"
            )

        if total is not None and need > total:
            raise error(f"the device has {total:,} bytes in all")
        try:
            with torch.inference_mode(False):  # normal tensors: writable outside inference mode
                return {n: torch.full(shapes[n], s.pad, dtype=s.dtype, device=dev) for n, s in self.specs.items()}
        except (RuntimeError, MemoryError) as exc:  # torch.OutOfMemoryError is a RuntimeError
            raise error(f"allocating them failed ({type(exc).__name__}: {str(exc).splitlines()[0][:200]})") from None

    # ------------------------------------------------------------ facts
    @property
    def storages(self) -> list[int]:
        """The storage keys of the buffers (they are inputs, not externals, to the checks)."""
        return [b.untyped_storage().data_ptr() for b in self.buffers.values()]

    @property
    def nbytes(self) -> int:
        """Bytes held by the buffers."""
        return sum(t.numel() * t.element_size() for t in self.buffers.values())

    def key_inputs(self, views: dict[str, torch.Tensor]) -> list[tuple[str, torch.Tensor, tuple[int, ...], BatchInput]]:
        """``(name, its view in views, leading-dim indices, BatchInput)`` of every input: what the
        padding check fills."""
        return [(n, views[n], self.in_dims[n], s) for n, s in self.specs.items()]

    def fingerprint(self) -> dict[str, Any]:
        """The inputs as the cross-rank configuration check compares them."""
        return {
            n: {
                "dims": [self.dims[d] for d in self.in_dims[n]],
                "trailing": list(s.trailing),
                "dtype": str(s.dtype),
                "pad": s.pad,
            }
            for n, s in self.specs.items()
        }

    def key_views(self, key: Sizes) -> dict[str, torch.Tensor]:
        """``{name: the key's region of its buffer}``: what the step reads for ``key``."""
        return {name: buf[region(key, self.in_dims[name])] for name, buf in self.buffers.items()}

    def prepare(self, sizes: Sizes) -> None:
        """Build what a call of ``sizes`` uses (its buffer views, its expected shapes) ahead of
        the call, so that the first call of a key costs what later ones do."""
        if not self.fits(sizes):
            return
        if sizes not in self._views:
            if len(self._views) >= MEMO_LIMIT:  # bounded, as in stage()
                self._views.clear()
            self._views[sizes] = [buf[region(sizes, didx)] for (buf, _), didx in zip(self._pads, self.dim_idx)]
        if self._rows_only and sizes[0] not in self._shapes:
            if len(self._shapes) >= MEMO_LIMIT:
                self._shapes.clear()
            self._shapes[sizes[0]] = tuple(torch.Size((sizes[0], *s.trailing)) for s in self.specs.values())

    def warm(self) -> None:
        """Make the first call's copies cost what later ones do: run what :meth:`stage` and
        :meth:`pad_to` run (``torch._foreach_copy_``, ``copy_``, ``torch._foreach_zero_``, ``fill_``)
        once on scratch rows shaped like one row of each buffer, never on the buffers. The first
        call of each in a process costs tens of microseconds (torch looks the operator and its
        kernel up lazily)."""
        with torch.inference_mode(False), torch.no_grad():
            # views, as the call's destinations are (a copy into a view takes another path in torch,
            # whose first use costs ~10 us more)
            dst = [torch.empty_like(buf[:1])[:1] for buf, _ in self._pads]
            src = [torch.zeros_like(d) for d in dst]
            torch._foreach_copy_(dst, src)
            dst[0].copy_(src[0])
            torch._foreach_zero_(dst)
            for d, (_, pad) in zip(dst, self._pads):
                d.fill_(pad)
        if self._views:  # and the validation, on copies of the smallest key's views (reads shapes only)
            sizes = min(self._views)
            self.validate({n: v.clone() for n, v in zip(self.names, self._views[sizes])})

    def fits(self, sizes: Sizes) -> bool:
        """True when ``sizes`` fit the buffers (every size at most the dim's largest)."""
        return all(n <= m for n, m in zip(sizes, self.maxes))

    # ----------------------------------------------------------- per call
    def validate(self, inputs: Mapping[str, Any]) -> tuple[list[torch.Tensor], Sizes]:
        """``(tensors in declaration order, sizes per dim)`` of valid call ``inputs``; raises the
        ``ValueError``/``TypeError`` naming the input otherwise (nothing is written)."""
        if self._rows_only:
            try:
                fast = self._validate_rows(inputs)
            except Exception:  # noqa: BLE001 - any failure to inspect an input (a sparse tensor's
                # data_ptr() raises RuntimeError) is invalid input: the runner tells its peers, never skips
                raise self.error(inputs) from None
            if fast is not None:
                return fast
        sizes = [-1] * len(self.dims)
        try:
            if len(inputs) != self._n:
                raise KeyError
            tensors = [inputs[name] for name in self.names]
            lo_all, hi_all = self._span
            for name, t, (dtype, trailing, ndim, lead, didx), own in zip(self.names, tensors, self._checks, self._own):
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
                if not ptr or lo_all <= ptr < hi_all:
                    self._check_memory(name, t, own)
        except Exception:  # noqa: BLE001 - as above: invalid input, named by the slow path
            raise self.error(inputs) from None
        return tensors, tuple(sizes)

    def _validate_rows(self, inputs: Mapping[str, Any]) -> tuple[list[torch.Tensor], Sizes] | None:
        """:meth:`validate` when every input is ``(rows, *trailing)``: one shape comparison per
        input against the shapes expected for the first input's row count (cached per count).
        ``None`` for a row count outside ``1..largest`` (the generic path decides)."""
        if len(inputs) != self._n:
            raise KeyError
        tensors = list(map(inputs.__getitem__, self.names))
        n = tensors[0].shape[0]
        want = self._shapes.get(n)
        if want is None:
            if not 0 <= n <= self.maxes[0]:
                return None  # over the largest bucket: the generic path
            self.prepare((n,))
            want = self._shapes[n]
        lo_all, hi_all = self._span
        for t, (dtype, own, name), shape in zip(tensors, self._fast, want):
            if t.dtype is not dtype or t.shape != shape:
                raise KeyError
            ptr = t.data_ptr()  # must hold data (not meta) and not point into a static buffer
            if not ptr or lo_all <= ptr < hi_all:
                self._check_memory(name, t, own)
        return tensors, (n,)

    def _check_memory(self, name: str, t: torch.Tensor, own: int) -> None:
        """Raise ``KeyError`` (the slow path names the error) for input ``name`` without data (meta)
        or starting inside a static buffer other than exactly its own leading region (contiguous:
        a harmless no-op copy)."""
        ptr = t.data_ptr()
        if ptr == 0:
            if t.is_meta:
                raise KeyError
        elif (ptr != own or not t.is_contiguous()) and self._alias_error(name, t) is not None:
            raise KeyError

    def error(self, inputs: Any) -> Exception:
        """The error for invalid call ``inputs`` (slow path): names the input and what was expected."""
        return diagnose(inputs, self.specs, self.in_dims, self.dims, self.one_batch_dim, self._alias_error)

    def _alias_error(self, name: str, t: torch.Tensor) -> Exception | None:
        return alias_error(self._ranges, self.names, name, t)

    def stage(self, tensors: list[torch.Tensor], sizes: Sizes) -> bool:
        """Copy the (validated) inputs into the leading region ``sizes`` of the buffers; ``False``
        (nothing written) when ``sizes`` do not fit them. If a copy fails, every buffer is reset
        to its pad value (no half-written cells stay behind) and :class:`GraphRunnerError` names
        the input."""
        views = self._views.get(sizes)
        if views is None:
            if not self.fits(sizes):
                return False
            if len(self._views) >= MEMO_LIMIT:  # varlen sizes rarely repeat: start over, never grow unbounded
                self._views.clear()
            views = self._views[sizes] = [buf[region(sizes, didx)] for (buf, _), didx in zip(self._pads, self.dim_idx)]
        i = 0
        # Grad off for the copies: a copy from a tensor that requires grad would chain an
        # autograd history onto the static buffer at every call.
        grad = torch.is_grad_enabled()
        if grad:
            _set_grad_enabled(False)
        try:
            if self._n > 1:
                try:  # one dispatch for every input; a failure is redone one by one to name the input
                    torch._foreach_copy_(views, tensors)
                except Exception:  # noqa: BLE001
                    for i, (v, t) in enumerate(zip(views, tensors)):  # noqa: B007 - i names the input that failed
                        v.copy_(t)
            else:
                views[0].copy_(tensors[0])
        except Exception as exc:
            self.restore_pads(tuple(map(max, self.filled, sizes)))
            t = tensors[i]
            raise GraphRunnerError(
                f"GraphRunner: copying input {self.names[i]!r} ({type(t).__name__} of shape {list(t.shape)}, "
                f"{t.dtype}, on {t.device}) into its static buffer failed: {type(exc).__name__}: {exc}. Nothing "
                "was replayed and the static buffers were reset to their pad values; the runner is still usable"
            ) from exc
        finally:
            if grad:
                _set_grad_enabled(True)
        filled = self.filled
        if filled != sizes:
            if self._one_dim:
                if sizes[0] > filled[0]:
                    self.filled = sizes
            else:
                self.filled = sizes if filled == self.zero else tuple(map(max, filled, sizes))
        return True

    def pad_to(self, sizes: Sizes, key: Sizes) -> None:
        """Make the cells inside ``key`` but outside ``sizes`` hold the pad value: a no-op unless
        an earlier call left data there (``filled`` exceeds ``sizes`` in some dim). Cells whose
        pad is zero are cleared by one ``torch._foreach_zero_`` over all inputs (one dispatch
        instead of one ``fill_`` per input)."""
        if self.filled == sizes:
            return
        pv = self._pad_views.get((sizes, key))
        if pv is None:
            views = [
                (buf[r], pad)
                for (buf, pad), didx in zip(self._pads, self.dim_idx)
                for r in padding_regions(sizes, key, didx)
            ]
            zeros = [v for v, pad in views if _is_zero(pad)]
            if len(self._pad_views) >= MEMO_LIMIT:  # one entry per (sizes, key): bounded as in stage()
                self._pad_views.clear()
            pv = self._pad_views[(sizes, key)] = (zeros, [(v, pad) for v, pad in views if not _is_zero(pad)])
        zeros, others = pv
        if zeros:
            torch._foreach_zero_(zeros)
        for view, pad in others:
            view.fill_(pad)
        filled = self.filled
        # Outside ``key`` earlier data may remain: keep the bounding box.
        self.filled = sizes if all(f <= k for f, k in zip(filled, key)) else tuple(map(max, filled, sizes))

    def written_by_step(self, key: Sizes) -> None:
        """A call of ``key`` ran a step that writes its state inputs: every cell of ``key`` may
        now hold data, so the next call re-pads what it does not fill."""
        self.filled = tuple(map(max, self.filled, key))

    def storage_names(self) -> dict[int, tuple[str, bool]]:
        """``{storage key of a buffer: (input name, declared state)}``: how a check tells which
        input an op writes."""
        return {b.untyped_storage().data_ptr(): (n, self.specs[n].state) for n, b in self.buffers.items()}

    def restore_pads(self, extent: Sizes | None = None) -> None:
        """Set the leading region ``extent`` (default: all that may hold data) of every buffer to
        its pad value."""
        extent = self.filled if extent is None else extent
        for (buf, pad), didx in zip(self._pads, self.dim_idx):
            buf[region(extent, didx)].fill_(pad)
        self.filled = self.zero

    def padded(self, tensors: list[torch.Tensor], sizes: Sizes, rows: Sizes) -> dict[str, torch.Tensor]:
        """The step's keyword inputs for an eager run of ``tensors`` (sizes ``sizes``) padded to
        ``rows`` with each input's pad value (fresh tensors on the runner's device)."""
        kwargs: dict[str, torch.Tensor] = {}
        dev = self.device
        for (name, spec), t, didx in zip(self.specs.items(), tensors, self.dim_idx):
            if rows != sizes:
                p = torch.full((*(rows[d] for d in didx), *spec.trailing), spec.pad, dtype=spec.dtype, device=dev)
                p[region(sizes, didx)].copy_(t)
                t = p
            elif t.device != dev:
                t = t.to(dev)
            elif spec.state:
                t = t.clone()  # the step writes it: never the caller's tensor
            kwargs[name] = t
        return kwargs


def _memory_of(device: torch.device) -> int | None:
    """The total memory of ``device`` in bytes (CUDA: the GPU's; CPU and tape: the machine's RAM), or
    ``None`` when unknown. A buffer larger than this cannot be allocated: the runner says so before
    trying (an over-committed CPU allocation could succeed and then be killed while it is filled)."""
    try:
        if device.type == "cuda":
            return int(torch.cuda.mem_get_info(device)[1])
        if device.type == "cpu":
            return int(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, RuntimeError, AttributeError):
        pass
    return None


def _is_zero(pad: Pad) -> bool:
    """True for a pad value that ``zero_()`` writes bit for bit (``0``, ``False``, ``+0.0``)."""
    return pad == 0 and math.copysign(1.0, float(pad)) > 0
