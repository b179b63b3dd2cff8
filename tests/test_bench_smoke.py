"""The benchmark driver: a quick run of the real suite writes the merged JSON and the PNG,
and the driver reports failing, missing and main-less scripts instead of hiding them.

Benchmarks are never timed assertions: these tests check structure and correctness values
(graph output == eager output), not speed.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from extras_util import missing, require

import graphrunner_tools
from graphrunner_tools import bench as grbench

REPO = Path(__file__).resolve().parents[1]
BENCH_DIR = REPO / "bench"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.pop("GRAPHRUNNER_BENCH_DIR", None)
    return env


@pytest.mark.slow
def test_quick_suite_writes_json_and_png(tmp_path):
    """Without matplotlib (the ``bench`` extra) the same run writes the JSON and says why there is no plot."""
    no_plot = missing("matplotlib")
    out = tmp_path / "res" / "bench.json"
    png = tmp_path / "res" / "latency.png"
    # cwd is tmp_path: the driver must find bench/ from the package, not from the cwd.
    proc = subprocess.run(
        [sys.executable, "-m", "graphrunner_tools.bench", "--quick", "--out", str(out), "--plot", str(png)],
        cwd=tmp_path,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads(out.read_text())

    for key in (
        "schema",
        "created",
        "quick",
        "environment",
        "bench_dir",
        "results",
        "seconds",
        "argv",
        "skipped",
        "errors",
        "summary",
        "plot",
        "plot_note",
        "out",
    ):
        assert key in data, key
    assert data["quick"] is True and data["out"] == str(out)
    assert data["errors"] == {}
    assert Path(data["bench_dir"]) == BENCH_DIR.resolve()
    # Every suite script present in bench/ ran (or says why not); ours always run.
    for name in grbench.SUITE:
        if (BENCH_DIR / f"{name}.py").is_file():
            assert name in data["results"] or name in data["skipped"], name
            if name in data["results"]:
                assert (out.parent / f"{name}.json").is_file(), name
    assert {"latency_vs_batch", "capture_vs_compile"} <= set(data["results"])

    lat = data["results"]["latency_vs_batch"]
    batches = lat["batches"]
    assert batches == sorted(batches) and len(batches) >= 2
    for m in ("eager", "eager_masked", "tape_full", "tape_breakable"):
        row = lat["methods"][m]
        assert len(row["latency_us"]) == len(batches)
        assert all(isinstance(v, float) and v > 0 for v in row["latency_us"]), (m, row["latency_us"])
    # Replays equal eager on the same inputs (tape replays run the same kernels).
    assert lat["methods"]["tape_full"]["max_abs_diff"] == [0.0] * len(batches)
    assert lat["methods"]["tape_breakable"]["max_abs_diff"] == [0.0] * len(batches)
    assert lat["methods"]["tape_full"]["reference"] == "eager_masked"
    assert lat["methods"]["tape_breakable"]["reference"] == "eager"
    for m in ("tape_full", "tape_breakable"):
        want = [
            r / x
            for r, x in zip(
                lat["methods"][lat["methods"][m]["reference"]]["latency_us"], lat["methods"][m]["latency_us"]
            )
        ]
        assert lat["speedup"][m] == pytest.approx(want)

    cvc = data["results"]["capture_vs_compile"]
    assert cvc["capture_seconds_all_buckets"] > 0
    assert cvc["capture"]["full_all"]["segments"] == {str(b): 1 for b in cvc["buckets"]}  # one graph per bucket
    assert all(n > 1 for n in cvc["capture"]["breakable_varlen_all"]["segments"].values())
    assert cvc["compile"] is None and cvc["ratio"] is None and "--quick" in cvc["compile_skipped"]
    assert data["summary"]["capture_vs_compile"]["compile_skipped"] == cvc["compile_skipped"]

    if no_plot:
        assert data["plot"] is None and not png.exists()
        assert data["plot_note"] == "matplotlib is not installed: no plot (pip install -e '.[bench]')"
        assert data["plot_note"] in proc.stdout
    else:
        assert data["plot"] == str(png)
        assert png.read_bytes()[:8] == PNG_MAGIC
    assert "summary" in proc.stdout
    _check_output(proc.stdout, proc.stderr, data)


def _check_output(stdout: str, stderr: str, data: dict) -> None:
    """stdout holds tables and the summary only: no raw dicts, no progress lines, no warnings from our own
    models; every target is marked met or MISSED; the summary repeats the body's figures, never others."""
    assert "row:" not in stdout and "{'" not in stdout and "[bench] tape_vs_eager:" not in stdout, stdout[:2000]
    assert "wrote " not in stdout and "wrote " in stderr  # where the JSON went: stderr
    for text in (stdout, stderr):
        assert "bounds=(lo, hi)" not in text and "padding check:" not in text, text[:3000]
    for line in stdout.splitlines():
        if "target" in line and ("<=" in line or ">=" in line):
            assert line.rstrip().endswith((": met", ": MISSED", ": met)", ": MISSED)")) or "target: <=" in line, line
    ro = data["results"]["runner_overhead"]
    body, summary = stdout.split("[bench] summary")
    for key, ratio in (
        ("main", ro["ratio_runner_over_minimal"]),
        ("tiny", ro["tiny_two_inputs"]["ratio_runner_over_minimal"]),
    ):
        label = ro["steps"][key]
        (row,) = [ln for ln in body.splitlines() if ln.strip().startswith(label)]
        (line,) = [ln for ln in summary.splitlines() if f"runner vs minimal loop, {label}:" in ln]
        assert f"{ratio:.3f}x" in row and f"{ratio:.3f}x" in line, (row, line)
    worst = ro["tiny_two_inputs"]["first_over_steady_max"]
    assert f"max {worst:.2f}x" in summary and f"{worst:.2f}x" in body


