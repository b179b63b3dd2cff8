"""The tools (CLI, demo models, loadtest, verify, bench driver) live in ``graphrunner_tools``,
outside the runtime: the runtime never imports them, and the demo models are user code to it."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from extras_util import missing

import graphrunner as gr
from graphrunner._frames import is_internal, user_frame
from graphrunner.tape import tape_graph

ROOT = Path(__file__).resolve().parents[1]


def test_import_graphrunner_does_not_load_the_tools():
    # graphrunner.hf imports transformers (the hf extra): checked too when it is installed
    hf = "" if missing("transformers") else "graphrunner.hf, "
    code = (
        f"import sys, graphrunner, {hf}graphrunner.checks.lint; "
        "print([m for m in sys.modules if m.startswith('graphrunner_tools')])"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


def test_no_runtime_module_imports_the_tools():
    offenders = []
    for path in sorted((ROOT / "graphrunner").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom)
                else []
            )
            offenders += [
                f"{path.relative_to(ROOT)}:{node.lineno}" for n in names if n.split(".")[0] == "graphrunner_tools"
            ]
    assert offenders == []
    # Negative control: the walk does see an import of the tools.
    tree = ast.parse("from graphrunner_tools.models import build_model")
    assert tree.body[0].module.split(".")[0] == "graphrunner_tools"


def test_the_runtime_names_no_tool_module():
    # The runtime neither special-cases the demo models nor points at the moved modules.
    pattern = re.compile(r"graphrunner[./](models|demo|cli|bench|loadtest|spec|launch|threads)\b")
    hits = [
        f"{p.relative_to(ROOT)}" for p in sorted((ROOT / "graphrunner").rglob("*.py")) if pattern.search(p.read_text())
    ]
    assert hits == []
    assert not (ROOT / "graphrunner" / "models").exists()


def test_console_script_and_packages_in_pyproject():
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert project["project"]["scripts"]["graphrunner"] == "graphrunner_tools.cli:main"
    include = project["tool"]["setuptools"]["packages"]["find"]["include"]
    assert "graphrunner_tools" in include and "graphrunner_tools.*" in include


def test_python_dash_m_graphrunner_tools_is_the_cli():
    proc = subprocess.run(
        [sys.executable, "-m", "graphrunner_tools", "--version"], capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == f"graphrunner {gr.__version__}"


def test_demo_model_frames_are_user_code():
    from graphrunner_tools.models import llama

    assert not is_internal(llama.build_model.__code__)
    assert not is_internal(llama.LlamaForCausalLM.decode_step.__code__)
    assert not is_internal(llama.varlen_attention.__wrapped__.__code__)  # under its @no_graph wrapper
    # Negative control: the runtime's own frames are internal.
    assert is_internal(gr.GraphRunner.__init__.__code__)
    assert is_internal(user_frame.__code__)


def test_capture_error_names_the_demo_models_source_line():
    from graphrunner_tools.models import LlamaConfig, build_model

    # varlen attention reads lengths on the host: inside a whole-step tape capture that is
    # capture-unsafe, and the message names the model's line, not graphrunner's.
    model = build_model(LlamaConfig.demo(num_layers=1, attention="varlen", max_batch_size=4))
    ids = torch.zeros(2, dtype=torch.long)
    with pytest.raises(gr.CaptureUnsafeOpError) as err:
        with tape_graph(gr.tape.TapeGraph()):
            model.decode_step(ids, ids.clone())
    msg = str(err.value)
    llama_py = str(ROOT / "graphrunner_tools" / "models" / "llama.py")
    assert re.search(re.escape(llama_py) + r":\d+ in varlen_attention: `", msg), msg
