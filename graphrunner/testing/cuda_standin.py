"""A stand-in for ``torch.cuda`` on CPU-only machines: CUDA graph conformance without a GPU.

No GPU has to be present for graphrunner's CUDA paths to be exercised: :class:`CudaStandin`
replaces the parts of ``torch.cuda`` that graphrunner (and its tests and tools) use, and
enforces the rules a real GPU would, read from torch 2.13's sources:

``aten/src/ATen/cuda/CUDAGraph.cpp``
    * ``capture_begin`` refuses a graph that already owns a captured graph ("This CUDAGraph
      instance already owns a captured graph. To capture a new graph, create a new
      instance."), and a capture on the device's default stream ("CUDA graphs must be
      captured on a non-default stream.").
    * A pool handle from ``graph_pool_handle()`` (``(0, n)``) is shared; without one a
      private pool ``(n, 0)`` is made.
    * ``capture_end`` must run on the stream the capture began on ("Capture must end on the
      same stream it began on."); an invalidated capture makes ``cudaStreamEndCapture`` fail
      *before* the allocator is told the capture ended (``endAllocateToPool``), so the
      allocator stays mid-capture for the rest of the process.
    * An empty capture warns "The CUDA Graph is empty. This usually means that the graph
      was attempted to be captured on wrong device or stream.".
    * ``reset()`` (also the destructor, i.e. dropping the last Python reference) releases
      the graph's use of its pool only if its capture ended successfully; ``pool()`` and
      ``replay()`` need a successful capture.

``c10/cuda/CUDACachingAllocator.cpp``
    * ``beginAllocateToPool`` creates a private pool or increments its use count, and
      ``TORCH_INTERNAL_ASSERT(use_count > 0)`` for a pool that still exists: a pool whose
      graphs were all released stays registered (``graph_pools_freeable``) until
      ``empty_cache()`` frees it, and cannot be captured into before that.
    * Two captures cannot record into one pool at once ("beginAllocateToPool: already
      recording to mempool_id").
    * ``empty_cache()`` synchronizes, so ``TORCH_INTERNAL_ASSERT(captures_underway.empty())``.

CUDA stream capture
    * ``torch.cuda.synchronize()``, ``Stream.synchronize()`` or ``Event.synchronize()`` while
      a capture is underway fails with "operation not permitted when stream is capturing"
      and invalidates the capture; so does a host-synchronising op (``.item()``,
      ``nonzero``, ...: the tape refuses them during capture).
    * A ``torch.distributed`` collective of a non-NCCL process group (gloo) during a capture
      synchronizes the device: it fails and invalidates the capture. NCCL collectives can
      be captured.

Every function and method is bound to the installed torch's real signature (see
:func:`check_signatures`): a call torch would refuse with ``TypeError`` is refused here too.
Tensors stay on the CPU (``CudaDevice().torch_device`` is ``cpu`` while the stand-in is
installed); each ``CUDAGraph`` captures into a :class:`~graphrunner.tape.TapeGraph` that
poisons its survivors at capture end (on a GPU they hold uninitialised pool memory until
the first replay), so replays compute real results.

What it cannot show (see ``docs/troubleshooting.md``): anything about kernels (speed,
occupancy, nondeterministic reductions, cuBLAS workspaces), real memory numbers (the pool
sizes are the tape's estimates), asynchrony (work runs when issued, so a missing
``wait_stream`` or event is recorded, not raced: the debug-mode stream check,
fed by the ``torch.cuda._gpu_trace`` hooks the stand-in fires as torch does,
refuses it at capture), work issued on a stream other than the
capture stream (the tape records it anyway; on a GPU it runs eagerly and the graph may be
empty), NCCL itself, multi-process GPU sharing, and driver or toolkit versions.

Use it from pytest through the ``cuda_standin`` / ``cuda_device`` fixtures of
``tests/conftest.py``, in-process with ``with CudaStandin().installed(): ...``, or around a
command (``GRAPHRUNNER_CUDA_STANDIN=1`` is set for its child processes, and
``graphrunner_tools.launch`` installs the stand-in in every rank)::

    python -m graphrunner.testing.cuda_standin graphrunner_tools loadtest --device cuda
"""

from __future__ import annotations

import contextlib
import inspect
import itertools
import os
import runpy
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch.cuda import _gpu_trace
from torch.utils._python_dispatch import TorchDispatchMode

from graphrunner.tape import TapeGraph, TapePool

if TYPE_CHECKING:
    from graphrunner.tape import TapeGraph

__all__ = [
    "CudaStandin",
    "check_signatures",
    "installed_standin",
    "ENV_VAR",
    "EMPTY_GRAPH_WARNING",
    "CAPTURE_UNSUPPORTED",
    "CAPTURE_INVALIDATED",
]

#: Set (to ``1``) for commands run under the stand-in; ``graphrunner_tools.launch`` installs
#: the stand-in in every spawned rank when it is set.
ENV_VAR = "GRAPHRUNNER_CUDA_STANDIN"

#: CUDAGraph.cpp's warning for a capture that recorded no work.
EMPTY_GRAPH_WARNING = (
    "The CUDA Graph is empty. This usually means that the graph was attempted to be captured on wrong device or stream."
)
#: cudaErrorStreamCaptureUnsupported, as torch reports it.
CAPTURE_UNSUPPORTED = "CUDA error: operation not permitted when stream is capturing"
#: cudaErrorStreamCaptureInvalidated, as torch reports it (from cudaStreamEndCapture).
CAPTURE_INVALIDATED = "CUDA error: operation failed due to a previous error during capture"

