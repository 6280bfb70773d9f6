"""A command's start-up without the cyclic garbage collector walking what its imports make.

Importing torch, hydra and the project leaves about 290,000 objects that the collector tracks and that live as long
as the process. Made with the collector on, they are walked again by each of its passes over the older generations
while the imports run, and by every full collection after (the lazy import of torch._dynamo that the first optimizer
triggers included): 0.2-0.3 CPU-s of every worker's start on a 2-core EPYC. The gc module documents the pattern for a
process whose start-up builds long-lived state (gc.freeze): disable collection early, freeze what was made, enable
it again. Frozen objects sit in a permanent generation that no collection visits; reference counting still frees
them. The import-time garbage frozen with them (about 8,000 objects of reference cycles) is not worth the full
collection that would free it first (0.14 CPU-s).

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
