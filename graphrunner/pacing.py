"""How a background capture shares the machine with the calls it serves beside: :class:`Pace`.

A key's capture holds the runner's lock (calls wait for it) and takes the cores
the calls need. With ``share`` below 1 the capture takes at most that share of
the time while calls come: after a key that took ``d`` seconds the thread rests
:func:`rest_after` ``(d, share)`` = ``d * (1 - share) / share`` seconds before
the next one. It rests only while the runner is busy: once no call came for
``idle`` seconds (an idle server, a gap between requests) it captures at full
speed again. ``share=1`` never rests (every key back to back, a waiting call
first). One formula for every capture that shares time with serving: the keys
of a background capture here, and a re-plan's captures in
:mod:`graphrunner.hf.ladder`.
"""

from __future__ import annotations

import contextlib
import math
import threading
import time
from collections.abc import Callable, Iterator

__all__ = ["IDLE_SECONDS", "Pace", "check_share", "rest_after"]

#: Seconds without a call after which the runner counts as idle and a resting capture goes on.
IDLE_SECONDS = 0.05


def check_share(share: float, what: str = "share") -> float:
    """``share`` as a float in ``(0, 1]``; ``ValueError`` naming ``what`` otherwise (0, negative, NaN, > 1)."""
    try:
        value = float(share)
    except (TypeError, ValueError):
        raise ValueError(f"{what} must be a number in (0, 1], got {share!r}") from None
    if math.isnan(value) or not 0 < value <= 1:
        raise ValueError(f"{what} must be a share of the time in (0, 1] (1: no rest), got {share!r}")
    return value


def rest_after(capture_seconds: float, share: float) -> float:
    """Seconds of serving after a capture of ``capture_seconds`` before the next may start, so that
    captures take at most ``share`` of the time: ``capture_seconds * (1 - share) / share`` (a 2 s
    capture at 0.1: 18 s; ``share=1``: 0). ``ValueError`` for a share outside ``(0, 1]``."""
    share = check_share(share)
    return max(0.0, float(capture_seconds)) * (1.0 - share) / share


class Pace:
    """The rest between a background capture's keys (module docstring).

    The capture's thread calls :meth:`captured` after each key and :meth:`rest` before the next;
    each call the runner serves (and each ``runner.hold()``) runs inside :meth:`busy`, waiting for
    the lock included. :meth:`resting` says whether the thread would rest now (several ranks: each
    rank's answer rides on a call's agreement, and a key is granted only when no rank rests).
    :attr:`keys` logs each key's ``(start, end, rest_until)`` on :attr:`clock`."""

    def __init__(
        self, share: float = 1.0, idle: float = IDLE_SECONDS, clock: Callable[[], float] = time.perf_counter
    ) -> None:
        self.share = check_share(share)
        self.idle_after = float(idle)
        self.clock = clock  # tests: a hand-driven clock
        self._last_call = -math.inf
        self._active = 0
        self._lock = threading.Lock()
        self._rest_until = -math.inf
        #: ``(start, end, rest until)`` of every key captured, in order.
        self.keys: list[tuple[float, float, float]] = []
        #: Seconds the thread rested so far (reports, tests).
        self.rested = 0.0

    @contextlib.contextmanager
    def busy(self) -> Iterator[None]:
        """Around a call (from before it waits for the lock until it returns): the runner is busy."""
        with self._lock:
            self._active += 1
        try:
            yield
        finally:
            with self._lock:
                self._active -= 1
                self._last_call = self.clock()

    def captured(self, seconds: float) -> None:
        """A key's capture took ``seconds`` (ending now): the next waits :func:`rest_after` of it while calls come."""
        end = self.clock()
        self._rest_until = end + rest_after(seconds, self.share)
        self.keys.append((end - seconds, end, self._rest_until))

    def idle(self) -> bool:
        """No call in progress and none for :attr:`idle_after` seconds."""
        return self._active == 0 and self.clock() - self._last_call >= self.idle_after

    def resting(self) -> bool:
        """True while the rest after the last key runs and calls come."""
        return self.clock() < self._rest_until and not self.idle()

    def rest(self, stop: threading.Event) -> None:
        """Block while :meth:`resting` (or until ``stop`` is set)."""
        began = self.clock()
        while not stop.is_set() and self.resting():
            stop.wait(min(0.005, max(0.0, self._rest_until - self.clock())))
        self.rested += self.clock() - began
