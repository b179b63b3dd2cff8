"""Capture backends: one capture protocol (:class:`GraphBackend`) and three
ways to hold a captured step.

- :class:`FullGraphBackend`: the whole forward in one device graph.
- :class:`BreakableGraphBackend`: graph segments split at ``@no_graph`` calls.
- :class:`EagerBackend`: no graph; the forward runs at replay.

All share the protocol in :meth:`GraphBackend.capture_one`; see
``docs/protocol.md``.

``GRAPHRUNNER_DISABLE=1`` in the environment turns graphs off in a deployed
engine without a code change: :func:`make_backend` (what every
:class:`~graphrunner.GraphRunner` calls) then returns an
:class:`EnvDisabledBackend`, an :class:`EagerBackend` whose name, capture
report, trace events and ``info(key)`` say that the environment disabled
graphs, whatever backend was asked for.
"""

import logging
import os
from typing import Any

from graphrunner._env import env_flag
from graphrunner.backends.base import GraphBackend
from graphrunner.backends.eager import EagerBackend
from graphrunner.backends.full import FullGraphBackend
from graphrunner.backends.segmented import BreakableGraphBackend

__all__ = [
    "GraphBackend",
    "FullGraphBackend",
    "BreakableGraphBackend",
    "EagerBackend",
    "EnvDisabledBackend",
    "make_backend",
    "graphs_disabled",
    "DISABLE_ENV_VAR",
]

logger = logging.getLogger("graphrunner")

_BACKENDS = ("full", "breakable", "eager")

#: The environment variable that turns graphs off (``1``/``true``/``yes``/``on``).
DISABLE_ENV_VAR = "GRAPHRUNNER_DISABLE"


def graphs_disabled() -> bool:
    """Whether ``GRAPHRUNNER_DISABLE`` turns graphs off: ``1``/``true``/``yes``/``on`` (any case)
    yes; unset, empty, ``0``/``false``/``no``/``off`` no; anything else is a ``ValueError``
    (:func:`graphrunner._env.env_flag`)."""
    return env_flag(
        DISABLE_ENV_VAR, "set it to 1 to serve every runner eagerly (no graphs), or 0 / unset it to capture graphs"
    )


