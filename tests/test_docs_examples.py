"""The code in the README and the runner guide runs as written."""

from __future__ import annotations

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent


def python_blocks(path: pathlib.Path) -> list[str]:
    return re.findall(r"```python\n(.*?)```", path.read_text(), flags=re.S)


@pytest.mark.parametrize("doc", ["README.md", "docs/runner.md"])
def test_python_blocks_run(doc):
    blocks = python_blocks(ROOT / doc)
    assert blocks, f"{doc} has no python example"
    # Run only the first (complete) example of the runner guide: later blocks are fragments.
    for code in blocks if doc == "README.md" else blocks[:1]:
        exec(compile(code, f"{doc}:example", "exec"), {"__name__": "__docs__"})


def test_readme_quick_start_commands():
    text = (ROOT / "README.md").read_text()
    assert "python -m pip install torch==2.13.0 -e '.[test]' && graphrunner demo" in text
    ci = (ROOT / ".ci" / "run").read_text()
    assert "python -m pytest\n" in ci and "python -m pytest\n" in text
