"""The model on a device mesh: tensor parallelism inside each block, then data parallelism (FSDP2 shards, replicas, or
both) over the data-parallel ranks, in the order torchtitan applies them (tensor parallelism, activation
checkpointing, compiling each block, sharding).

Data parallelism on a mesh is FSDP2's `fully_shard` over the (dp_replicate, dp_shard) sub-mesh: with one shard it
is plain replication (gradients all-reduced across the replicas), with one replica plain sharding, with both hybrid
sharding. DDP's reducer is not used here: it cannot take DTensor parameters, and inside a pipeline stage under
GPipe or interleaved schedules it trains wrong (tests/test_pipeline.py).
"""

from __future__ import annotations

import functools
import logging
from typing import Any, Callable, Iterator, Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from mingpt.compat import CPU_FSDP_TORCH, require_torch
from mingpt.parallel.data_parallel import (
    Parallel,
    blocks_of,
    checkpoint_activations,
    compile_options,
    full_tensors,
    local_tensor,
)
from mingpt.parallel.layout import Mesh, ParallelConfig


def wrap_on_mesh(model: nn.Module, mesh: Mesh, activation_checkpointing: str, compile: bool,
                 amp_dtype: torch.dtype, device: torch.device, cfg: ParallelConfig) -> Parallel:
    """Collective. `model` parallelised in place over `mesh`; under pipeline parallelism, this rank's stages of it."""
    if device.type == "cpu":
        require_torch(CPU_FSDP_TORCH, "tensor parallelism and hybrid layouts on a CPU")
    # DTensor logs a hint per rank each time a tensor on two mesh dimensions is gathered or its norm reduced in two
    # collectives (clipping, snapshots, digests): right, and not the user's to act on.
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    if mesh.layout.pp > 1:
        return wrap_pipeline(model, mesh, activation_checkpointing, compile, amp_dtype, device, cfg)
    layout = mesh.layout
    permuted: dict[str, int] = {}
    if layout.tp > 1:
        from mingpt.parallel.tensor_parallel import apply_tensor_parallel

        permuted = apply_tensor_parallel(model, mesh.sub_mesh("tp"))
    prepare_blocks(model, activation_checkpointing, compile, device)
    if layout.dp > 1:
        shard_data_parallel(model, mesh, amp_dtype)
    return Parallel(model, model, None, sharded=layout.dp > 1, loss_parallel=layout.tp > 1, permuted=permuted,
                    lockstep_eval=layout.dp_shard > 1, sharded_snapshots=True, mesh=mesh, name=layout.describe(),
                    modules=[model])


def prepare_blocks(model: nn.Module, activation_checkpointing: str, compile: bool, device: torch.device) -> None:
    """Activation checkpointing and compiling, block by block (FSDP's hooks stay outside the compiled graphs)."""
    for block in blocks_of(model):
        if activation_checkpointing == "blocks":
            checkpoint_activations(block)
        if compile:
            block.compile(**compile_options(device))


