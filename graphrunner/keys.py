"""Shape keys of a GraphRunner: named dims, their buckets, the key of a call,
the padding plan and the one agreement vector across ranks.

A runner has one or more *named dims* (``"reqs"``, ``"draft"``, ``"tokens"``),
each with a strictly increasing bucket list. A call's *sizes* are its real
extent in every dim; its *key* is a tuple with one bucket per dim. With
``buckets=[...]`` (a list) there is one dim, named ``"batch"``, and keys are
plain ints, exactly as before dims existed.

This module knows nothing about graphs: the runner asks :class:`KeySpace`
which key a call replays and :func:`agree` what every rank agreed on.
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Hashable, Mapping, Sequence
from typing import Any, Protocol

import torch

from graphrunner.buckets import check_ratio, validate_buckets
from graphrunner.errors import AgreementError

__all__ = [
    "KeySpace",
    "BATCH_DIM",
    "agree",
    "agreement_vector",
    "all_max_vector",
    "AgreementError",
    "check_dims",
    "region",
    "padding_regions",
    "slice_leaves",
    "count_leaves",
    "resolve_input_dims",
    "resolve_output_dims",
]

#: The name of the one dim of a runner built with ``buckets=[...]``.
BATCH_DIM = "batch"

Sizes = tuple[int, ...]
#: A key as users, backends, stats and traces name it (:meth:`KeySpace.external`): an int with
#: ``buckets=[...]``, else the tuple.
Key = int | Sizes
#: A call's sizes as users give them (``key_for``): an int (one dim), a tuple in dims order, or ``{dim: size}``.
Batch = int | Sequence[int] | Mapping[str, int]
#: ``buckets=``: a list of sizes (one dim, the batch) or ``{dim: [sizes...]}``.
Buckets = Sequence[int] | Mapping[str, Sequence[int]]
#: ``outputs=``: the outputs' leading dims (a dims tuple, or ``{dict output key: dims}``), or ``None``.
OutputDims = None | Sequence[str] | Mapping[Hashable, Sequence[str]]
#: The index of a leading region of a tensor (:func:`region`).
Index = slice | tuple[slice, ...]


class Group(Protocol):
    """A rank group as graphrunner uses it (:mod:`graphrunner.group`: ``LocalGroup``,
    ``TorchDistGroup``, or a test's fake); ``all_max_vector(values, phase=, key=)`` is optional
    (:func:`all_max_vector`)."""

    @property
    def rank(self) -> int: ...

    @property
    def size(self) -> int: ...

    def barrier(self, phase: str = "", key: Hashable | None = None) -> None: ...

    def all_max(self, value: int, phase: str = "", key: Hashable | None = None) -> int: ...

    def all_min(self, value: int, phase: str = "", key: Hashable | None = None) -> int: ...


#: Why a call falls back (``RunnerStats.fallback_reasons``).
OVER_MAX, PADDING, CANNOT = "over_max_bucket", "padding_ratio", "cannot_replay"


class KeySpace:
    """The dims, buckets and captured keys of one runner, and the key choice.

    Args:
        buckets: a list of ints (one dim, ``"batch"``; keys are ints) or a
            dict ``{dim: [sizes...]}`` (keys are tuples in the dict's order).
        keys: ``None`` (capture every combination of buckets) or a list of
            key tuples (ints with one dim), each a bucket in every dim:
            only those are captured.
        max_padding_ratio: ``None`` or a float in ``[0, 1)``, applied per
            dim: a key whose padding in some dim exceeds that share of the
            dim's bucket is not used for the call.

    :meth:`choose` maps a call's sizes to ``(key, None)`` or
    ``(None, reason)``: the smallest captured key (by padded volume, then
    lexicographically) that covers the sizes in every dim within the padding
    ratio. Raises ``ValueError``/``TypeError`` naming the entry for invalid
    buckets or keys.
    """

    def __init__(
        self, buckets: Buckets, keys: Sequence[Key] | None = None, max_padding_ratio: float | None = None
    ) -> None:
        #: True for ``buckets=[...]`` (a list): one dim, :data:`BATCH_DIM`, int keys, and messages that
        #: speak of the batch; False for ``{dim: [sizes...]}`` (tuple keys, even with one dim).
        self.one_batch_dim = not isinstance(buckets, Mapping)
        if isinstance(buckets, Mapping):
            if not buckets:
                raise ValueError("buckets is an empty dict; pass {dim: [sizes...]}, e.g. {'reqs': [1, 2, 4]}")
            self.buckets: dict[str, list[int]] = {}
            for dim, bl in buckets.items():
                if not isinstance(dim, str) or not dim.isidentifier():
                    raise ValueError(f"buckets: dim name {dim!r} must be an identifier such as 'reqs'")
                try:
                    self.buckets[dim] = validate_buckets(bl)
                except (TypeError, ValueError) as exc:
                    raise type(exc)(f"buckets[{dim!r}]: {exc}") from None
        else:
            self.buckets = {BATCH_DIM: validate_buckets(buckets)}
        self.dims: tuple[str, ...] = tuple(self.buckets)
        self.max_padding_ratio = check_ratio(max_padding_ratio)
        self.explicit = keys is not None
        if keys is None:
            grid = itertools.product(*self.buckets.values())
            self.keys: list[Sizes] = sorted(grid, key=_order)
        else:
            self.keys = self._validate_keys(keys)
        #: The largest key (it covers every other key): the static buffers' leading shape.
        self.maxes: Sizes = self.keys[-1]
        self._memo: dict[Sizes, tuple[Sizes | None, str | None]] = {}
        #: The choice per tuple of per-dim buckets (:meth:`bucket_of`): without a padding ratio every
        #: size a dim's bucket covers is served by the same key, so varlen sizes share one entry.
        self._by_bucket: dict[Sizes, tuple[Sizes | None, str | None]] = {}
        self._lists = tuple(self.buckets[d] for d in self.dims)

    def _validate_keys(self, keys: Any) -> list[Sizes]:
        if isinstance(keys, (str, bytes)) or not hasattr(keys, "__iter__"):
            raise TypeError(f"keys must be a list of key tuples such as [(1, 1), (4, 2)], got {type(keys).__name__}")
        out: list[Sizes] = []
        for i, k in enumerate(keys):
            t = self.internal(k, what=f"keys[{i}]")
            for d, v in zip(self.dims, t):
                if v not in self.buckets[d]:
                    raise ValueError(
                        f"keys[{i}] = {k!r}: {v} is not a bucket of dim {d!r} "
                        f"{self.buckets[d]}; every key holds one bucket per dim"
                    )
            if t in out:
                raise ValueError(f"keys[{i}] = {k!r} is listed twice; list each key once")
            out.append(t)
        if not out:
            raise ValueError("keys is empty; list at least one key, or pass keys=None to capture every combination")
        top = tuple(max(k[i] for k in out) for i in range(len(self.dims)))
        if top not in out:
            raise ValueError(
                f"keys must include the key {self.external(top)!r} that covers every other listed key "
                "in every dim: the static buffers and the shared output buffer are allocated at it"
            )
        return sorted(out, key=_order)

    # --------------------------------------------------------- conversion
    def internal(self, key: Any, what: str = "key") -> Sizes:
        """``key`` (an int for a one-dim runner, else a tuple) as a tuple; raises for a wrong arity."""
        if isinstance(key, bool):
            raise TypeError(f"{what} {key!r} must be an int or a tuple of ints")
        if isinstance(key, int):
            key = (key,)
        try:
            t = tuple(key)
        except TypeError:
            raise TypeError(f"{what} {key!r} must be a tuple with one int per dim {self.dims}") from None
        if len(t) != len(self.dims) or any(isinstance(v, bool) or not isinstance(v, int) for v in t):
            raise ValueError(f"{what} {key!r} must hold one int per dim {self.dims}")
        return t

    def sizes_of(self, batch: Batch, what: str = "sizes") -> Sizes:
        """``batch`` as sizes: an int (one dim), a tuple in :attr:`dims` order, or ``{dim: size}``;
        ``ValueError`` naming ``what`` otherwise."""
        if isinstance(batch, Mapping):
            if len(batch) != len(self.dims) or any(d not in self.dims for d in batch):
                raise ValueError(f"{what}: give one size per dim {self.dims}, got {dict(batch)!r}")
            batch = tuple(int(batch[d]) for d in self.dims)
        return self.internal(batch, what=f"{what} sizes")

    def external(self, key: Sizes) -> Key:
        """The key as users, backends, stats and traces see it: an int with ``buckets=[...]``, else the tuple."""
        return key[0] if self.one_batch_dim else key

    def capture_order(self) -> list[Sizes]:
        """The keys to capture, largest (by volume, then lexicographically) first."""
        return list(reversed(self.keys))

    # -------------------------------------------------------------- choice
    def choose(self, sizes: Sizes) -> tuple[Sizes | None, str | None]:
        """``(key, None)`` for the key that serves ``sizes``, or ``(None, reason)``
        with ``reason`` ``"over_max_bucket"`` (no captured key covers it) or
        ``"padding_ratio"`` (every covering key pads some dim too much)."""
        hit = self._memo.get(sizes)
        if hit is None:
            if self.max_padding_ratio is None:
                # the keys covering ``sizes`` are those covering its per-dim buckets (every key holds a
                # bucket per dim): a bisect per dim and one lookup, not a scan of the keys
                b = self.bucket_of(sizes)
                if b is None:
                    hit = (None, OVER_MAX)
                else:
                    hit = self._by_bucket.get(b)
                    if hit is None:
                        hit = self._by_bucket[b] = self._choose(b)
            else:
                hit = self._choose(sizes)
            if len(self._memo) >= MEMO_LIMIT:  # varlen sizes rarely repeat: keep the memo bounded
                self._memo.clear()
            self._memo[sizes] = hit
        return hit

    def bucket_of(self, sizes: Sizes) -> Sizes | None:
        """The smallest bucket of each dim that covers ``sizes`` (a tuple in :attr:`dims` order), or
        ``None`` when some size exceeds its dim's largest bucket."""
        out = []
        for bl, n in zip(self._lists, sizes):
            i = bisect.bisect_left(bl, n)
            if i == len(bl):
                return None
            out.append(bl[i])
        return tuple(out)

    def serving_sizes(self, sizes: Sizes) -> Sizes:
        """The sizes a call of (agreed) ``sizes`` runs at: ``sizes`` with every 0 raised to 1 (a dim
        idle on every rank runs the smallest key covering one cell, every cell padding). The one
        rule the dispatcher and ``GraphRunner.key_for`` share."""
        return sizes if min(sizes) >= 1 else tuple(max(n, 1) for n in sizes)

    def _choose(self, sizes: Sizes) -> tuple[Sizes | None, str | None]:
        ratio = self.max_padding_ratio
        covered = False
        for k in self.keys:  # sorted smallest first
            if all(b >= n for b, n in zip(k, sizes)):
                covered = True
                if ratio is None or all((b - n) / b <= ratio + 1e-12 for b, n in zip(k, sizes)):
                    return k, None
        return None, (PADDING if covered else OVER_MAX)

    def describe(self, sizes: Sizes) -> str:
        """``sizes`` for an error message: ``batch 3`` or ``reqs=3, draft=2``."""
        if self.one_batch_dim:
            return f"batch {sizes[0]}"
        return ", ".join(f"{d}={n}" for d, n in zip(self.dims, sizes))

    def why(self, sizes: Sizes, rows: Sizes, reason: str) -> str:
        """Why no key serves a call of local ``sizes`` agreed to ``rows`` (for ``fallback='error'``)."""
        space = self
        if space.one_batch_dim:
            n, r = sizes[0], rows[0]
            where = f"the agreed batch {r} (max over ranks; this rank has {n})" if r != n else f"batch {n}"
            if reason == OVER_MAX:
                return f"{where} exceeds the largest bucket {self.maxes[0]}"
            if reason == PADDING:
                b = next(x for x in self.buckets[BATCH_DIM] if x >= r)
                return (
                    f"{where} would pad bucket {b} with {b - r} rows, more than max_padding_ratio="
                    f"{self.max_padding_ratio}"
                )
            return f"bucket for {where} cannot be replayed on every rank"
        where = (
            f"the agreed sizes ({space.describe(rows)}; max over ranks; this rank has {space.describe(sizes)})"
            if rows != sizes
            else f"sizes ({space.describe(sizes)})"
        )
        if reason == OVER_MAX:
            return f"no captured key covers {where} (keys: {[self.external(k) for k in self.keys]})"
        if reason == PADDING:
            return f"every captured key covering {where} pads some dim by more than max_padding_ratio={self.max_padding_ratio}"
        return f"the key for {where} cannot be replayed on every rank"

    def fingerprint(self) -> dict[str, Any]:
        """The configuration ranks must share: dims, bucket lists, keys, padding ratio."""
        return {
            "dims": list(self.dims),
            "buckets": {d: list(b) for d, b in self.buckets.items()},
            "keys": [list(k) for k in self.keys],
            "max_padding_ratio": self.max_padding_ratio,
        }


#: Entries :meth:`KeySpace.choose` (and the dispatcher's routes, the static inputs' views and re-pad
#: views, the output views) keep per exact sizes before starting over: a server's varlen sizes rarely
#: repeat, and the per-bucket entries behind them are cheap to reach (a miss costs a few views).
MEMO_LIMIT = 4096


def _order(key: Sizes) -> tuple[int, Sizes]:
    return (math.prod(key), key)


# ------------------------------------------------------ named dims of inputs and outputs
def check_dims(dims: Any, what: str, allow_empty: bool = False) -> tuple[str, ...]:
    """``dims`` as a tuple of distinct dim names, or a clear error."""
    if isinstance(dims, str):
        raise TypeError(
            f"{what} must be a tuple of dim names such as ('reqs', 'draft'), got the string {dims!r} "
            f"(write ({dims!r},) for one dim)"
        )
    try:
        t = tuple(dims)
    except TypeError:
        raise TypeError(f"{what} must be a tuple of dim names such as ('reqs', 'draft'), got {dims!r}") from None
    if not t and not allow_empty:
        raise ValueError(f"{what} is empty; name at least one dim")
    for d in t:
        if not isinstance(d, str) or not d.isidentifier():
            raise ValueError(f"{what} = {dims!r}: {d!r} is not a dim name (an identifier such as 'reqs')")
    if len(set(t)) != len(t):
        raise ValueError(f"{what} = {dims!r} names a dim twice")
    return t


def region(sizes: Sequence[int], didx: tuple[int, ...]) -> Index:
    """The index of the leading region ``sizes`` (runner-dim order) of a tensor whose leading dims are ``didx``."""
    if len(didx) == 1:
        return slice(0, sizes[didx[0]])
    return tuple(slice(0, sizes[d]) for d in didx)


def padding_regions(sizes: Sequence[int], key: Sequence[int], didx: tuple[int, ...]) -> list[Index]:
    """Indices that together cover ``key`` minus ``sizes`` on a tensor with leading dims ``didx``:
    one region per dim (``[:n0, ..., n_j:k_j, :k_{j+1}, ...]``), empty ones left out."""
    out: list[Index] = []
    for j, d in enumerate(didx):
        if sizes[d] >= key[d]:
            continue
        idx = (
            [slice(0, sizes[e]) for e in didx[:j]]
            + [slice(sizes[d], key[d])]
            + [slice(0, key[e]) for e in didx[j + 1 :]]
        )
        out.append(idx[0] if len(idx) == 1 else tuple(idx))
    return out


def slice_leaves(leaves: list[torch.Tensor], idx: list[tuple[int, ...]], sizes: Sequence[int]) -> list[torch.Tensor]:
    """Every tensor leaf sliced to ``sizes`` on its leading dims ``idx[i]`` (0-dim leaves and ``()`` dims whole)."""
    out = []
    for t, didx in zip(leaves, idx):
        if t.dim() == 0 or not didx:
            out.append(t)
        else:
            out.append(t[region(sizes, didx)])
    return out


def count_leaves(spec: tuple) -> int:
    """The number of tensor leaves of a pytree spec (:mod:`graphrunner._pytree`)."""
    tag = spec[0]
    if tag == "T":
        return 1
    if tag in ("N", "S"):
        return 0
    return sum(count_leaves(c) for c in spec[-1])


class DeclaresDims(Protocol):
    """What :func:`resolve_input_dims` reads of an input declaration (a
    :class:`graphrunner.inputs.BatchInput`, which imports this module): its leading dims' names,
    or None for the batch dim alone."""

    @property
    def dims(self) -> tuple[str, ...] | None: ...


def resolve_input_dims(inputs: Mapping[str, DeclaresDims], space: KeySpace) -> dict[str, tuple[int, ...]]:
    """``{input name: indices of its leading dims in space.dims}``; every dim used by some input."""
    out: dict[str, tuple[int, ...]] = {}
    for name, spec in inputs.items():
        dims = spec.dims
        if dims is None:
            if len(space.dims) != 1:
                raise ValueError(
                    f"inputs[{name!r}] must declare its leading dims, e.g. gr.BatchInput(..., dims="
                    f"{space.dims!r}): the runner has several dims {space.dims}"
                )
            dims = space.dims
        unknown = [d for d in dims if d not in space.dims]
        if unknown:
            raise ValueError(
                f"inputs[{name!r}].dims = {dims!r} names {unknown}, which buckets does not list "
                f"(dims: {space.dims}); add them to buckets={{dim: [...]}} or fix the name"
            )
        out[name] = tuple(space.dims.index(d) for d in dims)
    unused = [d for i, d in enumerate(space.dims) if not any(i in v for v in out.values())]
    if unused:
        raise ValueError(
            f"buckets names dim(s) {unused} that no input declares in dims=: a call's size in them "
            "would be unknown; declare them on an input or drop them from buckets"
        )
    return out


def resolve_output_dims(
    outputs: OutputDims, default: tuple[int, ...], space: KeySpace
) -> tuple[tuple[int, ...], dict[Hashable, tuple[int, ...]]]:
    """``(default leading dims, {dict output key: leading dims})`` as runner-dim indices."""

    def idx(dims: Any, what: str) -> tuple[int, ...]:
        t = check_dims(dims, what, allow_empty=True)
        unknown = [d for d in t if d not in space.dims]
        if unknown:
            raise ValueError(f"{what} = {dims!r} names {unknown}, which buckets does not list (dims: {space.dims})")
        return tuple(space.dims.index(d) for d in t)

    if outputs is None:
        return default, {}
    if isinstance(outputs, Mapping):
        return default, {k: idx(v, f"outputs[{k!r}]") for k, v in outputs.items()}
    return idx(outputs, "outputs"), {}


# ------------------------------------------------------------------ agreement
#: The agreement vector packs a *tag* (the call number modulo ``2**_CALL_BITS``, then the
#: configuration digest modulo ``2**_DIGEST_BITS``) into the first size and the "invalid"
#: element, so that it has one element per dim plus one, as before the tag: on gloo a longer
#: vector costs measurably more per call. Sizes in the first dim must stay below ``2**_SIZE_BITS``.
_SIZE_BITS, _CALL_BITS, _DIGEST_BITS = 32, 16, 14
_CALL_MOD, _DIGEST_MOD = 1 << _CALL_BITS, 1 << _DIGEST_BITS

#: What a rank must do after its calls were found unpaired (the end of every such message).
RESYNC = (
    "every rank must call the runner the same number of times. Nothing was replayed on any rank, and this "
    "runner now refuses every call on every rank (without a collective): re-synchronise the ranks' steps and "
    "build a new GraphRunner on every rank (or let the processes exit)"
)


def _tag(call: int, digest: int) -> int:
    return (call % _CALL_MOD) * _DIGEST_MOD + digest % _DIGEST_MOD


def agreement_vector(sizes: Sizes, invalid: bool, call: int, digest: int = 0) -> list[int]:
    """The int vector one rank contributes to a call's agreement, one element per dim plus one:
    ``[n0 - tag * 2**32, n1, ..., n_last, tag * 2 + invalid]`` with ``tag`` the call number
    (modulo ``2**16``) and the configuration digest (modulo ``2**14``). The element-wise max
    over the ranks gives the agreed sizes and "some rank is invalid" when every rank has the
    same tag, and always the highest tag (last element) and the lowest (first element: the
    tag is negated there): a max and a min in the same collective."""
    t = _tag(call, digest)
    return [sizes[0] - (t << _SIZE_BITS), *sizes[1:], (t << 1) | (1 if invalid else 0)]


def _near(own: int, low_bits: int) -> int:
    """The call number nearest ``own`` whose residue modulo ``2**_CALL_BITS`` is ``low_bits``."""
    d = (low_bits - own) % _CALL_MOD
    return own + (d - _CALL_MOD if d >= _CALL_MOD // 2 else d)


def agree(group: Group, sizes: Sizes, invalid: bool, call: int, digest: int = 0) -> tuple[Sizes, bool]:
    """:func:`agree_extra` without extra elements: ``(agreed_sizes, any_invalid)``."""
    agreed, bad, _ = agree_extra(group, sizes, invalid, call, digest)
    return agreed, bad


def agree_extra(
    group: Group, sizes: Sizes, invalid: bool, call: int, digest: int = 0, extra: Sequence[int] = ()
) -> tuple[Sizes, bool, list[int]]:
    """The one collective of a multi-rank call: the element-wise max of
    :func:`agreement_vector` over the ranks (``group.all_max_vector``), which carries the
    sizes, an "invalid" flag, and the call number and configuration digest as both max and min.

    Returns ``(agreed_sizes, any_invalid, extra_max)``. A rank with invalid inputs
    passes ``invalid=True`` (its sizes are ignored: pass zeros). ``call`` is
    the runner's call number (every rank's must be equal: the ranks' calls are
    paired in order) and ``digest`` the runner's configuration digest (0 when
    there is none). Raises :class:`AgreementError` on every rank alike when
    the call numbers or the digests differ between the ranks (naming this
    rank's call number and the lowest and highest), and on this rank if an
    agreed size is below its own (the group broke the max). A size of
    ``2**32`` or more in the first dim takes part as invalid and then raises
    ``ValueError``. A group without ``all_max_vector`` is served by one
    ``all_max`` per element (see :func:`all_max_vector`). ``extra``: more ints this rank adds
    to the same collective (every rank the same count), returned as their max over the ranks
    (``extra_max``: a background capture's counts, :mod:`graphrunner.background`).
    """
    n = len(sizes)
    huge = not invalid and sizes[0] >> _SIZE_BITS
    vector = agreement_vector(sizes if not huge else (0,) * n, invalid or bool(huge), call, digest) + list(extra)
    out = all_max_vector(group, vector, "runner_agree", call)
    if len(out) != len(vector):
        raise AgreementError(
            f"the group's all_max_vector returned {len(out)} values for {len(vector)} "
            f"({list(out)!r}); it must return one per element"
        )
    extra_max = [int(v) for v in out[n + 1 :]]
    first, last = int(out[0]), int(out[n])
    hi, lo = last >> 1, -(first >> _SIZE_BITS)
    if hi != lo:
        _unpaired(group, call, digest, hi, lo)
    if huge:
        raise ValueError(
            f"GraphRunner: size {sizes[0]} in the first dim is too large to agree across ranks "
            f"(at most {(1 << _SIZE_BITS) - 1}); every rank skipped this call"
        )
    agreed = (first + (lo << _SIZE_BITS), *map(int, out[1:n]))
    bad = bool(last & 1)
    if not invalid and any(a < s for a, s in zip(agreed, sizes)):
        low = [i for i, (a, s) in enumerate(zip(agreed, sizes)) if a < s]
        raise AgreementError(
            f"rank {getattr(group, 'rank', '?')}: the agreement of call {call} returned sizes {list(agreed)} "
            f"below this rank's own {list(sizes)} in position(s) {low}: the group's all_max_vector is not an "
            "element-wise max over the ranks; nothing was replayed"
        )
    return agreed, bad, extra_max


def _unpaired(group: Group, call: int, digest: int, hi: int, lo: int) -> None:
    """Raise the :class:`AgreementError` for a call whose peers' tags (call number, digest)
    ranged from ``lo`` to ``hi``, not all equal to this rank's."""
    rank, size = getattr(group, "rank", "?"), getattr(group, "size", "?")
    own_d, lo_d, hi_d = digest % _DIGEST_MOD, lo % _DIGEST_MOD, hi % _DIGEST_MOD
    calls = sorted({call, _near(call, lo // _DIGEST_MOD), _near(call, hi // _DIGEST_MOD)})
    first, last = calls[0], calls[-1]
    if first == last:  # the same call numbers: the ranks ran runners of different configurations
        raise AgreementError(
            f"rank {rank} (call {call} of a runner whose configuration digest is {own_d:#x}) met a call of a runner "
            f"with another configuration on another rank (digests {min(lo_d, hi_d):#x} to {max(lo_d, hi_d):#x} "
            f"over the {size} ranks): the ranks called different runners over one group, so their calls are not "
            "paired; " + RESYNC,
            digests=(own_d, min(lo_d, hi_d), max(lo_d, hi_d)),
        )
    if call == last:
        other = f"another rank is at call {first}"
    elif call == first:
        other = f"another rank is at call {last}"
    else:
        other = f"other ranks are at calls {first} and {last}"
    raise AgreementError(
        f"rank {rank} is at call {call} but {other} (lowest {first}, highest {last} over the {size} ranks): a rank "
        "skipped or added a call (one of its calls raised or was interrupted before it reached the agreement, or "
        "the ranks crossed calls of different runners on one group), so the ranks' calls are not paired; " + RESYNC,
        calls=(call, first, last),
    )


def all_max_vector(group: Group, values: list[int], phase: str, key: Hashable) -> list[int]:
    """``group.all_max_vector(values)``; for a group without it, one ``all_max`` per element
    (correct, but one collective per element: add ``all_max_vector`` to such a group)."""
    fn = getattr(group, "all_max_vector", None)
    if fn is not None:
        return list(fn(values, phase=phase, key=key))
    return [group.all_max(v, phase=phase, key=key) for v in values]
