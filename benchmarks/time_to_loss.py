"""Time to a target validation loss: this project's main.py against nanoGPT's own train.py on its CPU recipe, whole
processes, paired.

    python benchmarks/time_to_loss.py --nanogpt ../nanoGPT preset=cpu                 # 1 pair, target 1.886
    python benchmarks/time_to_loss.py --nanogpt ../nanoGPT --pairs 5 --json ttl.json preset=nanogpt_cpu
    python benchmarks/time_to_loss.py --nanogpt ../nanoGPT --threads 1 --target 2.0 preset=cpu

**Runs.** Each pair runs both programs once, each a fresh process, one after the other; the order alternates
(pair 1: ours, then nanoGPT; pair 2: nanoGPT, then ours; ...) so that a machine drifting in speed favours neither.
Both get the same environment: OMP_NUM_THREADS=N with `--threads N` (otherwise neither sets it: each uses all
cores, torch's default), and PYTHONUNBUFFERED=1, so that a line reaches this script when it is printed; every line
of output (stdout and stderr, merged) is timestamped on arrival with time.time(), the clock of the file
modification times below. Before the first pair both datasets are made, so that no run pays a one-time encoding:
ours with `prepare.py OVERRIDES` (the encoded-corpus cache), nanoGPT's with its own
data/shakespeare_char/prepare.py from this project's data/input.txt where train.bin is missing.

**Ours**: `python main.py OVERRIDES trainer_config.eval_every_steps=E trainer_config.log_every_steps=E
trainer_config.eval_batches=B trainer_config.progress=lines trainer_config.snapshot_path=TMP hydra.run.dir=TMP`
(under `torchrun --standalone --nproc_per_node=P` with `--nproc P`). B is null by default: the whole validation
split, each character predicted once, the loss nanoGPT's 240 random windows estimate (the first windows alone,
`--eval-batches N`, read lower than the whole split on tiny-shakespeare: not a fair sample). The crossing is the
first val row of the run folder's metrics.jsonl with val_loss <= target; its step is N.
- training seconds: the sum of ms_per_step x (the row's steps) over the train rows up to step N. ms_per_step is
  the trainer's own: the wall time since the previous row over the steps between, less the evaluations and
  snapshots in it (trainer.py's `LossWindow.exclude`); the first row's window starts as fit() starts, so the
  first steps' warm-up counts. A train row every E steps ends a window at every evaluation.
- wall seconds: from starting the process to the arrival of its "step N | epoch .. | val loss" line (start-up,
  data, model, every step, evaluation and snapshot up to and including the crossing evaluation).
- tokens: N x batch_size x grad_accum_steps x block_size x P (the composed config).

**nanoGPT**: `python train.py config/train_shakespeare_char.py` with its README's CPU recipe (`--device=cpu
--compile=False --eval_iters=20 --log_interval=1 --block_size=64 --batch_size=12 --n_layer=4 --n_head=4
--n_embd=128 --max_iters=2000 --lr_decay_iters=2000 --dropout=0.0`) and `--eval_interval=E
--always_save_checkpoint=False --out_dir=TMP`, unmodified, in its checkout. Its "step N: train loss X, val loss Y"
line comes from the evaluation that runs before iteration N, after N steps; the crossing is the first with
Y <= target (Y as printed, 4 decimals).
- training seconds: the sum of its own per-iteration times ("iter k: loss X, time Tms") over iterations 0..N-1.
  train.py's `dt` runs from the end of one iteration's timing to the end of the next, so an iteration k that an
  evaluation precedes (k = 0, E, 2E, ...) holds that evaluation (estimate_loss over 20 batches of train and 20 of
  val) and, from k = E on, the checkpoint it writes whenever the val loss improved (always_save_checkpoint=False
  still saves then). Both are taken out of that iteration's time: the evaluation as the time from the arrival of
  the line before "step k" to the arrival of "step k", the checkpoint as the time from the arrival of "saving
  checkpoint to ..." to ckpt.pt's modification time (read as the "iter k" line arrives, long before the next one).
- wall seconds: from starting the process to the arrival of its "step N:" line.
- tokens: N x its own "tokens per iteration will be: T" (grad_accum x batch x block, one process).

**Reported** (JSON on stdout and with `--json FILE`, a table on stderr): per run the step, tokens, training and wall
seconds and the val loss of the crossing (or `reached: false` and no numbers where no evaluation reached the
target), its last evaluation and the whole process's time; per pair the ratios ours / nanoGPT's of training
seconds, wall seconds and tokens (where both reached the target); then each program's medians (with min and max)
over its runs that reached the target, and the median, min and max of the per-pair ratios.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the project's root: main.py, mingpt/

import argparse
import functools
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

from benchmarks.bench_launch import NANOGPT, prepare_nanogpt, print_report, spread
from mingpt import PROJECT_DIR
from mingpt.reporting.logs import read_metrics

NANOGPT_RECIPE = [*NANOGPT, "--max_iters=2000"]  # its README's CPU recipe, whole
NANOGPT_EVAL_WINDOWS = 20 * 12  # eval_iters x batch_size: the windows of each of its evaluations
EVAL_BATCH_FACTOR = 4  # our evaluation batch: 4 x batch_size windows (trainer.py's EVAL_BATCH_FACTOR)
# The settings this script sets itself on main.py's command line (a second value would make the numbers wrong).
OWN_KEYS = ("trainer_config.eval_every_steps", "trainer_config.log_every_steps", "trainer_config.eval_batches",
            "trainer_config.progress", "trainer_config.snapshot_path", "hydra.run.dir")

NANOGPT_EVAL = re.compile(r"^step (\d+): train loss \S+, val loss (\S+)$")
NANOGPT_ITER = re.compile(r"^iter (\d+): loss \S+, time ([\d.]+)ms")
NANOGPT_TOKENS = re.compile(r"^tokens per iteration will be: ([\d,]+)")
NANOGPT_SAVE = "saving checkpoint to "
OURS_EVAL = re.compile(r"\bstep (\d+) \| epoch \d+ \| val loss (\S+)")


@dataclass
class Line:
    at: float  # seconds after the process was started
    text: str


@dataclass
class Logged:
    """A finished process's output, line by line, and what was seen while it ran."""

    lines: list[Line]
    wall_s: float
    checkpoint_written: dict[int, float] = field(default_factory=dict)  # nanoGPT: iteration -> ckpt.pt's mtime


