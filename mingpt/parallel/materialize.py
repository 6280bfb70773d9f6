"""A model built on the meta device, made real piece by piece where a layout puts it: no process holds the whole
model on the way to its shards.

    with torch.device("meta"):
        model = GPT(cfg, seed=seed)                        # shapes only: nothing allocated, nothing drawn
    apply_tensor_parallel(model, tp_mesh)                  # meta DTensors: the layout, not yet the values
    for block in blocks_of(model):
        materialize(model, block, device, model.initial_value)   # this block's tensors, then its shards
        fully_shard(block, mesh=dp_mesh)                   # the whole block freed: only its shard stays
    materialize(model, model, device, model.initial_value)  # what is left (embeddings, final norm, head)

Each tensor is drawn whole, on the CPU, by its name (`GPT.initial_value`, a generator per name), so every layout
starts from the weights one process draws; a tensor-parallel DTensor then keeps only this rank's part of it
(`distribute_tensor` without communication: every rank drew the same whole tensor). The peak on the way is one
block whole plus the shards so far, where building the model and then sharding it held all of it on every rank.
"""

from __future__ import annotations

from collections import Counter
from typing import Callable, Optional

import torch
import torch.nn as nn

from mingpt.compat import distribute_locally
from mingpt.parallel.state import is_dtensor

InitialValue = Callable[[str], torch.Tensor]  # a tensor's name in the whole model -> its whole initial value


def on_meta(module: nn.Module) -> bool:
    """Whether any parameter or buffer of `module` is still only a shape."""
    return any(t.is_meta for t in [*module.parameters(), *module.buffers()])


@torch.no_grad()
def materialize(root: nn.Module, part: nn.Module, device: torch.device, initial_value: InitialValue,
                permuted: Optional[dict[str, int]] = None, made: Optional[dict[int, nn.Parameter]] = None) -> None:
    """Every meta parameter and buffer of `part` (a submodule of `root`, or `root` itself) real on `device` at its
    initial value, under the name it has in `root`; what is real already is left alone. A DTensor keeps its layout
    (this rank's part of the value); `permuted` names the parameters tensor parallelism keeps in permuted row order
    ({name: degree}). `made`: the tied parameters made so far, by the meta parameter's id, so that a tied one stays
    one (and only those: any other is held by its module alone, and freed once its block is sharded)."""
    from mingpt.parallel.tensor_parallel import permuted_full

    permuted = permuted or {}
    made = {} if made is None else made
    names = Counter(id(param) for _, param in root.named_parameters(remove_duplicate=False))
    prefix = next(name for name, module in root.named_modules() if module is part)
    for path, owner in part.named_modules(prefix=prefix):
        for attr, param in list(owner.named_parameters(recurse=False)):
            if not param.is_meta:
                continue
            real = made.get(id(param))
            if real is None:
                name = f"{path}.{attr}" if path else attr
                value = initial_value(name)
                if name in permuted:
                    value = permuted_full(value, permuted[name])
                real = nn.Parameter(_placed(value, param, device), requires_grad=param.requires_grad)
                if names[id(param)] > 1:  # tied: kept for its other name. Nothing else is held here, so a
                    made[id(param)] = real  # block's whole tensors are freed as soon as it is sharded
            setattr(owner, attr, real)
        for attr, buffer in list(owner.named_buffers(recurse=False)):
            if buffer is not None and buffer.is_meta:
                setattr(owner, attr, _placed(initial_value(f"{path}.{attr}" if path else attr), buffer, device))


def _placed(value: torch.Tensor, like: torch.Tensor, device: torch.device) -> torch.Tensor:
    """The whole `value` as `like` holds it: its dtype on `device`, and for a DTensor this rank's part."""
    value = value.to(device=device, dtype=like.dtype)
    if is_dtensor(like):
        return distribute_locally(value, like.device_mesh, like.placements)
    return value
