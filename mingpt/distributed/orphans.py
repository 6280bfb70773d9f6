"""A torchrun worker never outlives its agent.

An agent that is SIGKILLed (the OOM killer, a node supervisor dying) would leave its workers training on and
writing snapshots while the user reruns the command into the same folder. With this, the kernel sends each worker
SIGTERM when its agent dies, and SIGTERM stops training after the current step with a snapshot (trainer.py).
Imported before torch by main.py: importing torch takes seconds, and the agent may die meanwhile.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1  # linux/prctl.h
_parent = os.getppid()  # a worker's parent is the torchrun agent that started it


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


def agent_pid() -> int:
    """The pid of this worker's torchrun agent: its parent."""
    return _parent


def agent_alive() -> bool:
    """Whether the agent that started this worker is still running (a worker outliving it is handed to another
    parent)."""
    return os.getppid() == _parent
