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
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import BatchSampler, DataLoader, Dataset, DistributedSampler

import snapshot as snapshot_lib
from char_dataset import check_location
from errors import UsageError
from reporting import PROGRESS_MODES, MetricsLog, Progress
from shm_allreduce import FLOAT_BYTES, SharedMemoryAllReduce, shared_memory_allreduce_hook
from snapshot import SnapshotStore
from stopping import StopDeadline, StopVote

log = logging.getLogger(__name__)

PRECISIONS = ("auto", "bf16", "fp16", "fp32")
EVAL_BATCH_FACTOR = 4


@dataclass
class TrainerConfig:
    """How long and how to train; per-process batch size; evaluation, logging and snapshot cadence."""

    max_epochs: int = 2
    """passes over the training windows"""
    max_steps: Optional[int] = None
    """optional cap on optimizer steps; null = no cap"""
    batch_size: int = 64
    """windows per micro-batch, per process"""
    grad_accum_steps: int = 1
    """micro-batches per optimizer step (gradients all-reduced on the last one only)"""
    grad_norm_clip: float = 1.0
    """clip the global gradient norm; 0 = off"""
    mixed_precision: str = "auto"
    """auto | bf16 | fp16 | fp32 (auto: bf16 on recent GPUs, fp16 on older ones, fp32 on CPU)"""
    compile: bool = False
    """torch.compile the model

    The first step compiles (~40 s on a CPU); then ~10% faster there."""
    shared_memory_allreduce: bool = True
    """CPU ranks on one host average gradients through /dev/shm, not gloo's TCP

    Falls back to gloo when the ranks span hosts or /dev/shm lacks room; false = always gloo. No effect on GPUs
    (NCCL)."""
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
    stop_timeout_s: float = 15.0
    """after SIGTERM, a rank that cannot agree with its peers to stop within this exits

    Seconds. Such a rank has lost a peer or is blocked in a collective; it exits without a new snapshot and the
    last one stays. Below torchrun's 30 s."""
    snapshot_storage_options: Any = None
    """extra fsspec options, e.g. {client_kwargs:{endpoint_url:...}}; secrets: use the env"""

    def __post_init__(self) -> None:
        positive = ("max_epochs", "batch_size", "grad_accum_steps", "log_every_steps", "save_every", "keep_last",
                    "stop_timeout_s")  # fmt: skip
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
            raise UsageError(f"trainer_config.progress must be one of {', '.join(PROGRESS_MODES)}, got {self.progress!r}")
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
    # including_emulation=False: pre-Ampere GPUs (V100, T4) can create bf16 tensors, so the default check says
    # yes, but they have no bf16 tensor cores and run it emulated, many times slower than fp16.
    if name == "auto":
        if device.type != "cuda":
            return torch.float32
        return torch.bfloat16 if torch.cuda.is_bf16_supported(including_emulation=False) else torch.float16
    if name == "bf16" and device.type == "cuda" and not torch.cuda.is_bf16_supported(including_emulation=False):
        raise UsageError(f"mixed_precision=bf16 is not supported on {torch.cuda.get_device_name(device)} "
                         f"(no bf16 tensor cores, only slow emulation); use fp16 or auto")  # fmt: skip
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


