"""An opt-in for small CPU machines (MINGPT_FORKSERVER=1): one fork server per torchrun agent, so that a worker, and
every restarted worker, starts without importing anything. Off by default: each worker is then the process
torchrun started, as torchrun, SLURM's accounting, py-spy and nvidia-smi expect.

torchrun starts each worker, and each worker again after a failure, as a new interpreter; importing torch, Hydra,
the project and torch._dynamo (which DDP imports) costs 3-4 s of CPU per process, every time. Here the first worker
under an agent starts a *server* that imports all of that once and listens on a Unix socket. Every worker, the first
one too, is then a thin *client*, the process torchrun sees: it hands its command line, environment, working
directory, umask and standard streams to the server, which forks a *child* that runs main.py as `__main__`. The
client passes signals on to the child and ends as the child ends, with its exit code or by its signal.

    MINGPT_FORKSERVER=1 torchrun --standalone --nproc_per_node=2 --max-restarts=3 main.py preset=cpu   # on
    torchrun ...                                                  # off (the default): each worker imports itself

A child is what a fresh process would be: main.py runs as `__main__` with the client's argv, sys.path, environment,
directory, umask, CPU affinity and streams (buffering as the client's), in a session of its own. The server only
imports (no tensor is made, no thread pool started, CUDA not initialised), so a fork carries no state a fresh import
lacks.
The server refuses (the client then starts as an ordinary process, and local rank 0 says why in one line):
- an environment that differs from the server's in anything but torchrun's per-worker variables (rank, world
  size, master address, restart count, error file): a variable read at import time would be stale in a fork;
- a project source file changed since the server imported it (the server then leaves; the next worker starts a
  new one), another interpreter, another sys.path.
Lifetimes: the server leaves once its agent has exited (a pidfd) and its last child has ended. A child is
SIGKILLed when its client dies (a SIGKILLed worker takes its child with it, as torchrun expects; the server sees
to it when the child is stopped); a client ends when its child does. The socket is abstract (no file to clean
up) and takes connections from this user only.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import select
import signal
import socket
import struct
import sys
import threading
import time
from typing import Any, Iterable, Optional

from mingpt.distributed import orphans

PROJECT_DIR = os.path.dirname(os.path.dirname(os.path.dirname(os.path.realpath(__file__))))  # main.py's folder
PACKAGE_DIR = os.path.join(PROJECT_DIR, "mingpt")
SWITCH = "MINGPT_FORKSERVER"  # "1": workers are forks of the agent's server; anything else: torchrun's own workers
# What torchrun sets per worker and per attempt; read at run time only, so a fork may differ from the server in it.
PER_WORKER = frozenset({"RANK", "LOCAL_RANK", "GROUP_RANK", "ROLE_RANK", "ROLE_NAME", "LOCAL_WORLD_SIZE",
                        "WORLD_SIZE", "GROUP_WORLD_SIZE", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                        "TORCH_NCCL_ASYNC_ERROR_HANDLING"})
PER_WORKER_PREFIX = "TORCHELASTIC_"
RELAYED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)
WARM_UP = ("main", "torch._dynamo", "torch.nn.parallel.distributed")  # main imports torch, Hydra, the project
CONNECT_S = 10.0  # a server binds its name first thing: this long for a started one to appear
REPLY_S = 600.0  # for the server's warm-up: imports on a loaded node, a slow shared file system
HEADER = struct.Struct("!I")
STOP_POLL_S = 0.1  # how soon a child follows its client into a SIGSTOP

_served = False  # True in a child: main.py's start_worker() returns at once
_serving = False  # True in the server while it imports main.py


# ------------------------------------------------------------------------------------------------------- client
def start_worker() -> None:
    """Called by main.py before its imports. Under torchrun: die with the agent, and run in a fork of the agent's
    fork server (this call then never returns: the process ends as its child does). Returns to run here as an
    ordinary process where no server applies or one refused."""
    if _served or _serving:
        return
    orphans.exit_with_parent()
    if not _applies():
        return
    connection = _connect(_server_name(os.getppid()), os.getppid())
    if connection is None:
        return
    replies = Replies(connection)
    reply = _request(connection, replies)
    if "pid" not in reply:
        if os.environ.get("LOCAL_RANK", "0") == "0":
            print(f"forkserver: {reply.get('refused', 'no reply')}; this worker starts on its own "
                  f"(unset {SWITCH} to start every worker so)", file=sys.stderr, flush=True)
        connection.close()
        return
    _relay_until_child_ends(connection, replies, reply["pid"])


def _applies() -> bool:
    return (os.environ.get(SWITCH, "0") == "1" and "TORCHELASTIC_RUN_ID" in os.environ
            and sys.platform.startswith("linux") and hasattr(os, "pidfd_open") and os.getppid() != 1)


def _server_name(agent: int) -> bytes:
    """An abstract socket name per (user, agent, run, project, interpreter, mount and pid namespace): two
    containers sharing a network namespace must not meet."""
    identity = [str(os.getuid()), str(agent), os.environ.get("TORCHELASTIC_RUN_ID", ""), PROJECT_DIR, sys.executable]
    for namespace in ("mnt", "pid"):
        try:
            identity.append(os.readlink(f"/proc/self/ns/{namespace}"))
        except OSError:
            identity.append("?")
    return b"\0mingpt-forkserver-" + hashlib.sha256("\n".join(identity).encode()).hexdigest()[:24].encode()


def _connect(name: bytes, agent: int) -> Optional[socket.socket]:
    """A connection to the agent's server, started here if there is none; None if none could be had."""
    started = False
    deadline = time.monotonic() + CONNECT_S
    while True:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(name)
            return sock
        except (ConnectionRefusedError, FileNotFoundError):  # no server (yet)
            sock.close()
        except OSError:  # anything else: no server for this worker
            sock.close()
            return None
        if not started:
            try:
                _start_server(name, agent)
            except OSError:
                return None
            started = True
        if time.monotonic() > deadline:
            return None
        time.sleep(0.005)


