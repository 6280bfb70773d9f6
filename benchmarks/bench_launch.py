"""Benchmark whole processes, as a user runs them: start-up, restart latency, and the training step as each
program's own log reports it, against nanoGPT's train.py.

    python benchmarks/bench_launch.py --only startup  # start-up: 5 launches of 1 step, median and spread
    python benchmarks/bench_launch.py --only startup --nanogpt ../nanoGPT  # paired with nanoGPT's train.py
    python benchmarks/bench_launch.py --only restart --kills 3 --restart-rounds 4  # kill to first step, 4 jobs
    python benchmarks/bench_launch.py --only step --nanogpt ../nanoGPT  # the step: whole runs of both, alternating
    python benchmarks/bench_launch.py --nanogpt ../nanoGPT --json r.json    # all three; also write the numbers as JSON

**startup**: `python main.py preset=nanogpt_cpu trainer_config.max_steps=1` (nanoGPT's CPU recipe, one step, a new
snapshot folder and run directory each time: import, config, data, model, one step, the end-of-run validation,
snapshot, plot and sample, exit), wall time from the outside and the peak RSS from wait4 (the larger of the
process's and its plot child's, which is far smaller). With `--nanogpt DIR` (a checkout of karpathy/nanoGPT; its
shakespeare_char data is prepared from data/input.txt when missing) each round also runs nanoGPT's own `train.py`
with its README's CPU settings and `--max_iters=1`, the two in turn, the order swapped every round; reported: each
one's median and the median of the per-round ratios (ours / nanoGPT's). One untimed round first warms the page
cache.

**restart**: `torchrun --standalone --nproc_per_node=2 --max-restarts=K main.py preset=nanogpt_cpu` with a
snapshot every 5 steps; once it has taken 15 steps since its last (re)start, one worker (rank 1 and rank 0 in turn)
is SIGKILLed. Latency: from the kill to the first step logged after torchrun's restart (the step's own time
included), and its parts: to the new worker processes (torchrun noticing, stopping the other worker), to the new
rank 0's first log line (the new processes' start: imports, config, data, process group), to "resumed from"
(model, DDP, snapshot). Each round runs one such job; reported: the latencies and their parts over all jobs, and
the launch itself (from starting torchrun to the first step logged).

**step** (needs `--nanogpt`): 240-step runs of both programs on nanoGPT's CPU recipe, in turn, the order swapped
every round; each program's own step times for steps 30-210 (nanoGPT: `--log_interval=1`, its per-iteration
"time ... ms"; this one: `trainer_config.log_every_steps=10`, the mean ms/step of each 10), their medians, and the
median of the per-round ratios (nanoGPT's step / ours: above 1 is faster than nanoGPT). Whatever each program does
per step counts: data, forward, backward, clipping, the optimizer, logging; the evaluations are outside the window.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the project's root: main.py, mingpt/

import argparse
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Optional

from benchmarks.chaos import children, rank_of, wait_until
from mingpt import PROJECT_DIR

OURS = ["main.py", "preset=nanogpt_cpu", "trainer_config.max_steps=1"]
NANOGPT = ["train.py", "config/train_shakespeare_char.py", "--device=cpu", "--compile=False", "--eval_iters=20",
           "--log_interval=1", "--block_size=64", "--batch_size=12", "--n_layer=4", "--n_head=4", "--n_embd=128",
           "--lr_decay_iters=2000", "--dropout=0.0"]  # its README's CPU recipe (max_iters: 2000 there)


def run_timed(argv: list[str], cwd: Path) -> tuple[float, int]:
    """(wall seconds, peak RSS in bytes) of one whole process; raises if it fails."""
    with tempfile.TemporaryFile() as errors:
        start = time.perf_counter()
        process = subprocess.Popen(argv, cwd=cwd, stdout=subprocess.DEVNULL, stderr=errors)
        _, status, usage = os.wait4(process.pid, 0)
        wall = time.perf_counter() - start
        process.returncode = os.waitstatus_to_exitcode(status)
        if process.returncode != 0:
            errors.seek(0)
            text = errors.read().decode(errors="replace").strip()[-500:]
            raise SystemExit(f"{' '.join(argv[:3])} failed ({process.returncode}): {text}")
    return wall, usage.ru_maxrss * 1024


def prepare_nanogpt(checkout: Path) -> None:
    data = checkout / "data" / "shakespeare_char"
    if not (data / "train.bin").exists():
        shutil.copy(PROJECT_DIR / "data" / "input.txt", data / "input.txt")  # its prepare.py downloads otherwise
        subprocess.run([sys.executable, "prepare.py"], cwd=data, check=True, stdout=subprocess.DEVNULL)


def spread(values: list[float], digits: int = 2) -> dict:
    return {"median": round(statistics.median(values), digits), "min": round(min(values), digits),
            "max": round(max(values), digits), "all": [round(v, digits) for v in values]}


def bench_startup(rounds: int, nanogpt: Optional[Path], overrides: list[str]) -> dict:
    scratch = Path(tempfile.mkdtemp(prefix="bench-startup-"))
    ours_times, ours_rss, theirs_times, theirs_rss, ratios = [], [], [], [], []
    try:
        for index in range(rounds + 1):  # round 0: untimed warm-up
            ours = [sys.executable, *OURS, f"trainer_config.snapshot_path={scratch}/s{index}",
                    f"hydra.run.dir={scratch}/o{index}", *overrides]
            theirs = [sys.executable, *NANOGPT, "--max_iters=1", f"--out_dir={scratch}/n{index}"]
            order = [("ours", ours, PROJECT_DIR)] + ([("nanogpt", theirs, nanogpt)] if nanogpt else [])
            results = {name: run_timed(argv, cwd) for name, argv, cwd in (order if index % 2 else order[::-1])}
            if index == 0:
                continue
            ours_times.append(results["ours"][0])
            ours_rss.append(results["ours"][1] / 2**20)
            if nanogpt:
                theirs_times.append(results["nanogpt"][0])
                theirs_rss.append(results["nanogpt"][1] / 2**20)
                ratios.append(results["ours"][0] / results["nanogpt"][0])
            print(f"round {index}: " + ", ".join(f"{k} {v[0]:.2f} s {v[1] / 2**20:.0f} MB" for k, v in results.items()),
                  file=sys.stderr)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    report = {"command": " ".join(["python", *OURS, *overrides]), "rounds": rounds,
              "ours_s": spread(ours_times), "ours_peak_rss_mb": spread(ours_rss, 0)}
    if nanogpt:
        report.update({"nanogpt_s": spread(theirs_times), "nanogpt_peak_rss_mb": spread(theirs_rss, 0),
                       "ratio_ours_to_nanogpt": spread(ratios, 3)})
    return report


# --------------------------------------------------------------------------------------------------------- step
STEP_WINDOW = (30, 210)  # steps timed: after warm-up, before the first of nanoGPT's evaluations at 250


def logged_step_ms(argv: list[str], cwd: Path, pattern: str) -> list[float]:
    """Run a program to the end; the step times its log gives for steps in STEP_WINDOW."""
    result = subprocess.run(argv, cwd=cwd, capture_output=True, text=True)
    if result.returncode != 0:
        raise SystemExit(f"{' '.join(argv[:3])} failed ({result.returncode}): {result.stderr.strip()[-500:]}")
    times = []
    for match in re.finditer(pattern, result.stdout + result.stderr):
        step, ms = int(match.group(1)), float(match.group(2).replace(",", ""))
        if STEP_WINDOW[0] < step <= STEP_WINDOW[1]:
            times.append(ms)
    if not times:
        raise SystemExit(f"no step times in the output of {' '.join(argv[:3])}")
    return times


def bench_step(rounds: int, nanogpt: Path, overrides: list[str]) -> dict:
    scratch = Path(tempfile.mkdtemp(prefix="bench-step-"))
    ours_ms, theirs_ms, ratios = [], [], []
    try:
        for index in range(rounds):
            ours = [sys.executable, "main.py", "preset=nanogpt_cpu", "trainer_config.max_steps=240",
                    "trainer_config.log_every_steps=10", "trainer_config.progress=lines",
                    "trainer_config.eval_every_steps=0", f"trainer_config.snapshot_path={scratch}/s{index}",
                    f"hydra.run.dir={scratch}/o{index}", *overrides]
            theirs = [sys.executable, *NANOGPT, "--max_iters=240", f"--out_dir={scratch}/n{index}"]
            runs = [("ours", ours, PROJECT_DIR, r"step (\d+)/\d+ .*?\| ([\d,.]+) ms/step"),
                    ("nanogpt", theirs, nanogpt, r"iter (\d+): loss [\d.]+, time ([\d.]+)ms")]
            medians = {name: statistics.median(logged_step_ms(argv, cwd, pattern))
                       for name, argv, cwd, pattern in (runs if index % 2 else runs[::-1])}
            ours_ms.append(medians["ours"])
            theirs_ms.append(medians["nanogpt"])
            ratios.append(medians["nanogpt"] / medians["ours"])
            print(f"step round {index + 1}: ours {medians['ours']:.1f} ms, nanogpt {medians['nanogpt']:.1f} ms, "
                  f"speed-up {ratios[-1]:.3f}", file=sys.stderr)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return {"rounds": rounds, "window": list(STEP_WINDOW), "ours_ms": spread(ours_ms, 1),
            "nanogpt_ms": spread(theirs_ms, 1), "speedup_vs_nanogpt": spread(ratios, 3)}


# ------------------------------------------------------------------------------------------------------ restart
class LogWatcher:
    """The job's output, line by line, with the time each line arrived."""

    def __init__(self, stream) -> None:  # noqa: ANN001 (a text stream)
        self.lines: list[tuple[float, str]] = []
        self._changed = threading.Condition()
        self._thread = threading.Thread(target=self._read, args=(stream,), daemon=True)
        self._thread.start()

    def _read(self, stream) -> None:  # noqa: ANN001
        for line in stream:
            with self._changed:
                self.lines.append((time.perf_counter(), line.rstrip("\n")))
                self._changed.notify_all()
        with self._changed:
            self.lines.append((time.perf_counter(), "<eof>"))
            self._changed.notify_all()

    def wait_for(self, start: int, predicate, timeout_s: float) -> tuple[int, float, str]:  # noqa: ANN001
        """The first line at index >= start that satisfies predicate: (index, arrival time, line)."""
        deadline = time.perf_counter() + timeout_s
        index = start
        with self._changed:
            while True:
                while index < len(self.lines):
                    arrived, line = self.lines[index]
                    if line == "<eof>":
                        raise SystemExit("the job ended: " + " | ".join(text for _, text in self.lines[-5:]))
                    if predicate(line):
                        return index, arrived, line
                    index += 1
                if not self._changed.wait(timeout=max(0.0, deadline - time.perf_counter())):
                    raise SystemExit(f"timed out; last lines: {[text for _, text in self.lines[-5:]]}")


