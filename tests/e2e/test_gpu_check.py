"""gpu_check.sh on a machine without a CUDA device: it stops at once with one line and exit code 2, before it
installs, benchmarks or trains anything. (The checks themselves need a GPU; GPU_CHECK_ALLOW_CPU=1 dry-runs them on a
CPU with tiny overrides, as its header says, in minutes: not a test.)"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from support import PROJECT_DIR

SCRIPT = PROJECT_DIR / "gpu_check.sh"

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device here: the script would run for real")


def run_script(out: Path, **env_vars: str) -> tuple[subprocess.CompletedProcess, float]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("GPU_CHECK_ALLOW_CPU", "FORCE", "BENCH_ARGS", "TRAIN_ARGS", "BUDGET_S")}
    env.update({"PYTHON": sys.executable, **env_vars})
    started = time.monotonic()
    result = subprocess.run(["bash", str(SCRIPT), str(out)], env=env, capture_output=True, text=True, timeout=120)
    return result, time.monotonic() - started


def test_without_cuda_it_stops_at_once_with_one_line(tmp_path):
    out = tmp_path / "out"
    result, took = run_script(out)
    assert result.returncode == 2, result.stderr
    assert result.stderr.splitlines() == [
        f"error: gpu_check.sh needs a CUDA GPU and a CUDA build of torch (torch {torch.__version__}, cuda available: "
        "False)"], result.stderr
    assert result.stdout == "" and not out.exists()  # nothing installed, benchmarked or trained
    assert took < 60


def test_an_interpreter_without_torch_is_the_same_line(tmp_path):
    out = tmp_path / "out"
    result, _ = run_script(out, PYTHON=str(tmp_path / "no-such-python"))
    assert result.returncode == 2 and not out.exists()
    assert result.stderr.splitlines() == [
        f"error: gpu_check.sh needs a CUDA GPU and a CUDA build of torch (torch not importable by "
        f"{tmp_path / 'no-such-python'}, cuda available: False)"], result.stderr


def test_the_dry_run_refuses_a_folder_of_earlier_results(tmp_path):
    """GPU_CHECK_ALLOW_CPU=1 passes the gate; an earlier bench.json still stops it before anything runs (BUDGET_S=1
    would end any check that started anyway within a second)."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "bench.json").write_text("{}")
    result, _ = run_script(out, GPU_CHECK_ALLOW_CPU="1", BUDGET_S="1")
    assert result.returncode == 2, result.stderr
    assert result.stderr.splitlines() == [
        f"error: {out} already holds an earlier check ({out}/bench.json): use another OUT_DIR, or FORCE=1 to delete "
        "its results"], result.stderr
    assert sorted(p.name for p in out.iterdir()) == ["bench.json"]
