"""The model spread over the processes, one way for every layout: `parallelize` takes the model and the parallel
settings and returns a `ParallelModel`, whose methods are all the training loop needs.

    parallel = parallelize(model, cfg.parallel_config, ctx, amp_dtype, build_optimizers)   # collective
    for i, (x, y) in enumerate(micro_batches):
        loss = parallel.forward_backward(x, y, scaler, micro_batches=n, last=i == n - 1)
    parallel.finish_gradients()                  # a pipeline's accumulated mean and tied copies; else nothing
    norm = parallel.clip_grad_norm(1.0)          # over every rank's shards and stages
    parallel.optimizers.step(scaler)
    loss = parallel.evaluate(x, y)               # a validation forward; None on a rank that computes no loss
    states = parallel.snapshot_states()          # the model and optimizer in the layout's snapshot form

What each layout (layout.py) applies, in torchtitan's order: tensor parallelism inside each block
(tensor_parallel.py), activation checkpointing and compiling block by block, then data parallelism.

    Replicated   plain data parallelism, every process the whole model: DistributedDataParallel (nothing for one
                 process), activation checkpointing per block, compile over the whole model
    Sharded      FSDP2's fully_shard on each block and the root over the data-parallel mesh (shards, replicas of
                 shards, or replicas alone), after tensor parallelism where tp > 1
    Pipelined    this process's pipeline stages (pipeline.py), each parallelised as Sharded parallelises a model, fed
                 micro-batches by a schedule

FSDP2 is applied in one place, `fsdp_sharding`. DDP is not used on a mesh: its reducer cannot take DTensor
parameters, and inside a pipeline stage under GPipe or interleaved schedules it trains wrong
(tests/e2e/test_pipeline.py).
"""

from __future__ import annotations

import contextlib
import functools
import logging
from typing import Any, Callable, Iterator, Optional

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint

from mingpt.compat import ddp_no_buffer_sync, require_fsdp, sharded_gradient_scaler
from mingpt.distributed.process_group import DistContext
from mingpt.optim import Optimizers
from mingpt.parallel.layout import Layout, Mesh, ParallelConfig, resolve_layout
from mingpt.parallel.materialize import InitialValue, materialize, on_meta
from mingpt.parallel.state import (
    ModelState,
    OptimizerState,
    full_tensors,
    is_dtensor,
    local_tensor,
    model_from_tensors,
    parameter_names,
)

log = logging.getLogger(__name__)

Batch = tuple[torch.Tensor, torch.Tensor]
WholeShapes = dict[str, tuple[torch.Size, torch.dtype]]

IGNORED_TARGET = -100  # F.cross_entropy's default ignore_index: padded windows' targets, which the loss does not count


