"""CPU intra-op thread count of the command-line tools (``--threads``).

PyTorch's default intra-op thread count is the number of cores. The demo's
and the benchmarks' ops are far too small to gain from threads, and OpenMP
workers busy-wait on cores they do not get when another process shares the
machine: on a 2-core machine with one competing process, ``graphrunner
demo`` ran 9x slower with the default than with one thread. So the CLI
runs with :data:`DEFAULT_CLI_THREADS` unless ``--threads N`` says otherwise,
and prints the count it used.

The library itself (``GraphRunner``, the backends, the tape) never changes
the caller's thread settings: only the CLI entry points use
:func:`torch_threads`, which restores the previous count on exit.
"""

from __future__ import annotations

import argparse
import contextlib
from typing import Any, Iterator

import torch

#: ``--threads`` default of ``graphrunner demo`` and ``graphrunner bench``:
#: one intra-op thread (small workloads; stable on a shared CPU).
DEFAULT_CLI_THREADS = 1


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
    """Add ``--threads N`` (a positive int, default :data:`DEFAULT_CLI_THREADS`) to ``parser``."""
    parser.add_argument(
        "--threads", type=positive_int, default=DEFAULT_CLI_THREADS,
        help=f"torch intra-op CPU threads for this run (default: {DEFAULT_CLI_THREADS}; the workloads are "
             "small, and more threads than free cores busy-wait: see docs/troubleshooting.md)")


@contextlib.contextmanager
def torch_threads(n: int) -> Iterator[int]:
    """Run the body with ``torch.set_num_threads(n)`` and restore the previous
    count afterwards, also on an exception. Yields ``n``. Raises
    ``ValueError`` for ``n < 1``."""
    if n < 1:
        raise ValueError(f"thread count must be >= 1, got {n}")
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

    return {"torch_threads": torch.get_num_threads(),
            "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None}
