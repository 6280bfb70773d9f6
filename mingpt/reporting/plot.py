"""Loss curves: training and validation loss against step, as a PNG.

    write_loss_plot(Path("outputs/<run id>"))            # writes outputs/<run id>/loss.png

plot.py (at the project's root) is its command. main.py writes `loss.png` into the run directory at the end of
training, in a child process (`LossPlotter`) while it generates its sample. Needs matplotlib.
"""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path
from typing import Optional

from mingpt import PROJECT_DIR
from mingpt.reporting.logs import metrics_path, read_metrics

log = logging.getLogger(__name__)
MISSING_MATPLOTLIB = 3  # plot.py's exit code without matplotlib


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


class PlotterFailed(Exception):
    """The child process drew nothing; the message says why in one line."""


class LossPlotter:
    """`write_loss_plot(source)` in a child process (`python plot.py SOURCE`), so that the end of a run draws
    its plot (about 1 s, most of it importing matplotlib) and generates its sample (about as long) at the same time,
    on two cores. `log_result` waits for it and logs the PNG's path, or why there is none."""

    def __init__(self, source: Path) -> None:
        self._process: Optional[subprocess.Popen] = None
        self._error = ""
        try:
            self._process = subprocess.Popen(
                [sys.executable, str(PROJECT_DIR / "plot.py"), str(Path(source).resolve())],
                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, errors="replace",
            )
        except OSError as e:  # no process to spare: `result` says so
            self._error = str(e)

    def result(self, timeout_s: float = 60.0) -> Path:
        if self._process is None:
            raise PlotterFailed(f"cannot start plot.py: {self._error}")
        try:
            out, err = self._process.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.communicate()
            raise PlotterFailed(f"no plot after {timeout_s:.0f} s") from None
        if self._process.returncode == MISSING_MATPLOTLIB:
            raise ImportError("matplotlib is not installed")
        if self._process.returncode != 0:
            lines = [line for line in err.splitlines() if line.strip()]
            raise PlotterFailed(lines[-1] if lines else f"exit code {self._process.returncode}")
        return Path(out.strip())

    def log_result(self) -> None:
        try:
            log.info("loss plot: %s", self.result())
        except ImportError:
            log.info("loss plot skipped: matplotlib is not installed")
        except Exception as e:  # the plot is a convenience: the run itself has finished
            log.warning("loss plot failed: %s", e)
