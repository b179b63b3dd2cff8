"""The dispatcher: the one place that says what a call of given sizes does.

:class:`Routes` maps the agreed sizes of a call to a route, computed once
and cached: the key that serves them (:meth:`graphrunner.keys.KeySpace.choose`),
whether every rank can replay it, and the backend's replay function and
static outputs for it (:meth:`graphrunner.backends.base.GraphBackend.replayer`),
or the reason to fall back. The runner's call path is then one dict lookup.

Agreed sizes with a 0 in some dim (every rank idle there; alone: this rank
idle) run no step when every output would be empty (:data:`IDLE`: empty
views of the output buffer, nothing replayed); otherwise they run the
smallest key as if the 0 were a 1, every cell padding. :func:`fall_back`
serves the routes that do not replay.
"""

from __future__ import annotations

import logging
import math
from typing import Any, Dict, List, Optional, Tuple

import torch

from graphrunner.backends.base import GraphBackend
from graphrunner.checks.contracts import step_error
from graphrunner.errors import RankTimeoutError
from graphrunner.keys import CANNOT
from graphrunner.layout import FreshOutputs, clone_outputs

__all__ = ["Routes", "IDLE", "CAPTURING", "fall_back"]

logger = logging.getLogger("graphrunner")

#: The route of agreed sizes with a 0 in some dim whose outputs are all empty: no step runs.
IDLE = "idle"
#: The reason of a call whose key a background capture has not captured on every rank yet: the
#: step runs eagerly on the inputs padded to the key, as its graph will (``capture(background=True)``).
CAPTURING = "capturing"

Sizes = Tuple[int, ...]


class Routes:
    """Routes of one captured runner: ``space`` (its :class:`~graphrunner.keys.KeySpace`),
    ``backend``, and ``replayable`` (``{key: every rank can replay it}``, from the agreement)."""

    def __init__(self, space: Any, backend: Any, replayable: Optional[Dict[Sizes, bool]] = None) -> None:
        self.space, self.backend = space, backend
        self.replayable = replayable or {}
        #: Keys a background capture will still capture: their calls run eagerly, padded to the key.
        self.pending: set = set()
        self.layout: Any = None  # the runner's OutputLayout, from prepare()
        self._routes: Dict[Sizes, tuple] = {}
        #: The route of ``rows`` if already known, else ``None`` (the hot path's one lookup).
        self.get = self._routes.get

    def prepare(self, staging: Any, layout: Any) -> None:
        """After capture: the route, input views and output views of every key, so that the
        first call of a key costs what later ones do."""
        self.layout = layout
        for k in self.space.keys:
            staging.prepare(k)
            route = self.route(k)
            if route[0] is not None:
                layout.replayed(route[3], k)

    def enable(self, keys: Any, staging: Any, layout: Any) -> None:
        """Keys a background capture has captured on every rank: replayable from now on (those the
        backend can run), their routes computed again and prepared as :meth:`prepare` does."""
        self.layout = layout
        for k in keys:
            self.pending.discard(k)
            self.replayable[k] = bool(self.backend.can_run(self.space.external(k)))
            staging.prepare(k)
        self._routes.clear()
        for k in keys:
            route = self.route(k)
            if route[0] is not None:
                layout.replayed(route[3], k)

    def route(self, rows: Sizes) -> tuple:
        """What a call of agreed sizes ``rows`` does: ``(key, external key, replay(), outputs,
        key volume, None)`` to replay, ``(None, sizes to run eagerly, None, None, 0, reason)`` to
        fall back, or ``(None, sizes, None, outputs, 0, IDLE)`` to run nothing (a 0 in ``rows``)."""
        hit = self._routes.get(rows)
        if hit is not None:
            return hit
        if min(rows) < 1:  # idle in some dim on every rank: the smallest key covering a 1 there
            run = self.space.serving_sizes(rows)
            route = self._route(run)
            if route[3] is not None and self.layout.all_empty(route[3], rows):
                route = (None, run, None, route[3], 0, IDLE)
        else:
            route = self._route(rows)
        self._routes[rows] = route
        return route

    def _route(self, rows: Sizes) -> tuple:
        key, reason = self.space.choose(rows)
        if key is not None and key in self.pending:
            return (None, key, None, None, 0, CAPTURING)
        if key is None or not self.replayable.get(key, False):
            return (None, rows, None, None, 0, reason or CANNOT)
        ext = self.space.external(key)
        if isinstance(self.backend, GraphBackend):
            replay, outputs = self.backend.replayer(ext)
        else:  # any object with replay(key): its outputs are sliced at every call
            outputs = FreshOutputs()

            def replay(b=self.backend, k=ext, box=outputs) -> None:
                box.value = b.replay(k)
        return (key, ext, replay, outputs, math.prod(key), None)


def fall_back(runner: Any, tensors: List[torch.Tensor], sizes: Sizes, rows: Sizes, route: tuple,
              copy_outputs: bool) -> Any:
    """Serve a call of local ``sizes`` (agreed ``rows``) whose route does not replay: :data:`IDLE`
    returns the empty outputs, anything else runs ``runner.step`` eagerly on the inputs padded to
    the route's sizes (the key's, for :data:`CAPTURING`; ``fallback='error'``: ``ValueError``
    except while capturing) and slices the result to ``sizes``."""
    space, run, reason = runner._space, route[1], route[5]
    if reason == IDLE:
        runner.stats.last_bucket = None  # neither a replay nor a fallback: nothing ran
        out = runner._layout.replayed(route[3], sizes)
        return clone_outputs(out) if copy_outputs else out
    if runner.fallback == "error" and reason != CAPTURING:
        raise ValueError(f"GraphRunner(fallback='error'): {space.why(sizes, run, reason)}; "
                         + ("add a bucket" if space.legacy else "add a bucket or key")
                         + ", raise max_padding_ratio, or use fallback='eager'")
    kwargs = runner._inputs.padded(tensors, sizes, run)
    try:
        with torch.inference_mode():
            out = runner.step(**kwargs)
    except Exception as exc:  # a failed collective (RankTimeoutError), else the cause named
        staging = runner._inputs
        err = RankTimeoutError.from_step(exc, runner.group, "fallback", space.external(run)) or step_error(
            exc, "eager fallback", f"sizes ({space.describe(run)})", staging.bounded, staging.names, tensors,
            runner.debug)
        if err is None:
            raise
        raise err from exc
    if run != sizes:
        out = runner._layout.slice(out, sizes)
    runner.stats.count(None, sizes, run, reason)
    logger.debug("GraphRunner: eager fallback (%s) for %s (padded to %s)", reason, space.describe(sizes),
                 space.describe(run))
    return clone_outputs(out) if copy_outputs else out
