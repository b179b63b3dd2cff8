"""`graphrunner demo`: the main job runs, checks itself, and fails when a graph is wrong."""

from __future__ import annotations

import io
import json
import subprocess
import sys

import pytest

import graphrunner as gr
import graphrunner_tools.demo as demo
from graphrunner.errors import CaptureError
from graphrunner_tools.cli import main


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["breakable", "full", "eager"])
def test_demo_serves_steps_equal_to_eager(backend, tmp_path):
    out = io.StringIO()
    result = demo.run_demo(
        backend=backend,
        device="tape",
        steps=12,
        buckets=(1, 2, 4),
        max_batch=6,
        layers=2,
        trace_out=str(tmp_path / "trace"),
        progress=False,
        out=out,
    )
    text = out.getvalue()
    assert result.ok, text
    assert result.graph_mismatches == 0 and result.padding_mismatches == 0 and result.violations == []
    assert result.max_abs_diff_padded == 0.0
    # batch 5 and 6 are above the largest bucket: counted by hand from the batches drawn, and said in words
    assert len(result.batches) == 12 and max(result.batches) <= 6
    over = sum(n > 4 for n in result.batches)
    assert result.fallbacks == over > 0
    assert result.padding_rows == _hand_padding(result.batches, (1, 2, 4))
    assert result.real_rows == sum(result.batches)  # fallbacks serve real rows too
    assert f"fallbacks: {over} of 12 calls ran eagerly" in text
    assert f"{over} had a batch above the largest bucket, 4 (batches drawn up to 6" in text
    assert "capture protocol held" in text and "demo: OK" in text
    lines = (tmp_path / "trace.jsonl").read_text().splitlines()
    kinds = {json.loads(line)["kind"] for line in lines}
    assert {"warmup_forward", "synchronize", "barrier", "graph_construct", "capture_forward", "replay"} <= kinds
    chrome = json.loads((tmp_path / "trace.chrome.json").read_text())
    assert chrome["traceEvents"]


def _hand_padding(batches, buckets):
    """Padding rows by hand: each batch that fits runs the smallest bucket that holds it."""
    return sum(min(b for b in buckets if b >= n) - n for n in batches if n <= max(buckets))


@pytest.mark.slow
def test_the_default_demo_shows_what_graphs_gain_with_no_fallback():
    """Issue 53 item 5: the default run (full backend, batches up to the largest bucket) replays a
    graph at every call and prints graphs vs eager side by side with what the ratio means. The
    over-bucket run of test_demo_serves_steps_equal_to_eager is the negative control of the
    hand computation: the same count is > 0 there."""
    out = io.StringIO()
    result = demo.run_demo(device="tape", steps=40, layers=1, trace_out=None, progress=False, out=out)
    text = out.getvalue()
    assert result.ok, text
    header = text.splitlines()[0]
    assert "backend=full" in header and "buckets=[1, 2, 4, 8, 16, 32]" in header and "batch 1..32" in header
    assert len(result.batches) == 40 and 1 <= min(result.batches) and max(result.batches) <= 32
    assert result.fallbacks == sum(n > 32 for n in result.batches) == 0
    assert result.padding_rows == _hand_padding(result.batches, (1, 2, 4, 8, 16, 32))
    assert result.real_rows == sum(result.batches)
    assert "fallbacks: none: every batch drawn (1..32) fits a bucket, so all 40 calls replayed" in text
    assert "over_max_bucket" not in text
    # the speed line is the table's lowest and highest ratio, each with its bucket
    ratios = {int(b): row["speedup"] for b, row in result.latency.items()}
    lo, hi = min(ratios, key=ratios.__getitem__), max(ratios, key=ratios.__getitem__)
    speed = next(line for line in text.splitlines() if line.startswith("speed: graphs"))
    assert f"{ratios[lo]:.2f}x (bucket {lo}) to {ratios[hi]:.2f}x (bucket {hi})" in speed
    assert "no GPU here: the graphs are the tape" in text


