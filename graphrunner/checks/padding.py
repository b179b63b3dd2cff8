"""Padding-leak check at capture: padding cells must not change real results, now or later.

A graph computes every cell of its key, padding included, and runs every write
of the padding rows, so a step whose real outputs depend on the padding (a
reduction over the batch such as ``h.sum()``, a mean, a norm across rows, a
padding row that wins a max) replays a silently wrong result, and a step whose
padding rows write state (a KV cache, a recurrent state) where a real request
reads later replays right for the padded call and wrong for that request's
next one. For every key that a smaller call can replay, :class:`LeakCheck`
runs the step eagerly on seeded random real cells with the padding at its pad
value (run A: the protocol's one but last warmup, through the capture hook's
``before_warmup``/``after_warmup``), then, at ``after_warmups`` (the capture
order stays in :mod:`graphrunner.backends.base`), with the float padding
changed and without padding, and compares the real cells of every output, 0-dim
outputs whole, with run A's; and it runs call sequences: a follow-up call
after the padded call against the same follow-up after the unpadded one (see
:class:`LeakCheck`). Equal means within :func:`difference`'s tolerance, which
admits last-bit noise only (:func:`admitted`). Any difference raises
:class:`~graphrunner.errors.PaddingLeakError` naming the output path and the
key, for a sequence the input whose pad did it and the cells the padding rows
wrote.

- Real sizes: per dim, the smallest size that still replays the key (on a
  full grid the dim's previous bucket + 1; ``max_padding_ratio`` and
  ``keys=`` are taken into account), see :func:`check_sizes`. A key no smaller call
  maps to (the smallest bucket) is not checked.
- Integer, bool and complex inputs keep their pad value in the padding cells:
  it must stay a safe index. Integer inputs without bounds keep it in the real
  cells too: a step whose only inputs are such indices cannot be checked.
- Opt out per output with ``GraphRunner(checks=["drift", gr.PaddingCheck(exempt=("total",)),
  "fingerprint"])`` (an output meant to read the whole padded batch; its
  slicing by ``outputs=`` is unchanged), per runner by leaving ``"padding"``
  out of ``checks=``.

This module knows nothing about graphs; the runner builds one check per key
from its :class:`PaddingCheck` (the configuration in ``checks=``).
"""

from __future__ import annotations

import logging
import math
import re
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from graphrunner._pytree import flatten, leaf_paths
from graphrunner.recording.hooks import Capture, CaptureHook, Finding
from graphrunner.recording.ops import OpConsumer
from graphrunner.errors import PaddingLeakError
from graphrunner.keys import all_max_vector, region

__all__ = ["PaddingCheck", "exempt_prefixes", "check_sizes", "second_sizes", "real_cells", "Noise", "admitted", "difference",
           "LeakCheck"]

Sizes = Tuple[int, ...]


class PaddingCheck:
    """The padding-leak check as configured in ``GraphRunner(checks=[...])`` (``"padding"`` is
    ``PaddingCheck()``).

    ``exempt``: outputs the check does not compare, meant to read the whole
    padded batch: dict output keys (``("total",)``) or output paths as the
    error spells them (``"output[1]"``). Raises ``TypeError`` for anything
    but a string or a sequence of them.
    """

    name = "padding"

    def __init__(self, exempt: Any = ()) -> None:
        self.exempt = exempt_prefixes(exempt)
        #: Integer inputs already warned about (no bounds): one warning per runner; it also carries
        #: the follow-up values the runner's keys have drawn (:class:`_PerRunner`).
        self.warned: set = _PerRunner()

    def __repr__(self) -> str:
        return f"PaddingCheck(exempt={self.exempt!r})"


class _PerRunner(set):
    """What the padding checks of one runner's keys share: the names of the integer inputs already
    warned about (the set), and per integer input the follow-up values drawn so far
    (:attr:`follow`: ``name -> (permutation of its real values but the pad, next offset)``), so the
    keys' follow-ups use each value of a small range once before any repeats."""

    def __init__(self) -> None:
        super().__init__()
        self.follow: Dict[str, list] = {}


def _follow_ints(lo: int, hi: int, shape: Tuple[int, ...], pad: Any, at: int, name: str, shared: Any,
                 seed: int) -> torch.Tensor:
    """The follow-up's integers: cell ``at`` (flat, modulo the size) at ``pad`` when it lies in
    ``[lo, hi]``, the others the next values of a runner-wide permutation of the range without the
    pad (all different where the range allows), continuing where the runner's previous key stopped."""
    n = math.prod(shape)
    inside = lo <= pad <= hi
    follow = getattr(shared, "follow", None)
    entry = follow.get(name) if follow is not None else None
    if entry is None:
        perm = torch.randperm(hi - lo + 1, generator=torch.Generator().manual_seed(seed)) + lo
        if inside and perm.numel() > 1:
            perm = perm[perm != pad]
        entry = [perm, 0]
        if follow is not None:
            follow[name] = entry
    perm, off = entry
    m = perm.numel()
    need = n - int(inside and n > 0)
    if need > 0 and m:
        idx = (torch.arange(need) + off) % m
        vals = perm[idx]
        entry[1] = (off + need) % m
    else:
        vals = torch.empty(0, dtype=torch.long)
    t = torch.empty(n, dtype=torch.long)
    if inside and n:
        j = at % n
        t[j] = pad
        keep = torch.ones(n, dtype=torch.bool)
        keep[j] = False
        t[keep] = vals
    else:
        t[:] = vals
    return t.reshape(shape)


def exempt_prefixes(exempt: Any) -> Tuple[str, ...]:
    """``PaddingCheck(exempt=...)`` as leaf-path prefixes.

    Each entry is a dict output key (``"total"`` -> ``output['total']``) or a
    leaf path as messages spell it (``"output[1]"``, ``"output['aux'].loss"``).
    Raises ``TypeError`` for anything but a string or a sequence of them.
    """
    if isinstance(exempt, str):
        exempt = (exempt,)
    try:
        items = tuple(exempt)
    except TypeError:
        raise TypeError(f"PaddingCheck(exempt=...) must be a tuple of output names such as ('total',), got {exempt!r}") from None
    out = []
    for e in items:
        if not isinstance(e, str) or not e:
            raise TypeError(f"PaddingCheck(exempt=...) entries must be dict output keys or output paths (strings), got {e!r}")
        out.append(e if e == "output" or e.startswith("output[") or e.startswith("output.") else f"output[{e!r}]")
    return tuple(out)


def _exempt(path: str, prefixes: Tuple[str, ...]) -> bool:
    return any(path == p or path.startswith(p + "[") or path.startswith(p + ".") for p in prefixes)


