"""slurm/sbatch_run.sh under a real SLURM (slurmctld, slurmd and munge on 127.0.0.1, tests/slurm_cluster.py), two CPU
workers on one core of the node: a job trains to the end; a job warned of its time limit snapshots, requeues itself
and, preempted in its next allocation, snapshots again and finishes in a later one; scancel leaves loadable snapshots
and no process. The interrupted job ends with the weights of the uninterrupted one."""

from __future__ import annotations

import os
import re
import sys
import time
from pathlib import Path

import pytest
from support import PROJECT_DIR, TINY, free_port, read_summary, subprocess_env, wait_for

from mingpt.checkpoint import store as snapshot

# The jobs' two workers share one core (tests/slurm_cluster.py pins slurmd): 18 ms a step on an AVX2 EPYC, so about
# 27 s of training. The interrupted job is warned at step 100 and preempted soon after its next allocation has
# trained a step: its last allocation still has over 1,000 steps to go when the preemption is asked for (seconds, at
# 5 ms a step on two free cores).
STEPS = 1500
WARN_AT_STEP = 100
TRAINING = [*TINY, f"trainer_config.max_steps={STEPS}", "trainer_config.max_epochs=100",
            "trainer_config.log_every_steps=50", "trainer_config.eval_every_steps=500"]
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
    """One job meets both interruptions (one job's training instead of two): an allocation is warned of its time
    limit, snapshots and requeues itself; the allocation that resumes is preempted by a job of partition "urgent"
    (SLURM sends SIGTERM to its steps: PreemptMode=REQUEUE, GraceTime), snapshots and requeues itself too; the last
    allocation finishes with the uninterrupted job's weights.

    The warning is the one the script's `#SBATCH --signal=B:USR1@120` asks SLURM for: SIGUSR1 to the batch shell
    alone, its steps untouched. `scancel --signal=USR1 --batch` sends exactly that, at a step the test picks; waiting
    for a real time limit instead took a 4,000-step run (SLURM checks time limits every 30 s, so a 1-minute limit
    signalled a job anywhere from 10 to 40 s after its start) and twice its CPU time, the reference's included."""
    job = Job(slurm_cluster, tmp_path / "interrupted")
    wait_for(lambda: f"step {WARN_AT_STEP}/" in job.log() or slurm_cluster.job(job.id).get("JobState") in ENDED,
             JOB_TIMEOUT_S, 0.2, f"job {job.id} to reach step {WARN_AT_STEP}")
    slurm_cluster.run("scancel", "--signal=USR1", "--batch", str(job.id))
    wait_for(lambda: trained_since_resuming(job.log()) or slurm_cluster.job(job.id).get("JobState") in ENDED,
             JOB_TIMEOUT_S, 0.2, f"job {job.id} to resume and train on")
    urgent = slurm_cluster.sbatch("--partition=urgent", "--exclusive", f"--output={tmp_path / 'urgent.out'}",
                                  "--wrap=echo urgent job ran", env=dict(os.environ), cwd=tmp_path)
    info = job.wait(*ENDED)
    log = job.log()
    assert (info["JobState"], info["ExitCode"]) == ("COMPLETED", "0:0"), log
    assert slurm_cluster.job(urgent)["JobState"] == "COMPLETED"
    # Two stopped allocations, each of which requeued the job: the one warned (the script then stops the steps with
    # SIGTERM and requeues it itself) and the one preempted (SLURM sends SIGTERM to its steps alone and requeues it).
    # Their workers saved a snapshot on the way out and the next allocation resumed from it.
    assert info["Restarts"] == "2", log
    warned, preempted, last = log.split("allocation=")[1:]
    assert "SIGUSR1, the time limit is near" in warned and "saved (stop requested" in warned, log
    assert "SIGUSR1" not in preempted and "saved (stop requested" in preempted and "resumed from" in preempted, log
    assert "resumed from" in last and "saved (stop requested" not in last, log
    assert log.count("requeueing job") == 2, log
    assert "allocation=3" in log  # one output file for all allocations (--open-mode=append)
    assert "Traceback" not in log and "TIMEOUT" not in log, log
    assert_finished_like(job, uninterrupted["summary"])


def trained_since_resuming(log: str) -> bool:
    """Whether the newest allocation resumed from a snapshot and has logged a training step since."""
    resumed = log.rfind("resumed from")
    return resumed >= 0 and re.search(r"step \d+/", log[resumed:]) is not None


def test_scancel_leaves_loadable_snapshots_and_no_process(slurm_cluster, tmp_path):
    job = Job(slurm_cluster, tmp_path)
    job.wait_until_training()
    wait_for(lambda: re.search(rf"step {WARN_AT_STEP}/", job.log()), 120, 0.2, f"step {WARN_AT_STEP}")
    slurm_cluster.run("scancel", str(job.id))
    info = job.wait("CANCELLED")
    wait_for(lambda: not processes_of(job), 60, 0.2, f"the processes of job {job.id} to end")
    time.sleep(3)  # long enough for a requeue to show
    info = slurm_cluster.job(job.id)
    assert (info["JobState"], info["Restarts"]) == ("CANCELLED", "0"), job.log()
    assert "saved (stop requested" in job.log(), job.log()
    store = snapshot.SnapshotStore(str(job.snapshots))
    entries = store.entries()
    assert entries and entries[0].step > WARN_AT_STEP, [e.name for e in entries]
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
