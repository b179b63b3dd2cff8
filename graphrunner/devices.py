"""Devices: where graphs are made, captured and synchronized.

A device is any object with ``synchronize()``, ``new_graph()``,
``graph_pool()``, ``capture_stream()`` and ``capture(graph, ...)``. Two are
provided:

- :class:`CudaDevice`: real ``torch.cuda.CUDAGraph`` graphs, one shared memory
  pool and one capture stream per device object.
- :class:`TapeDevice`: :class:`~graphrunner.tape.TapeGraph` graphs, the CPU
  emulation of CUDA graphs; works on any torch device.

:func:`get_device` picks one. Every graph the library makes comes from
``device.new_graph()`` and is captured through ``device.capture(graph)``, so
tests can inject a recording device.
"""

from __future__ import annotations

import contextlib
import warnings
import weakref
from typing import Any, Iterator

import torch

__all__ = ["Device", "TapeDevice", "CudaDevice", "get_device"]


class Device:
    """Base of the devices: the interface the backends and breakable graphs use.

    Subclasses set ``kind`` ("tape" or "cuda") and ``torch_device`` and
    implement the five methods below.
    """

    kind: str = "abstract"
    torch_device: torch.device

    def synchronize(self) -> None:
        """Block until all work queued on this device has finished."""
        raise NotImplementedError

    def new_graph(self) -> Any:
        """Return a new, empty graph (``capture_begin``/``capture_end``/``replay``/``reset``)."""
        raise NotImplementedError

    def graph_pool(self) -> Any:
        """Return the memory-pool handle shared by every graph captured on this device object."""
        raise NotImplementedError

    def capture_stream(self) -> Any:
        """Return the stream captures run on (``None`` where streams do not apply)."""
        raise NotImplementedError

    def capture(self, graph: Any, stream: Any = None, capture_error_mode: str = "global", pool: Any = None):
        """Context manager: capture the work done inside it into ``graph``.

        Uses ``pool`` (default: this device's shared pool) and, unless
        ``stream`` is given, the capture stream. On an exception inside the
        block the capture is ended (its state cleaned up) and the exception
        propagates.
        """
        raise NotImplementedError

    def warmup_context(self):
        """Context manager that warmup forwards and hooks run in: the stream
        captures run on, so per-stream lazy state (library handles,
        workspaces) exists before capture. A no-op where streams do not apply."""
        return contextlib.nullcontext()

    def is_empty(self, graph: Any) -> bool:
        """True if a finished capture recorded no work (such segments are dropped)."""
        return getattr(graph, "num_ops", None) == 0

    def release_pool(self) -> None:
        """Forget the shared pool handle once its graphs are reset; the next
        capture starts a fresh pool (a CUDA pool whose graphs were all reset
        cannot be captured into again)."""
        self._pool = None

    def __repr__(self) -> str:
        return f"{type(self).__name__}({str(self.torch_device)!r})"


