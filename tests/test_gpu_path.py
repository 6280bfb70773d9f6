"""The GPU path, checked on a CPU: precision choice on simulated GPUs, batches as one contiguous window block,
resuming across a change of mixed_precision (fp16 runs on a CPU too), and bench.py's datasheet peaks."""

import functools
import logging
from types import SimpleNamespace

import pytest
import torch
from support import TINY, assert_ok, make_trainer, run_cli

from benchmarks import bench
from mingpt.errors import UsageError
from mingpt.reporting.logs import read_metrics
from trainer import resolve_precision

CUDA = torch.device("cuda", 0)


def fake_gpu(monkeypatch, name: str, major: int, bf16_tensors: bool) -> None:
    """torch.cuda as it looks on one GPU of compute capability `major`.x; bf16_tensors: whether creating a bf16
    tensor works there (on a V100 or T4 it does: emulated)."""
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: SimpleNamespace(major=major))
    monkeypatch.setattr(torch.cuda, "_check_bf16_tensor_supported", lambda device: bf16_tensors)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)


@pytest.mark.parametrize("name", ["Tesla V100-SXM2-16GB", "Tesla T4"])
def test_auto_precision_is_fp16_where_bf16_is_only_emulated(monkeypatch, name):
    fake_gpu(monkeypatch, name, major=7, bf16_tensors=True)
    assert torch.cuda.is_bf16_supported()  # what misled `auto`: the default check counts emulation
    assert resolve_precision("auto", CUDA) == torch.float16
    with pytest.raises(UsageError, match=f"bf16 is not supported on {name} .*emulation.*use fp16"):
        resolve_precision("bf16", CUDA)
    assert resolve_precision("fp16", CUDA) == torch.float16


def test_auto_precision_is_bf16_on_ampere_and_later(monkeypatch):
    fake_gpu(monkeypatch, "NVIDIA H100 80GB HBM3", major=9, bf16_tensors=True)
    assert resolve_precision("auto", CUDA) == torch.bfloat16
    assert resolve_precision("bf16", CUDA) == torch.bfloat16


# The trainers here: support.make_trainer with dropout, over 200 lines, 4 steps of batches of 8.
gpu_path_trainer = functools.partial(make_trainer, dropout=0.1, lines=200, batch_size=8, max_steps=4)


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
    args = [*TINY, f"trainer_config.max_steps={max_steps}", "trainer_config.eval_every_steps=10",
            "trainer_config.eval_batches=2", f"trainer_config.mixed_precision={precision}",
            f"hydra.run.dir={tmp_path / run}"]
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


@pytest.mark.parametrize("saved, resumed", [("fp32", "fp16"), ("bf16", "fp16"), ("fp16", "fp32"), ("fp16", "bf16"),
                                            ("fp16", "fp16")])
def test_scaler_state_across_precisions(saved, resumed, caplog):
    """In process, every direction: a scaler only where fp16 trains; its state carried over only fp16 -> fp16."""
    before = gpu_path_trainer(mixed_precision=saved)
    before.train_step()
    if before.scaler.is_enabled():
        before.scaler.update(1024.0)  # a loss scale that is not the default
    snap = {key: part.state_dict() for key, part in before.checkpoints.stateful.items()}  # what a snapshot holds
    after = gpu_path_trainer(mixed_precision=resumed)
    with caplog.at_level(logging.INFO, logger="trainer"):
        for key, part in after.checkpoints.stateful.items():
            part.load_state_dict(snap[key])
    lines = [r.getMessage() for r in caplog.records if "scale" in r.getMessage()]
    assert after.step == 1 and after.scaler.is_enabled() == (resumed == "fp16")
    if saved == resumed:
        assert lines == [] and after.scaler.get_scale() == 1024.0
    elif resumed == "fp16":
        assert len(lines) == 1 and "starting a fresh scaler" in lines[0] and after.scaler.get_scale() == 2.0**16
    else:
        assert len(lines) == 1 and "not needed" in lines[0]
    after.train_step()  # and it trains on
    assert after.step == 2


@pytest.mark.parametrize(
    "name, dtype, tf32, peak, model",
    [
        ("NVIDIA H100 80GB HBM3", torch.bfloat16, True, 989, "NVIDIA H100 SXM"),
        ("NVIDIA H100 PCIe", torch.bfloat16, True, 756, "NVIDIA H100 PCIe"),
        ("NVIDIA H100 NVL", torch.float16, True, 835, "NVIDIA H100 NVL"),
        ("NVIDIA H200", torch.bfloat16, True, 989, "NVIDIA H200 SXM"),
        ("NVIDIA H200 NVL", torch.bfloat16, True, 835, "NVIDIA H200 NVL"),
        ("NVIDIA GH200 480GB", torch.bfloat16, True, 989, "NVIDIA GH200"),
        ("NVIDIA A100-SXM4-80GB", torch.bfloat16, True, 312, "NVIDIA A100"),
        ("NVIDIA A100-PCIE-40GB", torch.float32, True, 156, "NVIDIA A100"),  # TF32 tensor cores
        ("NVIDIA H100 80GB HBM3", torch.float32, False, 67, "NVIDIA H100 SXM"),  # plain fp32
    ],
)
def test_known_datasheet_peaks(name, dtype, tf32, peak, model):
    value, source = bench.known_peak_tflops(name, dtype, tf32=tf32)
    assert value == peak and source.startswith(f"datasheet: {model}, dense ")


@pytest.mark.parametrize("name", ["Tesla V100-SXM2-16GB", "NVIDIA L4", "NVIDIA H100 80GB HBM3 MIG 3g.40gb"])
def test_unknown_gpus_have_no_datasheet_peak(name):
    assert bench.known_peak_tflops(name, torch.bfloat16) is None


def test_peak_source(monkeypatch, caplog):
    monkeypatch.setattr(bench, "measure_peak_tflops", lambda device, dtype: 123.0)
    assert bench.peak_tflops(500.0, CUDA, torch.bfloat16) == (500.0, "given")
    assert bench.peak_tflops(None, torch.device("cpu"), torch.float32) == (123.0, "measured matmul")
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    assert bench.peak_tflops(None, CUDA, torch.bfloat16) == (989.0, "datasheet: NVIDIA H200 SXM, dense bf16")
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA L4")
    with caplog.at_level(logging.WARNING, logger="bench"):
        assert bench.peak_tflops(None, CUDA, torch.bfloat16) == (123.0, "measured matmul")
    assert "no datasheet peak known for NVIDIA L4" in caplog.text
