"""DDP's gradient all-reduce through shared memory, for CPU processes that share one host.

gloo all-reduces over TCP even between processes on one machine: 4.4-5.1 ms for the 3.2 MB of gradients of the
nanoGPT CPU model on 2 processes here, about 4% of a one-thread step, plus a copy through the kernel both ways.
Through /dev/shm the same reduction is a divided copy in, one barrier and a sum: 2.0-2.3 ms in the same jobs
(medians of 200 calls, 3 runs; dividing on the way in made it 13-15% faster than copy, sum, divide).

    >>> reducer = SharedMemoryAllReduce.create(num_elements, group)   # collective; None: not all on one host
    >>> if reducer: ddp.register_comm_hook(reducer, shared_memory_allreduce_hook)

Each rank owns one file, `<dir>/mingpt-<token>-r<rank>`, of two gradient-sized halves, used alternately, and a
small control block. A reduction: the rank writes its gradients divided by the world size into the current half of
its file; a barrier; every rank sums all ranks' halves in rank order, so every rank computes bit-for-bit the same
average (DDP also divides before gloo sums, so with 2 ranks these are gloo's bits too). A rank writes a half again
only two reductions later, after a barrier that every rank passes once it has read that half, so one barrier per
reduction is enough. The files are unlinked as soon as every rank has mapped them: nothing is left in /dev/shm,
even when a process is killed.

The barrier is in the files too: each rank counts its arrivals in its control block and waits until every other
rank's count has caught up, spinning (yielding the core at every look) for the first SPIN_S, sleeping in short
naps after that. gloo's barrier took 0.3 ms when both ranks arrived together and 1.1-1.3 ms (p90 5 ms) after a
stretch of computing here: the wake-ups of its threads on busy cores. A waiting rank checks that its peers'
processes still exist (a peer that was killed would otherwise be waited for until the timeout; gloo notices the
closed connection); where a rank cannot see its peers' processes (another PID namespace), or the CPU might reorder
the stores (only x86's stores are seen in order), the ranks use gloo's barrier instead. Every reduction also carries
one flag per rank (`flag_out`, the max over ranks in `flag_in`): the stop flag of stopping.py, at no extra cost.
"""

import logging
import os
import platform
import secrets
import time
from typing import Optional

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"
FLOAT_BYTES = 4
CONTROL_FLOATS = 16  # the control block after the two halves: 8 int64 slots
ARRIVED, PID, START, FLAG = 0, 1, 2, 3  # its slots: arrivals, the process and its start time, flags (2, by half)
SPIN_S = 0.01  # a waiting rank spins this long, then naps
NAP_S = 0.0002
CHECK_PEERS_S = 0.1  # while napping, how often a waiting rank looks for its peers' processes
WAIT_TIMEOUT_S = 600.0  # as the process group's (distributed.PG_TIMEOUT)
STORES_IN_ORDER = platform.machine().lower() in ("x86_64", "amd64", "i386", "i686")  # total store order


