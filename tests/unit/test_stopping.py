"""The SIGTERM deadline's wakeup pipe, in this process: signals sent to itself, no peers."""
from __future__ import annotations

import os
import signal
import sys
import time

from mingpt.distributed.stopping import StopDeadline


def test_a_sigterm_after_the_ranks_agreed_finds_the_wakeup_pipe_still_read(monkeypatch) -> None:
    # SLURM's SIGTERM, then torchrun's forwarded one: the second must not meet a pipe whose reader is closed
    # (CPython's C handler would print "Exception ignored ... BrokenPipeError" into the job's log).
    unraisable = []
    monkeypatch.setattr(sys, "unraisablehook", unraisable.append)
    previous = signal.signal(signal.SIGTERM, lambda *_: None)
    deadline = StopDeadline(30.0, rank=0, before_exit=lambda: None)
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        deadline.agreed.set()
        time.sleep(0.3)  # long enough for the watcher to see the signal and the agreement
        os.kill(os.getpid(), signal.SIGTERM)
        for _ in range(100):  # the C handler's error is reported between bytecodes of this thread
            time.sleep(0.001)
    finally:
        deadline.close()
        signal.signal(signal.SIGTERM, previous)
    assert [hook.exc_type for hook in unraisable] == []
    assert deadline._thread is not None
    deadline._thread.join(5)
    assert not deadline._thread.is_alive(), "the watcher outlived close()"


def test_close_without_a_signal_ends_the_watcher_and_restores_the_wakeup_fd() -> None:
    before = signal.set_wakeup_fd(-1)
    signal.set_wakeup_fd(before)
    deadline = StopDeadline(30.0, rank=0, before_exit=lambda: None)
    deadline.close()
    assert deadline._thread is not None
    deadline._thread.join(5)
    assert not deadline._thread.is_alive()
    assert signal.set_wakeup_fd(before) == before


def test_the_stop_vote_is_read_vote_depth_steps_later_from_buffers_made_once() -> None:
    """Each step's flag is all-reduced in the background and its result read VOTE_DEPTH steps later (the host never
    waits for the step it has just cast), in the same buffers every time."""
    import torch
    import torch.distributed as dist

    from mingpt.distributed.stopping import VOTE_DEPTH, StopVote

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        vote = StopVote(torch.device("cpu"), dist.group.WORLD)
        buffers = [ballot.on_device.data_ptr() for ballot in vote.ballots]
        flags = [False, False, True, False, False, False, False, False]
        results = [vote.cast(flag) for flag in flags]
        vote.finish()
        assert results == [False] * (2 + VOTE_DEPTH) + [True] + [False] * (len(flags) - 3 - VOTE_DEPTH)
        assert [ballot.on_device.data_ptr() for ballot in vote.ballots] == buffers and len(buffers) == VOTE_DEPTH
    finally:
        dist.destroy_process_group()
