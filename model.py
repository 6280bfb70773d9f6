"""A GPT-2-style decoder-only transformer for character-level language modelling.

This module is only the model: it knows nothing of ranks, devices, files or Hydra.

    >>> from model import GPT, GPTConfig
    >>> gpt = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, vocab_size=65, block_size=64))
    >>> logits, loss = gpt(idx, targets)          # idx, targets: (batch, time) int64
    >>> text_ids = gpt.generate(prompt_ids, max_new_tokens=100, temperature=0.8, top_k=40)
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from mingpt.errors import UsageError

ATTENTION_IMPLEMENTATIONS = ("auto", "sdpa", "matmul")
POSITIONS = ("learned", "rotary")
NORMS = ("layernorm", "rmsnorm")
ACTIVATIONS = ("gelu", "gelu_tanh", "relu2")
MAX_BIGRAM_VOCAB = 1024  # bigram_embedding: vocab_size * (vocab_size + 1) rows, about a million at most


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
    positions: str = "learned"
    """learned (a position embedding, GPT-2) | rotary (RoPE: q and k rotated by their position; no wpe)"""
    rope_base: float = 10000.0
    """rotary positions: the base of the rotation frequencies, pair i turning by position * rope_base^(-2i/head_dim)"""
    norm: str = "layernorm"
    """layernorm (GPT-2) | rmsnorm (torch's RMSNorm: no mean subtracted, a gain and no bias)"""
    activation: str = "gelu"
    """the MLP's nonlinearity: gelu (exact, erf) | gelu_tanh (GPT-2's tanh approximation) | relu2 (ReLU squared)

    gelu_tanh is what OpenAI's GPT-2 weights were trained with (a model started from them gets it from the
    folder); relu2 is the modded-nanogpt speedrun's."""
    qk_norm: bool = False
    """RMS-normalise each head's q and k before attention (no parameters)"""
    tie_embeddings: bool = True
    """the output head shares the token embedding's matrix (GPT-2); false: the head has a weight of its own"""
    logit_softcap: Optional[float] = None
    """when set, logits = cap * tanh(logits / cap), in training and generation; null = off"""
    zero_init_proj: bool = False
    """zero-initialise the residual output projections (attention's and the MLP's c_proj); false: GPT-2's scaled init"""
    bigram_embedding: bool = False
    """add a learned embedding of each (previous token, token) pair to the token's (vocabularies up to 1,024 tokens)

    vocab_size x (vocab_size + 1) rows, zero-initialised: the modded-nanogpt speedrun's bigram embedding, unhashed.
    The previous character at the cost of a lookup, leaving attention the longer range."""
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
        for name, choices in (("attention", ATTENTION_IMPLEMENTATIONS), ("positions", POSITIONS), ("norm", NORMS),
                              ("activation", ACTIVATIONS)):
            if getattr(self, name) not in choices:
                raise UsageError(f"gpt_config.{name} must be one of {', '.join(choices)}, got {getattr(self, name)!r}")
        self._check_options()

    def _check_options(self) -> None:
        """The settings that shape one of the options: each refused in one line."""
        if self.bigram_embedding and self.vocab_size is not None and self.vocab_size > MAX_BIGRAM_VOCAB:
            raise UsageError(f"gpt_config.bigram_embedding=true needs a vocabulary of at most {MAX_BIGRAM_VOCAB} "
                             f"tokens (a row per pair of them), got {self.vocab_size}")
        if self.positions == "rotary" and (self.n_embd // self.n_head) % 2:
            raise UsageError(f"gpt_config.positions=rotary needs an even head size (n_embd / n_head), got "
                             f"{self.n_embd // self.n_head}: it rotates q and k in pairs")
        if not self.rope_base > 1.0:
            raise UsageError(f"gpt_config.rope_base must be greater than 1, got {self.rope_base}")
        if self.logit_softcap is not None and not self.logit_softcap > 0:
            raise UsageError(f"gpt_config.logit_softcap must be positive or null, got {self.logit_softcap}")

    @property
    def norm_eps(self) -> Optional[float]:
        """The norms' epsilon: nn.LayerNorm's default 1e-5; None for RMSNorm, which torch then takes as the input
        dtype's machine epsilon."""
        return None if self.norm == "rmsnorm" else 1e-5


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention where position t only attends to positions <= t."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.head_dim = cfg.n_embd // cfg.n_head
        self.dropout = cfg.dropout
        self.attention = cfg.attention
        self.qk_norm = cfg.qk_norm
        self.rope_base = cfg.rope_base if cfg.positions == "rotary" else None  # None: positions come from wpe
        if cfg.attention == "matmul":
            # Added to the scores: -inf above the diagonal. Not part of the state_dict (it is not learned).
            self.register_buffer("causal_bias", causal_bias(cfg.block_size), persistent=False)
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias)  # q, k, v in one matmul
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.resid_dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self._heads(x, start=0)
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
        q, k, v = self._heads(x, start=cache["k"].size(2) if cache else 0)
        if cache:  # one new position, which sees every cached one
            k, v = torch.cat((cache["k"], k), dim=2), torch.cat((cache["v"], v), dim=2)
        cache["k"], cache["v"] = k, v
        return self._merge(F.scaled_dot_product_attention(q, k, v, is_causal=x.size(1) > 1))

    def _heads(self, x: torch.Tensor, start: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v of x (B, T, C), whose positions start at `start`, in one matmul, each as (B, heads, T, head_dim),
        q and k normalised and rotated where the options say. The heads are counted from the projection's width, not
        n_head: a tensor-parallel rank's c_attn yields the q, k and v of its own heads."""
        batch, time, _ = x.shape
        q, k, v = (t.view(batch, time, -1, self.head_dim).transpose(1, 2) for t in self.c_attn(x).chunk(3, dim=2))
        if self.qk_norm:  # parameter-free: bounds the scores whatever the weights grow to
            q, k = F.rms_norm(q, (self.head_dim,)), F.rms_norm(k, (self.head_dim,))
        if self.rope_base is not None:
            cos, sin = rotary_angles(start, time, self.head_dim, self.rope_base, q.device)
            q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        return q, k, v

    def _merge(self, y: torch.Tensor) -> torch.Tensor:
        """The heads' outputs (B, heads, T, head_dim) back to (B, T, C), through the output projection."""
        batch, _, time, _ = y.shape
        return self.c_proj(y.transpose(1, 2).contiguous().view(batch, time, -1))


def rotary_angles(start: int, time: int, head_dim: int, base: float,
                  device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the angles by which rotary embeddings turn positions start ... start + time - 1: pair i of a
    head turns by position * base^(-2i / head_dim). Each (time, head_dim / 2), fp32. Computed where they are used,
    not kept as a buffer: a model built on the meta device and materialised later would hold garbage there, and a few
    hundred sines cost nothing next to the matmuls (torch.compile fuses them)."""
    frequencies = base ** (-torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)
    positions = torch.arange(start, start + time, device=device, dtype=torch.float32)
    angles = torch.outer(positions, frequencies)
    return angles.cos(), angles.sin()


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (..., time, head_dim) with each pair (x_i, x_{i + head_dim/2}) rotated by its angle (RoPE, pairs of the two
    halves): then q_m . k_n depends on the positions through m - n only. In fp32, back in x's dtype."""
    first, second = x.float().chunk(2, dim=-1)
    rotated = torch.cat((first * cos - second * sin, first * sin + second * cos), dim=-1)
    return rotated.to(x.dtype)


def causal_bias(block_size: int) -> torch.Tensor:
    """(T, T): 0 on and below the diagonal, -inf above it (a position does not attend to later ones)."""
    return torch.full((block_size, block_size), float("-inf")).triu(1)


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
    weights = torch.softmax(scores + causal_bias.to(scores.dtype), dim=-1)
    if dropout_p > 0:
        weights = F.dropout(weights, p=dropout_p)
    return weights @ v


def bigram_ids(idx: torch.Tensor, previous: Optional[torch.Tensor], vocab_size: int) -> torch.Tensor:
    """The bigram embedding's row for each token of idx (B, T): previous * vocab_size + token, where previous is the
    token before it; vocab_size * vocab_size + token for the first of a window, whose previous token the model does
    not see (previous None), as in training, where every window starts so."""
    if previous is None:
        previous = torch.full_like(idx[:, :1], vocab_size)
    return torch.cat((previous, idx[:, :-1]), dim=1) * vocab_size + idx


class ReLUSquared(nn.Module):
    """relu(x)^2: the modded-nanogpt speedrun's MLP nonlinearity (sparse like ReLU, smooth at 0 like GELU)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(x).square()


def make_activation(cfg: GPTConfig) -> nn.Module:
    if cfg.activation == "relu2":
        return ReLUSquared()
    return nn.GELU(approximate="tanh" if cfg.activation == "gelu_tanh" else "none")


class LayerNorm(nn.LayerNorm):
    """nn.LayerNorm with its gain and bias applied in the input's dtype: a residual stream in fp32 is normalised in
    fp32 even where the parameters are held in a lower precision (FSDP's bf16 copies under mixed precision), as
    under DDP with autocast, whose parameters are fp32; with fp32 parameters it is nn.LayerNorm."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = None if self.weight is None else self.weight.to(x.dtype)
        bias = None if self.bias is None else self.bias.to(x.dtype)
        return F.layer_norm(x, self.normalized_shape, weight, bias, self.eps)


class RMSNorm(nn.RMSNorm):
    """nn.RMSNorm with its gain applied in the input's dtype, as LayerNorm above."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = None if self.weight is None else self.weight.to(x.dtype)
        return F.rms_norm(x, self.normalized_shape, weight, self.eps)


def make_norm(cfg: GPTConfig) -> nn.Module:
    """A norm over the residual stream's width; either kind names its gain `weight`, so parameter names stay."""
    if cfg.norm == "rmsnorm":
        return RMSNorm(cfg.n_embd, eps=cfg.norm_eps)
    return LayerNorm(cfg.n_embd, eps=cfg.norm_eps, bias=cfg.bias)


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=cfg.bias)
        self.activation = make_activation(cfg)
        self.c_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.activation(self.c_fc(x))))


class Block(nn.Module):
    """Pre-norm transformer block, as in GPT-2."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = make_norm(cfg)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = make_norm(cfg)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """The model. Its initial weights are a function of `seed` and each tensor's name alone (`initial_value`), not
    of the order tensors are drawn in: a model built on the meta device and materialised piece by piece (sharded,
    split into pipeline stages) starts from the weights a whole one gets. `seed` None: one drawn from torch's
    global generator (torch.manual_seed still decides). Built under `torch.device("meta")`, nothing is drawn and
    the caller materialises it with `initial_value`."""

    def __init__(self, cfg: GPTConfig, seed: Optional[int] = None) -> None:
        super().__init__()
        if not cfg.vocab_size or not cfg.block_size:
            raise ValueError("GPTConfig.vocab_size and block_size must be set from the data before building GPT")
        self.config = cfg
        parts: dict[str, nn.Module] = {"wte": nn.Embedding(cfg.vocab_size, cfg.n_embd)}
        if cfg.positions == "learned":  # rotary positions enter in attention, with nothing to learn
            parts["wpe"] = nn.Embedding(cfg.block_size, cfg.n_embd)
        if cfg.bigram_embedding:  # a row per (previous token, token) pair; a window's first token has rows of its own
            parts["bigram"] = nn.Embedding(cfg.vocab_size * (cfg.vocab_size + 1), cfg.n_embd)
        parts["drop"] = nn.Dropout(cfg.dropout)
        parts["h"] = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        parts["ln_f"] = make_norm(cfg)
        self.transformer = nn.ModuleDict(parts)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:  # as GPT-2: the output projection shares the token embedding matrix
            self.transformer.wte.weight = self.lm_head.weight
        # None: drawn from the CPU generator, which torch.manual_seed sets (even under torch.device("meta"))
        self.init_seed = int(torch.randint(2**62, (), device="cpu")) if seed is None else seed
        if not self.lm_head.weight.is_meta:
            self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """Every parameter and buffer at its `initial_value`."""
        for name, tensor in [*self.named_parameters(), *self.named_buffers()]:
            tensor.copy_(self.initial_value(name))

    @torch.no_grad()
    def initial_value(self, name: str) -> torch.Tensor:
        """The initial value of the parameter or buffer called `name` in this model (a pipeline stage's tensors keep
        these names), whole, in fp32 on the CPU, from a generator seeded by (init_seed, name). GPT-2's init: normal
        (0, 0.02) matrices and embeddings, the residual projections scaled by 1/sqrt(2 * n_layer) so the residual
        stream's variance does not grow with depth (two additions per block; zero_init_proj: zero, each block
        starting as the identity), zero biases and bigram table (the model starts as one without it), unit norm
        gains."""
        if self.config.tie_embeddings and name == "lm_head.weight":
            name = "transformer.wte.weight"  # one matrix under two names
        path, _, attr = name.rpartition(".")
        module = self.get_submodule(path)
        shape = getattr(module, attr).shape
        if attr == "causal_bias":
            return causal_bias(self.config.block_size)
        if isinstance(module, (nn.LayerNorm, nn.RMSNorm)):
            return torch.ones(shape) if attr == "weight" else torch.zeros(shape)
        if attr == "bias" or path == "transformer.bigram" or (
                name.endswith("c_proj.weight") and self.config.zero_init_proj):
            return torch.zeros(shape)
        if not isinstance(module, (nn.Linear, nn.Embedding)) or attr != "weight":
            raise ValueError(f"GPT.initial_value has no rule for {name}")
        std = 0.02 / math.sqrt(2 * self.config.n_layer) if name.endswith("c_proj.weight") else 0.02
        key = hashlib.blake2b(f"{self.init_seed}:{name}".encode(), digest_size=8).digest()
        generator = torch.Generator().manual_seed(int.from_bytes(key, "little") >> 1)
        return torch.empty(shape).normal_(0.0, std, generator=generator)

    def num_params(self, exclude_position_embedding: bool = False) -> int:
        """Parameter count (a tied embedding counted once), without the learned position embedding if asked."""
        n = sum(p.numel() for p in self.parameters())
        if exclude_position_embedding and "wpe" in self.transformer:
            n -= self.transformer.wpe.weight.numel()
        return n

    def forward(
        self, idx: torch.Tensor, targets: Optional[torch.Tensor] = None
    ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """Logits for every position, and the mean cross-entropy against `targets` when given."""
        x = self.transformer.drop(self.embed(idx))
        for block in self.transformer.h:
            x = block(x)
        logits = self.unembed(x)
        if targets is None:
            return logits, None
        # The loss is computed in fp32 even under autocast: log-softmax over the vocabulary is where low
        # precision hurts most.
        loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1))
        return logits, loss

    def embed(self, idx: torch.Tensor, start: int = 0, previous: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The residual stream's start for tokens idx (B, T) at positions start ... start + T - 1: their embeddings,
        plus those of their positions when learned (rotary positions enter in attention instead), plus those of their
        (previous token, token) pairs under bigram_embedding. previous (B, 1): the token before idx[:, 0] where the
        model saw it (generation with a cache); None where idx starts a window."""
        time = idx.size(1)
        if start + time > self.config.block_size:
            raise ValueError(f"sequence length {start + time} exceeds block_size {self.config.block_size}")
        x = self.transformer.wte(idx)
        if self.config.bigram_embedding:
            x = x + self.transformer.bigram(bigram_ids(idx, previous, self.config.vocab_size))
        if self.config.positions == "learned":
            x = x + self.transformer.wpe(torch.arange(start, start + time, device=idx.device))
        return x

    def unembed(self, x: torch.Tensor) -> torch.Tensor:
        """Logits of the residual stream x: final norm, output head, and the soft cap where set (in fp32: tanh
        flattens differences that bf16 would round away)."""
        logits = self.lm_head(self.transformer.ln_f(x))
        cap = self.config.logit_softcap
        if cap is not None:
            logits = cap * torch.tanh(logits.float() / cap)
        return logits

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
                logits = self._extend(idx[:, -1:], caches, start=idx.size(1) - 1, previous=idx[:, -2:-1])
            logits = logits[:, -1, :].float() / temperature
            if top_k is not None:
                kth_best = torch.topk(logits, min(top_k, logits.size(-1))).values[:, [-1]]
                logits = logits.masked_fill(logits < kth_best, float("-inf"))
            probs = F.softmax(logits, dim=-1)
            next_id = torch.multinomial(probs, num_samples=1, generator=generator)
            idx = torch.cat((idx, next_id), dim=1)
        return idx

    def _extend(self, idx: torch.Tensor, caches: list[dict], start: int,
                previous: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Inference (`generate`): the logits of the last of `idx`'s positions, which start at position `start`
        (after the token `previous`, where one is), with each block's keys and values cached in `caches` (the same
        function as `forward`, without dropout)."""
        x = self.embed(idx, start, previous)
        for block, cache in zip(self.transformer.h, caches):
            x = x + block.attn.extend(block.ln_1(x), cache)
            x = x + block.mlp(block.ln_2(x))
        return self.unembed(x[:, -1:])

    def flops_per_token(self) -> int:
        """Training FLOPs per token: 6 per matmul parameter (forward + backward), plus the attention score/value
        matmuls.

        Follows the PaLM appendix B accounting: 6N + 12 * n_layer * n_embd * block_size, where N leaves out the
        embedding lookups: the learned position embedding, and the token embedding when untied (tied, its matrix is
        the output head's, a matmul; an untied head counts as one). Norm gains and biases stay in N (a rounding
        error). The options' elementwise work (rotary, qk_norm, the soft cap) is not counted.
        """
        cfg = self.config
        lookup = 0 if cfg.tie_embeddings else self.transformer.wte.weight.numel()
        if cfg.bigram_embedding:
            lookup += self.transformer.bigram.weight.numel()
        matmul_params = self.num_params(exclude_position_embedding=True) - lookup
        return 6 * matmul_params + 12 * cfg.n_layer * cfg.n_embd * cfg.block_size
