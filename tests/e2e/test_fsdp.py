"""strategy=fsdp through the commands: the snapshot tools (list, consolidate, export) on sharded snapshots, and
sharded snapshots on the S3 server (in one process: tests/unit/test_fsdp.py; several ranks:
tests/e2e/test_fsdp_ranks.py)."""

from __future__ import annotations

import json
import os

import pytest
from support import fsdp_trainer, reopen

import snapshot as snapshot_tool
from mingpt.checkpoint import store as snap

pytestmark = pytest.mark.usefixtures("no_process_group_left")

def test_snapshot_cli_lists_consolidates_and_exports(tmp_path, capsys):
    """snapshot.py's commands in this process (tests/unit/test_snapshot.py runs the CLI as a process)."""
    fsdp_trainer(snapshots=tmp_path / "s", max_steps=6).fit()

    def run(*args: str) -> tuple[int, str, str]:
        code = snapshot_tool.cli(list(args))
        out, err = capsys.readouterr()
        return code, out, err

    code, out, _ = run("list", str(tmp_path / "s"))
    row = json.loads(out.splitlines()[0])
    assert code == 0 and row["format"] == "sharded" and row["name"] == "snapshot-000000006.dcp" and row["bytes"] > 1000
    assert run("consolidate", str(tmp_path / "s" / row["name"]), str(tmp_path / "one.pt"))[0] == 0
    assert snap.read_snapshot(str(tmp_path / "one.pt"))["progress"]["step"] == 6
    assert run("export", str(tmp_path / "one.pt"), str(tmp_path / "export"))[0] == 0  # a single file exports too
    assert sorted(os.listdir(tmp_path / "export")) == ["config.json", "model.safetensors"]
    for args, message in [(("info", str(tmp_path / "s" / "snapshot-000000099.dcp")), "no such snapshot"),
                          (("info", str(tmp_path / "s")), "is a folder of snapshots"),
                          (("consolidate", str(tmp_path / "one.pt"), str(tmp_path / "one.pt" / "two.pt")),
                           "cannot write")]:
        code, _, err = run(*args)
        assert code == 2 and err.count("\n") == 1 and message in err, (args, err)


def test_sharded_snapshots_on_s3(s3):
    """The local S3 server: each save's shards, index and (last) snapshot.json under its prefix; a killed save's
    objects are not a snapshot and are removed after the next save; info and resume read it back."""
    s3.create_bucket(Bucket="shards")
    url = "s3://shards/run"
    fsdp_trainer(snapshots=url, max_steps=8, save_every_steps=4).fit()

    def keys() -> list[str]:
        return sorted(o["Key"] for o in s3.list_objects_v2(Bucket="shards").get("Contents", []))

    assert keys() == [f"run/snapshot-00000000{step}.dcp/{name}" for step in (4, 8)
                      for name in (".metadata", "__0_0.distcp", "snapshot.json")]
    s3.put_object(Bucket="shards", Key="run/snapshot-000000012.dcp/__0_0.distcp", Body=b"partial")  # a killed save
    info = snap.summary(snap.read_snapshot(f"{url}/snapshot-000000008.dcp"))
    assert info["step"] == 8 and info["format"] == "sharded"
    resumed = reopen(lambda: fsdp_trainer(snapshots=url, max_steps=12, save_every_steps=4))
    resumed.fit()
    assert resumed.trained_steps == 4
    assert "run/snapshot-000000012.dcp/snapshot.json" in keys()  # the step was saved again, completely
    assert not any(key.startswith("run/snapshot-000000004.dcp/") for key in keys())  # keep_last=2