def _start_server(name: bytes, agent: int) -> None:
    """The server, in a session of its own (no terminal signals, not in the worker's process group), with this
    worker's interpreter, flags, sys.path and environment; its output is dropped (its errors reach the clients)."""
    import subprocess  # only the first worker of an agent pays for it

    code = (f"import sys; sys.path[:] = {sys.path!r}; from mingpt.distributed import forkserver; "
            f"forkserver.serve({name!r}, {agent})")
    subprocess.Popen([sys.executable, *subprocess._args_from_interpreter_flags(), "-c", code],
                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                     start_new_session=True, close_fds=True)


def _stream_settings(stream: Any) -> Optional[dict]:
    if stream is None or not hasattr(stream, "buffer"):
        return None
    return {"encoding": stream.encoding, "errors": stream.errors, "line_buffering": stream.line_buffering,
            "write_through": stream.write_through, "unbuffered": not isinstance(stream.buffer, io.BufferedIOBase)}


def _request(connection: socket.socket, replies: Replies) -> dict:
    """Hand this worker to the server; its first reply ({"pid": child} or {"refused": why})."""
    main_file = os.path.realpath(sys.modules["__main__"].__file__)
    request = {"argv": sys.argv, "main": main_file, "path": sys.path, "cwd": os.getcwd(), "env": dict(os.environ),
               "umask": _umask(), "executable": sys.executable, "agent": os.getppid(),
               "cpus": sorted(os.sched_getaffinity(0)),
               "streams": [_stream_settings(s) for s in (sys.stdin, sys.stdout, sys.stderr)]}
    body = json.dumps(request).encode()
    try:
        connection.settimeout(REPLY_S)
        socket.send_fds(connection, [HEADER.pack(len(body)) + body], [0, 1, 2])
        return replies.next() or {"refused": "the fork server ended without a reply"}
    except (OSError, ValueError) as error:
        return {"refused": f"the fork server did not answer ({error})"}


def _continue(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGCONT)
    except OSError:
        pass


def process_state(pid: int) -> str:
    """R, S, T (stopped), Z, ... from /proc; "" for a process that is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return ""


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


class Replies:
    """The server's messages to a client, one JSON object a line: {"pid": ...} or {"refused": ...}, {"status": ...}."""

    def __init__(self, connection: socket.socket) -> None:
        self.connection = connection
        self.pending = b""

    def next(self) -> Optional[dict]:
        """The next message; None at the end of the connection."""
        while b"\n" not in self.pending:
            data = self.connection.recv(4096)
            if not data:
                return None
            self.pending += data
        line, _, self.pending = self.pending.partition(b"\n")
        return json.loads(line)


