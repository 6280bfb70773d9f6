"""Distributed, mixed-precision training epochs with periodic evaluation and metrics.

The trainer receives a built model, optimizer and datasets plus a `DistContext` (set up by main.py) and runs:

    for each epoch:  sampler.set_epoch(epoch)
        for each optimizer step:  grad_accum_steps micro-batches (gradients all-reduced on the last one only),
                                  unscale (fp16) -> clip -> optimizer step -> LR for the next step
            every log_every_steps: one line + one metrics.jsonl row (rank 0)
            every eval_every_steps and at each epoch end: validation loss over all ranks

Nothing here is specific to GPT beyond `model(x, y) -> (logits, loss)`. Nothing here knows Hydra.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Optional

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import BatchSampler, DataLoader, Dataset, DistributedSampler

from errors import UsageError

log = logging.getLogger(__name__)

PRECISIONS = ("auto", "bf16", "fp16", "fp32")


@dataclass
class TrainerConfig:
    """How long and how to train; per-process batch size; evaluation, logging and snapshot cadence."""

    max_epochs: int = 2  # passes over the training windows
    max_steps: Optional[int] = None  # optional cap on optimizer steps (across epochs); null = no cap
    batch_size: int = 64  # windows per micro-batch, per process
    grad_accum_steps: int = 1  # micro-batches per optimizer step (gradients are all-reduced on the last only)
    grad_norm_clip: float = 1.0  # clip the global gradient norm to this; 0 = no clipping
    mixed_precision: str = "auto"  # auto | bf16 | fp16 | fp32; auto = bf16 on GPUs with bf16, fp16 on older, fp32 on CPU
    compile: bool = False  # torch.compile the model (slow first step; pays off on GPUs)
    seed: int = 1337  # seeds the weights, the data order and the dropout masks
    eval_every_steps: int = 500  # evaluate on the validation split every this many steps; 0 = at epoch ends only
    eval_batches: Optional[int] = None  # cap on validation batches per process per evaluation; null = all of them
    log_every_steps: int = 50  # print a line and append a metrics.jsonl row every this many steps
    data_loader_workers: int = 0  # DataLoader worker processes (batches are one tensor gather, 0 is usually best)
    snapshot_path: str = "snapshots"  # where snapshots go: a local folder (relative = to the project) or fsspec URL
    save_every: int = 1  # write a snapshot every this many epochs

    def __post_init__(self) -> None:
        positive = ("max_epochs", "batch_size", "grad_accum_steps", "log_every_steps", "save_every")
        for name in positive:
            if getattr(self, name) <= 0:
                raise UsageError(f"trainer_config.{name} must be positive, got {getattr(self, name)}")
        non_negative = ("grad_norm_clip", "eval_every_steps", "data_loader_workers")
        for name in non_negative:
            if getattr(self, name) < 0:
                raise UsageError(f"trainer_config.{name} must be >= 0, got {getattr(self, name)}")
        for name in ("max_steps", "eval_batches"):
            if getattr(self, name) is not None and getattr(self, name) <= 0:
                raise UsageError(f"trainer_config.{name} must be positive or null, got {getattr(self, name)}")
        if self.mixed_precision not in PRECISIONS:
            raise UsageError(
                f"trainer_config.mixed_precision must be one of {', '.join(PRECISIONS)}, got {self.mixed_precision!r}"
            )


@dataclass
class DistContext:
    """Who this process is in the job. world_size 1 without a process group means a plain `python main.py`."""

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    device: torch.device = torch.device("cpu")

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return dist.is_available() and dist.is_initialized()


def resolve_precision(name: str, device: torch.device) -> torch.dtype:
    """The autocast dtype for a `mixed_precision` setting on this device (float32 means no autocast)."""
    if name == "auto":
        if device.type != "cuda":
            return torch.float32
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    if name == "bf16" and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        raise UsageError(f"mixed_precision=bf16 is not supported on {torch.cuda.get_device_name(device)}; use fp16")
    return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[name]


class ResumableDistributedSampler(DistributedSampler):
    """`DistributedSampler` that can start an epoch at a global sample position.

    The epoch's permutation depends only on (seed, epoch), never on the world size; rank r takes every
    world_size-th index of what is left, so the first k*world_size indices of the permutation are exactly the
    samples consumed after k per-rank samples. Starting at position p skips p global samples without iterating
    over them, and stays valid when the job resumes with a different number of processes.
    """

    def __init__(self, dataset: Dataset, num_replicas: int, rank: int, seed: int) -> None:
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=True, seed=seed, drop_last=False)
        self.start = 0

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        super().set_epoch(epoch)
        self.start = start

    def _remaining(self) -> int:
        return max(0, len(self.dataset) - self.start)

    def __len__(self) -> int:
        return math.ceil(self._remaining() / self.num_replicas)

    def __iter__(self) -> Iterator[int]:
        generator = torch.Generator()
        generator.manual_seed(self.seed + self.epoch)
        order = torch.randperm(len(self.dataset), generator=generator)[self.start :]
        padding = len(self) * self.num_replicas - order.numel()
        if padding:  # like DistributedSampler: repeat from the front so every rank gets the same count
            order = torch.cat([order, order[:padding]])
        return iter(order[self.rank :: self.num_replicas].tolist())


def _batch_as_is(batch: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Collate function for datasets whose `__getitems__` already returns stacked tensors."""
    return batch


