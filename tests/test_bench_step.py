"""``graphrunner bench --step TARGET``: your own step's runner timed against the step eagerly.

The timings are never asserted (a shared machine); what is asserted is real: the graph's output is
compared with the eager step's on the same random inputs (``max_abs_diff``, with a negative control
whose graph froze a Python value), the speedup is the ratio of the two medians, the inputs respect the
declarations, and usage errors are one line with exit code 2.
"""

from __future__ import annotations

import json
import textwrap

import pytest
import torch

import graphrunner as gr
from graphrunner_tools.cli import main
from graphrunner_tools.steptime import random_inputs, time_runner

pytestmark = pytest.mark.usefixtures("one_torch_thread")

MODEL = textwrap.dedent("""
    import torch, graphrunner as gr

    w = torch.randn(32, 32, generator=torch.Generator().manual_seed(0)) / 8

    def step(x, ids):
        return torch.relu(x @ w) + ids[:, None]

    EXAMPLE = {"x": torch.randn(4, 32), "ids": torch.tensor([0, 3, 5, 9])}

    def make_runner():
        inputs = {"x": gr.BatchInput(trailing=(32,)), "ids": gr.BatchInput(trailing=(), dtype=torch.long, bounds=(0, 9))}
        return gr.GraphRunner(step, inputs, buckets=[1, 4, 8], backend="full", progress=False)
""")


def test_time_runner_compares_the_graph_with_eager_and_reports_the_ratio_of_medians():
    w = torch.randn(32, 32) / 8
    runner = gr.GraphRunner(
        lambda x: torch.relu(x @ w) + x,
        {"x": gr.BatchInput(trailing=(32,))},
        buckets=[1, 4, 8],
        backend="full",
        progress=False,
    )
    result = time_runner(runner, [1, 3, 8], rounds=3, calls=4)
    assert [(r["batch"], r["bucket"]) for r in result["rows"]] == [(1, 1), (3, 4), (8, 8)]  # 3 pads to 4
    for r in result["rows"]:
        # the tape replays the same kernels as eager: bit-exact at a bucket's size; padded (3 rows in bucket 4), a
        # matmul over 4 rows may round the last bits of 3 rows apart
        assert r["max_abs_diff"] == 0.0 if r["batch"] == r["bucket"] else r["max_abs_diff"] < 1e-5
        assert r["speedup"] == pytest.approx(r["eager_us"] / r["runner_us"])
        assert len(r["rounds_us"]["eager"]) == len(r["rounds_us"]["runner"]) == 3
        assert r["eager_us"] == pytest.approx(sorted(r["rounds_us"]["eager"])[1])  # the median of 3 rounds
    assert runner.stats.replays[4] > 0 and result["backend"] == "FullGraphBackend"


def test_negative_control_a_graph_that_froze_a_python_value_shows_a_difference():
    """A step reading a Python number: the graph keeps the value it saw at capture, eager reads the new one, so
    the comparison is real (it would hide nothing)."""
    scale = [1.0]
    runner = gr.GraphRunner(
        lambda x: x * scale[0], {"x": gr.BatchInput(trailing=(4,))}, buckets=[2], backend="full", progress=False
    )
    runner.capture()
    scale[0] = 2.0
    (row,) = time_runner(runner, [2], rounds=1, calls=1)["rows"]
    assert row["max_abs_diff"] > 0


def test_random_inputs_follow_the_declarations():
    runner = gr.GraphRunner(
        lambda a, ids, raw: a,
        {
            "a": gr.BatchInput(trailing=(3,), dtype=torch.float64),
            "ids": gr.BatchInput(trailing=(2,), dtype=torch.long, bounds=(3, 5)),
            "raw": gr.BatchInput(trailing=(), dtype=torch.int32, pad=7),
        },
        buckets=[8],
        progress=False,
    )
    x = random_inputs(runner, 6, torch.Generator().manual_seed(1))
    assert x["a"].shape == (6, 3) and x["a"].dtype == torch.float64 and x["a"].std() > 0
    assert x["ids"].shape == (6, 2) and int(x["ids"].min()) >= 3 and int(x["ids"].max()) <= 5
    assert set(x["ids"].flatten().tolist()) == {3, 4, 5}  # the whole range is drawn
    assert x["raw"].tolist() == [7] * 6  # no bounds: the pad value, which every step must accept


def test_cli_times_a_factory_and_a_step_with_example_inputs(tmp_path, capsys):
    (tmp_path / "model.py").write_text(MODEL)
    assert main(["bench", "--step", f"{tmp_path / 'model.py'}:make_runner", "--batches", "1,8"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith(f"graphrunner bench --step {tmp_path / 'model.py'}:make_runner: FullGraphBackend")
    assert out[1].split() == [
        "batch",
        "bucket",
        "eager",
        "us",
        "runner",
        "us",
        "speedup",
        "max",
        "|graph",
        "-",
        "eager|",
    ]
    rows = [line.split() for line in out[2:4]]
    assert [r[:2] for r in rows] == [["1", "1"], ["8", "8"]] and all(r[-1] == "0" for r in rows)
    for r in rows:  # the printed speedup is the printed times' ratio
        assert float(r[4].rstrip("x")) == pytest.approx(float(r[2]) / float(r[3]), abs=0.01)
    out_json = tmp_path / "t.json"
    assert (
        main(
            [
                "bench",
                "--step",
                f"{tmp_path / 'model.py'}:step",
                "--inputs",
                "EXAMPLE",
                "--batches",
                "2,4",
                "--out",
                str(out_json),
            ]
        )
        == 0
    )
    data = json.loads(out_json.read_text())
    assert [(r["batch"], r["bucket"], r["max_abs_diff"]) for r in data["rows"]] == [(2, 2, 0.0), (4, 4, 0.0)]
    assert data["backend"] == "FullGraphBackend"  # --backend's default for a step


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--step", "{d}/model.py:nope"], "has no attribute 'nope'"),
        (
            ["--step", "{d}/model.py:make_runner", "--backend", "full"],
            "--backend configures a step timed with --inputs",
        ),
        (["--step", "{d}/model.py:step"], "takes (x, ids): a step needs example inputs, --inputs NAME"),
        (["--step", "{d}/missing.py:make"], "does not exist"),
        (["--batches", "1,2"], "--inputs, --batches and --backend go with --step TARGET"),
    ],
)
def test_cli_usage_errors_are_one_line_exit_2(tmp_path, capsys, argv, message):
    (tmp_path / "model.py").write_text(MODEL)
    assert main(["bench"] + [a.format(d=tmp_path) for a in argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("graphrunner: error: ") and message in err and err.count("\n") == 1, err
