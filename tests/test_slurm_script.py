"""slurm/sbatch_run.sh under fake SLURM variables, with stub `srun` and `scontrol`: the torchrun command it builds
(one worker per allocated GPU, or as set) and its refusals. No SLURM, no torch: the stub srun only records."""

import os
import subprocess
from pathlib import Path

import pytest

from conftest import PROJECT_DIR

SCRIPT = PROJECT_DIR / "slurm" / "sbatch_run.sh"


def run_script(tmp_path: Path, **env_vars: str) -> tuple[subprocess.CompletedProcess, list[str] | None]:
    """Run the batch script; returns the process and the srun argument list (None if srun was not called)."""
    stubs = tmp_path / "bin"
    stubs.mkdir(exist_ok=True)
    calls = tmp_path / "srun_args"
    (stubs / "srun").write_text(f'#!/bin/bash\nprintf "%s\\n" "$@" > {calls}\n')
    # `scontrol show hostnames node-[a-b]`, written in one write(): the script reads its first line (`sed -n 1p`)
    (stubs / "scontrol").write_text("#!/bin/bash\nexec cat <<'EOF'\nnode-a\nnode-b\nEOF\n")
    for stub in stubs.iterdir():
        stub.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    for name in ("CUDA_VISIBLE_DEVICES", "NPROC_PER_NODE", "GPUS_PER_NODE", "NODES", "SNAPSHOT_PATH"):
        env.pop(name, None)
    env.update({"PATH": f"{stubs}:{env['PATH']}", "SLURM_JOB_NUM_NODES": "2", "SLURM_JOB_NODELIST": "node-[a-b]",
                "SLURM_JOB_ID": "4242", "SLURM_SUBMIT_DIR": str(tmp_path)})  # fmt: skip
    env.update(env_vars)
    proc = subprocess.run(["bash", str(SCRIPT), "trainer_config.max_epochs=3"], env=env, capture_output=True,
                          text=True, timeout=30)  # fmt: skip
    return proc, calls.read_text().splitlines() if calls.exists() else None


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
    assert proc.returncode == 0, proc.stderr
    assert srun == [
        "--kill-on-bad-exit=0", "torchrun", "--nnodes=2", f"--nproc-per-node={nproc}", "--rdzv-backend=c10d",
        "--rdzv-endpoint=node-a:29500", "--rdzv-id=4242", "--max-restarts=3", "main.py",
        "trainer_config.snapshot_path=snapshots/slurm-mingpt-ddp", "trainer_config.max_epochs=3",
    ]  # fmt: skip
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
