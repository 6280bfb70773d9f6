"""strategy=fsdp with real processes (torchrun, gloo): 2 ranks each saving their shards, a SIGKILLed worker
restarted by torchrun ending bit-for-bit equal, the 2 ranks' snapshots resumed on 1 and on 3 processes with the
global sample position kept; with Muon and AdamW where torch has Muon (AdamW alone on older torch). One run serves
several checks: the launches are the expensive part. (How close
fsdp's validation loss comes to ddp's is measured in the README's benchmark, on a longer run.)"""

import os
import shutil

import pytest
import torch
from support import Case, Fault, assert_ok, error_lines, job_args, muon_where_available, read_summary, run_case, run_cli

from mingpt import compat
from mingpt.checkpoint import store as snap


def fsdp_args(snaps, run_dir) -> list[str]:
    """Muon's matrices gathered whole from their shards, beside AdamW, where torch has Muon."""
    return job_args(snaps, run_dir, *muon_where_available(), "parallel_config.strategy=fsdp", max_steps=40,
                    save_every_steps=10, keep_last=5)


@pytest.mark.oldest_torch
@pytest.mark.skipif(compat.TORCH >= compat.FSDP_TORCH, reason="this torch runs FSDP on a CPU (the test below)")
def test_fsdp_is_refused_in_one_line_by_a_torch_too_old_for_it(tmp_path):
    result = run_cli(fsdp_args(tmp_path / "snaps", tmp_path / "run"), tmp_path, nproc=2)
    assert result.returncode != 0
    errors = error_lines(result.stderr)  # once for the job, from whichever rank failed first
    assert errors == ["error: parallel_config.strategy=fsdp needs torch 2.7 or newer, the oldest release it is tested "
                      f"on; this is torch {torch.__version__}"], result.stderr[-3000:]
    assert not (tmp_path / "snaps").exists() or not list((tmp_path / "snaps").iterdir())


@pytest.mark.oldest_torch
@pytest.mark.skipif(compat.TORCH < compat.FSDP_TORCH,
                    reason="FSDP on a CPU needs torch 2.7 (refused in one line: above)")
def test_two_ranks_save_shards_survive_a_kill_and_resume_on_one_and_three(tmp_path):
    # A worker SIGKILLed mid-run; torchrun restarts both, they resume from their shards: the weights of the same
    # command uninterrupted (the reference run).
    killed = run_case(Case("fsdp", tuple(fsdp_args("{s}", "{d}/run")), nproc=2, fault=Fault(at_step=25),
                           reference=True, expect=("resumed from",)), tmp_path)
    reference = read_summary(killed.reference)
    assert reference["steps"] == 40 and reference["replicas_identical"]
    snaps_a = killed.reference.parent / "snaps"
    folder = snaps_a / "snapshot-000000020.dcp"
    assert {".metadata", "__0_0.distcp", "__1_0.distcp", "snapshot.json"} == set(os.listdir(folder))
    newest = snap.summary(snap.read_snapshot(str(snaps_a / "snapshot-000000040.dcp")))
    assert newest["weights_sha256"] == reference["weights_sha256"] and newest["world_size"] == 2

    # The 2 ranks' step-20 snapshot, resumed by 1 process (no torchrun: a group of one) and by 3.
    for nproc in (None, 3):
        snaps = tmp_path / f"snaps_{nproc or 1}"
        snaps.mkdir()
        shutil.copytree(folder, snaps / folder.name)
        resumed = run_cli(fsdp_args(snaps, tmp_path / f"run_{nproc or 1}"), tmp_path, nproc=nproc)
        assert_ok(resumed)
        world_size = nproc or 1
        assert (f"written by 2 process(es), resuming with {world_size}: continuing at global sample 320 of epoch 0"
                in resumed.stdout)
        last = snap.read_snapshot(str(snaps / "snapshot-000000040.dcp"))
        assert last["world_size"] == world_size and last["progress"]["epoch_samples"] == 320 + 20 * world_size * 8
        assert read_summary(tmp_path / f"run_{nproc or 1}")["steps"] == 40
