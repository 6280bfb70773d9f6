"""Tensor, pipeline and hybrid layouts on one device mesh, through the real Trainer and the real CLI (torchrun, gloo).

Two launches of tests/workers/layout_worker.py (2 and 4 processes) check every supported layout three ways: 4 steps end
with the weights of one process on the same global batches (tests/workers/reference.py; fp32, dropout 0, clipping
engaged, AdamW with an epsilon that makes its update momentum SGD's, which does not divide by the gradient's size:
layout_worker.ADAMW; to TOLERANCE, far below what a real fault gives in these 4 steps: embeddings left untied 0.15, an
unpermuted q/k/v 0.11, a pipeline's tied gradient left unsummed, tests/e2e/test_pipeline.py); a run resumed from its
step-2 snapshot ends bit-for-bit equal; and the snapshot loads bit-for-bit into the next layout of the list. The
2-process launch also trains FSDP, TP and PP with Muon (tolerance: MUON_TOLERANCE) and runs MeshMuon on sharded matrices
against torch's Muon on whole ones (tests/workers/muon_worker.py). Then the survey's hybrid example through the CLI: 2
pipeline stages x 2 replicas on 4 processes, a worker SIGKILLed, the job resumed by torchrun to the uninterrupted run's
weights, its snapshot resumed by one process and by FSDP on 2. How the degrees resolve, in this process:
tests/unit/test_layouts.py; the layouts the CLI refuses, one line each: tests/e2e/test_bad_input.py."""

from __future__ import annotations

import json
import shutil
import subprocess

import pytest
from support import (
    PROJECT_DIR,
    TORCHRUN,
    Case,
    Fault,
    assert_ok,
    cli,
    job_args,
    muon_required,
    read_summary,
    run_case,
    run_cli,
    subprocess_env,
)

from mingpt import compat
from mingpt.checkpoint import store as snap

pytestmark = pytest.mark.skipif(compat.TORCH < compat.FSDP_TORCH, reason="mesh layouts on a CPU need torch 2.7")
# Absolute, the weights after 4 steps of layout_worker.ADAMW: one fp32 rounding of a norm's gain of ~1 is 1.2e-7;
# measured <= 1.2e-7 for every layout under this CPU's avx2 kernels and under ATEN_CPU_CAPABILITY=default alike (an
# AMD EPYC, 2026-12-07). With AdamW's own epsilon (1e-8), whose update divides by the gradient's size, the same
# layouts were 4.1e-5 and 2.7e-5 apart: the last bits of the gradients, amplified.
TOLERANCE = 1e-6
# Muon orthogonalises in bf16 (torch's Newton-Schulz): the last-bit differences of fp32 gradient reductions flip bf16
# roundings, which the iteration carries into the update: 2.6e-3 to 3.8e-3 in 4 steps, as between DDP and one
# process. The gathering itself is checked to 1e-6 on identical gradients (test_mesh_muon_orthogonalises_whole_
# matrices_not_their_shards, below; on plain tensors, to the bit: tests/unit/test_muon.py); resumes stay bit for bit.
MUON_TOLERANCE = 2e-2
# Muon under plain DDP is in the kill-and-resume tests (tests/e2e/test_resume.py); "dp_tp" (replicas x TP, the same
# TP code as fsdp_tp) and "pp_fsdp" (GPipe, as pp_gpipe) run with `tests/workers/layout_worker.py` by hand, to keep
# CI short.
TWO = ("tp", "pp", "pp_gpipe", "pp_interleaved", "fsdp", "fsdp_muon", "tp_muon", "pp_muon")
CHECKS = ("mesh_muon", "nonfinite_skip")  # checks of the 2-process launch that are not layouts (layout_worker.CHECKS)
CHECKS4 = ("nonfinite_skip4",)  # of the 4-process launch
FOUR = ("fsdp_tp", "pp_dp", "pp_fsdp_interleaved", "pp_tp", "hsdp", "pp4", "tp4")


def launch(tmp_path_factory, nproc: int, layouts: tuple[str, ...]) -> dict:
    out = tmp_path_factory.mktemp(f"layouts{nproc}")
    command = [*TORCHRUN, "--standalone", f"--nproc_per_node={nproc}",
               str(PROJECT_DIR / "tests" / "workers" / "layout_worker.py"), str(out), *layouts]
    done = subprocess.run(command, cwd=out, env={**subprocess_env(out), "OMP_NUM_THREADS": "1"}, capture_output=True,
                          text=True, timeout=600)
    results = json.loads((out / "result.json").read_text()) if (out / "result.json").exists() else {}
    return {"code": done.returncode, "log": done.stdout[-3000:] + done.stderr[-3000:], "results": results}


@pytest.fixture(scope="module")
def two(tmp_path_factory) -> dict:
    return launch(tmp_path_factory, 2, (*CHECKS, *TWO))


@pytest.fixture(scope="module")
def four(tmp_path_factory) -> dict:
    return launch(tmp_path_factory, 4, (*CHECKS4, *FOUR))


