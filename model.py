"""A GPT-2-style decoder-only transformer for character-level language modelling.

This module is only the model: it knows nothing of ranks, devices, files or Hydra.

    >>> from model import GPT, GPTConfig
    >>> gpt = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, vocab_size=65, block_size=64))
    >>> logits, loss = gpt(idx, targets)          # idx, targets: (batch, time) int64
    >>> text_ids = gpt.generate(prompt_ids, max_new_tokens=100, temperature=0.8, top_k=40)
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from mingpt.errors import UsageError

ATTENTION_IMPLEMENTATIONS = ("auto", "sdpa", "matmul")


@dataclass
class GPTConfig:
    """Shape of the network. `vocab_size` and `block_size` come from the data and are filled in by main.py."""

    n_layer: int = 6
    """number of transformer blocks"""
    n_head: int = 6
    """attention heads per block; must divide n_embd"""
    n_embd: int = 384
    """width of the residual stream"""
    dropout: float = 0.2
    """dropout on attention weights, residual branches and embeddings"""
    bias: bool = False
    """biases in Linear and LayerNorm layers

    GPT-2 had them; without is slightly faster and as good."""
    attention: str = "auto"
    """auto (matmul on a CPU in bf16 at short contexts) | sdpa (torch's fused kernels) | matmul (scores written out)

    The same function either way. "sdpa": torch's fused scaled_dot_product_attention (flash kernels on GPU and
    CPU, memory linear in the context). "matmul": the (T x T) score matrix written out as matmuls and a softmax,
    which torch.compile fuses; faster on a CPU for short contexts (docs/cpu.md). "auto": the training run picks
    (trainer.resolve_attention); a model built with "auto" as it is runs sdpa."""
    vocab_size: Optional[int] = None
    """set from the data; leave null"""
    block_size: Optional[int] = None
    """set from data_config.block_size; leave null"""

    def __post_init__(self) -> None:
        for name in ("n_layer", "n_head", "n_embd"):
            if getattr(self, name) <= 0:
                raise UsageError(f"gpt_config.{name} must be positive, got {getattr(self, name)}")
        if self.n_embd % self.n_head != 0:
            raise UsageError(
                f"gpt_config.n_embd ({self.n_embd}) must be divisible by gpt_config.n_head ({self.n_head})"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise UsageError(f"gpt_config.dropout must be in [0, 1), got {self.dropout}")
        if self.attention not in ATTENTION_IMPLEMENTATIONS:
            raise UsageError(
                f"gpt_config.attention must be one of {', '.join(ATTENTION_IMPLEMENTATIONS)}, got {self.attention!r}"
            )


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention where position t only attends to positions <= t."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.head_dim = cfg.n_embd // cfg.n_head
        self.dropout = cfg.dropout
        self.attention = cfg.attention
        if cfg.attention == "matmul":
            # Added to the scores: -inf above the diagonal. Not part of the state_dict (it is not learned).
            future = torch.full((cfg.block_size, cfg.block_size), float("-inf")).triu(1)
            self.register_buffer("causal_bias", future, persistent=False)
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias)  # q, k, v in one matmul
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.resid_dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self._heads(x)
        time = x.size(1)
        dropout_p = self.dropout if self.training else 0.0
        if self.attention == "matmul":
            y = causal_attention_matmul(q, k, v, self.causal_bias[:time, :time], dropout_p)
        else:
            y = causal_attention_sdpa(q, k, v, dropout_p)
        return self.resid_dropout(self._merge(y))

    def extend(self, x: torch.Tensor, cache: dict) -> torch.Tensor:
        """Inference: the output for positions appended to those whose keys and values `cache` holds (it keeps
        them); an empty cache starts at position 0. Positions attend causally, as in `forward`."""
        q, k, v = self._heads(x)
        if cache:  # one new position, which sees every cached one
            k, v = torch.cat((cache["k"], k), dim=2), torch.cat((cache["v"], v), dim=2)
        cache["k"], cache["v"] = k, v
        return self._merge(F.scaled_dot_product_attention(q, k, v, is_causal=x.size(1) > 1))

    def _heads(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v of x (B, T, C) in one matmul, each as (B, heads, T, head_dim). The heads are counted from the
        projection's width, not n_head: a tensor-parallel rank's c_attn yields the q, k and v of its own heads."""
        batch, time, _ = x.shape
        q, k, v = self.c_attn(x).chunk(3, dim=2)
        return tuple(t.view(batch, time, -1, self.head_dim).transpose(1, 2) for t in (q, k, v))

    def _merge(self, y: torch.Tensor) -> torch.Tensor:
        """The heads' outputs (B, heads, T, head_dim) back to (B, T, C), through the output projection."""
        batch, _, time, _ = y.shape
        return self.c_proj(y.transpose(1, 2).contiguous().view(batch, time, -1))


def causal_attention_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float) -> torch.Tensor:
    """softmax(q k^T / sqrt(d) + causal mask) v, by torch's fused kernel; q, k, v: (batch, heads, time, head_dim)."""
    # is_causal=True builds the mask inside the kernel. (PyTorch's minGPT-DDP example passes a float mask of ones to
    # nn.MultiheadAttention, which *adds* it to the scores, so nothing is masked and the model sees the future.)
    return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True)


