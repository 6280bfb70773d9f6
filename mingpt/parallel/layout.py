"""How the processes of a job divide the work: the degrees of one device mesh and the mesh itself.

    pp            pipeline stages: each holds some of the blocks; micro-batches flow through them
    dp_replicate  data-parallel replicas: each holds whole weights (of its stage, of its tensor slice)
    dp_shard      data-parallel shards (FSDP2): each holds 1/N of the weights, gradients and optimizer state
    tp            tensor parallelism: each block's attention heads and MLP columns split over N processes

The product of the four is the number of processes; data parallelism takes what the others leave, as replicas under
`trainer_config.strategy=ddp` and as shards under `fsdp` (so `strategy` alone gives the layouts it always gave). The
mesh is ordered (pp, dp_replicate, dp_shard, tp): tensor-parallel peers get neighbouring ranks, on one node and its
fast links, and pipeline stages are the farthest apart. Every component takes the sub-mesh it needs; the data
sampler splits batches over the data-parallel ranks only (tensor-parallel peers and pipeline stages of one replica
read the same windows).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

from mingpt.errors import UsageError

MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "tp")
SCHEDULES = ("1F1B", "GPipe", "Interleaved1F1B")
REFUSED_SCHEDULES = ("InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")  # torch's zero-bubble schedules


@dataclass
class ParallelConfig:
    """Degrees of parallelism beyond data parallelism: tensor, pipeline and hybrid layouts on one device mesh."""

    tp: int = 1
    """tensor-parallel degree: each block's heads and MLP split over this many processes (must divide n_head)

    With sequence parallelism for the norms and dropout, and the loss computed over the vocabulary's shards."""
    pp: int = 1
    """pipeline-parallel degree: the blocks split into this many stages, fed micro-batches"""
    dp_replicate: Optional[int] = None
    """data-parallel replicas; null = the processes tp and pp leave, under trainer_config.strategy=ddp (else 1)"""
    dp_shard: Optional[int] = None
    """data-parallel shards (FSDP2); null = the processes tp and pp leave, under trainer_config.strategy=fsdp (else 1)

    Both set above 1: hybrid sharding (HSDP), shards within a replica, replicas of those."""
    pp_schedule: str = "1F1B"
    """1F1B | GPipe | Interleaved1F1B (several stages per process: pp_stages_per_rank)"""
    pp_microbatches: Optional[int] = None
    """micro-batches per batch in the pipeline (must divide batch_size); null = the number of stages"""
    pp_stages_per_rank: Optional[int] = None
    """pipeline stages each process holds; null = 2 under Interleaved1F1B, else 1"""
    pp_layers: Optional[list[int]] = None
    """blocks per stage, e.g. [3, 3]; null = as even as the blocks allow"""

    def __post_init__(self) -> None:
        for name in ("tp", "pp"):
            if getattr(self, name) <= 0:
                raise UsageError(f"parallel_config.{name} must be positive, got {getattr(self, name)}")
        for name in ("dp_replicate", "dp_shard", "pp_microbatches", "pp_stages_per_rank"):
            if getattr(self, name) is not None and getattr(self, name) <= 0:
                raise UsageError(f"parallel_config.{name} must be positive or null, got {getattr(self, name)}")
        if self.pp_schedule in REFUSED_SCHEDULES:
            raise UsageError(f"parallel_config.pp_schedule={self.pp_schedule} is not offered: with FSDP inside a stage "
                             f"it trains wrong without an error (measured: loss 3-4e-2 off); use Interleaved1F1B")
        if self.pp_schedule not in SCHEDULES:
            raise UsageError(f"parallel_config.pp_schedule must be one of {', '.join(SCHEDULES)}, got "
                             f"{self.pp_schedule!r}")
        if self.pp_layers is not None and (not self.pp_layers or any(n <= 0 for n in self.pp_layers)):
            raise UsageError(f"parallel_config.pp_layers must list a positive number of blocks per stage, got "
                             f"{list(self.pp_layers)}")

    @property
    def stages_per_rank(self) -> int:
        if self.pp_stages_per_rank is not None:
            return self.pp_stages_per_rank
        return 2 if self.pp_schedule == "Interleaved1F1B" else 1