_NOTE = "\n[graphrunner cuda_standin: {}]"

# The real objects, read once at import (before any install), whose signatures every
# stand-in call is bound to.
_REAL: dict[str, Any] = {}
for _name in (
    "CUDAGraph",
    "graph_pool_handle",
    "Stream",
    "Event",
    "current_stream",
    "default_stream",
    "stream",
    "synchronize",
    "empty_cache",
    "memory_reserved",
    "memory_allocated",
    "max_memory_reserved",
    "max_memory_allocated",
    "reset_peak_memory_stats",
    "memory_stats",
    "memory_snapshot",
    "mem_get_info",
    "is_available",
    "device_count",
    "current_device",
    "set_device",
    "device",
    "get_device_name",
    "is_current_stream_capturing",
    "graph",
):
    _REAL[_name] = getattr(torch.cuda, _name)


def _sig(obj: Any) -> inspect.Signature:
    if isinstance(obj, type):
        return inspect.signature(obj)
    return inspect.signature(obj)


def _bound(real: Callable, method: bool = False) -> Callable[[Callable], Callable]:
    """Decorator: the function takes ``real``'s signature (``__signature__``) and every call
    is bound to it first, so what torch refuses with ``TypeError`` is refused here. The
    wrapped implementation receives the bound arguments (defaults applied) as keywords."""
    sig = inspect.signature(real)

    def deco(impl: Callable) -> Callable:
        wrapper: Callable[..., Any]
        if method:

            def method_wrapper(self, *args, **kwargs):
                ba = sig.bind(self, *args, **kwargs)
                ba.apply_defaults()
                a = dict(ba.arguments)
                a.pop(next(iter(sig.parameters)))
                extra = {}
                for p in sig.parameters.values():
                    if p.kind is p.VAR_KEYWORD:
                        extra = a.pop(p.name, {})
                return impl(self, **a, **extra)

            wrapper = method_wrapper
        else:

            def function_wrapper(*args, **kwargs):
                ba = sig.bind(*args, **kwargs)
                ba.apply_defaults()
                a = dict(ba.arguments)
                extra = {}
                for p in sig.parameters.values():
                    if p.kind is p.VAR_KEYWORD:
                        extra = a.pop(p.name, {})
                return impl(**a, **extra)

            wrapper = function_wrapper
        wrapper.__signature__ = sig  # type: ignore[attr-defined]  # inspect.signature reads a function's __signature__
        wrapper.__name__ = impl.__name__
        wrapper.__qualname__ = impl.__qualname__
        wrapper.__doc__ = impl.__doc__
        wrapper.__graphrunner_real__ = real  # type: ignore[attr-defined]  # our marker on the function object
        return wrapper

    return deco


def _internal_assert(cond: str, where: str) -> RuntimeError:
    return RuntimeError(
        f'{cond} INTERNAL ASSERT FAILED at "c10/cuda/CUDACachingAllocator.cpp" ({where}), '
        "please report a bug to PyTorch." + _NOTE.format("allocator rule")
    )


class _PrivatePool:
    __slots__ = ("id", "use_count", "tape_pool")

    def __init__(self, pool_id: tuple[int, int]) -> None:

        self.id = pool_id
        self.use_count = 1
        self.tape_pool = TapePool()


class _Allocator:
    """The private-pool bookkeeping of the CUDA caching allocator (one per device)."""

    def __init__(self) -> None:
        self.graph_pools: dict[tuple[int, int], _PrivatePool] = {}
        self.freeable: set = set()
        self.captures_underway: list[tuple[tuple[int, int], Any]] = []
        self.peak_reserved = 0

    def begin_allocate_to_pool(self, pool_id: tuple[int, int], owner: Any) -> _PrivatePool:
        pool = self.graph_pools.get(pool_id)
        if pool is None:
            pool = self.graph_pools[pool_id] = _PrivatePool(pool_id)
        else:
            if not pool.use_count > 0:
                raise _internal_assert(
                    "it->second->use_count > 0",
                    "create_or_incref_pool: a pool whose graphs "
                    "were all released is captured into again before empty_cache() freed it",
                )
            pool.use_count += 1
        for pid, _ in self.captures_underway:
            if pid == pool_id:
                raise RuntimeError(
                    "beginAllocateToPool: already recording to mempool_id" + _NOTE.format("allocator rule")
                )
        self.captures_underway.append((pool_id, owner))
        return pool

    def end_allocate_to_pool(self, pool_id: tuple[int, int]) -> None:
        for i, (pid, _) in enumerate(self.captures_underway):
            if pid == pool_id:
                del self.captures_underway[i]
                return
        raise RuntimeError("endAllocatePool: not currently recording to mempool_id" + _NOTE.format("allocator rule"))

    def release_pool(self, pool_id: tuple[int, int]) -> None:
        pool = self.graph_pools.get(pool_id)
        if pool is None:
            raise _internal_assert("it != graph_pools.end()", "get_private_pool")
        pool.use_count -= 1
        if pool.use_count < 0:
            raise _internal_assert("uc >= 0", "releasePool")
        if pool.use_count == 0:
            self.freeable.add(pool_id)

    def empty_cache(self) -> None:
        if self.captures_underway:
            raise _internal_assert(
                "captures_underway.empty()",
                "synchronize_and_free_events, called by emptyCache: "
                "a capture is underway, or one was left mid-capture by a failed capture_end",
            )
        for pid in list(self.freeable):
            self.graph_pools.pop(pid, None)
        self.freeable.clear()

    def reserved(self) -> int:
        return sum(p.tape_pool.bytes_held for p in self.graph_pools.values())

    def allocated(self) -> int:
        return sum(p.tape_pool.bytes_held for p in self.graph_pools.values() if p.use_count > 0)


