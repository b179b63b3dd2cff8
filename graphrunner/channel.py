"""The one collective channel: every collective graphrunner makes across ranks, as fixed-size frames.

Gloo pairs the ranks' collectives by order only. When two ranks are at
different points (one re-captures while its peer serves, one waits for a
background capture while its peer calls), a barrier of one rank meets a
vector of another; tensors of different sizes make gloo abort the process
(SIGABRT), tensors of equal size pair silently and give wrong answers.

:class:`Channel` makes that impossible for the collectives it carries. Every
collective (a barrier, a max, a min, an element-wise max of a vector) is sent
as one or more *frames* of exactly :data:`FRAME` int64 values, reduced with
one element-wise max::

    [tag, -tag, length, -length, payload[0], ..., payload[PAYLOAD - 1]]

where ``tag`` packs this rank's sequence number (the count of collectives it
made on the channel) and the collective's kind and phase, and ``length`` is
the payload's total length (a longer payload is sent in several frames).
Any two ranks' frames pair by size; the max of ``tag`` and of ``-tag`` give
every rank the highest and the lowest tag of the ranks in that one
reduction, so when the ranks' collectives are not the same (another phase,
another kind, another sequence number, another length) every rank sees it in
the same frame and raises :class:`~graphrunner.errors.AgreementError` naming
this rank's collective and the lowest and highest over the ranks: never an
abort, never a wrong pairing. After such an error every rank's sequence
number is set past the highest, so collectives that the ranks make alike
afterwards pair again.

A channel is shared by every :class:`~graphrunner.group.TorchDistGroup` over
one process group (:func:`channel_for`). The reduction itself (with its
deadline) is the group's: the channel only frames, counts and checks.
"""

from __future__ import annotations

import hashlib
import threading
import weakref
from typing import Any, Callable, Dict, Hashable, List, Optional, Tuple

from graphrunner.errors import AgreementError

__all__ = ["Channel", "channel_for", "FRAME", "PAYLOAD", "PHASES"]

#: int64 values per frame: a 4-value header and :data:`PAYLOAD` values.
FRAME = 16
HEADER = 4
#: Payload values per frame; a longer payload is sent in ``ceil(n / PAYLOAD)`` frames.
PAYLOAD = FRAME - HEADER

#: The collectives' kinds (2 bits of the tag).
KINDS = ("barrier", "all_max", "all_min", "all_max_vector")
#: The phases graphrunner names, with fixed ids (a phase not listed gets an id from its hash).
PHASES = ("", "warmup", "pre_capture", "runner_agree", "runner_replayable", "fingerprint", "fingerprint_values",
          "leak_check", "shadow_verify", "dp_step", "capture", "config", "capture_break")
_PHASE_BITS = 12  # phase id; then 2 bits of kind; the rest of the tag is the sequence number
_CODE_BITS = _PHASE_BITS + 2
_SEQ_LIMIT = 1 << (62 - _CODE_BITS)


def phase_id(phase: str) -> int:
    """The id of ``phase`` in a tag: its index in :data:`PHASES`, else a hash above them."""
    try:
        return PHASES.index(phase)
    except ValueError:
        h = int.from_bytes(hashlib.blake2b(phase.encode(), digest_size=4).digest(), "little")
        return 64 + h % ((1 << _PHASE_BITS) - 64)


