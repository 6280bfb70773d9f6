"""Runs that go non-finite, in one process: skipped steps, the stop in one line, the starting point, rollback, no
diverged snapshot ever written or resumed, and the best snapshot kept. The same across ranks and layouts under
torchrun: tests/e2e/test_divergence.py."""

import json
import logging

import pytest
import torch
from support import make_trainer, read_summary

import sample
import snapshot as snapshot_tool
from mingpt.checkpoint import store as snap
from mingpt.errors import Diverged, UsageError
from mingpt.reporting.logs import read_metrics

# A learning rate of 1000 without clipping: AdamW's decoupled decay multiplies every weight by 1 - lr * wd = -99 a
# step, and the loss or gradients are non-finite within a few steps (step 2 here).
EXPLODING = {"learning_rate": 1000.0, "grad_norm_clip": 0, "max_steps": 40, "save_every_steps": 10}


def snapshot_names(folder) -> list[str]:
    return sorted(path.name for path in folder.iterdir() if snap.snapshot_step(path.name) is not None)


def finite(path) -> bool:
    snapshot = snap.from_bytes(path.read_bytes(), str(path))
    return not snap.nonfinite_tensors({"model": snapshot["model"], "optimizer": snapshot["optimizer"]})


def weights(trainer) -> list[torch.Tensor]:
    return [p.detach().clone() for p in trainer.parallel.modules[0].parameters()]


def test_a_run_that_diverges_before_its_first_snapshot_stops_at_its_starting_point(tmp_path):
    """The stop names the starting point, written as a snapshot only now; a relaunch with a sane rate resumes from
    it and trains exactly as a fresh run does. The steps were skipped on the device (fused AdamW) and their flags
    read at the next log line: the streak is 10 or more there."""
    diverging = make_trainer(tmp_path / "run", snapshots=tmp_path / "s", **EXPLODING)
    with pytest.raises(Diverged, match=r"^training diverged at step \d+: (1\d) steps in a row had a non-finite "
                                       r"(loss|gradient norm|loss and gradient norm); the newest good snapshot is "
                                       r".*snapshot-000000000\.pt; lower optimizer_config\.learning_rate \(peak 1e\+03 "
                                       r"now\), or set trainer_config\.grad_norm_clip \(0 now\), or set "
                                       r"trainer_config\.on_divergence=rollback$"):
        diverging.fit()
    assert Diverged.exit_code == 3
    assert snapshot_names(tmp_path / "s") == ["snapshot-000000000.pt"]
    assert finite(tmp_path / "s" / "snapshot-000000000.pt")
    rows = [row for row in read_metrics(tmp_path / "run") if "skipped_steps" in row]
    assert rows and sum(row["skipped_steps"] for row in rows) >= 10

    sane = {**EXPLODING, "learning_rate": 1e-3}
    relaunched = make_trainer(snapshots=tmp_path / "s", **sane)
    relaunched.fit()
    fresh = make_trainer(**sane)
    fresh.fit()
    assert relaunched.nonfinite.total == 0 and torch.isfinite(torch.tensor(relaunched.last_val_loss))
    assert all(torch.equal(a, b) for a, b in zip(weights(relaunched), weights(fresh)))


def test_rollback_goes_back_lowers_every_rate_and_trains_to_the_end(tmp_path, caplog):
    trainer = make_trainer(tmp_path / "run", snapshots=tmp_path / "s", on_divergence="rollback",
                           rollback_lr_factor=0.001, **EXPLODING)
    with caplog.at_level(logging.WARNING):
        trainer.fit()
    assert trainer.step == 40 and trainer.rollbacks >= 1
    assert trainer.lr_scale == pytest.approx(0.001 ** trainer.rollbacks)
    assert "rolled back to" in caplog.text and "every learning rate x0.001 from here (rollback 1 of 3)" in caplog.text
    newest = snap.from_bytes((tmp_path / "s" / "snapshot-000000040.pt").read_bytes(), "newest")
    assert newest["progress"]["lr_scale"] == trainer.lr_scale  # a resumed run goes on at the lowered rate
    assert read_summary(tmp_path / "run")["finished"]


