"""The process group of a torchrun job: joining it, leaving it, and making sure no rank outlives the job.

    ctx = setup_distributed()          # join the group torchrun describes (or run as one process)
    ... train ...
    leave_distributed()                # the normal end: every rank together
    if report_failure(message): print  # this rank raised: the job's first failure is printed, once
    abandon_distributed()              # ... and it leaves without a collective teardown

A rank that raises must not wait for its peers: under NCCL `destroy_process_group()` can block until every peer
reaches it, while the peers wait in their next collective until the NCCL timeout. The failing rank records its
error in the job's store (so the job reports it once, not once per rank) and leaves without a collective; every
other rank watches that key and leaves within about a second (it polls once a second), on gloo as on NCCL.
"""

from __future__ import annotations

import datetime
import gc
import hashlib
import logging
import os
import socket
import sys
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from mingpt.compat import abort_process_group
from mingpt.distributed.orphans import agent_alive, agent_pid
from mingpt.distributed.stopping import exit_now
from mingpt.errors import UsageError

log = logging.getLogger(__name__)

TORCHRUN_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
FAILURE_POLL_S = 1.0  # how often each rank looks for a peer's failure in the job's store (one request)
JOB_STORE_TIMEOUT = datetime.timedelta(seconds=30)  # the longest one such request can take
PG_TIMEOUT = datetime.timedelta(minutes=10)
# The ranks of one attempt are started together by their agents; what can part them is the import of torch and the
# reading of the data, minutes on a slow shared file system or with a big corpus. Past this, a rank that waits
# for the others stops with one line (elastic membership under torch 2.13's shared store: _fresh_store_namespace).
MEET_TIMEOUT_VARIABLE = "MINGPT_MEET_TIMEOUT_S"
MEET_TIMEOUT_DEFAULT_S = 300.0
SHARED_STORE_FIX = ("set TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in the environment of every torchrun agent "
                    "(README: Several nodes)")


def global_rank() -> int:
    rank = os.environ.get("RANK", "0")
    return int(rank) if rank.isdigit() else 0  # a RANK that is not a number is reported by check_launch_environment


def world_size() -> int:
    """The number of processes torchrun started (WORLD_SIZE); 1 without torchrun."""
    size = os.environ.get("WORLD_SIZE", "1")
    return int(size) if size.isdigit() else 1


def local_rank() -> int:
    """This process's place on its node (torchrun's LOCAL_RANK); 0 without torchrun. Per-node work (the data
    cache) is done by local rank 0."""
    rank = os.environ.get("LOCAL_RANK", "0")
    return int(rank) if rank.isdigit() else 0


def check_launch_environment() -> None:
    """RANK without the rest of what torchrun sets (a variable leaked from another job, a hand-made launch) would
    fail deep inside torch.distributed; say what is missing instead."""
    if "RANK" not in os.environ:
        return
    missing = [name for name in TORCHRUN_VARIABLES if not os.environ.get(name)]
    if missing:
        raise UsageError(f"RANK is set but {', '.join(missing)} is not: launch with torchrun, or unset RANK to run "
                         f"a single process")
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):
        if not os.environ[name].isdigit():
            raise UsageError(f"environment variable {name}={os.environ[name]!r} is not a number")