def _relay_until_child_ends(connection: socket.socket, replies: Replies, child: int) -> None:
    """Pass this process's signals on to the child; end as it ended. Never returns.

    SIGSTOP cannot be caught: the child stops itself when it sees this process stopped (_follow_client), and a
    SIGCONT here continues it, again a moment later should the child have stopped itself just after it."""
    continued_at = -STOP_POLL_S

    def relay(signum: int, _frame: Any) -> None:
        try:
            connection.sendall(bytes([signum]))
        except OSError:
            pass

    def go_on(_signum: int, _frame: Any) -> None:
        nonlocal continued_at
        continued_at = time.monotonic()
        _continue(child)

    for signum in RELAYED:
        signal.signal(signum, relay)
    signal.signal(signal.SIGCONT, go_on)
    connection.settimeout(STOP_POLL_S)
    while True:
        try:
            message = replies.next()
            break
        except TimeoutError:
            if time.monotonic() - continued_at < 4 * STOP_POLL_S and process_state(child) == "T":
                _continue(child)
    if message is None or "status" not in message:  # the server died before it could report the child's end
        print("forkserver: lost the fork server before this worker's child ended", file=sys.stderr, flush=True)
        os._exit(1)
    code = os.waitstatus_to_exitcode(message["status"])
    if code < 0:  # ended by a signal: so does this process, for torchrun to see the same
        if -code not in (signal.SIGKILL, signal.SIGSTOP):  # whose handling cannot be changed
            signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
        code = 128 - code
    os._exit(code)


