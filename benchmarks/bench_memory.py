"""Peak memory per rank of the real training command, through start-up and the first steps, under torchrun.

    python benchmarks/bench_memory.py --strategy ddp,fsdp --rounds 2 --json memory.json  # 113M parameters, 4 ranks
    python benchmarks/bench_memory.py --strategy fsdp --project-dir /tmp/before  # another checkout's main.py
    python benchmarks/bench_memory.py --initial-weights --strategy ddp,fsdp      # the weights each layout starts from
    python benchmarks/bench_memory.py --model tiny --nproc 2 --strategy fsdp     # seconds: the script itself

Each run is `python -m torch.distributed.run --standalone --nproc_per_node=N main.py ...` (gloo on the CPU), a fresh
run directory and snapshot folder in a temporary folder, with the model of `--model` (`113m`: 16 blocks x 768 wide,
12 heads, block 64, batch 2 per rank, 113.4M parameters; `tiny`: benchmarks/chaos.py's), in fp32 (so the figure
does not depend on the CPU's bf16 support), `--steps` steps, one validation batch at the end, one log line a step.
Arguments starting with `--` are the benchmark's; the rest are Hydra overrides, given after the benchmark's own (the
last of a key wins). The `--strategy` names: `ddp`, `fsdp`, `tp` (tensor parallelism over all the processes), `pp`
(a pipeline stage per process; the batch must split into that many micro-batches). `--env KEY=VALUE` sets a variable
in the workers (e.g. MALLOC_MMAP_THRESHOLD_=1048576, glibc's); `--stop-after-steps` kills the job once its last step
is logged (no `run` figure: no end-of-run snapshot, which under DDP doubles rank 0's memory for a moment).

While it runs, every worker's /proc/PID/status is read every `--interval` seconds: VmHWM (the kernel's high-water
mark of its resident set: the true peak, whatever happened between two reads), VmRSS and its parts (RssAnon: what
the process allocated; RssFile: mapped files, torch's libraries mostly, the same pages in every process; RssShmem).
Reported per rank, at three moments of rank 0's log: `startup`, when it logs its plan ("training: steps ...",
after the model, its layout, the optimizer and the starting point kept in host memory: everything before the first
step); `steps`, when it logs the last step (`--steps`); `run`, the last reading before the worker exits (the
end-of-run validation, snapshot, gathered sample and exit included). The other ranks are read at the same moment,
within milliseconds of rank 0's line: they are then at most early in their first step (no collective yet), or in
the last step's log line, whose loss is all-reduced. Each figure is VmHWM at that moment (the peak so far) and the
largest RssAnon sampled so far, in MiB. Rounds alternate the strategies (ddp, fsdp, ddp, fsdp, ...); the summary gives
each rank's median and range over the rounds, and the ratio of each strategy's largest rank to the first
strategy's, per round (rounds paired in order) and of the medians.

`--initial-weights` instead builds the trainer exactly as a run does (`main.build_trainer`) for each strategy in
turn, in one torchrun launch (one process group), and in one plain process (the whole model built whole: "one
process's weights"), and compares the sha256 of the whole model's weights before any step (the digest a run writes
into summary.json at its end: `weights_sha256_of(parallel.whole_tensors())`, the tensors gathered one at a time, in
canonical order).

Only the standard library; Linux (/proc).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Optional

PROJECT_DIR = Path(__file__).resolve().parent.parent
MIB = 2**20

MODELS = {
    # GPT-2 small's width and heads, 16 blocks: 113,370,624 parameters with the 65-character vocabulary
    "113m": ["gpt_config.n_layer=16", "gpt_config.n_head=12", "gpt_config.n_embd=768", "data_config.block_size=64",
             "trainer_config.batch_size=2"],
    "tiny": None,  # benchmarks/chaos.py's TINY_MODEL (imported when used)
}
# The run around the model: fp32, a log line a step, one validation batch (at the end), a progress line per step.
RUN = ["trainer_config.mixed_precision=fp32", "trainer_config.log_every_steps=1", "trainer_config.eval_every_steps=0",
       "trainer_config.eval_batches=1", "trainer_config.progress=lines"]
STATUS_FIELDS = ("VmHWM", "VmRSS", "RssAnon", "RssFile", "RssShmem")
PLAN = "training: steps"
MODEL_LINE = re.compile(r"model: ([\d,]+) parameters")
STEP_LINE = re.compile(r"step (\d+)/(\d+) \|")
MOMENTS = ("startup", "steps", "run")


def strategy_overrides(name: str, nproc: int) -> list[str]:
    if name in ("ddp", "fsdp"):
        return [f"parallel_config.strategy={name}"]
    if name == "tp":
        return ["parallel_config.strategy=ddp", f"parallel_config.tp={nproc}"]
    if name == "pp":
        return ["parallel_config.strategy=ddp", f"parallel_config.pp={nproc}"]
    raise ValueError(f"unknown strategy {name!r}: ddp, fsdp, tp or pp")


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--strategy", default="ddp,fsdp", help="comma-separated: ddp, fsdp, tp, pp (default ddp,fsdp)")
    parser.add_argument("--nproc", type=int, default=4, help="processes (torchrun --nproc_per_node)")
    parser.add_argument("--rounds", type=int, default=1, help="runs of each strategy, alternating")
    parser.add_argument("--steps", type=int, default=3, help="training steps (trainer_config.max_steps)")
    parser.add_argument("--model", choices=sorted(MODELS), default="113m")
    parser.add_argument("--project-dir", type=Path, default=PROJECT_DIR,
                        help="the checkout whose main.py runs (default: this one)")
    parser.add_argument("--interval", type=float, default=0.02, help="seconds between two readings of /proc")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds a run may take")
    parser.add_argument("--initial-weights", action="store_true",
                        help="compare each strategy's initial weights with one process's instead")
    parser.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                        help="set in the workers' environment (e.g. MALLOC_MMAP_THRESHOLD_=1048576); repeatable")
    parser.add_argument("--stop-after-steps", action="store_true",
                        help="kill the job once the last step is logged (no end-of-run save: less memory, less time)")
    parser.add_argument("--timeline", action="store_true", help="also keep every rank's RSS over time in the JSON")
    parser.add_argument("--json", default=None, help="also write the result to this file")
    parser.add_argument("--digest-worker", action="store_true", help=argparse.SUPPRESS)  # the --initial-weights worker
    return parser.parse_known_args(argv)


# ------------------------------------------------------------------------------------------------------- /proc
def read_status(pid: int) -> Optional[dict[str, int]]:
    """STATUS_FIELDS of a process, in bytes; None once it is gone."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    found = {}
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key in STATUS_FIELDS:
            found[key] = int(value.split()[0]) * 1024
    return found if "VmHWM" in found else None  # a zombie has no memory lines


