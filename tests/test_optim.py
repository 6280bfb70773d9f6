import copy
import subprocess
import sys

import pytest
import torch

from char_dataset import PROJECT_DIR
from errors import UsageError
from model import GPT, GPTConfig
from optim import AdamW, OptimizerConfig, build_optimizer, learning_rate


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
    opt = build_optimizer(gpt, cfg)
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]
    assert opt.defaults["fused"] is True and opt.defaults["betas"] == (0.9, 0.95)
    # The fused CPU kernel must be the same AdamW as PyTorch's plain for-loop implementation.
    ref_opt = torch.optim.AdamW(reference.param_groups(cfg.weight_decay), lr=cfg.learning_rate,
                                betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, foreach=False)
    idx = torch.randint(0, 10, (3, 4))
    for model, optimizer in ((gpt, opt), (reference, ref_opt)):
        for _ in range(3):
            model(idx, idx)[1].backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    for (name, p), q in zip(gpt.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name)


def test_adamw_is_torchs_without_importing_dynamo():
    """optim.AdamW calls the functions inside torch.optim's wrappers: the same bits and state_dict as
    torch.optim.AdamW, each loads the other's state, hooks still run, and torch._dynamo stays unimported (checked in
    a fresh interpreter: in this one, another test may have imported it)."""
    def train(optimizer_class: type) -> tuple[GPT, torch.optim.Optimizer]:
        torch.manual_seed(0)
        model = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=16, vocab_size=11, block_size=8, dropout=0.0))
        optimizer = optimizer_class(model.param_groups(0.1), lr=1e-2, fused=True)
        idx = torch.randint(0, 11, (2, 8))
        for _ in range(3):
            model(idx, idx)[1].backward()
            optimizer.step()
            optimizer.zero_grad()
        return model, optimizer

    ours, theirs = train(AdamW), train(torch.optim.AdamW)
    for a, b in zip(ours[0].state_dict().values(), theirs[0].state_dict().values()):
        assert torch.equal(a, b)
    mine, torchs = ours[1].state_dict(), theirs[1].state_dict()
    assert mine["param_groups"] == torchs["param_groups"] and mine["state"].keys() == torchs["state"].keys()
    for key in mine["state"]:
        assert all(torch.equal(mine["state"][key][k], torchs["state"][key][k]) for k in ("step", "exp_avg"))
    theirs[1].load_state_dict(mine)
    ours[1].load_state_dict(torchs)
    steps = []
    ours[1].register_step_post_hook(lambda optimizer, args, kwargs: steps.append(1))
    ours[1].step()
    assert steps == [1]
    code = ("import sys, torch; from optim import AdamW; p = torch.nn.Parameter(torch.ones(3)); o = AdamW([p]);"
            "p.grad = torch.ones(3); o.step(); o.zero_grad(); o.load_state_dict(o.state_dict());"
            "print('torch._dynamo' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", code], cwd=PROJECT_DIR, capture_output=True, text=True)
    assert result.stdout.strip() == "False", result.stderr[-2000:]


@pytest.mark.parametrize(
    "kwargs, message",
    [(dict(learning_rate=0.0), "learning_rate"), (dict(learning_rate=-1.0), "learning_rate"),
     (dict(weight_decay=-0.1), "weight_decay"), (dict(beta2=1.0), "beta2"),
     (dict(min_lr=1.0), "min_lr"), (dict(warmup_steps=-1), "warmup_steps")],
)
def test_config_errors(kwargs, message):
    with pytest.raises(UsageError, match=message):
        OptimizerConfig(**kwargs)
