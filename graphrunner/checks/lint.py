"""Capture-safety lint: every reason a runner's step would not capture or would replay wrong, in one pass.

``graphrunner check FILE_OR_MODULE:FACTORY`` (and :func:`check_factory`)
calls ``FACTORY()`` once, a zero-argument callable returning an *uncaptured*
``graphrunner.GraphRunner``; ``graphrunner check
FILE_OR_MODULE:STEP --inputs NAME`` (and ``check_step``) builds that
runner from a step and a dict of example tensors instead (the CLI's target
loader, ``graphrunner_tools.targets``, above the runtime: this module knows a
runner only by its public surface). The runner is
captured for real on its device (the tape on a CPU) with every check in
**collect mode**: a check
that finds something records a :class:`~graphrunner.recording.hooks.Finding`
instead of raising, and a key whose capture fails becomes a finding while
the other keys are still captured. The findings come from the capture
hooks themselves (:mod:`graphrunner.recording.hooks`), never from parsing
error messages:

- :class:`UnsafeOpLint` (a hook added for the lint) runs one more eager
  warmup forward than the runner's and checks every op of that last
  warmup against the tape's capture-unsafe catalogue
  (:func:`graphrunner.tape.unsafe.unsafe_reason`) and every torch function
  against its host-reading idioms (``.item()``, ``.tolist()``, ``print``:
  :func:`~graphrunner.tape.unsafe.unsafe_function_reason`); the op then runs
  as usual, so the pass goes on past it (a tape capture stops at the
  first). It also compares the op streams of the last two warmups, the
  drift check's comparison, even when the runner turned the drift check off.
  Ops inside ``@no_graph`` bodies are skipped on the breakable backend (they
  run eagerly at replay); an eager backend freezes nothing and is not linted.
- :class:`UnsafeOpLint` also watches the ``@no_graph`` calls of the captured
  forward: one that returns a Python value (``lens.max().item()``, a list
  of ints) is a ``"frozen-return"`` finding, since the graph after it keeps
  the value the capture saw (a replay that gets another value raises).
- the runner's own checks (drift, padding, fingerprint) report in collect mode.
- a capture error of a key (the tape's first unsafe op, a step that
  raises) is a finding unless a hook already reported it for that key.

Each finding names the user's ``file:line`` and a fix: ``@no_graph`` the
nearest enclosing function (or module ``forward``) of the user's code, which
must then return tensors (or keep the code that uses a host value inside
it), or, when the line is inside a library (``site-packages``:
transformers, ...), *make the value an input*, since library code cannot be
decorated.

A target that cannot be checked (not found, a directory, a step without
example inputs, a factory that raises, calls ``sys.exit`` or returns no
runner) raises :class:`CheckUsageError`: one line, exit code 2 in the CLI.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from graphrunner._frames import is_internal, is_library, library_name, where
from graphrunner._frames import where as where_text
from graphrunner._pytree import describe, flatten
from graphrunner.checks.drift import OpStream, drift_finding, first_difference
from graphrunner.checks.findings import finding_at
from graphrunner.errors import CaptureError, CaptureUnsafeOpError, GraphRunnerError
from graphrunner.recording.hooks import Capture, CaptureHook, Finding
from graphrunner.recording.ops import OpConsumer, OpEvent, OpRecorder, WriteGuard, no_graph_code
from graphrunner.tape.unsafe import ONE_HOT, unsafe_function_reason, unsafe_reason

__all__ = [
    "Finding",
    "CheckReport",
    "CheckUsageError",
    "UnsafeOpLint",
    "EXPECTED",
    "exit_text",
    "required_parameters",
    "check_factory",
    "check_runner",
    "first_unsafe_op",
]

#: Finding kinds, in the order the table lists them.
KINDS = ("unsafe-op", "frozen-return", "drift", "padding-leak", "input-write", "step-error", "capture-error")


class CheckUsageError(ValueError):
    """``graphrunner check`` cannot run: the target cannot be loaded, is a
    directory, is a step given without example inputs, raised or called
    ``sys.exit`` (on loading, in the factory or in the step), or did not
    return an uncaptured GraphRunner. The CLI prints it as one line and
    exits 2."""


@dataclass
class CheckReport:
    """The result of :func:`check_factory`: ``target`` (what was checked),
    ``backend`` (the runner's backend name), ``buckets`` and ``findings``
    (in the order found). :attr:`ok` is true when there is none."""

    target: str
    backend: str
    buckets: list[Any]
    findings: list[Finding] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """True when nothing was found."""
        return not self.findings

    def to_json(self) -> str:
        """The report as a JSON object: ``target``, ``backend``, ``buckets``,
        ``ok`` and ``findings`` (each :meth:`Finding.to_dict`)."""
        return json.dumps(
            {
                "target": self.target,
                "backend": self.backend,
                "buckets": list(self.buckets),
                "ok": self.ok,
                "findings": [f.to_dict() for f in self.findings],
            },
            indent=2,
            default=str,
        )

    def table(self) -> str:
        """The human-readable report: one row per finding (number, kind,
        ``file:line``, function), its description and fix on the lines
        below, then a one-line verdict."""
        head = f"graphrunner check {self.target} (backend {self.backend}, buckets {list(self.buckets)})"
        if self.ok:
            return f"{head}\nno findings: the step captures with nothing frozen that changes between calls"
        rows = [(str(i + 1), f.kind, _short(f.location), f.function or "-") for i, f in enumerate(self.findings)]
        hdr = ("#", "kind", "location", "function")
        widths = [max(len(r[c]) for r in rows + [hdr]) for c in range(4)]
        fmt = "  ".join(f"{{:<{w}}}" for w in widths)
        lines = [head, fmt.format(*hdr).rstrip(), fmt.format(*("-" * w for w in widths))]
        pad = " " * (widths[0] + 2)
        for r, f in zip(rows, self.findings):
            lines.append(fmt.format(*r).rstrip())
            lines.append(f"{pad}found: {f.what}")
            lines.append(f"{pad}fix:   {f.fix}")
        n = len(self.findings)
        lines.append(f"{n} finding{'s' if n != 1 else ''}: the runner is not capture-safe")
        return "\n".join(lines)


def _short(path: str) -> str:
    """``path`` relative to the working directory when it is below it."""
    try:
        rel = os.path.relpath(path)
    except ValueError:
        return path
    return path if rel.startswith("..") else rel


# ------------------------------------------------------------------ the runner to check
#: What ``graphrunner check`` needs (said by every error about a target that is not that).
EXPECTED = (
    "a zero-argument factory returning an uncaptured graphrunner.GraphRunner, or a step with example "
    "inputs (graphrunner check FILE:STEP --inputs NAME, NAME a dict {argument: example tensor})"
)

#: What the lint uses of a runner (``GraphRunner``'s public surface; its ``capturer`` captures in
#: collect mode): a factory's result without all of it is not a runner.
_RUNNER_SURFACE = ("capture", "capturer", "cleanup", "captured", "backend", "step", "buckets", "progress")


def exit_text(exc: SystemExit) -> str:
    """``called sys.exit(code)``: what a target that exits did, for a :class:`CheckUsageError`."""
    return f"called sys.exit({exc.code!r})" if exc.code is not None else "called sys.exit()"


def required_parameters(fn: Callable[..., Any]) -> list[str] | None:
    """The names of ``fn``'s parameters without a default (``*args``/``**kwargs`` excluded), or
    ``None`` when its signature cannot be read."""

    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return None
    return [p.name for p in params if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]


def _make_runner(factory: Callable[[], Any], target: str) -> Any:
    """``factory()``, checked to be an uncaptured runner (:data:`_RUNNER_SURFACE`)."""
    required = required_parameters(factory)
    if required:
        raise CheckUsageError(
            f"{target} takes {len(required)} required argument{'s' if len(required) != 1 else ''} "
            f"({', '.join(required)}): that is a step, not a factory; pass --inputs NAME (a dict "
            f"{{{', '.join(f'{r!r}: tensor' for r in required)}}} of example tensors, or a zero-argument function "
            "returning one), or point at a zero-argument function that returns an uncaptured GraphRunner"
        )
    try:
        runner = factory()
    except SystemExit as exc:
        raise CheckUsageError(
            f"{target}() {exit_text(exc)} instead of returning a runner; check needs {EXPECTED}"
        ) from None
    except Exception as exc:
        raise CheckUsageError(f"{target}() raised {type(exc).__name__}: {exc}") from exc
    if isinstance(runner, type) or not all(hasattr(runner, a) for a in _RUNNER_SURFACE):
        raise CheckUsageError(
            f"{target}() returned {type(runner).__name__}; the factory must return an "
            f"uncaptured graphrunner.GraphRunner (check needs {EXPECTED})"
        )
    if runner.captured:
        raise CheckUsageError(f"{target}() returned a captured GraphRunner; return it before runner.capture()")
    runner.progress = False
    return runner


# ------------------------------------------------------------------ fixes
def _fix_for(frames: list[tuple[Any, int]], step_code: Any, backend: str) -> tuple[str, bool]:
    """The suggested fix for a finding whose user-side stack (innermost
    first, internal frames removed) is ``frames`` of ``(frame, lineno)``;
    returns ``(fix, in_library)``."""
    breakable = "" if backend == "breakable" else " and use backend='breakable' (a full graph does not break)"
    if not frames:
        return "move this code out of the step, or make the value a tensor input", False
    f0, line0 = frames[0]
    if is_library(f0.f_code.co_filename):
        lib = library_name(f0.f_code.co_filename)
        mine = next(((f, n) for f, n in frames if not is_library(f.f_code.co_filename)), None)
        tail = ""
        if mine is not None and mine[0].f_code is not step_code:
            tail = (
                f", or @no_graph your function {_qualname(mine[0])} ({_short(mine[0].f_code.co_filename)}:"
                f"{mine[0].f_code.co_firstlineno}) that calls into it{breakable}"
            )
        return (
            f"make it an input: this line is inside {lib}, which @no_graph cannot wrap; compute the value "
            "outside the step and pass it as a tensor input (or keep it in a tensor the step updates in "
            "place, e.g. a cache object that holds its length as a tensor)" + tail
        ), True
    return _no_graph_fix(f0, step_code, breakable), False


def _qualname(frame: Any) -> str:
    code = frame.f_code
    return getattr(code, "co_qualname", code.co_name)


def _no_graph_fix(frame: Any, step_code: Any, breakable: str) -> str:
    code = frame.f_code
    loc = f"{_short(code.co_filename)}:{code.co_firstlineno}"
    if code is step_code:
        return (
            "move this line, and the code that uses its value, into a small function decorated with "
            f"@no_graph that returns tensors (it is in the step function itself){breakable}; {_RETURNS}; "
            "or make the value a tensor input"
        )
    if code.co_name == "<module>":
        return f"move this code into a function decorated with @no_graph that returns tensors{breakable}"
    self_obj = frame.f_locals.get("self")
    if isinstance(self_obj, torch.nn.Module) and code.co_name == "forward":
        return (
            f"@no_graph the forward of module {type(self_obj).__name__} ({loc}) so it runs eagerly at "
            f"every replay{breakable}; {_RETURNS}; or make the value a tensor input"
        )
    return (
        f"@no_graph the enclosing function {_qualname(frame)} ({loc}){breakable}; {_RETURNS}; or make the "
        "value a tensor input"
    )


#: The part of a "@no_graph it" fix that keeps it from the frozen-return trap.
_RETURNS = (
    "it must return tensors, not the Python value it reads (a number a break returns is frozen into the "
    "graph after it: return lens.max(), not lens.max().item(), or keep the code that uses the number "
    "inside the break)"
)


# ------------------------------------------------------------------ the lint hook
class _FirstUnsafe(OpConsumer):
    """Keeps the first op of a forward that a device graph cannot hold, with the user's line."""

    def __init__(self) -> None:
        self.found: str | None = None

    def before(self, ev: OpEvent) -> None:
        if self.found is not None or ev.atomic or ev.func.namespace == "c10d" or ev.in_eager_break:
            return

        reason = unsafe_reason(ev.func, ev.args, ev.kwargs)
        if reason is not None:
            self.found = f"{reason[0]} [op: {reason[1]}] at {where_text(ev.where)}"


def first_unsafe_op(forward: Callable[[], Any]) -> str | None:
    """Run ``forward`` once more, eagerly, and describe its first capture-unsafe op (``"boolean-mask
    indexing ... [op: aten::index.Tensor] at step.py:12 in step"``), or ``None`` when it has none
    (or fails before one). What it writes outside itself is put back
    (:class:`~graphrunner.recording.ops.WriteGuard`, the static buffers included). Used when a
    capture's output has a shape the runner cannot slice: a data-dependent shape op is the
    usual cause, and the shape alone names neither the op nor the line."""

    guard, first = WriteGuard(()), _FirstUnsafe()
    try:
        with OpRecorder([guard, first], stop=getattr(forward, "__code__", None)):
            forward()
    except Exception:  # noqa: BLE001, S110 - a diagnosis: the original error is what the caller raises
        pass
    finally:
        guard.restore()
    return first.found


class _UnsafeOps(OpConsumer):
    """Checks every op (and torch function) of one forward against the capture-unsafe catalogue."""

    functions = True

    def __init__(self, lint: UnsafeOpLint, cap: Capture, skip_eager_breaks: bool):
        self.lint, self.cap, self.skip = lint, cap, skip_eager_breaks

    def before(self, ev: OpEvent) -> None:
        if ev.atomic or ev.func.namespace == "c10d" or (self.skip and ev.in_eager_break):
            return

        reason = unsafe_reason(ev.func, ev.args, ev.kwargs)
        if reason is not None:
            self.lint.report(self.cap.findings, self.cap.key, f"{reason[0]} [op: {reason[1]}]", ev.user_stack())

    # ev is a FunctionEvent; typed Any because FunctionEvent borrows OpEvent's in_eager_break and
    # user_stack (recording/ops.py), which mypy types with an OpEvent self
    def function(self, ev: Any) -> Any:

        reason = unsafe_function_reason(ev.func, ev.args, ev.kwargs)
        if reason is not None and not (self.skip and ev.in_eager_break):
            self.lint.report(self.cap.findings, self.cap.key, f"{reason[0]} [op: {reason[1]}]", ev.user_stack())
        # Inside a reported host read (and inside F.one_hot, which a tape runs
        # without its CPU-only host read) the ops it dispatches are not
        # findings of their own: they reach before() as atomic.
        return reason is not None or ev.func is ONE_HOT


class _BreakReturns:
    """Watches the ``@no_graph`` calls of one captured forward (a ``sys.setprofile`` function,
    active from :meth:`UnsafeOpLint.capture_consumers` to the key's ``end``): an outermost call
    that returns a Python value (``lens.max().item()``, a list of ints) is a ``"frozen-return"``
    finding at the ``return`` line of the function. Calls nested inside a break are plain
    calls, consumed by the break itself: not findings."""

    def __init__(self, lint: UnsafeOpLint, cap: Capture) -> None:

        self.lint, self.cap = lint, cap
        self.wrapper = no_graph_code()
        self.codes: dict[Any, tuple[str, int]] = {}  # the wrapped functions' code -> last return line
        self.active = False

    def start(self) -> None:
        if sys.getprofile() is None:  # not under another profiler (a profiler's run is not linted for this)
            sys.setprofile(self)
            self.active = True

    def stop(self) -> None:
        if self.active and sys.getprofile() is self:
            sys.setprofile(None)
        self.active = False

    def __call__(self, frame: Any, event: str, arg: Any) -> None:
        code = frame.f_code
        if event == "return":
            if code is self.wrapper:
                self._returned(frame, arg)
            elif code in self.codes:
                self.codes[code] = (code.co_filename, frame.f_lineno)
        elif event == "call" and code is self.wrapper:
            fn = frame.f_locals.get("fn")
            fcode = getattr(fn, "__code__", None)
            if fcode is not None and fcode not in self.codes:
                self.codes[fcode] = (fcode.co_filename, fcode.co_firstlineno)

    def _returned(self, frame: Any, value: Any) -> None:
        f = frame.f_back
        while f is not None:  # nested inside another break: a plain call, its value used eagerly
            if f.f_code is self.wrapper:
                return
            f = f.f_back

        try:
            spec, leaves = flatten(value, "result", scalars=True)
        except TypeError:
            return  # any other object: the capture itself refuses it (a capture-error finding)
        values: list[Any] = []
        _scalars(spec, values)
        if not values:
            return
        fn = frame.f_locals.get("fn")
        name = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or repr(fn)
        fcode = getattr(fn, "__code__", None)
        file, line = self.codes.get(fcode, (None, None)) if fcode is not None else (None, None)
        shown = ", ".join(repr(v) for v in values[:3]) + (", ..." if len(values) > 3 else "")
        segments = self.cap.freezes == "segments"
        what = (
            f"@no_graph function {name} returned {describe(spec, leaves)} at capture: the Python "
            f"value{'s' if len(values) != 1 else ''} {shown} "
            + (
                "is frozen into the graph segments after the break (a replay where it returns another "
                "value raises CaptureError)"
                if segments
                else "is frozen into the graph (a full graph does not break at @no_graph: a replay reuses it silently)"
            )
        )
        fix = (
            "return a tensor (e.g. lens.max(), not lens.max().item()), or keep the consumer inside the break "
            "(the code that uses the value moves into the @no_graph function)"
            + ("" if segments else "; and use backend='breakable' (a full graph does not break)")
        )
        self.lint.add(
            self.cap.findings,
            Finding(
                "frozen-return",
                what,
                file,
                line,
                name,
                fix=fix,
                bucket=self.cap.key,
                in_library=bool(file and is_library(file)),
            ),
        )


def _scalars(spec: tuple, out: list[Any]) -> None:
    """Append the Python scalars of a pytree ``spec`` (``("S", value)`` entries) to ``out``."""
    tag = spec[0]
    if tag == "S":
        out.append(spec[1])
    elif tag in ("tuple", "dict", "dc"):
        for child in spec[-1]:
            _scalars(child, out)
    elif tag == "list":
        for child in spec[1]:
            _scalars(child, out)


class UnsafeOpLint(CaptureHook):
    """The lint pass as a capture hook (:func:`check_factory` adds it and one warmup).

    On the last warmup forward: :class:`_UnsafeOps` records every
    capture-unsafe op as an ``"unsafe-op"`` finding; on the last two warmup
    forwards: op streams compared as the drift check compares the last
    warmup with the capture (a ``"drift"`` finding); in the captured forward:
    :class:`_BreakReturns` records every ``@no_graph`` call that returns a
    Python value (a ``"frozen-return"`` finding). ``step_code`` is the
    step's code object (the fix names "the step function itself"),
    ``backend`` the backend's name (the fix adds "use backend='breakable'"
    where a full graph cannot break).
    """

    name = "lint"

    def __init__(self, step_code: Any, backend: str) -> None:
        self.step_code, self.backend = step_code, backend
        self.seen: set = set()
        #: ``{key: kinds reported for it}`` (also those not added again as repeats of an earlier key's).
        self.reported: dict[Any, set] = {}
        self._streams: dict[Any, tuple[Any, Any]] = {}
        self._breaks: _BreakReturns | None = None

    def warmup_consumers(self, cap: Capture, i: int) -> Sequence[Any]:
        if cap.freezes is None or cap.warmups < 2 or i < cap.warmups - 2:
            return ()

        skip = cap.freezes == "segments"
        if i == cap.warmups - 2:
            self._streams[cap.key] = (OpStream(f"warmup {cap.warmups - 1}", skip), OpStream("capture", skip))
            return (self._streams[cap.key][0],)
        return (self._streams[cap.key][1], _UnsafeOps(self, cap, skip))

    def after_warmups(self, cap: Capture) -> None:
        streams = self._streams.pop(cap.key, None)
        if streams is None:
            return

        found = first_difference(*streams)
        if found is not None:
            self.add(cap.findings, drift_finding(found[0], found[1], self.backend, cap.key))

    def capture_consumers(self, cap: Capture) -> Sequence[Any]:
        # Not an op consumer: the @no_graph calls of the captured forward are watched from here
        # (the last step before the capture) until end().
        if cap.freezes is not None:
            self._breaks = _BreakReturns(self, cap)
            self._breaks.start()
        return ()

    def after_capture(self, cap: Capture) -> None:
        self._stop_watching()

    def end(self, cap: Capture) -> None:
        self._stop_watching()
        self._streams.pop(cap.key, None)

    def _stop_watching(self) -> None:
        breaks, self._breaks = self._breaks, None
        if breaks is not None:
            breaks.stop()

    def report(self, findings: list[Finding] | None, key: Any, what: str, stack: list[tuple[Any, int]]) -> None:
        """Record an ``"unsafe-op"`` finding of shape key ``key`` at the innermost frame of ``stack`` (in
        ``findings``, collect mode's list; ``None``: only noted as reported)."""
        loc = (stack[0][0].f_code.co_filename, stack[0][1], stack[0][0].f_code.co_name) if stack else None
        fix, lib = _fix_for(stack, self.step_code, self.backend)
        self.add(findings, finding_at("unsafe-op", f"{what} at {where(loc)}", loc, fix=fix, bucket=key, in_library=lib))

    def add(self, findings: list[Finding] | None, f: Finding) -> None:
        """Append ``f`` unless a finding of its kind was recorded at its line (and, for unsafe
        ops, with its text) before."""
        key = _dedupe_key(f)
        self.reported.setdefault(f.bucket, set()).add(f.kind)
        if findings is None or key in self.seen:
            return
        self.seen.add(key)
        findings.append(f)


class FindingsCollector:
    """Collect mode: the findings list the hooks append to, and a key's capture error as a finding."""

    def __init__(self, lint: UnsafeOpLint) -> None:
        self.lint = lint
        self.findings: list[Finding] = []

    def dedupe(self) -> list[Finding]:
        """The findings, each kind and line once (the backend's drift check repeats the lint's)."""
        out, seen = [], set()
        for f in self.findings:
            key = _dedupe_key(f)
            if key not in seen:
                seen.add(key)
                out.append(f)
        return out

    def capture_error(self, key: Any, exc: BaseException) -> None:
        """Turn the capture error of ``key`` into a finding, unless a hook reported its cause."""
        cause = exc.__cause__ if isinstance(exc, CaptureError) and exc.__cause__ is not None else exc
        mine = self.lint.reported.get(key, set()) | {f.kind for f in self.findings if f.bucket == key}
        if isinstance(cause, CaptureUnsafeOpError):
            if "unsafe-op" in mine:
                return  # the tape stops at the first of the ops the lint listed
            stack = _traceback_stack(cause)
            self.lint.report(self.findings, key, f"the tape capture raised {type(cause).__name__}", stack)
            return
        if isinstance(cause, GraphRunnerError) or cause is exc:
            self.findings.append(
                Finding(
                    "capture-error",
                    f"the tape capture raised {type(exc).__name__}: {exc}",
                    None,
                    None,
                    None,
                    fix="see the message",
                    bucket=key,
                )
            )
            return
        # the step itself raised (in a warmup or the capture): locate it in the traceback
        stack = _traceback_stack(cause)
        loc = (stack[0][0].f_code.co_filename, stack[0][1], stack[0][0].f_code.co_name) if stack else None
        self.lint.add(
            self.findings,
            finding_at(
                "step-error",
                f"the step raised {type(cause).__name__}: {cause}",
                loc,
                fix="fix the step so that it runs eagerly on the bucket's static inputs (the lint could not "
                "capture this bucket past the error)",
                bucket=key,
                in_library=bool(loc and is_library(loc[0])),
            ),
        )


def _dedupe_key(f: Finding) -> tuple:
    """Findings with equal keys are one: a drift, step error or frozen return once per line, an unsafe op once
    per line and text, anything else once per text (a padding leak names its key)."""
    return (f.kind, (f.file, f.line), None if f.kind in ("drift", "step-error", "frozen-return") else f.what)


def _traceback_stack(exc: BaseException) -> list[tuple[Any, int]]:
    """The non-internal frames of ``exc``'s traceback, innermost first."""
    frames = []
    tb = exc.__traceback__
    while tb is not None:
        frames.append((tb.tb_frame, tb.tb_lineno))
        tb = tb.tb_next
    return [(f, n) for f, n in reversed(frames) if not is_internal(f.f_code)]


def check_factory(factory: Callable[[], Any], target: str = "") -> CheckReport:
    """Lint the runner ``factory()`` returns for capture safety; return a :class:`CheckReport`.

    ``factory`` is called once. Its runner is captured in collect mode
    (see the module docstring) and cleaned up afterwards. Raises
    :class:`CheckUsageError` when ``factory`` needs arguments (a step: use
    ``graphrunner_tools.targets.check_step``), raises, calls ``sys.exit``, or does not return an
    uncaptured GraphRunner, and when the step calls ``sys.exit`` during the
    capture.
    """
    target = target or getattr(factory, "__qualname__", repr(factory))
    return check_runner(_make_runner(factory, target), target)


def check_runner(runner: Any, target: str) -> CheckReport:
    """Lint an uncaptured ``runner`` (see :func:`check_factory`); it is cleaned up afterwards."""
    runner.progress = False
    backend = runner.backend
    if getattr(backend, "disabled_by", None):
        raise CheckUsageError(
            f"{backend.disabled_by} is set: every runner serves eagerly and captures no graph, "
            "so there is nothing to check; unset it for graphrunner check"
        )
    name = str(getattr(backend, "name", type(backend).__name__))
    buckets = list(runner.buckets)
    lint = UnsafeOpLint(getattr(runner.step, "__code__", None), name)
    collector = FindingsCollector(lint)
    hooks = getattr(backend, "hooks", None)  # None: a backend that is not a GraphBackend, captured as it is
    if hooks is not None:
        hooks.append(lint)
        backend.warmups = int(backend.warmups) + 1  # the lint compares the last two warmups
    try:
        runner.capturer.capture(runner.agree_bucket, collector)
    except SystemExit as exc:
        raise CheckUsageError(
            f"the step of {target} {exit_text(exc)} during its capture; a step must return "
            "its outputs (check needs a runner whose step runs)"
        ) from None
    finally:
        if hooks is not None:
            lint._stop_watching()
            hooks.remove(lint)
            backend.warmups -= 1
        with contextlib.suppress(Exception):
            runner.cleanup()
    return CheckReport(target=target, backend=name, buckets=buckets, findings=collector.dedupe())
