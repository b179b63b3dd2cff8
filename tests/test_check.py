"""`graphrunner check FILE_OR_MODULE:FACTORY`: every capture-safety finding in one pass, located, with a fix.

Targets are written to tmp_path from the sources below; expected lines come
from marker comments in those sources, not from a run. Negative controls: a
plain tape capture of the same runner reports only the first unsafe op; a
counter drift replays wrong silently when the capture-time drift check is
off, while the lint still names its line.
"""

import json
import re
import textwrap

import pytest
import torch
from extras_util import require

import graphrunner as gr
from graphrunner.checks.lint import CheckUsageError, check_factory
from graphrunner.errors import CaptureError, CaptureUnsafeOpError
from graphrunner_tools.cli import main
from graphrunner_tools.targets import load_factory

pytestmark = pytest.mark.usefixtures("one_torch_thread")

THREE = textwrap.dedent("""
    import torch
    import graphrunner as gr

    W = torch.randn(8, 8, generator=torch.Generator().manual_seed(0))


    def helper(x):
        return x.sum().item()  # unsafe-1


    def step(x):
        h = x @ W
        s = helper(h)
        m = h[h > 0]  # unsafe-2
        n = int(h.max())  # unsafe-3
        return h * 2


    def make():
        return gr.GraphRunner(step, {"x": gr.BatchInput(trailing=(8,))}, buckets=[1, 2], progress=False)
""")

CLEAN = textwrap.dedent("""
    import torch
    import graphrunner as gr

    W = torch.randn(8, 8, generator=torch.Generator().manual_seed(0))


    @gr.no_graph
    def host_side(h):
        return h * float(h.abs().max().item())  # inside an eager break: fine on the breakable backend


    def step(x):
        return host_side(torch.relu(x @ W)) + 1


    def make(backend="breakable"):
        return gr.GraphRunner(step, {"x": gr.BatchInput(trailing=(8,))}, buckets=[1, 2], backend=backend,
                              progress=False)


    def make_full():
        return make("full")


    def not_a_runner():
        return 42
""")

COUNTER = textwrap.dedent("""
    import torch
    import graphrunner as gr


    class Counter:
        def __init__(self):
            self.calls = 0

        def step(self, x):
            self.calls += 1
            return x * self.calls  # drift


    def make(drift_check=None):
        return gr.GraphRunner(Counter().step, {"x": gr.BatchInput(trailing=(4,))}, buckets=[2], backend="full",
                              progress=False,
                              checks=None if drift_check is None else ("padding", "fingerprint"))
""")


COUNTED_LEAK = textwrap.dedent("""
    import torch
    import graphrunner as gr


    class Step:
        calls = 0  # COUNTER_WHERE

        def __call__(self, x):
            COUNTER_CODE
            return (x - x.mean(0)) * self.calls  # a leak across rows, and drift


    def make():
        return gr.GraphRunner(Step(), {"x": gr.BatchInput(trailing=(4,))}, buckets=[1, 2, 4], device="tape",
                              progress=False)
""")


def _line(source: str, marker: str) -> int:
    return next(i for i, text in enumerate(source.splitlines(), 1) if f"# {marker}" in text)


@pytest.fixture
def target(tmp_path):
    def write(source: str, name: str) -> str:
        path = tmp_path / f"{name}.py"
        path.write_text(source)
        return str(path)

    return write


def test_three_unsafe_ops_are_three_findings_at_their_lines(target, capsys):
    path = target(THREE, "three")
    report = check_factory(load_factory(f"{path}:make"))
    unsafe = [f for f in report.findings if f.kind == "unsafe-op"]
    assert [(f.file, f.line) for f in unsafe] == [(path, _line(THREE, f"unsafe-{i}")) for i in (1, 2, 3)]
    assert [f.function for f in unsafe] == ["helper", "step", "step"]
    assert "Tensor.item()" in unsafe[0].what and "boolean-mask" in unsafe[1].what and "int(t)" in unsafe[2].what
    assert unsafe[0].fix.startswith("@no_graph the enclosing function helper")
    assert "step function itself" in unsafe[1].fix and not unsafe[1].in_library
    assert len(report.findings) == 3  # the tape capture's error is the first of these: not repeated

    assert main(["check", f"{path}:make"]) == 1
    out = capsys.readouterr().out
    assert out.count("unsafe-op") == 3 and "3 findings" in out
    assert main(["check", f"{path}:make", "--json"]) == 1
    data = json.loads(capsys.readouterr().out)
    assert data["ok"] is False and [f["line"] for f in data["findings"]] == [f.line for f in unsafe]