# ----------------------------------------------------------------------------- output: tables, targets
def test_target_note_says_met_or_missed():
    assert grbench.target_note(11.88, 3) == "target <= 3x: MISSED"
    assert grbench.target_note(2.5, 3) == "target <= 3x: met"
    assert grbench.target_note(5.1, 5, at_most=False) == "target >= 5x: met"
    assert grbench.target_note(4.9, 5, at_most=False) == "target >= 5x: MISSED"
    assert grbench.target_note(None, 1.1) == "target <= 1.1x: not measured"


def _runner_overhead_result(first_max: float) -> dict:
    tiny = {
        "per_call_us": {"minimal": 20.0, "runner": 21.08},
        "ratio_runner_over_minimal": 1.054,
        "target_ratio": 1.10,
        "first_replay_us": [237.6, 40, 40, 40, 40, 40],
        "steady_replay_us": [20.0] * 6,
        "first_over_steady": [first_max, 2, 2, 2, 2, 2],
        "first_over_steady_max": first_max,
        "first_target": 3.0,
    }
    return {
        "backend": "full",
        "device": "tape",
        "rounds": 7,
        "hidden": 256,
        "per_call_us": {"minimal": 500.0, "runner": 501.5},
        "ratio_runner_over_minimal": 1.003,
        "target_ratio": 1.25,
        "tiny_two_inputs": tiny,
        "steps": {"main": "demo-like step (2 layers, hidden 256)", "tiny": "tiny 2-input step (x * w + y)"},
        "debug_mode": {
            "per_call_us_on": 900.0,
            "ratio_on_over_off": 1.8,
            "externals_checked_per_replay": 3,
            "capture_seconds_off": 1.0,
            "capture_seconds_on": 1.1,
        },
        "leak_check": {
            "capture_seconds_with": 1.0,
            "capture_seconds_without": 0.9,
            "leak_check_seconds": 0.05,
            "keys_checked": 4,
        },
    }


def test_runner_overhead_body_and_summary_print_one_figure_per_ratio_and_flag_missed_targets(capsys):
    """The issue's run: a first replay 11.88x over a 3x target passed unflagged, and the body said 1.054x
    'runner vs minimal loop' where the summary said 1.003x (two steps under one name). Now each ratio has its
    step's label, the same figure in both places, and a missed target says MISSED."""
    module = grbench.load_script(BENCH_DIR / "runner_overhead.py", "runner_overhead")
    result = _runner_overhead_result(11.88)
    module.print_tables(result, argparse.Namespace(calls=300, reps=7))
    body = capsys.readouterr().out
    summary = "\n".join(
        grbench.summary_lines({"summary": grbench.summarize({"runner_overhead": result}), "out": "b.json"})
    )
    for label, ratio, target in (
        ("demo-like step (2 layers, hidden 256)", "1.003x", "target <= 1.25x: met"),
        ("tiny 2-input step (x * w + y)", "1.054x", "target <= 1.1x: met"),
    ):
        (row,) = [ln for ln in body.splitlines() if ln.strip().startswith(label)]
        (line,) = [ln for ln in summary.splitlines() if f"runner vs minimal loop, {label}: " in ln]
        assert ratio in row and target in row and f"{label}: {ratio} ({target})" in line
    assert "11.88x  target <= 3x: MISSED" in body
    assert (
        "first call of a bucket vs a steady one, tiny 2-input step (x * w + y): max 11.88x "
        "(target <= 3x: MISSED)" in summary
    )
    # control: within the target, the same lines say met
    module.print_tables(_runner_overhead_result(2.5), argparse.Namespace(calls=300, reps=7))
    assert "2.50x  target <= 3x: met" in capsys.readouterr().out


