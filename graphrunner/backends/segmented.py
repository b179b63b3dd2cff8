"""BreakableGraphBackend: graph segments with eager breaks per key (the ``"breakable"`` backend;
the graph it makes, :class:`~graphrunner.breakable.BreakableGraph`, is in :mod:`graphrunner.breakable`)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from graphrunner.backends.base import GraphBackend
from graphrunner.breakable import BreakableGraph, breakable_graph, no_graph
from graphrunner.recording.ops import RecordingDevice
from graphrunner.trace import Trace

__all__ = ["BreakableGraphBackend"]


class BreakableGraphBackend(GraphBackend):
    """Capture each key as a :class:`~graphrunner.breakable.BreakableGraph`:
    every ``@no_graph`` call in the forward ends a graph segment and runs
    eagerly (once at capture, again at each replay).

    Args (in addition to :class:`~graphrunner.backends.base.GraphBackend`'s):
        debug_eager: capture the whole forward as a single eager break
            (the same code path, no device graph at all), to tell a graph
            bug from a model bug: if outputs are right with
            ``debug_eager=True`` and wrong without, the graph is at fault.

    During capture the group's barrier (``phase="capture_break"``) is the
    breakable graph's ``barrier_fn``, so all ranks realign before every
    eager break (eager code often holds collectives). Replay calls no
    barrier. Segment and eager-break events are recorded by the
    ``BreakableGraph`` into this backend's trace. ``info(key)`` reports the
    graph's ``num_segments`` and ``num_breaks``. The drift check
    (``drift_check=True``) compares only the ops outside ``@no_graph``
    bodies: those bodies run again at every replay, so Python state they
    read is not frozen (their Python return values are checked at replay).
    """

    name = "breakable"

    #: Ops inside ``@no_graph`` bodies run eagerly at every replay: the drift
    #: check compares only the ops the segments hold.
    _drift_scope: str | None = "segments"

    def __init__(
        self,
        device: Any = None,
        group: Any = None,
        warmups: int = 2,
        trace: Trace | None = None,
        debug_eager: bool = False,
        drift_check: bool = True,
        *,
        output_arena: Any = None,
        hooks: Any = (),
    ):
        super().__init__(
            device=device,
            group=group,
            warmups=warmups,
            trace=trace,
            drift_check=drift_check,
            output_arena=output_arena,
            hooks=hooks,
        )
        self.debug_eager = bool(debug_eager)
        if self.debug_eager:
            self.name = "breakable_debug_eager"
            self._drift_scope = None  # the whole step is one eager break: nothing is frozen

    def _make_graph(self, key: Any) -> Any:

        return BreakableGraph(device=self.device, trace=self.trace if self.trace else None, key=key, backend=self.name)

    def _break_barrier(self, key: Any, *args: Any, **kwargs: Any) -> None:
        """The barrier before each eager break during capture."""
        self._barrier(key, "capture_break")

    def _capture_into(self, graph: Any, key: Any, fn: Callable[[], None]) -> None:

        body = no_graph(fn) if self.debug_eager else fn
        recorder = getattr(fn, "recorder", None)  # the hooks' recorder of this capture (BoundForward)
        if recorder is not None:
            graph.device = RecordingDevice(self.device, recorder)  # records inside each segment
        try:
            with breakable_graph(
                graph,
                stream=self.device.capture_stream(),
                capture_error_mode=self.capture_error_mode,
                barrier_fn=functools.partial(self._break_barrier, key),
            ):
                body()
        finally:
            graph.device = self.device  # drop the hooks' RecordingDevice: replay and pool() need the real one

    def _recording_capture(self, recorder: Any) -> Any:
        # The recorder's modes are installed inside each segment (_capture_into):
        # around the whole step they would break the segments' mode nesting.
        return recorder.recording()

    def _graph_stats(self, graph: Any) -> dict[str, int]:
        d = {"num_segments": int(graph.num_segments), "num_breaks": int(graph.num_breaks)}
        ops = getattr(graph, "num_ops", None)
        if isinstance(ops, int):
            d["num_ops"] = ops
        collectives = getattr(graph, "num_collectives", None)
        if isinstance(collectives, int):
            d["num_collectives"] = collectives
        return d
