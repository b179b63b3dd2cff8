"""Collectives inside a tape capture are recorded and re-issued at replay (2 gloo ranks)."""

import os
import socket
import traceback

import pytest
import torch
import torch.multiprocessing as mp

pytestmark = pytest.mark.multirank


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world, port, q):
    try:
        import torch.distributed as dist

        from graphrunner.tape import TapeGraph, tape_graph

        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=world)
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
                results.append(
                    torch.equal(got[0], ref) and torch.equal(got[1], inplace) and torch.equal(got[2], gathered)
                )
                # negative control: the reduced result differs from the local one
                results.append(not torch.equal(got[1], x[0]))
        dist.destroy_process_group()
        q.put((rank, ok_undo, results, None))
    except Exception:
        q.put((rank, False, [], traceback.format_exc()))


def test_all_reduce_and_all_gather_replay_matches_eager():
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, 2, port, q)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        got = [q.get(timeout=60) for _ in procs]
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    for rank, ok_undo, results, err in sorted(got, key=lambda t: t[0]):
        assert err is None, f"rank {rank} failed:\n{err}"
        assert ok_undo, f"rank {rank}: capture left its write to an external in place"
        assert results and all(results), f"rank {rank}: {results}"
