"""``GRAPHRUNNER_DISABLE=1``: every runner serves eagerly through the same runner (no graph is made),
and its report, trace and ``info`` say so. Negative controls: without the variable (or with ``0``) the
same runner captures graphs and replays one (a frozen Python value shows it), and a bad value is an error."""

from __future__ import annotations

import pytest
import torch

import graphrunner as gr
from graphrunner.backends import EnvDisabledBackend, graphs_disabled
from graphrunner.devices import TapeDevice
from graphrunner_tools.cli import main

W = torch.randn(4, 4, generator=torch.Generator().manual_seed(0))


class CountingTape(TapeDevice):
    """A tape device that counts the graphs it makes."""

    def __init__(self):
        super().__init__()
        self.graphs = 0

    def new_graph(self):
        self.graphs += 1
        return super().new_graph()


class Scaled:
    """A step that reads Python state changing between calls: eager PyTorch multiplies by the
    current call count, a graph freezes the count of its capture."""

    def __init__(self):
        self.calls = 0

    def step(self, x):
        self.calls += 1
        return torch.relu(x @ W) * self.calls

    @gr.no_graph
    def host(self, h):
        return h + 1

    def step_with_break(self, x):
        return self.host(torch.relu(x @ W)) * 2


def _runner(step, backend="breakable", trace=None):
    device = CountingTape()
    runner = gr.GraphRunner(
        step,
        {"x": gr.BatchInput(trailing=(4,))},
        buckets=[2, 4],
        backend=backend,
        device=device,
        trace=trace,
        checks=(),
        progress=False,
    )
    return runner, device


@pytest.mark.parametrize("backend", ["breakable", "full"])
def test_disabled_runner_makes_no_graph_and_matches_eager_every_call(monkeypatch, backend):
    monkeypatch.setenv("GRAPHRUNNER_DISABLE", "1")
    model = Scaled()
    trace = gr.Trace()
    runner, device = _runner(model.step, backend, trace)
    assert isinstance(runner.backend, EnvDisabledBackend) and runner.backend.requested == backend
    report = runner.capture()
    assert device.graphs == 0  # capture made no graph
    assert all(b.num_segments == 0 for b in report.buckets)
    assert f"graphs disabled by GRAPHRUNNER_DISABLE=1; {backend} requested" in report.backend
    assert "GRAPHRUNNER_DISABLE=1" in report.table().splitlines()[0]
    assert runner.backend.info(4)["graphs_disabled"] == "GRAPHRUNNER_DISABLE=1"
    assert runner.backend.info(4)["requested_backend"] == backend
    named = [e.backend for e in trace.events if e.backend is not None]
    assert named and all("graphs disabled by GRAPHRUNNER_DISABLE=1" in b for b in named)
    for n in (1, 2, 3, 4):
        x = torch.randn(n, 4)
        got = runner(x=x).clone()
        expected = torch.relu(x @ W) * model.calls  # eager, with the count of this very call
        assert torch.equal(got, expected)
    assert runner.stats.fallbacks == 0 and sum(runner.stats.replays.values()) == 4  # served through the runner
    runner.cleanup()


def test_negative_control_without_the_variable_a_graph_is_replayed(monkeypatch):
    for value in (None, "0", "off"):
        if value is None:
            monkeypatch.delenv("GRAPHRUNNER_DISABLE", raising=False)
        else:
            monkeypatch.setenv("GRAPHRUNNER_DISABLE", value)
        model = Scaled()
        runner, device = _runner(model.step)
        assert not isinstance(runner.backend, EnvDisabledBackend)
        runner.capture()
        assert device.graphs > 0
        frozen = model.calls  # the capture's count, frozen in the graph
        x = torch.randn(2, 4)
        got = runner(x=x)
        assert model.calls == frozen  # the step did not run: the graph replayed
        assert torch.equal(got, torch.relu(x @ W) * frozen)
        assert not torch.equal(got, torch.relu(x @ W) * (frozen + 1))  # what eager would give now
        runner.cleanup()


def test_a_backend_instance_is_disabled_too_and_keeps_its_configuration(monkeypatch):
    monkeypatch.setenv("GRAPHRUNNER_DISABLE", "true")
    model = Scaled()
    device = CountingTape()
    backend = gr.backends.BreakableGraphBackend(device=device, warmups=3, drift_check=False)
    runner = gr.GraphRunner(
        model.step_with_break,
        {"x": gr.BatchInput(trailing=(4,))},
        buckets=[2],
        backend=backend,
        checks=(),
        progress=False,
    )
    assert isinstance(runner.backend, EnvDisabledBackend) and runner.backend.requested == "BreakableGraphBackend"
    assert runner.backend.device is device and runner.backend.warmups == 3
    runner.capture()
    assert device.graphs == 0
    x = torch.randn(2, 4)
    assert torch.equal(runner(x=x), (torch.relu(x @ W) + 1) * 2)


def test_bad_values_are_errors_naming_the_variable(monkeypatch):
    monkeypatch.setenv("GRAPHRUNNER_DISABLE", "maybe")
    with pytest.raises(ValueError, match=r"GRAPHRUNNER_DISABLE='maybe' is not understood: set it to 1"):
        graphs_disabled()
    with pytest.raises(ValueError, match="GRAPHRUNNER_DISABLE"):
        _runner(Scaled().step)
    monkeypatch.setenv("GRAPHRUNNER_DISABLE", "1")
    with pytest.raises(ValueError, match="unknown backend 'nope'"):  # the name is still checked
        _runner(Scaled().step, "nope")


def test_check_refuses_to_call_a_disabled_runner_clean(monkeypatch, tmp_path, capsys):
    path = tmp_path / "model.py"
    path.write_text(
        "import graphrunner as gr\n\ndef make():\n    return gr.GraphRunner(lambda x: x * 2, "
        "{'x': gr.BatchInput(trailing=(4,))}, buckets=[2], progress=False)\n"
    )
    monkeypatch.setenv("GRAPHRUNNER_DISABLE", "1")
    assert main(["check", f"{path}:make"]) == 2
    err = capsys.readouterr().err
    assert "GRAPHRUNNER_DISABLE=1 is set" in err and err.count("\n") == 1
    monkeypatch.delenv("GRAPHRUNNER_DISABLE")
    assert main(["check", f"{path}:make"]) == 0  # negative control
