"""bench/soak.py runs end to end (few steps): every rank reports, no mismatch, JSON written."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

from graphrunner_tools.bench import load_script

pytestmark = [pytest.mark.multirank, pytest.mark.slow]  # slow: spawns rank processes (-m "not slow" skips it)

SOAK = pathlib.Path(__file__).resolve().parent.parent / "bench" / "soak.py"


def test_soak_smoke(tmp_path):
    # A subprocess: the spawned ranks import the script as the main module.
    out = tmp_path / "soak.json"
    env = dict(os.environ, PYTHONPATH=str(SOAK.parent.parent) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run(
        [sys.executable, str(SOAK), "--ranks", "2", "--steps", "60", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=180,
        env=env,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "soak: OK" in proc.stdout
    data = json.loads(out.read_text())
    assert data["ok"] and len(data["per_rank"]) == 2
    for r in data["per_rank"]:
        assert r["steps"] == 60 and r["mismatches"] == 0
        assert r["replays"] + r["fallbacks"] == 60
        assert r["rss_mib"], r
    assert "torch_threads" in data["environment"] and data["threads_per_rank"] == 1


def test_soak_reference_is_the_all_reduced_sum():
    """The soak's reference, checked by hand for one step: the sum over ranks
    of each rank's shard applied to its own (zero-padded) rows."""
    import torch

    soak = load_script(SOAK, "soak_ref")
    gen = torch.Generator().manual_seed(0)
    w1, w2 = torch.randn(soak.D, soak.H, generator=gen), torch.randn(soak.H, soak.D, generator=gen)
    n = 3
    want = torch.zeros(n, soak.D)
    for r in range(2):
        x = soak._batch(7, r)
        rows = torch.zeros(n, soak.D)
        rows[: min(n, x.shape[0])] = x[:n]
        half = slice(r * soak.H // 2, (r + 1) * soak.H // 2)
        want += torch.relu(rows @ w1[:, half]) @ w2[half]
    assert torch.allclose(soak._reference(7, 0, 2, n, w1, w2), want, atol=1e-5)
