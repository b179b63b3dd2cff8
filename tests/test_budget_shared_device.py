"""The memory accounting is exact on a device shared by two runners (issue 34 items 4 and 7).

Runners given one device object share its graph pool (docs/runner.md, "Several runners of one
model"): their graphs reuse each other's freed memory. Reproduction, before the fix:

- a runner with ``memory_budget=`` on such a device counted the growth of the shared pool: its
  keys took the blocks the other runner's capture had freed, so it reported 0 B and its budget
  kept a key whose graph needs more than the budget; and its budget restart (``cleanup()``)
  released the device's pool although the other runner's graphs held it, so the device's figure
  read the restarted runner's new pool (13 KiB) while the graphs on it held 7 KiB more;
- any runner's ``cleanup()`` on a shared device did the same to the other runners' pool;
- on CUDA the figure was the growth of ``torch.cuda.memory_reserved()``: the whole GPU.

The fix: a runner with a budget given a device object captures into a pool of its own
(``device.with_own_pool()``), so its budget counts exactly its own graphs and a restart releases
only its pool; every figure is measured on the pool itself (``device.pool_bytes()``: the tape's
arena, the pool's segments in ``torch.cuda.memory_snapshot()``); ``cleanup()`` keeps a pool other
graphs still hold (``device.pool_in_use()``). Reference: the hand computation of
``tests/test_report_memory.py`` (two live temporaries of the largest key kept, in 512-byte
blocks). Negative controls: the budgeted runner forced onto the shared pool, and the
unconditional release.
"""

from __future__ import annotations

import gc

import pytest
import torch

import graphrunner as gr
from graphrunner.testing import cuda_standin as cs

F32 = 4


