"""slurm/sbatch_run.sh under fake SLURM variables, with stub `srun`, `scontrol` and `scancel`: the torchrun command
it builds (one worker per allocated GPU, or as set), its refusals, and when it requeues the job. No SLURM, no torch:
the stubs only record (tests/e2e/test_slurm.py runs the script under a real SLURM)."""

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from support import PROJECT_DIR, assert_ok, wait_for

SCRIPT = PROJECT_DIR / "slurm" / "sbatch_run.sh"
FINISHED = '{\n  "steps": 40,\n  "finished": true,\n  "val_loss": 2.1\n}\n'


def start_script(tmp_path: Path, srun_body: str = "", **env_vars: str) -> subprocess.Popen:
    """Start the batch script with stubs on PATH; `srun_body` is what the stub srun does after recording."""
    stubs = tmp_path / "bin"
    stubs.mkdir(exist_ok=True)
    (stubs / "srun").write_text(f'#!/bin/bash\nprintf "%s\\n" "$@" > {tmp_path}/srun_args\n{srun_body}\n')
    # `scontrol show hostnames node-[a-b]`, written in one write(): the script reads its first line (`sed -n 1p`)
    (stubs / "scontrol").write_text(f'#!/bin/bash\necho "$@" >> {tmp_path}/scontrol_calls\n'
                                    '[[ $1 == show ]] || exit 0\nexec cat <<\'EOF\'\nnode-a\nnode-b\nEOF\n')
    (stubs / "scancel").write_text(f'#!/bin/bash\necho "$@" >> {tmp_path}/scancel_calls\n')
    for stub in stubs.iterdir():
        stub.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    for name in ("CUDA_VISIBLE_DEVICES", "NPROC_PER_NODE", "GPUS_PER_NODE", "NODES", "SNAPSHOT_PATH", "RUN_DIR",
                 "MAX_REQUEUES", "PYTHON"):
        env.pop(name, None)
    env.update({"PATH": f"{stubs}:{env['PATH']}", "SLURM_JOB_NUM_NODES": "2", "SLURM_JOB_NODELIST": "node-[a-b]",
                "SLURM_JOB_ID": "4242", "SLURM_SUBMIT_DIR": str(tmp_path)})
    env.update(env_vars)
    return subprocess.Popen(["bash", str(SCRIPT), "trainer_config.max_epochs=3"], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def run_script(tmp_path: Path, srun_body: str = "", **env_vars: str) -> tuple[subprocess.CompletedProcess, list | None]:
    """Run the batch script; returns the process and the srun argument list (None if srun was not called)."""
    script = start_script(tmp_path, srun_body, **env_vars)
    stdout, stderr = script.communicate(timeout=30)
    proc = subprocess.CompletedProcess(script.args, script.returncode, stdout, stderr)
    calls = tmp_path / "srun_args"
    return proc, calls.read_text().splitlines() if calls.exists() else None


def calls(tmp_path: Path, command: str) -> list[str]:
    path = tmp_path / f"{command}_calls"
    return [line for line in path.read_text().splitlines() if not line.startswith("show")] if path.exists() else []


def test_script_parses_and_requests_gpus():
    assert subprocess.run(["bash", "-n", str(SCRIPT)]).returncode == 0
    assert "#SBATCH --gpus-per-node=" in SCRIPT.read_text()


@pytest.mark.parametrize(
    "env_vars, nproc",
    [
        ({"SLURM_GPUS_ON_NODE": "4"}, 4),
        ({"CUDA_VISIBLE_DEVICES": "0,1,2"}, 3),  # a site that exposes the allocation only this way
        ({"SLURM_GPUS_ON_NODE": "4", "CUDA_VISIBLE_DEVICES": "0,1"}, 4),  # SLURM's own count wins
        ({"SLURM_GPUS_ON_NODE": "4", "NPROC_PER_NODE": "2"}, 2),  # an explicit override
        ({"SLURM_GPUS_ON_NODE": "4", "GPUS_PER_NODE": "3"}, 3),  # the older name
        ({"NPROC_PER_NODE": "8"}, 8),  # CPU-only cluster: no GPUs, workers as set
    ],
)
def test_workers_per_node_follow_the_allocation(tmp_path, env_vars, nproc):
    proc, srun = run_script(tmp_path, **env_vars)
    assert_ok(proc)
    assert srun == [
        "--kill-on-bad-exit=0", "python3", "slurm/torchrun_agent.py", "--nnodes=2", f"--nproc-per-node={nproc}",
        "--rdzv-backend=c10d", "--rdzv-endpoint=node-a:29500", "--rdzv-id=4242", "--max-restarts=3", "main.py",
        "trainer_config.snapshot_path=snapshots/slurm-mingpt-ddp", "hydra.run.dir=outputs/4242",
        "trainer_config.max_epochs=3",
    ]
    assert calls(tmp_path, "scontrol") == [] and calls(tmp_path, "scancel") == []  # it finished: no requeue
    assert f"nproc_per_node={nproc} " in proc.stdout


@pytest.mark.parametrize(
    "env_vars, message",
    [
        ({}, "error: SLURM allocated no GPUs on this node"),  # the old script started 8 workers here
        ({"SLURM_GPUS_ON_NODE": "0"}, "error: SLURM allocated no GPUs on this node"),
        ({"CUDA_VISIBLE_DEVICES": "NoDevFiles"}, "error: SLURM allocated no GPUs on this node"),
        ({"CUDA_VISIBLE_DEVICES": ""}, "error: SLURM allocated no GPUs on this node"),
        ({"NPROC_PER_NODE": "four"}, "error: NPROC_PER_NODE (or GPUS_PER_NODE) must be a positive whole number"),
        ({"NPROC_PER_NODE": "0"}, "error: NPROC_PER_NODE (or GPUS_PER_NODE) must be a positive whole number"),
        ({"SLURM_GPUS_ON_NODE": "4", "NPROC_PER_NODE": "8"}, "error: NPROC_PER_NODE=8 workers per node, but SLURM"),
    ],
)
def test_refuses_with_one_line(tmp_path, env_vars, message):
    proc, srun = run_script(tmp_path, **env_vars)
    assert proc.returncode == 2 and srun is None
    assert len(proc.stderr.splitlines()) == 1 and proc.stderr.startswith(message), proc.stderr


RUN_DIR = {"RUN_DIR": "run", "NPROC_PER_NODE": "2"}


@pytest.mark.parametrize(
    "srun_body, env_vars, code, requeued",
    [
        ("exit 143", {}, 0, True),  # the agents were stopped by SIGTERM (preemption) before the end
        ("exit 143", {"SLURM_RESTART_COUNT": "3"}, 0, True),
        (f"mkdir -p run; printf '{FINISHED}' > run/summary.json; exit 143", {}, 0, False),  # stopped after the end
        (f"mkdir -p run; printf '{FINISHED}' > run/summary.json; exit 1", {}, 1, False),  # a failure after the end
        ("exit 1", {}, 1, False),  # a failure: torchrun already restarted the workers MAX_RESTARTS times
        ("exit 143", {"SLURM_RESTART_COUNT": "10"}, 1, False),  # MAX_REQUEUES (10) reached
        ("exit 143", {"SLURM_RESTART_COUNT": "2", "MAX_REQUEUES": "2"}, 1, False),
    ],
)
def test_requeues_a_job_stopped_before_its_end(tmp_path, srun_body, env_vars, code, requeued):
    proc, _ = run_script(tmp_path, srun_body, **RUN_DIR, **env_vars)
    assert proc.returncode == code, proc.stderr
    assert calls(tmp_path, "scontrol") == (["requeue 4242"] if requeued else [])
    if code == 1 and "SLURM_RESTART_COUNT" in env_vars:
        assert proc.stderr.startswith("error: not requeued: the job was requeued MAX_REQUEUES=")
        assert len(proc.stderr.splitlines()) == 1


def test_a_stale_summary_does_not_stop_a_requeue(tmp_path):
    """summary.json of an earlier run in the same folder says nothing of this one."""
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "summary.json").write_text(FINISHED.replace("\\n", "\n"))
    os.utime(tmp_path / "run" / "summary.json", (time.time() - 60, time.time() - 60))
    proc, _ = run_script(tmp_path, "exit 143", **RUN_DIR)
    assert proc.returncode == 0 and calls(tmp_path, "scontrol") == ["requeue 4242"], proc.stderr


@pytest.mark.parametrize("signum, requeued", [(signal.SIGUSR1, True), (signal.SIGTERM, False)])
def test_time_limit_signal_stops_the_steps_and_requeues_but_scancel_does_not(tmp_path, signum, requeued):
    """SIGUSR1 (--signal=B:USR1@120): SIGTERM to the steps (scancel --signal), then requeue. SIGTERM (scancel):
    the script waits for the workers and the job stays cancelled. Either way the agents end with 143."""
    srun_body = f"touch {tmp_path}/srun_started; sleep 2; exit 143"
    script = start_script(tmp_path, srun_body, **RUN_DIR)
    wait_for(lambda: (tmp_path / "srun_started").exists(), 10, what="srun to start")
    script.send_signal(signum)
    stdout, stderr = script.communicate(timeout=30)
    assert calls(tmp_path, "scancel") == (["--signal=TERM 4242"] if requeued else [])
    assert calls(tmp_path, "scontrol") == (["requeue 4242"] if requeued else [])
    assert script.returncode == (0 if requeued else 143), stderr
