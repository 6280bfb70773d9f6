"""Chaos harness: SIGKILL a 2-process CPU torchrun job at random moments and check that it always comes back.

    python benchmarks/chaos.py --trials 20 --seed 1  # the table; 45-135 s per trial on a busy 2-core box
    python benchmarks/chaos.py --trials 3 --json chaos.json --workdir /tmp/chaos --keep

One uninterrupted reference run of a tiny model with a snapshot every few steps, then N trials of the same job.
Each trial SIGKILLs it --kills times, each time at a moment drawn from the seed, and restarts it:

- moments: `startup` (workers importing, joining the process group, loading the snapshot), `step` (somewhere in
  a training step), `eval` (after the train row of an evaluation step is logged and before its val row), `save`
  (while rank 0's snapshot file, or under --strategy fsdp the folder of shards, still has its `.tmp-` name). The
  harness watches metrics.jsonl, train.log and the snapshot folder, and records the moment each kill actually hit
  (checked after the kill: an interrupted save leaves its temporary file behind, an interrupted evaluation never
  logs its val row);
- restarts, alternating between trials: `torchrun` (one worker SIGKILLed, the job's own `--max-restarts`
  restarts all workers) and `rerun` (the agent and all workers SIGKILLed at once, like a lost node; the same
  command is run again).

A trial passes when every kill was followed by a resume, the job exited 0, the final weights' sha256
(summary.json) equals the reference's, and every train_loss / val_loss row in metrics.jsonl (the recomputed steps
included) equals the reference's row of that step. Lost steps: for each kill, the last step logged before the
kill minus the step the next attempt resumed from (what had to be recomputed).

The reference and the trials run a copy of the code taken at the start (WORKDIR/code), so that edits to the
working tree while the harness runs cannot make them differ. The job runs
`torchrun --standalone --nproc_per_node=N --max-restarts=K main.py ...` exactly as documented, without
TORCH_DISABLE_SHARE_RDZV_TCP_STORE (mingpt.distributed.process_group.setup_distributed makes restarts reliable
without it).
Exit status: 0 when every trial resumed and ended identical, 1 otherwise.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the project's root: main.py, mingpt/

import argparse
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Optional

from mingpt import PROJECT_DIR
from mingpt.reporting.logs import read_metrics

MOMENTS = ("startup", "step", "eval", "save")
RESTARTS = ("torchrun", "rerun")

# A model and a data slice small enough that a run takes seconds on 2 CPU cores, in fp32 (bit-exact resume on a
# CPU); the tests' TINY (tests/support.py) is this and a short run of it.
TINY_MODEL = [
    "data_config.truncate=0.05",
    "data_config.block_size=32",
    "gpt_config.n_layer=2",
    "gpt_config.n_head=2",
    "gpt_config.n_embd=32",
    "gpt_config.dropout=0.1",
    "optimizer_config.learning_rate=3e-3",
    "optimizer_config.warmup_steps=5",
    "optimizer_config.min_lr=3e-4",
    "trainer_config.batch_size=8",
    "trainer_config.mixed_precision=fp32",
]
# The tiny model, one metrics row per step, an evaluation every EVAL_EVERY steps (a larger validation split so
# that it lasts long enough to be hit), a snapshot every SAVE_EVERY steps, no end-of-run plot or sample (the trial
# compares weights).
EVAL_EVERY, SAVE_EVERY = 10, 3
JOB = [
    *TINY_MODEL,
    "data_config.train_split=0.6",
    "trainer_config.log_every_steps=1",
    f"trainer_config.eval_every_steps={EVAL_EVERY}",
    f"trainer_config.save_every_steps={SAVE_EVERY}",
    "trainer_config.keep_last=2",
    "trainer_config.progress=lines",
    "trainer_config.report_at_end=false",
]
RESUMED = re.compile(r"resumed from \S+: step (\d+)")
FRESH = "no snapshot in"


# ------------------------------------------------------------------------------------------------ observation
def _temporary_files(snaps: Path) -> set[str]:
    try:
        return {n for n in os.listdir(snaps) if ".tmp-" in n}
    except FileNotFoundError:
        return set()


def _snapshot_steps(snaps: Path) -> list[int]:
    # Imported here: tests/support.py imports this module, and it then needs no torch.
    from mingpt.checkpoint.store import snapshot_step

    try:
        names = os.listdir(snaps)
    except FileNotFoundError:
        return []
    return sorted(step for n in names if (step := snapshot_step(n)) is not None)


def children(pid: int) -> list[int]:
    """The live direct children of a process (torchrun's workers), from /proc."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid and fields[0] != "Z":
            found.append(int(stat.parent.name))
    return sorted(found)


def rank_of(pid: int) -> Optional[int]:
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    for item in environ:
        if item.startswith(b"RANK="):
            return int(item[5:])
    return None


def alive(pid: int) -> bool:
    """Running: not gone, and not a zombie waiting for its parent."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):  # gone, or its stat read while it was being torn down
        return False
    return state != "Z"


def wait_until(predicate: Callable[[], object], timeout: float, interval: float = 0.002) -> object:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    return None


# ------------------------------------------------------------------------------------------------ the job
@dataclass
class Kill:
    target: str  # the moment aimed at
    hit: str = "missed"  # the moment the kill actually hit (checked afterwards); "missed": the job ended first
    killed: str = ""  # "rank 1 (pid 123)" or "agent+workers"
    step: int = 0  # last step logged before the kill (or the step the killed attempt started from)
    resumed_from: Optional[int] = None  # the step the next attempt resumed from (0 = from scratch)
    lost: int = 0
    detail: str = ""


@dataclass
class Trial:
    index: int
    restart: str
    kills: list[Kill] = field(default_factory=list)
    strategy: str = "ddp"
    exit_code: Optional[int] = None
    resumed: bool = False
    identical: bool = False
    seconds: float = 0.0
    error: str = ""

    @property
    def lost(self) -> int:
        return sum(k.lost for k in self.kills)


class Job:
    """One chaos trial's training job: the same torchrun command, started (again) as needed."""

    def __init__(self, folder: Path, nproc: int, steps: int, max_restarts: int, code: Path,
                 overrides: tuple[str, ...] = ()) -> None:
        self.folder, self.nproc, self.steps, self.max_restarts, self.code = folder, nproc, steps, max_restarts, code
        self.overrides = overrides
        self.snaps, self.run_dir = folder / "snaps", folder / "run"
        self.metrics, self.train_log = self.run_dir / "metrics.jsonl", self.run_dir / "train.log"
        self.process: Optional[subprocess.Popen] = None
        self.launches = 0
        folder.mkdir(parents=True, exist_ok=True)

    def command(self) -> list[str]:
        return [
            sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={self.nproc}",
            f"--max-restarts={self.max_restarts}", str(self.code / "main.py"), *JOB, *self.overrides,
            f"data_config.path={PROJECT_DIR / 'data' / 'input.txt'}",
            f"trainer_config.max_steps={self.steps}", f"trainer_config.snapshot_path={self.snaps}",
            f"hydra.run.dir={self.run_dir}",
        ]

    def start(self) -> None:
        env = dict(os.environ)
        for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "TORCHELASTIC_RUN_ID", "MASTER_ADDR", "MASTER_PORT"):
            env.pop(name, None)
        env["TMPDIR"] = str(self.folder)  # torchrun's torchelastic_* folders
        env["PYTHONUNBUFFERED"] = "1"
        self.launches += 1
        log = (self.folder / f"launch-{self.launches}.log").open("w")
        self.process = subprocess.Popen(self.command(), cwd=self.folder, env=env, stdout=log,
                                        stderr=subprocess.STDOUT)
        log.close()

    def workers(self) -> list[int]:
        return children(self.process.pid) if self.process is not None else []

    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def log_text(self) -> str:
        try:
            return self.train_log.read_text(encoding="utf-8", errors="replace")
        except FileNotFoundError:
            return ""

    def launch_logs(self) -> str:
        return "\n".join((self.folder / f"launch-{n}.log").read_text(errors="replace")
                         for n in range(1, self.launches + 1))

    def kill_all(self) -> list[int]:
        """SIGKILL the agent and its workers, back to back (torchrun starts each worker in its own session, so
        killing the agent's process group alone would leave them running). Returns the pids killed."""
        if self.process is None or self.process.poll() is not None:
            return []
        victims = [self.process.pid, *self.workers()]
        for pid in victims:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.process.wait()
        return victims