class Worker:
    """One torchrun worker, followed by its pid: the highest readings so far and, optionally, a timeline."""

    def __init__(self, pid: int, rank: int, timeline: bool) -> None:
        self.pid, self.rank = pid, rank
        self.last: dict[str, int] = {}
        self.max_anon = self.max_rss = 0
        self.lock = threading.Lock()
        self.timeline: Optional[list[list[float]]] = [] if timeline else None

    def read(self, t: float) -> bool:
        status = read_status(self.pid)
        if status is None:
            return False
        with self.lock:
            self.last = status
            self.max_anon = max(self.max_anon, status.get("RssAnon", 0))
            self.max_rss = max(self.max_rss, status["VmRSS"])
            rss, anon = status["VmRSS"] / MIB, status.get("RssAnon", 0) / MIB
            if self.timeline is not None and (not self.timeline or abs(rss - self.timeline[-1][1]) >= 4):
                self.timeline.append([round(t, 2), round(rss), round(anon)])
        return True

    def moment(self) -> dict:
        """The figures so far, in MiB: the kernel's peak, the largest RssAnon and RSS sampled, the last reading."""
        with self.lock:
            return {"vm_hwm_mib": round(self.last.get("VmHWM", 0) / MIB, 1),
                    "max_rss_anon_mib": round(self.max_anon / MIB, 1), "max_rss_mib": round(self.max_rss / MIB, 1),
                    **{f"{key}_mib": round(value / MIB, 1) for key, value in self.last.items() if key != "VmHWM"}}


# ------------------------------------------------------------------------------------------------------ a run
def env_for(tmp: Path, extra: list[str]) -> dict[str, str]:
    env = dict(os.environ)
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID"):
        env.pop(key, None)
    env["TMPDIR"] = str(tmp)  # torchrun's torchelastic_* folders
    env["PYTHONUNBUFFERED"] = "1"
    env.update(item.split("=", 1) for item in extra)
    return env


