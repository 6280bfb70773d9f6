"""gpu_check.sh on a machine without a CUDA device: it stops at once with one line and exit code 2, before it
installs, benchmarks or trains anything; its dry run on the CPU (GPU_CHECK_ALLOW_CPU=1, tiny models, torch.compile's
backend swapped for aot_eager) runs every check end to end, installing the committed wheels where hydra is hidden,
and leaves exactly gpu_check.tar.gz (its logs, no snapshot) and summary.json; a check that fails leaves them too,
with the failure in both; the committed wheels are requirements.txt's pins, pure Python, and travel with the tree."""

from __future__ import annotations

import itertools
import json
import os
import re
import shlex
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest
import torch
from support import PROJECT_DIR, subprocess_env

SCRIPT = PROJECT_DIR / "gpu_check.sh"
WHEELS = PROJECT_DIR / ".gpu-wheels"
KNOBS = ("GPU_CHECK_ALLOW_CPU", "FORCE", "BENCH_ARGS", "TRAIN_ARGS", "BUDGET_S", "MFU_FLOOR", "PEAK_TFLOPS", "JOBS",
         "TRAIN_STEPS", "EVAL_EVERY", "VAL_BOUND", "FEATURE_STEPS", "TARGET", "TORCH_COMPILE_OVERRIDE_BACKENDS",
         "TORCH_LOGS", "PYTHONPATH")


def header_dry_run() -> dict[str, str]:
    """The environment of the developer's dry run whose command gpu_check.sh's header gives (`KEY=VALUE ... bash
    gpu_check.sh OUT`, its settings explained there): the run this file's main test makes, written in one place.
    PYTHON is left to run_script (this interpreter)."""
    lines = SCRIPT.read_text(encoding="utf-8").splitlines()
    starts = [i for i, line in enumerate(lines) if line.startswith("# A developer's dry run")]
    command = []
    for line in lines[starts[0] + 1:] if starts else []:
        if not line.startswith("#   "):
            continue
        command.append(line.removeprefix("#").strip().removesuffix("\\").strip())
        if "bash gpu_check.sh" in line:
            break
    assignments = itertools.takewhile(lambda word: "=" in word, shlex.split(" ".join(command)))  # up to `bash`
    settings = dict(word.split("=", 1) for word in assignments)
    assert settings.get("GPU_CHECK_ALLOW_CPU") == "1", \
        "gpu_check.sh's header gives no dry-run command (# A developer's dry run ... bash gpu_check.sh OUT)"
    settings.pop("PYTHON", None)
    return settings


DRY_RUN = header_dry_run()

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device here: the script would run for real")


def run_script(out: Path, tmp_path: Path | None = None, timeout: float = 120,
               **env_vars: str) -> tuple[subprocess.CompletedProcess, float]:
    env = {k: v for k, v in (subprocess_env(tmp_path) if tmp_path else os.environ).items() if k not in KNOBS}
    env.update({"PYTHON": sys.executable, **env_vars})
    started = time.monotonic()
    result = subprocess.run(["bash", str(SCRIPT), str(out)], env=env, stdin=subprocess.DEVNULL, capture_output=True,
                            text=True, timeout=timeout)
    return result, time.monotonic() - started