def test_speed_table_quotes_the_scripts_own_figures_at_batch_1_8_32():
    """The table that opens the summary (and that the README quotes): the machine and date, then each figure
    exactly as the scripts measured it, at batch 1, 8 and 32, '-' where a batch was not measured."""
    lat = {
        "batches": [1, 2, 8, 32],
        "methods": {
            "eager": {"latency_us": [2000.0, 2100.0, 2500.0, 4000.0]},
            "eager_masked": {"latency_us": [2200.0, 2300.0, 2600.0, 4100.0]},
            "tape_full": {"latency_us": [1100.0, 1200.0, 1300.0, 2050.0], "reference": "eager_masked"},
            "tape_breakable": {"latency_us": [1600.0, 1700.0, 2400.0, 4100.0], "reference": "eager"},
        },
        "speedup": {"tape_full": [2.0, 1.92, 2.0, 2.0], "tape_breakable": [1.25, 1.24, 1.0417, 0.9756]},
    }
    hg = {
        "batches": [1, 8],
        "new": 16,
        "prompt": 8,
        "results": [
            {"arch": "llama", "speedup": {"1": 4.71, "8": 3.02}, "equal": {"1": True, "8": True}, "ms_per_call": {}},
            {"arch": "gpt2", "speedup": {"1": 3.5, "8": 2.5}, "equal": {"1": True, "8": False}, "ms_per_call": {}},
        ],
    }
    ro = _runner_overhead_result(2.0)
    ro["overhead_us"] = 1.5
    ro["tiny_two_inputs"]["per_call_us"]["eager"] = 4.0
    ro["tiny_two_inputs"]["ratio_runner_over_eager"] = 21.08 / 4.0
    merged = {
        "summary": grbench.summarize({"latency_vs_batch": lat, "hf_generate": hg, "runner_overhead": ro}),
        "created": "2026-12-04T15:00:00+00:00",
        "threads": 1,
        "quick": False,
        "out": "b.json",
        "environment": {"cpu_model": "AMD EPYC", "cpu_count": 2, "torch": "2.13.0+cpu", "cuda_device": None},
    }
    lines = grbench.speed_lines(merged)
    text = "\n".join(lines)
    assert lines[0].startswith("[bench] speed, 2026-12-04: AMD EPYC, 2 cores, torch 2.13.0+cpu, 1 thread(s); no GPU")
    assert "GPU figures not yet measured" in lines[0]

    def cells(prefix):
        (row,) = [ln for ln in lines if ln.strip().startswith(prefix)]
        return row.split()[-3:]

    assert cells("demo decoder step, eager (us)") == ["2000", "2500", "4000"]
    assert cells("breakable (attention an eager break) vs eager") == ["1.25x", "1.04x", "0.98x"]
    assert cells("full (one graph, masked attention) vs eager masked") == ["2.00x", "2.00x", "2.00x"]
    assert cells("DecodeRunner.generate vs model.generate(static), llama") == ["4.71x", "3.02x", "-"]
    (gpt2,) = [ln for ln in lines if "model.generate(static), gpt2" in ln]
    assert gpt2.endswith("TOKENS DIFFER")  # a run whose tokens differ says so next to its figure
    assert (
        "host cost of a GraphRunner call over a hand-written replay loop: +1.1 us on the tiny 2-input step "
        "(x * w + y) (21.1 vs 20.0 us); +1.5 us on the demo-like step (2 layers, hidden 256)"
    ) in text
    assert "eager 4.0 us, runner 21.1 us (5.27x eager's time)" in text
    # the summary opens with the table; nothing to show: no table
    assert grbench.summary_lines(merged)[: len(lines)] == lines
    assert grbench.speed_lines({"summary": {}}) == []


@pytest.mark.hf
def test_hf_generate_script_times_decode_runner_against_model_generate(tmp_path):
    """bench/hf_generate.py --quick: the runner's tokens equal model.generate's at every batch (checked before
    timing), one positive time per round and method, the speedup the ratio of the medians."""
    require("transformers")
    module = grbench.load_script(BENCH_DIR / "hf_generate.py", "hf_generate")
    result = module.main(["--quick", "--out", str(tmp_path / "hg.json")])
    assert json.loads((tmp_path / "hg.json").read_text())["batches"] == result["batches"] == [1, 8]
    (r,) = result["results"]
    assert r["arch"] == "llama" and r["equal"] == {"1": True, "8": True}
    for b in ("1", "8"):
        assert len(r["ms_all_rounds"]["runner"][b]) == len(r["ms_all_rounds"]["generate"][b]) == 2
        assert r["speedup"][b] == pytest.approx(r["ms_per_call"]["generate"][b] / r["ms_per_call"]["runner"][b])
    assert r["capture_seconds"] > r["self_test_seconds"] > 0


def test_summary_marks_capture_vs_compile_target():
    merged = {
        "summary": {"capture_vs_compile": {"ratio": 4.0, "target_ratio": 5, "compile_buckets": [1, 2]}},
        "out": "b.json",
    }
    assert "4.0x faster (target >= 5x: MISSED)" in "\n".join(grbench.summary_lines(merged))


def test_decode_runner_declares_bounds_so_the_padding_check_warns_nothing(caplog):
    """Our own demo decoder's bench runner declares the bounds of its integer inputs: the padding check draws
    real token ids and positions and logs no 'no bounds' warning. Control: the inputs without bounds warn."""
    import logging

    import graphrunner as gr
    from graphrunner_tools.models import LlamaConfig, build_model

    model = build_model(LlamaConfig.tiny(max_batch_size=4, attention="masked"), seed=0)
    with caplog.at_level(logging.WARNING, logger="graphrunner"):
        report = grbench.decode_runner(model, "full", "tape", [1, 2, 4]).capture()
    assert not [r for r in caplog.records if "bounds" in r.getMessage()]
    assert report.bucket(4).info["leak_check_forwards"] > 0  # the check ran real token ids and positions
    spec = grbench.decode_inputs(model.config.vocab_size, model.config.max_seq_len)
    assert spec["input_ids"].bounds == (0, model.config.vocab_size - 1)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="graphrunner"):
        gr.GraphRunner(
            lambda input_ids, positions: model.decode_step(input_ids, positions),
            grbench.decode_inputs(),
            [1, 2, 4],
            backend="full",
            device="tape",
            progress=False,
        ).capture()
    assert [r for r in caplog.records if "bounds" in r.getMessage()]


# ----------------------------------------------------------------------------- driver behaviour
_GOOD_LATENCY = """
import json, sys
def main(argv):
    out = argv[argv.index("--out") + 1]
    res = {"batches": [1, 2], "methods": {"eager": {"latency_us": [10.0, 20.0]},
           "tape_full": {"latency_us": [5.0, None]}}, "speedup": {"tape_full": [2.0, None]},
           "argv": list(argv)}
    json.dump(res, open(out, "w"))
    return res
"""

_FAILING = """
def main(argv):
    raise RuntimeError("boom from the fake benchmark")
"""

_NO_MAIN = "X = 1\n"

_WRITES_ONLY = """
import json
def main(argv):
    json.dump({"rows": [{"batch": 1, "speedup": 1.5}]}, open(argv[argv.index("--out") + 1], "w"))
"""


