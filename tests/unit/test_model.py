import math

import pytest
import torch

from mingpt.errors import UsageError
from mingpt.optim import decay_groups
from model import GPT, GPTConfig, causal_attention_matmul, causal_attention_sdpa


def tiny_gpt(dropout: float = 0.0, vocab_size: int = 65, block_size: int = 16, attention: str = "sdpa") -> GPT:
    torch.manual_seed(0)
    cfg = GPTConfig(n_layer=2, n_head=2, n_embd=32, dropout=dropout, vocab_size=vocab_size, block_size=block_size,
                    attention=attention)
    return GPT(cfg)


def test_shapes_and_loss():
    gpt = tiny_gpt()
    idx = torch.randint(0, 65, (3, 16))
    logits, loss = gpt(idx, idx)
    assert logits.shape == (3, 16, 65)
    assert loss.ndim == 0
    logits, loss = gpt(idx)
    assert loss is None


def test_loss_at_init_is_about_log_vocab():
    gpt = tiny_gpt(vocab_size=65)
    idx = torch.randint(0, 65, (16, 16), generator=torch.Generator().manual_seed(1))
    targets = torch.randint(0, 65, (16, 16), generator=torch.Generator().manual_seed(2))
    _, loss = gpt(idx, targets)
    assert abs(loss.item() - math.log(65)) < 0.1


@pytest.mark.parametrize("attention", ["sdpa", "matmul"])
def test_attention_is_causal(attention: str):
    """Changing token t must leave the logits at every position < t unchanged, and change those at >= t."""
    gpt = tiny_gpt(attention=attention).eval()
    idx = torch.randint(0, 65, (1, 16), generator=torch.Generator().manual_seed(3))
    base, _ = gpt(idx)
    for t in (0, 5, 15):
        changed = idx.clone()
        changed[0, t] = (changed[0, t] + 1) % 65
        out, _ = gpt(changed)
        assert torch.equal(out[:, :t], base[:, :t]), f"positions before {t} saw token {t}"
        assert not torch.allclose(out[:, t], base[:, t])