@dataclass(frozen=True)
class Layout:
    """The resolved degrees: their product is the number of processes."""

    pp: int = 1
    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1

    @property
    def world_size(self) -> int:
        return self.pp * self.dp_replicate * self.dp_shard * self.tp

    @property
    def dp(self) -> int:
        """Data-parallel ranks: the batch is split over this many."""
        return self.dp_replicate * self.dp_shard

    @property
    def needs_mesh(self) -> bool:
        """True unless the layout is plain DDP or plain FSDP over every process (their own code paths)."""
        return self.tp > 1 or self.pp > 1 or (self.dp_replicate > 1 and self.dp_shard > 1)

    @property
    def sharded_state(self) -> bool:
        """True when no single process holds the whole model and optimizer: snapshots are folders of shards."""
        return self.dp_shard > 1 or self.needs_mesh

    def describe(self) -> str:
        """e.g. "pp 2 x dp_replicate 2"; "1 process" for one."""
        parts = [f"{name} {getattr(self, name)}" for name in MESH_DIMS if getattr(self, name) > 1]
        return " x ".join(parts) if parts else "1 process"

    def as_dict(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in MESH_DIMS}


def resolve_layout(cfg: ParallelConfig, strategy: str, world_size: int) -> Layout:
    """The degrees for `world_size` processes: data parallelism takes what tp, pp and any set dp degree leave, as
    shards under strategy=fsdp and as replicas under ddp. One-line error when they do not multiply to world_size."""
    fixed = cfg.tp * cfg.pp * (cfg.dp_replicate or 1) * (cfg.dp_shard or 1)
    if world_size % fixed != 0:
        raise UsageError(f"{world_size} process(es) cannot be split as {_given(cfg)}: the degrees must multiply to "
                         f"the number of processes (set parallel_config.* or the --nproc_per_node)")
    rest = world_size // fixed
    replicate, shard = cfg.dp_replicate, cfg.dp_shard
    takes_rest = "dp_shard" if strategy == "fsdp" else "dp_replicate"
    if takes_rest == "dp_shard" and shard is None:
        shard, replicate = rest, replicate or 1
    elif takes_rest == "dp_replicate" and replicate is None:
        replicate, shard = rest, shard or 1
    elif replicate is None or shard is None:  # the strategy's degree is set: the other takes the rest
        replicate, shard = replicate or rest, shard or rest
    elif rest != 1:
        raise UsageError(f"{world_size} processes cannot be split as {_given(cfg)}: the degrees multiply to "
                         f"{fixed}; leave parallel_config.dp_replicate or dp_shard null to take the rest")
    layout = Layout(pp=cfg.pp, dp_replicate=replicate, dp_shard=shard, tp=cfg.tp)
    if layout.pp > 1 and layout.tp > 1 and layout.dp > 1:
        raise UsageError(f"{layout.describe()} is not offered yet: pipeline and tensor parallelism are tested "
                         f"together and each with data parallelism, not all three at once (8+ processes)")
    return layout


def writes_shards(cfg: ParallelConfig, strategy: str, world_size: int) -> bool:
    """True when every process writes its part of each snapshot (a layout of shards or stages, or strategy=fsdp)."""
    return strategy == "fsdp" or resolve_layout(cfg, strategy, world_size).sharded_state


def _given(cfg: ParallelConfig) -> str:
    degrees = {"tp": cfg.tp, "pp": cfg.pp, "dp_replicate": cfg.dp_replicate, "dp_shard": cfg.dp_shard}
    return " x ".join(f"{name} {value}" for name, value in degrees.items() if value not in (None, 1)) or "1"


@dataclass
class Mesh:
    """The device mesh of a layout and this process's place in it. `device_mesh` is None for one process."""

    layout: Layout
    device_mesh: Any = None  # torch.distributed.device_mesh.DeviceMesh, named by MESH_DIMS

    @classmethod
    def build(cls, layout: Layout, device: torch.device) -> Mesh:
        """Collective: every process builds the same mesh (its groups are new process groups)."""
        if layout.world_size == 1:
            return cls(layout)
        from torch.distributed.device_mesh import init_device_mesh

        shape = tuple(getattr(layout, name) for name in MESH_DIMS)
        return cls(layout, init_device_mesh(device.type, shape, mesh_dim_names=MESH_DIMS))

    def coordinate(self, name: str) -> int:
        """This process's index along one mesh dimension."""
        return 0 if self.device_mesh is None else self.device_mesh.get_local_rank(name)

    @property
    def dp_rank(self) -> int:
        """This process's index among the data-parallel ranks (the batches it reads)."""
        return self.coordinate("dp_replicate") * self.layout.dp_shard + self.coordinate("dp_shard")

    def sub_mesh(self, *names: str) -> Any:
        return self.device_mesh[names if len(names) > 1 else names[0]]

    def group(self, name: str) -> Any:
        """The process group along one dimension (None for one process)."""
        return None if self.device_mesh is None else self.device_mesh.get_group(name)
