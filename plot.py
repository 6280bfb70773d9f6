"""Loss curves: training and validation loss against step, as a PNG.

    python plot.py outputs/<run id>                      # writes outputs/<run id>/loss.png
    python plot.py outputs/<run id>/metrics.jsonl -o curve.png

Needs matplotlib (exit code 3 without it); main.py runs this at the end of every run.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Optional

from mingpt.reporting.logs import metrics_path
from mingpt.reporting.plot import MISSING_MATPLOTLIB, write_loss_plot


def cli(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="plot.py", description="Plot a run's training and validation loss.")
    parser.add_argument("source", type=Path, help="run directory or metrics.jsonl")
    parser.add_argument("-o", "--output", type=Path, default=None, help="PNG path (default: loss.png beside it)")
    args = parser.parse_args(argv)
    metrics = metrics_path(args.source)
    if not metrics.is_file():
        print(f"error: no metrics file at {metrics}", file=sys.stderr)
        return 2
    try:
        print(write_loss_plot(args.source, args.output))
    except ImportError:
        print("error: matplotlib is not installed", file=sys.stderr)
        return MISSING_MATPLOTLIB
    return 0


if __name__ == "__main__":
    sys.exit(cli())
