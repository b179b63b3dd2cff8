"""One capture of a runner's keys, in three parts: set up, one key at a time, finish.

:class:`CaptureRun` is what ``GraphRunner.capture()`` does, split so that a
blocking capture (every key in a row) and a background capture
(:mod:`graphrunner.background`: one key at a time between calls) run the
same code: the same backend protocol per key (``capture_one`` with the
runner's checks as hooks), the same reports, routes and report.
"""

from __future__ import annotations

import functools
import logging
import time
from typing import Any, List, Optional, Sequence, Tuple

from graphrunner.agreement import config_digest, make_agreement
from graphrunner.checks import contracts, fingerprint
from graphrunner.progress import CaptureProgress
from graphrunner.report import BucketReport, CaptureReport

__all__ = ["CaptureRun"]

logger = logging.getLogger("graphrunner")

Sizes = Tuple[int, ...]


class CaptureRun:
    """The capture of ``order`` (internal keys, largest first) for ``runner`` (a ``GraphRunner``).

    Construction sets the runner up for capture (its agreement, debug-mode externals, the
    input-writes check); :meth:`begin` makes the capture's first collective (the configuration
    fingerprint on several ranks), inside the backend's capture session; :meth:`key` captures
    one key; :meth:`finish` builds the :class:`CaptureReport`. ``collect`` (``graphrunner
    check``) puts the hooks in collect mode and turns a key's error into findings."""

    def __init__(self, runner: Any, order: List[Sizes], collect: Any = None) -> None:
        self.runner, self.order, self.collect = runner, list(order), collect
        space = runner._space
        self.bar = CaptureProgress(len(order), enabled=runner.progress and runner.rank == 0)
        self.reports: List[BucketReport] = []
        self.started = 0  # keys begun
        self.t0 = time.perf_counter()
        shared = runner.agree_bucket and runner.world_size > 1
        runner._agreement = make_agreement(runner.group, runner.agree_bucket,
                                           config_digest(runner._config_fields()) if shared else 0,
                                           verdicts=runner.verify_every > 0)
        if runner.debug:
            runner._externals = contracts.ExternalsCheck(runner.step, runner._inputs.storages,
                                                         lambda k: runner._key_text(space.internal(k)))
        self.extra = {"lead_dims": runner._layout.lead} if runner._layout.lead > 1 else {}
        self.writes = contracts.InputWritesCheck(runner._inputs.storage_names())  # one for every key

    def begin(self) -> None:
        """The capture's first collective (several ranks, fingerprint check on): every rank's configuration."""
        r = self.runner
        if r.checks.fingerprint and r.world_size > 1:
            fingerprint.check(r.group, r._config_fields(), "configurations", key="config")

    def key(self, key: Sizes, report: Optional[Any] = None, extra_hooks: Sequence[Any] = ()) -> None:
        """Capture ``key`` through the backend's protocol with the runner's checks as hooks, and add
        its :class:`BucketReport` (through ``report(ext, reports, bucket_report)`` when given, e.g. the
        memory budget's ``append``; ``extra_hooks``: more capture hooks for this key). In collect
        mode a failure becomes findings."""
        r, space = self.runner, self.runner._space
        ext = space.external(key)
        self.bar.start(self.started, ext)
        self.started += 1
        views = r._inputs.key_views(key)
        hook = functools.partial(r.post_warmup_hook, ext) if r.post_warmup_hook else None
        forward = r._layout.forward(r.step, key, views, f"GraphRunner.step[{ext}]")
        hooks = r.checks.key_hooks(space, key, r._key_text(key), r._inputs.key_inputs(views), r.step,
                                   r._layout.leaf_dims, r.group, r._externals, self.writes) + list(extra_hooks)
        r._layout.capturing = True
        try:
            r.backend.capture_one(ext, forward, capture_inputs=views, post_warmup_hook=hook, hooks=hooks,
                                  findings=None if self.collect is None else self.collect.findings, **self.extra)
        except Exception as exc:
            if self.collect is None:
                raise
            self.collect.capture_error(ext, exc)
            return
        finally:
            r._layout.capturing = False
        bucket = BucketReport.from_info(ext, r.backend.info(ext))
        if report is None:
            self.reports.append(bucket)
        else:
            report(ext, self.reports, bucket)

    def agree_replayable(self) -> None:
        """After every key: which keys every rank can replay (one collective), and their routes."""
        r, space = self.runner, self.runner._space
        local = [bool(r.backend.can_run(space.external(k))) for k in space.keys]
        r._routes.replayable = dict(zip(space.keys, r._agreement.replayable(local)))
        r._routes.prepare(r._inputs, r._layout)

    def close(self, ok: bool) -> None:
        """End the progress bar."""
        self.bar.close(ok)

    def finish(self) -> CaptureReport:
        """The capture report (also ``runner.report``); marks the runner captured."""
        r = self.runner
        r._captured = True
        r.report = CaptureReport.of(r.backend, r.rank, r.world_size, self.reports, time.perf_counter() - self.t0,
                                    r._inputs.nbytes, r.output_arena,
                                    None if r._externals is None else r._externals.guard.written())
        logger.info("GraphRunner captured %d keys (%s) in %.3fs on rank %d", len(self.reports),
                    r.report.backend, r.report.total_seconds, r.rank)
        return r.report
