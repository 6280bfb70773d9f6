"""Loss curves: training and validation loss against step, as a PNG.

    python plot.py outputs/<run id>                      # writes outputs/<run id>/loss.png
    python plot.py outputs/<run id>/metrics.jsonl -o curve.png

main.py writes `loss.png` into the run directory at the end of training. Needs matplotlib.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Optional

from reporting import metrics_path, read_metrics


def read_losses(metrics: Path) -> tuple[dict[int, float], dict[int, float]]:
    """{step: train_loss} and {step: val_loss}; a step logged twice (a resumed run) keeps its last value."""
    rows = read_metrics(metrics)
    train = {row["step"]: row["train_loss"] for row in rows if "train_loss" in row}
    val = {row["step"]: row["val_loss"] for row in rows if "val_loss" in row}
    return train, val


def write_loss_plot(source: Path, output: Optional[Path] = None) -> Path:
    """Plot a run directory's (or a metrics file's) losses; returns the PNG's path."""
    import matplotlib

    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt

    metrics = metrics_path(source)
    output = output or metrics.parent / "loss.png"
    train, val = read_losses(metrics)
    fig, ax = plt.subplots(figsize=(8, 5), dpi=110)
    if train:
        ax.plot(list(train), list(train.values()), label="train loss", color="tab:blue", linewidth=1.2)
    if val:
        ax.plot(list(val), list(val.values()), label="validation loss", color="tab:orange", marker="o", linewidth=1.5)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("cross-entropy (nats per character)")
    ax.set_title(f"{metrics.parent.name}: loss")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(output)
    plt.close(fig)
    return output


def cli(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="plot.py", description="Plot a run's training and validation loss.")
    parser.add_argument("source", type=Path, help="run directory or metrics.jsonl")
    parser.add_argument("-o", "--output", type=Path, default=None, help="PNG path (default: loss.png beside it)")
    args = parser.parse_args(argv)
    metrics = metrics_path(args.source)
    if not metrics.is_file():
        print(f"error: no metrics file at {metrics}", file=sys.stderr)
        return 2
    print(write_loss_plot(args.source, args.output))
    return 0


if __name__ == "__main__":
    sys.exit(cli())
