"""Stopping a distributed job together: agreeing on the step after which every rank stops, and a deadline for a
rank that cannot agree.

    stop = StopRequest(rank, device, group, timeout_s, before_exit)   # once per job
    with stop.watch():                                 # SIGTERM now requests a stop, with a deadline
        while training:
            step()
            if stop.agreed(): ...                      # True on every rank after the same step

SIGTERM sets a flag in the main thread; the ranks must stop after the same step, or the ones left would wait
forever in the next all-reduce. Agreeing takes one max-reduction of one flag per step, read one step later, so no
step waits for a round trip (a stop lands one step later instead): StopVote all-reduces it in the background.
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


class StopVote:
    """The stop flags of all ranks, max-reduced in the background: `cast(flag)` returns the result of the
    previous call's flags, which every rank receives after the same step.

    On CPU the flag goes through the default (gloo) group. On CUDA it goes through NCCL like the gradients (no second
    transport): a side stream waits for the all-reduce and copies the flag to pinned host memory, so neither the
    training stream nor the host waits; one step later the copy's event has long completed."""

    def __init__(self, device: torch.device, group: Optional[dist.ProcessGroup] = None) -> None:
        self.device = device
        self.group = group
        self.cuda = device.type == "cuda"
        self.side_stream = torch.cuda.Stream(device) if self.cuda else None
        self.pending: Optional[tuple[Optional[dist.Work], torch.Tensor, Optional[torch.cuda.Event]]] = None

    def cast(self, flag: bool) -> bool:
        agreed = self._result()
        self.pending = self._start(flag)
        return agreed

    def finish(self) -> None:
        """Wait for the vote in flight (before the job's next collectives or its teardown)."""
        self._result()

    def _start(self, flag: bool) -> tuple:
        if not self.cuda:
            value = torch.tensor([int(flag)], dtype=torch.int32)
            return dist.all_reduce(value, op=dist.ReduceOp.MAX, group=self.group, async_op=True), value, None
        on_device = torch.full((1,), int(flag), dtype=torch.int32, device=self.device)  # a kernel, no host copy
        work = dist.all_reduce(on_device, op=dist.ReduceOp.MAX, group=self.group, async_op=True)
        host = torch.empty(1, dtype=torch.int32).pin_memory()
        done = torch.cuda.Event()
        with torch.cuda.stream(self.side_stream):
            work.wait()  # the side stream (not the training stream) waits for NCCL
            host.copy_(on_device, non_blocking=True)
            on_device.record_stream(self.side_stream)
            done.record(self.side_stream)
        return None, host, done

    def _result(self) -> bool:
        if self.pending is None:
            return False
        work, value, done = self.pending
        self.pending = None
        if work is not None:
            work.wait()
        if done is not None:
            done.synchronize()
        return bool(value.item())


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
