"""graphrunner: capture PyTorch inference steps into device graphs and replay them.

The public API is :data:`__all__` (``help(graphrunner)`` lists it). Everything
else lives in its submodule: tape internals in :mod:`graphrunner.tape`
(``tape_graph``, ``graph_pool_handle``, ``TapePool``, ...), trace internals in
:mod:`graphrunner.trace` (``Event``, ``EventKind``, ``NullTrace``), report rows
in :mod:`graphrunner.report` (``BucketReport``, ``RunnerStats``), the device
protocol in :mod:`graphrunner.devices` (``Device``). ``graphrunner.hf`` (needs
``transformers``) is imported on first access.
"""

from graphrunner.errors import (CaptureError, CaptureUnsafeOpError, ContractError, GraphRunnerError, PaddingLeakError,
                                RankTimeoutError)

__version__ = "0.1.0"
from graphrunner.devices import CudaDevice, TapeDevice, get_device
from graphrunner.breakable import BreakableGraph, breakable_graph, force_no_graph, is_in_breakable_graph, no_graph
from graphrunner.tape import TapeGraph
from graphrunner.group import LocalGroup, TorchDistGroup
from graphrunner.trace import Trace, check_capture_order
from graphrunner.backends import BreakableGraphBackend, EagerBackend, FullGraphBackend, GraphBackend
from graphrunner.runner import BatchInput, GraphRunner, default_buckets
from graphrunner.report import CaptureReport
from graphrunner.planning import plan_buckets
from graphrunner.arena import OutputArena
from graphrunner.checks import PaddingCheck
from graphrunner.checks.compare import CompareReport
from graphrunner.checks.lint import check_factory

#: The public API: every name above (``help(graphrunner)`` lists these).
__all__ = [
    "__version__",
    # errors
    "CaptureError", "CaptureUnsafeOpError", "ContractError", "GraphRunnerError", "PaddingLeakError", "RankTimeoutError",
    # devices
    "CudaDevice", "TapeDevice", "get_device",
    # breakable graphs
    "BreakableGraph", "breakable_graph", "force_no_graph", "is_in_breakable_graph", "no_graph",
    # the CPU emulation of a CUDA graph
    "TapeGraph",
    # rank groups
    "LocalGroup", "TorchDistGroup",
    # tracing
    "Trace", "check_capture_order",
    # backends
    "BreakableGraphBackend", "EagerBackend", "FullGraphBackend", "GraphBackend",
    # the runner and its reports
    "BatchInput", "GraphRunner", "default_buckets", "plan_buckets", "CaptureReport", "OutputArena",
    # checks
    "PaddingCheck", "CompareReport", "check_factory",
]

#: Names that left the top level in 0.1.0 -> the module that keeps them. They
#: still resolve (with a ``DeprecationWarning`` naming that module) for one
#: release; import them from there.
_MOVED = {
    "Device": "graphrunner.devices",
    "BreakableCUDAGraph": "graphrunner.breakable",
    "EscapedTensorWarning": "graphrunner.tape",
    "TapePool": "graphrunner.tape",
    "graph_pool_handle": "graphrunner.tape",
    "is_tape_capturing": "graphrunner.tape",
    "tape_graph": "graphrunner.tape",
    "Event": "graphrunner.trace",
    "EventKind": "graphrunner.trace",
    "NullTrace": "graphrunner.trace",
    "BucketReport": "graphrunner.report",
    "RunnerStats": "graphrunner.report",
}


def __getattr__(name):
    """Lazy ``gr.hf`` (imports :mod:`graphrunner.hf`, which needs ``transformers``,
    on first access), and the names moved out of the top level (see ``_MOVED``):
    they resolve from their module with a ``DeprecationWarning`` naming it."""
    import importlib

    if name == "hf":
        return importlib.import_module("graphrunner.hf")
    home = _MOVED.get(name)
    if home is not None:
        import warnings

        warnings.warn(f"graphrunner.{name} is deprecated and will be removed in the next release: "
                      f"use {home}.{name} (from {home} import {name})", DeprecationWarning, stacklevel=2)
        return getattr(importlib.import_module(home), name)
    raise AttributeError(f"module 'graphrunner' has no attribute {name!r}")
