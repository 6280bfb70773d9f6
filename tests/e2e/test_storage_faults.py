"""Storage faults, for real: an S3 server (moto's, over HTTP on 127.0.0.1) that stops in the middle of a run or is
down from the start, a local disk that fills up, and a read-only snapshot location.

What must hold: a failed save is retried with backoff and then reported in one line; training goes on; the
previous snapshot stays the newest valid one, byte for byte, and nothing half-written appears as a snapshot; the
next save after the store comes back succeeds; a save that cannot be made at the end of training, or a location
that cannot be written at the start, is a one-line error and a non-zero exit. A multipart upload that fails or is
killed leaves no parts in the bucket; a store that fails while snapshots are read at start is retried as a save
is, then one line."""

from __future__ import annotations

import logging
import os
import resource
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
import s3fs
import torch
from support import assert_ok, cli, job_args, logged_step, subprocess_env, wait_for

from mingpt.checkpoint import store as snap
from mingpt.errors import UsageError

SNAPSHOT_BYTES_MAX = 400_000  # a TINY snapshot is ~358 KB; the file-size limit and the tmpfs size depend on it


def objects(s3, bucket: str) -> dict[str, bytes]:
    """The bucket's objects, except the trainer's short-lived write probes (one may vanish between list and get)."""
    listing = s3.list_objects_v2(Bucket=bucket).get("Contents", [])
    keys = [o["Key"] for o in listing if "/.write-check-" not in o["Key"]]
    return {key: s3.get_object(Bucket=bucket, Key=key)["Body"].read() for key in keys}


def step_of(key: str) -> int:
    return int(key.rsplit("-", 1)[1].removesuffix(".pt"))


# ------------------------------------------------------------------------------------------- the real CLI
def train_args(url: str, run_dir: Path, max_steps: int, save_every_steps: int, keep_last: int = 100) -> list[str]:
    return job_args(url, run_dir, max_steps=max_steps, save_every_steps=save_every_steps, keep_last=keep_last,
                    eval_every_steps=100, progress="lines")


def start_main(args: list[str], tmp_path: Path, name: str, max_file_bytes: int | None = None) -> subprocess.Popen:
    """`python main.py ARGS` in the background: stdout to tmp_path/NAME.out, stderr to NAME.err. With
    max_file_bytes, no file it writes may grow beyond that (RLIMIT_FSIZE: a disk that is full for big files)."""

    def limit_file_size() -> None:
        # Past the limit the kernel sends SIGXFSZ, which kills by default; ignored, the write fails with EFBIG.
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (max_file_bytes, resource.RLIM_INFINITY))

    return subprocess.Popen(
        cli(args), cwd=tmp_path, env=subprocess_env(tmp_path),
        stdout=(tmp_path / f"{name}.out").open("w"), stderr=(tmp_path / f"{name}.err").open("w"), text=True,
        preexec_fn=limit_file_size if max_file_bytes else None,
    )


def finish(job: subprocess.Popen, tmp_path: Path, name: str, timeout: float = 300) -> tuple[int, str, list[str]]:
    """Exit code, stdout, and the non-blank lines of stderr."""
    try:
        code = job.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        job.kill()  # leave nothing running behind a failed test (nor writing into a file system being unmounted)
        job.wait()
        raise
    out = (tmp_path / f"{name}.out").read_text()
    err = [line for line in (tmp_path / f"{name}.err").read_text().splitlines() if line.strip()]
    return code, out, err


def run_main(args: list[str], tmp_path: Path, name: str, **kwargs) -> tuple[int, str, list[str]]:
    return finish(start_main(args, tmp_path, name, **kwargs), tmp_path, name)


def log_text(tmp_path: Path, name: str) -> str:
    path = tmp_path / f"{name}.out"
    return path.read_text() if path.exists() else ""


# ------------------------------------------------------------------------------------------- in-process S3
def tiny_state(step: int) -> tuple[dict, dict]:
    state = {"model": {"w": torch.full((4,), float(step))}, "optimizer": {}, "scaler": {},
             "progress": {"step": step, "epoch": 0, "epoch_samples": 0, "val_loss": None, "last_eval_step": 0},
             "loss_window": {"sums": [0.0], "count": 0, "start_step": step}}
    return state, {"model_config": {}, "vocab": "ab"}


