"""When to snapshot and what goes in: the checkpoint component between the training loop and the store (store.py).

    checkpoints = Checkpointer(store, metadata, cfg, ctx, {"model": model, "optimizer": optimizer, ...})
    checkpoints.restore()                                    # every rank, before training
    checkpoints.save_if_due(step, finished_epoch=None)       # after every step: the cadence decides
    checkpoints.save(step, "end of training")                # at the end, on SIGTERM

The trainer hands it stateful objects (anything with `state_dict()` and `load_state_dict()`) under the keys they
take in a snapshot; it knows nothing of their contents. Every rank calls `state_dict()` (a state may need a
collective to assemble). Unsharded (ddp): global rank 0 stages the result into host memory (store.HostStaging:
reused buffers, asynchronous copies) and a background writer serialises, checksums, writes one file atomically and
prunes. Sharded (fsdp): every rank stages its shards alike and its background writer saves them with the others'
(sharded.py). The tensors a `state_dict()` returns are the live ones: they may change in place only in the
optimizer step, which the trainer announces with `before_update()`, or in a load; either first waits for a staging
copy still reading them. Either kind of snapshot restores into either kind of run: a sharded one is loaded into
what the stateful objects' `named_state_dict()` holds (their shards or full tensors), through DCP. What a snapshot
is (bytes, storage, validation, the newest valid one) stays in store.py and sharded.py.
"""

from __future__ import annotations

import functools
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional, Protocol

import torch
import torch.distributed as dist

from mingpt.checkpoint import store as snapshot_lib
from mingpt.checkpoint.store import SnapshotStore
from mingpt.data.tokenizer import snapshot_tokenizer
from mingpt.distributed.process_group import DistContext
from mingpt.errors import UsageError, describe
from mingpt.parallel.state import is_fresh

if TYPE_CHECKING:
    from mingpt.checkpoint.sharded import ShardedWriter

log = logging.getLogger(__name__)


class Stateful(Protocol):
    def state_dict(self) -> Any: ...

    def load_state_dict(self, state: Any) -> Any: ...


@dataclass
class Cadence:
    """When snapshots are due besides the end of training and a stop: every `save_every` epochs, and every
    `save_every_steps` optimizer steps (None: off)."""

    save_every: int = 1
    save_every_steps: Optional[int] = None
    keep_last: int = 2

    def step_due(self, step: int) -> bool:
        """Whether a snapshot is due after optimizer step `step` by the step count."""
        return bool(self.save_every_steps and step % self.save_every_steps == 0)


@dataclass
class Restored:
    """What `restore()` found: the snapshot's URL, the number of processes that wrote it, their strategy and the
    attention implementation that ran."""

    url: str
    world_size: int
    strategy: str  # the strategy it was trained under (older snapshots: ddp)
    attention: Optional[str] = None  # model_config.attention ("auto" in snapshots from before it was resolved)
    layout: str = ""  # the layout it was trained under ("pp 2 x dp_replicate 2"; the strategy for plain DDP/FSDP)


def check_same_optimizer(saved: str, wanted: str, source: str) -> None:
    """A snapshot's optimizer state continues only under the same optimizer choice: AdamW's moments are not Muon's
    momentum, and no conversion is exact. (Snapshots from before the choice existed were AdamW's.)"""
    if saved != wanted:
        raise UsageError(f"snapshot {source} was trained with optimizer_config.name={saved}, this run asks for "
                         f"{wanted}: resume with optimizer_config.name={saved}, or use another "
                         f"trainer_config.snapshot_path to start afresh")


