"""CPU intra-op thread count of the command-line tools (``--threads``).

PyTorch's default intra-op thread count is the number of cores. The demo's
and the benchmarks' ops are far too small to gain from threads, and OpenMP
workers busy-wait on cores they do not get when another process shares the
machine: on a 2-core machine with one competing process, ``graphrunner
demo`` ran 9x slower with the default than with one thread. So the CLI
runs with :data:`DEFAULT_CLI_THREADS` unless ``--threads N`` says otherwise,
and prints the count it used.

``--threads`` is at most :func:`max_threads`: :data:`THREADS_PER_CORE`
times the cores this process may use. More is never faster, and a count in
the tens of thousands crashes the OpenMP runtime (``torch.set_num_threads(100000)``
segfaults), so a larger value is a one-line usage error.

The library itself (``GraphRunner``, the backends, the tape) never changes
the caller's thread settings: only the CLI entry points use
:func:`torch_threads`, which restores the previous count on exit.
"""

from __future__ import annotations

import argparse
import contextlib
import os
from collections.abc import Iterator
from typing import Any

import torch

#: ``--threads`` default of ``graphrunner demo`` and ``graphrunner bench``:
#: one intra-op thread (small workloads; stable on a shared CPU).
DEFAULT_CLI_THREADS = 1

#: ``--threads`` may be at most this many threads per usable core (:func:`max_threads`).
THREADS_PER_CORE = 4


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity where the OS tells, else ``os.cpu_count()``)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def max_threads() -> int:
    """The largest ``--threads``: :data:`THREADS_PER_CORE` x :func:`usable_cores`."""
    return THREADS_PER_CORE * usable_cores()


def thread_count(text: str) -> int:
    """``argparse`` type of ``--threads``: a positive int <= :func:`max_threads`, else
    ``ArgumentTypeError`` (a one-line usage error)."""
    value = positive_int(text)
    top = max_threads()
    if value > top:
        raise argparse.ArgumentTypeError(
            f"{value} threads is more than {THREADS_PER_CORE} per core this process may use ({usable_cores()} "
            f"cores: at most {top}); pass --threads {top} or less (threads beyond the {usable_cores()} cores "
            "only busy-wait)"
        )
    return value


def positive_int(text: str) -> int:
    """``argparse`` type: ``text`` as an int >= 1, else ``ArgumentTypeError``
    (a one-line usage error). Used by ``--threads`` and the demo's counts."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def add_threads_argument(parser: argparse.ArgumentParser) -> None:
    """Add ``--threads N`` (1..:func:`max_threads`, default :data:`DEFAULT_CLI_THREADS`) to ``parser``."""
    parser.add_argument(
        "--threads",
        type=thread_count,
        default=DEFAULT_CLI_THREADS,
        help=f"torch intra-op CPU threads for this run, 1 to {THREADS_PER_CORE} per usable core (default: "
        f"{DEFAULT_CLI_THREADS}; the workloads are small, and more threads than free cores busy-wait: see "
        "docs/troubleshooting.md)",
    )


@contextlib.contextmanager
def torch_threads(n: int) -> Iterator[int]:
    """Run the body with ``torch.set_num_threads(n)`` and restore the previous
    count afterwards, also on an exception. Yields ``n``. Raises
    ``ValueError`` for ``n < 1`` or ``n > max_threads()`` (before changing anything)."""
    if n < 1:
        raise ValueError(f"thread count must be >= 1, got {n}")
    if n > max_threads():
        raise ValueError(
            f"thread count {n} is more than {THREADS_PER_CORE} per usable core (at most "
            f"{max_threads()} here); pass fewer threads"
        )
    previous = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield n
    finally:
        torch.set_num_threads(previous)


def thread_facts() -> dict[str, Any]:
    """``{"torch_threads", "load_average"}`` of this process now (load
    average ``None`` where the OS has none): what makes a timing comparable."""
    import os

    return {
        "torch_threads": torch.get_num_threads(),
        "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
    }
