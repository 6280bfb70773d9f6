"""Stopping a distributed job together: agreeing on the step after which every rank stops, and a deadline for a
rank that cannot agree.

    stop = StopRequest(rank, device, group, timeout_s, before_exit)   # once per job
    with stop.watch():                                 # SIGTERM now requests a stop, with a deadline
        while training:
            step()
            if stop.agreed(): ...                      # True on every rank after the same step

SIGTERM sets a flag in the main thread; the ranks must stop after the same step, or the ones left would wait
forever in the next all-reduce. Agreeing takes one max-reduction of one flag per step, read VOTE_DEPTH steps later,
so no step waits for a round trip and the host may run that many steps ahead of the GPU (a stop lands that many
steps later instead): StopVote all-reduces it in the background, into buffers allocated once.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
from typing import Callable, Iterator, Optional

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

# Votes in flight: the result of a step's vote is read this many steps later. Enough for the host to run a few
# steps ahead of the device, few enough that a stop after SIGTERM (torchrun, SLURM: 30 s or more) lands in time.
VOTE_DEPTH = 3


class _Ballot:
    """One vote's buffers, reused: the flag on the device, its all-reduce, and (on CUDA) its pinned host copy and
    the event that says the copy is done."""

    def __init__(self, device: torch.device) -> None:
        self.on_device = torch.zeros(1, dtype=torch.int32, device=device)
        cuda = device.type == "cuda"
        self.host = torch.zeros(1, dtype=torch.int32, pin_memory=True) if cuda else self.on_device
        self.copied = torch.cuda.Event() if cuda else None
        self.work: Optional[dist.Work] = None
        self.cast = False  # a vote was started in it and not read yet


class StopVote:
    """The stop flags of all ranks, max-reduced in the background: `cast(flag)` returns the result of the flags
    cast VOTE_DEPTH calls before, which every rank receives after the same step (False for the first calls).

    On CPU the flag goes through the default (gloo) group. On CUDA it goes through NCCL like the gradients (no second
    transport): a side stream waits for the all-reduce and copies the flag to pinned host memory, so neither the
    training stream nor the host waits; VOTE_DEPTH steps later the copy's event has long completed. Every buffer is
    allocated once (no pinned allocation per step, which would synchronise the device)."""

    def __init__(self, device: torch.device, group: Optional[dist.ProcessGroup] = None,
                 depth: int = VOTE_DEPTH) -> None:
        self.device = device
        self.group = group
        self.cuda = device.type == "cuda"
        self.side_stream = torch.cuda.Stream(device) if self.cuda else None
        self.ballots = [_Ballot(device) for _ in range(depth)]
        self.calls = 0

    def cast(self, flag: bool) -> bool:
        ballot = self.ballots[self.calls % len(self.ballots)]
        self.calls += 1
        agreed = self._result(ballot)
        self._start(ballot, flag)
        return agreed

    def finish(self) -> None:
        """Wait for the votes in flight (before the job's next collectives or its teardown)."""
        for ballot in self.ballots:
            self._result(ballot)

    def _start(self, ballot: _Ballot, flag: bool) -> None:
        ballot.on_device.fill_(int(flag))  # a kernel on the device, no host copy
        ballot.cast = True
        if not self.cuda:
            ballot.work = dist.all_reduce(ballot.on_device, op=dist.ReduceOp.MAX, group=self.group, async_op=True)
            return
        self.side_stream.wait_stream(torch.cuda.current_stream(self.device))  # after the fill
        with torch.cuda.stream(self.side_stream):
            # NCCL runs on its own stream; wait() makes the side stream (not the training stream) wait for it
            dist.all_reduce(ballot.on_device, op=dist.ReduceOp.MAX, group=self.group, async_op=True).wait()
            ballot.host.copy_(ballot.on_device, non_blocking=True)
            ballot.copied.record(self.side_stream)
        # the next fill of this buffer, VOTE_DEPTH steps on, is ordered after the copy by the event read before it

    def _result(self, ballot: _Ballot) -> bool:
        if not ballot.cast:
            return False
        ballot.cast = False
        if ballot.work is not None:
            ballot.work.wait()
            ballot.work = None
        if ballot.copied is not None:
            ballot.copied.synchronize()
        return bool(ballot.host.item())


class StopRequest:
    """SIGTERM (sent by torchrun, SLURM and cloud schedulers before a kill, and by the kernel when the torchrun agent
    dies) ends training after the current step, on every rank after the same one, instead of killing the process
    mid-step. A rank that cannot agree with its peers within `timeout_s` leaves without them (StopDeadline),
    after `before_exit` (which finishes a snapshot being written). `group` None: a process on its own."""

    def __init__(self, rank: int, device: torch.device, group: Optional[dist.ProcessGroup], timeout_s: float,
                 before_exit: Callable[[], None]) -> None:
        self.rank, self.timeout_s, self.before_exit = rank, timeout_s, before_exit
        self.signal: Optional[int] = None
        self._vote = StopVote(device, group) if group is not None else None
        self._deadline: Optional[StopDeadline] = None

    @contextlib.contextmanager
    def watch(self) -> Iterator[StopRequest]:
        """While inside, SIGTERM requests a stop (only the main thread can take signals: elsewhere nothing does)."""

        def request_stop(signum: int, _frame) -> None:
            self.signal = signum

        in_main_thread = threading.current_thread() is threading.main_thread()
        previous = signal.signal(signal.SIGTERM, request_stop) if in_main_thread else None
        self._deadline = StopDeadline(self.timeout_s if in_main_thread else None, self.rank, self.before_exit)
        try:
            yield self
            if self._vote is not None:
                self._vote.finish()  # no collective of the loop left behind (not after an error: a peer may be gone)
        finally:
            self._deadline.close()
            # A stop under way keeps its handler: SIGTERM can come again (a dying torchrun agent's PR_SET_PDEATHSIG
            # fires once per thread of the agent as the worker is handed from one to the next), and must not end
            # the process while it writes its snapshot.
            if in_main_thread and self.signal is None:
                signal.signal(signal.SIGTERM, previous)

    def agreed(self) -> bool:
        """After each step: whether every rank stops now. All must stop after the same step, or the ones left
        would wait forever in the next all-reduce."""
        requested = self.signal is not None
        stop = self._vote.cast(requested) if self._vote is not None else requested
        if stop and self._deadline is not None:
            self._deadline.agreed.set()
        return stop


class StopDeadline:
    """After SIGTERM, the rank has `timeout_s` to agree with its peers to stop (`agreed.set()`); if it cannot, it
    leaves by itself.

    A rank blocked in a collective with a peer that is gone cannot even run its Python SIGTERM handler (that runs
    only between bytecodes of the main thread), so torchrun would wait its full 30 s before SIGKILL at every
    restart. CPython's C-level handler still writes the signal's number to the wakeup fd at once; a thread reading
    it starts the clock. On timeout: finish a snapshot being written (`before_exit`), one line, exit 143."""

    def __init__(self, timeout_s: Optional[float], rank: int, before_exit: Callable[[], None]) -> None:
        self.agreed = threading.Event()
        self.timeout_s, self.rank, self.before_exit = timeout_s, rank, before_exit
        self._closed = threading.Event()
        self._reader = self._writer = -1
        self._previous_fd = -1
        self._thread: Optional[threading.Thread] = None
        if timeout_s is None:
            return
        self._reader, self._writer = os.pipe()
        os.set_blocking(self._writer, False)
        self._previous_fd = signal.set_wakeup_fd(self._writer, warn_on_full_buffer=False)
        self._thread = threading.Thread(target=self._watch, name="mingpt-stop-deadline", daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        # The reader stays open until close() has restored the previous wakeup fd and closed the writer (end of
        # file): a later SIGTERM (SLURM's, then torchrun's forwarded one) written to a pipe without a reader
        # would print "Exception ignored ... BrokenPipeError" from CPython's C handler.
        clock_started = False
        try:
            while received := self._read():
                if signal.SIGTERM in received and not clock_started and not self._closed.is_set():
                    clock_started = True
                    self._leave_unless_agreed()
        finally:
            os.close(self._reader)

    def _read(self) -> bytes:
        try:
            return os.read(self._reader, 64)
        except OSError:
            return b""

    def _leave_unless_agreed(self) -> None:
        if self.agreed.wait(self.timeout_s) or self._closed.is_set():
            return
        log.error("[rank %d] SIGTERM: could not agree with the other ranks to stop within %.0f s (trainer_config."
                  "stop_timeout_s; a peer is gone or stuck): leaving without a new snapshot, the last one stays",
                  self.rank, self.timeout_s)
        self.before_exit()
        exit_now(128 + signal.SIGTERM)

    def close(self) -> None:
        self._closed.set()
        if self._writer < 0:
            return
        signal.set_wakeup_fd(self._previous_fd)
        os.close(self._writer)  # the reader sees end of file and returns
        self._writer = -1


def exit_now(code: int) -> None:
    """End the process at once, waiting for no thread and no peer; log handlers and streams are flushed first."""
    for handler in logging.getLogger().handlers:
        handler.flush()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
