"""The supported torch range and what differs inside it (compat.py), and the GPU-only faults checked on a CPU: the
process-count check with a faked device count, and the sharded snapshot writer thread's loader and device."""

import ast
import importlib
import importlib.util
import logging
import re
import threading
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import filesystem
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
from torch.nn.parallel import DistributedDataParallel

from mingpt import PROJECT_DIR, compat
from mingpt.checkpoint import sharded
from mingpt.checkpoint.sharded import ShardedWriter
from mingpt.checkpoint.store import SnapshotStore
from mingpt.distributed.process_group import cuda_device
from mingpt.errors import CorruptSnapshot, UsageError

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


@pytest.mark.usefixtures("no_process_group_left")
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


# ------------------------------------------------------------------------ private interfaces: each one's fallback
def test_fp16_under_fsdp_is_one_line_where_the_scaler_keeps_no_per_optimizer_states(monkeypatch):
    """tests/unit/test_fsdp.py trains fp16 under FSDP with the private state there; where a torch keeps it no more,
    the sharded scaler is refused in one line naming bf16, before any step."""
    scaler = compat.sharded_gradient_scaler(torch.device("cpu"), None)
    assert isinstance(scaler, ShardedGradScaler) and isinstance(scaler._per_optimizer_states, dict)
    init = ShardedGradScaler.__init__

    def init_without_the_states(self, *args, **kwargs):
        init(self, *args, **kwargs)
        del self._per_optimizer_states  # a torch where the private attribute moved

    monkeypatch.setattr(ShardedGradScaler, "__init__", init_without_the_states)
    with pytest.raises(UsageError) as refused:
        compat.sharded_gradient_scaler(torch.device("cpu"), None)
    assert str(refused.value).startswith("mixed_precision=fp16 under FSDP needs GradScaler internals that torch ")
    assert str(refused.value).endswith(": use mixed_precision=bf16") and "\n" not in str(refused.value)


def test_a_non_finite_step_is_skipped_on_the_host_where_adamw_announces_no_device_skip(monkeypatch):
    """Fused AdamW announces that it takes GradScaler's overflow flag (`_step_supports_amp_scaling`): the trainer's
    non-finite steps are then skipped on the device. Where a torch announces it no more, each step's flags are read on
    the host first: the same step is skipped, counted once, and nothing moves at it."""
    from support import make_trainer

    trainer = make_trainer(max_steps=6, log_every_steps=3)
    assert trainer.nonfinite.on_device and trainer.optimizers.skip_on_device
    init = torch.optim.AdamW.__init__

    def init_without_the_marker(self, *args, **kwargs):
        init(self, *args, **kwargs)
        del self._step_supports_amp_scaling  # a torch where the private attribute moved

    monkeypatch.setattr(torch.optim.AdamW, "__init__", init_without_the_marker)
    trainer = make_trainer(max_steps=6, log_every_steps=3)
    assert not trainer.nonfinite.on_device
    finish = trainer.parallel.finish_gradients
    params = list(trainer.parallel.modules[0].parameters())
    moved = []

    def poisoned() -> None:
        finish()
        if trainer.step == 2:
            moved.append([p.detach().clone() for p in params])
            params[0].grad[0, 0] = float("nan")

    trainer.parallel.finish_gradients = poisoned
    train_step = trainer.train_step

    def watched() -> None:
        train_step()
        if trainer.step == 3:
            moved[0] = any(not torch.equal(a, b) for a, b in zip(moved[0], params))

    trainer.train_step = watched
    trainer.fit()
    assert moved == [False] and trainer.nonfinite.total == 1 and trainer.step == 6


def test_the_silenced_dtensor_logger_is_the_one_that_logs_the_hints():
    """parallelize.py sets this logger to ERROR under tensor parallelism. Where the module is gone the name is an
    unused logger (nothing fails, the hints show again): then there is nothing to check."""
    name = "torch.distributed.tensor._redistribute"
    if importlib.util.find_spec(name) is None:
        pytest.skip(f"this torch has no {name}: the silencing is a no-op")
    logger = getattr(importlib.import_module(name), "logger", None)
    if logger is None:
        pytest.skip(f"this torch's {name} logs nothing: the silencing is a no-op")
    assert logger is logging.getLogger(name)