@dataclass
class Crossing:
    """One run's result: where it first reached the target (reached False: it never did)."""

    reached: bool
    final_step: int
    final_val_loss: Optional[float]
    process_s: float
    step: Optional[int] = None
    val_loss: Optional[float] = None
    train_s: Optional[float] = None
    wall_s: Optional[float] = None
    tokens: Optional[int] = None
    final_train_s: Optional[float] = None  # training seconds to the last evaluation, reached or not


    def as_dict(self) -> dict:
        rounded = {"train_s": 2, "wall_s": 2, "process_s": 2, "val_loss": 4, "final_val_loss": 4, "final_train_s": 2}
        return {name: round(value, rounded[name]) if name in rounded and value is not None else value
                for name, value in vars(self).items()}


# ------------------------------------------------------------------------------------------------ running
class CheckpointWatch:
    """nanoGPT overwrites out_dir/ckpt.pt at each improved evaluation: its modification time, read as the line of the
    iteration after a "saving checkpoint" line arrives, is when that write ended."""

    def __init__(self, out_dir: Path, launched: float) -> None:
        self.path, self.launched, self.saving = out_dir / "ckpt.pt", launched, False
        self.written: dict[int, float] = {}

    def __call__(self, text: str) -> None:
        if text.startswith(NANOGPT_SAVE):
            self.saving = True
        elif self.saving and (match := NANOGPT_ITER.match(text)):
            self.saving = False
            try:
                self.written[int(match.group(1))] = self.path.stat().st_mtime - self.launched
            except FileNotFoundError:  # no file: nothing to take out
                pass


