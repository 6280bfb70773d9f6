"""gpt_config.init_from (mingpt/checkpoint/hf_import.py, main.from_folder and main.build_trainer) in this process: a
GPT2LMHeadModel folder made by transformers (save_pretrained) loads as our model with transformers' logits (fp32,
within 1e-5), tied and untied, with OpenAI's gelu_new and torch's tanh GELU, from old-style folders too; an export
(`snapshot.py export --format hf`) imports back to the snapshot's weights; a snapshot with a trained BPE exports a
folder that transformers tokenizes and runs as the project does; a folder reaches the DDP and FSDP builds; each bad
folder or contradicting setting is one UsageError line. Through main.py and torchrun: tests/e2e/test_init_from.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from support import HF_TOLERANCE, load_hf, max_logit_difference, moved_gpt_snapshot_file

import main
from char_dataset import CharCorpus, DataConfig
from mingpt import compat
from mingpt.checkpoint.hf_export import export_hf
from mingpt.checkpoint.hf_import import gpt2_state_dict, read_gpt2_folder
from mingpt.data.tokenizer import BpeTokenizer
from mingpt.distributed.process_group import DistContext
from mingpt.errors import UsageError
from mingpt.optim import OptimizerConfig
from mingpt.parallel.layout import ParallelConfig
from model import GPT, GPTConfig
from trainer import TrainerConfig

transformers = pytest.importorskip("transformers")  # requirements-hf.txt; CI's oldest-torch leg has none

TEXT = "".join(f"First Citizen {i}: before we proceed any further, hear me speak.\n" for i in range(40))
POSITIONS = 32
VOCAB = 300  # more rows than the tokenizer's tokens: a folder's vocabulary is kept whole


@pytest.fixture(scope="module")
def tokenizer() -> BpeTokenizer:
    return BpeTokenizer.train([TEXT], 280, "test")


def gpt2_folder(folder: Path, tokenizer: BpeTokenizer, seed: int = 0, **settings) -> tuple[object, Path]:
    """A small GPT2LMHeadModel made by transformers, its weights (biases and norms too) moved off their
    initialisation, saved with save_pretrained beside `tokenizer`'s tokenizer.json; the model (eval) and the folder."""
    config = transformers.GPT2Config(n_layer=2, n_head=2, n_embd=32, n_positions=POSITIONS, vocab_size=VOCAB,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, **settings)
    torch.manual_seed(seed)
    model = transformers.GPT2LMHeadModel(config).eval()
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.05 * torch.randn(param.shape))
    model.save_pretrained(str(folder))
    (folder / "tokenizer.json").write_text(tokenizer.json, encoding="utf-8")
    return model, folder


def imported(folder: Path) -> GPT:
    """Our GPT at the folder's weights, as main.py builds one (fp32, eval)."""
    found = read_gpt2_folder(str(folder))
    model = GPT(GPTConfig(**found.shape, dropout=0.0)).eval()
    model.load_state_dict(gpt2_state_dict(found, {name: t.shape for name, t in model.state_dict().items()}))
    return model


def ids(vocab: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, vocab, (3, POSITIONS), generator=torch.Generator().manual_seed(seed))


# ------------------------------------------------------------------------------------------------ (a) transformers'
FOLDERS = {
    "tied gelu_new (OpenAI's)": {},
    "untied gelu_pytorch_tanh": {"tie_word_embeddings": False, "activation_function": "gelu_pytorch_tanh"},
    "exact gelu": {"activation_function": "gelu"},
}


@pytest.mark.parametrize("settings", FOLDERS.values(), ids=FOLDERS.keys())
def test_a_transformers_gpt2_folder_gives_transformers_logits(tmp_path, tokenizer, settings):
    theirs, folder = gpt2_folder(tmp_path / "gpt2", tokenizer, **settings)
    ours = imported(folder)
    assert ours.config.tie_embeddings == theirs.config.tie_word_embeddings
    assert ours.config.activation == {"gelu": "gelu"}.get(theirs.config.activation_function, "gelu_tanh")
    assert (ours.config.vocab_size, ours.config.block_size, ours.config.bias) == (VOCAB, POSITIONS, True)
    difference = max_logit_difference(ours, theirs, ids(VOCAB))
    print(f"(a) max |logit difference| {difference:.2e}")
    assert difference <= HF_TOLERANCE


def test_an_old_style_folder_without_the_prefix_and_with_mask_buffers_loads(tmp_path, tokenizer):
    """OpenAI's folders hold a bare GPT2Model (no `transformer.` prefix) and the causal mask buffers."""
    from safetensors.torch import load_file, save_file

    theirs, folder = gpt2_folder(tmp_path / "gpt2", tokenizer)
    weights = load_file(str(folder / "model.safetensors"))
    bare = {name.removeprefix("transformer."): t for name, t in weights.items()}
    for i in range(2):
        bare[f"h.{i}.attn.bias"] = torch.ones(1, 1, POSITIONS, POSITIONS).tril()
    save_file(bare, str(folder / "model.safetensors"))
    assert max_logit_difference(imported(folder), theirs, ids(VOCAB)) <= HF_TOLERANCE


