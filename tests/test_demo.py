"""`graphrunner demo`: the main job runs, checks itself, and fails when a graph is wrong."""

from __future__ import annotations

import io
import json
import subprocess
import sys

import pytest
import torch

import graphrunner.demo as demo
from graphrunner.cli import main


@pytest.mark.parametrize("backend", ["breakable", "full", "eager"])
def test_demo_serves_steps_equal_to_eager(backend, tmp_path):
    out = io.StringIO()
    result = demo.run_demo(backend=backend, device="tape", steps=12, buckets=(1, 2, 4), max_batch=6,
                           layers=2, trace_out=str(tmp_path / "trace"), progress=False, out=out)
    text = out.getvalue()
    assert result.ok, text
    assert result.graph_mismatches == 0 and result.padding_mismatches == 0 and result.violations == []
    assert result.max_abs_diff_padded == 0.0
    assert result.fallbacks > 0  # batch 5 and 6 are above the largest bucket
    assert "capture protocol held" in text and "demo: OK" in text
    lines = (tmp_path / "trace.jsonl").read_text().splitlines()
    kinds = {json.loads(line)["kind"] for line in lines}
    assert {"warmup_forward", "synchronize", "barrier", "graph_construct", "capture_forward", "replay"} <= kinds
    chrome = json.loads((tmp_path / "trace.chrome.json").read_text())
    assert chrome["traceEvents"]


def test_demo_reports_a_graph_that_differs_from_eager(monkeypatch, tmp_path):
    """Negative control: a step that reads a Python counter is frozen in the
    graph but live in eager, so the demo must see mismatches and fail."""
    real_build = demo.build_model

    def build_drifting_model(*args, **kwargs):
        model = real_build(*args, **kwargs)
        step = model.decode_step
        calls = {"n": 0}

        def drifting(input_ids, positions, slot_ids=None):
            calls["n"] += 1
            return step(input_ids, positions) + float(calls["n"])  # Python scalar: frozen at capture

        model.decode_step = drifting
        return model

    monkeypatch.setattr(demo, "build_model", build_drifting_model)
    out = io.StringIO()
    result = demo.run_demo(backend="breakable", device="tape", steps=4, buckets=(1, 2), max_batch=2,
                           layers=1, trace_out=None, progress=False, out=out)
    assert not result.ok and result.graph_mismatches == 4
    assert "demo: FAILED" in out.getvalue()
    # the command line turns the failure into exit code 1 (each main() builds a fresh drifting model)
    assert main(["demo", "--device", "tape", "--steps", "4", "--buckets", "1,2", "--max-batch", "2",
                 "--layers", "1", "--no-progress", "--trace-out", ""]) == 1


def test_demo_reports_a_protocol_violation(monkeypatch):
    """Negative control: a backend that skips the final synchronize and barrier
    replays correct values, but the trace checker must catch it and fail the demo."""
    from graphrunner.backends.base import GraphBackend

    monkeypatch.setattr(GraphBackend, "_final_barrier", lambda self, key: None)
    monkeypatch.setattr(GraphBackend, "_final_sync", lambda self, key: None)
    out = io.StringIO()
    result = demo.run_demo(backend="breakable", device="tape", steps=3, buckets=(1, 2), max_batch=2,
                           layers=1, trace_out=None, progress=False, out=out)
    assert result.graph_mismatches == 0 and result.padding_mismatches == 0  # values are fine ...
    assert not result.ok and result.violations  # ... the protocol is not
    assert any("no barrier between the last warmup/hook and graph construction" in v for v in result.violations)
    assert any("no synchronize between the last warmup/hook and graph construction" in v
               for v in result.violations)
    assert "protocol violation" in out.getvalue() and "demo: FAILED" in out.getvalue()


def test_demo_reports_padding_that_leaks_into_real_rows(monkeypatch):
    """Negative control: a step that mixes rows (adds the batch mean) is bit-exact
    against eager on the same padded batch, but the padding rows change the real
    rows' results, which the comparison with eager on the real batch must catch."""
    real_build = demo.build_model

    def build_leaky_model(*args, **kwargs):
        model = real_build(*args, **kwargs)
        step = model.decode_step

        def leaky(input_ids, positions, slot_ids=None):
            out = step(input_ids, positions)
            return out + out.mean(0, keepdim=True)  # every row sees every other row, padding included

        model.decode_step = leaky
        return model

    monkeypatch.setattr(demo, "build_model", build_leaky_model)
    out = io.StringIO()
    # bucket 4 only, batches of 1..3: every call is padded
    result = demo.run_demo(backend="breakable", device="tape", steps=4, buckets=(4,), max_batch=3,
                           layers=1, trace_out=None, progress=False, out=out)
    assert result.padding_mismatches == 4 and not result.ok
    assert result.fallbacks == 0 and result.violations == []
    assert "demo: FAILED" in out.getvalue()


def test_demo_rejects_bad_arguments():
    with pytest.raises(ValueError, match="backend"):
        demo.run_demo(backend="nope", progress=False, trace_out=None)
    assert main(["demo", "--steps", "0", "--trace-out", ""]) == 2


def test_cli_demo_exit_code_and_help(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "graphrunner.cli", "demo", "--device", "tape", "--steps", "6", "--buckets", "1,2",
         "--max-batch", "3", "--layers", "1", "--no-progress", "--trace-out", str(tmp_path / "t")],
        capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "demo: OK" in proc.stdout
    helptext = subprocess.run([sys.executable, "-m", "graphrunner.cli", "demo", "--help"],
                              capture_output=True, text=True, timeout=120).stdout
    for flag in ("--backend", "--device", "--steps", "--trace-out"):
        assert flag in helptext
