"""The recipe's options, one change at a time: each variant's validation loss after a fixed budget of training time.

    python benchmarks/recipe.py                                   # every variant against the baseline, 3 runs each
    python benchmarks/recipe.py --variants baseline muon wsd --runs 5 --budget 60 --json recipe.json
    python benchmarks/recipe.py --base preset=cpu gpt_config.n_layer=2 --variants baseline muon

Each variant is a list of Hydra overrides on top of `--base` (default `preset=cpu`, the quick start). A variant is
first calibrated: one run of `--calibration-steps` steps gives its median step time (metrics.jsonl's ms_per_step)
and the time an evaluation adds; its timed runs then take as many steps as fit `--budget` seconds of the Trainer's
clock (`summary.json`'s wall time: training, evaluations and snapshots, not start-up), so every variant trains for
about the same time, and the schedule decays over exactly those steps. Runs alternate between the variants (run r
of every variant, then run r + 1; the order rotated each round, against the machine's drift), each with its own
seed (1337 + r) and its own snapshot folder. Reported per
variant: the final validation losses, their median and spread, the median wall time, and the median of the paired
differences from the first variant (same round, same seed).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the project's root: main.py, mingpt/

import argparse
import json
import statistics
import subprocess
import tempfile

from mingpt import PROJECT_DIR

VARIANTS = {
    "baseline": [],
    "muon": ["optimizer_config.name=muon"],
    "wsd": ["optimizer_config.schedule=wsd"],
    "rotary": ["gpt_config.positions=rotary"],
    "rmsnorm": ["gpt_config.norm=rmsnorm"],
    "relu2": ["gpt_config.activation=relu2"],
    "qk_norm": ["gpt_config.qk_norm=true"],
    "untied": ["gpt_config.tie_embeddings=false"],
    "softcap": ["gpt_config.logit_softcap=30"],
    "zero_init": ["gpt_config.zero_init_proj=true"],
}


def train(overrides: list[str], steps: int, seed: int, folder: Path) -> dict:
    """One run of main.py in folders of its own (`folder` is the variant's); its summary.json."""
    run_dir = folder / f"run-{seed}-{steps}"
    command = [sys.executable, str(PROJECT_DIR / "main.py"), *overrides, f"trainer_config.max_steps={steps}",
               f"trainer_config.seed={seed}", "trainer_config.progress=off",
               f"trainer_config.snapshot_path={folder / f'snapshots-{seed}-{steps}'}", f"hydra.run.dir={run_dir}"]
    done = subprocess.run(command, cwd=PROJECT_DIR, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"run failed: {' '.join(command)}\n{done.stderr[-2000:]}")
    return json.loads((run_dir / "summary.json").read_text())


def calibrate(overrides: list[str], steps: int, budget: float, folder: Path) -> int:
    """The steps that fit `budget` seconds of the Trainer's clock, from one run of `steps` steps: its median step
    time (the train rows' ms_per_step after the first, which holds the warm-up; a stall moves a median little) and
    the time each evaluation adds (the rest of its wall time, per validation row), so that N steps take
    N x step + (N / eval_every + 1) x evaluation."""
    summary = train(overrides, steps, 1, folder)
    rows = [json.loads(line) for line in (folder / f"run-1-{steps}" / "metrics.jsonl").read_text().splitlines()]
    train_rows = [row for row in rows if "ms_per_step" in row]
    step_s = statistics.median(row["ms_per_step"] for row in train_rows[1:]) / 1000
    trained_s = sum(row["ms_per_step"] * (row["step"] - before["step"]) / 1000
                    for before, row in zip([{"step": 0}, *train_rows], train_rows))
    evaluations = [row for row in rows if "val_loss" in row]
    eval_s = max(0.0, summary["wall_time_s"] - trained_s) / len(evaluations)
    eval_every = summary["steps"] / max(1, len(evaluations) - 1)  # evaluations every so many steps, and at the end
    return max(steps, int((budget - eval_s) / (step_s + eval_s / eval_every)))


def report(names: list[str], results: dict[str, list[dict]]) -> dict:
    """Per variant: losses, their median and spread, and the paired differences from the first variant."""
    first = results[names[0]]
    table = {}
    for name in names:
        losses = [run["val_loss"] for run in results[name]]
        paired = [run["val_loss"] - base["val_loss"] for run, base in zip(results[name], first)]
        table[name] = {"val_losses": losses, "median": statistics.median(losses), "min": min(losses),
                       "max": max(losses), "steps": results[name][0]["steps"],
                       "wall_s": statistics.median(run["wall_time_s"] for run in results[name]),
                       "paired_difference": statistics.median(paired), "paired_min": min(paired),
                       "paired_max": max(paired)}
    return table


def print_table(table: dict) -> None:
    print(f"{'variant':<12} {'steps':>6} {'wall s':>7} {'val loss (median, min-max)':>28} "
          f"{'vs first (median, min..max)':>30}")
    for name, row in table.items():
        print(f"{name:<12} {row['steps']:>6} {row['wall_s']:>7.1f} {row['median']:>10.4f} ({row['min']:.4f}-"
              f"{row['max']:.4f}) {row['paired_difference']:>+10.4f} "
              f"({row['paired_min']:+.4f}..{row['paired_max']:+.4f})")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), help=f"names from {list(VARIANTS)}, or "
                        "NAME=OVERRIDE,OVERRIDE for a variant of your own; the first is the reference")
    parser.add_argument("--base", nargs="*", default=["preset=cpu"], help="overrides every variant starts from")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--budget", type=float, default=60.0, help="seconds of training per run (Trainer's clock)")
    parser.add_argument("--calibration-steps", type=int, default=1000)
    parser.add_argument("--json", type=Path, help="also write the results here")
    return parser.parse_args()


def variant(spec: str) -> tuple[str, list[str]]:
    name, _, overrides = spec.partition("=")
    return name, (overrides.split(",") if overrides else VARIANTS[name])


def main() -> None:
    args = parse_args()
    variants = dict(variant(spec) for spec in args.variants)
    names = list(variants)
    with tempfile.TemporaryDirectory(prefix="recipe-") as tmp:
        folders = {name: Path(tmp) / name for name in names}
        steps = {name: calibrate([*args.base, *variants[name]], args.calibration_steps, args.budget, folders[name])
                 for name in names}
        results: dict[str, list[dict]] = {name: [] for name in names}
        for r in range(args.runs):
            for name in names[r % len(names):] + names[: r % len(names)]:  # rotated: no variant always first
                results[name].append(train([*args.base, *variants[name]], steps[name], 1337 + r, folders[name]))
                print(f"round {r}: {name}: val loss {results[name][-1]['val_loss']:.4f} in "
                      f"{results[name][-1]['wall_time_s']:.1f} s", flush=True)
    table = report(names, results)
    print_table(table)
    if args.json:
        args.json.write_text(json.dumps({"base": args.base, "budget_s": args.budget, "variants": variants,
                                         "results": table}, indent=1))


if __name__ == "__main__":
    main()
