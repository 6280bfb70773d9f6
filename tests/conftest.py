"""The tests' fixtures (everything else they share is in support.py)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    return tmp_path / "run"


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
