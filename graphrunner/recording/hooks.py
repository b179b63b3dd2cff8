"""Capture hooks: how a check attaches to the capture protocol.

:meth:`GraphBackend.capture_one <graphrunner.backends.base.GraphBackend.capture_one>`
runs the protocol and calls every hook at fixed points, in this order::

    begin(cap)
    repeat warmups:   sync; barrier; before_warmup(cap, i);
                      forward (ops to warmup_consumers(cap, i)); after_warmup(cap, i, out); post_warmup_hook
    after_warmups(cap)             # eager forwards and collectives of a check (the padding check)
    sync; barrier
    graph construction; capture    # ops of the captured forward to capture_consumers(cap)
    after_capture(cap)             # compare, name, agree (drift, externals, fingerprint)
    end(cap)                       # always, also after an error: drop references
    ...
    before_replay(key)             # per replay, only for hooks with replay_check = True (debug mode)

A hook sees one key's capture through :class:`Capture`; the ops it wants to
see reach it through the one op recorder (:mod:`graphrunner.recording.ops`):
it returns :class:`~graphrunner.recording.ops.OpConsumer` objects for the warmup
forwards and the captured forward it wants to watch. A hook that finds a
problem calls :meth:`Capture.fail`, which raises the error, or in collect
mode (``graphrunner check``) records it as a finding and lets capture go on.

Hooks reach a backend the same way whoever supplies them: a list of hooks for
every key (``backend.hooks``) and one per ``capture_one`` call (``hooks=``).
The checks themselves live a layer above (:mod:`graphrunner.checks`, where
every check is attached); a check that a backend switches on by its own
argument (the drift check: ``drift_check=True``) is provided to it by name
(:func:`provide_check`, :func:`provided_check`), so a backend used without a
runner runs it too without importing a check.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["Capture", "CaptureHook", "Finding", "provide_check", "provided_check"]


@dataclass
class Finding:
    """One reason a step would not capture or would replay wrong (collect mode).

    ``kind``: ``"unsafe-op"``, ``"drift"``, ``"padding-leak"``,
    ``"step-error"`` or ``"capture-error"``; ``what`` says what was found;
    ``file``/``line``/``function`` locate the user's source line (``None``
    when unknown); ``fix`` says what to do; ``bucket`` is the key it was seen
    in; ``in_library`` is true when the line is inside installed library code.
    """

    kind: str
    what: str
    file: str | None
    line: int | None
    function: str | None
    fix: str
    bucket: Any = None
    in_library: bool = False

    @property
    def location(self) -> str:
        """``file:line`` (``"-"`` when unknown)."""
        return "-" if self.file is None else f"{self.file}:{self.line}"

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict of the fields."""

        return asdict(self)


@dataclass
class Capture:
    """One key's capture as a hook sees it.

    ``key``: the shape key; ``backend``: the backend capturing it (its
    ``name``, ``group``, ``warmups``, ``device``); ``forward_fn``: the step's
    forward on the key's static inputs (call it for an extra eager forward
    through :meth:`eager`); ``post_warmup_hook``: the user's hook or ``None``;
    ``freezes``: what the graph freezes (``"all"`` ops, ``"segments"``: ops
    outside ``@no_graph`` bodies, or ``None``: nothing, an eager backend);
    ``last_output``: the last warmup forward's output (set for
    ``after_warmups``, not held through the capture); ``outputs``: after the
    capture, ``(spec, views)`` of the key's static outputs; ``info``: fields a hook adds to the key's
    report (``backend.info(key)``); ``findings``: ``None``, or the list that
    collect mode appends to. ``check_seconds``: what the hooks took so far
    (their methods, their extra forwards included, and the op recorder's
    Python per op while it fed their consumers; the dispatch mode's own entry
    per op is not counted), reported as ``info(key)["checks_seconds"]``.
    """

    key: Any
    backend: Any
    forward_fn: Callable[[], Any]
    post_warmup_hook: Callable[[], Any] | None
    freezes: str | None
    findings: list[Finding] | None = None
    last_output: Any = None
    outputs: Any = None
    info: dict[str, Any] = field(default_factory=dict)
    check_seconds: float = 0.0

    @property
    def group(self) -> Any:
        """The backend's rank group."""
        return self.backend.group

    @property
    def warmups(self) -> int:
        """The backend's warmup count."""
        return int(self.backend.warmups)

    @contextlib.contextmanager
    def timing(self) -> Iterator[None]:
        """Add the block's wall time to :attr:`check_seconds` (the backend wraps each hook call)."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.check_seconds += time.perf_counter() - t0

    def eager(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn()`` eagerly as a warmup would (under the device's warmup context: the capture
        stream on CUDA)."""
        make = getattr(self.backend.device, "warmup_context", None)
        with make() if make is not None else contextlib.nullcontext():
            return fn()

    def fail(self, error: BaseException, finding: Finding | None = None) -> None:
        """Report a problem: raise ``error``, or in collect mode append ``finding`` (built from
        the error's text when not given) and return."""
        if self.findings is None:
            raise error
        if finding is None:
            finding = Finding(
                "capture-error", f"{type(error).__name__}: {error}", None, None, None, fix="see the message"
            )
        if finding.bucket is None:
            finding.bucket = self.key
        self.findings.append(finding)


