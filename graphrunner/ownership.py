"""One call at a time: a runner's static buffers hold one batch, so a second concurrent call is refused.

:class:`CallOwner` is taken for each call or capture of a runner and
refuses, at once and with a clear message, a call from another thread
while one is in progress, and a re-entrant call (a step or hook calling its
own runner). It never blocks: serializing calls is the caller's decision.
"""

from __future__ import annotations

import threading

from graphrunner.errors import GraphRunnerError

__all__ = ["CallOwner"]


class CallOwner:
    """A non-blocking ownership lock with messages that say who holds it."""

    def __init__(self) -> None:
        #: The lock itself (a hot path may acquire it directly and call :meth:`refuse` on failure,
        #: then set :attr:`thread`).
        self.lock = threading.Lock()
        #: The owning thread's ident while held.
        self.thread: int | None = None

    def enter(self, what: str) -> None:
        """Take ownership for ``what`` (``"run()"``, ``"capture()"``), or raise
        :class:`GraphRunnerError` at once if a call is in progress."""
        if not self.lock.acquire(blocking=False):
            self.refuse(what)
        self.thread = threading.get_ident()

    def refuse(self, what: str) -> None:
        """Raise the :class:`GraphRunnerError` for ``what`` while another call holds the lock."""
        me, owner = threading.get_ident(), self.thread
        if owner == me:
            raise GraphRunnerError(
                f"GraphRunner.{what} called re-entrantly (from inside step or a hook of the same runner): "
                "its static buffers hold the batch in progress; do not call a runner from its own step"
            )
        raise GraphRunnerError(
            f"GraphRunner.{what} called from thread {threading.current_thread().name} (id {me}) while thread "
            f"id {owner} is inside a call of the same runner: one runner serves one call at a time (its static "
            "buffers hold one batch). Use one runner per thread, or serialize the calls with a lock"
        )

    def leave(self) -> None:
        """Give ownership back."""
        self.thread = None
        self.lock.release()
