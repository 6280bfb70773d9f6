"""Muon on DTensors (mingpt.optim.MeshMuon) against torch's Muon on whole tensors, given bit-identical gradients. Run
as the check "mesh_muon" of the 2-process launch of tests/workers/layout_worker.py (tests/e2e/test_layouts.py), or
alone:

    torchrun --standalone --nproc_per_node=2 tests/workers/muon_worker.py OUT_DIR

Two 2-D matrices (one taller than wide, one wider than tall: Muon transposes the first) are placed as FSDP2 places
them (rows sharded) and as tensor parallelism does (columns sharded), each given the same random gradients, in
turn, for 3 steps with weight decay and Nesterov momentum. The figures (`compare`; alone, written by global rank 0 to
OUT_DIR/result.json): the largest difference of the weights and of the momentum from torch's Muon on the whole
matrices, for MeshMuon and, as the negative control, for torch's Muon given the DTensors directly (it orthogonalises
the pieces).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the project's root

import json

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

from mingpt.optim import MeshMuon

SHAPES = ((48, 16), (16, 40))
STEPS = 3
SETTINGS = {"lr": 0.05, "weight_decay": 0.1, "momentum": 0.9, "nesterov": True, "ns_steps": 5}


def run(placement: Shard, optimizer_class: type, mesh) -> tuple[float, float]:
    """The largest difference (weights, momentum) between `optimizer_class` on DTensors placed by `placement` and
    torch's Muon on the same matrices whole."""
    torch.manual_seed(0)  # every rank: the same weights and gradients
    whole = [torch.nn.Parameter(torch.randn(shape)) for shape in SHAPES]
    placed = [torch.nn.Parameter(distribute_tensor(p.detach().clone(), mesh, [placement])) for p in whole]
    reference, tested = torch.optim.Muon(whole, **SETTINGS), optimizer_class(placed, **SETTINGS)
    for _ in range(STEPS):
        for p, q in zip(whole, placed):
            p.grad = torch.randn(p.shape)
            q.grad = distribute_tensor(p.grad.clone(), mesh, [placement])
        reference.step()
        tested.step()
    weights = max((p - q.full_tensor()).abs().max().item() for p, q in zip(whole, placed))
    momentum = max((reference.state[p]["momentum_buffer"] - tested.state[q]["momentum_buffer"].full_tensor())
                   .abs().max().item() for p, q in zip(whole, placed))
    return weights, momentum


def compare() -> dict[str, tuple[float, float]]:
    """Collective over the whole process group: the figures of each placement, for MeshMuon and torch's Muon."""
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    results = {}
    for label, placement in (("rows", Shard(0)), ("columns", Shard(1))):
        results[f"mesh_muon_{label}"] = run(placement, MeshMuon, mesh)
        results[f"torch_muon_on_pieces_{label}"] = run(placement, torch.optim.Muon, mesh)
    return results


def main(out: Path) -> None:
    dist.init_process_group("gloo")
    results = compare()
    if dist.get_rank() == 0:
        (out / "result.json").write_text(json.dumps(results, indent=1))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
