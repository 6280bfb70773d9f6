"""What a run tells its user: logging (rank 0 to the console and train.log, other ranks warnings only), per-step
progress (a bar or lines), metrics rows (metrics.jsonl and TensorBoard, then any experiment tracker), and the one
reader of metrics.jsonl that plot.py, chaos.py and the tests use."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path
from typing import Callable, Optional

from mingpt.reporting.tensorboard_events import EventFile

METRICS_FILE = "metrics.jsonl"
SUMMARY_FILE = "summary.json"
PROGRESS_MODES = ("auto", "bar", "lines", "off")
log = logging.getLogger(__name__)
step_log = logging.getLogger(f"{__name__}.steps")  # per-step lines: a console filter drops them when a bar shows


class _ConsoleHandler(logging.Handler):
    """Writes to stdout through tqdm, so that messages appear above a progress bar instead of breaking it."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            from tqdm import tqdm

            tqdm.write(self.format(record), file=sys.stdout)
        except Exception:
            self.handleError(record)


def setup_logging(rank: int, run_dir: Optional[Path]) -> None:
    """Rank 0 logs INFO to stdout and to train.log in the run directory; other ranks only warnings, prefixed."""
    root = logging.getLogger()
    root.handlers.clear()
    if rank == 0:
        fmt = logging.Formatter("%(asctime)s %(message)s", datefmt="%H:%M:%S")
        console = _ConsoleHandler()
        console.addFilter(lambda record: getattr(record, "console", True))  # per-step lines hidden under a bar
        handlers: list[logging.Handler] = [console]
        if run_dir is not None:
            handlers.append(logging.FileHandler(run_dir / "train.log", encoding="utf-8"))
        level = logging.INFO
    else:
        fmt = logging.Formatter(f"[rank {rank}] %(levelname)s %(message)s")
        handlers = [logging.StreamHandler(sys.stderr)]
        level = logging.WARNING
    for handler in handlers:
        handler.setFormatter(fmt)
        root.addHandler(handler)
    root.setLevel(level)
    logging.getLogger("matplotlib").setLevel(logging.WARNING)  # its font-cache notices are not ours
    logging.getLogger("botocore").setLevel(logging.WARNING)  # "Found endpoint for s3 via: ..." and the like
    # When S3 drops a connection mid-upload, aiohttp (under s3fs) leaves asyncio "Future exception was never
    # retrieved" reports, each a traceback; the failed save itself is reported in one line by the snapshot writer.
    logging.getLogger("asyncio").setLevel(logging.CRITICAL)


class MetricsLog:
    """Rank 0's metrics: JSON rows appended to `metrics.jsonl`, and the same values as TensorBoard scalars
    (tensorboard_events.py), then handed to each of `listeners` (the experiment trackers, trackers.py). A no-op on
    other ranks."""

    TENSORBOARD_TAGS = {
        "train_loss": "loss/train", "val_loss": "loss/val", "val_bpb": "bpb/val", "lr": "lr",
        "tokens_per_s": "throughput/tokens_per_s",
        "ms_per_step": "throughput/ms_per_step", "grad_norm": "grad_norm", "loss_scale": "loss_scale",
    }

    def __init__(self, run_dir: Optional[Path], enabled: bool) -> None:
        self.path = run_dir / METRICS_FILE if (run_dir is not None and enabled) else None
        self._tensorboard: Optional[EventFile] = None
        self.listeners: list[Callable[[dict], None]] = []  # each gets every row once it is in metrics.jsonl
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._tensorboard = EventFile(self.path.parent)

    def write(self, row: dict) -> None:
        if self.path is None:
            return
        with self.path.open("a", encoding="utf-8") as f:
            f.write(json.dumps(row) + "\n")
        if self._tensorboard is not None:
            scalars = {tag: row[key] for key, tag in self.TENSORBOARD_TAGS.items() if key in row}
            self._tensorboard.add_scalars(scalars, row["step"])
        for listener in self.listeners:
            listener(row)

    def close(self) -> None:
        if self._tensorboard is not None:
            self._tensorboard.close()
            self._tensorboard = None


class Progress:
    """Rank 0's per-step output: a tqdm bar (steps, loss, tokens/s, lr, time left) on a terminal, or one log line
    every log_every_steps where output goes to a file (CI, SLURM logs). Other ranks show nothing."""

    def __init__(self, mode: str, enabled: bool, total: int, initial: int) -> None:
        if mode == "auto":
            mode = "bar" if sys.stdout.isatty() else "lines"
        self.mode = mode if enabled else "off"
        self.bar = None
        if self.mode == "bar":
            from tqdm import tqdm

            self.bar = tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True, file=sys.stdout,
                            bar_format="{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}<{remaining}]{postfix}")

    def advance(self) -> None:
        if self.bar is not None:
            self.bar.update(1)

    def rewind(self, step: int) -> None:
        """Back to `step` (a run rolled back to an earlier snapshot)."""
        if self.bar is not None:
            self.bar.n = step
            self.bar.refresh()

    def report(self, line: str, loss: float, tokens_per_s: float, lr: float) -> None:
        if self.bar is not None:
            self.bar.set_postfix_str(f"loss {loss:.4f}, {tokens_per_s:,.0f} tok/s, lr {lr:.2e}", refresh=True)
            step_log.info(line, extra={"console": False})  # in train.log; the bar shows it on the terminal
        elif self.mode == "lines":
            step_log.info(line)
        else:
            step_log.info(line, extra={"console": False})

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def report_end(metrics: MetricsLog, digest: str, digests: list[str], **summary) -> None:
    """The end of a fit: whether every rank ended with the same weights (this rank's digest, and every rank's in
    rank order), one line, and summary.json beside metrics.jsonl (rank 0)."""
    identical, wall = len(set(digests)) == 1, summary["wall_time_s"]
    if not identical:
        log.error("replicas diverged: weight digests differ between ranks: %s", digests)
    elif not summary["finished"]:
        log.info("stopped at step %d after %.1f s; run the same command again to continue", summary["steps"], wall)
    else:
        log.info("done: %d steps in %.1f s; weights identical on all %d rank(s), sha256 %s", summary["steps"], wall,
                 len(digests), digest[:16])
    if metrics.path is not None:
        summary = {**summary, "weights_sha256": digest, "rank_weights_sha256": digests, "replicas_identical": identical}
        order = ("steps", "epochs_completed", "finished", "val_loss", "val_bpb", "best_val_loss", "skipped_steps",
                 "rollbacks", "weights_sha256", "rank_weights_sha256", "replicas_identical", "wall_time_s",
                 "world_size")
        text = json.dumps({key: summary[key] for key in order if key in summary}, indent=2) + "\n"
        (metrics.path.parent / SUMMARY_FILE).write_text(text)


def metrics_path(source: Path) -> Path:
    """A run directory's metrics file, or the file itself."""
    return source / METRICS_FILE if source.is_dir() else source


def read_metrics(source: Path) -> list[dict]:
    """The rows of a run's metrics.jsonl (given the run directory or the file), oldest first. No file, no rows; a
    line still being written (no newline yet) is left out, and so is one a killed writer left broken."""
    try:
        text = metrics_path(source).read_text(encoding="utf-8")
    except (FileNotFoundError, IsADirectoryError):  # not there yet (the run directory appeared just now: no rows)
        return []
    rows = []
    for line in text.split("\n")[:-1]:
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows
