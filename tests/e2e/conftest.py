"""The end-to-end tests' fixtures: the servers they start (a SLURM cluster, an S3 server) and clients of them."""

from __future__ import annotations

import os

import pytest


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory):
    """A one-node SLURM cluster on 127.0.0.1 (tests/slurm_cluster.py). Skipped, with the reason, where this machine
    cannot run one; MINGPT_REQUIRE_SLURM=1 (set by .ci/run) makes that a failure instead."""
    from slurm_cluster import SlurmCluster, unavailable_reason

    reason = unavailable_reason()
    if reason:
        if os.environ.get("MINGPT_REQUIRE_SLURM") == "1":
            pytest.fail(f"MINGPT_REQUIRE_SLURM=1 but {reason}", pytrace=False)
        pytest.skip(reason)
    cluster = SlurmCluster(tmp_path_factory.mktemp("slurm"))
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture
def s3_credentials() -> dict[str, str]:
    """The AWS credentials the S3 server's clients use (a test module may override this fixture)."""
    return {"AWS_ACCESS_KEY_ID": "test-access-key-id", "AWS_SECRET_ACCESS_KEY": "test-secret-access-key"}


@pytest.fixture
def s3_server(monkeypatch, s3_credentials):
    """A running S3Server, its settings in the environment the CLI's processes inherit; stopped at the end."""
    pytest.importorskip("moto.server")
    from support import S3Server

    server = S3Server(s3_credentials)
    for key, value in server.env.items():
        monkeypatch.setenv(key, value)
    server.start()
    try:
        yield server
    finally:
        server.stop()
        import s3fs

        s3fs.S3FileSystem.clear_instance_cache()  # in-process stores must not outlive this endpoint


@pytest.fixture
def s3(s3_server):
    """A boto3 client of the S3 server."""
    import boto3

    return boto3.client("s3", endpoint_url=s3_server.endpoint)

