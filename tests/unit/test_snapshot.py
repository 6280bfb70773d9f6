"""Snapshot contents, bytes, integrity and storage, in this process (the snapshot.py commands as processes:
tests/e2e/test_snapshot.py)."""

import logging
import os

import pytest
import torch
from support import PROJECT_DIR, SNAPSHOT_VOCAB, make_snapshot

from mingpt.checkpoint import store as snap
from mingpt.errors import UsageError


def expected(snapshot: dict) -> tuple[dict, str]:
    return snapshot["model_config"], snapshot["vocab"]


def test_round_trip_keeps_everything():
    original = make_snapshot()
    loaded = snap.from_bytes(snap.to_bytes(original), "mem")
    assert loaded["progress"] == original["progress"]
    assert loaded["world_size"] == 2 and loaded["format_version"] == snap.CHAR_FORMAT_VERSION  # characters
    assert loaded["vocab"] == SNAPSHOT_VOCAB and loaded["model_config"]["n_layer"] == 1
    assert all(torch.equal(loaded["model"][k], v) for k, v in original["model"].items())
    assert loaded["weights_sha256"] == snap.weights_sha256(loaded["model"])


def test_weights_sha256_is_over_sorted_tensor_bytes():
    state = {"b": torch.tensor([1.0, 2.0]), "a": torch.tensor([3], dtype=torch.int64)}
    import hashlib

    manual = hashlib.sha256(state["a"].numpy().tobytes() + state["b"].numpy().tobytes()).hexdigest()
    assert snap.weights_sha256(state) == manual


def test_flipped_byte_in_tensor_data_is_detected():
    data = bytearray(snap.to_bytes(make_snapshot()))
    # Find the bytes of one weight matrix inside the file and damage one of them.
    weight = make_snapshot()["model"]["transformer.h.0.mlp.c_fc.weight"]
    offset = bytes(data).find(weight.numpy().tobytes()[:64])
    assert offset > 0
    data[offset + 10] ^= 0x40
    with pytest.raises(snap.CorruptSnapshot, match="damaged"):
        snap.from_bytes(bytes(data), "mem")


@pytest.mark.parametrize("damage", ["truncated", "random", "empty", "not a dict"])
def test_unreadable_bytes_are_corrupt(damage):
    good = snap.to_bytes(make_snapshot())
    data = {
        "truncated": good[: len(good) // 2],
        "random": os.urandom(4096),
        "empty": b"",
        "not a dict": snap.to_bytes([1, 2, 3]),
    }[damage]
    with pytest.raises(snap.CorruptSnapshot):
        snap.from_bytes(data, "mem")


class _RunsCode:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.mkdir, (self.marker,))


def test_pickled_callable_is_refused_without_running_it(tmp_path):
    marker = tmp_path / "code-ran"
    evil = make_snapshot()
    evil["progress"] = _RunsCode(str(marker))
    with pytest.raises(UsageError, match=r"references code \(posix.mkdir\)"):
        snap.from_bytes(snap.to_bytes(evil), "evil.pt")
    assert not marker.exists()


def test_newer_format_is_an_error():
    newer = make_snapshot()
    newer["format_version"] = snap.FORMAT_VERSION + 1
    newer["integrity_sha256"] = snap.integrity_sha256(newer)
    with pytest.raises(UsageError, match="newer than this code"):
        snap.from_bytes(snap.to_bytes(newer), "new.pt")


def test_store_writes_atomically_lists_newest_first_and_prunes(tmp_path):
    store = snap.SnapshotStore(str(tmp_path / "snaps"))
    store.check_writable()
    for step in (10, 30, 20):
        store.write(snap.snapshot_name(step), snap.to_bytes(make_snapshot(step)))
    assert [e.step for e in store.entries()] == [30, 20, 10]
    assert sorted(os.listdir(tmp_path / "snaps")) == [snap.snapshot_name(s) for s in (10, 20, 30)]  # no temp files
    assert store.prune(keep_last=2) == [snap.snapshot_name(10)]
    assert [e.step for e in store.entries()] == [30, 20]


def test_interrupted_local_save_leaves_previous_snapshot(tmp_path, monkeypatch):
    store = snap.SnapshotStore(str(tmp_path))
    store.write(snap.snapshot_name(10), snap.to_bytes(make_snapshot(10)))

    def crash(*args):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError):
        store.write(snap.snapshot_name(20), snap.to_bytes(make_snapshot(20)))
    assert os.listdir(tmp_path) == [snap.snapshot_name(10)]  # the temp file is gone, the old snapshot intact
    entry, loaded = store.load_newest_valid(*expected(make_snapshot(10)))
    assert entry.step == 10