# ------------------------------------------------------------------------------------------------------- joining
def _fresh_store_namespace(rank: int, world_size: int, timeout: datetime.timedelta) -> Optional[str]:
    """A namespace of torchrun's store that no earlier attempt (restart) of this job has used; None if not needed.

    torchrun's c10d rendezvous (the default of --standalone and of the multi-node form) hands the workers the
    agent's own TCPStore (MASTER_ADDR:MASTER_PORT, TORCHELASTIC_USE_AGENT_STORE=True) and keeps that same store
    server for every restart: DynamicRendezvousHandler.next_rendezvous (torch/distributed/elastic/rendezvous/
    dynamic_rendezvous.py) creates it only while `_bootstrap_store_info` is None, i.e. in the first round. The
    default process group's keys (`default_pg/0//cpu//0/<rank>`: each gloo rank's listening address; NCCL's
    unique id) therefore survive a restart, and a restarted rank may read a peer's address of the previous attempt
    before the peer has overwritten it: "Gloo connectFullMesh failed ... Connection refused" (or a hang in
    connect), which burns one of --max-restarts. (TORCHELASTIC_RESTART_COUNT cannot name the attempt: each node's
    agent counts its own restarts.) TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in torchrun's environment avoids it by
    having global rank 0 host a new store on a new port each attempt; this does the same inside the shared store,
    so restarts of a job whose nodes stay the same need no variable.

    The ranks agree on a fresh random token that no stale key can imitate: rank 0 publishes its token; every
    other rank answers under the token it read with a token of its own, and accepts the token once rank 0 has
    confirmed that answer under a key named after its own token, which no earlier attempt can have written. A
    rank that read an earlier attempt's token is never confirmed; it polls until the token changes and answers
    again. The process group then lives under `<namespace>/pg/` in the same store, the job's own keys beside it.

    A node that joins a running job breaks the shared store in torch 2.13 (the same handler keeps each agent's
    `_bootstrap_store_info` of its first round; see _refuse_a_stale_agent_store): the agents then fail, or hand
    the nodes' workers different stores, which could never meet. So the meeting has a deadline (`timeout`,
    MINGPT_MEET_TIMEOUT_S) and ends in one line that names the fix instead of the process group's 10 minutes per
    attempt; it polls with `check`, which returns at once, so no timed-out torch call prints its C++ warnings.
    """
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or world_size == 1:
        return None  # a store created for this attempt (see _this_attempts_store), or nothing to share
    _refuse_a_stale_agent_store()
    deadline = time.monotonic() + timeout.total_seconds()
    mine = uuid.uuid4().hex
    try:
        store = _store_client_by(deadline, timeout)
        if rank == 0:
            token = _publish_token(store, mine, world_size, deadline, timeout)
        else:
            token = _accept_token(store, mine, rank, deadline, timeout)
    except dist.DistError as error:  # the store's host went away (its agent ended)
        raise _not_met(f"rank {rank}: {str(error).splitlines()[0]}", timeout, shared=True) from None
    return f"mingpt/{token}"


def _publish_token(store: dist.Store, mine: str, world_size: int, deadline: float, timeout: datetime.timedelta) -> str:
    """Rank 0: publish this attempt's token, wait for every other rank's answer under it, confirm each answer."""
    store.set("mingpt/attempt", mine)
    answers = [f"mingpt/{mine}/answer/{r}" for r in range(1, world_size)]
    if not _poll(lambda: store.check(answers), deadline):  # every other rank has answered this token
        missing = [r for r, key in enumerate(answers, 1) if not store.check([key])]
        raise _not_met(f"rank 0 heard nothing from {_ranks(missing)} of {world_size}", timeout, shared=True)
    store.multi_set([f"mingpt/{mine}/ok/{t.decode()}" for t in store.multi_get(answers)], ["1"] * len(answers))
    return mine


def _accept_token(store: dist.Store, mine: str, rank: int, deadline: float, timeout: datetime.timedelta) -> str:
    """Any other rank: answer the newest token until rank 0 confirms the answer; returns the confirmed token."""
    token = ""

    def confirmed() -> bool:
        nonlocal token
        if not store.check(["mingpt/attempt"]):
            return False  # rank 0 has not arrived (in this store)
        current = store.get("mingpt/attempt").decode()
        if current != token:  # (again) answer under the newest token: an earlier attempt's is never confirmed
            token = current
            store.set(f"mingpt/{token}/answer/{rank}", mine)
        return store.check([f"mingpt/{token}/ok/{mine}"])

    if not _poll(confirmed, deadline):
        raise _not_met(f"rank {rank} was not confirmed by rank 0", timeout, shared=True)
    return token