class TapeDevice(Device):
    """Graphs are :class:`~graphrunner.tape.TapeGraph` tapes over tensors on ``torch_device``.

    ``synchronize`` waits for the device when it is a CUDA device and is a
    no-op on CPU. There is no capture stream.

    ``poison_captured_values``: every graph this device makes fills the
    tensors that survive its capture (outputs, a segment's results handed to
    an eager break) with a poison value at capture end (NaN; an integer
    dtype's maximum; ``True``), as a CUDA capture, which launches nothing,
    leaves them holding uninitialised memory until the first replay. Replay
    is unchanged. ``None`` (the default) reads ``$GRAPHRUNNER_TAPE_POISON``
    (``1`` enables it) when the device is made; see
    :class:`~graphrunner.tape.TapeGraph`.

    ``jit_replay``: the graphs replay through a TorchScript trace of their
    generated code where it allows (bit-identical, less per-op overhead;
    :mod:`graphrunner.tape.jit`). ``None`` (the default) reads
    ``$GRAPHRUNNER_TAPE_JIT`` (``0`` turns it off) when the device is made.
    """

    kind = "tape"

    def __init__(self, torch_device: str | torch.device = "cpu",
                 poison_captured_values: bool | None = None, jit_replay: bool | None = None) -> None:
        from graphrunner.tape import _resolve_poison
        from graphrunner.tape.jit import jit_default

        self.torch_device = torch.device(torch_device)
        #: Whether the graphs this device makes poison their survivors at capture end.
        self.poison_captured_values: bool = _resolve_poison(poison_captured_values, "TapeDevice")
        if jit_replay is not None and not isinstance(jit_replay, bool):
            raise TypeError(f"jit_replay must be True, False or None, got {type(jit_replay).__name__}")
        #: Whether the graphs this device makes replay through a TorchScript trace where they can.
        self.jit_replay: bool = jit_default() if jit_replay is None else jit_replay
        self._pool = None

    def synchronize(self) -> None:
        """Wait for queued work (CUDA tensors only; CPU work is synchronous)."""
        if self.torch_device.type == "cuda":
            torch.cuda.synchronize(self.torch_device)

    def new_graph(self):
        """Return a new, empty :class:`~graphrunner.tape.TapeGraph` (poisoning
        its survivors at capture end when ``poison_captured_values``)."""
        from graphrunner.tape import TapeGraph

        return TapeGraph(poison_captured_values=self.poison_captured_values, jit_replay=self.jit_replay)

    def graph_pool(self):
        """Return this device's shared tape pool handle (made on first use)."""
        if self._pool is None:
            from graphrunner.tape import graph_pool_handle

            self._pool = graph_pool_handle()
        return self._pool

    def owns_memory(self, tensor: torch.Tensor) -> bool:
        """True if ``tensor``'s memory belongs to a captured tape graph (it
        survived a capture and the graph refreshes it at each replay): the
        graph keeps that memory, so holders such as an eager break need not
        keep the tensor object itself (optional device method)."""
        from graphrunner.tape.survivors import survivor_graph

        return survivor_graph(tensor) is not None

    def capture_stream(self) -> None:
        """Tapes have no streams: always ``None``."""
        return None

    def capture(self, graph, stream=None, capture_error_mode: str = "global", pool=None):
        """Capture into ``graph`` as :func:`~graphrunner.tape.tape_graph` does
        (``pool``: default the device's), without its "graph is empty"
        warning: :meth:`is_empty` tells callers, which drop such captures (a
        breakable graph's segment between back-to-back breaks)."""
        from graphrunner.tape import _capturing

        return _capturing(graph, pool if pool is not None else self.graph_pool(), capture_error_mode,
                          warn_empty=False)

    def __repr__(self) -> str:
        extra = ", poison_captured_values=True" if self.poison_captured_values else ""
        extra += "" if self.jit_replay else ", jit_replay=False"
        return f"TapeDevice({str(self.torch_device)!r}{extra})"