class SharedMemoryAllReduce:
    """The state of a DDP comm hook that averages one bucket of fp32 gradients of `num_elements` elements."""

    def __init__(self, halves: list[list[torch.Tensor]], controls: list, rank: int,
                 group: Optional[dist.ProcessGroup], spin: bool) -> None:
        self.halves = halves  # halves[h][r]: half h of rank r's file
        self.controls = controls  # controls[r]: rank r's control block (int64 slots, a NumPy view of the file)
        self.rank = rank
        self.world_size = len(halves[0])
        self.group = group
        self.spin = spin  # wait for the peers in shared memory (else gloo's barrier)
        self.num_elements = halves[0][0].numel()
        self.reductions = 0
        self.flag_out = 0  # carried by this rank's next reduction
        self.flag_in = 0  # the largest flag any rank sent with the latest reduction

    @classmethod
    def create(
        cls, num_elements: int, group: Optional[dist.ProcessGroup] = None, shm_dir: str = SHM_DIR
    ) -> Optional["SharedMemoryAllReduce"]:
        """Collective. The reducer when every rank of `group` could create its file in `shm_dir` and map every
        other rank's; None otherwise (ranks on several hosts, no /dev/shm, too little room in it)."""
        rank, world_size = dist.get_rank(group), dist.get_world_size(group)
        token = [secrets.token_hex(8) if rank == 0 else None]
        dist.broadcast_object_list(token, src=0, group=group)
        paths = [os.path.join(shm_dir, f"mingpt-{token[0]}-r{r}") for r in range(world_size)]
        size = 2 * num_elements + CONTROL_FLOATS
        created = _create_file(paths[rank], size * FLOAT_BYTES)
        try:
            everyone_created = _all_ranks(created, group)
            files = [_map_existing(path, size) if everyone_created else None for path in paths]
            controls = [None if f is None else f[2 * num_elements :].view(torch.int64).numpy() for f in files]
            if controls[rank] is not None:  # who this rank is, for its peers' checks (read after the next collective)
                controls[rank][PID], controls[rank][START] = os.getpid(), _start_time(os.getpid()) or -1
            # (this all-reduce is also the barrier that lets each rank unlink its file: every rank has mapped it)
            everyone_mapped = _all_ranks(all(f is not None for f in files), group)
        finally:
            if created:  # the mappings live on; the name goes, so nothing is left behind, even after a kill
                os.unlink(paths[rank])
        if not everyone_mapped:
            return None
        sees_peers = all(_start_time(int(c[PID])) == c[START] for c in controls)
        spin = _all_ranks(STORES_IN_ORDER and sees_peers, group)
        halves = [[f[h * num_elements : (h + 1) * num_elements] for f in files] for h in range(2)]
        return cls(halves, controls, rank, group, spin)

    def average(self, gradients: torch.Tensor) -> torch.Tensor:
        """Replace `gradients` (this rank's) by the mean over all ranks, in place; every rank gets the same bits."""
        if gradients.numel() != self.num_elements or gradients.dtype != torch.float32:
            raise RuntimeError(
                f"shared-memory all-reduce expects one fp32 bucket of {self.num_elements} elements, got "
                f"{gradients.numel()} {gradients.dtype} (set trainer_config.shared_memory_allreduce=false)"
            )
        h = self.reductions % 2
        half = self.halves[h]
        self.reductions += 1
        # Divide on the way in, as DDP does before gloo's sum: one pass fewer than dividing the sum afterwards.
        torch.div(gradients, self.world_size, out=half[self.rank])
        self.controls[self.rank][FLAG + h] = self.flag_out
        self._barrier()  # every rank's share (and flag) is in its half
        self.flag_in = int(max(c[FLAG + h] for c in self.controls))
        if self.world_size == 1:
            return gradients.copy_(half[0])
        torch.add(half[0], half[1], out=gradients)
        for other in half[2:]:
            gradients.add_(other)
        return gradients

    def _barrier(self) -> None:
        """Every rank has arrived at this reduction (the stores before it are visible: x86 keeps them in order)."""
        arrivals = self.reductions
        self.controls[self.rank][ARRIVED] = arrivals
        if not self.spin:
            dist.barrier(group=self.group)
            return
        started = time.monotonic()
        next_check = started + SPIN_S
        for peer, control in enumerate(self.controls):
            while control[ARRIVED] < arrivals:
                now = time.monotonic()
                if now - started < SPIN_S:
                    os.sched_yield()  # another process waiting for this core gets it (more ranks than cores)
                    continue
                time.sleep(NAP_S)
                if now >= next_check:
                    next_check = now + CHECK_PEERS_S
                    self._check_peer(peer, control, now - started)

    def _check_peer(self, peer: int, control, waited_s: float) -> None:
        if _start_time(int(control[PID])) != control[START]:
            raise RuntimeError(f"shared-memory all-reduce: rank {peer} (process {int(control[PID])}) is gone")
        if waited_s > WAIT_TIMEOUT_S:
            raise RuntimeError(f"shared-memory all-reduce: waited {waited_s:.0f} s for rank {peer} "
                               f"(process {int(control[PID])}) to reach reduction {self.reductions}")


def shared_memory_allreduce_hook(
    state: SharedMemoryAllReduce, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """DDP comm hook: average the bucket through shared memory; done by the time it returns."""
    done: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    done.set_result(state.average(bucket.buffer()))
    return done


def _start_time(pid: int) -> Optional[int]:
    """When process `pid` started (clock ticks since boot, /proc/<pid>/stat), or None: no such process here (gone,
    or in another PID namespace), or a zombie. With the pid, it names one process: pids are reused."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
        fields = stat[stat.rindex(b")") + 2 :].split()  # after the command name, which may hold anything
        return None if fields[0] in (b"Z", b"X", b"x") else int(fields[19])  # fields 3 (state) and 22 (starttime)
    except (OSError, ValueError, IndexError):
        return None
def _create_file(path: str, size_bytes: int) -> bool:
    """Create `path` with its blocks reserved (a tmpfs that runs full later would kill the process with SIGBUS)."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError as e:
        log.debug("no shared-memory file %s: %s", path, e)
        return False
    try:
        os.posix_fallocate(fd, 0, size_bytes)
    except OSError as e:
        log.debug("no room for %d bytes in %s: %s", size_bytes, path, e)
        os.unlink(path)
        return False
    finally:
        os.close(fd)
    return True


def _map_existing(path: str, num_elements: int) -> Optional[torch.Tensor]:
    """Map a file another rank created, or None when it is not there (another host) or not the expected size."""
    try:
        if os.path.getsize(path) != num_elements * FLOAT_BYTES:
            return None
        return torch.from_file(path, shared=True, size=num_elements, dtype=torch.float32)
    except (OSError, RuntimeError) as e:
        log.debug("cannot map %s: %s", path, e)
        return None


def _all_ranks(ok: bool, group: Optional[dist.ProcessGroup]) -> bool:
    flag = torch.tensor([1 if ok else 0], dtype=torch.int32)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    return bool(flag.item())