class ParallelModel:
    """The model as this process trains and evaluates it under a layout, with the optimizers of what this process
    holds. The loop reads the same for every layout: a replica, a sharded model or a pipeline is this object's
    business. `modules` are the unwrapped modules holding this rank's parameters (the model, or its pipeline
    stages): what snapshots and the replica check read. Built by `parallelize`."""

    def __init__(self, layout: Layout, mesh: Mesh, ctx: DistContext, amp_dtype: torch.dtype,
                 modules: list[nn.Module], build_optimizers: Callable[[nn.Module], Optimizers],
                 whole_shapes: WholeShapes, permuted: Optional[dict[str, int]] = None) -> None:
        self.layout, self.mesh, self.ctx, self.amp_dtype = layout, mesh, ctx, amp_dtype
        self.modules = modules
        # FSDP replaces the parameters with shards: optimizers built before wrapping would update parameters that
        # are gone. One container for every stage's.
        self.optimizers = Optimizers.merged(build_optimizers(module) for module in modules)
        self.permuted = permuted or {}  # parameters whose rows a tensor-parallel layout keeps reordered, by name
        self._whole_shapes = whole_shapes  # the whole model's (name: (shape, dtype)), taken before it was split
        self._parameters: Optional[list[nn.Parameter]] = None  # what clipping reads

    # ------------------------------------------------------------------------------------------- what it is
    @property
    def name(self) -> str:
        """"ddp", "fsdp", or the degrees on a mesh ("pp 2 x dp_replicate 2")."""
        return self.layout.name

    @property
    def data_ranks(self) -> int:
        """The ranks the batches are split over (tensor-parallel peers and pipeline stages share theirs)."""
        return self.layout.dp

    @property
    def data_rank(self) -> int:
        """This process's place among the data-parallel ranks: which windows it reads."""
        return self.mesh.dp_rank if self.mesh.device_mesh is not None else self.ctx.rank

    @property
    def computes_loss(self) -> bool:
        """Whether this rank computes losses (under pipeline parallelism, the last stage's ranks only)."""
        return True

    @property
    def lockstep_eval(self) -> bool:
        """Whether a forward pass is a collective among ranks that read different windows (FSDP's shards): every
        rank must then make as many validation passes as the one with the most windows."""
        return False

    @property
    def sharded_snapshots(self) -> bool:
        """Whether every rank writes its part of each snapshot (a folder of shards) rather than rank 0 one file."""
        return self.layout.sharded_state

    # ------------------------------------------------------------------------------------------- training
    def autocast(self) -> contextlib.AbstractContextManager:
        return torch.autocast(self.ctx.device.type, dtype=self.amp_dtype, enabled=self.amp_dtype != torch.float32)

    def gradient_scaler(self) -> torch.amp.GradScaler:
        """The fp16 loss scaler (disabled otherwise: bf16 has fp32's exponent range and needs no loss scaling)."""
        return torch.amp.GradScaler(self.ctx.device.type, enabled=self.amp_dtype == torch.float16)

    def prepare(self, batch: Batch) -> None:
        """Collective. Before training, in fresh and resumed runs alike: whatever the layout must do with a batch
        before the first step counts."""

    def forward_backward(self, x: torch.Tensor, y: torch.Tensor, scaler: torch.amp.GradScaler, micro_batches: int,
                         last: bool) -> Optional[torch.Tensor]:
        """Collective. One micro-batch's forward and backward, its gradient a `micro_batches`-th of the step's; only
        the `last` one synchronises gradients (DDP's all-reduce, FSDP's reduce-scatter). Returns its loss, detached,
        on a rank that computes one (nothing waits for it)."""
        with self._gradient_sync(last), self._loss_context():
            with self.autocast():
                _, loss = self._train_module()(x, y)
            scaler.scale(loss / micro_batches).backward()
        return local_tensor(loss.detach())

    def finish_gradients(self) -> None:
        """Collective. After a step's micro-batches, before clipping: what the layout still owes the gradients."""

    def clip_grad_norm(self, max_norm: Optional[float]) -> torch.Tensor:
        """Collective. The global gradient norm over every rank's shards (and stages), as a plain tensor, the same on
        every rank; the gradients clipped to `max_norm` (None: measured only)."""
        return clip_grad_norm(self._clipped_parameters(), max_norm)

    def _clipped_parameters(self) -> list[nn.Parameter]:
        """The parameters, listed once (model.parameters() walks every module: 50 us a step)."""
        if self._parameters is None:
            self._parameters = [p for module in self.modules for p in module.parameters()]
        return self._parameters

    def _train_module(self) -> Callable[[torch.Tensor, torch.Tensor], tuple[Any, torch.Tensor]]:
        return self.modules[0]

    def _gradient_sync(self, last: bool) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def _loss_context(self) -> contextlib.AbstractContextManager:
        """Where the loss is computed and differentiated: over the vocabulary's shards under tensor parallelism."""
        if self.layout.tp == 1:
            return contextlib.nullcontext()
        from mingpt.parallel.tensor_parallel import loss_parallel_context

        return loss_parallel_context(True)

    # ------------------------------------------------------------------------------------------- evaluation
    @torch.no_grad()
    def evaluate(self, x: torch.Tensor, y: torch.Tensor, max_rows: Optional[int] = None) -> Optional[torch.Tensor]:
        """Collective where a forward pass is. The mean loss over a batch's counted targets (all but
        IGNORED_TARGET), forward only, where this rank computes one (None elsewhere), in forward passes of at most
        `max_rows` windows: with a vocabulary of thousands the logits (and cross-entropy's copy of them) are most
        of a window's memory, so an evaluation batch larger than a training micro-batch would otherwise hold more
        than a training step does. Every rank makes the same passes (the batches have one shape: FSDP's
        all-gathers stay in step). Call between `train(False)` and `train(True)`."""
        if max_rows is None or x.size(0) <= max_rows:
            return self._evaluate_pass(x, y)
        loss_sum, counted = x.new_zeros((), dtype=torch.float32), x.new_zeros(())
        for x_part, y_part in zip(x.split(max_rows), y.split(max_rows)):
            part_counted = (y_part != IGNORED_TARGET).sum()
            loss = self._evaluate_pass(x_part, y_part)
            # a slice of padding alone has the mean of no targets (nan): it counts for nothing (no host read)
            loss_sum += torch.where(part_counted > 0, loss.float() * part_counted, 0.0)
            counted += part_counted
        return loss_sum / counted

    def _evaluate_pass(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with self._loss_context(), self.autocast():
            _, loss = self._eval_module()(x, y)
        return local_tensor(loss)

    def train(self, mode: bool = True) -> None:
        """Dropout on (training) or off (evaluation)."""
        for module in self.modules:
            module.train(mode)

    def _eval_module(self) -> Callable[[torch.Tensor, torch.Tensor], tuple[Any, torch.Tensor]]:
        return self.modules[0]

    # ------------------------------------------------------------------------------------------- state
    def snapshot_states(self) -> dict[str, Any]:
        """The model and the optimizers in this layout's snapshot form (Checkpointer's stateful objects)."""
        named = self.sharded_snapshots
        return {"model": ModelState(self.modules, self.permuted, named),
                "optimizer": OptimizerState(self.optimizers.by_module(), self.permuted, named)}

    def whole_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Collective under sharded layouts. (name, full tensor in canonical order) of the whole model, in sorted
        name order, on every rank; one tensor gathered at a time."""
        state = {name: value for module in self.modules for name, value in module.state_dict().items()}
        return full_tensors(state, self.permuted)

    def full_model_copy(self, build: Callable[[], nn.Module]) -> Optional[nn.Module]:
        """Collective under sharded layouts. The whole model, unsharded, on global rank 0 (None elsewhere): under
        DDP the model itself, else a copy built by `build` on rank 0's CPU from the gathered tensors."""
        return model_from_tensors(self.whole_tensors(), build, self.ctx.is_main)


class Replicated(ParallelModel):
    """Plain data parallelism: every process holds the whole model (wrapped by DistributedDataParallel when there
    are several), its gradients and optimizer state; the gradients are all-reduced."""

    def __init__(self, model: nn.Module, compiled: nn.Module, ddp: Optional[DDP], **common: Any) -> None:
        super().__init__(modules=[model], **common)
        self.compiled, self.ddp = compiled, ddp  # compiled is the model itself unless parallel_config.compile

    def _train_module(self) -> nn.Module:
        return self.ddp if self.ddp is not None else self.compiled

    def _eval_module(self) -> nn.Module:
        return self.compiled  # no gradients to reduce: DDP's wrapper has nothing to do

    def train(self, mode: bool = True) -> None:
        self.compiled.train(mode)

    def _gradient_sync(self, last: bool) -> contextlib.AbstractContextManager:
        """Only the step's last micro-batch all-reduces: the others accumulate locally."""
        if self.ddp is not None and not last:
            return self.ddp.no_sync()
        return contextlib.nullcontext()

    def prepare(self, batch: Batch) -> None:
        """One throw-away forward/backward under DDP. DDP rebuilds its gradient buckets after its first backward
        pass, in the order gradients became ready. If that first pass were a real step, a resumed run (whose first
        step is a different step) would reduce in a different order than the uninterrupted one, and with 3+ ranks
        the sums would differ in the last bits."""
        if self.ddp is None:
            return
        x, y = batch
        device = self.ctx.device
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            with self.autocast():
                _, loss = self.ddp(x, y)
            loss.backward()
        self.modules[0].zero_grad(set_to_none=True)

    def full_model_copy(self, build: Callable[[], nn.Module]) -> Optional[nn.Module]:
        return self.modules[0]  # every rank holds it whole


class Sharded(ParallelModel):
    """FSDP2 over the data-parallel mesh (when `fsdp`), after tensor parallelism where the layout has it: no process
    holds the whole model; a block's parameters are all-gathered for its forward and backward and freed again, its
    gradients reduce-scattered."""

    def __init__(self, model: nn.Module, fsdp: bool, **common: Any) -> None:
        super().__init__(modules=[model], **common)
        self.fsdp = fsdp

    @property
    def lockstep_eval(self) -> bool:
        return self.layout.dp_shard > 1

    def gradient_scaler(self) -> torch.amp.GradScaler:
        """Each rank sees only its shards' gradients: an fp16 overflow is agreed across ranks."""
        if self.amp_dtype != torch.float16:
            return super().gradient_scaler()
        return sharded_gradient_scaler(self.ctx.device, self.ctx.group)

    def _gradient_sync(self, last: bool) -> contextlib.AbstractContextManager:
        if self.fsdp:
            self.modules[0].set_requires_gradient_sync(last)
        return contextlib.nullcontext()

    def _clipped_parameters(self) -> list[nn.Parameter]:
        """Under FSDP listed every step: it swaps the registered parameters around its forward and backward passes."""
        if self.fsdp:
            self._parameters = None
        return super()._clipped_parameters()


class Pipelined(ParallelModel):
    """This rank's pipeline stages of the model, each parallelised as Sharded parallelises a whole model, and the
    schedule that runs a batch's micro-batches through them (pipeline.py). Optimizers one per stage module;
    autocast runs around each stage's forward only (the schedule runs the backward outside it)."""

    def __init__(self, pipeline: Any, numbered_names: list[str], **common: Any) -> None:
        super().__init__(modules=list(pipeline.stages), **common)
        self.pipeline = pipeline  # pipeline.GPTPipeline
        self.numbered_names = numbered_names  # the whole model's parameters in a one-optimizer numbering
        self._accumulated = 0  # schedule steps since the last optimizer step

    @property
    def lockstep_eval(self) -> bool:
        return self.layout.dp_shard > 1

    @property
    def computes_loss(self) -> bool:
        return self.pipeline.has_last_stage

    def forward_backward(self, x: torch.Tensor, y: torch.Tensor, scaler: torch.amp.GradScaler, micro_batches: int,
                         last: bool) -> Optional[torch.Tensor]:
        """The schedule's forward and backward of this rank's batch (its own micro-batches, each the schedule's
        mean's share); the mean over the step's accumulated batches is taken in `finish_gradients`. fp16 is not
        offered here (ParallelConfig.check_fits), so there is no loss to scale."""
        with self._loss_context():
            loss = self.pipeline.step(x, y)
        self._accumulated += 1
        return None if loss is None else local_tensor(loss)

    @torch.no_grad()
    def finish_gradients(self) -> None:
        """Collective. The mean over accumulated steps (each schedule step already averages over its micro-batches),
        and the tied embedding's two copies summed."""
        if self._accumulated > 1:
            for param in self.pipeline.parameters():
                if param.grad is not None:
                    param.grad.div_(self._accumulated)
        self._accumulated = 0
        self.pipeline.sync_tied_gradients()

    def clip_grad_norm(self, max_norm: Optional[float]) -> torch.Tensor:
        return self.pipeline.clip_grad_norm_(max_norm)

    @torch.no_grad()
    def evaluate(self, x: torch.Tensor, y: torch.Tensor, max_rows: Optional[int] = None) -> Optional[torch.Tensor]:
        """The whole batch through the stages at once (`max_rows` is not applied: the schedule's evaluation takes
        only the training batches' shape, whose micro-batches a padded slice would leave without targets)."""
        with self._loss_context(), self.autocast():
            loss = self.pipeline.evaluate(x, y)
        return None if loss is None else local_tensor(loss)

    def snapshot_states(self) -> dict[str, Any]:
        return {"model": ModelState(self.modules, self.permuted, True),
                "optimizer": OptimizerState(self.optimizers.by_module(), self.permuted, True, self.numbered_names,
                                            self.pipeline.pp_group)}

    def whole_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Each tensor sent from the first pipeline rank that holds it to the others."""
        state = {name: value for module in self.modules for name, value in module.state_dict().items()}
        group = self.pipeline.pp_group
        holders = [None] * dist.get_world_size(group)
        dist.all_gather_object(holders, sorted(state), group=group)
        device = local_tensor(next(iter(state.values()))).device
        for name in sorted(self._whole_shapes):
            owner = next(rank for rank, names in enumerate(holders) if name in names)
            if name in state and owner == dist.get_rank(group):
                tensor = next(full_tensors({name: state[name]}, self.permuted))[1].contiguous()
            else:
                shape, dtype = self._whole_shapes[name]
                tensor = torch.empty(shape, dtype=dtype, device=device)
            dist.broadcast(tensor, dist.get_global_rank(group, owner), group=group)
            yield name, tensor


# ----------------------------------------------------------------------------------------------- building
def builds_on_meta(cfg: ParallelConfig, world_size: int) -> bool:
    """Whether the model for this layout is built on the meta device and made real by `parallelize` piece by piece
    (every layout that shards or splits it); plain DDP builds it whole, as every rank holds it whole anyway."""
    return resolve_layout(cfg, world_size).strategy != "ddp"


def parallelize(model: nn.Module, cfg: ParallelConfig, ctx: DistContext, amp_dtype: torch.dtype,
                build_optimizers: Callable[[nn.Module], Optimizers],
                initial_value: Optional[InitialValue] = None) -> ParallelModel:
    """Collective. `model` spread over the processes of `ctx` as `cfg` lays them out (in place: its modules become
    DTensor shards, or this rank's pipeline stages of it), with `build_optimizers(module)` over what this process
    holds. Under a sharded layout a process on its own gets a process group of one (FSDP2 needs one).

    A `model` built on the meta device (`builds_on_meta`: every layout but plain DDP) is made real here, part by
    part on the way to its shards or stages, at `initial_value` (whole tensors by name: the starting weights of
    gpt_config.init_from), by default `model.initial_value` (GPT's: the weights one process draws)."""
    layout = resolve_layout(cfg, ctx.world_size)
    whole_shapes = {name: (value.shape, value.dtype) for name, value in model.state_dict().items()}
    # the whole model's, taken before it is split
    initial_value = (initial_value or model.initial_value) if on_meta(model) else None
    if layout.strategy == "ddp":
        if initial_value is not None:
            materialize(model, model, ctx.device, initial_value)
        return _replicate(model, cfg, layout, ctx, amp_dtype, build_optimizers, whole_shapes)
    what = "tensor parallelism and hybrid layouts" if layout.needs_mesh else "parallel_config.strategy=fsdp"
    require_fsdp(what)
    ctx = group_of_one(ctx)
    mesh = Mesh.build(layout, ctx.device)
    common = {"layout": layout, "mesh": mesh, "ctx": ctx, "amp_dtype": amp_dtype,
              "build_optimizers": build_optimizers, "whole_shapes": whole_shapes}
    if layout.pp > 1:
        return _pipeline(model, cfg, mesh, amp_dtype, ctx.device, common, initial_value)
    common["permuted"] = parallelize_module(model, mesh, cfg, amp_dtype, ctx.device, initial_value)
    return Sharded(model, fsdp=layout.dp > 1 or not layout.needs_mesh, **common)


def _replicate(model: nn.Module, cfg: ParallelConfig, layout: Layout, ctx: DistContext, amp_dtype: torch.dtype,
               build_optimizers: Callable[[nn.Module], Optimizers], whole_shapes: WholeShapes) -> Replicated:
    """Collective. Activation checkpointing, torch.compile over the whole model, and DDP over several processes."""
    if cfg.activation_checkpointing == "blocks":
        for block in blocks_of(model):
            checkpoint_activations(block)
    compiled = torch.compile(model, **compile_options(ctx.device)) if cfg.compile else model
    ddp = None
    if ctx.distributed:
        device_ids = [ctx.device.index] if ctx.device.type == "cuda" else None
        # No buffer needs syncing (the attention mask buffer is a constant): skip a broadcast per forward pass.
        # gradient_as_bucket_view=True: a reduced gradient is a view of its all-reduce bucket, not a second copy
        # (less memory); zero_grad(set_to_none=True) then frees it, so each backward still copies into the bucket.
        ddp = DDP(compiled, device_ids=device_ids, gradient_as_bucket_view=True, process_group=ctx.group,
                  **ddp_no_buffer_sync())
    return Replicated(model, compiled, ddp, layout=layout, mesh=Mesh(layout), ctx=ctx, amp_dtype=amp_dtype,
                      build_optimizers=build_optimizers, whole_shapes=whole_shapes)


def parallelize_module(module: nn.Module, mesh: Mesh, cfg: ParallelConfig, amp_dtype: torch.dtype,
                       device: torch.device, initial_value: Optional[InitialValue] = None) -> dict[str, int]:
    """Collective. A model, or a pipeline stage of one, in place, as torchtitan applies the parts: tensor
    parallelism over the mesh's tp dimension, activation checkpointing and compiling block by block (FSDP's hooks
    stay outside the compiled graphs), then FSDP2 over the data-parallel mesh, on each block and then the root.
    A module on the meta device is made real (`initial_value`) one block at a time, each just before it is
    sharded, then the rest: the whole module never exists on this rank. Returns the parameters tensor
    parallelism keeps in permuted row order ({name: degree})."""
    layout = mesh.layout
    permuted: dict[str, int] = {}
    if layout.tp > 1:
        from mingpt.parallel.tensor_parallel import apply_tensor_parallel

        # DTensor logs a hint per rank each time a tensor on two mesh dimensions is gathered or its norm reduced in
        # two collectives (clipping, snapshots, digests): right, and not the user's to act on.
        logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
        permuted = apply_tensor_parallel(module, mesh.sub_mesh("tp"))
    made: dict[int, nn.Parameter] = {}  # one tied parameter made once, whichever part holds it first

    def make_real(part: nn.Module) -> None:
        if on_meta(part):
            if initial_value is None:
                raise ValueError("a module on the meta device needs initial_value to be made real")
            materialize(module, part, device, initial_value, permuted, made)

    shard = fsdp_sharding(mesh.data_parallel_mesh(), amp_dtype) if layout.dp > 1 or not layout.needs_mesh else None
    for block in blocks_of(module):
        if cfg.activation_checkpointing == "blocks":
            checkpoint_activations(block)
        if cfg.compile:
            block.compile(**compile_options(device))
        make_real(block)
        if shard is not None:
            shard(block, root=False)
    if layout.pp > 1 and amp_dtype != torch.float32:  # the forward pass only: the schedule runs the backward outside
        module.forward = autocast_forward(module.forward, device, amp_dtype)
    make_real(module)
    if shard is not None:
        shard(module, root=True)
    return permuted


def fsdp_sharding(dp_mesh: Any, amp_dtype: torch.dtype) -> Callable[..., None]:
    """FSDP2's `fully_shard` over `dp_mesh` (1-D: shards; 2-D: replicas of shards), as `shard(module, root)`: first
    each block, then the root (the embeddings, the final norm and the head).

    Mixed precision as DDP under autocast computes it (docs/fsdp.md, "Mixed precision"): a block's parameters are
    all-gathered in the autocast dtype, but its input is not cast (cast_forward_inputs=False), and the root's
    parameters stay fp32, so the embeddings' sum and every residual addition stay fp32, as they do under DDP; the
    matrix products run in the autocast dtype under both; gradients are reduced in fp32."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    whole = MixedPrecisionPolicy()
    block = whole
    if amp_dtype != torch.float32:
        block = MixedPrecisionPolicy(param_dtype=amp_dtype, reduce_dtype=torch.float32, cast_forward_inputs=False)
        whole = MixedPrecisionPolicy(reduce_dtype=torch.float32, cast_forward_inputs=False)

    def shard(module: nn.Module, root: bool) -> None:
        fully_shard(module, mesh=dp_mesh, mp_policy=whole if root else block)

    return shard


def _pipeline(model: nn.Module, cfg: ParallelConfig, mesh: Mesh, amp_dtype: torch.dtype, device: torch.device,
              common: dict, initial_value: Optional[InitialValue]) -> Pipelined:
    """Collective. This rank's pipeline stages of `model`, each parallelised by `parallelize_module`."""
    from mingpt.parallel.pipeline import build_pipeline

    # A DDP snapshot numbers the optimizer's parameters as one optimizer of the whole model does: the numbering,
    # taken before the model is split, that loads it by name into the stages.
    numbered = parameter_names(common["build_optimizers"](model), model)
    permuted: dict[str, int] = {}

    def prepare(stage: nn.Module) -> nn.Module:
        permuted.update(parallelize_module(stage, mesh, cfg, amp_dtype, device, initial_value))
        return stage

    pipeline = build_pipeline(model, mesh.device_mesh, device, schedule=cfg.pp_schedule,
                              microbatches=cfg.pp_microbatches, stages_per_rank=cfg.stages_per_rank,
                              layers=cfg.pp_layers, prepare_stage=prepare,
                              evaluate_with_schedule=False)  # whole batches: a last one need not split evenly
    return Pipelined(pipeline, numbered, **common, permuted=permuted)


def autocast_forward(forward: Callable, device: torch.device, dtype: torch.dtype) -> Callable:
    @functools.wraps(forward)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        with torch.autocast(device.type, dtype=dtype):
            return forward(*args, **kwargs)

    return wrapped


def blocks_of(model: nn.Module) -> list[nn.Module]:
    """The transformer blocks: the unit of sharding, compiling and activation checkpointing. A pipeline stage keeps
    its blocks in a ModuleDict by their index in the whole model (pipeline.py)."""
    blocks = model.transformer.h
    return list(blocks.values()) if isinstance(blocks, nn.ModuleDict) else list(blocks)


def checkpoint_activations(block: nn.Module) -> None:
    """Recompute `block`'s activations in the backward pass instead of keeping them. The forward is replaced on the
    instance, not wrapped in another module, so parameter names (and snapshots) stay as they are; dropout draws
    the same masks again (checkpoint restores the RNG state)."""
    block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False)


def compile_options(device: torch.device) -> dict:
    # On a CPU, C++ rather than Python calls the generated kernels: a few % of a small step (benchmarks/bench.md).
    return {"options": {"cpp_wrapper": True}} if device.type == "cpu" else {}


def clip_grad_norm(parameters: list[nn.Parameter], max_norm: Optional[float]) -> torch.Tensor:
    """Clip to a global norm (None: only measure it); over DTensor shards (FSDP, tensor parallelism) the norm is
    over all ranks' shards (a collective). Returns the norm before clipping as a plain tensor."""
    grads = [p.grad for p in parameters if p.grad is not None]
    total = nn.utils.get_total_norm(grads, foreach=True)
    if is_dtensor(total):
        total = total.full_tensor()  # the shards' partial norms, combined
    if max_norm is not None:
        nn.utils.clip_grads_with_norm_(parameters, max_norm, total, foreach=True)
    return total


def group_of_one(ctx: DistContext) -> DistContext:
    """A process on its own, given a process group of one: FSDP's device mesh needs one (one shard holds all)."""
    if ctx.distributed:
        return ctx
    if not dist.is_initialized():
        backend = "nccl" if ctx.device.type == "cuda" else "gloo"
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    elif dist.get_world_size() != 1:
        raise RuntimeError("a process of a larger group cannot shard on its own")
    return DistContext(device=ctx.device, group=dist.group.WORLD)
