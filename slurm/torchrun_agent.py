"""torchrun for the batch script: the same agent (torch.distributed.run, the same arguments), minus the traceback
that torchrun prints when it is stopped by a signal. SLURM stops a job with SIGTERM at its time limit, on scancel and
on preemption: the agent passes the signal on to its workers and waits for them (they save a snapshot), as torchrun
does; then this prints one line instead of torchrun's 30 and exits with 128 + the signal's number."""

import sys

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.run import main

if __name__ == "__main__":
    try:
        main()
    except SignalException as stop:
        print(f"torchrun: stopped by {stop.sigval.name}, after its workers had exited", file=sys.stderr)
        sys.exit(128 + stop.sigval)