class CaptureHook:
    """Base class of a check attached to capture: every method is an optional no-op.

    Hooks are given to a backend (``backend.hooks``, for every key) or to one
    :meth:`~graphrunner.backends.base.GraphBackend.capture_one` call
    (``hooks=``, for that key). ``name`` names the check in messages and
    reports. A hook that sets ``replay_check = True`` has
    :meth:`before_replay` called before every replay (debug mode only: the
    replay path runs no hook otherwise).
    """

    name = "hook"
    replay_check = False

    def begin(self, cap: Capture) -> None:
        """Before the first warmup of ``cap.key``."""

    def before_warmup(self, cap: Capture, i: int) -> None:
        """Before warmup forward ``i`` (0-based), after its synchronize and barrier: a check may
        set what the forward reads (the padding check's first run is the last warmup)."""

    def warmup_consumers(self, cap: Capture, i: int) -> Sequence[Any]:
        """Op consumers to feed the ops of warmup forward ``i`` (0-based) to."""
        return ()

    def after_warmup(self, cap: Capture, i: int, out: Any) -> None:
        """Warmup forward ``i`` returned ``out``; before the post-warmup hook runs."""

    def after_warmups(self, cap: Capture) -> None:
        """After the last warmup and its post-warmup hook, before the final synchronize and
        barrier: extra eager forwards (:meth:`Capture.eager`) and collectives go here."""

    def capture_consumers(self, cap: Capture) -> Sequence[Any]:
        """Op consumers to feed the ops of the captured forward to (inside the graph's capture)."""
        return ()

    def after_capture(self, cap: Capture) -> None:
        """After the graph was captured (the key is stored; an error here discards it)."""

    def end(self, cap: Capture) -> None:
        """Always last, also after an error: drop what the hook held for this key."""

    def before_replay(self, key: Any) -> None:
        """Before each replay of ``key`` (only with ``replay_check = True``)."""


#: Factories of the checks a backend attaches by its own switch, by name (``"drift"``: a
#: backend's ``drift_check=True``), registered by :mod:`graphrunner.checks` (:func:`provide_check`).
_PROVIDED: dict[str, Callable[[], CaptureHook]] = {}


def provide_check(name: str, make: Callable[[], CaptureHook]) -> None:
    """Register ``make`` (no arguments, returns a new :class:`CaptureHook`) as the check ``name``
    a backend attaches for every key when its own switch asks for it. :mod:`graphrunner.checks`
    provides ``"drift"`` when it is imported (``import graphrunner`` imports it)."""
    _PROVIDED[name] = make


def provided_check(name: str) -> CaptureHook:
    """A new hook of the check ``name`` (:func:`provide_check`); ``RuntimeError`` naming it when
    nothing provided it."""
    make = _PROVIDED.get(name)
    if make is None:
        raise RuntimeError(
            f"no {name!r} check is provided to the backends: import graphrunner (or "
            "graphrunner.checks, which provides it) before making a backend"
        )
    return make()