def _this_attempts_store(rank: int, world_size: int, timeout: datetime.timedelta) -> dist.TCPStore:
    """Without the agent's store (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, or a launcher other than torchrun) global
    rank 0 hosts this attempt's store at MASTER_ADDR:MASTER_PORT, as init_process_group's env:// would, and every
    rank checks in under `mingpt/here/<rank>`: a rank that never comes is reported within `timeout`, in one line,
    not after the process group's timeout."""
    deadline = time.monotonic() + timeout.total_seconds()
    here = [f"mingpt/here/{r}" for r in range(world_size)]
    try:
        if rank == 0:
            store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size, is_master=True,
                                  timeout=timeout, multi_tenant=True, wait_for_workers=False)
        else:
            store = _store_client_by(deadline, timeout, shared=False)
        store.set(here[rank], "1")
        if not _poll(lambda: store.check(here), deadline):
            missing = [r for r, key in enumerate(here) if not store.check([key])]
            raise _not_met(f"rank {rank} waited for {_ranks(missing)} of {world_size}", timeout, shared=False)
    except dist.DistError as error:  # rank 0 (the store's host) went away
        raise _not_met(f"rank {rank}: {str(error).splitlines()[0]}", timeout, shared=False) from None
    store.set_timeout(PG_TIMEOUT)
    return store


def _meet_timeout() -> datetime.timedelta:
    """How long a rank waits for the others to meet: MINGPT_MEET_TIMEOUT_S seconds, 300 if unset."""
    raw = os.environ.get(MEET_TIMEOUT_VARIABLE, "").strip()
    try:
        seconds = float(raw) if raw else MEET_TIMEOUT_DEFAULT_S
    except ValueError:
        seconds = -1.0
    if not 0 < seconds < float("inf"):
        raise UsageError(f"{MEET_TIMEOUT_VARIABLE}={raw!r} is not a positive number of seconds")
    return datetime.timedelta(seconds=seconds)


def _not_met(what: str, timeout: datetime.timedelta, shared: bool) -> UsageError:
    where = f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
    if shared:  # the agent's store: most likely the torch bug after a node joined or left
        cause = (f"torchrun (torch {torch.__version__}) can give the workers of different nodes different stores "
                 f"after a node joined or left (this node's: {where}); {SHARED_STORE_FIX}")
    else:
        cause = f"a rank did not start, or cannot reach rank 0's store at {where}: see that rank's log"
    return UsageError(f"the ranks did not meet within {timeout.total_seconds():g} s ({what}): {cause}; workers "
                      f"that start slower than that need a larger {MEET_TIMEOUT_VARIABLE} (seconds)")


def _ranks(ranks: list[int]) -> str:
    shown = ", ".join(str(r) for r in ranks[:8]) + (f" and {len(ranks) - 8} more" if len(ranks) > 8 else "")
    return f"rank{'s' if len(ranks) > 1 else ''} {shown}"


def _poll(done: Callable[[], bool], deadline: float) -> bool:
    """Call `done` until it returns True (then True) or the deadline passes (then False); 50 ms growing to 0.5 s."""
    pause = 0.05
    while not done():
        if time.monotonic() > deadline:
            return False
        time.sleep(pause)
        pause = min(0.5, pause * 1.5)
    return True


def _store_client_by(deadline: float, timeout: datetime.timedelta, shared: bool = True) -> dist.TCPStore:
    """A client of the store at MASTER_ADDR:MASTER_PORT once it accepts connections, waiting until `deadline`. A
    plain socket knocks first: TCPStore's own retries print C++ warnings and a stack when they time out."""
    addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])

    def accepts() -> bool:
        try:
            socket.create_connection((addr, port), timeout=2).close()
            return True
        except OSError:
            return False

    if not _poll(accepts, deadline):
        raise _not_met(f"nothing accepts connections at {addr}:{port}", timeout, shared=shared)
    return _store_client(timeout)


