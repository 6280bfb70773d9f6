"""Snapshots without a stall: a save's copy of the state into host memory (store.HostStaging) reuses its buffers,
runs beside training (a staging thread on a CPU, the training stream on a GPU) and is waited for only where the live
tensors change in place: the optimizer step (Checkpointer.before_update), a restore, the end. A snapshot holds the
state of the step it names, never a later step's weights, for single files and shards alike."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from support import fsdp_trainer, make_trainer

from mingpt.checkpoint import store as snap
from mingpt.checkpoint.checkpointer import Cadence, Checkpointer
from mingpt.distributed.process_group import DistContext
from mingpt.parallel.state import is_dtensor

SLOW_COPY_S = 0.4  # far longer than a step of the tiny model: an update that did not wait would land inside it


def assert_same(actual, expected, path: str = "state") -> None:
    """Equal nests: tensors bit for bit (a DTensor whole), everything else by ==."""
    if isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor), path
        whole = [t.full_tensor() if is_dtensor(t) else t for t in (actual, expected)]
        same = whole[0].dtype == whole[1].dtype and torch.equal(whole[0].cpu(), whole[1].cpu())
        assert same, f"{path} differs"
    elif isinstance(expected, dict):
        assert isinstance(actual, dict) and actual.keys() == expected.keys(), path
        for key in expected:
            assert_same(actual[key], expected[key], f"{path}.{key}")
    elif isinstance(expected, (list, tuple)):
        assert len(actual) == len(expected), path
        for index, (a, e) in enumerate(zip(actual, expected)):
            assert_same(a, e, f"{path}.{index}")
    else:
        assert actual == expected, path


def tensors_of(state) -> list[torch.Tensor]:
    return list(snap._walk_tensors(state))


class LateCopy:
    """Every CPU tensor copied on the staging thread, which first waits for `go` (at most 10 s), then SLOW_COPY_S
    more: a copy still reading the live tensors when the next optimizer step (or a load) comes."""

    def __init__(self, monkeypatch) -> None:
        self.go = threading.Event()
        copy_now = snap.copy_tensors

        def copy_late(pairs) -> None:
            self.go.wait(10)
            time.sleep(SLOW_COPY_S)
            copy_now(pairs)

        monkeypatch.setattr(snap, "BACKGROUND_COPY_BYTES", 0)
        monkeypatch.setattr(snap, "copy_tensors", copy_late)

    def after_the_next_backward(self, trainer) -> None:
        """The copy starts once the trainer's next forward and backward pass is done, so that whatever the machine's
        speed it is still running when that step's update comes."""
        forward_backward = trainer.parallel.forward_backward

        def then_go(*args, **kwargs):
            loss = forward_backward(*args, **kwargs)
            self.go.set()
            return loss

        trainer.parallel.forward_backward = then_go


@pytest.fixture
def late_copy(monkeypatch) -> LateCopy:
    return LateCopy(monkeypatch)


# ------------------------------------------------------------------------------------------- HostStaging alone
def test_staging_reuses_its_buffers_and_replaces_those_that_no_longer_fit(monkeypatch):
    monkeypatch.setattr(snap, "BACKGROUND_COPY_BYTES", 1024)  # w on the staging thread, b and step copied at once
    live = {"model": {"w": torch.randn(32, 32), "b": torch.randn(4)},
            "optimizer": {"state": {0: {"step": torch.tensor(3.0)}}, "param_groups": [{"lr": 0.1, "params": [0]}]},
            "progress": {"step": 3}}
    staging = snap.HostStaging()
    first = staging.stage(live).result()
    assert_same(first, live)
    assert not {t.data_ptr() for t in tensors_of(first)} & {t.data_ptr() for t in tensors_of(live)}  # private
    live["optimizer"]["param_groups"][0]["lr"] = 0.2  # the containers are the copy's own
    assert first["optimizer"]["param_groups"][0]["lr"] == 0.1
    buffers = {name: first["model"][name].data_ptr() for name in ("w", "b")}

    live["model"]["w"].add_(1.0)
    live["model"]["b"] = torch.randn(5)  # another shape: a new buffer for it alone
    second = staging.stage(live).result()
    assert_same(second, live)
    assert second["model"]["w"].data_ptr() == buffers["w"] and second["model"]["b"].data_ptr() != buffers["b"]
    assert second["model"]["w"] is first["model"]["w"]  # the same buffer, so the previous copy is gone from it

    live["model"]["w"] = live["model"]["w"].to(torch.float64)  # another dtype: a new buffer
    third = staging.stage(live).result()
    assert_same(third, live)
    assert third["model"]["w"].data_ptr() != buffers["w"]


