"""The GPU path, checked on a CPU with processes: batches as one contiguous window block in the in-process path and
the DataLoader workers' (the path CUDA takes), the same weights from both, and the CLI resuming across a change of
mixed_precision (fp16 runs on a CPU too). Precision choice and peaks: tests/unit/test_gpu_path.py."""


import pytest
import torch
from support import assert_ok, gpu_path_trainer, job_args, run_cli

from mingpt.reporting.logs import read_metrics


@pytest.mark.parametrize("workers", [0, 1])
def test_batches_are_one_contiguous_window_block(workers):
    """What goes to the device is one contiguous (B, T+1) tensor (pinned as one block on CUDA); x and y are its
    views, the same values as the dataset's (x, y) pairs, in the in-process path and the DataLoader's alike."""
    trainer = gpu_path_trainer(data_loader_workers=workers)
    trainer.sampler.set_epoch(0)
    indices = next(iter(torch.utils.data.BatchSampler(trainer.sampler, 8, drop_last=True)))
    windows = next(trainer.epoch_batches())
    assert windows.shape == (8, 17) and windows.is_contiguous()
    x, y = trainer.split(windows)
    want_x, want_y = trainer.train_loader.dataset.dataset.__getitems__(indices)
    assert torch.equal(x, want_x) and torch.equal(y, want_y)
    assert x.data_ptr() == windows.data_ptr() and y.data_ptr() == windows[:, 1:].data_ptr()  # views, no copy
    val = next(iter(trainer.val_loader))
    assert val.shape == (32, 17) and val.is_contiguous()


def test_data_loader_workers_train_the_same_weights():
    """The DataLoader path (the one CUDA takes, with pinned memory there) trains exactly as the in-process one."""
    in_process, loader = gpu_path_trainer(data_loader_workers=0), gpu_path_trainer(data_loader_workers=1)
    for trainer in (in_process, loader):
        for _ in range(3):
            trainer.train_step()
    for a, b in zip(in_process.parallel.modules[0].parameters(), loader.parallel.modules[0].parameters()):
        assert torch.equal(a, b)
    assert in_process.validation_loss() == loader.validation_loss()


def precision_run(tmp_path, precision: str, max_steps: int, run: str):
    args = job_args(tmp_path / "snapshots", tmp_path / run, max_steps=max_steps, eval_every_steps=10, eval_batches=2,
                    mixed_precision=precision)
    proc = run_cli(args, tmp_path)
    assert_ok(proc)
    return proc.stdout + proc.stderr, read_metrics(tmp_path / run)


def test_fp16_resumes_a_fp32_snapshot_with_a_fresh_scaler(tmp_path):
    """The real CLI: an fp32 snapshot (no scaler state) resumed with mixed_precision=fp16 used to crash in
    GradScaler.load_state_dict; now a fresh scaler, one warning line, and training continues in fp16."""
    precision_run(tmp_path, "fp32", 10, "run_fp32")
    output, rows = precision_run(tmp_path, "fp16", 20, "run_fp16")
    warnings = [line for line in output.splitlines() if "gradient-scaler" in line]
    assert len(warnings) == 1 and "starting a fresh scaler" in warnings[0], output[-3000:]
    assert "resumed from" in output and "Traceback" not in output
    train_rows = [r for r in rows if "train_loss" in r]
    assert [r["step"] for r in train_rows] == [15, 20] and all(r["loss_scale"] > 0 for r in train_rows)