# ------------------------------------------------------------------------------------------------------- server
class Server:
    """Accepts this user's workers of one agent, forks a child for each, reports each child's end to its client."""

    def __init__(self, listener: socket.socket, agent: int) -> None:
        self.listener = listener
        self.agent = agent
        self.agent_fd = os.pidfd_open(agent)
        self.poller = select.poll()
        self.poller.register(listener, select.POLLIN)
        self.poller.register(self.agent_fd, select.POLLIN)
        self.children: dict[int, tuple[int, socket.socket]] = {}  # pidfd -> (pid, connection to its client)
        self.clients: dict[int, int] = {}  # a client's pidfd -> its child's pidfd
        self.accepting = True
        self.broken: Optional[str] = None
        self.environment = dict(os.environ)
        self.sources: dict[str, tuple[int, int]] = {}
        self.path = list(sys.path)  # before the warm-up's imports, some of which add to it (torch 2.6 does)

    def warm_up(self) -> None:
        """Import what every worker imports. CUDA must stay uninitialised for the forks to use it: availability
        checks made while importing ask NVML instead of the CUDA driver."""
        global _serving
        _serving = True
        os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] = "1"
        try:
            import importlib

            for module in WARM_UP:
                importlib.import_module(module)
            import torch

            from mingpt import config

            config.warm_up()

            if torch.cuda.is_initialized() or cuda_driver_loaded():
                self.broken = "the CUDA driver was loaded while importing: a fork could not use the GPU"
        except BaseException as error:  # noqa: BLE001 (reported to every client instead)
            self.broken = f"the fork server could not import the project: {type(error).__name__}: {error}"
        finally:
            os.environ.clear()
            os.environ.update(self.environment)
            _serving = False
        self.sources = source_stamps(project_sources())

    def run(self) -> None:
        while self.accepting or self.children:
            for fd, _ in self.poller.poll():
                if fd == self.listener.fileno():
                    self._accept()
                elif fd == self.agent_fd:
                    self._stop_accepting()
                    self.poller.unregister(self.agent_fd)
                elif fd in self.children:
                    self._report_end(fd)
                elif fd in self.clients:
                    self._client_gone(fd)

    def _stop_accepting(self) -> None:
        if self.accepting:
            self.accepting = False
            self.poller.unregister(self.listener)
            self.listener.close()  # frees the name for a new server

    def _accept(self) -> None:
        connection, _ = self.listener.accept()
        try:
            client, uid, _ = struct.unpack("3i", connection.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
            if uid != os.getuid():  # an abstract socket has no permissions of its own
                connection.close()
                return
            connection.settimeout(CONNECT_S)
            request, fds = _receive_request(connection)
        except (OSError, ValueError):
            connection.close()
            return
        refusal = self.refusal(request, fds) or _take_affinity(request.get("cpus"))
        if refusal is not None:
            _send(connection, {"refused": refusal})
            for fd in fds:
                os.close(fd)
            connection.close()
            if refusal.startswith("the project's code changed"):
                self._stop_accepting()  # stale: the next worker starts a server with the new code
            return
        self._fork(connection, client, request, fds)

    def refusal(self, request: dict, fds: list[int]) -> Optional[str]:
        if self.broken:
            return self.broken
        if len(fds) != 3:
            return "the worker's standard streams did not arrive"
        if request.get("agent") != self.agent or request.get("executable") != sys.executable:
            return "the worker belongs to another agent or interpreter"
        if request.get("path") != self.path or os.path.dirname(request.get("main", "")) != PROJECT_DIR:
            return "the worker's sys.path or script differs from the server's"
        changed = [path for path, stamp in source_stamps(self.sources).items() if self.sources[path] != stamp]
        if changed:
            return f"the project's code changed since the fork server started ({os.path.basename(changed[0])})"
        env = request.get("env", {})
        differing = sorted(name for name in set(env) | set(self.environment)
                           if env.get(name) != self.environment.get(name) and not _per_worker(name))
        if differing:
            return f"the worker's environment differs from the fork server's in {', '.join(differing[:3])}"
        return None

    def _fork(self, connection: socket.socket, client: int, request: dict, fds: list[int]) -> None:
        pid = os.fork()
        if pid == 0:
            try:
                self._close_in_child()
                become_worker(request, fds, connection, client, self.agent)
            finally:
                os._exit(70)  # become_worker never returns; this is for an error on the way there
        for fd in fds:
            os.close(fd)
        pidfd = os.pidfd_open(pid)
        self.children[pidfd] = (pid, connection)
        self.poller.register(pidfd, select.POLLIN)
        try:
            client_fd = os.pidfd_open(client)
        except ProcessLookupError:  # gone already
            os.kill(pid, signal.SIGKILL)
        else:
            self.clients[client_fd] = pidfd
            self.poller.register(client_fd, select.POLLIN)
        _send(connection, {"pid": pid})

    def _close_in_child(self) -> None:
        """The server's descriptors: a sibling's client must see its connection end when its own child ends."""
        for pidfd, (_, connection) in self.children.items():
            os.close(pidfd)
            connection.close()
        for client_fd in self.clients:
            os.close(client_fd)
        self.listener.close()
        os.close(self.agent_fd)

    def _client_gone(self, client_fd: int) -> None:
        """A child whose client died (SIGKILL) ends too: by itself when it sees its connection end, here even
        when it is stopped (SIGSTOP) and cannot."""
        child_fd = self.clients.pop(client_fd)
        self.poller.unregister(client_fd)
        os.close(client_fd)
        if child_fd in self.children:
            os.kill(self.children[child_fd][0], signal.SIGKILL)

    def _report_end(self, pidfd: int) -> None:
        pid, connection = self.children.pop(pidfd)
        for client_fd in [c for c, child_fd in self.clients.items() if child_fd == pidfd]:
            del self.clients[client_fd]
            self.poller.unregister(client_fd)
            os.close(client_fd)
        self.poller.unregister(pidfd)
        os.close(pidfd)
        _, status = os.waitpid(pid, 0)
        _send(connection, {"status": status})
        connection.close()


def cuda_driver_loaded(maps: str = "/proc/self/maps") -> bool:
    """Whether the CUDA driver's library (libcuda.so) is mapped into this process. cuInit loads it, and a driver
    initialised before fork() is unusable in the child; torch.cuda.is_initialized() misses a cuInit made outside
    torch's lazy init (an NVML fallback in device_count()). Not loaded: nothing touched the driver."""
    try:
        with open(maps, encoding="utf-8", errors="replace") as f:
            return any(os.path.basename(line.split()[-1]).startswith("libcuda.so") for line in f if "/" in line)
    except OSError:
        return True  # cannot tell: refuse rather than hand out broken forks


def _take_affinity(cpus: Any) -> Optional[str]:
    """The accepting thread takes on the client's CPU affinity, for its fork to inherit: torchrun --numa-binding
    binds each local rank to its own CPUs (numactl --physcpubind), and the server has only its first client's."""
    try:
        os.sched_setaffinity(0, cpus)
    except (OSError, TypeError, ValueError) as error:
        return f"the worker's CPU affinity {cpus} cannot be taken on ({error})"
    return None


def _per_worker(name: str) -> bool:
    return name in PER_WORKER or name.startswith(PER_WORKER_PREFIX)


def project_sources() -> list[str]:
    """The files of this project's imported modules: those at its root and those of the mingpt package."""
    paths = (getattr(module, "__file__", None) for module in list(sys.modules.values()))
    return [path for path in paths if path and _in_project(os.path.realpath(path))]


def _in_project(path: str) -> bool:
    return os.path.dirname(path) == PROJECT_DIR or path.startswith(PACKAGE_DIR + os.sep)


def source_stamps(paths: Iterable[str]) -> dict[str, tuple[int, int]]:
    """(mtime, size) of each file; (0, -1) for one that is gone."""
    stamps = {}
    for path in paths:
        try:
            info = os.stat(path)
            stamps[path] = (info.st_mtime_ns, info.st_size)
        except OSError:
            stamps[path] = (0, -1)
    return stamps


def _receive_request(connection: socket.socket) -> tuple[dict, list[int]]:
    data, fds, _, _ = socket.recv_fds(connection, 1 << 16, 3)
    try:
        if len(data) < HEADER.size:
            raise ValueError("short request")
        (size,) = HEADER.unpack_from(data)
        body = bytearray(data[HEADER.size:])
        while len(body) < size:
            more = connection.recv(size - len(body))
            if not more:
                raise ValueError("truncated request")
            body += more
        return json.loads(body), fds
    except (OSError, ValueError):
        for fd in fds:
            os.close(fd)
        raise


def _send(connection: socket.socket, message: dict) -> None:
    try:
        connection.sendall(json.dumps(message).encode() + b"\n")
    except OSError:  # the client is gone; its child (if any) sees that itself
        pass


def serve(name: bytes, agent: int) -> None:
    """The server process: claim the name (a second server started in a race leaves), import, serve."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        listener.bind(name)
    except OSError:
        return
    listener.listen(64)
    try:
        server = Server(listener, agent)
    except OSError:  # the agent is already gone
        return
    server.warm_up()
    server.run()
    os._exit(0)  # no teardown of torch's thousands of modules (1-2 s of CPU)


# -------------------------------------------------------------------------------------------------------- child
def become_worker(request: dict, fds: list[int], connection: socket.socket, client: int, agent: int) -> None:
    """In the fork: take on the client's process state, then run its main.py as `__main__`. Never returns."""
    global _served
    _served = True
    os.setsid()
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        if fd > 2:
            os.close(fd)
    os.umask(request["umask"])
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    sys.argv[:] = request["argv"]
    sys.path[:] = request["path"]
    _rebuild_standard_streams(request["streams"])
    orphans.served_by(agent)
    connection.settimeout(None)  # the server's timeout: a slow read must not look like the client's death
    follow = threading.Thread(target=_follow_client, args=(connection, client), name="mingpt-client", daemon=True)
    follow.start()
    _run_main(request["main"])


def _rebuild_standard_streams(settings: list[Optional[dict]]) -> None:
    """sys.stdin/stdout/stderr over the new descriptors 0-2, buffered as the client's were (`python -u`: not)."""
    for fd, (name, mode), setting in zip(range(3), (("stdin", "r"), ("stdout", "w"), ("stderr", "w")), settings):
        if setting is None:
            continue
        raw = io.FileIO(fd, mode, closefd=False)
        binary = raw if setting["unbuffered"] else (io.BufferedReader(raw) if mode == "r" else io.BufferedWriter(raw))
        stream = io.TextIOWrapper(binary, encoding=setting["encoding"], errors=setting["errors"],
                                  line_buffering=setting["line_buffering"], write_through=setting["write_through"])
        setattr(sys, name, stream)
        setattr(sys, f"__{name}__", stream)


def _follow_client(connection: socket.socket, client: int) -> None:
    """Each byte from the client is a signal it received; the end of the connection is its death; a stopped
    client (SIGSTOP: a debugger, a test pausing a rank) stops this process too, until the client's SIGCONT."""
    readable = select.poll()
    readable.register(connection, select.POLLIN)
    while True:
        if not readable.poll(STOP_POLL_S * 1000):
            if process_state(client) == "T":
                os.kill(os.getpid(), signal.SIGSTOP)
            continue
        try:
            data = connection.recv(64)
        except OSError:
            data = b""
        if not data:
            os.kill(os.getpid(), signal.SIGKILL)
        for signum in data:
            os.kill(os.getpid(), signum)


def _run_main(path: str) -> None:
    import runpy
    import traceback

    code = 0
    try:
        runpy.run_path(path, run_name="__main__")
    except SystemExit as done:
        code = done.code if isinstance(done.code, int) else (0 if done.code is None else 1)
    except BaseException:  # noqa: BLE001 (as an uncaught exception ends a fresh process)
        traceback.print_exc()
        code = 1
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)
