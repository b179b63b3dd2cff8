"""DTensor and functional collectives on the tape (2 gloo ranks).

The tape records the plain-tensor ops under DTensor (its local ops, its redistributions' functional
collectives), never a DTensor-level op, and replays a functional collective on the recorded group in
recorded order, reading its result only after its ``wait_tensor``. Every result is compared with eager
PyTorch computed without the tape (and without DTensor where it can be: a plain embedding of the full
weight, sums of the ranks' inputs rebuilt from their seeds). Negative controls: the old DTensor-level
recording (the binding proof ran DTensor's Python a second time: MaskPartial's "MaskBuffer has been
materialized with conflicting data"), the old recording of ``wait_tensor`` as a plain op (an alias of its
input, dropped at replay) and a refresh copy or a buffer reuse before the wait, each with a
late peer, which makes the race they lose certain.
"""

import pytest
import torch
from mp_util import assert_all_ok, format_results, run_ranks
from tp_util import tiny_llama_dir

pytestmark = [pytest.mark.multirank, pytest.mark.slow]  # slow: spawns rank processes (-m "not slow" skips it)

VOCAB, DIM = 16, 4
#: The other rank's delay before each replay in the race tests: its collective is issued this late, so a rank
#: that reads a result before waiting for it reads what its collective has not written yet.
LATE_S = 0.15


def _full_weight() -> torch.Tensor:
    return torch.arange(VOCAB * DIM, dtype=torch.float32).view(VOCAB, DIM) / 7


def _old_dtensor_level_recording(monkeypatch_target) -> None:
    """The tape's recorder as it was before: an op on a DTensor recorded as it is (the DTensor types hidden
    from the recorder, so that the plain-tensor path records it and proves its binding by running it again)."""
    from torch.distributed.tensor import DTensor

    orig = monkeypatch_target.__torch_dispatch__

    def recorded_as_it_is(self, func, types, args=(), kwargs=None):
        plain = tuple(t for t in types if not issubclass(t, DTensor)) or (torch.Tensor,)
        return orig(self, func, plain, args, kwargs)

    monkeypatch_target.__torch_dispatch__ = recorded_as_it_is