def _device_index(standin: CudaStandin, device: Any, optional: bool = True) -> int:
    """torch.cuda._utils._get_device_index for the stand-in."""
    if device is None:
        if not optional:
            raise ValueError("Expected a torch.device with a specified index or an integer, but got:None")
        return standin.current_device()
    if isinstance(device, str):
        device = torch.device(device)
    if isinstance(device, torch.device):
        if device.type != "cuda":
            raise ValueError(f"Expected a cuda device, but got: {device}")
        index = device.index if device.index is not None else standin.current_device()
    elif isinstance(device, int) and not isinstance(device, bool):
        index = device
    elif isinstance(device, _StandinStream):
        index = device.device_index
    else:
        raise ValueError(f"Expected a cuda device, but got: {device!r}")
    if not 0 <= index < standin.num_devices:
        raise RuntimeError(
            f"CUDA error: invalid device ordinal (device {index} of {standin.num_devices})"
            + _NOTE.format("device_count() is " + str(standin.num_devices))
        )
    return index


class _StandinStream:
    """Base of the stand-in ``torch.cuda.Stream`` (the class is made per stand-in)."""

    standin: CudaStandin
    _ids = itertools.count(1)

    def _init(self, device_index: int, priority: int, default: bool = False) -> None:
        self.device_index = device_index
        self.priority = priority
        self.is_default = default
        self.stream_id = 0 if default else next(_StandinStream._ids)
        self.capturing: Any | None = None  # the stand-in CUDAGraph capturing on this stream
        #: Streams this one was made to wait on (``wait_stream``), in order: the stand-in runs work
        #: synchronously, so it records the ordering a GPU would need instead of racing.
        self.waited_on: list[_StandinStream] = []

    @property
    def device(self) -> torch.device:
        return torch.device("cuda", self.device_index)

    @property
    def cuda_stream(self) -> int:
        return self.stream_id

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, _StandinStream)
            and other.stream_id == self.stream_id
            and other.device_index == self.device_index
        )

    def __hash__(self) -> int:
        return hash((self.device_index, self.stream_id))

    def __repr__(self) -> str:
        kind = "default " if self.is_default else ""
        return f"<torch.cuda.Stream (standin {kind}stream {self.stream_id}) device=cuda:{self.device_index}>"


def _trace(registry: str, *args: Any) -> None:
    """Fire ``torch.cuda._gpu_trace``'s callbacks as torch's C++ does for a real stream or event call
    (event record / wait: ``(event, stream)`` handles; stream, event and device synchronize), so
    the debug-mode stream bookkeeping (:mod:`graphrunner.checks.stream_use`) sees the stand-in's joins."""

    callbacks = getattr(_gpu_trace, registry)
    if callbacks.callback_list:
        callbacks.fire_callbacks(*args)


class _StandinEvent:
    """Base of the stand-in ``torch.cuda.Event``."""

    standin: CudaStandin

    _ids = itertools.count(1)

    def _init(self, enable_timing: bool) -> None:
        self.enable_timing = enable_timing
        #: The handle the GPU trace hooks report for this event (torch: the cudaEvent_t).
        self.event_id = next(_StandinEvent._ids)
        self.t: float | None = None
        self.recorded_in_capture = False
        self.stream: _StandinStream | None = None


