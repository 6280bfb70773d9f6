"""What differs between the torch releases this project supports, in one place: the range, the one-line refusal of
a feature the running torch is too old for, and every call of a private torch interface, each behind a guard with
a public fallback (README, "Supported versions"). Private names that are only names (a logger's, those DCP's shard
index pickles) stay where they are used; docs/private-interfaces.md lists them all.

    check_torch_supported()                  # at start-up: torch older than OLDEST_TORCH is one line, not a TypeError
    require_torch((2, 7), "some feature")    # a feature that needs a newer torch than the oldest supported
    DDP(model, **ddp_no_buffer_sync())       # DDP's keyword for "buffers need no syncing" in this release
    distribute_locally(whole, mesh, placements)  # a DTensor of a value every rank holds, without communication
    dcp.save(state, **dcp_alone(group))      # DCP's keywords for a group, or for this process alone (None)
    abort_process_group()                    # a failed rank leaves its NCCL communicators without waiting for peers
    sharded_gradient_scaler(device, group)   # fp16 under FSDP: an overflow agreed across ranks, for fused AdamW
    step_unless(optimizer, skip)             # a fused AdamW step skipped on the device (skips_on_device: can it?)
    cpu_has_native_bf16()                    # bf16 in hardware on this CPU (mixed_precision=auto)
"""

from __future__ import annotations

import inspect
import re
from typing import Any

import torch
import torch.distributed as dist

from mingpt.errors import UsageError

OLDEST_TORCH = (2, 6)  # the oldest release CI runs (.ci/run's second leg)
NEWEST_TORCH = (2, 15)  # the newest release the package index served when the range was last checked
# FSDP2 (strategy=fsdp, and the mesh layouts built on it): on a CPU torch 2.6's records events on CPU streams, which
# lack them, so no test can run it there, and on a GPU it has never run: refused below the oldest release CI runs it on
FSDP_TORCH = (2, 7)
MUON_TORCH = (2, 9)  # torch.optim.Muon's first release


def version_tuple(version: str) -> tuple[int, int]:
    """(major, minor) of a version string such as "2.11.0+cu130" or "2.6.0a0+git1234"."""
    match = re.match(r"(\d+)\.(\d+)", version)
    if match is None:
        raise ValueError(f"not a version: {version!r}")
    return int(match.group(1)), int(match.group(2))


TORCH = version_tuple(torch.__version__)


def _named(version: tuple[int, int]) -> str:
    return ".".join(str(part) for part in version)


def check_torch_supported() -> None:
    """Stop with one line on a torch older than the oldest supported one (a newer one is only untested)."""
    if TORCH < OLDEST_TORCH:
        raise UsageError(f"torch {torch.__version__} is older than this project supports (torch {_named(OLDEST_TORCH)}"
                         f" to {_named(NEWEST_TORCH)}): install a newer torch, e.g. pip install 'torch>="
                         f"{_named(OLDEST_TORCH)}'")


def require_torch(version: tuple[int, int], feature: str) -> None:
    """Refuse `feature` in one line when the running torch is older than `version`."""
    if TORCH < version:
        raise UsageError(f"{feature} needs torch {_named(version)} or newer; this is torch {torch.__version__}")


def require_fsdp(feature: str) -> None:
    """Refuse FSDP2 (and what is built on it) in one line below FSDP_TORCH, on every device."""
    if TORCH < FSDP_TORCH:
        raise UsageError(f"{feature} needs torch {_named(FSDP_TORCH)} or newer, the oldest release it is tested on; "
                         f"this is torch {torch.__version__}")


def check_muon_available() -> None:
    """optimizer_config.name=muon uses torch's own Muon: refused in one line where this torch has none."""
    require_torch(MUON_TORCH, "optimizer_config.name=muon (torch.optim.Muon)")
    if not hasattr(torch.optim, "Muon"):  # a build without it
        raise UsageError(f"optimizer_config.name=muon needs torch.optim.Muon, which torch {torch.__version__} lacks")


def ddp_no_buffer_sync() -> dict[str, Any]:
    """DDP's keyword for "skip syncing the module's buffers before each forward pass": `forward_sync_buffers`
    since torch 2.13, which deprecates `broadcast_buffers` with a warning; older releases know only the latter."""
    from torch.nn.parallel import DistributedDataParallel

    if "forward_sync_buffers" in inspect.signature(DistributedDataParallel.__init__).parameters:
        return {"forward_sync_buffers": False}
    return {"broadcast_buffers": False}


def distribute_locally(tensor: torch.Tensor, mesh: Any, placements: Any) -> Any:
    """A DTensor of `tensor` (the same whole value on every rank) with `placements` on `mesh`, each rank keeping its
    own part: `src_data_rank=None` (torch 2.7 and newer) says so without communication; older releases scatter
    rank 0's value, which is the same one."""
    from torch.distributed.tensor import distribute_tensor

    if "src_data_rank" in inspect.signature(distribute_tensor).parameters:
        return distribute_tensor(tensor, mesh, placements, src_data_rank=None)
    return distribute_tensor(tensor, mesh, placements)


