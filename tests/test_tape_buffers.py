"""Replay into preplanned buffers: results written with ``out=`` into memory
allocated once at capture, reused by liveness.

Every test checks replay against eager bit for bit on new input values, over
several replays; the negative control frees a buffer before its last reader
and shows the corruption the liveness rule prevents.
"""

import re

import torch

from graphrunner.tape import TapeGraph, codegen, tape_graph


def _step(x, w):
    a = x * 2  # live across the next three ops
    b = torch.matmul(a, w)  # same shape as a: a free buffer of a's kind would do
    c = b + 1
    d = torch.matmul(c, w) * a  # reads a after b and c were computed
    e = d.view(4, 2, 4).transpose(1, 2)  # a view of a planned buffer
    return torch.tanh(e) + a.sum()


def _capture(x, w):
    with torch.inference_mode():
        g = TapeGraph()
        with tape_graph(g):
            out = _step(x, w)
    return g, out


def _replays_match(g, out, x, w, n=3) -> bool:
    gen = torch.Generator().manual_seed(1)
    ok = True
    for _ in range(n):
        x.copy_(torch.randn(x.shape, generator=gen))
        g.replay()
        with torch.inference_mode():
            ok &= torch.equal(out, _step(x, w))
    return ok


def test_results_go_to_preplanned_buffers_bit_exact():
    x, w = torch.randn(4, 8), torch.randn(8, 8)
    g, out = _capture(x, w)
    assert "out=" in g.source
    # views of planned buffers are constants: no view call at replay
    assert "as_strided" not in "".join(str(v) for k, v in g._env.items() if k.startswith("f"))
    bufs = [v for k, v in g._env.items() if k.startswith("b") and isinstance(v, torch.Tensor)]
    ptrs = [b.data_ptr() for b in bufs]
    assert _replays_match(g, out, x, w)
    assert [b.data_ptr() for b in bufs] == ptrs  # the same memory at every replay


def test_buffers_are_reused_only_after_the_last_reader():
    x, w = torch.randn(4, 8), torch.randn(8, 8)
    g, out = _capture(x, w)
    # five (4, 8) float results, at most three live at once: buffers are shared
    same_kind = [
        v
        for k, v in g._env.items()
        if k.startswith("b") and isinstance(v, torch.Tensor) and v.shape == (4, 8) and v._base is None
    ]
    assert 1 < len(same_kind) < 5
    assert _replays_match(g, out, x, w)


def test_negative_control_freeing_before_the_last_reader_corrupts(monkeypatch):
    # Free each buffer right after the op that wrote it: `a` is then reused
    # by b or c while `d` still reads it, and replay goes silently wrong.
    monkeypatch.setattr(codegen, "_release_after", lambda i, last_use: i)
    x, w = torch.randn(4, 8), torch.randn(8, 8)
    g, out = _capture(x, w)
    assert not _replays_match(g, out, x, w)


def test_survivor_written_in_place_and_refreshed():
    x, w = torch.randn(4, 8), torch.randn(8, 8)
    with torch.inference_mode():
        g = TapeGraph()
        with tape_graph(g):
            h = torch.matmul(x * 2, w)  # a survivor produced by an out= capable op
            out = h + 1
    src = g.source.split("_replay():", 1)[1]
    # both survivors written directly (by name, or through a view a collapsed matmul writes)
    targets = [g._env[t].data_ptr() for t in re.findall(r"out=(\w+)", src)]
    assert sorted(targets).count(h.data_ptr()) == 1 and targets.count(out.data_ptr()) == 1
    assert ".copy_(" not in src
    gen = torch.Generator().manual_seed(2)
    for _ in range(2):
        x.copy_(torch.randn(x.shape, generator=gen))
        g.replay()
        with torch.inference_mode():
            ref_h = torch.matmul(x * 2, w)
            assert torch.equal(h, ref_h) and torch.equal(out, ref_h + 1)


