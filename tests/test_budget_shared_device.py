"""The memory accounting is exact on a device shared by two runners (issue 34 items 4 and 7).

Reproduction: two runners given one device object captured into its one pool. The second
runner's graphs took the blocks the first one's capture had freed, so its report (the growth of
that shared pool) said 0 B while its graphs held a key's worth, and its ``memory_budget=`` kept a
key that does not fit; a budget restart of one runner (``cleanup()`` releases the device's pool)
dropped the pool handle the other runner's graphs still held, so that runner's figure read the
other's pool; and the two could not replay at the same time in two threads (graphs of one pool:
``CaptureError`` on the tape, corruption on a GPU). On CUDA the figure was the growth of
``torch.cuda.memory_reserved()``: the whole GPU, every other pool and allocation included.

The fix: a runner given a device object another live runner already captures with captures
through ``device.with_own_pool()`` (its graphs share a pool of their own) and measures that pool alone (``device.pool_bytes()``: the tape's
arena, CUDA's ``memory_snapshot()`` segments of the pool). Reference: the hand computation of
``tests/test_report_memory.py`` (two live temporaries of the largest key kept, in 512-byte
blocks). Negative control: two runners sharing the pool on purpose (backend instances on one
device) show the figure the old path reported.
"""

from __future__ import annotations

import threading

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
    return gr.GraphRunner(chain, {"x": gr.BatchInput(trailing=(t,))}, list(BUCKETS), backend=backend, device=dev,
                          progress=False, **kw)


# (t of the runner captured first, t of the runner with the budget): "reuse": the second runner's
# temporaries fit in the blocks the first one freed; "restart": they do not, its key 8 goes over
# the budget and its capture restarts (cleanup) while the first runner's graphs hold their pool
SCENARIOS = {"reuse": (300, 100), "restart": (100, 400)}


def _serve_both(a, ta, b, tb, left):
    """Both runners served at the same time from two threads: every value equal to eager."""
    errors, wrong = [], []

    def serve(r, t, seed):
        gen = torch.Generator().manual_seed(seed)
        try:
            for _ in range(40):
                for n in range(1, 9):
                    x = torch.randn(n, t, generator=gen).to(r.torch_device)
                    got = r(x=x).clone()
                    bucket = r.bucket_for(n)
                    if r is b and bucket in left:
                        want = eager(x)
                    else:
                        want = eager(torch.cat([x, x.new_zeros(bucket - n, t)]))[:n]
                    if not torch.equal(got, want):
                        wrong.append((t, n))
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=serve, args=(a, ta, 1)), threading.Thread(target=serve, args=(b, tb, 2))]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=120)
    assert not any(th.is_alive() for th in threads)
    assert errors == [] and wrong == []


@pytest.mark.parametrize("backend", ["full", "breakable"])
@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_two_runners_on_one_tape_device_each_count_their_own_graphs(backend, scenario):
    ta, tb = SCENARIOS[scenario]
    dev = gr.TapeDevice()
    a = make(dev, ta, backend)
    rep_a = a.capture()
    assert rep_a.graph_pool_bytes == pool_need(8, ta) == a.device.memory_reserved()
    b = make(dev, tb, backend, memory_budget=pool_need(4, tb))
    rep_b = b.capture()
    figures = (rep_b.left_to_eager, rep_b.graph_pool_bytes, a.device.memory_reserved())
    # key 8 needs two blocks of 8 rows, over the budget; key 4 fits exactly; the other runner's
    # graphs still hold their pool, and its figure says so
    assert figures == ([8], pool_need(4, tb), pool_need(8, ta))
    assert b.device.memory_reserved() == pool_need(4, tb) == b.device.pool_bytes()
    assert [k.graph_pool_bytes for k in rep_b.buckets] == [pool_need(4, tb), 0, 0]
    assert a.device.pool_bytes() == pool_need(8, ta)
    # the same runner alone on a device of its own reports the same: nothing depends on the sharing
    alone = make(gr.TapeDevice(), tb, backend, memory_budget=pool_need(4, tb)).capture()
    assert alone.left_to_eager == [8] and alone.graph_pool_bytes == rep_b.graph_pool_bytes
    _serve_both(a, ta, b, tb, [8])
    b.cleanup()  # releases b's pool only
    assert a.device.pool_bytes() == pool_need(8, ta)
    x = torch.randn(3, ta)
    torch.testing.assert_close(a(x=x), eager(torch.cat([x, x.new_zeros(1, ta)]))[:3], rtol=0, atol=0)
    a.cleanup()


