"""Distributed, mixed-precision training epochs with periodic evaluation and metrics.

The trainer receives the model as the layout spreads it (a `ParallelModel`: mingpt/parallel/parallelize.py, with
the optimizers of what this process holds), the learning-rate schedule and the datasets (set up by main.py), and runs:

    for each epoch:  sampler.set_epoch(epoch)
        for each optimizer step:  grad_accum_steps micro-batches (gradients all-reduced on the last one only),
                                  unscale (fp16) -> clip -> optimizer step -> LR for the next step
            every log_every_steps: one line + one metrics.jsonl row (rank 0)
            every eval_every_steps and at each epoch end: validation loss over all ranks
            a snapshot when the checkpointer's cadence says so; a stop after SIGTERM (mingpt.distributed.stopping)

Nothing here is specific to GPT beyond `model(x, y) -> (logits, loss)`, and nothing here depends on the layout: a
replica, a sharded model or a pipeline is the ParallelModel's business. Nothing here knows Hydra. The trainer's own
snapshot state is its progress (`state_dict()`); the Checkpointer saves it beside the model, optimizer, scaler and
loss window.
"""

from __future__ import annotations

import hashlib
import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import torch
import torch.distributed as dist
from torch.utils.data import BatchSampler, DataLoader, Dataset

from char_dataset import EPOCH_ORDER, LEGACY_ORDER, ResumableDistributedSampler
from mingpt.checkpoint.checkpointer import Cadence, Checkpointer, Restored
from mingpt.checkpoint.store import SnapshotStore
from mingpt.compat import cpu_has_native_bf16
from mingpt.distributed.process_group import DistContext
from mingpt.distributed.stopping import StopRequest
from mingpt.errors import Diverged, UsageError
from mingpt.parallel.parallelize import IGNORED_TARGET, ParallelModel
from mingpt.parallel.state import weights_sha256_of
from mingpt.reporting.logs import PROGRESS_MODES, MetricsLog, Progress, report_end
from mingpt.storage.locations import check_location

log = logging.getLogger(__name__)

PRECISIONS = ("auto", "bf16", "fp16", "fp32")
DIVERGENCE_ACTIONS = ("stop", "rollback")
EVAL_BATCH_FACTOR = 4


@dataclass
class TrainerConfig:
    """How long and how to train; per-process batch size; evaluation, logging and snapshot cadence."""

    max_epochs: int = 2
    """passes over the training windows"""
    max_steps: Optional[int] = None
    """optional cap on optimizer steps; null = no cap"""
    batch_size: int = 64
    """windows per micro-batch, per data-parallel rank

    Per process under plain DDP and FSDP; tensor-parallel peers and pipeline stages of one replica share theirs."""
    grad_accum_steps: int = 1
    """micro-batches per optimizer step (gradients all-reduced on the last one only)"""
    grad_norm_clip: float = 1.0
    """clip the global gradient norm; 0 = off"""
    mixed_precision: str = "auto"
    """auto | bf16 | fp16 | fp32 (auto: bf16 on recent GPUs and bf16-capable CPUs, fp16 on older GPUs, else fp32)"""
    seed: int = 1337
    """seeds weights, data order and dropout"""
    eval_every_steps: int = 500
    """validation loss every this many steps (and at every epoch end); 0 = epoch ends only"""
    eval_batches: Optional[int] = None
    """cap on validation batches (4 x batch_size windows) per process; null = the whole split"""
    log_every_steps: int = 50
    """log line and metrics.jsonl row every this many steps"""
    progress: str = "auto"
    """auto (bar on a terminal, lines otherwise) | bar | lines | off"""
    report_at_end: bool = True
    """after training, rank 0 draws loss.png and logs a short sample (false: neither, and no whole-model gather)"""
    data_loader_workers: int = 0
    """DataLoader worker processes (a batch is one tensor gather; 0 is usually fastest)"""
    snapshot_path: str = "snapshots/default"
    """snapshot folder: local (relative = to the project) or fsspec URL (s3://...)"""
    save_every: int = 1
    """snapshot every this many epochs (and always at the end of training)"""
    save_every_steps: Optional[int] = None
    """also snapshot every this many optimizer steps; null = off"""
    keep_last: int = 2
    """snapshots kept; older ones are deleted once a newer one is complete"""
    keep_best: bool = False
    """also keep the snapshot with the lowest validation loss, beside the newest ones

    A snapshot is saved at every evaluation that improves on the best so far and marked in best.json; retention
    never deletes it. sample.py which=best and snapshot.py --which best read it."""
    skip_nonfinite_steps: bool = True
    """skip every optimizer step whose loss or gradient norm is not finite on any rank

    Every rank skips it together (no update; under fp16 the gradient scaler's own overflow handling is kept), counted
    in the log line and metrics.jsonl. One flag is read on the host per step; false: no check per step, and a run
    that goes non-finite is caught at its next log line or evaluation."""
    max_skipped_steps: int = 10
    """consecutive skipped steps after which the run has diverged (on_divergence says what then happens)"""
    on_divergence: str = "stop"
    """stop | rollback: what a diverged run does

    stop: one line naming the newest good snapshot, exit code 3. rollback: go back to the newest good snapshot, the
    learning rate times rollback_lr_factor from there, at most max_rollbacks times, then stop."""
    rollback_lr_factor: float = 0.5
    """on_divergence=rollback: each rollback multiplies every learning rate by this (0 < factor < 1)"""
    max_rollbacks: int = 3
    """on_divergence=rollback: rollbacks in the whole run before it stops as diverged"""
    stop_timeout_s: float = 15.0
    """after SIGTERM, a rank that cannot agree with its peers to stop within this exits

    Seconds. Such a rank has lost a peer or is blocked in a collective; it exits without a new snapshot and the
    last one stays. Below torchrun's 30 s."""
    snapshot_storage_options: Any = None
    """extra fsspec options, e.g. {client_kwargs:{endpoint_url:...}}; secrets: use the env"""

    def __post_init__(self) -> None:
        positive = ("max_epochs", "batch_size", "grad_accum_steps", "log_every_steps", "save_every", "keep_last",
                    "stop_timeout_s", "max_skipped_steps", "max_rollbacks")
        for name in positive:
            if getattr(self, name) <= 0:
                raise UsageError(f"trainer_config.{name} must be positive, got {getattr(self, name)}")
        non_negative = ("grad_norm_clip", "eval_every_steps", "data_loader_workers")
        for name in non_negative:
            if getattr(self, name) < 0:
                raise UsageError(f"trainer_config.{name} must be >= 0, got {getattr(self, name)}")
        for name in ("max_steps", "eval_batches", "save_every_steps"):
            if getattr(self, name) is not None and getattr(self, name) <= 0:
                raise UsageError(f"trainer_config.{name} must be positive or null, got {getattr(self, name)}")
        check_location(self.snapshot_path, "trainer_config.snapshot_path")  # a mangled URL, before anything runs
        if self.snapshot_storage_options is not None and not isinstance(self.snapshot_storage_options, dict):
            raise UsageError("trainer_config.snapshot_storage_options must be a mapping, e.g. {key: value}, or null")
        if self.progress not in PROGRESS_MODES:
            raise UsageError(
                f"trainer_config.progress must be one of {', '.join(PROGRESS_MODES)}, got {self.progress!r}"
            )
        if self.on_divergence not in DIVERGENCE_ACTIONS:
            raise UsageError(f"trainer_config.on_divergence must be one of {', '.join(DIVERGENCE_ACTIONS)}, got "
                             f"{self.on_divergence!r}")
        if not 0 < self.rollback_lr_factor < 1:
            raise UsageError(f"trainer_config.rollback_lr_factor must be between 0 and 1 (exclusive), got "
                             f"{self.rollback_lr_factor}")
        if self.mixed_precision not in PRECISIONS:
            raise UsageError(
                f"trainer_config.mixed_precision must be one of {', '.join(PRECISIONS)}, got {self.mixed_precision!r}"
            )