def torchrun(nproc: int) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]


def model_overrides(name: str) -> list[str]:
    if MODELS[name] is not None:
        return list(MODELS[name])
    sys.path.insert(0, str(PROJECT_DIR))
    from benchmarks.chaos import TINY_MODEL

    return list(TINY_MODEL)


def kill(proc: subprocess.Popen, workers: dict[int, "Worker"]) -> None:
    """SIGKILL the workers this run started, then their torchrun (they run in sessions of their own)."""
    for pid in workers:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.kill()
    proc.wait()


def measure(args: argparse.Namespace, strategy: str, overrides: list[str]) -> dict:
    """One run of main.py under torchrun, every worker's memory followed until it exits."""
    sys.path.insert(0, str(PROJECT_DIR))
    from benchmarks.chaos import children, rank_of

    with tempfile.TemporaryDirectory(prefix="bench-memory-") as folder:
        tmp = Path(folder)
        command = [*torchrun(args.nproc), str(args.project_dir / "main.py"), *model_overrides(args.model), *RUN,
                   f"trainer_config.max_steps={args.steps}", *strategy_overrides(strategy, args.nproc),
                   f"trainer_config.snapshot_path={tmp / 'snapshots'}", f"hydra.run.dir={tmp / 'run'}", *overrides]
        start = time.monotonic()
        proc = subprocess.Popen(command, cwd=tmp, env=env_for(tmp, args.env), stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, bufsize=1)
        workers: dict[int, Worker] = {}
        moments: dict[str, dict] = {}
        events: dict[str, float] = {}
        output: list[str] = []
        n_params: list[int] = []

        def at(name: str) -> None:  # every worker read now, at rank 0's line
            t = time.monotonic() - start
            for worker in list(workers.values()):
                worker.read(t)
            moments[name] = {w.rank: w.moment() for w in workers.values()}
            events[name] = round(t, 2)

        def follow_output() -> None:
            for line in proc.stdout:
                output.append(line)
                if (found := MODEL_LINE.search(line)) is not None:
                    n_params.append(int(found.group(1).replace(",", "")))
                    events["model"] = round(time.monotonic() - start, 2)
                elif PLAN in line and "startup" not in moments:
                    at("startup")
                elif (step := STEP_LINE.search(line)) is not None and int(step.group(1)) == args.steps:
                    at("steps")

        reader = threading.Thread(target=follow_output, daemon=True)
        reader.start()
        deadline, stopped = start + args.timeout, False
        while proc.poll() is None:
            t = time.monotonic() - start
            if len(workers) < args.nproc:
                for pid in children(proc.pid):
                    if pid not in workers and (rank := rank_of(pid)) is not None:
                        workers[pid] = Worker(pid, rank, args.timeline)
            for worker in list(workers.values()):
                worker.read(t)
            if time.monotonic() > deadline:
                kill(proc, workers)
                raise TimeoutError(f"{strategy}: no end after {args.timeout} s:\n{''.join(output)[-3000:]}")
            if args.stop_after_steps and "steps" in moments:
                stopped = True
                kill(proc, workers)
                break
            time.sleep(args.interval)
        reader.join(timeout=10)
        wall = time.monotonic() - start
    text = "".join(output)
    if (proc.returncode != 0 and not stopped) or "startup" not in moments or "steps" not in moments:
        raise RuntimeError(f"{strategy}: exit {proc.returncode}, moments {sorted(moments)}:\n{text[-3000:]}")
    ranks = sorted(w.rank for w in workers.values())
    if ranks != list(range(args.nproc)):
        raise RuntimeError(f"{strategy}: followed ranks {ranks}, expected {args.nproc}")
    if not stopped:
        moments["run"] = {w.rank: w.moment() for w in workers.values()}
    per_rank = [{"rank": rank, **{name: moments[name][rank] for name in MOMENTS if name in moments}}
                for rank in ranks]
    result = {"strategy": strategy, "n_params": n_params[0] if n_params else None, "wall_s": round(wall, 1),
              "events_s": events, "ranks": per_rank}
    if args.timeline:
        result["timeline"] = {w.rank: w.timeline for w in workers.values()}
    return result


# ----------------------------------------------------------------------------------------------- the summary
def spread(values: list[float]) -> dict:
    return {"median": round(statistics.median(values), 1), "min": round(min(values), 1),
            "max": round(max(values), 1), "values": [round(v, 1) for v in values]}


