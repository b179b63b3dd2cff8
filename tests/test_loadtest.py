"""``graphrunner loadtest``: the continuous-batching engine, the sweep on 1 and 2 real ranks, the
planted faults, and the command line.

The independent reference is the decoder's uncached ``forward_full``: for each request, the
prompt plus the generated tokens are run through it in one causal forward (teacher forcing), and
every generated token must be the argmax of its position's logits (up to a float tie).
"""

from __future__ import annotations

import json
import math

import pytest
import torch

import graphrunner as gr
from graphrunner_tools import loadtest as lt
from graphrunner_tools.models import LlamaConfig, build_model

TIE = 1e-3  # logits closer than this to the maximum count as a tie (float rounding of another batch shape)


def _bad_tokens(model, requests, tokens):
    """Ids of the requests whose generated tokens are not the greedy argmax of ``forward_full``."""
    bad = []
    with torch.inference_mode():
        for req in requests:
            out = tokens[req.rid]
            assert len(out) == req.output_len
            seq = torch.tensor([list(req.prompt) + out[:-1]])
            logits = model.forward_full(seq)[0]
            p = len(req.prompt)
            for k, tok in enumerate(out):
                row = logits[p - 1 + k]
                if row[tok] < row.max() - TIE:
                    bad.append(req.rid)
                    break
    return bad


def _tiny(backend="breakable", rows=9, seed=3):
    cfg = LlamaConfig.tiny(max_batch_size=rows, attention="masked" if backend == "full" else "varlen")
    return build_model(cfg, seed=seed)


def _requests(n=14, seed=5):
    return lt.make_requests(n, 128, prompt_len=(2, 10), output_len=(1, 12), seed=seed)


# --------------------------------------------------------------------------- requests and the engine
def test_make_requests_is_seeded_and_in_range():
    a, b = lt.make_requests(50, 100, (3, 7), (2, 5), seed=1), lt.make_requests(50, 100, (3, 7), (2, 5), seed=1)
    assert a == b and a != lt.make_requests(50, 100, (3, 7), (2, 5), seed=2)
    assert {len(r.prompt) for r in a} <= set(range(3, 8)) and len({len(r.prompt) for r in a}) > 1
    assert {r.output_len for r in a} <= set(range(2, 6)) and len({r.output_len for r in a}) > 1
    assert all(0 <= t < 100 for r in a for t in r.prompt)
    with pytest.raises(ValueError, match="output_len"):
        lt.make_requests(3, 100, (1, 2), (0, 2))


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["breakable", "full"])
def test_graph_engine_tokens_match_the_uncached_reference(backend):
    # buckets 1, 2, 4, 8 and the padding slot 8; at most 6 running: a full batch pads 2 rows
    model, reqs = _tiny(backend), _requests()
    runner = lt.decode_runner(model, backend, 8, device="tape", progress=False)
    runner.capture()
    engine = lt.Engine(model, runner, 6)
    run = engine.serve(reqs)
    assert sorted(run.tokens) == [r.rid for r in reqs]
    assert run.generated_tokens == sum(r.output_len for r in reqs)
    assert max(run.schedule) == 6 and len(run.schedule) == len(run.step_s)
    assert sum(runner.stats.replays.values()) == len(run.schedule) and runner.stats.fallbacks == 0
    assert runner.stats.padding_rows >= 2 * run.schedule.count(6)  # batch 6 replays bucket 8
    assert _bad_tokens(model, reqs, run.tokens) == []


@pytest.mark.slow
def test_padding_rows_in_a_real_slot_corrupt_requests():
    # Negative control of the padding slot: padding rows sent to cache row 0 (a request's slot)
    # overwrite that request's position 0, and the uncached reference catches it. The padding check
    # refuses it at capture (its call sequences: a later call of the request in slot 0 reads what the
    # padding rows wrote, also where the warmups left the same values); served with the check off:
    model, reqs = _tiny(), _requests()
    with pytest.raises(
        gr.PaddingLeakError,
        match=r"slot_ids \(pad 0, also a real value.*"
        r"self_attn\.k_cache\[0, :, 0, :\]",
    ):
        lt.decode_runner(_tiny(), "breakable", 8, pad_slot=0, device="tape", progress=False).capture()
    runner = lt.decode_runner(
        model, "breakable", 8, pad_slot=0, device="tape", progress=False, checks=("drift", "fingerprint")
    )
    runner.capture()
    run = lt.Engine(model, runner, 6).serve(reqs)
    assert runner.stats.padding_rows > 0
    assert _bad_tokens(model, reqs, run.tokens) != []


