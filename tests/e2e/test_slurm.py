"""slurm/sbatch_run.sh under a real SLURM (slurmctld, slurmd and munge on 127.0.0.1, tests/slurm_cluster.py), two CPU
workers on one core of the node: a job trains to the end; a job at its time limit snapshots, requeues itself and,
preempted in its next allocation, snapshots again and finishes in a later one; scancel leaves loadable snapshots and
no process. The interrupted job ends with the weights of the uninterrupted one."""

from __future__ import annotations

import os
import re
import sys
import time
from pathlib import Path

import pytest
from support import PROJECT_DIR, TINY, free_port, read_summary, subprocess_env, wait_for

from mingpt.checkpoint import store as snapshot

# The jobs' two workers share one core (tests/slurm_cluster.py pins slurmd): 18 ms a step, so about 72 s of training,
# against 12.6 ms on two quiet cores (6,000 steps took 75 s there, keeping both cores busy): longer than a 1-minute
# job runs before its early signal (below, at most 40 s in), with room for a faster machine (on two cores 4,000
# steps once finished before the signal came, at 5 ms a step: 1.43 times that is 29 s for these 4,000).
STEPS = 4000
TRAINING = [*TINY, f"trainer_config.max_steps={STEPS}", "trainer_config.max_epochs=100",
            "trainer_config.log_every_steps=500", "trainer_config.eval_every_steps=1000"]
# A 1-minute time limit with SIGUSR1 50 s before it: SLURM checks time limits every 30 s, so the signal comes 10 to
# 40 s after the start, and the first allocation trains for a part of the run.
TIME_LIMITED = ["--time=1", "--signal=B:USR1@50"]
FINISHING_TIME_LIMIT_MIN = 30  # what a time-limited job gets once an allocation has saved (below)
JOB_TIMEOUT_S = 600
ENDED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY")


class Job:
    """One submission of slurm/sbatch_run.sh, with its own snapshots, run directory and output file."""

    def __init__(self, cluster, folder: Path, *sbatch_args: str) -> None:
        self.cluster, self.folder = cluster, folder
        folder.mkdir(parents=True, exist_ok=True)
        self.output = folder / "job.out"
        self.run_dir, self.snapshots = folder / "run", folder / "snapshots"
        env = subprocess_env(folder)
        env.update({"PATH": f"{Path(sys.executable).parent}:{env['PATH']}", "PYTHON": sys.executable,
                    "NPROC_PER_NODE": "2", "SNAPSHOT_PATH": str(self.snapshots), "RUN_DIR": str(self.run_dir),
                    "RDZV_PORT": str(free_port())})  # not 29500, which anything on the machine may hold
        self.id = cluster.sbatch(
            "--gpus-per-node=0", f"--output={self.output}", *sbatch_args, "slurm/sbatch_run.sh", *TRAINING,
            env=env, cwd=PROJECT_DIR,
        )

    def wait(self, *states: str) -> dict[str, str]:
        return self.cluster.wait_for_job(self.id, set(states), JOB_TIMEOUT_S)

    def log(self) -> str:
        return self.output.read_text() if self.output.exists() else ""

    def summary(self) -> dict:
        return read_summary(self.run_dir)

    def wait_until_training(self) -> None:
        wait_for(lambda: "training: steps" in self.log(), 120, 0.2, f"job {self.id} to train")


def assert_finished_like(job: Job, reference: dict) -> None:
    summary = job.summary()
    assert summary["finished"] and summary["steps"] == STEPS, summary
    assert summary["weights_sha256"] == reference["weights_sha256"], job.log()


@pytest.fixture(scope="module")
def uninterrupted(slurm_cluster, tmp_path_factory) -> dict:
    """The reference: the job with no time limit, trained to the end in one allocation."""
    job = Job(slurm_cluster, tmp_path_factory.mktemp("uninterrupted"))
    info = job.wait(*ENDED)
    return {"job": job, "info": info, "summary": job.summary() if info["JobState"] == "COMPLETED" else None}


def test_a_job_trains_to_the_end(uninterrupted):
    job, info = uninterrupted["job"], uninterrupted["info"]
    assert (info["JobState"], info["ExitCode"], info["Restarts"]) == ("COMPLETED", "0:0", "0"), job.log()
    summary = uninterrupted["summary"]
    assert summary["finished"] and summary["steps"] == STEPS and summary["replicas_identical"]
    assert summary["world_size"] == 2
    assert "requeue" not in job.log() and "Traceback" not in job.log()


