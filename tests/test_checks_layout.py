"""graphrunner/checks/ stays carryable (issue 45): modules under 700 lines, no re-export shim,
every attribute of a check's classes first set in ``__init__``."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CHECKS = ROOT / "graphrunner" / "checks"


def _late_attributes(source: str) -> dict:
    """``{class: {attribute: method}}`` of the ``self.<attribute>`` first assigned outside
    ``__init__`` (neither set there nor a class attribute)."""
    out = {}
    for cls in [n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.ClassDef)]:
        declared = {
            t.id
            for n in cls.body
            if isinstance(n, (ast.Assign, ast.AnnAssign))
            for t in (n.targets if isinstance(n, ast.Assign) else [n.target])
            if isinstance(t, ast.Name)
        }
        init, other = set(), {}
        for m in cls.body:
            if not isinstance(m, ast.FunctionDef):
                continue
            for n in ast.walk(m):
                targets = (
                    n.targets
                    if isinstance(n, ast.Assign)
                    else [n.target]
                    if isinstance(n, (ast.AnnAssign, ast.AugAssign))
                    else []
                )
                for t in targets:
                    for e in ast.walk(t):
                        if isinstance(e, ast.Attribute) and isinstance(e.value, ast.Name) and e.value.id == "self":
                            if m.name == "__init__":
                                init.add(e.attr)
                            else:
                                other.setdefault(e.attr, m.name)
        late = {a: m for a, m in other.items() if a not in init and a not in declared}
        if late:
            out[cls.name] = late
    return out


def test_no_module_of_the_checks_is_over_700_lines():
    sizes = {p.name: len(p.read_text().splitlines()) for p in CHECKS.glob("*.py")}
    assert sizes and max(sizes.values()) <= 700, sorted(sizes.items(), key=lambda kv: -kv[1])[:3]


def test_the_checks_have_no_re_export_shim_and_no_file_named_like_the_tapes():
    assert not (CHECKS / "ops.py").exists()  # the op recorder is graphrunner.recording.ops
    tape = {p.name for p in (ROOT / "graphrunner" / "tape").glob("*.py")} - {"__init__.py"}
    assert not tape & {p.name for p in CHECKS.glob("*.py")}


def test_every_attribute_of_the_checks_classes_is_first_set_in_init():
    late = {p.name: found for p in sorted(CHECKS.glob("*.py")) if (found := _late_attributes(p.read_text()))}
    assert late == {}


def test_negative_control_an_attribute_first_set_in_a_method_is_found():
    src = (
        "class Check:\n    name = 'x'\n    def __init__(self):\n        self.a = 1\n"
        "    def run(self):\n        self.a = 2\n        self.name = 'y'\n        self.later = 3\n"
    )
    assert _late_attributes(src) == {"Check": {"later": "run"}}