def test_a_large_cpu_copy_runs_beside_the_training_thread_until_it_is_done_reading(monkeypatch):
    released = threading.Event()
    copy_now = snap.copy_tensors

    def copy_when_released(pairs) -> None:
        assert released.wait(10)
        copy_now(pairs)

    monkeypatch.setattr(snap, "copy_tensors", copy_when_released)
    live = {"w": torch.arange(2 * snap.BACKGROUND_COPY_BYTES, dtype=torch.float32)}  # over the threshold
    expected = live["w"].clone()
    started = time.perf_counter()
    staged = snap.HostStaging().stage(live)
    assert time.perf_counter() - started < 5  # stage() did not wait for the copy
    reader = threading.Thread(target=staged.done_reading)
    reader.start()
    reader.join(0.2)
    assert reader.is_alive()  # the training thread would still be held before its update
    released.set()
    reader.join(10)
    assert not reader.is_alive()
    live["w"].zero_()  # the update, after done_reading: the copy keeps the staged values
    assert torch.equal(staged.result()["w"], expected)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a GPU's copies: pinned buffers, the training stream")
def test_on_a_gpu_the_copy_is_queued_before_the_update_and_needs_no_wait():
    device = torch.device("cuda", torch.cuda.current_device())
    live = {"w": torch.randn(64 * 2**20, device=device), "step": torch.tensor(1.0)}  # 256 MiB, and a CPU scalar
    expected = {"w": live["w"].cpu(), "step": live["step"].clone()}
    staging = snap.HostStaging()
    staged = staging.stage(live)
    assert staged.done_reading() == 0.0  # the training thread goes straight on
    live["w"].add_(1.0)  # the optimizer's update: queued after the copy on the same stream
    live["step"].add_(1.0)  # a small CPU tensor was copied at once
    copy = staged.result()
    assert copy["w"].device.type == "cpu" and copy["w"].is_pinned()
    assert_same(copy, expected)
    again = staging.stage(live).result()
    assert again["w"].data_ptr() == copy["w"].data_ptr()  # the pinned buffer is reused
    assert torch.equal(again["w"], live["w"].cpu())


# ------------------------------------------------------------------------------------------- in the trainer
def test_a_snapshot_holds_the_state_of_its_step_while_training_goes_on(tmp_path, late_copy):
    """Saved at step 3 with the copy still running, then 2 more steps: an update that did not wait for the copy
    would put step 4's weights and moments into the snapshot of step 3."""
    trainer = make_trainer(snapshots=tmp_path / "snaps", max_steps=20, keep_last=5)
    for _ in range(3):
        trainer.train_step()
    late_copy.after_the_next_backward(trainer)
    at_step_3 = {key: snap.cpu_copy(trainer.checkpoints.stateful[key].state_dict()) for key in ("model", "optimizer")}
    blocked_in_save = trainer.checkpoints.save(trainer.step, "test")
    assert blocked_in_save < SLOW_COPY_S  # save() itself does not wait for the copy
    trainer.train_step()
    trainer.train_step()
    trainer.checkpoints.wait()

    saved = snap.read_snapshot(str(tmp_path / "snaps" / snap.snapshot_name(3)))
    assert saved["progress"]["step"] == 3
    assert_same(saved["model"], at_step_3["model"])
    assert_same(saved["optimizer"], at_step_3["optimizer"])
    now = trainer.parallel.modules[0].state_dict()
    assert not all(torch.equal(now[name], at_step_3["model"][name]) for name in now)  # training went on
    # The step after the save waited for the copy: the wait is the save's, beside its time in save() (bench.py)
    assert trainer.checkpoints.blocked_s[-1] >= SLOW_COPY_S / 2 + blocked_in_save


