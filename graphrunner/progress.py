"""Progress output on stderr: the capture progress bar (rank 0 only) and status lines.

A :class:`StatusLine` is redrawn in place with a carriage return only when
its stream is a terminal; on any other stream (a redirected stderr, a log
file, a pipe) every update is a plain newline-terminated line, so logs stay
readable. :class:`CaptureProgress` draws with ``tqdm`` when it is installed
and the stream is a terminal, and with a :class:`StatusLine` otherwise (one
line per bucket when not a terminal). :class:`TaskProgress` is the bar of one
long computation (``gr.plan_buckets``): drawn on a terminal only, and only
once the computation has run past a delay. This is the only place the library
writes to a stream; everything else goes through
``logging.getLogger("graphrunner")``.
"""

from __future__ import annotations

import sys
import time
from typing import Any, TextIO

from graphrunner.report import key_text

__all__ = ["CaptureProgress", "StatusLine", "TaskProgress", "is_terminal"]


def is_terminal(stream: Any) -> bool:
    """True when ``stream`` is a terminal (``isatty()``); False for pipes, files and streams without a working one."""
    try:
        return bool(stream.isatty())
    except Exception:  # noqa: BLE001 - a stream without (a working) isatty is not a terminal
        return False


class StatusLine:
    """One line of status text on ``stream`` (default: ``sys.stderr``, looked up at construction).

    :meth:`write` redraws the line in place (``\\r``, padded over the previous
    text) when the stream is a TTY, and writes ``text`` plus a newline
    otherwise. ``final=True`` ends the line (a newline on a TTY too). A stream
    that fails to write disables the line instead of raising.
    """

    def __init__(self, stream: TextIO | None = None) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.tty = is_terminal(self.stream)
        self.enabled = True
        self._width = 0

    def write(self, text: str, final: bool = False) -> None:
        """Show ``text`` (see the class docstring); a no-op once disabled."""
        if not self.enabled:
            return
        try:
            if self.tty:
                pad = max(0, self._width - len(text))
                self.stream.write("\r" + text + " " * pad + ("\n" if final else ""))
                self._width = 0 if final else len(text)
            else:
                self.stream.write(text + "\n")
            self.stream.flush()
        except Exception:  # noqa: BLE001 - a broken stderr must not break the caller
            self.enabled = False


class CaptureProgress:
    """Progress of a capture over ``total`` buckets.

    ``enabled=False`` makes every method a no-op. ``stream`` defaults to
    ``sys.stderr`` (looked up at construction). ``use_tqdm`` (default: when
    importable and the stream is a TTY) draws with tqdm; otherwise a
    :class:`StatusLine` shows the bucket (one line per bucket when the stream
    is not a TTY). Call :meth:`start` before bucket ``i`` (0-based) is
    captured and :meth:`close` once at the end (also after an error).
    ``label`` names the items in the text (``"bucket"``; ``"batch"`` for
    the ``gr.hf`` self-test).
    """

    def __init__(
        self,
        total: int,
        enabled: bool = True,
        stream: TextIO | None = None,
        desc: str = "graphrunner capture",
        use_tqdm: bool | None = None,
        label: str = "bucket",
    ) -> None:
        self.total = total
        self.label = label
        self.enabled = bool(enabled)
        self.stream = stream if stream is not None else sys.stderr
        self.desc = desc
        self.t0 = time.perf_counter()
        self._bar: Any = None
        self._line = StatusLine(self.stream)
        self._closed = False
        if not self.enabled:
            return
        if use_tqdm or (use_tqdm is None and self._line.tty):
            try:
                from tqdm import tqdm  # noqa: WPS433 - optional dependency
            except ImportError:
                if use_tqdm:
                    raise
            else:
                self._bar = tqdm(total=total, desc=desc, unit=label, file=self.stream, leave=True)

    def start(self, i: int, bucket: Any) -> None:
        """Show that bucket ``bucket`` (the ``i``-th, 0-based) is being captured."""
        if not self.enabled:
            return
        elapsed = time.perf_counter() - self.t0
        if self._bar is not None:
            if i:
                self._bar.update(1)
            self._bar.set_postfix_str(f"{self.label} {key_text(bucket)}")
            return
        self._line.write(f"{self.desc}: {self.label} {key_text(bucket):>5} ({i + 1}/{self.total}) {elapsed:7.2f}s")

    def close(self, ok: bool = True) -> None:
        """Finish the bar with the total elapsed time (``ok=False``: failed)."""
        if not self.enabled or self._closed:
            return
        self._closed = True
        elapsed = time.perf_counter() - self.t0
        if self._bar is not None:
            if ok:
                self._bar.update(1)
            self._bar.close()
            return
        status = f"{self.total} {self.label}s in {elapsed:.2f}s" if ok else f"FAILED after {elapsed:.2f}s"
        self._line.write(f"{self.desc}: {status}", final=True)


class TaskProgress:
    """Progress of one computation of ``total`` equal steps, shown only if it runs long.

    Nothing is written until :meth:`update` finds that ``after`` seconds have
    passed since construction; from then on a :class:`StatusLine` on
    ``stream`` (default: ``sys.stderr``, looked up at construction) is
    redrawn in place, at most every ``every`` seconds, as ``"{desc}:
    {done}/{total} {unit} ({percent}) {elapsed}s"``, and :meth:`close` ends
    it with the total time. ``enabled=False``, or a stream that is not a
    terminal (a log file, a pipe, a captured stderr), writes nothing at all.
    """

    def __init__(
        self,
        total: int,
        desc: str,
        unit: str = "steps",
        enabled: bool = True,
        stream: TextIO | None = None,
        after: float = 1.0,
        every: float = 0.1,
    ) -> None:
        self.total, self.desc, self.unit = max(1, int(total)), desc, unit
        self.after, self.every = after, every
        self.t0 = time.perf_counter()
        self._line = StatusLine(stream)
        self.enabled = bool(enabled) and self._line.tty
        #: whether anything was drawn (the delay passed while enabled)
        self.shown = False
        self._last = float("-inf")

    def update(self, done: int) -> None:
        """``done`` of the ``total`` steps are finished; redraw if due (see the class docstring)."""
        if not self.enabled:
            return
        now = time.perf_counter()
        if now - self.t0 < self.after or now - self._last < self.every:
            return
        self._last, self.shown = now, True
        self._line.write(self._text(done, now))

    def close(self) -> None:
        """End the line with the total time (only if it was shown); later calls do nothing."""
        if self.enabled and self.shown:
            self._line.write(self._text(self.total, time.perf_counter()) + " done", final=True)
        self.enabled = False

    def _text(self, done: int, now: float) -> str:
        return f"{self.desc}: {done}/{self.total} {self.unit} ({done / self.total:.0%}) {now - self.t0:.1f}s"
