"""`graphrunner verify`: the speculative verify step, captured per (reqs, draft) tier, checked against eager.

Single rank: the loop's accepted tokens equal an independent eager model and plain
greedy decoding; a planted cache drift is caught (exit 1). The padding mask: padded draft
cells leave real cells and the real cache untouched (negative control: without the mask
they overwrite the first token's K/V). Three gloo ranks with a tensor-parallel MLP: each
rank pads to its own tier and the agreement makes them replay (or fall back) together;
with the agreement off the run ends in an error within the group timeout, not a hang.
"""

from __future__ import annotations

import io
import os
import sys

import pytest
import torch

import graphrunner_tools.spec as spec
from graphrunner_tools.cli import main
from graphrunner_tools.models import LlamaConfig, build_model

sys.path.insert(0, os.path.dirname(__file__))
from mp_util import assert_all_ok, format_results, run_ranks  # noqa: E402

SMALL = dict(requests=3, max_new=6, k=3, reqs_buckets=(1, 2, 4), draft_buckets=(2, 4), layers=1, progress=False)
SMALL_CLI = [
    "--requests",
    "3",
    "--max-new",
    "6",
    "--k",
    "3",
    "--reqs-buckets",
    "1,2,4",
    "--draft-buckets",
    "2,4",
    "--layers",
    "1",
    "--no-progress",
]


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["breakable", "full"])
def test_verify_loop_equals_eager_and_plain_greedy(backend):
    out = io.StringIO()
    res = spec.run_spec(backend=backend, out=out, **SMALL)
    text = out.getvalue()
    assert res.ok, text
    assert res.tokens == 3 * 6 and res.steps >= 2
    assert 0 < res.accepted < res.drafted  # drafts were both accepted and rejected
    assert sum(res.replays.values()) + res.fallbacks == res.steps and res.replays
    assert "replays per tier (reqs x draft)" in text and "verify: OK" in text


def test_planted_cache_drift_is_a_mismatch_and_exits_1():
    """Negative control of the eager check: the graph model's cache drifts after step 0."""
    out = io.StringIO()
    res = spec.run_spec(plant_mismatch=True, out=out, **SMALL)
    assert not res.ok and res.logit_mismatches > 0, out.getvalue()
    assert "verify: FAILED" in out.getvalue()
    assert main(["verify", *SMALL_CLI, "--plant-mismatch"]) == 1


def _prefilled(config, prompt):
    model = build_model(config, seed=3)
    with torch.inference_mode():
        model.prefill(torch.tensor([prompt]), slot_ids=torch.tensor([0]))
    return model


