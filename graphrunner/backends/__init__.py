"""Capture backends: one capture protocol (:class:`GraphBackend`) and three
ways to hold a captured step.

- :class:`FullGraphBackend`: the whole forward in one device graph.
- :class:`BreakableGraphBackend`: graph segments split at ``@no_graph`` calls.
- :class:`EagerBackend`: no graph; the forward runs at replay.

All share the protocol in :meth:`GraphBackend.capture_one`; see
``docs/protocol.md``.
"""

from typing import Any, Optional

from graphrunner.backends.base import GraphBackend
from graphrunner.backends.breakable import BreakableGraphBackend
from graphrunner.backends.eager import EagerBackend
from graphrunner.backends.full import FullGraphBackend

__all__ = ["GraphBackend", "FullGraphBackend", "BreakableGraphBackend", "EagerBackend", "make_backend"]

_BACKENDS = ("full", "breakable", "eager")


def make_backend(backend: Any, device: Any = "auto", group: Any = None, warmups: int = 2, trace: Any = None,
                 drift_check: Optional[bool] = None, output_arena: Any = None) -> Any:
    """The backend a :class:`~graphrunner.GraphRunner` captures with: a new one for a name
    (``"full"``, ``"breakable"``, ``"eager"``) configured with the other arguments, or the given
    instance, which must not be contradicted by them (configure an instance on itself)."""
    if isinstance(backend, str):
        classes = {"full": FullGraphBackend, "breakable": BreakableGraphBackend, "eager": EagerBackend}
        if backend not in classes:
            raise ValueError(f"unknown backend {backend!r}: expected one of {_BACKENDS} or a backend instance")
        drift = True if drift_check is None else drift_check
        if backend == "eager":  # no graphs, no output buffer: the arena has nothing to hold
            return classes[backend](device=device, group=group, warmups=warmups, trace=trace, drift_check=drift)
        return classes[backend](device=device, group=group, warmups=warmups, trace=trace, drift_check=drift,
                                output_arena=output_arena)
    if output_arena is not None and output_arena is not getattr(backend, "output_arena", None):
        raise ValueError("output_arena= was given together with a backend instance that does not use it; "
                         "pass output_arena= to the backend instead")
    missing = [m for m in ("capture_session", "capture_one", "replay", "can_run", "cleanup", "info")
               if not callable(getattr(backend, m, None))]
    if missing:
        raise TypeError(
            f"backend must be one of {_BACKENDS} or a backend instance (a graphrunner.backends.GraphBackend); "
            f"{type(backend).__name__} lacks {', '.join(missing)}"
        )
    if device not in ("auto", None) and device is not getattr(backend, "device", None):
        raise ValueError("device= was given together with a backend instance; configure the device on the backend")
    if group is not None and group is not getattr(backend, "group", None):
        raise ValueError("group= differs from the backend instance's group; the runner must agree buckets over the "
                         "group the backend captures with: pass the same object, or configure it on the backend only")
    if trace is not None:
        raise ValueError("trace= was given together with a backend instance; configure the trace on the backend")
    if drift_check is not None and drift_check != getattr(backend, "drift_check", drift_check):
        raise ValueError("checks= asks for the drift check but the backend instance has drift_check=False (or the other way round); configure it on the backend")
    return backend

