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
import copy
import os
import warnings
import weakref
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch

from graphrunner.errors import CaptureError
from graphrunner.tape import TapeGraph, graph_pool_handle, streams
from graphrunner.tape.graph import capturing_into
from graphrunner.tape.jit import jit_default
from graphrunner.tape.pool import pools_bytes
from graphrunner.tape.streams import TapeEvent, TapeStream, current_stream, default_stream, stream
from graphrunner.tape.survivors import resolve_poison, survivor_graph

if TYPE_CHECKING:
    from graphrunner.tape import TapePool

__all__ = ["Device", "TapeDevice", "CudaDevice", "get_device"]


class Device:
    """Base of the devices: the interface the backends and breakable graphs use.

    Subclasses set ``kind`` ("tape" or "cuda") and ``torch_device`` and
    implement the five methods below.
    """

    kind: str = "abstract"
    torch_device: torch.device
    # the shared pool's bookkeeping, set by the subclasses that have a pool
    _pool: Any
    _pool_graphs: list[weakref.ref[Any]]

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
        self._pool_graphs = []

    def with_own_pool(self) -> Device:
        """A device like this one (same torch device, settings and capture stream) whose graphs
        share a memory pool of their own, not this device's (optional device method).

        A :class:`~graphrunner.GraphRunner` with ``memory_budget=`` given a device object
        captures through one: runners given one device object otherwise share its pool (their
        graphs reuse each other's memory), so the budget would count memory other runners'
        graphs use, and memory its restart freed would stay in the shared pool. A shallow copy
        with no pool yet; a subclass with state of its own to separate overrides it."""
        twin = copy.copy(self)
        twin._pool = None
        twin._pool_graphs = []
        return twin

    def pool_in_use(self) -> bool:
        """Whether a graph captured into this device's pool still holds it (captured, not reset):
        ``cleanup()`` of one backend then keeps the pool (another runner's graphs sharing the device
        live in it) instead of :meth:`release_pool` (optional device method)."""
        graphs = [ref() for ref in getattr(self, "_pool_graphs", ())]
        return any(g is not None and _holds_pool(g) for g in graphs)

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

    def __init__(
        self,
        torch_device: str | torch.device = "cpu",
        poison_captured_values: bool | None = None,
        jit_replay: bool | None = None,
    ) -> None:

        self.torch_device = torch.device(torch_device)
        #: Whether the graphs this device makes poison their survivors at capture end.
        self.poison_captured_values: bool = resolve_poison(poison_captured_values, "TapeDevice")
        if jit_replay is not None and not isinstance(jit_replay, bool):
            raise TypeError(f"jit_replay must be True, False or None, got {type(jit_replay).__name__}")
        #: Whether the graphs this device makes replay through a TorchScript trace where they can.
        self.jit_replay: bool = jit_default() if jit_replay is None else jit_replay
        self._pool: TapePool | None = None
        self._pool_graphs = []  # graphs captured into the current pool

    def synchronize(self) -> None:
        """Wait for queued work (CUDA tensors; CPU work is synchronous) and for every tape
        stream: side-stream writes deferred until a join land (:mod:`graphrunner.tape.streams`)."""

        streams.synchronize()
        if self.torch_device.type == "cuda":
            torch.cuda.synchronize(self.torch_device)

    # -- streams (graphrunner.tape.streams: torch.cuda's API on the tape) ----
    def new_stream(self, priority: int = 0, name: str | None = None):
        """A new :class:`~graphrunner.tape.TapeStream` (``torch.cuda.Stream()``)."""

        return TapeStream(priority=priority, name=name)

    def new_event(self, enable_timing: bool = False):
        """A new :class:`~graphrunner.tape.TapeEvent` (``torch.cuda.Event()``)."""

        return TapeEvent(enable_timing=enable_timing)

    def current_stream(self):
        """This thread's current tape stream (``torch.cuda.current_stream()``)."""

        return current_stream()

    def default_stream(self):
        """The tape's default stream (``torch.cuda.default_stream()``)."""

        return default_stream()

    def stream(self, s):
        """Context manager: ``s`` is this thread's current stream in the block (``torch.cuda.stream(s)``)."""

        return stream(s)

    def new_graph(self):
        """Return a new, empty :class:`~graphrunner.tape.TapeGraph` (poisoning
        its survivors at capture end when ``poison_captured_values``)."""

        return TapeGraph(poison_captured_values=self.poison_captured_values, jit_replay=self.jit_replay)

    def graph_pool(self):
        """Return this device's shared tape pool handle (made on first use)."""
        if self._pool is None:
            self._pool = graph_pool_handle()
        return self._pool

    def owns_memory(self, tensor: torch.Tensor) -> bool:
        """True if ``tensor``'s memory belongs to a captured tape graph (it
        survived a capture and the graph refreshes it at each replay): the
        graph keeps that memory, so holders such as an eager break need not
        keep the tensor object itself (optional device method)."""

        return survivor_graph(tensor) is not None

    def memory_reserved(self) -> int:
        """Estimated bytes of every live tape pool of the process (their arenas), as CUDA's
        ``memory_reserved()`` counts every pool of the allocator: this device's shared pool and the
        pools of its own that other devices (a runner with ``memory_budget=``, ``with_own_pool()``)
        hold. :meth:`pool_bytes` is this device object's pool alone."""

        return pools_bytes()

    def pool_bytes(self) -> int:
        """Estimated bytes of this device object's tape pool (its arena's blocks,
        :attr:`TapePool.bytes_held <graphrunner.tape.TapePool.bytes_held>`; 0 before the first
        capture and after ``release_pool()``)."""
        return int(self._pool.bytes_held) if self._pool is not None else 0

    def capture_stream(self) -> None:
        """Tapes have no streams: always ``None``."""
        return None

    def capture(self, graph, stream=None, capture_error_mode: str = "global", pool=None):
        """Capture into ``graph`` as :func:`~graphrunner.tape.tape_graph` does
        (``pool``: default the device's), without its "graph is empty"
        warning: :meth:`is_empty` tells callers, which drop such captures (a
        breakable graph's segment between back-to-back breaks).

        ``stream``: ``None`` captures on the current stream; a
        :class:`~graphrunner.tape.TapeStream` is forked from the current
        stream, made current for the capture and joined back after it (also
        when the block raises), as :class:`CudaDevice` does with its capture
        stream."""

        if pool is None:
            pool = self.graph_pool()
            held = [r for r in getattr(self, "_pool_graphs", ()) if r() is not None]
            self._pool_graphs = held + [weakref.ref(graph)]
        if stream is None:
            return capturing_into(graph, pool, capture_error_mode, warn_empty=False)
        return self._capture_on(graph, stream, capture_error_mode, pool)

    @contextlib.contextmanager
    def _capture_on(self, graph, stream, capture_error_mode: str, pool) -> Iterator[None]:

        current = streams.current_stream()
        stream.wait_stream(current)
        try:
            with streams.stream(stream), capturing_into(graph, pool, capture_error_mode, warn_empty=False):
                yield
        finally:
            current.wait_stream(stream)  # also when the block raised: later work must not race it

    def __repr__(self) -> str:
        extra = ", poison_captured_values=True" if self.poison_captured_values else ""
        extra += "" if self.jit_replay else ", jit_replay=False"
        return f"TapeDevice({str(self.torch_device)!r}{extra})"