def causal_attention_matmul(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal_bias: torch.Tensor, dropout_p: float
) -> torch.Tensor:
    """The same function as `causal_attention_sdpa`, with the score matrix written out; causal_bias: (T, T), 0 on
    and below the diagonal, -inf above.

    Why: torch's CPU flash-attention backward gains nothing from a second thread at short contexts (2.6 ms on one
    thread, 2.9 ms on two, for 12 x 4 heads x 64 x 32 here), while batched matmuls use both. Under torch.compile the
    scaling rides on the copy of q the matmul needs anyway, and bias and softmax fuse into one loop. Measured against
    masking with masked_fill on a mask built in the graph, which was 3% slower than sdpa instead of 3% faster.
    Costs (batch x heads x T x T) activations per layer, so it suits short contexts, not GPU-sized ones.
    """
    scores = (q * q.size(-1) ** -0.5) @ k.transpose(-2, -1)
    weights = torch.softmax(scores + causal_bias, dim=-1)
    if dropout_p > 0:
        weights = F.dropout(weights, p=dropout_p)
    return weights @ v


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=cfg.bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    """Pre-LayerNorm transformer block, as in GPT-2."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        if not cfg.vocab_size or not cfg.block_size:
            raise ValueError("GPTConfig.vocab_size and block_size must be set from the data before building GPT")
        self.config = cfg
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(cfg.vocab_size, cfg.n_embd),
                wpe=nn.Embedding(cfg.block_size, cfg.n_embd),
                drop=nn.Dropout(cfg.dropout),
                h=nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer)),
                ln_f=nn.LayerNorm(cfg.n_embd, bias=cfg.bias),
            )
        )
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        # Weight tying (as GPT-2): the output projection shares the token embedding matrix.
        self.transformer.wte.weight = self.lm_head.weight
        self.apply(self._init_weights)
        # GPT-2 scales the residual projections by 1/sqrt(2 * n_layer) so the residual stream's variance does not
        # grow with depth (two residual additions per block).
        for name, param in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(param, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def num_params(self, exclude_position_embedding: bool = False) -> int:
        """Parameter count (the tied embedding counted once)."""
        n = sum(p.numel() for p in self.parameters())
        if exclude_position_embedding:
            n -= self.transformer.wpe.weight.numel()
        return n

    def forward(
        self, idx: torch.Tensor, targets: Optional[torch.Tensor] = None
    ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """Logits for every position, and the mean cross-entropy against `targets` when given."""
        _, time = idx.shape
        if time > self.config.block_size:
            raise ValueError(f"sequence length {time} exceeds block_size {self.config.block_size}")
        pos = torch.arange(time, device=idx.device)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        for block in self.transformer.h:
            x = block(x)
        logits = self.lm_head(self.transformer.ln_f(x))
        if targets is None:
            return logits, None
        # The loss is computed in fp32 even under autocast: log-softmax over the vocabulary is where low
        # precision hurts most.
        loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1))
        return logits, loss

    def param_groups(self, weight_decay: float) -> list[dict]:
        """AdamW parameter groups: decay the matrices (linear weights, embeddings), not biases or LayerNorm gains."""
        params = [p for p in self.parameters() if p.requires_grad]
        decay = [p for p in params if p.dim() >= 2]
        no_decay = [p for p in params if p.dim() < 2]
        return [
            {"params": decay, "weight_decay": weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ]

    @torch.no_grad()
    def generate(
        self,
        idx: torch.Tensor,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_k: Optional[int] = None,
        generator: Optional[torch.Generator] = None,
    ) -> torch.Tensor:
        """Extend `idx` (batch, time) by `max_new_tokens` sampled tokens; call in eval() mode.

        temperature < 1 sharpens the distribution, > 1 flattens it; top_k keeps only the k likeliest tokens.
        Pass a seeded `generator` for a reproducible sample.
        """
        if temperature <= 0:
            raise ValueError(f"temperature must be positive, got {temperature}")
        caches: list[dict] = []
        for _ in range(max_new_tokens):
            if self.training:  # dropout on (generation is meant for eval mode): the plain forward
                logits = self(idx[:, -self.config.block_size :])[0][:, -1:]
            elif not caches or idx.size(1) > self.config.block_size:  # the window moved: every position changed
                caches = [{} for _ in self.transformer.h]
                logits = self._extend(idx[:, -self.config.block_size :], caches, start=0)
            else:  # the new token only: keys and values of the others are cached
                logits = self._extend(idx[:, -1:], caches, start=idx.size(1) - 1)
            logits = logits[:, -1, :].float() / temperature
            if top_k is not None:
                kth_best = torch.topk(logits, min(top_k, logits.size(-1))).values[:, [-1]]
                logits = logits.masked_fill(logits < kth_best, float("-inf"))
            probs = F.softmax(logits, dim=-1)
            next_id = torch.multinomial(probs, num_samples=1, generator=generator)
            idx = torch.cat((idx, next_id), dim=1)
        return idx

    def _extend(self, idx: torch.Tensor, caches: list[dict], start: int) -> torch.Tensor:
        """Inference (`generate`): the logits of the last of `idx`'s positions, which start at position `start`,
        with each block's keys and values cached in `caches` (the same function as `forward`, without dropout)."""
        pos = torch.arange(start, start + idx.size(1), device=idx.device)
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)
        for block, cache in zip(self.transformer.h, caches):
            x = x + block.attn.extend(block.ln_1(x), cache)
            x = x + block.mlp(block.ln_2(x))
        return self.lm_head(self.transformer.ln_f(x[:, -1:]))

    def flops_per_token(self) -> int:
        """Training FLOPs per token: 6 per parameter (forward + backward), plus the attention score/value matmuls.

        Follows the PaLM appendix B accounting: 6N + 12 * n_layer * n_embd * block_size.
        """
        cfg = self.config
        return 6 * self.num_params(exclude_position_embedding=True) + 12 * cfg.n_layer * cfg.n_embd * cfg.block_size