@pytest.mark.parametrize("time", [16, 7, 1])
def test_matmul_attention_computes_what_sdpa_does(time: int):
    """Same weights, same inputs: logits, loss and every gradient agree to float rounding, at full and short T."""
    idx = torch.randint(0, 65, (4, time), generator=torch.Generator().manual_seed(4))
    targets = torch.randint(0, 65, (4, time), generator=torch.Generator().manual_seed(5))
    results = []
    for attention in ("sdpa", "matmul"):
        gpt = tiny_gpt(attention=attention)
        logits, loss = gpt(idx, targets)
        loss.backward()
        results.append((logits, loss, {name: p.grad for name, p in gpt.named_parameters()}))
    (logits_a, loss_a, grads_a), (logits_b, loss_b, grads_b) = results
    torch.testing.assert_close(logits_b, logits_a, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(loss_b, loss_a, rtol=1e-6, atol=1e-6)
    assert grads_a.keys() == grads_b.keys()
    for name in grads_a:
        torch.testing.assert_close(grads_b[name], grads_a[name], rtol=1e-4, atol=1e-6, msg=name)


def test_matmul_attention_drops_attention_weights():
    """With dropout_p > 0 some weights are zeroed and the rest scaled by 1/(1-p): the mean output is unchanged."""
    q, k, v = torch.randn(3, 64, 2, 8, 4, generator=torch.Generator().manual_seed(6))
    bias = torch.full((8, 8), float("-inf")).triu(1)
    exact = causal_attention_matmul(q, k, v, bias, dropout_p=0.0)
    torch.testing.assert_close(exact, causal_attention_sdpa(q, k, v, dropout_p=0.0), rtol=1e-5, atol=1e-6)
    torch.manual_seed(1)
    dropped = torch.stack([causal_attention_matmul(q, k, v, bias, dropout_p=0.5) for _ in range(400)])
    assert not torch.allclose(dropped[0], exact)
    assert (dropped.mean(0) - exact).abs().mean() < 0.1 * exact.abs().mean()


def test_unknown_attention_is_a_usage_error():
    with pytest.raises(UsageError, match="gpt_config.attention must be one of auto, sdpa, matmul, got 'flash'"):
        GPTConfig(attention="flash")


def test_too_long_sequence_is_refused():
    gpt = tiny_gpt(block_size=8)
    with pytest.raises(ValueError, match="block_size"):
        gpt(torch.zeros(1, 9, dtype=torch.long))


def test_weight_decay_only_on_matrices():
    gpt = tiny_gpt()
    decay, no_decay = decay_groups(gpt.named_parameters(), weight_decay=0.1)
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert all(p.dim() >= 2 for p in decay["params"])
    assert all(p.dim() < 2 for p in no_decay["params"])
    assert sum(p.numel() for g in (decay, no_decay) for p in g["params"]) == gpt.num_params()


def test_embedding_is_tied_to_output_layer():
    gpt = tiny_gpt()
    assert gpt.lm_head.weight is gpt.transformer.wte.weight


def test_gpt2_initialisation_scales_residual_projections():
    gpt = GPT(GPTConfig(n_layer=8, n_head=4, n_embd=256, vocab_size=65, block_size=16))
    proj = gpt.transformer.h[0].attn.c_proj.weight
    fc = gpt.transformer.h[0].mlp.c_fc.weight
    assert abs(fc.std().item() - 0.02) < 0.002
    assert abs(proj.std().item() - 0.02 / math.sqrt(16)) < 0.001


def test_generate_is_reproducible_and_respects_top_k():
    gpt = tiny_gpt().eval()
    prompt = torch.zeros(2, 1, dtype=torch.long)
    a = gpt.generate(prompt, 20, temperature=0.8, top_k=5, generator=torch.Generator().manual_seed(7))
    b = gpt.generate(prompt, 20, temperature=0.8, top_k=5, generator=torch.Generator().manual_seed(7))
    assert a.shape == (2, 21)
    assert torch.equal(a, b)
    # top_k=1 is greedy decoding: each token is the argmax of the logits for its context.
    greedy = gpt.generate(prompt, 10, top_k=1)
    for t in range(1, greedy.size(1)):
        logits, _ = gpt(greedy[:, :t])
        assert torch.equal(greedy[:, t], logits[:, -1].argmax(-1))


def test_generate_beyond_block_size_crops_context():
    """Keys and values are cached while the context fits, and the window is recomputed once it slides: each greedy
    token is the argmax of a plain forward over the last block_size tokens, from a prompt longer than the block."""
    gpt = tiny_gpt(block_size=8).eval()
    out = gpt.generate(torch.zeros(1, 1, dtype=torch.long), 20, generator=torch.Generator().manual_seed(0))
    assert out.shape == (1, 21)
    prompt = torch.randint(0, 65, (2, 11))
    greedy = gpt.generate(prompt, 12, top_k=1)
    for t in range(11, greedy.size(1)):
        logits, _ = gpt(greedy[:, max(0, t - 8) : t])
        assert torch.equal(greedy[:, t], logits[:, -1].argmax(-1)), t
    assert gpt.train().generate(prompt, 3).shape == (2, 14)  # train mode: the plain forward, dropout and all


def test_dropout_is_active_only_in_training():
    gpt = tiny_gpt(dropout=0.5)
    idx = torch.randint(0, 65, (2, 16))
    gpt.train()
    assert not torch.equal(gpt(idx)[0], gpt(idx)[0])
    gpt.eval()
    assert torch.equal(gpt(idx)[0], gpt(idx)[0])


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(n_embd=30, n_head=4), "divisible"),
        (dict(n_layer=0), "n_layer must be positive"),
        (dict(dropout=1.0), "dropout"),
    ],
)
def test_gpt_config_refuses_indivisible_heads_no_layers_and_full_dropout(kwargs, message):
    with pytest.raises(UsageError, match=message):
        GPTConfig(**kwargs)


def test_flops_per_token_counts_attention():
    gpt = tiny_gpt()
    cfg = gpt.config
    assert gpt.flops_per_token() == 6 * (gpt.num_params() - 16 * 32) + 12 * cfg.n_layer * cfg.n_embd * cfg.block_size
