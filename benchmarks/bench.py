"""Benchmark the real training step: median step time, tokens/s (all ranks together), MFU, snapshot blocking.

    python benchmarks/bench.py preset=nanogpt_cpu  # 1 process (threads: OMP_NUM_THREADS)
    OMP_NUM_THREADS=1 python benchmarks/bench.py preset=nanogpt_cpu                 # 1 process, 1 thread
    torchrun --standalone --nproc_per_node=2 benchmarks/bench.py preset=nanogpt_cpu # 2 processes x 1 thread
    python benchmarks/bench.py --snapshots 3  # + time training is blocked per snapshot
    python benchmarks/bench.py --steps 50 --json result.json parallel_config.compile=true gpt_config.n_layer=12 ...
    python benchmarks/bench.py --baseline nanogpt preset=nanogpt_cpu  # + nanoGPT's CPU loop, step for step
    torchrun --standalone --nproc_per_node=2 benchmarks/bench.py --snapshots 3 parallel_config.strategy=fsdp  # sharded
    torchrun --standalone --nproc_per_node=2 benchmarks/bench.py --scaling preset=nanogpt_cpu  # + 1 process alone

Arguments starting with `--` are the benchmark's own; everything else is a Hydra override, exactly as for main.py.
The steps timed are `Trainer` steps of the same model, data path, optimizer, DDP wrapper and mixed precision that
main.py builds (through `main.build_trainer`), after warm-up steps that are not timed.

MFU = model FLOPs per token (6 N + 12 n_layer n_embd block_size) x tokens/s / (processes x peak). The peak is
`--peak-tflops` per process; else, on a GPU model NVIDIA publishes it for (H100, H200, GH200, A100; `KNOWN_PEAKS`),
its dense datasheet peak in the training precision (bf16/fp16 tensor cores, TF32 for fp32 when TF32 matmuls are
on); else (a CPU, another GPU) measured here with a large matmul in that precision. A measured matmul runs below
the datasheet peak, so on a GPU it reads MFU 15-30% high: the output says which peak was used (`peak_source`).

Every result has the training state one rank holds (`state_bytes_per_rank`: parameters, gradients, optimizer
state; under FSDP its shards) and the largest rank's peak memory (CUDA max allocated on a GPU, peak RSS on a CPU).
With `--snapshots`, each save between two steps: the time training is blocked per save (in `save()` and waiting for
its copy to host memory before the next optimizer step), every rank's stall (the save and the next step beyond its
median step), and the time until the save is complete (sharded: every rank writing its shards, rank 0 committing
last).

`--baseline nanogpt` also times nanoGPT's training loop (as its train.py runs on a CPU) around the same model,
alternating one step of each, and reports the median of the per-pair time ratios. On a machine whose speed drifts
by 10-30% from minute to minute (shared CPUs), that ratio holds still where separate runs do not.

`--scaling` (under torchrun) measures scaling efficiency the same way: each round, rank 0 first takes a step of
a one-process trainer of the same config while the other ranks wait, then all ranks take a step together; the
efficiency is the median over rounds of (one-process step time / all-ranks step time), i.e. the tokens/s of all
ranks over N x the one-process tokens/s.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the project's root: main.py, mingpt/

import argparse
import dataclasses
import json
import logging
import resource
import statistics
import sys
import tempfile
import time
from typing import Optional

import torch
import torch.distributed as dist

import main
from char_dataset import CharCorpus
from mingpt.distributed import process_group as distributed
from mingpt.distributed.process_group import DistContext
from mingpt.errors import UsageError
from mingpt.optim import decay_groups
from mingpt.parallel.state import is_dtensor
from mingpt.reporting import logs as reporting
from model import GPT
from trainer import Trainer, TrainerConfig

log = logging.getLogger("bench")


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=30, help="timed optimizer steps")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps first (allocator, compile, buckets)")
    parser.add_argument("--peak-tflops", type=float, default=None,
                        help="peak per process; default: the GPU's datasheet peak if known, else measured")
    parser.add_argument("--snapshots", type=int, default=0, help="also time this many snapshot saves")
    parser.add_argument("--json", default=None, help="also write the result to this file")
    comparison = parser.add_mutually_exclusive_group()
    comparison.add_argument("--baseline", choices=["nanogpt"], default=None,
                            help="also time nanoGPT's CPU training loop, alternating steps (1 CPU process)")
    comparison.add_argument("--scaling", action="store_true",
                            help="under torchrun: also time one process alone, alternating rounds")
    return parser.parse_known_args(argv)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# Dense (no structured sparsity) peak TFLOP/s of one GPU, from NVIDIA's datasheets: bf16 (= fp16) tensor cores,
# TF32 tensor cores, plain fp32. Matched against torch.cuda.get_device_name() case-insensitively, first match wins
# (so the more specific names come first; "NVIDIA H100 80GB HBM3" is the SXM part).
KNOWN_PEAKS: tuple[tuple[str, str, dict[str, float]], ...] = (
    ("GH200", "NVIDIA GH200", {"bf16": 989, "tf32": 494, "fp32": 67}),
    ("H200 NVL", "NVIDIA H200 NVL", {"bf16": 835, "tf32": 418, "fp32": 60}),
    ("H200", "NVIDIA H200 SXM", {"bf16": 989, "tf32": 494, "fp32": 67}),
    ("H100 NVL", "NVIDIA H100 NVL", {"bf16": 835, "tf32": 418, "fp32": 60}),
    ("H100 PCIe", "NVIDIA H100 PCIe", {"bf16": 756, "tf32": 378, "fp32": 51}),
    ("H100", "NVIDIA H100 SXM", {"bf16": 989, "tf32": 494, "fp32": 67}),
    ("A100", "NVIDIA A100", {"bf16": 312, "tf32": 156, "fp32": 19.5}),
)


def known_peak_tflops(device_name: str, dtype: torch.dtype, tf32: bool = True) -> Optional[tuple[float, str]]:
    """(datasheet peak TFLOP/s, what it is) for a GPU named `device_name` training in `dtype`, or None if unknown.

    A MIG slice gets None: it has a fraction of the GPU, which its name does not say exactly."""
    name = device_name.lower()
    if "mig" in name.split():
        return None
    if dtype in (torch.bfloat16, torch.float16):  # the same tensor-core rate on these GPUs
        kind, label = "bf16", "bf16" if dtype == torch.bfloat16 else "fp16"
    else:
        kind = label = "tf32" if tf32 else "fp32"
    for pattern, model, peaks in KNOWN_PEAKS:
        if pattern.lower() in name:
            return float(peaks[kind]), f"datasheet: {model}, dense {label}"
    return None


def peak_tflops(given: Optional[float], device: torch.device, dtype: torch.dtype) -> tuple[float, str]:
    """(peak TFLOP/s per process, where it comes from): given, a datasheet peak, or a measured matmul."""
    if given:
        return given, "given"
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        known = known_peak_tflops(name, dtype, tf32=torch.backends.cuda.matmul.allow_tf32)
        if known is not None:
            return known
        log.warning("no datasheet peak known for %s: MFU is against a measured matmul, which reads 15-30%% high "
                    "on a GPU; pass --peak-tflops for the real one", name)
    return measure_peak_tflops(device, dtype), "measured matmul"


def measure_peak_tflops(device: torch.device, dtype: torch.dtype) -> float:
    """Best of several large matmuls in the training dtype: what this process can get from its device."""
    size = 8192 if device.type == "cuda" else 1024
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    best = float("inf")
    for _ in range(10 if device.type == "cuda" else 5):
        _sync(device)
        start = time.perf_counter()
        a @ b
        _sync(device)
        best = min(best, time.perf_counter() - start)
    return 2 * size**3 / best / 1e12


def time_steps(trainer: Trainer, steps: int) -> list[float]:
    times = []
    for _ in range(steps):
        _sync(trainer.ctx.device)
        start = time.perf_counter()
        trainer.train_step()
        _sync(trainer.ctx.device)
        times.append(time.perf_counter() - start)
    return times


class NanoGPTLoop:
    """nanoGPT's training loop as its train.py runs on a CPU, around the same model: a side-by-side reference.

    What its loop does there, per optimizer step: the forward pass, then the next batch (random windows, each
    sliced and stacked in Python), backward, gradient clipping with torch's defaults (foreach), `AdamW.step()`
    with torch's defaults on a CPU (nanoGPT asks for the fused kernel only on CUDA, and torch then picks the
    per-parameter loop), `zero_grad(set_to_none=True)`, and `loss.item()` (its CPU recipe logs every step).
    Its GradScaler is disabled outside fp16 and its autocast is a null context in fp32, so both are left out.
    The model is this project's GPT, the same network as nanoGPT's (pre-LayerNorm, flash attention, exact GELU,
    tied embeddings, no biases in the recipe). Windows are sliced from an int64 copy of the training ids, not from a
    NumPy memmap converted per window as nanoGPT does, which if anything makes this loop a little faster than nanoGPT.
    """

    def __init__(self, cfg, corpus: CharCorpus) -> None:
        tc, oc = cfg.trainer_config, cfg.optimizer_config
        self.block_size = cfg.data_config.block_size
        self.batch_size, self.accum, self.clip = tc.batch_size, tc.grad_accum_steps, tc.grad_norm_clip
        # nanoGPT's attention is torch's scaled_dot_product_attention, whatever gpt_config.attention says here.
        gpt_cfg = dataclasses.replace(cfg.gpt_config, vocab_size=len(corpus.vocab), block_size=self.block_size,
                                      attention="sdpa")
        torch.manual_seed(tc.seed)
        self.model = GPT(gpt_cfg)
        self.optimizer = torch.optim.AdamW(decay_groups(self.model.named_parameters(), oc.weight_decay),
                                           lr=oc.learning_rate, betas=(oc.beta1, oc.beta2), eps=oc.eps)
        self.learning_rate = oc.learning_rate
        self.data = torch.from_numpy(corpus.ids(0, corpus.n_train).astype("int64"))
        self.x, self.y = self._batch()

    def _batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        starts = torch.randint(self.data.numel() - self.block_size, (self.batch_size,))
        x = torch.stack([self.data[i : i + self.block_size] for i in starts])
        y = torch.stack([self.data[i + 1 : i + 1 + self.block_size] for i in starts])
        return x, y

    def train_step(self) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = self.learning_rate  # nanoGPT sets the scheduled rate every step
        for _ in range(self.accum):
            _, loss = self.model(self.x, self.y)
            loss = loss / self.accum
            self.x, self.y = self._batch()
            loss.backward()
        if self.clip > 0:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        loss.item()


def time_alternating(trainer: Trainer, baseline: NanoGPTLoop, steps: int) -> tuple[list[float], list[float]]:
    """One step of each in turn, so that both see the same machine (its speed drifts over seconds)."""
    ours, theirs = [], []
    for _ in range(steps):
        ours += time_steps(trainer, 1)
        start = time.perf_counter()
        baseline.train_step()
        theirs.append(time.perf_counter() - start)
    return ours, theirs


def time_scaling(trainer: Trainer, solo: Optional[Trainer], steps: int) -> tuple[list[float], list[float]]:
    """Per round: rank 0 alone steps `solo` while the other ranks wait in a barrier, then all ranks step together,
    twice: the first together step is not timed. It takes up what training never has: ranks released by a barrier
    at different moments (gloo's threads wake 1-5 ms apart) and the idle ranks' cold caches."""
    together, alone = [], []
    for _ in range(steps):
        dist.barrier()
        if solo is not None:
            alone += time_steps(solo, 1)
        dist.barrier()
        trainer.train_step()
        together += time_steps(trainer, 1)
    return together, alone


def time_snapshots(trainer: Trainer, saves: int, step_s: float) -> dict:
    """Each save between two steps, as in training: the training thread's time the snapshot costs
    (Checkpointer.blocked_s: in save() and waiting for its staging copy before the next optimizer step; none on a
    rank that does not write), the save with the step after it (beyond this rank's median step `step_s`: its stall,
    which under DDP reaches every rank through that step's all-reduce), and the time until the snapshot is
    complete (the next step running meanwhile). Collective: rank 0's numbers, with every rank's stall."""
    checkpoints = trainer.checkpoints
    blocked, around, total = [], [], []
    for _ in range(saves):
        trainer.train_step()
        saved_before = len(checkpoints.blocked_s)
        start = time.perf_counter()
        checkpoints.save(trainer.step, "benchmark")
        trainer.train_step()  # its update waits for a staging copy still reading the weights
        around.append(time.perf_counter() - start)
        checkpoints.wait()
        total.append(time.perf_counter() - start)
        blocked.append(sum(checkpoints.blocked_s[saved_before:]))  # read after the step: its wait is added there
    stalls = trainer.ctx.gather_objects({"rank": trainer.ctx.rank, "blocked_s": [round(b, 4) for b in blocked],
                                         "stall_s": [round(a - step_s, 4) for a in around]})
    return {
        "location": checkpoints.location,
        "saves": saves,
        "blocked_s_median": round(statistics.median(blocked), 4),
        "blocked_s": [round(b, 4) for b in blocked],
        "save_and_next_step_s_median": round(statistics.median(around), 4),
        "written_s_median": round(statistics.median(total), 4),
        "ranks": [{**rank, "stall_s_median": round(statistics.median(rank["stall_s"]), 4)} for rank in stalls],
    }


def time_training(args, cfg, corpus: CharCorpus, ctx: DistContext, trainer: Trainer) -> tuple[list[float], dict]:
    """Warm-up, then the timed steps; with --baseline or --scaling, alternating with the reference's steps.

    Returns the step times and what the comparison adds to the result (rank 0's view)."""
    if args.baseline:
        if ctx.distributed or ctx.device.type != "cpu":
            raise UsageError("--baseline nanogpt compares one process on a CPU (nanoGPT's CPU loop)")
        baseline = NanoGPTLoop(cfg, corpus)
        time_alternating(trainer, baseline, args.warmup)
        times, baseline_times = time_alternating(trainer, baseline, args.steps)
        return times, {"baseline": summarize_baseline(trainer, times, baseline_times)}
    if args.scaling:
        if not ctx.distributed:
            raise UsageError("--scaling compares the processes of a torchrun job with one of them alone: "
                             "run benchmarks/bench.py under torchrun")
        solo = None
        if ctx.is_main:
            alone = DistContext.single_process(ctx.device)  # no DDP or FSDP, no collectives
            unwrapped = dataclasses.replace(cfg.parallel_config, strategy="ddp")
            solo = main.build_trainer(dataclasses.replace(cfg, parallel_config=unwrapped), corpus, alone, run_dir=None,
                                      with_snapshots=False)
        time_scaling(trainer, solo, args.warmup)
        times, solo_times = time_scaling(trainer, solo, args.steps)
        return times, {"scaling": summarize_scaling(solo, times, solo_times, ctx.world_size)} if solo else {}
    time_steps(trainer, args.warmup)
    return time_steps(trainer, args.steps), {}


def timed_config(cfg, args: argparse.Namespace):
    """The config of the timed trainer: its schedule spans exactly the benchmark's steps, and its snapshots (with
    --snapshots) go to a temporary folder unless a snapshot_path was given."""
    steps = args.warmup + args.steps + 2 * args.snapshots + 1  # a step before and after each save
    location = cfg.trainer_config.snapshot_path
    if args.snapshots and (location == TrainerConfig().snapshot_path or not location):
        location = tempfile.mkdtemp(prefix="bench-snapshots-")
    trainer_cfg = dataclasses.replace(cfg.trainer_config, max_steps=steps, max_epochs=10**9, snapshot_path=location)
    return dataclasses.replace(cfg, trainer_config=trainer_cfg)


def run(args: argparse.Namespace, overrides: list[str]) -> Optional[dict]:
    cfg = main.load_config(overrides)
    corpus = CharCorpus.load(cfg.data_config, build=distributed.local_rank() == 0)
    ctx: DistContext = distributed.setup_distributed()
    try:
        reporting.setup_logging(ctx.rank, None)
        logging.getLogger().setLevel(logging.WARNING)  # the benchmark prints its own result
        distributed.configure_device(ctx.device)
        cfg = timed_config(cfg, args)
        trainer = main.build_trainer(cfg, corpus, ctx, run_dir=None, with_snapshots=bool(args.snapshots))
        times, comparison = time_training(args, cfg, corpus, ctx, trainer)
        snapshot = time_snapshots(trainer, args.snapshots, statistics.median(times)) if args.snapshots else None
        memory = memory_per_rank(trainer)  # collective: every rank's, the largest reported
        result = None
        if ctx.is_main:
            result = {**summarize(args, cfg, corpus, trainer, times, snapshot), **memory, **comparison}
    except BaseException:
        distributed.abandon_distributed()  # no collective teardown: a peer may never reach it
        raise
    distributed.leave_distributed()  # together, after the last collective
    return result


def _local_bytes(tensor: torch.Tensor) -> int:
    local = tensor.to_local() if is_dtensor(tensor) else tensor
    return local.numel() * local.element_size()


def state_bytes(trainer: Trainer) -> dict:
    """The training state this rank holds: parameters, gradients (one per parameter element, as during a step;
    its shard under FSDP) and optimizer state (AdamW's two moments and step counts)."""
    held = {id(p): p for module in trainer.parallel.modules for p in module.parameters()}  # its stages, once each
    params = [p for p in held.values() if p.requires_grad]
    parameters = sum(_local_bytes(p) for p in params)
    gradients = sum(_local_bytes(p) // p.element_size() * 4 for p in params)  # fp32 gradients (reduce dtype)
    optimizer = sum(_local_bytes(value) for state in trainer.optimizers.state.values()
                    for value in state.values() if isinstance(value, torch.Tensor))
    return {"parameters": parameters, "gradients": gradients, "optimizer": optimizer,
            "total": parameters + gradients + optimizer}


def peak_memory_bytes(device: torch.device) -> int:
    """CUDA's max allocated on a GPU; on a CPU the process's peak resident set (ru_maxrss: everything the
    process ever held, imports and data included)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def memory_per_rank(trainer: Trainer) -> dict:
    """Collective. The largest rank's state bytes and peak memory."""
    mine = {"state_bytes_per_rank": state_bytes(trainer), "peak_memory_bytes": peak_memory_bytes(trainer.ctx.device)}
    everyone = trainer.ctx.gather_objects(mine)
    return {"state_bytes_per_rank": max((r["state_bytes_per_rank"] for r in everyone), key=lambda b: b["total"]),
            "peak_memory_bytes": max(r["peak_memory_bytes"] for r in everyone),
            "peak_memory_kind": "cuda max allocated" if trainer.ctx.device.type == "cuda" else "peak RSS"}


def summarize(args, cfg, corpus: CharCorpus, trainer: Trainer, times: list[float], snapshot: Optional[dict]) -> dict:
    ctx = trainer.ctx
    median = statistics.median(times)
    tokens_per_s = trainer.tokens_per_step / median
    model_config = main.model_config(cfg, corpus, ctx.device)
    with torch.device("meta"):  # the whole model's shape, allocating nothing (a pipeline rank holds some blocks)
        whole = GPT(model_config)
    flops_per_token = whole.flops_per_token()
    peak, peak_source = peak_tflops(args.peak_tflops, ctx.device, trainer.amp_dtype)
    result = {
        "device": torch.cuda.get_device_name(ctx.device) if ctx.device.type == "cuda" else "cpu",
        "world_size": ctx.world_size,
        "threads_per_process": torch.get_num_threads(),
        "precision": str(trainer.amp_dtype).removeprefix("torch."),
        "strategy": cfg.parallel_config.strategy,
        "layout": trainer.parallel.name,  # the strategy's name, or the degrees on a device mesh ("pp 2 x dp_shard 2")
        "activation_checkpointing": cfg.parallel_config.activation_checkpointing,
        "compile": cfg.parallel_config.compile,
        "attention": cfg.gpt_config.attention,
        "model": {k: getattr(model_config, k) for k in ("n_layer", "n_head", "n_embd", "block_size")},
        "n_params": whole.num_params(),
        "batch_size_per_process": cfg.trainer_config.batch_size,
        "grad_accum_steps": cfg.trainer_config.grad_accum_steps,
        "tokens_per_step": trainer.tokens_per_step,
        "timed_steps": len(times),
        "step_ms_median": round(1000 * median, 2),
        "step_ms_p10": round(1000 * statistics.quantiles(times, n=10)[0], 2),
        "step_ms_p90": round(1000 * statistics.quantiles(times, n=10)[-1], 2),
        "tokens_per_s": round(tokens_per_s, 1),
        "flops_per_token": flops_per_token,
        "peak_tflops_per_process": round(peak, 3),
        "peak_source": peak_source,  # "given", "datasheet: <GPU>, dense <precision>" or "measured matmul"
        "mfu": round(flops_per_token * tokens_per_s / (ctx.world_size * peak * 1e12), 4),
    }
    if snapshot is not None:
        snapshot["blocked_over_step"] = round(snapshot["blocked_s_median"] / median, 3)
        result["snapshot"] = snapshot
    return result


def summarize_baseline(trainer: Trainer, ours: list[float], theirs: list[float]) -> dict:
    median = statistics.median(theirs)
    return {
        "name": "nanoGPT CPU loop",
        "step_ms_median": round(1000 * median, 2),
        "tokens_per_s": round(trainer.tokens_per_step / median, 1),
        # > 1: this trainer is faster. The median of per-pair ratios, not a ratio of medians.
        "speedup_paired_median": round(statistics.median(t / o for o, t in zip(ours, theirs)), 3),
    }


def summarize_scaling(solo: Trainer, together: list[float], alone: list[float], world_size: int) -> dict:
    median = statistics.median(alone)
    return {
        "one_process_step_ms_median": round(1000 * median, 2),
        "one_process_tokens_per_s": round(solo.tokens_per_step / median, 1),
        # tokens/s of all ranks / (world_size x tokens/s of one alone); the per-process batch is the same
        "efficiency_paired_median": round(statistics.median(a / t for t, a in zip(together, alone)), 3),
        "world_size": world_size,
    }


def cli(argv: list[str]) -> int:
    args, overrides = parse_args(argv)
    try:
        result = run(args, overrides)
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if result is not None:
        text = json.dumps(result, indent=2)
        print(text)
        if args.json:
            with open(args.json, "w", encoding="utf-8") as f:
                f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(cli(sys.argv[1:]))
