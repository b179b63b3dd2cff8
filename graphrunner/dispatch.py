"""The dispatcher: the one place that says what a call of given sizes does.

:class:`Routes` maps the agreed sizes of a call to a route, computed once
and cached: the key that serves them (:meth:`graphrunner.keys.KeySpace.choose`),
whether every rank can replay it, and the backend's replay function and
static outputs for it (:meth:`graphrunner.backends.base.GraphBackend.replayer`),
or the reason to fall back. The runner's call path is then one dict lookup.
"""

from __future__ import annotations

import math
from typing import Any, Dict, Optional, Tuple

from graphrunner.backends.base import GraphBackend
from graphrunner.keys import CANNOT
from graphrunner.layout import FreshOutputs

__all__ = ["Routes"]

Sizes = Tuple[int, ...]


class Routes:
    """Routes of one captured runner: ``space`` (its :class:`~graphrunner.keys.KeySpace`),
    ``backend``, and ``replayable`` (``{key: every rank can replay it}``, from the agreement)."""

    def __init__(self, space: Any, backend: Any, replayable: Optional[Dict[Sizes, bool]] = None) -> None:
        self.space, self.backend = space, backend
        self.replayable = replayable or {}
        self._routes: Dict[Sizes, tuple] = {}
        #: The route of ``rows`` if already known, else ``None`` (the hot path's one lookup).
        self.get = self._routes.get

    def prepare(self, staging: Any, layout: Any) -> None:
        """After capture: the route, input views and output views of every key, so that the
        first call of a key costs what later ones do."""
        for k in self.space.keys:
            staging.prepare(k)
            route = self.route(k)
            if route[0] is not None:
                layout.replayed(route[3], k)

    def route(self, rows: Sizes) -> tuple:
        """What a call of agreed sizes ``rows`` does: ``(key, external key, replay(), outputs,
        key volume, None)`` to replay, or ``(None, None, None, None, 0, reason)`` to fall back."""
        hit = self._routes.get(rows)
        if hit is not None:
            return hit
        key, reason = self.space.choose(rows)
        if key is None or not self.replayable.get(key, False):
            route: tuple = (None, None, None, None, 0, reason or CANNOT)
        else:
            ext = self.space.external(key)
            if isinstance(self.backend, GraphBackend):
                replay, outputs = self.backend.replayer(ext)
            else:  # any object with replay(key): its outputs are sliced at every call
                outputs = FreshOutputs()

                def replay(b=self.backend, k=ext, box=outputs) -> None:
                    box.value = b.replay(k)
            route = (key, ext, replay, outputs, math.prod(key), None)
        self._routes[rows] = route
        return route