def test_negative_control_plain_capture_reports_only_the_first(target):
    path = target(THREE, "three")
    runner = load_factory(f"{path}:make")()
    with pytest.raises(CaptureError) as info:
        runner.capture()
    assert isinstance(info.value.__cause__, CaptureUnsafeOpError)
    msg = str(info.value)
    assert f":{_line(THREE, 'unsafe-1')} in helper" in msg
    assert f":{_line(THREE, 'unsafe-2')}" not in msg and f":{_line(THREE, 'unsafe-3')}" not in msg


def test_clean_factory_exits_0(target, capsys):
    path = target(CLEAN, "clean")
    assert main(["check", f"{path}:make"]) == 0
    assert "no findings" in capsys.readouterr().out
    # the same step captures and replays as eager PyTorch
    runner = load_factory(f"{path}:make")()
    runner.capture()
    x = torch.randn(2, 8)
    mod = runner.step.__globals__
    assert torch.equal(runner(x=x), mod["step"](x))


def test_unsafe_op_in_no_graph_body_is_a_finding_on_the_full_backend(target):
    # a full graph does not break at @no_graph: the .item() inside is captured
    path = target(CLEAN, "clean")
    report = check_factory(load_factory(f"{path}:make_full"))
    assert [(f.kind, f.function) for f in report.findings] == [("unsafe-op", "host_side")]
    assert "backend='breakable'" in report.findings[0].fix


def test_python_counter_drift_is_located(target):
    path = target(COUNTER, "counter")
    report = check_factory(load_factory(f"{path}:make"))
    assert [(f.kind, f.line, f.function) for f in report.findings] == [("drift", _line(COUNTER, "drift"), "step")]
    # 3, or 4 when the padding-leak check's extra forward ran between the last warmup and the capture
    assert re.search(r"was 2 at warmup 2 and [34] at capture", report.findings[0].what), report.findings[0].what
    # the lint reports it even with the capture-time check off ...
    report = check_factory(load_factory(f"{path}:make"), "off")
    assert [f.kind for f in report.findings] == ["drift"]
    # ... where a capture replays the frozen multiplier silently (negative control)
    runner = load_factory(f"{path}:make")(drift_check=False)
    runner.capture()
    x = torch.ones(2, 4)
    frozen = runner.step.__self__.calls  # the capture's call (after the warmups and the leak check's forward)
    assert frozen >= 3
    assert torch.equal(runner(x=x), x * frozen)  # eager would multiply by frozen + 1 now: the graph froze it
    assert runner.step.__self__.calls == frozen