def test_a_job_requeues_itself_at_its_time_limit_and_when_preempted_and_finishes(slurm_cluster, uninterrupted,
                                                                                  tmp_path):
    """One job meets both interruptions (one job's training instead of two): an allocation reaches its time limit,
    snapshots and requeues itself; the allocation that resumes is preempted by a job of partition "urgent" (SLURM
    sends SIGTERM to its steps: PreemptMode=REQUEUE, GraceTime), snapshots and requeues itself too; the last
    allocation finishes with the uninterrupted job's weights."""
    job = Job(slurm_cluster, tmp_path / "interrupted", *TIME_LIMITED)
    # Once an allocation has been stopped by the early signal and its workers saved a snapshot, the job gets the time
    # to finish (scontrol update, before the requeued job may start again): otherwise every later allocation is
    # signalled too, within 30 s of its start, and the job takes several more allocations (a start-up and a requeue
    # each) for the same steps.
    # An allocation signalled before its workers trained saves nothing; the job is requeued with the short limit.
    wait_for(lambda: "saved (stop requested" in job.log() or slurm_cluster.job(job.id).get("JobState") in ENDED,
             JOB_TIMEOUT_S, 0.2, f"job {job.id} to save at its time limit")
    slurm_cluster.run("scontrol", "update", f"JobId={job.id}", f"TimeLimit={FINISHING_TIME_LIMIT_MIN}", check=False)
    wait_for(lambda: trained_since_resuming(job.log()) or slurm_cluster.job(job.id).get("JobState") in ENDED,
             JOB_TIMEOUT_S, 0.2, f"job {job.id} to resume and train on")
    urgent = slurm_cluster.sbatch("--partition=urgent", "--exclusive", f"--output={tmp_path / 'urgent.out'}",
                                  "--wrap=echo urgent job ran", env=dict(os.environ), cwd=tmp_path)
    info = job.wait(*ENDED)
    log = job.log()
    assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), log
    assert slurm_cluster.job(urgent)["JobState"] == "COMPLETED"
    requeues = int(info["Restarts"])
    assert requeues >= 2, log
    # Every stopped allocation requeued the job itself: those stopped by the early signal (the script then stops the
    # steps with SIGTERM) and the one preempted (SLURM sends SIGTERM to its steps alone). The workers saved a snapshot
    # on the way out and the next allocation resumed from it, unless the signal came before they had started
    # training (seen once: SLURM signalled a job 0.16 s after starting it, though 60 s were left).
    allocations = log.split("allocation=")[1:]
    assert len(allocations) == requeues + 1, log
    preempted = [text for text in allocations if "saved (stop requested" in text and "SIGUSR1" not in text]
    assert len(preempted) == 1, log
    assert any("saved (stop requested" in text for text in allocations if "SIGUSR1" in text), log
    assert log.count("requeueing job") == requeues, log
    assert requeues - 1 <= log.count("SIGUSR1, the time limit is near") <= requeues, log
    assert 2 <= log.count("saved (stop requested") <= requeues, log
    assert 2 <= log.count("resumed from") <= requeues, log
    assert f"allocation={requeues + 1}" in log, log  # one output file for all allocations (--open-mode=append)
    assert "Traceback" not in log and "TIMEOUT" not in log, log
    assert_finished_like(job, uninterrupted["summary"])


def trained_since_resuming(log: str) -> bool:
    """Whether the newest allocation resumed from a snapshot and has logged a training step since."""
    resumed = log.rfind("resumed from")
    return resumed >= 0 and re.search(r"step \d+/", log[resumed:]) is not None


def test_scancel_leaves_loadable_snapshots_and_no_process(slurm_cluster, tmp_path):
    job = Job(slurm_cluster, tmp_path)
    job.wait_until_training()
    wait_for(lambda: re.search(r"step 500/", job.log()), 120, 0.2, "step 500")
    slurm_cluster.run("scancel", str(job.id))
    info = job.wait("CANCELLED")
    wait_for(lambda: not processes_of(job), 60, 0.2, f"the processes of job {job.id} to end")
    time.sleep(3)  # long enough for a requeue to show
    info = slurm_cluster.job(job.id)
    assert (info["JobState"], info["Restarts"]) == ("CANCELLED", "0"), job.log()
    assert "saved (stop requested" in job.log(), job.log()
    store = snapshot.SnapshotStore(str(job.snapshots))
    entries = store.entries()
    assert entries and entries[0].step > 500, [e.name for e in entries]
    for entry in entries:
        loaded = snapshot.from_bytes(store.read(entry.name), entry.name)  # verified: integrity hash, format
        assert loaded["progress"]["step"] == entry.step


def processes_of(job: Job) -> list[int]:
    """Processes whose command line names the job's snapshot folder: its agents and workers."""
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if str(job.snapshots).encode() in cmdline.read_bytes():
                found.append(int(cmdline.parent.name))
        except OSError:
            continue
    return found