#: Set once a CUDA capture could not be ended (an invalidated capture): the caching allocator
#: still believes that capture is underway, for the rest of the process (torch 2.13's
#: ``CUDAGraph::capture_end`` throws before ``endAllocateToPool``). ``None`` while healthy.
_ALLOCATOR_MID_CAPTURE: str | None = None

_RESTART = (
    "The CUDA caching allocator is left mid-capture for the rest of this process (torch's "
    "CUDAGraph::capture_end threw before it told the allocator that the capture ended): "
    "torch.cuda.empty_cache() and any out-of-memory retry would fail an INTERNAL ASSERT, and no further "
    "capture is safe. Restart the process, after fixing the cause above"
)


def _collective_in(exc: BaseException) -> str | None:
    """The torch.distributed function an exception was raised in (walking its traceback and
    its chain), or None: a collective that failed inside a CUDA graph capture."""
    seen = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        tb = e.__traceback__
        while tb is not None:
            code = tb.tb_frame.f_code
            if code.co_filename.replace("\\", "/").endswith("torch/distributed/distributed_c10d.py"):
                return code.co_name
            tb = tb.tb_next
        e = e.__cause__ or e.__context__
    return None


def _holds_pool(graph: Any) -> bool:
    """Whether ``graph`` (a ``torch.cuda.CUDAGraph`` or a ``TapeGraph``, or ``None`` once dropped)
    still holds its memory pool: a CUDA graph's ``pool()`` answers only after a successful capture,
    until ``reset()``; a tape's ``replay_engine`` is ``None`` before a capture and after a reset."""
    if graph is None:
        return False

    if isinstance(graph, TapeGraph):
        return graph.replay_engine is not None
    try:
        graph.pool()
    except Exception:  # noqa: BLE001 - "without a preceding successful capture": reset or never captured
        return False
    return True


