"""The supported torch range and what differs inside it (compat.py), and the GPU-only faults checked on a CPU: the
process-count check with a faked device count, and the sharded snapshot writer thread's loader and device."""

import threading
import warnings

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint import filesystem
from torch.nn.parallel import DistributedDataParallel

from mingpt import compat
from mingpt.checkpoint.sharded import ShardedWriter
from mingpt.checkpoint.store import SnapshotStore
from mingpt.distributed.process_group import cuda_device
from mingpt.errors import UsageError

pytestmark = pytest.mark.oldest_torch


@pytest.mark.parametrize("version, expected", [("2.13.0", (2, 13)), ("2.11.0+cu130", (2, 11)), ("2.6.0", (2, 6)),
                                               ("2.16.0a0+git1234abc", (2, 16)), ("10.2", (10, 2))])
def test_versions_compare_by_major_and_minor(version, expected):
    assert compat.version_tuple(version) == expected


def test_a_torch_older_than_the_oldest_supported_is_one_line(monkeypatch):
    compat.check_torch_supported()  # the running one is in range (both CI legs)
    monkeypatch.setattr(compat, "TORCH", (2, 5))
    monkeypatch.setattr(torch, "__version__", "2.5.1+cu124")
    with pytest.raises(UsageError, match=r"^torch 2\.5\.1\+cu124 is older than this project supports \(torch 2\.6 "):
        compat.check_torch_supported()
    with pytest.raises(UsageError, match=r"^tensor parallelism needs torch 2\.6 or newer; this is torch 2\.5\.1"):
        compat.require_torch((2, 6), "tensor parallelism")
    compat.require_torch((2, 5), "anything older")


def test_ddp_skips_buffer_syncing_without_a_deprecation_warning():
    """torch 2.13 renamed DDP's broadcast_buffers to forward_sync_buffers (and warns on the old name); older
    releases reject the new name with a TypeError."""
    created = not dist.is_initialized()
    if created:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", FutureWarning)
            ddp = DistributedDataParallel(torch.nn.Linear(2, 2), **compat.ddp_no_buffer_sync())
        assert getattr(ddp, "forward_sync_buffers", getattr(ddp, "broadcast_buffers", None)) is False
    finally:
        if created:
            dist.destroy_process_group()


def test_the_private_abort_is_used_on_nccl_only_and_its_absence_is_survived(monkeypatch):
    calls = []
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "gloo")
    monkeypatch.setattr(dist.distributed_c10d, "_abort_process_group", lambda group=None: calls.append("abort"))
    compat.abort_process_group()
    assert calls == []  # gloo: its sockets close with the process
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    compat.abort_process_group()
    assert calls == ["abort"]
    monkeypatch.delattr(dist.distributed_c10d, "_abort_process_group")  # a torch where the private call moved
    monkeypatch.setattr(dist, "destroy_process_group", lambda group=None: calls.append("destroy"))
    compat.abort_process_group()
    assert calls == ["abort"]  # nothing that could wait for peers


def test_bf16_hardware_is_read_from_the_cpu_flags_where_torch_has_no_check(monkeypatch, tmp_path):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f avx512_bf16\n\nprocessor\t: 1\n")
    assert compat._cpu_flags(str(cpuinfo)) >= {"avx2", "avx512_bf16"}
    assert compat._cpu_flags(str(tmp_path / "missing")) == set()
    with_torch = compat.cpu_has_native_bf16()
    for name in ("_is_avx512_bf16_supported", "_is_amx_tile_supported"):
        monkeypatch.delattr(torch.cpu, name, raising=False)
    assert compat.cpu_has_native_bf16() == bool(compat._cpu_flags() & {"avx512_bf16", "amx_tile"}) == with_torch


def test_more_processes_than_gpus_is_one_line(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert cuda_device(1) == torch.device("cuda", 1)
    with pytest.raises(UsageError) as refused:
        cuda_device(2)
    assert str(refused.value) == ("this node has 2 CUDA device(s) but torchrun started 4 processes on it: use "
                                  "--nproc_per_node=2 or fewer (CUDA_VISIBLE_DEVICES limits the devices a job sees)")
    with pytest.raises(UsageError, match="2 CUDA device"):
        cuda_device(3)  # every extra rank says the same: the job prints it once


def test_the_sharded_writer_thread_stays_off_gpu_0(monkeypatch, tmp_path):
    """Where CUDA is available DCP's writer would take `torch.cuda.current_stream()` (its overlapping loader) on a
    thread whose current device is GPU 0; the state is in CPU memory already: the serial loader, and the thread is
    put on the rank's own device first."""
    def no_overlapping_loader(*args, **kwargs):
        raise AssertionError("DCP's overlapping loader (CUDA streams) was chosen")

    devices = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(filesystem, "_OverlappingCpuLoader", no_overlapping_loader)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: devices.append((threading.current_thread().name,
                                                                                 device)))
    store = SnapshotStore(str(tmp_path / "snaps"))
    writer = ShardedWriter(store, 0, None, 1, 0.0, lambda: "", torch.device("cuda", 1))
    state = {"model": {"w": torch.arange(6.0).reshape(2, 3)}, "progress": {"step": 3}}
    writer.submit("snapshot-000000003.dcp", state, {"model_config": {}, "vocab": "ab"}, 1, "test")
    writer.wait()
    assert devices == [("snapshot-writer", torch.device("cuda", 1))]
    assert (tmp_path / "snaps" / "snapshot-000000003.dcp").is_dir()
