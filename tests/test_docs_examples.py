"""Every python block in README.md and docs/*.md runs as pasted, each in a
fresh Python process, unless the line just above it is ``<!-- fragment -->``.
The process is forked from one that imported torch, graphrunner and
transformers once (``tests/block_zygote.py``): a fresh interpreter as
``python -c`` gives it, without paying the imports for every block.

A block whose imports need an optional extra that is not installed
(``import transformers``, ``from graphrunner import hf``, ``gr.hf``: the ``hf``
extra; ``matplotlib``: the ``bench`` extra) is skipped with the extra to
install, so the README's test command is green after the quick start's
``.[test]`` install; with the extra installed the block runs."""

from __future__ import annotations

import ast
import os
import pathlib
import re
import subprocess
import sys
from typing import NamedTuple

import pytest
from block_zygote import Zygote
from extras_util import missing, skip_reason

ROOT = pathlib.Path(__file__).resolve().parent.parent
FRAGMENT = "<!-- fragment -->"
DOCS = ["README.md"] + sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md"))


class Block(NamedTuple):
    doc: str
    line: int  # 1-based line of the opening fence
    code: str
    fragment: bool


def python_blocks(text: str, doc: str = "<text>") -> list[Block]:
    """The fenced ```python blocks of a markdown text, each with whether the
    line just above its fence is the fragment marker."""
    blocks = []
    for m in re.finditer(r"^```python\n(.*?)^```", text, flags=re.S | re.M):
        before = text[: m.start()].rstrip("\n").rsplit("\n", 1)[-1]
        blocks.append(Block(doc, text.count("\n", 0, m.start()) + 1, m.group(1), before.strip() == FRAGMENT))
    return blocks


