"""bench.py runs the real trainer and reports consistent numbers: one process with snapshots and the nanoGPT
baseline, under torchrun with scaling, the comparisons refusing the wrong launch, the data benchmark, the memory
benchmark (it is not itself a performance test; its parts in one process: tests/unit/test_bench.py)."""

import json
import subprocess
import sys

import pytest
from support import PROJECT_DIR, TINY, assert_ok, cli, standalone, subprocess_env

from mingpt import compat

BENCH, BENCH_DATA = PROJECT_DIR / "benchmarks" / "bench.py", PROJECT_DIR / "benchmarks" / "bench_data.py"
BENCH_MEMORY = PROJECT_DIR / "benchmarks" / "bench_memory.py"


def check_result(result: dict, world_size: int) -> None:
    assert result["world_size"] == world_size and result["timed_steps"] == 4
    assert result["tokens_per_step"] == 8 * 32 * world_size
    assert abs(result["tokens_per_s"] - result["tokens_per_step"] / (result["step_ms_median"] / 1000)) < 0.01 * result[
        "tokens_per_s"]
    assert 0 < result["mfu"] < 1 and result["peak_source"] == "measured matmul"
    assert result["flops_per_token"] > 6 * result["n_params"] * 0.9


def test_bench_single_process_with_snapshots_and_baseline(tmp_path):
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [sys.executable, str(BENCH), "--steps", "4", "--warmup", "1", "--snapshots", "2",
         "--baseline", "nanogpt", "--json", str(out), *TINY, f"trainer_config.snapshot_path={tmp_path / 'snaps'}"],
        cwd=tmp_path, env=subprocess_env(tmp_path), capture_output=True, text=True, timeout=120,
    )
    assert_ok(proc)
    result = json.loads(out.read_text())
    assert json.loads(proc.stdout) == result
    check_result(result, world_size=1)
    snap = result["snapshot"]
    assert snap["saves"] == 2 and 0 < snap["blocked_s_median"] <= snap["written_s_median"]
    assert len(list((tmp_path / "snaps").glob("snapshot-*.pt"))) == 2
    baseline = result["baseline"]
    assert baseline["name"] == "nanoGPT CPU loop" and baseline["speedup_paired_median"] > 0
    baseline_tokens_per_s = result["tokens_per_step"] / (baseline["step_ms_median"] / 1000)
    assert abs(baseline["tokens_per_s"] - baseline_tokens_per_s) < 0.01 * baseline_tokens_per_s


def test_bench_under_torchrun_with_scaling(tmp_path):
    proc = subprocess.run(
        cli(["--steps", "4", "--warmup", "1", "--scaling", *TINY], standalone(2), script="benchmarks/bench.py"),
        cwd=tmp_path, env=subprocess_env(tmp_path), capture_output=True, text=True, timeout=120,
    )
    assert_ok(proc)
    result = json.loads(proc.stdout)
    check_result(result, world_size=2)
    scaling = result["scaling"]
    assert scaling["world_size"] == 2 and scaling["one_process_step_ms_median"] > 0
    assert abs(scaling["one_process_tokens_per_s"] - 8 * 32 / (scaling["one_process_step_ms_median"] / 1000)) < 0.01 * (
        scaling["one_process_tokens_per_s"])
    assert 0 < scaling["efficiency_paired_median"] < 2


def test_bench_comparisons_refuse_the_wrong_launch(tmp_path):
    proc = subprocess.run([sys.executable, str(BENCH), "--steps", "1", "--scaling", *TINY],
                          cwd=tmp_path, env=subprocess_env(tmp_path), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        "error: --scaling compares the processes of a torchrun job with one of them alone: "
        "run benchmarks/bench.py under torchrun"
    ], proc.stderr


