"""AdamW and its learning-rate schedule (linear warmup, then cosine decay to a floor), from `OptimizerConfig`.

    >>> opt = build_optimizer(model, OptimizerConfig())
    >>> lr = learning_rate(step, OptimizerConfig(), total_steps=5000)
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

from mingpt.errors import UsageError
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


def build_optimizer(model: GPT, cfg: OptimizerConfig) -> torch.optim.AdamW:
    """torch's AdamW over the model's decay/no-decay groups, with the fused kernel on CUDA and CPU alike (CPU since
    torch 2.4): one pass over each parameter's memory per step instead of ~10; the same algorithm and state_dict."""
    return torch.optim.AdamW(
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