def _refuse_elastic_with_shared_store() -> None:
    """`torchrun --nnodes=MIN:MAX` (MIN < MAX: nodes may join and leave) with the agent's shared store stops here.

    In torch 2.13 a node that joins a running job under the shared store makes the job fail (see
    _refuse_a_stale_agent_store): found here at the start, not hours later when a node comes back. The agent's
    --nnodes is read from its command line (the worker's parent; Linux) or PET_NNODES; unknown = allowed."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return
    nnodes = _agent_option("--nnodes") or os.environ.get("PET_NNODES", "")
    low, _, high = nnodes.partition(":")
    if high and low.strip() != high.strip():
        raise UsageError(f"torchrun --nnodes={nnodes} lets nodes join and leave, which torch {torch.__version__} "
                         f"breaks while the agents share their rendezvous store with the workers (a node that "
                         f"joins makes every agent fail or hang): {SHARED_STORE_FIX}")


def _agent_option(name: str) -> Optional[str]:
    """The value of option `name` on the command line of this worker's parent (its torchrun agent), if any."""
    try:
        with open(f"/proc/{agent_pid()}/cmdline", "rb") as f:
            args = [a.decode(errors="replace") for a in f.read().split(b"\0")]
    except OSError:
        return None
    if sys.argv and sys.argv[0] in args[1:]:
        args = args[: args.index(sys.argv[0], 1)]  # torchrun's own options come before the training script
    value = None
    for i, arg in enumerate(args):
        option, equals, given = arg.partition("=")
        if len(option) < 4 or not name.startswith(option):  # argparse also takes an unambiguous prefix (--nnode)
            continue
        if equals:
            value = given
        elif i + 1 < len(args):
            value = args[i + 1]
    return value


def _refuse_a_stale_agent_store() -> None:
    """Stop at once when torchrun handed this node's workers a store that their own agent hosts although this node
    is not node 0 (GROUP_RANK > 0): the store of the job is node 0's, so the ranks could never meet.

    torch 2.13, DynamicRendezvousHandler.next_rendezvous: with the shared store an agent rebuilds its
    `_bootstrap_store_info` (MASTER_ADDR:MASTER_PORT of its workers) only in its first round or when it becomes
    rank 0 without a store server of its own. An agent that was node 0 (and started a server) and is now another
    rank keeps pointing its workers at its own server, while the new node 0 starts another one. (The other case:
    a node that joins a round in which node 0 did not rebuild waits for `MASTER_ADDR` in that round's keys, which
    no one writes, until the rendezvous' read timeout: its agent fails, and no worker starts.) Read from /proc
    (Linux): the listening sockets of MASTER_PORT against the sockets the parent process holds."""
    group_rank = os.environ.get("GROUP_RANK", "0")
    if not group_rank.isdigit() or group_rank == "0" or not _parent_listens_on(int(os.environ["MASTER_PORT"])):
        return
    raise UsageError(f"torchrun gave the workers of node {group_rank} the store of their own agent "
                     f"({os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}), which node 0's workers do not use: "
                     f"a torch {torch.__version__} bug once a node has joined or left; {SHARED_STORE_FIX}")


def _parent_listens_on(port: int) -> bool:
    listening = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                rows = [line.split() for line in f.readlines()[1:]]
        except OSError:
            continue
        for row in rows:  # local address (hex ip:port), state 0A = LISTEN, inode
            if len(row) > 9 and row[3] == "0A" and int(row[1].rsplit(":", 1)[1], 16) == port:
                listening.add(f"socket:[{row[9]}]")
    fds = f"/proc/{agent_pid()}/fd"
    try:
        names = os.listdir(fds) if listening else []
    except OSError:
        return False
    for name in names:
        try:
            if os.readlink(f"{fds}/{name}") in listening:
                return True
        except OSError:
            continue
    return False


def cuda_device(local_rank: int) -> torch.device:
    """This process's GPU: the one its local rank names. More processes on a node than GPUs is one line (every extra
    rank says the same, so the job prints it once), not CUDA's "invalid device ordinal" from each of them."""
    count = torch.cuda.device_count()
    if local_rank >= count:
        started = os.environ.get("LOCAL_WORLD_SIZE", f"more than {count}")
        raise UsageError(f"this node has {count} CUDA device(s) but torchrun started {started} processes on it: use "
                         f"--nproc_per_node={count} or fewer (CUDA_VISIBLE_DEVICES limits the devices a job sees)")
    return torch.device("cuda", local_rank)