def test_bench_data_encodes_both_corpora_and_times_the_order(tmp_path):
    """bench_data.py's encode and order parts on a 2 MB corpus (its launch part runs whole torchrun jobs: the
    README's figures, not a test)."""
    out = tmp_path / "data.json"
    proc = subprocess.run([sys.executable, str(BENCH_DATA), "--only", "encode,order", "--size-mb",
                           "2", "--rounds", "1", "--json", str(out)], cwd=tmp_path, env=subprocess_env(tmp_path),
                          capture_output=True, text=True, timeout=300)
    assert_ok(proc)
    result = json.loads(out.read_text())
    ascii_, mixed = result["encode"]["mostly_ascii"], result["encode"]["mixed_script"]
    assert ascii_["vocabulary"] > 256 and ascii_["dtype"] == "uint16" and ascii_["mb_per_s_median"] > 0
    assert mixed["characters"] < mixed["bytes"] / 1.5  # multi-byte scripts: fewer characters than bytes
    assert set(result["order"]) == {"1e4", "1e6", "1e9", "1e12"}
    assert all(row["sampler_peak_bytes"] < 2_000_000 for row in result["order"].values())


def test_bench_memory_follows_every_rank_of_a_torchrun_job(tmp_path):
    """bench_memory.py on the tiny model, 2 processes under FSDP: a peak per rank at each moment of the run (its
    figures for the 113M-parameter model: benchmarks/memory.md)."""
    out = tmp_path / "memory.json"
    proc = subprocess.run([sys.executable, str(BENCH_MEMORY), "--model", "tiny", "--nproc", "2", "--strategy", "fsdp",
                           "--steps", "2", "--json", str(out)],
                          cwd=tmp_path, env=subprocess_env(tmp_path), capture_output=True, text=True, timeout=120)
    assert_ok(proc)
    result = json.loads(out.read_text())
    assert json.loads(proc.stdout) == result
    (run,) = result["runs"]
    assert run["strategy"] == "fsdp" and run["n_params"] == 27_840 and [r["rank"] for r in run["ranks"]] == [0, 1]
    for rank in run["ranks"]:
        peaks = [rank[moment]["vm_hwm_mib"] for moment in ("startup", "steps", "run")]
        assert 0 < peaks[0] <= peaks[1] <= peaks[2], rank  # the kernel's high-water mark only rises
        assert 0 < rank["steps"]["max_rss_anon_mib"] <= peaks[1], rank
    assert result["summary"]["fsdp"]["largest_rank"]["steps"]["vm_hwm_mib"]["median"] == max(
        rank["steps"]["vm_hwm_mib"] for rank in run["ranks"])


@pytest.mark.skipif(compat.TORCH < compat.FSDP_TORCH, reason="mesh layouts need torch 2.7")
def test_every_sharded_layout_starts_from_one_processs_weights_to_the_bit(tmp_path):
    """The meta-device build (FSDP, tensor and pipeline parallelism on 2 processes, each rank making only its part
    real) starts from the weights one plain process draws, bit for bit: the whole weights' digest before the first
    step, gathered one tensor at a time, on every rank (the layout tests compare after 4 steps, to 1e-6)."""
    out = tmp_path / "initial.json"
    proc = subprocess.run([sys.executable, str(BENCH_MEMORY), "--initial-weights", "--model", "tiny", "--nproc", "2",
                           "--strategy", "fsdp,tp,pp", "--json", str(out)],
                          cwd=tmp_path, env=subprocess_env(tmp_path), capture_output=True, text=True, timeout=300)
    assert_ok(proc)
    found = json.loads(out.read_text())["initial_weights"]
    runs = found["runs"]
    assert sorted(runs) == ["fsdp", "one process", "pp", "tp"]
    for name in ("fsdp", "tp", "pp"):
        assert runs[name]["rank_digests"] == [found["reference_sha256"]] * 2, (name, runs[name])
        whole = runs["one process"]["parameters_held_per_rank"][0]
        assert max(runs[name]["parameters_held_per_rank"]) < whole, runs[name]  # each rank made its part real
