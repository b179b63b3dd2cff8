"""``graphrunner_tools.launch``: the tools' ranks started by torch's elastic launcher (``launch_ranks``)
and a torchrun worker's environment (``torchrun_env``), with the command lines' refusals under it.

The ranks are real processes (gloo); the reference for what a rank computed is worked out here
by hand (the sum of the ranks, each rank's own pid)."""

from __future__ import annotations

import os
import signal
import time

import pytest

from graphrunner_tools import launch
from graphrunner_tools.launch import PartialResult, launch_ranks, torchrun_env


# --------------------------------------------------------------------------- rank functions (top level: spawned)
def _sum_of_ranks(rank, world, pid_dir):
    import torch
    import torch.distributed as dist

    with open(os.path.join(pid_dir, f"{rank}"), "w") as f:
        f.write(str(os.getpid()))
    t = torch.tensor([rank + 1])
    dist.all_reduce(t)
    env = {k: os.environ.get(k) for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "TORCHELASTIC_RUN_ID")}
    return {"sum": int(t), "backend": dist.get_backend(), "env": env, "threads": torch.get_num_threads()}


def _one_fails(rank, world, how, pid_dir):
    with open(os.path.join(pid_dir, f"{rank}"), "w") as f:
        f.write(str(os.getpid()))
    if rank == 1:
        if how == "raise":
            raise PartialResult({"done": 3}, "rank 1 planted failure")
        if how == "signal":
            os.kill(os.getpid(), signal.SIGKILL)
        return {"done": 7}  # "none": the negative control, nobody fails
    time.sleep(60 if how != "none" else 0.5)  # far beyond the run: only its peer's failure can end it early
    return {"done": 5}


def _rank0_hangs(rank, world, pid_dir):
    with open(os.path.join(pid_dir, f"{rank}"), "w") as f:
        f.write(str(os.getpid()))
    if rank == 0:
        time.sleep(3600)
    return rank