def test_negative_control_runners_sharing_one_pool_on_purpose_hide_their_graphs():
    """Backend instances on one device share its pool (what every runner given that device did
    before): the second runner's keys take the first one's freed blocks, its figure is 0 B and its
    budget keeps key 8, whose graph holds two blocks of 8 rows: the accounting the test above
    refuses. Its replays are right when the two are served one after the other."""
    ta, tb = SCENARIOS["reuse"]
    dev = gr.TapeDevice()
    a = gr.GraphRunner(chain, {"x": gr.BatchInput(trailing=(ta,))}, list(BUCKETS), progress=False,
                       backend=gr.FullGraphBackend(device=dev))
    b = gr.GraphRunner(chain, {"x": gr.BatchInput(trailing=(tb,))}, list(BUCKETS), progress=False,
                       backend=gr.FullGraphBackend(device=dev), memory_budget=pool_need(4, tb))
    assert a.device is dev and b.device is dev
    a.capture()
    rep_b = b.capture()
    assert rep_b.left_to_eager == [] and rep_b.graph_pool_bytes == 0 != pool_need(8, tb)
    assert dev.memory_reserved() == pool_need(8, ta)  # one pool: b added nothing to it
    x = torch.randn(8, tb)
    torch.testing.assert_close(b(x=x), eager(x), rtol=0, atol=0)


def test_with_own_pool_gives_a_twin_with_a_pool_of_its_own():
    dev = gr.TapeDevice(jit_replay=False)
    twin = dev.with_own_pool()
    assert type(twin) is gr.TapeDevice and twin is not dev and twin.jit_replay is False
    assert twin.torch_device == dev.torch_device and twin.graph_pool() is not dev.graph_pool()
    # the first runner given a device object captures into its pool; a second one, while the first
    # lives, through a twin; once the first is gone the device is free again
    first = make(dev, 16)
    second = make(dev, 16)
    assert first.device is dev and second.device is not dev and type(second.device) is gr.TapeDevice
    del first, second
    import gc

    gc.collect()
    assert make(dev, 16).device is dev


@pytest.mark.cuda
def test_two_runners_on_one_cuda_device_each_count_their_own_pool(cuda_device):
    """The same on CUDA (the stand-in here, the GPU where there is one): each runner's figure is
    its own pool's segments (``torch.cuda.memory_snapshot()``), not the GPU's reserved memory."""
    ta, tb = SCENARIOS["reuse"]
    a = make(cuda_device, ta)
    rep_a = a.capture()
    pool_a = tuple(a.device.graph_pool())

    def snapshot_bytes(pool):
        return sum(s["total_size"] for s in torch.cuda.memory_snapshot() if tuple(s["segment_pool_id"]) == pool)

    assert rep_a.graph_pool_bytes == snapshot_bytes(pool_a) == a.device.pool_bytes()
    standin = cs.installed_standin() is not None
    budget = pool_need(4, tb) if standin else rep_a.graph_pool_bytes  # a GPU rounds to 2 MiB segments
    b = make(cuda_device, tb, memory_budget=budget)
    rep_b = b.capture()
    pool_b = tuple(b.device.graph_pool())
    assert pool_b != pool_a and tuple(a.device.graph_pool()) == pool_a
    assert rep_b.graph_pool_bytes == snapshot_bytes(pool_b) == b.device.pool_bytes()
    assert a.device.pool_bytes() == rep_a.graph_pool_bytes  # b's capture and restart left a's pool alone
    if standin:  # the tape's block arithmetic: the hand computation
        assert rep_a.graph_pool_bytes == pool_need(8, ta)
        assert rep_b.left_to_eager == [8] and rep_b.graph_pool_bytes == pool_need(4, tb)
        # the old figure, the GPU's reserved memory, holds both runners' pools
        assert torch.cuda.memory_reserved() == pool_need(8, ta) + pool_need(4, tb) != rep_b.graph_pool_bytes
    for r, t in ((a, ta), (b, tb)):
        x = torch.randn(5, t).to(r.torch_device)
        bucket = r.bucket_for(5)
        want = eager(x) if bucket in rep_b.left_to_eager and r is b else \
            eager(torch.cat([x, x.new_zeros(bucket - 5, t)]))[:5]
        torch.testing.assert_close(r(x=x), want)
    b.cleanup()
    a.cleanup()


BUDGET_TARGET = '''
import graphrunner as gr

def make():
    x2 = {"x": gr.BatchInput(trailing=(64,), dims=("r", "d"))}
    return gr.GraphRunner(lambda x: x * 2.0 + 1.0, x2, {"r": [1, 2, 4], "d": [1, 8, 16]}, device="tape",
                          progress=False, memory_budget=BUDGET)
'''


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
    assert found[0].strip() == ("found: memory_budget=19.5 KiB: with key (4, 16) the graph pool holds 32.0 KiB, over "
                                "the budget: a capture leaves this key (and any that do not fit after it) to eager")
    assert 2 * (4 * 16 * 64 * F32) == 32 * 1024
