"""graphrunner: capture PyTorch inference steps into device graphs and replay them.

The public API is :data:`__all__` (``help(graphrunner)`` lists it). Everything
else lives in its submodule: the CPU emulation of a CUDA graph in :mod:`graphrunner.tape`
(``TapeGraph``, ``tape_graph``, ``TapePool``, ...), the backends a runner drives in
:mod:`graphrunner.backends` (``FullGraphBackend``, ``BreakableGraphBackend``, ``EagerBackend``),
the segment controls of a breakable capture in :mod:`graphrunner.breakable` (``force_no_graph``,
``is_in_breakable_graph``), trace internals in
:mod:`graphrunner.trace` (``Event``, ``EventKind``, ``NullTrace``), the capture protocol's
named steps and its order checker in :mod:`graphrunner.backends.protocol` (``Step``,
``check_capture_order``), report rows
in :mod:`graphrunner.report` (``BucketReport``, ``RunnerStats``), the device
protocol in :mod:`graphrunner.devices` (``Device``). ``graphrunner.hf`` (needs
``transformers``) is imported on first access.
"""

from graphrunner.errors import (
    CaptureError,
    CaptureUnsafeOpError,
    ContractError,
    GraphRunnerError,
    PaddingLeakError,
    RankTimeoutError,
)

__version__ = "0.1.0"
import importlib

from graphrunner.arena import OutputArena
from graphrunner.breakable import BreakableGraph, breakable_graph, no_graph
from graphrunner.checks import PaddingCheck
from graphrunner.checks.compare import CompareReport
from graphrunner.checks.lint import check_factory
from graphrunner.devices import CudaDevice, TapeDevice, get_device
from graphrunner.group import LocalGroup, TorchDistGroup
from graphrunner.planning import plan_buckets
from graphrunner.report import CaptureReport
from graphrunner.runner import BatchInput, GraphRunner, default_buckets
from graphrunner.trace import Trace

#: The public API: every name above (``help(graphrunner)`` lists these).
__all__ = [
    "__version__",
    # errors
    "CaptureError",
    "CaptureUnsafeOpError",
    "ContractError",
    "GraphRunnerError",
    "PaddingLeakError",
    "RankTimeoutError",
    # devices
    "CudaDevice",
    "TapeDevice",
    "get_device",
    # breakable graphs
    "BreakableGraph",
    "breakable_graph",
    "no_graph",
    # rank groups
    "LocalGroup",
    "TorchDistGroup",
    # tracing
    "Trace",
    # the runner and its reports
    "BatchInput",
    "GraphRunner",
    "default_buckets",
    "plan_buckets",
    "CaptureReport",
    "OutputArena",
    # checks
    "PaddingCheck",
    "CompareReport",
    "check_factory",
]


def __getattr__(name):
    """Lazy ``gr.hf``: imports :mod:`graphrunner.hf` (which needs ``transformers``) on first access."""
    if name == "hf":
        return importlib.import_module("graphrunner.hf")
    raise AttributeError(f"module 'graphrunner' has no attribute {name!r}")
