"""Capture-unsafe operations raise CaptureUnsafeOpError naming op, file and line;
capture-safe look-alikes do not, and replay them like eager."""

import inspect
import re

import pytest
import torch
import torch.nn.functional as F

from graphrunner.errors import CaptureUnsafeOpError
from graphrunner.tape import TapeGraph, is_tape_capturing, tape_graph

X = torch.tensor([1.0, -2.0, 3.0, 0.0])
M = X > 0

# name -> (code, phrase the friendly description must contain, the op reported).
# The op is a dict where inference_mode and no_grad reach the tape differently
# (a composite op arrives whole under inference_mode, decomposed under no_grad).
_NONZERO = "aten.nonzero.default"
UNSAFE = {
    "item": (lambda: X.sum().item(), "Tensor.item()", "TensorBase.item"),
    "float": (lambda: float(X[0]), "float(t)", "TensorBase.__float__"),
    "int": (lambda: int(X[0]), "int(t)", "TensorBase.__int__"),
    "bool": (lambda: bool(X[0] > 0), "bool(t)", "TensorBase.__bool__"),
    "if_tensor": (lambda: 1 if X[0] > 0 else 0, "`if t:`", "TensorBase.__bool__"),
    "tolist": (lambda: X.tolist(), "Tensor.tolist()", "TensorBase.tolist"),
    "cpu": (lambda: X.cpu(), "Tensor.cpu()", "TensorBase.cpu"),
    "numpy": (lambda: X.numpy(), "Tensor.numpy()", "TensorBase.numpy"),
    "print": (lambda: print(X), "printing / repr()", "Tensor.__repr__"),
    "fstring": (lambda: f"{X}", "formatting a tensor", "Tensor.__format__"),
    "nonzero": (lambda: torch.nonzero(X), "torch.nonzero", _NONZERO),
    "where1": (
        lambda: torch.where(M),
        "1-argument torch.where",
        {"inference_mode": "aten.where.default", "no_grad": _NONZERO},
    ),
    "argwhere": (
        lambda: torch.argwhere(X),
        {"inference_mode": "torch.argwhere", "no_grad": "torch.nonzero"},
        {"inference_mode": "aten.argwhere.default", "no_grad": _NONZERO},
    ),
    "mask_index": (lambda: X[M], "boolean-mask indexing", "aten.index.Tensor"),
    "uint8_mask_index": (lambda: X[M.to(torch.uint8)], "boolean-mask indexing", "aten.index.Tensor"),
    # a tensor of values: ATen gathers the mask's positions (nonzero); a scalar is masked_fill (safe, below)
    "mask_assign": (
        lambda: X.clone().__setitem__(M, torch.ones(2)),
        "boolean-mask assignment",
        "aten.index_put_.default",
    ),
    "masked_select": (lambda: torch.masked_select(X, M), "torch.masked_select", "aten.masked_select.default"),
    "unique": (lambda: torch.unique(X), "torch.unique (", "aten._unique2.default"),
    "unique_dim": (lambda: torch.unique(X, dim=0), "torch.unique", "aten.unique_dim.default"),
    "unique_consecutive": (
        lambda: torch.unique_consecutive(X),
        "torch.unique_consecutive",
        "aten.unique_consecutive.default",
    ),
    "repeat_interleave": (
        lambda: torch.repeat_interleave(X, torch.tensor([1, 2, 1, 1])),
        "torch.repeat_interleave with tensor repeats",
        {"inference_mode": "aten.repeat_interleave.self_Tensor", "no_grad": "aten.repeat_interleave.Tensor"},
    ),
    "bincount": (lambda: torch.bincount(torch.tensor([0, 1, 1])), "torch.bincount", "aten.bincount.default"),
    "equal": (lambda: torch.equal(X, X), "torch.equal", "aten.equal.default"),
    "method_equal": (lambda: X.equal(X), "Tensor.equal", "TensorBase.equal"),
    "allclose": (lambda: torch.allclose(X, X), "torch.allclose", "aten.allclose.default"),
    "one_hot": (lambda: F.one_hot(torch.tensor([0, 2])), "F.one_hot without num_classes", "one_hot"),
    "one_hot_minus1": (
        lambda: F.one_hot(torch.tensor([0, 2]), num_classes=-1),
        "F.one_hot without num_classes",
        "one_hot",
    ),
}

