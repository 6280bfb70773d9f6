"""The model's options (model.py's GPTConfig: positions, rope_base, norm, activation, qk_norm, tie_embeddings,
logit_softcap, zero_init_proj, bigram_embedding), in this process on tiny models: each changes the function or the
parameters as it says, the defaults build today's GPT to the bit, generation with the key/value cache equals
generation by the plain forward under every option, the counts (num_params, flops_per_token) follow them,
torch.compile takes them whole, and snapshots are matched on them (a snapshot from before the options resumes as the
default GPT and is refused by any other). Tensor and pipeline parallelism with every option on:
tests/e2e/test_tensor_parallel.py, tests/e2e/test_pipeline.py."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from reference import ALL_OPTIONS

from mingpt import compat
from mingpt.checkpoint import store as snap
from mingpt.errors import UsageError
from mingpt.optim import OptimizerConfig, build_optimizer, decay_groups
from model import GPT, GPTConfig, LayerNorm, RMSNorm

VOCAB, BLOCK = 65, 16
# What each option is set to when it is "on" (the defaults are today's GPT-2): every option at once is the table the
# tensor- and pipeline-parallel workers train (tests/workers/reference.py), rope_base (rotary's setting) besides
ALL = ALL_OPTIONS
ON = {**ALL_OPTIONS, "rope_base": 500.0}
NEW_FIELDS = (*snap.OPTION_FIELDS, "zero_init_proj")
# weights_sha256 of tiny(seed 0) with the options off, since the initial weights are drawn per tensor name (issue 42:
# the same in every layout; before, one stream in module order); the options leave them so (torch 2.13's CPU
# generator, through its vectorised normal_: the AVX2 and AVX512 kernels draw the same bits, the scalar one,
# ATEN_CPU_CAPABILITY=default or a CPU without AVX2, others)
DIGEST_KERNELS = ("AVX2", "AVX512")
TODAYS_DIGESTS = {
    "plain": "e452470dbaaefdde3837e81a65686beef4acc9e1aad8821bdff5835b54904ce3",
    "bias_matmul": "ca250c67fe02a23e88ce474775b70e533b7b54e1b94b899313944142348c2004",
}


def config(**options) -> GPTConfig:
    return GPTConfig(n_layer=2, n_head=2, n_embd=32, dropout=0.0, vocab_size=VOCAB, block_size=BLOCK, **options)


def tiny(seed: int = 0, **options) -> GPT:
    torch.manual_seed(seed)
    return GPT(config(**options))


def tokens(shape: tuple[int, ...], seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, shape, generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def moved_off_init(model: GPT) -> GPT:
    """The weights moved well away from their initialisation, so that every part shapes the output (zero-initialised
    projections included) and near-ties between logits are unlikely."""
    generator = torch.Generator().manual_seed(5)
    for param in model.parameters():
        param.add_(0.1 * torch.randn(param.shape, generator=generator))
    return model.eval()


# ------------------------------------------------------------------------------------------------ the defaults


@pytest.mark.parametrize("name, settings", [("plain", {}), ("bias_matmul", dict(bias=True, attention="matmul"))])
def test_the_defaults_build_todays_gpt_to_the_bit(name, settings):
    gpt = tiny(**settings)
    if torch.backends.cpu.get_cpu_capability() in DIGEST_KERNELS:
        assert snap.weights_sha256(gpt.state_dict()) == TODAYS_DIGESTS[name]
    assert "transformer.wpe.weight" in gpt.state_dict() and gpt.lm_head.weight is gpt.transformer.wte.weight
    norms = [module for name, module in gpt.named_modules() if name.split(".")[-1].startswith("ln_")]
    assert len(norms) == 5 and all(type(module) is LayerNorm for module in norms)
    assert all(type(block.mlp.activation) is nn.GELU for block in gpt.transformer.h)


@pytest.mark.parametrize("settings, message", [
    (dict(positions="alibi"), "gpt_config.positions must be one of learned, rotary, got 'alibi'"),
    (dict(norm="batchnorm"), "gpt_config.norm must be one of layernorm, rmsnorm, got 'batchnorm'"),
    (dict(activation="swiglu"), "gpt_config.activation must be one of gelu, gelu_tanh, relu2, got 'swiglu'"),
    (dict(positions="rotary", n_embd=30, n_head=10), "positions=rotary needs an even head size"),
    (dict(rope_base=1.0), "gpt_config.rope_base must be greater than 1, got 1.0"),
    (dict(logit_softcap=0.0), "gpt_config.logit_softcap must be positive or null, got 0.0"),
    (dict(logit_softcap=-3.0), "gpt_config.logit_softcap must be positive or null, got -3.0"),
    (dict(bigram_embedding=True, vocab_size=1025), "bigram_embedding=true needs a vocabulary of at most 1024 tokens "
                                                   r"\(a row per pair of them\), got 1025"),
])
def test_a_bad_option_is_one_line(settings, message):
    with pytest.raises(UsageError, match=message) as error:
        GPTConfig(**settings)
    assert "\n" not in str(error.value)


# ------------------------------------------------------------------------------------------------ each option


def test_rotary_positions_replace_the_position_embedding_and_depend_on_relative_positions_only():
    gpt = tiny(positions="rotary")
    assert "wpe" not in gpt.transformer and "transformer.wpe.weight" not in gpt.state_dict()
    attn = gpt.transformer.h[0].attn
    x = torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(2))
    (q0, k0, v0), (q5, k5, v5) = attn._heads(x, start=0), attn._heads(x, start=5)
    assert not torch.allclose(q0, q5) and torch.equal(v0, v5)  # q and k turn with the position, v does not
    torch.testing.assert_close(q5 @ k5.transpose(-2, -1), q0 @ k0.transpose(-2, -1), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(q5.norm(dim=-1), q0.norm(dim=-1))  # a rotation
    # Without learned positions only rotary tells the order: swapping two earlier tokens moves the last logits.
    idx = tokens((1, 8))
    swapped = idx[:, [1, 0, *range(2, 8)]]
    assert not torch.allclose(gpt(idx)[0][:, -1], gpt(swapped)[0][:, -1])


def test_rope_base_sets_the_rotation_frequencies():
    idx = tokens((1, 8))
    assert not torch.allclose(tiny(positions="rotary")(idx)[0], tiny(positions="rotary", rope_base=500.0)(idx)[0])


def test_rmsnorm_keeps_the_norms_names_without_their_biases():
    default, gpt = tiny(bias=True), tiny(bias=True, norm="rmsnorm")
    norms = [module for name, module in gpt.named_modules() if name.split(".")[-1].startswith("ln_")]
    assert len(norms) == 5 and all(type(module) is RMSNorm for module in norms)
    assert set(gpt.state_dict()) == {name for name in default.state_dict()
                                     if not (".ln_" in name and name.endswith(".bias"))}
    x = torch.randn(3, 32)
    expected = x / x.pow(2).mean(-1, keepdim=True).add(torch.finfo(x.dtype).eps).sqrt()
    torch.testing.assert_close(gpt.transformer.ln_f(x), expected)  # gain 1 at init: no mean taken out


def test_relu2_squares_the_relu():
    gpt = tiny(activation="relu2")
    x = torch.randn(4, 128)
    assert torch.equal(gpt.transformer.h[0].mlp.activation(x), F.relu(x) ** 2)
    assert set(gpt.state_dict()) == set(tiny().state_dict())


def test_qk_norm_gives_each_head_unit_rms_q_and_k_without_parameters():
    plain, gpt = tiny(), tiny(qk_norm=True)
    assert set(gpt.state_dict()) == set(plain.state_dict())
    x = 5 * torch.randn(2, 8, 32)
    q, k, v = gpt.transformer.h[0].attn._heads(x, start=0)
    for t in (q, k):
        torch.testing.assert_close(t.pow(2).mean(-1), torch.ones(t.shape[:-1]), rtol=1e-4, atol=1e-4)
    assert torch.equal(v, plain.transformer.h[0].attn._heads(x, start=0)[2])


def test_an_untied_head_has_its_own_weight():
    tied, gpt = tiny(), tiny(tie_embeddings=False)
    assert gpt.lm_head.weight is not gpt.transformer.wte.weight
    assert gpt.num_params() == tied.num_params() + VOCAB * 32
    assert abs(gpt.lm_head.weight.std().item() - 0.02) < 0.002  # GPT-2's init, as the tied matrix gets
    decay, no_decay = decay_groups(gpt.named_parameters(), weight_decay=0.1)
    assert any(p is gpt.lm_head.weight for p in decay["params"])
    assert sum(p.numel() for group in (decay, no_decay) for p in group["params"]) == gpt.num_params()
    _, loss = gpt(tokens((2, 8)), tokens((2, 8), seed=2))
    loss.backward()
    assert gpt.lm_head.weight.grad is not None and gpt.transformer.wte.weight.grad is not None


def test_the_soft_cap_bounds_the_logits_by_tanh():
    plain, capped = moved_off_init(tiny()), moved_off_init(tiny(logit_softcap=0.5))
    idx, targets = tokens((2, 16)), tokens((2, 16), seed=2)
    raw, _ = plain(idx)
    logits, loss = capped(idx, targets)
    assert raw.abs().max() > 1.0 and logits.abs().max() <= 0.5  # the cap bit
    torch.testing.assert_close(logits, 0.5 * torch.tanh(raw / 0.5))
    torch.testing.assert_close(loss, F.cross_entropy(logits.view(-1, VOCAB), targets.view(-1)))


def test_zero_init_proj_zeroes_the_residual_projections_and_nothing_else():
    default, gpt = tiny().state_dict(), tiny(zero_init_proj=True).state_dict()
    assert default.keys() == gpt.keys()
    for name, tensor in gpt.items():
        if name.endswith("c_proj.weight"):
            assert not tensor.any(), name
        else:
            assert torch.equal(tensor, default[name]), name
    idx = tokens((1, 8))
    embedded = tiny(zero_init_proj=True)
    torch.testing.assert_close(embedded(idx)[0], embedded.unembed(embedded.embed(idx)))  # blocks start as identity


def test_the_bigram_embedding_adds_the_row_of_each_token_pair():
    plain, gpt = tiny(), tiny(bigram_embedding=True)
    table = gpt.transformer.bigram.weight
    assert table.shape == (VOCAB * (VOCAB + 1), 32) and not table.any()
    assert set(gpt.state_dict()) == {*plain.state_dict(), "transformer.bigram.weight"}
    plain.load_state_dict({name: t for name, t in gpt.state_dict().items() if name != "transformer.bigram.weight"})
    idx = tokens((2, 8))
    assert torch.equal(gpt(idx)[0], plain(idx)[0])  # zero-initialised: the same function as without it
    with torch.no_grad():
        table.normal_(generator=torch.Generator().manual_seed(4))
    # Each token's row is that of (previous token, token); a window's first token has one of its own.
    rows = torch.cat((VOCAB * VOCAB + idx[:, :1], idx[:, :-1] * VOCAB + idx[:, 1:]), dim=1)
    torch.testing.assert_close(gpt.embed(idx), plain.embed(idx) + table[rows])
    # Given the token before them (generation with a cache), later tokens embed as inside the window.
    torch.testing.assert_close(gpt.embed(idx[:, 3:], start=3, previous=idx[:, 2:3]), gpt.embed(idx)[:, 3:])
    assert gpt.num_params() == plain.num_params() + VOCAB * (VOCAB + 1) * 32
    assert gpt.flops_per_token() == plain.flops_per_token()  # a lookup, no matmul


def test_the_bigram_table_has_its_own_rate_and_weight_decay():
    cfg = OptimizerConfig(learning_rate=1e-3, weight_decay=0.1, bigram_lr_scale=7.0, bigram_weight_decay=0.0)
    gpt = tiny(bigram_embedding=True)
    for name in ("adamw", "muon"):
        groups = build_optimizer(gpt, dataclasses.replace(cfg, name=name)).param_groups
        (table_group,) = [group for group in groups if any(p is gpt.transformer.bigram.weight for p in group["params"])]
        assert len(table_group["params"]) == 1 and table_group["lr"] == pytest.approx(7e-3), name
        assert table_group["weight_decay"] == 0.0
    assert len(build_optimizer(tiny(), cfg).param_groups) == 2  # without it: the groups a snapshot always had


# ------------------------------------------------------------------------------------------------ what follows them


CASES = [pytest.param({name: value}, id=name) for name, value in ON.items() if name != "rope_base"]
CASES += [pytest.param(ON, id="all"),
          pytest.param(dict(ON, bias=True, attention="matmul"), id="all-bias-matmul")]


@pytest.mark.parametrize("options", CASES)
def test_cached_generation_equals_generation_by_the_plain_forward(options):
    """Greedy and seeded sampling, from a prompt that starts short and runs past block_size (the window then
    slides: the cache is rebuilt). In train mode (dropout 0 here) generate runs the plain forward every step."""
    gpt = moved_off_init(tiny(**options))
    prompt = tokens((2, 5))
    for sampling in (dict(top_k=1), dict(temperature=0.8, top_k=10)):
        cached = gpt.eval().generate(prompt, 20, generator=torch.Generator().manual_seed(3), **sampling)
        plain = gpt.train().generate(prompt, 20, generator=torch.Generator().manual_seed(3), **sampling)
        assert torch.equal(cached, plain), sampling
    greedy = gpt.eval().generate(prompt, 20, top_k=1)
    for t in range(5, greedy.size(1)):  # and each greedy token is the argmax of the plain forward's logits
        assert torch.equal(greedy[:, t], gpt(greedy[:, max(0, t - BLOCK) : t])[0][:, -1].argmax(-1)), t


def test_counts_follow_the_options():
    attention = 12 * 2 * 32 * BLOCK  # 12 * n_layer * n_embd * block_size
    default, rotary, untied = tiny(), tiny(positions="rotary"), tiny(tie_embeddings=False)
    assert default.flops_per_token() == 6 * (default.num_params() - BLOCK * 32) + attention  # as before
    assert rotary.num_params() == default.num_params() - BLOCK * 32
    assert rotary.num_params(exclude_position_embedding=True) == rotary.num_params()
    assert rotary.flops_per_token() == default.flops_per_token()  # the same matmuls
    # untied: the lookup is no matmul, the head still is one
    assert untied.flops_per_token() == 6 * (untied.num_params() - BLOCK * 32 - VOCAB * 32) + attention
    assert untied.flops_per_token() == default.flops_per_token()
    with torch.device("meta"):  # as benchmarks/bench.py counts a model: built on the meta device, nothing allocated
        whole = GPT(config(**ALL))
    assert whole.flops_per_token() == tiny(**ALL).flops_per_token()
    assert whole.num_params() == tiny(**ALL).num_params()


def test_a_meta_built_model_materialises_with_every_option():
    """Nothing an option needs is a buffer filled at construction (rotary's angles are computed when used): a
    model built on the meta device, moved to real memory and re-initialised computes what one built directly does."""
    with torch.device("meta"):
        lazy = GPT(config(**ALL))
    lazy.to_empty(device="cpu")
    lazy.load_state_dict(tiny(**ALL).state_dict())
    idx = tokens((2, 16))
    assert torch.equal(lazy(idx)[0], tiny(**ALL)(idx)[0])


def test_torch_compile_takes_every_option_in_one_graph():
    gpt = moved_off_init(tiny(**ALL)).train()
    compiled = torch.compile(gpt, backend="aot_eager", fullgraph=True)  # graph capture and autograd, no codegen
    idx, targets = tokens((2, 16)), tokens((2, 16), seed=2)
    expected_logits, expected_loss = gpt(idx, targets)
    logits, loss = compiled(idx, targets)
    torch.testing.assert_close(logits, expected_logits)
    torch.testing.assert_close(loss, expected_loss)


# ------------------------------------------------------------------------------------------------ snapshots


def model_config(**options) -> dict:
    return dataclasses.asdict(config(**options))


def as_before_the_options(model_config: dict) -> dict:
    """A model config as snapshots written before the options hold it: without their keys."""
    return {name: value for name, value in model_config.items() if name not in NEW_FIELDS}


def with_config(snapshot_config: dict) -> dict:
    return {"model_config": snapshot_config, "vocab": "abc"}


def test_what_an_old_snapshot_means_is_gpt2_and_todays_defaults():
    """The store's fixed table of what a snapshot without an option was trained with is GPT-2's choice, which the
    model's defaults still are (if a default ever changes, the table must not follow it)."""
    defaults = {field.name: field.default for field in dataclasses.fields(GPTConfig)}
    assert snap.OPTION_DEFAULTS == {name: defaults[name] for name in snap.OPTION_FIELDS}


def test_a_snapshot_from_before_the_options_matches_the_default_only():
    old = with_config(as_before_the_options(model_config()))
    snap.check_compatible(old, model_config(), "abc", "old")
    snap.check_compatible(old, model_config(zero_init_proj=True, attention="matmul"), "abc", "old")  # how, not what
    for name, value in ON.items():
        if name == "zero_init_proj":
            continue
        with pytest.raises(UsageError, match=f"is for a different model: {name}=") as error:
            snap.check_compatible(old, model_config(**{name: value}), "abc", "old")
        assert f"{value} in the config" in str(error.value) and "\n" not in str(error.value)


@pytest.mark.parametrize("name", [name for name in ON if name != "zero_init_proj"])
def test_a_snapshot_with_an_option_is_refused_by_a_model_without_it(name):
    with_option = with_config(model_config(**{name: ON[name]}))
    snap.check_compatible(with_option, model_config(**{name: ON[name]}), "abc", "new")
    with pytest.raises(UsageError, match=f"{name}={ON[name]} in the snapshot, "):
        snap.check_compatible(with_option, model_config(), "abc", "new")


def train_tiny(folder: Path, steps: int, strategy: str = "ddp", **options):
    """A real Trainer (main.build_trainer, one process) of a 1-block GPT with `options`; it resumes from the newest
    snapshot in `folder` when fit, and saves its last step there (a folder of shards under FSDP)."""
    import main
    from char_dataset import CharCorpus, DataConfig
    from mingpt.distributed.process_group import DistContext
    from mingpt.optim import OptimizerConfig
    from mingpt.parallel.layout import ParallelConfig
    from trainer import TrainerConfig

    data = DataConfig(block_size=16)
    trainer = TrainerConfig(max_steps=steps, batch_size=4, mixed_precision="fp32", progress="off",
                            eval_every_steps=0, log_every_steps=100, snapshot_path=str(folder))
    cfg = main.TrainConfig(data, main.ModelSettings(n_layer=1, n_head=2, n_embd=16, dropout=0.0, **options),
                           OptimizerConfig(learning_rate=1e-2, warmup_steps=0), trainer,
                           ParallelConfig(strategy=strategy))
    text = "".join(f"line {i}: the quick brown fox.\n" for i in range(60))
    return main.build_trainer(cfg, CharCorpus.from_text(text, data), DistContext(), None,
                              store=snap.SnapshotStore(str(folder)))


def made_old(folder: Path) -> Path:
    """The newest snapshot in `folder` rewritten as from before the options. Its integrity digest covers tensors
    only (store.integrity_sha256), so dropping config keys keeps it valid."""
    path = sorted(folder.glob("snapshot-*.pt"))[-1]
    snapshot = snap.from_bytes(path.read_bytes(), str(path))
    snapshot["model_config"] = as_before_the_options(snapshot["model_config"])
    path.write_bytes(snap.to_bytes(snapshot))
    assert snap.from_bytes(path.read_bytes(), str(path))["model_config"].keys().isdisjoint(NEW_FIELDS)
    return path


def test_an_old_snapshot_resumes_as_the_default_gpt_and_is_refused_by_rmsnorm(tmp_path):
    from sample import model_from_snapshot

    folder = tmp_path / "snapshots"
    train_tiny(folder, 2).fit()
    old = made_old(folder)
    with pytest.raises(UsageError, match="norm=layernorm in the snapshot, rmsnorm in the config"):
        train_tiny(folder, 4, norm="rmsnorm").checkpoints.restore()
    resumed = train_tiny(folder, 4)
    assert resumed.checkpoints.restore() is not None and resumed.step == 2
    model, _ = model_from_snapshot(snap.read_snapshot(str(old)), torch.device("cpu"))  # as sample.py builds it
    assert model.lm_head.weight is model.transformer.wte.weight and "wpe" in model.transformer
    snap.export(str(old), str(tmp_path / "export"))
    exported = json.loads((tmp_path / "export" / "config.json").read_text())
    assert exported["tied_weights"] == {"lm_head.weight": "transformer.wte.weight"}


@pytest.mark.usefixtures("no_process_group_left")
@pytest.mark.parametrize("strategy", ["ddp", pytest.param("fsdp", marks=pytest.mark.skipif(
    compat.TORCH < compat.FSDP_TORCH, reason="FSDP on a CPU needs torch 2.7"))])
def test_a_snapshot_of_every_option_resumes_samples_and_exports_as_such(tmp_path, strategy):
    """A file (DDP) or a folder of shards (FSDP): refused by the default GPT, resumed by the same options under the
    other strategy, built by sample.py, counted by snapshot.py info, exported with the head stored apart."""
    from sample import model_from_snapshot

    folder = tmp_path / "snapshots"
    train_tiny(folder, 2, strategy, **ALL).fit()
    with pytest.raises(UsageError, match="positions=rotary in the snapshot, learned in the config"):
        train_tiny(folder, 4, strategy).checkpoints.restore()
    resumed = train_tiny(folder, 4, "fsdp" if strategy == "ddp" else "ddp", **ALL)
    assert resumed.checkpoints.restore() is not None and resumed.step == 2
    path = sorted(folder.glob("snapshot-*"))[-1]
    snapshot = snap.read_snapshot(str(path))
    model, _ = model_from_snapshot(snapshot, torch.device("cpu"))
    assert model.config == GPTConfig(**snapshot["model_config"]) and model.config.positions == "rotary"
    assert model.lm_head.weight is not model.transformer.wte.weight
    assert snap.summary(snapshot)["n_params"] == model.num_params()  # the untied head counted
    snap.export(str(path), str(tmp_path / "export"))
    assert json.loads((tmp_path / "export" / "config.json").read_text())["tied_weights"] == {}