def _embedding(rank, world, variant):
    """A vocabulary-parallel embedding (weight sharded on dim 0, as transformers' tensor parallelism shards
    it), captured with ids [1, 13], replayed with other ids; then eager calls with other ids."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    from graphrunner.tape import TapeGraph, tape_graph
    from graphrunner.tape.recording import Recorder

    if variant == "old_dtensor_level":
        _old_dtensor_level_recording(Recorder)
    mesh = init_device_mesh("cpu", (world,))
    full = _full_weight()
    emb = torch.nn.Embedding(VOCAB, DIM)
    emb.weight = torch.nn.Parameter(distribute_tensor(full.clone(), mesh, [Shard(0)]), requires_grad=False)
    ids = torch.tensor([1, 13])  # one id in each rank's shard

    def step():
        return emb(DTensor.from_local(ids, mesh, [Replicate()], run_check=False)).full_tensor()

    out = {"replays": [], "eager_after": [], "ops": []}
    with torch.inference_mode():
        g = TapeGraph()
        try:
            with tape_graph(g):
                got = step()
        except Exception as exc:  # the negative control may fail here already
            out["capture_error"] = f"{type(exc).__name__}: {exc}"
            return out
        out["ops"] = sorted(set(g._labels.values()))
        for other in ([2, 14], [15, 0], [7, 8], [13, 1]):
            ids.copy_(torch.tensor(other))
            g.replay()
            ref = torch.nn.functional.embedding(ids, full)  # plain eager, no DTensor
            out["replays"].append((other, torch.equal(got, ref), got.tolist(), ref.tolist()))
        for other in ([3, 12], [9, 4]):  # eager DTensor calls after the capture, with ids never seen
            ids.copy_(torch.tensor(other))
            try:
                eager = step()
                ok = torch.equal(eager, torch.nn.functional.embedding(ids, full))
                out["eager_after"].append((other, ok, None))
            except Exception as exc:
                out["eager_after"].append((other, False, f"{type(exc).__name__}: {exc}"))
    return out


def test_vocab_parallel_embedding_replays_other_ids_equal_to_eager_and_eager_calls_after_pass():
    res = run_ranks(_embedding, 2, timeout=120, args=("tape",))
    assert_all_ok(res)
    for r in res:
        v = r.value
        assert "capture_error" not in v, f"rank {r.rank}: {v['capture_error']}"
        # the local ops and the redistribution's collective, never the DTensor-level op
        assert "_c10d_functional.all_reduce.default" in v["ops"], v["ops"]
        assert "_c10d_functional.wait_tensor.default" in v["ops"], v["ops"]
        assert len(v["replays"]) == 4 and all(ok for _, ok, _, _ in v["replays"]), f"rank {r.rank}: {v['replays']}"
        assert len(v["eager_after"]) == 2 and all(ok for _, ok, _ in v["eager_after"]), (
            f"rank {r.rank}: {v['eager_after']}"
        )


def test_negative_control_the_old_dtensor_level_recording_breaks_the_next_eager_call():
    res = run_ranks(_embedding, 2, timeout=120, args=("old_dtensor_level",))
    assert_all_ok(res)
    errors = []
    for r in res:
        v = r.value
        errors.append(v.get("capture_error", ""))
        errors += [e or "" for _, ok, e in v["eager_after"] if not ok]
    assert any("MaskBuffer has been materialized with conflicting data" in e for e in errors), (
        f"{errors}\n{format_results(res)}"
    )


def _seeded(rank: int, i: int, shape=(64, 33)) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * i + rank)
    return torch.randn(shape, generator=g)


def _functional(rank, world, kind, variant, n):
    """Capture a functional collective once, replay it ``n`` times with fresh inputs (the other rank late
    at some replays), each result compared with the eager value rebuilt from every rank's seeded input."""
    import time

    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol

    from graphrunner.tape import TapeGraph, codegen, recording, tape_graph

    if variant == "wait_as_plain_op":  # wait_tensor recorded as a plain op: a pure alias of its input, dropped
        orig = recording.Recorder.__torch_dispatch__
        namespaces = recording.FUNCTIONAL_COLLECTIVES

        def wait_as_plain_op(self, func, types, args=(), kwargs=None):
            wait = func is torch.ops._c10d_functional.wait_tensor.default
            recording.FUNCTIONAL_COLLECTIVES = () if wait else namespaces
            try:
                return orig(self, func, types, args, kwargs)
            finally:
                recording.FUNCTIONAL_COLLECTIVES = namespaces

        recording.Recorder.__torch_dispatch__ = wait_as_plain_op
    elif variant == "copy_before_wait":  # a survivor refreshed right after the collective is issued
        codegen._functional = lambda op: False
    elif variant == "reuse_before_wait":  # the input's buffer given to a later op before the wait
        codegen._wait_index = lambda ops, keep, i, cn: i
    # one gloo thread: the group runs its collectives one after the other, so a collective issued behind one
    # that waits for the late peer reads its input late (the race a buffer reused before the wait loses)
    opts = dist.ProcessGroupGloo._Options()
    opts._threads = 1
    group = dist.new_group(backend="gloo", pg_options=opts)
    x = _seeded(rank, 0)

    def step():
        if kind == "all_reduce":
            y = funcol.all_reduce(x * 2, "sum", group).wait()  # the collective's own result: a survivor
            return y, y + 1  # and a result read from it
        if kind == "all_gather":
            a = funcol.all_reduce(x * 5, "sum", group)  # in flight first: the group's thread waits in it
            y = funcol.all_gather_single(x * 2, 0, group)  # read by that thread once the all_reduce is done
            z = x * 3  # a temporary of x * 2's shape: takes its buffer once that is free
            return y.wait(), z + a.wait()
        y = funcol.reduce_scatter_tensor(x * 2, "sum", 0, group)
        return y.wait(), None

    def expected(i):
        xs = [_seeded(r, i) * 2 for r in range(world)]
        if kind == "all_reduce":
            return sum(xs)
        if kind == "all_gather":
            return torch.cat(xs)
        return sum(xs).chunk(world)[rank]

    out = []
    with torch.inference_mode():
        g = TapeGraph()
        with tape_graph(g):
            got, got1 = step()
        labels = sorted(set(g._labels.values()))
        for i in range(1, n + 1):
            x.copy_(_seeded(rank, i))
            late = rank == 1 and (i % 3 == 1 or variant != "new")
            if late:
                time.sleep(LATE_S)
            g.replay()
            ok = torch.equal(got, expected(i))
            if kind == "all_reduce":
                ok = ok and torch.equal(got1, got + 1)
            elif kind == "all_gather":
                ok = ok and torch.equal(got1, x * 3 + sum(_seeded(r, i) * 5 for r in range(world)))
            eager, _ = step()  # eager, same inputs (on the same group, without the tape)
            out.append((i, ok, torch.equal(eager, expected(i))))
    return labels, out