def test_no_grad_capture_with_parameters():
    lin = torch.nn.Linear(8, 8)
    x = torch.randn(4, 8)
    with torch.no_grad():
        g = TapeGraph()
        with tape_graph(g):
            out = torch.relu(lin(x)) * 3
        x.copy_(torch.randn(4, 8))
        g.replay()
        assert torch.equal(out, torch.relu(lin(x)) * 3)
    assert not out.requires_grad


def test_composite_linear_with_bias_keeps_its_functional_kernel():
    """F.linear(x, w, b) is one addmm; its out= variant is matmul then add,
    whose bits can differ: such composites never replay with out=."""
    lin = torch.nn.Linear(256, 1024)
    x = torch.randn(32, 1, 256)
    with torch.inference_mode():
        g = TapeGraph()
        with tape_graph(g):
            out = lin(x) * 2
        fns = {k for k, v in g._env.items() if v is torch._C._nn.linear}
        assert fns and not any(f"{k}(" in ln and "out=" in ln for k in fns for ln in g.source.splitlines())
        gen = torch.Generator().manual_seed(3)
        for _ in range(3):
            x.copy_(torch.randn(x.shape, generator=gen))
            g.replay()
            assert torch.equal(out, lin(x) * 2)


def test_out_only_for_bindings_sharing_the_functional_kernel():
    from graphrunner.tape.bindings import _out_same_kernel

    aten = torch.ops.aten
    assert _out_same_kernel(aten.mul.Tensor, torch.mul)
    assert _out_same_kernel(aten.linear.default, torch.matmul)  # the linear -> matmul rewrite
    assert not _out_same_kernel(aten.linear.default, torch._C._nn.linear)  # a composite
    assert not _out_same_kernel(aten.softmax.int, torch.softmax)
    assert not _out_same_kernel(aten.add.Tensor, torch.mul)  # not the op's own binding


def _temporaries(g):
    """The planned temporary buffers of ``g`` (not their views)."""
    return [v for k, v in g._env.items() if k.startswith("b") and isinstance(v, torch.Tensor) and v._base is None]


def _graphs(pools, seed=4):
    gen = torch.Generator().manual_seed(seed)
    made = []
    for pool in pools:
        x, w = torch.randn(4, 8, generator=gen), torch.randn(8, 8, generator=gen)
        with torch.inference_mode():
            g = TapeGraph()
            with tape_graph(g, pool=pool):
                out = _step(x, w)
        made.append((g, out, x, w))
    return made


def test_graphs_of_one_pool_share_their_temporaries_memory():
    """The j-th temporary buffer of every graph of a pool is the same memory (a CUDA capture reuses the blocks an
    earlier capture into its pool freed): the pool holds one graph's temporaries, not one set per graph. Replayed
    one after the other in any order, every graph still equals eager: its temporaries are dead when it returns."""
    from graphrunner.tape import graph_pool_handle

    pool = graph_pool_handle()
    made = _graphs([pool] * 4)
    memory = [sorted(t.untyped_storage().data_ptr() for t in _temporaries(g)) for g, *_ in made]
    assert len(memory[0]) >= 2 and all(m == memory[0] for m in memory)
    distinct = {t.untyped_storage().data_ptr(): t for t in _temporaries(made[0][0])}.values()  # a reused buffer: one
    assert pool.scratch_bytes == sum(t.numel() * t.element_size() for t in distinct)
    gen = torch.Generator().manual_seed(5)
    for order in ([0, 1, 2, 3], [3, 1, 0, 2], [2, 2, 0, 3]):
        for i in order:
            g, out, x, w = made[i]
            x.copy_(torch.randn(x.shape, generator=gen))
            g.replay()
        for i in set(order):  # every output still holds its own graph's last replay, bit for bit
            g, out, x, w = made[i]
            with torch.inference_mode():
                assert torch.equal(out, _step(x, w))


def test_negative_control_graphs_of_separate_pools_do_not_share_temporaries():
    from graphrunner.tape import graph_pool_handle

    made = _graphs([graph_pool_handle() for _ in range(2)])
    a, b = ({t.untyped_storage().data_ptr() for t in _temporaries(g)} for g, *_ in made)
    assert a and b and not (a & b)
