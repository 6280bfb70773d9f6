"""Several optimizers in one run (mingpt.optim), in this process: the groups Muon and AdamW get, the schedule as a
factor of each group's own peak, Muon's momentum warm-up, MeshMuon on plain tensors being torch's Muon bit for bit,
the choices checked in one line. MeshMuon on sharded matrices between torchrun processes:
tests/e2e/test_layouts.py; the CLI's refusal on a torch without Muon: tests/e2e/test_muon.py."""

from __future__ import annotations

import copy

import pytest
import torch
from support import (
    muon_required,
)

from mingpt.optim import (
    MeshMuon,
    OptimizerConfig,
    adamw,
    build_optimizer,
    decay_groups,
    is_hidden_matrix,
    learning_rate,
    lr_factor,
    muon_momentum,
)
from model import GPT, GPTConfig

needs_muon = muon_required()

def tiny_gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(n_layer=2, n_head=2, n_embd=16, vocab_size=11, block_size=8, dropout=0.0))


def test_wsd_warms_up_holds_then_decays_linearly_over_the_last_fraction():
    cfg = OptimizerConfig(schedule="wsd", learning_rate=1e-3, warmup_steps=10, decay_fraction=0.2, min_lr=1e-4)
    lrs = [learning_rate(s, cfg, total_steps=100) for s in range(110)]
    assert all(a < b for a, b in zip(lrs[:10], lrs[1:11]))  # warm-up
    assert lrs[10:80] == [1e-3] * 70  # stable until the last 20% of the run
    assert lrs[90] == pytest.approx(1e-4 + 0.5 * 9e-4)  # linear, half-way down
    assert lrs[100:] == [1e-4] * 10
    assert lr_factor(90, 100, cfg) == pytest.approx(0.55)


@needs_muon
def test_muon_takes_the_blocks_matrices_and_adamw_the_rest():
    gpt = tiny_gpt()
    optimizers = build_optimizer(gpt, OptimizerConfig(name="muon"))
    adamw, muon = optimizers.optimizers
    names = {id(p): name for name, p in gpt.named_parameters()}
    on_muon = sorted(names[id(p)] for group in muon.param_groups for p in group["params"])
    assert on_muon == sorted(f"transformer.h.{i}.{m}.weight" for i in range(2)
                             for m in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"))
    on_adamw = {names[id(p)] for group in adamw.param_groups for p in group["params"]}
    assert "transformer.wte.weight" in on_adamw and "transformer.wpe.weight" in on_adamw  # the head is tied to wte
    assert on_adamw.isdisjoint(on_muon) and len(on_adamw) + len(on_muon) == len(names)
    assert muon.param_groups[0]["weight_decay"] == 0.0 and muon.param_groups[0]["nesterov"]


@needs_muon
def test_the_schedule_scales_each_groups_own_peak_and_warms_muons_momentum():
    cfg = OptimizerConfig(name="muon", learning_rate=1e-3, muon_learning_rate=0.05, warmup_steps=0, min_lr=1e-4,
                          muon_momentum_start=0.85, muon_momentum=0.95, muon_momentum_warmup_steps=10)
    optimizers = build_optimizer(tiny_gpt(), cfg)
    optimizers.schedule(5, lr_factor(50, 100, cfg))  # cosine half-way: 0.55 of the peak
    assert [group["lr"] for group in optimizers.param_groups] == pytest.approx([5.5e-4, 5.5e-4, 0.0275])
    assert optimizers.optimizers[1].param_groups[0]["momentum"] == pytest.approx(0.90)
    assert "momentum" not in optimizers.optimizers[0].param_groups[0]  # AdamW's betas stay as set
    assert muon_momentum(10, cfg) == muon_momentum(500, cfg) == 0.95


@needs_muon
def test_mesh_muon_on_plain_tensors_is_torchs_muon_and_adamw_alone_is_unchanged():
    gpt = tiny_gpt()
    reference = copy.deepcopy(gpt)
    cfg = OptimizerConfig(name="muon")
    hidden = {name: is_hidden_matrix(name, p) for name, p in reference.named_parameters()}
    torch_muon = torch.optim.Muon([p for name, p in reference.named_parameters() if hidden[name]], lr=0.02,
                                  weight_decay=0.0, momentum=0.95, nesterov=True, ns_steps=5)
    rest = adamw(decay_groups([(n, p) for n, p in reference.named_parameters() if not hidden[n]], 0.1), cfg)
    optimizers = build_optimizer(gpt, cfg)
    assert isinstance(optimizers.optimizers[1], MeshMuon)
    idx = torch.randint(0, 11, (3, 8))
    for _ in range(3):
        gpt(idx, idx)[1].backward()
        reference(idx, idx)[1].backward()
        optimizers.step()
        torch_muon.step()
        rest.step()
        optimizers.zero_grad()
        reference.zero_grad()
    for name, p in gpt.named_parameters():
        assert torch.equal(p, dict(reference.named_parameters())[name]), name
    alone = build_optimizer(tiny_gpt(), OptimizerConfig())
    assert len(alone.optimizers) == 1 and [g["weight_decay"] for g in alone.param_groups] == [0.1, 0.0]


@pytest.mark.parametrize("kwargs, message", [
    (dict(name="sgd"), "name must be one of adamw, muon"), (dict(schedule="linear"), "schedule must be one of"),
    (dict(decay_fraction=0.0), "decay_fraction"), (dict(muon_momentum=1.0), "muon_momentum"),
    (dict(muon_learning_rate=0.0), "muon_learning_rate"), (dict(muon_weight_decay=-1.0), "muon_weight_decay"),
])
def test_optimizer_choices_are_checked_in_one_line(kwargs, message):
    from mingpt.errors import UsageError

    with pytest.raises(UsageError, match=message):
        OptimizerConfig(**kwargs)


def test_muon_in_fp16_is_refused_in_one_line():
    from mingpt.errors import UsageError
    from mingpt.optim import check_optimizer_fits

    with pytest.raises(UsageError, match="optimizer_config.name=muon does not run in fp16"):
        check_optimizer_fits(OptimizerConfig(name="muon"), torch.float16)
    check_optimizer_fits(OptimizerConfig(name="muon"), torch.bfloat16)