def _alive(pid):
    """Whether ``pid`` is a live (not zombie) process."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _pids(pid_dir):
    return [int(open(os.path.join(pid_dir, n)).read()) for n in sorted(os.listdir(pid_dir))]


# --------------------------------------------------------------------------- launch_ranks on real processes
@pytest.mark.slow
@pytest.mark.multirank
def test_launch_ranks_runs_each_rank_as_a_torchrun_worker(tmp_path):
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    env_before = os.environ.get("TORCHELASTIC_SIGNALS_TO_HANDLE")
    outcomes = launch_ranks(_sum_of_ranks, 2, args=(str(tmp_path),), timeout=120)
    assert [o.ok for o in outcomes] == [True, True], [o.error for o in outcomes]
    assert [o.exitcode for o in outcomes] == [0, 0]
    for r, o in enumerate(outcomes):
        assert o.value["sum"] == 1 + 2  # (rank + 1) summed over both ranks by the group's all_reduce
        assert o.value["backend"] == "gloo" and o.value["threads"] == 1
        env = o.value["env"]
        assert (env["RANK"], env["LOCAL_RANK"], env["WORLD_SIZE"]) == (str(r), str(r), "2")
        assert env["MASTER_ADDR"] == "127.0.0.1" and env["TORCHELASTIC_RUN_ID"].startswith("graphrunner-")
    assert not any(_alive(p) for p in _pids(tmp_path))
    # the elastic launcher installs its own signal handlers and leaves them: launch_ranks puts ours back
    assert {s: signal.getsignal(s) for s in handlers} == handlers
    assert os.environ.get("TORCHELASTIC_SIGNALS_TO_HANDLE") == env_before


@pytest.mark.slow
@pytest.mark.multirank
@pytest.mark.parametrize("how", ["raise", "signal", "none"])
def test_a_failed_rank_ends_the_run_on_every_rank(tmp_path, how):
    t0 = time.monotonic()
    outcomes = launch_ranks(_one_fails, 2, args=(how, str(tmp_path)), timeout=120)
    elapsed = time.monotonic() - t0
    assert not any(_alive(p) for p in _pids(tmp_path))  # no orphan: both ranks are gone
    if how == "none":  # negative control: without a failure rank 0 finishes its own work
        assert [o.value for o in outcomes] == [{"done": 5}, {"done": 7}] and all(o.ok for o in outcomes)
        return
    # bounds that rank 0's 60 s sleep was cut short by the launcher, not waited out
    assert elapsed < 55, elapsed
    rank0, rank1 = outcomes
    assert not rank0.ok and rank0.value is None
    assert rank0.error == "rank 0 was stopped by torch's launcher before it reported, after rank 1 failed"
    assert not rank1.ok
    if how == "raise":
        assert rank1.error == "PartialResult: rank 1 planted failure" and rank1.value == {"done": 3}
        assert "planted failure" in rank1.traceback and rank1.exitcode == 1
    else:
        assert rank1.error.startswith("rank 1 killed by SIGKILL without reporting") and rank1.exitcode == -9


@pytest.mark.slow
@pytest.mark.multirank
def test_a_hung_rank_is_killed_at_the_deadline(tmp_path):
    t0 = time.monotonic()
    outcomes = launch_ranks(_rank0_hangs, 2, args=(str(tmp_path),), timeout=15)
    elapsed = time.monotonic() - t0
    # bounds the deadline (15 s) plus the launcher's stop (SIGTERM, SIGKILL after 5 s) and spawn, far below 3600 s
    assert elapsed < 60, elapsed
    assert outcomes[0].timed_out and not outcomes[0].ok
    assert outcomes[0].error == "rank 0 still running at the deadline (15s after the start): killed"
    assert outcomes[1].ok and outcomes[1].value == 1  # it had reported before the deadline
    assert not any(_alive(p) for p in _pids(tmp_path))


def test_launch_ranks_refuses_bad_arguments():
    with pytest.raises(ValueError, match="world_size must be >= 1"):
        launch_ranks(_sum_of_ranks, 0)
    with pytest.raises(ValueError, match="timeout must be > 0"):
        launch_ranks(_sum_of_ranks, 2, timeout=0)
    with pytest.raises(ValueError, match="backend must be 'gloo' or 'nccl'"):
        launch_ranks(_sum_of_ranks, 2, backend="mpi")


# --------------------------------------------------------------------------- torchrun's environment
FULL = {
    "RANK": "3",
    "WORLD_SIZE": "4",
    "MASTER_ADDR": "10.0.0.1",
    "MASTER_PORT": "29500",
    "LOCAL_RANK": "1",
    "LOCAL_WORLD_SIZE": "2",
}


def test_torchrun_env_reads_a_workers_environment():
    assert torchrun_env({}) is None and torchrun_env({"PATH": "/bin"}) is None
    env = torchrun_env(FULL)
    assert (env.rank, env.world_size, env.local_rank, env.local_world_size) == (3, 4, 1, 2)
    assert (env.master_addr, env.master_port) == ("10.0.0.1", 29500)
    one_node = torchrun_env({k: FULL[k] for k in launch.TORCHRUN_VARS})
    assert (one_node.local_rank, one_node.local_world_size) == (3, 4)


@pytest.mark.parametrize(
    "env, words",
    [
        ({"RANK": "0", "WORLD_SIZE": "2"}, "sets RANK, WORLD_SIZE but not MASTER_ADDR, MASTER_PORT"),
        (dict(FULL, RANK="x"), "is not an integer"),
        (dict(FULL, RANK="4"), "RANK=4 is not in [0, WORLD_SIZE=4)"),
    ],
)
def test_torchrun_env_refuses_a_half_set_environment(env, words):
    with pytest.raises(ValueError) as info:
        torchrun_env(env)
    assert words in str(info.value) and "torchrun" in str(info.value)


def _set(monkeypatch, env):
    for k in FULL:
        monkeypatch.delenv(k, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)


@pytest.mark.parametrize("command", ["loadtest", "verify"])
@pytest.mark.parametrize(
    "env, argv, words",
    [
        ({"RANK": "0", "WORLD_SIZE": "2"}, [], "sets RANK, WORLD_SIZE but not MASTER_ADDR"),
        (dict(FULL, RANK="0"), ["--ranks", "2"], "--ranks: 2, but this process is a torchrun worker of WORLD_SIZE=4"),
    ],
)
def test_cli_under_a_torchrun_environment_refuses_what_cannot_run(monkeypatch, capsys, command, env, argv, words):
    """Nothing starts: the usage error comes before the group is joined (which would wait for peers)."""
    from graphrunner_tools.cli import main

    _set(monkeypatch, env)
    assert main([command, *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("graphrunner: error:") and words in err and len(err.strip().splitlines()) == 1, err


def test_cli_loadtest_dp_tp_must_make_torchruns_world(monkeypatch, capsys):
    from graphrunner_tools.cli import main

    _set(monkeypatch, dict(FULL, RANK="0"))
    assert main(["loadtest", "--dp", "2", "--tp", "1"]) == 2
    err = capsys.readouterr().err
    assert "--dp x --tp = 2, but torchrun started WORLD_SIZE=4 ranks" in err and len(err.strip().splitlines()) == 1


def test_run_loadtest_refuses_ranks_other_than_torchruns(monkeypatch):
    from graphrunner_tools import loadtest as lt

    _set(monkeypatch, dict(FULL, RANK="0"))
    with pytest.raises(ValueError, match="ranks=2, but this process is rank 0 of a torchrun job of WORLD_SIZE=4"):
        lt.run_loadtest(lt.LoadtestConfig(ranks=2, requests=2, concurrency=(1,), progress=False))


def test_every_row_of_the_failure_table_names_a_test_that_exists():
    """docs/multirank.md's "Failure -> what every rank sees": each row's test is a real test (file,
    function, parameter id), so the table cannot drift from the suite."""
    import pathlib
    import re

    root = pathlib.Path(__file__).resolve().parent.parent
    text = (root / "docs" / "multirank.md").read_text()
    table = text.split("### Failure -> what every rank sees", 1)[1].split("\n## ", 1)[0]  # up to the next section
    rows = [line for line in table.splitlines() if line.startswith("| ") and "tests/" in line]
    assert len(rows) >= 8
    for row in rows:
        node = re.search(r"`(tests/[\w/]+\.py)::(\w+)(?:\[(\w+)\])?`", row)
        assert node, row
        path, name, param = node.groups()
        source = (root / path).read_text()
        assert re.search(rf"^def {name}\(", source, re.M), (path, name)
        if param:
            assert re.search(rf"""["']{param}["']""", source), (path, name, param)


_INTERRUPTED = """
import sys, time
sys.path.insert(0, {root!r})
from graphrunner_tools.launch import launch_ranks

def hang(rank, world, pid_dir):
    import os
    with open(os.path.join(pid_dir, str(rank)), "w") as f:
        f.write(str(os.getpid()))
    time.sleep(3600)

if __name__ == "__main__":
    try:
        launch_ranks(hang, 2, args=({pid_dir!r},), timeout=600)
    except KeyboardInterrupt:
        print("KeyboardInterrupt after the launch")
        sys.exit(130)
"""


@pytest.mark.slow
@pytest.mark.multirank
def test_ctrl_c_stops_every_rank_and_raises_keyboard_interrupt(tmp_path):
    import pathlib
    import subprocess
    import sys

    root = str(pathlib.Path(__file__).resolve().parent.parent)
    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()
    script = tmp_path / "interrupted.py"
    script.write_text(_INTERRUPTED.format(root=root, pid_dir=str(pid_dir)))
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 120
    while len(os.listdir(pid_dir)) < 2 and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.2)
    assert len(os.listdir(pid_dir)) == 2, proc.communicate(timeout=30)[0]
    proc.send_signal(signal.SIGINT)
    out = proc.communicate(timeout=60)[0]
    assert proc.returncode == 130 and "KeyboardInterrupt after the launch" in out, out
    assert not any(_alive(p) for p in _pids(pid_dir))  # the ranks were stopped, not orphaned
