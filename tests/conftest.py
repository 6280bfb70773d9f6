"""The tests' fixtures (everything else they share is in support.py)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# `make test` runs the suite in TEST_WORKERS processes (pytest-xdist, --dist loadfile; 2 by default, for CI's two
# cores: docs/testing.md gives the figures).

# Under several workers the longest files start first (serial durations of 2026-12-06, 2 cores): one that started
# last would keep a worker busy long after the other had run out of tests.
LONGEST_FIRST = ("tests/e2e/test_docs.py", "tests/e2e/test_slurm.py", "tests/e2e/test_layouts.py",
                 "tests/e2e/test_bad_input.py", "tests/e2e/test_storage_faults.py", "tests/e2e/test_resume.py",
                 "tests/e2e/test_tokenizer.py", "tests/e2e/test_lifecycle.py", "tests/e2e/test_gpu_check.py")


def pytest_configure(config: pytest.Config) -> None:
    """Under several workers, each worker and the processes its tests start get their share of the cores (an
    OpenMP pool as wide as the machine in each of two workers busy-waits on the other's cores)."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1 and "OMP_NUM_THREADS" not in os.environ:
        threads = max(1, (os.cpu_count() or 1) // workers)
        os.environ["OMP_NUM_THREADS"] = str(threads)
        import torch

        torch.set_num_threads(threads)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under several workers, LONGEST_FIRST's files come first: xdist hands the files out in this order (each file's
    tests to one worker, --dist loadfile, so that a module-scoped launch serves all of them once)."""
    if int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) > 1:
        rank = {name: index for index, name in enumerate(LONGEST_FIRST)}
        items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))  # stable: the rest keep order


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