class CudaStandin:
    """A stand-in ``torch.cuda`` for ``num_devices`` GPUs of ``total_memory`` bytes each.

    ``installed()`` (a context manager) patches ``torch.cuda``'s attributes with the
    stand-in's and restores them on exit; ``install()``/``uninstall()`` do the same
    explicitly. ``poison`` (default ``True``): the tape of each graph poisons its survivors
    at capture end, as a CUDA capture leaves them uninitialised. State (pools, streams,
    captures underway) belongs to this object: a new stand-in starts clean, as a new
    process does.
    """

    def __init__(self, num_devices: int = 1, total_memory: int = 141 * 2**30, poison: bool = True) -> None:
        if num_devices < 1:
            raise ValueError(f"num_devices must be >= 1, got {num_devices}")
        self.num_devices = num_devices
        self.total_memory = total_memory
        self.poison = poison
        #: The tensor device a ``CudaDevice`` uses while installed (tensors stay on the CPU).
        self.tensor_device = torch.device("cpu")
        self.allocators = [_Allocator() for _ in range(num_devices)]
        self._uid = itertools.count(1)
        self._capture_ids = itertools.count(1)
        self._local = threading.local()
        self._saved: dict[str, Any] = {}
        #: Every rule violation and notable call, in order: ``(kind, detail)`` (for tests).
        self.log: list[tuple[str, str]] = []
        self._defaults: dict[int, _StandinStream] = {}
        self._build()

    # ------------------------------------------------------------------ device state
    def current_device(self) -> int:
        return getattr(self._local, "device", 0)

    def _streams(self) -> dict[int, _StandinStream]:
        s = getattr(self._local, "streams", None)
        if s is None:
            s = self._local.streams = {}
        return s

    def _default_stream(self, index: int) -> _StandinStream:
        st = self._defaults.get(index)
        if st is None:
            st = self.Stream.__new__(self.Stream)
            st._init(index, 0, default=True)
            self._defaults[index] = st
        return st

    def _current_stream(self, index: int) -> _StandinStream:
        return self._streams().get(index) or self._default_stream(index)

    def capturing_graphs(self, index: int | None = None) -> list[Any]:
        """The stand-in graphs whose capture is underway (on device ``index``, default all)."""
        out: list[Any] = []
        for i, a in enumerate(self.allocators):
            if index is None or i == index:
                out.extend(g for _, g in a.captures_underway if getattr(g, "_capturing", False))
        return out

    def _forbid_sync(self, what: str, index: int | None = None) -> None:
        """A synchronizing call during capture: invalidate the captures and raise as CUDA does."""
        graphs = self.capturing_graphs(index)
        if not graphs:
            return
        for g in graphs:
            g._invalidate(f"{what} during capture")
        self.log.append(("sync_during_capture", what))
        raise RuntimeError(
            f"{CAPTURE_UNSUPPORTED}\nCUDA kernel errors might be asynchronously reported at some "
            "other API call, so the stacktrace below might be incorrect."
            + _NOTE.format(f"{what} while a CUDA graph capture is underway; the capture is invalidated")
        )

    # ------------------------------------------------------------------ install
    def install(self) -> None:
        """Patch ``torch.cuda`` (idempotent per stand-in; one stand-in at a time)."""
        if self._saved:
            return
        if getattr(torch.cuda, "_graphrunner_standin", None) is not None:
            raise RuntimeError("another CudaStandin is installed; uninstall it first")
        for name, obj in self._api.items():
            self._saved[name] = getattr(torch.cuda, name)
            setattr(torch.cuda, name, obj)
        torch.cuda._graphrunner_standin = self  # type: ignore[attr-defined]  # our marker: not a torch.cuda name

    def uninstall(self) -> None:
        """Restore ``torch.cuda``'s own attributes."""
        for name, obj in self._saved.items():
            setattr(torch.cuda, name, obj)
        self._saved.clear()
        if getattr(torch.cuda, "_graphrunner_standin", None) is self:
            del torch.cuda._graphrunner_standin  # type: ignore[attr-defined]  # our marker: not a torch.cuda name

    @contextlib.contextmanager
    def installed(self) -> Iterator[CudaStandin]:
        """Context manager: :meth:`install` on entry, :meth:`uninstall` on exit."""
        self.install()
        try:
            yield self
        finally:
            self.uninstall()

    # ------------------------------------------------------------------ the API
    def _build(self) -> None:  # noqa: C901 - one closure per torch.cuda name, bound to its real signature
        standin = self
        R = _REAL

        class Stream(_StandinStream):
            __doc__ = "Stand-in ``torch.cuda.Stream``: an ordered queue of work on one device."

            def __new__(cls, *args, **kwargs):
                ba = inspect.signature(R["Stream"].__new__).bind(cls, *args, **kwargs)
                ba.apply_defaults()
                a = ba.arguments
                self = object.__new__(cls)
                self._init(_device_index(standin, a.get("device")), int(a.get("priority", 0)))
                return self

            def __init__(self, *args, **kwargs):
                pass

            @_bound(R["Stream"].wait_stream, method=True)
            def wait_stream(self, stream):
                if not isinstance(stream, _StandinStream):
                    raise TypeError(f"wait_stream expects a torch.cuda.Stream, got {type(stream).__name__}")
                self.waited_on.append(stream)
                standin.log.append(("wait_stream", f"{self.stream_id}<-{stream.stream_id}"))
                # torch: self.wait_event(stream.record_event()): the GPU trace sees a record and a wait
                ev = standin.Event()
                ev.record(stream)
                ev.wait(self)

            @_bound(R["Stream"].wait_event, method=True)
            def wait_event(self, event):
                event.wait(self)

            @_bound(R["Stream"].record_event, method=True)
            def record_event(self, event=None):
                event = event if event is not None else standin.Event()
                event.record(self)
                return event

            @_bound(R["Stream"].synchronize, method=True)
            def synchronize(self):
                if self.capturing is not None:
                    standin._forbid_sync("Stream.synchronize()", self.device_index)
                _trace("StreamSynchronizationCallbacks", self.stream_id)

            @_bound(R["Stream"].query, method=True)
            def query(self):
                return True

        Stream.__new__.__signature__ = inspect.signature(R["Stream"].__new__)  # type: ignore[attr-defined]  # for inspect.signature
        Stream.standin = self
        self.Stream = Stream

        class Event(_StandinEvent):
            __doc__ = "Stand-in ``torch.cuda.Event`` (host-timed: the stand-in runs work when issued)."

            def __new__(cls, *args, **kwargs):
                ba = inspect.signature(R["Event"].__new__).bind(cls, *args, **kwargs)
                ba.apply_defaults()
                self = object.__new__(cls)
                self._init(bool(ba.arguments.get("enable_timing", False)))
                return self

            def __init__(self, *args, **kwargs):
                pass

            @_bound(R["Event"].record, method=True)
            def record(self, stream=None):
                st = stream if stream is not None else standin._current_stream(standin.current_device())
                self.stream = st
                self.recorded_in_capture = st.capturing is not None
                self.t = time.perf_counter()
                _trace("EventRecordCallbacks", self.event_id, st.stream_id)

            @_bound(R["Event"].wait, method=True)
            def wait(self, stream=None):
                st = stream if stream is not None else standin._current_stream(standin.current_device())
                _trace("EventWaitCallbacks", self.event_id, st.stream_id)

            @_bound(R["Event"].synchronize, method=True)
            def synchronize(self):
                if self.stream is not None and self.stream.capturing is not None:
                    standin._forbid_sync("Event.synchronize()", self.stream.device_index)
                _trace("EventSynchronizationCallbacks", self.event_id)

            @_bound(R["Event"].query, method=True)
            def query(self):
                return True

            @_bound(R["Event"].elapsed_time, method=True)
            def elapsed_time(self, end_event):
                if not (self.enable_timing and end_event.enable_timing):
                    raise RuntimeError("Both events must be created with argument 'enable_timing=True'.")
                if self.t is None or end_event.t is None:
                    raise RuntimeError("Both events must be recorded before calculating elapsed time.")
                if self.recorded_in_capture or end_event.recorded_in_capture:
                    raise RuntimeError(
                        "CUDA error: operation not permitted on an event last recorded in a capturing stream"
                    )
                return (end_event.t - self.t) * 1000.0

        Event.__new__.__signature__ = inspect.signature(R["Event"].__new__)  # type: ignore[attr-defined]  # for inspect.signature
        Event.standin = self
        self.Event = Event

        class CUDAGraph:
            """Stand-in ``torch.cuda.CUDAGraph``: CUDAGraph.cpp's state machine around a tape."""

            # set in __new__ (bound to the real __new__'s signature)
            _keep_graph: bool
            _tape: TapeGraph
            _capture_stream: _StandinStream
            _capture_dev: int | None  # the device the capture began on (None before one began)
            _mempool_id: tuple[int, int]
            _capture_id: int
            _capture_ended: bool
            _has_graph: bool
            _has_graph_exec: bool
            _capturing: bool
            _invalidated: str | None
            _guard: _CollectiveGuard | None

            def __new__(cls, *args, **kwargs):
                ba = inspect.signature(R["CUDAGraph"].__new__).bind(cls, *args, **kwargs)
                ba.apply_defaults()
                self = object.__new__(cls)

                self._keep_graph = bool(ba.arguments.get("keep_graph", False))
                self._tape = TapeGraph(poison_captured_values=standin.poison)
                self._capture_stream = standin._current_stream(standin.current_device())
                self._capture_dev = None
                self._mempool_id = (0, 0)
                self._capture_id = 0
                self._capture_ended = False
                self._has_graph = False
                self._has_graph_exec = False
                self._capturing = False
                self._invalidated = None
                self._guard = None
                return self

            def __init__(self, *args, **kwargs):
                pass

            def _invalidate(self, why: str) -> None:
                if self._invalidated is None:
                    self._invalidated = why

            def _allocator(self) -> _Allocator:
                """The caching allocator of the device this graph's capture began on."""
                if self._capture_dev is None:
                    raise RuntimeError(
                        "stand-in CUDAGraph: no capture began on this graph, so it has no device"
                        + _NOTE.format("internal state")
                    )
                return standin.allocators[self._capture_dev]

            @_bound(R["CUDAGraph"].capture_begin, method=True)
            def capture_begin(self, pool=None, capture_error_mode="global", check_input_liveness=False):
                if capture_error_mode not in ("global", "thread_local", "relaxed"):
                    raise RuntimeError(
                        "Unknown capture error mode. Expected `global`, `thread_local`, or "
                        f"`relaxed`, got {capture_error_mode}"
                    )
                if self._has_graph_exec:
                    standin.log.append(("rule", "already owns a captured graph"))
                    raise RuntimeError(
                        "This CUDAGraph instance already owns a captured graph. To capture a new "
                        "graph, create a new instance." + _NOTE.format("CUDAGraph.cpp rule")
                    )
                dev = standin.current_device()
                stream = standin._current_stream(dev)
                if stream.is_default:
                    standin.log.append(("rule", "default stream"))
                    raise RuntimeError(
                        "CUDA graphs must be captured on a non-default stream. (However, after "
                        "capture, it's ok to replay them on the default stream.)" + _NOTE.format("CUDAGraph.cpp rule")
                    )
                self._capture_stream = stream
                self._capture_dev = dev
                if pool is not None:
                    pool = tuple(pool)
                if pool is not None and (pool[0] != 0 or pool[1] != 0):
                    if pool[0] and pool[1]:
                        raise RuntimeError(
                            "!(pool.first && pool.second) INTERNAL ASSERT FAILED at "
                            '"aten/src/ATen/cuda/CUDAGraph.cpp"' + _NOTE.format("pool handle")
                        )
                    self._mempool_id = pool
                else:
                    self._mempool_id = (next(standin._uid), 0)
                alloc = standin.allocators[dev]
                private = alloc.begin_allocate_to_pool(self._mempool_id, self)  # may raise, as the real one does
                if stream.capturing is not None:
                    # cudaStreamBeginCapture on a capturing stream; the allocator already began (as in torch).
                    raise RuntimeError(
                        "CUDA error: operation not permitted when stream is capturing"
                        + _NOTE.format("cudaStreamBeginCapture on a stream that is capturing")
                    )
                try:
                    self._tape.capture_begin(pool=private.tape_pool, capture_error_mode=capture_error_mode)
                except BaseException:
                    alloc.end_allocate_to_pool(self._mempool_id)
                    alloc.release_pool(self._mempool_id)
                    raise
                stream.capturing = self
                self._capture_id = next(standin._capture_ids)
                self._capturing = True
                self._invalidated = None
                self._guard = _CollectiveGuard(self)
                self._guard.__enter__()

            @_bound(R["CUDAGraph"].capture_end, method=True)
            def capture_end(self):
                stream = standin._current_stream(standin.current_device())
                if stream != self._capture_stream:
                    standin.log.append(("rule", "capture_end on another stream"))
                    raise RuntimeError(
                        "Capture must end on the same stream it began on." + _NOTE.format("CUDAGraph.cpp rule")
                    )
                if not self._capturing:
                    raise RuntimeError(
                        "CUDA error: operation not permitted when stream is capturing"
                        + _NOTE.format(
                            "capture_end() without a capture underway (stream is not capturing: cudaErrorIllegalState)"
                        )
                    )
                guard, self._guard = self._guard, None
                if guard is not None:
                    guard.__exit__(None, None, None)
                # cudaStreamEndCapture: the stream leaves capture mode whatever happened.
                self._capture_stream.capturing = None
                self._capturing = False
                tape_cap = self._tape._cap
                failed = getattr(tape_cap, "failed", None) if tape_cap is not None else None
                if failed is not None and self._invalidated is None:
                    # The tape refused an op that synchronizes the host: on a GPU it invalidates the capture.
                    self._invalidate(f"{type(failed).__name__} during capture")
                if self._invalidated is not None:
                    self._tape._abort()
                    standin.log.append(("invalidated_capture_end", self._invalidated))
                    # AT_CUDA_CHECK(cudaStreamEndCapture) throws here: the capture id stays registered
                    # and endAllocateToPool is never called, so the allocator stays mid-capture.
                    raise RuntimeError(
                        f"{CAPTURE_INVALIDATED}\nCUDA kernel errors might be asynchronously "
                        "reported at some other API call, so the stacktrace below might be incorrect."
                        + _NOTE.format(
                            f"the capture was invalidated ({self._invalidated}); the "
                            "caching allocator is left mid-capture"
                        )
                    )
                alloc = self._allocator()
                alloc.end_allocate_to_pool(self._mempool_id)
                self._capture_id = 0
                try:
                    self._tape._end(warn_empty=False)
                except BaseException:
                    # A tape failure at capture end (not a CUDA one): leave the graph ended and empty.
                    self._capture_ended = True
                    raise
                if self._tape.num_ops == 0:
                    warnings.warn(EMPTY_GRAPH_WARNING, UserWarning, stacklevel=3)
                self._capture_ended = True
                self._has_graph = True
                if not self._keep_graph:
                    self._has_graph_exec = True
                    self._has_graph = False

            @_bound(R["CUDAGraph"].instantiate, method=True)
            def instantiate(self):
                if not self._capture_ended:
                    raise RuntimeError("capture_end() must have been called before calling instantiate")
                self._has_graph_exec = True

            @_bound(R["CUDAGraph"].replay, method=True)
            def replay(self):
                if not self._capture_ended:
                    raise RuntimeError(
                        "Called CUDAGraph::replay without a preceding successful capture."
                        + _NOTE.format("CUDAGraph.cpp rule")
                    )
                self._has_graph_exec = True
                if self._tape.num_ops:
                    self._tape.replay()

            @_bound(R["CUDAGraph"].reset, method=True)
            def reset(self):
                if self._capture_id != 0:
                    self._capture_id = 0  # erased from _currently_capturing_graphs; nothing else
                if self._capture_ended:
                    self._allocator().release_pool(self._mempool_id)
                    self._capture_ended = False
                self._has_graph = False
                self._has_graph_exec = False
                if not self._capturing:
                    self._tape.reset()

            @_bound(R["CUDAGraph"].pool, method=True)
            def pool(self):
                if not self._capture_ended:
                    raise RuntimeError(
                        "Called CUDAGraph::pool() without a preceding successful capture."
                        + _NOTE.format("CUDAGraph.cpp rule")
                    )
                return self._mempool_id

            @_bound(R["CUDAGraph"].enable_debug_mode, method=True)
            def enable_debug_mode(self):
                pass

            def __del__(self):
                # ~CUDAGraph() calls reset(): dropping the last reference releases the pool.
                try:
                    if self._capture_ended:
                        self._allocator().release_pool(self._mempool_id)
                        self._capture_ended = False
                except Exception:  # noqa: BLE001 - never raise under GC (torch warns)
                    pass

            @property
            def num_ops(self) -> int:
                """Ops the tape recorded (stand-in only; a real CUDAGraph does not count them)."""
                return self._tape.num_ops

            def __repr__(self) -> str:
                state = "captured" if self._capture_ended else ("capturing" if self._capturing else "empty")
                return f"<torch.cuda.CUDAGraph (standin, {state}, pool={self._mempool_id})>"

        CUDAGraph.__new__.__signature__ = inspect.signature(R["CUDAGraph"].__new__)  # type: ignore[attr-defined]  # for inspect.signature
        self.CUDAGraph = CUDAGraph

        @_bound(R["graph_pool_handle"])
        def graph_pool_handle():
            return (0, next(standin._uid))

        @_bound(R["current_stream"])
        def current_stream(device=None):
            return standin._current_stream(_device_index(standin, device))

        @_bound(R["default_stream"])
        def default_stream(device=None):
            return standin._default_stream(_device_index(standin, device))

        class _StreamContext:
            def __init__(self, s):
                self.s = s
                self.prev = None
                self.prev_dev = None

            def __enter__(self):
                if self.s is None:
                    return None
                streams = standin._streams()
                self.prev_dev = standin.current_device()
                self.prev = streams.get(self.s.device_index)
                streams[self.s.device_index] = self.s
                standin._local.device = self.s.device_index
                return self.s

            def __exit__(self, *exc):
                if self.s is None:
                    return False
                streams = standin._streams()
                if self.prev is None:
                    streams.pop(self.s.device_index, None)
                else:
                    streams[self.s.device_index] = self.prev
                standin._local.device = self.prev_dev
                return False

        @_bound(R["stream"])
        def stream(stream):
            if stream is not None and not isinstance(stream, _StandinStream):
                raise TypeError(f"expected a torch.cuda.Stream, got {type(stream).__name__}")
            return _StreamContext(stream)

        @_bound(R["synchronize"])
        def synchronize(device=None):
            standin._forbid_sync("torch.cuda.synchronize()", _device_index(standin, device))
            _trace("DeviceSynchronizationCallbacks")

        @_bound(R["empty_cache"])
        def empty_cache():
            standin.log.append(("empty_cache", ""))
            for a in standin.allocators:
                a.empty_cache()

        def _alloc(device):
            return standin.allocators[_device_index(standin, device)]

        @_bound(R["memory_reserved"])
        def memory_reserved(device=None):
            a = _alloc(device)
            r = a.reserved()
            a.peak_reserved = max(a.peak_reserved, r)
            return r

        @_bound(R["memory_allocated"])
        def memory_allocated(device=None):
            return _alloc(device).allocated()

        @_bound(R["max_memory_reserved"])
        def max_memory_reserved(device=None):
            a = _alloc(device)
            a.peak_reserved = max(a.peak_reserved, a.reserved())
            return a.peak_reserved

        @_bound(R["max_memory_allocated"])
        def max_memory_allocated(device=None):
            return max_memory_reserved(device)

        @_bound(R["reset_peak_memory_stats"])
        def reset_peak_memory_stats(device=None):
            a = _alloc(device)
            a.peak_reserved = a.reserved()

        @_bound(R["memory_stats"])
        def memory_stats(device=None):
            a = _alloc(device)
            return {
                "reserved_bytes.all.current": a.reserved(),
                "reserved_bytes.all.peak": max_memory_reserved(device),
                "allocated_bytes.all.current": a.allocated(),
                "num_device_alloc": len(a.graph_pools),
            }

        @_bound(R["memory_snapshot"])
        def memory_snapshot(mempool_id=None, include_traces=True):
            # one segment per registered graph pool of every device, sized by its tape arena (the
            # keys torch's snapshot segments carry; no blocks, no traces)
            want = None if mempool_id is None else tuple(mempool_id)
            segments: list[dict[str, Any]] = []
            for index, a in enumerate(standin.allocators):
                for pid, p in a.graph_pools.items():
                    if want is not None and pid != want:
                        continue
                    size = int(p.tape_pool.bytes_held)
                    segments.append(
                        {
                            "device": index,
                            "address": 0,
                            "total_size": size,
                            "allocated_size": size if p.use_count > 0 else 0,
                            "active_size": size if p.use_count > 0 else 0,
                            "requested_size": size,
                            "stream": 0,
                            "segment_type": "large" if size > (1 << 20) else "small",
                            "segment_pool_id": pid,
                            "is_expandable": False,
                            "frames": [],
                            "blocks": [],
                        }
                    )
            return segments

        @_bound(R["mem_get_info"])
        def mem_get_info(device=None):
            return standin.total_memory - _alloc(device).reserved(), standin.total_memory

        @_bound(R["is_available"])
        def is_available():
            return True

        @_bound(R["device_count"])
        def device_count():
            return standin.num_devices

        @_bound(R["current_device"])
        def current_device():
            return standin.current_device()

        @_bound(R["set_device"])
        def set_device(device):
            standin._local.device = _device_index(standin, device)
            standin.log.append(("set_device", str(standin._local.device)))

        @_bound(R["get_device_name"])
        def get_device_name(device=None):
            return f"graphrunner cuda_standin (CPU) {_device_index(standin, device)}"

        @_bound(R["is_current_stream_capturing"])
        def is_current_stream_capturing():
            return standin._current_stream(standin.current_device()).capturing is not None

        class device:
            """Stand-in ``torch.cuda.device``: context manager that changes the current device."""

            def __init__(self, *args, **kwargs):
                ba = inspect.signature(R["device"]).bind(*args, **kwargs)
                d = ba.arguments["device"]
                self.idx = -1 if d is None or (isinstance(d, int) and d < 0) else _device_index(standin, d)
                self.prev = None

            def __enter__(self):
                self.prev = standin.current_device()
                if self.idx >= 0:
                    standin._local.device = self.idx

            def __exit__(self, *exc):
                standin._local.device = self.prev
                return False

        device.__init__.__signature__ = inspect.signature(R["device"].__init__)  # type: ignore[attr-defined]  # for inspect.signature

        class graph:
            """Stand-in ``torch.cuda.graph`` (the real context manager's steps, on the stand-in)."""

            default_capture_stream = None

            def __init__(self, *args, **kwargs):
                ba = inspect.signature(R["graph"]).bind(*args, **kwargs)
                ba.apply_defaults()
                a = ba.arguments
                if a["stream"] is None and type(self).default_capture_stream is None:
                    type(self).default_capture_stream = Stream()
                self.pool = () if a["pool"] is None else (a["pool"],)
                self.capture_stream = a["stream"] if a["stream"] is not None else type(self).default_capture_stream
                self.stream_ctx = stream(self.capture_stream)
                self.cuda_graph = a["cuda_graph"]
                self.capture_error_mode = a["capture_error_mode"]

            def __enter__(self):
                synchronize()
                empty_cache()
                self.stream_ctx.__enter__()
                self.cuda_graph.capture_begin(*self.pool, capture_error_mode=self.capture_error_mode)

            def __exit__(self, *args):
                self.cuda_graph.capture_end()
                self.stream_ctx.__exit__(*args)

        graph.__init__.__signature__ = inspect.signature(R["graph"].__init__)  # type: ignore[attr-defined]  # for inspect.signature

        self._api: dict[str, Any] = {
            "CUDAGraph": CUDAGraph,
            "graph_pool_handle": graph_pool_handle,
            "Stream": Stream,
            "Event": Event,
            "current_stream": current_stream,
            "default_stream": default_stream,
            "stream": stream,
            "synchronize": synchronize,
            "empty_cache": empty_cache,
            "memory_reserved": memory_reserved,
            "memory_allocated": memory_allocated,
            "max_memory_reserved": max_memory_reserved,
            "max_memory_allocated": max_memory_allocated,
            "reset_peak_memory_stats": reset_peak_memory_stats,
            "memory_stats": memory_stats,
            "memory_snapshot": memory_snapshot,
            "mem_get_info": mem_get_info,
            "is_available": is_available,
            "device_count": device_count,
            "current_device": current_device,
            "set_device": set_device,
            "device": device,
            "get_device_name": get_device_name,
            "is_current_stream_capturing": is_current_stream_capturing,
            "graph": graph,
        }

    # ------------------------------------------------------------------ inspection (tests)
    def allocator(self, index: int = 0) -> _Allocator:
        """The private-pool bookkeeping of device ``index`` (``graph_pools``, ``captures_underway``, ...)."""
        return self.allocators[index]

    def pool_use_count(self, pool_id: Any, index: int = 0) -> int | None:
        """The use count of a registered pool, or ``None`` when the pool is not registered."""
        p = self.allocators[index].graph_pools.get(tuple(pool_id))
        return None if p is None else p.use_count


