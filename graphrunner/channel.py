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

**A rank that fails alone** (its capture or its step raised on this rank only,
while its peers may be inside the step's own collectives, which graphrunner
does not frame) must send nothing more on the process group: its next frame
would meet a peer's tensor of another size (gloo aborts that process) or of the
same size (a wrong pairing). :func:`fail_ranks` is the one way out: the rank
writes what happened to the rendezvous store (out of band) and waits up to
:data:`FAIL_WINDOW` seconds for its peers' reports of the same failure (every
rank failing alike, e.g. a deterministic error, leaves the group in step:
nothing is aborted and each rank raises its own error). Failing alone, it sets
the group's verdict (``compare_set``: the first report wins), aborts the process group (``ProcessGroup.abort()``:
gloo closes its connections, NCCL aborts its communicator, as engines call
``ncclCommAbort``), and raises :class:`~graphrunner.errors.RankFailedError`.
A peer's pending collective (a frame, or the step's own ``all_reduce``) then
fails at once; the peer finds the report (:meth:`Channel.peer_failure`),
aborts its own process group too and raises the same error. From then on
every collective of the channel raises it again without sending anything:
the runner stops on every rank. Errors that every rank raises together (an
:class:`~graphrunner.errors.AgreementError` of out-of-step ranks, the
fingerprint's ``RanksDisagreeError``, an agreed ``PaddingLeakError``) leave the
group in step and are not failures of one rank.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
import weakref
from collections.abc import Callable, Hashable
from typing import Any

from graphrunner.errors import AgreementError, PaddingLeakError, RankFailedError, RanksDisagreeError, RankTimeoutError

__all__ = ["Channel", "channel_for", "fail_ranks", "FRAME", "PAYLOAD", "PHASES"]

logger = logging.getLogger("graphrunner")

#: The store keys of a group's failure reports (the process group's store is prefixed per group).
FAILURE_KEY = "graphrunner/failure"
#: Seconds a rank whose capture or step failed waits for its peers' reports of the same failure.
FAIL_WINDOW = 2.0

#: int64 values per frame: a 4-value header and :data:`PAYLOAD` values.
FRAME = 16
HEADER = 4
#: Payload values per frame; a longer payload is sent in ``ceil(n / PAYLOAD)`` frames.
PAYLOAD = FRAME - HEADER

#: The collectives' kinds (2 bits of the tag).
KINDS = ("barrier", "all_max", "all_min", "all_max_vector")
#: The phases graphrunner names, with fixed ids (a phase not listed gets an id from its hash).
PHASES = (
    "",
    "warmup",
    "pre_capture",
    "runner_agree",
    "runner_replayable",
    "fingerprint",
    "fingerprint_values",
    "leak_check",
    "shadow_verify",
    "dp_step",
    "capture",
    "config",
    "capture_break",
    "background_key",
)
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

    def __init__(self, rank: int, size: int, process_group: Any = None, store: Any = None) -> None:
        self.rank, self.size = int(rank), int(size)
        #: How many collectives this rank made on the channel (the next one's sequence number).
        self.seq = 0
        self._lock = threading.Lock()
        self._names: dict[int, str] = {phase_id(p): p for p in PHASES}
        #: The process group aborted when a rank fails (``None``: nothing to abort), and the
        #: rendezvous store the failure is reported through (``None``: this process only).
        self._pg = _weak(process_group)  # never keeps the process group alive past destroy_process_group()
        self.store = store
        #: Set once a rank of the group failed alone (this one or a peer): every collective then
        #: raises it again, sending nothing.
        self.failure: RankFailedError | None = None
        #: Failures every rank raised alike so far (the store keys of the next one carry it).
        self.generation = 0
        #: Seconds a failed rank waits for its peers' reports of the same failure (:meth:`fail`).
        self.window = FAIL_WINDOW
        self._fail_lock = threading.Lock()  # not _lock: a thread may be inside a collective holding it

    def exchange(
        self,
        send: Callable[[list[int]], list[int]],
        kind: str,
        values: list[int],
        phase: str = "",
        key: Hashable | None = None,
    ) -> list[int]:
        """The element-wise max of ``values`` over the ranks, as one collective of ``kind`` (one of
        :data:`KINDS`) in ``phase`` (``key`` names it in errors). Raises
        :class:`~graphrunner.errors.AgreementError` on every rank when the ranks' collectives differ."""
        phase = str(phase or "")
        pid = phase_id(phase)
        self._names.setdefault(pid, phase)
        code = (pid << 2) | KINDS.index(kind)
        n = len(values)
        out: list[int] = []
        with self._lock:
            if self.failure is not None:  # a rank failed alone: nothing more is sent on this group
                raise self.again()
            seq = self.seq
            self.seq += 1
            for start in range(0, max(n, 1), PAYLOAD):
                chunk = list(values[start : start + PAYLOAD])
                tag = ((seq % _SEQ_LIMIT) << _CODE_BITS) | code
                try:
                    got = send([tag, -tag, n, -n] + chunk + [0] * (PAYLOAD - len(chunk)))
                except BaseException as exc:  # a peer that failed alone aborted the group: say which and why
                    peer = self.peer_failure()
                    if peer is not None:
                        raise self.again() from exc
                    raise
                if len(got) != FRAME:
                    raise AgreementError(
                        f"rank {self.rank}: the group's reduction returned {len(got)} values for a "
                        f"frame of {FRAME}; it must return one per element"
                    )
                hi, lo, n_hi, n_lo = int(got[0]), -int(got[1]), int(got[2]), -int(got[3])
                if hi != lo or n_hi != n_lo:
                    self.seq = max(self.seq, (hi >> _CODE_BITS) + 1)  # past every rank's: later collectives pair
                    raise self._mismatch(seq, code, n, key, (lo, n_lo), (hi, n_hi))
                out.extend(int(v) for v in got[HEADER : HEADER + len(chunk)])
        return out

    # ------------------------------------------------------------- a rank that fails alone
    @property
    def process_group(self) -> Any:
        """The process group a failure aborts (``None``: none, or no longer alive)."""
        return self._pg()

    def fail(self, cause: BaseException, where: str, alone: bool = False) -> RankFailedError | None:
        """This rank's capture or step raised ``cause`` (``where``: e.g. ``"in its background capture"``)
        while its peers may be inside the step's own collectives. Sends nothing on the group.

        The rank reports it to the store and waits up to :attr:`window` seconds for every peer's
        report of the same failure (a deterministic error fails every rank at the same point: then
        no rank is inside a collective, the group is still in step, and this returns ``None``: each
        rank raises its own error and the runner goes on). Otherwise (``alone``: without waiting) it
        failed alone: the first such report is the group's :class:`RankFailedError` (``compare_set``,
        so every rank names the same failure), the process group is aborted (a peer's pending
        collective ends at once) and the error returned. Safe from any thread, also while another
        thread is inside a collective (that collective then fails)."""
        with self._fail_lock:
            if self.failure is not None:
                return self.failure
            text = f"{type(cause).__name__}: {str(cause).strip()}"[:2000]
            report = f"{self.rank}\n{where}\n{text}"
            store, gen = self.store, self.generation
            if store is None:  # no rendezvous store: nothing to tell the peers through (a group you wrote)
                return None
            decision = f"{FAILURE_KEY}/{gen}"
            try:
                if not alone:
                    store.set(f"{FAILURE_KEY}/{gen}/rank{self.rank}", report)
                    others = [f"{FAILURE_KEY}/{gen}/rank{r}" for r in range(self.size) if r != self.rank]
                    deadline = time.monotonic() + self.window
                    together = False
                    while not store.check([decision]):
                        if store.check(others):
                            together = True
                            break
                        if time.monotonic() > deadline:
                            break
                        time.sleep(0.005)
                    if together:
                        report = "together"
                verdict = _text(
                    store.compare_set(decision, "", "failed\n" + report if report != "together" else report)
                )
            except Exception as exc:  # noqa: BLE001 - the abort below still ends the peers' collectives
                logger.error(
                    "GraphRunner: rank %d could not report its failure to the store (%s: %s); "
                    "its peers will raise RankTimeoutError",
                    self.rank,
                    type(exc).__name__,
                    exc,
                )
                verdict = "failed\n" + report
            if verdict == "together":  # every rank failed here alike: in step, nothing aborted
                self.generation += 1
                return None
            self.failure = self._error(verdict.split("\n", 1)[1])
        logger.error("%s", self.failure)
        self._abort()
        return self.failure

    def peer_failure(self) -> RankFailedError | None:
        """The failure a rank of the group reported as failed alone (:meth:`fail`), or ``None``: read
        from the store without waiting. Once found, this rank aborts its process group too (any
        collective still pending on it ends) and every later collective raises it."""
        if self.failure is not None:
            return self.failure
        if self.store is None:
            return None
        key = f"{FAILURE_KEY}/{self.generation}"
        try:
            if not self.store.check([key]):
                return None
            verdict = _text(self.store.get(key))
        except Exception:  # noqa: BLE001 - no store to read: no report
            return None
        if not verdict.startswith("failed\n"):
            return None
        with self._fail_lock:
            if self.failure is None:
                self.failure = self._error(verdict.split("\n", 1)[1])
        self._abort()
        return self.failure

    def again(self) -> RankFailedError:
        """A fresh copy of :attr:`failure` (raised by every later collective)."""
        f = self.failure
        assert f is not None
        return RankFailedError(str(f), f.failed_rank, f.cause_text)

    def _error(self, report: str) -> RankFailedError:
        rank, where, text = (report.split("\n", 2) + ["", ""])[:3]
        return RankFailedError(
            f"rank {rank} of {self.size} failed alone {where}: {text}. It reported this out of band (the "
            "rendezvous store), sent nothing more on the process group and aborted it; every rank aborted the "
            "process group and raised this error, instead of a collective hanging, pairing wrongly or gloo "
            "aborting the process. The process group cannot be used any more, so the runner stops on every "
            "rank: every later call raises this error. To go on, fix the cause on that rank, then on every "
            "rank destroy the process group (torch.distributed.destroy_process_group()), initialise a new one, "
            "build and capture a new GraphRunner; or let the processes exit",
            int(rank) if rank.lstrip("-").isdigit() else -1,
            text,
        )

    def _abort(self) -> None:
        """Abort the process group (its pending collectives fail at once, on every rank)."""
        pg = self.process_group
        if pg is None:  # none, or already destroyed
            return
        try:
            abort = getattr(pg, "abort", None)
            if abort is not None:  # ProcessGroup.abort(): gloo and NCCL (ncclCommAbort)
                abort()
            else:
                # a private c10d helper, absent from some PyTorch versions: looked up only on this path
                from torch.distributed.distributed_c10d import _abort_process_group

                _abort_process_group(pg)
        except Exception as exc:  # noqa: BLE001 - a failed abort leaves the peers to their timeout
            logger.error(
                "GraphRunner: rank %d could not abort its process group (%s: %s); its peers' pending "
                "collectives end at their timeout",
                self.rank,
                type(exc).__name__,
                exc,
            )

    def _describe(self, tag: int, n: int) -> tuple[int, str]:
        seq, code = tag >> _CODE_BITS, tag & ((1 << _CODE_BITS) - 1)
        pid, kind = code >> 2, KINDS[code & 3]
        name = self._names.get(pid)
        where = f"phase {name!r}" if name is not None else f"an unknown phase (id {pid})"
        size = f" of {n} values" if kind == "all_max_vector" else ""
        return seq, f"collective #{seq} ({kind}{size} in {where})"

    def _mismatch(
        self, seq: int, code: int, n: int, key: Any, lo: tuple[int, int], hi: tuple[int, int]
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
            collectives=(seq, lo_seq, hi_seq),
        )


_CHANNELS: weakref.WeakKeyDictionary[Any, Channel] = weakref.WeakKeyDictionary()
_CHANNELS_LOCK = threading.Lock()


def channel_for(process_group: Any, rank: int, size: int, store: Any = None) -> Channel:
    """The one :class:`Channel` of ``process_group`` (a ``torch.distributed`` process group
    object): every group object over it shares the same sequence numbers and the same failure
    (``store``: the group's rendezvous store, where a rank that fails alone reports it)."""
    with _CHANNELS_LOCK:
        try:
            ch = _CHANNELS.get(process_group)
        except TypeError:  # not weak-referenceable: a channel of its own
            return Channel(rank, size, process_group, store)
        if ch is None:
            ch = _CHANNELS[process_group] = Channel(rank, size, process_group, store)
        return ch


def _weak(obj: Any) -> Callable[[], Any]:
    """``obj`` behind a weak reference where it takes one (a strong one otherwise; ``None``: none)."""
    if obj is None:
        return lambda: None
    try:
        return weakref.ref(obj)
    except TypeError:
        return lambda: obj


def _text(value: Any) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, (bytes, bytearray)) else str(value)