class Trainer:
    """Runs the epochs. Snapshots go through `snapshots` (a `SnapshotStore`, or None for none); the trainer only
    decides when to save and what its own state is."""

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
        snapshots: Optional[SnapshotStore] = None,
        snapshot_metadata: Optional[dict] = None,
    ) -> None:
        self.cfg = cfg
        self.ctx = ctx
        self.raw_model = model  # unwrapped: what snapshots and the replica check read
        self.optimizer = optimizer
        self.lr_schedule = lr_schedule
        self.snapshots = snapshots
        self.snapshot_metadata = snapshot_metadata or {}
        self.amp_dtype = resolve_precision(cfg.mixed_precision, ctx.device)
        # GradScaler only for fp16: bf16 has fp32's exponent range and needs no loss scaling.
        self.scaler = torch.amp.GradScaler(ctx.device.type, enabled=self.amp_dtype == torch.float16)
        self.eval_model, self.ddp, self.model = self._wrap_model(model)
        self._setup_data(train_data, val_data)
        self.metrics = MetricsLog(run_dir, enabled=ctx.is_main)
        # Progress: everything the position in training depends on, saved in snapshots.
        self.step = 0  # optimizer steps done
        self.epoch = 0  # current epoch (= completed epochs)
        self.epoch_samples = 0  # global samples consumed in the current epoch (world-size independent)
        self.last_val_loss: Optional[float] = None
        self._last_eval_step = -1
        self._last_saved_step = -1
        self._batches: Optional[Iterator] = None
        self._stop_signal: Optional[int] = None
        self._writer: Optional[snapshot_lib.BackgroundWriter] = None
        self.progress = Progress("off", False, 0, 0)
        self._fit_start = time.perf_counter()
        self.snapshot_blocked_s: list[float] = []  # training-thread time per snapshot, for reports and bench.py
        self.stopped_early = False
        self.trained_steps = 0  # optimizer steps taken by this fit() (0: the snapshot was already at the end)
        self._stop_vote = StopVote(ctx.device) if ctx.distributed else None
        self.total_steps = self._total_steps()
        self._reset_window()
        if self.ddp is not None:
            self._prime_ddp_buckets(val_data)

    # ----------------------------------------------------------------------------------------------- setup
    def _wrap_model(self, model: nn.Module) -> tuple[nn.Module, Optional[DDP], nn.Module]:
        """(model for evaluation, DDP wrapper or None, model for training)."""
        compiled = self._compile(model) if self.cfg.compile else model
        if not self.ctx.distributed:
            return compiled, None, compiled
        device_ids = [self.ctx.device.index] if self.ctx.device.type == "cuda" else None
        shm_reducer = self._shared_memory_reducer(model)
        bucket_options = {}
        if shm_reducer is not None:  # one bucket: one barrier per step (with a core per process nothing overlaps)
            bucket_options["bucket_cap_mb"] = shm_reducer.num_elements * FLOAT_BYTES / 2**20 + 1
        # forward_sync_buffers=False: no buffer needs syncing (the attention mask buffer is a constant), so skip a
        # broadcast per forward pass. gradient_as_bucket_view=True: gradients live inside the all-reduce buckets
        # (no copy, less memory).
        ddp = DDP(compiled, device_ids=device_ids, forward_sync_buffers=False, gradient_as_bucket_view=True,
                  **bucket_options)  # fmt: skip
        if shm_reducer is not None:
            ddp.register_comm_hook(shm_reducer, shared_memory_allreduce_hook)
        return compiled, ddp, ddp

    def _shared_memory_reducer(self, model: nn.Module) -> Optional[SharedMemoryAllReduce]:
        """Collective. The /dev/shm gradient all-reduce where it applies: CPU ranks that all share one host
        (about half the time of gloo's TCP all-reduce on one host: README, Benchmarks)."""
        if self.ctx.device.type != "cpu":
            return None
        params = [p for p in model.parameters() if p.requires_grad]
        reducer = None
        if not self.cfg.shared_memory_allreduce:
            why_not = "trainer_config.shared_memory_allreduce=false"
        elif any(p.dtype != torch.float32 for p in params):
            why_not = "the parameters are not all fp32"
        else:
            reducer = SharedMemoryAllReduce.create(sum(p.numel() for p in params))
            why_not = "the ranks do not all share one host's /dev/shm, or it has no room"
        if self.ctx.is_main:
            how = "through shared memory (/dev/shm)" if reducer is not None else f"by gloo ({why_not})"
            log.info("gradients are averaged %s", how)
        return reducer

    def _compile(self, model: nn.Module) -> nn.Module:
        if self.ctx.device.type == "cpu":
            # C++, not Python, calls the generated kernels: a few % of a small CPU step (README, Benchmarks).
            return torch.compile(model, options={"cpp_wrapper": True})
        return torch.compile(model)

    def _setup_data(self, train_data: Dataset, val_data: Dataset) -> None:
        cfg, ctx = self.cfg, self.ctx
        self.n_train = len(train_data)
        self.sampler = ResumableDistributedSampler(train_data, ctx.world_size, ctx.rank, cfg.seed)
        self.train_loader = self._loader(train_data, self.sampler, drop_last=True)
        own_val_windows = range(ctx.rank, len(val_data), ctx.world_size)  # disjoint across ranks, no padding
        # Without gradients a window needs a fraction of the memory: evaluate EVAL_BATCH_FACTOR x larger batches.
        self.val_loader = self._loader(val_data, own_val_windows, drop_last=False,
                                       batch_size=cfg.batch_size * EVAL_BATCH_FACTOR)  # fmt: skip
        self.global_batch = cfg.batch_size * cfg.grad_accum_steps * ctx.world_size  # windows per optimizer step
        self.tokens_per_step = self.global_batch * self._block_size(train_data)
        self.steps_per_epoch = self.n_train // self.global_batch
        if self.steps_per_epoch == 0:
            raise UsageError(
                f"an optimizer step needs batch_size x grad_accum_steps x processes = "
                f"{cfg.batch_size} x {cfg.grad_accum_steps} x {ctx.world_size} windows, "
                f"but the training split has only {self.n_train}"
            )

    def _prime_ddp_buckets(self, dataset: Dataset) -> None:
        """One throw-away forward/backward before training, in fresh and resumed runs alike.

        DDP rebuilds its gradient buckets after its first backward pass, in the order gradients became ready. If
        that first pass were a real step, a resumed run (whose first step is a different step) would reduce in a
        different order than the uninterrupted one, and with 3+ ranks the sums would differ in the last bits.
        """
        first_windows = list(range(min(self.cfg.batch_size, len(dataset))))
        x, y = self._split(dataset.windows(first_windows))
        with torch.random.fork_rng(devices=[self.ctx.device] if self.ctx.device.type == "cuda" else []):
            with self._autocast():
                _, loss = self.model(x, y)
            loss.backward()
        self.optimizer.zero_grad(set_to_none=True)

    def _loader(self, dataset: Dataset, sampler, drop_last: bool, batch_size: Optional[int] = None) -> DataLoader:
        # The loader gets its own generator: iter(DataLoader) draws a base seed from it, and would otherwise draw
        # from the global RNG and shift the dropout stream.
        return DataLoader(
            WindowBatches(dataset),  # batches of (B, T+1) windows, pinned on CUDA: `_split` makes x and y
            batch_sampler=BatchSampler(sampler, batch_size or self.cfg.batch_size, drop_last=drop_last),
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

    def _split(self, windows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, y) on the device from a (B, T+1) batch of windows: one copy (asynchronous when the loader pinned
        it), then two views. On the CPU no copy at all: the same views as the dataset's `__getitems__`."""
        windows = windows.to(self.ctx.device, non_blocking=True)
        return windows[:, :-1], windows[:, 1:]

    def _autocast(self) -> contextlib.AbstractContextManager:
        return torch.autocast(self.ctx.device.type, dtype=self.amp_dtype, enabled=self.amp_dtype != torch.float32)

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
        if self.step >= self.total_steps:
            self._report_nothing_to_train()
        else:
            log.info(
                "training: steps %d -> %d (%d per epoch, %d epochs max), %d process(es) on %s, %s, %s tokens per step",
                self.step, self.total_steps, self.steps_per_epoch, self.cfg.max_epochs, self.ctx.world_size,
                self.ctx.device.type, str(self.amp_dtype).removeprefix("torch."), f"{self.tokens_per_step:,}",
            )  # fmt: skip
        self._reset_window()
        first_step = self.step
        self.progress = Progress(self.cfg.progress, self.ctx.is_main, self.total_steps, self.step)
        try:
            self._train_until_done()
        finally:
            self.progress.close()
        self.trained_steps = self.step - first_step
        if not self.stopped_early:
            if self._last_eval_step != self.step:
                self._evaluate()
            self.save_snapshot("end of training")
        self.wait_for_snapshot()  # the last snapshot must be complete before the process exits
        self._finish()
        self.metrics.close()

    def _report_nothing_to_train(self) -> None:
        limits = f"max_steps={self.cfg.max_steps}, max_epochs={self.cfg.max_epochs}"
        log.info("nothing to train: the snapshot in %s is at step %d, the end of this run (%s). To continue it, "
                 "raise trainer_config.max_steps or trainer_config.max_epochs; to start afresh, use another "
                 "trainer_config.snapshot_path", self.snapshots.location if self.snapshots else "memory", self.step,
                 limits)  # fmt: skip

    def _train_until_done(self) -> None:
        with self._sigterm_requests_stop() as deadline:
            while self.step < self.total_steps:
                self.train_step()
                self.progress.advance()
                self._after_step()
                if self._stop_agreed():
                    deadline.agreed.set()
                    self._stop_early()
                    break
            if self._stop_vote is not None:
                self._stop_vote.finish()  # no collective of this loop left behind

    def train_step(self) -> None:
        """One optimizer step on the next batches of the epoch (bench.py times exactly this)."""
        if self._batches is None:
            self._start_epoch()
        self._train_step()

    def _start_epoch(self) -> None:
        self.sampler.set_epoch(self.epoch, start=self.epoch_samples)  # mid-epoch resume starts at the next batch
        if self.cfg.data_loader_workers == 0 and self.ctx.device.type == "cpu":
            # Same batches as the DataLoader (it would call __getitems__ the same way), minus its per-batch
            # bookkeeping, which costs ~0.3 ms of a ~60 ms CPU step; on CUDA the loader pins each (B, T+1) batch.
            batch_sampler = BatchSampler(self.sampler, self.cfg.batch_size, drop_last=True)
            self._batches = (self.train_loader.dataset.__getitems__(indices) for indices in batch_sampler)
        else:
            self._batches = iter(self.train_loader)

    def _after_step(self) -> None:
        if self.step % self.cfg.log_every_steps == 0 or self.step == self.total_steps:
            self._log_train()
        last_step = self.step == self.total_steps
        if last_step or (self.cfg.eval_every_steps and self.step % self.cfg.eval_every_steps == 0):
            self._evaluate()  # the last step is evaluated before any snapshot of it is written
        if self._steps_left_in_epoch() == 0:
            self._end_epoch()
        if self.cfg.save_every_steps and self.step % self.cfg.save_every_steps == 0:
            self.save_snapshot(f"every {self.cfg.save_every_steps} steps")

    def _end_epoch(self) -> None:
        if self._last_eval_step != self.step:
            self._evaluate()  # a complete epoch ends with an evaluation
        self.epoch += 1
        self.epoch_samples = 0
        self._batches = None
        if self.epoch % self.cfg.save_every == 0:
            self.save_snapshot(f"end of epoch {self.epoch - 1}")

    def _train_step(self) -> None:
        lr = self.lr_schedule(self.step, self.total_steps)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self._seed_dropout()
        for micro_step in range(self.cfg.grad_accum_steps):
            x, y = self._split(next(self._batches))
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
            self._grad_norm = nn.utils.clip_grad_norm_(self.raw_model.parameters(), self.cfg.grad_norm_clip,
                                                       foreach=True)  # fmt: skip
        self.scaler.step(self.optimizer)  # skipped by the scaler when fp16 gradients overflowed
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        self.epoch_samples += self.global_batch
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

    # ----------------------------------------------------------------------------------------------- stopping
    @contextlib.contextmanager
    def _sigterm_requests_stop(self) -> Iterator["StopDeadline"]:
        """SIGTERM (sent by torchrun, SLURM and cloud schedulers before a kill, and by the kernel when the torchrun
        agent dies) ends training after the current step with a snapshot, instead of killing the process mid-step.
        A rank that cannot agree with its peers to stop within stop_timeout_s leaves without one (StopDeadline)."""

        def request_stop(signum: int, _frame) -> None:
            self._stop_signal = signum

        if threading.current_thread() is not threading.main_thread():
            yield StopDeadline(None, self.ctx.rank, self.finish_snapshot_quietly)
            return
        previous = signal.signal(signal.SIGTERM, request_stop)
        deadline = StopDeadline(self.cfg.stop_timeout_s, self.ctx.rank, self.finish_snapshot_quietly)
        try:
            yield deadline
        finally:
            deadline.close()
            signal.signal(signal.SIGTERM, previous)

    def finish_snapshot_quietly(self) -> None:
        """Wait for a snapshot being written, on a path that is ending anyway (its failure is not raised)."""
        self.wait_for_snapshot(raise_error=False)

    def _stop_agreed(self) -> bool:
        """All ranks must stop after the same step, or the ones left would wait forever in the next all-reduce."""
        if not self.ctx.distributed:
            return self._stop_signal is not None
        return self._stop_vote.cast(self._stop_signal is not None)

    def _stop_early(self) -> None:
        self.stopped_early = True
        log.warning("stop requested (SIGTERM) after step %d: saving a snapshot and exiting", self.step)
        self.save_snapshot("stop requested")

    # ----------------------------------------------------------------------------------------------- snapshots
    def state_dict(self, loss_window: dict) -> dict:
        """The trainer's part of a snapshot: weights, optimizer, scaler, progress."""
        return {
            "model": self.raw_model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scaler": self.scaler.state_dict(),
            "progress": {
                "step": self.step,
                "epoch": self.epoch,
                "epoch_samples": self.epoch_samples,
                "val_loss": self.last_val_loss,
                "last_eval_step": self._last_eval_step,
            },
            "loss_window": loss_window,
        }

    def _gather_loss_window(self) -> dict:
        """The partly filled logging window of every rank, so a resumed run logs the same averages."""
        sums = self._loss_sum.detach().reshape(1).to(torch.float64)
        if self.ctx.distributed:
            gathered = [torch.zeros_like(sums) for _ in range(self.ctx.world_size)]
            dist.all_gather(gathered, sums)
            sums = torch.cat(gathered)
        return {"sums": sums.cpu().tolist(), "count": self._loss_count, "start_step": self._window_step}

    def save_snapshot(self, reason: str) -> None:
        """Every rank calls this at the same step; only global rank 0 writes, the others go straight on.

        Rank 0 copies its state into CPU memory (the only part that blocks training) and hands it to a background
        writer that serialises, checksums, writes and prunes.
        """
        if self.snapshots is None or self._last_saved_step == self.step:
            return
        window = self._gather_loss_window()  # a collective of all ranks, outside rank-0-only code
        self._last_saved_step = self.step
        if not self.ctx.is_main:
            return
        start = time.perf_counter()
        state = snapshot_lib.cpu_copy(self.state_dict(window))
        if self._writer is None or self._writer.store is not self.snapshots:
            self.wait_for_snapshot()
            self._writer = snapshot_lib.BackgroundWriter(self.snapshots, self.cfg.keep_last)
        name = snapshot_lib.snapshot_name(self.step)
        self._writer.submit(name, state, self.snapshot_metadata, self.ctx.world_size, reason)
        self.snapshot_blocked_s.append(time.perf_counter() - start)
        self._window_start += time.perf_counter() - start

    def wait_for_snapshot(self, raise_error: bool = True) -> None:
        """Block until the snapshot being written is complete (raises if writing it failed, if asked to)."""
        if self._writer is not None:
            self._writer.wait(raise_error=raise_error)

    def _restore(self) -> None:
        """Load the newest valid snapshot, if any. Every rank loads it; all must agree on which."""
        if self.snapshots is None:
            return
        if self.ctx.is_main:
            self.snapshots.check_writable()
        found = self.snapshots.load_newest_valid(
            self.snapshot_metadata.get("model_config", {}), self.snapshot_metadata.get("vocab", "")
        )
        loaded_step = -1 if found is None else found[0].step
        if self.ctx.distributed:
            steps = [None] * self.ctx.world_size
            dist.all_gather_object(steps, loaded_step)
            if len(set(steps)) != 1:
                raise RuntimeError(f"ranks found different snapshots to resume from (steps {steps})")
        if found is None:
            log.info("no snapshot in %s: starting from scratch", self.snapshots.location)
            return
        entry, snap = found
        self.load_state_dict(snap)
        self._last_saved_step = self.step
        log.info("resumed from %s: step %d, epoch %d, sample %d of the epoch", self.snapshots.url(entry.name),
                 self.step, self.epoch, self.epoch_samples)  # fmt: skip

    def load_state_dict(self, snap: dict) -> None:
        self.raw_model.load_state_dict(snap["model"])
        self.optimizer.load_state_dict(snap["optimizer"])
        self._load_scaler(snap["scaler"])
        progress = snap["progress"]
        self.step, self.epoch = progress["step"], progress["epoch"]
        self.epoch_samples = progress["epoch_samples"]
        self.last_val_loss, self._last_eval_step = progress["val_loss"], progress["last_eval_step"]
        saved_world_size = snap["world_size"]
        if saved_world_size != self.ctx.world_size and self.ctx.is_main:  # one line for the job
            log.warning("snapshot was written by %d process(es), resuming with %d: continuing at global sample %d "
                        "of epoch %d", saved_world_size, self.ctx.world_size, self.epoch_samples, self.epoch)  # fmt: skip
        self.total_steps = self._total_steps()
        self._restore_loss_window(snap["loss_window"], saved_world_size)

    def _load_scaler(self, state: dict) -> None:
        """The gradient scaler's state, across a change of mixed_precision: a disabled scaler (bf16, fp32) saves {}.

        fp16 resuming a bf16/fp32 snapshot starts a fresh scaler (one warning); bf16/fp32 resuming an fp16 snapshot
        has no use for its loss scale (GradScaler.load_state_dict ignores it when disabled; one info line)."""
        if self.scaler.is_enabled() and not state:
            if self.ctx.is_main:  # other ranks log warnings too: one line for the job, not one per process
                log.warning("snapshot has no fp16 gradient-scaler state (it was trained in bf16 or fp32): starting a "
                            "fresh scaler, loss scale %g", self.scaler.get_scale())  # fmt: skip
            return
        if not self.scaler.is_enabled() and state:
            log.info("snapshot was trained in fp16: its loss scale (%g) is not needed in %s", state.get("scale", 0.0),
                     str(self.amp_dtype).removeprefix("torch."))  # fmt: skip
            return
        self.scaler.load_state_dict(state)

    def _restore_loss_window(self, window: dict, saved_world_size: int) -> None:
        self._reset_window()
        self._window_step = window["start_step"]
        self._loss_count = window["count"]
        if saved_world_size == self.ctx.world_size:
            own = window["sums"][self.ctx.rank]  # each rank continues its own sum: identical arithmetic
        else:  # rescale so that the all-rank mean over the window stays right
            own = sum(window["sums"]) * self.ctx.world_size / saved_world_size if self.ctx.is_main else 0.0
        self._loss_sum = torch.tensor(own, dtype=torch.float32, device=self.ctx.device)

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
            "elapsed_s": round(time.perf_counter() - self._fit_start, 2),  # since this process started fit()
        }
        if self._grad_norm is not None:
            row["grad_norm"] = round(self._grad_norm.item(), 6)
        if self.scaler.is_enabled():
            row["loss_scale"] = self.scaler.get_scale()
        self.metrics.write(row)
        line = (f"step {self.step}/{self.total_steps} | epoch {self.epoch} | loss {train_loss:.4f} | "
                f"lr {self._last_lr:.2e} | {tokens_per_s:,.0f} tok/s | {row['ms_per_step']:.1f} ms/step")  # fmt: skip
        self.progress.report(line, train_loss, tokens_per_s, self._last_lr)
        self._reset_window()

    @torch.no_grad()
    def _evaluate(self) -> float:
        """Mean per-character validation loss over all validation windows of all ranks."""
        start = time.perf_counter()
        self.eval_model.eval()
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.ctx.device)
        count = torch.zeros((), dtype=torch.float64, device=self.ctx.device)
        for i, windows in enumerate(self.val_loader):
            if self.cfg.eval_batches is not None and i >= self.cfg.eval_batches:
                break
            x, y = self._split(windows)
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
        self.metrics.write({"step": self.step, "epoch": self.epoch, "val_loss": round(val_loss, 6),
                            "elapsed_s": round(time.perf_counter() - self._fit_start, 2)})  # fmt: skip
        log.info("step %d | epoch %d | val loss %.4f (%.1f s)", self.step, self.epoch, val_loss,
                 time.perf_counter() - start)  # fmt: skip
        self._window_start += time.perf_counter() - start  # evaluation time does not count against tokens/s
        return val_loss

    def _finish(self) -> None:
        """Check that every rank ended with the same weights, and write the run's summary (rank 0)."""
        digest = snapshot_lib.weights_sha256(self.raw_model.state_dict())
        digests = [digest]
        if self.ctx.distributed:
            digests = [None] * self.ctx.world_size
            dist.all_gather_object(digests, digest)
        identical = len(set(digests)) == 1
        wall = time.perf_counter() - self._fit_start
        if not identical:
            log.error("replicas diverged: weight digests differ between ranks: %s", digests)
        elif self.stopped_early:
            log.info("stopped at step %d after %.1f s; run the same command again to continue", self.step, wall)
        else:
            log.info("done: %d steps in %.1f s; weights identical on all %d rank(s), sha256 %s",
                     self.step, wall, len(digests), digest[:16])  # fmt: skip
        if self.ctx.is_main and self.metrics.path is not None:
            summary = {
                "steps": self.step,
                "epochs_completed": self.epoch,
                "finished": not self.stopped_early,
                "val_loss": self.last_val_loss,
                "weights_sha256": digest,
                "rank_weights_sha256": digests,
                "replicas_identical": identical,
                "wall_time_s": round(wall, 2),
                "world_size": self.ctx.world_size,
            }
            (self.metrics.path.parent / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
