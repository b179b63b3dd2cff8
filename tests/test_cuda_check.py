"""scripts/cuda-check.sh and its checks (graphrunner_tools.cuda_check) on the CUDA stand-in.

The whole dry run (``scripts/cuda-check.sh --dry-run``, about 150 s on a 2-core CPU) is a
documented command, not part of the suite; these run its pieces that the suite does not
already cover (the cuda-marked tests of tests/test_cuda_conformance.py run the defects):
the demo, the 2-rank loadtest's refusal (fewer GPUs than ranks, or no NCCL) and
gr.hf.DecodeRunner on a CudaDevice, and the script's refusal without CUDA.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from graphrunner_tools import cuda_check

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_the_script_without_cuda_and_without_dry_run_exits_2(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("has a GPU")
    env = {**os.environ, "OUT": str(tmp_path), "PYTHON": sys.executable}
    env.pop("GRAPHRUNNER_CUDA_STANDIN", None)
    p = subprocess.run(
        ["bash", os.path.join(REPO, "scripts", "cuda-check.sh")], env=env, capture_output=True, text=True, timeout=120
    )
    assert p.returncode == 2, p.stdout + p.stderr
    assert "--dry-run" in (tmp_path / "summary.txt").read_text()


def test_memory_check_on_the_standin(cuda_standin, tmp_path):
    ok, line, data = cuda_check.check_memory(str(tmp_path))
    assert ok, line
    sizes = [r["reserved_bytes"] for r in data["per_bucket"]]
    assert sizes == sorted(sizes) and sizes[0] > 0  # each bucket's graph adds to the pool
    assert data["after_empty_cache"] == 0  # the released pool is freed by empty_cache()
    assert data["after_cleanup"] == sizes[-1]  # cleanup releases, empty_cache frees


def test_demo_on_a_cuda_device(cuda_standin, one_torch_thread, tmp_path):
    import io

    from graphrunner_tools.demo import run_demo

    out = io.StringIO()
    result = run_demo(
        backend="breakable",
        device="cuda",
        steps=12,
        buckets=(1, 2, 4),
        max_batch=6,
        layers=2,
        progress=False,
        trace_out=str(tmp_path / "trace"),
        out=out,
    )
    assert result.ok, out.getvalue()
    assert "device=cuda" in out.getvalue()


@pytest.mark.slow
@pytest.mark.parametrize(
    "devices,words",
    [
        ("1", "--ranks 2 on CUDA needs 2 GPUs, one per rank, and this machine has 1"),
        ("2", "--ranks 2 on CUDA needs NCCL"),
    ],
)
def test_loadtest_two_ranks_on_cuda_is_refused_before_spawning(devices, words):
    """A tensor-parallel step on CUDA captures an all_reduce, which only NCCL allows, one GPU per rank: on the
    stand-in with 1 GPU, and with 2 but a CPU torch without NCCL, the command says so at once (exit 2, one
    line), before any rank process starts (on a GPU machine: the loadtest-ranks step of scripts/cuda-check.sh)."""
    if torch.cuda.is_available():
        pytest.skip("on a GPU this is the loadtest-ranks step of scripts/cuda-check.sh")
    env = {**os.environ, "PYTHONPATH": REPO, "GRAPHRUNNER_CUDA_STANDIN_DEVICES": devices}
    env.pop("GRAPHRUNNER_DEVICE", None)
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "graphrunner.testing.cuda_standin",
            "graphrunner_tools",
            "loadtest",
            "--device",
            "cuda",
            "--ranks",
            "2",
            "--requests",
            "4",
            "--concurrency",
            "2",
            "--layers",
            "1",
            "--no-progress",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )
    assert p.returncode == 2 and p.stdout == "", p.stdout + p.stderr
    assert p.stderr.count("\n") == 1 and words in p.stderr, p.stderr


@pytest.mark.hf
def test_decode_runner_on_a_cuda_device(cuda_standin, one_torch_thread):
    pytest.importorskip("transformers")
    import graphrunner as gr
    from graphrunner.devices import CudaDevice
    from graphrunner_tools.models.hf_tiny import build_tiny

    dev = CudaDevice()
    model = build_tiny("llama", seed=0)
    ids = torch.randint(3, 128, (3, 5), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        ref = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False, cache_implementation="static"
        )
    runner = gr.hf.DecodeRunner(model, max_batch=4, max_cache_len=16, buckets=[1, 2, 4], device=dev)
    got = runner.generate(ids, max_new_tokens=4)
    assert torch.equal(torch.as_tensor(got), ref)
