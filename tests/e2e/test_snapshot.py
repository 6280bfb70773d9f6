"""The snapshot.py commands as a user runs them: `info` and `list`, and `list` on a missing, empty or file location
(contents, bytes, integrity and storage in one process: tests/unit/test_snapshot.py)."""

import json
import subprocess
import sys

from support import PROJECT_DIR, SNAPSHOT_VOCAB, assert_ok, make_snapshot

from mingpt.checkpoint import store as snap
from model import GPT, GPTConfig


def test_cli_info_and_list(tmp_path):
    store = snap.SnapshotStore(str(tmp_path))
    original = make_snapshot(10)
    for step in (10, 20):
        store.write(snap.snapshot_name(step), snap.to_bytes(make_snapshot(step)))
    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, str(PROJECT_DIR / "snapshot.py"), *args], capture_output=True,
                              text=True, timeout=60)

    info = run("info", str(tmp_path / snap.snapshot_name(10)))
    assert_ok(info)
    summary = json.loads(info.stdout)
    for key in ("format_version", "epoch", "step", "world_size", "n_params", "vocab_size", "val_loss",
                "created_at", "weights_sha256"):
        assert key in summary
    assert summary["step"] == 10 and summary["world_size"] == 2 and summary["vocab_size"] == len(SNAPSHOT_VOCAB)
    assert summary["weights_sha256"] == original["weights_sha256"]
    assert summary["n_params"] == GPT(GPTConfig(**original["model_config"])).num_params()
    listing = run("list", str(tmp_path))
    assert [json.loads(line)["step"] for line in listing.stdout.splitlines()] == [20, 10]
    missing = run("info", str(tmp_path / "nope.pt"))
    assert missing.returncode == 2 and missing.stderr.startswith("error: no such snapshot")


def test_cli_list_says_when_a_folder_is_missing_empty_or_a_file(tmp_path):
    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, str(PROJECT_DIR / "snapshot.py"), *args], capture_output=True,
                              text=True, timeout=60)

    missing = run("list", str(tmp_path / "nope"))
    assert missing.returncode == 2 and missing.stderr == f"error: no such snapshot folder: {tmp_path / 'nope'}\n"
    (tmp_path / "empty").mkdir()
    empty = run("list", str(tmp_path / "empty"))
    assert empty.returncode == 0 and empty.stdout == "" and empty.stderr == f"no snapshot in {tmp_path / 'empty'}\n"
    snap.SnapshotStore(str(tmp_path)).write(snap.snapshot_name(10), snap.to_bytes(make_snapshot(10)))
    a_file = run("list", str(tmp_path / snap.snapshot_name(10)))
    assert a_file.returncode == 2 and "is a file, not a snapshot folder" in a_file.stderr, a_file.stderr
