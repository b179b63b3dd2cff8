"""The capture fingerprint: ranks check they configured and captured the same thing.

Ranks that disagree on their configuration capture different graphs and
then replay mismatched keys, silently (the same number of buckets with
different values) or with barriers paired with the wrong calls (a different
number of buckets). :func:`check` compares a dict of named fields across the
ranks of a group with one collective (an element-wise max over a hash of
every field and its negation, so both the max and the min arrive) and, only
when some field differs, one more that gathers every rank's text of the
differing fields, so that every rank raises the same
:class:`~graphrunner.errors.RanksDisagreeError` naming the field, the ranks and
their values. The runner checks its configuration at the start of
:meth:`~graphrunner.GraphRunner.capture` and what it captured after each
key (the capture hook :class:`FingerprintCheck`); nothing is checked per
replay.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any

from graphrunner._pytree import describe
from graphrunner.errors import RanksDisagreeError
from graphrunner.keys import all_max_vector
from graphrunner.recording.hooks import Capture, CaptureHook

__all__ = ["check", "canonical", "FingerprintCheck"]

_MASK = (1 << 62) - 1
_CHUNK = 7  # bytes packed into one int64 (non-negative)
_MAX_TEXT = 4000  # bytes of a field's text gathered for the message


def canonical(value: Any) -> str:
    """A stable text of ``value`` (JSON with sorted keys; ``repr`` for anything JSON cannot hold)."""
    return json.dumps(value, sort_keys=True, default=repr, separators=(",", ":"), ensure_ascii=False)


def stable_hash(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") & _MASK


def check(group: Any, fields: Mapping[str, Any], what: str, key: Any = None) -> None:
    """Raise :class:`RanksDisagreeError` (a ``CaptureError``) on every rank if any of ``fields`` differs between the ranks.

    Every rank must call it with the same field names in the same order
    (the values may differ: that is what it finds). ``what`` names the check
    in the message (``"configuration"``, ``"capture of key 8"``). With a
    one-rank group it returns at once. Cost: one collective, plus one more
    when a field differs.
    """
    size = int(getattr(group, "size", 1))
    if size <= 1:
        return
    names = list(fields)
    texts = [canonical(fields[n]) for n in names]
    hashes = [stable_hash(t) for t in texts]
    out = all_max_vector(group, hashes + [-h for h in hashes], "fingerprint", key)
    hi, lo = out[: len(names)], [-v for v in out[len(names) :]]
    bad = [i for i in range(len(names)) if hi[i] != lo[i]]
    if not bad:
        return
    values = _gather_texts(group, [texts[i] for i in bad], key)
    rank = int(getattr(group, "rank", 0))
    parts = []
    for j, i in enumerate(bad):
        by_value: dict[str, list[int]] = {}
        for r in range(size):
            by_value.setdefault(values[r][j], []).append(r)
        groups = "; ".join(
            f"rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))}: {v}" for v, rs in by_value.items()
        )
        parts.append(f"{names[i]!r} differs ({groups})")
    raise RanksDisagreeError(
        f"rank {rank} of {size}: the ranks' {what} differ: " + "; and ".join(parts) + ". Every rank must build "
        "the runner with the same buckets, keys, inputs, outputs, backend and warmups (and its step must capture "
        "the same graph), or ranks replay mismatched graphs; nothing was replayed"
    )


def _gather_texts(group: Any, texts: list[str], key: Any) -> list[list[str]]:
    """Every rank's ``texts`` (the same number on every rank), through one element-wise max
    in which each rank fills only its own slot."""
    size, rank = int(group.size), int(group.rank)
    enc = [t.encode()[:_MAX_TEXT] for t in texts]
    width = (_MAX_TEXT + _CHUNK - 1) // _CHUNK + 1  # ints per text: length, then the packed bytes
    slot = width * len(texts)
    vec = [0] * (slot * size)
    for j, b in enumerate(enc):
        base = rank * slot + j * width
        vec[base] = len(b)
        for c in range(0, len(b), _CHUNK):
            vec[base + 1 + c // _CHUNK] = int.from_bytes(b[c : c + _CHUNK], "little")
    out = all_max_vector(group, vec, "fingerprint_values", key)
    result = []
    for r in range(size):
        mine = []
        for j in range(len(texts)):
            base = r * slot + j * width
            n = out[base]
            raw = b"".join(out[base + 1 + c].to_bytes(_CHUNK, "little") for c in range((n + _CHUNK - 1) // _CHUNK))
            mine.append(raw[:n].decode(errors="replace"))
        result.append(mine)
    return result


class FingerprintCheck(CaptureHook):
    """After each key's capture, :func:`check` that every rank captured the same thing: the
    output structure and shapes, the number of segments and breaks, and the tape's op count.
    On a group of tensor-parallel ranks (``group.tensor_parallel``, :class:`~graphrunner.group.TorchDistGroup`)
    the tape's count of collectives instead of its op count: the ranks' shards may differ in size (a vocabulary
    that does not divide by the ranks records an op more on one of them), but the collectives must pair.
    One collective per key (plus one when something differs); nothing with one rank."""

    name = "fingerprint"

    def after_capture(self, cap: Capture) -> None:
        group = cap.group
        if int(getattr(group, "size", 1)) <= 1:
            return

        info = cap.backend.info(cap.key)
        spec, views = cap.outputs
        fields = {
            "output": describe(spec, views),
            "num_segments": info.get("num_segments"),
            "num_breaks": info.get("num_breaks"),
        }
        if getattr(group, "tensor_parallel", False):  # shards: their op counts may differ, their collectives not
            fields["tape_collectives"] = info.get("num_collectives")
        else:
            fields["tape_ops"] = info.get("num_ops")
        check(group, fields, f"captures of key {cap.key!r}", key=cap.key)