def resolve_precision(name: str, device: torch.device) -> torch.dtype:
    """The autocast dtype for a `mixed_precision` setting on this device (float32 means no autocast)."""
    # including_emulation=False: pre-Ampere GPUs (V100, T4) can create bf16 tensors, so the default check says
    # yes, but they have no bf16 tensor cores and run it emulated, many times slower than fp16.
    if name == "auto":
        if device.type == "cpu":
            return torch.bfloat16 if cpu_has_native_bf16() else torch.float32
        if device.type != "cuda":
            return torch.float32
        return torch.bfloat16 if torch.cuda.is_bf16_supported(including_emulation=False) else torch.float16
    if name == "bf16" and device.type == "cuda" and not torch.cuda.is_bf16_supported(including_emulation=False):
        raise UsageError(f"mixed_precision=bf16 is not supported on {torch.cuda.get_device_name(device)} "
                         f"(no bf16 tensor cores, only slow emulation); use fp16 or auto")
    return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[name]


# Up to which context "auto" writes the scores out (docs/cpu.md, Precision): measured at 64-1,024.
MATMUL_ATTENTION_MAX_T = 1024  # with dropout: at T=1024 matmul 1.447x nanoGPT, sdpa (its math fallback) 1.235x
MATMUL_ATTENTION_MAX_T_NO_DROPOUT = 256  # without: torch's flash kernel wins from 512 on (1.33x against 1.09-1.18x)


def resolve_attention(name: str, device: torch.device, amp_dtype: torch.dtype, block_size: int,
                      dropout: float) -> str:
    """The attention implementation for a `gpt_config.attention` setting: "auto" is matmul on a CPU in bf16 for
    short contexts and sdpa everywhere else. torch's CPU flash kernel is slow in bf16 at short contexts (its backward
    4.7x fp32's at T=64) and fast at long ones, where the written-out (T x T) scores cost more than they save; and it
    takes no dropout (aten/src/ATen/native/transformers/sdp_utils_cpp.cpp, use_flash_attention_cpp:
    check_for_dropout), so with dropout sdpa runs its math fallback, which writes the scores out too, more slowly
    than matmul does: the crossing is at a longer context with dropout than without."""
    if name != "auto":
        return name
    if device.type != "cpu" or amp_dtype != torch.bfloat16:
        return "sdpa"
    longest = MATMUL_ATTENTION_MAX_T if dropout > 0 else MATMUL_ATTENTION_MAX_T_NO_DROPOUT
    return "matmul" if block_size <= longest else "sdpa"


def _batch_as_is(batch: torch.Tensor) -> torch.Tensor:
    """Collate function for datasets whose `__getitems__` already returns a stacked tensor."""
    return batch


class WindowBatches(Dataset):
    """A window dataset as the loaders see it: a batch is the dataset's `windows(indices)`, one contiguous
    (batch, block_size + 1) tensor, not an (x, y) pair of views into it.

    One contiguous block pins as it is and goes to the GPU in one asynchronous copy from pinned memory; two
    strided views would each go through a pageable temporary, so pinning would buy nothing. x = w[:, :-1] and
    y = w[:, 1:] are sliced on the device (`Trainer._split`), the same values as the dataset's (x, y).
    """

    def __init__(self, dataset: Dataset) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitems__(self, indices: list[int]) -> torch.Tensor:
        return self.dataset.windows(indices)


# ----------------------------------------------------------------------------------------------- parts of a trainer
def make_loader(dataset: Dataset, sampler, batch_size: int, drop_last: bool, cfg: TrainerConfig,
                device: torch.device) -> DataLoader:
    # The loader gets its own generator: iter(DataLoader) draws a base seed from it, and would otherwise draw
    # from the global RNG and shift the dropout stream.
    return DataLoader(
        WindowBatches(dataset),  # batches of (B, T+1) windows, pinned on CUDA: `Trainer.split` makes x and y
        batch_sampler=BatchSampler(sampler, batch_size, drop_last=drop_last),
        collate_fn=_batch_as_is,
        num_workers=cfg.data_loader_workers,
        pin_memory=device.type == "cuda",
        generator=torch.Generator().manual_seed(cfg.seed),
        persistent_workers=cfg.data_loader_workers > 0,
    )


def seed_dropout(seed: int, step: int, rank: int, device: torch.device) -> None:
    """Dropout masks are a pure function of (seed, step, rank).

    Every rank gets different masks (a shared seed would give all ranks the same masks), and a resumed job draws
    exactly the masks the uninterrupted one would have, without saving RNG state.
    """
    key = f"{seed}:{step}:{rank}".encode()
    generator_seed = int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") >> 1
    torch.default_generator.manual_seed(generator_seed)
    if device.type == "cuda":
        torch.cuda.default_generators[device.index].manual_seed(generator_seed)