def weights_sha256(model: nn.Module) -> str:
    """SHA-256 over the model's tensors in sorted key order, bytes as stored (a fingerprint of the weights)."""
    digest = hashlib.sha256()
    state = model.state_dict()
    for key in sorted(state):
        tensor = state[key].detach().cpu().contiguous()
        digest.update(key.encode())
        digest.update(tensor.view(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


class MetricsLog:
    """Appends JSON rows to `metrics.jsonl` in the run directory; a no-op on ranks other than 0."""

    def __init__(self, run_dir: Optional[Path], enabled: bool) -> None:
        self.path = run_dir / "metrics.jsonl" if (run_dir is not None and enabled) else None
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)

    def write(self, row: dict) -> None:
        if self.path is None:
            return
        with self.path.open("a", encoding="utf-8") as f:
            f.write(json.dumps(row) + "\n")


class Trainer:
    def __init__(
        self,
        cfg: TrainerConfig,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        lr_schedule: Callable[[int, int], float],
        train_data: Dataset,
        val_data: Dataset,
        ctx: DistContext,
        run_dir: Optional[Path] = None,
    ) -> None:
        self.cfg = cfg
        self.ctx = ctx
        self.raw_model = model  # unwrapped: what snapshots and the replica check read
        self.optimizer = optimizer
        self.lr_schedule = lr_schedule
        self.amp_dtype = resolve_precision(cfg.mixed_precision, ctx.device)
        # GradScaler only for fp16: bf16 has fp32's exponent range and needs no loss scaling.
        self.scaler = torch.amp.GradScaler(ctx.device.type, enabled=self.amp_dtype == torch.float16)
        self.eval_model, self.ddp, self.model = self._wrap_model(model)
        self.sampler = ResumableDistributedSampler(train_data, ctx.world_size, ctx.rank, cfg.seed)
        self.train_loader = self._loader(train_data, self.sampler, drop_last=True)
        own_val_windows = range(ctx.rank, len(val_data), ctx.world_size)  # disjoint across ranks, no padding
        self.val_loader = self._loader(val_data, own_val_windows, drop_last=False)
        self.tokens_per_step = cfg.batch_size * cfg.grad_accum_steps * ctx.world_size * self._block_size(train_data)
        self.steps_per_epoch = len(self.sampler) // cfg.batch_size // cfg.grad_accum_steps
        if self.steps_per_epoch == 0:
            raise UsageError(
                f"an optimizer step needs batch_size x grad_accum_steps x processes = "
                f"{cfg.batch_size} x {cfg.grad_accum_steps} x {ctx.world_size} windows, "
                f"but the training split has only {len(train_data)}"
            )
        self.total_steps = self.steps_per_epoch * cfg.max_epochs
        if cfg.max_steps is not None:
            self.total_steps = min(self.total_steps, cfg.max_steps)
        self.metrics = MetricsLog(run_dir, enabled=ctx.is_main)
        self.step = 0  # optimizer steps done
        self.epoch = 0
        self.last_val_loss: Optional[float] = None
        self._last_eval_step = -1
        self._reset_window()

    # ----------------------------------------------------------------------------------------------- setup
    def _wrap_model(self, model: nn.Module) -> tuple[nn.Module, Optional[DDP], nn.Module]:
        """(model for evaluation, DDP wrapper or None, model for training)."""
        compiled = torch.compile(model) if self.cfg.compile else model
        if not self.ctx.distributed:
            return compiled, None, compiled
        device_ids = [self.ctx.device.index] if self.ctx.device.type == "cuda" else None
        # forward_sync_buffers=False: the model has no buffers, so skip a buffer broadcast per forward pass.
        # gradient_as_bucket_view=True: gradients live inside the all-reduce buckets (no copy, less memory).
        ddp = DDP(compiled, device_ids=device_ids, forward_sync_buffers=False, gradient_as_bucket_view=True)
        return compiled, ddp, ddp

    def _loader(self, dataset: Dataset, sampler, drop_last: bool) -> DataLoader:
        # The loader gets its own generator: iter(DataLoader) draws a base seed from it, and would otherwise draw
        # from the global RNG and shift the dropout stream.
        return DataLoader(
            dataset,
            batch_sampler=BatchSampler(sampler, self.cfg.batch_size, drop_last=drop_last),
            collate_fn=_batch_as_is,
            num_workers=self.cfg.data_loader_workers,
            pin_memory=self.ctx.device.type == "cuda",
            generator=torch.Generator().manual_seed(self.cfg.seed),
            persistent_workers=self.cfg.data_loader_workers > 0,
        )

    @staticmethod
    def _block_size(dataset: Dataset) -> int:
        x, _ = dataset[0]
        return x.numel()

    def _autocast(self) -> contextlib.AbstractContextManager:
        return torch.autocast(self.ctx.device.type, dtype=self.amp_dtype, enabled=self.amp_dtype != torch.float32)

    # ----------------------------------------------------------------------------------------------- training
    def fit(self) -> None:
        log.info(
            "training: %d steps (%d per epoch, %d epochs max), %d process(es) on %s, %s, %s tokens per step",
            self.total_steps, self.steps_per_epoch, self.cfg.max_epochs, self.ctx.world_size,
            self.ctx.device.type, str(self.amp_dtype).removeprefix("torch."), f"{self.tokens_per_step:,}",
        )  # fmt: skip
        self._fit_start = time.perf_counter()
        while self.step < self.total_steps:
            if self._run_epoch():
                self.epoch += 1
        if self._last_eval_step != self.step:
            self._evaluate()
        self._finish()

    def _run_epoch(self) -> bool:
        """Train until the epoch ends or the run's last step; True when the epoch was completed."""
        self.sampler.set_epoch(self.epoch)
        batches = iter(self.train_loader)
        steps_this_epoch = min(self.steps_per_epoch, self.total_steps - self.step)
        for _ in range(steps_this_epoch):
            self._train_step(batches)
            if self.step % self.cfg.log_every_steps == 0 or self.step == self.total_steps:
                self._log_train()
            if self.cfg.eval_every_steps and self.step % self.cfg.eval_every_steps == 0:
                self._evaluate()
        completed = steps_this_epoch == self.steps_per_epoch
        if completed and self._last_eval_step != self.step:
            self._evaluate()  # a complete epoch ends with an evaluation
        return completed

    def _train_step(self, batches: Iterator[tuple[torch.Tensor, torch.Tensor]]) -> None:
        lr = self.lr_schedule(self.step, self.total_steps)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self._seed_dropout()
        for micro_step in range(self.cfg.grad_accum_steps):
            x, y = (t.to(self.ctx.device, non_blocking=True) for t in next(batches))
            last = micro_step == self.cfg.grad_accum_steps - 1
            # Only the last micro-batch all-reduces; the others accumulate gradients locally.
            with self.ddp.no_sync() if (self.ddp is not None and not last) else contextlib.nullcontext():
                with self._autocast():
                    _, loss = self.model(x, y)
                self.scaler.scale(loss / self.cfg.grad_accum_steps).backward()
            self._loss_sum += loss.detach()
        self._loss_count += self.cfg.grad_accum_steps
        self.scaler.unscale_(self.optimizer)  # clip the true gradients, not the scaled ones
        if self.cfg.grad_norm_clip > 0:
            self._grad_norm = nn.utils.clip_grad_norm_(self.raw_model.parameters(), self.cfg.grad_norm_clip)
        self.scaler.step(self.optimizer)  # skipped by the scaler when fp16 gradients overflowed
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        self._last_lr = lr

    def _seed_dropout(self) -> None:
        """Dropout masks are a pure function of (seed, step, rank).

        Every rank gets different masks (a shared seed would give all ranks the same masks), and a resumed job
        draws exactly the masks the uninterrupted one would have, without saving RNG state.
        """
        key = f"{self.cfg.seed}:{self.step}:{self.ctx.rank}".encode()
        seed = int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") >> 1
        torch.default_generator.manual_seed(seed)
        if self.ctx.device.type == "cuda":
            torch.cuda.default_generators[self.ctx.device.index].manual_seed(seed)

    # ----------------------------------------------------------------------------------------------- reporting
    def _reset_window(self) -> None:
        """Start a new logging window: losses are summed on the device and read once per log line."""
        self._loss_sum = torch.zeros((), device=self.ctx.device)
        self._loss_count = 0
        self._window_start = time.perf_counter()
        self._window_step = self.step
        self._grad_norm: Optional[torch.Tensor] = None

    def _all_ranks_mean(self, value: torch.Tensor) -> float:
        if self.ctx.distributed:
            value = value.clone()
            dist.all_reduce(value)
            value /= self.ctx.world_size
        return value.item()

    def _log_train(self) -> None:
        train_loss = self._all_ranks_mean(self._loss_sum / max(1, self._loss_count))
        elapsed = time.perf_counter() - self._window_start
        steps = self.step - self._window_step
        tokens_per_s = steps * self.tokens_per_step / elapsed if elapsed > 0 else 0.0
        row = {
            "step": self.step,
            "epoch": self.epoch,
            "train_loss": round(train_loss, 6),
            "lr": self._last_lr,
            "tokens_per_s": round(tokens_per_s, 1),
            "ms_per_step": round(1000 * elapsed / max(1, steps), 2),
        }
        if self._grad_norm is not None:
            row["grad_norm"] = round(self._grad_norm.item(), 6)
        if self.scaler.is_enabled():
            row["loss_scale"] = self.scaler.get_scale()
        self.metrics.write(row)
        log.info(
            "step %d/%d | epoch %d | loss %.4f | lr %.2e | %s tok/s | %.1f ms/step",
            self.step, self.total_steps, self.epoch, train_loss, self._last_lr, f"{tokens_per_s:,.0f}",
            row["ms_per_step"],
        )  # fmt: skip
        self._reset_window()

    @torch.no_grad()
    def _evaluate(self) -> float:
        """Mean per-character validation loss over all validation windows of all ranks."""
        start = time.perf_counter()
        self.eval_model.eval()
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.ctx.device)
        count = torch.zeros((), dtype=torch.float64, device=self.ctx.device)
        for i, (x, y) in enumerate(self.val_loader):
            if self.cfg.eval_batches is not None and i >= self.cfg.eval_batches:
                break
            x, y = x.to(self.ctx.device, non_blocking=True), y.to(self.ctx.device, non_blocking=True)
            with self._autocast():
                _, loss = self.eval_model(x, y)
            loss_sum += loss.double() * y.numel()
            count += y.numel()
        if self.ctx.distributed:
            totals = torch.stack([loss_sum, count])
            dist.all_reduce(totals)
            loss_sum, count = totals[0], totals[1]
        self.eval_model.train()
        val_loss = (loss_sum / count).item()
        self.last_val_loss = val_loss
        self._last_eval_step = self.step
        self.metrics.write({"step": self.step, "epoch": self.epoch, "val_loss": round(val_loss, 6)})
        log.info("step %d | epoch %d | val loss %.4f (%.1f s)", self.step, self.epoch, val_loss,
                 time.perf_counter() - start)  # fmt: skip
        self._window_start += time.perf_counter() - start  # evaluation time does not count against tokens/s
        return val_loss

    def _finish(self) -> None:
        """Check that every rank ended with the same weights, and write the run's summary (rank 0)."""
        digest = weights_sha256(self.raw_model)
        digests = [digest]
        if self.ctx.distributed:
            digests = [None] * self.ctx.world_size
            dist.all_gather_object(digests, digest)
        identical = len(set(digests)) == 1
        wall = time.perf_counter() - self._fit_start
        if identical:
            log.info("done: %d steps in %.1f s; weights identical on all %d rank(s), sha256 %s",
                     self.step, wall, len(digests), digest[:16])  # fmt: skip
        else:
            log.error("replicas diverged: weight digests differ between ranks: %s", digests)
        if self.ctx.is_main and self.metrics.path is not None:
            summary = {
                "steps": self.step,
                "epochs_completed": self.step // self.steps_per_epoch,
                "val_loss": self.last_val_loss,
                "weights_sha256": digest,
                "rank_weights_sha256": digests,
                "replicas_identical": identical,
                "wall_time_s": round(wall, 2),
                "world_size": self.ctx.world_size,
            }
            (self.metrics.path.parent / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