class Channel:
    """The framed collectives of one group of ranks (``rank`` of ``size``).

    :meth:`exchange` is the one entry: ``send(frame) -> frame`` is the group's element-wise max
    of one frame over the ranks (with its deadline). Thread-safe: one collective at a time,
    the frames of a long payload never interleaved with another thread's."""

    def __init__(self, rank: int, size: int) -> None:
        self.rank, self.size = int(rank), int(size)
        #: How many collectives this rank made on the channel (the next one's sequence number).
        self.seq = 0
        self._lock = threading.Lock()
        self._names: Dict[int, str] = {phase_id(p): p for p in PHASES}

    def exchange(self, send: Callable[[List[int]], List[int]], kind: str, values: List[int], phase: str = "",
                 key: Optional[Hashable] = None) -> List[int]:
        """The element-wise max of ``values`` over the ranks, as one collective of ``kind`` (one of
        :data:`KINDS`) in ``phase`` (``key`` names it in errors). Raises
        :class:`~graphrunner.errors.AgreementError` on every rank when the ranks' collectives differ."""
        phase = str(phase or "")
        pid = phase_id(phase)
        self._names.setdefault(pid, phase)
        code = (pid << 2) | KINDS.index(kind)
        n = len(values)
        out: List[int] = []
        with self._lock:
            seq = self.seq
            self.seq += 1
            for start in range(0, max(n, 1), PAYLOAD):
                chunk = list(values[start:start + PAYLOAD])
                tag = ((seq % _SEQ_LIMIT) << _CODE_BITS) | code
                got = send([tag, -tag, n, -n] + chunk + [0] * (PAYLOAD - len(chunk)))
                if len(got) != FRAME:
                    raise AgreementError(f"rank {self.rank}: the group's reduction returned {len(got)} values for a "
                                         f"frame of {FRAME}; it must return one per element")
                hi, lo, n_hi, n_lo = int(got[0]), -int(got[1]), int(got[2]), -int(got[3])
                if hi != lo or n_hi != n_lo:
                    self.seq = max(self.seq, (hi >> _CODE_BITS) + 1)  # past every rank's: later collectives pair
                    raise self._mismatch(seq, code, n, key, (lo, n_lo), (hi, n_hi))
                out.extend(int(v) for v in got[HEADER:HEADER + len(chunk)])
        return out

    def _describe(self, tag: int, n: int) -> Tuple[int, str]:
        seq, code = tag >> _CODE_BITS, tag & ((1 << _CODE_BITS) - 1)
        pid, kind = code >> 2, KINDS[code & 3]
        name = self._names.get(pid)
        where = f"phase {name!r}" if name is not None else f"an unknown phase (id {pid})"
        size = f" of {n} values" if kind == "all_max_vector" else ""
        return seq, f"collective #{seq} ({kind}{size} in {where})"

    def _mismatch(self, seq: int, code: int, n: int, key: Any, lo: Tuple[int, int], hi: Tuple[int, int]
                  ) -> AgreementError:
        own = self._describe((seq << _CODE_BITS) | code, n)[1]
        lo_seq, low = self._describe(*lo)
        hi_seq, high = self._describe(*hi)
        for_key = f" for key {key!r}" if key is not None else ""
        return AgreementError(
            f"rank {self.rank} of {self.size}: its {own}{for_key} met a different collective on another rank "
            f"(over the {self.size} ranks: lowest {low}, highest {high}): the ranks are out of step (one rank "
            "captures while another serves or waits, calls wait_captured() or capture() alone, or skipped or "
            "repeated a step). Nothing ran on any rank for this collective, and every rank raised this error. "
            "Every rank must make the same calls in the same order: capture(), wait_captured(), cleanup() "
            "and every call of the runner on every rank alike",
            collectives=(seq, lo_seq, hi_seq))


_CHANNELS: "weakref.WeakKeyDictionary[Any, Channel]" = weakref.WeakKeyDictionary()
_CHANNELS_LOCK = threading.Lock()


def channel_for(process_group: Any, rank: int, size: int) -> Channel:
    """The one :class:`Channel` of ``process_group`` (a ``torch.distributed`` process group
    object): every group object over it shares the same sequence numbers."""
    with _CHANNELS_LOCK:
        try:
            ch = _CHANNELS.get(process_group)
        except TypeError:  # not weak-referenceable: a channel of its own
            return Channel(rank, size)
        if ch is None:
            ch = _CHANNELS[process_group] = Channel(rank, size)
        return ch