def test_a_folder_of_shards_loads(tmp_path, tokenizer):
    """A large model is saved as shards that model.safetensors.index.json names."""
    theirs, folder = gpt2_folder(tmp_path / "gpt2", tokenizer)
    theirs.save_pretrained(str(tmp_path / "shards"), max_shard_size="20KB")
    (tmp_path / "shards" / "tokenizer.json").write_text(tokenizer.json, encoding="utf-8")
    assert not (tmp_path / "shards" / "model.safetensors").exists()
    assert len(list((tmp_path / "shards").glob("model-*.safetensors"))) > 1
    assert max_logit_difference(imported(tmp_path / "shards"), theirs, ids(VOCAB)) <= HF_TOLERANCE


# ------------------------------------------------------------------------------------------- (c) the export's inverse
def snapshot_file(folder: Path, tokenizer: BpeTokenizer, **options) -> tuple[GPT, Path]:
    """A moved-off GPT with `options` and a BPE as a snapshot file (support's helper)."""
    return moved_gpt_snapshot_file(folder, tokenizer.describe(), tokenizer.size, POSITIONS, 3, **options)


SNAPSHOTS = {
    "tied gelu biases": {"bias": True},
    "untied gelu_tanh biases": {"bias": True, "tie_embeddings": False, "activation": "gelu_tanh"},
    "relu2 without biases": {"activation": "relu2"},
}


