"""Experiment trackers beside metrics.jsonl and TensorBoard: MLflow and Weights & Biases, chosen in `tracking_config`
(docs/tracking.md).

Global rank 0 hands every metrics.jsonl row (`MetricsLog`'s listeners), the resolved config and, at the end, the loss
plot to a tracker process of its own (`python -m mingpt.reporting.trackers`, started at the first row), which alone
imports mlflow and wandb. Training never waits for a tracker: rows go through a queue and a pipe, and a tracker that
cannot be reached or fails costs one warning line and is switched off. The tracker process outlives a SIGKILLed
worker long enough to finish what it was given (wandb-core keeps up to 15 s of rows in memory), in a session of its
own so that torchrun's stop signals to the worker's group do not cut it short, and holds the run's lock until it
exits, so that the next attempt's tracker process starts from what it left.

The tracked run belongs to the snapshot folder: `tracking.json` there holds its key (an MLflow tag, the W&B run id),
so a resumed run, a torchrun restart, a requeue or a rerun of the command continue the same tracked run, and a new
folder (or a folder copied to another place) starts a new one. Every row is logged at most once: rows are ordered
by (step, train before validation), and the tracker process skips the rows at or before the last one the tracker
already holds (MLflow: its metric history; W&B: the run's step online, a state file beside the offline files).
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import importlib.util
import json
import logging
import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, TextIO
from urllib.parse import unquote, urlparse

from mingpt import PROJECT_DIR
from mingpt.errors import UsageError, describe
from mingpt.storage.durable import temporary_name

log = logging.getLogger(__name__)

# switch: (the module it imports, the project's requirements file that installs it: README, "Install")
PACKAGES = {"mlflow": ("mlflow", "requirements-mlflow.txt"), "wandb": ("wandb", "requirements-wandb.txt")}
MLFLOW_SQL = ("sqlalchemy", "alembic")  # what MLflow's SQL store (sqlite:...) needs beyond mlflow-skinny
MLFLOW_DB = "mlflow.db"  # the default store, sqlite:///<project>/mlflow.db: MLflow's own default name (mlflow ui's)
MLFLOW_ARTIFACTS = "mlartifacts"  # beside a SQLite store: the runs' files, a folder per experiment
OLD_MLFLOW_DEFAULT = PROJECT_DIR / "mlruns"  # the default store before mlflow.db: MLflow's file store
WANDB_MODES = ("offline", "online")
KEY_FILE = "tracking.json"  # in the snapshot folder: the key of the tracked run these snapshots belong to
LOG_FILE = "tracking.log"  # in the run directory: what the tracker process and its libraries print
ANCHORS = ("train_loss", "val_loss")  # what makes a row a training (0) or a validation (1) row
NOTHING = (-1, -1)  # the position before any row
SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*:")  # a URI (http:, file:, databricks:) rather than a local folder
MLFLOW_PARAM_CHARS = 500  # the shortest limit of MLflow servers still in use (newer ones take 6000)
MLFLOW_BATCH = 100  # params or tags per log_batch call (MLflow's limit)


@dataclass
class TrackingConfig:
    """Experiment trackers fed by global rank 0 beside metrics.jsonl and TensorBoard (docs/tracking.md)."""

    mlflow: bool = False
    """log the config, every metrics.jsonl row and the loss plot to MLflow (needs requirements-mlflow.txt)"""
    mlflow_tracking_uri: Optional[str] = None
    """a server (http://host:5000) or sqlite:///FILE (relative: to the project); null: $MLFLOW_TRACKING_URI or mlflow.db
    (sqlite:///mlflow.db in the project, MLflow's default store); a folder is MLflow's file store, which MLflow 3
    refuses unless MLFLOW_ALLOW_FILE_STORE=true"""
    mlflow_experiment: str = "mingpt-ddp"
    """the MLflow experiment the run goes into (created if missing)"""
    wandb: bool = False
    """log the config, every metrics.jsonl row and the loss plot to Weights & Biases (needs requirements-wandb.txt)"""
    wandb_mode: str = "offline"
    """offline (files in wandb_dir/wandb; upload with wandb sync) | online (needs wandb login or WANDB_API_KEY)"""
    wandb_project: str = "mingpt-ddp"
    """the W&B project"""
    wandb_entity: Optional[str] = None
    """the W&B team or user; null = your default entity"""
    wandb_dir: Optional[str] = None
    """the folder W&B writes its wandb/ folder into (relative = to the project); null = the project folder"""
    run_name: Optional[str] = None
    """the tracked run's display name; null = the snapshot folder's name"""
    timeout_s: float = 30.0
    """how long one tracker request may take, and how long the end of a run waits for the trackers to finish"""

    def __post_init__(self) -> None:
        if self.wandb_mode not in WANDB_MODES:
            raise UsageError(f"tracking_config.wandb_mode must be one of {', '.join(WANDB_MODES)}, "
                             f"got {self.wandb_mode!r}")
        if self.timeout_s <= 0:
            raise UsageError(f"tracking_config.timeout_s must be positive, got {self.timeout_s}")
        for switch, (module, requirements) in PACKAGES.items():
            if getattr(self, switch) and importlib.util.find_spec(module) is None:  # found, not imported
                raise UsageError(f"tracking_config.{switch}=true needs the {module} package: "
                                 f"pip install -r {requirements}")
        if self.mlflow:
            check_mlflow_store(self.mlflow_tracking_uri)

    @property
    def enabled(self) -> bool:
        return self.mlflow or self.wandb


# ------------------------------------------------------------------------------------------- what both sides share
def row_key(row: dict) -> tuple[int, int]:
    """A metrics row's place in the run: (step, 0 for a training row, 1 for a validation row). metrics.jsonl's rows
    come in this order (a step's training row before its validation row), so one position says what was logged."""
    return row["step"], int(ANCHORS[1] in row)


def flatten(config: dict, prefix: str = "") -> dict[str, Any]:
    """{"trainer_config": {"batch_size": 8}} -> {"trainer_config.batch_size": 8}: the config as tracker parameters."""
    flat: dict[str, Any] = {}
    for key, value in config.items():
        if isinstance(value, dict) and value:
            flat.update(flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = list(value) if isinstance(value, tuple) else value
    return flat


def local_folder(path: str, base: Path = PROJECT_DIR) -> Path:
    return (base / Path(path).expanduser()).resolve()


def sqlite_uri(path: Path) -> str:
    return f"sqlite:///{path}"  # an absolute path: sqlite:////home/...


def file_store_allowed() -> bool:
    """Whether the user opted in to MLflow's file store, read as MLflow reads it."""
    return os.environ.get("MLFLOW_ALLOW_FILE_STORE", "").lower() in ("true", "1")


def file_store_data(folder: Path) -> bool:
    """Whether a folder holds an MLflow file store's runs (an experiment folder with its meta.yaml), as MLflow asks."""
    return any(entry.is_dir() and entry.name.isdigit() and (entry / "meta.yaml").exists()
               for entry in (folder.iterdir() if folder.is_dir() else ()))


def mlflow_uri(configured: Optional[str]) -> str:
    """The tracking URI: the config's (a relative path taken from the project), else $MLFLOW_TRACKING_URI (a
    relative path taken from where the command runs, as MLflow does), else the project's mlflow.db, the SQLite
    store MLflow itself defaults to; as in MLflow, the default stays the old mlruns/ where that holds runs, no
    mlflow.db exists and MLFLOW_ALLOW_FILE_STORE=true (without it: check_mlflow_store). A SQLite file or a folder
    comes out absolute: the tracker process runs in the project folder, not where the command was run."""
    if configured is not None:
        uri, base = configured, PROJECT_DIR
    elif os.environ.get("MLFLOW_TRACKING_URI"):
        uri, base = os.environ["MLFLOW_TRACKING_URI"], Path.cwd()
    elif file_store_allowed() and file_store_data(OLD_MLFLOW_DEFAULT) and not (PROJECT_DIR / MLFLOW_DB).exists():
        return OLD_MLFLOW_DEFAULT.as_uri()
    else:
        return sqlite_uri(PROJECT_DIR / MLFLOW_DB)
    if uri.startswith("sqlite:///"):
        path, query = uri[len("sqlite:///"):].partition("?")[::2]
        if path and not path.startswith("/") and path != ":memory:":
            return sqlite_uri(local_folder(path, base)) + (f"?{query}" if query else "")
        return uri
    if SCHEME.match(uri) or uri == "databricks":
        return uri
    return local_folder(uri, base).as_uri()


def check_mlflow_store(configured: Optional[str]) -> None:
    """The stores MLflow would refuse in the tracker process, refused before anything runs, in one line: a SQLite
    store without MLflow's SQL packages; a file store (a folder), which MLflow 3 keeps in maintenance mode, without
    MLFLOW_ALLOW_FILE_STORE=true; and the default mlflow.db while the old default mlruns/ holds runs (they would be
    left behind, and a resumed run would start a new tracked run)."""
    uri = mlflow_uri(configured)
    where = ("tracking_config.mlflow_tracking_uri" if configured is not None
             else "$MLFLOW_TRACKING_URI" if os.environ.get("MLFLOW_TRACKING_URI") else "tracking_config.mlflow")
    if uri.startswith("sqlite:"):
        missing = next((module for module in MLFLOW_SQL if importlib.util.find_spec(module) is None), None)
        if missing is not None:
            raise UsageError(f"{where}: MLflow's SQLite store needs the {missing} package: "
                             f"pip install -r {PACKAGES['mlflow'][1]}")
        if uri == sqlite_uri(PROJECT_DIR / MLFLOW_DB) and not (PROJECT_DIR / MLFLOW_DB).exists() \
                and file_store_data(OLD_MLFLOW_DEFAULT):
            raise UsageError(f"{where}: {OLD_MLFLOW_DEFAULT} holds MLflow runs in a file store (this project's "
                             f"default before {MLFLOW_DB}): move them into {MLFLOW_DB} with `mlflow migrate-filestore "
                             f"--source {OLD_MLFLOW_DEFAULT} --target {uri}`, or set MLFLOW_ALLOW_FILE_STORE=true to "
                             f"keep using the folder")
    elif uri.startswith("file:") and not file_store_allowed():
        folder = unquote(urlparse(uri).path)
        raise UsageError(f"{where}: {folder} is a folder, MLflow's file store, which MLflow 3 refuses (maintenance "
                         f"mode): use a SQLite store, sqlite:///FILE (null: the project's {MLFLOW_DB}), into which "
                         f"`mlflow migrate-filestore --source {folder} --target sqlite:///FILE` moves the folder's "
                         f"runs, or set MLFLOW_ALLOW_FILE_STORE=true to keep the folder")


def mlflow_artifacts(uri: str, experiment: str) -> Optional[str]:
    """Where a new experiment's files go: beside a SQLite store, mlartifacts/EXPERIMENT (MLflow's own default is
    mlruns/ in the folder the client runs in, wherever the database is); elsewhere, the store's choice."""
    if not uri.startswith("sqlite:////"):
        return None
    database = Path(uri[len("sqlite:///"):].partition("?")[0])
    return (database.parent / MLFLOW_ARTIFACTS / re.sub(r"[^A-Za-z0-9._-]+", "_", experiment)).as_uri()


def mlflow_environment(timeout_s: float) -> dict[str, str]:
    """MLflow's settings for the tracker process, each only where the user set none. Its HTTP client retries
    7 times with growing waits (minutes) by default: an unreachable server should cost one warning within
    seconds."""
    wanted = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2", "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
              "MLFLOW_HTTP_REQUEST_TIMEOUT": str(max(1, round(timeout_s)))}
    return {name: value for name, value in wanted.items() if name not in os.environ}


def run_key(store: Any) -> str:
    """The tracked run's key, kept in the snapshot folder beside the snapshots (`store`: a SnapshotStore): the
    same folder, the same tracked run; a new folder, or this one copied or moved elsewhere, a new one."""
    try:
        saved = json.loads(store.read(KEY_FILE))
    except (FileNotFoundError, ValueError):
        saved = {}
    if isinstance(saved, dict) and saved.get("location") == store.location and saved.get("run_key"):
        return str(saved["run_key"])
    key = uuid.uuid4().hex[:16]
    store.write(KEY_FILE, json.dumps({"location": store.location, "run_key": key}).encode())
    return key


def take_lock(key: str, timeout_s: float) -> Optional[int]:
    """The run's lock (a descriptor; None after timeout_s): taken by rank 0 before it starts a tracker process, and
    held by that process until it exits. The tracker process of a killed attempt may still be finishing, and where
    the run left off is only known once it has; the lock was taken before that attempt could die, so the next one
    always waits for it."""
    descriptor = os.open(Path(tempfile.gettempdir()) / f"mingpt-tracking-{key}.lock", os.O_CREAT | os.O_RDWR, 0o600)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return descriptor
        except BlockingIOError:
            if time.monotonic() > deadline:
                os.close(descriptor)
                return None
            time.sleep(0.1)


# ------------------------------------------------------------------------------------- rank 0: the training side
class Tracking:
    """Global rank 0's side: rows queued for a tracker process (started at the first row, so that a run that fails
    before training, or has nothing to train, creates no tracked run), its lines relayed into the run's log, and the
    end of the run. A no-op where no tracker is asked for and on every other rank."""

    def __init__(self, cfg: TrackingConfig, config: dict, metrics: Any, store: Any, run_dir: Optional[Path]) -> None:
        """`config`: the resolved config, secrets masked; `metrics`: the run's MetricsLog, which hands rows on only
        where it writes them (global rank 0); `store`: the run's SnapshotStore."""
        self.cfg, self.store, self.run_dir = cfg, store, run_dir
        self.enabled = cfg.enabled and metrics.path is not None
        self.params = flatten(config) if self.enabled else {}
        if self.enabled:
            metrics.listeners.append(self.log)
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._feeder: Optional[threading.Thread] = None
        self._relay: Optional[threading.Thread] = None
        self._process: Optional[subprocess.Popen] = None
        self._started = time.time()
        self._ended = False

    def log(self, row: dict) -> None:
        """A metrics row (MetricsLog calls this after writing it): queued, never waited for."""
        if not self.enabled:
            return
        if self._feeder is None:
            self._feeder = threading.Thread(target=self._feed, name="tracking", daemon=True)
            self._feeder.start()
            atexit.register(self._end_quietly)  # an error path: what was queued still goes out
        self._queue.put({"row": row, "time": time.time()})

    def finish(self, stopped: bool) -> None:
        """The end of a fit: the loss plot this run drew (not after a stop), the outcome, then wait for the tracker
        process to finish (at most timeout_s; after that it finishes in the background)."""
        if self._feeder is None or self._ended:
            return
        plot = self.run_dir / "loss.png" if self.run_dir is not None else None
        if not stopped and plot is not None and plot.is_file() and plot.stat().st_mtime >= self._started:
            self._queue.put({"artifact": str(plot)})
        self._queue.put({"end": "stopped" if stopped else "finished"})
        self._end(self.cfg.timeout_s)

    def _end_quietly(self) -> None:
        if not self._ended:  # no "end" message: the tracker process records the run as failed
            self._end(min(5.0, self.cfg.timeout_s))

    def _end(self, timeout_s: float) -> None:
        self._ended = True
        self._queue.put(None)
        deadline = time.monotonic() + timeout_s
        if self._feeder is not None:
            self._feeder.join(timeout_s)
        if self._process is None:
            return
        try:
            code = self._process.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            log.warning("tracking: the trackers are still finishing after %.0f s; they go on in the background "
                        "(process %d, output in %s)", timeout_s, self._process.pid, self._log_path())
            return
        if self._relay is not None:
            self._relay.join(5.0)
        if code != 0:
            log.warning("tracking: the tracker process exited with code %d (see %s)", code, self._log_path())

    def _feed(self) -> None:
        """The feeder thread: the run's key, the run's lock, the tracker process, then every message in order."""
        try:
            setup = self._setup()
            lock = take_lock(setup["key"], 2 * self.cfg.timeout_s)
            if lock is None:
                self.enabled = False
                log.warning("tracking: the tracker process of an earlier attempt of this run is still running after "
                            "%.0f s; tracking is off for this run", 2 * self.cfg.timeout_s)
                return
            try:
                self._process = self._spawn(setup, lock)
            finally:
                os.close(lock)  # the tracker process holds it now
        except Exception as e:  # the snapshot folder or the process: training goes on without trackers
            self.enabled = False
            log.warning("tracking: the trackers cannot start (%s); training goes on without them", describe(e))
            return
        self._relay = threading.Thread(target=self._relay_lines, args=(self._process.stdout,), name="tracking-relay",
                                       daemon=True)
        self._relay.start()
        message: Optional[dict] = setup
        while message is not None:
            if not self._send(message):
                return
            message = self._queue.get()
        with contextlib.suppress(OSError):
            self._process.stdin.close()

    def _setup(self) -> dict:
        cfg = self.cfg
        setup = {"key": run_key(self.store), "params": self.params, "timeout_s": cfg.timeout_s,
                 "name": cfg.run_name or self.store.location.rstrip("/").rsplit("/", 1)[-1], "mlflow": None,
                 "wandb": None}
        if cfg.mlflow:
            setup["mlflow"] = {"uri": mlflow_uri(cfg.mlflow_tracking_uri), "experiment": cfg.mlflow_experiment}
        if cfg.wandb:
            folder = local_folder(cfg.wandb_dir) if cfg.wandb_dir else PROJECT_DIR
            setup["wandb"] = {"mode": cfg.wandb_mode, "project": cfg.wandb_project, "entity": cfg.wandb_entity,
                              "dir": str(folder)}
        return setup

    def _log_path(self) -> str:
        return str(self.run_dir / LOG_FILE) if self.run_dir is not None else os.devnull

    def _spawn(self, setup: dict, lock: int) -> subprocess.Popen:
        """The tracker process, holding the run's lock until it exits, in a session of its own (torchrun stops a
        worker by signalling its process group; the tracker finishes when its input ends instead). What it and its
        libraries print goes to tracking.log."""
        with open(self._log_path(), "ab") as output:
            return subprocess.Popen(
                [sys.executable, "-m", __name__], cwd=PROJECT_DIR, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                stderr=output, env={**os.environ, **mlflow_environment(setup["timeout_s"])}, text=True,
                encoding="utf-8", start_new_session=True, pass_fds=(lock,),
            )

    def _send(self, message: dict) -> bool:
        try:
            self._process.stdin.write(json.dumps(message) + "\n")
            self._process.stdin.flush()
            return True
        except (OSError, ValueError):  # the process is gone (a crash): say so once, drop the rest
            self.enabled = False
            log.warning("tracking: the tracker process ended early (see %s); training goes on without it",
                        self._log_path())
            return False

    @staticmethod
    def _relay_lines(lines: TextIO) -> None:
        """The tracker process's lines ("info ..." or "warning ...") into this run's log (console, train.log)."""
        for line in lines:
            level, _, text = line.rstrip("\n").partition(" ")
            log.log(logging.WARNING if level == "warning" else logging.INFO, "%s", text)


# -------------------------------------------------------------------------------------- the tracker process
Key = tuple[int, int]


def wandb_step(key: Key) -> int:
    """W&B's own step of a row: one per row, in the rows' order (a step's validation row after its training row,
    which W&B would otherwise merge into one). Charts use the training step (`define_metric`)."""
    return 2 * key[0] + key[1]


class MlflowRun:
    """The tracked run in MLflow: the run tagged with the key in the experiment (the newest, if several), or a new
    one. Each row is one log_batch call with its anchor (train_loss, val_loss) first, so that a call cut short
    leaves a row missing some values, never one that looks logged and is logged again."""

    label = "MLflow"

    def __init__(self, setup: dict) -> None:
        from mlflow.tracking import MlflowClient

        conf = setup["mlflow"]
        self.client = MlflowClient(conf["uri"])
        experiment = self._experiment(conf["experiment"], conf["uri"])
        found = self.client.search_runs([experiment], f"tags.`mingpt.run_key` = '{setup['key']}'",
                                        order_by=["attributes.start_time DESC"], max_results=1)
        if found:
            self.run_id = found[0].info.run_id
            self.client.update_run(self.run_id, status="RUNNING")
        else:
            self.run_id = self.client.create_run(experiment, run_name=setup["name"],
                                                 tags={"mingpt.run_key": setup["key"]}).info.run_id
        self._log_params(setup["params"], found[0].data.params if found else {})
        self.cursor = self._cursor()
        self.where = f"MLflow run {self.run_id} (experiment {conf['experiment']!r}, {conf['uri']})"

    def _experiment(self, name: str, uri: str) -> str:
        experiment = self.client.get_experiment_by_name(name)
        if experiment is not None:
            return experiment.experiment_id
        return self.client.create_experiment(name, artifact_location=mlflow_artifacts(uri, name))

    def _log_params(self, params: dict, existing: dict[str, str]) -> None:
        """The config as parameters; MLflow's are immutable, so a value changed on a resume (a raised max_steps)
        becomes the tag `resumed_with.KEY`."""
        from mlflow.entities import Param, RunTag

        text = {key: (value if isinstance(value, str) else json.dumps(value))[:MLFLOW_PARAM_CHARS]
                for key, value in params.items()}
        new = [Param(key, value) for key, value in text.items() if key not in existing]
        changed = [RunTag(f"resumed_with.{key}", value) for key, value in text.items()
                   if key in existing and existing[key] != value]
        for start in range(0, len(new), MLFLOW_BATCH):
            self.client.log_batch(self.run_id, params=new[start:start + MLFLOW_BATCH])
        for start in range(0, len(changed), MLFLOW_BATCH):
            self.client.log_batch(self.run_id, tags=changed[start:start + MLFLOW_BATCH])

    def _cursor(self) -> Key:
        last = NOTHING
        for kind, anchor in enumerate(ANCHORS):
            steps = [metric.step for metric in self.client.get_metric_history(self.run_id, anchor)]
            last = max(last, (max(steps), kind)) if steps else last
        return last

    def log(self, row: dict, when: float) -> None:
        from mlflow.entities import Metric

        keys = sorted((key for key in row if key != "step" and isinstance(row[key], (int, float))),
                      key=lambda key: key not in ANCHORS)
        self.client.log_batch(self.run_id, metrics=[Metric(key, float(row[key]), int(when * 1000), row["step"])
                                                    for key in keys])

    def artifact(self, path: str) -> None:
        self.client.log_artifact(self.run_id, path)

    def close(self, outcome: str) -> None:
        self.client.set_terminated(self.run_id, {"finished": "FINISHED", "stopped": "KILLED"}.get(outcome, "FAILED"))


class WandbRun:
    """The tracked run in W&B: run id `mingpt-KEY`, resumed if it exists. Where it left off: the run's next step
    (online), or a state file beside the offline files, rewritten after every row (offline: W&B knows nothing of
    earlier offline sessions of the run)."""

    label = "W&B"

    def __init__(self, setup: dict) -> None:
        import wandb

        conf = setup["wandb"]
        root = Path(conf["dir"])
        root.mkdir(parents=True, exist_ok=True)
        settings = wandb.Settings(console="off", silent=True, init_timeout=setup["timeout_s"])
        self.run = wandb.init(project=conf["project"], entity=conf["entity"], dir=str(root), mode=conf["mode"],
                              id=f"mingpt-{setup['key']}", name=setup["name"], resume="allow", settings=settings)
        self.run.config.update(setup["params"], allow_val_change=True)
        self.run.define_metric("step")
        self.run.define_metric("*", step_metric="step")  # charts against the training step, not W&B's own
        self.state = root / "wandb" / f"{self.run.id}.json"
        next_step = self.run.starting_step or 0
        online = (next_step - 1) // 2, (next_step - 1) % 2
        self.cursor = max(self._saved_cursor(), online if next_step > 0 else NOTHING)
        where = f"{root / 'wandb'}; upload: wandb sync {root / 'wandb'}" if conf["mode"] == "offline" else "online"
        self.where = f"W&B run {self.run.id} (project {conf['project']!r}, {where})"

    def _saved_cursor(self) -> Key:
        try:
            return tuple(json.loads(self.state.read_text())["logged"])
        except (FileNotFoundError, ValueError, KeyError, TypeError):
            return NOTHING

    def log(self, row: dict, when: float) -> None:
        key = row_key(row)
        self.run.log(dict(row), step=wandb_step(key))
        temporary = self.state.with_name(temporary_name(self.state.name))
        temporary.write_text(json.dumps({"logged": list(key)}))
        os.replace(temporary, self.state)

    def artifact(self, path: str) -> None:
        copy = Path(self.run.dir) / Path(path).name  # a copy in the run's files: the run directory may go first
        shutil.copyfile(path, copy)
        self.run.save(str(copy), base_path=self.run.dir, policy="now")

    def close(self, outcome: str) -> None:
        self.run.finish(exit_code=0 if outcome in ("finished", "stopped") else 1)


BACKENDS = {"mlflow": MlflowRun, "wandb": WandbRun}


class Reporter:
    """The tracker process's lines to rank 0, which logs them: "info TEXT" or "warning TEXT"."""

    def __init__(self, out: TextIO) -> None:
        self.out = out

    def say(self, level: str, text: str) -> None:
        with contextlib.suppress(OSError, ValueError):  # rank 0 is gone: nobody to tell
            self.out.write(f"{level} {' '.join(text.split())}\n")
            self.out.flush()


def protocol_streams() -> tuple[TextIO, TextIO]:
    """The pipes to rank 0, kept apart: stdin and stdout become /dev/null and stderr (tracking.log), so that
    nothing mlflow, wandb or wandb-core print can get into the messages."""
    messages = os.fdopen(os.dup(0), "r", encoding="utf-8")
    replies = os.fdopen(os.dup(1), "w", encoding="utf-8")
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    os.dup2(2, 1)
    sys.stdin, sys.stdout = open(os.devnull, encoding="utf-8"), sys.stderr
    return messages, replies


def open_backends(setup: dict, reporter: Reporter) -> list:
    """The trackers asked for, each started or reported as off for this run in one line."""
    opened = []
    for name in (name for name in BACKENDS if setup.get(name)):
        backend = BACKENDS[name]
        try:
            opened.append(backend(setup))
        except Exception as e:  # unreachable, refused, misconfigured: one line, and training goes on
            reporter.say("warning", f"tracking: {backend.label} is off for this run: cannot start ({describe(e)})")
            continue
        after = f", continuing after step {opened[-1].cursor[0]}" if opened[-1].cursor != NOTHING else ""
        reporter.say("info", f"tracking: {opened[-1].where}{after}")
    return opened


def still_working(backend: Any, reporter: Reporter, action: str, *args: Any) -> bool:
    """One call to a tracker; a failure is one warning line and the end of that tracker for this run."""
    try:
        getattr(backend, action)(*args)
        return True
    except Exception as e:
        reporter.say("warning", f"tracking: {backend.label} failed ({describe(e)}); it is off for the rest of "
                                f"this run (metrics.jsonl has every row)")
        return False


def serve() -> None:
    """The tracker process: a setup message, then rows, the plot and the outcome, one JSON object a line, until its
    input ends (the end of the run, or rank 0's death: then the run is recorded as failed)."""
    for stop in (signal.SIGTERM, signal.SIGINT):  # SLURM signals every process of a job: finish when rank 0 does
        signal.signal(stop, lambda *_: None)
    messages, replies = protocol_streams()
    reporter = Reporter(replies)
    lines = (json.loads(line) for line in messages if line.endswith("\n"))  # not a line cut short by rank 0's death
    setup = next(lines, None)
    backends = open_backends(setup, reporter) if setup else []
    outcome = "failed"
    for message in lines:
        if "row" in message:
            key = row_key(message["row"])
            backends = [b for b in backends if key <= b.cursor
                        or still_working(b, reporter, "log", message["row"], message["time"])]
        elif "artifact" in message:
            backends = [b for b in backends if still_working(b, reporter, "artifact", message["artifact"])]
        elif "end" in message:
            outcome = message["end"]
    for backend in backends:
        still_working(backend, reporter, "close", outcome)


if __name__ == "__main__":
    serve()