def test_the_demo_command_defaults_are_run_demos(monkeypatch):
    """`graphrunner demo` with no option passes what run_demo defaults to: the full backend and
    batches up to the largest bucket (no fallback), so the command and the library agree."""
    import inspect

    defaults = {k: p.default for k, p in inspect.signature(demo.run_demo).parameters.items()}
    seen = {}

    def recording(**kwargs):
        seen.update(kwargs)
        return demo.DemoResult(0, 0, 0, 0.0, 0.0, 0, [])

    monkeypatch.setattr(demo, "run_demo", recording)
    assert main(["demo", "--trace-out", ""]) == 0
    assert seen["backend"] == defaults["backend"] == "full"
    assert seen["max_batch"] is defaults["max_batch"] is None
    assert list(seen["buckets"]) == list(defaults["buckets"]) == [1, 2, 4, 8, 16, 32]
    assert seen["steps"] == defaults["steps"] == 200


@pytest.mark.parametrize(
    "speedups,head",
    [
        ({"1": 1.5, "8": 1.2}, "speed: graphs faster than eager at every bucket: 1.20x (bucket 8) to 1.50x (bucket 1)"),
        ({"1": 0.8, "8": 0.9}, "speed: graphs slower than eager at every bucket: 0.80x (bucket 1) to 0.90x (bucket 8)"),
        ({"1": 1.3, "8": 0.97}, "speed: graphs 0.97x (bucket 8) to 1.30x (bucket 1) (below 1.00x eager is faster)"),
    ],
)
def test_the_speed_line_says_faster_only_when_every_bucket_is(speedups, head):
    lines = demo._speed_lines({b: {"speedup": r} for b, r in speedups.items()}, "tape")
    assert lines[0] == head and "CPU emulation of CUDA graphs" in " ".join(lines)
    assert "kernel by kernel" in " ".join(demo._speed_lines({b: {"speedup": r} for b, r in speedups.items()}, "cuda"))


@pytest.mark.slow
def test_demo_reports_a_graph_that_differs_from_eager(monkeypatch, tmp_path, capsys):
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
    kw = dict(
        backend="breakable",
        device="tape",
        steps=4,
        buckets=(1, 2),
        max_batch=2,
        layers=1,
        trace_out=None,
        progress=False,
    )
    # The drift check refuses the capture, naming the line ...
    with pytest.raises(
        CaptureError,
        match=r"argument 2 of aten.add was 2.0 at warmup 2 and 3.0 at capture.*"
        r"test_demo.py:\d+ in drifting",
    ):
        demo.run_demo(out=io.StringIO(), **kw)
    # ... and without it the graph replays the frozen value: the demo's eager comparison fails.
    out = io.StringIO()
    result = demo.run_demo(out=out, drift_check=False, **kw)
    assert not result.ok and result.graph_mismatches == 4
    assert "demo: FAILED" in out.getvalue()
    # the command line stops at the capture too (each main() builds a fresh drifting model):
    # one line on stderr naming the error, exit 1, no traceback
    rc = main(
        [
            "demo",
            "--device",
            "tape",
            "--steps",
            "4",
            "--buckets",
            "1,2",
            "--max-batch",
            "2",
            "--layers",
            "1",
            "--no-progress",
            "--trace-out",
            "",
        ]
    )
    err = capsys.readouterr().err
    assert (
        rc == 1
        and err.startswith("graphrunner demo: CaptureError: ")
        and "drift between warmup 2 and the capture" in err
    )
    assert "Traceback" not in err