def block(nbytes: int) -> int:
    """A CUDA caching-allocator block: a multiple of 512 bytes (at least 512)."""
    return max(512, -(-nbytes // 512) * 512)


def pool_need(b: int, t: int) -> int:
    """Two live temporaries of ``b`` rows of ``t`` floats (the step below)."""
    return 2 * block(b * t * F32)


def chain(x):
    a = x * 2
    b = a + 1
    return b.sum(-1)


def eager(x):
    with torch.inference_mode():
        return chain(x)


BUCKETS = (1, 2, 4, 8)


def make(dev, t, backend="full", **kw):
    return gr.GraphRunner(
        chain, {"x": gr.BatchInput(trailing=(t,))}, list(BUCKETS), backend=backend, device=dev, progress=False, **kw
    )


def served_right(r, t, left=()):
    """Every size 1..8 equal to eager: a replay on its padded bucket, a left-out key on its own rows."""
    gen = torch.Generator().manual_seed(t)
    for n in range(1, 9):
        x = torch.randn(n, t, generator=gen).to(r.torch_device)
        bucket = r.bucket_for(n)
        want = eager(x) if bucket in left else eager(torch.cat([x, x.new_zeros(bucket - n, t)]))[:n]
        if not torch.equal(r(x=x), want):
            return False
    return True


# (t of the runner captured first, t of the runner with the budget): "reuse": the budgeted runner's
# temporaries fit in the blocks the first one freed; "restart": they do not, its key 8 goes over
# the budget and its capture restarts (cleanup) while the first runner's graphs hold their pool
SCENARIOS = {"reuse": (300, 100), "restart": (100, 400)}


@pytest.mark.parametrize("backend", ["full", "breakable"])
@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_a_budget_on_a_shared_tape_device_counts_exactly_its_own_graphs(backend, scenario):
    ta, tb = SCENARIOS[scenario]
    gc.collect()
    base = gr.TapeDevice().memory_reserved()  # pools other tests' runners still hold
    dev = gr.TapeDevice()
    a = make(dev, ta, backend)
    rep_a = a.capture()
    assert a.device is dev and rep_a.graph_pool_bytes == pool_need(8, ta) == dev.pool_bytes()
    assert dev.memory_reserved() - base == pool_need(8, ta)
    b = make(dev, tb, backend, memory_budget=pool_need(4, tb))
    rep_b = b.capture()
    figures = (rep_b.left_to_eager, rep_b.graph_pool_bytes, dev.pool_bytes())
    # key 8 needs two blocks of 8 rows, over the budget; key 4 fits exactly; the other runner's
    # graphs still hold the device's pool, and its figure says so
    assert figures == ([8], pool_need(4, tb), pool_need(8, ta))
    assert b.device is not dev and b.device.pool_bytes() == pool_need(4, tb)
    # issue 42 item 7: memory_reserved() counts every pool, as CUDA's does (both runners' here);
    # the old figure, the device's own pool, left the budgeted runner's pool out
    assert dev.memory_reserved() - base == pool_need(8, ta) + pool_need(4, tb) == b.device.memory_reserved() - base
    assert dev.pool_bytes() != dev.memory_reserved() - base
    assert [k.graph_pool_bytes for k in rep_b.buckets] == [pool_need(4, tb), 0, 0]
    # the same runner alone on a device of its own reports the same: nothing depends on the sharing
    alone = make(gr.TapeDevice(), tb, backend, memory_budget=pool_need(4, tb)).capture()
    assert alone.left_to_eager == [8] and alone.graph_pool_bytes == rep_b.graph_pool_bytes
    # the graphs on the device hold exactly what the two reports say
    assert dev.pool_bytes() + b.device.pool_bytes() == rep_a.graph_pool_bytes + rep_b.graph_pool_bytes
    assert served_right(a, ta) and served_right(b, tb, left=[8])
    b.cleanup()  # releases b's pool only
    assert dev.pool_bytes() == pool_need(8, ta) and served_right(a, ta)
    a.cleanup()
    assert dev.pool_bytes() == 0  # the last graphs of the pool released: a fresh pool next time


def test_negative_control_a_budget_on_the_shared_pool_hides_its_graphs(monkeypatch):
    """The budgeted runner forced onto the device's shared pool (the path before the fix): its
    keys take the other runner's freed blocks, its figure is 0 B and its budget keeps key 8, whose
    graph needs two blocks of 8 rows: what the test above refuses. Its replays are right."""
    monkeypatch.setattr(gr.TapeDevice, "with_own_pool", lambda self: self)
    ta, tb = SCENARIOS["reuse"]
    dev = gr.TapeDevice()
    make(dev, ta).capture()
    b = make(dev, tb, memory_budget=pool_need(4, tb))
    rep_b = b.capture()
    assert b.device is dev
    assert rep_b.left_to_eager == [] and rep_b.graph_pool_bytes == 0 != pool_need(8, tb)
    assert served_right(b, tb)


def test_runners_without_a_budget_share_one_pool_and_their_rows_sum_to_it():
    """The documented sharing stays: a second runner given the device's object captures into its
    pool (its keys reuse the first one's freed blocks: it adds nothing), the two reports sum to the
    pool, and one runner's cleanup keeps the pool the other's graphs hold."""
    ta, tc = SCENARIOS["reuse"]
    dev = gr.TapeDevice()
    a, c = make(dev, ta), make(dev, tc)
    assert a.device is dev and c.device is dev
    rep_a, rep_c = a.capture(), c.capture()
    assert (rep_a.graph_pool_bytes, rep_c.graph_pool_bytes) == (pool_need(8, ta), 0)
    assert rep_a.graph_pool_bytes + rep_c.graph_pool_bytes == dev.pool_bytes() == pool_need(8, ta)
    pool = dev.graph_pool()
    c.cleanup()
    assert dev.graph_pool() is pool and dev.pool_bytes() == pool_need(8, ta) and dev.pool_in_use()
    assert served_right(a, ta)
    rep_c = c.capture()  # into the same pool again: a's freed blocks again, nothing added
    assert rep_c.graph_pool_bytes == 0 and dev.pool_bytes() == pool_need(8, ta)
    assert served_right(c, tc) and served_right(a, ta)


def test_negative_control_an_unconditional_release_drops_the_pool_the_other_runner_holds(monkeypatch):
    """``cleanup()`` releasing the device's pool whatever holds it (before the fix): the device
    forgets the pool the first runner's graphs hold, its figure reads 0 B, and the next capture
    starts a second pool on the device."""
    monkeypatch.setattr(gr.TapeDevice, "pool_in_use", lambda self: False)
    ta, tc = SCENARIOS["reuse"]
    dev = gr.TapeDevice()
    a, c = make(dev, ta), make(dev, tc)
    a.capture()
    c.capture()
    pool = dev.graph_pool()
    c.cleanup()
    assert dev.pool_bytes() == 0 != pool_need(8, ta) and pool.bytes_held == pool_need(8, ta)
    assert dev.graph_pool() is not pool
    assert served_right(a, ta)  # a's graphs still replay from the pool the device forgot


def test_with_own_pool_gives_a_twin_with_a_pool_of_its_own():
    dev = gr.TapeDevice(jit_replay=False)
    twin = dev.with_own_pool()
    assert type(twin) is gr.TapeDevice and twin is not dev and twin.jit_replay is False
    assert twin.torch_device == dev.torch_device and twin.graph_pool() is not dev.graph_pool()
    assert not twin.pool_in_use() and twin.pool_bytes() == 0
    # only a runner with a budget takes a twin; a backend instance keeps its device
    assert make(dev, 16).device is dev and make(dev, 16, memory_budget=1 << 20).device is not dev
    inst = gr.GraphRunner(
        chain,
        {"x": gr.BatchInput(trailing=(16,))},
        list(BUCKETS),
        progress=False,
        backend=gr.backends.FullGraphBackend(device=dev),
        memory_budget=1 << 20,
    )
    assert inst.device is dev


@pytest.mark.cuda
@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_a_budget_on_a_shared_cuda_device_counts_its_own_pool(cuda_device, scenario):
    """The same on CUDA (the stand-in here, the GPU where there is one): each runner's figure is
    its pool's segments (``torch.cuda.memory_snapshot()``), not the GPU's reserved memory. Before
    the fix, on the stand-in: "reuse": B reported 0 B and kept key 8; "restart": B's over-budget
    attempt stayed in the shared pool A holds (the GPU reserved 46080 B for reports of 7168 + 13312)."""
    ta, tb = SCENARIOS[scenario]
    a = make(cuda_device, ta)
    rep_a = a.capture()
    pool_a = tuple(a.device.graph_pool())

    def snapshot_bytes(pool):
        return sum(s["total_size"] for s in torch.cuda.memory_snapshot() if tuple(s["segment_pool_id"]) == pool)

    assert a.device is cuda_device and rep_a.graph_pool_bytes == snapshot_bytes(pool_a) == a.device.pool_bytes()
    standin = cs.installed_standin() is not None
    budget = pool_need(4, tb) if standin else rep_a.graph_pool_bytes  # a GPU rounds to 2 MiB segments
    b = make(cuda_device, tb, memory_budget=budget)
    rep_b = b.capture()
    pool_b = tuple(b.device.graph_pool())
    assert pool_b != pool_a and tuple(cuda_device.graph_pool()) == pool_a
    assert rep_b.graph_pool_bytes == snapshot_bytes(pool_b) == b.device.pool_bytes()
    assert cuda_device.pool_bytes() == rep_a.graph_pool_bytes  # b's capture and restart left a's pool alone
    if standin:  # the tape's block arithmetic: the hand computation
        assert rep_a.graph_pool_bytes == pool_need(8, ta)
        assert rep_b.left_to_eager == [8] and rep_b.graph_pool_bytes == pool_need(4, tb)
        # the GPU holds exactly what the two reports say (the old figure, its reserved memory, is both pools)
        assert torch.cuda.memory_reserved() == pool_need(8, ta) + pool_need(4, tb) != rep_b.graph_pool_bytes
    assert served_right(a, ta) and served_right(b, tb, left=rep_b.left_to_eager)
    b.cleanup()
    assert cuda_device.pool_bytes() == rep_a.graph_pool_bytes
    a.cleanup()


BUDGET_TARGET = """
import graphrunner as gr

def make():
    x2 = {"x": gr.BatchInput(trailing=(64,), dims=("r", "d"))}
    return gr.GraphRunner(lambda x: x * 2.0 + 1.0, x2, {"r": [1, 2, 4], "d": [1, 8, 16]}, device="tape",
                          progress=False, memory_budget=BUDGET)
"""


@pytest.mark.parametrize("budget", [20000, None])
def test_graphrunner_check_reports_a_budget_in_one_finding_line(tmp_path, capsys, budget):
    """``graphrunner check`` on a runner whose keys do not fit its budget: exit 1, one
    ``memory-budget`` finding whose text is one line naming the budget, the first key over it
    and the pool it would hold (a hand computation: key (4, 16) alone holds its 4 x 16 x 64
    float output temporary and result, 2 x 16 KiB), no traceback. Control: no budget, no finding."""
    from graphrunner_tools.cli import main

    path = tmp_path / "target.py"
    path.write_text(BUDGET_TARGET.replace("BUDGET", repr(budget)))
    rc = main(["check", f"{path}:make"])
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err and "OverBudget" not in out + err
    found = [line for line in out.splitlines() if line.strip().startswith("found:")]
    if budget is None:
        assert rc == 0 and found == []
        return
    assert rc == 1 and len(found) == 1
    assert found[0].strip() == (
        "found: memory_budget=19.5 KiB: with key (4, 16) the graph pool holds 32.0 KiB, over "
        "the budget: a capture leaves this key (and any that do not fit after it) to eager"
    )
    assert 2 * (4 * 16 * 64 * F32) == 32 * 1024
