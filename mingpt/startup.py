"""A command's start-up without the cyclic garbage collector walking what its imports make.

Importing torch, hydra and the project leaves about 290,000 objects that the collector tracks and that live as long
as the process. Made with the collector on, they are walked again by each of its passes over the older generations
while the imports run, and by every full collection after (the lazy import of torch._dynamo that the first optimizer
triggers included): 0.25-0.7 CPU-s of each command's process on a 2-vCPU EPYC (benchmarks/bench_launch.md). So:
collection disabled before the imports, what they made frozen, collection enabled again. gc.freeze, in its own
words, "Freeze[s] all current tracked objects and ignore[s] them for future collections" (reference counting still
frees them), and "can be used before a POSIX fork() call to make the gc copy-on-write friendly", as for a
DataLoader's workers (not measured here). The import-time garbage frozen with them (about 8,000 objects of reference
cycles) is not worth the full collection that would free it first (0.14 CPU-s).

Only a command's own process does this (its script passes `__name__`, "__main__" there): a module that imports
main.py or sample.py (the tests, benchmarks, prepare.py) leaves its process's collector alone.
"""

from __future__ import annotations

import gc

MAIN = "__main__"


def pause_collection(caller: str) -> None:
    """At the top of a command's script, before its heavy imports: no cyclic collection until resume_collection."""
    if caller == MAIN:
        gc.disable()


def resume_collection(caller: str) -> None:
    """After the script's imports: what they made frozen (never walked again), then collection as usual."""
    if caller == MAIN:
        gc.freeze()
        gc.enable()
