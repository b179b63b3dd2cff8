"""FullGraphBackend: the whole forward in one device graph per key."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from graphrunner.backends.base import GraphBackend
from graphrunner.errors import CaptureError

__all__ = ["FullGraphBackend"]


class FullGraphBackend(GraphBackend):
    """Capture the whole forward of each key into one graph from
    ``device.new_graph()`` (a ``torch.cuda.CUDAGraph`` on CUDA, a
    ``TapeGraph`` otherwise), captured through ``device.capture(graph)``
    with the device's shared pool and capture stream.

    The forward must be fully capturable: a ``@no_graph`` function inside it
    is a plain call here (use :class:`BreakableGraphBackend` to break).
    Constructor and API: see :class:`~graphrunner.backends.base.GraphBackend`.
    ``info(key)`` reports ``num_segments == 1`` and ``num_breaks == 0``.
    A capture that recorded no work (``device.is_empty(graph)``; on CUDA
    torch's "CUDA Graph is empty" warning, its only sign of work issued on
    another stream or device) is a :class:`~graphrunner.errors.CaptureError`.
    """

    name = "full"

    def _make_graph(self, key: Any) -> Any:
        return self.device.new_graph()

    def _capture_into(self, graph: Any, key: Any, fn: Callable[[], None]) -> None:
        with self.device.capture(graph, capture_error_mode=self.capture_error_mode):
            fn()
        is_empty = getattr(self.device, "is_empty", None)
        if is_empty is not None and is_empty(graph):
            raise CaptureError(
                f'the full graph of shape key {key!r} captured no work (torch: "The CUDA Graph is empty. This '
                'usually means that the graph was attempted to be captured on wrong device or stream."); its '
                "replay would do nothing. Run the step's work on the current stream and device inside the "
                "capture (no torch.cuda.stream(...) or device switch of its own), and make it return a tensor"
            )

    def _graph_stats(self, graph: Any) -> dict[str, int]:
        d = {"num_segments": 1, "num_breaks": 0}
        ops = getattr(graph, "num_ops", None)  # tape graphs count their recorded aten ops
        if isinstance(ops, int):
            d["num_ops"] = ops
        collectives = getattr(graph, "num_collectives", None)
        if isinstance(collectives, int):
            d["num_collectives"] = collectives
        return d