@pytest.mark.parametrize(
    "argv, message",
    [
        (["check", "no_colon"], "expected FILE_OR_MODULE:FACTORY"),
        (["check", "/nonexistent/model.py:make"], "does not exist"),
        (["check", "graphrunner_no_such_module:make"], "cannot import module"),
    ],
)
def test_usage_errors_are_one_line_exit_2(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("graphrunner: error: ") and message in err and err.count("\n") == 1


def test_factory_errors_are_usage_errors(target, capsys):
    path = target(CLEAN, "clean")
    assert main(["check", f"{path}:missing"]) == 2
    assert "has no attribute 'missing'" in capsys.readouterr().err
    assert main(["check", f"{path}:not_a_runner"]) == 2
    assert "returned int" in capsys.readouterr().err
    with pytest.raises(CheckUsageError, match="captured GraphRunner"):
        runner = load_factory(f"{path}:make")()
        runner.capture()
        check_factory(lambda: runner)


def test_a_factory_result_without_the_runner_surface_is_not_a_runner(target):
    """The lint knows a runner by its public surface, not its class (it sits below the runner)."""
    for bad in (None, torch.nn.Linear(2, 2), gr.GraphRunner):
        with pytest.raises(CheckUsageError, match="must return an uncaptured graphrunner.GraphRunner"):
            check_factory(lambda: bad)  # noqa: B023 - called in this iteration, before the variable moves on
    assert check_factory(load_factory(f"{target(CLEAN, 'clean')}:make")).ok  # negative control: a runner is one


OPT = textwrap.dedent("""
    import torch
    import transformers
    import graphrunner as gr
    from graphrunner.hf.cache import make_static_cache
    from graphrunner.hf.steps import decode_inputs, make_decode_step


    def make():
        cfg = transformers.OPTConfig(vocab_size=128, hidden_size=64, ffn_dim=128, num_hidden_layers=2,
                                     num_attention_heads=4, max_position_embeddings=64, word_embed_proj_dim=64)
        torch.manual_seed(0)
        model = transformers.OPTForCausalLM(cfg).eval()
        cache = make_static_cache(model, 2, 16)
        return gr.GraphRunner(make_decode_step(model, cache), decode_inputs(), buckets=[2],
                              backend="full", progress=False)
""")


@pytest.mark.hf
def test_opt_cache_length_read_inside_transformers_says_make_it_an_input(target):
    require("transformers")
    path = target(OPT, "opt_target")
    report = check_factory(load_factory(f"{path}:make"))
    unsafe = [f for f in report.findings if f.kind == "unsafe-op"]
    assert len(unsafe) == 1
    f = unsafe[0]
    assert f.in_library and f.file.endswith("transformers/models/opt/modeling_opt.py")
    assert f.fix.startswith("make it an input") and "transformers" in f.fix and "@no_graph the" not in f.fix
    # independent reference: the tape capture stops at the same library line
    runner = load_factory(f"{path}:make")()
    with pytest.raises(CaptureError) as info:
        runner.capture()
    assert isinstance(info.value.__cause__, CaptureUnsafeOpError)
    assert f"modeling_opt.py:{f.line} in forward" in str(info.value)
    # and the cache length it reads grows between calls: a drift at a library line, same advice
    drift = [f for f in report.findings if f.kind == "drift"]
    assert drift and drift[0].in_library and drift[0].fix.startswith("make it an input")


@pytest.mark.parametrize("backend, attention", [("breakable", "varlen"), ("full", "masked")])
def test_demo_decoder_has_no_findings(backend, attention):
    # no false alarm on a real decoder: its varlen attention reads lengths on the host inside an eager break
    from graphrunner_tools.models import LlamaConfig, build_model

    def make():
        config = LlamaConfig.demo(num_layers=2, attention=attention, max_batch_size=8)
        model = build_model(config, seed=0, device=torch.device("cpu"))
        return gr.GraphRunner(
            lambda input_ids, positions: model.decode_step(input_ids, positions),
            inputs={"input_ids": gr.BatchInput(dtype=torch.long), "positions": gr.BatchInput(dtype=torch.long)},
            buckets=[1, 4],
            backend=backend,
            progress=False,
        )

    report = check_factory(make)
    assert report.ok, report.table()
    if backend == "breakable":  # negative control: the same decoder on a full graph has unsafe ops

        def make_full():
            runner = make()
            return gr.GraphRunner(runner.step, runner.inputs, buckets=[1, 4], backend="full", progress=False)

        assert any(f.kind == "unsafe-op" for f in check_factory(make_full).findings)


def test_factory_is_called_once_and_a_padding_leak_is_a_finding(target):
    """check builds the runner once (a factory that loads a model is not paid twice) and collects what
    the capture hooks find: here the padding check, in collect mode, and still every unsafe op."""
    path = target(THREE, "three_once")
    calls = []
    make = load_factory(f"{path}:make")

    def counting():
        calls.append(1)
        return make()

    report = check_factory(counting)
    assert len(calls) == 1
    assert [f.kind for f in report.findings] == ["unsafe-op"] * 3

    def leaky():
        calls.append(1)
        return gr.GraphRunner(
            lambda x: x - x.mean(0, keepdim=True),
            {"x": gr.BatchInput(trailing=(4,))},
            buckets=[2, 4],
            device="tape",
            progress=False,
        )

    calls.clear()
    report = check_factory(leaky)
    assert len(calls) == 1
    assert [(f.kind, f.bucket) for f in report.findings] == [("padding-leak", 4), ("padding-leak", 2)]
    # independent reference: the plain capture raises the same leak for the largest key
    with pytest.raises(gr.PaddingLeakError, match="bucket 4"):
        leaky().capture()


def test_step_writing_its_input_is_a_finding():
    def accumulate(state, delta):
        state.add_(delta)
        return state * 2

    def make():
        return gr.GraphRunner(
            accumulate,
            {"state": gr.BatchInput(trailing=(4,)), "delta": gr.BatchInput(trailing=(4,))},
            buckets=[2, 4],
            device="tape",
            progress=False,
        )

    report = check_factory(make)
    kinds = [f.kind for f in report.findings]
    assert (
        "input-write" in kinds and "writes into its input 'state'" in report.findings[kinds.index("input-write")].what
    )
    with pytest.raises(gr.CaptureError, match="writes into its input 'state'"):  # the plain capture refuses it too
        make().capture()


# ------------------------------------------------------------ @no_graph functions that return Python values
TRAP = textwrap.dedent("""
    import torch
    import graphrunner as gr


    def inline(x, lens):
        n = lens.max().item()  # item-in-step
        return x * n


    @gr.no_graph
    def longest_of(lens):
        return lens.max().item()  # frozen


    def literal(x, lens):  # the .item() advice followed without returning a tensor
        return x * longest_of(lens)


    @gr.no_graph
    def longest(lens):
        return lens.max()


    def fixed(x, lens):  # the advice followed: the break returns a tensor
        return x * longest(lens)


    @gr.no_graph
    def scaled(x, lens):
        return x * longest_of(lens)  # nested: a plain call, its number used inside the outer break


    def consumer_inside(x, lens):
        return scaled(x, lens)


    @gr.no_graph
    def shape_and_scale(lens):
        return lens.max(), [int(v) for v in lens.tolist()]  # frozen-list


    def mixed(x, lens):
        scale, _ = shape_and_scale(lens)
        return x * scale


    INPUTS = {"x": gr.BatchInput(trailing=(4,)), "lens": gr.BatchInput(dtype=torch.long, bounds=(0, 16))}


    def make(step, backend="breakable"):
        return gr.GraphRunner(step, INPUTS, buckets=[2], backend=backend, progress=False)


    def make_inline():
        return make(inline)


    def make_literal():
        return make(literal)


    def make_fixed():
        return make(fixed)


    def make_consumer_inside():
        return make(consumer_inside)


    def make_mixed():
        return make(mixed)


    def make_literal_full():
        return make(literal, "full")


    EXAMPLE = {"x": torch.randn(2, 4, generator=torch.Generator().manual_seed(1)), "lens": torch.tensor([3, 9])}
""")


def test_item_advice_leads_to_a_break_that_returns_a_tensor(target):
    path = target(TRAP, "trap")
    findings = check_factory(load_factory(f"{path}:make_inline")).findings
    # the number also reaches the mul (a drift: the last warmup is the padding check's run A, on real data)
    (f,) = [f for f in findings if f.kind != "drift"]
    assert (f.kind, f.line) == ("unsafe-op", _line(TRAP, "item-in-step"))
    assert "returns tensors" in f.fix and "lens.max(), not lens.max().item()" in f.fix
    assert "keep the code that uses the number inside the break" in f.fix


def test_no_graph_returning_a_number_is_a_frozen_return_finding(target, capsys):
    path = target(TRAP, "trap")
    report = check_factory(load_factory(f"{path}:make_literal"))
    # the frozen number also reaches the mul after the break: a drift between the last warmup (the padding
    # check's run A, on real data) and the capture (on the padding)
    assert [(f.kind, f.file, f.line, f.function) for f in report.findings if f.kind != "drift"] == [
        ("frozen-return", path, _line(TRAP, "frozen"), "longest_of")
    ]
    f = [f for f in report.findings if f.kind != "drift"][0]
    assert "returned 0 at capture" in f.what and "frozen" in f.what
    assert f.fix.startswith("return a tensor") and "keep the consumer inside the break" in f.fix
    assert main(["check", f"{path}:make_literal"]) == 1
    assert "frozen-return" in capsys.readouterr().out
    # independent reference: the same runner, captured for real, raises on the first call whose maximum
    # differs from the capture's (its one key has one real row, which the padding check's follow-up, the
    # last warmup, fills with the pad: the number at the last warmup equals the capture's, so the drift
    # check has no difference to see here: it sees a Python number only when the two runs' data differ)
    runner = load_factory(f"{path}:make_literal")()
    runner.capture()
    x, lens = torch.ones(2, 4), torch.tensor([3, 9])
    with pytest.raises(CaptureError, match=r"longest_of returned 9 at replay where it returned 0 at capture"):
        runner(x=x, lens=lens)


def test_frozen_return_negative_controls_tensor_return_and_consumer_inside(target):
    path = target(TRAP, "trap")
    x, lens = torch.randn(2, 4), torch.tensor([3, 9])
    for name, eager in (("make_fixed", x * 9), ("make_consumer_inside", x * 9)):
        report = check_factory(load_factory(f"{path}:{name}"))
        assert report.ok, report.table()
        runner = load_factory(f"{path}:{name}")()
        runner.capture()
        assert torch.equal(runner(x=x, lens=lens), eager)  # and it replays as eager PyTorch
        assert torch.equal(runner(x=x, lens=torch.tensor([2, 1])), x * 2)


def test_frozen_list_and_full_backend(target):
    path = target(TRAP, "trap")
    (f,) = check_factory(load_factory(f"{path}:make_mixed")).findings
    assert (f.kind, f.line, f.function) == ("frozen-return", _line(TRAP, "frozen-list"), "shape_and_scale")
    assert "[0, 0]" in f.what or "0, 0" in f.what
    # a full graph does not break: the .item() inside is captured, an unsafe op (the capture stops there)
    (f,) = [f for f in check_factory(load_factory(f"{path}:make_literal_full")).findings if f.kind != "drift"]
    assert (f.kind, f.line) == ("unsafe-op", _line(TRAP, "frozen")) and "backend='breakable'" in f.fix


# ------------------------------------------------------------ what check accepts
def test_a_step_without_inputs_says_what_check_expects(target, capsys):
    path = target(TRAP, "trap")
    assert main(["check", f"{path}:literal"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("graphrunner: error: ")
    assert "takes 2 required arguments (x, lens): that is a step, not a factory; pass --inputs NAME" in err
    with pytest.raises(CheckUsageError, match="that is a step"):
        check_factory(load_factory(f"{path}:literal"))


def test_a_step_with_example_inputs_is_checked(target, capsys):
    path = target(TRAP, "trap")
    assert main(["check", f"{path}:literal", "--inputs", "EXAMPLE"]) == 1
    assert "frozen-return" in capsys.readouterr().out
    assert main(["check", f"{path}:fixed", "--inputs", f"{path}:EXAMPLE", "--buckets", "1,2,4"]) == 0
    out = capsys.readouterr().out
    assert "buckets [1, 2, 4]" in out and "no findings" in out
    # the runner it checks is the step's: captured, it replays the examples as eager PyTorch
    from graphrunner_tools.targets import runner_from_examples

    module = load_factory(f"{path}:fixed").__globals__
    runner = runner_from_examples(module["fixed"], module["EXAMPLE"])
    assert runner.buckets == [2] and runner.inputs["lens"].bounds == (3, 9) and runner.inputs["x"].trailing == (4,)
    runner.capture()
    ex = module["EXAMPLE"]
    assert torch.equal(runner(**ex), ex["x"] * 9)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["{path}:make_fixed", "--inputs", "EXAMPLE"], "the step takes no arguments"),
        (["{path}:literal", "--inputs", "NOPE"], "argument --inputs: "),
        (["{path}:make_fixed", "--buckets", "1,2"], "--buckets and --backend configure a step"),
        (["{path}:INPUTS"], "is dict, not callable"),
    ],
)
def test_step_mode_usage_errors(target, capsys, argv, message):
    path = target(TRAP + "\nBAD = {'x': torch.zeros(2, 4)}\n", "trap")
    assert main(["check"] + [a.format(path=path) for a in argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err, err


def test_example_names_must_match_the_step(target, capsys):
    path = target(TRAP + "\nBAD = {'x': torch.zeros(2, 4)}\n", "trap")
    assert main(["check", f"{path}:literal", "--inputs", "BAD"]) == 2
    err = capsys.readouterr().err
    assert "missing ['lens']" in err and err.count("\n") == 1


EXITS = textwrap.dedent("""
    import sys
    import torch
    import graphrunner as gr


    def exits():
        raise SystemExit(0)


    def quits():
        sys.exit(3)


    def step_exits(x):
        sys.exit(0)


    def make_step_exits():
        return gr.GraphRunner(step_exits, {"x": gr.BatchInput(trailing=(4,))}, buckets=[1], progress=False)


    def raises():
        raise RuntimeError("model weights not found")
""")


@pytest.mark.parametrize(
    "name, message",
    [
        ("exits", "exits() called sys.exit(0) instead of returning a runner"),
        ("quits", "quits() called sys.exit(3)"),
        ("make_step_exits", "called sys.exit(0) during its capture"),
        ("raises", "raises() raised RuntimeError: model weights not found"),
    ],
)
def test_a_target_that_exits_or_raises_is_exit_2_not_a_pass(target, capsys, name, message):
    path = target(EXITS, "exits")
    assert main(["check", f"{path}:{name}"]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1 and message in captured.err, captured.err


def test_a_module_that_exits_on_load_is_exit_2(target, capsys):
    path = target("import sys\nsys.exit(0)\n", "script")
    assert main(["check", f"{path}:make"]) == 2
    err = capsys.readouterr().err
    assert "called sys.exit(0)" in err and "if __name__ == '__main__'" in err and err.count("\n") == 1


def test_a_directory_is_named_as_a_directory(tmp_path, monkeypatch, capsys):
    (tmp_path / "pkgdir").mkdir()
    (tmp_path / "pkgdir" / "model.py").write_text(CLEAN)
    monkeypatch.chdir(tmp_path)
    assert main(["check", "pkgdir:make"]) == 2
    err = capsys.readouterr().err
    assert "'pkgdir' is a directory, not a Python file" in err and "does not exist" not in err
    assert main(["check", f"{tmp_path / 'pkgdir'}:make"]) == 2
    assert "is a directory" in capsys.readouterr().err
    # negative control: the file inside it is checked
    assert main(["check", "pkgdir/model.py:make"]) == 0
    assert "no findings" in capsys.readouterr().out


@pytest.mark.parametrize("where", ["class", "instance"])
def test_a_counter_in_a_class_attribute_hides_no_leak(target, where, caplog):
    """Issue 42 item 6: a step counting its calls in a class attribute (``Step.calls += 1``) that also
    leaks across rows (``x - x.mean(0)``): both findings, as with an instance attribute, and no
    "cannot be checked" warning."""
    code = "Step.calls += 1" if where == "class" else "self.calls = self.calls + 1"
    path = target(COUNTED_LEAK.replace("COUNTER_CODE", code), f"counted_{where}")
    with caplog.at_level("WARNING", logger="graphrunner"):
        report = check_factory(load_factory(f"{path}:make"))
    kinds = sorted({f.kind for f in report.findings})
    assert "padding-leak" in kinds and "drift" in kinds, kinds
    assert "cannot be checked" not in caplog.text


def test_negative_control_without_the_classes_the_leak_is_not_checked(target, monkeypatch, caplog):
    from graphrunner.checks import step_objects as padding

    real = padding.PythonNumbers.__init__

    def instances_only(self, step):
        real(self, step)
        self.objects = [o for o in self.objects if not isinstance(o, type)]

    monkeypatch.setattr(padding.PythonNumbers, "__init__", instances_only)
    path = target(COUNTED_LEAK.replace("COUNTER_CODE", "Step.calls += 1"), "counted_control")
    with caplog.at_level("WARNING", logger="graphrunner"):
        report = check_factory(load_factory(f"{path}:make"))
    assert "padding-leak" not in {f.kind for f in report.findings}
    assert "cannot be checked" in caplog.text