def run_block(code: str, cwd: pathlib.Path) -> subprocess.CompletedProcess:
    """Run ``code`` as a script in a fresh interpreter in ``cwd`` (this
    checkout first on the path, one torch thread)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True, timeout=120)


#: what a block may import -> the optional module it needs (a key of extras_util.EXTRAS)
OPTIONAL = {"transformers": "transformers", "matplotlib": "matplotlib", "graphrunner.hf": "transformers"}


def needed_modules(code: str) -> list[str]:
    """The optional modules that the imports of ``code`` need, sorted: a module
    of :data:`OPTIONAL` or a submodule of one, imported (``import``, ``from ...
    import``) or reached as an attribute of an imported name (``gr.hf`` after
    ``import graphrunner as gr``). Code that does not parse needs nothing (its
    run reports the error)."""
    try:
        tree = ast.parse(code)
    except SyntaxError:
        return []
    names, aliases = set(), {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                names.add(a.name)
                bound = a.asname or a.name.split(".")[0]  # `import x.y` binds x
                aliases[bound] = a.name if a.asname else bound
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
            for a in node.names:
                names.add(f"{node.module}.{a.name}")
                aliases[a.asname or a.name] = f"{node.module}.{a.name}"
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases:
            names.add(f"{aliases[node.value.id]}.{node.attr}")
    return sorted(
        {need for name in names for mod, need in OPTIONAL.items() if name == mod or name.startswith(mod + ".")}
    )


def missing_extra(code: str) -> str | None:
    """The skip reason of a block that needs an optional module which is not
    installed (``needs transformers: pip install -e '.[hf]'``), else ``None``."""
    return next((skip_reason(m) for m in needed_modules(code) if missing(m)), None)


ALL_BLOCKS = [b for doc in DOCS for b in python_blocks((ROOT / doc).read_text(), doc)]
RUNNABLE = [b for b in ALL_BLOCKS if not b.fragment]


@pytest.fixture(scope="module")
def zygote():
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    z = Zygote(env)
    yield z
    z.close()


@pytest.mark.parametrize("block", RUNNABLE, ids=[f"{b.doc}:{b.line}" for b in RUNNABLE])
def test_python_block_runs_as_pasted(block, tmp_path, zygote):
    reason = missing_extra(block.code)
    if reason:
        pytest.skip(reason)
    status, _, stderr = zygote.run(block.code, str(tmp_path))
    assert status == 0, (
        f"{block.doc}:{block.line} fails when pasted (mark it {FRAGMENT} on the line "
        f"above if it is not meant to run):\n{stderr[-3000:]}"
    )


def test_a_forked_block_runs_as_python_c_runs_it(tmp_path, zygote):
    """The zygote's child against a real ``python -c`` (:func:`run_block`), on a block that prints what a
    script sees of its process (``__name__``, ``sys.argv``, the working directory, the path's head, a fresh
    ``__main__``), then fails with an exit status of its own: the same output and status."""
    code = (
        "import os, sys\n"
        "print(__name__, sys.argv, os.getcwd() == os.path.realpath('.'), repr(sys.path[0]))\n"
        "print(sorted(k for k in vars(sys.modules['__main__']) if not k.startswith('__')))\n"
        "x = 1\n"
        "print('err', file=sys.stderr)\n"
        "sys.exit(3)\n"
    )
    status, out, err = zygote.run(code, str(tmp_path))
    ref = run_block(code, tmp_path)
    assert (status, out, err.strip()) == (ref.returncode, ref.stdout, ref.stderr.strip()) == (3, ref.stdout, "err")
    status, out, err = zygote.run("raise ValueError('planted')", str(tmp_path))
    assert status == 1 and "ValueError: planted" in err and out == ""


def test_blocks_are_found_and_most_run():
    assert any(b.doc == "README.md" for b in RUNNABLE), "README.md has no runnable python example"
    assert len(RUNNABLE) >= 4, [f"{b.doc}:{b.line}" for b in RUNNABLE]


def test_fragment_marker_only_applies_to_the_line_just_above():
    """Negative control of the extractor: a marker further up, or none, leaves
    the block runnable, and a failing runnable block is reported as failing."""
    text = (
        f"{FRAGMENT}\n```python\nundefined_name\n```\n\n"
        f"{FRAGMENT}\n\ntext\n```python\nraise SystemExit(3)\n```\n"
        "```python\nprint('ok')\n```\n"
    )
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


def test_needed_modules_reads_the_imports():
    """The extractor of the skip-if-missing rule, with negative controls: a name
    in a string or a comment, a lookalike module, or plain graphrunner need nothing."""
    assert needed_modules("import transformers\n") == ["transformers"]
    assert needed_modules("import matplotlib.pyplot as plt\n") == ["matplotlib"]
    assert needed_modules("from matplotlib import pyplot\n") == ["matplotlib"]
    assert needed_modules("from graphrunner import hf\n") == ["transformers"]
    assert needed_modules("from graphrunner.hf import DecodeRunner\n") == ["transformers"]
    assert needed_modules("import graphrunner.hf as ghf\n") == ["transformers"]
    assert needed_modules("def f():\n    import transformers\n") == ["transformers"]
    assert needed_modules("import graphrunner as gr\nr = gr.hf.DecodeRunner\n") == ["transformers"]
    assert needed_modules("import graphrunner\ngraphrunner.hf.DecodeRunner\n") == ["transformers"]
    assert needed_modules("import transformers, matplotlib\n") == ["matplotlib", "transformers"]
    for code in (
        "import torch\nimport graphrunner as gr\ngr.GraphRunner\n",
        "print('import transformers')  # import matplotlib\n",
        "import transformers_stub\nimport graphrunner.tape\n",
        "hf = object()\nhf.x\n",
        "this is not python (\n",
    ):
        assert needed_modules(code) == [], code


def test_blocks_needing_a_missing_extra_skip_and_run_when_it_is_there(monkeypatch, tmp_path):
    """The docs that use transformers are found; hidden, each block skips naming the
    extra; installed, none is skipped (they run), and a block without extras never skips."""
    hf_blocks = [b for b in RUNNABLE if "transformers" in needed_modules(b.code)]
    assert {b.doc for b in hf_blocks} >= {"docs/debugging.md", "docs/porting.md"}, hf_blocks
    plain = [b for b in RUNNABLE if not needed_modules(b.code)]
    assert plain and any(b.doc == "README.md" for b in plain)
    if not missing("transformers"):
        assert all(missing_extra(b.code) is None for b in hf_blocks)  # with the extra, they run
    monkeypatch.setitem(sys.modules, "transformers", None)  # as if not installed
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    for b in hf_blocks:
        assert missing_extra(b.code) == "needs transformers: pip install -e '.[hf]'"
        with pytest.raises(pytest.skip.Exception, match=r"pip install -e '\.\[hf\]'"):
            test_python_block_runs_as_pasted(b, tmp_path, None)  # skips before it runs: no process needed
    assert all(missing_extra(b.code) is None for b in plain)
    assert missing_extra("import matplotlib\n") == "needs matplotlib: pip install -e '.[bench]'"


# ----------------------------------------------------------------------------- links between the docs
def heading_anchors(text: str) -> set:
    """The anchors GitHub gives the headings of a markdown text (lower case, punctuation but ``-`` and ``_``
    dropped, spaces to ``-``, ``-1``, ``-2``... for repeats); lines inside fenced code blocks are no headings."""
    anchors, seen, fenced = set(), {}, False
    for line in text.splitlines():
        if line.startswith("```"):
            fenced = not fenced
            continue
        m = None if fenced else re.match(r"^#{1,6} +(.*?) *#*$", line)
        if m:
            slug = re.sub(r"[^\w\- ]", "", m.group(1).lower()).replace(" ", "-")
            n = seen.get(slug, 0)
            seen[slug] = n + 1
            anchors.add(slug if n == 0 else f"{slug}-{n}")
    return anchors


def relative_links(text: str) -> list[str]:
    """The relative link targets ``[text](target)`` of a markdown text outside fenced code (no ``http``,
    no ``mailto``)."""
    out, fenced = [], False
    for line in text.splitlines():
        if line.startswith("```"):
            fenced = not fenced
            continue
        if not fenced:
            out += [t for t in re.findall(r"\]\(([^)\s]+)\)", line) if not re.match(r"[a-z]+:", t)]
    return out


@pytest.mark.parametrize("doc", DOCS)
def test_links_between_the_docs_resolve(doc):
    """Every relative link of README.md and docs/*.md names a file of the repository and, after ``#``, a
    heading of that file (or of the same page for ``#anchor``)."""
    here = (ROOT / doc).parent
    broken = []
    for target in relative_links((ROOT / doc).read_text()):
        path, _, anchor = target.partition("#")
        file = (here / path).resolve() if path else (ROOT / doc)
        if not file.exists():
            broken.append(f"{target}: no file {file.relative_to(ROOT) if ROOT in file.parents else file}")
        elif anchor and file.suffix == ".md" and anchor not in heading_anchors(file.read_text()):
            broken.append(f"{target}: no heading with anchor #{anchor} in {file.relative_to(ROOT)}")
    assert not broken, f"{doc}: broken links:\n" + "\n".join(broken)


def test_link_checker_sees_a_broken_anchor_and_a_missing_file():
    """Negative control: the slugs of headings with code and punctuation, a repeated heading, a heading in
    code that is none, and links to a missing file or heading found as broken."""
    text = "# A `x=` (b)\n## Same\n## Same\n```\n# not a heading\n```\n"
    assert heading_anchors(text) == {"a-x-b", "same", "same-1"}
    links = relative_links("[a](runner.md#nope) [b](https://x.org/y.md) [c](nothing.md)\n```\n[d](e.md)\n```\n")
    assert links == ["runner.md#nope", "nothing.md"]
    assert "nope" not in heading_anchors((ROOT / "docs" / "runner.md").read_text())
    assert not (ROOT / "docs" / "nothing.md").exists()
