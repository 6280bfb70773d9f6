"""One torchrun launch, several layouts (tests/e2e/test_layouts.py): for each, the real Trainer as main.build_trainer
builds it, on one process group.

    torchrun --standalone --nproc_per_node=4 tests/workers/layout_worker.py OUT_DIR LAYOUT|CHECK [...]

For each LAYOUT (a name in LAYOUTS: its parallel_config and strategy):
1. equivalence: 4 optimizer steps (fp32, dropout 0, clipping engaged) end with the weights of one process trained on
   the same global batches (reference.py, in every process, no group: the model, optimizers, learning-rate schedule
   and batches main.build_trainer makes for one process, stepped by the reference's own loop; one per data-parallel
   degree and optimizer, shared by the layouts that have them); the largest difference is reported;
2. exact resume: the step-4 snapshot deleted, a new trainer resumes from step 2 and must end with the same digest;
3. across layouts: the step-4 snapshot loaded by a trainer of the NEXT layout in the list (of those with the same
   optimizer: names ending in "muon" train with Muon and AdamW, the others with AdamW) must hold the same
   weights (digest after restoring), and that trainer takes a step from it; read alone, as snapshot.py and sample.py
   read it, it has the same digest too.
A CHECK (a name in CHECKS) is a check of its own that shares the launch, run first: "mesh_muon", MeshMuon on
sharded matrices against torch's Muon on whole ones (muon_worker.py); "nonfinite_skip" (2 processes: ddp, fsdp, tp,
pp) and "nonfinite_skip4" (4: hsdp, pp_tp), a NaN in one rank's gradient skipped by every rank. Global rank 0 writes
OUT_DIR/result.json after each.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the project's root

from mingpt import startup

startup.pause_collection(__name__)  # as a run's command does (mingpt/startup.py)

import dataclasses
import itertools
import json
import shutil

import muon_worker
import torch
import torch.distributed as dist
from reference import Reference

import main
from char_dataset import CharCorpus, DataConfig
from mingpt.checkpoint.store import SnapshotStore, read_snapshot, summary
from mingpt.distributed.process_group import DistContext, leave_distributed, setup_distributed
from mingpt.optim import OptimizerConfig
from mingpt.parallel.layout import ParallelConfig
from mingpt.parallel.state import weights_sha256_of
from trainer import Trainer, TrainerConfig

startup.resume_collection(__name__)

BATCH = 4  # windows per data-parallel rank and micro-batch
STEPS, SAVED = 4, 2
TEXT = "".join(f"line {i}: the quick brown fox jumps over the lazy dog.\n" for i in range(300))
# name: (strategy, parallel_config fields)
LAYOUTS = {
    "ddp": ("ddp", {}),
    "fsdp": ("fsdp", {}),
    "tp": ("ddp", {"tp": 2}),
    "pp": ("ddp", {"pp": 2}),
    "pp_gpipe": ("ddp", {"pp": 2, "pp_schedule": "GPipe"}),
    "pp_interleaved": ("ddp", {"pp": 2, "pp_schedule": "Interleaved1F1B"}),
    "fsdp_tp": ("fsdp", {"tp": 2}),
    "dp_tp": ("ddp", {"tp": 2}),
    "pp_dp": ("ddp", {"pp": 2}),
    "pp_fsdp": ("fsdp", {"pp": 2, "pp_schedule": "GPipe"}),
    "pp_fsdp_interleaved": ("fsdp", {"pp": 2, "pp_schedule": "Interleaved1F1B"}),
    "pp_tp": ("ddp", {"pp": 2, "tp": 2}),
    "hsdp": ("fsdp", {"dp_replicate": 2}),
    "pp4": ("ddp", {"pp": 4}),
    "tp4": ("ddp", {"tp": 4}),
    # Muon on the blocks' matrices (gathered whole where they are DTensors), AdamW on the rest
    "ddp_muon": ("ddp", {}),
    "fsdp_muon": ("fsdp", {}),
    "tp_muon": ("ddp", {"tp": 2}),
    "pp_muon": ("ddp", {"pp": 2}),
}
# AdamW with an epsilon far above sqrt(v) (gradients are clipped to a norm of 0.3: no entry reaches 1): each update is
# ~lr * m, momentum SGD's, and not m / sqrt(v), whose division by the gradient's own size moves a weight whose
# gradient is at rounding level by up to a whole learning rate either way (the fp32 sums of another layout, or
# another CPU's kernels, flip its sign): the comparison with one process reads what the layout computes. Its state
# (m and v, sharded as the layout shards), groups and weight decay are AdamW's, saved and resumed as in any run.
ADAMW = OptimizerConfig(learning_rate=1.0, eps=1.0, warmup_steps=0, min_lr=0.1, weight_decay=0.01)
# Every Muon setting in play: the momentum's warm-up ends within the run, and the resume from step 2 starts inside it;
# its AdamW part (embeddings, head, norms) is ADAMW.
MUON = dataclasses.replace(ADAMW, name="muon", muon_learning_rate=0.05, muon_momentum_warmup_steps=3,
                           muon_weight_decay=0.1)


POISONED_STEP = 2  # nonfinite_skip: the step whose gradient one rank sees as NaN


def nonfinite_skip(ctx: DistContext, layouts: tuple[str, ...]) -> dict:
    """Collective. For each layout: rank 1's gradient made NaN at one step, after the layout's reductions (so the
    other ranks' own gradients stay finite); every rank must skip that step (its weights, whole, unchanged), count
    one skip, and train on to the end with whole weights equal on every rank."""
    results = {}
    for name in layouts:
        trainer = build(name, ctx, Path("unused"))
        trainer.checkpoints.store = None  # no snapshots: the check is of the steps
        finish = trainer.parallel.finish_gradients

        def poisoned(trainer: Trainer = trainer, finish=finish) -> None:
            finish()
            if trainer.step == POISONED_STEP and trainer.ctx.rank == 1:
                grads = [p.grad for module in trainer.parallel.modules for p in module.parameters()
                         if p.grad is not None]
                local = grads[0].to_local() if hasattr(grads[0], "to_local") else grads[0]  # a shard: its own part
                local.view(-1)[0] = float("nan")

        trainer.parallel.finish_gradients = poisoned
        before = after = ""
        train_step = trainer.train_step
        for _ in range(STEPS):
            if trainer.step == POISONED_STEP:
                before = digest(trainer)
            train_step()
            if trainer.step == POISONED_STEP + 1:
                after = digest(trainer)
        trainer.settle()  # the verdicts of steps skipped on the device, read (the loop does it before a log line)
        ends = [None] * dist.get_world_size()
        dist.all_gather_object(ends, (trainer.nonfinite.total, digest(trainer), bool(torch.isfinite(
            torch.stack([t.float().abs().max() for _, t in trainer.parallel.whole_tensors()])).all())))
        results[name] = {"skipped_per_rank": [end[0] for end in ends], "unchanged": before == after,
                         "digests_equal": len({end[1] for end in ends}) == 1, "finite": all(end[2] for end in ends)}
    return results


# name: a collective (given the process group) returning its figures
CHECKS = {"mesh_muon": lambda ctx: muon_worker.compare(),
          "nonfinite_skip": lambda ctx: nonfinite_skip(ctx, ("ddp", "fsdp", "tp", "pp")),
          "nonfinite_skip4": lambda ctx: nonfinite_skip(ctx, ("hsdp", "pp_tp"))}


def optimizer_of(name: str) -> OptimizerConfig:
    return MUON if name.endswith("muon") else ADAMW


def config(strategy: str, parallel: dict, batch_size: int, snapshots: Path,
           optimizer: OptimizerConfig) -> main.TrainConfig:
    # One validation batch at the end of a run: its path runs on every layout, and nothing here compares its loss
    # (tests/workers/pp_worker.py does); the whole split took half of a tensor-parallel launch's time.
    trainer = TrainerConfig(max_steps=STEPS, batch_size=batch_size, mixed_precision="fp32", grad_norm_clip=0.3,
                            eval_every_steps=0, eval_batches=1, save_every_steps=SAVED, keep_last=3,
                            log_every_steps=100, progress="off", snapshot_path=str(snapshots))
    return main.TrainConfig(DataConfig(block_size=16), main.ModelSettings(n_layer=4, n_head=4, n_embd=32, dropout=0.0),
                            optimizer, trainer, ParallelConfig(strategy=strategy, **parallel))


def build(name: str, ctx: DistContext, snapshots: Path, batch_size: int = BATCH, optimizer: str = "") -> Trainer:
    strategy, parallel = LAYOUTS[name]
    cfg = config(strategy, parallel, batch_size, snapshots, optimizer_of(optimizer or name))
    corpus = CharCorpus.from_text(TEXT, cfg.data_config)
    return main.build_trainer(cfg, corpus, ctx, None, store=SnapshotStore(str(snapshots)))


def whole_weights(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {name: tensor.clone() for name, tensor in trainer.parallel.whole_tensors()}


def digest(trainer: Trainer) -> str:
    return weights_sha256_of(trainer.parallel.whole_tensors())


REFERENCES: dict[tuple[int, str], dict[str, torch.Tensor]] = {}  # (dp, optimizer name): the weights it ends with


def reference(dp: int, folder: Path, optimizer: str) -> dict[str, torch.Tensor]:
    """The weights after STEPS steps of one process on the global batches of `dp` data-parallel ranks, with the
    optimizer of layout `optimizer` (no group: every rank trains it); trained once per (dp, optimizer)."""
    key = (dp, optimizer_of(optimizer).name)
    if key not in REFERENCES:
        trainer = build("ddp", DistContext.single_process(torch.device("cpu")), folder, batch_size=BATCH * dp,
                        optimizer=optimizer)

        def schedule(step: int) -> None:  # what Trainer.train_step sets before each step
            trainer.optimizers.schedule(step, trainer.lr_schedule(step, trainer.total_steps))

        ref = Reference(trainer.parallel.modules[0], trainer.optimizers, trainer.cfg.grad_norm_clip, schedule,
                        keep_gradients=False)
        ref.train(trainer.split(windows) for windows in itertools.islice(trainer.epoch_batches(), STEPS))
        REFERENCES[key] = ref.state()
    return REFERENCES[key]


def check(name: str, following: str, ctx: DistContext, out: Path) -> dict:
    folder = out / name
    trained = build(name, ctx, folder / "snapshots")
    trained.fit()
    weights = whole_weights(trained)
    end = weights_sha256_of(weights.items())  # the digest of the weights just gathered, not a second gather
    expected = reference(trained.parallel.data_ranks, folder / f"reference-{ctx.rank}", name)
    differences = {key: (weights[key] - expected[key]).abs().max().item() for key in expected}
    dist.barrier()
    if ctx.is_main:  # the run as if killed right after the step-2 snapshot
        shutil.rmtree(folder / "snapshots" / f"snapshot-{STEPS:09d}.dcp", ignore_errors=True)
        (folder / "snapshots" / f"snapshot-{STEPS:09d}.pt").unlink(missing_ok=True)
    dist.barrier()
    resumed = build(name, ctx, folder / "snapshots")
    resumed.fit()
    resume_exact = digest(resumed) == end
    newest = sorted((folder / "snapshots").iterdir())[-1]  # what snapshot.py info and consolidate read, alone
    tools_exact = summary(read_snapshot(str(newest)))["weights_sha256"] == end if ctx.is_main else True
    loader = build(following, ctx, folder / "snapshots")  # its newest snapshot: the resumed run's step 4
    restored = loader.checkpoints.restore()
    cross_exact = restored is not None and loader.step == STEPS and digest(loader) == end
    loader.train_step()
    return {"max_difference": max(differences.values()), "worst": max(differences, key=differences.get),
            "resume_exact": resume_exact, "next": following, "cross_exact": cross_exact, "tools_exact": tools_exact,
            "layout": trained.parallel.name}


def main_worker(out: Path, names: list[str]) -> None:
    ctx = setup_distributed()
    results = {}
    for name in [name for name in names if name in CHECKS]:
        results[name] = CHECKS[name](ctx)
        if ctx.is_main:
            (out / "result.json").write_text(json.dumps(results, indent=1))
    names = [name for name in names if name not in CHECKS]
    for name in names:
        same_optimizer = [other for other in names if optimizer_of(other) is optimizer_of(name)]
        results[name] = check(name, same_optimizer[(same_optimizer.index(name) + 1) % len(same_optimizer)], ctx, out)
        if ctx.is_main:
            (out / "result.json").write_text(json.dumps(results, indent=1))
    # As main.py ends: together, and with the failure watch stopped first (its thread, still inside a store request
    # at exit, aborted a rank now and then on a loaded machine: "terminate called without an active exception").
    leave_distributed()


if __name__ == "__main__":
    main_worker(Path(sys.argv[1]), sys.argv[2:])
