"""Gradients averaged through /dev/shm: the same numbers as gloo, a fallback that needs no help, nothing left behind;
the barrier and the stop flag in shared memory."""

import json
import os
import subprocess
import threading
import time

import pytest
import torch
from support import TINY, assert_ok, cli, run_cli, standalone, subprocess_env

from mingpt.reporting.logs import read_metrics


def test_three_processes_average_exactly_or_fall_back_together_and_leave_no_files(tmp_path):
    shm_dir, out = tmp_path / "shm", tmp_path / "result.json"
    shm_dir.mkdir()
    cmd = cli([str(shm_dir), str(out)], standalone(3), script="tests/shm_worker.py")
    proc = subprocess.run(cmd, cwd=tmp_path, env=subprocess_env(tmp_path), capture_output=True, text=True,
                          timeout=180)
    assert_ok(proc)
    results = json.loads(out.read_text())

    ok = results["ok"]
    assert ok["reducer"] and ok["reductions"] == 5
    assert ok["means_exact"] and ok["same_bits"]
    assert ok["files_left"] == []  # unlinked as soon as every rank had mapped them
    assert "expects one fp32 bucket of 1001 elements, got 1002" in ok["wrong_size_error"]
    # A rank on "another host" (another folder) or without room: every rank falls back, nothing is left anywhere.
    assert results["other_host"] == {"reducer": False, "files_left": [], "files_left_elsewhere": []}
    assert results["no_room"] == {"reducer": False, "files_left": [], "files_left_elsewhere": []}


def test_training_through_shared_memory_equals_gloo_bit_for_bit(tmp_path):
    """2 ranks: both compute a/2 + b/2 (DDP divides before gloo sums; addition commutes): identical runs."""
    runs = {}
    for shm in ("true", "false"):
        args = [*TINY, "trainer_config.max_steps=16", "trainer_config.log_every_steps=2",
                f"trainer_config.shared_memory_allreduce={shm}", f"hydra.run.dir={tmp_path / ('run_' + shm)}",
                f"trainer_config.snapshot_path={tmp_path / ('snaps_' + shm)}"]
        proc = run_cli(args, tmp_path, nproc=2)
        assert_ok(proc)
        runs[shm] = proc.stdout + proc.stderr
        assert read_metrics(tmp_path / f"run_{shm}")
    assert "gradients are averaged through shared memory (/dev/shm)" in runs["true"]
    assert "gradients are averaged by gloo (trainer_config.shared_memory_allreduce=false)" in runs["false"]
    def numbers(run: str) -> list[dict]:  # everything but the timings
        timing = {"tokens_per_s", "ms_per_step", "elapsed_s", "eval_s"}
        return [{k: v for k, v in row.items() if k not in timing} for row in read_metrics(tmp_path / f"run_{run}")]

    assert numbers("true") == numbers("false")
    sha = [line.split("sha256 ")[1].split()[0] for line in (runs["true"], runs["false"]) for line in line.splitlines()
           if "weights identical on all 2 rank(s)" in line]
    assert len(sha) == 2 and sha[0] == sha[1]
    assert not [f for f in os.listdir("/dev/shm") if f.startswith("mingpt-")]


def _ranks_in_threads(world: int, n: int) -> list:
    """`world` reducers over plain memory, as ranks in threads of this process would use them (spinning barrier)."""
    import numpy as np

    from mingpt.parallel.shm_allreduce import PID, START, SharedMemoryAllReduce, _start_time

    halves = [[torch.zeros(n) for _ in range(world)] for _ in range(2)]
    controls = [np.zeros(8, dtype=np.int64) for _ in range(world)]
    for control in controls:
        control[PID], control[START] = os.getpid(), _start_time(os.getpid())
    return [SharedMemoryAllReduce(halves, controls, rank, None, spin=True) for rank in range(world)]


def test_the_stop_flag_rides_on_the_reduction_and_every_rank_stops_after_the_same_step():
    """stopping.CarriedVote: rank 1 is asked to stop after step 2; step 3's reduction carries it, and both ranks
    agree after step 3 (as StopVote's one-step-later agreement), with exact averages all along."""
    from mingpt.distributed.stopping import CarriedVote

    reducers = _ranks_in_threads(2, 1001)
    seen: dict[int, list] = {0: [], 1: []}

    def rank(r: int) -> None:
        vote = CarriedVote(reducers[r])
        for step in range(1, 6):
            mine = torch.full((1001,), float(step * (r + 1)))
            got = reducers[r].average(mine)
            seen[r].append((torch.equal(got, torch.full((1001,), step * 1.5)), vote.cast(r == 1 and step == 2)))

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    expected = [(True, False), (True, False), (True, True), (True, False), (True, False)]
    assert seen == {0: expected, 1: expected}


def test_a_rank_whose_peer_process_is_gone_raises_instead_of_waiting():
    """gloo would notice the closed connection; the shared-memory barrier looks for the peer's process."""
    from mingpt.parallel.shm_allreduce import PID

    reducers = _ranks_in_threads(2, 16)
    ended = subprocess.Popen(["true"])
    ended.wait()
    reducers[0].controls[1][PID] = ended.pid  # rank 1 is now a process that has ended (and been reaped)
    started = time.monotonic()
    with pytest.raises(RuntimeError, match=f"rank 1 \\(process {ended.pid}\\) is gone"):
        reducers[0].average(torch.ones(16))
    assert time.monotonic() - started < 2