def test_verify_step_equals_one_token_at_a_time_decoding():
    """Independent reference of the verify step: feeding the cells one decode step at a time."""
    config = LlamaConfig.tiny(num_layers=2, max_batch_size=2)
    prompt, cells = [5, 9, 17], [33, 2, 71, 8]
    model, ref = _prefilled(config, prompt), _prefilled(config, prompt)
    pos = torch.arange(len(prompt), len(prompt) + len(cells))
    with torch.inference_mode():
        got = spec.verify_step_fn(model)(torch.tensor([cells]), pos[None], torch.tensor([4]), torch.tensor([0]))[0]
        want = torch.stack(
            [ref.decode_step(torch.tensor([c]), p[None], torch.tensor([0]))[0] for c, p in zip(cells, pos)]
        )
    assert torch.allclose(got, want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("mask", [True, False])
def test_padded_draft_cells_do_not_change_real_cells(mask):
    """Two requests, 2 and 3 real cells, padded to 6 cells (padding: token 0, position 0, as the
    runner pads). With the mask, real cells and the real cache equal the unpadded step; without it
    (negative control) the padded cells overwrite position 0 of each request and real cells change."""
    config = LlamaConfig.tiny(num_layers=2, max_batch_size=3)
    prompts = [[5, 9, 17, 4], [8, 1, 60]]
    models = []
    for _ in range(2):
        m = build_model(config, seed=3)
        with torch.inference_mode():
            for i, p in enumerate(prompts):
                m.prefill(torch.tensor([p]), slot_ids=torch.tensor([i]))
        models.append(m)
    real_tokens = torch.tensor([[7, 40, 0], [11, 3, 99]])
    real_pos = torch.tensor([[4, 5, 0], [3, 4, 5]])
    lens, slots = torch.tensor([2, 3]), torch.tensor([0, 1])
    pad_tokens = torch.cat([real_tokens, torch.zeros(2, 3, dtype=torch.long)], 1)
    pad_pos = torch.cat([real_pos, torch.zeros(2, 3, dtype=torch.long)], 1)
    with torch.inference_mode():
        # the reference is always masked (its one padded cell would otherwise write position 0 too)
        ref = spec.verify_step_fn(models[0])(real_tokens, real_pos, lens, slots)
        got = spec.verify_step_fn(models[1], mask=mask)(pad_tokens, pad_pos, lens, slots)
    real_same = all(torch.allclose(got[b, :n], ref[b, :n], atol=1e-4, rtol=1e-4) for b, n in enumerate([2, 3]))
    k_ref, k_got = models[0].kv_cache_tensors()[0], models[1].kv_cache_tensors()[0]
    cache_same = torch.allclose(k_got[:2, :, :6], k_ref[:2, :, :6], atol=1e-5)
    if mask:
        assert real_same and cache_same
    else:
        assert not real_same and not cache_same


def _ranks_worker(rank, world, agree, timeout):
    res = spec.run_spec(rank=rank, world=world, agree=agree, group_timeout=timeout, out=io.StringIO(), **SMALL)
    return res


@pytest.mark.slow
@pytest.mark.multirank
def test_verify_on_three_ranks_agrees_every_step():
    results = run_ranks(_ranks_worker, world_size=3, args=(True, 30.0), timeout=240)
    assert_all_ok(results)
    res = [r.value for r in results]
    assert all(r.ok for r in res), [spec.summary(r) for r in res]
    # every rank padded to its own tier, yet all replayed the same keys and fell back together
    assert len({(tuple(sorted(r.replays.items())), r.fallbacks, r.steps) for r in res}) == 1
    assert res[0].fallbacks > 0 and res[0].replays  # rank 2's budget padding goes over the largest draft tier
    assert 0 < res[0].accepted < res[0].drafted


@pytest.mark.slow
@pytest.mark.multirank
def test_without_agreement_the_run_fails_clearly_not_hangs():
    """Negative control of the agreement: ranks replay their own tiers, the all_reduce inside the
    step gets different sizes, and every rank fails within the group timeout."""
    results = run_ranks(_ranks_worker, world_size=3, args=(False, 5.0), timeout=240)
    text = format_results(results)
    assert not any(r.timed_out for r in results), text
    assert not any(r.ok for r in results), text
    assert any(r.exc_type == "RankTimeoutError" and "collective inside the step" in r.exc_message for r in results), (
        text
    )


@pytest.mark.slow
@pytest.mark.multirank
def test_cli_verify_on_two_ranks(capsys):
    assert main(["verify", *SMALL_CLI, "--ranks", "2", "--timeout", "200"]) == 0
    out = capsys.readouterr().out
    assert "verify on 2 ranks: OK" in out and "rank 1: 0 mismatches" in out


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--requests", "5", "--reqs-buckets", "1,2,4"], "must hold all 5 requests"),
        (["--ranks", "5"], "does not divide the MLP width"),
        (["--draft-buckets", "4,2"], "strictly increasing"),
    ],
)
def test_cli_verify_usage_errors(argv, message, capsys):
    assert main(["verify", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("graphrunner: error:") and message in err and len(err.strip().splitlines()) == 1


def test_without_the_mask_the_run_departs_from_plain_greedy(monkeypatch):
    """End-to-end negative control of the mask: graph and eager agree with each other (both
    unmasked), so only the plain-greedy comparison can catch the padding leak, and it does."""
    real = spec.verify_step_fn
    monkeypatch.setattr(spec, "verify_step_fn", lambda model, mask=True: real(model, mask=False))
    res = spec.run_spec(out=io.StringIO(), **SMALL)
    assert res.logit_mismatches == 0 and res.token_mismatches == 0
    assert res.greedy_mismatches > 0 and not res.ok


def test_mlp_only_shards_sum_to_the_whole_mlp_and_leave_o_proj():
    """``shard_tensor_parallel(attention=False)``, as verify uses it: o_proj stays whole (with the
    default it is replaced: the control), and the two ranks' hand-computed partial MLPs sum to the
    unsplit MLP (so verify's all_reduce of them equals the one-rank model)."""
    import torch.nn.functional as F
    from torch import nn

    from graphrunner_tools.models.tp import shard_tensor_parallel

    config = LlamaConfig.tiny(num_layers=1, intermediate_size=spec.MLP_WIDTH)
    full = build_model(config, seed=3)
    shards = [shard_tensor_parallel(build_model(config, seed=3), r, 2, attention=False) for r in range(2)]
    both = shard_tensor_parallel(build_model(config, seed=3), 0, 2)
    assert type(shards[0].model.layers[0].self_attn.o_proj) is nn.Linear
    assert type(both.model.layers[0].self_attn.o_proj) is not nn.Linear
    x = torch.randn(3, config.hidden_size)
    with torch.no_grad():
        parts = [
            F.linear(F.silu(F.linear(x, m.gate)) * F.linear(x, m.up), m.down)
            for m in (s.model.layers[0].mlp for s in shards)
        ]
        want = full.model.layers[0].mlp(x)
    assert torch.allclose(parts[0] + parts[1], want, atol=1e-5)
    assert not torch.allclose(parts[0], want, atol=1e-3)  # one shard alone is not the MLP


def test_a_rank_killed_by_a_signal_is_named():
    from graphrunner_tools.launch import _died

    assert _died(-6).startswith("killed by SIGABRT without reporting (gloo aborts")
    assert _died(3) == "exited with code 3 without reporting"
