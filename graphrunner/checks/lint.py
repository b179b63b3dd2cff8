"""Capture-safety lint: every reason a runner's step would not capture or would replay wrong, in one pass.

``graphrunner check FILE_OR_MODULE:FACTORY`` (and :func:`check_factory`)
calls ``FACTORY()`` once, a zero-argument callable returning an *uncaptured*
:class:`~graphrunner.runner.GraphRunner`, and captures it for real on its
device (the tape on a CPU) with every check in **collect mode**: a check
that finds something records a :class:`~graphrunner.backends.hooks.Finding`
instead of raising, and a key whose capture fails becomes a finding while
the other keys are still captured. The findings come from the capture
hooks themselves (:mod:`graphrunner.backends.hooks`), never from parsing
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
- the runner's own checks (drift, padding, fingerprint) report in collect mode.
- a capture error of a key (the tape's first unsafe op, a step that
  raises) is a finding unless a hook already reported it for that key.

Each finding names the user's ``file:line`` and a fix: ``@no_graph`` the
nearest enclosing function (or module ``forward``) of the user's code, or,
when the line is inside a library (``site-packages``: transformers, ...),
*make the value an input*, since library code cannot be decorated.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import json
import os
import re
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from graphrunner._frames import is_internal, is_library, library_name, where
from graphrunner.backends.hooks import Capture, CaptureHook, Finding
from graphrunner.checks.ops import OpConsumer
from graphrunner.errors import CaptureError, CaptureUnsafeOpError, GraphRunnerError

__all__ = ["Finding", "CheckReport", "CheckUsageError", "UnsafeOpLint", "load_factory", "check_factory"]

#: Finding kinds, in the order the table lists them.
KINDS = ("unsafe-op", "drift", "padding-leak", "input-write", "step-error", "capture-error")


class CheckUsageError(ValueError):
    """``graphrunner check`` cannot run: the target cannot be loaded, is not
    a zero-argument factory, or did not return an uncaptured GraphRunner.
    The CLI prints it as one line and exits 2."""


@dataclass
class CheckReport:
    """The result of :func:`check_factory`: ``target`` (what was checked),
    ``backend`` (the runner's backend name), ``buckets`` and ``findings``
    (in the order found). :attr:`ok` is true when there is none."""

    target: str
    backend: str
    buckets: List[Any]
    findings: List[Finding] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """True when nothing was found."""
        return not self.findings

    def to_json(self) -> str:
        """The report as a JSON object: ``target``, ``backend``, ``buckets``,
        ``ok`` and ``findings`` (each :meth:`Finding.to_dict`)."""
        return json.dumps({"target": self.target, "backend": self.backend, "buckets": list(self.buckets),
                           "ok": self.ok, "findings": [f.to_dict() for f in self.findings]}, indent=2, default=str)

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


# ------------------------------------------------------------------ loading
def load_factory(target: str) -> Callable[[], Any]:
    """Resolve ``FILE_OR_MODULE:FACTORY`` to the callable it names.

    ``FILE`` is a path to a ``.py`` file (loaded as a fresh module, its
    folder first on ``sys.path`` while it loads); otherwise the part before
    the last ``:`` is an importable module name. ``FACTORY`` may be dotted
    (``module:Class.make``). Raises :class:`CheckUsageError` naming what is
    wrong."""
    if not isinstance(target, str) or ":" not in target:
        raise CheckUsageError(f"expected FILE_OR_MODULE:FACTORY (e.g. model.py:make_runner), got {target!r}")
    source, _, attr = target.rpartition(":")
    if not source or not attr:
        raise CheckUsageError(f"expected FILE_OR_MODULE:FACTORY (e.g. model.py:make_runner), got {target!r}")
    if source.endswith(".py") or os.sep in source or os.path.exists(source):
        path = os.path.abspath(source)
        if not os.path.isfile(path):
            raise CheckUsageError(f"file {source!r} does not exist")
        name = f"_graphrunner_check_{abs(hash(path))}"
        spec = importlib.util.spec_from_file_location(name, path)
        if spec is None or spec.loader is None:
            raise CheckUsageError(f"cannot load {source!r} as a Python file")
        module = importlib.util.module_from_spec(spec)
        sys.path.insert(0, os.path.dirname(path))
        sys.modules[name] = module
        try:
            spec.loader.exec_module(module)
        except Exception as exc:
            sys.modules.pop(name, None)
            raise CheckUsageError(f"loading {source!r} raised {type(exc).__name__}: {exc}") from exc
        finally:
            with contextlib.suppress(ValueError):
                sys.path.remove(os.path.dirname(path))
    else:
        try:
            module = importlib.import_module(source)
        except Exception as exc:
            raise CheckUsageError(f"cannot import module {source!r}: {type(exc).__name__}: {exc}") from exc
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise CheckUsageError(f"{source!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise CheckUsageError(f"{target} is {type(obj).__name__}, not a callable factory")
    return obj


def _make_runner(factory: Callable[[], Any], target: str) -> Any:
    from graphrunner.runner import GraphRunner

    try:
        runner = factory()
    except Exception as exc:
        raise CheckUsageError(f"{target}() raised {type(exc).__name__}: {exc}") from exc
    if not isinstance(runner, GraphRunner):
        raise CheckUsageError(f"{target}() returned {type(runner).__name__}; the factory must return an "
                              "uncaptured graphrunner.GraphRunner")
    if runner.captured:
        raise CheckUsageError(f"{target}() returned a captured GraphRunner; return it before runner.capture()")
    runner.progress = False
    return runner


# ------------------------------------------------------------------ fixes
def _fix_for(frames: List[Tuple[Any, int]], step_code: Any, backend: str) -> Tuple[str, bool]:
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
            tail = (f", or @no_graph your function {_qualname(mine[0])} ({_short(mine[0].f_code.co_filename)}:"
                    f"{mine[0].f_code.co_firstlineno}) that calls into it{breakable}")
        return (f"make it an input: this line is inside {lib}, which @no_graph cannot wrap; compute the value "
                "outside the step and pass it as a tensor input (or keep it in a tensor the step updates in "
                "place, e.g. a cache object that holds its length as a tensor)" + tail), True
    return _no_graph_fix(f0, step_code, breakable), False


def _qualname(frame: Any) -> str:
    code = frame.f_code
    return getattr(code, "co_qualname", code.co_name)


def _no_graph_fix(frame: Any, step_code: Any, breakable: str) -> str:
    code = frame.f_code
    loc = f"{_short(code.co_filename)}:{code.co_firstlineno}"
    if code is step_code:
        return ("move this line into a small function decorated with @no_graph (it is in the step function "
                f"itself), or make the value a tensor input{breakable}")
    if code.co_name == "<module>":
        return f"move this code into a function decorated with @no_graph{breakable}"
    self_obj = frame.f_locals.get("self")
    if isinstance(self_obj, torch.nn.Module) and code.co_name == "forward":
        return (f"@no_graph the forward of module {type(self_obj).__name__} ({loc}) so it runs eagerly at "
                f"every replay{breakable}, or make the value a tensor input")
    return f"@no_graph the enclosing function {_qualname(frame)} ({loc}){breakable}, or make the value a tensor input"


# ------------------------------------------------------------------ the lint hook
class _UnsafeOps(OpConsumer):
    """Checks every op (and torch function) of one forward against the capture-unsafe catalogue."""

    functions = True

    def __init__(self, lint: "UnsafeOpLint", cap: Capture, skip_eager_breaks: bool):
        self.lint, self.cap, self.skip = lint, cap, skip_eager_breaks

    def before(self, ev: Any) -> None:
        if ev.atomic or ev.func.namespace == "c10d" or (self.skip and ev.in_eager_break):
            return
        from graphrunner.tape.unsafe import unsafe_reason

        reason = unsafe_reason(ev.func, ev.args, ev.kwargs)
        if reason is not None:
            self.lint.report(self.cap, f"{reason[0]} [op: {reason[1]}]", ev.user_stack())

    def function(self, ev: Any) -> Any:
        from graphrunner.tape.unsafe import _ONE_HOT, unsafe_function_reason

        reason = unsafe_function_reason(ev.func, ev.args, ev.kwargs)
        if reason is not None and not (self.skip and ev.in_eager_break):
            self.lint.report(self.cap, f"{reason[0]} [op: {reason[1]}]", ev.user_stack())
        # Inside a reported host read (and inside F.one_hot, which a tape runs
        # without its CPU-only host read) the ops it dispatches are not
        # findings of their own: they reach before() as atomic.
        return reason is not None or ev.func is _ONE_HOT


class UnsafeOpLint(CaptureHook):
    """The lint pass as a capture hook (:func:`check_factory` adds it and one warmup).

    On the last warmup forward: :class:`_UnsafeOps` records every
    capture-unsafe op as an ``"unsafe-op"`` finding; on the last two warmup
    forwards: op streams compared as the drift check compares the last
    warmup with the capture (a ``"drift"`` finding). ``step_code`` is the
    step's code object (the fix names "the step function itself"),
    ``backend`` the backend's name (the fix adds "use backend='breakable'"
    where a full graph cannot break).
    """

    name = "lint"

    def __init__(self, step_code: Any, backend: str) -> None:
        self.step_code, self.backend = step_code, backend
        self.seen: set = set()
        #: ``{key: kinds reported for it}`` (also those not added again as repeats of an earlier key's).
        self.reported: Dict[Any, set] = {}
        self._streams: Dict[Any, Tuple[Any, Any]] = {}

    def warmup_consumers(self, cap: Capture, i: int) -> Sequence[Any]:
        if cap.freezes is None or cap.warmups < 2 or i < cap.warmups - 2:
            return ()
        from graphrunner.checks.drift import OpStream

        skip = cap.freezes == "segments"
        if i == cap.warmups - 2:
            self._streams[cap.key] = (OpStream(f"warmup {cap.warmups - 1}", skip), OpStream("capture", skip))
            return (self._streams[cap.key][0],)
        return (self._streams[cap.key][1], _UnsafeOps(self, cap, skip))

    def after_warmups(self, cap: Capture) -> None:
        streams = self._streams.pop(cap.key, None)
        if streams is None:
            return
        from graphrunner.checks.drift import _first_difference, drift_finding

        found = _first_difference(*streams)
        if found is not None:
            self.add(cap.findings, drift_finding(found[0], found[1], self.backend, cap.key))

    def end(self, cap: Capture) -> None:
        self._streams.pop(cap.key, None)

    def report(self, cap: Capture, what: str, stack: List[Tuple[Any, int]]) -> None:
        """Record an ``"unsafe-op"`` finding at the innermost frame of ``stack``."""
        loc = (stack[0][0].f_code.co_filename, stack[0][1], stack[0][0].f_code.co_name) if stack else None
        fix, lib = _fix_for(stack, self.step_code, self.backend)
        self.add(cap.findings, Finding("unsafe-op", f"{what} at {where(loc)}", *(loc or (None, None, None)),
                                       fix=fix, bucket=cap.key, in_library=lib))

    def add(self, findings: Optional[List[Finding]], f: Finding) -> None:
        """Append ``f`` unless a finding of its kind was recorded at its line (and, for unsafe
        ops, with its text) before."""
        key = _dedupe_key(f)
        self.reported.setdefault(f.bucket, set()).add(f.kind)
        if findings is None or key in self.seen:
            return
        self.seen.add(key)
        findings.append(f)


class _Collector:
    """Collect mode: the findings list the hooks append to, and a key's capture error as a finding."""

    def __init__(self, lint: UnsafeOpLint) -> None:
        self.lint = lint
        self.findings: List[Finding] = []

    def dedupe(self) -> List[Finding]:
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
            self.lint.report(Capture(key, None, None, None, None, self.findings),
                             f"the tape capture raised {type(cause).__name__}", stack)
            return
        if isinstance(cause, GraphRunnerError) or cause is exc:
            self.findings.append(Finding("capture-error", f"the tape capture raised {type(exc).__name__}: {exc}",
                                         None, None, None, fix="see the message", bucket=key))
            return
        # the step itself raised (in a warmup or the capture): locate it in the traceback
        stack = _traceback_stack(cause)
        loc = (stack[0][0].f_code.co_filename, stack[0][1], stack[0][0].f_code.co_name) if stack else None
        self.lint.add(self.findings, Finding(
            "step-error", f"the step raised {type(cause).__name__}: {cause}", *(loc or (None, None, None)),
            fix="fix the step so that it runs eagerly on the bucket's static inputs (the lint could not "
                "capture this bucket past the error)", bucket=key, in_library=bool(loc and is_library(loc[0]))))


