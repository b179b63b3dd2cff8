"""Capture-safety lint: every reason a runner's step would not capture or would replay wrong, in one pass.

``graphrunner check FILE_OR_MODULE:FACTORY`` (and :func:`check_factory`)
calls ``FACTORY()``, a zero-argument callable returning an *uncaptured*
:class:`~graphrunner.runner.GraphRunner`, and lints it on the CPU, in two
parts:

1. **Lint pass** (no graph). The runner's own capture loop runs with a lint
   backend in place of its backend: for every bucket, the warmups, then the
   step once more as "the capture", all eagerly. While the capture forward
   runs, every aten op is checked against the tape's capture-unsafe
   catalogue (:func:`graphrunner.tape.unsafe.unsafe_reason`) and every torch
   function against its host-reading idioms (``.item()``, ``.tolist()``,
   ``print``, ...: :func:`~graphrunner.tape.unsafe.unsafe_function_reason`);
   each hit is a finding and the op then runs as usual, so the pass goes on
   past it (a tape capture stops at the first). The last warmup's and the
   capture's op streams are compared by the drift check
   (:mod:`graphrunner.drift`). Ops inside ``@no_graph`` bodies are skipped
   on the breakable backend (they run eagerly at replay), as the capture
   does; an eager backend freezes nothing and is not linted.
2. **Tape capture.** ``FACTORY()`` is called again and the fresh runner is
   captured for real on its device (the tape on a CPU), so that every check
   the capture itself runs reports too: a capture error that the lint pass
   did not already report becomes a finding (:func:`_capture_findings`, the
   one place where capture-time checks of :class:`GraphRunner` -- the
   padding-leak check included -- turn into findings).

Each :class:`Finding` names the user's ``file:line`` and a fix: ``@no_graph``
the nearest enclosing function (or module ``forward``) of the user's code,
or, when the line is inside a library (``site-packages``: transformers, ...),
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
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from graphrunner._frames import is_internal, is_library, library_name, where
from graphrunner.errors import CaptureError, CaptureUnsafeOpError

__all__ = ["Finding", "CheckReport", "CheckUsageError", "load_factory", "check_factory"]

#: Finding kinds, in the order the table lists them.
KINDS = ("unsafe-op", "drift", "step-error", "capture-error")


class CheckUsageError(ValueError):
    """``graphrunner check`` cannot run: the target cannot be loaded, is not
    a zero-argument factory, or did not return an uncaptured GraphRunner.
    The CLI prints it as one line and exits 2."""


@dataclass
class Finding:
    """One reason the runner would fail to capture or replay wrong.

    ``kind``: ``"unsafe-op"`` (an op a device graph cannot hold),
    ``"drift"`` (Python state the graph would freeze), ``"step-error"`` (the
    step raised while linted) or ``"capture-error"`` (the tape capture
    raised something the lint pass did not report, e.g. a padding leak).
    ``what`` says what was found; ``file``/``line``/``function`` locate the
    user's source line (``None`` when unknown); ``fix`` says what to do;
    ``bucket`` is the first bucket it was seen in; ``in_library`` is true
    when the line is inside installed library code.
    """

    kind: str
    what: str
    file: Optional[str]
    line: Optional[int]
    function: Optional[str]
    fix: str
    bucket: Any = None
    in_library: bool = False

    @property
    def location(self) -> str:
        """``file:line`` (``"-"`` when unknown)."""
        return "-" if self.file is None else f"{self.file}:{self.line}"

    def to_dict(self) -> Dict[str, Any]:
        """A JSON-ready dict of the fields."""
        return asdict(self)


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


def _user_stack(frame: Any) -> List[Tuple[Any, int]]:
    """The non-internal frames from ``frame`` outwards to the lint pass's
    forward call (frames outside the step are not the user's to fix),
    innermost first."""
    out = []
    f = frame
    stop = _LintBackend.capture_one.__code__
    while f is not None and f.f_code is not stop:
        if not is_internal(f.f_code):
            out.append((f, f.f_lineno))
        f = f.f_back
    return out


# ------------------------------------------------------------------ lint modes
class _Lint:
    """The findings of one lint pass, shared by its two modes."""

    def __init__(self, step_code: Any, backend: str, skip_eager_breaks: bool):
        self.step_code = step_code
        self.backend = backend
        self.findings: List[Finding] = []
        self.seen: set = set()
        self.bucket: Any = None
        self.on = False
        self.host_depth = 0  # inside a host-reading torch function already reported
        from graphrunner.drift import _no_graph_wrapper_code

        self.no_graph = _no_graph_wrapper_code() if skip_eager_breaks else None

    def in_eager_break(self, frame: Any) -> bool:
        if self.no_graph is None:
            return False
        f = frame
        while f is not None:
            if f.f_code is self.no_graph:
                return True
            f = f.f_back
        return False

    def report(self, what: str, frame: Any) -> None:
        stack = _user_stack(frame)
        loc = (stack[0][0].f_code.co_filename, stack[0][1], stack[0][0].f_code.co_name) if stack else None
        key = ("unsafe-op", loc[:2] if loc else None, what)
        if key in self.seen:
            return
        self.seen.add(key)
        fix, lib = _fix_for(stack, self.step_code, self.backend)
        self.findings.append(Finding("unsafe-op", f"{what} at {where(loc)}", *(loc or (None, None, None)),
                                     fix=fix, bucket=self.bucket, in_library=lib))


class _LintDispatch(TorchDispatchMode):
    def __init__(self, lint: _Lint):
        super().__init__()
        self.lint = lint

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        lint = self.lint
        if lint.on and not lint.host_depth and func.namespace != "c10d":
            from graphrunner.tape.unsafe import unsafe_reason

            reason = unsafe_reason(func, args, kwargs)
            if reason is not None:
                frame = sys._getframe(1)
                if not lint.in_eager_break(frame):
                    lint.report(f"{reason[0]} [op: {reason[1]}]", frame)
        return func(*args, **kwargs)


class _LintFunction(TorchFunctionMode):
    def __init__(self, lint: _Lint):
        super().__init__()
        self.lint = lint

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        lint = self.lint
        if not lint.on or lint.host_depth:
            return func(*args, **kwargs)
        from graphrunner.tape.unsafe import _ONE_HOT, unsafe_function_reason

        reason = unsafe_function_reason(func, args, kwargs)
        frame = sys._getframe(1)
        if reason is not None and not lint.in_eager_break(frame):
            lint.report(f"{reason[0]} [op: {reason[1]}]", frame)
        # Inside a reported host read (and inside F.one_hot, which a tape runs
        # without its CPU-only host read) the ops it dispatches are not
        # findings of their own.
        if reason is None and func is not _ONE_HOT:
            return func(*args, **kwargs)
        lint.host_depth += 1
        try:
            return func(*args, **kwargs)
        finally:
            lint.host_depth -= 1


class _LintBackend:
    """Stands in for a runner's backend during the lint pass: the runner's
    capture loop calls :meth:`capture_one` per bucket, which runs the
    warmups and a linted "capture" forward eagerly, records findings and
    never raises for the step's own faults."""

    name = "lint"

    def __init__(self, real: Any, lint: _Lint):
        self.real = real
        self.lint = lint
        self.device = getattr(real, "device", None)
        self.group = getattr(real, "group", None)
        self.warmups = max(1, int(getattr(real, "warmups", 2)))
        # drift is linted even when the runner turned its capture-time check off: a lint reports everything
        self.drift = getattr(real, "_drift_scope", "all") is not None
        self.skip = getattr(real, "_drift_scope", "all") == "segments"
        self.done: List[Any] = []

    @contextlib.contextmanager
    def capture_session(self) -> Iterator["_LintBackend"]:
        """No session state: yields itself."""
        yield self

    def capture_one(self, key: Any, forward_fn: Callable[[], Any], capture_inputs: Any = None,
                    post_warmup_hook: Optional[Callable[[], Any]] = None) -> None:
        """Lint ``forward_fn`` for ``key`` (warmups, then a linted forward and the drift comparison)."""
        from graphrunner.drift import OpRecorder, _first_difference

        lint = self.lint
        lint.bucket = key
        warm = OpRecorder(f"warmup {self.warmups}", skip_eager_breaks=self.skip)
        cap = OpRecorder("capture", skip_eager_breaks=self.skip)
        try:
            for i in range(self.warmups):
                with warm if self.drift and i == self.warmups - 1 else contextlib.nullcontext():
                    forward_fn()
                if post_warmup_hook is not None:
                    post_warmup_hook()
            with _LintFunction(lint), _LintDispatch(lint), (cap if self.drift else contextlib.nullcontext()):
                lint.on = True
                try:
                    forward_fn()
                finally:
                    lint.on = False
        except Exception as exc:  # the step itself failed: report it and go on with the next bucket
            self._step_error(key, exc)
            return
        finally:
            self.done.append(key)
        if self.drift:
            found = _first_difference(warm, cap)
            if found is not None:
                self._drift(key, *found)

    def _step_error(self, key: Any, exc: Exception) -> None:
        tb = exc.__traceback__
        frames = []
        while tb is not None:
            frames.append((tb.tb_frame, tb.tb_lineno))
            tb = tb.tb_next
        stack = [(f, n) for f, n in reversed(frames) if not is_internal(f.f_code)
                 and f.f_code is not _LintBackend.capture_one.__code__]
        loc = (stack[0][0].f_code.co_filename, stack[0][1], stack[0][0].f_code.co_name) if stack else None
        key_ = ("step-error", loc[:2] if loc else None, type(exc).__name__)
        if key_ in self.lint.seen:
            return
        self.lint.seen.add(key_)
        self.lint.findings.append(Finding(
            "step-error", f"the step raised {type(exc).__name__}: {exc}", *(loc or (None, None, None)),
            fix="fix the step so that it runs eagerly on the bucket's static inputs (the lint pass could not "
                "lint this bucket past the error)", bucket=key,
            in_library=bool(loc and is_library(loc[0]))))

    def _drift(self, key: Any, text: str, rec: Any) -> None:
        loc = rec.where
        key_ = ("drift", loc[:2] if loc else None)
        if key_ in self.lint.seen:
            return
        self.lint.seen.add(key_)
        breakable = "" if self.lint.backend == "breakable" else " and use backend='breakable'"
        if loc is not None and is_library(loc[0]):
            lib = library_name(loc[0])
            fix = (f"make it an input: the value is Python state inside {lib}, which @no_graph cannot wrap; keep "
                   "it in a tensor (an input, or a buffer the step updates in place) instead of a Python "
                   "number, or use a cache/model configuration that does")
        elif loc is not None:
            fix = (f"make the value a tensor input (or a tensor the step updates in place), or @no_graph the "
                   f"enclosing function {loc[2]}{breakable} so it runs eagerly at every replay")
        else:
            fix = "make the value a tensor input"
        self.lint.findings.append(Finding(
            "drift", f"{text}: the step reads Python state that changes between calls, which the graph freezes",
            *(loc or (None, None, None)), fix=fix, bucket=key, in_library=bool(loc and is_library(loc[0]))))

    def can_run(self, key: Any) -> bool:
        """Nothing is captured: False."""
        return False

    def info(self, key: Any) -> Dict[str, Any]:
        """No capture statistics: an empty dict."""
        return {}

    def replay(self, key: Any) -> Any:
        """Never called: the lint pass captures nothing."""
        raise CaptureError("the lint backend captures nothing")  # pragma: no cover

    def cleanup(self) -> None:
        """Nothing to release."""


def _lint(runner: Any) -> List[Finding]:
    """The lint pass over ``runner`` (which it consumes: do not use it after)."""
    real = runner.backend
    name = str(getattr(real, "name", type(real).__name__))
    if getattr(real, "_drift_scope", "all") is None and name == "eager":
        return []  # an eager backend captures nothing: nothing can be frozen or unsafe
    lint = _Lint(getattr(runner.step, "__code__", None), name,
                 skip_eager_breaks=getattr(real, "_drift_scope", "all") == "segments")
    runner.backend = _LintBackend(real, lint)
    try:
        runner.capture()
    finally:
        runner.backend = real
    return lint.findings


# ------------------------------------------------------------------ tape capture
_AT = re.compile(r" at (?P<file>[^\s:]+\.py):(?P<line>\d+) in (?P<func>[\w<>.]+)")


def _capture_findings(runner: Any, prior: List[Finding]) -> List[Finding]:
    """Capture ``runner`` for real and turn a capture error into findings.

    THE hook point for capture-time checks of :class:`GraphRunner`: a check
    the capture runs (drift, capture-unsafe ops, the padding-leak check)
    raises :class:`CaptureError`; the error becomes one finding unless the
    lint pass already reported it (an unsafe op or a drift: the tape stops at
    the first of what the lint pass listed). A new capture-time check needs
    no change here to be reported; give its error a ``file:line`` in the
    `` at FILE:LINE in FUNC`` form to have it located, or add a branch below
    to name its own kind.
    """
    try:
        runner.capture()
    except CaptureError as exc:
        cause = exc.__cause__
        text = str(exc)
        kinds = {f.kind for f in prior}
        if isinstance(cause, CaptureUnsafeOpError) and "unsafe-op" in kinds:
            return []
        if "drift between" in text and "drift" in kinds:
            return []
        if cause is not None and not isinstance(cause, (CaptureError,)) and "step-error" in kinds:
            return []
        m = _AT.search(text)
        loc = (m["file"], int(m["line"]), m["func"]) if m else (None, None, None)
        kind = "unsafe-op" if isinstance(cause, CaptureUnsafeOpError) else (
            "drift" if "drift between" in text else "capture-error")
        return [Finding(kind, f"the tape capture raised {type(exc).__name__}: {text}", *loc,
                        fix="see the message", in_library=bool(m and is_library(m["file"])))]
    except (TypeError, ValueError) as exc:
        if any(f.kind == "step-error" for f in prior):
            return []
        return [Finding("capture-error", f"the tape capture raised {type(exc).__name__}: {exc}", None, None, None,
                        fix="see the message")]
    finally:
        with contextlib.suppress(Exception):
            runner.cleanup()
    return []


def check_factory(factory: Callable[[], Any], target: str = "") -> CheckReport:
    """Lint the runner ``factory()`` returns for capture safety; return a :class:`CheckReport`.

    ``factory`` is called twice (the lint pass consumes its runner; the tape
    capture uses a fresh one), so it must build everything it needs
    (model, cache) itself. Raises :class:`CheckUsageError` when a call
    raises or does not return an uncaptured GraphRunner.
    """
    target = target or getattr(factory, "__qualname__", repr(factory))
    runner = _make_runner(factory, target)
    backend = str(getattr(runner.backend, "name", type(runner.backend).__name__))
    buckets = list(runner.buckets)
    findings = _lint(runner)
    del runner
    findings += _capture_findings(_make_runner(factory, target), findings)
    return CheckReport(target=target, backend=backend, buckets=buckets, findings=findings)