def test_a_shard_index_is_refused_in_one_line_where_a_private_class_it_names_is_gone(monkeypatch, tmp_path):
    """DCP's index pickles three private names (sharded.INDEX_CLASSES); on a torch without one, an index that names
    it is refused in one line, never unpickled further."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        dcp.save({"w": torch.ones(2, 3), "step": torch.tensor(3)},
                 storage_writer=filesystem.FileSystemWriter(str(tmp_path)), **compat.dcp_alone(None))
    data = (tmp_path / ".metadata").read_bytes()
    assert set(sharded.parse_index(data, "x").state_dict_metadata) == {"w", "step"}
    private = sorted((module, name) for module, name in sharded.INDEX_CLASSES if name.startswith("_"))
    assert private == [("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
                       ("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING"),
                       ("torch.serialization", "_get_layout")]
    for module, name in private:
        assert name.encode() in data  # each is in the index this torch writes
        with monkeypatch.context() as gone:
            gone.delattr(importlib.import_module(module), name)
            with pytest.raises(CorruptSnapshot) as refused:
                sharded.parse_index(data, "x")
        assert str(refused.value) == "x: damaged shard index (AttributeError)"


# ------------------------------------------------------------------------ private interfaces: the documented list
def private_names_used() -> dict[str, list[str]]:
    """Every private name (one leading underscore) the code of mingpt/ and the root's .py files takes from outside
    the project, with where: an attribute read (`x._name`), a name imported (`from m import _name`, a module path
    with a private part), or a string that is one name or a dotted path (getattr's, a logger's, a pickled class's).
    A name the project defines anywhere (a function, class, argument, assignment, attribute set) is its own and
    left out. Not seen: a name the project also defines, and one built at run time (an f-string)."""
    sources = sorted([*PROJECT_DIR.glob("*.py"), *PROJECT_DIR.glob("mingpt/**/*.py")])
    trees = {path: ast.parse(path.read_text(encoding="utf-8")) for path in sources}
    own: set[str] = set()
    for tree in trees.values():
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                own.add(node.name)
            elif isinstance(node, ast.arg):
                own.add(node.arg)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                own.add(node.id)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                own.add(node.attr)
            elif isinstance(node, ast.alias) and node.asname:
                own.add(node.asname)
    used: dict[str, list[str]] = {}
    for path, tree in trees.items():
        for node in ast.walk(tree):
            names: list[str] = []
            if isinstance(node, ast.Attribute):
                names = [node.attr]
            elif isinstance(node, ast.Import):
                names = [part for alias in node.names for part in alias.name.split(".")]
            elif isinstance(node, ast.ImportFrom):
                names = [alias.name for alias in node.names] + (node.module or "").split(".")
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) and re.fullmatch(
                    r"[A-Za-z_]\w*(\.\w+)*", node.value):
                names = node.value.split(".")
            for name in names:
                if re.fullmatch(r"_[A-Za-z]\w*", name) and not name.endswith("__") and name not in own:
                    used.setdefault(name, []).append(f"{path.relative_to(PROJECT_DIR)}:{node.lineno}")
    return used


PUBLIC_DESPITE_THE_UNDERSCORE = {"_exit"}  # os._exit: documented by Python (docs/private-interfaces.md says so)


def test_the_private_interfaces_page_lists_every_private_name_the_code_uses():
    page = (PROJECT_DIR / "docs" / "private-interfaces.md").read_text(encoding="utf-8")
    rows = [line.split(" | ")[0] for line in page.splitlines() if line.startswith("| `")]
    listed = {part for row in rows for name in re.findall(r"`([\w.]+)`", row) for part in name.split(".")
              if part.startswith("_")}
    used = private_names_used()
    assert {"_abort_process_group", "_per_optimizer_states"} <= set(used)  # the scan sees them
    assert {name: where for name, where in used.items()
            if name not in listed | PUBLIC_DESPITE_THE_UNDERSCORE} == {}, "used, not in docs/private-interfaces.md"
    assert listed - set(used) == set(), "in docs/private-interfaces.md, no longer used"