@pytest.mark.parametrize("options", SNAPSHOTS.values(), ids=SNAPSHOTS.keys())
def test_export_then_init_from_gives_the_snapshot_back(tmp_path, tokenizer, options):
    ours, path = snapshot_file(tmp_path / "snaps", tokenizer, **options)
    export_hf(str(path), str(tmp_path / "hf"), GPTConfig)
    back = imported(tmp_path / "hf")
    for name in ("activation", "tie_embeddings", "vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
        assert getattr(back.config, name) == getattr(ours.config, name), name
    state = back.state_dict()
    for name, tensor in ours.state_dict().items():  # bias=false: zero biases in the folder, the same function
        assert torch.equal(state[name], tensor), name
    with torch.no_grad():
        difference = (ours(ids(tokenizer.size))[0] - back(ids(tokenizer.size))[0]).abs().max().item()
    print(f"(c) max |logit difference| {difference:.2e}")
    assert difference <= HF_TOLERANCE


def test_a_bpe_snapshot_exports_a_folder_transformers_tokenizes_and_runs_as_we_do(tmp_path, tokenizer):
    """(b): the snapshot's BPE is the folder's tokenizer (AutoTokenizer gives our ids) and its model our logits."""
    ours, path = snapshot_file(tmp_path / "snaps", tokenizer, activation="gelu_tanh")
    export_hf(str(path), str(tmp_path / "hf"), GPTConfig)
    theirs = load_hf(tmp_path / "hf")
    auto = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
    text = "Before we proceed, hear me: speak é😀!\n  twice"
    assert auto(text).input_ids == tokenizer.encode(text).tolist()
    assert auto.decode(tokenizer.encode(text).tolist()) == text
    difference = max_logit_difference(ours, theirs, ids(tokenizer.size))
    print(f"(b) max |logit difference| {difference:.2e}")
    assert difference <= HF_TOLERANCE


# ------------------------------------------------------------------------------------------------ every layout
def train_config(folder: Path, strategy: str, *overrides: str) -> tuple[main.TrainConfig, object]:
    data = DataConfig(block_size=16)
    cfg = main.TrainConfig(data, main.ModelSettings(n_layer=1, n_head=4, n_embd=64, dropout=0.0, init_from=str(folder)),
                           OptimizerConfig(), TrainerConfig(mixed_precision="fp32", batch_size=4, progress="off"),
                           ParallelConfig(strategy=strategy))
    return main.from_folder(cfg, overrides)


@pytest.mark.usefixtures("no_process_group_left")
@pytest.mark.parametrize("strategy", ["ddp", pytest.param("fsdp", marks=pytest.mark.skipif(
    compat.TORCH < compat.FSDP_TORCH, reason="FSDP on a CPU needs torch 2.7"))])
def test_the_build_starts_from_the_folder_in_each_layout(tmp_path, tokenizer, strategy):
    theirs, folder = gpt2_folder(tmp_path / "gpt2", tokenizer)
    cfg, found = train_config(folder, strategy)
    assert (cfg.gpt_config.n_layer, cfg.gpt_config.n_embd, cfg.data_config.tokenizer) == (
        2, 32, str(folder / "tokenizer.json"))  # the folder's, not the config's
    corpus = CharCorpus.from_text(TEXT, cfg.data_config, BpeTokenizer(tokenizer.json, "folder"))
    weights = main.starting_weights(cfg, corpus, found)
    trainer = main.build_trainer(cfg, corpus, DistContext(), None, with_snapshots=False, folder=found,
                                 weights=weights)
    built = dict(trainer.parallel.whole_tensors())
    assert built.keys() == weights.keys()
    assert all(torch.equal(built[name], weights[name]) for name in weights)
    model = trainer.full_model_copy(lambda: GPT(main.model_config(cfg, corpus, torch.device("cpu"), found)))
    assert max_logit_difference(model.eval(), theirs, ids(VOCAB)) <= HF_TOLERANCE


# ------------------------------------------------------------------------------------------------ refusals
def refusal(call) -> str:  # noqa: ANN001 (a callable)
    with pytest.raises(UsageError) as error:
        call()
    assert "\n" not in str(error.value)
    return str(error.value)


def from_command_line(folder: Path, *overrides: str) -> main.TrainConfig:
    """The settings main.py makes of this command line with gpt_config.init_from=folder (the YAML, the overrides)."""
    return main.from_folder(main.load_config([f"gpt_config.init_from={folder}", *overrides]), overrides)[0]


def test_settings_that_contradict_the_folder_are_refused_in_one_line(tmp_path, tokenizer):
    _, folder = gpt2_folder(tmp_path / "gpt2", tokenizer, tie_word_embeddings=False)
    # The YAML's and a preset's values (not the command line's): the folder's replace them
    assert from_command_line(folder, "preset=cpu", "data_config.block_size=32").gpt_config.n_layer == 2
    assert from_command_line(folder, "gpt_config.n_layer=2", "data_config.block_size=32").gpt_config.n_layer == 2
    message = refusal(lambda: from_command_line(folder, "gpt_config.n_layer=1"))
    assert message == (f"gpt_config.n_layer=1 contradicts gpt_config.init_from={folder}, whose config.json gives "
                       f"n_layer=2: leave it out, the folder sets the model")
    assert "gpt_config.bias=false contradicts" in refusal(lambda: from_command_line(folder, "gpt_config.bias=false"))
    assert "gpt_config.tie_embeddings=true contradicts" in refusal(
        lambda: from_command_line(folder, "gpt_config.tie_embeddings=true"))
    assert "uses the folder's own tokenizer" in refusal(lambda: from_command_line(folder, "data_config.tokenizer=bpe"))
    assert f"data_config.block_size=256 is longer than the n_positions of gpt_config.init_from={folder} (32)" in (
        refusal(lambda: from_command_line(folder)))


def damage(folder: Path, how: str) -> None:
    from safetensors.torch import load_file, save_file

    weights_file = folder / "model.safetensors"
    if how == "truncated":
        weights_file.write_bytes(weights_file.read_bytes()[:1000])
    elif how == "missing":
        weights_file.unlink()
    else:
        weights = load_file(str(weights_file))
        if how == "nan":
            weights["transformer.h.0.mlp.c_fc.weight"][0, 0] = float("nan")
        elif how == "a tensor missing":
            del weights["transformer.h.1.ln_2.bias"]
        elif how == "a tensor left over":
            weights["transformer.h.2.ln_1.weight"] = torch.ones(32)
        save_file(weights, str(weights_file))


BAD_WEIGHTS = {
    "truncated": "cannot read model.safetensors: ",
    "missing": "the folder has no model.safetensors",
    "nan": "its transformer.h.0.mlp.c_fc.weight is not finite",
    "a tensor missing": "its weights have no transformer.h.1.ln_2.bias",
    "a tensor left over": "its weights have 1 tensors a GPT-2 of its config.json has not (transformer.h.2.ln_1",
}


@pytest.mark.parametrize("how, message", BAD_WEIGHTS.items(), ids=BAD_WEIGHTS.keys())
def test_a_bad_weights_file_is_refused_in_one_line(tmp_path, tokenizer, how, message):
    _, folder = gpt2_folder(tmp_path / "gpt2", tokenizer)
    damage(folder, how)
    assert message in refusal(lambda: imported(folder))


def test_a_folder_that_is_missing_or_not_gpt2_is_refused_in_one_line(tmp_path, tokenizer):
    assert refusal(lambda: read_gpt2_folder(str(tmp_path / "none"))).startswith(
        f"gpt_config.init_from={tmp_path / 'none'}: no such folder")
    _, path = snapshot_file(tmp_path / "snaps", tokenizer, positions="rotary")
    export_hf(str(path), str(tmp_path / "neox"), GPTConfig)
    assert "is a gpt_neox model, not GPT-2" in refusal(lambda: read_gpt2_folder(str(tmp_path / "neox")))
    _, folder = gpt2_folder(tmp_path / "gpt2", tokenizer)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "layer_norm_epsilon": 1e-6}))
    assert "its GPT-2 has layer_norm_epsilon=1e-06 (ours: 1e-05)" in refusal(lambda: read_gpt2_folder(str(folder)))
    (folder / "config.json").write_text(json.dumps({**config, "activation_function": "quick_gelu"}))
    assert "activation_function=quick_gelu" in refusal(lambda: read_gpt2_folder(str(folder)))
    (folder / "tokenizer.json").unlink()
    (folder / "config.json").write_text(json.dumps(config))
    assert "the folder has no tokenizer.json" in refusal(lambda: read_gpt2_folder(str(folder)))