# The message: "capture-unsafe operation during tape capture: <what> [op: <op>] at <file>:<line> ...: `<source>`".
# Matching the two fields (not the whole message) keeps the quoted source line
# (which names the op too) from satisfying the assertions.
_FIELDS = re.compile(r"capture: (.*?) \[op: ([^\]]+)\]")


def _reported(exc):
    m = _FIELDS.search(str(exc))
    assert m, str(exc)
    return m.group(1), m.group(2)


def _per_ctx(v, ctx):
    return v[ctx.__name__] if isinstance(v, dict) else v


@pytest.mark.filterwarnings("ignore:indexing with dtype torch.uint8 is now deprecated:UserWarning")
@pytest.mark.parametrize("name", sorted(UNSAFE))
@pytest.mark.parametrize("ctx", [torch.inference_mode, torch.no_grad])
def test_unsafe_op_raises_naming_op_description_location_and_hint(name, ctx):
    fn, phrase, op = UNSAFE[name]
    phrase, op = _per_ctx(phrase, ctx), _per_ctx(op, ctx)
    line = inspect.getsourcelines(fn)[1]
    g = TapeGraph()
    with ctx(), pytest.raises(CaptureUnsafeOpError) as ei:
        with tape_graph(g):
            fn()
    what, got_op = _reported(ei.value)
    assert got_op == op, str(ei.value)
    assert phrase in what, what
    msg = str(ei.value)
    assert f"test_tape_unsafe.py:{line}" in msg
    assert "@no_graph" in msg
    assert not is_tape_capturing() and g.num_ops == 0
    fn()  # negative control: the same code runs eagerly outside capture


def test_negative_control_generic_description_fails_the_field_check(monkeypatch):
    # Without its friendly name, torch.unique is reported by its aten name.
    # The quoted source line still says "torch.unique", so a match on the whole
    # message would pass; the field check of the test above does not.
    from graphrunner.tape import unsafe

    monkeypatch.delitem(unsafe._FRIENDLY, "_unique2", raising=False)
    g = TapeGraph()
    with torch.inference_mode(), pytest.raises(CaptureUnsafeOpError) as ei:
        with tape_graph(g):
            torch.unique(X)
    what, op = _reported(ei.value)
    assert "`torch.unique(X)`" in str(ei.value)
    assert op == "aten._unique2.default"
    assert "torch.unique (" not in what, what


def test_no_false_alarm_on_long_index_indexing_and_static_ops():
    x = torch.randn(6, 3)
    idx = torch.tensor([4, 0, 2])
    with torch.inference_mode():
        g = TapeGraph()
        with tape_graph(g):
            a = x[idx]
            b = x.index_select(0, idx)
            c = torch.where(x > 0, x, torch.zeros_like(x))  # 3-arg where is static
            x2 = x.clone()
            x2[idx] = 1.0  # long-index assignment
            # Deliberately declared safe: for a CPU tensor, .to("cpu") is a no-op
            # (no device-to-host copy, no sync), so the tape records nothing
            # unsafe. TAPE-NOTES calls .to(<device>) ambiguous: on a CUDA tensor
            # the same call would be a host copy; only the CPU->CPU case is tested.
            d = x.to("cpu") + 0
        for _ in range(2):
            x.copy_(torch.randn(6, 3))
            idx.copy_(torch.randperm(6)[:3])
            g.replay()
            x2e = x.clone()
            x2e[idx] = 1.0
            assert torch.equal(a, x[idx]) and torch.equal(b, x.index_select(0, idx))
            assert torch.equal(c, torch.where(x > 0, x, torch.zeros_like(x)))
            assert torch.equal(x2, x2e) and torch.equal(d, x)


def _capture_and_check(ctx, build, inputs_refill, eager):
    """Capture ``build()`` (must not raise), then refill the inputs, replay and
    compare every output with ``eager()`` twice; the refill makes a no-op
    replay fail."""
    with ctx():
        g = TapeGraph()
        with tape_graph(g):
            outs = build()
        for seed in range(2):
            inputs_refill(seed)
            stale = [o.clone() for o in outs]
            g.replay()
            ref = eager()
            for i, (o, r) in enumerate(zip(outs, ref)):
                assert o.dtype == r.dtype and torch.equal(o, r), i
            assert any(not torch.equal(s, r) for s, r in zip(stale, ref))  # the refill changed the answer