def _fake_bench(tmp_path: Path, **scripts: str) -> Path:
    d = tmp_path / "fakebench"
    d.mkdir()
    for name, src in scripts.items():
        (d / f"{name}.py").write_text(src)
    return d


def test_driver_records_failures_missing_and_mainless_scripts(tmp_path, capsys):
    d = _fake_bench(
        tmp_path,
        latency_vs_batch=_GOOD_LATENCY,
        capture_vs_compile=_FAILING,
        runner_overhead=_NO_MAIN,
        tape_vs_eager=_WRITES_ONLY,
    )
    out = tmp_path / "r" / "bench.json"
    rc = grbench.main(["--bench-dir", str(d), "--out", str(out), "--plot", str(tmp_path / "r" / "p.png"), "--quick"])
    assert rc == 1  # a script raised
    data = json.loads(out.read_text())
    assert "boom from the fake benchmark" in data["errors"]["capture_vs_compile"]
    assert "no main(argv)" in data["skipped"]["runner_overhead"]
    assert data["results"]["tape_vs_eager"] == {"rows": [{"batch": 1, "speedup": 1.5}]}  # read back from --out
    assert data["summary"]["tape_vs_eager"] == {"speedup": {"1": 1.5}}
    # Each script got its own --out next to the merged file; no --quick for scripts without it.
    assert data["results"]["latency_vs_batch"]["argv"] == ["--out", str(out.parent / "latency_vs_batch.json")]
    assert (tmp_path / "r" / "p.png").is_file() or data["plot_note"]
    assert "FAILED capture_vs_compile" in capsys.readouterr().out

    # Negative control: without the failing script the same run exits 0.
    (d / "capture_vs_compile.py").unlink()
    rc = grbench.main(["--bench-dir", str(d), "--out", str(out), "--no-plot"])
    data = json.loads(out.read_text())
    assert rc == 0 and data["errors"] == {}
    assert "does not exist" in data["skipped"]["capture_vs_compile"]
    assert data["plot"] is None and data["plot_note"] == "no plot requested"


def test_quick_flag_passed_only_to_scripts_that_take_it(tmp_path):
    takes_quick = _GOOD_LATENCY.replace('"argv": list(argv)', '"argv": list(argv), "doc": "--quick"')
    d = _fake_bench(tmp_path, latency_vs_batch=takes_quick)
    out = tmp_path / "bench.json"
    grbench.run_suite(out=out, plot=None, quick=True, only=["latency_vs_batch"], bench_dir=d, echo=lambda s: None)
    assert json.loads(out.read_text())["results"]["latency_vs_batch"]["argv"][-1] == "--quick"
    grbench.run_suite(out=out, plot=None, quick=False, only=["latency_vs_batch"], bench_dir=d, echo=lambda s: None)
    assert "--quick" not in json.loads(out.read_text())["results"]["latency_vs_batch"]["argv"]


def test_unknown_names_and_missing_bench_dir_are_clear_errors(tmp_path, monkeypatch, capsys):
    with pytest.raises(ValueError, match="unknown benchmark"):
        grbench.run_suite(out=tmp_path / "b.json", only=["nope"], bench_dir=BENCH_DIR)
    with pytest.raises(grbench.BenchDirNotFoundError, match="does not exist"):
        grbench.find_bench_dir(tmp_path / "missing")
    # A non-editable install: the tools package lives in site-packages with no bench/ next to it.
    fake_pkg = tmp_path / "site-packages" / "graphrunner_tools"
    fake_pkg.mkdir(parents=True)
    monkeypatch.delenv("GRAPHRUNNER_BENCH_DIR", raising=False)
    monkeypatch.setattr(graphrunner_tools, "__file__", str(fake_pkg / "__init__.py"))
    looked_for = str(tmp_path / "site-packages" / "bench")
    with pytest.raises(grbench.BenchDirNotFoundError, match=r"pip install -e \.") as err:
        grbench.find_bench_dir()
    assert looked_for in str(err.value) and "--bench-dir" in str(err.value)
    assert grbench.main(["--out", str(tmp_path / "b.json")]) == 2
    msg = capsys.readouterr().err
    assert msg.startswith("graphrunner: error: ") and looked_for in msg and "Traceback" not in msg
    # A bench/ folder there that is not graphrunner's (none of the suite's scripts) is not taken either.
    (tmp_path / "site-packages" / "bench").mkdir()
    with pytest.raises(grbench.BenchDirNotFoundError, match="none of the suite's scripts"):
        grbench.find_bench_dir()
    # The CLI: the same one line, exit 2.
    from graphrunner_tools.cli import main as cli_main

    assert cli_main(["bench", "--out", str(tmp_path / "b.json")]) == 2
    msg = capsys.readouterr().err
    assert msg.startswith("graphrunner: error: ") and "--bench-dir" in msg and "Traceback" not in msg
    # The environment variable points the driver at a checkout.
    monkeypatch.setenv("GRAPHRUNNER_BENCH_DIR", str(BENCH_DIR))
    assert grbench.find_bench_dir() == BENCH_DIR.resolve()


def test_plot_skipped_with_message_without_matplotlib(tmp_path, monkeypatch):
    d = _fake_bench(tmp_path, latency_vs_batch=_GOOD_LATENCY)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    lat = {"batches": [1, 2], "methods": {"eager": {"latency_us": [1.0, 2.0]}}}
    assert grbench.plot_latency(lat, tmp_path / "x.png") is None
    merged = grbench.run_suite(
        out=tmp_path / "b.json", plot=tmp_path / "p.png", only=["latency_vs_batch"], bench_dir=d, echo=lambda s: None
    )
    assert merged["plot"] is None and "matplotlib is not installed" in merged["plot_note"]
    assert not (tmp_path / "p.png").exists()