@pytest.mark.parametrize("kind", ["all_reduce", "all_gather", "reduce_scatter"])
def test_functional_collective_replays_fresh_inputs_equal_to_eager_every_time(kind):
    n = 30
    res = run_ranks(_functional, 2, timeout=120, args=(kind, "new", n))
    assert_all_ok(res)
    for r in res:
        labels, out = r.value
        assert "_c10d_functional.wait_tensor.default" in labels, labels
        assert len(out) == n, out
        bad = [i for i, ok, _ in out if not ok]
        assert not bad, f"rank {r.rank}: replays {bad} of {n} differ from eager\n{labels}"
        assert all(e for _, _, e in out), f"rank {r.rank}: eager reference broken: {out}"


@pytest.mark.parametrize(
    "kind,variant",
    [("all_reduce", "wait_as_plain_op"), ("all_reduce", "copy_before_wait"), ("all_gather", "reuse_before_wait")],
)
def test_negative_control_reading_before_the_wait_replays_wrong_with_a_late_peer(kind, variant):
    n = 4
    res = run_ranks(_functional, 2, timeout=120, args=(kind, variant, n))
    assert_all_ok(res)
    wrong = [(r.rank, i) for r in res for i, ok, _ in r.value[1] if not ok]
    assert wrong, f"{variant}: every replay was right\n{[r.value for r in res]}"
    assert all(e for r in res for _, _, e in r.value[1]), "eager reference broken"


# --------------------------------------------------------------------------- a tiny Llama with tp_size=2
def _tiny_llama_dir(tmp_path) -> str:
    """A tiny Llama with random weights saved to ``tmp_path`` (no download)."""
    return tiny_llama_dir(tmp_path, vocab_size=96, num_hidden_layers=2)


