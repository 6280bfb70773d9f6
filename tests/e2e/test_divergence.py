"""Runs that go wrong, through the command a user runs: a learning rate that is too high stops the run in one line
with only finite snapshots left and a saner relaunch trains on (one process, DDP and FSDP on 2), and the best
snapshot survives a kill and retention. In one process, in more detail: tests/unit/test_divergence.py; a NaN on one
rank on every layout: tests/e2e/test_layouts.py."""

from __future__ import annotations

import json
import math

import pytest
from support import Case, Fault, job_args, read_summary, run_case

import snapshot as snapshot_tool
from mingpt import compat
from mingpt.checkpoint import store as snap

# The run: AdamW's decay at lr 1000 multiplies every weight by -99 a step; non-finite within a few steps.
EXPLODING = ("optimizer_config.learning_rate=1000", "trainer_config.grad_norm_clip=0", "trainer_config.max_steps=80",
             "trainer_config.save_every_steps=10")
DIVERGED = (r"^training diverged at step \d+: 1\d steps in a row had a non-finite [a-z ]+; the newest good snapshot "
            r"is \S+/snapshot-000000000\.(pt|dcp); lower optimizer_config\.learning_rate \(peak 1e\+03 now\), or set "
            r"trainer_config\.grad_norm_clip \(0 now\), or set trainer_config\.on_divergence=rollback$")


def left_in(folder) -> dict[str, bool]:
    """The snapshots in a folder, each with whether its weights and optimizer state are all finite."""
    found = {}
    for path in sorted(folder.iterdir()):
        if snap.snapshot_step(path.name) is not None:
            snapshot = snap.read_snapshot(str(path))
            tensors = {"model": snap.model_tensors(snapshot)}
            if "shards" not in snapshot:
                tensors["optimizer"] = snapshot["optimizer"]
            found[path.name] = not snap.nonfinite_tensors(tensors)
    return found


CPU_FSDP = pytest.mark.skipif(compat.TORCH < compat.FSDP_TORCH, reason="FSDP on a CPU needs torch 2.7")


@pytest.mark.parametrize("nproc, strategy", [(None, "ddp"), (2, "ddp"), pytest.param(2, "fsdp", marks=CPU_FSDP)])
def test_a_run_that_diverges_stops_in_one_line_and_a_saner_relaunch_trains_on(nproc, strategy, tmp_path):
    layout = f"parallel_config.strategy={strategy}"
    diverged = run_case(Case("diverges", tuple(job_args("{s}", "{d}/run", *EXPLODING, layout)), nproc=nproc,
                             exit_code=3 if nproc is None else 1, error=DIVERGED), tmp_path)
    if nproc is None:  # run_case: stderr is the error line alone, no traceback
        assert len(diverged.stderr.strip().splitlines()) <= 3
    left = left_in(diverged.snapshots)
    assert left and all(left.values()), left
    if strategy == "fsdp":  # the starting point's shards as one file: its optimizer not yet stepped
        assert snapshot_tool.cli(["consolidate", str(diverged.snapshots / next(iter(left))), str(tmp_path)]) == 0
        assert snap.read_snapshot(str(tmp_path / "snapshot-000000000.pt"))["optimizer"] == {"fresh": True}

    sane = (*EXPLODING, layout, "optimizer_config.learning_rate=1e-3")
    again = tmp_path / "again"
    again.mkdir()
    relaunched = run_case(Case("relaunch", tuple(job_args("{s}", "{d}/run", *sane)), nproc=nproc,
                               expect=("resumed from", "snapshot-000000000")), again, snapshots=diverged.snapshots)
    summary = read_summary(again / "run")
    assert summary["steps"] == 80 and math.isfinite(summary["val_loss"]), relaunched.output[-2000:]
    assert all(left_in(diverged.snapshots).values())


def test_the_best_snapshot_survives_a_kill_and_retention(tmp_path):
    """A little training text (1% of the corpus, 32 steps an epoch) overfits from its second epoch on: the
    validation loss is lowest at step 50 and rises from there to step 120 (here: 3.158 at 50, 3.219 at 60, 3.279 at
    120; at 60 steps it was still falling). The worker killed at step 55 resumes from step 50 and must go on
    comparing with step 50's loss (a fresh comparison would mark a later step); with keep_last=1 the best stays
    beside the newest."""
    args = job_args("{s}", "{d}/run", "data_config.train_split=0.01", "optimizer_config.learning_rate=1e-2",
                    max_steps=120, max_epochs=5, eval_every_steps=10, save_every_steps=10, keep_last=1,
                    keep_best=True)
    outcome = run_case(Case("best", tuple(args), nproc=2, fault=Fault(at_step=55), expect=("resumed from",)),
                       tmp_path)
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    losses = {row["step"]: row["val_loss"] for row in rows if "val_loss" in row}
    best_step = min(losses, key=losses.get)
    assert best_step < 60 and losses[120] > losses[best_step], losses  # it got worse at the end
    best = snap.SnapshotStore(str(outcome.snapshots)).best()
    assert best["snapshot"] == snap.snapshot_name(best_step), (best, losses)
    assert sorted(left_in(outcome.snapshots)) == [snap.snapshot_name(best_step), snap.snapshot_name(120)]
