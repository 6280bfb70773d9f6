"""Storage faults in this process: bounded S3 request retries as a default that user settings override, and an
unreachable store reported within seconds (the faults of a real S3 server and disk:
tests/e2e/test_storage_faults.py)."""

from __future__ import annotations

import time

import pytest
import s3fs
from support import free_port

from mingpt.checkpoint import store as snap
from mingpt.errors import UsageError


def test_bounded_s3_request_retries_are_a_default_that_user_settings_override(monkeypatch, tmp_path):
    monkeypatch.delenv("AWS_MAX_ATTEMPTS", raising=False)
    monkeypatch.delenv("AWS_RETRY_MODE", raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-aws-config"))
    added = snap.with_default_retries("s3://b/run", {"client_kwargs": {"endpoint_url": "http://x"}})
    assert added == {"client_kwargs": {"endpoint_url": "http://x"},
                     "config_kwargs": {"retries": snap.S3_DEFAULT_RETRIES}}
    assert snap.with_default_retries(str(tmp_path), {}) == {}  # local folders: nothing to add
    mine = {"config_kwargs": {"retries": {"max_attempts": 10}, "connect_timeout": 2}}
    assert snap.with_default_retries("s3://b/run", mine) == mine
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "7")
    assert snap.with_default_retries("s3://b/run", {}) == {}
    monkeypatch.delenv("AWS_MAX_ATTEMPTS")
    (tmp_path / "aws-config").write_text("[default]\nretry_mode = adaptive\n")
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "aws-config"))
    assert snap.with_default_retries("s3://b/run", {}) == {}


def test_unreachable_store_is_reported_within_seconds(monkeypatch):
    """Nothing listens on the port: one line naming the problem (not "bucket does not exist"), in seconds."""
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{free_port()}")
    for key, value in {"AWS_ACCESS_KEY_ID": "k", "AWS_SECRET_ACCESS_KEY": "s", "AWS_REGION": "us-east-1",
                       "AWS_EC2_METADATA_DISABLED": "true"}.items():
        monkeypatch.setenv(key, value)
    s3fs.S3FileSystem.clear_instance_cache()
    start = time.perf_counter()
    try:
        with pytest.raises(UsageError) as error:
            snap.SnapshotStore("s3://bucket/run").check_writable()
    finally:
        s3fs.S3FileSystem.clear_instance_cache()
    elapsed = time.perf_counter() - start
    message = str(error.value)
    assert "cannot be reached" in message and "EndpointConnectionError" in message and "\n" not in message
    assert elapsed < 10, f"{elapsed:.1f} s to report an unreachable store"