@dataclass
class DistContext:
    """Who this process is in the job, and the process group its collectives go through. Without a group (a plain
    `python main.py`, or one rank of a job timing itself alone in bench.py) it is a process on its own."""

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    device: torch.device = torch.device("cpu")
    group: Optional[dist.ProcessGroup] = None

    @classmethod
    def single_process(cls, device: torch.device) -> DistContext:
        """A process on its own: no process group, no collectives."""
        return cls(device=device)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.group is not None

    def all_reduce(self, tensor: torch.Tensor, op: Any = dist.ReduceOp.SUM) -> torch.Tensor:
        """Collective. The tensor reduced over all ranks, in place (itself when on its own)."""
        if self.distributed:
            dist.all_reduce(tensor, op=op, group=self.group)
        return tensor

    def gather_objects(self, value: Any) -> list:
        """Collective. Every rank's value, in rank order ([value] when on its own)."""
        if not self.distributed:
            return [value]
        values = [None] * self.world_size
        dist.all_gather_object(values, value, group=self.group)
        return values


def setup_distributed() -> DistContext:
    """Join the process group torchrun describes in the environment; without RANK, run as a single process."""
    cuda = torch.cuda.is_available()
    if "RANK" not in os.environ:
        return DistContext.single_process(torch.device("cuda:0" if cuda else "cpu"))
    rank, local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    meet = _meet_timeout()  # how long the ranks may take to meet, then one line instead of a hang
    _refuse_elastic_with_shared_store()  # --nnodes=MIN:MAX needs TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (torch 2.13)
    namespace = _fresh_store_namespace(rank, world_size, meet)  # restarts under torchrun: see there
    if namespace is not None:  # the agent's store, shared by every attempt
        group = {"store": dist.PrefixStore(f"{namespace}/pg", _store_client(PG_TIMEOUT)), "rank": rank,
                 "world_size": world_size}
    elif os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":  # a store of this attempt's own
        group = {"store": _this_attempts_store(rank, world_size, meet), "rank": rank, "world_size": world_size}
    else:
        group = {}  # one rank alone in the agent's store: env:// as torch does it
    if cuda:
        device = cuda_device(local_rank)
        torch.cuda.set_device(device)  # before init_process_group, so NCCL binds this process to its own GPU
        dist.init_process_group("nccl", device_id=device, timeout=PG_TIMEOUT, **group)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo", timeout=PG_TIMEOUT, **group)
    ctx = DistContext(rank=rank, local_rank=local_rank, world_size=world_size, device=device, group=dist.group.WORLD)
    if world_size > 1:
        # A connection of its own (the main thread's may be busy). With the agent's store, the attempt's namespace
        # keeps an earlier attempt's failure from ending this one; otherwise the store is this attempt's (env://).
        job_store = dist.PrefixStore(namespace or "mingpt", _store_client(JOB_STORE_TIMEOUT))
        _FailureWatch.start(job_store, rank)
    return ctx


def _store_client(timeout: datetime.timedelta) -> dist.TCPStore:
    """A client of the store torchrun names in MASTER_ADDR:MASTER_PORT."""
    return dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=timeout)


# ------------------------------------------------------------------------------------------------------- leaving
class _FailureWatch:
    """One thread per rank that polls the job's store for a peer's failure and then ends this process.

    A request to a store whose host has gone makes torch print a C++ stack, so the thread polls (a request lasts a
    millisecond, a blocking `store.wait` would be pending when the host exits), stops polling once its parent (the
    torchrun agent, which may host the store) is gone, and is stopped right after the last barrier."""

    KEY = "failed"
    instance: Optional["_FailureWatch"] = None
    before_exit: list[Callable[[], None]] = []  # e.g. wait for a snapshot being written

    def __init__(self, store: dist.Store, rank: int) -> None:
        self.store, self.rank = store, rank
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._watch, name="mingpt-failure-watch", daemon=True)

    @classmethod
    def start(cls, store: dist.Store, rank: int) -> None:
        cls.instance = cls(store, rank)
        cls.instance.thread.start()

    def _watch(self) -> None:
        while not self.stopped.wait(FAILURE_POLL_S) and agent_alive():
            try:
                failed = self.store.check([self.KEY])
            except Exception:  # the store's host is gone: the job is ending or the agent restarts it; not our call
                return
            if failed and not self.stopped.is_set():
                _leave_now(1)

    def stop(self) -> None:
        """Stop polling, and wait until the thread has ended: a daemon thread still inside a store request when the
        interpreter exits is ended mid-call (pthread_exit through C++ frames), which aborts the process (SIGABRT)."""
        self.stopped.set()
        self.thread.join(timeout=JOB_STORE_TIMEOUT.total_seconds() + 2 * FAILURE_POLL_S)

    def record(self, message: str) -> bool:
        """Publish this rank's error as the job's failure; False if a peer's failure was recorded first."""
        self.stop()
        value = f"{self.rank}\n{message}"
        return self.store.compare_set(self.KEY, "", value).decode() == value