class CudaDevice(Device):
    """Real CUDA graphs on one GPU.

    All graphs made through one ``CudaDevice`` share one memory pool
    (``torch.cuda.graph_pool_handle()``) and are captured on one side stream,
    as serving engines do, so segments of a breakable graph and the graphs of
    all buckets reuse the same memory.
    """

    kind = "cuda"

    def __init__(self, index: int | None = None) -> None:
        if not torch.cuda.is_available():
            raise ValueError(
                "CudaDevice needs a CUDA GPU, and torch.cuda.is_available() is False here. "
                "Use get_device('auto') (falls back to the tape emulation) or TapeDevice()."
            )
        if index is None:
            index = torch.cuda.current_device()
        self.torch_device = torch.device("cuda", index)
        self._pool = None
        self._stream = None
        self._empty_graphs: "weakref.WeakKeyDictionary[Any, bool]" = weakref.WeakKeyDictionary()

    def synchronize(self) -> None:
        """``torch.cuda.synchronize`` on this GPU."""
        torch.cuda.synchronize(self.torch_device)

    def new_graph(self) -> "torch.cuda.CUDAGraph":
        """Return a new, empty ``torch.cuda.CUDAGraph``."""
        return torch.cuda.CUDAGraph()

    def graph_pool(self):
        """Return the pool handle shared by every graph of this device (made on first use)."""
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        return self._pool

    def capture_stream(self) -> "torch.cuda.Stream":
        """Return the side stream every capture of this device runs on (made on first use)."""
        if self._stream is None:
            self._stream = torch.cuda.Stream(device=self.torch_device)
        return self._stream

    @contextlib.contextmanager
    def _on_capture_stream(self, stream=None) -> Iterator["torch.cuda.Stream"]:
        stream = stream if stream is not None else self.capture_stream()
        current = torch.cuda.current_stream(self.torch_device)
        stream.wait_stream(current)
        with torch.cuda.device(self.torch_device), torch.cuda.stream(stream):
            yield stream
        current.wait_stream(stream)

    def warmup_context(self):
        """Run warmups on the capture stream, as ``torch.cuda`` recommends, so
        cuBLAS handles and workspaces for that stream exist before capture."""
        return self._on_capture_stream()

    @contextlib.contextmanager
    def capture(self, graph, stream=None, capture_error_mode: str = "global", pool=None) -> Iterator[None]:
        """Capture into ``graph`` on the capture stream, into ``pool`` (default: the shared pool).

        Unlike ``torch.cuda.graph`` this neither synchronizes nor collects
        garbage on entry: the capture protocol synchronizes once before the
        first segment, and a breakable graph enters here once per segment. A
        capture that recorded no work is marked so that :meth:`is_empty` can
        drop it, instead of printing torch's "CUDA Graph is empty" warning.
        """
        pool = pool if pool is not None else self.graph_pool()
        with self._on_capture_stream(stream):
            graph.capture_begin(pool=pool, capture_error_mode=capture_error_mode)
            try:
                yield
            except BaseException:
                with contextlib.suppress(Exception):
                    graph.capture_end()
                with contextlib.suppress(Exception):
                    graph.reset()
                if stream is None:
                    self._stream = None  # a failed capture may leave the stream bound to the pool
                raise
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                graph.capture_end()
            empty = False
            for w in caught:
                if "empty" in str(w.message).lower() and "graph" in str(w.message).lower():
                    empty = True
                else:
                    warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
            self._empty_graphs[graph] = empty

    def is_empty(self, graph) -> bool:
        """True if the capture of ``graph`` recorded no kernels."""
        return self._empty_graphs.get(graph, False)


_KINDS = ("auto", "tape", "cuda")
_DEVICE_METHODS = ("synchronize", "new_graph", "graph_pool", "capture_stream", "capture")


def get_device(kind: "str | Device | None" = "auto") -> Device:
    """Return a device.

    ``"auto"`` (or ``None``) gives a :class:`CudaDevice` when CUDA is
    available, else a :class:`TapeDevice` on CPU; ``"cuda"`` and ``"tape"``
    force one (``"cuda"`` raises ``ValueError`` without a GPU). Any object that
    has the device methods (``synchronize``, ``new_graph``, ``graph_pool``,
    ``capture_stream``, ``capture``) is returned unchanged, so a custom or
    recording device can be injected everywhere a device is taken; one that
    lacks some raises ``TypeError`` naming them.
    """
    if kind is None:
        kind = "auto"
    if not isinstance(kind, str):
        missing = [m for m in _DEVICE_METHODS if not callable(getattr(kind, m, None))]
        if not missing:
            return kind
        raise TypeError(
            f"device must be one of {_KINDS} or a device object with {', '.join(_DEVICE_METHODS)}; "
            f"{type(kind).__name__} lacks {', '.join(missing)}. Subclass graphrunner.devices.Device "
            "(or TapeDevice) to get the optional methods"
        )
    if kind == "auto":
        return CudaDevice() if torch.cuda.is_available() else TapeDevice("cpu")
    if kind == "cuda":
        return CudaDevice()
    if kind == "tape":
        return TapeDevice("cpu")
    raise ValueError(f"unknown device {kind!r}: expected one of {_KINDS} or a device object")