@pytest.mark.slow
def test_demo_reports_a_protocol_violation(monkeypatch):
    """Negative control: a backend that skips the final synchronize and barrier
    replays correct values, but the trace checker must catch it and fail the demo."""
    from graphrunner.backends.base import GraphBackend

    monkeypatch.setattr(GraphBackend, "_final_barrier", lambda self, key: None)
    monkeypatch.setattr(GraphBackend, "_final_sync", lambda self, key: None)
    out = io.StringIO()
    result = demo.run_demo(
        backend="breakable",
        device="tape",
        steps=3,
        buckets=(1, 2),
        max_batch=2,
        layers=1,
        trace_out=None,
        progress=False,
        out=out,
    )
    assert result.graph_mismatches == 0 and result.padding_mismatches == 0  # values are fine ...
    assert not result.ok and result.violations  # ... the protocol is not
    assert any("no barrier between the last warmup/hook and graph construction" in v for v in result.violations)
    assert any("no synchronize between the last warmup/hook and graph construction" in v for v in result.violations)
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
    # the padding check catches it at capture ...
    with pytest.raises(gr.PaddingLeakError, match="bucket 4"):
        demo.run_demo(
            backend="breakable",
            device="tape",
            steps=4,
            buckets=(4,),
            max_batch=3,
            layers=1,
            trace_out=None,
            progress=False,
            out=io.StringIO(),
        )
    # ... and with it off, the demo's own comparison with eager on the real batch does
    # bucket 4 only, batches of 1..3: every call is padded
    result = demo.run_demo(
        backend="breakable",
        device="tape",
        steps=4,
        buckets=(4,),
        max_batch=3,
        layers=1,
        trace_out=None,
        progress=False,
        out=out,
        checks=("drift", "fingerprint"),
    )
    assert result.padding_mismatches == 4 and not result.ok
    assert result.fallbacks == 0 and result.violations == []
    assert "demo: FAILED" in out.getvalue()


def test_demo_rejects_bad_arguments():
    with pytest.raises(ValueError, match="backend"):
        demo.run_demo(backend="nope", progress=False, trace_out=None)
    assert main(["demo", "--steps", "0", "--trace-out", ""]) == 2


@pytest.mark.slow
def test_cli_demo_exit_code_and_help(tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "graphrunner_tools.cli",
            "demo",
            "--device",
            "tape",
            "--steps",
            "6",
            "--buckets",
            "1,2",
            "--max-batch",
            "3",
            "--layers",
            "1",
            "--no-progress",
            "--trace-out",
            str(tmp_path / "t"),
        ],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "demo: OK" in proc.stdout
    helptext = subprocess.run(
        [sys.executable, "-m", "graphrunner_tools.cli", "demo", "--help"], capture_output=True, text=True, timeout=120
    ).stdout
    for flag in ("--backend", "--device", "--steps", "--trace-out"):
        assert flag in helptext