def dcp_alone(group: Any) -> dict[str, Any]:
    """torch.distributed.checkpoint's save/load keywords for `group`, None meaning this process alone: `no_dist`
    (torch 2.7 and newer) says so outright; older releases assume it when no process group exists."""
    import torch.distributed.checkpoint as dcp

    if "no_dist" in inspect.signature(dcp.save).parameters:
        return {"process_group": group, "no_dist": group is None}
    return {"process_group": group}


def abort_process_group() -> None:
    """A rank that failed leaves its NCCL communicators without waiting for peers that may never come.

    Private interface: `torch.distributed.distributed_c10d._abort_process_group` (seen in torch 2.6 and 2.13; on
    gloo a no-op with a warning in 2.6, so it is called for NCCL only). Where it is missing (private: it may move),
    nothing is called and the communicators end with the process: the public `destroy_process_group()` is no
    fallback, as on NCCL it can wait for peers. gloo needs neither: its sockets close with the process."""
    if not dist.is_initialized() or dist.get_backend() != "nccl":
        return
    abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
    if abort is not None:
        abort()


def sharded_gradient_scaler(device: torch.device, group: Any) -> torch.amp.GradScaler:
    """fp16 under FSDP: each rank sees only its shards' gradients, so an overflow is agreed across ranks (torch's
    ShardedGradScaler all-reduces it over `group`).

    Private interface: ShardedGradScaler hands fused AdamW a (1,)-shaped overflow flag summed over ranks, where the
    fused step wants GradScaler's ()-shaped 0/1 (it subtracts the flag from its step counts: torch/optim/adam.py,
    _fused_adam); the flags are reshaped in GradScaler's private `_per_optimizer_states` (seen in torch 2.6 to
    2.13). Where that is missing, fp16 under FSDP is refused in one line: bf16 needs no loss scaling."""
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    class AgreedOverflowScaler(ShardedGradScaler):
        def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
            super().unscale_(optimizer)
            state = self._per_optimizer_states[id(optimizer)]
            state["found_inf_per_device"] = {where: flag.clamp(max=1.0).reshape(())
                                             for where, flag in state["found_inf_per_device"].items()}

    scaler = AgreedOverflowScaler(device.type, enabled=True, process_group=group)
    if not isinstance(getattr(scaler, "_per_optimizer_states", None), dict):
        raise UsageError(f"mixed_precision=fp16 under FSDP needs GradScaler internals that torch {torch.__version__} "
                         f"lacks (an overflow agreed across ranks): use mixed_precision=bf16")
    return scaler


def skips_on_device(optimizer: torch.optim.Optimizer) -> bool:
    """Whether `optimizer` can be told to skip a step on the device (`step_unless`): torch's fused Adam and AdamW,
    which honour the overflow flag GradScaler hands them. Where the marker is missing: no (steps are decided on the
    host, as for Muon)."""
    return bool(getattr(optimizer, "_step_supports_amp_scaling", False)) and all(
        group.get("fused") for group in optimizer.param_groups)


def step_unless(optimizer: torch.optim.Optimizer, skip: torch.Tensor) -> None:
    """`optimizer.step()`, skipped on the device where `skip` (a ()-shaped float on the parameters' device) is 1:
    no update, no weight decay, the step counts unchanged, and no host synchronisation.

    Private interface: the `found_inf` attribute GradScaler sets on optimizers that declare
    `_step_supports_amp_scaling` (torch/amp/grad_scaler.py, GradScaler.step: "add two Tensor attributes of
    `grad_scale` and `found_inf` to the passed optimizer"), read by torch/optim/adam.py's step and honoured by
    `_fused_adam` (the kernel returns early where the flag is 1, then the step counts are decremented by it); seen
    in torch 2.6 to 2.13. Only called where `skips_on_device` says the optimizer declares it."""
    optimizer.found_inf = skip
    try:
        optimizer.step()
    finally:
        del optimizer.found_inf


def cpu_has_native_bf16() -> bool:
    """Whether this CPU multiplies bf16 in hardware (AVX512-BF16 or AMX tiles). Private interface:
    torch.cpu._is_avx512_bf16_supported / _is_amx_tile_supported (they also check what the OS enables); where they
    are missing, the CPU flags Linux reports in /proc/cpuinfo."""
    checks = [getattr(torch.cpu, name, None) for name in ("_is_avx512_bf16_supported", "_is_amx_tile_supported")]
    if any(check is not None for check in checks):
        return any(check is not None and check() for check in checks)
    return bool(_cpu_flags() & {"avx512_bf16", "amx_tile"})


def _cpu_flags(path: str = "/proc/cpuinfo") -> set[str]:
    try:
        with open(path, encoding="utf-8") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.partition(":")[2].split())
    except OSError:
        pass
    return set()