def test_rollback_stops_after_max_rollbacks(tmp_path):
    trainer = make_trainer(snapshots=tmp_path / "s", on_divergence="rollback", rollback_lr_factor=0.9,
                           max_rollbacks=2, **EXPLODING)
    with pytest.raises(Diverged, match=r"after 2 rollback\(s\): .*; the newest good snapshot is .*snapshot-000000000"):
        trainer.fit()


def test_without_step_checks_no_non_finite_state_is_saved_and_the_log_line_stops_the_run(tmp_path, caplog):
    trainer = make_trainer(snapshots=tmp_path / "s", skip_nonfinite_steps=False,
                           **{**EXPLODING, "save_every_steps": 3, "log_every_steps": 12})
    with caplog.at_level(logging.WARNING), pytest.raises(Diverged, match=r"at step 12: the mean training loss is nan"):
        trainer.fit()
    assert "snapshot of step 9 not written: model." in caplog.text and "is not finite" in caplog.text
    names = snapshot_names(tmp_path / "s")
    assert names and all(finite(tmp_path / "s" / name) for name in names)


def test_a_non_finite_gradient_skips_exactly_that_step(tmp_path, monkeypatch):
    trainer = make_trainer(tmp_path, max_steps=8, log_every_steps=4)
    finish = trainer.parallel.finish_gradients
    before: list[torch.Tensor] = []

    def poisoned() -> None:
        finish()
        if trainer.step == 2:  # the third step
            before.extend(weights(trainer))
            next(trainer.parallel.modules[0].parameters()).grad[0, 0] = float("nan")

    monkeypatch.setattr(trainer.parallel, "finish_gradients", poisoned)
    steps_taken = []
    train_step = trainer.train_step

    def watched() -> None:
        train_step()
        if trainer.step == 3:
            steps_taken.append(all(torch.equal(a, b) for a, b in zip(before, weights(trainer))))

    monkeypatch.setattr(trainer, "train_step", watched)
    trainer.fit()
    assert steps_taken == [True]  # nothing moved at the skipped step
    assert trainer.nonfinite.total == 1 and trainer.step == 8
    rows = {row["step"]: row for row in read_metrics(tmp_path) if "train_loss" in row}
    assert rows[4]["skipped_steps"] == 1 and "skipped_steps" not in rows[8]
    assert all(torch.isfinite(w).all() for w in weights(trainer))


def test_an_fp16_overflow_is_the_scalers_and_training_goes_on_as_without_the_check():
    def run(check: bool):
        trainer = make_trainer(max_steps=12, mixed_precision="fp16", skip_nonfinite_steps=check)
        trainer.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**40)  # overflows at first: the scaler's skips
        trainer.fit()
        return trainer

    checked, unchecked = run(True), run(False)
    assert checked.scaler.get_scale() < 2.0**40  # the scaler skipped overflowing steps itself
    assert checked.nonfinite.total == 0
    assert all(torch.equal(a, b) for a, b in zip(weights(checked), weights(unchecked)))


def test_resuming_passes_over_a_non_finite_snapshot_and_refuses_when_all_are(tmp_path, caplog):
    common = {"max_steps": 20, "save_every_steps": 10, "keep_last": 5}
    make_trainer(snapshots=tmp_path / "s", **common).fit()
    newest = tmp_path / "s" / "snapshot-000000020.pt"
    snapshot = snap.from_bytes(newest.read_bytes(), "newest")
    snapshot["model"] = {k: torch.full_like(v, float("nan")) for k, v in snapshot["model"].items()}
    newest.write_bytes(snap.to_bytes(snap.seal(snapshot)))  # as a run before this check would have written it
    with caplog.at_level(logging.WARNING):
        resumed = make_trainer(snapshots=tmp_path / "s", **common)
        resumed.checkpoints.restore()
    assert resumed.step == 10
    assert "skipping snapshot" in caplog.text and "snapshot-000000020.pt" in caplog.text and "not finite" in caplog.text
    (tmp_path / "s" / "snapshot-000000010.pt").unlink()
    with pytest.raises(UsageError, match=r"no readable snapshot in .*: 0 damaged, 1 not finite"):
        make_trainer(snapshots=tmp_path / "s", **common).checkpoints.restore()