def is_step_line(line: str) -> bool:
    return " step " in line and "/" in line.split(" step ", 1)[1].split(" ", 1)[0]


def worker_pids(agent: int) -> dict[int, int]:
    """{global rank: pid} of the agent's worker processes."""
    return {rank: pid for pid in children(agent) if (rank := rank_of(pid)) is not None}


def wait_for_new_workers(agent: int, old: set[int], count: int, timeout_s: float = 120) -> float:
    """When `count` workers that are not `old` are all running (polled every 10 ms): torchrun's share of a restart."""
    if not wait_until(lambda: len(set(worker_pids(agent).values()) - old) >= count, timeout_s, interval=0.01):
        raise SystemExit("torchrun started no new workers")
    return time.perf_counter()


def bench_restart(kills: int, overrides: list[str], rounds: int = 1) -> dict:
    """`rounds` jobs, `kills` kills each: the latencies and their parts, min/median/max."""
    each: list[dict] = []
    for index in range(rounds):
        print(f"round {index + 1}:", file=sys.stderr)
        each += restart_job(kills, overrides)
    report = {"command": " ".join(["torchrun", "--standalone", "--nproc_per_node=2", f"--max-restarts={kills}",
                                   "main.py", "preset=nanogpt_cpu", "..."]), "kills": kills, "rounds": rounds}
    report.update({part: spread([r[part] for r in each])
                   for part in ("latency_s", "to_new_processes_s", "to_first_line_s", "to_resumed_s")})
    report["launch_s"] = spread([r["launch_s"] for r in each[::kills]])  # one launch a job
    report["each"] = each
    return report


