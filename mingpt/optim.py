"""The optimizers of a run and their schedule, from `OptimizerConfig`.

    >>> optimizers = build_optimizer(model, OptimizerConfig(name="muon"))   # an `Optimizers`: Muon + AdamW
    >>> optimizers.schedule(step, lr_factor(step, 5000, cfg))
    >>> optimizers.step(scaler); optimizers.zero_grad()

`adamw` (the default) is torch's AdamW over the whole model. `muon` is torch's Muon on the blocks' 2-D matrices and
AdamW on everything else (embeddings, head, norms, biases), as the modded-nanoGPT speedrun splits them. The schedule
is a factor of each parameter group's own peak rate: linear warm-up, then cosine decay, or warm-up-stable-decay.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Optional, Sequence

import torch
import torch.nn as nn

from mingpt import compat
from mingpt.errors import UsageError

OPTIMIZERS = ("adamw", "muon")
BIGRAM_TABLE = "transformer.bigram.weight"  # model.py's bigram embedding (gpt_config.bigram_embedding)
SCHEDULES = ("cosine", "wsd")


@dataclass
class OptimizerConfig:
    """The optimizers' hyper-parameters and the learning-rate schedule."""

    name: str = "adamw"
    """adamw | muon (torch.optim.Muon on the blocks' 2-D matrices, AdamW on embeddings, head, norms and biases)"""
    learning_rate: float = 1e-3
    """AdamW's peak learning rate (under muon: the embeddings', head's, norms' and biases'), reached after warmup"""
    weight_decay: float = 0.1
    """AdamW weight decay on matrices and embeddings (not biases or LayerNorm)"""
    beta1: float = 0.9
    """AdamW first-moment decay"""
    beta2: float = 0.99
    """AdamW second-moment decay

    0.99 rather than 0.999: few tokens per step."""
    eps: float = 1e-8
    """AdamW epsilon"""
    schedule: str = "cosine"
    """cosine | wsd (warmup-stable-decay: warmup, constant, then linear decay over the last decay_fraction)"""
    warmup_steps: int = 100
    """optimizer steps of linear warmup"""
    decay_steps: Optional[int] = None
    """step where the decay reaches min_lr; null = the last step of the run"""
    decay_fraction: float = 0.3
    """wsd: the fraction of the steps up to decay_steps over which the rate falls linearly to min_lr"""
    min_lr: float = 1e-4
    """learning-rate floor after decay (every group falls to the same fraction min_lr / learning_rate of its peak)"""
    bigram_lr_scale: float = 10.0
    """gpt_config.bigram_embedding: the table's peak rate as a multiple of learning_rate (AdamW, under muon too)

    Each pair's row learns only from the positions where that pair occurs: a larger rate than the rest's pays."""
    bigram_weight_decay: float = 0.1
    """gpt_config.bigram_embedding: AdamW weight decay on the table"""
    muon_learning_rate: float = 0.02
    """muon: peak learning rate of the blocks' matrices (torch's Muon scales it by sqrt(max(1, rows / columns)))"""
    muon_momentum: float = 0.95
    """muon: momentum, reached after muon_momentum_warmup_steps"""
    muon_momentum_start: float = 0.85
    """muon: momentum at step 0, raised linearly to muon_momentum"""
    muon_momentum_warmup_steps: int = 300
    """muon: optimizer steps over which the momentum rises from muon_momentum_start; 0 = none"""
    muon_weight_decay: float = 0.0
    """muon: decoupled weight decay on the blocks' matrices (torch's default is 0.1; the speedrun found 0 best)"""
    muon_ns_steps: int = 5
    """muon: Newton-Schulz iterations that orthogonalise each update"""

    def __post_init__(self) -> None:
        self._check_choices()
        self._check_rates()
        if self.decay_steps is not None and self.decay_steps <= self.warmup_steps:
            # Otherwise the schedule would warm up to the peak and then drop straight to min_lr, with no decay.
            raise UsageError(f"optimizer_config.decay_steps ({self.decay_steps}) must be larger than "
                             f"optimizer_config.warmup_steps ({self.warmup_steps}), or null")

    def _check_choices(self) -> None:
        for name, choices in (("name", OPTIMIZERS), ("schedule", SCHEDULES)):
            if getattr(self, name) not in choices:
                raise UsageError(f"optimizer_config.{name} must be one of {', '.join(choices)}, "
                                 f"got {getattr(self, name)!r}")

    def _check_rates(self) -> None:
        for name in ("learning_rate", "muon_learning_rate", "muon_ns_steps", "bigram_lr_scale"):
            if getattr(self, name) <= 0:
                raise UsageError(f"optimizer_config.{name} must be positive, got {getattr(self, name)}")
        for name in ("weight_decay", "muon_weight_decay", "bigram_weight_decay", "warmup_steps",
                     "muon_momentum_warmup_steps"):
            if getattr(self, name) < 0:
                raise UsageError(f"optimizer_config.{name} must be >= 0, got {getattr(self, name)}")
        for name in ("beta1", "beta2", "muon_momentum", "muon_momentum_start"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise UsageError(f"optimizer_config.{name} must be in [0, 1), got {getattr(self, name)}")
        if not 0.0 < self.decay_fraction <= 1.0:
            raise UsageError(f"optimizer_config.decay_fraction must be in (0, 1], got {self.decay_fraction}")
        if not 0.0 <= self.min_lr <= self.learning_rate:
            raise UsageError(
                f"optimizer_config.min_lr must be in [0, learning_rate={self.learning_rate}], got {self.min_lr}"
            )


# ----------------------------------------------------------------------------------------------- the schedule
def learning_rate(step: int, cfg: OptimizerConfig, total_steps: int) -> float:
    """AdamW's learning rate for optimizer step `step` (0-based): linear warmup, the decay, then flat at min_lr."""
    if step < cfg.warmup_steps:
        return cfg.learning_rate * (step + 1) / (cfg.warmup_steps + 1)
    end = cfg.decay_steps if cfg.decay_steps is not None else total_steps
    if step >= end:
        return cfg.min_lr
    if cfg.schedule == "wsd":
        decay_start = max(cfg.warmup_steps, end - round(cfg.decay_fraction * end))
        progress = max(0.0, (step - decay_start) / max(1, end - decay_start))
        return cfg.learning_rate - progress * (cfg.learning_rate - cfg.min_lr)
    progress = (step - cfg.warmup_steps) / max(1, end - cfg.warmup_steps)
    return cfg.min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (cfg.learning_rate - cfg.min_lr)


def lr_factor(step: int, total_steps: int, cfg: OptimizerConfig) -> float:
    """The schedule as a fraction of each group's own peak rate (1.0 at the peak): the trainer's `lr_schedule`,
    as `functools.partial(lr_factor, cfg=cfg)`."""
    return learning_rate(step, cfg, total_steps) / cfg.learning_rate


def muon_momentum(step: int, cfg: OptimizerConfig) -> float:
    """Muon's momentum at `step`: raised linearly from muon_momentum_start, as the speedrun warms it."""
    if step >= cfg.muon_momentum_warmup_steps:
        return cfg.muon_momentum
    fraction = step / cfg.muon_momentum_warmup_steps
    return cfg.muon_momentum_start + fraction * (cfg.muon_momentum - cfg.muon_momentum_start)


# ----------------------------------------------------------------------------------------------- the container
class Optimizers:
    """The optimizers of a run used as one: the loop schedules, unscales, steps and zeroes them without knowing how
    many there are. Each is paired with the module whose parameters it updates (a pipeline stage each), which is
    how its state is named in a snapshot. Peak rates are kept here, not in the groups: a resumed snapshot's groups
    carry the rate of the step it was saved at."""

    def __init__(self, parts: Sequence[tuple[nn.Module, torch.optim.Optimizer]],
                 momentum: Optional[Callable[[int], float]] = None) -> None:
        self.parts = list(parts)
        self.optimizers = [optimizer for _, optimizer in self.parts]
        self.peak_lrs = [group["lr"] for group in self.param_groups]
        self.momentum = momentum  # Muon's momentum by step, for groups that have one

    @classmethod
    def merged(cls, containers: Iterable[Optimizers]) -> Optimizers:
        """Several containers as one (one per pipeline stage); the same momentum rule."""
        containers = list(containers)
        return cls([part for container in containers for part in container.parts], containers[0].momentum)

    @property
    def param_groups(self) -> list[dict]:
        """Every optimizer's groups (the dicts themselves: setting a rate here sets it there)."""
        return [group for optimizer in self.optimizers for group in optimizer.param_groups]

    @property
    def state(self) -> dict:
        return {param: state for optimizer in self.optimizers for param, state in optimizer.state.items()}

    def by_module(self) -> list[tuple[nn.Module, list[torch.optim.Optimizer]]]:
        """The modules in order, each with the optimizers of its parameters."""
        grouped: dict[int, tuple[nn.Module, list[torch.optim.Optimizer]]] = {}
        for module, optimizer in self.parts:
            grouped.setdefault(id(module), (module, []))[1].append(optimizer)
        return list(grouped.values())

    def schedule(self, step: int, factor: float) -> None:
        """Every group at `factor` of its peak rate, and Muon's momentum at its value for `step`."""
        for group, peak in zip(self.param_groups, self.peak_lrs):
            group["lr"] = peak * factor
            if self.momentum is not None and "momentum" in group:
                group["momentum"] = self.momentum(step)

    def unscale(self, scaler: torch.amp.GradScaler) -> None:
        for optimizer in self.optimizers:
            scaler.unscale_(optimizer)

    @property
    def skip_on_device(self) -> bool:
        """Whether every optimizer can skip a step on the device (fused AdamW; not Muon)."""
        return all(compat.skips_on_device(optimizer) for optimizer in self.optimizers)

    def step(self, scaler: Optional[torch.amp.GradScaler] = None, skip: Optional[torch.Tensor] = None) -> None:
        """Each optimizer's step: through the fp16 scaler when one is given (skipped on an overflow), or with `skip`
        (a flag on the device, 1: skip; only where `skip_on_device`) skipped without the host reading it."""
        for optimizer in self.optimizers:
            if skip is not None:
                compat.step_unless(optimizer, skip)
            elif scaler is None:
                optimizer.step()
            else:
                scaler.step(optimizer)

    def zero_grad(self, set_to_none: bool = True) -> None:
        for optimizer in self.optimizers:
            optimizer.zero_grad(set_to_none=set_to_none)


def as_optimizers(optimizer: Any, module: nn.Module) -> Optimizers:
    """A torch optimizer (tests, benchmarks) in a container of one; a container as it is."""
    return optimizer if isinstance(optimizer, Optimizers) else Optimizers([(module, optimizer)])


# ----------------------------------------------------------------------------------------------- building
def check_optimizer_fits(cfg: OptimizerConfig, amp_dtype: torch.dtype) -> None:
    """Muon with fp16's loss scaling is refused: the scaler decides per optimizer whether an overflow skips its
    step, so Muon and AdamW could part ways; Muon's Newton-Schulz runs in bf16 anyway."""
    if cfg.name == "muon" and amp_dtype == torch.float16:
        raise UsageError("optimizer_config.name=muon does not run in fp16 (trainer_config.mixed_precision resolved "
                         "to fp16): use bf16 or fp32, or optimizer_config.name=adamw")


def build_optimizer(model: nn.Module, cfg: OptimizerConfig) -> Optimizers:
    """The optimizers of `model` (a GPT, a pipeline stage of one, or either sharded) that `cfg.name` says."""
    if cfg.name == "muon":
        return build_muon(model, cfg)
    return Optimizers([(model, adamw(adamw_groups(model, model.named_parameters(), cfg), cfg))])


def adamw(groups: list[dict], cfg: OptimizerConfig) -> torch.optim.AdamW:
    """torch's AdamW with the fused kernel on CUDA and CPU alike (CPU since torch 2.4): one pass over each
    parameter's memory per step instead of ~10; the same algorithm and state_dict."""
    return torch.optim.AdamW(groups, lr=cfg.learning_rate, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, fused=True)


def decay_groups(named: Iterable[tuple[str, nn.Parameter]], weight_decay: float) -> list[dict]:
    """AdamW groups: decay the matrices (linear weights, embeddings), not biases or norm gains."""
    params = [p for _, p in named if p.requires_grad]
    return [{"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]


def adamw_groups(model: nn.Module, named: Iterable[tuple[str, nn.Parameter]], cfg: OptimizerConfig) -> list[dict]:
    """AdamW's groups of `named` (parameters of `model`): `decay_groups`, and, where the model's config has a bigram
    embedding, a third group for its table at bigram_lr_scale times the rate (empty on a pipeline stage without the
    table, so that every stage has the same groups). A model without the option has the two groups it always had."""
    named = list(named)
    if not getattr(getattr(model, "config", None), "bigram_embedding", False):
        return decay_groups(named, cfg.weight_decay)
    table = [p for name, p in named if name.endswith(BIGRAM_TABLE) and p.requires_grad]
    groups = decay_groups([(name, p) for name, p in named if not name.endswith(BIGRAM_TABLE)], cfg.weight_decay)
    return [*groups, {"params": table, "weight_decay": cfg.bigram_weight_decay,
                      "lr": cfg.learning_rate * cfg.bigram_lr_scale}]


def is_hidden_matrix(name: str, param: nn.Parameter) -> bool:
    """A block's 2-D weight (attention and MLP projections): what Muon updates. Embeddings and the head stay on
    AdamW: a lookup table and the output layer are not the hidden linear maps Muon's orthogonalisation suits."""
    return name.startswith("transformer.h.") and param.dim() == 2


def build_muon(model: nn.Module, cfg: OptimizerConfig) -> Optimizers:
    """torch's Muon on the blocks' matrices, AdamW on the rest. Groups exist even where empty (a pipeline stage
    with no blocks), so that every stage's optimizers have the same groups in the same order."""
    from mingpt.compat import check_muon_available

    check_muon_available()
    named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    hidden = [p for name, p in named if is_hidden_matrix(name, p)]
    rest = [(name, p) for name, p in named if not is_hidden_matrix(name, p)]
    muon = MeshMuon([{"params": hidden}], lr=cfg.muon_learning_rate, weight_decay=cfg.muon_weight_decay,
                    momentum=cfg.muon_momentum, nesterov=True, ns_steps=cfg.muon_ns_steps)
    return Optimizers([(model, adamw(adamw_groups(model, rest, cfg), cfg)), (model, muon)],
                      momentum=lambda step: muon_momentum(step, cfg))


def _muon_class() -> type:
    """torch.optim.Muon (torch 2.9+), looked up when a run asks for it: importing this module must not need it."""
    return torch.optim.Muon


class MeshMuon(torch.optim.Optimizer):
    """torch's Muon, for parameters that may be DTensors (FSDP shards, tensor-parallel pieces).

    Muon orthogonalises each matrix's update, which a shard is not: orthogonalising the pieces gives another
    update (measured: 9e-3 off after 3 steps of a sharded 32 x 16 matrix). So a DTensor's gradient and momentum are
    gathered whole, torch's Muon runs on the whole matrix (every rank the same work, as under DDP), and each rank
    keeps its part of the update and of the momentum. Plain tensors take torch's Muon as it is."""

    def __init__(self, params: Any, **settings: Any) -> None:
        self.inner = _muon_class()(params, **settings)  # torch's own checks (2-D only) and its step for plain tensors
        super().__init__(self.inner.param_groups, self.inner.defaults)
        # Built after the model is wrapped, so its parameters stay what they are. A DTensor has a device mesh
        # (checked so, as importing torch.distributed.tensor costs every run time).
        self.has_dtensors = any(hasattr(p, "device_mesh") for group in self.param_groups for p in group["params"])

    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], float]] = None) -> Optional[float]:
        if not self.has_dtensors:
            # torch's Muon on this optimizer's groups and state (load_state_dict replaces both objects)
            self.inner.param_groups, self.inner.state = self.param_groups, self.state
            return self.inner.step(closure)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is not None:
                    self._step_whole(param, group)
        return loss

    def _step_whole(self, param: torch.Tensor, group: dict) -> None:
        """Collective over the parameter's mesh. One DTensor matrix's Muon step, computed on the whole matrix."""
        state = self.state[param]
        whole = torch.zeros(param.shape, dtype=param.dtype, device=param.grad.device)  # receives the update
        whole.grad = param.grad.full_tensor()
        settings = {key: group[key] for key in ("lr", "momentum", "nesterov", "ns_steps", "eps", "ns_coefficients",
                                                "adjust_lr_fn")}
        muon = _muon_class()([whole], weight_decay=0.0, **settings)  # decay below, on the parameter itself
        if "momentum_buffer" in state:
            muon.state[whole]["momentum_buffer"] = state["momentum_buffer"].full_tensor()
        muon.step()
        state["momentum_buffer"] = like(muon.state[whole]["momentum_buffer"], param)
        param.mul_(1 - group["lr"] * group["weight_decay"])  # torch's Muon decays before it updates
        param.add_(like(whole, param))


def like(whole: torch.Tensor, template: torch.Tensor) -> torch.Tensor:
    """A whole tensor, identical on every rank, as a DTensor placed like `template`: each rank keeps its own part
    (taken locally: Replicate to Shard moves no data)."""
    from torch.distributed.tensor import DTensor, Replicate

    mesh = template.device_mesh
    replicated = DTensor.from_local(whole, mesh, [Replicate()] * mesh.ndim, run_check=False)
    return replicated.redistribute(mesh, template.placements)