def test_schedule_depends_on_lengths_only_and_respects_max_running():
    model, reqs = _tiny(), _requests()
    seen = []

    def decode(input_ids, positions, slot_ids):
        seen.append(slot_ids.tolist())
        return model.decode_step(input_ids, positions, slot_ids)

    def noise(input_ids, positions, slot_ids):  # other logits, so other tokens
        return torch.randn(input_ids.shape[0], 128)

    a = lt.Engine(model, decode, 4).serve(reqs)
    b = lt.Engine(model, noise, 4).serve(reqs)
    assert a.schedule == b.schedule and a.tokens != b.tokens
    assert max(a.schedule) == 4
    for slots in seen:  # distinct slots, never the padding rows >= max_running
        assert len(set(slots)) == len(slots) and all(0 <= s < 4 for s in slots)
    # one-token requests finish at prefill and never enter a decode step
    assert sum(a.schedule) == sum(r.output_len - 1 for r in reqs)
    with pytest.raises(ValueError, match="padding slot"):
        lt.Engine(model, decode, 9)  # 9 cache rows: no row left for the padding slot


def test_nonfinite_logits_are_a_fault():
    model, reqs = _tiny(), _requests(4)

    def nan_decode(input_ids, positions, slot_ids):
        return torch.full((input_ids.shape[0], 128), float("nan"))

    with pytest.raises(lt.NonFiniteLogitsError, match="decode step 0"):
        lt.Engine(model, nan_decode, 4).serve(reqs)
    # negative control: without the check, argmax of NaN logits is a valid-looking token
    assert 0 <= int(torch.full((128,), float("nan")).argmax()) < 128


# --------------------------------------------------------------------------- verify steps (--spec)
def _spec_engine(model, reqs, verify, k=3, max_running=6):
    """Serve ``reqs`` with verify steps; also return every draft proposed: (rid, done, drafts)."""
    with torch.inference_mode():
        greedy = lt.Engine(model, model.decode_step, max_running).serve(reqs)
    model.reset_cache()
    drafter = lt.Drafter(greedy.tokens, k, 128, seed=7)
    proposed = []

    def record(rid, done):
        d = drafter(rid, done)
        proposed.append((rid, done, d))
        return d

    record.k = k
    run = lt.Engine(model, None, max_running, verify=verify, drafter=record).serve(reqs)
    return greedy, run, proposed


@pytest.mark.slow
def test_verify_engine_tokens_match_eager_and_the_uncached_reference():
    # reqs buckets 1, 2, 4, 8 (padding slot 8), draft buckets 2, 4 (cells: last token + 1..3 drafts)
    model, reqs = _tiny(), _requests()
    runner = lt.verify_runner(model, "breakable", 8, 3, device="tape", progress=False)
    runner.capture()
    greedy, run, proposed = _spec_engine(model, reqs, runner)
    assert sorted(run.tokens) == [r.rid for r in reqs] and _bad_tokens(model, reqs, run.tokens) == []
    assert sum(runner.stats.replays.values()) == len(run.schedule) and runner.stats.fallbacks == 0
    assert {len(d) for *_, d in proposed} == {1, 2, 3}  # ragged draft lengths: padded cells in real rows
    assert runner.stats.padding_rows > 0
    # drafts were accepted (fewer steps than plain decoding) and rejected (not every draft kept)
    accepted = sum(
        next((j for j, t in enumerate(d) if t != run.tokens[rid][done + j]), len(d))
        for rid, done, d in proposed
        if done + len(d) <= len(run.tokens[rid])
    )
    drafted = sum(len(d) for rid, done, d in proposed if done + len(d) <= len(run.tokens[rid]))
    assert 0 < accepted < drafted and len(run.schedule) < len(greedy.schedule)
    # the eager engine with the same decisions generates the same tokens, step for step
    eager = lt.verify_runner(model, "eager", 8, 3, device="tape", progress=False)
    eager.capture()
    model.reset_cache()
    _, again, _ = _spec_engine(model, reqs, eager)
    assert again.tokens == run.tokens and again.schedule == run.schedule


@pytest.mark.slow
def test_verify_padding_cells_unmasked_corrupt_requests():
    # Negative control of the scratch position: padded cells left at position 0 overwrite the
    # K/V of the requests' first token, and the uncached reference catches it.
    model, reqs = _tiny(), _requests()
    runner = lt.verify_runner(model, "breakable", 8, 3, mask=False, device="tape", progress=False)
    runner.capture()
    _, run, _ = _spec_engine(model, reqs, runner)
    assert _bad_tokens(model, reqs, run.tokens) != []


