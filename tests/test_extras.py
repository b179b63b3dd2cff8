"""The README's promise: after ``pip install -e '.[test]'`` (no ``hf``, no
``bench`` extra) ``python -m pytest`` is green, the tests that need an extra
skipping with the extra to install.

CI installs every extra, so this guard hides transformers and matplotlib
(``sys.modules[name] = None``: ``import`` raises ``ModuleNotFoundError``) in a
pytest run of its own: the whole suite is collected (no test module may import
an extra at its top without skipping) and every ``hf``-marked test skips with
the reason, none runs or fails. The docs test's rule for blocks is checked in
``test_docs_examples.py``.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from extras_util import EXTRAS, missing, require, skip_reason

ROOT = Path(__file__).resolve().parents[1]

_HIDE = "import sys\nfor _name in {names!r}:\n    sys.modules[_name] = None\n"


def test_skip_reason_names_the_extra():
    assert skip_reason("transformers") == "needs transformers: pip install -e '.[hf]'"
    assert skip_reason("matplotlib") == "needs matplotlib: pip install -e '.[bench]'"


def test_require_skips_only_a_missing_module(monkeypatch):
    monkeypatch.setitem(EXTRAS, "json", "stdlib")  # a module that is always there
    assert not missing("json") and require("json") is sys.modules["json"]  # present: imported, no skip
    monkeypatch.setitem(sys.modules, "transformers", None)
    assert missing("transformers")
    with pytest.raises(pytest.skip.Exception, match=re.escape(skip_reason("transformers"))):
        require("transformers")


def test_hf_tests_skip_with_the_reason_when_the_extras_are_missing(tmp_path):
    (tmp_path / "hide_extras.py").write_text(_HIDE.format(names=tuple(EXTRAS)))
    # not an xdist worker's environment (PYTEST_XDIST_WORKER: pytest-benchmark would warn it is disabled)
    env = dict(
        {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_XDIST")},
        OMP_NUM_THREADS="1",
        PYTHONPATH=os.pathsep.join([str(tmp_path), str(ROOT), os.environ.get("PYTHONPATH", "")]),
    )
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-o",
            "addopts=",  # no xdist workers (pyproject's -n 2): the plugin below hides the extras in this process
            "-p",
            "hide_extras",
            "-p",
            "no:cacheprovider",
            "-q",
            "-rs",
            "-m",
            "hf",
            "tests",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    summary = out.strip().splitlines()[-1]
    assert re.search(r"\d+ skipped", summary) and not re.search(r"passed|failed|error", summary), summary
    assert int(re.search(r"(\d+) skipped", summary).group(1)) >= 20, summary
    assert skip_reason("transformers") in out, out[-4000:]
    assert "could not import" not in out, out[-4000:]  # every skip names its extra
