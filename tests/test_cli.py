"""The ``graphrunner`` command line: version, one-line user errors, argument validation."""

from __future__ import annotations

import subprocess
import sys

import graphrunner
from graphrunner.cli import main


def test_version_prints_the_package_version(capsys):
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"graphrunner {graphrunner.__version__}"


def test_version_from_the_module_entry_point():
    proc = subprocess.run([sys.executable, "-m", "graphrunner.cli", "--version"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == f"graphrunner {graphrunner.__version__}"


def test_all_lists_the_public_api():
    public = {n for n in dir(graphrunner) if not n.startswith("_") and
              type(getattr(graphrunner, n)).__name__ != "module"}
    assert public <= set(graphrunner.__all__)
    assert all(hasattr(graphrunner, n) for n in graphrunner.__all__)


def test_pyproject_ships_py_typed_and_an_spdx_license():
    tomllib = __import__("pytest").importorskip("tomllib")
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    project = tomllib.loads((root / "pyproject.toml").read_text())
    assert isinstance(project["project"]["license"], str)  # SPDX expression, not the deprecated table
    assert not any(c.startswith("License ::") for c in project["project"].get("classifiers", []))
    assert "py.typed" in project["tool"]["setuptools"]["package-data"]["graphrunner"]
    assert (root / "graphrunner" / "py.typed").is_file()