def run_logged(argv: list[str], cwd: Path, env: dict[str, str],
               watch: Optional[Callable[[float], Callable[[str], None]]] = None) -> Logged:
    """Run a process to its end, timestamping each line of its output as it arrives; raises if it fails.
    `watch(launched)` makes a function that sees each line as it arrives."""
    launched = time.time()
    process = subprocess.Popen(argv, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               errors="replace", start_new_session=True)
    observer = watch(launched) if watch else None
    lines = []
    try:
        for raw in process.stdout:
            lines.append(Line(time.time() - launched, raw.rstrip("\n")))
            if observer:
                observer(lines[-1].text)
        process.wait()
    finally:
        if process.poll() is None:  # interrupted: the whole process group goes
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    if process.returncode != 0:
        tail = "\n".join(line.text for line in lines[-15:])
        raise SystemExit(f"{' '.join(argv[:4])} ... failed ({process.returncode}):\n{tail}")
    return Logged(lines, time.time() - launched, getattr(observer, "written", {}))


# ------------------------------------------------------------------------------------------------ nanoGPT
def nanogpt_step_seconds(logged: Logged) -> dict[int, float]:
    """{iteration: its training seconds}: train.py's own dt, less the evaluation and checkpoint write before it."""
    seconds: dict[int, float] = {}
    evaluated_for: dict[int, float] = {}  # iteration -> the evaluation before it, in seconds
    saving_from: dict[int, float] = {}  # iteration -> when its "saving checkpoint" line arrived
    pending = None  # the iteration whose evaluation was the last one seen
    for index, line in enumerate(logged.lines):
        if match := NANOGPT_EVAL.match(line.text):
            pending = int(match.group(1))
            before = logged.lines[index - 1].at if index else 0.0
            evaluated_for[pending] = line.at - before
        elif line.text.startswith(NANOGPT_SAVE) and pending is not None:
            saving_from[pending] = line.at
        elif match := NANOGPT_ITER.match(line.text):
            k = int(match.group(1))
            dt = float(match.group(2)) / 1000
            save = logged.checkpoint_written.get(k, 0.0) - saving_from[k] if k in saving_from else 0.0
            seconds[k] = max(0.0, dt - evaluated_for.get(k, 0.0) - max(0.0, save))
    return seconds


def nanogpt_crossing(logged: Logged, target: float) -> Crossing:
    """The first "step N: ... val loss Y" with Y <= target, from nanoGPT's output (see the module's docstring)."""
    evaluations = [(int(m.group(1)), float(m.group(2)), line.at) for line in logged.lines
                   if (m := NANOGPT_EVAL.match(line.text))]
    tokens = next((int(m.group(1).replace(",", "")) for line in logged.lines
                   if (m := NANOGPT_TOKENS.match(line.text))), None)
    if not evaluations or tokens is None:
        raise SystemExit("nanoGPT's output has no evaluation or no 'tokens per iteration' line")
    final_step, final_loss, _ = evaluations[-1]
    result = Crossing(False, final_step, final_loss, logged.wall_s)
    seconds = nanogpt_step_seconds(logged)
    if all(k in seconds for k in range(final_step)):
        result.final_train_s = sum(seconds[k] for k in range(final_step))
    crossing = next((e for e in evaluations if e[1] <= target), None)
    if crossing is None:
        return result
    step, loss, at = crossing
    missing = [k for k in range(step) if k not in seconds]
    if missing:
        raise SystemExit(f"nanoGPT logged no time for iterations {missing[:5]}...: is --log_interval 1?")
    result.reached, result.step, result.val_loss, result.wall_s = True, step, loss, at
    result.train_s, result.tokens = sum(seconds[k] for k in range(step)), step * tokens
    return result