def summarize(runs: list[dict], strategies: list[str]) -> dict:
    """Per strategy and rank: the median and range over rounds of each moment's VmHWM and RssAnon; the largest
    rank's; and each strategy's largest rank over the first strategy's, per round and of the medians."""
    summary: dict = {}
    for strategy in strategies:
        mine = [run for run in runs if run["strategy"] == strategy]
        figures: dict = {"rounds": len(mine), "ranks": {}, "largest_rank": {}}
        for moment in [m for m in MOMENTS if m in mine[0]["ranks"][0]]:
            for key in ("vm_hwm_mib", "max_rss_anon_mib"):
                for rank in range(len(mine[0]["ranks"])):
                    figures["ranks"].setdefault(rank, {}).setdefault(moment, {})[key] = spread(
                        [run["ranks"][rank][moment][key] for run in mine])
                figures["largest_rank"].setdefault(moment, {})[key] = spread(
                    [max(r[moment][key] for r in run["ranks"]) for run in mine])
        summary[strategy] = figures
    base = strategies[0]
    for strategy in strategies[1:]:
        ratios: dict = {}
        for moment in summary[strategy]["largest_rank"]:
            for key in ("vm_hwm_mib", "max_rss_anon_mib"):
                ours = summary[strategy]["largest_rank"][moment][key]
                theirs = summary[base]["largest_rank"][moment][key]
                paired = [a / b for a, b in zip(ours["values"], theirs["values"])]
                ratios.setdefault(moment, {})[key] = {"of_medians": round(ours["median"] / theirs["median"], 3),
                                                      "per_round": [round(r, 3) for r in paired]}
        summary[strategy][f"over_{base}"] = ratios
    return summary


def print_table(runs: list[dict], summary: dict, strategies: list[str]) -> None:
    out = sys.stderr
    print("peak memory per rank, MiB: VmHWM (RssAnon sampled) at the end of start-up / of the steps / of the run",
          file=out)
    print(f"{'strategy':<9} {'round':>5} {'rank':>4} {'startup':>16} {'steps':>16} {'run':>16}", file=out)
    rounds: dict[str, int] = {}
    for run in runs:
        rounds[run["strategy"]] = rounds.get(run["strategy"], 0) + 1
        for r in run["ranks"]:
            cells = [f"{r[m]['vm_hwm_mib']:.0f} ({r[m]['max_rss_anon_mib']:.0f})" if m in r else "-" for m in MOMENTS]
            print(f"{run['strategy']:<9} {rounds[run['strategy']]:>5} {r['rank']:>4} "
                  + " ".join(f"{c:>16}" for c in cells), file=out)
    for strategy in strategies:
        largest = summary[strategy]["largest_rank"]
        print(f"{strategy}: largest rank, median (min-max) VmHWM: " + ", ".join(
            f"{m} {largest[m]['vm_hwm_mib']['median']:.0f} ({largest[m]['vm_hwm_mib']['min']:.0f}-"
            f"{largest[m]['vm_hwm_mib']['max']:.0f})" for m in largest), file=out)
        over = summary[strategy].get(f"over_{strategies[0]}")
        if over:
            print(f"{strategy} / {strategies[0]}, largest rank, VmHWM: " + ", ".join(
                f"{m} {over[m]['vm_hwm_mib']['of_medians']} {over[m]['vm_hwm_mib']['per_round']}"
                for m in over), file=out)


# ------------------------------------------------------------------------------------------ initial weights
def digest_worker(project_dir: Path, strategies: list[str], overrides: list[str]) -> None:
    """Under torchrun (or alone): for each strategy in turn, on one process group, the trainer a run builds and the
    digest of its whole weights before any step; rank 0 prints one JSON line, {strategy: result}."""
    sys.path.insert(0, str(project_dir))
    import main
    from char_dataset import CharCorpus
    from mingpt.distributed import process_group as distributed

    nproc = distributed.world_size()  # tp and pp span every process
    configs = {name: main.load_config([*overrides, *strategy_overrides(name, nproc)]) for name in strategies}
    corpus = CharCorpus.load(configs[strategies[0]].data_config, build=distributed.local_rank() == 0)  # one corpus
    ctx = distributed.setup_distributed()
    results = {}
    try:
        distributed.configure_device(ctx.device)
        for name, cfg in configs.items():
            results[name] = initial_digest(main.build_trainer(cfg, corpus, ctx, run_dir=None, with_snapshots=False),
                                           ctx)
        if ctx.is_main:
            print(json.dumps(results))
    except BaseException:
        distributed.abandon_distributed()
        raise
    distributed.leave_distributed()  # the trainers are garbage by now: their process groups go with the group's end