def submit(writer: snap.BackgroundWriter, step: int) -> None:
    state, metadata = tiny_state(step)
    writer.submit(snap.snapshot_name(step), state, metadata, world_size=1, reason="test")


def attempt_times(caplog, name: str) -> list[float]:
    return [r.created for r in caplog.records if name in r.getMessage() and "failed" in r.getMessage()]


def test_save_retries_with_backoff_until_the_server_returns(s3_server, s3, caplog):
    caplog.set_level(logging.INFO, logger="mingpt.checkpoint.store")
    s3.create_bucket(Bucket="retry")
    writer = snap.BackgroundWriter(snap.SnapshotStore("s3://retry/run"), keep_last=5)
    submit(writer, 10)
    writer.wait()
    first = s3.get_object(Bucket="retry", Key="run/snapshot-000000010.pt")["Body"].read()

    s3_server.stop()
    submit(writer, 20)
    name = snap.snapshot_name(20)
    wait_for(lambda: len(attempt_times(caplog, name)) >= 2, timeout=60, what="two failed attempts")
    s3_server.start()
    writer.wait()  # raises if the save did not succeed in the end

    saved = [r.getMessage() for r in caplog.records if f"{name} saved" in r.getMessage()]
    assert len(saved) == 1 and "3 attempts" in saved[0], caplog.text
    failed = attempt_times(caplog, name)
    gap = failed[1] - failed[0]  # the 1 s backoff plus the second attempt's own request retries
    assert 1.0 <= gap < 6, f"first backoff {gap:.2f} s"
    assert all("\n" not in r.getMessage() and r.exc_info is None for r in caplog.records)
    found = objects(s3, "retry")
    assert sorted(found) == ["run/snapshot-000000010.pt", "run/snapshot-000000020.pt"]
    assert found["run/snapshot-000000010.pt"] == first
    assert snap.from_bytes(found["run/snapshot-000000020.pt"], "s3")["progress"]["step"] == 20


def test_training_goes_on_while_s3_is_down_and_saving_resumes_when_it_returns(tmp_path, s3_server, s3):
    s3.create_bucket(Bucket="outage")
    job = start_main(train_args("s3://outage/run", tmp_path / "run", max_steps=200, save_every_steps=10),
                     tmp_path, "train")
    try:
        wait_for(lambda: "run/snapshot-000000010.pt" in objects(s3, "outage"), timeout=240, interval=0.1,
                 what="first snapshot")
        s3_server.stop()
        stopped_at = logged_step(tmp_path / "run")
        wait_for(lambda: " not saved " in log_text(tmp_path, "train"), timeout=120, what="a failed save")
        back_at = logged_step(tmp_path / "run")  # the failed save took seconds of retries; training did not wait
        s3_server.start()
        code, out, err = finish(job, tmp_path, "train")
    finally:
        job.kill()
    assert code == 0, out[-3000:] + "\n".join(err)
    assert "Traceback" not in out and not err, err

    steps = sorted(step_of(key) for key in objects(s3, "outage"))
    missing = sorted(set(range(10, 201, 10)) - set(steps))
    assert steps[0] == 10 and steps[-1] == 200 and missing, steps
    for step in missing:  # each save lost to the outage was reported, in one line
        assert f"snapshot s3://outage/run/{snap.snapshot_name(step)} not saved (" in out, step
    assert all(step in steps for step in range(max(missing) + 10, 201, 10)), steps  # every save after it returned
    assert logged_step(tmp_path / "run") == 200 and back_at > stopped_at  # training went on during the outage
    for key, body in objects(s3, "outage").items():
        assert snap.from_bytes(body, key)["progress"]["step"] == step_of(key)