def restart_job(kills: int, overrides: list[str]) -> list[dict]:
    """One torchrun job, `kills` workers SIGKILLed in turn: each kill's latency and its parts."""
    scratch = Path(tempfile.mkdtemp(prefix="bench-restart-"))
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
            f"--max-restarts={kills}", "main.py", "preset=nanogpt_cpu", "trainer_config.max_steps=100000",
            "trainer_config.log_every_steps=1", "trainer_config.progress=lines", "trainer_config.save_every_steps=5",
            "trainer_config.eval_every_steps=0", f"trainer_config.snapshot_path={scratch}/snapshots",
            f"hydra.run.dir={scratch}/run", *overrides]
    launched_at = time.perf_counter()
    job = subprocess.Popen(argv, cwd=PROJECT_DIR, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           start_new_session=True)
    watcher = LogWatcher(job.stdout)
    results = []
    try:
        position, _, _ = watcher.wait_for(0, lambda line: "run directory:" in line, 120)
        _, first_step_at, _ = watcher.wait_for(position, is_step_line, 120)
        print(f"launch: first step after {first_step_at - launched_at:.2f} s", file=sys.stderr)
        for kill in range(kills):
            for _ in range(15):
                position, _, _ = watcher.wait_for(position + 1, is_step_line, 120)
            victim_rank = (kill + 1) % 2  # rank 1 first, then rank 0
            victim = worker_pids(job.pid)[victim_rank]
            killed_at = time.perf_counter()
            before = set(worker_pids(job.pid).values())
            os.kill(victim, signal.SIGKILL)
            kill_index = len(watcher.lines)
            spawned_at = wait_for_new_workers(job.pid, before, 2)
            up, up_at, _ = watcher.wait_for(kill_index, lambda line: "run directory:" in line, 120)
            resumed, resumed_at, _ = watcher.wait_for(up, lambda line: "resumed from" in line, 120)
            position, step_at, line = watcher.wait_for(resumed, is_step_line, 120)
            results.append({"killed_rank": victim_rank, "launch_s": first_step_at - launched_at,
                            "latency_s": step_at - killed_at,
                            "to_new_processes_s": spawned_at - killed_at,
                            "to_first_line_s": up_at - killed_at, "to_resumed_s": resumed_at - killed_at})
            parts = {"new processes": spawned_at, "first line": up_at, "resumed": resumed_at}
            print(f"kill {kill + 1} (rank {victim_rank}): first step after {step_at - killed_at:.2f} s ("
                  + ", ".join(f"{name} {at - killed_at:.2f} s" for name, at in parts.items()) + ")", file=sys.stderr)
    finally:
        os.killpg(job.pid, signal.SIGKILL)
        job.wait()
        shutil.rmtree(scratch, ignore_errors=True)
    return results


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python benchmarks/bench_launch.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", choices=["startup", "restart", "step"], default=None)
    parser.add_argument("--step-rounds", type=int, default=5, help="step rounds (default 5)")
    parser.add_argument("--rounds", type=int, default=5, help="start-up rounds (default 5)")
    parser.add_argument("--nanogpt", type=Path, default=None, help="a nanoGPT checkout to compare with")
    parser.add_argument("--kills", type=int, default=5, help="restarts to time per job (default 5)")
    parser.add_argument("--restart-rounds", type=int, default=1,
                        help="restart rounds, a job each (default 1)")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("overrides", nargs="*", help="Hydra overrides for main.py")
    args = parser.parse_args(argv)
    if args.nanogpt is not None:
        if not (args.nanogpt / "train.py").is_file():
            print(f"error: no train.py in {args.nanogpt}", file=sys.stderr)
            return 2
        args.nanogpt = args.nanogpt.resolve()
        prepare_nanogpt(args.nanogpt)
    report = {}
    if args.only in (None, "startup"):
        report["startup"] = bench_startup(args.rounds, args.nanogpt, args.overrides)
    if args.only in (None, "restart"):
        report["restart"] = bench_restart(args.kills, args.overrides, args.restart_rounds)
    if args.only in (None, "step") and args.nanogpt is not None:
        report["step"] = bench_step(args.step_rounds, args.nanogpt, args.overrides)
    elif args.only == "step":
        print("error: --only step needs --nanogpt DIR", file=sys.stderr)
        return 2
    print_report(report, args.json)
    return 0


def print_report(report: dict, path: Optional[Path]) -> None:
    """The report as JSON on stdout, and in `path` too when one is given."""
    text = json.dumps(report, indent=2)
    print(text)
    if path:
        path.write_text(text + "\n")


if __name__ == "__main__":
    sys.exit(main())
