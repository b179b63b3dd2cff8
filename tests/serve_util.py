"""A ``graphrunner serve`` process for the tests (``tests/test_serve.py``) and ``bench/serve_sweep.py``:
:class:`ServerProcess`."""

from __future__ import annotations

import os
import signal
import sys
from typing import Any


class ServerProcess:
    """A ``graphrunner serve`` process on a free port of 127.0.0.1.

    ``ServerProcess(flags, log_path, start_timeout=180, env=None, probe=False)`` starts ``python -m
    graphrunner_tools serve --port <free> *flags`` with its output in ``log_path`` and returns once ``/health``
    answers 200 (polled every 0.5 s); raises ``RuntimeError`` with the log's tail when it exits or does not
    listen in time. :attr:`start_seconds`: seconds from the launch to that first 200. ``probe=True``: right
    after that first 200, ``/ready`` and ``/metrics`` are read once into :attr:`at_health` (:meth:`probe`).
    :attr:`url` is its base URL; :meth:`metrics` parses ``/metrics``; :meth:`stop` sends SIGTERM
    and returns the exit code (killed after ``timeout`` seconds)."""

    def __init__(
        self,
        flags: Any,
        log_path: str,
        start_timeout: float = 180.0,
        env: dict[str, str] | None = None,
        probe: bool = False,
    ) -> None:
        import socket
        import subprocess
        import time
        import urllib.error
        import urllib.request

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.log_path = log_path
        self._log = open(log_path, "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "graphrunner_tools", "serve", "--port", str(self.port), *flags],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})},
        )
        self.url = f"http://127.0.0.1:{self.port}"
        #: What :meth:`probe` read right after the first ``/health`` 200 (``probe=True``), else ``None``.
        self.at_health: dict[str, Any] | None = None
        t0 = time.monotonic()
        deadline = t0 + start_timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"graphrunner serve exited with {self.proc.returncode}:\n{self.output()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        #: Seconds from the launch to the first ``/health`` 200 seen.
                        self.start_seconds = time.monotonic() - t0
                        if probe:
                            self.at_health = self.probe()
                        return
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() > deadline:
                printed = self.output()  # before stop() closes the log
                self.stop()
                raise RuntimeError(f"graphrunner serve did not listen within {start_timeout:.0f} s:\n{printed}")
            time.sleep(0.5)

    def probe(self) -> dict[str, Any]:
        """``GET /ready`` then ``GET /metrics``, now: ``{"ready_status": 200 or 503, "ready": /ready's JSON,
        "metrics": {"name{labels}": value}}``; a route that fails is ``None`` (``/metrics`` behind an API key)."""
        import json
        import urllib.error
        import urllib.request

        out: dict[str, Any] = {"ready_status": None, "ready": None, "metrics": None}
        try:
            with urllib.request.urlopen(self.url + "/ready", timeout=30) as r:
                out["ready_status"], out["ready"] = r.status, json.loads(r.read())
        except urllib.error.HTTPError as exc:  # 503: not ready, with the same body
            out["ready_status"], out["ready"] = exc.code, json.loads(exc.read() or b"null")
        except (urllib.error.URLError, OSError, ValueError):
            pass
        try:
            out["metrics"] = self.metrics()
        except (urllib.error.URLError, OSError, ValueError):
            pass
        return out

    def output(self, tail: int = 4000) -> str:
        """The last ``tail`` characters the server printed."""
        self._log.flush()
        with open(self.log_path) as f:
            return f.read()[-tail:]

    def metrics(self) -> dict[str, float]:
        """``GET /metrics`` as ``{"name{labels}": value}``."""
        import urllib.request

        with urllib.request.urlopen(self.url + "/metrics", timeout=30) as r:
            text = r.read().decode()
        out: dict[str, float] = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, _, value = line.rpartition(" ")
                out[name] = float(value)
        return out

    def metric(self, name: str) -> float:
        """The sum of metric ``name`` over its labels."""
        return sum(v for k, v in self.metrics().items() if k == name or k.startswith(name + "{"))

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int | None:
        """Send ``sig`` and wait up to ``timeout`` s (then kill); the exit code."""
        import subprocess

        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return self.proc.returncode


def start_together(makers: dict[str, Any]) -> dict[str, Any]:
    """Start servers side by side (each start is mostly one core's imports): ``makers`` maps a name to a
    function that starts one and returns it (a :class:`ServerProcess`). Returns ``{name: server}`` once all
    listen; when one fails to start, the others are stopped (SIGKILL) and its error is raised."""
    import threading

    started: dict[str, Any] = {}

    def start(name: str) -> None:
        try:
            started[name] = makers[name]()
        except BaseException as exc:  # noqa: BLE001 - re-raised below, after every start ended
            started[name] = exc

    threads = [threading.Thread(target=start, args=(name,)) for name in makers]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    failed = [s for s in started.values() if isinstance(s, BaseException)]
    if failed:
        for s in started.values():
            if not isinstance(s, BaseException):
                s.stop(signal.SIGKILL)
        raise failed[0]
    return {name: started[name] for name in makers}