def test_verify_engine_refuses_a_scratch_position_a_real_cell_uses():
    model = build_model(LlamaConfig.tiny(max_batch_size=9, max_seq_len=23), seed=3)  # scratch 22
    reqs = _requests()  # prompt + output up to 22: cells up to 20 + 3 drafts
    with pytest.raises(ValueError, match="scratch position"):
        _spec_engine(model, reqs, lt.verify_runner(model, "eager", 8, 3, device="tape", progress=False))


# --------------------------------------------------------------------------- the sweep
def _cfg(**kw):
    base = dict(
        requests=10,
        concurrency=(3, 6),
        layers=1,
        prompt_len=(2, 8),
        output_len=(1, 8),
        seed=2,
        progress=False,
        timeout=20.0,
    )
    base.update(kw)
    return lt.LoadtestConfig(**base)


def _reference_check(cfg, result):
    model = lt.build_decoder(cfg)  # unsharded, same seed
    reqs = lt.run_requests(cfg, model.config.vocab_size)
    for lv in result.levels:
        assert sorted(lv.tokens) == list(range(cfg.requests))
        assert _bad_tokens(model, reqs, lv.tokens) == [], lv.concurrency
    return reqs


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["breakable", "full"])
def test_loadtest_one_rank(backend):
    cfg = _cfg(backend=backend)
    res = lt.run_loadtest(cfg)
    assert res.ok, [lv.errors for lv in res.levels]
    reqs = _reference_check(cfg, res)
    for lv in res.levels:
        assert (lv.completed, lv.faults, lv.mismatches, lv.fallbacks) == (10, 0, 0, 0)
        assert lv.generated_tokens == sum(r.output_len for r in reqs)
        assert lv.replays > 0
        assert lv.tokens_per_s > 0 and lv.eager_tokens_per_s > 0 and lv.p50_step_ms <= lv.p99_step_ms
    doc = res.to_json()
    assert set(doc) == {"ranks", "dp", "tp", "backend", "dist_backend", "spec", "background_capture", "levels"}
    assert doc["ranks"] == 1 and doc["dist_backend"] is None  # one rank: no process group
    assert doc["background_capture"] is False and doc["levels"][0]["first_decode_s"] > 0
    assert doc["backend"] == backend and (doc["dp"], doc["tp"]) == (1, 1)
    assert doc["spec"] == 0 and all(sum(d["tier_replays"].values()) == d["replays"] for d in doc["levels"])
    assert [tuple(d) for d in doc["levels"]] == [lt.LEVEL_KEYS] * 2
    assert "C3: 10/10 requests, 0 faults, 0 mismatches, " in res.levels[0].line()


def test_mismatch_fault_is_caught():
    cfg = _cfg(inject_fault="mismatch", concurrency=(3,))
    res = lt.run_loadtest(cfg)
    assert not res.ok
    lv = res.levels[0]
    assert lv.mismatches == 1 and len(lv.mismatched) == 1
    # negative control: only the comparison sees it; nothing else failed, and the request's
    # graph tokens are really wrong against the uncached reference
    assert lv.faults == 0 and lv.completed == cfg.requests
    model = lt.build_decoder(cfg)
    reqs = lt.run_requests(cfg, model.config.vocab_size)
    assert _bad_tokens(model, reqs, lv.tokens) == lv.mismatched


@pytest.mark.slow
def test_loadtest_spec_one_rank():
    cfg = _cfg(spec=3)
    res = lt.run_loadtest(cfg)
    assert res.ok, [lv.errors for lv in res.levels]
    reqs = _reference_check(cfg, res)  # equal to eager (the comparison) and to the uncached reference
    for lv in res.levels:
        assert (lv.completed, lv.faults, lv.mismatches, lv.fallbacks) == (10, 0, 0, 0)
        assert lv.generated_tokens == sum(r.output_len for r in reqs)
        assert lv.replays > 0 and sum(lv.tier_replays.values()) == lv.replays
        assert all(len(t.split("x")) == 2 for t in lv.tier_replays)  # "RxD" tiers
    doc = res.to_json()
    assert doc["spec"] == 3 and [tuple(d) for d in doc["levels"]] == [lt.LEVEL_KEYS] * 2


