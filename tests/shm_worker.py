"""Run under torchrun by tests/test_shm_allreduce.py: SharedMemoryAllReduce between real processes.

    torchrun --standalone --nproc_per_node=N tests/shm_worker.py SHM_DIR OUT_JSON

Three cases in one process group, one after another: "ok" (every rank uses SHM_DIR), "other_host" (the last
rank looks in a sibling folder, as a rank on another host would) and "no_room" (the last rank may not write files
larger than 1 kB, so its file cannot be reserved). Rank 0 writes what happened in each to OUT_JSON.
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

from mingpt.parallel.shm_allreduce import SharedMemoryAllReduce  # noqa: E402

N = 1001  # odd: no chunking or alignment assumption


def exercise(reducer: SharedMemoryAllReduce, rank: int, world: int) -> dict:
    means_exact, same_bits = True, True
    for step in range(5):  # more than two reductions: both halves of every file are reused
        everyone = [torch.randn(N, generator=torch.Generator().manual_seed(100 * step + r)) * (r + 1)
                    for r in range(world)]
        shares = [e / world for e in everyone]
        expected = sum(shares[1:], shares[0].clone())
        got = reducer.average(everyone[rank].clone())
        means_exact &= torch.equal(got, expected)  # divide, then sum in rank order: exactly this arithmetic
        gathered = [torch.empty(N) for _ in range(world)]
        dist.all_gather(gathered, got)
        same_bits &= all(torch.equal(g, gathered[0]) for g in gathered)
    result = {"means_exact": means_exact, "same_bits": same_bits, "reductions": reducer.reductions}
    try:
        reducer.average(torch.zeros(N + 1))
    except RuntimeError as e:
        result["wrong_size_error"] = str(e)
    return result


def attempt(case: str, shm_dir: str, rank: int, world: int) -> dict:
    last = rank == world - 1
    my_dir, limits = shm_dir, None
    if case == "other_host" and last:
        my_dir = shm_dir + "-elsewhere"
        os.makedirs(my_dir, exist_ok=True)
    if case == "no_room" and last:
        limits = resource.getrlimit(resource.RLIMIT_FSIZE)
        resource.setrlimit(resource.RLIMIT_FSIZE, (1024, limits[1]))
    try:
        reducer = SharedMemoryAllReduce.create(N, shm_dir=my_dir)
    finally:
        if limits is not None:
            resource.setrlimit(resource.RLIMIT_FSIZE, limits)
    dist.barrier()  # every rank is out of create()
    result = {"reducer": reducer is not None, "files_left": sorted(os.listdir(shm_dir))}
    if os.path.isdir(shm_dir + "-elsewhere"):
        result["files_left_elsewhere"] = sorted(os.listdir(shm_dir + "-elsewhere"))
    if reducer is not None:
        result.update(exercise(reducer, rank, world))
    return result


def main() -> None:
    shm_dir, out = sys.argv[1], sys.argv[2]
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # an oversized write fails with EFBIG instead of killing us
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    results = {case: attempt(case, shm_dir, rank, world) for case in ("ok", "other_host", "no_room")}
    if rank == 0:
        Path(out).write_text(json.dumps(results))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