def check_sizes(space: Any, key: Sizes) -> Optional[Sizes]:
    """The real sizes the leak check of ``key`` uses, or ``None`` when no smaller call replays ``key``.

    Dim by dim, in key order: the smallest size that still replays ``key``
    (the runner's own key choice, :meth:`KeySpace.choose`, so
    ``max_padding_ratio`` and ``keys=`` count), among 1, every bucket of
    that dim below the key's plus 1, and ``ceil(bucket * (1 -
    max_padding_ratio))``. On a full grid of keys that is the
    dim's previous bucket + 1 in every dim.
    """
    key = tuple(key)
    sizes = list(key)
    ratio = space.max_padding_ratio
    for j, d in enumerate(space.dims):
        cands = {1} | {b + 1 for b in space.buckets[d] if b < key[j]}
        if ratio is not None:
            cands.add(math.ceil(key[j] * (1 - ratio) - 1e-9))
        for n in sorted(cands):
            if n >= key[j]:
                break
            trial = tuple(sizes[:j] + [n] + sizes[j + 1:])
            if space.choose(trial)[0] == key:
                sizes[j] = n
                break
    return None if tuple(sizes) == key else tuple(sizes)


def second_sizes(space: Any, key: Sizes, sizes: Sizes) -> Optional[Sizes]:
    """Real sizes between ``sizes`` (:func:`check_sizes`) and ``key`` that still pad and still
    replay ``key`` (``key - 1`` in every dim that pads), or ``None`` when there are none: the
    padding check's second real size, so that the padded count varies."""
    s2 = tuple(max(s, k - 1) for s, k in zip(sizes, key))
    if s2 == tuple(sizes) or s2 == tuple(key) or space.choose(s2)[0] != tuple(key):
        return None
    return s2


def _distinct_ints(lo: int, hi: int, shape: Tuple[int, ...], pad: Any, g: torch.Generator,
                   at: Optional[int] = 0) -> torch.Tensor:
    """Random integers in ``[lo, hi]`` of ``shape``, all different where the range allows (real
    requests use different cache slots; two real rows at one slot would be a collision the runner
    never makes), none at ``pad`` (while other values exist) except cell ``at`` (flat, modulo the
    size) when ``at`` is given and the pad lies in the range: where padding rows meet a real one;
    each input at its own cell, so that a padding row, which holds every input's pad at once,
    differs from that real row in the other inputs. ``at=None``: no real cell at the pad (where
    the padding row alone holds the pad value: the pad value as the winner of a max)."""
    n = math.prod(shape)
    span = hi - lo + 1
    inside = lo <= pad <= hi
    avoid = int(inside and span > 1)
    if span - avoid >= n > 0:
        perm = torch.randperm(span, generator=g)[: n + avoid] + lo
        if avoid:
            perm = perm[perm != pad][:n]
        t = perm.reshape(shape)
    else:
        t = torch.randint(lo, hi + 1 - avoid, shape, generator=g, dtype=torch.int64)
        if avoid:
            t = t + (t >= pad).long()  # skip the pad
    if inside and n and at is not None:
        t.reshape(-1)[at % n] = pad  # a real cell at the pad index
    return t


def real_cells(t: torch.Tensor, didx: Tuple[int, ...], sizes: Sizes) -> torch.Tensor:
    """The real cells ``sizes`` of output leaf ``t`` on its leading dims ``didx`` (a 0-dim leaf whole)."""
    return t if t.dim() == 0 or not didx else t[region(sizes, didx)]


@dataclass(frozen=True)
class Noise:
    """What a tolerant :func:`difference` admits: the last-bit noise of kernels chosen for another
    shape, nothing more.

    ``lead``: how many leading (row) dims the compared tensors have (the column scale of an
    element is the root mean square of its column over them); ``reduction``: the longest
    reduction (the ``K`` of a matmul) of the step, and ``matmuls``: how many matmul-like ops it
    runs, as the padding check measures them in its first run (0: unknown, then a large model
    is assumed: ``reduction * matmuls = 2**20``). See :func:`admitted`.
    """

    lead: int = 1
    reduction: int = 0
    matmuls: int = 0


#: Ulps of the output's own dtype a tolerant comparison admits per element (the rounding of
#: the last op, and a flip it may cause upstream).
STORAGE_ULPS = 2.0
#: Accumulator ulps admitted per ``sqrt(reduction * matmuls)``: a reduction summed in another
#: order moves its result by about ``eps * sqrt(K)`` of its terms' scale, and every matmul of the
#: step adds its own.
ACCUMULATION_ULPS = 16.0
#: ``reduction * matmuls`` assumed when a comparison does not know them.
UNKNOWN_WORK = 2 ** 20


def admitted(b: torch.Tensor, noise: "Noise | None" = None) -> torch.Tensor:
    """Per element of ``b`` (the reference), the absolute difference a tolerant comparison admits,
    as float64::

        (|b_i| + s_i) * (STORAGE_ULPS * eps + ACCUMULATION_ULPS * eps_acc * sqrt(reduction * matmuls))

    ``eps``: the dtype's machine epsilon; ``eps_acc``: the accumulator's (float32 for float16
    and bfloat16, whose kernels accumulate in float32; the dtype's own otherwise); ``s_i``: the
    root mean square of the element's column over the ``lead`` dims (of the whole tensor when
    it has no other dims), at least 1/8 of the whole tensor's, a floor for elements near zero
    that cancellation made small. So a difference of a few percent in a small channel is a leak
    in bfloat16 (about 2 ulps admitted) as in float32, while the float32 noise of a deep step
    (a few hundred ulps where the kernel of a 256-long reduction changed) is not."""
    noise = noise or Noise()
    dt = b.real.dtype if b.dtype.is_complex else b.dtype
    eps = torch.finfo(dt).eps
    eps_acc = torch.finfo(torch.float32).eps if torch.finfo(dt).bits < 32 else eps
    work = noise.reduction * noise.matmuls if noise.reduction > 0 and noise.matmuls > 0 else UNKNOWN_WORK
    factor = STORAGE_ULPS * eps + ACCUMULATION_ULPS * eps_acc * math.sqrt(work)
    mag = torch.nan_to_num(b.detach().abs().to(torch.float64), nan=0.0, posinf=0.0, neginf=0.0)
    if mag.dim() == 0 or mag.numel() == 0:
        return mag * (2 * factor)
    whole = mag.pow(2).mean().sqrt()
    lead = max(0, min(int(noise.lead), mag.dim()))
    col = mag.pow(2).mean(dim=tuple(range(lead)), keepdim=True).sqrt() if 0 < lead < mag.dim() else whole
    return (mag + torch.maximum(col, whole / 8)) * factor


