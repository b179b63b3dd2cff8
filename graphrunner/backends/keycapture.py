"""One key's capture in progress: what the phases of the capture protocol share.

:meth:`GraphBackend.capture_one <graphrunner.backends.base.GraphBackend.capture_one>`
runs its phases (warmups, bind outputs, capture, fail) on one :class:`KeyCapture`;
the graph holds only its :class:`BoundForward`, the function it captured.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Hashable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from graphrunner.backends.outputs import OutputBuffer
from graphrunner.recording.hooks import Capture, CaptureHook
from graphrunner.recording.ops import OpRecorder

__all__ = ["BoundForward", "KeyCapture"]


class BoundForward:
    """The function a key's graph holds: ``forward_fn()``, then its output copied into the key's
    views of the shared output buffer.

    The views are bound from the last warmup's output (:meth:`bind`) or, without warmups, by
    the first call; a later call's output must have the same structure. While :attr:`recorder`
    is set (during the capture), the forward's ops are fed to the hooks' consumers through
    ``recording(recorder)`` (the backend's
    :meth:`~graphrunner.backends.base.GraphBackend._recording_capture`); a backend that
    installs the recorder elsewhere (the breakable backend, inside each segment) reads it here.
    """

    __slots__ = ("forward_fn", "key", "lead_dims", "buffer", "recording", "recorder", "spec", "views")

    def __init__(
        self,
        forward_fn: Callable[[], Any],
        key: Hashable,
        lead_dims: int,
        buffer: OutputBuffer,
        recording: Callable[[OpRecorder], Any],
    ) -> None:
        self.forward_fn, self.key, self.lead_dims, self.buffer = forward_fn, key, lead_dims, buffer
        self.recording = recording
        #: The hooks' op recorder of the capture, or ``None`` (no hook watches it, or it is over).
        self.recorder: OpRecorder | None = None
        self.spec: Any = None
        #: The key's views of the shared output buffer, once bound.
        self.views: list[torch.Tensor] | None = None

    def bind(self, out: Any) -> list[torch.Tensor]:
        """Bind the key's views for output ``out`` (the first key allocates the shared buffer);
        returns them."""
        if not self.buffer.allocated:
            self.buffer.allocate(out, self.key)
        self.spec, views = self.buffer.views(out, self.key, self.lead_dims)
        self.views = views
        return views

    def __call__(self) -> None:
        with self.recording(self.recorder) if self.recorder is not None else contextlib.nullcontext():
            result = self.forward_fn()
        views = self.views
        if views is None:
            views = self.bind(result)
        else:
            self.buffer.views(result, self.key, self.lead_dims)  # same structure as at warmup, or a clear error
        OutputBuffer.copy_into(views, result)


@dataclass(eq=False)
class KeyCapture:
    """One key's capture in progress.

    ``cap``: the capture as the hooks see it; ``hooks``: the backend's then the call's;
    ``bound``: the forward the graph will hold; ``step``: what runs now (named in the
    error of a failed capture); ``graph``: set at construction; ``t0`` ... ``t_end``: when
    the capture began, the warmups ended, the graph capture began and ended.
    """

    key: Hashable
    cap: Capture
    hooks: list[CaptureHook]
    bound: BoundForward
    capture_inputs: Any
    step: str = "start"
    graph: Any = None
    t0: float = field(default_factory=time.perf_counter)
    t_warm: float = 0.0
    t_cap: float = 0.0
    t_end: float = 0.0

    def call_hooks(self, point: str, *args: Any, step: str | None = None) -> None:
        """Every hook's ``point`` method on ``(cap, *args)``, timed as the checks'; ``step``
        (``"{} check"``) names each hook's call as the step that runs."""
        for h in self.hooks:
            if step is not None:
                self.step = step.format(h.name)
            with self.cap.timing():
                getattr(h, point)(self.cap, *args)

    def new_recorder(self, consumers: Sequence[Any]) -> OpRecorder | None:
        """The one op recorder feeding ``consumers`` (``None`` for none); the frames above the
        forward are not the user's."""
        if not consumers:
            return None
        return OpRecorder(consumers, stop=getattr(self.bound.forward_fn, "__code__", None))

    @contextlib.contextmanager
    def watching(self, consumers: Sequence[Any]) -> Iterator[None]:
        """Feed the ops of the block to ``consumers`` (nothing without any); the recorder's time
        counts as the checks'."""
        rec = self.new_recorder(consumers)
        if rec is None:
            yield
            return
        with rec:
            yield
        self.cap.check_seconds += rec.seconds