class EnvDisabledBackend(EagerBackend):
    """The backend of every runner made while ``GRAPHRUNNER_DISABLE=1``: an
    :class:`EagerBackend` (the same capture protocol and output buffer, no
    graph: every call runs the step eagerly) that says why. ``requested`` is
    the backend that was asked for (a name, or the class name of an
    instance); ``name`` (in the capture report and every trace event) and
    ``info(key)`` (``graphs_disabled``, ``requested_backend``) name the
    variable."""

    def __init__(self, requested: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        #: The backend the runner asked for.
        self.requested = requested
        #: What disabled graphs: ``"GRAPHRUNNER_DISABLE=1"``.
        self.disabled_by = f"{DISABLE_ENV_VAR}={os.environ.get(DISABLE_ENV_VAR, '1').strip()}"
        self.name = f"eager (graphs disabled by {self.disabled_by}; {requested} requested)"

    def _graph_stats(self, graph: Any) -> dict[str, Any]:
        stats: dict[str, Any] = dict(super()._graph_stats(graph))
        stats.update(graphs_disabled=self.disabled_by, requested_backend=self.requested)
        return stats


def make_backend(
    backend: Any,
    device: Any = "auto",
    group: Any = None,
    warmups: int = 2,
    trace: Any = None,
    drift_check: bool | None = None,
    output_arena: Any = None,
    own_pool: bool = False,
) -> Any:
    """The backend a :class:`~graphrunner.GraphRunner` captures with: a new one for a name
    (``"full"``, ``"breakable"``, ``"eager"``) configured with the other arguments, or the given
    instance, which must not be contradicted by them (configure an instance on itself).

    ``own_pool`` (a runner with ``memory_budget=``): a device *object* given with a name is used
    through its ``with_own_pool()`` where it has one
    (:meth:`graphrunner.devices.Device.with_own_pool`), so the backend's graphs live in a pool of
    their own even when other runners share that device's pool: the budget then counts exactly
    this runner's graphs, and a restart releases only its own pool. An instance keeps its device.

    With ``GRAPHRUNNER_DISABLE=1`` the arguments are checked as usual, then an
    :class:`EnvDisabledBackend` is returned instead (an instance's device,
    group, warmups and trace carried over): capture makes no graphs and every
    call runs eagerly through the same runner."""
    disabled = graphs_disabled()
    if not disabled or not isinstance(backend, str):
        if (
            own_pool
            and isinstance(backend, str)
            and device is not None
            and not isinstance(device, str)
            and callable(getattr(device, "with_own_pool", None))
        ):
            device = device.with_own_pool()
        chosen = _make_backend(backend, device, group, warmups, trace, drift_check, output_arena)
        if not disabled:
            return chosen
        # an instance: its configuration carries over
        device, group, warmups, trace = chosen.device, chosen.group, chosen.warmups, chosen.trace
        drift_check = bool(getattr(chosen, "drift_check", True))
    elif backend not in _BACKENDS:
        raise ValueError(f"unknown backend {backend!r}: expected one of {_BACKENDS} or a backend instance")
    requested = backend if isinstance(backend, str) else type(backend).__name__
    logger.warning(
        "%s: serving eagerly through the runner, no graphs captured (backend %s requested)",
        f"{DISABLE_ENV_VAR}={os.environ.get(DISABLE_ENV_VAR, '').strip()}",
        requested,
    )
    return EnvDisabledBackend(
        requested,
        device=device,
        group=group,
        warmups=warmups,
        trace=trace,
        drift_check=True if drift_check is None else drift_check,
    )


def _make_backend(
    backend: Any, device: Any, group: Any, warmups: int, trace: Any, drift_check: bool | None, output_arena: Any
) -> Any:
    if isinstance(backend, str):
        classes = {"full": FullGraphBackend, "breakable": BreakableGraphBackend, "eager": EagerBackend}
        if backend not in classes:
            raise ValueError(f"unknown backend {backend!r}: expected one of {_BACKENDS} or a backend instance")
        drift = True if drift_check is None else drift_check
        if backend == "eager":  # no graphs, no output buffer: the arena has nothing to hold
            return classes[backend](device=device, group=group, warmups=warmups, trace=trace, drift_check=drift)
        return classes[backend](
            device=device, group=group, warmups=warmups, trace=trace, drift_check=drift, output_arena=output_arena
        )
    if output_arena is not None and output_arena is not getattr(backend, "output_arena", None):
        raise ValueError(
            "output_arena= was given together with a backend instance that does not use it; "
            "pass output_arena= to the backend instead"
        )
    missing = [
        m
        for m in ("capture_session", "capture_one", "replay", "can_run", "cleanup", "info")
        if not callable(getattr(backend, m, None))
    ]
    if missing:
        raise TypeError(
            f"backend must be one of {_BACKENDS} or a backend instance (a graphrunner.backends.GraphBackend); "
            f"{type(backend).__name__} lacks {', '.join(missing)}"
        )
    if device not in ("auto", None) and device is not getattr(backend, "device", None):
        raise ValueError("device= was given together with a backend instance; configure the device on the backend")
    if group is not None and group is not getattr(backend, "group", None):
        raise ValueError(
            "group= differs from the backend instance's group; the runner must agree buckets over the "
            "group the backend captures with: pass the same object, or configure it on the backend only"
        )
    if trace is not None:
        raise ValueError("trace= was given together with a backend instance; configure the trace on the backend")
    if drift_check is not None and drift_check != getattr(backend, "drift_check", drift_check):
        raise ValueError(
            "checks= asks for the drift check but the backend instance has drift_check=False (or the other way round); configure it on the backend"
        )
    return backend