@pytest.mark.parametrize("ctx", [torch.inference_mode, torch.no_grad])
def test_repeat_interleave_with_int_repeats_is_safe(ctx):
    x = torch.randn(4)

    def refill(seed):
        x.copy_(torch.randn(4, generator=torch.Generator().manual_seed(seed)))

    _capture_and_check(
        ctx,
        lambda: [torch.repeat_interleave(x, 2), x.repeat_interleave(3)],
        refill,
        lambda: [torch.repeat_interleave(x, 2), x.repeat_interleave(3)],
    )


@pytest.mark.parametrize("ctx", [torch.inference_mode, torch.no_grad])
def test_mask_assign_of_a_scalar_is_safe_and_replays_the_new_mask(ctx):
    # x[mask] = 0 is ATen's masked_fill_ (CUDA stream capture holds it: the scalar stays on the host); DTensor's
    # vocab-parallel embedding does it at every step (transformers' tensor parallelism)
    x = torch.randn(6)
    m = torch.zeros(6, dtype=torch.bool)

    def refill(seed):
        g = torch.Generator().manual_seed(seed)
        x.copy_(torch.randn(6, generator=g))
        m.copy_(torch.rand(6, generator=g) > 0.5)

    def build():
        y = x.clone()
        y[m] = 0
        z = x.clone().view(2, 3)
        z[m[:2]] = -1.0  # a mask on the leading dim: whole rows
        return [y, z]

    _capture_and_check(ctx, build, refill, build)


@pytest.mark.parametrize("ctx", [torch.inference_mode, torch.no_grad])
def test_repeat_interleave_with_output_size_is_safe(ctx):
    x = torch.randn(4)
    rep = torch.tensor([1, 2, 1, 1])

    def refill(seed):
        x.copy_(torch.randn(4, generator=torch.Generator().manual_seed(seed)))
        rep.copy_(torch.tensor([[2, 1, 0, 2], [0, 0, 4, 1]][seed]))  # same total: output_size holds

    build = lambda: [torch.repeat_interleave(x, rep, output_size=5)]  # noqa: E731
    _capture_and_check(ctx, build, refill, build)


@pytest.mark.parametrize("ctx", [torch.inference_mode, torch.no_grad])
def test_copies_of_externals_are_replayed_not_hoisted(ctx):
    # Views of externals may be hoisted out of the replay (they alias the
    # external's storage); these are copies, which must be recomputed each replay.
    x = torch.randn(3, 4)

    def build():
        xt = x.t()  # a view: hoisting is fine
        a = xt.reshape(-1) * 1  # reshape of a non-contiguous view: a copy
        b = xt.flatten()  # likewise a copy
        c = x.to(torch.float64)  # dtype conversion: a copy
        return [a, b, c]

    def refill(seed):
        x.copy_(torch.randn(3, 4, generator=torch.Generator().manual_seed(seed)))

    _capture_and_check(ctx, build, refill, build)


@pytest.mark.parametrize("ctx", [torch.inference_mode, torch.no_grad])
def test_one_hot_with_num_classes_is_safe(ctx):
    """As on CUDA, F.one_hot with num_classes >= 1 reads nothing on the host."""
    idx = torch.tensor([[0, 2], [1, 3]])
    empty = torch.zeros(0, dtype=torch.long)

    def refill(seed):
        idx.copy_(torch.tensor([[[3, 3], [0, 1]], [[2, 0], [0, 0]]][seed]))

    build = lambda: [F.one_hot(idx, 4), F.one_hot(idx, num_classes=5) * 2, F.one_hot(empty, 3)]  # noqa: E731
    _capture_and_check(ctx, build, refill, build)


def test_one_hot_out_of_range_class_still_fails_at_capture():
    """Negative control: skipping the host check does not hide a bad class
    (eager raises too; on CUDA the scatter's device assert fires)."""
    bad = torch.tensor([0, 4])
    with pytest.raises(RuntimeError):
        F.one_hot(bad, 4)
    with pytest.raises(RuntimeError, match="out of bounds"):
        with torch.inference_mode(), tape_graph(TapeGraph()):
            F.one_hot(bad, 4)
    assert not is_tape_capturing()
