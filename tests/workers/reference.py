"""The one reference of the torchrun workers (pp_worker.py, tp_worker.py, layout_worker.py): the whole GPT trained by
one process alone, on the global batches of the parallel run it is compared with, with that run's optimizer and
clipping, keeping what the comparisons read: each step's loss, gradient norm before clipping and gradients (before
clipping and before the optimizer steps them), and the weights after the steps. Every rank of a worker trains it for
itself (no collective). Also the table of every model option at once (ALL_OPTIONS), shared by the workers and
tests/unit/test_model_options.py.

Weights after steps are compared where the steps are SGD's (`sgd`): SGD moves a weight by the learning rate times its
gradient, so fp32 rounding in a gradient stays rounding in the weight. AdamW divides each step by the gradient's root
mean square: a gradient at rounding level (a sum that cancels, a bigram row that one window uses) moves its weight by
up to the learning rate either way. Measured on one AMD EPYC (torch 2.13), this reference alone (pp_worker's GPT with
every option on) under the CPU's own kernels (AVX512) against ATEN_CPU_CAPABILITY=avx2 and =default, the same code:
first gradients 1.6e-7 to 6.1e-7 apart (relative), the weights after 5 AdamW steps (lr 1e-2) 3.5e-4 to 1.5e-3 apart,
after 5 steps of `sgd` 3.7e-9 to 4.2e-8.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Optional

import torch
import torch.nn as nn

from mingpt.optim import decay_groups

# Every model option of model.py at once, the soft cap tight enough to bend the logits (tests/unit/test_model_options.py
# turns them on one by one too, with rope_base besides).
ALL_OPTIONS = dict(positions="rotary", norm="rmsnorm", activation="relu2", qk_norm=True, tie_embeddings=False,
                   logit_softcap=1.0, zero_init_proj=True, bigram_embedding=True)

# The optimizer of the comparisons that read weights after steps: SGD with momentum (state to save and resume) and
# weight decay by decay_groups (the groups are built from the names a stage or shard keeps).
SGD_LR, SGD_MOMENTUM, SGD_WEIGHT_DECAY = 0.5, 0.9, 0.01

# The tolerances of the comparisons against this reference (fp32, 5 steps, clipping engaged; measured on an AMD EPYC
# with torch 2.13 under the CPU's own kernels, AVX512, and under ATEN_CPU_CAPABILITY=avx2 and =default alike):
LOSS_TOLERANCE = 1e-5  # losses and gradient norms (both ~1): fp32 sums in another order; measured <= 9.5e-7
# relative_difference of each step's gradients: fp32 sums over micro-batches, stages, shards and ranks in another
# order, ~1e-6 of a gradient's largest entry; measured <= 1.2e-6 (PP, TP, FSDP x TP), the pipeline's unsummed tie 1.09
GRADIENT_TOLERANCE = 1e-5
# Absolute, the weights after 5 SGD steps: fp32 rounds a weight of ~1 (a norm's gain) at 6e-8 a step, and the
# gradients' ~1e-6 of rounding moves a weight by ~1e-6 of how far it moved (~1e-2: `moved`); measured <= 1.2e-7 (one
# rounding of a gain of 1). A tie left undone: 3.5e-3 (PP), 4.4e-3 (TP).
WEIGHT_TOLERANCE = 1e-6


def sgd(module: nn.Module) -> torch.optim.SGD:
    return torch.optim.SGD(decay_groups(module.named_parameters(), SGD_WEIGHT_DECAY), lr=SGD_LR,
                           momentum=SGD_MOMENTUM)


def detached(named: Iterable[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    return {name: tensor.detach().clone() for name, tensor in named}


class Reference:
    """One process training `model` with `optimizer` (a torch optimizer, or mingpt.optim.Optimizers), clipping to
    `max_norm` (0: no clipping), `schedule(step)` called before each step (the learning rates a trainer sets). Its
    figures so far: `losses`, `norms` (before clipping), `evals` (the losses `evaluate` returned) and, with
    `keep_gradients`, `gradients` (each step's, by parameter name: a tied matrix once, under its first name)."""

    def __init__(self, model: nn.Module, optimizer: Any, max_norm: float,
                 schedule: Optional[Callable[[int], None]] = None, keep_gradients: bool = True) -> None:
        self.model, self.optimizer, self.max_norm, self.schedule = model, optimizer, max_norm, schedule
        self.keep_gradients = keep_gradients
        self.initial = self.parameters()
        self.losses: list[float] = []
        self.norms: list[float] = []
        self.evals: list[float] = []
        self.gradients: list[dict[str, torch.Tensor]] = []

    @property
    def steps(self) -> int:
        return len(self.losses)

    def step(self, x: torch.Tensor, y: torch.Tensor) -> float:
        """One optimizer step on the global batch (x, y); its loss."""
        if self.schedule is not None:
            self.schedule(self.steps)
        _, loss = self.model(x, y)
        loss.backward()
        if self.keep_gradients:
            self.gradients.append(detached((name, p.grad) for name, p in self.model.named_parameters()))
        parameters = [p for p in self.model.parameters() if p.grad is not None]
        if self.max_norm > 0:
            norm = nn.utils.clip_grad_norm_(parameters, self.max_norm)
        else:
            norm = nn.utils.get_total_norm([p.grad for p in parameters])
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.losses.append(loss.item())
        self.norms.append(norm.item())
        return self.losses[-1]

    def train(self, batches: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> Reference:
        for x, y in batches:
            self.step(x, y)
        return self

    @torch.no_grad()
    def evaluate(self, x: torch.Tensor, y: torch.Tensor) -> float:
        """The loss of a batch, forward only (the model in its own mode: the workers train without dropout)."""
        self.evals.append(self.model(x, y)[1].item())
        return self.evals[-1]

    def parameters(self) -> dict[str, torch.Tensor]:
        """The weights now, by parameter name (a tied matrix once)."""
        return detached(self.model.named_parameters())

    def state(self) -> dict[str, torch.Tensor]:
        """The model's state dict now (a tied matrix under each of its names)."""
        return detached(self.model.state_dict().items())

    def moved(self) -> float:
        """How far training moved any weight: the scale of the weight comparisons."""
        return max((tensor - self.initial[name]).abs().max().item() for name, tensor in self.parameters().items())


def relative_difference(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> float:
    """The largest difference of a tensor of `got` from its namesake in `expected`, relative to that tensor's largest
    entry (absolute where the expected tensor is all zeros). Names missing in `got` are not compared."""
    worst = 0.0
    for name, value in got.items():
        reference = expected[name].float()
        scale = reference.abs().max().item() or 1.0
        worst = max(worst, (value.float() - reference).abs().max().item() / scale)
    return worst
