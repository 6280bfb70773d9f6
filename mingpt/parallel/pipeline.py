"""Pipeline parallelism for the GPT of model.py: its blocks split into stages that run on different processes, fed
micro-batches by one of torch.distributed.pipelining's schedules.

    layers = stage_layers(cfg.n_layer, pp * stages_per_rank)       # blocks per stage, as even as they allow
    pipe = build_pipeline(GPT(cfg), mesh, torch.device("cpu"), schedule="1F1B", microbatches=4,
                          prepare_stage=lambda stage: fully_shard(stage, mesh=mesh["dp"]))  # collective
    optimizers = Optimizers([(stage, make_optimizer(stage)) for stage in pipe.stages])  # one per stage
    loss = pipe.step(x, y)           # forward + backward of this rank's batch; the mean loss on the last stage
    pipe.sync_tied_gradients()       # once per optimizer step: the embedding's gradient, summed over its two copies
    pipe.clip_grad_norm_(1.0)        # the norm over every stage, the tied weight counted once
    optimizers.step()
    eval_loss = pipe.evaluate(x, y)  # forward only; the mean loss on the last stage

Every rank builds the whole GPT (the same seed gives the same weights), then keeps only its stages' parts, under the
parameter names they have in the whole GPT (`transformer.h.3.attn.c_attn.weight` stays that): state dicts of the
stages merge by name into the whole model's, which is what torch.distributed.checkpoint saves and reshards.

The token embedding is tied to the output projection. The first stage uses it as the embedding, the last as the
head: both keep a copy (the last under both names, `transformer.wte.weight` first, as in a whole GPT), and each copy
gets the gradient of its own use. `sync_tied_gradients` sums the two over a group of the two stages' ranks, so both
copies take the same optimizer steps and stay equal. With `tie_embeddings=false` the head has its own matrix, which
only the last stage holds, and there is nothing to sum.

Data parallelism inside a stage is the caller's `prepare_stage(module) -> module`, applied before the schedule sees
the stage: FSDP2's `fully_shard` over a data-parallel mesh (shards, or replicas: a 2-D mesh whose shard dimension is
1) is correct with every schedule here; DDP only with find_unused_parameters=True (torch's stage drives DDP's reducer
by hand: without it the reducer asserts, or with static_graph trains wrong), so other DDP wrappers are refused.

One optimizer per stage module: torch.distributed.checkpoint's `get_optimizer_state_dict(model, optimizer)` names
an optimizer's parameters from one module, and fails on a parameter of another (Interleaved1F1B holds several stage
modules per rank). The trainer's snapshots hold them as `OptimizerState` does for every layout (state.py):
each stage's optimizers by the whole GPT's parameter names, which load into any layout, one process included.

Needs torch 2.7 (the schedules' `scale_grads`, FSDP2 on a CPU); on a CPU (gloo) 1F1B and Interleaved1F1B need 2.8:
torch 2.7's schedules wait on only the last of a batch of sends and receives, which deadlocks under gloo (fixed by
pytorch/pytorch#152938). Evaluation goes through the schedule's `eval()` from torch 2.10 (2.9 has it, but a first
eval() before any step() broke the next step), else through a forward pass of this module's own. Both are tested.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, Iterator, Optional, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from mingpt.compat import TORCH, require_torch
from mingpt.errors import UsageError
from mingpt.parallel.state import is_dtensor, local_tensor

PIPELINE_TORCH = (2, 7)  # scale_grads (mean over micro-batches) arrives in 2.7; FSDP2 on a CPU needs 2.7 too
GLOO_1F1B_TORCH = (2, 8)  # 2.7's _batch_p2p waits on batch_isend_irecv(...).pop() only: gloo deadlocks
# schedule.eval() arrived in 2.9 (pytorch/pytorch#157795); in 2.9 an eval() before the first step() left the backward
# uninitialised (#162822, fixed by #162823 for 2.10)
SCHEDULE_EVAL_TORCH = (2, 10)
SCHEDULES = ("1F1B", "GPipe", "Interleaved1F1B")


# ------------------------------------------------------------------------------------------------------- layout


def stage_layers(n_layer: int, n_stages: int, explicit: Optional[Sequence[int]] = None) -> list[range]:
    """The blocks of each stage: `explicit` (blocks per stage, in order) or as even as `n_layer` allows, the later
    stages taking the one block more (under 1F1B the first stage holds the most micro-batches' activations; the
    head of a character vocabulary is cheap). The first stage may hold the embeddings alone (a one-block model in
    two stages); every other stage needs a block. One-line UsageError when the split is impossible."""
    if n_stages < 1 or n_stages > n_layer + 1:
        raise UsageError(f"{n_layer} blocks cannot make {n_stages} pipeline stages: each stage after the first needs "
                         f"one at least")
    if explicit is None:
        base, extra = divmod(n_layer, n_stages)
        explicit = [base + (1 if stage >= n_stages - extra else 0) for stage in range(n_stages)]
    counts = list(explicit)
    if len(counts) != n_stages or sum(counts) != n_layer or min(counts) < 0 or min(counts[1:], default=1) < 1:
        raise UsageError(f"pipeline layers {counts} must give each of the {n_stages} stages after the first at least "
                         f"one block, {n_layer} in all")
    starts = [sum(counts[:stage]) for stage in range(n_stages)]
    return [range(start, start + count) for start, count in zip(starts, counts)]


def stage_owner(stage: int, pp: int) -> int:
    """The pipeline rank that holds `stage`: stages are dealt round-robin (looped), as interleaved schedules expect."""
    return stage % pp


def rank_stages(pp_rank: int, pp: int, stages_per_rank: int) -> list[int]:
    """The stages pipeline rank `pp_rank` holds, in order."""
    return [pp_rank + pp * loop for loop in range(stages_per_rank)]


# ------------------------------------------------------------------------------------------------------- stages


class GPTStage(nn.Module):
    """Some consecutive blocks of a GPT: with the embeddings if first, the final norm and head if last.

    Built from a GPT's own modules (no copy): parameter names are those of the whole GPT. With tied embeddings the
    last stage also keeps `transformer.wte`, which its forward never calls: the tied weight then keeps its GPT name
    `transformer.wte.weight` first, and both its state-dict keys exist. Untied, the last stage holds its own head
    (`lm_head.weight`) and no embedding; under rotary positions the first holds no `wpe`, and the bigram embedding
    (`transformer.bigram`) where the model has one.
    forward: first stage idx (B, T) int64 -> hidden (B, T, C); others hidden -> hidden; the last -> logits (B, T, V).
    """

    def __init__(self, gpt: nn.Module, layers: range, first: bool, last: bool) -> None:
        super().__init__()
        self.config = gpt.config
        self.whole_model_class = type(gpt)  # whose embed and unembed run over this stage's modules (the same names)
        self.is_first, self.is_last = first, last
        whole = gpt.transformer
        parts: dict[str, nn.Module] = {}  # in the GPT's order, so the tied weight's first name is the GPT's
        if first or (last and self.config.tie_embeddings):
            parts["wte"] = whole.wte
        if first:
            parts.update({name: whole[name] for name in ("wpe", "bigram", "drop") if name in whole})
        parts["h"] = nn.ModuleDict({str(index): whole.h[index] for index in layers})
        if last:
            parts["ln_f"] = whole.ln_f
        self.transformer = nn.ModuleDict(parts)
        if last:
            self.lm_head = gpt.lm_head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.is_first:  # as GPT.forward
            x = self.transformer.drop(self.whole_model_class.embed(self, x))
        for block in self.transformer.h.values():
            x = block(x)
        if self.is_last:
            x = self.whole_model_class.unembed(self, x)
        return x


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy in fp32, as GPT.forward computes it (one micro-batch's)."""
    return F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), targets.reshape(-1))