def test_mismatch_fault_is_caught_with_spec():
    cfg = _cfg(inject_fault="mismatch", concurrency=(3,), spec=3)
    res = lt.run_loadtest(cfg)
    assert not res.ok
    lv = res.levels[0]
    assert lv.mismatches >= 1 and lv.faults == 0 and lv.completed == cfg.requests
    # negative control: the graph tokens of the reported requests are really wrong
    model = lt.build_decoder(cfg)
    reqs = lt.run_requests(cfg, model.config.vocab_size)
    assert _bad_tokens(model, reqs, lv.tokens) == lv.mismatched


@pytest.mark.slow
@pytest.mark.multirank
def test_loadtest_two_ranks_spec():
    cfg = _cfg(ranks=2, requests=6, concurrency=(4,), spec=2)
    res = lt.run_loadtest(cfg, launch_timeout=240)
    assert res.ok, [lv.errors for lv in res.levels] + res.errors
    lv = res.levels[0]
    assert (lv.completed, lv.faults, lv.mismatches, lv.fallbacks) == (6, 0, 0, 0) and lv.tier_replays
    _reference_check(cfg, res)


@pytest.mark.slow
@pytest.mark.multirank
def test_loadtest_two_ranks_tensor_parallel():
    cfg = _cfg(ranks=2, requests=8)
    res = lt.run_loadtest(cfg, launch_timeout=240)
    assert res.ok, [lv.errors for lv in res.levels] + res.errors
    for lv in res.levels:
        assert (lv.completed, lv.faults, lv.mismatches, lv.fallbacks) == (8, 0, 0, 0) and lv.replays > 0
    _reference_check(cfg, res)  # the sharded ranks generate the unsharded model's tokens


def test_dp_schedule_is_seeded_uneven_and_covers_every_request():
    reqs = lt.make_requests(200, 100, (2, 6), (1, 6), seed=1)
    split = lt.dp_schedule(reqs, 2, seed=0)
    assert split == lt.dp_schedule(reqs, 2, seed=0) and split != lt.dp_schedule(reqs, 2, seed=1)
    ids = sorted(r.rid for part, _ in split for r in part)
    assert ids == list(range(200))  # every request in exactly one group
    n0, n1 = (len(part) for part, _ in split)
    assert n1 > 1.5 * n0  # weights 1:2: group 1 gets about two thirds
    for part, arrival in split:
        assert len(arrival) == len(part) and 0 <= min(arrival) and max(arrival) <= 50 and len(set(arrival)) > 10


@pytest.mark.slow
@pytest.mark.multirank
def test_loadtest_data_parallel_with_idle_ranks():
    # DP 2 x TP 2 on 4 gloo processes: the groups serve different requests, the MLP spans all 4
    # ranks (all-gather + all-reduce inside the step), an idle rank joins with 0 rows.
    cfg = _cfg(ranks=4, dp=2, requests=12, concurrency=(2, 4))
    res = lt.run_loadtest(cfg, launch_timeout=300)
    assert res.ok, [lv.errors for lv in res.levels] + res.errors
    for lv in res.levels:
        assert (lv.completed, lv.faults, lv.mismatches, lv.fallbacks) == (12, 0, 0, 0) and lv.replays > 0
        assert lv.idle_rank_steps > 0, "the scheduler never left a rank idle: the case under test did not occur"
        assert f"{lv.idle_rank_steps} idle-rank steps" in lv.line()
    _reference_check(cfg, res)  # every request's tokens are the unsharded model's greedy tokens
    doc = res.to_json()
    assert (doc["ranks"], doc["dp"], doc["tp"], doc["dist_backend"]) == (4, 2, 2, "gloo")
    assert [tuple(d) for d in doc["levels"]] == [lt.LEVEL_KEYS] * 2


@pytest.mark.slow
@pytest.mark.multirank
def test_stall_fault_raises_rank_timeout_and_never_passes():
    cfg = _cfg(ranks=2, requests=6, concurrency=(3, 6), inject_fault="stall", timeout=2.0)
    res = lt.run_loadtest(cfg, launch_timeout=240)
    assert not res.ok
    first = res.levels[0]
    assert first.faults >= 1 and first.completed < cfg.requests
    assert any("rank 0" in e and "RankTimeoutError" in e and "within 2s" in e for e in first.errors), first.errors
    assert not any("killed" in e for lv in res.levels for e in lv.errors + res.errors)  # no rank had to be killed
    # the stalled rank did not wait out its stall: torch's launcher stopped it once rank 0 had failed
    assert "rank 1 was stopped by torch's launcher before it reported, after rank 0 failed" in first.errors
    assert res.levels[1].completed == 0  # the run stopped: the group is unusable after a timeout