class Attempt:
    """What one attempt (one start of the workers) has done so far: rows and log text since it began."""

    def __init__(self, job: Job, workers: list[int]) -> None:
        self.job, self.workers = job, workers
        self.row_offset = len(read_metrics(job.metrics))
        self.log_offset = len(job.log_text())
        self.old_tmp = _temporary_files(job.snaps)  # left by an earlier killed save: not this attempt's

    def new_tmp(self) -> set[str]:
        return _temporary_files(self.job.snaps) - self.old_tmp

    def rows(self) -> list[dict]:
        return read_metrics(self.job.metrics)[self.row_offset :]

    def train_rows(self) -> list[dict]:
        return [r for r in self.rows() if "train_loss" in r]

    def base_step(self) -> Optional[int]:
        """The step this attempt resumed from (0 = fresh start), once it has said so."""
        text = self.job.log_text()[self.log_offset :]
        if m := RESUMED.search(text):
            return int(m.group(1))
        return 0 if FRESH in text else None


def _new_attempt(job: Job, previous: list[int], timeout: float) -> Optional[Attempt]:
    """Wait until the job's workers are (re)started: all nproc of them, none of the previous ones."""
    workers = wait_until(lambda: (w := job.workers()) and len(w) == job.nproc and not set(w) & set(previous) and w
                    or (not job.running() and "ended"), timeout, interval=0.005)
    if not workers or workers == "ended":
        return None
    return Attempt(job, workers)


