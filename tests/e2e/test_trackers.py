"""The experiment trackers (mingpt/reporting/trackers.py) with real processes and the real packages, no mocks.

MLflow on a SQLite store (the kind MLflow recommends and the default, mlflow.db; no MLFLOW_ALLOW_FILE_STORE) and W&B
offline follow a 2-process run whose rank 0 is SIGKILLed, restarted by torchrun and then rerun with a later
max_steps: one tracked run, holding each metrics.jsonl row once, read back with MLflow's own client and W&B's own
reader of its offline files (`wandb leet inspect --json`). An unreachable MLflow server costs one warning line; a
missing package, or a store MLflow would refuse, is a one-line error before training that names the install command
or the way out; a run that asks for a tracker imports its package in its tracker process only (one that asks for
none imports neither: tests/e2e/test_cli.py, NOT_IMPORTED, in a run it makes anyway).
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

from support import (
    PROJECT_DIR,
    PYTHON,
    Case,
    Fault,
    assert_ok,
    assert_one_error_line,
    cli,
    free_port,
    job_args,
    resumes,
    run_case,
    subprocess_env,
)

from mingpt.reporting.logs import read_metrics
from mingpt.reporting.trackers import KEY_FILE, LOG_FILE, row_key

SECRET = "tok3n-0f-the-st0rage"  # a storage option: masked in the parameters, nowhere in the trackers' files
EXACT = ("train_loss", "val_loss", "lr")  # bit-exact across a resume; throughput and times are not


def tracked_args(tmp_path: Path | str, run_dir: Path | str, max_steps: int) -> list[str]:
    return job_args(f"{tmp_path}/snaps", run_dir, f"trainer_config.snapshot_storage_options={{token:'{SECRET}'}}",
                    "tracking_config.mlflow=true", f"tracking_config.mlflow_tracking_uri={mlflow_store(tmp_path)}",
                    "tracking_config.wandb=true", f"tracking_config.wandb_dir={tmp_path}", max_steps=max_steps,
                    log_every_steps=2, eval_every_steps=10, save_every_steps=20, progress="lines",
                    report_at_end="true")  # the loss plot goes to the trackers


def mlflow_store(tmp_path: Path | str) -> str:
    return f"sqlite:///{tmp_path}/mlflow.db"  # an absolute path: sqlite:////tmp/...


def tracker_env(tmp_path: Path) -> dict[str, str]:
    env = subprocess_env(tmp_path)
    env["WANDB_ERROR_REPORTING"] = "false"  # no network here: nothing to report errors to
    return env


def first_rows(run_dirs: list[Path]) -> list[dict]:
    """The rows a tracker should hold: every metrics.jsonl row of these runs, in order, a row repeated by a resumed
    attempt (same step and kind) left out."""
    seen, rows = set(), []
    for row in (row for run_dir in run_dirs for row in read_metrics(run_dir)):
        if row_key(row) not in seen:
            seen.add(row_key(row))
            rows.append(row)
    return rows


def mlflow_runs(tmp_path: Path) -> tuple[object, list]:
    """MLflow's own client on the store as the run left it (no setting of ours; MLFLOW_ALLOW_FILE_STORE unset)."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=mlflow_store(tmp_path))
    experiment = client.get_experiment_by_name("mingpt-ddp")
    return client, client.search_runs([experiment.experiment_id])


def check_mlflow(tmp_path: Path, expected: list[dict]) -> None:
    client, runs = mlflow_runs(tmp_path)
    assert len(runs) == 1, [run.info.run_id for run in runs]
    run = runs[0]
    assert run.info.status == "FINISHED"
    assert run.data.params["trainer_config.batch_size"] == "8"
    assert run.data.params["trainer_config.snapshot_storage_options.token"] == "***"
    assert run.data.tags["resumed_with.trainer_config.max_steps"] == "60"  # the rerun's; 50 is the parameter
    for key in {key for row in expected for key in row} - {"step"}:
        logged = sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, key))
        wanted = sorted((row["step"], float(row[key])) for row in expected if key in row)
        assert [step for step, _ in logged] == [step for step, _ in wanted], key  # every step once (twice: both rows)
        if key in EXACT:
            assert logged == wanted, key
    assert [artifact.path for artifact in client.list_artifacts(run.info.run_id)] == ["loss.png"]
    # the run's files beside its database, in a folder of the experiment's (MLflow's default: mlruns/ in the cwd)
    assert (tmp_path / "mlartifacts" / "mingpt-ddp" / run.info.run_id / "artifacts" / "loss.png").is_file()


