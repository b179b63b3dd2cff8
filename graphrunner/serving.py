"""The server part of a runner: everything one call does, and the state it owns.

:class:`Server` owns a runner's static inputs (:class:`~graphrunner.staging.StaticInputs`),
its output layout (:class:`~graphrunner.layout.OutputLayout`), the routes of the agreed sizes
(:class:`~graphrunner.dispatch.Routes`), the agreement across ranks
(:mod:`graphrunner.agreement`), the call statistics and the call counter. A call is
:meth:`Server.run`: validate, stage, agree (the one collective), route, replay or fall back,
slice, count, verify. The capturer part (:mod:`graphrunner.capturing`) hands it what a capture
produced through :meth:`Server.install` and :meth:`Server.serve`; the background capture
through :meth:`Server.enable`. Nothing else writes its state.
"""

from __future__ import annotations

import contextlib
import logging
import math
import threading
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Protocol

import torch

from graphrunner.agreement import LocalAgreement, RankAgreement
from graphrunner.channel import fail_ranks
from graphrunner.checks import contracts
from graphrunner.checks.verify import shadow_reference, shadow_verify
from graphrunner.dispatch import CAPTURING, IDLE, ReplayBackend, Route, Routes
from graphrunner.errors import (
    AgreementError,
    CaptureError,
    GraphRunnerError,
    RankFailedError,
    RankTimeoutError,
    add_note,
)
from graphrunner.layout import clone_outputs
from graphrunner.ownership import CallOwner
from graphrunner.report import RunnerStats

if TYPE_CHECKING:
    from graphrunner.keys import Batch, Group, Key, KeySpace
    from graphrunner.layout import OutputLayout
    from graphrunner.staging import StaticInputs

__all__ = ["Server", "BackgroundWork"]

logger = logging.getLogger("graphrunner")

Sizes = tuple[int, ...]


class BackgroundWork(Protocol):
    """What a server (and the parts above it: the capturer, the runner) needs of a background
    capture, :class:`graphrunner.background.BackgroundCapture`. The background capture sits
    above the server (it serves calls through one while it captures), so the server knows it
    only as this, handed to :meth:`Server.serve_in_background`."""

    @property
    def error(self) -> BaseException | None:
        """The error that stopped the capture, or None."""
        ...

    def settle(self, server: Server, rows: Sizes | None) -> None:
        """In a call, after its agreement (``rows``: the agreed sizes): captured keys start replaying."""
        ...

    def before_call(self) -> None:
        """Before a call: wait for the key being captured."""
        ...

    def call(self, busy: bool = True) -> contextlib.AbstractContextManager[None]:
        """Around a call: no key starts meanwhile; ``busy=False`` for a call without rows (it does not slow
        the capture's pace)."""
        ...

    def stop(self, timeout: float | None = None) -> None:
        """Stop the capture's thread (cleanup)."""
        ...

    def end(self, why: str, grace: float | None = None) -> None:
        """End the capture's thread (the runner garbage collected, the interpreter exiting)."""
        ...


#: How a call's sizes are agreed: by this rank alone, or with its peers (:mod:`graphrunner.agreement`).
Agreement = LocalAgreement | RankAgreement

_get_ident = threading.get_ident


