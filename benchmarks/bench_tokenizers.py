"""Launch time and peak memory of `data_config.tokenizer=bpe` against `char` (issue 43; benchmarks/tokenizers.md).

    python benchmarks/bench_tokenizers.py                              # the bundled text, cold, 3 pairs
    python benchmarks/bench_tokenizers.py --corpus /tmp/code_corpus.txt --rounds 2 --warm --json r.json

Each launch is the real command, `python -m torch.distributed.run --standalone --nproc_per_node=2 main.py` on a
1-block model for 1 step, with a fresh cache folder (cold) or one built before the rounds (`--warm`). The two
tokenizers run in turn (A B A B ..., the order swapped every round), so that load from elsewhere falls on both.
Measured from the outside: the launch's wall seconds, its CPU seconds (user + system of torchrun and its workers:
what load from elsewhere changes least), and the peak resident set of its largest process (wait4's ru_maxrss of
torchrun: the largest of it and its workers). Reported: medians and min-max of each, the median of the per-round
ratios of wall times, and the load average at the start and the end (the machine may be shared).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parent.parent
TOKENIZERS = ("bpe", "char")


def command(corpus: Path, cache: Path, tokenizer: str, run: Path) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "main.py",
            f"data_config.path={corpus}", f"data_config.cache_dir={cache}", f"data_config.tokenizer={tokenizer}",
            "data_config.block_size=32", "gpt_config.n_layer=1", "gpt_config.n_head=2", "gpt_config.n_embd=32",
            "trainer_config.max_steps=1", "trainer_config.eval_batches=1", "trainer_config.eval_every_steps=0",
            "trainer_config.mixed_precision=fp32", f"trainer_config.snapshot_path={run}/snapshots",
            f"hydra.run.dir={run}"]


def launch(corpus: Path, cache: Path, tokenizer: str, work: Path) -> tuple[float, float, float]:
    """(wall s, CPU s, peak MiB of the largest process) of one launch; raises if it fails."""
    run = Path(tempfile.mkdtemp(dir=work, prefix=f"run-{tokenizer}-"))
    with open(run / "output.log", "wb") as log:
        start = time.perf_counter()
        process = subprocess.Popen(command(corpus, cache, tokenizer, run), cwd=ROOT, stdout=log,
                                   stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(process.pid, 0)
        wall = time.perf_counter() - start
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"the {tokenizer} launch failed: see {run / 'output.log'}")
    shutil.rmtree(run)
    return wall, usage.ru_utime + usage.ru_stime, usage.ru_maxrss / 1024


def spread(values: list[float], digits: int = 2) -> dict:
    return {"median": round(statistics.median(values), digits), "min": round(min(values), digits),
            "max": round(max(values), digits), "all": [round(v, digits) for v in values]}


def bench(corpus: Path, rounds: int, warm: bool, work: Path) -> dict:
    caches = {name: work / f"cache-{name}" for name in TOKENIZERS}
    if warm:
        for name in TOKENIZERS:
            launch(corpus, caches[name], name, work)  # builds the cache (and warms the page cache)
    walls: dict[str, list[float]] = {name: [] for name in TOKENIZERS}
    peaks: dict[str, list[float]] = {name: [] for name in TOKENIZERS}
    cpus: dict[str, list[float]] = {name: [] for name in TOKENIZERS}
    load = [os.getloadavg()[0]]
    for i in range(rounds):
        for name in TOKENIZERS if i % 2 == 0 else reversed(TOKENIZERS):
            if not warm:
                shutil.rmtree(caches[name], ignore_errors=True)
            wall, cpu, peak = launch(corpus, caches[name], name, work)
            walls[name].append(wall)
            cpus[name].append(cpu)
            peaks[name].append(peak)
            print(f"  round {i + 1} {name}: {wall:.2f} s, {cpu:.1f} CPU s, {peak:.0f} MiB", flush=True)
    load.append(os.getloadavg()[0])
    ratios = [b / c for b, c in zip(walls["bpe"], walls["char"])]
    return {"corpus": str(corpus), "bytes": corpus.stat().st_size, "cache": "warm" if warm else "cold",
            "rounds": rounds, "load_average": load, "ratio_bpe_char": spread(ratios),
            **{f"{name}_wall_s": spread(walls[name]) for name in TOKENIZERS},
            **{f"{name}_cpu_s": spread(cpus[name], 1) for name in TOKENIZERS},
            **{f"{name}_peak_mib": spread(peaks[name], 0) for name in TOKENIZERS}}


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--corpus", type=Path, default=ROOT / "data" / "input.txt")
    parser.add_argument("--rounds", type=int, default=3, help="pairs of launches (bpe and char in turn)")
    parser.add_argument("--warm", action="store_true", help="caches built once before the rounds")
    parser.add_argument("--json", type=Path, help="also write the numbers here")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bench-tokenizers-") as work:
        report = bench(args.corpus.resolve(), args.rounds, args.warm, Path(work))
    print(json.dumps(report, indent=1))
    if args.json:
        args.json.write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