def test_a_restore_waits_for_the_copy_before_loading_into_the_live_state(tmp_path, monkeypatch):
    """A rollback loads an older snapshot into the live tensors: the newer one still being copied keeps its step's
    state."""
    trainer = make_trainer(snapshots=tmp_path / "snaps", max_steps=20, keep_last=5)
    for _ in range(2):
        trainer.train_step()
    trainer.checkpoints.save(trainer.step, "test")
    trainer.checkpoints.wait()
    for _ in range(2):
        trainer.train_step()
    at_step_4 = snap.cpu_copy(trainer.checkpoints.stateful["model"].state_dict())
    LateCopy(monkeypatch).go.set()  # the copy starts at once, and takes SLOW_COPY_S
    trainer.checkpoints.save(trainer.step, "test")
    trainer.checkpoints.restore()  # the newest complete snapshot: step 2's, or step 4's once written
    trainer.checkpoints.wait()
    saved = snap.read_snapshot(str(tmp_path / "snaps" / snap.snapshot_name(4)))
    assert_same(saved["model"], at_step_4)


def test_a_rank_that_does_not_write_copies_nothing_and_never_waits(tmp_path, monkeypatch):
    """Under DDP only global rank 0 writes: the others' saves and updates must not depend on any copy."""
    def no_copy(pairs) -> None:
        raise AssertionError("a rank that does not write copied its state")

    monkeypatch.setattr(snap, "BACKGROUND_COPY_BYTES", 0)
    monkeypatch.setattr(snap, "copy_tensors", no_copy)
    weights = torch.nn.Linear(4, 4)
    second_rank = DistContext(rank=1, world_size=2)
    checkpoints = Checkpointer(snap.SnapshotStore(str(tmp_path)), {"model_config": {}, "vocab": "ab"}, Cadence(),
                               second_rank, {"model": weights})
    assert checkpoints.save(1, "test") == 0.0
    checkpoints.before_update()
    checkpoints.wait()
    assert checkpoints.blocked_s == [] and list(tmp_path.iterdir()) == []


@pytest.mark.usefixtures("no_process_group_left")
def test_shards_stay_dtensors_of_their_layout_in_reused_host_buffers():
    trainer = fsdp_trainer(max_steps=10)
    trainer.train_step()
    states = {key: obj.state_dict() for key, obj in trainer.checkpoints.stateful.items()}
    live = [t for t in tensors_of(states) if is_dtensor(t)]
    assert live  # FSDP's parameters and AdamW's moments
    staging = snap.HostStaging()
    first = staging.stage(states).result()
    staged = [t for t in tensors_of(first) if is_dtensor(t)]
    assert len(staged) == len(live)
    for copy, original in zip(staged, live):
        assert copy.placements == original.placements and copy.device_mesh == original.device_mesh
        assert copy.shape == original.shape and copy.to_local().device.type == "cpu"
        assert copy.to_local().data_ptr() != original.to_local().data_ptr()
        assert torch.equal(copy.to_local(), original.to_local())
    second = staging.stage(states).result()
    assert [t.to_local().data_ptr() for t in tensors_of(second) if is_dtensor(t)] == \
        [t.to_local().data_ptr() for t in staged]


@pytest.mark.usefixtures("no_process_group_left")
def test_a_sharded_snapshot_holds_the_shards_of_its_step_while_training_goes_on(tmp_path, late_copy):
    trainer = fsdp_trainer(snapshots=tmp_path / "snaps", max_steps=20, keep_last=5)
    for _ in range(2):
        trainer.train_step()
    late_copy.after_the_next_backward(trainer)
    model = {name: t.full_tensor().clone() for name, t in trainer.checkpoints.stateful["model"].state_dict().items()}
    moments = {f"{name}.{key}": (value.full_tensor() if is_dtensor(value) else value).clone()
               for name, entry in trainer.checkpoints.stateful["optimizer"].state_dict()["state"].items()
               for key, value in entry.items()}
    trainer.checkpoints.save(trainer.step, "test")
    trainer.train_step()
    trainer.train_step()
    trainer.checkpoints.wait()
    saved = snap.read_snapshot(str(tmp_path / "snaps" / snap.snapshot_name(2, sharded=True)))
    assert saved["progress"]["step"] == 2
    assert_same(snap.model_tensors(saved), model)
    assert_same(saved["shards"].full("optimizer.state."), moments)
    assert trainer.checkpoints.blocked_s[-1] >= SLOW_COPY_S / 2
