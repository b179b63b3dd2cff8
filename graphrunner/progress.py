"""The capture progress bar (rank 0 only, stderr).

Uses ``tqdm`` when it is installed; otherwise writes one line to stderr that
is redrawn with a carriage return when stderr is a terminal, and one line per
bucket when it is not (logs stay readable). This is the only place the
library writes to a stream; everything else goes through
``logging.getLogger("graphrunner")``.
"""

from __future__ import annotations

import sys
import time
from typing import Any, Optional, TextIO

__all__ = ["CaptureProgress"]


class CaptureProgress:
    """Progress of a capture over ``total`` buckets.

    ``enabled=False`` makes every method a no-op. ``stream`` defaults to
    ``sys.stderr`` (looked up at construction). ``use_tqdm`` (default: when
    importable) draws with tqdm. Call :meth:`start` before bucket ``i`` (0-based)
    is captured and :meth:`close` once at the end (also after an error).
    """

    def __init__(self, total: int, enabled: bool = True, stream: Optional[TextIO] = None,
                 desc: str = "graphrunner capture", use_tqdm: Optional[bool] = None) -> None:
        self.total = total
        self.enabled = bool(enabled)
        self.stream = stream if stream is not None else sys.stderr
        self.desc = desc
        self.t0 = time.perf_counter()
        self._bar: Any = None
        self._width = 0
        self._closed = False
        if not self.enabled:
            return
        if use_tqdm is None or use_tqdm:
            try:
                from tqdm import tqdm  # noqa: WPS433 - optional dependency
            except ImportError:
                if use_tqdm:
                    raise
            else:
                self._bar = tqdm(total=total, desc=desc, unit="bucket", file=self.stream, leave=True)
        try:
            self._tty = bool(self.stream.isatty())
        except Exception:  # noqa: BLE001 - a stream without isatty
            self._tty = False

    def start(self, i: int, bucket: int) -> None:
        """Show that bucket ``bucket`` (the ``i``-th, 0-based) is being captured."""
        if not self.enabled:
            return
        elapsed = time.perf_counter() - self.t0
        if self._bar is not None:
            if i:
                self._bar.update(1)
            self._bar.set_postfix_str(f"bucket {bucket}")
            return
        self._write(f"{self.desc}: bucket {bucket:>5} ({i + 1}/{self.total}) {elapsed:7.2f}s")

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
        status = f"{self.total} buckets in {elapsed:.2f}s" if ok else f"FAILED after {elapsed:.2f}s"
        self._write(f"{self.desc}: {status}", final=True)

    def _write(self, text: str, final: bool = False) -> None:
        try:
            if self._tty:
                pad = max(0, self._width - len(text))
                self.stream.write("\r" + text + " " * pad + ("\n" if final else ""))
                self._width = 0 if final else len(text)
            else:
                self.stream.write(text + "\n")
            self.stream.flush()
        except Exception:  # noqa: BLE001 - a broken stderr must not break capture
            self.enabled = False
