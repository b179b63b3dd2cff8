"""Capture backends: one capture protocol (:class:`GraphBackend`) and three
ways to hold a captured step.

- :class:`FullGraphBackend`: the whole forward in one device graph.
- :class:`BreakableGraphBackend`: graph segments split at ``@no_graph`` calls.
- :class:`EagerBackend`: no graph; the forward runs at replay.

All share the protocol in :meth:`GraphBackend.capture_one`; see
``docs/protocol.md``.
"""

from graphrunner.backends.base import GraphBackend
from graphrunner.backends.breakable import BreakableGraphBackend
from graphrunner.backends.eager import EagerBackend
from graphrunner.backends.full import FullGraphBackend

__all__ = ["GraphBackend", "FullGraphBackend", "BreakableGraphBackend", "EagerBackend"]
