"""The checks that make a graph replay like eager or refuse loudly, as capture hooks.

Every check attaches to the capture protocol through the hook points of
:mod:`graphrunner.recording.hooks` and sees ops through the one op recorder
(:mod:`graphrunner.recording.ops`). See ``docs/protocol.md`` for where each
runs and which collectives it makes.

The checks are attached here: :meth:`CheckSet.key_hooks` gives a runner's
hooks for each key, and the drift check, which a backend switches on by its
own ``drift_check=`` (also a backend used without a runner), is provided to
the backends below (:func:`~graphrunner.recording.hooks.provide_check`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from graphrunner.checks.drift import DriftCheck
from graphrunner.checks.fingerprint import FingerprintCheck
from graphrunner.checks.leak_check import LeakCheck
from graphrunner.checks.padding import PaddingCheck, check_sizes, second_sizes
from graphrunner.checks.stash import captured_cache  # noqa: F401 - the stashed-state check's opt-out
from graphrunner.checks.stream_use import StreamCheck
from graphrunner.recording.hooks import CaptureHook, provide_check

if TYPE_CHECKING:
    from graphrunner.checks.contracts import InputWritesCheck
    from graphrunner.checks.leak_runs import KeyInput
    from graphrunner.keys import KeySpace

__all__ = ["DEFAULT_CHECKS", "CheckSet", "PaddingCheck", "resolve_checks"]

#: A backend with ``drift_check=True`` (the default) attaches this hook for every key.
provide_check("drift", DriftCheck)

#: The checks a runner runs unless ``checks=`` says otherwise.
DEFAULT_CHECKS = ("drift", "padding", "fingerprint")

_NAMES = ("drift", "padding", "fingerprint", "streams")


@dataclass(frozen=True)
class CheckSet:
    """The checks of one runner, resolved from ``GraphRunner(checks=...)``.

    ``drift``: the backend's drift check (:mod:`graphrunner.checks.drift`);
    ``padding``: the padding-leak check's configuration
    (:class:`~graphrunner.checks.padding.PaddingCheck`) or ``None``;
    ``fingerprint``: the cross-rank capture fingerprint
    (:mod:`graphrunner.checks.fingerprint`; UNSAFE to leave out with several
    ranks: mismatched ranks then replay mismatched graphs silently);
    ``streams``: stream ownership (:mod:`graphrunner.checks.stream_use`: side-stream
    work joined before it is read; off unless named). Debug mode adds the
    externals contract (:mod:`graphrunner.checks.contracts`) and the stream
    check.
    """

    drift: bool
    padding: PaddingCheck | None
    fingerprint: bool
    streams: bool = False

    def key_hooks(
        self,
        space: KeySpace,
        key: tuple[int, ...],
        key_text: str,
        inputs: Sequence[KeyInput],
        step: Callable[..., Any],
        leaf_dims: Callable[[tuple, int], list[tuple[int, ...]]],
        group: Any,
        externals: CaptureHook | None = None,
        input_writes: InputWritesCheck | None = None,
    ) -> list[CaptureHook]:
        """The capture hooks of a runner's ``key`` (the drift check is the backend's: ``drift`` says
        what the backend was made with, see :func:`provide_check` above):
        ``input_writes`` (:class:`~graphrunner.checks.contracts.InputWritesCheck`, always given by
        the runner) first; the padding check when a smaller call replays ``key`` (``inputs``: ``(name, key view,
        leading-dim indices, BatchInput)`` of every input); the fingerprint with several ranks in
        ``group``; the debug-mode ``externals`` hook when given."""

        hooks: list[CaptureHook] = [] if input_writes is None else [input_writes]
        multi = int(getattr(group, "size", 1)) > 1
        padding = self.padding
        sizes = check_sizes(space, key) if padding is not None else None
        if padding is not None and sizes is not None:
            hooks.append(
                LeakCheck(
                    key,
                    key_text,
                    sizes,
                    second_sizes(space, key, sizes),
                    inputs,
                    step,
                    leaf_dims,
                    padding.exempt,
                    group=group if multi else None,
                    phase_key=space.external(key),
                    warned=padding.warned,
                )
            )
        if self.fingerprint and multi:
            hooks.append(FingerprintCheck())
        if externals is not None:
            hooks.append(externals)
        if self.streams or externals is not None:  # named, or debug mode
            names = {k: v[0] for k, v in getattr(input_writes, "storages", {}).items()}
            hooks.append(StreamCheck(names=names, step=step))
        return hooks

    def names(self) -> list:
        """The checks' names, in :data:`DEFAULT_CHECKS` order."""
        return [
            n
            for n, on in (
                ("drift", self.drift),
                ("padding", self.padding is not None),
                ("fingerprint", self.fingerprint),
                ("streams", self.streams),
            )
            if on
        ]


def resolve_checks(checks: Any) -> CheckSet:
    """``GraphRunner(checks=...)`` as a :class:`CheckSet`.

    ``None`` means :data:`DEFAULT_CHECKS`; otherwise a sequence of names
    (``"drift"``, ``"padding"``, ``"fingerprint"``, ``"streams"``) and
    :class:`~graphrunner.checks.padding.PaddingCheck` instances (a
    configured ``"padding"``), e.g. ``checks=["drift",
    gr.PaddingCheck(exempt=("total",)), "fingerprint"]``; ``()`` runs none.
    Raises ``TypeError``/``ValueError`` naming the entry for anything else.
    """
    if checks is None:
        checks = DEFAULT_CHECKS
    if isinstance(checks, (str, PaddingCheck)):
        raise TypeError(
            f"checks must be a sequence such as {list(DEFAULT_CHECKS)}, got {checks!r}; wrap a single check in a list"
        )
    try:
        items = list(checks)
    except TypeError:
        raise TypeError(
            f"checks must be a sequence of check names {list(_NAMES)} or gr.PaddingCheck(...), "
            f"got {type(checks).__name__}"
        ) from None
    drift = fingerprint = streams = False
    padding: PaddingCheck | None = None
    for c in items:
        if isinstance(c, PaddingCheck):
            padding = c
            c = "padding"
        elif c == "padding":
            padding = padding or PaddingCheck()
        if c == "drift":
            drift = True
        elif c == "fingerprint":
            fingerprint = True
        elif c == "streams":
            streams = True
        elif c != "padding":
            raise ValueError(
                f"unknown check {c!r} in checks=: expected names from {list(_NAMES)} or gr.PaddingCheck(exempt=...)"
            )
    return CheckSet(drift=drift, padding=padding, fingerprint=fingerprint, streams=streams)