def test_s3_down_until_the_end_fails_clearly_and_down_at_start_fails_fast(tmp_path, s3_server, s3):
    s3.create_bucket(Bucket="down")
    args = train_args("s3://down/run", tmp_path / "run", max_steps=60, save_every_steps=5)
    job = start_main(args, tmp_path, "train")
    try:
        wait_for(lambda: objects(s3, "down"), timeout=240, interval=0.1, what="first snapshot")
        before = objects(s3, "down")
        s3_server.stop()
        code, out, err = finish(job, tmp_path, "train")
    finally:
        job.kill()
    # The end-of-training save is the one that must not be lost silently: one line, non-zero exit.
    assert code == 2, out[-3000:] + "\n".join(err)
    assert len(err) == 1 and err[0].startswith("error: snapshot s3://down/run/snapshot-000000060.pt not saved ("), err
    assert "4 attempt(s)" in err[0] and "EndpointConnectionError" in err[0], err
    assert logged_step(tmp_path / "run") == 60 and "Traceback" not in out  # training went on to the end

    start = time.perf_counter()
    code, out, err_at_start = run_main(args, tmp_path, "again")
    elapsed = time.perf_counter() - start
    assert code == 2 and len(err_at_start) == 1, err_at_start
    assert err_at_start[0].startswith("error: snapshot location s3://down/run cannot be reached: "), err_at_start
    # Seconds, not minutes; most of it is process start-up (import torch, s3fs), which on a loaded 2-core machine
    # alone can take 30 s. The store check itself is timed in test_unreachable_store_is_reported_within_seconds.
    assert elapsed < 60, f"{elapsed:.1f} s (process start-up included) to report a store that is down"

    s3_server.start()
    after = objects(s3, "down")
    assert all(after[key] == body for key, body in before.items())  # what was there is untouched
    newest = max(after, key=step_of)
    assert f"{newest.rsplit('/', 1)[1]} stays the newest" in err[0], (err, sorted(after))
    for key, body in after.items():  # whatever is there is complete: saves in flight either landed or not at all
        assert snap.from_bytes(body, key)["progress"]["step"] == step_of(key)
        assert f"snapshot s3://down/{key} saved" in log_text(tmp_path, "train")


# ------------------------------------------------------------------------------------------- multipart uploads
def incomplete_uploads(s3, bucket: str) -> list[str]:
    return sorted(u["Key"] for u in s3.list_multipart_uploads(Bucket=bucket).get("Uploads", []))


def big_state(step: int) -> tuple[dict, dict]:
    """A snapshot of three 5 MiB parts (S3's smallest) once S3_PART_BYTES is 5 MiB: a multipart upload."""
    state, metadata = tiny_state(step)
    state["model"]["w"] = torch.full((3 * 2**20,), float(step))
    return state, metadata


def lose_connection_in_part_2(monkeypatch, fs: s3fs.S3FileSystem) -> list[str]:
    """From now on every upload's part 2 fails as a dropped connection does, and so does the abort that s3fs makes
    right after it (the connection is gone); later requests go through. Returns the S3 calls made."""
    real, calls, lost = fs._call_s3, [], []

    async def call(method, *args, **kwargs):
        calls.append(method)
        if method == "upload_part" and kwargs.get("PartNumber") == 2:
            lost.append(True)
            raise ConnectionResetError(104, "Connection reset by peer (injected)")
        if method == "abort_multipart_upload" and lost:
            lost.clear()
            raise ConnectionResetError(104, "Connection reset by peer (injected)")
        return await real(method, *args, **kwargs)

    monkeypatch.setattr(fs, "_call_s3", call)
    return calls


def test_a_failed_multipart_save_leaves_no_incomplete_upload(s3_server, s3, monkeypatch):
    monkeypatch.setattr(snap, "S3_PART_BYTES", 5 * 2**20)
    monkeypatch.setattr(snap, "SAVE_FIRST_BACKOFF_S", 0.01)
    s3.create_bucket(Bucket="mpu")
    store = snap.SnapshotStore("s3://mpu/run")
    writer = snap.BackgroundWriter(store, keep_last=2)
    calls = lose_connection_in_part_2(monkeypatch, store.fs)
    state, metadata = big_state(10)
    writer.submit(snap.snapshot_name(10), state, metadata, world_size=1, reason="test")
    with pytest.raises(UsageError, match=r"snapshot s3://mpu/run/snapshot-000000010\.pt not saved \(4 attempt"):
        writer.wait()
    assert calls.count("create_multipart_upload") == 4 and calls.count("upload_part") >= 8  # really in parts
    assert incomplete_uploads(s3, "mpu") == [] and "Contents" not in s3.list_objects_v2(Bucket="mpu")

    monkeypatch.undo()  # the connection holds again: the same save in parts completes
    monkeypatch.setattr(snap, "S3_PART_BYTES", 5 * 2**20)
    state, metadata = big_state(20)
    writer.submit(snap.snapshot_name(20), state, metadata, world_size=1, reason="test")
    writer.wait()
    body = s3.get_object(Bucket="mpu", Key="run/snapshot-000000020.pt")["Body"].read()
    assert len(body) > 2 * snap.S3_PART_BYTES and snap.from_bytes(body, "s3")["progress"]["step"] == 20
    assert incomplete_uploads(s3, "mpu") == []