def _classify(attempt: Attempt, pre_tmp: set[str], pre_last: Optional[dict]) -> tuple[str, str]:
    """The moment a kill hit, from what was on disk just before it and is still (not) there after it."""
    snaps = attempt.job.snaps
    if pre_last is None:
        return "startup", "before the attempt's first training step"
    interrupted = pre_tmp & attempt.new_tmp()
    if interrupted:
        name = sorted(interrupted)[0].split(".tmp-")[0].lstrip(".")
        if not (snaps / name).exists():
            return "save", f"{name} left half-written"
    step = pre_last["step"]
    if step % EVAL_EVERY == 0 and not any(r.get("step") == step and "val_loss" in r for r in attempt.rows()):
        return "eval", f"evaluation of step {step} never finished"
    return "step", f"during step {step + 1}"


def _strike(job: Job, attempt: Attempt, kill: Kill, restart: str, rng: random.Random, startup_s: float) -> bool:
    """Wait for the moment `kill.target` in this attempt, then SIGKILL. False when the job ended first."""
    # Train rows this attempt must have logged before the moment may come (small for eval and save, so that
    # an evaluation or a save is still ahead after a late resume).
    threshold = rng.randint(1, 12 if kill.target == "step" else 6)
    seen = lambda: len(attempt.train_rows()) >= threshold  # noqa: E731
    ended = lambda: not job.running()  # noqa: E731
    if kill.target == "startup":
        # A random moment of the reference's start-up, but no later than this attempt's first step: a start-up
        # quicker than the reference's (measured while the machine was busier) let a whole 45-step job end first.
        deadline = time.monotonic() + rng.uniform(0.05, 0.9) * startup_s
        wait_until(lambda: time.monotonic() >= deadline or attempt.train_rows() or ended(), 600, interval=0.005)
    elif kill.target == "step":
        if not wait_until(lambda: seen() or ended(), 600) or ended():
            return False
        recent = [r.get("ms_per_step", 50.0) for r in attempt.train_rows()[-3:]]
        time.sleep(rng.random() * sum(recent) / len(recent) / 1000)
    elif kill.target == "eval":
        def at_eval():
            rows = attempt.rows()
            train = [r for r in rows if "train_loss" in r]
            if len(train) < threshold or train[-1]["step"] % EVAL_EVERY:
                return False
            return not any("val_loss" in r and r["step"] == train[-1]["step"] for r in rows)

        if not wait_until(lambda: at_eval() or ended(), 600, interval=0.001) or ended():
            return False
    elif kill.target == "save":
        if not wait_until(lambda: (seen() and attempt.new_tmp()) or ended(), 600, interval=0.0005) or ended():
            return False
    if not job.running():
        return False
    pre_tmp, train = attempt.new_tmp(), attempt.train_rows()
    pre_last = train[-1] if train else None
    if restart == "rerun":
        victims = job.kill_all()  # the agent and all its workers at once: a lost node
        kill.killed = "agent+workers"
    else:
        by_rank = {rank_of(pid): pid for pid in attempt.workers}
        rank = 0 if kill.target == "save" else rng.randrange(job.nproc)  # rank 0 is the one that writes
        victim = by_rank.get(rank, attempt.workers[0])
        os.kill(victim, signal.SIGKILL)
        victims = [victim]
        kill.killed = f"rank {rank}"
    wait_until(lambda: not any(alive(pid) for pid in victims), 10)
    kill.hit, kill.detail = _classify(attempt, pre_tmp, pre_last)
    if pre_last is not None:
        kill.step = pre_last["step"]
    else:  # killed before its first step: it had got as far as the snapshot it resumed from (or would have)
        base = attempt.base_step()
        kill.step = base if base is not None else max(_snapshot_steps(job.snaps), default=0)
    return True