# ------------------------------------------------------------------------------------------------ ours
def ours_train_seconds(rows: list[dict], step: int) -> float:
    """Training seconds of steps 0..step from metrics.jsonl's train rows: the sum of ms_per_step x the row's steps."""
    total, previous = 0.0, 0
    for row in rows:
        if "train_loss" not in row or row["step"] > step:
            continue
        total += row["ms_per_step"] * (row["step"] - previous) / 1000
        previous = row["step"]
    if previous != step:
        raise SystemExit(f"metrics.jsonl has no train row at step {step}: log_every_steps must divide the "
                         "evaluation steps")
    return total


def ours_crossing(logged: Logged, rows: list[dict], target: float, tokens_per_step: int) -> Crossing:
    """The first val row with val_loss <= target, from our metrics.jsonl (see the module's docstring)."""
    evaluations = [row for row in rows if "val_loss" in row]
    if not evaluations:
        raise SystemExit("our metrics.jsonl has no val row")
    result = Crossing(False, evaluations[-1]["step"], evaluations[-1]["val_loss"], logged.wall_s)
    result.final_train_s = ours_train_seconds(rows, result.final_step)
    crossing = next((row for row in evaluations if row["val_loss"] <= target), None)
    if crossing is None:
        return result
    step = crossing["step"]
    arrived = next((line.at for line in logged.lines
                    if (m := OURS_EVAL.search(line.text)) and int(m.group(1)) == step), None)
    if arrived is None:
        raise SystemExit(f"no 'step {step} | ... | val loss' line in our output")
    result.reached, result.step, result.val_loss, result.wall_s = True, step, crossing["val_loss"], arrived
    result.train_s, result.tokens = ours_train_seconds(rows, step), step * tokens_per_step
    return result


