"""End to end: the real CLI as a subprocess, under torchrun (2 processes, gloo) and without it."""

import subprocess
from pathlib import Path

import pytest
from support import (
    TINY,
    assert_ok,
    cli,
    job_args,
    own_snapshots,
    read_summary,
    run_cli,
    standalone,
    subprocess_env,
)

from mingpt.reporting.logs import read_metrics


def assert_trained(run_dir: Path, world_size: int) -> list[dict]:
    rows = read_metrics(run_dir)
    losses = [r["train_loss"] for r in rows if "train_loss" in r]
    assert len(losses) == 8, rows
    assert losses[-1] < losses[0] - 0.5, f"training loss did not fall: {losses}"
    val = [r["val_loss"] for r in rows if "val_loss" in r]
    assert len(val) == 2 and val[-1] < val[0]
    summary = read_summary(run_dir)
    assert summary["world_size"] == world_size and summary["steps"] == 40
    assert len(summary["rank_weights_sha256"]) == world_size
    assert len(set(summary["rank_weights_sha256"])) == 1 and summary["replicas_identical"]
    return rows


def test_torchrun_two_processes(tmp_path):
    """Also: each worker is the process torchrun started (no stand-in). (Not marked oldest_torch: the old legs train
    two processes under torchrun in tests/e2e/test_resume.py's SIGKILL test and test_s3.py's.)"""
    command = cli([*own_snapshots(tmp_path), *TINY], standalone(2))
    launch = subprocess.Popen(command, cwd=tmp_path, env=subprocess_env(tmp_path), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
    stdout, stderr = launch.communicate(timeout=240)
    result = subprocess.CompletedProcess(command, launch.returncode, stdout, stderr)
    assert_ok(result)
    assert f"rank 0 is process {launch.pid}" not in stdout and f"started by {launch.pid})" in stdout, stdout[-2000:]
    # One run directory for both ranks (Hydra would otherwise compute one per process).
    run_dirs = list((tmp_path / "outputs").iterdir())
    assert len(run_dirs) == 1, run_dirs
    run_dir = run_dirs[0]
    assert_trained(run_dir, world_size=2)
    assert (run_dir / ".hydra" / "config.yaml").exists() and (run_dir / "train.log").exists()
    # Only rank 0 logs progress.
    assert result.stdout.count("val loss") == 2
    assert "[rank 1]" not in result.stdout
    # trainer_config.report_at_end=false (TINY's): no plot, no sample (test_single_process_without_torchrun: both).
    assert not (run_dir / "loss.png").exists() and "sample (" not in stdout and "loss plot" not in stdout


# Imported by a one-process eager run, each would add 0.3-2 s to every start (bench_launch.py): DCP (sharded
# snapshots only), TensorBoard (events are written directly), matplotlib (the plot is drawn by another process),
# the experiment trackers (optional packages; a run that asks for one imports it in its tracker process only).
NOT_IMPORTED = ["torch.distributed.checkpoint", "torch.utils.tensorboard", "tensorboard", "matplotlib", "mlflow",
                "wandb"]
WATCH_IMPORTS = (  # reported at exit: main.py ends a clean run with os._exit (no teardown), others through atexit
    "import atexit, os, runpy, sys\n"
    f"report = lambda: print('imported:', [m for m in {NOT_IMPORTED!r} if m in sys.modules], flush=True)\n"
    "atexit.register(report)\n"
    "os._exit = lambda code, _exit=os._exit: (report(), _exit(code))\n"
    "sys.argv = sys.argv[1:]\n"
    "sys.path.insert(0, sys.argv[0].rsplit('/', 1)[0])\n"
    "runpy.run_path(sys.argv[0], run_name='__main__')\n"
)


def test_single_process_without_torchrun(tmp_path, run_dir):
    """Also: the saved overrides are the user's, and the process imports none of NOT_IMPORTED."""
    command = cli([*own_snapshots(tmp_path), *TINY, "trainer_config.report_at_end=true", f"hydra.run.dir={run_dir}"])
    result = subprocess.run([command[0], "-c", WATCH_IMPORTS, *command[1:]], cwd=tmp_path,
                            env=subprocess_env(tmp_path), capture_output=True, text=True, timeout=240)
    assert_ok(result)
    assert_trained(run_dir, world_size=1)
    assert "imported: []" in result.stdout, result.stdout[-500:]
    assert (run_dir / "loss.png").stat().st_size > 10_000
    saved = (run_dir / ".hydra" / "overrides.yaml").read_text()
    assert all(f"- {arg}" in saved for arg in TINY) and "hydra.mode" not in saved, saved


@pytest.mark.oldest_torch
def test_an_unreachable_snapshot_location_fails_before_the_data_is_read(tmp_path, run_dir):
    """Every location the run writes to is checked before the data is read or the model built (with a large corpus
    that is minutes earlier)."""
    result = run_cli(job_args("ftp://127.0.0.1:1/x", run_dir),
                     tmp_path, timeout=60)
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines() == [
        "error: cannot use snapshot location ftp://127.0.0.1:1/x: ConnectionRefusedError: [Errno 111] Connection "
        "refused"]
    assert "data:" not in result.stdout and "model:" not in result.stdout, result.stdout
