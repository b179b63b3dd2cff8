"""The capturer part of a runner: key order, checks as hooks, memory budget, background capture.

:class:`Capturer` owns what a capture needs beyond the server's state: the checks
(:class:`~graphrunner.checks.CheckSet`), the post-warmup hook, the memory budget
(:mod:`graphrunner.budget`), the progress bar, the last report and the background capture
(:mod:`graphrunner.background`). It drives the backend's protocol (``capture_one``) one key at a
time through :class:`CaptureRun`, and hands the server (:class:`graphrunner.serving.Server`) the
agreement and its replayable keys through the server's own methods (``install``, ``serve``).

:class:`CaptureRun` is one capture, split in three parts (set up, one key at a time, finish) so
that a blocking capture (every key in a row) and a background capture (one key at a time between
calls) run the same code: the same protocol per key, the same hooks, reports and routes.
"""

from __future__ import annotations

import functools
import logging
import math
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from graphrunner.agreement import config_digest, config_fields, make_agreement
from graphrunner.budget import MemoryBudget, OverBudget, one_time_imports
from graphrunner.channel import fail_ranks
from graphrunner.checks import contracts, fingerprint
from graphrunner.checks.lint import first_unsafe_op
from graphrunner.errors import RankFailedError, add_note
from graphrunner.layout import user_error
from graphrunner.progress import CaptureProgress
from graphrunner.recording.hooks import Finding
from graphrunner.report import BucketReport, CaptureReport, format_bytes

if TYPE_CHECKING:
    import threading

    from graphrunner.arena import OutputArena
    from graphrunner.backends.base import GraphBackend
    from graphrunner.checks import CheckSet
    from graphrunner.checks.lint import FindingsCollector
    from graphrunner.recording.hooks import CaptureHook
    from graphrunner.serving import Server

__all__ = ["Capturer", "CaptureRun"]

logger = logging.getLogger("graphrunner")

Sizes = tuple[int, ...]


