"""The model's and the optimizer's state in the form each layout saves and loads, and the whole model's tensors.

    ModelState(modules, permuted)           # snapshots' "model": full tensors (DDP) or this rank's shards, by name
    OptimizerState(pairs, permuted, ...)    # snapshots' "optimizer": torch's numbered form (DDP) or by name
    full_tensors(state, permuted)           # (name, full tensor in canonical order), one gathered at a time

A DDP snapshot holds `model.state_dict()` and the optimizer's own `state_dict()` (one file, rank 0); a sharded one
each rank's part by parameter name (torch.distributed.checkpoint.state_dict): DTensor shards under FSDP and tensor
parallelism, its stages' tensors under pipeline parallelism. Either form loads into either layout. Tensors whose
rows a tensor-parallel layout keeps `permuted` go out in canonical order and come back permuted.
"""

from __future__ import annotations

import hashlib
import sys
from typing import Any, Callable, Iterator, Optional

import torch
import torch.distributed as dist
import torch.nn as nn


def is_dtensor(value: Any) -> bool:
    """isinstance(value, DTensor) without importing torch.distributed.tensor here, at the start of every run (FSDP,
    DCP or torch._dynamo import it when a run needs them): until one has, nothing is a DTensor."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(value, module.DTensor)


def local_tensor(value: torch.Tensor) -> torch.Tensor:
    """A plain tensor of a value that every rank holds whole (a loss over the vocabulary's shards is a replicated
    DTensor)."""
    return value.to_local() if is_dtensor(value) else value


def is_sharded_state(state: Any) -> bool:
    """True if a (nested) state holds DTensors: shards, not full tensors."""
    if is_dtensor(state):
        return True
    if isinstance(state, dict):
        return any(is_sharded_state(value) for value in state.values())
    return False


def is_sharded_model(model: nn.Module) -> bool:
    return any(is_dtensor(p) for p in model.parameters())


class ModelState:
    """The model in a snapshot: a DDP snapshot holds `model.state_dict()` (full tensors), a sharded one each rank's
    part (DTensor shards under FSDP and tensor parallelism; its stages' tensors under pipeline parallelism), by the
    whole model's parameter names. `named_state_dict()` is the form this process holds: what a sharded snapshot
    loads into. `modules`: the modules holding this rank's parameters (one, or its pipeline stages). Snapshots hold
    every tensor in its canonical order: the rows a tensor-parallel layout keeps `permuted` (name: degree) are put
    back in order on the way out and permuted again on the way in."""

    def __init__(self, modules: nn.Module | list[nn.Module], permuted: Optional[dict[str, int]] = None,
                 named: Optional[bool] = None) -> None:
        self.modules = modules if isinstance(modules, list) else [modules]
        self.model, self.permuted = self.modules[0], permuted or {}
        self.sharded = any(is_sharded_model(module) for module in self.modules) if named is None else named

    def state_dict(self) -> dict:
        return self.named_state_dict() if self.sharded else self.model.state_dict()

    def named_state_dict(self) -> dict:
        return canonical_state(self._own_state(), self.permuted)

    def _own_state(self) -> dict:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        return {key: value for module in self.modules for key, value in get_model_state_dict(module).items()}

    def load_state_dict(self, state: dict) -> None:
        if not self.sharded:
            self.model.load_state_dict(state)
            return
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        full = not is_sharded_state(state)  # a DDP snapshot's full tensors: each rank keeps its shards of them
        state = layout_state(state, self.permuted, full, self._own_state)
        for module in self.modules:  # each takes its own entries (a pipeline stage: its blocks')
            own = {key: state[key] for key in module.state_dict()}
            set_model_state_dict(module, own, options=StateDictOptions(full_state_dict=full))


def canonical_state(state: dict, permuted: dict[str, int]) -> dict:
    """Collective under tensor parallelism. A state dict (model, or an optimizer's by name) with its permuted rows
    in canonical order."""
    if not permuted:
        return state
    from mingpt.parallel.tensor_parallel import to_canonical

    return to_canonical(state, permuted)


def layout_state(state: dict, permuted: dict[str, int], full: bool, templates: Callable[[], dict]) -> dict:
    """Collective under tensor parallelism. The reverse of `canonical_state`: full tensors permuted as they are,
    shards into the layout of this process's own state (`templates`)."""
    if not permuted:
        return state
    from mingpt.parallel.tensor_parallel import from_canonical

    return from_canonical(state, None if full else templates(), permuted)


FRESH = {"fresh": True}  # a state that is none yet: an optimizer before its first step


def is_fresh(state: object) -> bool:
    return isinstance(state, dict) and state.get("fresh") is True


class OptimizerState:
    """The optimizer in a snapshot. DDP: the optimizer's own state_dict (parameters numbered); sharded layouts: keyed
    by parameter name, each rank's part, with the parameter groups of the whole model. Any loads into any layout.

    `pairs`: each module (one per pipeline stage) with the optimizers of its parameters (AdamW, or Muon and AdamW:
    `Optimizers.by_module()`); `numbered_names` are the whole model's
    parameter names in a one-optimizer numbering, for a DDP snapshot's numbered state (default: the model's own);
    `group` is where the groups' members are gathered from when no rank holds them all (pipeline stages)."""

    def __init__(self, pairs: list[tuple[nn.Module, list[torch.optim.Optimizer]]],
                 permuted: Optional[dict[str, int]] = None, named: Optional[bool] = None,
                 numbered_names: Optional[list[str]] = None, group: Optional[dist.ProcessGroup] = None) -> None:
        self.pairs = pairs  # each module (a pipeline stage each) with the optimizers of its parameters
        self.model, self.optimizer, self.permuted = pairs[0][0], pairs[0][1][0], permuted or {}
        self.sharded = any(is_sharded_model(module) for module, _ in pairs) if named is None else named
        self.numbered_names, self.group = numbered_names, group
        # torch's numbered form holds one optimizer: several (Muon and AdamW) are saved by parameter name
        self.by_name = self.sharded or len(pairs) > 1 or len(pairs[0][1]) > 1

    def state_dict(self) -> dict:
        """Before the first step, FRESH: asking a sharded optimizer for its state then would make one (torch's
        `_init_optim_state` steps it once with zero gradients, which shifts AdamW's bias correction by a step)."""
        if self.fresh:
            return dict(FRESH)
        return self.named_state_dict() if self.by_name else self.optimizer.state_dict()

    @property
    def fresh(self) -> bool:
        """No optimizer has stepped yet (it holds no state)."""
        return not any(optimizer.state for _, optimizers in self.pairs for optimizer in optimizers)

    def named_state_dict(self) -> dict:
        return canonical_state(self._own_state(), self.permuted)

    def _own_state(self) -> dict:
        """Collective with a `group`. This rank's state by name; every group lists the whole model's members."""
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        parts = [get_optimizer_state_dict(module, optimizers) for module, optimizers in self.pairs]
        state = {name: value for part in parts for name, value in part["state"].items()}
        groups = [[part["param_groups"][i] for part in parts]  # the i-th group of each module's optimizers
                  for i in range(len(parts[0]["param_groups"]))]
        if self.group is not None:
            groups = [[g for rank_groups in gathered for g in rank_groups]
                      for gathered in zip(*_all_gather_objects(groups, self.group))]
        return {"state": state, "param_groups": [merged_group(parts) for parts in groups]}

    def load_state_dict(self, state: dict) -> None:
        if is_fresh(state):  # a snapshot of the start: the optimizers as they are before their first step
            for _, optimizers in self.pairs:
                for optimizer in optimizers:
                    optimizer.state.clear()
            return
        numbered = any(isinstance(p, int) for group in state["param_groups"] for p in group["params"])
        if numbered and not self.by_name:
            self.optimizer.load_state_dict(state)
            return
        if numbered:
            names = self.numbered_names or parameter_names(self.optimizer, self.model)
            state = named_optimizer_state(state, names)
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        full = not is_sharded_state(state)
        state = layout_state(state, self.permuted, full and self.sharded, self._own_state)
        options = StateDictOptions(full_state_dict=full and self.sharded)
        for module, optimizers in self.pairs:
            set_optimizer_state_dict(module, optimizers, own_optimizer_state(state, module), options=options)


def merged_group(groups: list[dict]) -> dict:
    """One parameter group of the whole model from the same group of several optimizers: their settings (the
    same), their members together."""
    return {**groups[0], "params": [name for group in groups for name in group["params"]]}


def own_optimizer_state(state: dict, module: nn.Module) -> dict:
    """The entries of a by-name optimizer state that concern `module`'s parameters (a pipeline stage's)."""
    names = {name for name, _ in module.named_parameters()}
    if all(name in names for group in state["param_groups"] for name in group["params"]):
        return state
    return {"state": {name: value for name, value in state["state"].items() if name in names},
            "param_groups": [{**group, "params": [name for name in group["params"] if name in names]}
                             for group in state["param_groups"]]}


def _all_gather_objects(value: Any, group: dist.ProcessGroup) -> list:
    values = [None] * dist.get_world_size(group)
    dist.all_gather_object(values, value, group=group)
    return values


def parameter_names(optimizer: torch.optim.Optimizer, model: nn.Module) -> list[str]:
    """The names of the optimizer's parameters in its own numbering (group by group, as `state_dict()` numbers
    them); a tied parameter goes by its first name."""
    names: dict[int, str] = {}
    for name, param in model.named_parameters():  # named_parameters skips the second name of a tied parameter
        names.setdefault(id(param), name)
    return [names[id(p)] for group in optimizer.param_groups for p in group["params"]]


def named_optimizer_state(state: dict, names: list[str]) -> dict:
    """An optimizer state_dict with numbered parameters -> the same keyed by parameter name."""
    return {
        "state": {names[index]: value for index, value in state["state"].items()},
        "param_groups": [{**group, "params": [names[index] for index in group["params"]]}
                         for group in state["param_groups"]],
    }


def numbered_optimizer_state(state: dict) -> dict:
    """The reverse of `named_optimizer_state`: names numbered group by group, as the optimizer numbers them."""
    order = [name for group in state["param_groups"] for name in group["params"]]
    index = {name: i for i, name in enumerate(order)}
    return {
        "state": {index[name]: value for name, value in state["state"].items()},
        "param_groups": [{**group, "params": [index[name] for name in group["params"]]}
                         for group in state["param_groups"]],
    }


def full_tensors(state: dict, permuted: Optional[dict[str, int]] = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Collective under FSDP and tensor parallelism. (name, full tensor in canonical order) in sorted name order, one
    tensor gathered at a time."""
    permuted = permuted or {}
    for name in sorted(state):
        value = state[name]
        full = value.full_tensor() if is_dtensor(value) else value
        if name in permuted:
            from mingpt.parallel.tensor_parallel import canonical_full

            full = canonical_full(full, permuted[name])
        yield name, full


def weights_sha256_of(tensors: Iterator[tuple[str, torch.Tensor]]) -> str:
    """snapshot.weights_sha256 of (name, full tensor) in sorted name order, one at a time (`full_tensors`)."""
    digest = hashlib.sha256()
    for _, tensor in tensors:
        flat = tensor.detach().cpu().contiguous().reshape(-1)
        digest.update(memoryview(flat.view(torch.uint8).numpy()))
    return digest.hexdigest()


def model_from_tensors(tensors: Iterator[tuple[str, torch.Tensor]], build: Callable[[], nn.Module], is_main: bool,
                       whole: Optional[nn.Module] = None) -> Optional[nn.Module]:
    """Collective when `tensors` is. An unsharded copy of the model on global rank 0's CPU (None on the others), for
    what one process does alone (generating a sample), from (name, full tensor) in order. `whole`: a model every
    rank holds whole (DDP), returned as it is."""
    if whole is not None:
        return whole
    state = {}
    for name, tensor in tensors:
        if is_main:  # the others take part in the gathers and keep nothing
            state[name] = tensor.cpu()
    if not is_main:
        return None
    copy = build()
    copy.load_state_dict(state)
    return copy  # on the CPU: a model sharded for want of GPU memory would not fit there whole