def test_prune_removes_stale_temp_files_of_killed_saves(tmp_path):
    store = snap.SnapshotStore(str(tmp_path))
    stale = tmp_path / ".snapshot-000000020.pt.tmp-99999-abcdef12"
    stale.write_bytes(b"partial")
    store.write(snap.snapshot_name(10), snap.to_bytes(make_snapshot(10)))
    store.prune(keep_last=2)
    assert not stale.exists()


def test_corrupt_newest_falls_back_to_previous(tmp_path, caplog):
    store = snap.SnapshotStore(str(tmp_path))
    store.write(snap.snapshot_name(10), snap.to_bytes(make_snapshot(10)))
    good = snap.to_bytes(make_snapshot(20))
    store.write(snap.snapshot_name(20), good[: len(good) // 3])
    with caplog.at_level(logging.WARNING):
        entry, loaded = store.load_newest_valid(*expected(make_snapshot(10)))
    assert entry.step == 10 and loaded["progress"]["step"] == 10
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "snapshot-000000020.pt" in warnings[0] and "\n" not in warnings[0]


def test_no_snapshot_means_none(tmp_path):
    assert snap.SnapshotStore(str(tmp_path / "empty")).load_newest_valid({}, "") is None


def test_other_model_shape_is_a_clear_error(tmp_path):
    store = snap.SnapshotStore(str(tmp_path))
    store.write(snap.snapshot_name(10), snap.to_bytes(make_snapshot(10, n_layer=2)))
    with pytest.raises(UsageError, match="n_layer=2 in the snapshot, 1 in the config"):
        store.load_newest_valid(*expected(make_snapshot(10, n_layer=1)))


def test_other_vocabulary_is_a_clear_error(tmp_path):
    store = snap.SnapshotStore(str(tmp_path))
    store.write(snap.snapshot_name(10), snap.to_bytes(make_snapshot(10, vocab="abcdefghij")))
    config, _ = expected(make_snapshot(10, vocab="abcdefghij"))
    with pytest.raises(UsageError, match="different vocabulary.*only in the data: 'k'.*only in the snapshot: 'j'"):
        store.load_newest_valid(config, "abcdefghik")


def test_unwritable_location_fails_fast(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    with pytest.raises(UsageError, match="not writable"):
        snap.SnapshotStore(str(blocker / "snaps")).check_writable()


# --------------------------------------------------------------------------------------------------- locations
@pytest.mark.parametrize("location, error", [
    ("s3://", r"'s3://': no bucket after 's3://' \(expected s3://BUCKET/PATH\)"),
    ("s3:/bucket/run", r"'s3:/bucket/run' is not a complete URL: 's3:' must be followed by '//'"),
    ("s3:", r"'s3:' is not a complete URL"),
    ("s3:///run", r"no bucket after 's3://'"),
    ("http:///x", r"no host after 'http://' \(expected http://HOST/PATH\)"),
    ("file://", r"no path after 'file://' \(expected file:///ABSOLUTE/PATH\)"),
    ("file://runs/x", r"a file URL needs an absolute path"),
    ("memory://", r"no path after 'memory://'"),
    ("s4://bucket/run", r"unknown protocol 's4' \(fsspec knows s3, "),
    ("S3://bucket/run", r"unknown protocol 'S3' \(did you mean s3://\?\)"),
    ("a:b", r"unknown protocol 'a' .*a local path is written \./a:b"),
    ("simplecache::s3://", r"no bucket after 's3://'"),
    ("simplecache::runs/x", r"'runs/x' in a chained URL is not a URL"),
    (" s3://bucket/run", r"is not a URL \(it does not start with PROTOCOL://\) nor a local path"),
    ("runs/a::b", r"a local path cannot contain '://' or '::'"),
    ("", r"location is empty"),
])
def test_a_location_that_looks_like_a_url_is_one_or_an_error(location, error, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UsageError, match=error) as raised:
        snap.resolve_path(location)
    assert "\n" not in str(raised.value)
    with pytest.raises(UsageError, match=error):
        snap.SnapshotStore(location)
    assert not list(tmp_path.iterdir())  # no local folder made of a mangled URL


def test_valid_urls_and_local_paths_with_a_colon(tmp_path, monkeypatch):
    for url in ("s3://bucket", "s3://bucket/run/", "file:///tmp/x", "memory://x", "hdfs:///user/x",
                "simplecache::s3://bucket/run", "zip://in.txt::s3://bucket/a.zip", "ftp://127.0.0.1:21/x"):
        assert snap.resolve_path(url) == url
    assert snap.resolve_path("runs/a:b") == str(PROJECT_DIR / "runs" / "a:b")  # a colon after the start: local
    assert snap.resolve_path("./s3:/bucket") == str(PROJECT_DIR / "s3:" / "bucket")  # written as local on purpose
    monkeypatch.chdir(tmp_path)
    store = snap.SnapshotStore(f"file://{tmp_path}/snaps/")  # a file URL is a local folder, at its absolute path
    assert store.is_local and store.location == f"file://{tmp_path}/snaps"
    store.check_writable()
    assert os.listdir(tmp_path) == ["snaps"]


# --------------------------------------------------------------------------------------------------- store failures
def fail_first(monkeypatch, store: snap.SnapshotStore, method: str, times: int, error: Exception) -> list[int]:
    """Make `store.fs.<method>` raise `error` on its first `times` calls; returns the list of calls made."""
    real, calls = getattr(store.fs, method), []

    def flaky(*args, **kwargs):
        calls.append(1)
        if len(calls) <= times:
            raise error
        return real(*args, **kwargs)

    monkeypatch.setattr(store.fs, method, flaky)
    return calls


def test_a_store_failing_while_reading_snapshots_is_retried_as_a_save_is(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(snap, "SAVE_FIRST_BACKOFF_S", 0.01)
    store = snap.SnapshotStore(str(tmp_path))
    store.write(snap.snapshot_name(10), snap.to_bytes(make_snapshot(10)))
    calls = fail_first(monkeypatch, store, "cat_file", 2, ConnectionResetError(104, "Connection reset by peer"))
    with caplog.at_level(logging.INFO, logger="mingpt.checkpoint.store"):
        entry, _ = store.load_newest_valid(*expected(make_snapshot(10)))
    assert entry.step == 10 and len(calls) == 3
    retries = [r.getMessage() for r in caplog.records if "failed" in r.getMessage()]
    assert len(retries) == 2 and "attempt 1 of 4 failed (ConnectionResetError" in retries[0], retries


def test_a_store_that_stays_down_while_reading_snapshots_is_one_line(tmp_path, monkeypatch):
    monkeypatch.setattr(snap, "SAVE_FIRST_BACKOFF_S", 0.01)
    store = snap.SnapshotStore(str(tmp_path))
    store.write(snap.snapshot_name(10), snap.to_bytes(make_snapshot(10)))
    calls = fail_first(monkeypatch, store, "ls", 100, ConnectionRefusedError(111, "Connection refused"))
    with pytest.raises(UsageError) as raised:
        store.load_newest_valid(*expected(make_snapshot(10)))
    message = str(raised.value)
    assert message.startswith(f"cannot list the snapshots in {tmp_path} (4 attempt(s) in ") and "\n" not in message
    assert message.endswith("last error ConnectionRefusedError: [Errno 111] Connection refused)") and len(calls) == 4


def test_a_read_error_no_retry_can_fix_is_one_line_at_once(tmp_path, monkeypatch):
    store = snap.SnapshotStore(str(tmp_path))
    store.write(snap.snapshot_name(10), snap.to_bytes(make_snapshot(10)))
    calls = fail_first(monkeypatch, store, "cat_file", 100, PermissionError(13, "Permission denied"))
    with pytest.raises(UsageError, match=r"cannot read snapshot .*snapshot-000000010\.pt \(1 attempt\(s\) in .*"
                                         r"PermissionError: \[Errno 13\] Permission denied\)$"):
        store.load_newest_valid(*expected(make_snapshot(10)))
    assert len(calls) == 1


def test_a_snapshot_removed_after_the_listing_is_skipped(tmp_path, monkeypatch):
    store = snap.SnapshotStore(str(tmp_path))
    for step in (10, 20):
        store.write(snap.snapshot_name(step), snap.to_bytes(make_snapshot(step)))
    fail_first(monkeypatch, store, "cat_file", 1, FileNotFoundError(2, "No such file or directory"))
    entry, _ = store.load_newest_valid(*expected(make_snapshot(10)))
    assert entry.step == 10