class CudaDevice(Device):
    """Real CUDA graphs on one GPU.

    All graphs made through one ``CudaDevice`` share one memory pool
    (``torch.cuda.graph_pool_handle()``) and are captured on one side stream,
    as serving engines do, so segments of a breakable graph and the graphs of
    all buckets reuse the same memory.

    The pool stays capturable: a CUDA pool whose graphs were all released
    (reset, or dropped: an empty breakable segment, a failed capture, a
    ``BreakableGraph.reset()``) stays registered in the caching allocator with
    use count 0 until ``empty_cache()`` frees it, and cannot be captured into
    before that (``INTERNAL ASSERT use_count > 0``). So before each capture into
    a pool that a capture already began in, the device checks that a graph it
    captured into the pool still holds it (``graph.pool()`` answers only while
    it does) and otherwise starts a fresh pool handle: also when the only
    capture was one that failed (it is ended and reset, which released its
    use), so a backend can retry its first key in the same capture session.

    A capture that fails is ended and reset; if CUDA cannot end it (the capture
    was invalidated: a device synchronize, ``.item()``, a non-NCCL collective
    inside the step) the allocator is left mid-capture for the rest of the
    process, and the :class:`~graphrunner.errors.CaptureError` raised says that
    the process must be restarted; every later capture in the process is
    refused with that message. A collective that fails inside a capture is
    reported as such (only NCCL collectives can be captured), never as a rank
    timeout.

    ``torch_device`` is ``cuda:<index>``; under the CUDA stand-in of
    :mod:`graphrunner.testing.cuda_standin` it is the CPU, where the stand-in
    keeps tensors.
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
        #: The GPU every ``torch.cuda`` call of this device names.
        self.cuda_device = torch.device("cuda", index)
        standin = getattr(torch.cuda, "_graphrunner_standin", None)
        self.torch_device = standin.tensor_device if standin is not None else self.cuda_device
        self._pool: torch.cuda._POOL_HANDLE | None = None
        self._pool_graphs = []  # graphs captured into the current pool
        self._pool_begun = False  # a capture began in the current pool: the allocator registered it
        self._stream: torch.cuda.Stream | None = None
        self._empty_graphs: weakref.WeakKeyDictionary[Any, bool] = weakref.WeakKeyDictionary()

    def __repr__(self) -> str:
        return f"CudaDevice({str(self.cuda_device)!r})"

    def synchronize(self) -> None:
        """``torch.cuda.synchronize`` on this GPU."""
        torch.cuda.synchronize(self.cuda_device)

    def new_graph(self) -> torch.cuda.CUDAGraph:
        """Return a new, empty ``torch.cuda.CUDAGraph``."""
        return torch.cuda.CUDAGraph()

    def graph_pool(self):
        """Return the pool handle shared by every graph of this device (made on first use)."""
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
            self._pool_graphs = []
            self._pool_begun = False
        return self._pool

    def release_pool(self) -> None:
        """Forget the shared pool handle once its graphs are reset; the next
        capture starts a fresh pool."""
        self._pool = None
        self._pool_graphs = []
        self._pool_begun = False

    def pool_in_use(self) -> bool:
        """Whether a graph captured into this device's pool still holds it (:meth:`Device.pool_in_use`)."""
        return self._pool is not None and any(_holds_pool(ref()) for ref in self._pool_graphs)

    def with_own_pool(self) -> CudaDevice:
        """A ``CudaDevice`` on the same GPU, capturing on the same side stream, whose graphs share
        a pool of their own (:meth:`Device.with_own_pool`): its pool bookkeeping starts empty."""
        self.capture_stream()  # made now, so that the twin captures on the same stream
        twin = copy.copy(self)
        twin.release_pool()
        return twin

    def pool_bytes(self) -> int:
        """Bytes of the segments the caching allocator holds for this device object's pool
        (``torch.cuda.memory_snapshot()``, the segments whose ``segment_pool_id`` is the pool's
        handle; 0 without a pool). Unlike ``memory_reserved()`` it counts no other pool and no
        eager allocation on the GPU: another runner capturing or serving on the same GPU leaves
        it unchanged."""
        if self._pool is None:
            return 0
        pool = tuple(self._pool)
        try:
            segments = torch.cuda.memory_snapshot(include_traces=False)  # no trace entries, where torch takes it
        except TypeError:
            segments = torch.cuda.memory_snapshot()
        return sum(int(seg.get("total_size", 0)) for seg in segments if tuple(seg.get("segment_pool_id", ())) == pool)

    def _live_pool(self) -> Any:
        """The shared pool for the next capture, made fresh when a capture began in the current
        one and no graph captured into it holds it any more (every graph reset or dropped, or the
        only capture failed): the caching allocator keeps such a pool with use count 0 until
        ``empty_cache`` frees it, and refuses to capture into it before."""
        if self._pool is not None and self._pool_begun:
            self._pool_graphs = [ref for ref in self._pool_graphs if _holds_pool(ref())]
            if not self._pool_graphs:
                self.release_pool()
        return self.graph_pool()

    def capture_stream(self) -> torch.cuda.Stream:
        """Return the side stream every capture of this device runs on (made on first use)."""
        if self._stream is None:
            self._stream = torch.cuda.Stream(device=self.cuda_device)
        return self._stream

    @contextlib.contextmanager
    def _on_capture_stream(self, stream=None) -> Iterator[torch.cuda.Stream]:
        stream = stream if stream is not None else self.capture_stream()
        current = torch.cuda.current_stream(self.cuda_device)
        stream.wait_stream(current)
        try:
            with torch.cuda.device(self.cuda_device), torch.cuda.stream(stream):
                yield stream
        finally:
            current.wait_stream(stream)  # also when the block raised: later work must not race it

    def warmup_context(self):
        """Run warmups on the capture stream, as ``torch.cuda`` recommends, so
        cuBLAS handles and workspaces for that stream exist before capture."""
        return self._on_capture_stream()

    # -- streams: the same names as TapeDevice's, over torch.cuda -------------
    def new_stream(self, priority: int = 0, name: str | None = None) -> torch.cuda.Stream:
        """A new ``torch.cuda.Stream`` on this GPU (``name`` is accepted for parity with the tape)."""
        return torch.cuda.Stream(device=self.cuda_device, priority=priority)

    def new_event(self, enable_timing: bool = False) -> torch.cuda.Event:
        """A new ``torch.cuda.Event``."""
        return torch.cuda.Event(enable_timing=enable_timing)

    def current_stream(self) -> torch.cuda.Stream:
        """``torch.cuda.current_stream`` of this GPU."""
        return torch.cuda.current_stream(self.cuda_device)

    def default_stream(self) -> torch.cuda.Stream:
        """``torch.cuda.default_stream`` of this GPU."""
        return torch.cuda.default_stream(self.cuda_device)

    def stream(self, s):
        """``torch.cuda.stream(s)``."""
        return torch.cuda.stream(s)

    def empty_cache(self) -> None:
        """``torch.cuda.empty_cache()``: return cached blocks (and the memory of pools whose
        graphs were all released) to the driver, as ``torch.cuda.graph`` does before a capture.
        Raises :class:`~graphrunner.errors.CaptureError` once a failed capture left the
        allocator mid-capture (it would fail an internal assert)."""
        self._refuse_if_mid_capture()
        torch.cuda.empty_cache()

    def memory_reserved(self) -> int:
        """Bytes the caching allocator holds on this GPU (``torch.cuda.memory_reserved``)."""
        return int(torch.cuda.memory_reserved(self.cuda_device))

    def mem_get_info(self) -> tuple[int, int]:
        """``(free, total)`` bytes of this GPU (``torch.cuda.mem_get_info``)."""
        free, total = torch.cuda.mem_get_info(self.cuda_device)
        return int(free), int(total)

    @staticmethod
    def _refuse_if_mid_capture() -> None:
        if _ALLOCATOR_MID_CAPTURE is not None:
            raise CaptureError(
                f"no CUDA capture is possible in this process any more: an earlier capture failed "
                f"({_ALLOCATOR_MID_CAPTURE}). {_RESTART}."
            )

    @contextlib.contextmanager
    def capture(self, graph, stream=None, capture_error_mode: str = "global", pool=None) -> Iterator[None]:
        """Capture into ``graph`` on the capture stream, into ``pool`` (default: the shared pool).

        Unlike ``torch.cuda.graph`` this neither synchronizes nor collects
        garbage on entry: the capture protocol synchronizes once before the
        first segment, and a breakable graph enters here once per segment. A
        capture that recorded no work is marked so that :meth:`is_empty` tells
        (torch's "CUDA Graph is empty" warning becomes that mark: a breakable
        segment between back-to-back breaks is dropped, an empty full graph is
        an error of the backend).

        On an exception inside the block the capture is ended and the graph
        reset, and the exception propagates; a collective that failed inside
        the capture, or a capture CUDA cannot end (invalidated), becomes a
        :class:`~graphrunner.errors.CaptureError` that says so (the latter: the
        process must be restarted), chaining the original.
        """

        self._refuse_if_mid_capture()
        own_pool = pool is None
        pool = self._live_pool() if own_pool else pool
        if own_pool:
            self._pool_begun = True  # from capture_begin on, the allocator counts this pool's uses
        with self._on_capture_stream(stream):
            graph.capture_begin(pool=pool, capture_error_mode=capture_error_mode)
            try:
                yield
            except BaseException as exc:
                end_error = None
                try:
                    with warnings.catch_warnings():
                        warnings.simplefilter("ignore")  # "CUDA Graph is empty": the step failed first
                        graph.capture_end()
                except Exception as e:  # noqa: BLE001 - reported below, with the original
                    end_error = e
                with contextlib.suppress(Exception):
                    graph.reset()
                collective = _collective_in(exc) if isinstance(exc, Exception) else None
                what = (
                    f"torch.distributed.{collective} failed inside a CUDA graph capture: only NCCL collectives "
                    "can be captured (a gloo or MPI collective on CUDA tensors synchronizes the device, which "
                    "stream capture forbids). Use an NCCL process group for collectives inside the step, or "
                    "call them in a @no_graph function with the breakable backend"
                    if collective is not None
                    else None
                )
                if end_error is not None:
                    global _ALLOCATOR_MID_CAPTURE
                    cause = what or f"{type(exc).__name__}: {str(exc).strip()[:600]}"
                    _ALLOCATOR_MID_CAPTURE = cause
                    raise CaptureError(
                        f"{cause}. CUDA could not end the capture ({type(end_error).__name__}: "
                        f"{str(end_error).strip().splitlines()[0] if str(end_error).strip() else ''}). {_RESTART}."
                    ) from exc
                if what is not None:
                    raise CaptureError(f"{what}: {type(exc).__name__}: {str(exc).strip()[:300]}") from exc
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
            if own_pool:
                self._pool_graphs.append(weakref.ref(graph))

    def is_empty(self, graph) -> bool:
        """True if the capture of ``graph`` recorded no kernels."""
        return self._empty_graphs.get(graph, False)