def _settle(pending: list[Kill], base: Optional[int]) -> None:
    """The step the restarted job resumed from is known: the steps each pending kill lost."""
    if base is None:
        return
    for kill in pending:
        kill.resumed_from, kill.lost = base, max(0, kill.step - base)
    pending.clear()


def run_trial(index: int, folder: Path, restart: str, targets: list[str], rng: random.Random, nproc: int,
              steps: int, startup_s: float, timeout: float, code: Path, overrides: tuple[str, ...] = ()) -> Trial:
    trial = Trial(index=index, restart=restart)
    started = time.monotonic()
    shutil.rmtree(folder, ignore_errors=True)
    job = Job(folder, nproc, steps, max_restarts=len(targets) if restart == "torchrun" else 0, code=code,
              overrides=overrides)
    job.start()
    try:
        attempt = _new_attempt(job, [], timeout)
        pending: list[Kill] = []  # kills whose restart has not said yet which step it resumed from
        for n, target in enumerate(targets):
            kill = Kill(target=target)
            trial.kills.append(kill)
            if attempt is None or not _strike(job, attempt, kill, restart, rng, startup_s):
                break
            pending.append(kill)
            if restart == "rerun":
                job.start()
            attempt = _new_attempt(job, attempt.workers, timeout)
            if attempt is None:
                trial.error = f"no new attempt after kill {len(trial.kills)}"
                break
            if n + 1 < len(targets) and targets[n + 1] == "startup":
                continue  # strike again before this attempt has even resumed
            wait_until(lambda: attempt.base_step() is not None or not job.running(), timeout, interval=0.02)
            _settle(pending, attempt.base_step())
        if job.process is not None:
            trial.exit_code = job.process.wait(timeout=timeout)
            if attempt is not None:
                _settle(pending, attempt.base_step())
        if pending and not trial.error:
            trial.error = f"no resume after kill {trial.kills.index(pending[0]) + 1}"
    except subprocess.TimeoutExpired:
        trial.error = f"did not finish within {timeout:.0f} s"
    finally:
        job.kill_all()
    struck = [k for k in trial.kills if k.hit != "missed"]
    trial.resumed = trial.exit_code == 0 and all(k.resumed_from is not None for k in struck) and not trial.error
    trial.seconds = round(time.monotonic() - started, 1)
    if trial.exit_code not in (0, None) and not trial.error:
        trial.error = f"exit code {trial.exit_code}: " + job.launch_logs()[-1500:]
    return trial