def test_incomplete_uploads_of_killed_saves_are_aborted_by_the_next_save(s3_server, s3, caplog):
    """A save killed mid-upload (SIGKILL, a lost node) leaves its parts; the next completed save aborts them, and
    only the uploads of snapshots in its own location."""
    caplog.set_level(logging.INFO, logger="mingpt.checkpoint.store")
    s3.create_bucket(Bucket="killed")
    keys = ["run/snapshot-000000010.pt", "run/notes.bin", "run/sub/snapshot-000000010.pt",
            "other/snapshot-000000010.pt"]
    for key in keys:
        upload = s3.create_multipart_upload(Bucket="killed", Key=key)
        s3.upload_part(Bucket="killed", Key=key, PartNumber=1, UploadId=upload["UploadId"], Body=b"x" * 1024)
    writer = snap.BackgroundWriter(snap.SnapshotStore("s3://killed/run"), keep_last=2)
    submit(writer, 20)
    writer.wait()
    assert incomplete_uploads(s3, "killed") == sorted(keys[1:])
    saved = [r.getMessage() for r in caplog.records if "saved" in r.getMessage()]
    assert len(saved) == 1 and saved[0].endswith("; removed the incomplete upload of snapshot-000000010.pt"), saved


def test_s3_down_while_a_job_reads_its_snapshots_is_one_line(s3_server, s3, monkeypatch):
    """The store fails after the start-up check, while snapshots are listed and loaded: tried again as a failed
    save is, then one line (no traceback)."""
    monkeypatch.setattr(snap, "SAVE_FIRST_BACKOFF_S", 0.01)
    s3.create_bucket(Bucket="resume")
    writer = snap.BackgroundWriter(snap.SnapshotStore("s3://resume/run"), keep_last=2)
    submit(writer, 10)
    writer.wait()
    s3_server.stop()
    s3fs.S3FileSystem.clear_instance_cache()  # a new process: nothing listed yet
    store = snap.SnapshotStore("s3://resume/run", {"config_kwargs": {"retries": {"total_max_attempts": 1}}})
    start = time.perf_counter()
    with pytest.raises(UsageError) as error:
        store.load_newest_valid(*tiny_state(10)[1].values())
    message = str(error.value)
    assert message.startswith("cannot list the snapshots in s3://resume/run (4 attempt(s) in ") and "\n" not in message
    assert "EndpointConnectionError" in message and time.perf_counter() - start < 30


# ------------------------------------------------------------------------------------------- local disk
@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """Snapshots at steps 10 and 20 of a TINY run, written once for the local-disk tests to copy."""
    tmp_path = tmp_path_factory.mktemp("trained")
    code, out, err = run_main(train_args(str(tmp_path / "snapshots"), tmp_path / "run", max_steps=20,
                                         save_every_steps=10), tmp_path, "train")
    assert code == 0, out[-3000:] + "\n".join(err)
    snapshots = tmp_path / "snapshots"
    assert sorted(os.listdir(snapshots)) == ["snapshot-000000010.pt", "snapshot-000000020.pt"]
    assert max(p.stat().st_size for p in snapshots.iterdir()) < SNAPSHOT_BYTES_MAX
    return snapshots


