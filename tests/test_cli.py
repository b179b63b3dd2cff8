"""The ``graphrunner`` command line: version, one-line user errors, argument validation."""

from __future__ import annotations

import argparse
import io
import subprocess
import sys

import pytest
import torch

import graphrunner
from graphrunner.progress import CaptureProgress, StatusLine
from graphrunner_tools.bench import parse_buckets
from graphrunner_tools.cli import main


def test_version_prints_the_package_version(capsys):
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"graphrunner {graphrunner.__version__}"


def test_version_from_the_module_entry_point():
    proc = subprocess.run(
        [sys.executable, "-m", "graphrunner_tools.cli", "--version"], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0 and proc.stdout.strip() == f"graphrunner {graphrunner.__version__}"


def test_all_lists_the_public_api():
    public = {
        n for n in dir(graphrunner) if not n.startswith("_") and type(getattr(graphrunner, n)).__name__ != "module"
    }
    assert public <= set(graphrunner.__all__)
    assert all(hasattr(graphrunner, n) for n in graphrunner.__all__)


#: The public API (issue 20, item 6): about 30 names; everything else stays in its submodule.
PUBLIC_API = {
    "__version__",
    "CaptureError",
    "CaptureUnsafeOpError",
    "ContractError",
    "GraphRunnerError",
    "PaddingLeakError",
    "RankTimeoutError",
    "CudaDevice",
    "TapeDevice",
    "get_device",
    "BreakableGraph",
    "breakable_graph",
    "no_graph",
    "LocalGroup",
    "TorchDistGroup",
    "Trace",
    "GraphRunner",
    "BatchInput",
    "default_buckets",
    "plan_buckets",
    "CaptureReport",
    "OutputArena",
    "PaddingCheck",
    "check_factory",
    "CompareReport",
}

#: Internals that are not public (issue 45): each lives in its module only.
INTERNAL = {
    "Device": "graphrunner.devices",
    "TapeGraph": "graphrunner.tape",
    "TapePool": "graphrunner.tape",
    "tape_graph": "graphrunner.tape",
    "Event": "graphrunner.trace",
    "NullTrace": "graphrunner.trace",
    "FullGraphBackend": "graphrunner.backends",
    "BreakableGraphBackend": "graphrunner.backends",
    "EagerBackend": "graphrunner.backends",
    "GraphBackend": "graphrunner.backends",
    "force_no_graph": "graphrunner.breakable",
    "is_in_breakable_graph": "graphrunner.breakable",
    "BucketReport": "graphrunner.report",
    "RunnerStats": "graphrunner.report",
    "check_capture_order": "graphrunner.backends.protocol",
}


def test_all_is_the_small_public_api():
    assert len(graphrunner.__all__) == len(set(graphrunner.__all__)), "duplicates in __all__"
    assert set(graphrunner.__all__) == PUBLIC_API
    assert not set(graphrunner.__all__) & set(INTERNAL)


def _undocumented(module) -> list:
    """The names of ``module.__all__`` (but ``__version__``) without a docstring of one sentence or more."""
    return [n for n in module.__all__ if n != "__version__" and len((getattr(module, n).__doc__ or "").strip()) < 40]


def test_every_public_name_states_its_contract_in_a_docstring():
    assert isinstance(graphrunner.__version__, str) and graphrunner.__version__
    assert _undocumented(graphrunner) == []
    # negative control: a name without a docstring is reported
    import types

    fake = types.ModuleType("fake")
    fake.__all__ = ["documented", "bare"]

    def documented():
        """Return nothing; this sentence is the contract of the function."""

    fake.documented, fake.bare = documented, lambda: None
    assert _undocumented(fake) == ["bare"]


@pytest.mark.parametrize("name", sorted(INTERNAL))
def test_internals_live_in_their_module_only(name):
    import importlib

    assert hasattr(importlib.import_module(INTERNAL[name]), name)  # the module that keeps it has it
    with pytest.raises(AttributeError, match=f"no attribute '{name}'"):
        getattr(graphrunner, name)
    with pytest.raises(ImportError):
        exec(f"from graphrunner import {name}", {})


def test_public_names_import_and_others_raise_attribute_error():
    from graphrunner import GraphRunner, check_factory, no_graph  # noqa: F401  (test_hf: gr.hf is lazy)

    with pytest.raises(AttributeError, match="no attribute 'NotAName'"):
        graphrunner.NotAName  # noqa: B018 - the attribute access is what raises


def test_pyproject_ships_py_typed_and_an_spdx_license():
    tomllib = __import__("pytest").importorskip("tomllib")
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    project = tomllib.loads((root / "pyproject.toml").read_text())
    assert isinstance(project["project"]["license"], str)  # SPDX expression, not the deprecated table
    assert not any(c.startswith("License ::") for c in project["project"].get("classifiers", []))
    assert "py.typed" in project["tool"]["setuptools"]["package-data"]["graphrunner"]
    assert (root / "graphrunner" / "py.typed").is_file()


def _one_error_line(capsys) -> str:
    err = capsys.readouterr().err
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("graphrunner: error: "), err
    assert "Traceback" not in err
    return lines[0]


@pytest.mark.parametrize(
    "argv",
    [
        ["demo", "--steps", "0"],
        ["demo", "--buckets", "a,b"],
        ["demo", "--backend", "nope"],
        ["demo", "--bogus"],
        [],
    ],
)
def test_bad_arguments_are_one_line_and_exit_2(capsys, argv):
    assert main(argv) == 2
    _one_error_line(capsys)


@pytest.mark.parametrize("buckets", ["4,2", "1,2,2", "2,1,4"])
def test_buckets_must_be_strictly_increasing(capsys, buckets):
    assert main(["demo", "--buckets", buckets, "--trace-out", ""]) == 2
    assert "strictly increasing" in _one_error_line(capsys)
    assert main(["bench", "--compile-buckets", buckets]) == 2
    assert "strictly increasing" in _one_error_line(capsys)


def test_parse_buckets_keeps_an_increasing_list():
    assert parse_buckets("1,2, 8") == [1, 2, 8]
    with pytest.raises(argparse.ArgumentTypeError, match="strictly increasing"):
        parse_buckets("8,1")


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available: --device cuda is not an error")
@pytest.mark.parametrize("argv", [["demo", "--device", "cuda", "--trace-out", ""], ["bench", "--device", "cuda"]])
def test_device_cuda_without_cuda_is_one_line_and_exit_2(capsys, argv):
    assert main(argv) == 2
    assert "cuda" in _one_error_line(capsys)


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available: --device cuda is not an error")
def test_device_cuda_without_cuda_from_the_console(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "graphrunner_tools.cli", "demo", "--device", "cuda"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert len(proc.stderr.splitlines()) == 1 and proc.stderr.startswith("graphrunner: error: "), proc.stderr
    assert proc.stdout == ""


# --------------------------------------------------------------------------- progress output

TINY_DEMO = [
    "demo",
    "--device",
    "tape",
    "--steps",
    "3",
    "--layers",
    "1",
    "--buckets",
    "1,2",
    "--max-batch",
    "3",
    "--trace-out",
    "",
]


def test_progress_to_a_redirected_stderr_has_no_carriage_returns(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "graphrunner_tools.cli", *TINY_DEMO],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "\r" not in proc.stderr and "\r" not in proc.stdout
    lines = proc.stderr.splitlines()
    assert any("graphrunner capture: bucket" in line for line in lines), proc.stderr
    assert any(line.startswith("serving: step 3/3") for line in lines), proc.stderr


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_status_line_redraws_only_on_a_terminal():
    plain, tty = io.StringIO(), _Terminal()
    for stream in (plain, tty):
        line = StatusLine(stream)
        line.write("step 1")
        line.write("step 2", final=True)
    assert plain.getvalue() == "step 1\nstep 2\n"
    assert tty.getvalue() == "\rstep 1\rstep 2\n"


def test_capture_progress_on_a_plain_stream_writes_lines_even_with_tqdm():
    s = io.StringIO()
    p = CaptureProgress(2, stream=s)  # use_tqdm=None: tqdm (if installed) only on a terminal
    p.start(0, 2)
    p.start(1, 1)
    p.close()
    assert "\r" not in s.getvalue() and len(s.getvalue().splitlines()) == 3


def test_help_mentions_version(capsys):
    assert main(["--help"]) == 0
    assert "--version" in capsys.readouterr().out


def test_unwritable_trace_out_is_one_line_before_any_work(tmp_path, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    assert main(["demo", "--trace-out", str(blocker / "trace")]) == 2  # a file where the folder should be
    assert "--trace-out" in _one_error_line(capsys)


def test_closed_stdout_pipe_is_a_quiet_exit(tmp_path):
    """`graphrunner demo | head -1`: the reader leaves early; no BrokenPipeError traceback."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "graphrunner_tools.cli", *TINY_DEMO, "--no-progress"],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    proc.stdout.readline()
    proc.stdout.close()  # like head after its first line
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=240) == 1
    assert "Traceback" not in err and "BrokenPipeError" not in err, err


@pytest.mark.parametrize(
    "argv, over, fit",
    [
        (["--requests", "1", "--concurrency", "100000"], "level 100000 exceeds --requests 1", "--concurrency 1,"),
        (
            ["--requests", "10"],
            "levels 16,64 exceed --requests 10",
            "--concurrency 4,10,",
        ),  # the default levels 4,16,64
    ],
)
def test_loadtest_concurrency_above_requests_is_one_line(capsys, argv, over, fit):
    assert main(["loadtest"] + argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("graphrunner: error: argument --concurrency: ")
    assert over in err and fit in err and "graphrunner loadtest --help" in err


def test_loadtest_concurrency_up_to_requests_is_accepted(monkeypatch):
    # negative control: levels up to --requests pass the usage checks and reach the run
    import graphrunner_tools.cli as cli

    parser = cli.build_parser()
    args = parser.parse_args(["loadtest", "--requests", "4", "--concurrency", "1,4"])
    cli._check_loadtest(parser, args)  # no SystemExit
    seen = []
    monkeypatch.setattr(args, "func", lambda a: seen.append((a.requests, a.concurrency)) or 0)
    monkeypatch.setattr(cli.argparse.ArgumentParser, "parse_args", lambda self, argv=None: args)
    assert cli.main(["loadtest"]) == 0 and seen == [(4, [1, 4])]
