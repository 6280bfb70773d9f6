"""How a job begins and ends, with real torchrun processes: a rerun of a finished job, a torchrun agent that dies
(its workers must not train on as orphans), one rank that fails (the others end within seconds, the error is
printed once), SIGTERM while a peer is stuck (the rank leaves within trainer_config.stop_timeout_s), and more
SIGTERMs after a stop was agreed (they must not end it)."""

import os
import signal
import subprocess
import time

from support import (
    PYTHON,
    Case,
    Fault,
    alive,
    assert_ok,
    children,
    job_args,
    kill_all,
    logged_step,
    read_summary,
    run_case,
    run_cli,
    start_cli,
    wait_for,
)

from mingpt import PROJECT_DIR
from mingpt.checkpoint import store as snap


def test_rerun_of_a_finished_job_says_so_and_exits_0(tmp_path):
    snaps = tmp_path / "snaps"
    first = run_cli(job_args(snaps, tmp_path / "run1", max_steps=20, save_every_steps=10), tmp_path)
    assert_ok(first)
    # Again, as `make run` twice does: a new run directory, nothing to train. Under torchrun, where a crash at the
    # end would use up every restart.
    again = run_cli(job_args(snaps, tmp_path / "run2", max_steps=20, save_every_steps=10, report_at_end="true"),
                    tmp_path, nproc=2)
    assert_ok(again)
    assert again.stdout.count("nothing to train") == 1, again.stdout[-3000:]
    assert "raise trainer_config.max_steps or trainer_config.max_epochs" in again.stdout
    assert "Traceback" not in again.stderr and "training: steps" not in again.stdout
    assert not (tmp_path / "run2" / "loss.png").exists()  # no plot or sample of a run that trained nothing
    assert read_summary(tmp_path / "run2")["steps"] == 20
    assert [e.step for e in snap.SnapshotStore(str(snaps)).entries()] == [20, 10]  # nothing written

    # The same error on every rank (a snapshot of another shape) is printed once, not once per rank.
    other = run_cli(job_args(snaps, tmp_path / "run3", "gpt_config.n_layer=3", max_steps=30, save_every_steps=10),
                    tmp_path, nproc=2)
    assert other.returncode != 0
    errors = [line for line in other.stderr.splitlines() if "error:" in line and "n_layer" in line]
    assert len(errors) == 1, other.stderr[-3000:]


def test_workers_of_a_killed_agent_stop_and_a_rerun_ends_as_if_uninterrupted(tmp_path):
    steps = 400  # ~10 s of training on 2 cores: orphans that trained on would still be at it when checked
    args = tuple(job_args("{s}", "{d}/run", max_steps=steps, save_every_steps=10))
    # The agent only SIGKILLed, as the OOM killer would: its workers must stop by themselves, within seconds.
    killed = run_case(Case("agent", args, nproc=2, fault=Fault(at_step=20, victim="agent", restarts=0),
                           exit_code=-9, expect=("stop requested (SIGTERM)",)), tmp_path)
    assert killed.workers_gone_s < 10, killed.workers_gone_s
    snaps, stopped_at = tmp_path / "snaps", logged_step(tmp_path / "run")
    assert stopped_at < steps - 50, stopped_at  # they stopped; they did not finish the job
    assert not [p.name for p in snaps.iterdir() if ".tmp-" in p.name]  # nothing half-written
    for entry in snap.SnapshotStore(str(snaps)).entries():
        snap.read_snapshot(str(snaps / entry.name))  # every snapshot there reads back intact
    # The user runs the command again: it resumes and ends with the weights of a run that was never interrupted.
    run_case(Case("rerun", args, nproc=2, reference=True, expect=("resumed from",)), tmp_path)


def test_one_rank_failing_ends_every_rank_within_seconds_with_one_report(tmp_path):
    run_dir = tmp_path / "run"
    (run_dir / "metrics.jsonl").mkdir(parents=True)  # rank 0's first metrics write fails; rank 1 writes none
    job = start_cli(job_args(tmp_path / "snaps", run_dir, max_steps=100000, save_every_steps=1000), tmp_path, nproc=2)
    log_path = tmp_path / "launch.log"
    try:
        wait_for(lambda: "IsADirectoryError" in log_path.read_text() or job.poll() is not None, timeout=120,
                 what="rank 0's failure")
        failed_at = time.monotonic()
        code = job.wait(timeout=60)
        ended_after = time.monotonic() - failed_at
    finally:
        kill_all([*children(job.pid), job.pid])
    log = log_path.read_text()
    assert code != 0
    assert ended_after < 10, (ended_after, log[-3000:])
    assert log.count("IsADirectoryError: [Errno 21]") == 1, log[-5000:]  # rank 0's traceback, once
    assert "[rank 1]" not in log and "Connection closed" not in log, log[-5000:]  # rank 1 adds nothing


def test_sigterm_with_a_stuck_peer_leaves_within_the_stop_timeout(tmp_path):
    run_dir = tmp_path / "run"
    args = job_args(tmp_path / "snaps", run_dir, "trainer_config.stop_timeout_s=3", max_steps=100000,
                    save_every_steps=1000)
    job = start_cli(args, tmp_path, nproc=2)
    workers: list[int] = []
    try:
        wait_for(lambda: logged_step(run_dir) >= 5, timeout=120, what="step 5")
        workers = children(job.pid)
        os.kill(workers[1], signal.SIGSTOP)  # a peer that neither answers nor closes its connections
        time.sleep(1)  # the other rank is now blocked in a collective with it
        os.kill(workers[0], signal.SIGTERM)
        signalled_at = time.monotonic()
        wait_for(lambda: not alive(workers[0]), timeout=30, what="the signalled rank to leave")
        left_after = time.monotonic() - signalled_at
    finally:
        kill_all([*workers, job.pid])
        job.wait()
    log = (tmp_path / "launch.log").read_text()
    assert 2.5 < left_after < 8, (left_after, log[-3000:])
    assert log.count("could not agree with the other ranks to stop within 3 s") == 1, log[-3000:]


def test_a_stop_under_way_outlives_more_sigterms():
    """A dying torchrun agent's PR_SET_PDEATHSIG comes once per thread of the agent: the worker may get SIGTERM again
    after it agreed to stop; that must not end it while it writes its snapshot."""
    code = """if True:
        import os, signal, time, torch
        from mingpt.distributed.stopping import StopRequest
        stop = StopRequest(0, torch.device("cpu"), None, 5.0, lambda: None)
        with stop.watch():
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.01)
            assert stop.agreed()
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.01)
        print("still here")"""
    result = subprocess.run([PYTHON, "-c", code], cwd=PROJECT_DIR, capture_output=True, text=True, timeout=60)
    assert (result.returncode, result.stdout.strip()) == (0, "still here"), result.stderr[-2000:]