class _CollectiveGuard(TorchDispatchMode):
    """Pushed while a stand-in graph captures: a ``c10d`` collective of a process group that is
    not NCCL synchronizes the device, which stream capture forbids (the capture is invalidated)."""

    def __init__(self, graph: Any) -> None:
        super().__init__()
        self.graph = graph

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace == "c10d" and self.graph._capturing:
            backend = _backend_of(args, kwargs)
            if "nccl" not in backend:
                self.graph._invalidate(f"a {backend} collective ({func.__name__}) during capture")
                raise RuntimeError(
                    f"ProcessGroup{backend.capitalize()} {func.__name__}: {CAPTURE_UNSUPPORTED}"
                    + _NOTE.format(
                        f"a {backend} collective synchronizes the device to copy CUDA tensors to the "
                        "host, which stream capture forbids; only NCCL collectives can be captured"
                    )
                )
        return func(*args, **kwargs)


def _backend_of(args: Any, kwargs: Any) -> str:
    """The backend name of the process group among a c10d op's arguments (default: the world's)."""
    # torch.distributed only for a collective's backend (absent from some builds)
    import torch.distributed as dist

    for a in list(args) + list(kwargs.values()):
        if type(a).__name__ in ("ProcessGroup", "ScriptObject") or hasattr(a, "_get_backend_name"):
            for get in (lambda g: g._get_backend_name(), lambda g: g.name(), lambda g: dist.get_backend(g)):
                try:
                    name = str(get(a)).lower()
                except Exception:  # noqa: BLE001
                    continue
                if name:
                    return name
    try:
        return str(dist.get_backend()).lower()
    except Exception:  # noqa: BLE001
        return "unknown"