def initial_digest(trainer: Any, ctx: Any) -> dict:
    """Collective. The layout, and every rank's digest of the whole weights and count of the parameters it holds."""
    from mingpt.parallel.state import weights_sha256_of

    params = {id(p): p for module in trainer.parallel.modules for p in module.parameters()}  # tied: once
    held = sum((p.to_local() if hasattr(p, "to_local") else p).numel() for p in params.values())  # its shards
    digest = weights_sha256_of(trainer.parallel.whole_tensors())
    everyone = ctx.gather_objects({"digest": digest, "held": held})
    return {"layout": trainer.parallel.name, "world_size": ctx.world_size,
            "rank_digests": [r["digest"] for r in everyone], "parameters_held_per_rank": [r["held"] for r in everyone]}


def initial_weights(args: argparse.Namespace, strategies: list[str], overrides: list[str]) -> dict:
    """Each strategy's digest before the first step (all of them built in turn by one torchrun launch: the same
    trainers a run of each builds, for one start-up instead of one each), and one plain process's."""
    base = [*model_overrides(args.model), "trainer_config.mixed_precision=fp32", *overrides]
    me = [str(Path(__file__).resolve()), "--digest-worker", "--project-dir", str(args.project_dir)]
    with tempfile.TemporaryDirectory(prefix="bench-memory-") as folder:
        def digests(what: str, command: list[str]) -> dict:  # the worker's {strategy: result}
            done = subprocess.run(command, cwd=folder, env=env_for(Path(folder), args.env), capture_output=True,
                                  text=True, timeout=args.timeout)
            if done.returncode != 0:
                raise RuntimeError(f"{what}: exit {done.returncode}:\n{(done.stdout + done.stderr)[-3000:]}")
            return json.loads(done.stdout.strip().splitlines()[-1])

        one_process = digests("one process", [sys.executable, *me, "--strategy", "ddp", *base])["ddp"]
        each = digests(", ".join(strategies), [*torchrun(args.nproc), *me, "--strategy", ",".join(strategies), *base])
    results = {"one process": one_process, **each}
    reference = results["one process"]["rank_digests"][0]
    for name, result in results.items():
        result["equals_one_process"] = set(result["rank_digests"]) == {reference}
    return {"reference_sha256": reference, "runs": results}


# ------------------------------------------------------------------------------------------------------ main
def cli(argv: list[str]) -> int:
    args, overrides = parse_args(argv)
    args.project_dir = args.project_dir.resolve()
    strategies = [s.strip() for s in args.strategy.split(",") if s.strip()]
    if args.digest_worker:
        digest_worker(args.project_dir, strategies, overrides)
        return 0
    if bad := [item for item in args.env if "=" not in item]:
        raise SystemExit(f"error: --env takes KEY=VALUE, got {bad[0]!r}")
    for name in strategies:
        strategy_overrides(name, args.nproc)  # an unknown one fails here, before anything runs
    setting = {"nproc": args.nproc, "model": args.model, "steps": args.steps, "project_dir": str(args.project_dir),
               "overrides": overrides, "env": args.env, "strategies": strategies}
    if args.initial_weights:
        result = {**setting, "initial_weights": initial_weights(args, strategies, overrides)}
        for name, run in result["initial_weights"]["runs"].items():
            print(f"{name}: {run['layout']}, {run['world_size']} process(es), sha256 {run['rank_digests'][0][:16]}, "
                  f"equal to one process's: {run['equals_one_process']}", file=sys.stderr)
    else:
        runs = []
        for round_ in range(args.rounds):
            for strategy in strategies:
                print(f"round {round_ + 1}/{args.rounds}: {strategy} ...", file=sys.stderr, flush=True)
                runs.append(measure(args, strategy, overrides))
        summary = summarize(runs, strategies)
        result = {**setting, "n_params": runs[0]["n_params"], "runs": runs, "summary": summary}
        print_table(runs, summary, strategies)
    text = json.dumps(result, indent=2)
    print(text)
    if args.json:
        Path(args.json).write_text(text + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(cli(sys.argv[1:]))
