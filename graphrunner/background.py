"""Serving while graphs are captured: ``GraphRunner.capture(background=True)``.

A background thread captures the runner's keys one at a time, each through
the one capture protocol (``GraphBackend.capture_one``, its trace and checks
as in a blocking capture), while the runner serves every call: eagerly, on
the inputs padded to the key the graph will replay (so a key's results do
not change when it switches to its graph), or by replay once the key is
captured on every rank.

One lock (:attr:`BackgroundCapture.mutex`) is held by a key's whole capture
and by every call, so the step never runs on two threads at once and the
static buffers hold one batch at a time: a call waits at most for the key
being captured, and a waiting call goes before the next key.

Order: the largest key first (it allocates the output buffer every key
shares), then the keys calls have landed on most, then the rest by size.

Several ranks: a key's capture runs the step (warmups, collectives inside
it) and barriers, so every rank must capture it between the same two calls.
Each call's one agreement collective carries every rank's captured-key count
and failure flag (:meth:`vector`); when every rank has captured the same
keys, the call grants the next key to the background thread, which captures
it right after the call returns; the next call waits until it is captured
(:meth:`BackgroundCapture.before_call`). The keys the
agreed (smallest) count covers replay from that call on, on every rank
alike, so every rank switches a key from eager to graph at the same call.
Without calls nothing is granted: :meth:`wait` (every rank must call it)
captures the remaining keys, or an idle server calls the runner with no rows
on every rank at the same point (a call whose every input is empty: it only
agrees, and the key it grants is captured at full speed, since an idle call
does not count as busy for the pace).

A failed capture stops the background capture. When every rank raised it
together (the channel found the ranks out of step: an ``AgreementError``), the
next call raises the :class:`~graphrunner.errors.CaptureError` (on every rank,
at the same call: the flag is agreed), without serving that call, and later
calls are served as before (eagerly for the keys not captured). When it failed
on one rank alone (the step raised there, e.g. out of memory, while its peers
may be inside the step's own collectives), that rank sends nothing more on the
group: it reports the failure out of band and aborts the process group
(:func:`graphrunner.channel.fail_ranks`), the peers' capture of the same key
fails at once, and every rank raises the same
:class:`~graphrunner.errors.RankFailedError` (a ``CaptureError``) at the next
call, the one after the grant: the runner stops on every rank.

The thread never outlives its runner inside a collective: ``cleanup()`` stops
it after the key it is capturing (every collective of the key has the group's
deadline); garbage collection of the runner and interpreter exit stop it too
(:meth:`BackgroundCapture.end`) and, when it is still inside a collective after
a grace period (its peers are not in it), fail the group the same way, so the
collective ends and the process exits normally.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch

from graphrunner.agreement import RankAgreement
from graphrunner.budget import one_time_imports
from graphrunner.capturing import Capturer, CaptureRun, wait_seconds
from graphrunner.channel import fail_ranks
from graphrunner.devices import TapeDevice
from graphrunner.errors import AgreementError, CaptureError
from graphrunner.layout import user_error
from graphrunner.pacing import Pace, check_share
from graphrunner.recording.hooks import Capture, CaptureHook
from graphrunner.recording.ops import OpConsumer, OpEvent, OpRecorder, WriteGuard
from graphrunner.serving import Server
from graphrunner.tape.rng import shared_generators

if TYPE_CHECKING:
    from graphrunner.backends.base import GraphBackend
    from graphrunner.report import CaptureReport
    from graphrunner.staging import StaticInputs

__all__ = [
    "BackgroundCapture",
    "PutBack",
    "start_background",
    "settle_background",
    "wait_background",
    "hold_background",
    "capture_in_background",
    "wait_captured",
]

logger = logging.getLogger("graphrunner")

Sizes = tuple[int, ...]

#: Seconds garbage collection or interpreter exit waits for the key being captured before failing the group.
END_GRACE = 5.0

_STOP = object()  # grant: stop capturing
_ALL = object()  # grant: capture every remaining key


class BackgroundCapture:
    """The background capture of one runner.

    ``keys``: the runner's keys, largest first (``KeySpace.capture_order()``);
    ``capture_key(key)``: captures one key (called on the background thread,
    under :attr:`mutex`); ``session``: a context manager factory entered on the
    background thread around every capture (``torch.inference_mode`` and the
    backend's capture session); ``finish()``: builds the report after the last
    key; ``shared``: several ranks agree every call (grants, see the module
    docstring).
    """

    def __init__(
        self,
        keys: list[Sizes],
        capture_key: Callable[[Sizes], None],
        session: Callable[[], Any],
        finish: Callable[[], Any],
        shared: bool,
        gate: threading.Event | None = None,
        fail: Callable[[BaseException, str, bool], BaseException] | None = None,
        deadline: float = 60.0,
        end_key: Callable[[Sizes, BaseException | None], BaseException | None] | None = None,
        pace: Pace | None = None,
    ) -> None:
        self.keys = list(keys)
        self._capture_key, self._session, self._finish = capture_key, session, finish
        #: ``fail(exc, where, alone) -> error``: what a failure on this rank becomes (several ranks:
        #: :func:`graphrunner.channel.fail_ranks`, which reports it and aborts the group unless every rank
        #: failed alike).
        self._fail: Callable[[BaseException, str, bool], BaseException] = fail or (lambda exc, where, alone: exc)
        self.shared = bool(shared)
        #: The group's collective deadline in seconds (how long a collective of the thread can take).
        self.deadline = float(deadline)
        #: Several ranks: ``end_key(key, exc)`` after each key (``exc``: its error on this rank, or None)
        #: agrees the key's outcome over the ranks (one collective) and returns the error this rank's key
        #: ends with (None: captured on every rank); it raises ``exc`` where it cannot agree (a peer may be
        #: inside the step's own collectives).
        self._end_key = end_key
        #: The rest between keys while calls come (:class:`graphrunner.pacing.Pace`; share 1: none).
        self.pace = pace or Pace()
        #: True once a key's failure was agreed by every rank: the ranks are in step, nothing to abort.
        self.agreed_failure = False
        #: Held by a key's capture and by every call of the runner.
        self.mutex = threading.RLock()  # re-entrant: a call inside hold(), or a step calling its runner (refused)
        #: Keys captured on this rank, in capture order.
        self.done: list[Sizes] = []
        #: How many of :attr:`done` replay: every rank had captured them at a call's agreement.
        self.agreed = 0
        #: The capture's error, once one failed (the background capture then stops).
        self.error: BaseException | None = None
        self._raised = False
        #: Calls per key (agreed keys, identical on every rank): the capture order after the first key.
        self.hits: dict[Sizes, int] = {}
        self.report: CaptureReport | None = None
        self._grants: queue.Queue[Any] = queue.Queue()
        self._stop = threading.Event()
        self._waiting, self._waiting_lock = 0, threading.Lock()  # calls waiting for the mutex
        self._settled = threading.Condition()  # a granted key captured (or failed): the next call may run
        self._gate = gate  # tests: the thread waits for it before its first key
        self._granted = 0
        self._finished = threading.Event()
        self._thread = threading.Thread(target=self._main, name="graphrunner-background-capture", daemon=True)

    # ------------------------------------------------------------------ thread
    def start(self) -> None:
        """Start the background thread (single rank: it captures every key on its own)."""
        self._thread.start()

    def _next_key(self) -> Sizes:
        left = [k for k in self.keys if k not in self.done]
        if not self.done:
            return left[0]  # the largest: it allocates the shared output buffer
        return max(left, key=lambda k: (self.hits.get(k, 0), -self.keys.index(k)))

    @contextlib.contextmanager
    def call(self, busy: bool = True) -> Iterator[None]:
        """Held by a call of the runner: waits for the key being captured (a call waiting has the
        next turn: the thread lets waiting calls run before it starts another key); the runner counts
        as busy meanwhile (:meth:`graphrunner.pacing.Pace.busy`) unless ``busy=False``: an idle call
        (no rows on this rank: an idle server's tick that only agrees) serves nothing the capture
        would slow, so the capture's rest does not apply to it."""
        with self.pace.busy() if busy else contextlib.nullcontext(), self._call():
            yield

    @contextlib.contextmanager
    def _call(self) -> Iterator[None]:
        with self._waiting_lock:
            self._waiting += 1
        try:
            self.mutex.acquire()
        finally:
            with self._waiting_lock:
                self._waiting -= 1
        try:
            yield
        finally:
            self.mutex.release()

    def _capture_next(self, key: Sizes | None = None) -> None:
        if not self.shared:  # several ranks rest before the grant instead (vector(), after_agreement())
            self.pace.rest(self._stop)
        while self._waiting and not self._stop.is_set():  # calls first: serving is never starved by capture
            time.sleep(0.0002)
        with self.mutex:
            key = self._next_key() if key is None else key
            began = time.perf_counter()
            try:
                self._capture_key(key)
            except Exception as exc:
                if self._end_key is None:
                    raise
                err = self._end_key(key, exc)  # raises exc where the ranks cannot agree on it
                self.agreed_failure = True
                raise (err or exc) from (None if err is exc or err is None else exc)
            if self._end_key is not None:
                err = self._end_key(key, None)  # a peer's capture of the key may have failed
                if err is not None:
                    self.agreed_failure = True
                    raise err
            self.done.append(key)
            self.pace.captured(time.perf_counter() - began)
        with self._settled:
            self._settled.notify_all()

    def before_call(self) -> None:
        """Several ranks: wait until the keys granted so far are captured (or the capture failed or
        stopped), so that every rank captures a granted key before its next call, not after it."""
        if not self.shared:
            return
        with self._settled:
            while (
                self._granted > len(self.done)
                and self.error is None
                and not self._stop.is_set()
                and self._thread.is_alive()
            ):
                self._settled.wait(0.05)

    def _main(self) -> None:
        try:
            one_time_imports()  # PyTorch's one-time import (~1.4 s), before taking the lock from any call
            if self._gate is not None:
                self._gate.wait()
            with self._session():
                everything = not self.shared  # one rank: no grants, capture on
                while len(self.done) < len(self.keys):
                    if self._stop.is_set():
                        return
                    if everything:
                        self._capture_next()
                        continue
                    grant = self._grants.get()
                    if grant is _STOP:
                        return
                    if grant is _ALL:
                        everything = True
                        continue
                    self._capture_next(grant)
                self.report = self._finish()
        except BaseException as exc:  # surfaced on the next call (every rank, see vector())
            # a key's failure every rank agreed on (end_key) leaves the ranks in step: the key stays eager on
            # every rank and serving goes on; else it is reported and the group aborted unless every rank
            # failed alike (fail_ranks)
            failed = exc if self.agreed_failure else self._fail(exc, "in its background capture", False)
            if failed is not exc:
                failed.__cause__ = exc
            logger.error("GraphRunner: background capture failed: %s", failed)
            self.error = failed
        finally:
            self._finished.set()
            with self._settled:
                self._settled.notify_all()

    # ------------------------------------------------------------------ calls
    @property
    def finished(self) -> bool:
        """True when the thread ended: every key captured, or a capture failed."""
        return self._finished.is_set()

    def vector(self) -> list[int]:
        """What this rank adds to a call's agreement: ``[-captured keys, failed, resting]`` (the max over
        the ranks gives the smallest count, whether any rank failed, and whether any rank still rests
        after its last key: no key is granted then, :class:`graphrunner.pacing.Pace`)."""
        return [-len(self.done), 1 if self.error is not None else 0, 1 if self.pace.resting() else 0]

    def after_agreement(
        self, extra: list[int] | None, call_key: Sizes | None
    ) -> tuple[list[Sizes], CaptureError | None]:
        """Called by a call under :attr:`mutex` after its agreement (``extra``: the agreed
        :meth:`vector`, None on one rank) with the key it runs (``None``: none). Returns the keys
        that start replaying at this call, and the error this call must raise (once, on every rank
        at the same call, when a rank's background capture failed; keys captured before the
        failure still replay)."""
        if call_key is not None:
            self.hits[call_key] = self.hits.get(call_key, 0) + 1
        if extra is None:
            agreed, failed, resting = len(self.done), self.error is not None, False
        else:
            agreed, failed, resting = -int(extra[0]), bool(extra[1]), bool(extra[2])
        new = self.done[self.agreed : agreed]
        self.agreed = max(self.agreed, agreed)
        if failed:
            if self._raised:
                return new, None
            self._raised = True
            self._stop.set()
            self._grants.put(_STOP)
            err = self.error or CaptureError(
                "GraphRunner: another rank's background capture failed (see its "
                "error); every rank stops capturing and serves eagerly"
            )
            return new, CaptureError(
                f"GraphRunner: background capture failed, this call was not served (retry it; "
                f"later calls are served, eagerly for the keys not captured): {err}"
            )
        if self.shared and not resting and len(self.done) == agreed == self._granted and agreed < len(self.keys):
            self._granted += 1
            self._grants.put(self._next_key())  # captured right after this call returns
        return new, None

    def settle(self, server: Server, rows: Sizes | None) -> None:
        """:func:`settle_background` for this capture, served by ``server`` (the server calls it
        through :class:`graphrunner.serving.BackgroundWork`, knowing no more of this class)."""
        settle_background(server, rows)

    def wait(self, timeout: float | None = None) -> bool:
        """Wait up to ``timeout`` seconds (None: for ever) for the thread; True when it finished.
        Several ranks: first grants every remaining key (every rank must call it, at the same
        point between calls, so that their captures pair)."""
        if self.shared and not self.finished and self._granted < len(self.keys):
            self._granted = len(self.keys)
            self._grants.put(_ALL)
        self._thread.join(timeout)
        return self.finished

    def stop(self, timeout: float | None = None) -> None:
        """Stop the thread after the key it is capturing and wait up to ``timeout`` s for it (cleanup)."""
        self._stop.set()
        self._grants.put(_STOP)
        if self._gate is not None:
            self._gate.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout)

    def end(self, why: str, grace: float | None = None) -> None:
        """The runner is gone (``why``: garbage collected, interpreter exit): stop the thread, waiting up
        to ``grace`` s for the key it is capturing; a thread still inside a collective then (its peers
        are not in it) fails the group (reported, the process group aborted), which ends that
        collective at once, so no thread is inside a collective when the process exits (``grace``:
        :data:`END_GRACE` by default)."""
        grace = END_GRACE if grace is None else float(grace)
        self.stop(grace)
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            logger.error(
                "GraphRunner: %s while its background capture was still inside a collective after %gs; "
                "failing the group so that the collective ends",
                why,
                grace,
            )
            self._fail(
                RuntimeError(f"{why} while its background capture was inside a collective"),
                "(its runner went away)",
                True,
            )
            # the group's own collectives end at once; one inside the step ends when its peer's side closes,
            # at the latest at the group's deadline
            self._thread.join(self.deadline + END_GRACE)
        # The runner's parts (server, capturer, this object and the thread's closures) refer to each other:
        # freed by the garbage collector, not when the runner goes. Free them now, while the process group
        # is alive, not at interpreter exit: released there (with the group's store and the graphs they
        # hold) they aborted about 1 process exit in 5 ("terminate called without an active exception")
        gc.collect()


def start_background(
    server: Server, run: CaptureRun, backend: GraphBackend, gate: threading.Event | None = None, share: float = 1.0
) -> None:
    """``runner.capture(background=True)``: ``server`` (:class:`graphrunner.serving.Server`) serves
    every call from now on while ``run`` (a :class:`~graphrunner.capturing.CaptureRun`, which
    already set the server's agreement up) captures the keys on a thread through ``backend``;
    ``gate``: tests hold the thread before its first key; ``share``: the capture's share of the time
    while calls come (:class:`graphrunner.pacing.Pace`)."""

    pace = Pace(share)  # before anything starts: a bad share starts nothing
    begun: list[bool] = []
    executes = isinstance(
        getattr(backend, "device", None), TapeDevice
    )  # a tape capture computes; a CUDA capture only records
    staging = server.inputs

    def capture_key(key: Sizes) -> None:
        if not begun:  # the capture's first collective, paired like a key's (under a grant)
            begun.append(True)
            run.begin()
        put = PutBack(staging, executes, collectives)
        try:
            run.key(key, extra_hooks=[put], around_hook=put.around)
        except BaseException as exc:
            err = user_error(exc)  # as a blocking capture raises it
            raise err from (None if err is exc else exc)

    @contextlib.contextmanager
    def session():
        mode = getattr(backend, "capture_error_mode", None)
        if mode is not None:  # CUDA: only this thread's work is checked during a capture
            backend.capture_error_mode = "thread_local"
        try:
            with shared_generators(), torch.inference_mode(), backend.capture_session():
                yield
        finally:
            if mode is not None:
                backend.capture_error_mode = mode
            run.close(True)

    group = server.group
    agreement = server.agreement
    collectives = StepCollectives()

    def end_key(key: Sizes, exc: BaseException | None) -> BaseException | None:
        if exc is not None and not collectives.none:
            raise exc  # the step may hold collectives of its own, a peer inside one: fail_ranks decides
        failed = agree_key_end(group, key, exc is not None)
        if failed == 0:
            return None
        met_peer = isinstance(exc, AgreementError) and exc.collectives is not None
        if exc is not None and not met_peer:
            return exc  # this rank's own error; every rank knows the key is not captured
        if failed - 1 == group.rank:  # its end met a peer's other collective: out of step, kept eager
            return CaptureError(
                f"rank {group.rank} of {group.size}: the ranks' collectives for {server.key_text(key)} were out of "
                "step at the end of its background capture; every rank keeps it eager"
            )
        return CaptureError(
            f"rank {failed - 1} of {group.size}: its background capture of {server.key_text(key)} failed (its "
            f"error is raised there); rank {group.rank} captured it but every rank agreed to keep it eager, so "
            "it and the keys not captured yet are served eagerly on every rank"
        )

    bg = BackgroundCapture(
        run.order,
        capture_key,
        session,
        run.finish,
        agreement.shared,
        gate,
        lambda exc, where, alone: fail_ranks(group, exc, where, alone),
        float(getattr(group, "timeout", 60.0) or 60.0),
        end_key if agreement.shared else None,
        pace,
    )
    if isinstance(agreement, RankAgreement):  # several ranks: the thread's counts ride on every call's collective
        agreement.extra = bg.vector
    server.serve_in_background(bg)
    bg.start()
    return None


#: Retries of a key's end agreement whose frame met a peer still inside the key's capture.
KEY_END_TRIES = 4


def agree_key_end(group: Any, key: Sizes, failed: bool) -> int:
    """A key's background capture ended on every rank: one collective (``all_max``, phase
    ``background_key``) whose result is 0 when the key was captured on every rank, else the highest
    failed rank + 1. A rank whose capture failed comes here at once; a peer may still be inside the
    key's framed collectives (a warmup barrier, the padding check's verdict): the frames differ, the
    channel raises :class:`~graphrunner.errors.AgreementError` on both (nothing aborted, sequence
    numbers set past the highest), the peer's key fails with it and comes here too, and this
    rank tries again."""
    for i in range(KEY_END_TRIES):
        try:
            return int(group.all_max(group.rank + 1 if failed else 0, phase="background_key", key=key))
        except AgreementError as exc:
            if exc.collectives is None or i == KEY_END_TRIES - 1:
                raise
            failed = True  # the peer's key failed with the same error: so does this rank's
    raise AssertionError("unreachable")


class StepCollectives(OpConsumer):
    """Whether the step makes collectives of its own, as this rank's background warmups saw it:
    :attr:`none` once a warmup ran to its end without one and none was ever seen. Only then can a
    key's failure on one rank be agreed on by a collective (a peer cannot be inside the step's
    own ``all_reduce``, where a frame would pair wrongly or abort the process)."""

    NAMESPACES = ("c10d", "_c10d_functional", "c10d_functional")

    def __init__(self) -> None:
        self.seen = False
        self.runs = 0

    def before(self, ev: OpEvent) -> None:
        if ev.func.namespace in self.NAMESPACES:
            self.seen = True

    @property
    def none(self) -> bool:
        """True: a whole warmup ran and the step never made a collective of its own."""
        return self.runs > 0 and not self.seen


class PutBack(CaptureHook):
    """A background capture's hook: the key's warmups and capture run on inputs the runner controls,
    and what they wrote is put back after the key.

    Inputs: at the key's ``begin`` the static buffers (``staging``, a
    :class:`~graphrunner.staging.StaticInputs`) are kept and set to every input's pad value, as a
    blocking capture finds them, never what the last call left there (a bad request's row, a
    ``state=True`` input the step advanced); after each warmup and before the capture the
    ``state=True`` inputs get their pad values back (the step's own writes to them are undone);
    at ``end`` (also after an error) the buffers get the kept bytes back and the stager its
    ``filled`` extent, so the next call finds them as the last call left them.

    Writes outside the step: what a key's warmups, its post-warmup hooks (:meth:`around`) and, on
    the tape, its capture (which computes) wrote is put back after the key
    (:class:`~graphrunner.recording.ops.WriteGuard`: each written storage copied before its first
    write). The capture runs the step on padding between calls: without this, a cache indexed by
    batch row would lose what its real requests wrote at the padding's positions. The padding
    check puts back its own runs' writes; writes made by eager breaks during a CUDA capture are
    not seen. Generators are not this hook's business: the thread draws from its own
    (:func:`graphrunner.tape.rng.shared_generators`)."""

    name = "put-back"

    def __init__(
        self, staging: StaticInputs, executes_capture: bool, collectives: StepCollectives | None = None
    ) -> None:

        self.staging = staging
        self.guard, self.executes = WriteGuard(list(staging.buffers.values())), bool(executes_capture)
        self._kept: dict[str, Any] | None = None
        self._filled: Any = None
        self.collectives = collectives

    def begin(self, cap: Capture) -> None:
        """Keep the static buffers and set every input to its pad value (the key's own inputs)."""

        staging = self.staging
        with torch.inference_mode():
            self._kept = {n: b.clone() for n, b in staging.buffers.items()}
            self._filled = staging.filled
            for n, b in staging.buffers.items():  # the key's warmups read the pad values, as in a blocking capture
                b.fill_(staging.specs[n].pad)
        staging.filled = staging.zero

    def _state_to_pad(self) -> None:

        staging = self.staging
        with torch.inference_mode():
            for n, b in staging.buffers.items():
                if staging.specs[n].state:
                    b.fill_(staging.specs[n].pad)

    def after_warmup(self, cap: Capture, i: int, out: Any) -> None:
        """``state=True`` inputs back to their pad value after warmup ``i``."""
        self._state_to_pad()  # the next warmup starts where the first did
        if self.collectives is not None:
            self.collectives.runs += 1

    def after_warmups(self, cap: Capture) -> None:
        """``state=True`` inputs back to their pad value before the capture."""
        self._state_to_pad()  # the capture too (after the checks' runs, which put back their own data)

    def warmup_consumers(self, cap: Capture, i: int) -> Sequence[OpConsumer]:
        """The write guard watches every warmup (and the step's own collectives are looked for)."""
        return [self.guard] if self.collectives is None else [self.guard, self.collectives]

    def capture_consumers(self, cap: Capture) -> Sequence[OpConsumer]:
        """The write guard watches a tape capture (it computes); a CUDA capture only records."""
        return [self.guard] if self.executes else []

    def around(self, hook: Callable[[], Any]) -> Callable[[], Any]:
        """``hook`` (the post-warmup hook) with what it writes logged too: a cache reset in the hook
        must not wipe the rows real requests wrote, so it is put back with the warmups' writes."""

        def recorded() -> Any:
            with OpRecorder([self.guard]):
                return hook()

        return recorded

    def end(self, cap: Capture) -> None:
        """Put back what the key wrote outside the step, and the static buffers as the last call left them."""

        self.guard.restore()
        kept, self._kept = self._kept, None
        if kept is not None:
            with torch.inference_mode():
                for n, b in self.staging.buffers.items():
                    b.copy_(kept[n])
            self.staging.filled = self._filled


def settle_background(server: Server, rows: Sizes | None) -> None:
    """In a call of ``server`` (:class:`graphrunner.serving.Server`), after its agreement (``rows``:
    its agreed sizes; None outside a call, one rank): the keys every rank has captured start
    replaying now; on several ranks the next key is granted; a failed capture raises here, on
    every rank alike."""
    bg = server.background
    if not isinstance(bg, BackgroundCapture):
        raise CaptureError("internal error: settle_background() called with no background capture serving")
    agreement = server.agreement
    key = server.space.choose(rows)[0] if rows is not None and min(rows) >= 1 else None
    new, error = bg.after_agreement(agreement.last_extra if isinstance(agreement, RankAgreement) else None, key)
    if new:
        server.enable(new)
    if error is not None:
        raise error from bg.error
    if bg.agreed == len(bg.keys):  # every key on every rank (agreed: the same call everywhere): plain calls again
        server.settled()
        if isinstance(agreement, RankAgreement):
            agreement.extra = list


def wait_background(server: Server, bg: BackgroundCapture, timeout: float | None) -> CaptureReport | None:
    """``runner.wait_captured(timeout)`` for ``server``'s background capture ``bg``: its report, or
    None (timed out, failed)."""
    done = bg.wait(timeout) and bg.error is None
    if done and not bg.shared and server.background is not None:  # one rank: they replay from the next call
        with bg.mutex:
            settle_background(server, None)
    return bg.report if done else None


@contextlib.contextmanager
def hold_background(server: Server) -> Iterator[None]:
    """``runner.hold()``: no key starts (or is being captured) while the body runs. Several ranks: a key
    granted at an earlier call is captured first (:meth:`BackgroundCapture.before_call`, outside the lock),
    as the next call would wait for it: that call may be in the body, which holds the lock the capture needs."""
    bg = server.background
    if bg is None:
        yield
        return
    bg.before_call()
    with bg.call():
        yield


def capture_in_background(capturer: Capturer, agree: bool, share: float = 1.0) -> None:
    """``runner.capture(background=True, share=share)``: start a background capture of ``capturer``'s
    keys (:func:`start_background`); ``ValueError`` with a memory budget, which it cannot apply, or a
    ``share`` outside ``(0, 1]``."""
    check_share(share)
    if capturer.budget.budget is not None:
        raise ValueError(
            "GraphRunner.capture(background=True) does not apply memory_budget (it measures each "
            "key's graph after the capture); capture in the foreground, or drop memory_budget"
        )
    run = CaptureRun(capturer, capturer.server.space.capture_order(), agree)  # sets the server's agreement up
    start_background(capturer.server, run, capturer.backend, capturer.background_gate, share)


def wait_captured(capturer: Capturer, timeout: float | None) -> CaptureReport | None:
    """``runner.wait_captured(timeout)`` (:func:`wait_background`): the capture's report, kept as
    ``capturer.report``, or None. ``timeout``: seconds >= 0, ``None`` or ``math.inf`` to wait until
    done; ``ValueError`` for a negative or NaN one, ``TypeError`` for a non-number (nothing is
    waited for then)."""
    timeout = wait_seconds(timeout)
    server = capturer.server
    bg = server.background or server.last_background
    if not isinstance(bg, BackgroundCapture):
        return capturer.report
    report = wait_background(server, bg, timeout)
    if report is not None:
        capturer.report = report
    return report