def results(out: Path) -> tuple[dict, dict[str, bytes]]:
    """summary.json, and the tarball's files by name."""
    assert sorted(p.name for p in out.iterdir()) == ["gpu_check.tar.gz", "summary.json"]
    with tarfile.open(out / "gpu_check.tar.gz") as tar:
        files = {m.name: tar.extractfile(m).read() for m in tar.getmembers() if m.isfile()}
    return json.loads((out / "summary.json").read_text()), files


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
    """GPU_CHECK_ALLOW_CPU=1 passes the gate; an earlier summary.json still stops it before anything runs (BUDGET_S=1
    would end any check that started anyway within a second)."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "summary.json").write_text("{}")
    result, _ = run_script(out, GPU_CHECK_ALLOW_CPU="1", BUDGET_S="1")
    assert result.returncode == 2, result.stderr
    assert result.stderr.splitlines() == [
        f"error: {out} already holds an earlier check ({out}/summary.json): use another OUT_DIR, or FORCE=1 to "
        "delete its results"], result.stderr
    assert sorted(p.name for p in out.iterdir()) == ["summary.json"]


def test_a_failed_check_leaves_its_line_the_logs_and_summary_json(tmp_path):
    """BUDGET_S=1: the first check, bench.py, is killed after a second. The one FAIL line names its log; OUT_DIR
    still ends with the tarball and summary.json (what a lent machine brings back), and nothing temporary is left.
    Hydra is importable here: nothing is installed."""
    out = tmp_path / "out"
    result, _ = run_script(out, tmp_path, GPU_CHECK_ALLOW_CPU="1", BUDGET_S="1")
    line = ("FAIL: bench.py did not finish within 1 s (the script's budget: BUDGET_S=1): see "
            "gpu_check/bench/bench.log")
    assert result.returncode == 1, result.stderr
    assert result.stderr.splitlines() == [line], result.stderr
    assert re.search(rf"ok: {re.escape(sys.executable)} imports hydra-core 1\.3\.\d+, omegaconf 2\.3\.\d+ already: "
                     "nothing installed", result.stdout), result.stdout
    summary, files = results(out)
    assert summary["passed"] is False and summary["failed"] == line and summary["checks"] == {}
    assert line in files["gpu_check/gpu_check.log"].decode()
    assert "gpu_check/bench/bench.log" in files and json.loads(files["gpu_check/summary.json"]) == summary
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("gpu_check_")) == []


def test_the_dry_run_runs_every_check_and_leaves_one_tarball_and_summary_json(tmp_path):
    """The whole script on the CPU, as on a lent GPU machine whose python has no hydra: PYTHONPATH puts packages
    named hydra, omegaconf and antlr4 first that fail to import, so the script installs .gpu-wheels/ (which then
    come first). Every check passes ((d) needs a GPU); the logs hold each run's evidence, no snapshot."""
    hide = tmp_path / "hide"
    for name in ("hydra", "omegaconf", "antlr4"):
        (hide / name).mkdir(parents=True)
        (hide / name / "__init__.py").write_text("raise ImportError('hidden: gpu_check.sh must install its wheels')\n")
    out = tmp_path / "out"
    result, took = run_script(out, tmp_path, timeout=400, PYTHONPATH=str(hide), **DRY_RUN)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "FAIL" not in result.stdout + result.stderr
    pins = dict(re.findall(r"^(hydra-core|omegaconf)==(\S+)", (PROJECT_DIR / "requirements.txt").read_text(), re.M))
    assert (f"ok: installed the 3 wheels of .gpu-wheels/ (hydra-core {pins['hydra-core']}, omegaconf "
            f"{pins['omegaconf']}) into ") in result.stdout, result.stdout
    summary, files = results(out)
    from mingpt.compat import FSDP_TORCH, TORCH

    fsdp = "ok" if TORCH >= FSDP_TORCH else "skipped"
    expected = {"bench": "ok", "train": "ok", "sigterm": "ok", "nprocs": "skipped", "fsdp-kill": fsdp,
                "compile-fsdp": fsdp, "compile-ddp": "ok", "fp16": "ok", "activation-checkpointing": "ok",
                "muon": "ok" if hasattr(torch.optim, "Muon") else "skipped"}
    assert {name: check["status"] for name, check in summary["checks"].items()} == expected
    assert summary["passed"] is True and summary["failed"] is None and summary["dry_run_on_cpu"] is True
    assert summary["bench"]["precision"] == "bfloat16" and summary["bench"]["compile"] is True
    assert summary["bench"]["peak_source"] == "given"  # PEAK_TFLOPS reached bench.py: no measuring matmuls
    assert summary["train"]["steps"] == 100 and summary["train"]["best_val_loss"] < 3.3
    lines = {name: check["line"] for name, check in summary["checks"].items()}
    assert "stopped it at step" in lines["sigterm"] and "dynamo compiled" in lines["compile-ddp"]
    assert "gradient scaler on" in lines["fp16"] and "memory not compared" in lines["activation-checkpointing"]
    if expected["muon"] == "ok":
        assert "Muon state for 4 block matrices" in lines["muon"]  # 1 block: c_attn, attn c_proj, c_fc, mlp c_proj
    if fsdp == "ok":
        assert re.search(r"resumed from snapshot-0+[1-9]00\.dcp", lines["fsdp-kill"]), lines["fsdp-kill"]
    for log in ("gpu_check.log", "install.log", "bench/bench.json", "train/metrics.jsonl", "sigterm/second.log",
                "compile-ddp/launch.log", "fp16/run/metrics.jsonl", "ac-bench-blocks/bench.json", "summary.json"):
        assert f"gpu_check/{log}" in files, sorted(files)
    assert not [name for name in files if re.search(r"snapshot-\d+|\.distcp$|\.pt$", name)]
    assert sum(map(len, files.values())) < 16 * 2**20  # what a lent machine brings back, a file
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("gpu_check_")) == []
    print(f"dry run: {took:.0f} s; {summary['seconds']} s by the script's count")


def test_the_committed_wheels_are_the_pins_in_pure_python_and_travel():
    """.gpu-wheels/ holds requirements.txt's hydra-core and omegaconf and the Makefile's antlr4, each py3-none-any
    (any CPython 3 on any platform), and git does not ignore them: a copy of the working tree carries them."""
    pins = dict(re.findall(r"^(hydra-core|omegaconf)==(\S+)", (PROJECT_DIR / "requirements.txt").read_text(), re.M))
    antlr4 = re.search(r"^ANTLR4 = antlr4-python3-runtime==(\S+)", (PROJECT_DIR / "Makefile").read_text(), re.M)[1]
    wanted = [f"antlr4_python3_runtime-{antlr4}-py3-none-any.whl", f"hydra_core-{pins['hydra-core']}-py3-none-any.whl",
              f"omegaconf-{pins['omegaconf']}-py3-none-any.whl"]
    assert sorted(p.name for p in WHEELS.glob("*.whl")) == wanted, "run `make gpu-wheels` and commit .gpu-wheels/"
    ignored = subprocess.run(["git", "check-ignore", "--no-index", *(f".gpu-wheels/{name}" for name in wanted)],
                             cwd=PROJECT_DIR, capture_output=True, text=True)
    if ignored.returncode == 128:
        pytest.skip("not a git checkout")
    assert ignored.stdout == "", f"git ignores {ignored.stdout}: a copy of the working tree would arrive without them"