def resumed_order(order: str, epoch_samples: int, ctx: DistContext) -> str:
    """The order a resumed epoch continues in: its own, so every window is still seen once. A snapshot older than
    EPOCH_ORDER finishes its epoch in torch.randperm's order; one written by a newer version is refused."""
    if order not in (EPOCH_ORDER, LEGACY_ORDER):
        raise UsageError(f"the snapshot's epoch order {order!r} is unknown to this version (it knows {EPOCH_ORDER!r}"
                         f" and {LEGACY_ORDER!r}): update mingpt-ddp, or use another snapshot_path")
    if order == LEGACY_ORDER and epoch_samples == 0:
        return EPOCH_ORDER  # nothing of the epoch consumed yet: it may as well begin in the current order
    if order == LEGACY_ORDER and ctx.is_main:
        log.info("the snapshot predates the %s epoch order: its epoch ends in the order it began with (%s), later "
                 "epochs use %s", EPOCH_ORDER, LEGACY_ORDER, EPOCH_ORDER)
    return order


def eval_lockstep(val_data: Dataset, cfg: TrainerConfig, world_size: int) -> tuple[int, torch.Tensor]:
    """Under FSDP every forward pass is a collective: every rank evaluates as many batches as the rank with the most
    validation windows (its own are range(rank, n, world_size)), the others a filler batch for the rest."""
    most_windows = -(-len(val_data) // world_size)
    passes = -(-most_windows // (cfg.batch_size * EVAL_BATCH_FACTOR))
    if cfg.eval_batches is not None:
        passes = min(passes, cfg.eval_batches)
    return passes, val_data.windows([0] * min(cfg.batch_size * EVAL_BATCH_FACTOR, len(val_data)))


class ScalerState:
    """The gradient scaler in a snapshot, across a change of mixed_precision: a disabled scaler (bf16, fp32) saves {}.

    fp16 resuming a bf16/fp32 snapshot starts a fresh scaler (one warning); bf16/fp32 resuming an fp16 snapshot
    has no use for its loss scale (GradScaler.load_state_dict ignores it when disabled; one info line)."""

    def __init__(self, scaler: torch.amp.GradScaler, amp_dtype: torch.dtype, ctx: DistContext) -> None:
        self.scaler, self.amp_dtype, self.ctx = scaler, amp_dtype, ctx

    def state_dict(self) -> dict:
        return self.scaler.state_dict()

    def load_state_dict(self, state: dict) -> None:
        if self.scaler.is_enabled() and not state:
            if self.ctx.is_main:  # other ranks log warnings too: one line for the job, not one per process
                log.warning("snapshot has no fp16 gradient-scaler state (it was trained in bf16 or fp32): starting a "
                            "fresh scaler, loss scale %g", self.scaler.get_scale())
            return
        if not self.scaler.is_enabled() and state:
            log.info("snapshot was trained in fp16: its loss scale (%g) is not needed in %s", state.get("scale", 0.0),
                     str(self.amp_dtype).removeprefix("torch."))
            return
        self.scaler.load_state_dict(state)


class LossWindow:
    """The training losses since the last log line, summed on the device and read once per line. In a snapshot,
    every rank's partial sum, so that a resumed run logs the averages the uninterrupted one logs. Only `counted`
    ranks hold losses (under pipeline parallelism, the last stage's); the mean is over those."""

    def __init__(self, ctx: DistContext, counted: bool = True) -> None:
        self.ctx, self.counted = ctx, counted
        self.reset(0)

    def reset(self, step: int) -> None:
        self.loss_sum = torch.zeros((), device=self.ctx.device)
        self.count = 0
        self.skipped = 0  # steps of the window skipped as non-finite (their losses are not in the sum)
        self.start_step = step  # the losses from here on are averaged in the next line
        self.restart_clock(step)  # this process's steps and time since then: the speed
        self.grad_norm: Optional[torch.Tensor] = None

    def add(self, loss: Optional[torch.Tensor], skip: Optional[torch.Tensor] = None) -> None:
        """A micro-batch's loss (on the device: nothing waits for it); None on a rank that computes none. With
        `skip` (the step's flag on the device, 1: skipped), a skipped step's loss adds 0 (the trainer takes its
        count out once it reads the flag)."""
        if loss is not None:
            self.loss_sum += loss if skip is None else loss.nan_to_num(0.0, 0.0, 0.0) * (1 - skip)
        self.count += 1

    def restart_clock(self, step: int) -> None:
        self.timed_step, self.timed_from = step, time.perf_counter()

    def exclude(self, seconds: float) -> None:
        """Time spent on something else (evaluation, a snapshot) does not count against the speed."""
        self.timed_from += seconds

    def mean_loss(self) -> float:
        """Collective. The mean training loss over the window, over the counted ranks."""
        own = torch.stack([self.loss_sum / max(1, self.count), torch.ones((), device=self.ctx.device)])
        total, ranks = self.ctx.all_reduce(own * float(self.counted))
        return (total / ranks).item()

    def state_dict(self) -> dict:
        """Collective. Every rank's partial sum, and which ranks' sums count."""
        sums = torch.stack([self.loss_sum.detach().to(torch.float64), torch.tensor(float(self.counted),
                                                                                   dtype=torch.float64,
                                                                                   device=self.ctx.device)])
        if self.ctx.distributed:
            gathered = [torch.zeros_like(sums) for _ in range(self.ctx.world_size)]
            dist.all_gather(gathered, sums, group=self.ctx.group)
            sums = torch.stack(gathered)
        sums = sums.reshape(-1, 2).cpu().tolist()
        return {"sums": [row[0] for row in sums], "counted": [bool(row[1]) for row in sums], "count": self.count,
                "start_step": self.start_step, "skipped": self.skipped}

    def load_state_dict(self, window: dict) -> None:
        self.start_step, self.count = window["start_step"], window["count"]
        self.skipped = window.get("skipped", 0)
        counted = window.get("counted", [True] * len(window["sums"]))  # older snapshots: every rank counted
        now = self.ctx.gather_objects(self.counted)
        if counted == now:
            own = window["sums"][self.ctx.rank]  # each rank continues its own sum: identical arithmetic
        else:  # another layout: every counted rank takes the mean sum, so that the mean over the window stays right
            saved = [value for value, kept in zip(window["sums"], counted) if kept]
            own = sum(saved) / len(saved) if self.counted else 0.0
        self.loss_sum = torch.tensor(own, dtype=torch.float32, device=self.ctx.device)


class NonFiniteSteps:
    """Optimizer steps whose loss or gradient norm is not finite on some rank: every rank skips them together (no
    update), they are counted, and `limit` of them in a row mean the run has diverged.

    The gradient norm is global already (DDP's all-reduced gradients, FSDP's and the pipeline's reduced norm), but a
    fault may hit one rank's gradients after their reduction or its loss alone: one small all-reduce of both flags
    agrees. Under fp16 the gradients are the scaler's: an overflow there is its own skip (and a smaller scale), as
    GradScaler does it; only a non-finite loss is skipped here.

    `on_device` (every optimizer is fused AdamW and no fp16 scaler runs: the default): the agreed flags never reach
    the host during a step. The optimizer skips on the device, and the flags of the steps since are read in one go
    when the trainer next reads anything (`settle`: a log line, an evaluation, a snapshot, the end), so the counts,
    the streak and a divergence are known from then. Otherwise (Muon, fp16) each step's flags are read at once."""

    def __init__(self, ctx: DistContext, enabled: bool, limit: int, checks_gradients: bool, on_device: bool) -> None:
        self.ctx, self.enabled, self.limit, self.checks_gradients = ctx, enabled, limit, checks_gradients
        self.on_device = enabled and on_device
        self.total = 0  # skipped in the whole run (saved in snapshots)
        self.streak = 0  # skipped in a row up to the last step read
        self.what = ""  # what was not finite at the last skipped step
        self.last_skipped: Optional[int] = None  # the last step read, if it was skipped (its number, 1-based)
        self._pending: list[tuple[int, torch.Tensor | list[float], int]] = []  # (step, flags, its losses), unread

    def verdict(self, losses: list[torch.Tensor], grad_norm: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        """Collective. The flags every rank agrees on for this step, on the device: (loss, gradient norm) not finite
        on some rank, 1.0 or 0.0 each; None when the check is off."""
        if not self.enabled:
            return None
        loss_sum = torch.stack(losses).sum() if losses else torch.zeros((), device=self.ctx.device)
        checked = grad_norm is not None and self.checks_gradients
        gradient = grad_norm if checked else torch.zeros((), device=loss_sum.device)
        flags = torch.stack([~torch.isfinite(loss_sum.float()), ~torch.isfinite(gradient.float())]).float()
        return self.ctx.all_reduce(flags, dist.ReduceOp.MAX)

    def read_now(self, step: int, verdict: torch.Tensor) -> bool:
        """The verdict read on the host at once (Muon, fp16): whether the step is taken. Counted by `settle`."""
        flags = verdict.tolist()  # the host read
        self._pending.append((step, flags, 0))
        return not any(flags)

    def defer(self, step: int, verdict: torch.Tensor, losses_added: int) -> None:
        """The verdict of a step skipped (or not) on the device, to be read at the next `settle`; `losses_added`:
        the micro-batches the loss window counted for it (taken out again if it was skipped)."""
        self._pending.append((step, verdict, losses_added))

    def settle(self) -> list[tuple[int, int]]:
        """The verdicts not read yet, read in one go and counted; returns the skipped steps among them, each with
        the micro-batches the loss window counted for it."""
        if not self._pending:
            return []
        tensors = [flags for _, flags, _ in self._pending if isinstance(flags, torch.Tensor)]
        read = iter(torch.stack(tensors).tolist() if tensors else [])  # one host read for all of them
        skipped = []
        for step, flags, losses_added in self._pending:
            loss_bad, gradient_bad = next(read) if isinstance(flags, torch.Tensor) else flags
            if not (loss_bad or gradient_bad):
                self.streak, self.last_skipped = 0, None
                continue
            self.total += 1
            self.streak += 1
            self.last_skipped = step
            self.what = " and ".join(name for name, bad in (("loss", loss_bad), ("gradient norm", gradient_bad))
                                     if bad)
            skipped.append((step, losses_added))
        self._pending.clear()
        return skipped

    @property
    def diverged(self) -> bool:
        return self.streak >= self.limit


class Trainer:
    """Runs the epochs of one job. Its state is its own: the progress it saves in snapshots (`state_dict()`), the
    data position, the loss window, the scaler, the snapshots (a Checkpointer over `snapshots`, None for none).
    Nothing in it is specific to GPT beyond `model(x, y) -> (logits, loss)`, nor to a layout: `parallel` (built by
    mingpt.parallel.parallelize, with the optimizers of what this process holds) runs the forward and backward passes,
    finishes and clips the gradients, evaluates and hands snapshots the model's and optimizers' state."""

    def __init__(
        self,
        cfg: TrainerConfig,
        parallel: ParallelModel,
        lr_schedule: Callable[[int, int], float],  # (step, total steps) -> fraction of each group's peak rate
        train_data: Dataset,
        val_data: Dataset,
        run_dir: Optional[Path] = None,
        snapshots: Optional[SnapshotStore] = None,
        snapshot_metadata: Optional[dict] = None,
    ) -> None:
        self.cfg, self.parallel, self.lr_schedule = cfg, parallel, lr_schedule
        self.ctx = parallel.ctx  # the process group the layout's collectives go through (FSDP alone: a group of one)
        self.optimizers = parallel.optimizers
        self.scaler = parallel.gradient_scaler()
        self._setup_data(train_data, val_data)
        # The UTF-8 bytes each id stands for, on the device: val_bpb counts the bytes of exactly the targets evaluated
        # (it compares runs across tokenizers). None: the validation data cannot say.
        token_bytes = getattr(val_data, "token_bytes", None)
        self._target_bytes = (None if token_bytes is None else
                              torch.as_tensor(token_bytes, dtype=torch.float64, device=self.ctx.device))
        self.metrics = MetricsLog(run_dir, enabled=self.ctx.is_main)
        # Progress: everything the position in training depends on, saved in snapshots (`state_dict`).
        self.step = 0  # optimizer steps done
        self.epoch = 0  # current epoch (= completed epochs)
        self.epoch_samples = 0  # global samples consumed in the current epoch (world-size independent)
        self.epoch_order = EPOCH_ORDER  # the current epoch's order (an older snapshot's epoch ends in its own)
        self.last_val_loss: Optional[float] = None
        self.last_val_bpb: Optional[float] = None  # the same evaluation in bits per byte of the text
        self.best_val_loss: Optional[float] = None  # the lowest validation loss so far (keep_best's mark)
        self.lr_scale = 1.0  # every learning rate's factor after rollbacks (on_divergence=rollback)
        self.rollbacks = 0
        self._last_eval_step = -1
        self._last_lr = 0.0  # the first group's rate at the last step (AdamW's, as it was scheduled)
        self._batches: Optional[Iterator] = None
        self.window = LossWindow(self.ctx, counted=parallel.computes_loss)
        self.nonfinite = NonFiniteSteps(self.ctx, cfg.skip_nonfinite_steps, cfg.max_skipped_steps,
                                        checks_gradients=self.amp_dtype != torch.float16,
                                        on_device=self.optimizers.skip_on_device and not self.scaler.is_enabled())
        self.checkpoints = self._checkpointer(snapshots, snapshot_metadata or {})
        self.stop = StopRequest(self.ctx.rank, self.ctx.device, self.ctx.group, cfg.stop_timeout_s,
                                self.checkpoints.finish_quietly)
        self.progress = Progress("off", False, 0, 0)
        self._fit_start = time.perf_counter()
        self.stopped_early = False
        self.trained_steps = 0  # optimizer steps taken by this fit() (0: the snapshot was already at the end)
        self.total_steps = self._total_steps()
        parallel.prepare(self.split(val_data.windows(list(range(min(cfg.batch_size, len(val_data)))))))

    @property
    def amp_dtype(self) -> torch.dtype:
        return self.parallel.amp_dtype

    def _setup_data(self, train_data: Dataset, val_data: Dataset) -> None:
        cfg = self.cfg
        # Batches are split over the data-parallel ranks: tensor-parallel peers and pipeline stages share theirs.
        data_ranks, data_rank = self.parallel.data_ranks, self.parallel.data_rank
        self.n_train = len(train_data)
        self.sampler = ResumableDistributedSampler(len(train_data), data_ranks, data_rank, cfg.seed)
        self.train_loader = make_loader(train_data, self.sampler, cfg.batch_size, True, cfg, self.ctx.device)
        own_val_windows = range(data_rank, len(val_data), data_ranks)  # disjoint across replicas, no padding
        # Evaluation batches of EVAL_BATCH_FACTOR x batch_size windows (the unit of eval_batches and of the lockstep
        # passes), each through the model batch_size windows at a time: a large vocabulary's logits are most of a
        # window's memory, with gradients or without.
        self.eval_batch_size = cfg.batch_size * EVAL_BATCH_FACTOR
        self.val_loader = make_loader(val_data, own_val_windows, self.eval_batch_size, False, cfg, self.ctx.device)
        self._eval_lockstep = eval_lockstep(val_data, cfg, data_ranks) if self.parallel.lockstep_eval else None
        self.global_batch = cfg.batch_size * cfg.grad_accum_steps * data_ranks  # windows per optimizer step
        self.tokens_per_step = self.global_batch * train_data[0][0].numel()
        self.steps_per_epoch = self.n_train // self.global_batch
        if self.steps_per_epoch == 0:
            raise UsageError(f"an optimizer step needs batch_size x grad_accum_steps x data-parallel ranks = "
                             f"{cfg.batch_size} x {cfg.grad_accum_steps} x {data_ranks} windows, but the training "
                             f"split has only {self.n_train}")

    def _checkpointer(self, snapshots: Optional[SnapshotStore], metadata: dict) -> Checkpointer:
        """The snapshots of this trainer: the model and optimizers in the layout's form, the scaler, the progress
        and the loss window, with the layout they were trained under."""
        if metadata:
            metadata = {**metadata, "layout": self.parallel.name}
        states = {**self.parallel.snapshot_states(), "scaler": ScalerState(self.scaler, self.amp_dtype, self.ctx),
                  "progress": self, "loss_window": self.window}
        cadence = Cadence(self.cfg.save_every, self.cfg.save_every_steps, self.cfg.keep_last)
        return Checkpointer(snapshots, metadata, cadence, self.ctx, states, sharded=self.parallel.sharded_snapshots,
                            exit_wait_s=self.cfg.stop_timeout_s)

    def split(self, windows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, y) on the device from a (B, T+1) batch of windows: one copy (asynchronous when the loader pinned
        it), then two views. On the CPU no copy at all: the same views as the dataset's `__getitems__`."""
        windows = windows.to(self.ctx.device, non_blocking=True)
        return windows[:, :-1], windows[:, 1:]

    def _steps_left_in_epoch(self) -> int:
        return (self.n_train - self.epoch_samples) // self.global_batch

    def _total_steps(self) -> int:
        """Steps done + what is left of this epoch + the remaining epochs, capped by max_steps.

        Equals steps_per_epoch * max_epochs for a fresh run; stays right after a resume with another world size.
        """
        if self.epoch >= self.cfg.max_epochs:
            total = self.step
        else:
            remaining_epochs = self.cfg.max_epochs - self.epoch - 1
            total = self.step + self._steps_left_in_epoch() + remaining_epochs * self.steps_per_epoch
        return total if self.cfg.max_steps is None else min(total, self.cfg.max_steps)

    # ----------------------------------------------------------------------------------------------- training
    def fit(self) -> None:
        self._fit_start = time.perf_counter()
        self._restore()
        first_step = self.step
        self.progress = Progress(self.cfg.progress, self.ctx.is_main, self.total_steps, self.step)
        try:
            with self.stop.watch():  # SIGTERM: the snapshot of a stop is written while it still counts as one
                self._train_until_done()
        finally:
            self.progress.close()
        self.trained_steps = self.step - first_step
        if not self.stopped_early:
            if self._last_eval_step != self.step:
                self._evaluate()
            self._save("end of training")
        self.checkpoints.wait()  # the last snapshot must be complete before the process exits
        self._finish()
        self.metrics.close()

    def _train_until_done(self) -> None:
        while self.step < self.total_steps:
            self.train_step()
            if self._settles_now():
                self.settle()
            if self.nonfinite.diverged:
                self._diverged(f"{self.nonfinite.streak} steps in a row had a non-finite {self.nonfinite.what}")
                continue  # rolled back (or raised)
            self.progress.advance()
            if not self._after_step():
                continue  # rolled back
            if self.stop.agreed():
                self.settle()
                self.stopped_early = True
                log.warning("stop requested (SIGTERM) after step %d: saving a snapshot and exiting", self.step)
                self._save("stop requested")
                return

    def _restore(self) -> None:
        restored = self.checkpoints.restore()
        if restored is not None:
            self._log_resumed(restored)
            self.window.restart_clock(self.step)  # speed counts this process's steps from here
        else:
            self.window.reset(self.step)
            self.checkpoints.keep_starting_point(self.step)  # for a run that diverges before its first snapshot
        self._log_plan()

    def train_step(self) -> None:
        """One optimizer step on the next batches of the epoch (bench.py times exactly this)."""
        if self._batches is None:
            self._batches = self.epoch_batches()
        self.optimizers.schedule(self.step, self.lr_scale * self.lr_schedule(self.step, self.total_steps))
        seed_dropout(self.cfg.seed, self.step, self.ctx.rank, self.ctx.device)
        micro_batches = self.cfg.grad_accum_steps
        losses = []
        for micro_step in range(micro_batches):
            x, y = self.split(next(self._batches))
            losses.append(self.parallel.forward_backward(x, y, self.scaler, micro_batches,
                                                         last=micro_step == micro_batches - 1))
        self.parallel.finish_gradients()
        self.optimizers.unscale(self.scaler)  # clip the true gradients, not the scaled ones
        grad_norm = None
        if self.cfg.grad_norm_clip > 0 or self.nonfinite.enabled:
            grad_norm = self.parallel.clip_grad_norm(self.cfg.grad_norm_clip or None)
            self.window.grad_norm = grad_norm
        verdict = self.nonfinite.verdict([loss for loss in losses if loss is not None], grad_norm)
        if verdict is not None and self.nonfinite.on_device:  # skipped, if it is, without the host reading it
            skip = verdict.amax()
            for loss in losses:
                self.window.add(loss, skip)
            self.window.exclude(self.checkpoints.before_update())  # a snapshot still copying the weights finishes first
            self.optimizers.step(skip=skip)
            self.nonfinite.defer(self.step + 1, verdict, len(losses))
        elif verdict is None or self.nonfinite.read_now(self.step + 1, verdict):
            for loss in losses:
                self.window.add(loss)
            self.window.exclude(self.checkpoints.before_update())
            self.optimizers.step(self.scaler)  # skipped by the scaler when fp16 gradients overflowed
        # else every rank skips it: the weights and optimizer state stay as they were
        self.scaler.update()  # after unscale_ alone too: an fp16 overflow lowers the scale either way
        self.optimizers.zero_grad(set_to_none=True)
        self.step += 1
        self.epoch_samples += self.global_batch
        self._last_lr = self.optimizers.param_groups[0]["lr"]
        if not self.nonfinite.on_device:
            self.settle()  # read already: counted at once

    def settle(self) -> None:
        """The non-finite verdicts of the steps since the last call, read in one go (with every optimizer fused, the
        steps were skipped on the device without them): counted, skipped steps' losses taken out of the window,
        and a state whose last step was skipped held back from snapshots. Due before anything reads those (the log
        line, an evaluation, a snapshot, the end of the run)."""
        for _, losses_added in self.nonfinite.settle():
            self.window.skipped += 1
            self.window.count -= losses_added
        skipped = self.nonfinite.last_skipped
        self.checkpoints.held = (f"step {skipped} was skipped (non-finite {self.nonfinite.what})"
                                 if skipped is not None and skipped == self.step else None)

    def _settles_now(self) -> bool:
        """Whether the step just taken is read (`settle`) now: a log line, an evaluation or a snapshot may follow
        (`_after_step`), or the epoch ends."""
        return (self._logs_now() or self._evaluates_now() or self._steps_left_in_epoch() == 0
                or self.checkpoints.cadence.step_due(self.step))

    def _logs_now(self) -> bool:
        return self.step % self.cfg.log_every_steps == 0 or self.step == self.total_steps

    def _evaluates_now(self) -> bool:
        """The last step, and every eval_every_steps (an epoch's end is evaluated too: `_after_step`)."""
        every = self.cfg.eval_every_steps
        return self.step == self.total_steps or bool(every and self.step % every == 0)

    def epoch_batches(self) -> Iterator[torch.Tensor]:
        """The (B, T+1) window batches of the rest of the current epoch, as training consumes them."""
        self.sampler.set_epoch(self.epoch, self.epoch_samples, self.epoch_order)  # a resumed epoch: its next batch
        if self.cfg.data_loader_workers == 0 and self.ctx.device.type == "cpu":
            # Same batches as the DataLoader (it would call __getitems__ the same way), minus its per-batch
            # bookkeeping, which costs ~0.3 ms of a ~60 ms CPU step; on CUDA the loader pins each (B, T+1) batch.
            batch_sampler = BatchSampler(self.sampler, self.cfg.batch_size, drop_last=True)
            return (self.train_loader.dataset.__getitems__(indices) for indices in batch_sampler)
        return iter(self.train_loader)

    def _after_step(self) -> bool:
        """Collective. Logging, evaluation, the epoch's end and the snapshots due after a step. False: the run went
        non-finite there and rolled back (nothing more to do for this step)."""
        if self._logs_now():
            train_loss = self._log_train()
            if not math.isfinite(train_loss):  # only without skip_nonfinite_steps: skipped losses are not in it
                return self._diverged(f"the mean training loss is {train_loss}")
        if self._evaluates_now():
            if not self._evaluated_finite():  # the last step is evaluated before any snapshot of it is written
                return False
        finished_epoch = None
        if self._steps_left_in_epoch() == 0:  # a complete epoch ends with an evaluation
            if self._last_eval_step != self.step and not self._evaluated_finite():
                return False
            finished_epoch, self.epoch, self.epoch_samples, self._batches = self.epoch, self.epoch + 1, 0, None
            self.epoch_order = EPOCH_ORDER  # an older snapshot's epoch has ended
        self.window.exclude(self.checkpoints.save_if_due(self.step, finished_epoch))
        return True

    def _evaluated_finite(self) -> bool:
        """Collective. An evaluation (and, under keep_best, the snapshot of a new best); False: its loss was not
        finite and the run rolled back."""
        val_loss = self._evaluate()
        if not math.isfinite(val_loss):
            return self._diverged(f"the validation loss is {val_loss}")
        if self.cfg.keep_best and self.checkpoints.held is None and (self.best_val_loss is None
                                                                     or val_loss < self.best_val_loss):
            self.best_val_loss = val_loss
            self.window.exclude(self.checkpoints.save(self.step, "best validation loss", best_val_loss=val_loss))
        return True

    # ----------------------------------------------------------------------------------------------- divergence
    def _diverged(self, why: str) -> bool:
        """Collective (every rank finds it at the same step). Roll back (returns False) or stop with one line."""
        if self.step > self.window.start_step:
            self._log_train()  # the steps since the last line, skipped ones counted
        newest = self.checkpoints.newest_complete() or self.checkpoints.write_starting_point()
        if self.cfg.on_divergence == "rollback" and self.rollbacks < self.cfg.max_rollbacks and newest is not None:
            return self._roll_back(why, newest)
        kept = (f"the newest good snapshot is {newest}" if newest else
                "no snapshot was written before it (a relaunch starts afresh)")
        lr = self.optimizers.peak_lrs[0] * self.lr_scale if self.optimizers.peak_lrs else 0.0
        advice = [f"lower optimizer_config.learning_rate (peak {lr:.3g} now)"]
        if self.cfg.grad_norm_clip == 0:
            advice.append("set trainer_config.grad_norm_clip (0 now)")
        if self.cfg.on_divergence == "stop":
            advice.append("set trainer_config.on_divergence=rollback")
        rolled = f" after {self.rollbacks} rollback(s)" if self.rollbacks else ""
        raise Diverged(f"training diverged at step {self.step}{rolled}: {why}; {kept}; {', or '.join(advice)}")

    def _roll_back(self, why: str, newest: str) -> bool:
        """Collective. Back to the newest good snapshot (every rank loads it), every learning rate lowered."""
        diverged_at, lr_scale, rollbacks = self.step, self.lr_scale * self.cfg.rollback_lr_factor, self.rollbacks + 1
        self.checkpoints.restore()
        self.lr_scale, self.rollbacks = lr_scale, rollbacks
        self.nonfinite.streak, self.nonfinite.last_skipped, self.checkpoints.held, self._batches = 0, None, None, None
        self.window.restart_clock(self.step)
        self.progress.rewind(self.step)
        log.warning("training diverged at step %d: %s; rolled back to %s (step %d), every learning rate x%g from here "
                    "(rollback %d of %d)", diverged_at, why, newest, self.step, self.lr_scale, self.rollbacks,
                    self.cfg.max_rollbacks)
        return False

    # ----------------------------------------------------------------------------------------------- progress state
    def state_dict(self) -> dict:
        """The trainer's own part of a snapshot: where training is."""
        return {"step": self.step, "epoch": self.epoch, "epoch_samples": self.epoch_samples,
                "epoch_order": self.epoch_order, "val_loss": self.last_val_loss, "val_bpb": self.last_val_bpb,
                "last_eval_step": self._last_eval_step,
                "best_val_loss": self.best_val_loss, "skipped_steps": self.nonfinite.total, "lr_scale": self.lr_scale,
                "rollbacks": self.rollbacks}

    def load_state_dict(self, progress: dict) -> None:
        self.step, self.epoch, self.epoch_samples = progress["step"], progress["epoch"], progress["epoch_samples"]
        self.last_val_loss, self._last_eval_step = progress["val_loss"], progress["last_eval_step"]
        self.best_val_loss = progress.get("best_val_loss")  # older snapshots: none yet
        self.last_val_bpb = progress.get("val_bpb")  # older snapshots: none
        self.nonfinite.total = progress.get("skipped_steps", 0)
        self.lr_scale, self.rollbacks = progress.get("lr_scale", 1.0), progress.get("rollbacks", 0)
        self.epoch_order = resumed_order(progress.get("epoch_order", LEGACY_ORDER), self.epoch_samples, self.ctx)
        self.total_steps = self._total_steps()

    def _save(self, reason: str) -> None:
        self.window.exclude(self.checkpoints.save(self.step, reason))

    # ----------------------------------------------------------------------------------------------- evaluation
    @torch.no_grad()
    def validation_loss(self) -> float:
        """Collective. Mean per-token loss over the validation windows of all ranks (at most eval_batches batches per
        rank); the same in bits per UTF-8 byte of those windows' targets in `last_val_bpb` (nanochat's val_bpb: the
        nats summed over the targets / (ln 2 x their bytes)). Where a forward pass is a collective among ranks that
        read different windows (FSDP's shards), every rank makes as many passes as the rank with the most windows:
        one whose own windows ran out runs a filler batch, uncounted."""
        self.parallel.train(False)
        totals = torch.zeros(3, dtype=torch.float64, device=self.ctx.device)  # loss sum, tokens, their text's bytes
        done = 0
        for i, windows in enumerate(self.val_loader):
            if self.cfg.eval_batches is not None and i >= self.cfg.eval_batches:
                break
            x, y = self.split(windows)
            tokens = y.numel()
            loss = self.parallel.evaluate(*self.eval_shaped(x, y), max_rows=self.cfg.batch_size)
            if loss is not None:  # under pipeline parallelism: on the last stage's ranks only
                totals[0] += loss.double() * tokens
                totals[1] += tokens
                if self._target_bytes is not None:
                    totals[2] += self._target_bytes[y].sum()  # on the device: no read here
            done += 1
        if self._eval_lockstep is not None:
            passes, filler = self._eval_lockstep
            for _ in range(done, passes):
                self.parallel.evaluate(*self.eval_shaped(*self.split(filler)), max_rows=self.cfg.batch_size)
        self.parallel.train(True)
        loss_sum, count, text_bytes = self.ctx.all_reduce(totals).tolist()  # one read
        self.last_val_bpb = loss_sum / (math.log(2) * text_bytes) if text_bytes else None
        return loss_sum / count

    def eval_shaped(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A validation batch padded to the evaluation batch size, its padding's targets ignored by the loss (-100,
        cross_entropy's ignore_index): one shape for every evaluation pass, so a compiled model compiles its
        evaluation once, not again for the last, smaller batch (nor for lockstep fillers). Contiguous, as the padded
        ones are: compiled code is specialised on strides too."""
        missing = self.eval_batch_size - x.size(0)
        if missing <= 0:
            return x.contiguous(), y.contiguous()
        x = torch.cat([x, x.new_zeros((missing, x.size(1)))])
        return x, torch.cat([y, y.new_full((missing, y.size(1)), IGNORED_TARGET)])

    def _evaluate(self) -> float:
        """Collective. The validation loss, recorded, logged and written as a metrics row."""
        start = time.perf_counter()
        self.last_val_loss = self.validation_loss()
        self._last_eval_step = self.step
        bpb = None if self.last_val_bpb is None else round(self.last_val_bpb, 6)
        self.metrics.write({"step": self.step, "epoch": self.epoch, "val_loss": round(self.last_val_loss, 6),
                            **({} if bpb is None else {"val_bpb": bpb}),
                            "elapsed_s": round(time.perf_counter() - self._fit_start, 2)})
        log.info("step %d | epoch %d | val loss %.4f%s (%.1f s)", self.step, self.epoch, self.last_val_loss,
                 "" if bpb is None else f" | val bpb {bpb:.4f}", time.perf_counter() - start)
        self.window.exclude(time.perf_counter() - start)  # evaluation time does not count against tokens/s
        return self.last_val_loss

    # ----------------------------------------------------------------------------------------------- reporting
    def _log_plan(self) -> None:
        """The line that says what this fit() is about to do."""
        if self.step >= self.total_steps:
            log.info("nothing to train: the snapshot in %s is at step %d, the end of this run (max_steps=%s, "
                     "max_epochs=%d). To continue it, raise trainer_config.max_steps or trainer_config.max_epochs; to "
                     "start afresh, use another trainer_config.snapshot_path", self.checkpoints.location, self.step,
                     self.cfg.max_steps, self.cfg.max_epochs)
            return
        log.info("training: steps %d -> %d (%d per epoch, %d epochs max), %d process(es) on %s, %s, %s, %s tokens "
                 "per step", self.step, self.total_steps, self.steps_per_epoch, self.cfg.max_epochs,
                 self.ctx.world_size, self.ctx.device.type, self.parallel.name,
                 str(self.amp_dtype).removeprefix("torch."), f"{self.tokens_per_step:,}")

    def _log_resumed(self, restored: Restored) -> None:
        log.info("resumed from %s: step %d, epoch %d, sample %d of the epoch", restored.url, self.step, self.epoch,
                 self.epoch_samples)
        if not self.ctx.is_main:  # one line for the job
            return
        if restored.world_size != self.ctx.world_size:
            log.warning("snapshot was written by %d process(es), resuming with %d: continuing at global sample %d of "
                        "epoch %d", restored.world_size, self.ctx.world_size, self.epoch_samples, self.epoch)
        if restored.layout != self.parallel.name:
            log.info("snapshot was trained under %s: its weights and optimizer state continue under %s",
                     restored.layout, self.parallel.name)
        attention = self.checkpoints.metadata.get("model_config", {}).get("attention")
        # the same function either way, but other rounding
        if attention is not None and restored.attention not in (None, "auto", attention):
            log.warning("snapshot was trained with %s attention, this run uses %s (gpt_config.attention): training "
                        "continues, but not bit-for-bit as the snapshot's run would have", restored.attention,
                        attention)

    def _log_train(self) -> float:
        """Collective (the mean loss). The training line and its metrics row, for the steps since the last one;
        returns the mean loss (0.0 when every step of the window was skipped: the streak counts those)."""
        skipped = self.window.skipped
        all_skipped = skipped > 0 and skipped == self.step - self.window.start_step
        train_loss = self.window.mean_loss()
        if all_skipped:
            train_loss = math.nan
        elapsed = time.perf_counter() - self.window.timed_from
        steps = self.step - self.window.timed_step
        tokens_per_s = steps * self.tokens_per_step / elapsed if elapsed > 0 else 0.0
        row = {"step": self.step, "epoch": self.epoch, "train_loss": round(train_loss, 6), "lr": self._last_lr,
               "tokens_per_s": round(tokens_per_s, 1), "ms_per_step": round(1000 * elapsed / max(1, steps), 2),
               "elapsed_s": round(time.perf_counter() - self._fit_start, 2)}  # since this process started fit()
        if self.window.grad_norm is not None:
            row["grad_norm"] = round(self.window.grad_norm.item(), 6)
        if self.scaler.is_enabled():
            row["loss_scale"] = self.scaler.get_scale()
        if skipped:
            row["skipped_steps"] = skipped
        if all_skipped:
            del row["train_loss"]  # no step of the window counted
        self.metrics.write(row)
        loss = "skipped" if all_skipped else f"{train_loss:.4f}"
        line = (f"step {self.step}/{self.total_steps} | epoch {self.epoch} | loss {loss} | "
                f"lr {self._last_lr:.2e} | {tokens_per_s:,.0f} tok/s | {row['ms_per_step']:.1f} ms/step")
        if skipped:
            line += f" | {skipped} skipped (non-finite)"
        self.progress.report(line, train_loss, tokens_per_s, self._last_lr)
        self.window.reset(self.step)
        return 0.0 if all_skipped else train_loss  # a window of skipped steps is the streak's business

    # ----------------------------------------------------------------------------------------------- the end
    def full_model_copy(self, build: Callable[[], Any]) -> Optional[Any]:
        """Collective under sharded layouts. The whole model, unsharded, on global rank 0 (None elsewhere)."""
        return self.parallel.full_model_copy(build)

    def _finish(self) -> None:
        """Collective. Every rank's weights compared, the last line, and the summary."""
        digest = weights_sha256_of(self.parallel.whole_tensors())  # canonical, whole
        report_end(self.metrics, digest, self.ctx.gather_objects(digest), steps=self.step, epochs_completed=self.epoch,
                   finished=not self.stopped_early, val_loss=self.last_val_loss,
                   val_bpb=None if self.last_val_bpb is None else round(self.last_val_bpb, 6),
                   best_val_loss=self.best_val_loss,
                   skipped_steps=self.nonfinite.total, rollbacks=self.rollbacks,
                   wall_time_s=round(time.perf_counter() - self._fit_start, 2), world_size=self.ctx.world_size)