def difference(a: torch.Tensor, b: torch.Tensor, tolerant: "bool | Noise" = False) -> Optional[float]:
    """``None`` if equal (NaN equals NaN), else the max abs difference (inf for a shape or dtype change).

    ``tolerant`` (``True`` or a :class:`Noise` saying where the tensors come from): floating-point
    values count as equal where every element is within :func:`admitted` of ``b``'s: the last-bit
    noise of kernels a library picks by row count (an MoE expert's share of the rows moves when
    padding rows become real), scaled per element by its magnitude and the dtype's epsilon, never
    a share of the output's largest value."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return math.inf
    if a.dtype.is_floating_point or a.dtype.is_complex:
        same = (a == b) | (torch.isnan(a) & torch.isnan(b))
        if bool(same.all()):
            return None
        wide = torch.complex128 if a.dtype.is_complex else torch.float64
        d = torch.nan_to_num((a.to(wide) - b.to(wide)).abs(), nan=math.inf)
        d = torch.where(same, torch.zeros_like(d), d)
        if tolerant:
            ok = d <= admitted(b, tolerant if isinstance(tolerant, Noise) else None)
            if bool(ok.all()):
                return None
        return float(d.max())
    if torch.equal(a, b):
        return None
    return float((a.to(torch.float64) - b.to(torch.float64)).abs().max())


logger = logging.getLogger("graphrunner.checks.padding")


#: Matmul-like aten ops: the argument whose last dim is the reduction (``K``).
_MATMUL_ARG = {"aten::mm": 0, "aten::addmm": 1, "aten::bmm": 0, "aten::baddbmm": 1, "aten::addbmm": 1,
               "aten::mv": 0, "aten::addmv": 1, "aten::dot": 0, "aten::vdot": 0, "aten::matmul": 0,
               "aten::linear": 0, "aten::_scaled_mm": 0, "aten::_int_mm": 0}
_WORK_KINDS: dict = {}  # op overload -> how to read its reduction length, or None


def _work_kind(func: Any) -> Any:
    name = func._schema.name
    if name in _MATMUL_ARG:
        return _MATMUL_ARG[name]
    if "scaled_dot_product" in name:
        return "sdpa"
    if name in ("aten::convolution", "aten::_convolution"):
        return "conv"
    return None


class _Work(OpConsumer):
    """Counts a run's matmul-like ops and their longest reduction (``K``), for :class:`Noise`."""

    def __init__(self) -> None:
        self.reduction = 0
        self.matmuls = 0

    def before(self, ev: Any) -> None:
        kind = _WORK_KINDS.get(ev.func, _UNSET)
        if kind is _UNSET:
            kind = _WORK_KINDS[ev.func] = _work_kind(ev.func)
        if kind is None:
            return
        try:
            args = ev.args
            if kind == "sdpa":
                k = max(int(args[0].shape[-1]), int(args[1].shape[-2]))
            elif kind == "conv":
                k = int(math.prod(args[1].shape[1:]))
            else:
                k = int(args[kind].shape[-1])
        except Exception:  # noqa: BLE001 - an op called another way: count it, reduction unknown
            k = 0
        self.matmuls += 1
        self.reduction = max(self.reduction, k)


_UNSET = object()

# ----------------------------------------------------------------- what a run wrote, cell by cell
#: Written cells of one logged write larger than this are not followed (a whole KV cache).
_MAX_CELLS = 1 << 24


def _strided_offsets(shape: Sequence[int], stride: Sequence[int], offset: int, device: Any) -> torch.Tensor:
    off = torch.full((), offset, dtype=torch.long, device=device)
    for size, st in zip(shape, stride):
        off = off[..., None] + torch.arange(size, device=device) * st
    return off.reshape(-1)


def _index_offsets(t: torch.Tensor, index: Sequence[Any]) -> Optional[torch.Tensor]:
    """Element offsets (in ``t``'s storage) of the cells ``t[index] = ...`` writes (``None`` entries
    are whole dims, as ``index_put_`` takes them); ``None`` when they cannot be told."""
    adv, d = [], 0
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
        return _strided_offsets(t.shape, t.stride(), t.storage_offset(), t.device) if not adv else None
    idx = torch.broadcast_tensors(*[i for _, i in adv])
    base = torch.full((), t.storage_offset(), dtype=torch.long, device=t.device)
    for (dim, _), i in zip(adv, idx):
        base = base + (i.to(t.device) % max(1, t.shape[dim])) * t.stride(dim)
    done = {dim for dim, _ in adv}
    rest = [k for k in range(t.dim()) if k not in done]
    rest_off = _strided_offsets([t.shape[k] for k in rest], [t.stride(k) for k in rest], 0, t.device)
    if base.numel() * rest_off.numel() > _MAX_CELLS:
        return None
    return (base.reshape(-1, 1) + rest_off.reshape(1, -1)).reshape(-1)


def _written(log: Sequence[Tuple[Any, tuple]]) -> Dict[Tuple[Any, torch.dtype], Tuple[torch.Tensor, torch.Tensor]]:
    """``{(storage, dtype): (a tensor on it, element offsets written)}`` of a
    :class:`~graphrunner.recording.ops.WriteGuard` log (writes of whole storages, ``out=``, are not
    followed)."""
    from graphrunner._aten import storage_key
    from graphrunner.recording import ops

    parts: Dict[Tuple[Any, torch.dtype], Tuple[torch.Tensor, list]] = {}
    with torch.inference_mode():
        for put, args in log:
            t = args[0]
            if put is ops._put_index:
                off = _index_offsets(t, args[1])
            elif put is ops._put_index_copy:
                off = _index_offsets(t, [None] * (args[1] % max(1, t.dim())) + [args[2]])
            elif put is ops._put_view and t.numel() <= _MAX_CELLS:
                off = _strided_offsets(t.shape, t.stride(), t.storage_offset(), t.device)
            else:
                continue
            if off is None:
                continue
            k = (storage_key(t), t.dtype)
            parts.setdefault(k, (t, []))[1].append(off)
        return {k: (t, torch.cat(offs).unique()) for k, (t, offs) in parts.items()}


