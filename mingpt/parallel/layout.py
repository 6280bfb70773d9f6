"""How the processes of a job divide the work: the degrees of one device mesh and the mesh itself.

    pp            pipeline stages: each holds some of the blocks; micro-batches flow through them
    dp_replicate  data-parallel replicas: each holds whole weights (of its stage, of its tensor slice)
    dp_shard      data-parallel shards (FSDP2): each holds 1/N of the weights, gradients and optimizer state
    tp            tensor parallelism: each block's attention heads and MLP columns split over N processes

The product of the four is the number of processes; data parallelism takes what the others leave, as replicas under
`parallel_config.strategy=ddp` and as shards under `fsdp` (so `strategy` alone gives the layouts it always gave). The
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
STRATEGIES = ("ddp", "fsdp")
ACTIVATION_CHECKPOINTING = ("none", "blocks")
SCHEDULES = ("1F1B", "GPipe", "Interleaved1F1B")
REFUSED_SCHEDULES = ("InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")  # torch's zero-bubble schedules


@dataclass
class ParallelConfig:
    """How the model is spread over the processes: the data-parallel strategy, tensor, pipeline and hybrid layouts on
    one device mesh, and how each piece is compiled and recomputed."""

    strategy: str = "ddp"
    """ddp | fsdp: every process holds the whole model, or 1/N of its weights, gradients and optimizer state

    fsdp is torch's FSDP2 (fully_shard per transformer block and the root); its snapshots are folders of shards
    (torch.distributed.checkpoint) that resume at any number of processes. Either strategy resumes the other's
    snapshots."""
    activation_checkpointing: str = "none"
    """none | blocks: recompute each block's activations in the backward pass (less memory, more time)"""
    compile: bool = False
    """torch.compile the model

    The first step compiles (~40 s on a CPU); then ~10% faster there."""
    tp: int = 1
    """tensor-parallel degree: each block's heads and MLP split over this many processes (must divide n_head)

    With sequence parallelism for the norms and dropout, and the loss computed over the vocabulary's shards."""
    pp: int = 1
    """pipeline-parallel degree: the blocks split into this many stages, fed micro-batches"""
    dp_replicate: Optional[int] = None
    """data-parallel replicas; null = the processes tp and pp leave, under strategy=ddp (else 1)"""
    dp_shard: Optional[int] = None
    """data-parallel shards (FSDP2); null = the processes tp and pp leave, under strategy=fsdp (else 1)

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
        for name, allowed in (("strategy", STRATEGIES), ("activation_checkpointing", ACTIVATION_CHECKPOINTING)):
            if getattr(self, name) not in allowed:
                raise UsageError(f"parallel_config.{name} must be one of {', '.join(allowed)}, "
                                 f"got {getattr(self, name)!r}")
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

    def check_fits(self, n_head: int, n_layer: int, block_size: int, batch_size: int, mixed_precision: str) -> None:
        """The layout against the model's shape, the batch per process and the precision, in one line before
        anything runs (the settings come from gpt_config, data_config and trainer_config)."""
        if n_head % self.tp:
            raise UsageError(f"parallel_config.tp={self.tp} must divide gpt_config.n_head={n_head} (tensor "
                             f"parallelism splits the attention heads)")
        if block_size % self.tp:
            raise UsageError(f"parallel_config.tp={self.tp} must divide data_config.block_size={block_size} "
                             f"(sequence parallelism splits each window's positions)")
        stages = self.pp * self.stages_per_rank
        if self.pp_layers is not None and (len(self.pp_layers) != stages or sum(self.pp_layers) != n_layer):
            raise UsageError(f"parallel_config.pp_layers={list(self.pp_layers)} must give each of the {stages} "
                             f"pipeline stages its blocks, {n_layer} in all (gpt_config.n_layer)")
        if self.pp > 1 and stages > n_layer + 1:  # the first stage may hold only the embeddings
            raise UsageError(f"{stages} pipeline stages (parallel_config.pp x pp_stages_per_rank) need at least "
                             f"{stages - 1} blocks, gpt_config.n_layer={n_layer}")
        microbatches = self.pp_microbatches or stages
        if self.pp > 1 and batch_size % microbatches:
            raise UsageError(f"trainer_config.batch_size={batch_size} must split into {microbatches} pipeline "
                             f"micro-batches (parallel_config.pp_microbatches)")
        if self.pp > 1 and mixed_precision == "fp16":
            raise UsageError("mixed_precision=fp16 is not offered with pipeline parallelism (its loss scale would have "
                             "to be agreed across stages): use bf16 or fp32")


@dataclass(frozen=True)
class Layout:
    """The resolved degrees (their product is the number of processes) and who does the data parallelism: `strategy`
    "ddp" (DistributedDataParallel replicas) for plain data parallelism as asked, "fsdp" (FSDP2, over a device mesh)
    wherever the model is sharded, split or asked to be (on a mesh FSDP2 also makes the replicas)."""

    pp: int = 1
    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    strategy: str = "ddp"

    @property
    def world_size(self) -> int:
        return self.pp * self.dp_replicate * self.dp_shard * self.tp

    @property
    def dp(self) -> int:
        """Data-parallel ranks: the batch is split over this many."""
        return self.dp_replicate * self.dp_shard

    @property
    def needs_mesh(self) -> bool:
        """True unless the layout is plain DDP or plain FSDP over every process (FSDP then shards over a mesh of
        one dimension, all the processes)."""
        return self.tp > 1 or self.pp > 1 or (self.dp_replicate > 1 and self.dp_shard > 1)

    @property
    def sharded_state(self) -> bool:
        """True when every process writes its part of each snapshot (FSDP2's shards, tensor-parallel pieces,
        pipeline stages): snapshots are folders of shards."""
        return self.strategy == "fsdp"

    @property
    def name(self) -> str:
        """What logs and snapshots call the layout: the strategy for plain DDP and FSDP, else the degrees."""
        return self.describe() if self.needs_mesh else self.strategy

    def describe(self) -> str:
        """e.g. "pp 2 x dp_replicate 2"; "1 process" for one."""
        parts = [f"{name} {getattr(self, name)}" for name in MESH_DIMS if getattr(self, name) > 1]
        return " x ".join(parts) if parts else "1 process"

    def as_dict(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in MESH_DIMS}


def resolve_layout(cfg: ParallelConfig, world_size: int) -> Layout:
    """The degrees for `world_size` processes: data parallelism takes what tp, pp and any set dp degree leave, as
    shards under strategy=fsdp and as replicas under ddp. One-line error when they do not multiply to world_size."""
    fixed = cfg.tp * cfg.pp * (cfg.dp_replicate or 1) * (cfg.dp_shard or 1)
    if world_size % fixed != 0:
        raise UsageError(f"{world_size} process(es) cannot be split as {_given(cfg)}: the degrees must multiply to "
                         f"the number of processes (set parallel_config.* or the --nproc_per_node)")
    rest = world_size // fixed
    replicate, shard = cfg.dp_replicate, cfg.dp_shard
    takes_rest = "dp_shard" if cfg.strategy == "fsdp" else "dp_replicate"
    if takes_rest == "dp_shard" and shard is None:
        shard, replicate = rest, replicate or 1
    elif takes_rest == "dp_replicate" and replicate is None:
        replicate, shard = rest, shard or 1
    elif replicate is None or shard is None:  # the strategy's degree is set: the other takes the rest
        replicate, shard = replicate or rest, shard or rest
    elif rest != 1:
        raise UsageError(f"{world_size} processes cannot be split as {_given(cfg)}: the degrees multiply to "
                         f"{fixed}; leave parallel_config.dp_replicate or dp_shard null to take the rest")
    degrees = Layout(pp=cfg.pp, dp_replicate=replicate, dp_shard=shard, tp=cfg.tp)
    if degrees.pp > 1 and degrees.tp > 1 and degrees.dp > 1:
        raise UsageError(f"{degrees.describe()} is not offered yet: pipeline and tensor parallelism are tested "
                         f"together and each with data parallelism, not all three at once (8+ processes)")
    fsdp = cfg.strategy == "fsdp" or degrees.dp_shard > 1 or degrees.needs_mesh
    return Layout(pp=cfg.pp, dp_replicate=replicate, dp_shard=shard, tp=cfg.tp, strategy="fsdp" if fsdp else "ddp")


def writes_shards(cfg: ParallelConfig, world_size: int) -> bool:
    """True when every process writes its part of each snapshot (a layout of shards or stages, or strategy=fsdp)."""
    return resolve_layout(cfg, world_size).sharded_state


def _given(cfg: ParallelConfig) -> str:
    degrees = {"tp": cfg.tp, "pp": cfg.pp, "dp_replicate": cfg.dp_replicate, "dp_shard": cfg.dp_shard}
    return " x ".join(f"{name} {value}" for name, value in degrees.items() if value not in (None, 1)) or "1"


@dataclass
class Mesh:
    """The device mesh of a layout and this process's place in it: the four dimensions of MESH_DIMS where the
    layout needs them; one dimension, "dp_shard" over every process, for plain FSDP (the mesh fully_shard would
    make itself); none for DDP."""

    layout: Layout
    device_mesh: Any = None  # torch.distributed.device_mesh.DeviceMesh

    @classmethod
    def build(cls, layout: Layout, device: torch.device) -> Mesh:
        """Collective: every process builds the same mesh (its groups are new process groups)."""
        if layout.strategy != "fsdp":
            return cls(layout)
        from torch.distributed.device_mesh import init_device_mesh

        if not layout.needs_mesh:
            return cls(layout, init_device_mesh(device.type, (layout.world_size,), mesh_dim_names=("dp_shard",)))
        shape = tuple(getattr(layout, name) for name in MESH_DIMS)
        return cls(layout, init_device_mesh(device.type, shape, mesh_dim_names=MESH_DIMS))

    def coordinate(self, name: str) -> int:
        """This process's index along one mesh dimension (0 along one the mesh does not have)."""
        if self.device_mesh is None or name not in self.device_mesh.mesh_dim_names:
            return 0
        return self.device_mesh.get_local_rank(name)

    @property
    def dp_rank(self) -> int:
        """This process's index among the data-parallel ranks (the batches it reads), on a mesh."""
        return self.coordinate("dp_replicate") * self.layout.dp_shard + self.coordinate("dp_shard")

    def data_parallel_mesh(self) -> Any:
        """What FSDP2 shards and replicates over: the (dp_replicate, dp_shard) sub-mesh, 2-D (replicas of shards)."""
        if not self.layout.needs_mesh:
            return self.device_mesh
        return self.sub_mesh("dp_replicate", "dp_shard")

    def sub_mesh(self, *names: str) -> Any:
        return self.device_mesh[names if len(names) > 1 else names[0]]