class Checkpointer:
    """Snapshots of `stateful` objects in `store` (None: no snapshots at all)."""

    def __init__(self, store: Optional[SnapshotStore], metadata: dict, cadence: Cadence, ctx: DistContext,
                 stateful: dict[str, Stateful], sharded: bool = False, exit_wait_s: float = 15.0) -> None:
        self.store, self.metadata, self.cadence, self.ctx = store, metadata, cadence, ctx
        self.stateful, self.sharded, self.exit_wait_s = stateful, sharded, exit_wait_s
        # Training-thread time per snapshot, for reports and bench.py: in save(), and waiting for its staging copy
        # later (before the next optimizer step, a load, the end).
        self.blocked_s: list[float] = []
        # Why the state may not be saved now (the trainer's: its last step was skipped as non-finite); None: it may.
        self.held: Optional[str] = None
        self._restored: Optional[str] = None  # the snapshot this run resumed from
        self._starting_point: Optional[tuple[int, dict]] = None  # a fresh run's first state (keep_starting_point)
        self._last_saved_step = -1  # the last step a save was asked for (and done, or refused)
        self._writer: Optional[snapshot_lib.BackgroundWriter | ShardedWriter] = None
        self._staging = snapshot_lib.HostStaging()  # the host buffers every save of this rank reuses
        self._staged: Optional[snapshot_lib.StagedState] = None  # the newest save's copy, maybe still reading
        self._group: Any = None  # the snapshot threads' gloo group, made at the first sharded save or load

    @property
    def location(self) -> str:
        return self.store.location if self.store is not None else "memory"

    # --------------------------------------------------------------------------------------------------- saving
    def save_if_due(self, step: int, finished_epoch: Optional[int] = None) -> float:
        """After an optimizer step (and, with `finished_epoch`, the epoch it completed): a snapshot if one is due.
        Returns the seconds the calling thread was blocked."""
        blocked = 0.0
        if finished_epoch is not None and (finished_epoch + 1) % self.cadence.save_every == 0:
            blocked += self.save(step, f"end of epoch {finished_epoch}")
        if self.cadence.step_due(step):
            blocked += self.save(step, f"every {self.cadence.save_every_steps} steps")
        return blocked

    def save(self, step: int, reason: str, best_val_loss: Optional[float] = None) -> float:
        """Every rank calls this at the same step; only global rank 0 writes, the others go straight on. A step
        saved already is not saved again; nor is a state that is `held`, or one whose weights or optimizer state
        are not finite (a diverged state never replaces a good one). With `best_val_loss`, the snapshot is marked
        the best once complete (kept beside the newest). Returns the seconds the calling thread was blocked."""
        if self.store is None or self._last_saved_step == step:
            return 0.0
        name = snapshot_lib.snapshot_name(step, self.sharded)
        if self.held is not None:
            self._not_written(step, self.held)
            return 0.0
        if self._writer is not None and self._writer.newest_saved is not None:
            self._starting_point = None  # a snapshot of this run is complete: the start is no longer needed
        states = {key: obj.state_dict() for key, obj in self.stateful.items()}  # on every rank: may be collective
        self._last_saved_step = step
        writes = self.sharded or self.ctx.is_main
        not_finite = self._nonfinite(states) if writes else None
        if not_finite:
            self._not_written(step, f"{not_finite} is not finite")
            return 0.0
        if not writes:
            return 0.0  # nothing here waits for the writing ranks' copies: under DDP the others go straight on
        self._done_reading()
        start = time.perf_counter()
        self._writer = self._writer or self._new_writer()
        self._writer.make_room()  # the previous save is done with the host buffers this one reuses
        self._staged = self._staging.stage(states)  # copies queued or started; the writer waits for them
        self._writer.submit(name, self._staged, self.metadata, self.ctx.world_size, reason,
                            functools.partial(self._after_commit, name, step, best_val_loss))
        blocked = time.perf_counter() - start
        self.blocked_s.append(blocked)
        return blocked

    def before_update(self) -> float:
        """Before the optimizer changes the live tensors in place: a snapshot still copying them is done reading.
        Returns the seconds the calling thread waited for it."""
        return self._done_reading()

    def _done_reading(self) -> float:
        """Before the live state may change (an update, a load) or the run ends: the newest save's staging copy has
        read it. A wait here is that save's: added to its blocked_s. Returns the seconds waited."""
        staged = self._staged
        if staged is None:
            return 0.0
        waited = staged.done_reading()
        if self._staged is staged:  # cleared only once read: the stop deadline's thread may be waiting for it too
            self._staged = None
            if self.blocked_s:
                self.blocked_s[-1] += waited
        return waited

    def _nonfinite(self, states: dict) -> Optional[str]:
        """Collective where every rank writes (shards). The first non-finite tensor of the state, on any rank."""
        names = snapshot_lib.nonfinite_tensors(states)
        if self.sharded and self.ctx.distributed:
            anywhere = self.ctx.all_reduce(torch.tensor([float(bool(names))], device=self.ctx.device),
                                           dist.ReduceOp.MAX)
            if anywhere.item() and not names:
                return "a shard on another rank"
        return snapshot_lib.describe_nonfinite(names) if names else None

    def _not_written(self, step: int, why: str) -> None:
        if self.ctx.is_main:
            newest = self._newest_name()
            kept = f"{self.store.url(newest)} stays the newest" if newest else "no snapshot was written yet"
            log.warning("snapshot of step %d not written: %s; %s", step, why, kept)

    def _after_commit(self, name: str, step: int, best_val_loss: Optional[float]) -> str:
        """On the writer's thread (rank 0 of shards), once `name` is complete: marked the best if it is, then the
        old ones pruned (never this one, nor the best). What to add to its "saved" line."""
        mark = ""
        if best_val_loss is not None:
            try:
                self.store.mark_best(name, step, best_val_loss)
                mark = f"; the best so far, val loss {best_val_loss:.4f}"
            except Exception as e:  # the snapshot itself is complete; the next best one tries again
                log.warning("snapshot %s not marked the best: %s", self.store.url(name), describe(e))
        return mark + snapshot_lib.prune_quietly(self.store, self.cadence.keep_last, keep=(name,))

    def _new_writer(self) -> snapshot_lib.BackgroundWriter | ShardedWriter:
        """Collective when sharded (every rank saves at the same step): the snapshot threads' own group."""
        if not self.sharded:
            return snapshot_lib.BackgroundWriter(self.store, self.cadence.keep_last)
        from mingpt.checkpoint.sharded import (
            ShardedWriter,  # imports torch.distributed.checkpoint: only sharded runs pay for it
        )

        store, keep_last = self.store, self.cadence.keep_last
        return ShardedWriter(store, self.ctx.rank, self._snapshot_group(), snapshot_lib.SAVE_ATTEMPTS,
                             snapshot_lib.SAVE_FIRST_BACKOFF_S, lambda: snapshot_lib.prune_quietly(store, keep_last),
                             self.ctx.device)

    def _snapshot_group(self) -> Any:
        """Collective the first time (every rank saves or loads shards at the same point)."""
        if self._group is None and self.ctx.distributed:
            from mingpt.checkpoint.sharded import new_group

            self._group = new_group()
        return self._group

    def newest_complete(self) -> Optional[str]:
        """Collective. The URL of the newest snapshot of this run (written or restored), once the one being written
        is complete, as global rank 0 (the writer of single files) sees it; None: none."""
        self.wait(raise_error=False)
        name = self._newest_name()
        return self.ctx.gather_objects(self.store.url(name) if self.store is not None and name else None)[0]

    def _newest_name(self) -> Optional[str]:
        """The newest complete snapshot of this run on this rank: the writer's last, else the one restored."""
        return (self._writer.newest_saved if self._writer is not None else None) or self._restored

    # --------------------------------------------------------------------------------------------------- the start
    def keep_starting_point(self, step: int) -> None:
        """Collective. A fresh run's state before its first step, copied to host memory but not written: a run that
        diverges before its first snapshot is complete still has a good one to stop at or go back to
        (`write_starting_point`). Dropped once a snapshot is complete."""
        if self.store is None:
            return
        states = {key: obj.state_dict() for key, obj in self.stateful.items()}  # the optimizers: FRESH
        if self.sharded or self.ctx.is_main:
            self._starting_point = (step, snapshot_lib.cpu_copy(states))

    def write_starting_point(self) -> Optional[str]:
        """Collective. The kept starting point written as a snapshot and waited for; its URL (None: none kept, or
        it could not be written)."""
        if not self.ctx.gather_objects(self._starting_point is not None)[0]:  # rank 0 keeps one, or none does
            return None
        self._done_reading()  # a rollback loads into the live state after this
        if self._starting_point is not None:  # the ranks that write
            step, state = self._starting_point
            name = snapshot_lib.snapshot_name(step, self.sharded)
            self._writer = self._writer or self._new_writer()
            self._writer.submit(name, state, self.metadata, self.ctx.world_size, "the run's starting point",
                                functools.partial(self._after_commit, name, step, None))
        self._starting_point = None
        return self.newest_complete()

    def wait(self, raise_error: bool = True) -> None:
        """Block until the snapshot being written is complete (raises if writing it failed, if asked to)."""
        self._done_reading()
        if self._writer is not None:
            self._writer.wait(raise_error=raise_error)

    def finish_quietly(self) -> None:
        """Wait for a snapshot being written, on a path that is ending anyway (its failure is not raised). A sharded
        save needs every rank, and a peer may be gone: it gets exit_wait_s."""
        self._done_reading()
        if self.sharded and self._writer is not None:
            self._writer.wait(raise_error=False, timeout=self.exit_wait_s)
        else:
            self.wait(raise_error=False)

    # --------------------------------------------------------------------------------------------------- restoring
    def restore(self) -> Optional[Restored]:
        """Load the newest valid snapshot into the stateful objects, if there is one. Every rank loads it, and all
        must have found the same one."""
        if self.store is None:
            return None
        self._done_reading()  # a rollback's load changes the tensors a snapshot may still be copying
        if self.ctx.is_main:
            self.store.check_writable()
        found = self.store.load_newest_valid(self.metadata.get("model_config", {}),
                                             snapshot_tokenizer(self.metadata))
        steps = self.ctx.gather_objects(-1 if found is None else found[0].step)
        if len(set(steps)) != 1:
            raise RuntimeError(f"ranks found different snapshots to resume from (steps {steps})")
        if found is None:
            log.info("no snapshot in %s: starting from scratch", self.store.location)
            return None
        entry, snap = found
        check_same_optimizer(snap.get("optimizer_name", "adamw"), self.metadata.get("optimizer_name", "adamw"),
                             self.store.url(entry.name))
        if "shards" in snap:
            self._load_shards(snap)
        else:
            for key, obj in self.stateful.items():
                obj.load_state_dict(snap[key])
        self._last_saved_step = entry.step
        self._restored = entry.name
        strategy = snap.get("strategy", "fsdp" if entry.sharded else "ddp")
        return Restored(url=self.store.url(entry.name), world_size=snap["world_size"], strategy=strategy,
                        attention=snap["model_config"].get("attention"), layout=snap.get("layout", strategy))

    def _load_shards(self, snap: dict) -> None:
        """Collective. A sharded snapshot into the stateful objects: DCP fills what their `named_state_dict()` holds
        (this rank's shards, or full tensors), at this run's world size, whatever the snapshot's was."""
        templates = {key: obj.named_state_dict() for key, obj in self.stateful.items()
                     if hasattr(obj, "named_state_dict") and not is_fresh(snap.get(key))}
        from mingpt.checkpoint.sharded import merge, split_tensors

        tensors, _ = split_tensors(templates)
        snap["shards"].load_into(tensors, self._snapshot_group())  # gloo: DCP exchanges its plans as objects
        for key, obj in self.stateful.items():
            if key in templates:
                obj.load_state_dict(merge(tensors.get(key, {}), snap.get(key, {})))
            else:
                obj.load_state_dict(snap[key])