# --------------------------------------------------------------------------- ranks on CUDA: NCCL, a GPU each
def _fake_cuda(monkeypatch, gpus, nccl=True):
    """This process sees ``gpus`` CUDA GPUs (and NCCL or not); a spawned rank would fail the test."""
    import torch.distributed as dist

    import graphrunner_tools.launch as launch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    monkeypatch.setattr(dist, "is_nccl_available", lambda: nccl)
    spawned = []

    def spawn(*args, **kwargs):
        spawned.append(kwargs)
        raise _Spawned()

    monkeypatch.setattr(launch, "launch_ranks", spawn)
    return spawned


class _Spawned(Exception):
    pass


@pytest.mark.parametrize("device", ["cuda", "auto"], ids=["device-cuda", "device-auto"])  # (an id "cuda" marks it)
def test_ranks_on_cuda_need_one_gpu_each_refused_before_spawning(monkeypatch, capsys, device):
    monkeypatch.delenv("GRAPHRUNNER_DEVICE", raising=False)  # "auto" is CUDA here
    spawned = _fake_cuda(monkeypatch, gpus=1)
    code, out, err = _cli(capsys, "--device", device, "--ranks", "2")
    assert code == 2 and out == "" and err.count("\n") == 1, err
    assert "--ranks 2 on CUDA needs 2 GPUs, one per rank, and this machine has 1" in err and "--device tape" in err
    with pytest.raises(ValueError, match="needs 2 GPUs"):
        lt.run_loadtest(_cfg(ranks=2, device=device))
    assert spawned == []  # nothing was started


def test_ranks_on_cuda_need_nccl(monkeypatch, capsys):
    spawned = _fake_cuda(monkeypatch, gpus=2, nccl=False)
    code, _, err = _cli(capsys, "--device", "cuda", "--ranks", "2")
    assert code == 2 and "needs NCCL" in err and "is_nccl_available() is False" in err, err
    assert spawned == []


def test_ranks_on_cuda_with_a_gpu_each_spawn_over_nccl(monkeypatch):
    """The decision: N GPUs and NCCL -> N processes over NCCL; the tape (or one rank) -> gloo. Negative
    control: the refusal above is about the GPU count, not about CUDA at all."""
    spawned = _fake_cuda(monkeypatch, gpus=2)
    with pytest.raises(_Spawned):
        lt.run_loadtest(_cfg(ranks=2, device="cuda"))
    assert spawned[0]["backend"] == "nccl"
    assert lt.rank_backend(_cfg(ranks=2, device="tape")) == "gloo"
    assert lt.rank_backend(_cfg(ranks=1, device="cuda")) == "gloo"  # one rank: no process group
    monkeypatch.setenv("GRAPHRUNNER_DEVICE", "tape")  # what "auto" means in the suite
    assert lt.rank_backend(_cfg(ranks=4, device="auto")) == "gloo"
    monkeypatch.delenv("GRAPHRUNNER_DEVICE")
    with pytest.raises(ValueError, match="--ranks 4 on CUDA needs 4 GPUs, one per rank, and this machine has 2"):
        lt.rank_backend(_cfg(ranks=4, device="auto"))


# --------------------------------------------------------------------------- the command line
def _cli(capsys, *args):
    from graphrunner_tools.cli import main

    code = main(["loadtest", *args])
    cap = capsys.readouterr()
    return code, cap.out, cap.err


@pytest.mark.parametrize(
    "args, words",
    [
        (["--ranks", "0"], "--ranks"),
        (["--concurrency", "4,x"], "--concurrency"),
        (["--inject-fault", "stall"], "needs --ranks 2"),
        (["--inject-fault", "crash"], "--inject-fault"),
        (["--ranks", "3"], "split over 3 ranks"),
        (["--dp", "3"], "split over 3 ranks"),
        (["--dp", "2", "--tp", "2", "--ranks", "3"], "--dp x --tp = 4"),
        (["--prompt-len", "5,2"], "--prompt-len"),
        (["--timeout", "0"], "--timeout"),
        (["--backend", "eager"], "--backend"),
        (["--spec", "-1"], "--spec"),
        (["--json", "/proc/nope/out.json"], "--json"),
    ],
)
def test_cli_usage_errors_are_one_line_exit_2(capsys, args, words):
    code, out, err = _cli(capsys, *args)
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("graphrunner: error: ") and words in lines[0], err
    assert out == ""


