"""``--threads``: the CLI runs with the thread count it is given and prints it;
the library never changes the caller's thread settings."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import graphrunner as gr
import graphrunner_tools.demo as demo
from graphrunner_tools import bench as grbench
from graphrunner_tools.cli import main
from graphrunner_tools.threads import DEFAULT_CLI_THREADS, torch_threads

TINY_DEMO = [
    "demo",
    "--device",
    "tape",
    "--steps",
    "2",
    "--layers",
    "1",
    "--buckets",
    "1,2",
    "--max-batch",
    "2",
    "--trace-out",
    "",
    "--no-progress",
]


@pytest.fixture
def caller_threads():
    """The caller's thread count, set to a value no ``--threads`` in these
    tests uses, and restored afterwards."""
    before = torch.get_num_threads()
    torch.set_num_threads(5)
    yield 5
    torch.set_num_threads(before)


def _run_demo_recording(monkeypatch, argv):
    seen = []
    real = demo.run_demo

    def recording(**kwargs):
        result = real(**kwargs)
        seen.append(result)
        return result

    monkeypatch.setattr(demo, "run_demo", recording)
    assert main(argv) == 0
    (result,) = seen
    return result


@pytest.mark.parametrize("threads", [1, 3])
def test_demo_runs_with_threads_given_and_restores_the_callers(threads, caller_threads, monkeypatch, capsys):
    result = _run_demo_recording(monkeypatch, TINY_DEMO + ["--threads", str(threads)])
    assert result.ok
    assert result.threads == threads != caller_threads  # the steps ran with --threads, not the caller's
    assert f"threads={threads}" in capsys.readouterr().out.splitlines()[0]  # stated in the header
    assert torch.get_num_threads() == caller_threads  # and the caller's count is back


def test_demo_default_is_one_thread(caller_threads, monkeypatch, capsys):
    result = _run_demo_recording(monkeypatch, TINY_DEMO)
    assert result.threads == DEFAULT_CLI_THREADS == 1
    assert "threads=1" in capsys.readouterr().out.splitlines()[0]


def test_run_demo_in_a_library_call_keeps_the_callers_threads(caller_threads):
    """Negative control of the tests above: without the CLI nothing sets the
    count, so the steps run with the caller's."""
    import io

    result = demo.run_demo(
        device="tape", steps=2, layers=1, buckets=(1, 2), max_batch=2, trace_out=None, progress=False, out=io.StringIO()
    )
    assert result.threads == caller_threads == torch.get_num_threads()


@pytest.mark.parametrize("bad", ["0", "-2", "two"])
def test_bad_thread_counts_are_usage_errors(bad, capsys):
    assert main(TINY_DEMO + ["--threads", bad]) == 2
    assert "--threads" in capsys.readouterr().err


def test_torch_threads_restores_on_error(caller_threads):
    with pytest.raises(RuntimeError, match="inside"):
        with torch_threads(2):
            assert torch.get_num_threads() == 2
            raise RuntimeError("inside")
    assert torch.get_num_threads() == caller_threads
    with pytest.raises(ValueError, match=">= 1"):
        with torch_threads(0):
            pass


@pytest.mark.parametrize("backend", ["full", "breakable", "eager"])
def test_runner_never_changes_the_callers_threads(backend, caller_threads):
    w = torch.randn(8, 8)
    runner = gr.GraphRunner(
        lambda x: x @ w,
        {"x": gr.BatchInput(trailing=(8,), dtype=torch.float32)},
        buckets=[1, 2],
        backend=backend,
        device="tape",
        progress=False,
    )
    runner.capture()
    x = torch.randn(2, 8)
    assert torch.equal(runner(x=x), x @ w)
    runner.cleanup()
    assert torch.get_num_threads() == caller_threads


_RECORDS_THREADS = """
import json
def main(argv):  # takes --threads
    import torch
    res = {"argv": list(argv), "torch_threads_seen": torch.get_num_threads()}
    json.dump(res, open(argv[argv.index("--out") + 1], "w"))
    return res
"""

