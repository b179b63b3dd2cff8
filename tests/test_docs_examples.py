"""Every python block in README.md and docs/*.md runs as pasted, each in a
fresh Python process, unless the line just above it is ``<!-- fragment -->``."""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys
from typing import List, NamedTuple

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
FRAGMENT = "<!-- fragment -->"
DOCS = ["README.md"] + sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md"))


class Block(NamedTuple):
    doc: str
    line: int  # 1-based line of the opening fence
    code: str
    fragment: bool


def python_blocks(text: str, doc: str = "<text>") -> List[Block]:
    """The fenced ```python blocks of a markdown text, each with whether the
    line just above its fence is the fragment marker."""
    blocks = []
    for m in re.finditer(r"^```python\n(.*?)^```", text, flags=re.S | re.M):
        before = text[:m.start()].rstrip("\n").rsplit("\n", 1)[-1]
        blocks.append(Block(doc, text.count("\n", 0, m.start()) + 1, m.group(1), before.strip() == FRAGMENT))
    return blocks


def run_block(code: str, cwd: pathlib.Path) -> subprocess.CompletedProcess:
    """Run ``code`` as a script in a fresh interpreter in ``cwd`` (this
    checkout first on the path, one torch thread)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""),
               OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=120)


ALL_BLOCKS = [b for doc in DOCS for b in python_blocks((ROOT / doc).read_text(), doc)]
RUNNABLE = [b for b in ALL_BLOCKS if not b.fragment]


@pytest.mark.parametrize("block", RUNNABLE, ids=[f"{b.doc}:{b.line}" for b in RUNNABLE])
def test_python_block_runs_as_pasted(block, tmp_path):
    proc = run_block(block.code, tmp_path)
    assert proc.returncode == 0, (f"{block.doc}:{block.line} fails when pasted (mark it {FRAGMENT} on the line "
                                  f"above if it is not meant to run):\n{proc.stderr[-3000:]}")


def test_blocks_are_found_and_most_run():
    assert any(b.doc == "README.md" for b in RUNNABLE), "README.md has no runnable python example"
    assert len(RUNNABLE) >= 4, [f"{b.doc}:{b.line}" for b in RUNNABLE]


def test_fragment_marker_only_applies_to_the_line_just_above():
    """Negative control of the extractor: a marker further up, or none, leaves
    the block runnable, and a failing runnable block is reported as failing."""
    text = (f"{FRAGMENT}\n```python\nundefined_name\n```\n\n"
            f"{FRAGMENT}\n\ntext\n```python\nraise SystemExit(3)\n```\n"
            "```python\nprint('ok')\n```\n")
    blocks = python_blocks(text)
    assert [b.fragment for b in blocks] == [True, False, False]
    assert [b.line for b in blocks] == [2, 9, 12]
    assert run_block(blocks[1].code, ROOT).returncode == 3
    assert run_block(blocks[2].code, ROOT).stdout == "ok\n"


def test_readme_quick_start_commands():
    text = (ROOT / "README.md").read_text()
    assert "python -m pip install torch==2.13.0 -e '.[test]' && graphrunner demo" in text
    ci = (ROOT / ".ci" / "run").read_text()
    assert "python -m pytest\n" in ci and "python -m pytest\n" in text
