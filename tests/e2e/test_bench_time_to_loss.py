"""benchmarks/time_to_loss.py: its readers of both programs' output on real lines, and one tiny pair of whole runs
against nanoGPT's own train.py (cloned beside the project, as benchmarks/bench_launch.md has it, or where
MINGPT_NANOGPT points; skipped without it). Not a performance test."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from support import PROJECT_DIR, assert_ok, subprocess_env

from benchmarks import time_to_loss
from benchmarks.time_to_loss import Line, Logged

SCRIPT = PROJECT_DIR / "benchmarks" / "time_to_loss.py"
NANOGPT_DIR = Path(os.environ.get("MINGPT_NANOGPT", PROJECT_DIR.parent / "nanoGPT"))

# nanoGPT's train.py output (real lines, eval_interval=2), with arrival times: evaluations of 0.6 s, a checkpoint
# write of 0.04 s before iteration 2 (ckpt.pt's modification time: 2.50 s).
NANOGPT_LINES = [
    (0.50, "tokens per iteration will be: 768"),
    (1.00, "using fused AdamW: False"),
    (1.60, "step 0: train loss 4.1676, val loss 4.1649"),
    (1.80, "iter 0: loss 4.1828, time 800.00ms, mfu -100.00%"),  # 0.6 s of it the evaluation: 0.2 s training
    (1.85, "iter 1: loss 4.1373, time 50.00ms, mfu -100.00%"),
    (2.45, "step 2: train loss 3.5494, val loss 3.5571"),
    (2.46, "saving checkpoint to /tmp/out"),
    (2.55, "iter 2: loss 3.5233, time 700.00ms, mfu 0.00%"),  # less 0.6 s evaluation, 0.04 s write: 0.06 s
    (2.60, "iter 3: loss 3.4326, time 50.00ms, mfu 0.00%"),
    (3.20, "step 4: train loss 3.0627, val loss 3.0783"),
    (3.21, "saving checkpoint to /tmp/out"),
]

# Our metrics.jsonl rows (real, log_every_steps = eval_every_steps = 20) and the val lines of the same run.
OUR_ROWS = [
    {"step": 20, "epoch": 0, "train_loss": 3.370764, "lr": 0.0045, "tokens_per_s": 9639.5, "ms_per_step": 106.23,
     "elapsed_s": 2.12},
    {"step": 20, "epoch": 0, "val_loss": 2.867159, "elapsed_s": 4.19},
    {"step": 40, "epoch": 0, "train_loss": 2.739573, "lr": 0.0056, "tokens_per_s": 11143.2, "ms_per_step": 91.89,
     "elapsed_s": 6.03},
    {"step": 40, "epoch": 0, "val_loss": 2.65345, "elapsed_s": 9.24},
]
OUR_LINES = [(5.1, "08:03:16 step 20 | epoch 0 | val loss 2.8672 (2.1 s)"),
             (10.2, "08:03:21 step 40 | epoch 0 | val loss 2.6535 (3.2 s)")]


def nanogpt_logged() -> Logged:
    return Logged([Line(at, text) for at, text in NANOGPT_LINES], wall_s=4.0, checkpoint_written={2: 2.50})


def test_nanogpt_training_time_leaves_out_evaluations_and_checkpoint_writes():
    seconds = time_to_loss.nanogpt_step_seconds(nanogpt_logged())
    assert seconds == pytest.approx({0: 0.2, 1: 0.05, 2: 0.06, 3: 0.05})
    run = time_to_loss.nanogpt_crossing(nanogpt_logged(), target=3.1)
    assert run.reached and (run.step, run.val_loss, run.tokens) == (4, 3.0783, 4 * 768)
    assert run.train_s == pytest.approx(0.36) and run.wall_s == 3.20
    early = time_to_loss.nanogpt_crossing(nanogpt_logged(), target=3.5571)  # "at or below": the printed value
    assert (early.step, early.train_s, early.wall_s) == (2, pytest.approx(0.25), 2.45)


def test_a_run_that_never_reaches_the_target_has_no_numbers():
    run = time_to_loss.nanogpt_crossing(nanogpt_logged(), target=1.0)
    assert not run.reached and (run.final_step, run.final_val_loss, run.process_s) == (4, 3.0783, 4.0)
    assert run.step is run.train_s is run.wall_s is run.tokens is None
    ours = time_to_loss.ours_crossing(Logged([], 12.0), OUR_ROWS, target=1.0, tokens_per_step=1024)
    assert not ours.reached and (ours.final_step, ours.final_val_loss) == (40, 2.65345)


def test_our_training_time_is_the_trainers_own_step_times():
    logged = Logged([Line(at, text) for at, text in OUR_LINES], wall_s=12.0)
    run = time_to_loss.ours_crossing(logged, OUR_ROWS, target=2.7, tokens_per_step=1024)
    assert run.reached and (run.step, run.val_loss, run.tokens, run.wall_s) == (40, 2.65345, 40 * 1024, 10.2)
    assert run.train_s == pytest.approx((106.23 * 20 + 91.89 * 20) / 1000)
    with pytest.raises(SystemExit, match="no train row at step 30"):
        time_to_loss.ours_train_seconds(OUR_ROWS, 30)


# A tiny model and a high target, both programs: each reaches it at its first or second evaluation.
TINY_OURS = ["data_config.truncate=0.05", "data_config.block_size=32", "gpt_config.n_layer=1", "gpt_config.n_head=2",
             "gpt_config.n_embd=32", "optimizer_config.learning_rate=1e-2", "optimizer_config.warmup_steps=5",
             "trainer_config.max_steps=20"]
TINY_NANOGPT = ["--max_iters=20", "--n_layer=1", "--n_head=2", "--n_embd=32", "--learning_rate=1e-2",
                "--warmup_iters=5"]


@pytest.mark.skipif(not (NANOGPT_DIR / "train.py").is_file(),
                    reason=f"needs nanoGPT's repository at {NANOGPT_DIR} (or MINGPT_NANOGPT=DIR)")
def test_one_pair_against_nanogpt(tmp_path):
    out = tmp_path / "ttl.json"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--nanogpt", str(NANOGPT_DIR), "--target", "3.6", "--eval-every", "10",
         "--json", str(out), *[f"--nanogpt-arg={arg}" for arg in TINY_NANOGPT], *TINY_OURS],
        cwd=tmp_path, env=subprocess_env(tmp_path), capture_output=True, text=True, timeout=300)
    assert_ok(proc)
    report = json.loads(out.read_text())
    assert json.loads(proc.stdout) == report and "ours / nanoGPT, per pair" in proc.stderr
    assert report["machine"]["cpu"] and report["machine"]["torch"]
    (pair,) = report["pairs_run"]
    assert pair["order"] == ["ours", "nanogpt"]
    assert report["ours"]["tokens_per_step"] == 64 * 32  # the default batch of 64 windows, block 32
    for name, tokens_per_step in (("ours", 64 * 32), ("nanogpt", 12 * 64)):
        run = pair[name]
        assert run["reached"] and run["step"] in (10, 20) and run["val_loss"] <= 3.6
        assert run["tokens"] == run["step"] * tokens_per_step
        assert 0 < run["train_s"] < run["wall_s"] <= run["process_s"]
    ours_s, theirs_s = pair["ours"]["train_s"], pair["nanogpt"]["train_s"]  # each rounded to 0.01 s
    assert (ours_s - 0.005) / (theirs_s + 0.005) <= pair["ratio_ours_to_nanogpt"]["train_s"] <= (
        ours_s + 0.005) / (theirs_s - 0.005)
    assert report["summary"]["ratio_ours_to_nanogpt"]["wall_s"]["median"] == pair["ratio_ours_to_nanogpt"]["wall_s"]
    assert list(tmp_path.glob("time-to-loss-*")) == []  # its temporary folder is gone
