"""No import runs back up a layer (DESIGN.md's parts, bottom up; issue 32 item 3).

Every module of ``graphrunner`` and ``graphrunner_tools`` sits in one layer of
:data:`LAYERS`; an import (at the top of a module or inside a function) may name
its own layer or one below, never one above. A new module must be placed in the
table. ``python tests/test_layers.py [ROOT]`` prints every import that runs up a
layer in a checkout (exit status 1 when there is one).

The key space, inputs, staging and layout sit below the checks, as issue 32
counts the upward imports (``inputs -> checks`` is one of its three): the checks
build on them (the padding check draws a key's regions and an input's bounds),
while they know no check. DESIGN.md's parts table lists the checks' row first.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: The layers, bottom up: (name, module prefixes). A module is in the layer of its longest prefix.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    (
        "foundation",
        (
            "graphrunner._aten",
            "graphrunner._env",
            "graphrunner._frames",
            "graphrunner._pytree",
            "graphrunner.errors",
            "graphrunner.trace",
            "graphrunner.report",
            "graphrunner.progress",
        ),
    ),
    ("tape", ("graphrunner.tape",)),
    ("devices", ("graphrunner.devices", "graphrunner.testing")),
    ("group", ("graphrunner.group", "graphrunner.channel")),
    ("recording", ("graphrunner.recording",)),
    ("breakable", ("graphrunner.breakable",)),
    ("backends", ("graphrunner.backends", "graphrunner.arena")),
    (
        "keys/inputs/staging/layout",
        (
            "graphrunner.keys",
            "graphrunner.buckets",
            "graphrunner.inputs",
            "graphrunner.staging",
            "graphrunner.layout",
            "graphrunner.planning",
        ),
    ),
    ("checks", ("graphrunner.checks",)),
    (
        "server/capturer",
        (
            "graphrunner.serving",
            "graphrunner.server",
            "graphrunner.agreement",
            "graphrunner.dispatch",
            "graphrunner.ownership",
            "graphrunner.capturing",
            "graphrunner.capturer",
            "graphrunner.background",
            "graphrunner.budget",
        ),
    ),
    ("runner", ("graphrunner.runner", "graphrunner")),  # the package itself is the facade over the runner
    ("hf", ("graphrunner.hf",)),
    ("tools", ("graphrunner_tools",)),
]


def layer_of(module: str) -> int | None:
    """The index in :data:`LAYERS` of ``module`` (its longest matching prefix), or None."""
    best: tuple[int, int | None] = (-1, None)
    for i, (_, prefixes) in enumerate(LAYERS):
        for p in prefixes:
            if (module == p or module.startswith(p + ".")) and len(p) > best[0]:
                best = (len(p), i)
    return best[1]


def module_name(path: Path, root: Path) -> str:
    """``graphrunner/backends/base.py`` -> ``graphrunner.backends.base`` (a package: its ``__init__``)."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path, module: str) -> list[tuple[int, str]]:
    """``(line, imported module)`` of every ``graphrunner*`` import in the file, relative ones resolved."""
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            names = [".".join(base + ([node.module] if node.module else []))]
        else:
            continue
        out += [(node.lineno, n) for n in names if n.split(".")[0] in ("graphrunner", "graphrunner_tools")]
    return out


def upward_imports(root: Path = ROOT) -> tuple[list[tuple[str, int, str, str, str]], list[str]]:
    """``(upward, unplaced)``: every import of a module from a layer above its own, as
    ``(module, line, imported, its layer, imported layer)``, and the modules in no layer."""
    upward, unplaced = [], []
    files = sorted((root / "graphrunner").rglob("*.py")) + sorted((root / "graphrunner_tools").rglob("*.py"))
    for path in files:
        module = module_name(path, root)
        mine = layer_of(module)
        if mine is None:
            unplaced.append(module)
            continue
        for line, imported in imports_of(path, module):
            theirs = layer_of(imported)
            if theirs is None:
                unplaced.append(imported)
            elif theirs > mine:
                upward.append((module, line, imported, LAYERS[mine][0], LAYERS[theirs][0]))
    return upward, sorted(set(unplaced))


def test_every_module_is_in_a_layer():
    assert upward_imports()[1] == [], "place these modules in LAYERS"


def test_no_import_runs_up_a_layer():
    assert upward_imports()[0] == []


def test_the_walk_sees_an_upward_import(tmp_path):
    """Negative control: a backend that imports a check, and a function-level import, are found."""
    pkg = tmp_path / "graphrunner" / "backends"
    pkg.mkdir(parents=True)
    (tmp_path / "graphrunner" / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("from .base import X\n")
    (pkg / "base.py").write_text("X = 1\n\ndef f():\n    from graphrunner.checks.drift import DriftCheck\n")
    (tmp_path / "graphrunner_tools").mkdir()
    upward, unplaced = upward_imports(tmp_path)
    assert upward == [("graphrunner.backends.base", 4, "graphrunner.checks.drift", "backends", "checks")]
    assert unplaced == []
    assert layer_of("graphrunner.backends.base") < layer_of("graphrunner.checks.drift") < layer_of("graphrunner.runner")


def main(argv: list[str]) -> int:
    """Print the imports that run up a layer in the checkout ``argv[0]`` (default: this one)."""
    upward, unplaced = upward_imports(Path(argv[0]).resolve() if argv else ROOT)
    for module, line, imported, mine, theirs in upward:
        print(f"{module}:{line} imports {imported}: {mine} -> {theirs}")
    for module in unplaced:
        print(f"{module}: in no layer")
    print(f"{len(upward)} import(s) up a layer, {len(unplaced)} module(s) in no layer")
    return 1 if upward or unplaced else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