# ------------------------------------------------------------------------------------------------------- pipeline


class GPTPipeline:
    """This rank's stages of a GPT and the schedule that runs micro-batches through them (`build_pipeline`).

    `stages`: this rank's GPTStage modules (FSDP2 modules when `prepare_stage` sharded them), in stage order;
    their parameters and state dicts carry the whole GPT's names. `runners`: what the schedule calls (a DDP
    wrapper, or the stage itself). `stage_indices`: which stages they are, of `n_stages`.
    """

    def __init__(self, stages: list[GPTStage], runners: list[nn.Module], stage_indices: list[int], n_stages: int,
                 schedule: Any, microbatches: int, pp_group: Any, tie_group: Any,
                 evaluate_with_schedule: Optional[bool] = None) -> None:
        self.stages, self.runners, self.stage_indices = stages, runners, stage_indices
        self.n_stages, self.schedule, self.microbatches = n_stages, schedule, microbatches
        self.pp_group, self.tie_group = pp_group, tie_group
        self.pp = dist.get_world_size(pp_group)
        if evaluate_with_schedule is None:  # the schedule's forward-only mode, where torch has it working
            evaluate_with_schedule = TORCH >= SCHEDULE_EVAL_TORCH and hasattr(schedule, "eval")
        self.evaluate_with_schedule = evaluate_with_schedule
        step_parameters = inspect.signature(schedule.step).parameters
        self._step_options = {"return_outputs": False} if "return_outputs" in step_parameters else {}
        self._batch_shape: Optional[tuple[int, ...]] = None  # the shape the schedule's stages were built for

    @property
    def has_first_stage(self) -> bool:
        return 0 in self.stage_indices

    @property
    def has_last_stage(self) -> bool:
        return self.n_stages - 1 in self.stage_indices

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """(whole-GPT name, parameter) of every stage here, each parameter once."""
        seen: set[int] = set()
        for stage in self.stages:
            for name, param in stage.named_parameters():
                if id(param) not in seen:
                    seen.add(id(param))
                    yield name, param

    def parameters(self) -> list[nn.Parameter]:
        return [param for _, param in self.named_parameters()]

    def train(self, mode: bool = True) -> None:
        for stage in self.stages:
            stage.train(mode)

    def step(self, x: Optional[torch.Tensor], y: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        """Collective over the pipeline: forward and backward of this rank's batch, micro-batch by micro-batch;
        gradients accumulate in `.grad` (averaged over micro-batches, and over data-parallel peers by their
        wrapper). x is read on the first stage, y on the last (others may pass None). Returns the mean loss over the
        micro-batches (detached) on the rank with the last stage, None elsewhere. Call `sync_tied_gradients` once
        before the optimizer step (after the last of several accumulated steps). Every step's batch has the shape of
        the first: torch's stages size their buffers from it (another shape is a one-line error here, not a hang)."""
        shape = _shape_of(x, y)
        if self._batch_shape is not None and shape != self._batch_shape:
            raise UsageError(f"pipeline batches keep the shape of the first, {tuple(self._batch_shape)} sequences x "
                             f"tokens; got {tuple(shape)} (batch_size and block_size must stay fixed)")
        args, target, losses = self._feed(x, y)
        self._batch_shape = shape
        self.schedule.step(*args, target=target, losses=losses, **self._step_options)
        return torch.stack(losses).mean().detach() if losses is not None else None

    @torch.no_grad()
    def evaluate(self, x: Optional[torch.Tensor], y: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        """Collective over the pipeline (x and y of the same shape on every rank): the mean loss of a batch, forward
        only (dropout off for the pass), on the rank with the last stage; None elsewhere. Through the schedule's
        eval() (micro-batches) where torch has it working and the batch has the training batches' shape, else a
        plain forward pass stage after stage (the whole batch at once), which takes any batch."""
        modes = [stage.training for stage in self.stages]
        self.train(False)
        try:
            if self.evaluate_with_schedule and self._schedule_can_evaluate(x, y):
                args, target, losses = self._feed(x, y)
                self.schedule.eval(*args, target=target, losses=losses)
                return torch.stack(losses).mean() if losses is not None else None
            return self._forward_pass(x, y)
        finally:
            for stage, mode in zip(self.stages, modes):
                stage.train(mode)

    def _schedule_can_evaluate(self, x: Optional[torch.Tensor], y: Optional[torch.Tensor]) -> bool:
        """Collective over the pipeline: whether the schedule's eval() may take this batch. Only of the training
        batches' shape: torch's stages keep the buffers of the shape they were last built for, and another shape
        breaks the point-to-point transfers (gloo aborts). Not while gradients are held: returning to training
        rebuilds the stages, which clears FSDP stages' gradients (torch 2.13 stage.py,
        `_post_metadata_inference_cleanup`)."""
        holding = any(param.grad is not None for param in self.parameters())
        other_shape = self._batch_shape is None or _shape_of(x, y) != self._batch_shape
        return not _anywhere(holding or other_shape, self.pp_group, self._device())

    def _feed(self, x: Optional[torch.Tensor], y: Optional[torch.Tensor]) -> tuple[tuple, Any, Optional[list]]:
        """The schedule's arguments on this rank: the inputs where the first stage is, targets and a list for the
        micro-batches' losses where the last is."""
        for batch, needed in ((x, self.has_first_stage), (y, self.has_last_stage)):
            if needed and (batch is None or batch.size(0) % self.microbatches):
                size = None if batch is None else batch.size(0)
                raise UsageError(f"a batch of {size} sequences per process cannot be split into {self.microbatches} "
                                 f"pipeline micro-batches: the micro-batch count must divide it")
        # contiguous: torch 2.7's stage checks each micro-batch's strides against the first one's (a slice of a
        # window of block_size + 1 tokens is not)
        args = (x.contiguous(),) if self.has_first_stage else ()
        last = self.has_last_stage
        return args, (y.contiguous() if last else None), ([] if last else None)

    def _forward_pass(self, x: Optional[torch.Tensor], y: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        """Every stage in order, hidden states sent point to point: each rank walks the same stage order, so the
        sends and receives pair up whatever the stages' placement (interleaved included)."""
        held = dict(zip(self.stage_indices, self.stages))
        loss = None
        for index, stage in sorted(held.items()):
            hidden = x if index == 0 else self._receive(stage_owner(index - 1, self.pp))
            out = stage(hidden)
            if index == self.n_stages - 1:
                loss = loss_fn(out, y)
            else:
                self._send(out, stage_owner(index + 1, self.pp))
        return loss

    def _send(self, tensor: torch.Tensor, pp_rank: int) -> None:
        peer = dist.get_global_rank(self.pp_group, pp_rank)
        header = torch.tensor([*tensor.shape, _DTYPES.index(tensor.dtype)], dtype=torch.int64, device=tensor.device)
        dist.send(header, peer, group=self.pp_group)  # shape and dtype first: the receiver allocates from them
        dist.send(tensor.contiguous(), peer, group=self.pp_group)

    def _receive(self, pp_rank: int) -> torch.Tensor:
        peer = dist.get_global_rank(self.pp_group, pp_rank)
        header = torch.empty(4, dtype=torch.int64, device=self._device())
        dist.recv(header, peer, group=self.pp_group)
        *shape, dtype = header.tolist()
        tensor = torch.empty(shape, dtype=_DTYPES[dtype], device=self._device())
        dist.recv(tensor, peer, group=self.pp_group)
        return tensor

    def _device(self) -> torch.device:
        return next(self.stages[0].parameters()).device

    # -------------------------------------------------------------------------------------------- gradients

    def tied_parameter(self) -> Optional[nn.Parameter]:
        """This rank's copy of the embedding tied to the head (first or last stage), or None (also when the model's
        head is untied: each stage then owns its matrix alone, and there is nothing to sum)."""
        for stage in self.stages:
            if stage.config.tie_embeddings and (stage.is_first or stage.is_last):
                return stage.transformer.wte.weight
        return None

    @torch.no_grad()
    def sync_tied_gradients(self) -> None:
        """Collective over the first and last stages' ranks (a no-op elsewhere): the tied weight's gradient summed
        over its two copies, the embedding's and the head's, as one process's backward sums them. Once per
        optimizer step, before clipping: both copies then take the same step."""
        param = self.tied_parameter()
        if param is None or self.tie_group is None:
            return
        if param.grad is None:  # no backward reached it: contribute nothing, but still meet the peer
            param.grad = torch.zeros_like(param)
        if is_dtensor(param.grad) and param.grad.placements != param.placements:
            # Under tensor parallelism the first stage's embedding gradient comes back whole (Replicate) while the
            # head's is split over the vocabulary like the weight: the same split on both sides before summing.
            param.grad = param.grad.redistribute(param.device_mesh, param.placements)
        dist.all_reduce(local_tensor(param.grad), group=self.tie_group)  # a DTensor's shard: peers hold the same shard

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: Optional[float]) -> torch.Tensor:
        """Collective over the pipeline (and data-parallel peers under FSDP): clip every gradient here by the norm
        over all stages, the tied weight counted once (on the first stage); None: only measure it. Returns that
        norm. Call after `sync_tied_gradients`."""
        params = self.parameters()
        second_copy = self.tied_parameter() if not self.has_first_stage else None
        grads = [p.grad for p in params if p.grad is not None and p is not second_copy]
        norm = nn.utils.get_total_norm(grads, foreach=True) if grads else torch.zeros((), device=self._device())
        if is_dtensor(norm):
            norm = norm.full_tensor()  # the shards' partial norms over the data-parallel mesh, combined
        squared = norm.float() ** 2
        if second_copy is not None and second_copy.grad is not None:  # counted once, but stepped here too: a
            # non-finite gradient of this copy must make the norm non-finite (no host read: where, not if)
            copy_finite = torch.isfinite(local_tensor(second_copy.grad)).all()
            squared = squared + torch.where(copy_finite, 0.0, float("nan")).to(squared.device)
        dist.all_reduce(squared, group=self.pp_group)  # each stage's share of the squared norm
        total = squared.sqrt()
        if max_norm is not None:
            nn.utils.clip_grads_with_norm_(params, max_norm, total, foreach=True)
        return total


def _shape_of(x: Optional[torch.Tensor], y: Optional[torch.Tensor]) -> tuple[int, ...]:
    """(sequences, tokens) of a batch, from whichever of inputs and targets this rank has."""
    return tuple((x if x is not None else y).shape)


def _anywhere(flag: bool, group: Any, device: torch.device) -> bool:
    """True on every rank of `group` when it is True on any (all stages must take the same evaluation path)."""
    value = torch.tensor(float(flag), device=device)
    dist.all_reduce(value, op=dist.ReduceOp.MAX, group=group)
    return bool(value.item())


_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)  # what a hidden state may be sent as


def build_pipeline(gpt: nn.Module, mesh: Any, device: torch.device, schedule: str = "1F1B",
                   microbatches: Optional[int] = None, stages_per_rank: Optional[int] = None,
                   layers: Optional[Sequence[int]] = None,
                   prepare_stage: Optional[Callable[[GPTStage], nn.Module]] = None, pp_dim: str = "pp",
                   evaluate_with_schedule: Optional[bool] = None) -> GPTPipeline:
    """Collective over the whole mesh: this rank's stages of `gpt` (built identically on every rank; its modules
    are taken, not copied) under `schedule`. `mesh`: a DeviceMesh with a `pp_dim` dimension (the pipeline ranks).
    `microbatches` (default: the number of stages) must divide each step's batch per process; `stages_per_rank`
    defaults to 2 under Interleaved1F1B, else 1; `layers`: blocks per stage (default: even). `prepare_stage`
    parallelises a stage (data parallelism over the other mesh dimensions) and returns what the schedule runs."""
    pp = mesh.size(mesh.mesh_dim_names.index(pp_dim))
    per_rank, microbatches = _check_schedule(schedule, pp, stages_per_rank, microbatches)
    require_torch(PIPELINE_TORCH, "pipeline parallelism")
    if device.type == "cpu" and schedule != "GPipe":  # CPU tensors travel by gloo
        require_torch(GLOO_1F1B_TORCH, f"the {schedule} pipeline schedule on a CPU (torch 2.7 runs only GPipe there)")
    n_stages = pp * per_rank
    ranges = stage_layers(gpt.config.n_layer, n_stages, layers)
    tie_group = tied_weight_group(mesh, pp_dim)
    indices = rank_stages(mesh.get_local_rank(pp_dim), pp, per_rank)
    stages = [GPTStage(gpt, ranges[index], index == 0, index == n_stages - 1) for index in indices]
    runners = [prepare_stage(stage) if prepare_stage else stage for stage in stages]
    _refuse_ddp(runners)
    pp_group = mesh.get_group(pp_dim)
    driven = [_pipeline_stage(runner, index, n_stages, device, pp_group) for runner, index in zip(runners, indices)]
    runner = _schedule(schedule, driven, microbatches)
    return GPTPipeline(stages, runners, indices, n_stages, runner, microbatches, pp_group, tie_group,
                       evaluate_with_schedule)


def _check_schedule(schedule: str, pp: int, stages_per_rank: Optional[int],
                    microbatches: Optional[int]) -> tuple[int, int]:
    """Stages per rank and micro-batches, defaulted and checked against what torch's schedules accept."""
    if schedule not in SCHEDULES:
        raise UsageError(f"pipeline schedule must be one of {', '.join(SCHEDULES)}, got {schedule!r}")
    if pp < 2:
        raise UsageError(f"pipeline parallelism needs at least 2 pipeline ranks, got {pp}")
    interleaved = schedule == "Interleaved1F1B"
    per_rank = stages_per_rank or (2 if interleaved else 1)
    if (interleaved and per_rank < 2) or (not interleaved and per_rank != 1):
        raise UsageError(f"the {schedule} schedule takes {'2 or more stages' if interleaved else 'one stage'} per "
                         f"process, got {per_rank}")
    microbatches = microbatches or pp * per_rank
    if microbatches < pp:  # torch's 1F1B needs them (its 2.7 needs them under every schedule); fewer only idle
        raise UsageError(f"the {schedule} schedule needs at least {pp} micro-batches per batch (one per pipeline "
                         f"rank), got {microbatches}")
    return per_rank, microbatches


def tied_weight_group(mesh: Any, pp_dim: str = "pp") -> Any:
    """Collective over the whole mesh: the group of the first and last stages' ranks that share this rank's other
    mesh coordinates (None on a rank with neither). With 2 pipeline ranks that is the pipeline group; with more,
    one new group per coordinate, created on every rank in the same order (as new_group requires)."""
    dim = mesh.mesh_dim_names.index(pp_dim)
    pp = mesh.size(dim)
    if pp == 2:
        return mesh.get_group(pp_dim)
    mine = None
    for column in mesh.mesh.movedim(dim, -1).reshape(-1, pp).tolist():
        group = dist.new_group([column[0], column[-1]])
        if dist.get_rank() in (column[0], column[-1]):
            mine = group
    return mine


def _refuse_ddp(runners: list[nn.Module]) -> None:
    """DDP in a stage only with find_unused_parameters=True. torch's stage runs DDP's reducer by hand
    (stage.py: forward under no_sync, prepare_for_backward before the last backward); the reducer records the
    gradients' order in every backward of the first step until the next forward rebuilds its buckets, so two
    backwards in a row (GPipe, interleaved, 1F1B with as many micro-batches as stages) trip an internal assert, and
    static_graph=True trains wrong without an error. find_unused_parameters turns the bucket rebuild off."""
    from torch.nn.parallel import DistributedDataParallel

    for runner in runners:
        if isinstance(runner, DistributedDataParallel) and (runner.static_graph or not runner.find_unused_parameters):
            raise UsageError("DDP inside a pipeline stage needs find_unused_parameters=True and no static_graph "
                             "(else its reducer asserts or trains wrong): pass them, or replicate with FSDP2")


def _pipeline_stage(module: nn.Module, index: int, n_stages: int, device: torch.device, group: Any) -> Any:
    from torch.distributed.pipelining import PipelineStage

    return PipelineStage(module, index, n_stages, device, group=group)  # shapes inferred from the first batch


def _schedule(name: str, stages: list[Any], microbatches: int) -> Any:
    """torch's schedule; gradients are averaged over micro-batches (scale_grads), matching a mean loss."""
    from torch.distributed import pipelining

    if name == "Interleaved1F1B":
        return pipelining.ScheduleInterleaved1F1B(stages, microbatches, loss_fn=loss_fn, scale_grads=True)
    single = pipelining.Schedule1F1B if name == "1F1B" else pipelining.ScheduleGPipe
    return single(stages[0], microbatches, loss_fn=loss_fn, scale_grads=True)


# ------------------------------------------------------------------------------------------------------- state


def model_state_dict(pipe: GPTPipeline) -> dict[str, Any]:
    """This rank's part of the whole GPT's state dict, by the GPT's names (DTensor shards under FSDP): what
    torch.distributed.checkpoint saves; the ranks' parts (the tied weight in two of them, equal) make the whole."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    return {key: value for stage in pipe.stages for key, value in get_model_state_dict(stage).items()}


def load_model_state_dict(pipe: GPTPipeline, state: dict[str, Any]) -> None:
    """Each stage takes its own entries of `state` (a whole GPT's, or `model_state_dict`'s filled by dcp.load)."""
    from torch.distributed.checkpoint.state_dict import set_model_state_dict

    for stage in pipe.stages:
        set_model_state_dict(stage, {key: state[key] for key in stage.state_dict()})