class Server:
    """The serving state and call path of one runner.

    Args (keywords only):
        step: the user's step (``step(**static_inputs)``), run eagerly by the fallback.
        space: the runner's :class:`~graphrunner.keys.KeySpace`.
        inputs: its :class:`~graphrunner.staging.StaticInputs` (owned from now on).
        layout: its :class:`~graphrunner.layout.OutputLayout` (owned from now on).
        backend, group: the backend whose graphs replay, and the rank group.
        fallback: ``"eager"`` or ``"error"``.
        debug, verify_every: debug mode and shadow verification (:mod:`graphrunner.checks.verify`).
        copy_outputs: the default of :meth:`run`'s ``copy_outputs``.
        key_text: ``key_text(internal key) -> str`` for messages.
    """

    def __init__(
        self,
        *,
        step: Callable[..., Any],
        space: KeySpace,
        inputs: StaticInputs,
        layout: OutputLayout,
        backend: ReplayBackend,
        group: Group,
        fallback: str,
        debug: bool,
        verify_every: int,
        copy_outputs: bool,
        key_text: Callable[[Sizes], str],
    ) -> None:
        self.step, self.space, self.inputs, self.layout = step, space, inputs, layout
        self.backend, self.group, self.fallback = backend, group, fallback
        self.rank, self.world_size = int(getattr(group, "rank", 0)), int(getattr(group, "size", 1))
        self.debug, self.verify_every, self.copy_outputs = debug, verify_every, copy_outputs
        self.key_text = key_text
        #: Per-call statistics (``runner.stats``).
        self.stats = RunnerStats(replays={space.external(k): 0 for k in space.keys})
        #: Calls so far (invalid ones too): the number every rank's agreement pairs.
        self.calls = 0
        #: Replayed calls so far (the same on every rank): shadow verification takes every N-th.
        self.replayed = 0
        #: True while calls are served (after a capture, or from the start of a background one).
        self.serving = False
        #: True after ``cleanup()`` (a call then says so).
        self.cleaned_up = False
        #: One call (or capture) at a time: the static buffers hold one batch.
        self.owner = CallOwner()
        self.reset()

    # ------------------------------------------------------------- what a capture hands over
    def reset(self) -> None:
        """Forget every capture: no routes, no agreement, no background capture, calls refused until
        the next capture (``cleanup()``, a failed capture)."""
        self.layout.reset()
        #: The routes of the agreed sizes (:class:`~graphrunner.dispatch.Routes`).
        self.routes = Routes(self.space, self.backend, self.layout)
        #: The agreement across ranks (:mod:`graphrunner.agreement`).
        self.agreement: Agreement = LocalAgreement()
        #: Debug mode's check of the tensors the graphs read (:class:`~graphrunner.checks.contracts.ExternalsCheck`).
        self.externals: contracts.ExternalsCheck | None = None
        #: A background capture while its keys are not all replaying (:mod:`graphrunner.background`).
        self.background: BackgroundWork | None = None
        #: The background capture after every key replays (its thread may still build the report).
        self.last_background: BackgroundWork | None = None
        self.serving = False

    def install(self, agreement: Agreement, externals: contracts.ExternalsCheck | None) -> None:
        """A capture starts: its agreement and debug mode's externals check serve the calls from now on."""
        self.agreement, self.externals = agreement, externals

    def serve(self, replayable: dict[Sizes, bool]) -> None:
        """A blocking capture ended: ``replayable`` (``{key: every rank can replay it}``) keys replay
        from the next call on, their routes and views prepared now."""
        self.routes.replayable = dict(replayable)
        self.routes.prepare(self.inputs)
        self.inputs.warm()
        self.serving, self.cleaned_up = True, False

    def serve_in_background(self, background: BackgroundWork) -> None:
        """A background capture starts: every call is served from now on, eagerly (padded to its
        key) until :meth:`enable` switches a key to its graph."""
        self.routes.pending = set(self.space.keys)
        self.background = background
        self.serving, self.cleaned_up = True, False

    def enable(self, keys: list[Sizes]) -> None:
        """Keys a background capture has captured on every rank replay from now on."""
        self.routes.enable(keys, self.inputs)
        self.inputs.warm()

    def stop_serving(self) -> None:
        """``cleanup()``: calls raise until the next capture."""
        self.reset()
        self.cleaned_up = True

    def settled(self) -> None:
        """Every key of the background capture replays on every rank: calls are plain calls again."""
        self.background, self.last_background = None, self.background

    def key_for(self, batch: Batch) -> Key | None:
        """``GraphRunner.key_for``: the key a local call of ``batch`` replays (see there)."""
        space = self.space
        sizes = space.sizes_of(batch, what="key_for")
        if min(sizes) < 1 and (not self.serving or self.routes.route(sizes).reason == IDLE):
            return None
        key = space.choose(space.serving_sizes(sizes))[0]
        return None if key is None else space.external(key)

    # ------------------------------------------------------------------------ a call
    def run(self, inputs: Mapping[str, torch.Tensor], copy_outputs: bool | None, step: int | None) -> Any:
        """One call (``GraphRunner.run``; its docstring is the contract)."""
        lock, owner = self.owner.lock, self.owner
        if not lock.acquire(blocking=False):
            owner.refuse("run()")
        owner.thread = _get_ident()
        try:
            if not self.serving:
                raise CaptureError(
                    "GraphRunner called after cleanup(): its graphs were released; call runner."
                    "capture() again before serving"
                    if self.cleaned_up
                    else "GraphRunner called before capture(): call runner.capture() once first"
                )
            self.calls += 1
            staging = self.inputs
            try:
                tensors, sizes = staging.validate(inputs)
                if self.debug:  # before any write; with agreement every key's externals (no raise after peers agreed)
                    contracts.check_call(staging.bounded, tensors, self.externals if self.agreement.shared else None)
                staging.stage(tensors, sizes)  # before agreeing: a failed copy is reported to every rank
            except (ValueError, TypeError, GraphRunnerError):
                self._agree(staging.zero, step, invalid=True)
                raise
            copy_outputs = self.copy_outputs if copy_outputs is None else copy_outputs
            began = time.perf_counter()
            try:  # _agree's valid case, in this frame
                rows = self.agreement.agree(sizes, self.calls, step)
            except AgreementError as exc:
                if exc.collectives is not None:
                    self.calls -= 1
                raise
            finally:
                if self.agreement.shared:  # one rank agrees with itself: no wait
                    self.stats.agreement_seconds += time.perf_counter() - began
            if self.background is not None:
                self.background.settle(self, rows)
            route = self.routes.get(rows) or self.routes.route(rows)
            key = route.key
            if key is None:
                return self.fall_back(tensors, sizes, route, copy_outputs)
            if staging.filled != sizes:
                staging.pad_to(sizes, key)
            self.replayed += 1
            verify = self.verify_every and not self.replayed % self.verify_every  # every N-th replayed call
            ref = shadow_reference(self, sizes, key) if verify else None
            try:
                route.replay()
            except Exception as exc:  # a failed collective (RankTimeoutError), else the user's error, noted
                if self.step_failed(exc, "replay", route.ext):
                    raise
                note = contracts.step_note(
                    exc, "replay", self.key_text(key), staging.bounded, staging.names, tensors, self.debug
                )
                if note is not None:
                    add_note(exc, note)
                raise
            if staging.stateful:
                staging.written_by_step(key)
            stats, real = self.stats, (sizes[0] if len(sizes) == 1 else math.prod(sizes))
            stats.replays[route.ext] += 1
            stats.real_rows, stats.padding_rows, stats.last_bucket = (
                stats.real_rows + real,
                stats.padding_rows + route.volume - real,
                route.ext,
            )
            out = self.layout.replayed(route.outputs, sizes)
            if ref is not None:
                shadow_verify(self, ref, tensors, sizes, key, out)
            return clone_outputs(out) if copy_outputs else out
        finally:
            owner.thread = None
            lock.release()

    def _agree(self, sizes: Sizes, step: int | None, invalid: bool = False) -> Sizes:
        """The call's one collective (:mod:`graphrunner.agreement`). A call whose collective met
        another kind of collective on some rank (:class:`~graphrunner.errors.AgreementError` with
        ``collectives`` set: the ranks were out of step, e.g. one waiting for a background capture)
        happened on no rank: it is not counted, so the ranks' next calls pair again."""
        try:
            if invalid:
                self.agreement.invalid(sizes, self.calls, step)
                return sizes
            return self.agreement.agree(sizes, self.calls, step)
        except AgreementError as exc:
            if exc.collectives is not None:
                self.calls -= 1
            raise

    def step_failed(self, exc: Exception, phase: str, ext: Key) -> bool:
        """The step raised ``exc`` in a call (``phase``: ``"replay"`` or ``"fallback"``, key ``ext``). A
        failed collective raises :class:`~graphrunner.errors.RankTimeoutError` (or, when a peer failed
        alone and said so, its :class:`~graphrunner.errors.RankFailedError`). On several ranks the
        user's own error means this rank failed alone while its peers may be inside the step's own
        collectives: it is reported and the process group aborted
        (:func:`graphrunner.channel.fail_ranks`), so the peers raise ``RankFailedError``; ``exc`` keeps
        its type here, with a note (returns True: the caller raises it as it is; False: the group is
        fine, the caller adds its own note)."""
        err = RankTimeoutError.from_step(exc, self.group, phase, ext)
        where = (
            f"in the step's replay of key {ext!r}" if phase == "replay" else f"in the step's eager {phase} at {ext!r}"
        )
        if err is not None:
            failed = fail_ranks(self.group, err, where)
            raise failed from exc
        if self.world_size > 1:
            failed = fail_ranks(self.group, exc, where)
            if isinstance(failed, RankFailedError):
                add_note(
                    exc,
                    f"GraphRunner: the step raised on rank {self.rank} alone, while its peers may be "
                    "inside the step's own collectives; it told them out of band and aborted the process "
                    f"group, so every rank raises RankFailedError and the runner stops: {failed}",
                )
                return True
        return False

    def fall_back(self, tensors: list[torch.Tensor], sizes: Sizes, route: Route, copy_outputs: bool) -> Any:
        """Serve a call of local ``sizes`` whose route does not replay: :data:`~graphrunner.dispatch.IDLE`
        returns the empty outputs, anything else runs the step eagerly on the inputs padded to the
        route's sizes (the key's, for :data:`~graphrunner.dispatch.CAPTURING`; ``fallback='error'``:
        ``ValueError`` except while capturing) and slices the result to ``sizes``."""
        space, run, reason = self.space, route.run, route.reason
        if reason == IDLE:
            self.stats.last_bucket = None  # neither a replay nor a fallback: nothing ran
            out = self.layout.replayed(route.outputs, sizes)
            return clone_outputs(out) if copy_outputs else out
        if self.fallback == "error" and reason != CAPTURING:
            raise ValueError(
                f"GraphRunner(fallback='error'): {space.why(sizes, run, reason)}; "
                + ("add a bucket" if space.one_batch_dim else "add a bucket or key")
                + ", raise max_padding_ratio, or use fallback='eager'"
            )
        staging = self.inputs
        kwargs = staging.padded(tensors, sizes, run)
        try:
            with torch.inference_mode():
                out = self.step(**kwargs)
        except Exception as exc:  # a failed collective (RankTimeoutError), else the user's error, noted
            if self.step_failed(exc, "fallback", space.external(run)):
                raise
            note = contracts.step_note(
                exc,
                "eager fallback",
                f"sizes ({space.describe(run)})",
                staging.bounded,
                staging.names,
                tensors,
                self.debug,
            )
            if note is not None:
                add_note(exc, note)
            raise
        if run != sizes:
            out = self.layout.slice(out, sizes)
        self.stats.count(None, sizes, run, reason)
        logger.debug(
            "GraphRunner: eager fallback (%s) for %s (padded to %s)", reason, space.describe(sizes), space.describe(run)
        )
        return clone_outputs(out) if copy_outputs else out
