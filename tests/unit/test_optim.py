import copy

import pytest
import torch

from mingpt.errors import UsageError
from mingpt.optim import OptimizerConfig, build_optimizer, decay_groups, learning_rate
from model import GPT, GPTConfig


def test_schedule_warms_up_then_decays_to_floor():
    cfg = OptimizerConfig(learning_rate=1e-3, warmup_steps=10, min_lr=1e-4)
    lrs = [learning_rate(s, cfg, total_steps=100) for s in range(120)]
    assert all(a < b for a, b in zip(lrs[:10], lrs[1:11]))  # rising during warmup
    assert lrs[10] == pytest.approx(1e-3)  # peak right after warmup
    assert all(a >= b for a, b in zip(lrs[10:100], lrs[11:101]))  # non-increasing afterwards
    assert lrs[55] == pytest.approx(1e-4 + 0.5 * 9e-4)  # cosine midpoint
    assert lrs[100] == lrs[119] == pytest.approx(1e-4)


def test_explicit_decay_steps():
    cfg = OptimizerConfig(learning_rate=1e-3, warmup_steps=0, decay_steps=50, min_lr=0.0)
    assert learning_rate(50, cfg, total_steps=1000) == 0.0
    assert learning_rate(25, cfg, total_steps=1000) == pytest.approx(5e-4)


def test_optimizer_groups_and_fused_kernel_match_reference_adamw():
    torch.manual_seed(0)
    gpt = GPT(GPTConfig(n_layer=1, n_head=1, n_embd=8, vocab_size=10, block_size=4, dropout=0.0))
    reference = copy.deepcopy(gpt)
    cfg = OptimizerConfig(weight_decay=0.1, beta2=0.95)
    opt = build_optimizer(gpt, cfg).optimizers[0]
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]
    assert opt.defaults["fused"] is True and opt.defaults["betas"] == (0.9, 0.95)
    # The fused CPU kernel must be the same AdamW as PyTorch's plain for-loop implementation.
    ref_opt = torch.optim.AdamW(decay_groups(reference.named_parameters(), cfg.weight_decay), lr=cfg.learning_rate,
                                betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, foreach=False)
    # Both step on the same gradients (gpt's, copied): the update divides by the gradient's size, so gradients that
    # differed in their last bits (from weights a step apart in theirs) would move a weight whose gradient is at
    # rounding level by up to a learning rate either way; given the same ones, only the kernels' roundings differ.
    idx = torch.randint(0, 10, (3, 4))
    for _ in range(3):
        gpt(idx, idx)[1].backward()
        for p, q in zip(gpt.parameters(), reference.parameters()):
            q.grad = p.grad.clone()
        for optimizer in (opt, ref_opt):
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    for (name, p), q in zip(gpt.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize(
    "kwargs, message",
    [(dict(learning_rate=0.0), "learning_rate"), (dict(learning_rate=-1.0), "learning_rate"),
     (dict(weight_decay=-0.1), "weight_decay"), (dict(beta2=1.0), "beta2"),
     (dict(min_lr=1.0), "min_lr"), (dict(warmup_steps=-1), "warmup_steps")],
)
def test_optimizer_config_refuses_out_of_range_rates_betas_and_warmup(kwargs, message):
    with pytest.raises(UsageError, match=message):
        OptimizerConfig(**kwargs)
