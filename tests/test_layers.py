"""No import runs back up a layer, and no import cycle (DESIGN.md's parts, bottom up; issue 32
item 3, issue 50 item 4).

Every module of ``graphrunner`` and ``graphrunner_tools`` sits in one layer of
:data:`LAYERS`; an import (at the top of a module or inside a function) may name
its own layer or one below, never one above. A new module must be placed in the
table. ``python tests/test_layers.py [ROOT]`` prints every import that runs up a
layer, every import cycle between modules, every function-level import of a
``graphrunner`` module and every underscore name imported across modules in a
checkout (exit status 1 when the core has one; the known ones outside the core,
:data:`KNOWN_CYCLES_OUTSIDE_CORE` and :data:`KNOWN_UNDERSCORE_IMPORTS_OUTSIDE_CORE`, are
printed and marked as known).

The key space, inputs, staging and layout sit below the checks, as issue 32
counts the upward imports (``inputs -> checks`` is one of its three): the checks
build on them (the padding check draws a key's regions and an input's bounds),
while they know no check. DESIGN.md's parts table lists the checks' row first.

Cycles (:func:`import_graph`, :func:`import_cycles`): the nodes are the modules (a package is
its ``__init__``), an edge ``A -> B`` is "running A's imports runs B", and a cycle is a
strongly connected component of more than one module. The edges:

* every ``import`` and ``from ... import`` statement counts, at module top or inside a
  function (a function-level import still runs, later: hiding a cycle behind one is what this
  check exists to refuse);
* imports under ``if TYPE_CHECKING:`` never run, so they cannot break an import: the run-time
  graph (``import_graph(type_checking=False)``) leaves them out. They are still one module
  knowing another, and the cycles issue 50 counted (``background <-> capturing <-> serving``,
  ``inputs <-> keys``, the tape's modules) ran through them: the test counts them too
  (``type_checking=True``, the default), so a lower module names what it needs of a higher one
  as a ``typing.Protocol`` of its own (``serving.BackgroundWork``, ``tape.state.ActiveCapture``,
  ``tape.bindings.VerifiedCapture``, ``keys.DeclaresDims``), never by importing it;
* ``from P import x`` is an edge to the submodule ``P.x`` when ``x`` is one, else to ``P``
  (``x`` is then read from ``P``'s namespace, so ``P``'s ``__init__`` must have bound it:
  re-exports in a package ``__init__`` are edges like any other);
* importing ``P.Q.m`` first runs the ``__init__`` of ``P`` and ``P.Q``: edges to those
  too, except to the importing module's own packages. A module's own packages have always
  started running before it does (Python imports a package before its submodules), so
  that import adds nothing; a submodule that imports a sibling by its full path
  (``from graphrunner.tape.graph import TapeGraph`` inside ``graphrunner.tape``) has no
  edge to ``graphrunner.tape``. A submodule that *names* its own package
  (``from graphrunner.tape import TapeGraph``, ``from . import TapeGraph``) reads the
  package's namespace: that is an edge to the package, and it closes a cycle exactly when
  the package's ``__init__`` imports the submodule back (directly or through others), the
  case where the name may not be bound yet. A package ``__init__`` importing its own
  submodules is an ordinary edge.

Two more rules of the core (``graphrunner`` less ``graphrunner.hf``), both strict there and
reported, with an allow-list, in ``graphrunner.hf`` and ``graphrunner_tools``:

* no function-level import of a ``graphrunner`` module (:func:`function_level_imports`);
  a function-level import of an optional or heavy third-party module stays allowed, with a
  comment on its line or the line above saying why;
* no underscore name (``_x``, not a dunder) imported from another module
  (:func:`underscore_imports`): a helper another module needs is public, with a docstring,
  or lives where it is used.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from dataclasses import dataclass
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
            "graphrunner.pacing",
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


@dataclass(frozen=True)
class Import:
    """One ``graphrunner*`` import statement: where it is and what it names."""

    module: str  #: the importing module
    line: int
    imported: str  #: the module named (``from P import x``: ``P``), relative imports resolved
    names: tuple[str, ...]  #: ``from P import x, y``: ``("x", "y")``; ``import P``: ``()``
    in_function: bool  #: inside a ``def`` (runs when the function is called)
    type_checking: bool  #: under ``if TYPE_CHECKING:`` (never runs)
    comment: bool  #: a ``#`` comment on its line or the line above (the why of a function-level import)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _walk(
    node: ast.AST, in_function: bool = False, type_checking: bool = False
) -> Iterator[tuple[ast.AST, bool, bool]]:
    """Every node under ``node`` with whether it is inside a function and under ``if TYPE_CHECKING:``."""
    for child in ast.iter_child_nodes(node):
        yield child, in_function, type_checking
        if isinstance(child, ast.If) and _is_type_checking(child.test):
            for sub in child.body:
                yield sub, in_function, True
                yield from _walk(sub, in_function, True)
            for sub in child.orelse:
                yield sub, in_function, type_checking
                yield from _walk(sub, in_function, type_checking)
            continue
        inner = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
        yield from _walk(child, inner, type_checking)


def import_records(path: Path, module: str, *, every: bool = False) -> list[Import]:
    """Every ``graphrunner*`` import in the file (every import at all with ``every=True``)."""
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    text = path.read_text()
    lines = text.splitlines()
    out = []
    for node, in_function, type_checking in _walk(ast.parse(text, str(path))):
        if isinstance(node, ast.Import):
            targets = [(a.name, ()) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            targets = [(".".join(base + ([node.module] if node.module else [])), tuple(a.name for a in node.names))]
        else:
            continue
        near = lines[max(node.lineno - 2, 0) : node.lineno]
        comment = any("#" in line for line in near)
        for imported, names in targets:
            if every or imported.split(".")[0] in ("graphrunner", "graphrunner_tools"):
                out.append(Import(module, node.lineno, imported, names, in_function, type_checking, comment))
    return out


def imports_of(path: Path, module: str) -> list[tuple[int, str]]:
    """``(line, imported module)`` of every ``graphrunner*`` import in the file, relative ones resolved."""
    return [(r.line, r.imported) for r in import_records(path, module)]


def source_files(root: Path = ROOT) -> dict[str, Path]:
    """Module name -> file, for every module of ``graphrunner`` and ``graphrunner_tools`` under ``root``."""
    files = sorted((root / "graphrunner").rglob("*.py")) + sorted((root / "graphrunner_tools").rglob("*.py"))
    return {module_name(path, root): path for path in files}


def upward_imports(root: Path = ROOT) -> tuple[list[tuple[str, int, str, str, str]], list[str]]:
    """``(upward, unplaced)``: every import of a module from a layer above its own, as
    ``(module, line, imported, its layer, imported layer)``, and the modules in no layer."""
    upward, unplaced = [], []
    for module, path in source_files(root).items():
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


def in_core(module: str) -> bool:
    """The core: ``graphrunner`` less ``graphrunner.hf`` (and less ``graphrunner_tools``)."""
    return module.split(".")[0] == "graphrunner" and not (
        module == "graphrunner.hf" or module.startswith("graphrunner.hf.")
    )


def _ancestors(module: str) -> list[str]:
    parts = module.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def edge_targets(record: Import, modules: set[str]) -> set[str]:
    """The modules that running ``record`` runs (see the module docstring): the module it names
    or the submodules it imports from a package, and the packages above them that are not the
    importing module's own."""
    own = set(_ancestors(record.module)) | {record.module}
    named = record.imported
    while named not in modules and "." in named:  # ``import graphrunner.x.attr``-like: the longest module
        named = named.rsplit(".", 1)[0]
    if named not in modules:
        return set()
    direct = set()
    subs = [f"{named}.{n}" for n in record.names if f"{named}.{n}" in modules]
    direct.update(subs)
    if not record.names or len(subs) < len(record.names):
        direct.add(named)  # a name read from ``named``'s namespace (or ``import named`` itself)
    out = set()
    for target in direct:
        out.add(target)
        out.update(_ancestors(target))
    out -= own
    # a name read from one's own package is a real edge (the package's namespace must hold it)
    if record.names and named in own and named != record.module and len(subs) < len(record.names):
        out.add(named)
    return out


