"""The capture fingerprint on tensor-parallel ranks (``TorchDistGroup(tensor_parallel=True)``), 2 gloo ranks.

A tiny Llama whose vocabulary (97) does not divide by the ranks, loaded with transformers' tensor parallelism:
its ranks record a different number of ops for the same key (the uneven vocabulary shards), the same
collectives. On a tensor-parallel group the fingerprint compares the collectives: every key captures and
replays equal to eager on both ranks. Negative controls: the replicas' rule (op counts, a group without
``tensor_parallel``) refuses the same capture on every rank naming ``tape_ops``, and on the tensor-parallel
group a step whose ranks record different collectives is still refused, naming ``tape_collectives``."""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
from mp_util import assert_all_ok, run_ranks  # noqa: E402
from tp_util import tiny_llama_dir

pytestmark = [pytest.mark.multirank, pytest.mark.slow, pytest.mark.hf]

VOCAB = 97  # odd: the two ranks' vocabulary shards differ in size


def _tiny_llama_dir(path) -> str:
    """A tiny Llama with random weights saved to ``path`` (no download)."""
    return tiny_llama_dir(path, vocab_size=VOCAB, num_hidden_layers=1)


def _runner(step, group, trailing, dtype, bounds):
    from graphrunner.runner import BatchInput, GraphRunner

    inputs = {"x": BatchInput(trailing=trailing, dtype=dtype, pad=0, bounds=bounds)}
    return GraphRunner(step, inputs, [1, 2], backend="full", device="tape", group=group, warmups=1, progress=False)


def _ranks(rank, world, path):
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    from graphrunner.errors import RanksDisagreeError
    from graphrunner.group import TorchDistGroup

    kw = {"dtype": torch.float32, "attn_implementation": "sdpa"}
    tp = AutoModelForCausalLM.from_pretrained(path, distributed_config=DistributedConfig(tp_size=world), **kw).eval()

    def llama(x):
        return tp(x).logits[:, -1]

    out: dict = {}
    gen = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        # the replicas' rule on the TP ranks: their op counts differ, every rank refuses the capture
        runner = _runner(llama, TorchDistGroup(timeout=60), (4,), torch.long, (0, VOCAB - 1))
        try:
            runner.capture()
            out["replica_rule"] = None
        except RanksDisagreeError as exc:
            out["replica_rule"] = str(exc)
        runner.cleanup()
        # the tensor-parallel rule: captured and replayed on both ranks, equal to eager
        runner = _runner(llama, TorchDistGroup(timeout=60, tensor_parallel=True), (4,), torch.long, (0, VOCAB - 1))
        runner.capture()
        out["info"] = {
            k: (runner.backend.info(k)["num_ops"], runner.backend.info(k)["num_collectives"]) for k in (1, 2)
        }
        out["calls"] = []
        for n in (1, 2, 1):
            x = torch.randint(0, VOCAB, (n, 4), generator=gen)
            y = runner(x=x).clone()
            out["calls"].append((runner.stats.last_bucket, torch.equal(y, llama(x))))
        out["fallbacks"] = runner.stats.fallbacks
        runner.cleanup()
        # the control on the TP group: rank 1 records one collective more (on a group of itself alone)
        solo = [dist.new_group([r]) for r in range(world)]

        def step(x):
            y = funcol.all_reduce(x * 2.0, "sum", dist.group.WORLD)
            if rank == 1:
                y = funcol.all_reduce(y, "sum", solo[1])
            return y * 1.0

        runner = _runner(step, TorchDistGroup(timeout=60, tensor_parallel=True), (3,), torch.float32, None)
        try:
            runner.capture()
            out["collectives_rule"] = None
        except RanksDisagreeError as exc:
            out["collectives_rule"] = str(exc)
    return out


def test_tp_ranks_with_uneven_shards_capture_under_the_tp_rule_and_are_refused_by_the_replica_rule(tmp_path):
    res = run_ranks(_ranks, 2, timeout=300, args=(_tiny_llama_dir(tmp_path),))
    assert_all_ok(res)
    a, b = (r.value for r in res)
    # the case is real: the ranks' op counts differ for every key, their collectives do not
    for k in (1, 2):
        assert a["info"][k][0] != b["info"][k][0], (a["info"], b["info"])
        assert a["info"][k][1] == b["info"][k][1] > 0, (a["info"], b["info"])
    for v in (a, b):
        # every call replayed its key (no fallback), equal to the TP model's eager forward
        assert v["calls"] == [(1, True), (2, True), (1, True)] and v["fallbacks"] == 0, v["calls"]
        # negative control: the replicas' rule refuses the same capture on every rank, naming the op count
        assert v["replica_rule"] is not None and "'tape_ops' differs" in v["replica_rule"], v["replica_rule"]
        # and the TP rule still refuses ranks whose collectives differ
        assert v["collectives_rule"] is not None and "'tape_collectives' differs" in v["collectives_rule"], v[
            "collectives_rule"
        ]