def test_plot_draws_png(tmp_path):
    require("matplotlib")
    lat = {
        "batches": [1, 2, 4],
        "methods": {
            "eager": {"latency_us": [10.0, 12.0, 15.0]},
            "tape_full": {"latency_us": [8.0, None, 11.0]},
            "other": {"latency_us": [9.0, 9.5, 9.9]},
        },
    }
    path = grbench.plot_latency(lat, tmp_path / "sub" / "p.png")
    assert path == tmp_path / "sub" / "p.png"
    assert path.read_bytes()[:8] == PNG_MAGIC


def test_add_bench_subparser_registers_command():
    parser = argparse.ArgumentParser(prog="graphrunner")
    sub = parser.add_subparsers(dest="command", required=True)
    grbench.add_bench_subparser(sub)
    args = parser.parse_args(["bench", "--quick", "--only", "latency_vs_batch", "--compile-buckets", "1,2"])
    assert args.func is grbench._run_from_args
    assert args.quick and args.only == "latency_vs_batch" and args.compile_buckets == "1,2"
    assert args.out is None and args.plot == "auto"  # default: <repo>/bench/results/, wherever it runs


def test_every_public_name_has_a_docstring():
    for name in grbench.__all__:
        obj = getattr(grbench, name)
        if callable(obj):
            assert obj.__doc__ and obj.__doc__.strip(), name


def test_thread_count_restored_after_each_script(tmp_path):
    import torch

    pins = """
import torch
def main(argv):
    torch.set_num_threads(torch.get_num_threads() + 1)
    return {"ok": True}
"""
    d = _fake_bench(tmp_path, tape_vs_eager=pins)
    before = torch.get_num_threads()
    try:
        grbench.run_suite(out=tmp_path / "b.json", plot=None, only=["tape_vs_eager"], bench_dir=d, echo=lambda s: None)
        assert torch.get_num_threads() == before
    finally:
        torch.set_num_threads(before)


