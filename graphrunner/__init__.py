"""graphrunner: capture PyTorch inference steps into device graphs and replay them."""

from graphrunner.errors import (CaptureError, CaptureUnsafeOpError, ContractError, GraphRunnerError, PaddingLeakError,
                                RankTimeoutError)

__version__ = "0.1.0"
from graphrunner.devices import CudaDevice, Device, TapeDevice, get_device
from graphrunner.breakable import BreakableCUDAGraph, BreakableGraph, breakable_graph, force_no_graph, is_in_breakable_graph, no_graph
from graphrunner.tape import EscapedTensorWarning, TapeGraph, TapePool, graph_pool_handle, is_tape_capturing, tape_graph
from graphrunner.group import LocalGroup, TorchDistGroup
from graphrunner.trace import Event, EventKind, NullTrace, Trace, check_capture_order
from graphrunner.backends import BreakableGraphBackend, EagerBackend, FullGraphBackend, GraphBackend
from graphrunner.runner import BatchInput, GraphRunner, RunnerStats, default_buckets
from graphrunner.report import BucketReport, CaptureReport
from graphrunner.arena import OutputArena
from graphrunner.checks import PaddingCheck

#: The public API: every name above (``help(graphrunner)`` lists these).
__all__ = [
    "__version__",
    # errors
    "CaptureError", "CaptureUnsafeOpError", "ContractError", "GraphRunnerError", "PaddingLeakError", "RankTimeoutError",
    # devices
    "CudaDevice", "Device", "TapeDevice", "get_device",
    # breakable graphs
    "BreakableCUDAGraph", "BreakableGraph", "breakable_graph", "force_no_graph", "is_in_breakable_graph", "no_graph",
    # tape (CPU emulation of CUDA graphs)
    "EscapedTensorWarning", "TapeGraph", "TapePool", "graph_pool_handle", "is_tape_capturing", "tape_graph",
    # rank groups
    "LocalGroup", "TorchDistGroup",
    # tracing
    "Event", "EventKind", "NullTrace", "Trace", "check_capture_order",
    # backends
    "BreakableGraphBackend", "EagerBackend", "FullGraphBackend", "GraphBackend",
    # the runner and its report
    "BatchInput", "GraphRunner", "RunnerStats", "default_buckets", "BucketReport", "CaptureReport",
    "OutputArena",
    # checks
    "PaddingCheck",
]


def __getattr__(name):
    """Lazy submodules: ``gr.hf`` imports :mod:`graphrunner.hf` (needs ``transformers``) on first access."""
    if name == "hf":
        import importlib

        return importlib.import_module("graphrunner.hf")
    raise AttributeError(f"module 'graphrunner' has no attribute {name!r}")
