"""The dispatcher: the one place that says what a call of given sizes does.

:class:`Routes` maps the agreed sizes of a call to a route, computed once
and cached (per key, and per sizes up to a bound): the key that serves them (:meth:`graphrunner.keys.KeySpace.choose`),
whether every rank can replay it, and the backend's replay function and
static outputs for it (:meth:`graphrunner.backends.base.GraphBackend.replayer`),
or the reason to fall back. The runner's call path is then one dict lookup.

Agreed sizes with a 0 in some dim (every rank idle there; alone: this rank
idle) run no step when every output would be empty (:data:`IDLE`: empty
views of the output buffer, nothing replayed); otherwise they run the
smallest key as if the 0 were a 1, every cell padding. The server
(:meth:`graphrunner.serving.Server.fall_back`) serves the routes that do not replay.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Hashable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from graphrunner.backends.base import GraphBackend
from graphrunner.errors import GraphRunnerError
from graphrunner.keys import CANNOT, MEMO_LIMIT, Key, KeySpace
from graphrunner.layout import FreshOutputs

if TYPE_CHECKING:
    from graphrunner.layout import OutputLayout
    from graphrunner.staging import StaticInputs

__all__ = ["Route", "Routes", "ReplayBackend", "IDLE", "CAPTURING"]


#: The route of agreed sizes with a 0 in some dim whose outputs are all empty: no step runs.
IDLE = "idle"
#: The reason of a call whose key a background capture has not captured on every rank yet: the
#: step runs eagerly on the inputs padded to the key, as its graph will (``capture(background=True)``).
CAPTURING = "capturing"

Sizes = tuple[int, ...]


class ReplayBackend(Protocol):
    """A backend as serving sees it: a :class:`~graphrunner.backends.base.GraphBackend` (its
    ``replayer`` serves a key), or any object ``make_backend`` accepts as an instance, of which
    serving asks only whether a key replays on this rank and its ``replay`` (fresh outputs)."""

    def can_run(self, key: Hashable) -> bool: ...

    def replay(self, key: Hashable) -> Any: ...


def _no_replay() -> None:
    """The ``replay`` of a route without a key: the server falls back on ``key is None`` first."""
    raise GraphRunnerError("GraphRunner internal error: a call replayed a route that has no key; please report it")


@dataclasses.dataclass(frozen=True)
class Route:
    """What a call of given agreed sizes does.

    ``key``: the internal key it replays (``None``: it does not replay), ``ext`` that key as users
    name it (``()`` when it does not replay), ``replay()`` the backend's replay function (one that
    raises when it does not replay), ``outputs`` the static outputs it fills (or, for :data:`IDLE`,
    the empty views), ``volume`` the key's cell count; ``run``: the sizes the step runs at eagerly
    when it does not replay (the agreed sizes, or the key's for :data:`CAPTURING`; ``()`` when it
    replays); ``reason``: why it does not replay (``""`` when it does)."""

    key: Sizes | None
    ext: Key = ()
    replay: Callable[[], None] = _no_replay
    #: The step's static outputs (a pytree of the user's step, or a :class:`FreshOutputs` box).
    outputs: Any = None
    volume: int = 0
    run: Sizes = ()
    reason: str = ""


class Routes:
    """Routes of one captured runner: ``space`` (its :class:`~graphrunner.keys.KeySpace`),
    ``backend``, ``layout`` (its :class:`~graphrunner.layout.OutputLayout`: which outputs an idle
    call leaves empty) and ``replayable`` (``{key: every rank can replay it}``, from the agreement)."""

    def __init__(
        self, space: KeySpace, backend: ReplayBackend, layout: OutputLayout, replayable: dict[Sizes, bool] | None = None
    ) -> None:
        self.space, self.backend, self.layout = space, backend, layout
        self.replayable: dict[Sizes, bool] = replayable or {}
        #: Keys a background capture will still capture: their calls run eagerly, padded to the key.
        self.pending: set[Sizes] = set()
        self._routes: dict[Sizes, Route] = {}
        #: The replaying route of each key: the sizes a key serves share one (varlen sizes rarely repeat).
        self._by_key: dict[Sizes, Route] = {}
        #: The route of ``rows`` if already known, else ``None`` (the hot path's one lookup).
        self.get = self._routes.get

    def prepare(self, staging: StaticInputs) -> None:
        """After capture: the route, input views and output views of every key, so that the
        first call of a key costs what later ones do."""
        layout = self.layout
        for k in self.space.keys:
            staging.prepare(k)
            route = self.route(k)
            if route.key is not None:
                layout.replayed(route.outputs, k)

    def enable(self, keys: Sequence[Sizes], staging: StaticInputs) -> None:
        """Keys a background capture has captured on every rank: replayable from now on (those the
        backend can run), their routes computed again and prepared as :meth:`prepare` does."""
        layout = self.layout
        for k in keys:
            self.pending.discard(k)
            self.replayable[k] = bool(self.backend.can_run(self.space.external(k)))
            staging.prepare(k)
        self._routes.clear()
        self._by_key.clear()
        for k in keys:
            route = self.route(k)
            if route.key is not None:
                layout.replayed(route.outputs, k)

    def route(self, rows: Sizes) -> Route:
        """The :class:`Route` of a call of agreed sizes ``rows``: one that replays, one that falls
        back (``run``, ``reason``), or :data:`IDLE` (a 0 in ``rows``, every output empty: no step runs)."""
        hit = self._routes.get(rows)
        if hit is not None:
            return hit
        if min(rows) < 1:  # idle in some dim on every rank: the smallest key covering a 1 there
            run = self.space.serving_sizes(rows)
            route = self._route(run)
            if route.outputs is not None and self.layout.all_empty(route.outputs, rows):
                route = Route(None, outputs=route.outputs, run=run, reason=IDLE)
        else:
            route = self._route(rows)
        if len(self._routes) >= MEMO_LIMIT:  # bounded: a miss costs a bisect per dim and two lookups
            self._routes.clear()
        self._routes[rows] = route
        return route

    def _route(self, rows: Sizes) -> Route:
        key, reason = self.space.choose(rows)
        if key is not None and key in self.pending:
            return Route(None, run=key, reason=CAPTURING)
        if key is None or not self.replayable.get(key, False):
            return Route(None, run=rows, reason=reason or CANNOT)
        hit = self._by_key.get(key)
        if hit is not None:
            return hit
        self._by_key[key] = route = self._make(key)
        return route

    def _make(self, key: Sizes) -> Route:
        """The replaying :class:`Route` of captured, replayable ``key``."""
        ext = self.space.external(key)
        if isinstance(self.backend, GraphBackend):
            replay, outputs = self.backend.replayer(ext)
        else:  # any object with replay(key): its outputs are sliced at every call
            outputs = FreshOutputs()

            def replay(b=self.backend, k=ext, box=outputs) -> None:
                box.value = b.replay(k)

        return Route(key, ext, replay, outputs, math.prod(key))
