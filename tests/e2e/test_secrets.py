"""Secrets and untrusted snapshots, through the real CLI.

Credentials, from the environment or from trainer_config.snapshot_storage_options, must not appear in the logs, the
saved Hydra config (of a run or of a sweep), any file of the run directory, or a snapshot. (tests/e2e/test_s3.py checks
storage options on S3.) Loading a snapshot must never run code from it, in sample.py and `snapshot.py info` too
(main.py's resume is a case of tests/e2e/test_bad_input.py).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from support import PROJECT_DIR, PYTHON, assert_ok, cli, job_args, make_snapshot, run_cli, subprocess_env

from mingpt.checkpoint import store as snap

ENV_KEY_ID = "AKIAENVLEAKCHECK0001"
ENV_SECRET = "env/Secret+LEAKCHECK/0002"
OPTION_SECRETS = ("hunter2-OPTION-LEAKCHECK-0003", "tok_OPTION_LEAKCHECK_0004")


def assert_nowhere(secrets: tuple[str, ...], texts: dict[str, bytes]) -> None:
    """None of `secrets` in any of `texts` (name -> content), as text or inside binary data."""
    for name, content in texts.items():
        for secret in secrets:
            assert secret.encode() not in content, f"{secret!r} found in {name}"


def files_under(folder: Path) -> dict[str, bytes]:
    return {str(path): path.read_bytes() for path in folder.rglob("*") if path.is_file()}


def short_run(snapshot_path: str, run_dir: Path) -> list[str]:
    return job_args(snapshot_path, run_dir, max_steps=5, eval_every_steps=5, eval_batches=1)


@pytest.fixture
def s3_credentials() -> dict[str, str]:
    """Distinctive credentials, to look for in everything the run writes."""
    return {"AWS_ACCESS_KEY_ID": ENV_KEY_ID, "AWS_SECRET_ACCESS_KEY": ENV_SECRET}


def test_environment_credentials_are_not_written_anywhere(tmp_path, s3):
    s3.create_bucket(Bucket="envcreds")
    run_dir = tmp_path / "run"
    result = run_cli(short_run("s3://envcreds/r/", run_dir), tmp_path)
    assert_ok(result)
    info = subprocess.run([PYTHON, str(PROJECT_DIR / "snapshot.py"), "info", "s3://envcreds/r/snapshot-000000005.pt"],
                          capture_output=True, timeout=120)
    assert_ok(info)
    objects = {o["Key"]: s3.get_object(Bucket="envcreds", Key=o["Key"])["Body"].read()
               for o in s3.list_objects_v2(Bucket="envcreds").get("Contents", [])}
    assert list(objects) == ["r/snapshot-000000005.pt"]
    assert_nowhere((ENV_KEY_ID, ENV_SECRET), {
        "stdout": result.stdout.encode(), "stderr": result.stderr.encode(),
        "snapshot.py info": info.stdout + info.stderr, **files_under(run_dir), **objects,
    })


def test_storage_options_and_environment_credentials_stay_out_of_a_local_run(tmp_path, monkeypatch):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", ENV_KEY_ID)  # present, unused: a local run must not record them either
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", ENV_SECRET)
    password, token = OPTION_SECRETS
    run_dir, snaps = tmp_path / "run", tmp_path / "snaps"
    options = f"trainer_config.snapshot_storage_options={{password:'{password}',token:'{token}'}}"
    result = run_cli([*short_run(str(snaps), run_dir), options], tmp_path)
    assert_ok(result)
    assert (run_dir / ".hydra" / "overrides.yaml").exists() and list(snaps.glob("snapshot-*.pt"))
    assert_nowhere((ENV_KEY_ID, ENV_SECRET, *OPTION_SECRETS), {
        "stdout": result.stdout.encode(), "stderr": result.stderr.encode(),
        **files_under(run_dir), **files_under(snaps),
    })
    saved = snap.from_bytes((snaps / snap.snapshot_name(5)).read_bytes(), "local")
    assert saved["train_config"]["trainer_config"]["snapshot_storage_options"] == {"password": "***", "token": "***"}


def test_a_sweep_does_not_save_storage_options_in_multirun_yaml(tmp_path):
    """Hydra writes the sweep's overrides to <sweep dir>/multirun.yaml as well as to each job's .hydra/."""
    password, token = OPTION_SECRETS
    sweep = tmp_path / "sweep"
    result = subprocess.run(
        cli(["-m", "data_config.path=no-such-file.txt", f"hydra.sweep.dir={sweep}",
             f"trainer_config.snapshot_storage_options={{password:'{password}',token:'{token}'}}"]),
        cwd=tmp_path, env=subprocess_env(tmp_path), capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 2 and "data file not found" in result.stderr, result.stderr[-3000:]
    assert (sweep / "multirun.yaml").exists() and (sweep / "0" / ".hydra" / "overrides.yaml").exists()
    assert "***" in (sweep / "multirun.yaml").read_text()
    assert_nowhere(OPTION_SECRETS, {"stdout": result.stdout.encode(), "stderr": result.stderr.encode(),
                                    **files_under(sweep)})


def test_a_crash_does_not_echo_the_overrides(tmp_path):
    """A bug (not a usage error) keeps its traceback, but not Hydra's report, which lists every override."""
    password, token = OPTION_SECRETS
    crash = (  # main.py run as __main__ (as Hydra needs it), with a Trainer.fit that fails like a bug would
        "import runpy, sys; sys.path.insert(0, sys.argv[1]); import trainer\n"
        "def fit(self): raise RuntimeError('a bug')\n"
        "trainer.Trainer.fit = fit; sys.argv = [sys.argv[1] + '/main.py', *sys.argv[2:]]\n"
        "runpy.run_path(sys.argv[0], run_name='__main__')\n"
    )
    result = subprocess.run(
        [PYTHON, "-c", crash, str(PROJECT_DIR), *short_run(str(tmp_path / "snaps"), tmp_path / "run"),
         f"trainer_config.snapshot_storage_options={{password:'{password}',token:'{token}'}}"],
        cwd=tmp_path, env=subprocess_env(tmp_path), capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 1, result.stderr[-3000:]
    assert "Traceback" in result.stderr and "RuntimeError: a bug" in result.stderr
    assert_nowhere(OPTION_SECRETS, {"stdout": result.stdout.encode(), "stderr": result.stderr.encode(),
                                    **files_under(tmp_path / "run")})


class WritesMarker:
    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (exec, (f"open({self.marker!r}, 'w').close()",))


@pytest.mark.parametrize("tool", ["snapshot.py info", "sample.py file", "sample.py folder"])
def test_a_snapshot_with_code_is_refused_without_running_it(tmp_path, tool):
    marker = tmp_path / "code-ran"
    evil = make_snapshot(10)
    evil["progress"] = WritesMarker(marker)
    snaps = tmp_path / "snaps"
    snaps.mkdir()
    path = snaps / snap.snapshot_name(10)
    path.write_bytes(snap.to_bytes(evil))
    command = {
        "snapshot.py info": [str(PROJECT_DIR / "snapshot.py"), "info", str(path)],
        "sample.py file": [str(PROJECT_DIR / "sample.py"), f"snapshot={path}"],
        "sample.py folder": [str(PROJECT_DIR / "sample.py"), f"snapshot={snaps}"],
    }[tool]
    result = subprocess.run([sys.executable, *command], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr[-3000:]
    assert result.stderr.strip().splitlines() == [
        f"error: refusing to load {path}: it references code (exec), not only data"
    ], result.stderr
    assert not marker.exists() and path.exists()