def test_keep_best_keeps_the_lowest_validation_loss_through_retention_and_a_resume(tmp_path, capsys):
    """Trained well, then on at a rate too high (the validation loss rises at the end): the best snapshot is the one
    of the lowest validation loss, and retention (keep_last=1) never removes it."""
    common = {"eval_every_steps": 10, "save_every_steps": 10, "keep_last": 1, "keep_best": True}
    make_trainer(tmp_path / "first", snapshots=tmp_path / "s", max_steps=60, **common).fit()
    make_trainer(tmp_path / "second", snapshots=tmp_path / "s", max_steps=100, learning_rate=1.0, **common).fit()
    losses = {row["step"]: row["val_loss"] for run in ("first", "second") for row in read_metrics(tmp_path / run)
              if "val_loss" in row}
    best_step = min(losses, key=losses.get)
    assert losses[100] > losses[best_step]  # the run got worse at the end
    store = snap.SnapshotStore(str(tmp_path / "s"))
    best = store.best()  # the resumed run went on from the first's best (a fresh comparison would mark step 70)
    assert (best["snapshot"], best["step"]) == (snap.snapshot_name(best_step), best_step)
    assert best["val_loss"] == pytest.approx(losses[best_step], abs=1e-6)  # metrics.jsonl rounds to 6 places
    assert snapshot_names(tmp_path / "s") == sorted({snap.snapshot_name(best_step), snap.snapshot_name(100)})
    assert store.best_entry().step == best_step

    # The tools take it by name: snapshot.py list marks it, info/export --which best and sample.py which=best read it.
    snapshot_tool.cli(["list", str(tmp_path / "s")])
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [row["step"] for row in rows if row.get("best")] == [best_step]
    assert snapshot_tool.cli(["info", str(tmp_path / "s"), "--which", "best"]) == 0
    assert json.loads(capsys.readouterr().out)["step"] == best_step
    assert snapshot_tool.cli(["export", str(tmp_path / "s"), str(tmp_path / "weights"), "--which", "best"]) == 0
    assert (tmp_path / "weights" / "model.safetensors").exists()
    texts = sample.run(sample.SampleConfig(snapshot=str(tmp_path / "s"), which="best", max_new_tokens=5, prompt="l"))
    assert len(texts[0]) == 6
    (tmp_path / "s" / snap.BEST_FILE).unlink()
    assert snapshot_tool.cli(["info", str(tmp_path / "s"), "--which", "best"]) == 2
    assert "no best snapshot in" in capsys.readouterr().err


def test_the_end_of_a_run_with_non_finite_weights_has_no_plot_or_sample(tmp_path, caplog):
    import main

    trainer = make_trainer(tmp_path, max_steps=2)
    trainer.fit()
    model = trainer.parallel.modules[0]
    with torch.no_grad():
        next(model.parameters()).fill_(float("nan"))
    with caplog.at_level(logging.WARNING):
        main.report_results(trainer, model, None, tmp_path)  # no plotter started, no multinomial traceback
    assert "no loss plot or sample: the weights are not finite (transformer.wte.weight" in caplog.text
    assert not (tmp_path / "loss.png").exists()


def test_a_step_reads_nothing_back_from_the_device(monkeypatch):
    """The default path (fused AdamW, the non-finite check on) hands the ranks' verdict to the optimizer on the
    device: no tensor is read on the host inside a step (on a GPU each read would wait for the step to finish), only
    when the loop settles at a log line, an evaluation or a snapshot."""
    trainer = make_trainer(max_steps=8, log_every_steps=4, eval_every_steps=0)
    reads: list[int] = []
    item, tolist = torch.Tensor.item, torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "item", lambda self: reads.append(trainer.step) or item(self))
    monkeypatch.setattr(torch.Tensor, "tolist", lambda self: reads.append(trainer.step) or tolist(self))
    in_step = []
    train_step = trainer.train_step

    def counted() -> None:
        before = len(reads)
        train_step()
        in_step.append(len(reads) - before)

    monkeypatch.setattr(trainer, "train_step", counted)
    trainer.fit()
    assert trainer.nonfinite.on_device and trainer.step == 8
    assert in_step == [0] * 8  # not one read inside a step
    assert reads and set(reads) <= {4, 8}  # the settles, log lines and the end