def _chain_has(exc: BaseException, cls: type) -> bool:
    e: BaseException | None = exc
    for _ in range(8):
        if e is None:
            return False
        if isinstance(e, cls):
            return True
        e = e.__cause__ or e.__context__
    return False


def _together(exc: BaseException) -> bool:
    """``exc`` (or what it wraps) is an error every rank raised together, in step: the channel's or the
    agreement's :class:`AgreementError`, the fingerprint's ``RanksDisagreeError``, an agreed padding leak."""
    seen = 0
    e: BaseException | None = exc
    while e is not None and seen < 8:
        if isinstance(e, (RanksDisagreeError, PaddingLeakError)) or (isinstance(e, AgreementError) and e.unpaired):
            return True
        e, seen = e.__cause__, seen + 1
    return False


def fail_ranks(group: Any, exc: BaseException, where: str, alone: bool = False) -> BaseException:
    """What a rank of ``group`` raises for ``exc``, raised by its capture or its step ``where`` (e.g.
    ``"in its background capture"``), when peers may be inside the step's own collectives.

    ``exc`` itself on one rank, for a group without a channel (a group you wrote) and for an error
    every rank raised together (:func:`_together`), and for a collective of this rank that failed
    with no report (a ``RankTimeoutError``: a peer died or is stuck; unchanged, as before).
    Otherwise the group's :class:`RankFailedError`: a peer's, when a peer reported its failure first
    (``exc`` is then what that did here: a collective that failed); ``exc`` again when every rank
    failed alike (:meth:`Channel.fail` waits for their reports); else this rank's own, reported and
    the process group aborted now (``alone``: without waiting for the peers' reports)."""
    ch = getattr(group, "channel", None)
    if not isinstance(ch, Channel) or ch.size <= 1:
        return exc
    if isinstance(exc, RankFailedError):
        return exc
    if ch.failure is not None:
        return ch.again()
    if _together(exc):
        return exc
    peer = ch.peer_failure()
    if peer is not None:
        return ch.again()
    if _chain_has(exc, RankTimeoutError):  # this rank's collective failed, no report: a peer died or is stuck
        return exc
    if ch.fail(exc, where, alone) is None:  # every rank failed here alike: in step, its own error
        return exc
    return ch.again()
