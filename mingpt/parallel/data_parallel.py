"""How the model is spread over the processes, and its state in the form each way saves and loads.

    ddp   DistributedDataParallel: every rank holds the whole model, its gradients and the optimizer state; the
          gradients are all-reduced.
    fsdp  torch's FSDP2 `fully_shard` on each transformer block and on the root: each rank holds 1/N of every
          parameter, gradient and optimizer state; a block's parameters are all-gathered for its forward and
          backward and freed again, gradients are reduce-scattered.

Activation checkpointing (`blocks`) recomputes each block's activations in the backward pass instead of keeping
them, under either strategy. The model and optimizer state go into snapshots through `ModelState` and
`OptimizerState`: DDP saves the optimizer's own state_dict (one file, rank 0); FSDP saves each rank's shards keyed
by parameter name (torch.distributed.checkpoint.state_dict), and either form loads into either strategy.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint

from mingpt.compat import CPU_FSDP_TORCH, ddp_no_buffer_sync, require_torch
from mingpt.distributed.process_group import DistContext

log = logging.getLogger(__name__)

STRATEGIES = ("ddp", "fsdp")
ACTIVATION_CHECKPOINTING = ("none", "blocks")


@dataclass
class Parallel:
    """The model as training and evaluation call it. `ddp` is DDP's wrapper (None otherwise); `sharded` is True
    under FSDP (FSDP2 modules, whose registered parameters change around each pass).

    On a device mesh (tensor parallelism, hybrid sharding): `loss_parallel` when the loss is computed over the
    vocabulary's shards (forward and backward run inside `loss_context()`); `permuted`, the parameters whose rows a
    tensor-parallel layout keeps in another order (tensor_parallel.py), by name; `lockstep_eval` when a forward pass
    is a collective among ranks that read different windows; `sharded_snapshots` when no process holds the whole
    model, so snapshots are folders of shards."""

    eval_model: nn.Module
    model: nn.Module
    ddp: Optional[DDP]
    sharded: bool
    loss_parallel: bool = False
    permuted: dict[str, int] = field(default_factory=dict)
    lockstep_eval: Optional[bool] = None  # None: as `sharded`
    sharded_snapshots: Optional[bool] = None  # None: as `sharded`
    mesh: Any = None  # layout.Mesh: the degrees, the device mesh and this process's place in it
    name: str = ""  # "pp 2 x dp_replicate 2" on a mesh; the strategy's name for plain DDP and FSDP
    modules: list[nn.Module] = field(default_factory=list)  # the unwrapped modules of this rank's parameters
    pipeline: Any = None  # pipeline.GPTPipeline under pipeline parallelism

    def __post_init__(self) -> None:
        self.modules = self.modules or [self.eval_model]
        self.lockstep_eval = self.sharded if self.lockstep_eval is None else self.lockstep_eval
        self.sharded_snapshots = self.sharded if self.sharded_snapshots is None else self.sharded_snapshots

    def micro_batch(self, last: bool) -> contextlib.AbstractContextManager:
        """The context of one micro-batch's forward and backward: only the last one of a step synchronises
        gradients (DDP's all-reduce, FSDP's reduce-scatter); the others accumulate them locally."""
        if self.pipeline is not None:  # the schedule synchronises at its last micro-batch itself
            return contextlib.nullcontext()
        if self.sharded:
            self.model.set_requires_gradient_sync(last)
            return contextlib.nullcontext()
        if self.ddp is not None and not last:
            return self.ddp.no_sync()
        return contextlib.nullcontext()

    def loss_context(self) -> contextlib.AbstractContextManager:
        """Where the loss is computed and differentiated: over the vocabulary's shards under tensor parallelism."""
        if not self.loss_parallel:
            return contextlib.nullcontext()
        from mingpt.parallel.tensor_parallel import loss_parallel_context

        return loss_parallel_context(True)


def wrap_model(model: nn.Module, strategy: str, activation_checkpointing: str, compile: bool,
               amp_dtype: torch.dtype, ctx: DistContext) -> Parallel:
    """Collective under DDP and FSDP."""
    if activation_checkpointing == "blocks":
        for block in blocks_of(model):
            checkpoint_activations(block)
    if strategy == "fsdp":
        return _fully_shard(model, compile, amp_dtype, ctx)
    compiled = compile_model(model, ctx.device) if compile else model
    if not ctx.distributed:
        return Parallel(compiled, compiled, None, sharded=False)
    device_ids = [ctx.device.index] if ctx.device.type == "cuda" else None
    # No buffer needs syncing (the attention mask buffer is a constant): skip a broadcast per forward pass.
    # gradient_as_bucket_view=True: a reduced gradient is a view of its all-reduce bucket, not a second copy (less
    # memory); zero_grad(set_to_none=True) then frees it, so each backward still copies into the bucket.
    ddp = DDP(compiled, device_ids=device_ids, gradient_as_bucket_view=True, process_group=ctx.group,
              **ddp_no_buffer_sync())
    return Parallel(compiled, ddp, ddp, sharded=False)


