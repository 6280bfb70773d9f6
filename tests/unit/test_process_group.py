"""The end of a process group, in this process: a group of one on gloo, no peers."""
from __future__ import annotations

import gc
import os

import torch.distributed as dist

from mingpt.distributed.process_group import leave_distributed


def os_threads() -> set[str]:
    return set(os.listdir("/proc/self/task"))


def test_leaving_joins_the_threads_of_a_group_that_only_a_garbage_cycle_holds() -> None:
    """A pipeline stage keeps its group: after destroy_process_group that group lives on, with its gloo threads,
    until a collection; were that the interpreter's final one, a gloo thread taking the GIL aborts the process."""
    before = os_threads()
    gc.disable()  # no collection by chance: only leave_distributed's may free the cycle
    try:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        holder: dict = {"group": dist.new_group([0])}
        holder["self"] = holder
        del holder
        groups_threads = os_threads() - before  # gloo's, of the two groups
        assert groups_threads
        leave_distributed()
        assert groups_threads & os_threads() == set()
    finally:
        gc.enable()
        if dist.is_initialized():
            dist.destroy_process_group()
