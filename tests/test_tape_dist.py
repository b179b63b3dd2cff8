"""Collectives inside a tape capture are recorded and re-issued at replay (2 gloo ranks)."""

import pytest
import torch
from mp_util import assert_all_ok, format_results, run_ranks

pytestmark = [pytest.mark.multirank, pytest.mark.slow]  # slow: spawns rank processes (-m "not slow" skips it)


def _worker(rank, world):
    import torch.distributed as dist

    from graphrunner.tape import TapeGraph, tape_graph

    torch.manual_seed(rank)
    w = torch.randn(4, 4)
    x = torch.randn(2, 4)  # static input
    gathered = torch.empty(2 * world, 4)  # static output buffer (external)
    inplace = torch.zeros(4)  # external reduced in place

    def step():
        h = x @ w
        dist.all_reduce(h)
        inplace.copy_(x[0])
        dist.all_reduce(inplace)
        dist.all_gather_into_tensor(gathered, h * (rank + 1))
        return h.relu() + gathered.sum(0)

    results = []
    with torch.inference_mode():
        g = TapeGraph()
        with tape_graph(g):
            out = step()
        ok_undo = bool(torch.equal(inplace, torch.zeros(4)))
        for i in range(3):
            x.copy_(torch.randn(2, 4) + i)
            g.replay()
            got = (out.clone(), inplace.clone(), gathered.clone())
            ref = step()  # eager, same inputs
            results.append(torch.equal(got[0], ref) and torch.equal(got[1], inplace) and torch.equal(got[2], gathered))
            # negative control: the reduced result differs from the local one
            results.append(not torch.equal(got[1], x[0]))
    return ok_undo, results


def test_all_reduce_and_all_gather_replay_matches_eager():
    res = run_ranks(_worker, 2, timeout=60)
    assert_all_ok(res)
    for r in res:
        ok_undo, results = r.value
        assert ok_undo, f"rank {r.rank}: capture left its write to an external in place\n{format_results(res)}"
        assert len(results) == 6 and all(results), f"rank {r.rank}: {results}"


def _functional(rank, world, functional):
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    from graphrunner.errors import CaptureError
    from graphrunner.tape import TapeGraph, tape_graph

    x = torch.full((2, 3), float(rank + 1))
    if functional == "dtensor":  # a vocabulary-parallel embedding, as transformers' tensor parallelism shards it
        mesh = init_device_mesh("cpu", (world,))
        emb = torch.nn.Embedding(8, 3)
        weight = distribute_tensor(torch.ones(8, 3), mesh, [Shard(0)])
        emb.weight = torch.nn.Parameter(weight, requires_grad=False)
    other = _Wrapper(x) if functional == "other_subclass" else None

    def step():
        if functional == "dtensor":
            return emb(DTensor.from_local(torch.tensor([1, 7]), mesh, [Replicate()])).full_tensor() * (x[0, 0] + 2)
        if functional == "other_subclass":
            return other * 2
        if functional:  # what a DTensor redistribute issues (transformers' tensor parallelism)
            return funcol.all_reduce(x * 2, "sum", dist.group.WORLD).wait() + 1
        y = x * 2
        dist.all_reduce(y)
        return y + 1

    with torch.inference_mode():
        g = TapeGraph()
        try:
            with tape_graph(g):
                out = step()
        except CaptureError as exc:
            return str(exc)
        g.replay()
        return out.tolist()


class _Wrapper(torch.Tensor):
    """A minimal wrapper tensor subclass (not DTensor): the tape refuses ops on it."""

    @staticmethod
    def __new__(cls, elem):
        return torch.Tensor._make_wrapper_subclass(cls, elem.shape, dtype=elem.dtype, device=elem.device)

    def __init__(self, elem):
        self.elem = elem

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        unwrap = lambda t: t.elem if isinstance(t, _Wrapper) else t  # noqa: E731
        return func(*torch.utils._pytree.tree_map(unwrap, args), **torch.utils._pytree.tree_map(unwrap, kwargs or {}))


@pytest.mark.parametrize(
    "functional", [True, "dtensor", False, "other_subclass"], ids=["functional", "dtensor", "in_place", "other"]
)
def test_a_functional_collective_or_a_dtensor_op_is_replayed_another_subclass_refused(functional):
    res = run_ranks(_functional, 2, timeout=60, args=(functional,))
    assert_all_ok(res)
    for r in res:
        if functional == "dtensor":  # embedding rows of ones (all-reduced over the shards) times x[0, 0] + 2
            assert r.value == [[r.rank + 3.0] * 3] * 2, r.value
        elif functional == "other_subclass":
            assert "the tape does not record ops on tensor subclasses other than DTensor" in r.value, r.value
            assert "on a _Wrapper" in r.value, r.value
        else:  # the functional and the in-place collective are recorded and replayed: (1 + 2) * 2 + 1
            assert r.value == [[7.0] * 3] * 2, r.value