class CaptureRun:
    """The capture of ``order`` (internal keys, largest first) for ``capturer``'s server.

    Construction sets the server up for capture (:meth:`~graphrunner.serving.Server.install`: its
    agreement, with the configuration digest, and debug mode's externals check) and makes the
    input-writes check; :meth:`begin` makes the capture's first collective (the configuration
    fingerprint on several ranks), inside the backend's capture session; :meth:`key` captures
    one key; :meth:`agree_replayable` hands the server its keys; :meth:`finish` builds the
    :class:`CaptureReport`. ``collect`` (``graphrunner check``) puts the hooks in collect mode
    and turns a key's error into findings. ``agree``: agree the key across ranks per call."""

    def __init__(
        self, capturer: Capturer, order: list[Sizes], agree: bool, collect: FindingsCollector | None = None
    ) -> None:
        self.capturer, self.server, self.order, self.collect = capturer, capturer.server, list(order), collect
        server = self.server
        self.bar = CaptureProgress(len(order), enabled=capturer.progress and server.rank == 0)
        self.reports: list[BucketReport] = []
        self.started = 0  # keys begun
        self.t0 = time.perf_counter()
        shared = agree and server.world_size > 1
        agreement = make_agreement(
            server.group, agree, config_digest(capturer.config()) if shared else 0, verdicts=server.verify_every > 0
        )
        externals = None
        if server.debug:
            space = server.space
            externals = contracts.ExternalsCheck(
                server.step, server.inputs.storages, lambda k: server.key_text(space.internal(k))
            )
        server.install(agreement, externals)
        self.extra = {"lead_dims": server.layout.lead} if server.layout.lead > 1 else {}
        self.writes = contracts.InputWritesCheck(server.inputs.storage_names())  # one for every key

    def begin(self) -> None:
        """The capture's first collective (several ranks, fingerprint check on): every rank's configuration."""
        c = self.capturer
        if c.checks.fingerprint and self.server.world_size > 1:
            fingerprint.check(self.server.group, c.config(), "configurations", key="config")

    def key(
        self,
        key: Sizes,
        report: Any | None = None,
        extra_hooks: Sequence[CaptureHook] = (),
        around_hook: Callable[[Callable[[], Any]], Callable[[], Any]] | None = None,
    ) -> None:
        """Capture ``key`` through the backend's protocol with the checks as hooks, and add its
        :class:`BucketReport` (through ``report(ext, reports, bucket_report)`` when given, e.g. the
        memory budget's ``append``; ``extra_hooks``: more capture hooks for this key;
        ``around_hook(hook) -> hook``: wraps the post-warmup hook, e.g. to record its writes). In
        collect mode a failure becomes findings."""
        c, server = self.capturer, self.server
        space, layout, inputs = server.space, server.layout, server.inputs
        ext = space.external(key)
        self.bar.start(self.started, ext)
        self.started += 1
        views = inputs.key_views(key)
        hook: Callable[[], Any] | None = functools.partial(c.post_warmup_hook, ext) if c.post_warmup_hook else None
        if hook is not None and around_hook is not None:
            hook = around_hook(hook)
        forward = layout.forward(server.step, key, views, f"GraphRunner.step[{ext}]")
        hooks = c.checks.key_hooks(
            space,
            key,
            server.key_text(key),
            inputs.key_inputs(views),
            server.step,
            layout.leaf_dims,
            server.group,
            server.externals,
            self.writes,
        ) + list(extra_hooks)
        layout.capturing = True
        layout.explain = first_unsafe_op  # an output shape it cannot slice: the op and line behind it
        try:
            c.backend.capture_one(
                ext,
                forward,
                capture_inputs=views,
                post_warmup_hook=hook,
                hooks=hooks,
                findings=None if self.collect is None else self.collect.findings,
                **self.extra,
            )
        except Exception as exc:
            if self.collect is None:
                raise
            self.collect.capture_error(ext, exc)
            return
        finally:
            layout.capturing = False
        bucket = BucketReport.from_info(ext, c.backend.info(ext))
        if report is None:
            self.reports.append(bucket)
        else:
            report(ext, self.reports, bucket)

    def agree_replayable(self) -> None:
        """After every key: which keys every rank can replay (one collective), handed to the server."""
        server, space = self.server, self.server.space
        local = [bool(self.capturer.backend.can_run(space.external(k))) for k in space.keys]
        server.serve(dict(zip(space.keys, server.agreement.replayable(local))))

    def close(self, ok: bool) -> None:
        """End the progress bar."""
        self.bar.close(ok)

    def finish(self) -> CaptureReport:
        """The capture report (also the capturer's :attr:`Capturer.report`)."""
        c, server = self.capturer, self.server
        externals = server.externals
        c.report = CaptureReport.of(
            c.backend,
            server.rank,
            server.world_size,
            self.reports,
            time.perf_counter() - self.t0,
            server.inputs.nbytes,
            c.output_arena,
            None if externals is None else externals.guard.written(),
        )
        logger.info(
            "GraphRunner captured %d keys (%s) in %.3fs on rank %d",
            len(self.reports),
            c.report.backend,
            c.report.total_seconds,
            server.rank,
        )
        return c.report