def shard_data_parallel(model: nn.Module, mesh: Mesh, amp_dtype: torch.dtype) -> None:
    """FSDP2 on each block, then on the root, over the data-parallel sub-mesh (2-D: replicas of shards). Under
    mixed precision the parameters are all-gathered in the autocast dtype and gradients reduced in fp32."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy()
    if amp_dtype != torch.float32:
        policy = MixedPrecisionPolicy(param_dtype=amp_dtype, reduce_dtype=torch.float32)
    dp_mesh = mesh.sub_mesh("dp_replicate", "dp_shard")
    for block in blocks_of(model):
        fully_shard(block, mesh=dp_mesh, mp_policy=policy)
    fully_shard(model, mesh=dp_mesh, mp_policy=policy)


# ----------------------------------------------------------------------------------------------- pipelines
def wrap_pipeline(model: nn.Module, mesh: Mesh, activation_checkpointing: str, compile: bool, amp_dtype: torch.dtype,
                  device: torch.device, cfg: ParallelConfig) -> Parallel:
    """Collective. This rank's pipeline stages of `model`, each parallelised as a whole model would be (tensor
    parallelism, then data parallelism over the rest of the mesh), with autocast around each stage's forward only."""
    from mingpt.parallel.pipeline import build_pipeline

    layout, permuted = mesh.layout, {}

    def prepare(stage: nn.Module) -> nn.Module:
        if layout.tp > 1:
            from mingpt.parallel.tensor_parallel import apply_tensor_parallel

            permuted.update(apply_tensor_parallel(stage, mesh.sub_mesh("tp")))
        prepare_blocks(stage, activation_checkpointing, compile, device)
        if amp_dtype != torch.float32:  # the forward pass only: the schedule runs the backward outside it
            stage.forward = autocast_forward(stage.forward, device, amp_dtype)
        if layout.dp > 1:
            shard_data_parallel(stage, mesh, amp_dtype)
        return stage

    pipeline = build_pipeline(model, mesh.device_mesh, device, schedule=cfg.pp_schedule,
                              microbatches=cfg.pp_microbatches, stages_per_rank=cfg.stages_per_rank,
                              layers=cfg.pp_layers, prepare_stage=prepare,
                              evaluate_with_schedule=False)  # whole batches: a last one need not split evenly
    runner = PipelineRunner(pipeline)
    return Parallel(runner, runner, None, sharded=layout.dp > 1, loss_parallel=layout.tp > 1, permuted=permuted,
                    lockstep_eval=layout.dp_shard > 1, sharded_snapshots=True, mesh=mesh, name=layout.describe(),
                    modules=list(pipeline.stages), pipeline=pipeline)


def autocast_forward(forward: Callable, device: torch.device, dtype: torch.dtype) -> Callable:
    @functools.wraps(forward)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        with torch.autocast(device.type, dtype=dtype):
            return forward(*args, **kwargs)

    return wrapped


class PipelineRunner:
    """The pipeline as training and evaluation call a model: `runner(x, y) -> (None, loss)`, the loss on the rank of
    the last stage and None elsewhere (every rank of the pipeline calls it: each call is collective)."""

    def __init__(self, pipeline: Any) -> None:
        self.pipeline = pipeline
        self.training = True

    def __call__(self, x: torch.Tensor, y: torch.Tensor) -> tuple[None, Optional[torch.Tensor]]:
        if self.training:
            return None, self.pipeline.step(x, y)
        return None, self.pipeline.evaluate(x, y)

    def train(self, mode: bool = True) -> PipelineRunner:
        self.training = mode
        self.pipeline.train(mode)
        return self

    def eval(self) -> PipelineRunner:
        return self.train(False)


def whole_model_tensors(parallel: Parallel, shapes: dict[str, tuple[torch.Size, torch.dtype]]
                        ) -> Iterator[tuple[str, torch.Tensor]]:
    """Collective. (name, full tensor in canonical order) of the whole model, in sorted name order, on every rank;
    one tensor at a time. Without stages, as `full_tensors`; with them, each tensor is sent from the first pipeline
    rank that holds it to the others. `shapes`: the whole model's (name: (shape, dtype)), taken before the split."""
    state = {name: value for module in parallel.modules for name, value in module.state_dict().items()}
    if parallel.pipeline is None:
        yield from full_tensors(state, parallel.permuted)
        return
    group = parallel.pipeline.pp_group
    holders = [None] * dist.get_world_size(group)
    dist.all_gather_object(holders, sorted(state), group=group)
    for name in sorted(shapes):
        owner = next(rank for rank, names in enumerate(holders) if name in names)
        if name in state and owner == dist.get_rank(group):
            tensor = next(full_tensors({name: state[name]}, parallel.permuted))[1].contiguous()
        else:
            shape, dtype = shapes[name]
            tensor = torch.empty(shape, dtype=dtype, device=_device_of(state))
        dist.broadcast(tensor, dist.get_global_rank(group, owner), group=group)
        yield name, tensor


def _device_of(state: dict) -> torch.device:
    value = next(iter(state.values()))
    return local_tensor(value).device


def finish_pipeline_gradients(pipeline: Any, accumulated_steps: int) -> None:
    """Collective. After a step's schedule runs: the mean over accumulated steps (each schedule step already
    averages over its micro-batches), and the tied embedding's two copies summed."""
    if accumulated_steps > 1:
        grads = [p.grad for p in pipeline.parameters() if p.grad is not None]
        torch._foreach_div_(grads, float(accumulated_steps))
    pipeline.sync_tied_gradients()