def test_cli_passes_writes_json_and_exits_1_on_a_planted_mismatch(capsys, tmp_path):
    out = tmp_path / "lt.json"
    small = [
        "--requests",
        "6",
        "--concurrency",
        "2,4",
        "--layers",
        "1",
        "--prompt-len",
        "2,6",
        "--output-len",
        "1,6",
        "--no-progress",
    ]
    code, stdout, err = _cli(capsys, *small, "--json", str(out))
    assert code == 0, stdout + err
    lines = [x for x in stdout.splitlines() if x.startswith("C")]
    assert [x.split(":")[0] for x in lines] == ["C2", "C4"]
    assert all(" 6/6 requests, 0 faults, 0 mismatches, " in x and "x)" in x for x in lines), stdout
    doc = json.loads(out.read_text())
    assert doc["ranks"] == 1 and doc["backend"] == "breakable"
    assert [lv["concurrency"] for lv in doc["levels"]] == [2, 4]
    assert all(list(lv) == list(lt.LEVEL_KEYS) and lv["completed"] == 6 for lv in doc["levels"])
    assert all(math.isfinite(lv["tokens_per_s"]) for lv in doc["levels"])
    # the schedule: one batch size per decode step, each at most the level's concurrency, summing to the
    # tokens decoded after each request's first (prefill) token
    for lv in doc["levels"]:
        assert lv["schedule"] and max(lv["schedule"]) <= lv["concurrency"]
        assert sum(lv["schedule"]) == lv["generated_tokens"] - lv["completed"]
    from graphrunner_tools.cli import main  # graphrunner plan reads it

    assert main(["plan", str(out), "--max-graphs", "2"]) == 0
    import re

    assert re.search(r"\n  planned +2 ", capsys.readouterr().out)
    code, stdout, err = _cli(capsys, *small, "--inject-fault", "mismatch")
    assert code == 1, stdout + err
    assert "C2: 6/6 requests, 0 faults, 1 mismatches" in stdout and "FAIL" in stdout


# --------------------------------------------------------------------------- graphrunner bench
def test_bench_sweep_script_reports_graph_and_eager_per_level(tmp_path, capsys):
    from graphrunner_tools import bench as grbench

    merged = grbench.run_suite(
        out=tmp_path / "bench.json", plot=None, quick=True, only=["loadtest_sweep"], echo=lambda s: None
    )
    assert merged["errors"] == {}
    sweep = merged["results"]["loadtest_sweep"]
    assert sweep["failures"] == [] and [lv["concurrency"] for lv in sweep["levels"]] == [2, 8]
    for lv in sweep["levels"]:
        assert lv["speedup"] == pytest.approx(lv["tokens_per_s"] / lv["eager_tokens_per_s"])
        assert lv["p99_step_ms"] > 0 and lv["eager_p99_step_ms"] > 0
    rows = grbench.loadtest_table(merged["summary"]["loadtest_sweep"]["levels"])
    assert rows[0].split() == [
        "C",
        "graph",
        "tok/s",
        "eager",
        "tok/s",
        "ratio",
        "graph",
        "p99",
        "ms",
        "eager",
        "p99",
        "ms",
    ]
    assert [r.split()[0] for r in rows[1:]] == ["2", "8"]
    assert grbench.loadtest_table([{"concurrency": 4}])[1].split() == ["4", "-", "-", "-", "-", "-"]


@pytest.mark.parametrize("backend", ["full", "breakable"])
def test_background_capture_serves_every_token_equal_to_eager(capsys, tmp_path, backend):
    """``--background-capture``: the graph runner captures while the first level is served (its prefills
    held off the capture with ``runner.hold()``); every token equals the eager engine's."""
    out = tmp_path / "bg.json"
    code, stdout, err = _cli(
        capsys,
        "--requests",
        "12",
        "--concurrency",
        "4,8",
        "--layers",
        "1",
        "--backend",
        backend,
        "--background-capture",
        "--no-progress",
        "--json",
        str(out),
    )
    assert code == 0, stdout + err
    doc = json.loads(out.read_text())
    assert doc["background_capture"] is True
    first, second = doc["levels"]
    assert first["mismatches"] == second["mismatches"] == 0 and first["completed"] == second["completed"] == 12
    assert first["first_decode_s"] > 0 and second["first_decode_s"] is None
    assert "first decode step" in stdout and second["replays"] > 0  # captured by the second level