def contents(folder: Path) -> dict[str, bytes]:
    """Every file in the folder, hidden ones (temporary files) included."""
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def test_file_size_limit_fails_saves_clearly_and_keeps_the_previous_snapshots(tmp_path, trained):
    """RLIMIT_FSIZE makes every write past 128 KiB fail with EFBIG, as a disk that has filled up does for big
    files: the mid-run save is a warning, the final one an error; the snapshots already there do not change."""
    folder = tmp_path / "snapshots"
    shutil.copytree(trained, folder)
    before = contents(folder)
    args = train_args(str(folder), tmp_path / "run", max_steps=40, save_every_steps=10)
    code, out, err = run_main(args, tmp_path, "train", max_file_bytes=128 * 1024)
    assert code == 2, out[-3000:] + "\n".join(err)
    assert len(err) == 1 and err[0].startswith(f"error: snapshot {folder}/snapshot-000000040.pt not saved ("), err
    assert "File too large" in err[0] and "1 attempt(s)" in err[0], err  # not worth retrying
    assert f"snapshot {folder}/snapshot-000000030.pt not saved (" in out and "resumed from" in out
    assert logged_step(tmp_path / "run") == 40
    assert contents(folder) == before  # byte-identical, and no temporary file left behind


def _mount(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["mount", *args], capture_output=True, text=True)


@pytest.fixture
def small_tmpfs(tmp_path):
    """A real file system with room for 2.5 TINY snapshots; needs root with CAP_SYS_ADMIN, else the test skips."""
    mount_point = tmp_path / "disk"
    mount_point.mkdir()
    if shutil.which("mount") is None:
        pytest.skip("no mount command to create a small file system")
    done = _mount("-t", "tmpfs", "-o", f"size={int(2.5 * SNAPSHOT_BYTES_MAX)}", "tmpfs", str(mount_point))
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root with CAP_SYS_ADMIN): {done.stderr.strip()}")
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", "-l", str(mount_point)], capture_output=True)


def test_full_disk_then_read_only_disk_fail_clearly_and_keep_the_previous_snapshots(tmp_path, trained, small_tmpfs):
    folder = small_tmpfs / "snapshots"
    shutil.copytree(trained, folder)
    before = contents(folder)
    args = train_args(str(folder), tmp_path / "run", max_steps=40, save_every_steps=10)

    # Full: the third snapshot does not fit (older ones are removed only after a newer one is complete).
    code, out, err = run_main(args, tmp_path, "full")
    assert code == 2, out[-3000:] + "\n".join(err)
    assert len(err) == 1 and err[0].startswith(f"error: snapshot {folder}/snapshot-000000040.pt not saved ("), err
    assert "No space left on device" in err[0] and "4 attempt(s)" in err[0], err  # space may come back: retried
    assert f"snapshot {folder}/snapshot-000000030.pt not saved (" in out
    assert contents(folder) == before

    # Read-only: refused before training starts.
    done = _mount("-o", "remount,ro", str(small_tmpfs))
    assert_ok(done)
    start = time.perf_counter()
    code, out, err = run_main(args, tmp_path, "read-only")
    assert code == 2 and len(err) == 1, out[-3000:] + "\n".join(err)
    assert err[0].startswith(f"error: snapshot location {folder} is not writable: ") and "Read-only" in err[0], err
    assert time.perf_counter() - start < 60
    assert contents(folder) == before


def test_location_that_turns_read_only_mid_run_fails_the_save_without_retrying(tmp_path, small_tmpfs, caplog):
    """In-process: the writer meets EROFS after the location was checked; one line, no retries, nothing changed."""
    caplog.set_level(logging.INFO, logger="mingpt.checkpoint.store")
    writer = snap.BackgroundWriter(snap.SnapshotStore(str(small_tmpfs)), keep_last=2)
    submit(writer, 10)
    writer.wait()
    before = contents(small_tmpfs)
    assert _mount("-o", "remount,ro", str(small_tmpfs)).returncode == 0
    start = time.perf_counter()
    submit(writer, 20)
    with pytest.raises(UsageError, match=r"snapshot-000000020\.pt not saved \(1 attempt\(s\).*Read-only file system"):
        writer.wait()
    assert time.perf_counter() - start < 1.0
    assert "snapshot-000000010.pt stays the newest" in caplog.text
    assert contents(small_tmpfs) == before
