"""Run under torchrun by tests/test_shm_allreduce.py: SharedMemoryAllReduce between real processes.

    torchrun --standalone --nproc_per_node=N tests/shm_worker.py MODE SHM_DIR OUT_JSON

MODE: "ok" (all ranks share SHM_DIR), "other_host" (the last rank looks in another folder, as a rank on another
host would), "no_room" (the last rank may not write files larger than 1 kB, so its file cannot be reserved).
Rank 0 writes what happened to OUT_JSON.
"""

import json
import os
import resource
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from shm_allreduce import SharedMemoryAllReduce  # noqa: E402

mode, shm_dir, out = sys.argv[1], sys.argv[2], sys.argv[3]
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
last = rank == world - 1
if mode == "other_host" and last:
    shm_dir = shm_dir + "-elsewhere"
    os.makedirs(shm_dir, exist_ok=True)
if mode == "no_room" and last:
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # an oversized write fails with EFBIG instead of killing us
    resource.setrlimit(resource.RLIMIT_FSIZE, (1024, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))

n = 1001  # odd: no chunking or alignment assumption
reducer = SharedMemoryAllReduce.create(n, shm_dir=shm_dir)
dist.barrier()  # every rank is out of create()
result = {"reducer": reducer is not None, "files_left": sorted(os.listdir(shm_dir))}
if reducer is not None:
    means_exact, same_bits = True, True
    for step in range(5):  # more than two reductions: both halves of every file are reused
        generator = torch.Generator().manual_seed(100 * step + rank)
        mine = torch.randn(n, generator=generator) * (rank + 1)
        everyone = [torch.randn(n, generator=torch.Generator().manual_seed(100 * step + r)) * (r + 1)
                    for r in range(world)]
        expected = sum(everyone[1:], everyone[0].clone()) / world
        got = reducer.average(mine.clone())
        means_exact &= torch.equal(got, expected)  # rank order, then divide: exactly this arithmetic
        gathered = [torch.empty(n) for _ in range(world)]
        dist.all_gather(gathered, got)
        same_bits &= all(torch.equal(g, gathered[0]) for g in gathered)
    result.update(means_exact=means_exact, same_bits=same_bits, reductions=reducer.reductions)
    try:
        reducer.average(torch.zeros(n + 1))
    except RuntimeError as e:
        result["wrong_size_error"] = str(e)
if rank == 0:
    Path(out).write_text(json.dumps(result))
dist.destroy_process_group()