def wandb_history(tmp_path: Path) -> tuple[set[str], list[dict]]:
    """The run ids and the history rows of every offline session under tmp_path/wandb, read by W&B's own reader."""
    ids, rows = set(), []
    for session in sorted((tmp_path / "wandb").glob("offline-run-*")):
        (log,) = session.glob("run-*.wandb")
        ids.add(log.stem.removeprefix("run-"))
        read = subprocess.run([PYTHON, "-m", "wandb", "leet", "inspect", "--json", str(log)], capture_output=True,
                              text=True, timeout=60, env=tracker_env(tmp_path))
        assert_ok(read)
        records = [json.loads(line) for line in read.stdout.splitlines() if line.strip()]
        rows += [record["history"]["item"] for record in records if record["type"] == "history"]
    return ids, rows


def check_wandb(tmp_path: Path, expected: list[dict]) -> None:
    ids, rows = wandb_history(tmp_path)
    assert len(ids) == 1 and len(list((tmp_path / "wandb").glob("offline-run-*"))) == 3, ids  # 3 sessions, 1 run
    steps = [row["_step"] for row in rows]
    assert len(steps) == len(set(steps))  # no row twice across the sessions
    by_key = {row_key(row): row for row in sorted(rows, key=lambda row: row["_step"])}
    assert list(by_key) == [row_key(row) for row in expected]
    for row in expected:
        assert {key: by_key[row_key(row)].get(key) for key in EXACT if key in row} == \
               {key: row[key] for key in EXACT if key in row}
    sessions = sorted((tmp_path / "wandb").glob("offline-run-*"))
    assert (sessions[-1] / "files" / "loss.png").is_file()


def test_a_killed_resumed_and_rerun_job_is_one_tracked_run_with_each_row_once(tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)  # the SQLite store needs no opt-in, here or below
    run_a, run_b = tmp_path / "run_a", tmp_path / "run_b"
    # Rank 0 (the process feeding the trackers) SIGKILLed at step 25 or a little later: its snapshot is at step 20,
    # the next one would be at 40; torchrun restarts both and they resume.
    output = run_case(Case("trackers", tuple(tracked_args("{d}", "{d}/run_a", max_steps=50)), nproc=2,
                           fault=Fault(at_step=25, victim="rank0"), env=lambda d: {"WANDB_ERROR_REPORTING": "false"},
                           expect=("resumed from",)), tmp_path).output
    resumed = resumes(output)[0][0]
    continued = dict(re.findall(r"tracking: (MLflow|W&B) run .* continuing after step (\d+)", output))
    assert set(continued) == {"MLflow", "W&B"}, output[-3000:]
    assert min(int(step) for step in continued.values()) > resumed  # the killed attempt logged rows past its snapshot
    rows_a = read_metrics(run_a)
    assert len(rows_a) > len(first_rows([run_a]))  # the restart logged again steps the killed attempt had logged
    rerun = subprocess.run(cli(tracked_args(tmp_path, run_b, max_steps=60), ["--standalone", "--nproc_per_node=2"]),
                           cwd=tmp_path, env=tracker_env(tmp_path), capture_output=True, text=True, timeout=240)
    assert_ok(rerun)  # a rerun of the command: a new run directory, the same tracked run
    assert "resumed from" in rerun.stdout and rerun.stdout.count("continuing after step 50") == 2

    expected = first_rows([run_a, run_b])
    check_mlflow(tmp_path, expected)
    check_wandb(tmp_path, expected)
    assert json.loads((tmp_path / "snaps" / KEY_FILE).read_text())["location"] == str(tmp_path / "snaps")
    stored = [tmp_path / "mlflow.db", *(tmp_path / "mlartifacts").rglob("*"), *(tmp_path / "wandb").rglob("*")]
    for path in [*stored, run_a / LOG_FILE]:
        assert not path.is_file() or SECRET.encode() not in path.read_bytes(), path