def check_layout(run: dict, name: str) -> None:
    assert name in run["results"], run["log"]
    result = run["results"][name]
    tolerance = MUON_TOLERANCE if name.endswith("muon") else TOLERANCE
    assert result["max_difference"] < tolerance, result  # the weights of one process
    assert result["resume_exact"], result  # resumed from step 3: bit for bit
    assert result["cross_exact"], result  # loaded by the next layout: bit for bit
    assert result["tools_exact"], result  # read by one process, as snapshot.py and sample.py read it


@pytest.mark.parametrize("name", TWO)
def test_two_process_layouts_compute_what_one_process_computes_and_resume_exactly(two, name):
    check_layout(two, name)
    assert two["code"] == 0, two["log"]


@pytest.mark.parametrize("name", FOUR)
def test_four_process_layouts_compute_what_one_process_computes_and_resume_exactly(four, name):
    check_layout(four, name)
    assert four["code"] == 0, four["log"]


@muon_required()
def test_mesh_muon_orthogonalises_whole_matrices_not_their_shards(two):
    """Rows sharded as FSDP2 places them, columns as tensor parallelism does, given bit-identical gradients."""
    assert "mesh_muon" in two["results"], two["log"]
    result = two["results"]["mesh_muon"]
    for split in ("rows", "columns"):
        weights, momentum = result[f"mesh_muon_{split}"]
        assert weights < 1e-6 and momentum < 1e-6, result  # torch's Muon on the whole matrix, to fp32 rounding
        assert result[f"torch_muon_on_pieces_{split}"][0] > 1e-4, result  # the fault the gathering avoids


@pytest.mark.parametrize("launch_name, check", [("two", "nonfinite_skip"), ("four", "nonfinite_skip4")])
def test_a_nan_in_one_ranks_gradient_is_skipped_by_every_rank_on_every_layout(launch_name, check, request):
    """After the layout's reductions rank 1 alone sees a NaN gradient at one step: every rank skips that step (the
    whole weights do not move), counts it, and trains on; the whole weights end equal on every rank."""
    run = request.getfixturevalue(launch_name)
    assert check in run["results"], run["log"]
    for layout, result in run["results"][check].items():
        assert set(result["skipped_per_rank"]) == {1}, (layout, result)
        assert result["unchanged"] and result["digests_equal"] and result["finite"], (layout, result)


def hybrid_args(snaps, run_dir, max_steps: int = 16, *more: str) -> list[str]:
    """The tiny model as 2 pipeline stages (on 4 processes: x 2 replicas) unless `more` says otherwise."""
    return job_args(snaps, run_dir, *(more or ("parallel_config.pp=2",)), max_steps=max_steps, save_every_steps=4,
                    keep_last=5)


def test_the_surveys_hybrid_example_survives_a_kill_and_resumes_on_other_layouts(tmp_path):
    # A worker SIGKILLed mid-run; torchrun restarts all four, they resume from the stages' shards: the weights of
    # the same command uninterrupted (the reference run, in tmp_path/reference).
    run_case(Case("hybrid", tuple(hybrid_args("{s}", "{d}/run")), nproc=4, fault=Fault(at_step=9), reference=True,
                  expect=("pp 2 x dp_replicate 2", "resumed from")), tmp_path)
    snaps_a, run_a = tmp_path / "reference" / "snaps", tmp_path / "reference" / "run"
    assert read_summary(run_a)["replicas_identical"]

    # The snapshot tools read its shards: the digest the run reported, the layout it ran under, a sample.
    info = snap.summary(snap.read_snapshot(str(snaps_a / "snapshot-000000016.dcp")))
    assert info["weights_sha256"] == read_summary(run_a)["weights_sha256"]
    assert info["layout"] == "pp 2 x dp_replicate 2" and info["world_size"] == 4
    sample = subprocess.run(cli([f"snapshot={snaps_a / 'snapshot-000000016.dcp'}", "max_new_tokens=20"],
                                script="sample.py"), cwd=tmp_path, env=subprocess_env(tmp_path), capture_output=True,
                            text=True, timeout=120)
    assert_ok(sample)

    # Its step-12 snapshot resumed by one process and by FSDP on two, at the same global sample.
    folder = snaps_a / "snapshot-000000012.dcp"
    for nproc, more in ((None, ("parallel_config.pp=1",)), (2, ("parallel_config.strategy=fsdp",))):
        snaps = tmp_path / f"snaps_{nproc or 1}"
        snaps.mkdir()
        shutil.copytree(folder, snaps / folder.name)
        resumed = run_cli(hybrid_args(snaps, tmp_path / f"run_{nproc or 1}", 14, *more), tmp_path, nproc=nproc)
        assert_ok(resumed)
        assert "trained under pp 2 x dp_replicate 2" in resumed.stdout
        assert f"continuing at global sample {12 * 2 * 8} of epoch 0" in resumed.stdout
        assert read_summary(tmp_path / f"run_{nproc or 1}")["steps"] == 14