_KINDS = ("auto", "tape", "cuda")
_DEVICE_METHODS = ("synchronize", "new_graph", "graph_pool", "capture_stream", "capture")


#: Environment variable that says what ``get_device("auto")`` means: ``tape`` (the test suite
#: sets it, so CPU tests stay on the tape on a GPU machine), ``cuda``, or ``auto`` / unset.
DEVICE_ENV_VAR = "GRAPHRUNNER_DEVICE"


def get_device(kind: str | Device | None = "auto") -> Device:
    """Return a device.

    ``"auto"`` (or ``None``) gives a :class:`CudaDevice` when CUDA is
    available, else a :class:`TapeDevice` on CPU; ``$GRAPHRUNNER_DEVICE``
    (``tape`` or ``cuda``) overrides what ``"auto"`` means (the test suite sets
    ``tape``). ``"cuda"`` and ``"tape"`` force one (``"cuda"`` raises
    ``ValueError`` without a GPU). Any object that
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
        env = os.environ.get(DEVICE_ENV_VAR, "auto").strip().lower() or "auto"
        if env not in _KINDS:
            raise ValueError(
                f"${DEVICE_ENV_VAR} is {os.environ.get(DEVICE_ENV_VAR)!r}: expected one of {_KINDS} "
                "(or unset); it says what device='auto' means"
            )
        if env != "auto":
            return get_device(env)
        return CudaDevice() if torch.cuda.is_available() else TapeDevice("cpu")
    if kind == "cuda":
        return CudaDevice()
    if kind == "tape":
        return TapeDevice("cpu")
    raise ValueError(f"unknown device {kind!r}: expected one of {_KINDS} or a device object")
