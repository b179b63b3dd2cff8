"""Capture-unsafe operations raise CaptureUnsafeOpError naming op, file and line."""

import inspect

import pytest
import torch

from graphrunner.errors import CaptureUnsafeOpError
from graphrunner.tape import TapeGraph, is_tape_capturing, tape_graph

X = torch.tensor([1.0, -2.0, 3.0, 0.0])
M = X > 0

UNSAFE = {
    "item": lambda: X.sum().item(),
    "float": lambda: float(X[0]),
    "int": lambda: int(X[0]),
    "bool": lambda: bool(X[0] > 0),
    "if_tensor": lambda: 1 if X[0] > 0 else 0,
    "tolist": lambda: X.tolist(),
    "cpu": lambda: X.cpu(),
    "numpy": lambda: X.numpy(),
    "print": lambda: print(X),
    "fstring": lambda: f"{X}",
    "nonzero": lambda: torch.nonzero(X),
    "where1": lambda: torch.where(M),
    "mask_index": lambda: X[M],
    "mask_assign": lambda: X.clone().__setitem__(M, 0.0),
    "masked_select": lambda: torch.masked_select(X, M),
    "unique": lambda: torch.unique(X),
    "repeat_interleave": lambda: torch.repeat_interleave(X, torch.tensor([1, 2, 1, 1])),
    "bincount": lambda: torch.bincount(torch.tensor([0, 1, 1])),
    "equal": lambda: torch.equal(X, X),
    "allclose": lambda: torch.allclose(X, X),
}


@pytest.mark.parametrize("name", sorted(UNSAFE))
@pytest.mark.parametrize("ctx", [torch.inference_mode, torch.no_grad])
def test_unsafe_op_raises_with_location_and_hint(name, ctx):
    fn = UNSAFE[name]
    line = inspect.getsourcelines(fn)[1]
    g = TapeGraph()
    with ctx(), pytest.raises(CaptureUnsafeOpError) as ei:
        with tape_graph(g):
            fn()
    msg = str(ei.value)
    assert f"test_tape_unsafe.py:{line}" in msg
    assert "@no_graph" in msg and "[op:" in msg
    assert not is_tape_capturing() and g.num_ops == 0
    fn()  # negative control: the same code runs eagerly outside capture


def test_message_names_the_op():
    g = TapeGraph()
    with torch.inference_mode(), pytest.raises(CaptureUnsafeOpError, match="nonzero"):
        with tape_graph(g):
            torch.nonzero(X)
    with torch.inference_mode(), pytest.raises(CaptureUnsafeOpError, match="tolist"):
        with tape_graph(g):
            X.tolist()


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