def check_signatures(api: dict[str, Any] | None = None) -> list[str]:
    """The stand-in names whose signature differs from the installed torch's (empty when all
    conform). For classes the constructor and every public method the stand-in defines are
    compared. ``api`` (default: a fresh stand-in's) is a ``{name: object}`` map."""
    api = api if api is not None else CudaStandin()._api
    bad = []

    def same(a, b) -> bool:
        try:
            return inspect.signature(a) == inspect.signature(b)
        except (TypeError, ValueError):
            return False

    for name, obj in api.items():
        real = _REAL[name]
        if isinstance(obj, type):
            ctor = "__init__" if name in ("device", "graph") else "__new__"
            if not same(getattr(obj, ctor), getattr(real, ctor)):
                bad.append(f"{name}.{ctor}")
            for m, v in vars(obj).items():
                if m.startswith("_") or not callable(v) or isinstance(v, property):
                    continue
                if not hasattr(real, m):
                    bad.append(f"{name}.{m} (not in torch)")
                elif not same(v, getattr(real, m)):
                    bad.append(f"{name}.{m}")
        elif not same(obj, real):
            bad.append(name)
    return bad


def installed_standin() -> CudaStandin | None:
    """The stand-in installed in ``torch.cuda`` now, or ``None``."""
    return getattr(torch.cuda, "_graphrunner_standin", None)


