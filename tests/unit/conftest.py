"""The unit tests' one rule, enforced: a unit test runs in this process. Starting a process (a command, torchrun, a
DataLoader worker, a server's) fails the test with a line saying where it belongs: tests/e2e/."""

from __future__ import annotations

import multiprocessing.process
import subprocess

import pytest


def _refuse(*args, **kwargs):
    raise AssertionError("a unit test starts no process: a test that does belongs in tests/e2e/ (docs/testing.md)")


@pytest.fixture(autouse=True)
def in_this_process_only(monkeypatch) -> None:
    # Popen._execute_child is where subprocess.run/check_output/Popen fork; BaseProcess.start is every
    # multiprocessing (and torch.multiprocessing, DataLoader worker) process's start.
    monkeypatch.setattr(subprocess.Popen, "_execute_child", _refuse)
    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", _refuse)


@pytest.fixture(autouse=True)
def leaves_no_process_group():
    """A process group a test made is gone after it (a later test, in any order, makes its own): a test whose code
    under test makes one uses the `no_process_group_left` fixture (tests/conftest.py)."""
    yield
    import torch.distributed as dist

    # distributed_c10d's own is_initialized: a test may have patched torch.distributed's (undone after this runs)
    if dist.is_available() and dist.distributed_c10d.is_initialized():
        dist.distributed_c10d.destroy_process_group()
        pytest.fail("the test left a process group: use the no_process_group_left fixture", pytrace=False)
