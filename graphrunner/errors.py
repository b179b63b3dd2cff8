"""Error classes raised by graphrunner.

Every error a user can cause is a ``ValueError``/``TypeError`` or one of the
classes below, with a message that names what was wrong and what to do.
"""

from __future__ import annotations


class GraphRunnerError(RuntimeError):
    """Base class of graphrunner's own errors."""


class CaptureUnsafeOpError(GraphRunnerError):
    """An operation that a device graph cannot hold ran during capture.

    Raised by a tape capture for host-synchronising or data-dependent-shape
    operations (``.item()``, ``nonzero``, boolean masking, ``.cpu()``, ...),
    the way CUDA stream capture fails on a GPU. The message names the op and
    the user's source line; move that code into a ``@no_graph`` function.
    """


class CaptureError(GraphRunnerError):
    """Capture was misused (nested capture, replay of an empty graph, autograd
    recording during capture), or a forward failed during capture; in the
    latter case the message names the shape key and the original exception
    is chained as ``__cause__``."""


class RankTimeoutError(GraphRunnerError):
    """A barrier or agreement across ranks did not complete within the
    group's timeout: a peer rank died, raised, or is stuck. The message names
    this rank, the phase and the shape key."""
