"""A stand-in for a torchrun agent, driven line by line from its standard input (tests/test_forkserver.py): it starts
workers as torchrun does (Popen, a session of their own, the agent's environment plus the worker's variables) and
reports their pids and exit codes, so that one agent, and so one fork server, serves several checks.

    {"start": [argv...], "env": {...}, "log": "path"}   ->  {"pid": N}    ("cpus": [...]: its CPU affinity)
    {"wait": N}                                         ->  {"code": returncode}   (negative: the signal)
End of input: the agent exits."""

import json
import os
import subprocess
import sys

workers: dict[int, subprocess.Popen] = {}
for line in sys.stdin:
    order = json.loads(line)
    if "start" in order:
        cpus = order.get("cpus")
        with open(order["log"], "w") as log:  # with "cpus", bound as torchrun --numa-binding binds a worker
            worker = subprocess.Popen(order["start"], env=order["env"], stdout=log, stderr=subprocess.STDOUT,
                                      start_new_session=True,
                                      preexec_fn=(lambda: os.sched_setaffinity(0, cpus)) if cpus else None)
        workers[worker.pid] = worker
        reply = {"pid": worker.pid}
    else:
        reply = {"code": workers[order["wait"]].wait()}
    print(json.dumps(reply), flush=True)