class Capturer:
    """How a runner captures: the checks, the hook, the memory budget, background capture.

    Args:
        server: the runner's :class:`~graphrunner.serving.Server` (it is handed the results).
        backend: the backend whose ``capture_one`` runs the protocol.
        checks: the :class:`~graphrunner.checks.CheckSet`.
        post_warmup_hook: ``hook(key)`` after each warmup, or ``None``.
        progress: draw a progress bar on rank 0.
        memory_budget: a :class:`~graphrunner.budget.MemoryBudget`.
        output_arena: the shared :class:`~graphrunner.OutputArena`, or ``None`` (for the report).
        config: ``config() -> {field: value}``: what every rank must configure alike (the
            fingerprint's fields and the agreement's digest); ``None``:
            :func:`graphrunner.agreement.config_fields` of the server and :attr:`checks` (holds no
            reference to the runner, so a background capture's thread does not keep it alive).
    """

    def __init__(
        self,
        server: Server,
        backend: GraphBackend,
        checks: CheckSet,
        post_warmup_hook: Callable[[Any], Any] | None,
        progress: bool,
        memory_budget: MemoryBudget,
        output_arena: OutputArena | None,
        config: Callable[[], dict[str, Any]] | None = None,
    ) -> None:
        self.server, self.backend, self.checks = server, backend, checks
        self.post_warmup_hook, self.progress, self.budget = post_warmup_hook, bool(progress), memory_budget
        self.output_arena = output_arena
        self.config: Callable[[], dict[str, Any]] = config or (lambda: config_fields(self.server, self.checks))
        #: The last capture's :class:`CaptureReport` (``None`` before one, after ``cleanup()``).
        self.report: CaptureReport | None = None
        #: Tests: a ``threading.Event`` the background thread waits for before its first key.
        self.background_gate: threading.Event | None = None

    def capture(self, agree: bool, collect: FindingsCollector | None = None) -> CaptureReport:
        """Capture every key the budget keeps, largest first, inside one ``backend.capture_session()``
        under ``torch.inference_mode()`` (restarting without a key that did not fit). On any error
        the backend is cleaned up, the server reset, and the error raised as the user should see
        it. ``collect`` (``graphrunner check``) puts the hooks in collect mode."""
        if collect is not None:
            return self._capture_all(agree, collect)
        return self.budget.capture(lambda _: self._capture_all(agree, None), one_time_imports())

    def _capture_all(self, agree: bool, collect: FindingsCollector | None) -> CaptureReport:
        space = self.server.space
        run = CaptureRun(self, self.budget.keep(space.capture_order(), space.external), agree, collect)
        ok = False
        try:
            with torch.inference_mode(), self.backend.capture_session():
                run.begin()
                report = self.budget.append if collect is None else self._budget_finding(collect)
                for key in run.order:
                    run.key(key, report)
                run.agree_replayable()
            ok = True
        except BaseException as exc:
            self.abort()
            failed = fail_ranks(self.server.group, exc, "in its capture") if collect is None else exc
            if isinstance(failed, RankFailedError) and failed.failed_rank != self.server.rank:
                raise failed from exc  # a peer failed alone: its error, on every rank
            err = user_error(exc)
            if failed is not exc:  # this rank failed alone: reported, the group aborted; its own error
                add_note(
                    err,
                    f"GraphRunner: rank {self.server.rank} failed alone; it told the other ranks out of "
                    f"band and aborted the process group, so they raise RankFailedError: {failed}",
                )
            if err is exc:
                raise
            raise err from None
        finally:
            run.close(ok)
        return run.finish()

    def _budget_finding(self, collect: FindingsCollector) -> Callable[[Any, list[BucketReport], BucketReport], None]:
        """In collect mode (``graphrunner check``): the memory budget as one finding (the first key
        over it), instead of the restart a capture makes."""

        over_at: list[Any] = []  # one finding: the first key over the budget

        def report(ext: Any, reports: list[BucketReport], bucket: BucketReport) -> None:
            try:
                self.budget.append(ext, reports, bucket)
            except OverBudget as over:
                limit = self.budget.budget
                if limit is None:  # not reached: only a budget raises OverBudget
                    raise
                if over_at:
                    return
                over_at.append(ext)
                collect.findings.append(
                    Finding(
                        "memory-budget",
                        f"memory_budget={format_bytes(limit)}: with key {ext!r} the "
                        f"graph pool holds {format_bytes(over.total)}, over the budget: a capture leaves this key "
                        "(and any that do not fit after it) to eager",
                        None,
                        None,
                        None,
                        fix="raise memory_budget, or capture fewer keys (buckets=, keys=)",
                        bucket=ext,
                    )
                )

        return report

    def abort(self) -> None:
        """After a failed capture: the backend cleaned up (its error logged, never raised over the
        capture's) and the server reset."""
        try:
            self.backend.cleanup()
        except Exception:  # noqa: BLE001 - the capture error is what the caller needs
            logger.exception("GraphRunner: backend cleanup after a failed capture raised")
        self.server.reset()

    def cleanup(self) -> None:
        """Stop a background capture, release every graph, stop serving (``runner.cleanup()``)."""
        server = self.server
        if server.background is not None:
            server.background.stop()
        self.backend.cleanup()
        self.report = None
        server.stop_serving()


def wait_seconds(timeout: Any) -> float | None:
    """``wait_captured(timeout=)`` as seconds for ``Thread.join`` (``None``: wait until done, for
    ``None`` and ``math.inf``); ``ValueError`` for a negative or NaN timeout, ``TypeError`` for
    anything but a real number."""
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
        raise TypeError(
            f"wait_captured(timeout=...) must be seconds (a number >= 0) or None, got "
            f"{type(timeout).__name__} ({timeout!r})"
        )
    t = float(timeout)
    if math.isnan(t) or t < 0:
        raise ValueError(
            f"wait_captured(timeout=...) must be >= 0 seconds (None or math.inf: until the capture "
            f"is done), got {timeout!r}"
        )
    return None if math.isinf(t) else t