def install_from_env() -> CudaStandin | None:
    """Install a stand-in when ``$GRAPHRUNNER_CUDA_STANDIN`` is ``1`` (spawned ranks, commands run
    under :func:`main`) and no GPU is present; return it (or the one already installed)."""
    if os.environ.get(ENV_VAR, "0") != "1":
        return None
    current = installed_standin()
    if current is not None:
        return current
    n = int(os.environ.get(ENV_VAR + "_DEVICES", "2"))
    s = CudaStandin(num_devices=n)
    s.install()
    return s


def main(argv: list[str] | None = None) -> int:
    """``python -m graphrunner.testing.cuda_standin MODULE [ARGS...]``: run ``MODULE`` as
    ``python -m`` would, with the stand-in installed (and ``$GRAPHRUNNER_CUDA_STANDIN=1`` for
    child processes)."""

    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--"]:
        argv = argv[1:]
    if not argv or argv[0] in ("-h", "--help"):
        print(main.__doc__)
        return 0 if argv else 2
    os.environ[ENV_VAR] = "1"
    install_from_env()
    sys.argv = argv
    try:
        runpy.run_module(argv[0], run_name="__main__", alter_sys=True)
    except SystemExit as exc:
        code = exc.code
        return code if isinstance(code, int) else (0 if code is None else 1)
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(main())
