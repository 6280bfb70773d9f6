"""AdamW and its learning-rate schedule (linear warmup, then cosine decay to a floor), from `OptimizerConfig`.

    >>> opt = build_optimizer(model, OptimizerConfig())
    >>> lr = learning_rate(step, OptimizerConfig(), total_steps=5000)
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from errors import UsageError
from model import GPT


@dataclass
class OptimizerConfig:
    """AdamW hyper-parameters and the learning-rate schedule."""

    learning_rate: float = 1e-3
    """peak learning rate, reached at the end of warmup"""
    weight_decay: float = 0.1
    """AdamW weight decay on matrices and embeddings (not biases or LayerNorm)"""
    beta1: float = 0.9
    """AdamW first-moment decay"""
    beta2: float = 0.99
    """AdamW second-moment decay

    0.99 rather than 0.999: few tokens per step."""
    eps: float = 1e-8
    """AdamW epsilon"""
    warmup_steps: int = 100
    """optimizer steps of linear warmup"""
    decay_steps: Optional[int] = None
    """step where cosine decay reaches min_lr; null = the last step of the run"""
    min_lr: float = 1e-4
    """learning-rate floor after decay"""

    def __post_init__(self) -> None:
        if self.learning_rate <= 0:
            raise UsageError(f"optimizer_config.learning_rate must be positive, got {self.learning_rate}")
        if self.weight_decay < 0:
            raise UsageError(f"optimizer_config.weight_decay must be >= 0, got {self.weight_decay}")
        for name in ("beta1", "beta2"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise UsageError(f"optimizer_config.{name} must be in [0, 1), got {getattr(self, name)}")
        if self.warmup_steps < 0:
            raise UsageError(f"optimizer_config.warmup_steps must be >= 0, got {self.warmup_steps}")
        if self.decay_steps is not None and self.decay_steps <= self.warmup_steps:
            # Otherwise the schedule would warm up to the peak and then drop straight to min_lr, with no decay.
            raise UsageError(f"optimizer_config.decay_steps ({self.decay_steps}) must be larger than "
                             f"optimizer_config.warmup_steps ({self.warmup_steps}), or null")
        if not 0.0 <= self.min_lr <= self.learning_rate:
            raise UsageError(
                f"optimizer_config.min_lr must be in [0, learning_rate={self.learning_rate}], got {self.min_lr}"
            )


class AdamW(torch.optim.AdamW):
    """torch's AdamW, minus an import: torch.optim.Optimizer wraps step, zero_grad, add_param_group, state_dict and
    load_state_dict (`_use_grad_for_differentiable`, `@torch._disable_dynamo` in torch/optim/optimizer.py) so that
    a compiled region never traces them, and the wrappers import torch._dynamo at their first call: 1.2-2 s, a
    quarter of a short run's start, in a process that compiles nothing. These methods call the functions inside
    the wrappers (`inspect.unwrap`, through functools' `__wrapped__`), as the wrappers themselves do outside a
    compiled region: the same arithmetic and state_dict (tests/test_optim.py). The optimizer is never compiled
    here (`compile` compiles the model), so nothing is lost. A torch whose methods carry no `__wrapped__` gets its
    own methods, wrappers and all."""

    def step(self, closure: Optional[Callable[[], float]] = None) -> Optional[float]:
        with torch.set_grad_enabled(self.defaults["differentiable"]):  # what _use_grad_for_differentiable does
            return _STEP(self, closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        _ZERO_GRAD(self, set_to_none)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        _ADD_PARAM_GROUP(self, param_group)

    def state_dict(self) -> dict[str, Any]:
        return _STATE_DICT(self)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        _LOAD_STATE_DICT(self, state_dict)


# The functions inside torch's wrappers, found once (not on every step).
_STEP = inspect.unwrap(torch.optim.AdamW.step)
_ZERO_GRAD = inspect.unwrap(torch.optim.Optimizer.zero_grad)
_ADD_PARAM_GROUP = inspect.unwrap(torch.optim.Optimizer.add_param_group)
_STATE_DICT = inspect.unwrap(torch.optim.Optimizer.state_dict)
_LOAD_STATE_DICT = inspect.unwrap(torch.optim.Optimizer.load_state_dict)


def build_optimizer(model: GPT, cfg: OptimizerConfig) -> AdamW:
    """AdamW over the model's decay/no-decay groups, with the fused kernel on CUDA and CPU alike: one pass over
    each parameter's memory per step instead of ~10 (README, Benchmarks); the same algorithm and state_dict."""
    return AdamW(
        model.param_groups(cfg.weight_decay),
        lr=cfg.learning_rate,
        betas=(cfg.beta1, cfg.beta2),
        eps=cfg.eps,
        fused=True,
    )


def learning_rate(step: int, cfg: OptimizerConfig, total_steps: int) -> float:
    """Learning rate for optimizer step `step` (0-based): linear warmup, cosine decay to min_lr, then flat."""
    if step < cfg.warmup_steps:
        return cfg.learning_rate * (step + 1) / (cfg.warmup_steps + 1)
    decay_steps = cfg.decay_steps if cfg.decay_steps is not None else total_steps
    if step >= decay_steps:
        return cfg.min_lr
    progress = (step - cfg.warmup_steps) / max(1, decay_steps - cfg.warmup_steps)
    return cfg.min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (cfg.learning_rate - cfg.min_lr)
