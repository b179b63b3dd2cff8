"""EagerBackend: no graph; the forward runs at every replay."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from graphrunner.backends.base import GraphBackend
from graphrunner.errors import CaptureError

__all__ = ["EagerBackend"]


class _EagerGraph:
    """Stands in for a graph: ``replay()`` calls the captured function again
    under the grad mode it was captured in."""

    def __init__(self) -> None:
        self.fn: Callable[[], None] | None = None
        self.inference = False
        self.grad = False

    def capture(self, fn: Callable[[], None]) -> None:
        """Remember ``fn`` and the current grad/inference mode; call it once."""
        self.inference = torch.is_inference_mode_enabled()
        self.grad = torch.is_grad_enabled()
        self.fn = fn
        fn()

    def replay(self) -> None:
        """Call the captured function again (CaptureError if none)."""
        if self.fn is None:
            raise CaptureError("replay() of an eager backend entry that holds no capture")
        if self.inference:
            with torch.inference_mode():
                self.fn()
        else:
            with torch.set_grad_enabled(self.grad):
                self.fn()

    def reset(self) -> None:
        """Forget the captured function."""
        self.fn = None


class EagerBackend(GraphBackend):
    """No device graph: ``replay(key)`` runs ``forward_fn()`` eagerly and
    copies its output into the shared output buffer, so outputs alias
    exactly as with the graph backends. For debugging and as a fallback.

    The capture protocol is the same as for the graph backends (warmups,
    hooks, final synchronize and barrier, one "capture" forward that binds
    the output), so a protocol problem shows up here too; only the graph is
    missing. Replay runs under the grad / inference mode of the capture.
    ``info(key)`` reports ``num_segments == 0`` and ``num_breaks == 1`` (the
    whole forward is one eager step). ``drift_check`` has no effect: Python
    state is read afresh at every replay. ``device`` defaults to ``"auto"`` and
    is used for synchronization only.
    """

    name = "eager"

    #: The forward runs again at every replay: nothing is frozen, no drift check.
    _drift_scope = None

    def _make_graph(self, key: Any) -> Any:
        return _EagerGraph()

    def _capture_into(self, graph: Any, key: Any, fn: Callable[[], None]) -> None:
        graph.capture(fn)

    def _graph_stats(self, graph: Any) -> dict[str, int]:
        return {"num_segments": 0, "num_breaks": 1}
