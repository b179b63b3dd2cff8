"""The CLI's target loader: what ``graphrunner check TARGET [--inputs NAME]`` names, as a runner.

``TARGET`` is ``FILE_OR_MODULE:NAME`` (:func:`load_target`): a factory returning an
uncaptured :class:`~graphrunner.GraphRunner` (:func:`load_factory`, checked by
:func:`graphrunner.checks.lint.check_factory`), or a step checked with example inputs
(:func:`runner_from_examples`, :func:`check_step`). Every target that cannot be checked
raises :class:`~graphrunner.checks.lint.CheckUsageError` (one line, exit code 2 in the CLI).
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import inspect
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from graphrunner.checks.lint import EXPECTED, CheckReport, CheckUsageError, check_runner, exit_text, required_parameters
from graphrunner.inputs import BatchInput
from graphrunner.runner import GraphRunner

__all__ = ["load_target", "load_factory", "runner_from_examples", "check_step"]

#: The forms of a target.
_FORM = "FILE_OR_MODULE:FACTORY (e.g. model.py:make_runner), or FILE_OR_MODULE:STEP with --inputs NAME"


def _load_module(source: str, target: str) -> Any:
    """The module ``source`` names: a ``.py`` file (loaded fresh) or an importable module."""
    looks_like_file = source.endswith(".py") or os.sep in source or (os.altsep or os.sep) in source
    if os.path.isdir(source) and not source.endswith(".py"):
        importable = not looks_like_file and all(p.isidentifier() for p in source.split("."))
        if importable:  # a package directory named as a module (graphrunner check mypkg:make in its parent)
            try:
                importable = importlib.util.find_spec(source) is not None
            except Exception:
                importable = False
        if not importable:
            raise CheckUsageError(
                f"{source!r} is a directory, not a Python file: name a .py file inside it "
                f"({os.path.join(source, 'model.py')}:FACTORY) or an importable module (package.module:FACTORY)"
            )
        looks_like_file = False
    elif looks_like_file or os.path.exists(source):
        path = os.path.abspath(source)
        if not os.path.exists(path):
            raise CheckUsageError(f"file {source!r} does not exist (in {os.getcwd()}); check the path")
        if not os.path.isfile(path):
            raise CheckUsageError(f"{source!r} is not a regular file; name a .py file")
        name = f"_graphrunner_check_{abs(hash(path))}"
        spec = importlib.util.spec_from_file_location(name, path)
        if spec is None or spec.loader is None:
            raise CheckUsageError(f"cannot load {source!r} as a Python file; name a .py file")
        module = importlib.util.module_from_spec(spec)
        sys.path.insert(0, os.path.dirname(path))
        sys.modules[name] = module
        try:
            spec.loader.exec_module(module)
        except SystemExit as exc:
            sys.modules.pop(name, None)
            raise CheckUsageError(
                f"loading {source!r} {exit_text(exc)}; guard the module's script code with if __name__ == '__main__':"
            ) from None
        except Exception as exc:
            sys.modules.pop(name, None)
            raise CheckUsageError(f"loading {source!r} raised {type(exc).__name__}: {exc}") from exc
        finally:
            with contextlib.suppress(ValueError):
                sys.path.remove(os.path.dirname(path))
        return module
    try:
        return importlib.import_module(source)
    except SystemExit as exc:
        raise CheckUsageError(
            f"importing module {source!r} {exit_text(exc)}; guard the module's script code "
            "with if __name__ == '__main__':"
        ) from None
    except Exception as exc:
        raise CheckUsageError(f"cannot import module {source!r}: {type(exc).__name__}: {exc}") from exc


def _split(target: Any) -> tuple[str, str]:
    if not isinstance(target, str) or ":" not in target:
        raise CheckUsageError(f"expected {_FORM}, got {target!r}")
    source, _, attr = target.rpartition(":")
    if not source or not attr:
        raise CheckUsageError(f"expected {_FORM}, got {target!r}")
    return source, attr


def _attribute(module: Any, source: str, attr: str) -> Any:
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise CheckUsageError(f"{source!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    return obj


def load_target(target: str) -> tuple[Any, Any]:
    """Resolve ``FILE_OR_MODULE:NAME`` to ``(module, object)``.

    ``FILE`` is a path to a ``.py`` file (loaded as a fresh module, its
    folder first on ``sys.path`` while it loads); otherwise the part before
    the last ``:`` is an importable module name (a directory is refused,
    unless it is an importable package named as a module). ``NAME`` may be
    dotted (``module:Class.make``). Raises :class:`CheckUsageError` naming
    what is wrong: a missing file, a directory, a module that raises or
    calls ``sys.exit`` while loading, a missing attribute."""
    source, attr = _split(target)
    module = _load_module(source, target)
    return module, _attribute(module, source, attr)


def load_factory(target: str) -> Callable[..., Any]:
    """Resolve ``FILE_OR_MODULE:FACTORY`` to the callable it names (see :func:`load_target`);
    :class:`CheckUsageError` when it is not callable."""
    obj = load_target(target)[1]
    if isinstance(obj, GraphRunner):
        raise CheckUsageError(
            f"{target} is a GraphRunner object; check needs {EXPECTED}: point at a function "
            "that builds and returns the runner uncaptured"
        )
    if not callable(obj):
        raise CheckUsageError(f"{target} is {type(obj).__name__}, not callable; check needs {EXPECTED}")
    return obj


def _example_inputs(inputs: Any, what: str) -> dict[str, Any]:
    if callable(inputs) and not isinstance(inputs, Mapping):
        try:
            inputs = inputs()
        except SystemExit as exc:
            raise CheckUsageError(f"{what}() {exit_text(exc)} instead of returning example inputs") from None
        except Exception as exc:
            raise CheckUsageError(f"{what}() raised {type(exc).__name__}: {exc}") from exc
    if not isinstance(inputs, Mapping) or not inputs:
        raise CheckUsageError(
            f"{what} is {type(inputs).__name__}; expected a non-empty dict {{argument name: "
            "example tensor (batch on dim 0) or gr.BatchInput}, or a zero-argument function "
            "returning one"
        )
    for k, v in inputs.items():
        if not isinstance(v, (torch.Tensor, BatchInput)) or (isinstance(v, torch.Tensor) and v.dim() == 0):
            got = "a 0-dim tensor" if isinstance(v, torch.Tensor) else type(v).__name__
            raise CheckUsageError(
                f"{what}[{k!r}] is {got}; expected an example tensor with the batch on dim 0 (or a gr.BatchInput)"
            )
    return dict(inputs)


def runner_from_examples(
    step: Callable[..., Any],
    inputs: Any,
    buckets: Sequence[int] | None = None,
    backend: str = "breakable",
    what: str = "inputs",
) -> Any:
    """An uncaptured :class:`~graphrunner.GraphRunner` of ``step`` declared from example inputs.

    ``inputs``: ``{argument: example tensor}`` (the batch on dim 0; each
    becomes ``BatchInput(trailing=shape[1:], dtype=...)``, integer ones
    bounded by the example's min and max) or ``{argument: BatchInput}``, or a
    zero-argument function returning such a dict. ``buckets``: default the
    examples' batch size. Raises :class:`CheckUsageError` when the names do
    not match ``step``'s arguments."""
    examples = _example_inputs(inputs, what)
    required = required_parameters(step)
    if required is not None:
        missing = [r for r in required if r not in examples]
        params = inspect.signature(step).parameters
        if not params:
            raise CheckUsageError(
                "the step takes no arguments: a zero-argument function is checked as a factory "
                "(returning an uncaptured GraphRunner); drop --inputs, or name the step"
            )
        extra = (
            [] if any(p.kind == p.VAR_KEYWORD for p in params.values()) else [k for k in examples if k not in params]
        )
        if missing or extra:
            raise CheckUsageError(
                f"{what} names {sorted(examples)} but the step takes ({', '.join(params)})"
                + (f": missing {missing}" if missing else "")
                + (f": unknown {extra}" if extra else "")
                + "; give one example per argument, keyed by the argument's name"
            )
    decl, sizes = {}, set()
    for k, v in examples.items():
        if isinstance(v, BatchInput):
            decl[k] = v
            continue
        sizes.add(int(v.shape[0]))
        bounds = None
        if not v.dtype.is_floating_point and not v.dtype.is_complex and v.dtype != torch.bool and v.numel():
            bounds = (int(v.min()), int(v.max()))
        decl[k] = BatchInput(trailing=tuple(v.shape[1:]), dtype=v.dtype, bounds=bounds)
    if buckets is None:
        if len(sizes) != 1:
            raise CheckUsageError(
                f"{what} has examples of batch sizes {sorted(sizes) or 'unknown'}; give "
                "tensors of one batch size on dim 0, or pass --buckets"
            )
        buckets = [sizes.pop()]
    try:
        return GraphRunner(step, decl, buckets=list(buckets), backend=backend, progress=False)
    except (TypeError, ValueError) as exc:
        raise CheckUsageError(f"cannot build a GraphRunner from the step and {what}: {exc}") from exc


def check_step(
    step: Callable[..., Any],
    inputs: Any,
    buckets: Sequence[int] | None = None,
    backend: str = "breakable",
    target: str = "",
    what: str = "inputs",
) -> CheckReport:
    """Lint ``step`` with example ``inputs`` (see :func:`runner_from_examples`; ``what`` names
    them in errors): the runner a :func:`~graphrunner.checks.lint.check_factory` would get,
    declared from the examples; a :class:`~graphrunner.checks.lint.CheckReport`."""
    target = target or getattr(step, "__qualname__", repr(step))
    return check_runner(runner_from_examples(step, inputs, buckets, backend, what), target)