def on_abrupt_exit(action: Callable[[], None]) -> None:
    """Run `action` before this process ends on an error path (its own or a peer's failure)."""
    _FailureWatch.before_exit.append(action)


def _finish_pending_work() -> None:
    for action in _FailureWatch.before_exit:
        try:
            action()
        except Exception:
            pass


def _leave_now(code: int) -> None:
    """End this process at once (a peer failed): finish what must not be left half done, then exit."""
    _finish_pending_work()
    exit_now(code)


def leave_distributed() -> None:
    """The normal end: leave together (still watching: rank 0 may fail in its end-of-run report while the others
    wait here), stop watching, tear the group down."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        # A rank that tears down its gloo connections while a peer still finishes its last collective can make
        # that peer's gloo threads abort, and rank 0 may host the store the peers poll.
        dist.barrier()
    if _FailureWatch.instance is not None:
        _FailureWatch.instance.stop()
        _FailureWatch.instance = None
    _FailureWatch.before_exit.clear()  # a sweep's next job has its own trainer
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
        # destroy_process_group only unregisters the groups: one that a garbage cycle still holds (a pipeline stage
        # keeps its group) lives on with its gloo threads until a collection. Were that the interpreter's final one,
        # a gloo thread taking the GIL then aborts the process ("terminate called without an active exception",
        # exit -6, once in CI); collected here, the groups' threads are joined while Python is fully alive.
        gc.collect()


def report_failure(message: str) -> bool:
    """Called by a rank that raised, before anything else. True if this rank's error is the one to print.

    In a process group: the job's first failure only (peers that fail because of it, or with the same error, stay
    quiet). Before one exists (a bad config or data file, seen alike by every rank): each different message once,
    agreed in torchrun's agent store where the workers have one. Alone, or with no store to ask: always."""
    try:
        if _FailureWatch.instance is not None:
            return _FailureWatch.instance.record(message)
        if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" and int(os.environ.get("WORLD_SIZE", "1")) > 1:
            rank = str(global_rank())
            key = f"mingpt/early-error/{hashlib.sha256(message.encode()).hexdigest()[:32]}"
            store = _store_client_by(time.monotonic() + 5, datetime.timedelta(seconds=5))  # knocks first: no C++ stack
            return store.compare_set(key, "", rank).decode() == rank
    except Exception:  # no store to agree in (gone, or never there): say it here
        pass
    return True


def abandon_distributed() -> None:
    """After this rank raised: no collective teardown (peers may never reach it). NCCL communicators are aborted
    (compat.abort_process_group), which does not wait for peers; gloo's sockets close with the process."""
    _finish_pending_work()
    if not (dist.is_available() and dist.is_initialized()):
        return
    if _FailureWatch.instance is not None and _hosts_the_store():
        time.sleep(1.5 * FAILURE_POLL_S)  # the peers read this rank's failure from its store before it goes
    try:
        abort_process_group()
    except Exception:  # leaving anyway
        pass


def _hosts_the_store() -> bool:
    """Without torchrun's agent store (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, or a launch by env://) global rank 0's
    process hosts the job's store."""
    return os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" and global_rank() == 0


def configure_device(device: torch.device) -> None:
    """Process-wide settings for the training device."""
    if device.type == "cuda":
        # TF32 tensor cores for fp32 matmuls: ~8x the throughput, ample precision for training.
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
