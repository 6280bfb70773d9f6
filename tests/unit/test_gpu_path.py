"""The GPU path, checked on a CPU in one process: precision choice on simulated GPUs and bench.py's datasheet peaks
(batches, DataLoader workers and resuming across a change of mixed_precision: tests/e2e/test_gpu_path.py)."""

import logging
from types import SimpleNamespace

import pytest
import torch
from support import gpu_path_trainer

from benchmarks import bench
from mingpt.errors import UsageError
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