def test_an_unreachable_mlflow_server_is_one_warning_and_the_run_goes_on(tmp_path):
    """Also: the worker that asked for MLflow never imports it (its tracker process does)."""
    run_dir = tmp_path / "run"
    uri = f"http://127.0.0.1:{free_port()}"
    env = {**tracker_env(tmp_path), "PYTHONPROFILEIMPORTTIME": "1"}  # the worker's imports, on its stderr
    args = job_args(tmp_path / "snaps", run_dir, "tracking_config.mlflow=true",
                    f"tracking_config.mlflow_tracking_uri={uri}", max_steps=20)
    result = subprocess.run(cli(args), cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    assert_ok(result)
    said = [line for line in (result.stdout + result.stderr).splitlines() if "MLflow" in line]
    assert len(said) == 1 and uri in (run_dir / LOG_FILE).read_text() + said[0], said
    assert "MLflow is off for this run" in said[0] and "done: 20 steps" in result.stdout
    assert [row["step"] for row in read_metrics(run_dir) if "train_loss" in row] == [5, 10, 15, 20]
    assert list((tmp_path / "snaps").glob("snapshot-*.pt"))
    imported = [line for line in result.stderr.splitlines() if line.startswith("import time:")]
    assert imported and not [line for line in imported if "mlflow" in line or "wandb" in line]


def hiding(tmp_path: Path, *modules: str) -> dict[str, str]:
    """The environment of a process in which these packages look as if they were not installed."""
    hidden = tmp_path / "hidden"
    hidden.mkdir(exist_ok=True)
    (hidden / "sitecustomize.py").write_text("import sys\n" + "".join(f"sys.modules[{m!r}] = None\n" for m in modules))
    return {**subprocess_env(tmp_path), "PYTHONPATH": str(hidden)}


def test_a_tracker_whose_package_is_missing_is_a_one_line_error_naming_the_install_command(tmp_path):
    env = hiding(tmp_path, "mlflow", "wandb")  # as if neither package were installed
    for switch in ("mlflow", "wandb"):
        result = subprocess.run(cli([f"tracking_config.{switch}=true"]), cwd=tmp_path, env=env, capture_output=True,
                                text=True, timeout=120)
        assert result.returncode == 2
        assert_one_error_line(result, re.escape(f"tracking_config.{switch}=true needs the {switch} package: "
                                                f"pip install -r requirements-{switch}.txt"))
        assert switch in (PROJECT_DIR / f"requirements-{switch}.txt").read_text()
    # mlflow-skinny alone (no SQLAlchemy): the default SQLite store cannot open
    result = subprocess.run(cli(["tracking_config.mlflow=true"]), cwd=tmp_path, env=hiding(tmp_path, "sqlalchemy"),
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert_one_error_line(result, re.escape("MLflow's SQLite store needs the sqlalchemy package: "
                                            "pip install -r requirements-mlflow.txt"))
    assert not (tmp_path / "outputs").exists()  # stopped before Hydra made a run directory


def test_a_file_store_is_refused_in_one_line_unless_the_user_allows_it(tmp_path):
    """MLflow 3 refuses a folder (its file store, in maintenance mode) unless MLFLOW_ALLOW_FILE_STORE=true: so does
    the run, before training, naming the way out; the user's opt-in is MLflow's own, and the run then starts."""
    env = {key: value for key, value in subprocess_env(tmp_path).items() if key != "MLFLOW_ALLOW_FILE_STORE"}
    folder = tmp_path / "mlruns"
    args = ["tracking_config.mlflow=true", f"tracking_config.mlflow_tracking_uri={folder}", "--cfg", "job"]
    result = subprocess.run(cli(args), cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert_one_error_line(result, re.escape(f"tracking_config.mlflow_tracking_uri: {folder} is a folder, MLflow's "
                                            f"file store, which MLflow 3 refuses") + ".*mlflow migrate-filestore"
                                            ".*MLFLOW_ALLOW_FILE_STORE=true")
    allowed = subprocess.run(cli(args), cwd=tmp_path, env={**env, "MLFLOW_ALLOW_FILE_STORE": "true"},
                             capture_output=True, text=True, timeout=120)
    assert_ok(allowed)
