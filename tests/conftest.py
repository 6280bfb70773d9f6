"""The tests' fixtures (everything else they share is in support.py)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest


@pytest.fixture(scope="session", autouse=True)
def data_cache(tmp_path_factory) -> Path:
    """The encoded-corpus cache of every test and of the processes it starts: never the user's own."""
    folder = tmp_path_factory.mktemp("xdg-cache")
    before = os.environ.get("XDG_CACHE_HOME")
    os.environ["XDG_CACHE_HOME"] = str(folder)
    yield folder / "mingpt-ddp" / "data"
    if before is None:
        os.environ.pop("XDG_CACHE_HOME", None)
    else:
        os.environ["XDG_CACHE_HOME"] = before


@pytest.fixture
def no_process_group_left():
    """FSDP in one process makes a process group of one: gone after the test, as after a run."""
    yield
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    return tmp_path / "run"