def import_graph(root: Path = ROOT, type_checking: bool = True) -> dict[str, dict[str, list[int]]]:
    """``{module: {imported module: [lines]}}``: the import graph, every edge with its lines
    (function-level imports included; ``if TYPE_CHECKING:`` imports unless ``type_checking=False``)."""
    files = source_files(root)
    modules = set(files)
    graph: dict[str, dict[str, list[int]]] = {m: {} for m in files}
    for module, path in files.items():
        for record in import_records(path, module):
            if record.type_checking and not type_checking:
                continue
            for target in edge_targets(record, modules):
                if target != module:
                    graph[module].setdefault(target, []).append(record.line)
    return graph


def strongly_connected(graph: dict[str, dict[str, list[int]]]) -> list[list[str]]:
    """Tarjan's strongly connected components of ``graph`` (iterative), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    out: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            for child in children:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, {})))))
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    out.append(sorted(component))
    return out


def import_cycles(root: Path = ROOT, type_checking: bool = True) -> list[tuple[tuple[str, ...], list[str]]]:
    """Every import cycle: ``(its modules, sorted; the edges inside it as "a:line -> b")``
    (``type_checking=False``: only the cycles that run, without ``if TYPE_CHECKING:`` imports)."""
    graph = import_graph(root, type_checking)
    out = []
    for component in strongly_connected(graph):
        if len(component) < 2:
            continue
        members = set(component)
        edges = [
            f"{a}:{','.join(map(str, lines))} -> {b}"
            for a in component
            for b, lines in sorted(graph[a].items())
            if b in members
        ]
        out.append((tuple(component), edges))
    return sorted(out)


def function_level_imports(root: Path = ROOT) -> list[Import]:
    """Every import of a ``graphrunner*`` module inside a function (type-checking ones left out)."""
    return [
        r
        for module, path in source_files(root).items()
        for r in import_records(path, module)
        if r.in_function and not r.type_checking
    ]


def uncommented_function_level_imports(root: Path = ROOT) -> list[Import]:
    """Every function-level import in the core with no comment saying why (on its line or above)."""
    return [
        r
        for module, path in source_files(root).items()
        if in_core(module)
        for r in import_records(path, module, every=True)
        if r.in_function and not r.type_checking and not r.comment
    ]


def underscore_imports(root: Path = ROOT) -> list[tuple[str, int, str, str]]:
    """``(module, line, imported module, name)`` of every underscore name (``_x``, not a dunder)
    imported from another ``graphrunner*`` module (type-checking imports included: a private
    type is private too)."""
    return [
        (r.module, r.line, r.imported, name)
        for module, path in source_files(root).items()
        for r in import_records(path, module)
        for name in r.names
        if name.startswith("_") and not name.startswith("__") and r.imported != module
    ]


#: Import cycles inside ``graphrunner.hf`` and ``graphrunner_tools`` known when the core's were
#: removed (issue 50 item 4); those packages are being rewritten elsewhere. Empty it as they go.
KNOWN_CYCLES_OUTSIDE_CORE: list[tuple[str, ...]] = []

#: Underscore names imported across modules inside ``graphrunner.hf`` and ``graphrunner_tools``
#: known when the core's were removed, as ``(module, imported module, name)``. Empty it as they go.
KNOWN_UNDERSCORE_IMPORTS_OUTSIDE_CORE: list[tuple[str, str, str]] = []

#: Function-level imports of ``graphrunner*`` modules in ``graphrunner.hf`` and
#: ``graphrunner_tools``, as ``(module, imported module)``. Empty it as they go.
KNOWN_FUNCTION_LEVEL_IMPORTS_OUTSIDE_CORE: list[tuple[str, str]] = [
    ("graphrunner.hf.decode", "graphrunner.hf.generation"),
    ("graphrunner_tools.bench", "graphrunner"),
    ("graphrunner_tools.bench", "graphrunner.checks.lint"),
    ("graphrunner_tools.bench", "graphrunner.runner"),
    ("graphrunner_tools.bench", "graphrunner_tools"),
    ("graphrunner_tools.bench", "graphrunner_tools.steptime"),
    ("graphrunner_tools.cli", "graphrunner.checks.lint"),
    ("graphrunner_tools.cli", "graphrunner_tools.demo"),
    ("graphrunner_tools.cli", "graphrunner_tools.launch"),
    ("graphrunner_tools.cli", "graphrunner_tools.spec"),
    ("graphrunner_tools.cli", "graphrunner_tools.targets"),
    ("graphrunner_tools.cuda_check", "graphrunner"),
    ("graphrunner_tools.cuda_check", "graphrunner.backends"),
    ("graphrunner_tools.cuda_check", "graphrunner.breakable"),
    ("graphrunner_tools.cuda_check", "graphrunner.devices"),
    ("graphrunner_tools.cuda_check", "graphrunner.errors"),
    ("graphrunner_tools.cuda_check", "graphrunner.testing.cuda_standin"),
    ("graphrunner_tools.cuda_check", "graphrunner_tools.launch"),
    ("graphrunner_tools.cuda_check", "graphrunner_tools.models"),
    ("graphrunner_tools.cuda_check", "graphrunner_tools.models.hf_tiny"),
    ("graphrunner_tools.launch", "graphrunner.testing.cuda_standin"),
    ("graphrunner_tools.loadtest", "graphrunner.devices"),
    ("graphrunner_tools.loadtest", "graphrunner.group"),
    ("graphrunner_tools.loadtest", "graphrunner.progress"),
    ("graphrunner_tools.loadtest", "graphrunner.runner"),
    ("graphrunner_tools.loadtest", "graphrunner_tools.bench"),
    ("graphrunner_tools.loadtest", "graphrunner_tools.launch"),
    ("graphrunner_tools.loadtest", "graphrunner_tools.models"),
    ("graphrunner_tools.loadtest", "graphrunner_tools.models.tp"),
    ("graphrunner_tools.loadtest", "graphrunner_tools.spec"),
    ("graphrunner_tools.loadtest", "graphrunner_tools.threads"),
    ("graphrunner_tools.serve", "graphrunner_tools.models.tiny_chat"),
    ("graphrunner_tools.serve", "graphrunner_tools.plan"),
    ("graphrunner_tools.serve", "graphrunner_tools.serve_admission"),
    ("graphrunner_tools.serve", "graphrunner_tools.serve_engine"),
    ("graphrunner_tools.serve", "graphrunner_tools.serve_tp"),  # loaded only with --tp N
    ("graphrunner_tools.serve_tp", "graphrunner.hf.internals"),  # gr.hf needs transformers: in the rank's process
    ("graphrunner_tools.spec", "graphrunner"),
    ("graphrunner_tools.steptime", "graphrunner.checks.lint"),
    ("graphrunner_tools.steptime", "graphrunner.runner"),
    ("graphrunner_tools.steptime", "graphrunner_tools.targets"),
]


def test_every_module_is_in_a_layer():
    assert upward_imports()[1] == [], "place these modules in LAYERS"


def test_no_import_runs_up_a_layer():
    assert upward_imports()[0] == []


def test_no_import_cycle_in_the_core():
    assert [c for c in import_cycles() if any(in_core(m) for m in c[0])] == []


def test_import_cycles_outside_the_core_are_the_known_ones():
    found = [c[0] for c in import_cycles() if not any(in_core(m) for m in c[0])]
    assert sorted(found) == sorted(KNOWN_CYCLES_OUTSIDE_CORE)


def test_no_function_level_import_of_graphrunner_in_the_core():
    assert [(r.module, r.line, r.imported) for r in function_level_imports() if in_core(r.module)] == []


def test_function_level_imports_outside_the_core_are_the_known_ones():
    found = {(r.module, r.imported) for r in function_level_imports() if not in_core(r.module)}
    assert sorted(found) == sorted(set(KNOWN_FUNCTION_LEVEL_IMPORTS_OUTSIDE_CORE))


def test_every_function_level_import_in_the_core_says_why():
    assert [(r.module, r.line, r.imported) for r in uncommented_function_level_imports()] == []


def test_no_underscore_name_imported_across_modules_in_the_core():
    assert [u for u in underscore_imports() if in_core(u[0])] == []


def test_underscore_imports_outside_the_core_are_the_known_ones():
    found = {(m, imported, name) for m, _, imported, name in underscore_imports() if not in_core(m)}
    assert sorted(found) == sorted(set(KNOWN_UNDERSCORE_IMPORTS_OUTSIDE_CORE))


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


def _package(root: Path, files: dict[str, str]) -> Path:
    """Write ``{relative path: text}`` under ``root`` (with an empty ``graphrunner_tools``)."""
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    (root / "graphrunner_tools").mkdir(exist_ok=True)
    return root


def test_the_walk_sees_a_cycle_through_a_function_level_import(tmp_path):
    """Negative control: two modules importing each other, one of them inside a function, are a
    cycle (and its function-level import and underscore name are found); the same pair with the
    back import under ``if TYPE_CHECKING:`` is a cycle of what the modules know, not one that
    runs."""
    root = _package(
        tmp_path / "a",
        {
            "graphrunner/__init__.py": "",
            "graphrunner/serving.py": "from graphrunner.capturing import capture\n",
            "graphrunner/capturing.py": "def capture():\n    from graphrunner.serving import _serve\n",
        },
    )
    cycles = import_cycles(root)
    assert [c[0] for c in cycles] == [("graphrunner.capturing", "graphrunner.serving")]
    assert cycles[0][1] == [
        "graphrunner.capturing:2 -> graphrunner.serving",
        "graphrunner.serving:1 -> graphrunner.capturing",
    ]
    assert [(r.module, r.line) for r in function_level_imports(root)] == [("graphrunner.capturing", 2)]
    assert [(r.module, r.line) for r in uncommented_function_level_imports(root)] == [("graphrunner.capturing", 2)]
    assert underscore_imports(root) == [("graphrunner.capturing", 2, "graphrunner.serving", "_serve")]
    assert main([str(root)]) == 1

    root = _package(
        tmp_path / "b",
        {
            "graphrunner/__init__.py": "",
            "graphrunner/serving.py": "from graphrunner.capturing import capture\n",
            "graphrunner/capturing.py": (
                "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from graphrunner.serving import Server\n"
            ),
        },
    )
    assert import_cycles(root, type_checking=False) == []
    assert [c[0] for c in import_cycles(root)] == [("graphrunner.capturing", "graphrunner.serving")]
    assert main([str(root)]) == 1
    (root / "graphrunner" / "capturing.py").write_text("def capture():\n    pass\n")
    assert import_cycles(root) == []
    assert main([str(root)]) == 0


def test_a_submodule_naming_its_own_package_is_a_cycle_only_if_the_package_imports_it_back(tmp_path):
    """Negative control of the package rule: ``tape/graph.py`` reading a name from ``tape``
    while ``tape/__init__.py`` imports ``tape.graph`` is a cycle; importing the sibling by its
    full path is not, nor is naming the package when its ``__init__`` does not import back."""
    cyclic = _package(
        tmp_path / "a",
        {
            "graphrunner/__init__.py": "",
            "graphrunner/tape/__init__.py": "from .graph import TapeGraph\nfrom .pool import TapePool\n",
            "graphrunner/tape/pool.py": "class TapePool: ...\n",
            "graphrunner/tape/graph.py": "def f():\n    from graphrunner.tape import TapePool\n",
        },
    )
    assert [c[0] for c in import_cycles(cyclic)] == [("graphrunner.tape", "graphrunner.tape.graph")]
    relative = _package(
        tmp_path / "b",
        {
            "graphrunner/__init__.py": "",
            "graphrunner/tape/__init__.py": "from .graph import TapeGraph\n",
            "graphrunner/tape/pool.py": "class TapePool: ...\n",
            "graphrunner/tape/graph.py": "from . import TapeGraph as _\n",
        },
    )
    assert [c[0] for c in import_cycles(relative)] == [("graphrunner.tape", "graphrunner.tape.graph")]
    for name, graph_py, init_py in [
        ("c", "from graphrunner.tape.pool import TapePool\n", "from .graph import TapeGraph\n"),
        ("d", "from . import pool\n", "from .graph import TapeGraph\n"),
        ("e", "from graphrunner.tape import TapePool\n", "from .pool import TapePool\n"),
    ]:
        root = _package(
            tmp_path / name,
            {
                "graphrunner/__init__.py": "",
                "graphrunner/tape/__init__.py": init_py,
                "graphrunner/tape/pool.py": "class TapePool: ...\n",
                "graphrunner/tape/graph.py": graph_py,
            },
        )
        assert import_cycles(root) == [], name


def test_the_walk_sees_a_cycle_through_an_outside_package_init(tmp_path):
    """Negative control: importing ``graphrunner.tape.graph`` from outside runs ``tape/__init__``
    first, so ``devices -> tape.graph`` and ``tape/__init__ -> devices`` are a cycle."""
    root = _package(
        tmp_path,
        {
            "graphrunner/__init__.py": "",
            "graphrunner/devices.py": "from graphrunner.tape.graph import TapeGraph\n",
            "graphrunner/tape/__init__.py": "from graphrunner.devices import get_device\n",
            "graphrunner/tape/graph.py": "class TapeGraph: ...\n",
        },
    )
    assert [c[0] for c in import_cycles(root)] == [("graphrunner.devices", "graphrunner.tape")]


def main(argv: list[str]) -> int:
    """Print the imports that run up a layer, the import cycles, the function-level imports of
    ``graphrunner`` modules and the underscore names imported across modules in the checkout
    ``argv[0]`` (default: this one). Exit status 1 when any is in the core, or outside it and not known."""
    root = Path(argv[0]).resolve() if argv else ROOT
    upward, unplaced = upward_imports(root)
    for module, line, imported, mine, theirs in upward:
        print(f"{module}:{line} imports {imported}: {mine} -> {theirs}")
    for module in unplaced:
        print(f"{module}: in no layer")
    cycles = import_cycles(root)
    bad = 0
    for members, edges in cycles:
        core = any(in_core(m) for m in members)
        known = not core and members in KNOWN_CYCLES_OUTSIDE_CORE
        bad += not known
        print(f"cycle{' (known, outside the core)' if known else ''}: {' <-> '.join(members)}")
        for edge in edges:
            print(f"    {edge}")
    function_level = function_level_imports(root)
    for r in function_level:
        known = not in_core(r.module) and (r.module, r.imported) in KNOWN_FUNCTION_LEVEL_IMPORTS_OUTSIDE_CORE
        bad += not known
        print(f"{r.module}:{r.line} imports {r.imported} inside a function{' (known)' if known else ''}")
    uncommented = uncommented_function_level_imports(root)
    for r in uncommented:
        print(f"{r.module}:{r.line} imports {r.imported} inside a function with no comment saying why")
    underscore = underscore_imports(root)
    for module, line, imported, name in underscore:
        known = not in_core(module) and (module, imported, name) in KNOWN_UNDERSCORE_IMPORTS_OUTSIDE_CORE
        bad += not known
        print(f"{module}:{line} imports {name} from {imported}{' (known)' if known else ''}")
    core_cycles = sum(any(in_core(m) for m in c[0]) for c in cycles)
    print(
        f"{len(upward)} import(s) up a layer, {len(unplaced)} module(s) in no layer, "
        f"{len(cycles)} import cycle(s) ({core_cycles} in the core), "
        f"{len(function_level)} function-level import(s) of graphrunner modules "
        f"({sum(in_core(r.module) for r in function_level)} in the core), "
        f"{len(uncommented)} uncommented function-level import(s) in the core, "
        f"{len(underscore)} underscore name(s) imported across modules "
        f"({sum(in_core(u[0]) for u in underscore)} in the core)"
    )
    return 1 if upward or unplaced or bad or uncommented else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