def _llama(rank, world, path, variant):
    """The TP model's forward captured on the tape (a TapeGraph, and a GraphRunner step over the ranks'
    group), replayed with other token ids: compared with the same model without tensor parallelism (eager,
    loaded from the same weights) and with the TP model's eager call after the capture."""
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    from graphrunner.backends import FullGraphBackend
    from graphrunner.group import TorchDistGroup
    from graphrunner.runner import BatchInput, GraphRunner
    from graphrunner.tape import TapeGraph, tape_graph
    from graphrunner.tape.recording import Recorder

    kw = {"dtype": torch.float32, "attn_implementation": "sdpa"}
    tp = AutoModelForCausalLM.from_pretrained(path, distributed_config=DistributedConfig(tp_size=world), **kw).eval()
    ref = AutoModelForCausalLM.from_pretrained(path, **kw).eval()  # every weight on this rank, no DTensor
    if variant == "old_dtensor_level":
        _old_dtensor_level_recording(Recorder)
    gen = torch.Generator().manual_seed(0)
    out: dict = {"tape": [], "runner": []}
    with torch.inference_mode():
        ids = torch.randint(0, 96, (2, 5), generator=gen)
        g = TapeGraph()
        try:
            with tape_graph(g):
                got = tp(ids).logits
        except Exception as exc:
            out["capture_error"] = f"{type(exc).__name__}: {exc}"
            return out
        first = got.clone()
        out["ops"] = sorted(set(g._labels.values()))
        for _ in range(3):
            ids.copy_(torch.randint(0, 96, (2, 5), generator=gen))
            g.replay()
            want = ref(ids).logits
            try:
                eager = tp(ids).logits  # the TP model's eager call after the capture, with ids never seen
                eager_err = None
            except Exception as exc:
                eager, eager_err = None, f"{type(exc).__name__}: {exc}"
            out["tape"].append(
                (
                    torch.allclose(got, want, rtol=1e-5, atol=1e-6),
                    eager is not None and torch.equal(got, eager),
                    not torch.allclose(got, first),  # control: other ids, other logits (not a stale output)
                    eager_err,
                )
            )
        if variant != "tape":
            return out

        def step(input_ids):
            return tp(input_ids).logits[:, -1]

        group = TorchDistGroup(timeout=60)
        inputs = {"input_ids": BatchInput(trailing=(5,), dtype=torch.long, pad=0, bounds=(0, 95))}
        runner = GraphRunner(
            step, inputs, [1, 2, 4], backend=FullGraphBackend(device="tape", group=group, warmups=1), group=group
        )
        runner.capture()
        for n in (1, 3, 4, 2, 1):
            x = torch.randint(0, 96, (n, 5), generator=gen)
            y = runner(input_ids=x)
            out["runner"].append(
                (
                    n,
                    runner.stats.last_bucket,
                    torch.allclose(y, ref(x).logits[:, -1], rtol=1e-5, atol=1e-6),
                    torch.equal(y, step(x)),
                )
            )
        out["fallbacks"] = runner.stats.fallbacks
    return out


@pytest.mark.hf
def test_tiny_tp_llama_forward_on_the_tape_and_in_a_runner_equals_eager_on_both_ranks(tmp_path):
    res = run_ranks(_llama, 2, timeout=300, args=(_tiny_llama_dir(tmp_path), "tape"))
    assert_all_ok(res)
    for r in res:
        v = r.value
        assert "capture_error" not in v, f"rank {r.rank}: {v['capture_error']}"
        assert "_c10d_functional.all_reduce.default" in v["ops"], v["ops"]
        assert len(v["tape"]) == 3 and all(a and b and c for a, b, c, _ in v["tape"]), f"rank {r.rank}: {v['tape']}"
        # every call replayed a graph (bucket 1, 4, 4, 2, 1), equal to eager
        assert [(n, b) for n, b, _, _ in v["runner"]] == [(1, 1), (3, 4), (4, 4), (2, 2), (1, 1)], v["runner"]
        assert all(a and b for _, _, a, b in v["runner"]), f"rank {r.rank}: {v['runner']}"
        assert v["fallbacks"] == 0


@pytest.mark.hf
def test_negative_control_tiny_tp_llama_with_the_old_dtensor_level_recording_fails(tmp_path):
    res = run_ranks(_llama, 2, timeout=300, args=(_tiny_llama_dir(tmp_path), "old_dtensor_level"))
    assert_all_ok(res)
    for r in res:  # the replays differ from eager, and the eager calls after the capture raise
        v = r.value
        assert "capture_error" not in v, v["capture_error"]
        assert not any(a for a, _, _, _ in v["tape"]), f"rank {r.rank}: {v['tape']}"
        assert all("MaskBuffer has been materialized with conflicting data" in (e or "") for *_, e in v["tape"]), v