def compare(run_dir: Path, reference: dict) -> tuple[bool, str]:
    """Final weights and every per-step train/val loss row equal to the reference's."""
    try:
        summary = json.loads((run_dir / "summary.json").read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return False, "no summary.json"
    if summary.get("weights_sha256") != reference["sha256"]:
        return False, f"weights sha256 {summary.get('weights_sha256', '')[:16]} != {reference['sha256'][:16]}"
    rows = read_metrics(run_dir / "metrics.jsonl")
    for key in ("train_loss", "val_loss"):
        ref = reference[key]
        got = {r["step"] for r in rows if key in r}
        if got != set(ref):
            return False, f"{key} rows for steps {sorted(got ^ set(ref))[:10]} differ from the reference"
        for r in rows:
            if key in r and r[key] != ref[r["step"]]:
                return False, f"{key} at step {r['step']}: {r[key]} != {ref[r['step']]}"
    return True, ""


def run_reference(folder: Path, nproc: int, steps: int, timeout: float, code: Path,
                  overrides: tuple[str, ...] = ()) -> dict:
    shutil.rmtree(folder, ignore_errors=True)
    job = Job(folder, nproc, steps, max_restarts=0, code=code, overrides=overrides)
    started = time.monotonic()
    job.start()
    attempt = _new_attempt(job, [], timeout)
    first_step = wait_until(lambda: attempt is not None and attempt.train_rows() or not job.running(), timeout, 0.01)
    startup_s = time.monotonic() - started
    exit_code = job.process.wait(timeout=timeout)
    if exit_code != 0 or not first_step:
        raise RuntimeError(f"the reference run failed (exit code {exit_code}):\n{job.launch_logs()[-3000:]}")
    rows = read_metrics(job.metrics)
    summary = json.loads((job.run_dir / "summary.json").read_text())
    return {
        "sha256": summary["weights_sha256"],
        "train_loss": {r["step"]: r["train_loss"] for r in rows if "train_loss" in r},
        "val_loss": {r["step"]: r["val_loss"] for r in rows if "val_loss" in r},
        "startup_s": round(startup_s, 2),
        "seconds": round(time.monotonic() - started, 1),
    }


def freeze_code(folder: Path) -> Path:
    """A copy of the project's code and configs: the reference and every trial run the very same code, even if
    the working tree is edited while the harness runs (a changed line would change the weights)."""
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    for path in [*PROJECT_DIR.glob("*.py"), *PROJECT_DIR.glob("*.yaml")]:
        shutil.copy2(path, folder / path.name)
    shutil.copytree(PROJECT_DIR / "preset", folder / "preset")
    shutil.copytree(PROJECT_DIR / "mingpt", folder / "mingpt", ignore=shutil.ignore_patterns("__pycache__"))
    return folder


def run_references(workdir: Path, strategies: tuple[str, ...], nproc: int, steps: int, timeout: float, code: Path,
                   log: Callable[[str], None]) -> dict[str, dict]:
    """An uninterrupted run per strategy (their weights differ: another reduction order)."""
    references = {}
    for strategy in strategies:
        overrides = (f"parallel_config.strategy={strategy}",)
        reference = run_reference(workdir / f"reference-{strategy}", nproc, steps, timeout, code, overrides)
        log(f"reference ({strategy}): {steps} steps in {reference['seconds']} s (start-up "
            f"{reference['startup_s']} s), sha256 {reference['sha256'][:16]}")
        references[strategy] = reference
    return references


def run_chaos(trials: int, seed: int = 0, nproc: int = 2, workdir: Optional[Path] = None, steps: int = 45,
              kills: int = 2, timeout: float = 300, log: Callable[[str], None] = print,
              strategies: tuple[str, ...] = ("ddp",)) -> dict:
    """A reference run per strategy and `trials` chaos trials; returns the results (see main() for the table).
    Trials take the strategies in turn; the kind of restart changes after each round of them."""
    workdir = Path(workdir or tempfile.mkdtemp(prefix="chaos-"))
    workdir.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    started = time.monotonic()
    code = freeze_code(workdir / "code")
    references = run_references(workdir, strategies, nproc, steps, timeout, code, log)
    # Moments in shuffled rounds of all four: any 4 consecutive kills cover every moment.
    targets: list[str] = []
    while len(targets) < trials * kills:
        targets += rng.sample(MOMENTS, len(MOMENTS))
    results = []
    for i in range(trials):
        strategy = strategies[i % len(strategies)]
        restart = RESTARTS[i // len(strategies) % len(RESTARTS)]  # every (strategy, restart) in len x 2 trials
        reference = references[strategy]
        folder, trial_rng = workdir / f"trial-{i + 1:03d}", random.Random(rng.getrandbits(64))
        trial = run_trial(i + 1, folder, restart, targets[i * kills : (i + 1) * kills], trial_rng, nproc, steps,
                          reference["startup_s"], timeout, code, (f"parallel_config.strategy={strategy}",))
        trial.strategy = strategy
        if trial.resumed:
            trial.identical, why = compare(folder / "run", reference)
            if not trial.identical:
                trial.error = why
        results.append(trial)
        log(trial_line(trial))
    summary = {
        "trials": trials,
        "resumed": sum(t.resumed for t in results),
        "identical": sum(t.identical for t in results),
        "lost_steps": sum(t.lost for t in results),
        "kills": sum(k.hit != "missed" for t in results for k in t.kills),
        "hits": {m: sum(k.hit == m for t in results for k in t.kills) for m in (*MOMENTS, "missed")},
        "seconds": round(time.monotonic() - started, 1),
    }
    return {
        "config": {"seed": seed, "nproc": nproc, "steps": steps, "strategies": list(strategies),
                   "kills_per_trial": kills, "save_every_steps": SAVE_EVERY, "eval_every_steps": EVAL_EVERY,
                   "workdir": str(workdir)},
        "reference": {name: {k: ref[k] for k in ("sha256", "startup_s", "seconds")}
                      for name, ref in references.items()},
        "summary": summary,
        "trials": [{**asdict(t), "lost": t.lost} for t in results],
    }


def trial_line(t: Trial) -> str:
    kills = "; ".join(
        f"{k.target}->{k.hit} {k.killed} at step {k.step}, resumed from {k.resumed_from} (lost {k.lost})"
        if k.hit != "missed" else f"{k.target}->missed (job ended first)" for k in t.kills
    )
    status = "ok" if t.identical else f"FAILED: {t.error.splitlines()[0] if t.error else 'not identical'}"
    return f"trial {t.index:3d} {t.strategy:4s} {t.restart:8s} {t.seconds:6.1f} s  {status}  [{kills}]"


def table(result: dict) -> str:
    s = result["summary"]
    hits = ", ".join(f"{m} {n}" for m, n in s["hits"].items())
    return "\n".join([
        "| trials | resumed | identical | lost steps | kills | moments hit | time |",
        "| --- | --- | --- | --- | --- | --- | --- |",
        f"| {s['trials']} | {s['resumed']} | {s['identical']} | {s['lost_steps']} | {s['kills']} | {hits} | "
        f"{s['seconds']:.0f} s |",
    ])


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trials", type=int, default=20, help="number of chaos trials (default 20)")
    parser.add_argument("--seed", type=int, default=0, help="seeds the moments, ranks and delays (default 0)")
    parser.add_argument("--nproc", type=int, default=2, help="torchrun --nproc_per_node (default 2)")
    parser.add_argument("--kills", type=int, default=2, help="SIGKILLs per trial (default 2)")
    parser.add_argument("--steps", type=int, default=45, help="trainer_config.max_steps of the job (default 45)")
    parser.add_argument("--workdir", type=Path, help="where runs and snapshots go (default: a new temp folder)")
    parser.add_argument("--keep", action="store_true", help="keep the workdir (a temp workdir is deleted)")
    parser.add_argument("--json", type=Path, help="also write the full results to this JSON file")
    parser.add_argument("--timeout", type=float, default=300, help="seconds one attempt may take (default 300)")
    parser.add_argument("--strategy", choices=("ddp", "fsdp", "both"), default="ddp",
                        help="parallel_config.strategy of the job (default ddp; fsdp saves folders of shards; both: "
                             "trials alternate, each against its strategy's own reference)")
    args = parser.parse_args(argv)
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="chaos-"))
    try:
        result = run_chaos(args.trials, args.seed, args.nproc, workdir, args.steps, args.kills, args.timeout,
                           strategies=("ddp", "fsdp") if args.strategy == "both" else (args.strategy,))
    finally:
        if args.workdir is None and not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)
    print(table(result))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    s = result["summary"]
    return 0 if s["resumed"] == s["identical"] == s["trials"] else 1


if __name__ == "__main__":
    sys.exit(main())