def _table_rows(text: str):
    """The bucket rows and the totals row of a capture report table, split into cells."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.split()[:2] == ["bucket", "capture_s"])
    rows, total = [], None
    for line in lines[start + 2 :]:
        cells = line.split()
        if cells and cells[0] == "total":
            total = cells
            break
        if cells and cells[0].isdigit():
            rows.append(cells)
    return rows, total


def test_capture_report_totals_are_sums_of_its_rows():
    from graphrunner.report import BucketReport, CaptureReport

    rows = [
        BucketReport(4, 0.5, 0.25, 3, 2, 4096, checks_seconds=0.125),
        BucketReport(2, 0.125, 0.0625, 3, 2, 2048, checks_seconds=0.0625),
        BucketReport(1, 0.0625, 0.03125, 3, 2, 1024),
    ]
    report = CaptureReport(
        "breakable", "tape", 0, 1, rows, total_seconds=1.0, static_input_bytes=64, output_buffer_bytes=4096
    )
    printed, total = _table_rows(report.table())
    assert len(printed) == 3
    # 0.5+0.125+0.0625, checks 0.125+0.0625+0, graph 0.25+0.0625+0.03125, 3*3, 3*2
    assert total[1:6] == ["0.6875", "0.1875", "0.3438", "9", "6"]
    assert total[6] == "-"  # overlapping views of shared buffers: no sum printed
    assert "= 4.1 KiB" in report.table() and report.total_bytes_held == 64 + 4096


def _tiny_demo(backend: str):
    """``(result, stdout)`` of a 3-step demo run that passed."""
    out = io.StringIO()
    result = demo.run_demo(
        backend=backend,
        device="tape",
        steps=3,
        buckets=(1, 2),
        max_batch=3,
        layers=1,
        trace_out=None,
        progress=False,
        out=out,
    )
    assert result.ok, out.getvalue()
    return result, out.getvalue()


@pytest.mark.slow
def test_demo_prints_a_legend_and_true_totals():
    _, text = _tiny_demo("breakable")
    legend = [line for line in text.splitlines() if line.startswith(("columns:", "legend:"))]
    assert len(legend) == 2 and all(len(line) <= 160 for line in legend)  # the report's, the latency table's
    for col in ("capture_s", "checks_s", "graph_s", "graph_pool", "eager_ms", "graph_ms", "speedup"):
        assert col in " ".join(legend), col
    assert "bytes_held" not in text  # overlapping rows are gone: memory is one line of separate parts
    # the default backend says where the speedup is (issue 36: the demo showed ~1.0x and never said why)
    assert "note: breakable runs attention eagerly at every replay, so it gains little; --backend full" in text
    rows, total = _table_rows(text)
    for col in (1, 2, 3):  # capture_s, checks_s, graph_s
        assert float(total[col]) == pytest.approx(sum(float(r[col]) for r in rows), abs=1e-4 * len(rows))
    for col in (4, 5):
        assert int(total[col]) == sum(int(r[col]) for r in rows)
    assert all(0 < float(r[2]) < float(r[1]) for r in rows[:-1])  # checks ran on the padded keys, inside capture_s


@pytest.mark.slow
def test_demo_eager_latency_table_has_no_graph_columns():
    result, text = _tiny_demo("eager")
    head = next(line for line in text.splitlines() if line.split()[:2] == ["bucket", "eager_ms"])
    assert head.split() == ["bucket", "eager_ms", "runner_ms"]
    assert "speedup" not in text and "graph_ms" not in text and "x\n" not in text
    assert "note: breakable" not in text  # only the breakable backend's table gets the note
    assert set(result.latency["1"]) == {"eager_ms", "runner_ms"}


def test_trace_folder_replaced_by_a_file_mid_run_is_one_line(tmp_path, monkeypatch, capsys):
    folder = tmp_path / "out"
    real = demo.check_capture_order

    def replace_folder_then_check(trace):
        # mid-run, after the CLI checked that out/ is writable: out/ becomes a file
        for f in folder.iterdir():
            f.unlink()
        folder.rmdir()
        folder.write_text("not a folder")
        return real(trace)

    monkeypatch.setattr(demo, "check_capture_order", replace_folder_then_check)
    argv = [
        "demo",
        "--device",
        "tape",
        "--steps",
        "2",
        "--buckets",
        "1,2",
        "--max-batch",
        "2",
        "--layers",
        "1",
        "--no-progress",
        "--trace-out",
        str(folder / "t"),
    ]
    assert main(argv) == 1
    captured = capsys.readouterr()
    assert captured.err.count("\n") == 1 and "Traceback" not in captured.err
    assert f"cannot write the trace file {str(folder / 't.jsonl')!r} ({str(folder)!r} is a file now" in captured.err
    assert "demo: FAILED" in captured.out and folder.read_text() == "not a folder"
    # negative control: the same run with the folder left alone writes both files and exits 0
    monkeypatch.setattr(demo, "check_capture_order", real)
    folder.unlink()
    assert main(argv) == 0
    assert sorted(p.name for p in folder.iterdir()) == ["t.chrome.json", "t.jsonl"]
    assert (folder / "t.jsonl").read_text().count("\n") > 10
