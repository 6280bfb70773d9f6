"""A torchrun worker never outlives its agent.

An agent that is SIGKILLed (the OOM killer, a node supervisor dying) would leave its workers training on and
writing snapshots while the user reruns the command into the same folder. With this, the kernel sends each worker
SIGTERM when its agent dies, and SIGTERM stops training after the current step with a snapshot (trainer.py).
Imported before torch by main.py: importing torch takes seconds, and the agent may die meanwhile.

A worker run by the agent's fork server (forkserver.py) is the server's child, not the agent's: `agent_pid()` and
`agent_alive()` answer for the agent either way.
"""

from __future__ import annotations

import ctypes
import os
import select
import signal
import sys
from typing import Optional

PR_SET_PDEATHSIG = 1  # linux/prctl.h
_agent: Optional[tuple[int, int]] = None  # (pid, pidfd) of the agent, in a child of the fork server
_parent = os.getppid()  # for a worker torchrun started itself: the agent


def exit_with_parent() -> None:
    """Under torchrun (TORCHELASTIC_RUN_ID set): SIGTERM to this process when its parent, the agent, dies.

    torchrun starts workers from its main thread (torch/distributed/elastic/multiprocessing/subprocess_handler:
    Popen), and PR_SET_PDEATHSIG fires when the thread that forked exits, so the signal comes only when the agent
    process itself is gone. A worker whose agent died before this call has already been handed to init (or a
    subreaper) and signals itself."""
    if "TORCHELASTIC_RUN_ID" not in os.environ or not sys.platform.startswith("linux"):
        return
    parent = os.getppid()
    try:
        if ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0) != 0:
            return
    except (OSError, AttributeError):
        return
    if parent == 1 or os.getppid() != parent:
        os.kill(os.getpid(), signal.SIGTERM)


def served_by(agent: int) -> None:
    """In a child of the fork server: `agent` is this worker's agent (its parent is the server)."""
    global _agent
    _agent = (agent, os.pidfd_open(agent))


def agent_pid() -> int:
    """The pid of this worker's torchrun agent (its parent, or its fork server's agent)."""
    return _agent[0] if _agent else os.getppid()


def agent_alive() -> bool:
    """Whether the agent that started this worker is still running."""
    if _agent is None:
        return os.getppid() == _parent
    readable = select.poll()
    readable.register(_agent[1], select.POLLIN)
    return not readable.poll(0)  # a pidfd becomes readable when its process exits
