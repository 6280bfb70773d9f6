"""Tensor parallelism for the GPT of model.py (Megatron-style, with sequence parallelism), and its state in canonical
order.

    tp_mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))      # or mesh["tp"] of a larger mesh
    permuted = apply_tensor_parallel(model, tp_mesh)                       # in place; every parameter a DTensor
    with loss_parallel_context(True):                                      # forward AND backward inside it
        _, loss = model(idx, targets)                                      # idx, targets: the same on every TP rank
        loss.backward()
    log(local_value(loss).item())
    dcp.save({"model": to_canonical(get_model_state_dict(model), permuted)}, checkpoint_id=folder)

Under a degree of N, rank r holds heads r*n_head/N ... (r+1)*n_head/N - 1 of every block (their q, k and v: rows of
`c_attn`; their share of `c_proj`'s columns), 1/N of the MLP's hidden units likewise, and 1/N of the vocabulary (the
tied `wte` / `lm_head` matrix, Shard(0) for both; an untied head is split the same way, apart from `wte`). Between the
column- and row-parallel pairs the activations are split along the sequence (sequence parallelism): norms (LayerNorm
or RMSNorm), dropouts and residual additions each see T/N positions, and every parameter is a DTensor (fused AdamW and
gradient clipping refuse a mix of DTensors and plain tensors). What passes between blocks, and between pipeline
stages, is a rank's (B, T/N, C) part as a plain tensor. Attention sees the whole sequence (gathered), so rotary
positions and q/k norm (model.py's options) apply to each rank's own heads as in one process and need no plan. The
logits stay split over the vocabulary (the soft cap is elementwise); `loss_parallel` computes the cross-entropy over
those shards without gathering them.

The fused `c_attn` (rows [q | k | v]) is kept with its rows PERMUTED under TP: [q_0 k_0 v_0 | q_1 k_1 v_1 | ...], so
that a plain row split (ColwiseParallel, Shard(0)) hands rank r the q, k and v of its own heads. AdamW works element
by element and a gradient norm ignores the order, so training does not care; only what leaves the layout must be put
back in canonical order: snapshots (`to_canonical` / `from_canonical`), full tensors (`canonical_full` /
`permuted_full`), weight digests.

Limits: N must divide n_head and every sequence's length (block_size is checked up front, other lengths where they
enter `wte`). Dropout draws from each rank's own generator on its own positions and heads: seed tensor-parallel peers
differently (the global rank does) or their masks repeat. `GPT.generate` slices positions, so it needs a full copy.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Optional, Sequence

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard

from mingpt.errors import UsageError

QKV = 3  # c_attn's output rows: q, k and v, one after another
# A conversion of one tensor: (value, degree, its template or None) -> the converted value.
Convert = Callable[[torch.Tensor, int, Any], torch.Tensor]


# ----------------------------------------------------------------------------------------------------------------
# The row permutation of the fused q, k, v projection
# ----------------------------------------------------------------------------------------------------------------

def permuted_full(tensor: torch.Tensor, n: int) -> torch.Tensor:
    """A full c_attn weight (3C, C) or bias (3C,) in canonical order [q | k | v] -> the TP order of degree n,
    [q_0 k_0 v_0 | q_1 k_1 v_1 | ...]: rank r's Shard(0) slice is then its own heads' q, k and v."""
    return tensor.unflatten(0, (QKV, n, -1)).transpose(0, 1).flatten(0, 2)


def canonical_full(tensor: torch.Tensor, n: int) -> torch.Tensor:
    """The inverse of `permuted_full`: a full tensor in the TP order of degree n -> canonical [q | k | v]."""
    return tensor.unflatten(0, (n, QKV, -1)).transpose(0, 1).flatten(0, 2)


# ----------------------------------------------------------------------------------------------------------------
# Applying tensor parallelism
# ----------------------------------------------------------------------------------------------------------------

def apply_tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh) -> dict[str, int]:
    """Collective over `tp_mesh` (1-D). Shard a GPT, or a pipeline stage of one (any of wte, wpe, ln_f, lm_head and
    blocks may be missing; `transformer.h` a ModuleList or a ModuleDict), over `tp_mesh` in place. Every rank must
    hold the same weights (rank 0's are scattered, the norms' are kept as they are).

    Returns {parameter name: degree} for the parameters now kept in permuted row order (c_attn's weight and bias):
    what `to_canonical`, `from_canonical` and `canonical_full` need. Raises UsageError when the degree does not
    divide n_head or block_size; a forward pass on a sequence it does not divide raises ValueError. Apply it before
    compiling, activation checkpointing or FSDP's `fully_shard`, whose wrappers it does not look through."""
    from torch.distributed.tensor.parallel import parallelize_module

    degree = tp_mesh.size()
    _check_shapes(model, degree)
    permuted = _permute_qkv(model, degree)
    tied = _tied(model)
    _guard_sequence_length(model, degree)
    parallelize_module(model, tp_mesh, _outer_plan(model))
    for block in _blocks(model):
        parallelize_module(block, tp_mesh, _block_plan())
    # parallelize_module distributes each module's weight on its own: the tie would be lost (the weights 0.15 off one
    # process's after the 4 steps of tests/e2e/test_layouts.py)
    if tied:
        model.lm_head.weight = model.transformer.wte.weight
    _check_all_distributed(model)
    return permuted


def _blocks(model: nn.Module) -> list[nn.Module]:
    """The transformer blocks this model (or pipeline stage) holds, in order."""
    transformer = getattr(model, "transformer", None)
    blocks = getattr(transformer, "h", None) if transformer is not None else None
    if blocks is None:
        return []
    return list(blocks.values()) if isinstance(blocks, nn.ModuleDict) else list(blocks)


def _n_head(model: nn.Module) -> Optional[int]:
    """The heads per block: from the model's config, else from a block's shapes (a module without a config)."""
    config = getattr(model, "config", None)
    if config is not None:
        return config.n_head
    blocks = _blocks(model)
    if not blocks:
        return None
    attn = blocks[0].attn
    return attn.c_attn.out_features // QKV // attn.head_dim


def _check_shapes(model: nn.Module, degree: int) -> None:
    n_head = _n_head(model)
    if n_head is not None and n_head % degree != 0:
        raise UsageError(f"gpt_config.n_head ({n_head}) must be divisible by the tensor-parallel degree "
                         f"(parallel_config.tp={degree}): each process holds whole attention heads")
    block_size = getattr(getattr(model, "config", None), "block_size", None)
    if block_size is not None and block_size % degree != 0:
        raise UsageError(f"data_config.block_size ({block_size}) must be divisible by the tensor-parallel degree "
                         f"(parallel_config.tp={degree}): each process holds an equal part of the sequence")


def _guard_sequence_length(model: nn.Module, degree: int) -> None:
    """Refuse a sequence the degree does not divide where it enters: torch's sequence-parallel hooks assume equal
    parts, and gloo aborts the process (SIGABRT, "Received data size doesn't match") on unequal ones."""
    transformer = getattr(model, "transformer", None)
    wte = getattr(transformer, "wte", None) if transformer is not None else None
    if wte is None:
        return

    def check(module: nn.Module, args: tuple) -> None:
        length = args[0].size(-1)
        if length % degree != 0:
            raise ValueError(f"under tensor parallelism of degree {degree} the sequence length must be a multiple "
                             f"of it, got {length}")

    wte.register_forward_pre_hook(check)


@torch.no_grad()
def _permute_qkv(model: nn.Module, degree: int) -> dict[str, int]:
    """Every block's c_attn rows into the TP order, in place (before they are split); their names and the degree."""
    permuted: dict[str, int] = {}
    for name, module in model.named_modules():
        if name.endswith("attn.c_attn") and isinstance(module, nn.Linear):
            for param_name, param in module.named_parameters(recurse=False):
                param.copy_(permuted_full(param, degree))
                permuted[f"{name}.{param_name}"] = degree
    return permuted


def _tied(model: nn.Module) -> bool:
    transformer = getattr(model, "transformer", None)
    wte = getattr(transformer, "wte", None) if transformer is not None else None
    head = getattr(model, "lm_head", None)
    return wte is not None and head is not None and head.weight is wte.weight


def _outer_plan(model: nn.Module) -> dict[str, Any]:
    """The plan for the modules outside the blocks that this model holds."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

    transformer = getattr(model, "transformer", None)
    has = set(transformer.keys()) if isinstance(transformer, nn.ModuleDict) else set()
    plan: dict[str, Any] = {}
    if "wte" in has:  # vocabulary rows split; the sum over them reduce-scattered along the sequence: (B, T/N, C)
        plan["transformer.wte"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1))
    if "bigram" in has:  # pair rows split as wte's vocabulary rows, and its output laid out as wte's
        plan["transformer.bigram"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1))
    if "wpe" in has:  # positions (T,) -> (T/N, C): the same positions as wte's local output, broadcast over B
        plan["transformer.wpe"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(0))
    if "ln_f" in has:
        plan["transformer.ln_f"] = SequenceParallel()
    if getattr(model, "lm_head", None) is not None:  # logits split over the vocabulary, a DTensor for loss_parallel
        plan["lm_head"] = ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False)
    return plan


def _block_plan() -> dict[str, Any]:
    """One block: norms on sequence shards; attention and MLP gather the sequence, split heads / hidden units, and
    reduce-scatter their output back onto sequence shards."""
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
    )

    def gather_sequence() -> PrepareModuleInput:  # all-gather forward, reduce-scatter backward
        return PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))

    return {
        "ln_1": SequenceParallel(),
        "attn": gather_sequence(),
        "attn.c_attn": ColwiseParallel(),  # rows permuted: rank r's slice is its heads' q, k, v
        "attn.c_proj": RowwiseParallel(output_layouts=Shard(1)),
        "ln_2": SequenceParallel(),
        "mlp": gather_sequence(),
        "mlp.c_fc": ColwiseParallel(),
        "mlp.c_proj": RowwiseParallel(output_layouts=Shard(1)),
    }


def _check_all_distributed(model: nn.Module) -> None:
    """A plain parameter left over would break fused AdamW and clipping later, far from the cause: fail here."""
    plain = [name for name, param in model.named_parameters() if not isinstance(param, DTensor)]
    if plain:
        raise RuntimeError(f"tensor parallelism left parameters outside the mesh: {', '.join(plain)}")


# ----------------------------------------------------------------------------------------------------------------
# The loss
# ----------------------------------------------------------------------------------------------------------------

def loss_parallel_context(enabled: bool) -> contextlib.AbstractContextManager:
    """Where the loss is computed from vocabulary-sharded logits AND differentiated: the forward pass and
    `backward()` must both run inside it (its backward of the cross-entropy expects the sharded logits)."""
    if not enabled:
        return contextlib.nullcontext()
    from torch.distributed.tensor.parallel import loss_parallel

    return loss_parallel()


def local_value(loss: torch.Tensor) -> torch.Tensor:
    """The loss as a plain tensor (for logging, `.item()`, all-reducing over data-parallel ranks): a tensor-parallel
    loss is a replicated DTensor, which holds the whole value on every rank."""
    if isinstance(loss, DTensor):
        return loss.full_tensor()  # Replicate: no communication, only the unwrapping
    return loss


# ----------------------------------------------------------------------------------------------------------------
# State dicts in canonical order
# ----------------------------------------------------------------------------------------------------------------

def to_canonical(state: dict, permuted: dict[str, int]) -> dict:
    """Collective over the values' meshes. A model state dict (name -> tensor) or an optimizer one keyed by name
    ({"state": {name: {"exp_avg": ...}}, "param_groups": ...}) with the `permuted` entries in canonical row order:
    a DTensor becomes a DTensor on its own mesh split along rows (Shard(0) where it was split, Replicate where it
    was replicated), which torch.distributed.checkpoint saves and any layout loads; a full tensor stays full. One
    full tensor is gathered at a time, transiently. The other entries are passed through; `state` is not changed."""
    return _convert_state(state, permuted, None, _to_canonical_value)


def from_canonical(state: dict, templates: Optional[dict], permuted: dict[str, int]) -> dict:
    """Collective over the values' meshes. The reverse of `to_canonical`, for a state in canonical order (loaded by
    torch.distributed.checkpoint, or full tensors): each `permuted` entry back in the TP row order, laid out as the
    same entry of `templates` (this process's own state dict of the same shape, e.g. from get_model_state_dict /
    get_optimizer_state_dict), or as a full tensor when `templates` is None or holds a plain tensor there."""
    return _convert_state(state, permuted, templates, _from_canonical_value)


def is_optimizer_state(state: dict) -> bool:
    """An optimizer state dict ({"state": ..., "param_groups": ...}) rather than a model's."""
    return isinstance(state.get("state"), dict) and "param_groups" in state


