"""The optional extras the tests know about, and how a test skips without one.

The README's quick start installs ``.[test]`` only; the tests that need an
optional extra skip without it, with a reason naming the extra to install::

    from extras_util import require

    transformers = require("transformers")   # skips: needs transformers: pip install -e '.[hf]'

Tests marked ``hf`` skip in ``conftest.py`` before they run when transformers
is missing; the docs test skips a python block whose imports need a missing
extra (``test_docs_examples.needed_modules``). A module that is installed but
fails to import is not "missing": the test runs and fails, so a broken install
is never hidden behind a skip.
"""

from __future__ import annotations

import importlib.util
import inspect

import pytest

#: optional module -> the extra of pyproject.toml that installs it
EXTRAS = {
    "transformers": "hf",
    "matplotlib": "bench",
    "fastapi": "serve",
    "uvicorn": "serve",
    "prometheus_client": "serve",
    "openai": "serve",
}

# pytest >= 8.2 can skip on ModuleNotFoundError only: a module that is there but raises on import fails the test
_ONLY_NOT_FOUND = (
    {"exc_type": ModuleNotFoundError} if "exc_type" in inspect.signature(pytest.importorskip).parameters else {}
)


def missing(module: str) -> bool:
    """Whether ``module`` (a key of :data:`EXTRAS`) is not installed (also when
    ``sys.modules[module]`` is ``None``, the way tests hide an installed one)."""
    return importlib.util.find_spec(module) is None


def skip_reason(module: str) -> str:
    """The skip reason of a test that needs ``module``: which extra to install."""
    return f"needs {module}: pip install -e '.[{EXTRAS[module]}]'"


def require(module: str):
    """Import and return ``module``, or skip the calling test (or module, at
    module level) with :func:`skip_reason` when it is not installed."""
    __tracebackhide__ = True  # the skip is reported at the caller's line
    return pytest.importorskip(module, reason=skip_reason(module), **_ONLY_NOT_FOUND)