_NO_THREADS_OPTION = """
def main(argv):
    import torch
    return {"argv": list(argv), "torch_threads_seen": torch.get_num_threads()}
"""


def test_bench_threads_reach_every_script_and_its_json(tmp_path, caller_threads, capsys):
    d = tmp_path / "fakebench"
    d.mkdir()
    (d / "latency_vs_batch.py").write_text(_RECORDS_THREADS)
    (d / "runner_overhead.py").write_text(_NO_THREADS_OPTION)
    out = tmp_path / "bench.json"
    assert (
        grbench.main(
            [
                "--bench-dir",
                str(d),
                "--out",
                str(out),
                "--no-plot",
                "--threads",
                "2",
                "--only",
                "latency_vs_batch,runner_overhead",
            ]
        )
        == 0
    )
    data = json.loads(out.read_text())
    lat, ovh = data["results"]["latency_vs_batch"], data["results"]["runner_overhead"]
    assert lat["argv"][-2:] == ["--threads", "2"] and lat["torch_threads_seen"] == 2
    assert "--threads" not in ovh["argv"] and ovh["torch_threads_seen"] == 2  # set for the whole suite
    assert data["threads"] == 2 and data["environment"]["torch_threads"] == 2
    assert data["environment"]["load_average"] is None or len(data["environment"]["load_average"]) == 3
    cap = capsys.readouterr()
    assert "[bench] torch threads: 2" in cap.err  # progress: stderr
    assert "[bench] summary: torch threads 2," in cap.out and "[bench] torch threads" not in cap.out
    assert torch.get_num_threads() == caller_threads


def test_every_bench_script_records_threads_and_load_average():
    """Each script in bench/ writes the environment (thread count, load average) into its JSON."""
    for script in sorted(Path(grbench.find_bench_dir()).glob("*.py")):
        src = script.read_text()
        assert "--threads" in src, f"{script.name} takes no --threads"
        assert "environment()" in src, f"{script.name} does not record environment() in its JSON"


# ------------------------------------------------------------ --threads has an upper bound
@pytest.mark.parametrize("command", [["demo"], ["loadtest"], ["bench"], ["verify"]])
def test_huge_thread_counts_are_one_line_usage_errors(command, capsys):
    from graphrunner_tools.threads import max_threads, usable_cores

    assert main(command + ["--threads", "100000"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("graphrunner: error: argument --threads: 100000 threads")
    assert f"at most {max_threads()}" in err and max_threads() == 4 * usable_cores()
    assert main(command + ["--threads", str(max_threads() + 1)]) == 2  # the bound is exact
    capsys.readouterr()


def test_the_largest_allowed_count_parses_and_runs(caller_threads):
    from graphrunner_tools.cli import build_parser
    from graphrunner_tools.threads import max_threads

    # negative control of the bound: the largest count is accepted by every command ...
    for command in (["demo"], ["loadtest"], ["bench"], ["verify"]):
        assert build_parser().parse_args(command + ["--threads", str(max_threads())]).threads == max_threads()
    # ... and torch runs with it (a small matmul equals the same matmul on one thread)
    a = torch.randn(64, 64, generator=torch.Generator().manual_seed(0))
    with torch_threads(1):
        one = a @ a
    with torch_threads(max_threads()):
        assert torch.get_num_threads() == max_threads()
        assert torch.allclose(a @ a, one, atol=1e-5)
    assert torch.get_num_threads() == caller_threads
    with pytest.raises(ValueError, match="per usable core"):
        with torch_threads(max_threads() + 1):
            pass
    assert torch.get_num_threads() == caller_threads  # refused before anything changed


def test_huge_thread_count_in_a_real_process_is_exit_2_not_a_crash():
    import subprocess
    import sys

    for command in ("demo", "loadtest"):
        proc = subprocess.run(
            [sys.executable, "-m", "graphrunner_tools", command, "--threads", "100000"],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert proc.returncode == 2, (proc.returncode, proc.stderr)  # was 139 (segfault in the OpenMP runtime)
        assert proc.stderr.count("\n") == 1 and "--threads" in proc.stderr and "Traceback" not in proc.stderr
