"""Benchmark the real training step: median step time, tokens/s (all ranks together), MFU, snapshot blocking.

    python bench.py preset=nanogpt_cpu                                   # 1 process (threads: OMP_NUM_THREADS)
    OMP_NUM_THREADS=1 python bench.py preset=nanogpt_cpu                 # 1 process, 1 thread
    torchrun --standalone --nproc_per_node=2 bench.py preset=nanogpt_cpu # 2 processes x 1 thread
    python bench.py --snapshots 3                                        # + time training is blocked per snapshot
    python bench.py --steps 50 --json result.json trainer_config.compile=true gpt_config.n_layer=12 ...

Arguments starting with `--` are the benchmark's own; everything else is a Hydra override, exactly as for main.py.
The steps timed are `Trainer` steps of the same model, data path, optimizer, DDP wrapper and mixed precision that
main.py builds (through `main.build_trainer`), after warm-up steps that are not timed.

MFU = model FLOPs per token (6 N + 12 n_layer n_embd block_size) x tokens/s / (processes x peak). The peak is
`--peak-tflops` per process, or measured here with a large matmul in the training precision.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import tempfile
import time
from typing import Optional

import torch
import torch.distributed as dist

import main
from char_dataset import CharCorpus
from errors import UsageError
from snapshot import SnapshotStore
from trainer import DistContext, Trainer

log = logging.getLogger("bench")


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=30, help="timed optimizer steps")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps first (allocator, compile, buckets)")
    parser.add_argument("--peak-tflops", type=float, default=None, help="peak per process; default: measured")
    parser.add_argument("--snapshots", type=int, default=0, help="also time this many snapshot saves")
    parser.add_argument("--json", default=None, help="also write the result to this file")
    return parser.parse_known_args(argv)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


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


def time_snapshots(trainer: Trainer, saves: int, location: str) -> dict:
    """Training-thread time per snapshot (what blocks training) and the background write time."""
    trainer.snapshots = SnapshotStore(location)
    blocked, total = [], []
    for _ in range(saves):
        trainer.train_step()
        start = time.perf_counter()
        trainer.save_snapshot("benchmark")
        blocked.append(time.perf_counter() - start)
        trainer.wait_for_snapshot()
        total.append(time.perf_counter() - start)
    return {
        "location": location,
        "saves": saves,
        "blocked_s_median": round(statistics.median(blocked), 4),
        "written_s_median": round(statistics.median(total), 4),
    }


def run(args: argparse.Namespace, overrides: list[str]) -> Optional[dict]:
    cfg = main.compose_config(overrides)
    corpus = CharCorpus.load(cfg.data_config)
    ctx: DistContext = main.setup_distributed()
    try:
        main.setup_logging(ctx.rank, None)
        logging.getLogger().setLevel(logging.WARNING)  # the benchmark prints its own result
        main.configure_device(ctx.device)
        trainer = main.build_trainer(cfg, corpus, ctx, run_dir=None, with_snapshots=False)
        trainer.total_steps = args.warmup + args.steps + args.snapshots + 1
        time_steps(trainer, args.warmup)
        times = time_steps(trainer, args.steps)
        snapshot = None
        if args.snapshots:
            location = cfg.trainer_config.snapshot_path
            if location == main.TrainerConfig().snapshot_path or not location:
                location = tempfile.mkdtemp(prefix="bench-snapshots-")
            snapshot = time_snapshots(trainer, args.snapshots, location)
        if ctx.distributed:
            dist.barrier()
        if not ctx.is_main:
            return None
        return summarize(args, cfg, trainer, times, snapshot)
    finally:
        main.teardown_distributed()


def summarize(args, cfg, trainer: Trainer, times: list[float], snapshot: Optional[dict]) -> dict:
    ctx = trainer.ctx
    median = statistics.median(times)
    tokens_per_s = trainer.tokens_per_step / median
    flops_per_token = trainer.raw_model.flops_per_token()
    peak = args.peak_tflops or measure_peak_tflops(ctx.device, trainer.amp_dtype)
    result = {
        "device": torch.cuda.get_device_name(ctx.device) if ctx.device.type == "cuda" else "cpu",
        "world_size": ctx.world_size,
        "threads_per_process": torch.get_num_threads(),
        "precision": str(trainer.amp_dtype).removeprefix("torch."),
        "compile": cfg.trainer_config.compile,
        "model": {k: getattr(trainer.raw_model.config, k) for k in ("n_layer", "n_head", "n_embd", "block_size")},
        "n_params": trainer.raw_model.num_params(),
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
        "peak_source": "given" if args.peak_tflops else "measured matmul",
        "mfu": round(flops_per_token * tokens_per_s / (ctx.world_size * peak * 1e12), 4),
    }
    if snapshot is not None:
        snapshot["blocked_over_step"] = round(snapshot["blocked_s_median"] / median, 3)
        result["snapshot"] = snapshot
    return result


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