class _Perturbed:
    """The cells that only the padded call wrote (written by run A, not by run D), given new
    values in the unpadded sequence for its follow-up and put back afterwards."""

    def __init__(self, a_log: list, d_log: list) -> None:
        #: ``[(a tensor on the storage, flat typed view, offsets, old values)]``
        self.cells: List[Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]] = []
        wa, wd = _written(a_log), _written(d_log)
        g = torch.Generator().manual_seed(0x73657121)
        with _no_modes(), torch.inference_mode():
            for k, (t, offs) in wa.items():
                if not (t.dtype.is_floating_point or t.dtype.is_complex):
                    continue  # an integer state could become an index: left as it is
                if k in wd:
                    offs = offs[~torch.isin(offs, wd[k][1])]
                if not offs.numel():
                    continue
                st = t.untyped_storage()
                flat = torch.empty(0, dtype=t.dtype, device=t.device).set_(st, 0, (st.nbytes() // t.element_size(),))
                offs = offs[offs < flat.numel()]
                old = flat[offs].clone()
                mag = torch.nan_to_num(old.abs().to(torch.float32), nan=0.0, posinf=0.0).pow(2).mean().sqrt()
                scale = float(mag) if float(mag) > 0 else 1.0
                noise = torch.randn(offs.numel(), generator=g) * scale
                flat[offs] = old + noise.to(device=t.device, dtype=t.dtype)
                self.cells.append((t, flat, offs, old))

    def restore(self) -> None:
        with _no_modes(), torch.inference_mode():
            for _, flat, offs, old in reversed(self.cells):
                flat[offs] = old


def _no_modes() -> Any:
    from torch.utils._python_dispatch import _disable_current_modes

    return _disable_current_modes()


class LeakCheck(CaptureHook):
    """The padded-vs-eager equivalence check of one key, as a capture hook (the last two warmups, ``after_warmups``).

    Args:
        key: the key (runner-dim tuple); ``key_text`` how messages name it.
        sizes: the smallest real sizes that replay ``key`` (:func:`check_sizes`);
            ``sizes2``: larger real sizes that still pad (or ``None``), so the
            padded count varies.
        inputs: ``[(name, the key's view of its static buffer, leading-dim
            indices, BatchInput)]`` of every input.
        step: the step (``step(**inputs)``), for the eager runs without padding.
        leaf_dims: ``leaf_dims(spec, n) ->`` leading-dim indices of each output leaf.
        exempt: leaf-path prefixes not compared (:func:`exempt_prefixes`).
        group: the rank group; with several ranks the verdict is agreed (one
            ``all_max`` of one flag), so every rank raises or none does.
        phase_key: the key as the agreement's collective names it.
        warned: names of integer inputs already warned about (one warning per runner).

    Real cells get seeded random data (floats: normal; integers: all different, within
    ``BatchInput(bounds=)``; integers without bounds keep their pad value, with one warning),
    padding cells the pad value, as at replay. Two placements of the integers: in the data of
    runs A to D **no real cell holds its input's pad value** (a padding row alone there: the pad
    value as the winner of a max); in the follow-up's data **one real cell per input holds the
    pad** (where the pad is also a real value: a real request at the padding row's index).
    Eager forwards, what they write outside themselves put back after each
    (:class:`~graphrunner.recording.ops.WriteGuard`):

    - **A**: real sizes ``sizes``, padding = pad values (what the graph computes); with
      ``warmups >= 2`` this is the protocol's one but last warmup and the padded follow-up
      its last (their writes put back before the post-warmup hook; when A was the key's first
      warmup, which may initialise lazily, a finding is confirmed by running both again), with
      ``warmups=1`` extra forwards;
    - **B**: as A with the padding of floating-point inputs random: real cells must not move;
    - **D**: ``step`` eagerly on the unpadded real batch (no padding at all):
      A's real cells must equal it (a dependence on the padded size, ``x / x.shape[0]``, or a
      pad value reaching real rows);
    - **C**, only when D cannot run (a step that only runs at its keys' sizes): real sizes
      ``sizes2`` (more real cells, the first ones as in A): A's real cells must not move (the
      padded count varied);
    - **sequences**: the call after A (its writes kept) against the call after D: a follow-up
      ``F`` of ``sizes`` real rows (its own data, the pad among them), padded through the key's
      buffers after A, eagerly without padding after D. Before ``F`` of the unpadded sequence,
      the cells that only A wrote (its padding rows' writes) get other values, as a real request's
      history would have there: so a padding row that writes state a later real request reads
      (a pad slot that is also a real slot) changes ``F``'s real cells, also when the warmups
      left the padding rows' values there already. Run when the step writes state, or when an
      integer input's pad lies inside its bounds. Everything is put back after ``F``.

    A and B, A and D (or C), the two ``F``s must agree within :func:`difference`'s tolerance
    (:class:`Noise`: per element, the dtype's last bits, scaled by the step's matmul reductions,
    measured in run A): bit for bit on the tape for a row-independent step. When an integer input
    has no bounds its real cells keep the pad, so real rows meet padding rows by construction:
    only B is compared then (and a warning says what to declare). A difference raises
    :class:`PaddingLeakError` naming the output path, the key and the inputs; for the sequences
    the input whose pad the changed rows hold, and the cells the padding rows wrote (in collect
    mode: a ``"padding-leak"`` finding). An output that changes between two identical runs
    (state the step keeps in Python) is named in a warning instead. The static buffers are put
    back afterwards.
    """

    name = "padding"

    def __init__(self, key: Sizes, key_text: str, sizes: Sizes, sizes2: Optional[Sizes],
                 inputs: Sequence[Tuple[str, torch.Tensor, Tuple[int, ...], Any]], step: Callable[..., Any],
                 leaf_dims: Callable[[tuple, int], List[Tuple[int, ...]]], exempt: Tuple[str, ...],
                 group: Any = None, phase_key: Any = None, warned: Optional[set] = None) -> None:
        self.key, self.key_text, self.sizes, self.sizes2 = key, key_text, sizes, sizes2
        self.inputs = list(inputs)
        self.floats = [(n, v, d) for n, v, d, spec in self.inputs if spec.dtype.is_floating_point]
        #: Integer inputs whose pad is also a real value (inside their bounds): ``[(name, spec)]``.
        self.shared = [(n, spec) for n, _, _, spec in self.inputs if _shared_pad(spec)]
        self.step, self.leaf_dims, self.exempt = step, leaf_dims, exempt
        self.group, self.phase_key = group, phase_key
        self.warned = warned if warned is not None else set()
        #: Seconds the check itself took (its forwards and the comparisons).
        self.seconds = 0.0
        #: Eager forwards it ran.
        self.forwards = 0
        self._guard: Any = None  # the WriteGuard of the runs, during the check
        self._saved: Any = None  # the static buffers as they were before the check filled them
        self._numbers0: Any = None  # the step's Python numbers before the check's runs (PythonNumbers)
        self._numbers_last: Any = None  # ... and after the last warmup: what the capture sees
        self._data: Any = None  # the seeded real data of every input (runs A to D)
        self._follow_data: Any = None  # the follow-up's real data (the pad among it)
        self._a: Any = None  # run A's output leaves
        self._a_log: Any = None  # what run A wrote (the guard's log)
        self._f_padded: Any = None  # the follow-up's output leaves after A (padded through the key)
        self._seq: Dict[str, Any] = {}  # the sequences' runs, during the check
        self._explained: Dict[str, Any] = {}  # what a sequence finding needs to name its cause
        self._work = _Work()  # run A's matmuls, for the tolerance
        self._a_in_warmup = False  # the one but last warmup is running as run A
        self._f_in_warmup = False  # the last warmup is running as the padded follow-up
        self._a_first = False  # run A was the key's first warmup

    # ------------------------------------------------------------ the hook points
    @staticmethod
    def _a_index(cap: Capture) -> int:
        """The warmup that is run A: the one but last, so that the last one is the padded
        follow-up; the last when the user's post-warmup hook (which runs after every warmup: a
        cache reset) would come between the two."""
        return cap.warmups - (2 if cap.post_warmup_hook is None else 1)

    def before_warmup(self, cap: Capture, i: int) -> None:
        """With ``warmups >= 2`` the last two warmups are the padded sequence (without a post-warmup
        hook; with one, the last warmup is run A and the follow-up runs right after it): before run
        A's warmup the static buffers get A's data; before the last, when the sequences run, the
        follow-up's data (A's writes in place). Eager forwards fewer; every write of both is put
        back right after the last warmup, before the post-warmup hook."""
        if cap.warmups < 2:
            return
        t0 = time.perf_counter()
        if i == self._a_index(cap):
            if self._prepare():
                self._guard.generators.reset()
                self._fill(self._data, self.sizes)
                self._a_in_warmup = True
                self._a_first = i == 0  # the first warmup may be lazy initialisation: a finding is confirmed
        elif i == cap.warmups - 1 and self._a is not None and self._wants_sequences():
            self._guard.generators.reset()  # the check's own generators: never the engine's
            self._fill(self._follow_data, self.sizes)
            self._f_in_warmup = True
        self.seconds += time.perf_counter() - t0

    def warmup_consumers(self, cap: Capture, i: int) -> Sequence[Any]:
        if self._a_in_warmup and i == self._a_index(cap):
            return (self._guard, self._work)
        return (self._guard,) if self._a is not None and self._guard is not None and i == cap.warmups - 1 else ()

    def after_warmup(self, cap: Capture, i: int, out: Any) -> None:
        last = i == cap.warmups - 1
        if self._a_in_warmup and i == self._a_index(cap):
            self._a_in_warmup = False
            t0 = time.perf_counter()
            try:
                self._a = self._leaves(out)
                if last:  # run A is the last warmup: the capture sees the numbers as it left them
                    self._numbers_last = self._numbers.snapshot()
                self._after_a(cap, follow=last)
            except BaseException:
                self._put_back()
                raise
            finally:
                if last:
                    self._put_back()  # before the post-warmup hook, as after any run of the check
                self.seconds += time.perf_counter() - t0
            return
        if self._a is None or self._guard is None or not last:
            return
        t0 = time.perf_counter()
        try:
            if self._f_in_warmup:
                self._f_padded = self._leaves(out)
        finally:
            self._f_in_warmup = False
            self._numbers_last = self._numbers.snapshot()  # what the capture sees, as without the check
            self._put_back()  # before the post-warmup hook, as after any run of the check
            self.seconds += time.perf_counter() - t0

    def after_warmups(self, cap: Capture) -> None:
        if cap.warmups < 1:
            return
        t0 = time.perf_counter()
        try:
            if self._saved is None:  # warmups=1: the one warmup may be lazy initialisation, A runs here
                self._prepare()
            found = self._check(cap)
        finally:
            self._finish()
        leaked = bool(found)
        if int(getattr(self.group, "size", 1)) > 1:
            leaked = bool(all_max_vector(self.group, [1 if found else 0], "leak_check", self.phase_key)[0])
        self.seconds += time.perf_counter() - t0
        cap.info["leak_check_sizes"] = list(self.sizes)
        cap.info["leak_check_seconds"] = self.seconds
        cap.info["leak_check_forwards"] = self.forwards
        if leaked:
            msg = self._message(found)
            cap.fail(PaddingLeakError(msg), Finding("padding-leak", msg, None, None, None, fix=self._fix(found)))

    def end(self, cap: Capture) -> None:
        """After an error between the last warmup and the check: its writes and the static buffers
        put back."""
        if self._saved is not None:
            self._put_back()
            self._finish()

    def _prepare(self) -> bool:
        """Keep the static buffers, make the runs' write guard and seeded data; False when there is
        nothing to vary (only integer inputs, some without bounds: the warning says so)."""
        from graphrunner.recording.ops import WriteGuard
        from graphrunner.tape.rng import OwnedGenerators

        self._saved = [(v, v.clone()) for _, v, _, _ in self.inputs]
        # one guard for every run: what a run wrote is put back after it
        # the step's draws during the runs come from generators the check owns (reset before each
        # run): the engine's generators are never read, drawn from or set, on any thread
        self._guard = WriteGuard([v for _, v, _, _ in self.inputs], generators=OwnedGenerators(0x636B6563))
        # the step's Python numbers: every run starts from them; the capture sees them as after run A
        self._numbers = PythonNumbers(self.step)
        self._numbers0 = self._numbers.snapshot()
        self._numbers_last = None
        self._data = self._real_data(0x6C65616B, self.sizes2 or self.sizes, pad_cell=False)
        if not self._blind:
            self._follow_data = self._real_data(0x666F6C6C, self.sizes, pad_cell=True)
        return not (self._blind and not self.floats)

    def _finish(self) -> None:
        """Drop what the check held (the guard's log, the data, run A) and put the static buffers back."""
        saved, self._saved = self._saved or [], None
        PythonNumbers.put(self._numbers_last if self._numbers_last is not None else self._numbers0)
        self._numbers0 = self._numbers_last = None
        self._guard = self._data = self._a = self._a_log = self._follow_data = self._f_padded = None
        self._seq = {}
        self._a_in_warmup = self._f_in_warmup = self._a_first = False
        for v, old in saved:
            v.copy_(old)

    # ------------------------------------------------------------ the runs
    def _real_data(self, seed: int, top: Sizes, pad_cell: bool) -> Dict[str, torch.Tensor]:
        """Seeded random real cells of every input at sizes ``top``; with ``pad_cell`` one real
        cell of each integer input at its pad (where the pad is a real value), else none."""
        g = torch.Generator().manual_seed(seed)
        self._blind = False
        data = {}
        forced = 0  # integer inputs whose pad is a real value: each meets the padding at its own cell
        unbounded: List[str] = []
        for name, view, didx, spec in self.inputs:
            shape = (*(top[d] for d in didx), *spec.trailing)
            dt = spec.dtype
            if dt.is_floating_point or dt.is_complex:
                t = torch.randn(shape, generator=g, dtype=torch.float32).to(dt)
            elif dt == torch.bool:
                t = torch.randint(0, 2, shape, generator=g).bool()
            else:
                lo, hi = spec.bounds if spec.bounds is not None else (None, None)
                if lo is None or hi is None:
                    self._blind = True
                    unbounded.append(name)
                    t = torch.full(shape, spec.pad, dtype=dt)
                else:
                    if pad_cell:
                        t = _follow_ints(int(lo), int(hi), shape, spec.pad, forced, name, self.warned, seed).to(dt)
                    else:
                        t = _distinct_ints(int(lo), int(hi), shape, spec.pad, g, None).to(dt)
                    forced += lo <= spec.pad <= hi
            data[name] = t.to(view.device)
        if unbounded and not self.warned:  # one warning per runner
            self.warned.update(unbounded)
            logger.warning(
                "padding check: integer input(s) %s have no BatchInput(bounds=(lo, hi)), so their real cells keep "
                "the pad value and only the padding of floating-point inputs is measured (not leaks through "
                "integer inputs, nor a dependence on the padded count, nor what padding rows leave for later "
                "calls); declare the range of their real values, e.g. bounds=(0, vocab_size - 1) for token ids "
                "or (0, num_slots - 1) for cache slots (the pad may lie outside: a scratch index)",
                ", ".join(repr(n) for n in unbounded))
        return data

    def _fill(self, data: Dict[str, torch.Tensor], sizes: Sizes, random_float_padding: bool = False) -> None:
        """Real cells ``sizes`` of every key view from ``data``, the rest the pad value (floats
        random with ``random_float_padding``)."""
        g = torch.Generator().manual_seed(0x70616464)
        for name, view, didx, spec in self.inputs:
            view.fill_(spec.pad)
            if random_float_padding and spec.dtype.is_floating_point:
                noise = torch.randn(view.shape, generator=g, dtype=torch.float32) * 3.0 + 1.0
                view.copy_(noise.to(device=view.device, dtype=view.dtype))
            r = region(sizes, didx)
            view[r].copy_(data[name][r])

    def _run(self, cap: Capture, fn: Callable[[], Any], restore: bool = True,
             consumers: Sequence[Any] = ()) -> List[Optional[torch.Tensor]]:
        """``fn()`` eagerly, what it wrote outside itself logged (and put back, with ``restore``);
        its output leaves cloned (``None`` for exempt ones). The output's structure is kept in
        ``self._spec``."""
        from graphrunner.recording.ops import OpRecorder

        guard = self._guard
        self.forwards += 1
        try:
            with OpRecorder([guard, *consumers]):
                out = cap.eager(fn)
            return self._leaves(out)
        finally:
            if restore:
                self._put_back()

    def _leaves(self, out: Any) -> List[Optional[torch.Tensor]]:
        """The output leaves of one run, cloned (``None`` for exempt ones); the structure in ``self._spec``."""
        self._spec, leaves = flatten(out, "step output")
        skip = [_exempt(p, self.exempt) for p in leaf_paths(self._spec)]
        return [None if s else t.detach().clone() for t, s in zip(leaves, skip)]

    def _wants_sequences(self) -> bool:
        """The follow-up runs when the step wrote state in run A (a later call may read what the
        padding rows wrote) or an integer input's pad is also a real value (a real row at the pad
        meets the padding rows)."""
        return self._follow_data is not None and bool(self.shared or self._a_log)

    def _put_back(self) -> None:
        """After a run or a sequence: what it wrote put back, and the step's Python numbers."""
        self._guard.restore()
        PythonNumbers.put(self._numbers0)

    def _after_a(self, cap: Capture, follow: bool = True) -> None:
        """Right after run A, its writes not yet put back: keep what it wrote, and (``follow``) run
        the padded sequence's follow-up (else the last warmup is that follow-up)."""
        self._a_log = list(self._guard._undo)
        if follow and self._wants_sequences():
            self._f_padded = self._follow(cap, padded=True)

    def _follow(self, cap: Capture, padded: bool) -> List[Optional[torch.Tensor]]:
        """The follow-up call on its own data (the check's own generators reset, as for run A): through the
        key's static buffers (padded) or eagerly on the real rows alone. Its writes stay logged."""
        self._guard.generators.reset()
        if padded:
            self._fill(self._follow_data, self.sizes)
            return self._run(cap, cap.forward_fn, restore=False)
        inputs = {name: self._follow_data[name].clone() for name, _, _, _ in self.inputs}
        return self._run(cap, lambda: self.step(**inputs), restore=False)

    def _check(self, cap: Capture) -> List[Tuple[str, str, float]]:
        """``[(which comparison, output path, max abs diff)]`` of the outputs that moved."""
        data, sizes = self._data, self.sizes
        if self._blind and not self.floats:
            return []  # only integer inputs, some without bounds: nothing to vary (the warning says so)
        if self._a is None:  # the last warmup was not run A (warmups=1)
            self._fill(data, sizes)
            try:
                self._a = self._run(cap, cap.forward_fn, restore=False, consumers=(self._work,))
                self._after_a(cap)
            finally:
                self._put_back()
        a = self._a
        spec = self._spec
        paths, dims = leaf_paths(spec), self.leaf_dims(spec, len(a))
        found: List[Tuple[str, str, float]] = []

        def compare(kind: str, got: List[Optional[torch.Tensor]], other: List[Optional[torch.Tensor]],
                    got_sliced: bool = False, other_sliced: bool = False) -> None:
            # within the last-bit tolerance: the kernels CPU and GPU libraries choose depend on row counts
            # (an MoE expert's rows change when padding rows become real), which moves the last bits
            for p, x, y, d in zip(paths, got, other, dims):
                if x is None or y is None:
                    continue
                x = x if got_sliced else real_cells(x, d, sizes)
                y = y if other_sliced else real_cells(y, d, sizes)
                diff = difference(x, y, tolerant=self._noise(d))
                if diff is not None:
                    found.append((kind, p, diff))

        if self.floats:
            self._fill(data, sizes, random_float_padding=True)
            compare("padding", a, self._run(cap, cap.forward_fn))
        if self._blind:
            # an integer input without bounds keeps the pad in its real cells too: real rows then
            # meet padding rows by construction, so only the floating-point padding is measured
            return self._control(cap, data, a, found, paths, dims)
        unpadded = {name: data[name][region(sizes, didx)].clone() for name, _, didx, _ in self.inputs}
        try:
            ref = self._run(cap, lambda: self.step(**unpadded), restore=False)
        except Exception as exc:  # noqa: BLE001 - a step that only runs at its keys' sizes
            self._put_back()
            logger.info("padding check of %s: the step did not run on the unpadded batch (%s: %s); compared "
                        "padded runs only", self.key_text, type(exc).__name__, exc)
            if self.sizes2 is not None:  # C: without D, the padded count varied at least
                self._fill(data, self.sizes2)
                compare("count", a, self._run(cap, cap.forward_fn))
            return self._control(cap, data, a, found, paths, dims)
        if len(ref) == len(a):
            compare("eager", a, ref, other_sliced=True)
        if self._f_padded is not None and len(ref) == len(a):
            self._unpadded_sequence(cap, dims, compare)
        else:
            self._put_back()
        if found and self._a_first:
            # run A was the key's first warmup, which may initialise lazily (a table, a cache): the
            # finding counts only if run A and its follow-up, run again as extra forwards, agree
            self._a_first = False
            self._a = self._f_padded = None
            self._seq = {}
            return self._check(cap)
        return self._control(cap, data, a, found, paths, dims)

    def _unpadded_sequence(self, cap: Capture, dims: list, compare: Callable[..., None]) -> None:
        """Run D's writes still in place: give the cells only A wrote other values, run the
        follow-up eagerly without padding, put everything back, compare with the padded sequence."""
        pert = _Perturbed(self._a_log, list(self._guard._undo))
        try:
            f_unpadded = self._follow(cap, padded=False)
        except Exception as exc:  # noqa: BLE001 - a step that only runs at its keys' sizes
            logger.info("padding check of %s: the follow-up call did not run without padding (%s: %s); "
                        "sequences not compared", self.key_text, type(exc).__name__, exc)
            return
        finally:
            self._put_back()
            pert.restore()
        self._seq = {"unpadded": f_unpadded, "cells": [(t, offs) for t, _, offs, _ in pert.cells]}
        compare("sequence", self._f_padded, f_unpadded, other_sliced=True)

    def _noise(self, d: Tuple[int, ...]) -> Noise:
        return Noise(lead=len(d), reduction=self._work.reduction, matmuls=self._work.matmuls)

    def _control(self, cap: Capture, data: Dict[str, torch.Tensor], a: List[Optional[torch.Tensor]],
                 found: List[Tuple[str, str, float]], paths: List[str], dims: List[Tuple[int, ...]]) -> list:
        """``found`` without the outputs that also move between two identical runs (warned about);
        for a sequence finding, what it needs to name its cause."""
        if not found:
            return found
        # Control: A again. An output that moves between identical runs depends on state the
        # step keeps in Python (a counter, an attribute re-bound to a new tensor): not a padding
        # leak, and not checkable this way.
        self._fill(data, self.sizes)
        again = self._run(cap, cap.forward_fn)
        unstable = {p for p, x, y, d in zip(paths, a, again, dims)
                    if x is not None and y is not None and difference(x, y) is not None}
        if any(k == "sequence" for k, _, _ in found):
            unstable |= self._sequence_control(cap, paths, dims)
        if unstable:
            logger.warning(
                "padding check of %s: %s changed between two identical calls (the step's output depends "
                "on state it keeps in Python: a counter, or an attribute re-bound to a new tensor), so padding "
                "leaks into it cannot be checked", self.key_text, ", ".join(sorted(unstable)))
        found = [f for f in found if f[1] not in unstable]
        if any(k == "sequence" for k, _, _ in found):
            self._explain_sequence(cap, paths, dims)
        return found

    def _sequence_control(self, cap: Capture, paths: List[str], dims: list) -> set:
        """The unpadded sequence again: the outputs of its follow-up that move between two identical
        sequences (state the step keeps in Python)."""
        unstable: set = set()
        again = self._sequence_again(cap, padded_first=False)
        if again is None:
            return set(paths)
        for p, x, y in zip(paths, self._seq["unpadded"], again):
            if x is not None and y is not None and difference(x, y) is not None:
                unstable.add(p)
        return unstable

    def _sequence_again(self, cap: Capture, padded_first: bool) -> Optional[List[Optional[torch.Tensor]]]:
        """[A, F] (``padded_first``) or [D, F] with the unpadded follow-up, as the check ran it; every
        write put back."""
        data, sizes = self._data, self.sizes
        pert = None
        try:
            if padded_first:
                self._fill(data, sizes)
                self._run(cap, cap.forward_fn, restore=False)
            else:
                unpadded = {name: data[name][region(sizes, didx)].clone() for name, _, didx, _ in self.inputs}
                self._run(cap, lambda: self.step(**unpadded), restore=False)
                pert = _Perturbed(self._a_log, list(self._guard._undo))
            return self._follow(cap, padded=False)
        except Exception:  # noqa: BLE001 - the diagnosis is a bonus
            return None
        finally:
            self._put_back()
            if pert is not None:
                pert.restore()

    def _explain_sequence(self, cap: Capture, paths: List[str], dims: list) -> None:
        """What a sequence finding needs to name its cause: the follow-up rows that changed and the
        inputs whose pad they hold, whether the earlier padded call did it (its padding rows' writes)
        or the follow-up's own padding, the written tensors and cells."""
        seq = self._seq
        fu = seq["unpadded"]
        rows: set = set()
        for x, y, d in zip(self._f_padded, fu, dims):
            if x is None or y is None or not d:
                continue
            x = real_cells(x, d, self.sizes)
            if x.shape != y.shape or x.dim() == 0:
                continue
            if x.dtype.is_floating_point or x.dtype.is_complex:
                wide = torch.complex128 if x.dtype.is_complex else torch.float64
                bad = ~((x.to(wide) - y.to(wide)).abs() <= admitted(y, self._noise(d))) & ~(x == y)
            else:
                bad = x != y
            bad = bad.reshape(bad.shape[0], -1).any(-1) if bad.dim() > 1 else bad
            rows.update(int(r) for r in bad.nonzero().reshape(-1).tolist())
        seq["rows"] = sorted(rows)
        by_input = []
        for name, spec in self.shared:
            vals = self._follow_data[name].reshape(self._follow_data[name].shape[0], -1) \
                if self._follow_data[name].dim() else self._follow_data[name].reshape(1, 1)
            at_pad = [r for r in seq["rows"] if r < vals.shape[0] and bool((vals[r] == spec.pad).any())]
            if at_pad:
                by_input.append((name, spec, at_pad))
        seq["inputs"] = by_input
        again = self._sequence_again(cap, padded_first=True)
        seq["earlier"] = again is not None and any(
            x is not None and y is not None and difference(x, y, tolerant=self._noise(d)) is not None
            for x, y, d in zip(again, fu, dims))
        seq["named"] = _named_cells(self.step, seq["cells"]) if seq["earlier"] else []
        self._explained = {k: seq[k] for k in ("rows", "inputs", "earlier", "named")}

    def _message(self, found: List[Tuple[str, str, float]]) -> str:
        if not found:
            return (f"padding check of {self.key_text}: another rank found padding leaking into a real "
                    "output (see its error); every rank stops the capture")
        real = ", ".join(map(str, self.sizes))
        what = {
            "padding": "when only the padding cells of the floating-point input(s) "
                       f"{[n for n, _, _ in self.floats]} were changed",
            "count": f"when the cells after the real ones held real data instead of padding (real sizes "
                     f"({', '.join(map(str, self.sizes2 or ()))}) against ({real}))",
            "eager": f"against eager PyTorch on the same real batch without padding (real sizes ({real})): the step "
                     "depends on the padded size (x.shape[0], arange, a mean or norm over the batch) or a pad value "
                     "reaches real rows (a padding row's value wins a max or a sort over the batch)" + self._pad_hint(),
            "sequence": self._sequence_text(),
        }
        single = [f for f in found if f[0] != "sequence"]
        parts = "; ".join(f"{p} changed (max abs diff {d:.4g}) {what[k]}" for k, p, d in found)
        if not single:
            return (f"padding leaks into real results at {self.key_text}: {parts}. The graph computes the padding "
                    "rows too, their writes included, and a call replays with whatever they left behind. "
                    + self._sequence_fix() + '; leaving "padding" out of GraphRunner(checks=...) turns the check off.')
        first = single[0][1]
        m = re.fullmatch(r"output\[('[^']*')\]", first)
        optout = f"checks=[..., gr.PaddingCheck(exempt=({m.group(1) if m else repr(first)},))]"
        return (f"padding leaks into real results at {self.key_text}: {parts}. The graph computes the padding "
                "cells too, so at replay these outputs would include them. Make the step row-independent (e.g. "
                "reduce over the real rows only, with the count or a mask as an input; use the real count, not "
                f"the padded shape); if the output is meant to cover the whole padded batch, declare {optout}; "
                'leaving "padding" out of GraphRunner(checks=...) turns the check off.')

    def _fix(self, found: List[Tuple[str, str, float]]) -> str:
        single = [f for f in found if f[0] != "sequence"]
        if not found:
            return "see the other rank's finding"
        if not single:
            return self._sequence_fix()
        return (f"make the step row-independent, or exempt {single[0][1]} if it is meant to cover the whole "
                "padded batch")

    def _sequence_text(self) -> str:
        seq, real = self._explained, ", ".join(map(str, self.sizes))
        rows = seq.get("rows") or []
        shown = ", ".join(map(str, rows[:6])) + (", ..." if len(rows) > 6 else "")
        if seq.get("earlier", True):
            head = ("in a call after a padded call, against the same call after the same first call without "
                    f"padding (real sizes ({real}) in both)")
        else:
            head = ("in a padded call where a real row holds the pad value, against the same call without "
                    f"padding (real sizes ({real}))")
        text = f"{head}: rows [{shown}] of that call changed" if rows else head
        ins = seq.get("inputs") or []
        if ins:
            text += "; they hold the pad of integer input(s) " + ", ".join(
                f"{n} (pad {spec.pad!r}, also a real value: bounds {tuple(spec.bounds)})" for n, spec, _ in ins)
        named = seq.get("named") or []
        if named:
            text += ("; the padding rows wrote " + ", ".join(named[:3]) + (", ..." if len(named) > 3 else "")
                     + ", which a real request reads later")
        elif seq.get("earlier", True):
            text += "; the padding rows wrote state that a later real request reads"
        else:
            text += "; within that call the padding rows overwrote what the real row at the pad index wrote or read"
        return text

    def _sequence_fix(self) -> str:
        ins = (self._explained.get("inputs") or []) or [(n, spec, []) for n, spec in self.shared]
        if ins:
            names = ", ".join(repr(n) for n, _, _ in ins)
            return (f"Pad {names} with a scratch index outside the real range (e.g. a dedicated cache slot no "
                    f"request owns: one more slot, pad=num_slots, bounds=(0, num_slots - 1)), so that padding rows "
                    "only write where no real request reads")
        return ("Make padding rows write only where no real request reads (a scratch slot outside the real range "
                "as their pad, or a mask that skips their writes)")

    def _pad_hint(self) -> str:
        shared = [f"{n} (pad {spec.pad!r})" for n, spec in self.shared]
        if not shared:
            return ""
        return (f" (integer input(s) {', '.join(shared)}: the pad is also a real value, so padding rows write or "
                "read what a real row uses, or win against it; pad with a scratch index outside the real range, "
                "e.g. a dedicated cache slot, and declare bounds= as the real range)")


def _shared_pad(spec: Any) -> bool:
    """An integer input whose pad is also a real value (inside its bounds)."""
    if spec.dtype.is_floating_point or spec.dtype.is_complex or spec.dtype == torch.bool or spec.bounds is None:
        return False
    lo, hi = spec.bounds
    return lo is not None and hi is not None and lo <= spec.pad <= hi


def _named_cells(step: Any, cells: List[Tuple[torch.Tensor, torch.Tensor]]) -> List[str]:
    """``["SlotState.state[0, :]", ...]``: the tensors (by attribute, when the step's objects hold
    them) and the cells only the padded call wrote."""
    from graphrunner._aten import storage_key

    named = _tensor_attributes(step)
    out = []
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
    rel = offs.to("cpu") - v.storage_offset()
    rel = rel[(rel >= 0) & (rel < v.numel())]
    if not rel.numel():
        return ""
    parts = []
    for size, stride in zip(v.shape, v.stride()):
        vals = torch.unique((rel // stride) % size).tolist()
        if len(vals) == size and size > 1:
            parts.append(":")
        elif len(vals) <= 3:
            parts.append(vals[0] if len(vals) == 1 else "{" + ", ".join(map(str, vals)) + "}")
        else:
            parts.append("{" + ", ".join(map(str, vals[:3])) + ", ...}")
    return "[" + ", ".join(map(str, parts)) + "]"


def _step_objects(step: Any) -> List[Tuple[str, Any]]:
    """``[(label, object)]`` the step reaches: the step, the object of a bound method, a closure's
    cells; ``nn.Module`` children by attribute (``TinyDecoder.layers``), plain objects' attributes
    one level down. What :func:`_tensor_attributes` and :class:`PythonNumbers` look in."""
    roots, seen, out = [], set(), []
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
            elif depth == 0 and hasattr(v, "__dict__") and not callable(v) and not isinstance(v, type) \
                    and not isinstance(v, torch.Tensor):
                visit(v, f"{label}.{n}", depth + 1)

    for r in roots:
        if isinstance(r, (torch.nn.Module,)) or (hasattr(r, "__dict__") and not callable(r)) or \
                (callable(r) and hasattr(r, "__dict__") and not isinstance(r, type) and not hasattr(r, "__code__")):
            visit(r, type(r).__name__, 0)
    return out


def _tensor_attributes(step: Any) -> List[Tuple[str, torch.Tensor]]:
    """``[(name, tensor)]`` of the tensors the step's objects hold (:func:`_step_objects`);
    ``nn.Module`` buffers and parameters by their path (``TinyDecoder.layers.0.k_cache``)."""
    out = []
    for label, obj in _step_objects(step):
        if isinstance(obj, torch.nn.Module):
            for n, t in list(obj.named_buffers()) + list(obj.named_parameters()):
                out.append((f"{label}.{n}", t))
        attrs = getattr(obj, "__dict__", None)
        if isinstance(attrs, dict) and not isinstance(obj, type):
            out.extend((f"{label}.{n}", v) for n, v in list(attrs.items()) if isinstance(v, torch.Tensor))
    return out


class PythonNumbers:
    """The Python state a step re-binds: the number (``int``, ``float``, ``bool``) and tensor
    attributes of the objects it reaches (:func:`_step_objects`), kept so that the padding check's
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

    def __init__(self, step: Any) -> None:
        reached = [obj for _, obj in _step_objects(step)]
        self.objects = [obj for obj in reached
                        if isinstance(getattr(obj, "__dict__", None), dict) and not isinstance(obj, type)]
        # the user's classes of those objects (and their bases): a counter kept in a class attribute
        # (``Step.calls += 1``) is Python state the step re-binds just like ``self.calls``
        classes: List[type] = []
        for obj in reached:
            for cls in getattr(obj if isinstance(obj, type) else type(obj), "__mro__", ()):
                mod = getattr(cls, "__module__", "") or ""
                if mod == "builtins" or mod.split(".")[0] in ("torch", "graphrunner") or cls in classes:
                    continue
                classes.append(cls)
        self.objects += classes

    def snapshot(self) -> List[Tuple[Any, str, Any]]:
        """``[(object or class, attribute, value)]`` of every number and tensor attribute now."""
        return [(obj, n, v) for obj in self.objects for n, v in list(vars(obj).items())
                if type(v) in (int, float, bool) or isinstance(v, torch.Tensor)]

    @staticmethod
    def put(snapshot: Optional[List[Tuple[Any, str, Any]]]) -> None:
        """Write ``snapshot``'s values back where they changed."""
        for obj, n, v in snapshot or ():
            d = vars(obj)
            if d.get(n, v) is not v:
                if isinstance(obj, type):  # a class's __dict__ is read-only: set it as the class would
                    type.__setattr__(obj, n, v)
                else:
                    d[n] = v