# ------------------------------------------------------------------------------------------------ the bench
@dataclass
class Setup:
    """What every run of the benchmark shares."""

    overrides: list[str]
    nanogpt: Path
    nanogpt_args: list[str]
    target: float
    eval_every: int
    eval_batches: Optional[int]  # None: the whole validation split
    nproc: int
    tokens_per_step: int
    eval_windows: Optional[int]  # our windows per evaluation, all processes together (None: the whole split)
    env: dict[str, str]

    def ours_argv(self, scratch: Path) -> list[str]:
        launcher = [sys.executable] if self.nproc == 1 else [
            sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={self.nproc}"]
        batches = "null" if self.eval_batches is None else self.eval_batches
        return [*launcher, "main.py", *self.overrides, f"trainer_config.eval_every_steps={self.eval_every}",
                f"trainer_config.log_every_steps={self.eval_every}", f"trainer_config.eval_batches={batches}",
                "trainer_config.progress=lines", f"trainer_config.snapshot_path={scratch / 'snapshots'}",
                f"hydra.run.dir={scratch / 'run'}"]

    def nanogpt_argv(self, scratch: Path) -> list[str]:
        return [sys.executable, *NANOGPT_RECIPE, f"--eval_interval={self.eval_every}",
                "--always_save_checkpoint=False", f"--out_dir={scratch / 'out'}", *self.nanogpt_args]


def run_ours(setup: Setup, scratch: Path) -> Crossing:
    logged = run_logged(setup.ours_argv(scratch), PROJECT_DIR, setup.env)
    return ours_crossing(logged, read_metrics(scratch / "run"), setup.target, setup.tokens_per_step)


def run_nanogpt(setup: Setup, scratch: Path) -> Crossing:
    watch = functools.partial(CheckpointWatch, scratch / "out")  # given the launch time by run_logged
    return nanogpt_crossing(run_logged(setup.nanogpt_argv(scratch), setup.nanogpt, setup.env, watch), setup.target)


def ratio(ours: Crossing, theirs: Crossing, name: str) -> Optional[float]:
    if not (ours.reached and theirs.reached) or not getattr(theirs, name):
        return None
    return round(getattr(ours, name) / getattr(theirs, name), 3)


def bound(ours: Crossing, theirs: Crossing) -> Optional[float]:
    """Where nanoGPT never reached the target: our training seconds over its training seconds of the whole run,
    which it would have had to exceed: an upper bound of the training-seconds ratio."""
    if not ours.reached or theirs.reached or not theirs.final_train_s:
        return None
    return round(ours.train_s / theirs.final_train_s, 3)


def run_pair(setup: Setup, index: int, scratch: Path) -> dict:
    """One pair: both programs, ours first in odd pairs, nanoGPT first in even ones."""
    order = ["ours", "nanogpt"] if index % 2 == 1 else ["nanogpt", "ours"]
    results = {}
    for name in order:
        folder = scratch / f"pair{index}-{name}"
        results[name] = (run_ours if name == "ours" else run_nanogpt)(setup, folder)
        shutil.rmtree(folder, ignore_errors=True)
        print(f"pair {index}, {name}: {describe(results[name])}", file=sys.stderr)
    ours, theirs = results["ours"], results["nanogpt"]
    return {"pair": index, "order": order, "ours": ours.as_dict(), "nanogpt": theirs.as_dict(),
            "ratio_ours_to_nanogpt": {name: ratio(ours, theirs, name) for name in ("train_s", "wall_s", "tokens")},
            "train_s_bound_where_nanogpt_missed": bound(ours, theirs)}


def describe(run: Crossing) -> str:
    if not run.reached:
        return f"never reached the target (last val loss {run.final_val_loss:.4f} at step {run.final_step})"
    return (f"step {run.step}, {run.tokens:,} tokens, {run.train_s:.1f} s training, {run.wall_s:.1f} s wall "
            f"(val loss {run.val_loss:.4f})")


def summarize(pairs: list[dict]) -> dict:
    """Each program's medians over its runs that reached the target; the per-pair ratios' median, min and max."""
    summary = {}
    for name in ("ours", "nanogpt"):
        reached = [pair[name] for pair in pairs if pair[name]["reached"]]
        summary[name] = {"reached": f"{len(reached)}/{len(pairs)}"}
        for key, digits in (("step", 0), ("tokens", 0), ("train_s", 2), ("wall_s", 2)):
            summary[name][key] = spread([run[key] for run in reached], digits) if reached else None
    ratios = {}
    for key in ("train_s", "wall_s", "tokens"):
        values = [pair["ratio_ours_to_nanogpt"][key] for pair in pairs if pair["ratio_ours_to_nanogpt"][key]]
        ratios[key] = spread(values, 3) if values else None
    summary["ratio_ours_to_nanogpt"] = ratios
    bounds = [pair["train_s_bound_where_nanogpt_missed"] for pair in pairs
              if pair["train_s_bound_where_nanogpt_missed"]]
    summary["train_s_bound_where_nanogpt_missed"] = spread(bounds, 3) if bounds else None
    return summary


# ------------------------------------------------------------------------------------------------ set-up, output
def cpu_model() -> str:
    """lscpu's model name (the CPU the numbers hold for)."""
    try:
        listing = subprocess.run(["lscpu"], capture_output=True, text=True, env={**os.environ, "LC_ALL": "C"}).stdout
    except FileNotFoundError:
        listing = ""
    return next((line.split(":", 1)[1].strip() for line in listing.splitlines() if line.startswith("Model name")),
                "unknown (no lscpu)")


def composed_setup(args: argparse.Namespace, env: dict[str, str]) -> Setup:
    """Our composed config's tokens per step and evaluation batches (torch and the project load here, once)."""
    from main import load_config

    cfg = load_config(args.overrides)
    trainer, block = cfg.trainer_config, cfg.data_config.block_size
    tokens_per_step = trainer.batch_size * trainer.grad_accum_steps * block * args.nproc
    batches = None if args.eval_batches in (None, "all") else int(args.eval_batches)  # None: the whole split
    windows = None if batches is None else batches * EVAL_BATCH_FACTOR * trainer.batch_size * args.nproc
    return Setup(args.overrides, args.nanogpt, args.nanogpt_arg, args.target, args.eval_every, batches, args.nproc,
                 tokens_per_step, windows, env)


def prepare_data(setup: Setup) -> None:
    """Both programs' encoded data made before the first pair (see the module's docstring)."""
    prepare_nanogpt(setup.nanogpt)
    made = subprocess.run([sys.executable, "prepare.py", *setup.overrides], cwd=PROJECT_DIR, env=setup.env,
                          capture_output=True, text=True)
    if made.returncode != 0:
        raise SystemExit(f"prepare.py failed ({made.returncode}): {(made.stderr or made.stdout).strip()[-500:]}")


def machine(args: argparse.Namespace) -> dict:
    import torch

    threads = args.threads if args.threads else f"all ({os.cpu_count()} cores)"
    return {"cpu": cpu_model(), "torch": torch.__version__, "python": sys.version.split()[0], "threads": threads}


def header(setup: Setup, args: argparse.Namespace) -> dict:
    ours = setup.ours_argv(Path("TMP"))
    launcher = ["python"] if setup.nproc == 1 else ["torchrun", "--standalone", f"--nproc_per_node={setup.nproc}"]
    windows = "all the" if setup.eval_windows is None else f"the first {setup.eval_windows}"
    return {
        "target": setup.target, "pairs": args.pairs, "machine": machine(args),
        "ours": {"command": " ".join([*launcher, *ours[ours.index("main.py"):]]), "processes": setup.nproc,
                 "tokens_per_step": setup.tokens_per_step, "eval_every_steps": setup.eval_every,
                 "eval_windows": f"{windows} non-overlapping windows of the val split, the same each time"},
        "nanogpt": {"command": " ".join(["python", *setup.nanogpt_argv(Path("TMP"))[1:]]),
                    "checkout": str(setup.nanogpt), "eval_every_steps": setup.eval_every,
                    "eval_windows": f"{NANOGPT_EVAL_WINDOWS} random windows of the val split, new each time"},
    }


def row(label: str, name: str, run: dict) -> str:
    last = f"{run['final_val_loss']:.4f} ({run['final_step']})"
    if not run["reached"]:
        return f"{label:<7} {name:<8} {'not reached':>38} {'':>9} {last:>17} {run['process_s']:>9.1f}"
    return (f"{label:<7} {name:<8} {run['step']:>6} {run['tokens']:>12,} {run['train_s']:>8.2f} {run['wall_s']:>8.2f} "
            f"{run['val_loss']:>9.4f} {last:>17} {run['process_s']:>9.1f}")


def table(report: dict) -> str:
    """The report, readable: a row per run, the medians, the per-pair ratios."""
    machine_, ours, theirs = report["machine"], report["ours"], report["nanogpt"]
    lines = [f"time to val loss <= {report['target']} | {machine_['cpu']} | torch {machine_['torch']} | "
             f"threads: {machine_['threads']}",
             f"ours:    {ours['command']} ({ours['processes']} process(es), {ours['tokens_per_step']:,} tokens a step; "
             f"evaluation: {ours['eval_windows']})",
             f"nanoGPT: {theirs['command']} (evaluation: {theirs['eval_windows']})", "",
             f"{'pair':<7} {'program':<8} {'step':>6} {'tokens':>12} {'train s':>8} {'wall s':>8} {'val loss':>9} "
             f"{'last val (step)':>17} {'process s':>9}"]
    names = {"ours": "ours", "nanogpt": "nanoGPT"}
    for pair in report["pairs_run"]:
        lines += [row(str(pair["pair"]), names[name], pair[name]) for name in pair["order"]]
    for name, label in names.items():
        summary = report["summary"][name]
        medians = " | ".join(f"{key} {summary[key]['median']:,}" for key in ("step", "tokens", "train_s", "wall_s")
                             if summary[key]) or "-"
        lines.append(f"median  {label:<8} {medians}  (reached the target: {summary['reached']})")
    ratios = report["summary"]["ratio_ours_to_nanogpt"]
    shown = [f"{key} {value['median']:.3f} ({value['min']:.3f}-{value['max']:.3f})" for key, value in ratios.items()
             if value]
    lines.append("ours / nanoGPT, per pair (median, min-max): " + (", ".join(shown) or "no pair where both reached it"))
    bounds = report["summary"]["train_s_bound_where_nanogpt_missed"]
    if bounds:
        lines.append(f"where nanoGPT missed the target, ours / nanoGPT's whole run in training seconds (an upper "
                     f"bound): {bounds['median']:.3f} ({bounds['min']:.3f}-{bounds['max']:.3f})")
    return "\n".join(lines)


def own_key(override: str) -> Optional[str]:
    key = override.lstrip("+~").split("=", 1)[0]
    return key if key in OWN_KEYS else None


def parse_args(argv: Optional[list[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python benchmarks/time_to_loss.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--nanogpt", type=Path, required=True, help="a checkout of karpathy/nanoGPT")
    parser.add_argument("--pairs", type=int, default=1, help="pairs of runs, the order alternating (default 1)")
    parser.add_argument("--target", type=float, default=1.886, help="validation loss to reach (default 1.886)")
    parser.add_argument("--eval-every", type=int, default=50, help="steps between evaluations, both (default 50)")
    parser.add_argument("--eval-batches", default="all",
                        help="our evaluation batches of 4 x batch_size windows per process: the first ones only "
                             "(default: all, the whole validation split)")
    parser.add_argument("--threads", type=int, default=None, help="OMP_NUM_THREADS for both (default: unset)")
    parser.add_argument("--nproc", type=int, default=1, help="our processes, under torchrun when > 1 (default 1)")
    parser.add_argument("--nanogpt-arg", action="append", default=[], metavar="--KEY=VALUE",
                        help="one more argument for nanoGPT's train.py, after the recipe's (repeatable)")
    parser.add_argument("--json", type=Path, default=None, help="also write the JSON report here")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides for main.py, e.g. preset=cpu")
    return parser.parse_args(argv)


def check_args(args: argparse.Namespace) -> Optional[str]:
    """The first problem with the command line, as one line; None when there is none."""
    taken = [key for key in map(own_key, args.overrides) if key]
    if taken:
        return f"{taken[0]} is set by this script (--eval-every, --eval-batches; temporary folders)"
    if not (args.nanogpt / "train.py").is_file():
        return f"no train.py in {args.nanogpt}"
    if min(args.pairs, args.eval_every, args.nproc, args.threads or 1) < 1:
        return "--pairs, --eval-every, --nproc and --threads must be positive"
    if args.eval_batches not in (None, "all") and not (args.eval_batches.isdigit() and int(args.eval_batches) > 0):
        return f"--eval-batches must be a positive number or 'all', got {args.eval_batches!r}"
    return None


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    problem = check_args(args)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    args.nanogpt = args.nanogpt.resolve()
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **({"OMP_NUM_THREADS": str(args.threads)} if args.threads else {})}
    from mingpt.errors import UsageError

    try:
        setup = composed_setup(args, env)
    except UsageError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    prepare_data(setup)
    report = header(setup, args)
    scratch = Path(tempfile.mkdtemp(prefix="time-to-loss-"))
    try:
        report["pairs_run"] = [run_pair(setup, index, scratch) for index in range(1, args.pairs + 1)]
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    report["summary"] = summarize(report["pairs_run"])
    print(table(report), file=sys.stderr)
    print_report(report, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