def _fully_shard(model: nn.Module, compile: bool, amp_dtype: torch.dtype, ctx: DistContext) -> Parallel:
    """FSDP2 on each block, then the root (the embeddings, the final norm and the tied head). Under mixed
    precision the parameters are all-gathered in the autocast dtype and gradients reduced in fp32."""
    if ctx.device.type == "cpu":
        require_torch(CPU_FSDP_TORCH, "trainer_config.strategy=fsdp on a CPU")
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy()
    if amp_dtype != torch.float32:
        policy = MixedPrecisionPolicy(param_dtype=amp_dtype, reduce_dtype=torch.float32)
    for block in blocks_of(model):
        if compile:  # per block, before sharding: FSDP's hooks stay outside the compiled graphs (as torchtitan)
            block.compile(**compile_options(ctx.device))
        fully_shard(block, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    return Parallel(model, model, None, sharded=True)


def blocks_of(model: nn.Module) -> list[nn.Module]:
    """The transformer blocks: the unit of sharding and of activation checkpointing. A pipeline stage keeps its
    blocks in a ModuleDict by their index in the whole model (pipeline.py)."""
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


def compile_model(model: nn.Module, device: torch.device) -> nn.Module:
    return torch.compile(model, **compile_options(device))


def prime_ddp_buckets(model: nn.Module, optimizer: torch.optim.Optimizer, batch: tuple[torch.Tensor, torch.Tensor],
                      autocast: Callable[[], contextlib.AbstractContextManager], device: torch.device) -> None:
    """One throw-away forward/backward before training, in fresh and resumed runs alike.

    DDP rebuilds its gradient buckets after its first backward pass, in the order gradients became ready. If that
    first pass were a real step, a resumed run (whose first step is a different step) would reduce in a different
    order than the uninterrupted one, and with 3+ ranks the sums would differ in the last bits.
    """
    x, y = batch
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        with autocast():
            _, loss = model(x, y)
        loss.backward()
    optimizer.zero_grad(set_to_none=True)


def sharded_gradient_scaler(device: torch.device, group: Optional[dist.ProcessGroup]) -> torch.amp.GradScaler:
    """fp16 under FSDP: each rank sees only its shards' gradients, so an overflow is agreed across ranks (torch's
    ShardedGradScaler all-reduces it)."""
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    class AgreedOverflowScaler(ShardedGradScaler):
        """ShardedGradScaler hands fused AdamW a (1,)-shaped overflow flag summed over ranks; the fused step wants
        GradScaler's ()-shaped 0/1 (it subtracts the flag from its step counts: torch/optim/adam.py, _fused_adam)."""

        def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
            super().unscale_(optimizer)
            state = self._per_optimizer_states[id(optimizer)]
            state["found_inf_per_device"] = {where: flag.clamp(max=1.0).reshape(())
                                             for where, flag in state["found_inf_per_device"].items()}

    return AgreedOverflowScaler(device.type, enabled=True, process_group=group)


def clip_grad_norm(parameters: list[nn.Parameter], max_norm: float, pipeline: Any = None) -> torch.Tensor:
    """Clip to a global norm; under FSDP and tensor parallelism the norm is over all ranks' shards, under pipeline
    parallelism over all stages (collectives). Returns the norm before clipping as a plain tensor."""
    if pipeline is not None:
        return pipeline.clip_grad_norm_(max_norm)
    grads = [p.grad for p in parameters if p.grad is not None]
    total = nn.utils.get_total_norm(grads, foreach=True)
    if is_dtensor(total):
        total = total.full_tensor()  # the shards' partial norms, combined
    nn.utils.clip_grads_with_norm_(parameters, max_norm, total, foreach=True)
    return total


# ----------------------------------------------------------------------------------------------- state
def is_dtensor(value: Any) -> bool:
    """isinstance(value, DTensor) without importing torch.distributed.tensor here, at the start of every run (FSDP,
    DCP or torch._dynamo import it when a run needs them): until one has, nothing is a DTensor."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(value, module.DTensor)


def local_tensor(value: torch.Tensor) -> torch.Tensor:
    """A plain tensor of a value that every rank holds whole (a loss over the vocabulary's shards is a replicated
    DTensor)."""
    return value.to_local() if is_dtensor(value) else value


def is_sharded_state(state: Any) -> bool:
    """True if a (nested) state holds DTensors: shards, not full tensors."""
    if is_dtensor(state):
        return True
    if isinstance(state, dict):
        return any(is_sharded_state(value) for value in state.values())
    return False


def is_sharded_model(model: nn.Module) -> bool:
    return any(is_dtensor(p) for p in model.parameters())


class ModelState:
    """The model in a snapshot: a DDP snapshot holds `model.state_dict()` (full tensors), a sharded one each rank's
    part (DTensor shards under FSDP and tensor parallelism; its stages' tensors under pipeline parallelism), by the
    whole model's parameter names. `named_state_dict()` is the form this process holds: what a sharded snapshot
    loads into. `modules`: the modules holding this rank's parameters (one, or its pipeline stages). Snapshots hold
    every tensor in its canonical order: the rows a tensor-parallel layout keeps `permuted` (name: degree) are put
    back in order on the way out and permuted again on the way in."""

    def __init__(self, modules: nn.Module | list[nn.Module], permuted: Optional[dict[str, int]] = None,
                 named: Optional[bool] = None) -> None:
        self.modules = modules if isinstance(modules, list) else [modules]
        self.model, self.permuted = self.modules[0], permuted or {}
        self.sharded = any(is_sharded_model(module) for module in self.modules) if named is None else named

    def state_dict(self) -> dict:
        return self.named_state_dict() if self.sharded else self.model.state_dict()

    def named_state_dict(self) -> dict:
        return canonical_state(self._own_state(), self.permuted)

    def _own_state(self) -> dict:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        return {key: value for module in self.modules for key, value in get_model_state_dict(module).items()}

    def load_state_dict(self, state: dict) -> None:
        if not self.sharded:
            self.model.load_state_dict(state)
            return
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        full = not is_sharded_state(state)  # a DDP snapshot's full tensors: each rank keeps its shards of them
        state = layout_state(state, self.permuted, full, self._own_state)
        for module in self.modules:  # each takes its own entries (a pipeline stage: its blocks')
            own = {key: state[key] for key in module.state_dict()}
            set_model_state_dict(module, own, options=StateDictOptions(full_state_dict=full))


def canonical_state(state: dict, permuted: dict[str, int]) -> dict:
    """Collective under tensor parallelism. A state dict (model, or an optimizer's by name) with its permuted rows
    in canonical order."""
    if not permuted:
        return state
    from mingpt.parallel.tensor_parallel import to_canonical

    return to_canonical(state, permuted)


def layout_state(state: dict, permuted: dict[str, int], full: bool, templates: Callable[[], dict]) -> dict:
    """Collective under tensor parallelism. The reverse of `canonical_state`: full tensors permuted as they are,
    shards into the layout of this process's own state (`templates`)."""
    if not permuted:
        return state
    from mingpt.parallel.tensor_parallel import from_canonical

    return from_canonical(state, None if full else templates(), permuted)


class OptimizerState:
    """The optimizer in a snapshot. DDP: the optimizer's own state_dict (parameters numbered); sharded layouts: keyed
    by parameter name, each rank's part, with the parameter groups of the whole model. Any loads into any layout.

    `pairs`: each module (one per pipeline stage) with the optimizers of its parameters (AdamW, or Muon and AdamW:
    `Optimizers.by_module()`); `numbered_names` are the whole model's
    parameter names in a one-optimizer numbering, for a DDP snapshot's numbered state (default: the model's own);
    `group` is where the groups' members are gathered from when no rank holds them all (pipeline stages)."""

    def __init__(self, pairs: list[tuple[nn.Module, list[torch.optim.Optimizer]]],
                 permuted: Optional[dict[str, int]] = None, named: Optional[bool] = None,
                 numbered_names: Optional[list[str]] = None, group: Optional[dist.ProcessGroup] = None) -> None:
        self.pairs = pairs  # each module (a pipeline stage each) with the optimizers of its parameters
        self.model, self.optimizer, self.permuted = pairs[0][0], pairs[0][1][0], permuted or {}
        self.sharded = any(is_sharded_model(module) for module, _ in pairs) if named is None else named
        self.numbered_names, self.group = numbered_names, group
        # torch's numbered form holds one optimizer: several (Muon and AdamW) are saved by parameter name
        self.by_name = self.sharded or len(pairs) > 1 or len(pairs[0][1]) > 1

    def state_dict(self) -> dict:
        return self.named_state_dict() if self.by_name else self.optimizer.state_dict()

    def named_state_dict(self) -> dict:
        return canonical_state(self._own_state(), self.permuted)

    def _own_state(self) -> dict:
        """Collective with a `group`. This rank's state by name; every group lists the whole model's members."""
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        parts = [get_optimizer_state_dict(module, optimizers) for module, optimizers in self.pairs]
        state = {name: value for part in parts for name, value in part["state"].items()}
        groups = [[part["param_groups"][i] for part in parts]  # the i-th group of each module's optimizers
                  for i in range(len(parts[0]["param_groups"]))]
        if self.group is not None:
            groups = [[g for rank_groups in gathered for g in rank_groups]
                      for gathered in zip(*_all_gather_objects(groups, self.group))]
        return {"state": state, "param_groups": [merged_group(parts) for parts in groups]}

    def load_state_dict(self, state: dict) -> None:
        numbered = any(isinstance(p, int) for group in state["param_groups"] for p in group["params"])
        if numbered and not self.by_name:
            self.optimizer.load_state_dict(state)
            return
        if numbered:
            names = self.numbered_names or parameter_names(self.optimizer, self.model)
            state = named_optimizer_state(state, names)
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        full = not is_sharded_state(state)
        state = layout_state(state, self.permuted, full and self.sharded, self._own_state)
        options = StateDictOptions(full_state_dict=full and self.sharded)
        for module, optimizers in self.pairs:
            set_optimizer_state_dict(module, optimizers, own_optimizer_state(state, module), options=options)


def merged_group(groups: list[dict]) -> dict:
    """One parameter group of the whole model from the same group of several optimizers: their settings (the
    same), their members together."""
    return {**groups[0], "params": [name for group in groups for name in group["params"]]}


def own_optimizer_state(state: dict, module: nn.Module) -> dict:
    """The entries of a by-name optimizer state that concern `module`'s parameters (a pipeline stage's)."""
    names = {name for name, _ in module.named_parameters()}
    if all(name in names for group in state["param_groups"] for name in group["params"]):
        return state
    return {"state": {name: value for name, value in state["state"].items() if name in names},
            "param_groups": [{**group, "params": [name for name in group["params"] if name in names]}
                             for group in state["param_groups"]]}


def _all_gather_objects(value: Any, group: dist.ProcessGroup) -> list:
    values = [None] * dist.get_world_size(group)
    dist.all_gather_object(values, value, group=group)
    return values


def parameter_names(optimizer: torch.optim.Optimizer, model: nn.Module) -> list[str]:
    """The names of the optimizer's parameters in its own numbering (group by group, as `state_dict()` numbers
    them); a tied parameter goes by its first name."""
    names: dict[int, str] = {}
    for name, param in model.named_parameters():  # named_parameters skips the second name of a tied parameter
        names.setdefault(id(param), name)
    return [names[id(p)] for group in optimizer.param_groups for p in group["params"]]


def named_optimizer_state(state: dict, names: list[str]) -> dict:
    """An optimizer state_dict with numbered parameters -> the same keyed by parameter name."""
    return {
        "state": {names[index]: value for index, value in state["state"].items()},
        "param_groups": [{**group, "params": [names[index] for index in group["params"]]}
                         for group in state["param_groups"]],
    }


def numbered_optimizer_state(state: dict) -> dict:
    """The reverse of `named_optimizer_state`: names numbered group by group, as the optimizer numbers them."""
    order = [name for group in state["param_groups"] for name in group["params"]]
    index = {name: i for i, name in enumerate(order)}
    return {
        "state": {index[name]: value for name, value in state["state"].items()},
        "param_groups": [{**group, "params": [index[name] for name in group["params"]]}
                         for group in state["param_groups"]],
    }


def full_tensors(state: dict, permuted: Optional[dict[str, int]] = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Collective under FSDP and tensor parallelism. (name, full tensor in canonical order) in sorted name order, one
    tensor gathered at a time."""
    permuted = permuted or {}
    for name in sorted(state):
        value = state[name]
        full = value.full_tensor() if is_dtensor(value) else value
        if name in permuted:
            from mingpt.parallel.tensor_parallel import canonical_full

            full = canonical_full(full, permuted[name])
        yield name, full


def weights_sha256_of(tensors: Iterator[tuple[str, torch.Tensor]]) -> str:
    """snapshot.weights_sha256 of (name, full tensor) in sorted name order, one at a time (`full_tensors`)."""
    digest = hashlib.sha256()
    for _, tensor in tensors:
        flat = tensor.detach().cpu().contiguous().reshape(-1)
        digest.update(memoryview(flat.view(torch.uint8).numpy()))
    return digest.hexdigest()


def model_from_tensors(tensors: Iterator[tuple[str, torch.Tensor]], build: Callable[[], nn.Module], is_main: bool,
                       whole: Optional[nn.Module] = None) -> Optional[nn.Module]:
    """Collective when `tensors` is. An unsharded copy of the model on global rank 0's CPU (None on the others), for
    what one process does alone (generating a sample), from (name, full tensor) in order. `whole`: a model every
    rank holds whole (DDP), returned as it is."""
    if whole is not None:
        return whole
    state = {}
    for name, tensor in tensors:
        if is_main:  # the others take part in the gathers and keep nothing
            state[name] = tensor.cpu()
    if not is_main:
        return None
    copy = build()
    copy.load_state_dict(state)
    return copy  # on the CPU: a model sharded for want of GPU memory would not fit there whole


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