def _dedupe_key(f: Finding) -> tuple:
    """Findings with equal keys are one: a drift or step error once per line, an unsafe op once
    per line and text, anything else once per text (a padding leak names its key)."""
    return (f.kind, (f.file, f.line), None if f.kind in ("drift", "step-error") else f.what)


def _traceback_stack(exc: BaseException) -> List[Tuple[Any, int]]:
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
    :class:`CheckUsageError` when the call raises or does not return an
    uncaptured GraphRunner.
    """
    target = target or getattr(factory, "__qualname__", repr(factory))
    runner = _make_runner(factory, target)
    backend = runner.backend
    name = str(getattr(backend, "name", type(backend).__name__))
    buckets = list(runner.buckets)
    lint = UnsafeOpLint(getattr(runner.step, "__code__", None), name)
    collector = _Collector(lint)
    hooks = getattr(backend, "hooks", None)
    if hooks is None:  # a backend that is not a GraphBackend: capture it as it is
        lint = None
    else:
        hooks.append(lint)
        backend.warmups = int(backend.warmups) + 1  # the lint compares the last two warmups
    try:
        runner._capture(collector)
    finally:
        if lint is not None:
            hooks.remove(lint)
            backend.warmups -= 1
        with contextlib.suppress(Exception):
            runner.cleanup()
    return CheckReport(target=target, backend=name, buckets=buckets, findings=collector.dedupe())
