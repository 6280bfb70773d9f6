"""Benchmark the data layer: encoding throughput, what a large corpus adds to a launch, the epoch order's cost.

    python benchmarks/bench_data.py                              # all three, on a 340 MB corpus of 34 files (generated)
    python benchmarks/bench_data.py --only encode --size-mb 100  # encoding: mostly-ASCII and mixed-script, one core
    python benchmarks/bench_data.py --only launch --rounds 5  # torchrun, 2 procs, 5 steps: small vs large
    python benchmarks/bench_data.py --only order  # the epoch order: time and memory per index, by corpus size
    python benchmarks/bench_data.py --json result.json           # also write the numbers as JSON

**encode**: the cache build of a generated corpus, in this process (one core: OMP/MKL threads play no part),
median of `--rounds` builds into a fresh cache folder. Two corpora: "mostly ASCII" (tiny-shakespeare with one
character in 200 replaced by one of 400 accented, Greek, Cyrillic and CJK characters: a vocabulary over 256, so
uint16 ids) and "mixed script" (words of Latin, Greek, Cyrillic, Arabic, CJK and emoji). MB/s of UTF-8 read.

**launch**: `torchrun --standalone --nproc_per_node=2 main.py preset=cpu trainer_config.max_steps=5` (with one
validation batch), whole launches, alternating in each round: tiny-shakespeare; the large corpus with an empty
cache folder (first launch: local rank 0 builds, rank 1 waits); the large corpus again with its cache warm and a
new snapshot folder. Reported: the median wall time of each and the median of the per-round differences to
tiny-shakespeare, and the peak RSS of the launch's largest process (the kernel's RUSAGE_CHILDREN maximum over
torchrun and its workers: a worker, the larger of the two).

**order**: `EpochOrder` over 10^4 ... 10^12 windows: nanoseconds per index (blocks of 4096, as the sampler asks)
and the sampler's peak Python allocation while it yields 100,000 indices.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the project's root: main.py, mingpt/

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

import numpy as np

from char_dataset import EpochOrder, ResumableDistributedSampler
from mingpt import PROJECT_DIR
from mingpt.data.token_cache import open_tokens

SHAKESPEARE = PROJECT_DIR / "data" / "input.txt"
EXTRA_CHARS = ([chr(c) for c in range(0xC0, 0x180)] + [chr(c) for c in range(0x391, 0x3CA) if c != 0x3A2]
               + [chr(c) for c in range(0x410, 0x450)] + [chr(c) for c in range(0x4E00, 0x4E00 + 96)])[:400]


def mostly_ascii(folder: Path, size_mb: float, files: int) -> Path:
    """`files` files of tiny-shakespeare copies, one character in 200 replaced by a non-ASCII one."""
    base = SHAKESPEARE.read_text(encoding="utf-8")
    rng = random.Random(0)
    variants = []
    for _ in range(8):
        chars = list(base)
        for i in rng.sample(range(len(chars)), len(chars) // 200):
            chars[i] = rng.choice(EXTRA_CHARS)
        variants.append("".join(chars).encode("utf-8"))
    return _write_files(folder, variants, size_mb, files)


def mixed_script(folder: Path, size_mb: float, files: int) -> Path:
    """Words of six scripts, each word in one script, lines of ~12 words."""
    rng = random.Random(1)
    scripts = [(0x61, 26), (0x3B1, 25), (0x430, 32), (0x627, 28), (0x4E00, 3000), (0x1F600, 80)]
    words = ["".join(chr(start + rng.randrange(n)) for _ in range(rng.randint(1, 8)))
             for start, n in scripts for _ in range(500)]
    lines = [" ".join(rng.choice(words) for _ in range(12)) for _ in range(20_000)]
    return _write_files(folder, ["\n".join(lines).encode("utf-8")], size_mb, files)


def _write_files(folder: Path, pieces: list[bytes], size_mb: float, files: int) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    per_file, written = int(size_mb * 1e6 / files), 0
    for n in range(files):
        with open(folder / f"part-{n:03d}.txt", "wb") as f:
            size = 0
            while size < per_file:
                piece = pieces[written % len(pieces)][: per_file - size]
                piece = piece[: len(piece.decode("utf-8", errors="ignore").encode("utf-8"))]  # whole characters
                if not piece:  # fewer bytes left than the next character has
                    break
                f.write(piece)
                size, written = size + len(piece), written + 1
    return folder


def bench_encode(work: Path, size_mb: float, rounds: int) -> dict:
    results = {}
    for name, make in (("mostly_ascii", mostly_ascii), ("mixed_script", mixed_script)):
        folder = make(work / name, size_mb, files=max(1, int(size_mb // 10)))
        size = sum(p.stat().st_size for p in folder.iterdir())
        times, tokens = [], None
        for _ in range(rounds):
            cache = work / "encode-cache"
            shutil.rmtree(cache, ignore_errors=True)
            start = time.perf_counter()
            tokens = open_tokens(str(folder), "\n", cache)
            times.append(time.perf_counter() - start)
        shutil.rmtree(work / "encode-cache", ignore_errors=True)
        rates = [size / t / 1e6 for t in times]
        results[name] = {"bytes": size, "characters": tokens.n_tokens, "vocabulary": len(tokens.vocab),
                         "dtype": tokens.dtype.name, "seconds": [round(t, 2) for t in times],
                         "mb_per_s_median": round(statistics.median(rates), 1),
                         "mb_per_s_range": [round(min(rates), 1), round(max(rates), 1)]}
        print(f"encode {name}: {size / 1e6:.0f} MB, {tokens.n_tokens:,} characters, vocabulary {len(tokens.vocab)} "
              f"({tokens.dtype.name}): median {results[name]['mb_per_s_median']} MB/s "
              f"(range {results[name]['mb_per_s_range'][0]}-{results[name]['mb_per_s_range'][1]}) over {rounds}")
        shutil.rmtree(folder)
    return results


LAUNCH_ARGS = ["preset=cpu", "trainer_config.max_steps=5", "trainer_config.eval_batches=1",
               "trainer_config.log_every_steps=5", "trainer_config.progress=off"]
RUSAGE_WRAPPER = ("import resource, subprocess, sys; code = subprocess.call(sys.argv[1:]); "
                  "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss); sys.exit(code)")


def launch(work: Path, tag: str, data: str, cache: Path) -> tuple[float, float]:
    """One whole launch: (wall seconds, peak RSS in MB of its largest process)."""
    run = work / f"run-{tag}-{time.monotonic_ns()}"
    command = [sys.executable, "-c", RUSAGE_WRAPPER, sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc_per_node=2", str(PROJECT_DIR / "main.py"), *LAUNCH_ARGS, f"data_config.path={data}",
               f"data_config.cache_dir={cache}", f"trainer_config.snapshot_path={run / 'snaps'}",
               f"hydra.run.dir={run}"]
    env = {**os.environ, "TMPDIR": str(work), "OMP_NUM_THREADS": "1"}
    start = time.perf_counter()
    result = subprocess.run(command, capture_output=True, text=True, env=env, cwd=work)
    seconds = time.perf_counter() - start
    if result.returncode != 0:
        raise SystemExit(f"launch {tag} failed:\n{result.stderr[-3000:]}")
    shutil.rmtree(run, ignore_errors=True)
    return seconds, int(result.stdout.split()[-1]) / 1024


def bench_launch(work: Path, size_mb: float, rounds: int) -> dict:
    corpus = mostly_ascii(work / "large", size_mb, files=max(1, int(size_mb // 10)))
    rows: dict[str, list[tuple[float, float]]] = {"tiny": [], "large_cold": [], "large_warm": []}
    for n in range(rounds):
        cold_cache = work / f"cold-cache-{n}"
        order = ["tiny", "large_cold", "large_warm"] if n % 2 == 0 else ["large_cold", "large_warm", "tiny"]
        for tag in order:
            if tag == "tiny":
                rows[tag].append(launch(work, tag, str(SHAKESPEARE), work / "tiny-cache"))
            else:  # the warm launch reuses the cache the cold one of this round built
                rows[tag].append(launch(work, tag, str(corpus), cold_cache))
        shutil.rmtree(cold_cache, ignore_errors=True)
        print(f"round {n + 1}: " + ", ".join(f"{tag} {rows[tag][-1][0]:.1f} s {rows[tag][-1][1]:.0f} MB"
                                             for tag in rows), flush=True)
    shutil.rmtree(corpus)
    result = {"corpus_mb": size_mb, "rounds": rounds}
    for tag, values in rows.items():
        result[tag] = {"seconds_median": round(statistics.median(v[0] for v in values), 2),
                       "peak_rss_mb_median": round(statistics.median(v[1] for v in values), 1),
                       "seconds": [round(v[0], 2) for v in values], "peak_rss_mb": [round(v[1]) for v in values]}
        if tag != "tiny":
            extra = [v[0] - t[0] for v, t in zip(values, rows["tiny"])]
            more_rss = [v[1] - t[1] for v, t in zip(values, rows["tiny"])]
            result[tag].update(extra_seconds_median=round(statistics.median(extra), 2),
                               extra_seconds_range=[round(min(extra), 2), round(max(extra), 2)],
                               extra_rss_mb_median=round(statistics.median(more_rss), 1),
                               extra_rss_mb_range=[round(min(more_rss)), round(max(more_rss))])
            print(f"launch {tag}: +{result[tag]['extra_seconds_median']} s "
                  f"({result[tag]['extra_seconds_range'][0]} to {result[tag]['extra_seconds_range'][1]}), "
                  f"+{result[tag]['extra_rss_mb_median']} MB peak RSS over tiny-shakespeare "
                  f"({result['tiny']['seconds_median']} s, {result['tiny']['peak_rss_mb_median']} MB)")
    return result


def bench_order() -> dict:
    result = {}
    for exponent in (4, 6, 9, 12):
        n = 10**exponent
        order = EpochOrder(n, seed=1337, epoch=3)
        block = np.arange(4096, dtype=np.int64) + n // 3
        block = block[block < n]
        times = []
        for _ in range(7):
            start = time.perf_counter()
            for _ in range(50):
                order(block)
            times.append((time.perf_counter() - start) / (50 * block.size) * 1e9)
        sampler = ResumableDistributedSampler(n, 2, 1, seed=1337)
        sampler.set_epoch(3, start=n // 3)
        tracemalloc.start()
        iterator, picked = iter(sampler), 0
        for _ in range(min(100_000, len(sampler))):
            next(iterator)
            picked += 1
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        result[f"1e{exponent}"] = {"ns_per_index_median": round(statistics.median(times), 1),
                                   "ns_per_index_range": [round(min(times), 1), round(max(times), 1)],
                                   "sampler_peak_bytes": peak, "indices_drawn": picked}
        print(f"order n=1e{exponent}: {result[f'1e{exponent}']['ns_per_index_median']} ns per index "
              f"(range {min(times):.1f}-{max(times):.1f}), sampler peak {peak / 1024:.0f} KiB over {picked:,} indices")
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", default="encode,launch,order", help="comma-separated: encode, launch, order")
    parser.add_argument("--size-mb", type=float, default=340.0, help="size of each generated corpus")
    parser.add_argument("--rounds", type=int, default=5, help="builds (encode) or launch triples (launch)")
    parser.add_argument("--json", type=Path, default=None, help="write the results here too")
    args = parser.parse_args()
    parts = set(args.only.split(","))
    result = {}
    with tempfile.TemporaryDirectory(prefix="bench-data-") as tmp:
        work = Path(tmp)
        if "encode" in parts:
            result["encode"] = bench_encode(work, args.size_mb, args.rounds)
        if "launch" in parts:
            result["launch"] = bench_launch(work, args.size_mb, args.rounds)
        if "order" in parts:
            result["order"] = bench_order()
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