def _convert_state(state: dict, permuted: dict[str, int], templates: Optional[dict], convert: Convert) -> dict:
    """Both shapes of state dict: convert the tensors of the permuted names, in sorted order (the same on every
    rank: each conversion is a collective)."""
    if is_optimizer_state(state):
        own = templates["state"] if templates is not None else None
        return {**state, "state": _convert_entries(state["state"], permuted, own, convert, nested=True)}
    return _convert_entries(state, permuted, templates, convert, nested=False)


def _convert_entries(entries: dict, permuted: dict[str, int], templates: Optional[dict], convert: Convert,
                     nested: bool) -> dict:
    out = dict(entries)
    for name in sorted(set(permuted) & set(entries)):
        template = templates.get(name) if templates is not None else None
        if nested:  # an optimizer's: every tensor with the parameter's rows (moments), not the 0-d step
            out[name] = {key: convert(value, permuted[name], template.get(key) if template else None)
                         if _has_rows(value) else value for key, value in entries[name].items()}
        else:
            out[name] = convert(entries[name], permuted[name], template)
    return out


def _has_rows(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() > 0


@torch.no_grad()
def _to_canonical_value(value: torch.Tensor, degree: int, template: Any = None) -> torch.Tensor:
    if not isinstance(value, DTensor):
        return canonical_full(value, degree)
    full = canonical_full(value.full_tensor(), degree)
    return _distribute_locally(full, value.device_mesh, _row_split(value.placements))


@torch.no_grad()
def _from_canonical_value(value: torch.Tensor, degree: int, template: Any = None) -> torch.Tensor:
    full = permuted_full(value.full_tensor() if isinstance(value, DTensor) else value, degree)
    if isinstance(template, DTensor):
        return _distribute_locally(full, template.device_mesh, template.placements)
    if isinstance(value, DTensor) and template is None:  # no template: back to the value's own mesh and split
        return _distribute_locally(full, value.device_mesh, value.placements)
    return full


def _row_split(placements: Sequence[Placement]) -> list[Placement]:
    """Plain row shards wherever the tensor was split (FSDP's strided shards included), replicas where replicated:
    a layout any loader reads, each rank holding as much as it held before."""
    return [Replicate() if placement.is_replicate() else Shard(0) for placement in placements]


def _distribute_locally(full: torch.Tensor, mesh: DeviceMesh, placements: Sequence[Placement]) -> DTensor:
    """A DTensor of `full` (which every rank holds) laid out as `placements`, each rank cutting out its own part:
    no communication. The part is copied so that the full tensor can be freed (and only the part is written)."""
    replicated = DTensor.from_local(full, mesh, [Replicate()] * mesh.ndim, run_check=False)
    split = replicated.redistribute(mesh, placements)  # Replicate -> Shard: a local slice
    local = split.to_local().clone()
    return DTensor.from_local(local, mesh, placements, run_check=False, shape=split.shape, stride=split.stride())