def test_check_cost_script_measures_every_variant(tmp_path):
    """bench/check_cost.py (standalone): every variant captured, ratios against no checks, and the
    default run's per-key checks_s inside its capture_s (structure and consistency, not speed)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("check_cost", BENCH_DIR / "check_cost.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out = tmp_path / "cc.json"
    result = mod.main(["--quick", "--workloads", "demo_full", "--buckets", "1,2", "--out", str(out)])
    assert json.loads(out.read_text())["workloads"].keys() == {"demo_full"}
    row = result["workloads"]["demo_full"]
    assert set(row["ratio_min"]) == {"none", "drift", "padding", "default"}
    assert row["ratio_min"]["none"] == row["ratio_paired"]["none"] == 1.0
    assert set(row["ratio_paired"]) == set(row["ratio_min"])
    assert all(len(v) == 2 for v in row["capture_s_all_rounds"].values())  # --quick: 2 rounds each
    assert set(row["default_per_key"]) == {"1", "2"}
    for k in row["default_per_key"].values():
        assert 0 < k["checks_s"] < k["capture_s"]
    with pytest.raises(SystemExit):
        mod.main(["--workloads", "nope", "--out", str(out)])


@pytest.mark.parametrize("name", ["hf_generate", "hf_capture_vs_compile"])
def test_hf_bench_scripts_record_a_skip_without_transformers(tmp_path, monkeypatch, name, capsys):
    """Without the [hf] extra the gr.hf bench scripts write a JSON saying why they measured nothing (one helper,
    graphrunner_tools.bench.skipped_without_transformers), instead of failing on the import."""
    import json
    import sys

    monkeypatch.setitem(sys.modules, "transformers", None)  # `import transformers` raises ImportError
    module = grbench.load_script(BENCH_DIR / f"{name}.py", f"{name}_noextra")
    out = tmp_path / f"{name}.json"
    result = module.main(["--quick", "--out", str(out)])
    assert result["skipped"] == "transformers is not installed (pip install -e '.[hf]')"
    assert json.loads(out.read_text())["skipped"] == result["skipped"]
    assert f"{name}: skipped: transformers is not installed" in capsys.readouterr().out


# ----------------------------------------------------------------------------- bench/serve_sweep.py
def _serve_sweep():
    return grbench.load_script(BENCH_DIR / "serve_sweep.py", "serve_sweep")


def _req(ok=True, prompt=0, out=0, ttft=None, e2el=None, itl=()):
    return {"ok": ok, "prompt_tokens": prompt, "output_tokens": out, "ttft": ttft, "e2el": e2el, "itl": list(itl)}


def test_serve_sweep_metrics_and_goodput_equal_a_hand_computation():
    """vllm bench serve's figures for three requests and a failed one, worked out by hand: throughputs over
    the duration, TPOT = (E2EL - TTFT) / (tokens - 1) over the requests of 2 tokens or more, percentiles
    interpolated between ranks (numpy's), goodput counting the requests that meet every objective."""
    ss = _serve_sweep()
    results = [
        _req(prompt=10, out=5, ttft=0.1, e2el=0.5, itl=[0.1] * 4),  # TPOT 0.4 / 4 = 0.1
        _req(prompt=20, out=1, ttft=0.3, e2el=0.3),  # one token: no TPOT (0 for goodput)
        _req(prompt=30, out=3, ttft=0.2, e2el=1.0, itl=[0.4, 0.4]),  # TPOT 0.8 / 2 = 0.4
        {"ok": False, "error": "boom"},
    ]
    m = ss.metrics(results, 2.0, {"ttft": 250, "tpot": 150})
    expect = {
        "duration": 2.0,
        "completed": 3,
        "failed": 1,
        "total_input_tokens": 60,
        "total_output_tokens": 9,
        "request_throughput": 1.5,
        "request_goodput": 0.5,  # only the first: the second's TTFT 300 > 250, the third's TPOT 400 > 150
        "output_throughput": 4.5,
        "total_token_throughput": 34.5,
        "mean_ttft_ms": 200.0,
        "median_ttft_ms": 200.0,
        "std_ttft_ms": (0.02 / 3) ** 0.5 * 1e3,
        "p99_ttft_ms": 298.0,  # rank 1.98 of [100, 200, 300]
        "mean_tpot_ms": 250.0,
        "median_tpot_ms": 250.0,
        "std_tpot_ms": 150.0,
        "p99_tpot_ms": 397.0,  # rank 0.99 of [100, 400]
        "mean_itl_ms": 200.0,  # four of 100 and two of 400
        "median_itl_ms": 100.0,
        "std_itl_ms": ((4 * 0.01 + 2 * 0.04) / 6) ** 0.5 * 1e3,  # deviations 100 (x4) and 200 (x2)
        "p99_itl_ms": 400.0,
        "mean_e2el_ms": 600.0,
        "median_e2el_ms": 500.0,
        "std_e2el_ms": ((0.01 + 0.09 + 0.16) / 3) ** 0.5 * 1e3,
        "p99_e2el_ms": 990.0,  # rank 1.98 of [300, 500, 1000]
    }
    assert set(m) == set(expect)
    for k, v in expect.items():
        assert m[k] == pytest.approx(v), k
    assert ss.metrics(results, 2.0, {"e2el": 400})["request_goodput"] == 0.5  # only the second: 300 ms
    assert ss.metrics(results, 2.0, {"tpot": 0})["request_goodput"] == 0.5  # the one-token request's TPOT is 0
    assert ss.metrics(results, 2.0, {})["request_goodput"] is None  # no objectives: not reported
    assert ss.metrics([results[-1]], 1.0, {})["mean_ttft_ms"] is None  # nothing answered: no figure, not 0
    np = pytest.importorskip("numpy")
    for xs in ([3.0], [1.0, 2.0], [5.0, 1.0, 4.0, 2.0, 9.0, 7.0]):
        for p in (0, 25, 50, 90, 99, 100):
            assert ss.percentile(xs, p) == pytest.approx(float(np.percentile(xs, p)))
    assert ss.parse_goodput(["ttft:200", "tpot:20.5", "e2el:0"]) == {"ttft": 200.0, "tpot": 20.5, "e2el": 0.0}
    for bad in (["itl:5"], ["ttft"], ["ttft:x"], ["ttft:-1"]):
        with pytest.raises(ValueError):
            ss.parse_goodput(bad)


def test_serve_sweep_arrivals_dataset_and_time_to_full_speed():
    """Arrivals: all at once for an infinite rate, seeded gamma gaps ending at n / rate otherwise (more even
    for a larger burstiness). The random dataset: seeded, its prompt and output lengths in vllm's ranges,
    counted in the tokenizer's tokens. The time to full speed on a made-up token timeline."""
    ss = _serve_sweep()
    assert ss.arrivals(5, float("inf"), 1.0, 0) == [0.0] * 5
    a = ss.arrivals(100, 4.0, 1.0, 0)
    assert a == ss.arrivals(100, 4.0, 1.0, 0) and a != ss.arrivals(100, 4.0, 1.0, 1)
    assert a[-1] == pytest.approx(25.0) and all(x < y for x, y in zip(a, a[1:]))

    def spread(xs):
        gaps = [y - x for x, y in zip([0.0, *xs], xs)]
        mean = sum(gaps) / len(gaps)
        return (sum((g - mean) ** 2 for g in gaps) / len(gaps)) ** 0.5 / mean

    assert (
        spread(ss.arrivals(400, 4.0, 10.0, 0))
        < spread(ss.arrivals(400, 4.0, 1.0, 0))
        < spread(ss.arrivals(400, 4.0, 0.2, 0))
    )
    with pytest.raises(ValueError):
        ss.arrivals(3, 1.0, 0.0, 0)

    class CharTokenizer:  # one token a character; 0 is special
        all_special_ids = [0]

        def __len__(self):
            return 27

        def decode(self, ids):
            return "".join(chr(96 + i) for i in ids)

        def encode(self, text, add_special_tokens=False):
            return [ord(c) - 96 for c in text]

    data = ss.random_dataset(CharTokenizer(), 50, 20, 10, 0.5, seed=3)
    assert data == ss.random_dataset(CharTokenizer(), 50, 20, 10, 0.5, seed=3)
    assert all(10 <= d["prompt_len"] == len(d["prompt"]) <= 30 and 5 <= d["max_tokens"] <= 15 for d in data)
    assert all(set(d["prompt"]) <= set("abcdefghijklmnopqrstuvwxyz") for d in data)
    assert len({d["prompt_len"] for d in data}) > 5
    assert {d["prompt_len"] for d in ss.random_dataset(CharTokenizer(), 5, 20, 10, 0.0, seed=0)} == {20}
    with pytest.raises(ValueError):
        ss.random_dataset(CharTokenizer(), 1, 20, 10, 1.0, seed=0)

    # Nothing for 3 s (the start), 50 tokens/s for 2 s, then 100/s to 12 s: full speed from second 5.
    stamps = [3 + i / 50 for i in range(100)] + [5 + i / 100 for i in range(700)]
    fs = ss.full_speed(stamps, end=12.0, steady_from=8.0, window=2.0)
    assert fs["rolling_tokens_per_s"] == [0, 0, 25, 50, 75, 100, 100, 100, 100, 100, 100]
    assert fs["steady_tokens_per_s"] == 100 and fs["full_speed_s"] == 5
    # A stall in [7, 8) after it: full speed only once the windows are past the stall.
    stalled = [t for t in stamps if not 7 <= t < 8]
    assert ss.full_speed(stalled, end=12.0, steady_from=8.0, window=2.0)["full_speed_s"] == 8
    assert ss.full_speed([], end=12.0, steady_from=8.0)["full_speed_s"] is None  # no tokens: nothing to tell
    assert ss.full_speed(stamps, end=1.0, steady_from=0.0)["steady_tokens_per_s"] is None  # no whole window


def test_serve_sweep_usage_errors_before_any_server(capsys):
    ss = _serve_sweep()
    for argv in (
        ["--max-concurrency", "1,2", "--num-prompts", "1,2,3"],
        ["--goodput", "itl:5"],
        ["--burstiness", "0"],
        ["--columns", "graphs,nope"],
        ["--max-concurrency", "x"],
        ["--tp", "0"],
        ["--flags", "--tp 2"],
        ["--graphs-flags", "--tp 2"],
        ["--columns", "one-rank,eager"],
    ):
        with pytest.raises(SystemExit) as err:
            ss.main(argv)
        assert err.value.code == 2, argv


def test_serve_sweep_graphs_flags_reach_the_graphs_column_only_and_the_start_is_reported_per_column():
    """``--graphs-flags`` (e.g. ``--capture-first``, which ``--eager`` refuses) go to the ``graphs`` column alone,
    ``--flags`` and ``--tp`` as before; each column's start line names its seconds to the first ``/health`` 200
    and whether ``/ready`` was 200 then, from the harness's probe (by hand)."""
    ss = _serve_sweep()
    base, first, tp = ["model", "--flags-for-all"], ["--capture-first"], ["--tp", "2"]
    assert ss.column_flags("graphs", base, first, tp) == [*base, "--capture-first", "--tp", "2"]
    assert ss.column_flags("eager", base, first, tp) == [*base, "--eager", "--tp", "2"]
    assert ss.column_flags("backend-eager", base, first, []) == [*base, "--backend", "eager"]
    assert ss.column_flags("one-rank", base, first, tp) == [*base, "--eager"]  # one rank, no graphs flags
    ready = {"ready_status": 200, "ready": {"ready": True, "graphs_planned": 44, "graphs_captured": 44}}
    behind = {"ready_status": 503, "ready": {"ready": False, "graphs_planned": 44, "graphs_captured": 3}}
    assert ss.ready_at_start(ready) == {"ready_at_start": True, "graphs_captured_at_start": 44}
    assert ss.ready_at_start(behind) == {"ready_at_start": False, "graphs_captured_at_start": 3}
    assert ss.ready_at_start(None) == {"ready_at_start": None, "graphs_captured_at_start": None}  # not probed
    columns = {
        "graphs": {"start_seconds": 21.04, **ss.ready_at_start(ready)},
        "backend-eager": {"start_seconds": 12.0, **ss.ready_at_start(behind)},
        "eager": {"start_seconds": 11.96, **ss.ready_at_start(None)},
    }
    assert ss.start_line(columns) == (
        "[serve_sweep] start (launch to /health 200; /ready then): graphs 21.0 s ready, "
        "backend-eager 12.0 s not ready (3 graphs captured), eager 12.0 s"
    )


def test_serve_sweep_counts_one_rank_answers_as_agreement_never_as_mismatches():
    """``--tp N``'s reference column: the one-rank server's answers differing from the first column's are
    counted in ``one_rank_agreement`` (tensor parallelism reorders sums), a differing tensor-parallel
    column's in ``mismatches``: by hand, 3 requests over two runs."""
    ss = _serve_sweep()

    def col(*runs):
        return {"runs": [{"generated_texts": list(r), "failed": 0} for r in runs]}

    result = {
        "columns": {
            "graphs": col(["a", "b"], ["c"]),
            "eager": col(["a", "x"], ["c"]),  # one request differs: a mismatch
            "one-rank": col(["a", "y"], [None]),  # one differs, one unanswered: agreement 1 of 2
        }
    }
    ss.compare_answers(result, ["graphs", "eager", "one-rank"])
    assert result["mismatches"] == 1
    assert result["one_rank_agreement"] == {"same": 1, "compared": 2}
    assert [r["mismatches"] for r in result["columns"]["eager"]["runs"]] == [1, 0]
    assert all("mismatches" not in r for r in result["columns"]["one-rank"]["runs"])


def test_serve_sweep_rank_figures_equal_a_hand_computation():
    """Per rank, what a run added to ``/metrics``' ``graphrunner_rank_*`` counters, by hand: rank 0 served 30
    steps (all replayed) and waited 0.3 s in collectives, rank 1 30 eager steps and none; 120 output tokens
    over 30 steps are 4 a step; families of other names are not counted."""
    ss = _serve_sweep()
    steps = 'graphrunner_rank_steps_total{model="m",rank="%s",path="%s"}'
    wait = 'graphrunner_rank_collective_wait_seconds_total{model="m",rank="%s"}'
    before = {steps % (0, "replayed"): 10, steps % (0, "eager"): 5, wait % 0: 1.0, steps % (1, "replayed"): 10}
    before['graphrunner_steps_total{model="m",path="replayed"}'] = 7  # not a rank family
    after = dict(before)
    after[steps % (0, "replayed")] = 40
    after[wait % 0] = 1.3
    after[steps % (1, "eager")] = 30  # absent before: counted from 0
    after['graphrunner_steps_total{model="m",path="replayed"}'] = 99
    ranks = ss.rank_figures(before, after, output_tokens=120)
    assert list(ranks) == ["0", "1"]
    assert ranks["0"]["steps"] == 30 and ranks["0"]["replayed"] == 30
    assert ranks["0"]["collective_ms_per_step"] == pytest.approx(300 / 30)
    assert ranks["1"]["steps"] == 30 and ranks["1"]["replayed"] == 0 and ranks["1"]["collective_s"] == 0
    assert ranks["0"]["tokens_per_step"] == ranks["1"]["tokens_per_step"] == 4
    assert ss.rank_figures({}, {}, 5) == {}  # a server without the families
    synced = 'graphrunner_rank_synced_steps_total{model="m",rank="%s"}'
    eager = ss.rank_figures({synced % 0: 2}, {synced % 0: 12}, output_tokens=30)  # --eager: no step by path
    assert eager == {
        "0": {"steps": 10, "replayed": 0, "collective_s": 0, "collective_ms_per_step": 0, "tokens_per_step": 3}
    }
    assert ss.rank_lines(ranks)[0] == "rank 0: 30 steps, 100% replayed, collectives 10.00 ms/step, 4.0 tokens/step"


def test_serve_sweep_health_poller_counts_every_answer_that_is_not_a_200():
    """``HealthPoller`` against a real HTTP server on 127.0.0.1 whose ``/health`` answers 200, then 503, then
    is gone: the 503s and the refused connections are counted, the first named; a server that always
    answers 200 gives none (the control)."""
    import http.server

    ss = _serve_sweep()
    status = [200]

    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 (http.server's name)
            self.send_response(status[0] if self.path == "/health" else 404)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Health)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        healthy = ss.HealthPoller(url, period=0.02)
        healthy.start()
        time.sleep(0.3)
        ok = healthy.finish()
        assert ok["health_polls"] >= 3 and ok["health_not_ok"] == 0 and ok["health_first_failure"] is None

        poller = ss.HealthPoller(url, period=0.02, timeout=2)
        poller.start()
        time.sleep(0.2)
        status[0] = 503
        time.sleep(0.3)
    finally:
        server.shutdown()
        server.server_close()
    time.sleep(0.2)  # gone: refused connections
    got = poller.finish()
    assert got["health_first_failure"] == "HTTP 503"
    assert 2 <= got["health_not_ok"] < got["health_polls"]


@pytest.mark.hf
@pytest.mark.slow
def test_serve_sweep_small_run_reports_vllm_names_and_equal_answers(tmp_path, monkeypatch):
    """bench/serve_sweep.py, a small run of two columns (graphs and --eager, 6 prompts at a rate with
    Poisson arrivals, 4 at most in flight): vllm bench serve's names with sane values, every request
    answered, the same greedy answers in both columns, JSON written. Never a timing."""
    for module in ("transformers", "fastapi", "uvicorn", "prometheus_client", "openai"):
        require(module)
    monkeypatch.setenv("GRAPHRUNNER_CACHE", str(tmp_path.parent / "cache"))  # the tiny model: shared in a session
    out = tmp_path / "sweep.json"
    argv = ["--columns", "graphs,eager", "--max-concurrency", "4", "--num-prompts", "6", "--request-rate", "50"]
    argv += ["--random-input-len", "12", "--random-output-len", "6", "--num-warmups", "0", "--threads", "1"]
    argv += ["--full-speed-settle", "0"]  # no waiting for the capture: the time to full speed is not measured
    argv += ["--flags", "--capture-share 1"]  # the keys captured back to back under the run's load: some replay
    argv += ["--goodput", "ttft:60000", "tpot:60000", "--out", str(out)]
    result = _serve_sweep().main(argv)
    assert json.loads(out.read_text())["benchmark"] == "serve_sweep"
    assert result["failed"] == 0 and result["mismatches"] == 0
    assert list(result["columns"]) == ["graphs", "eager"]
    for name, col in result["columns"].items():
        assert col["exit_code"] == 0, name
        (run,) = col["runs"]
        assert run["completed"] == run["num_prompts"] == 6 and run["failed"] == 0
        assert run["max_concurrency"] == 4 and run["request_rate"] == 50.0 and run["burstiness"] == 1.0
        assert run["health_polls"] >= 1 and run["health_not_ok"] == 0, run["health_first_failure"]
        assert run["duration"] > 0 and run["total_output_tokens"] > 0 and run["total_input_tokens"] > 0
        for k in ("request_throughput", "output_throughput", "total_token_throughput"):
            assert run[k] > 0, k
        assert run["total_token_throughput"] > run["output_throughput"]
        assert 0 < run["request_goodput"] <= run["request_throughput"]
        for m in ("ttft", "tpot", "itl", "e2el"):
            mean, median, p99 = (run[f"{s}_{m}_ms"] for s in ("mean", "median", "p99"))
            assert 0 <= mean <= p99 and 0 <= median <= p99 and run[f"std_{m}_ms"] >= 0, m
        assert run["mean_ttft_ms"] <= run["mean_e2el_ms"]
        assert len(run["generated_texts"]) == len(run["ttfts"]) == len(run["latencies"]) == 6
        assert all(run["input_lens"]) and run["errors"] == [""] * 6
    assert result["columns"]["eager"]["runs"][0]["same"] == 6
    assert result["columns"]["graphs"]["runs"][0]["replayed_steps"] > 0
    assert result["columns"]["eager"]["runs"][0]["replayed_steps"] == 0
