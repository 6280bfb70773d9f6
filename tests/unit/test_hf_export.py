"""`snapshot.py export --format hf` (mingpt/checkpoint/hf_export.py) in this process: the folder transformers loads
offline computes our model's function. Per architecture: a random GPT moved off its initialisation, exported from its
snapshot file and loaded by AutoModelForCausalLM, gives our logits (fp32, within 1e-5) under GPT-2 (tied and untied,
gelu and relu2, with and without biases), GPT-NeoX, Arcee and Apertus; the tokenizer is our vocabulary's, character
by character; each option without an exact equivalent is refused in one line; only the export imports transformers.
On snapshots trained by real processes: tests/e2e/test_hf_export.py."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
from support import (
    HF_TOLERANCE,
    PROJECT_DIR,
    load_hf,
    max_logit_difference,
    moved_gpt_snapshot_file,
    project_modules,
)

import sample
import snapshot
from char_dataset import CharVocab
from mingpt.checkpoint.hf_export import export_hf
from mingpt.errors import UsageError
from model import GPT, GPTConfig

transformers = pytest.importorskip("transformers")  # requirements-hf.txt; CI's oldest-torch leg has none

TEXT = "First Citizen:\nBefore we proceed any further, hear me speak.\n"
VOCAB = "".join(sorted(set(TEXT + "é😀")))  # a character outside the BMP too: tokens are characters, not bytes
BLOCK = 24
LAZY = ("transformers", "tokenizers")  # imported by `snapshot.py export --format hf` alone
HF_FILES = {"model.safetensors", "config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"}


def snapshot_file(folder: Path, seed: int = 0, **options) -> tuple[GPT, Path]:
    """A moved-off GPT with `options` and the character vocabulary VOCAB as a snapshot file (support's helper)."""
    return moved_gpt_snapshot_file(folder, VOCAB, len(VOCAB), BLOCK, seed, **options)


# ------------------------------------------------------------------------------------------------ per architecture
ARCHITECTURES = {
    "gpt2 tied gelu": ({}, "GPT2LMHeadModel"),
    "gpt2 untied relu2 biases": ({"tie_embeddings": False, "activation": "relu2", "bias": True}, "GPT2LMHeadModel"),
    "neox rotary": ({"positions": "rotary", "rope_base": 500.0}, "GPTNeoXForCausalLM"),
    "neox untied relu2 biases": ({"positions": "rotary", "tie_embeddings": False, "activation": "relu2",
                                  "bias": True}, "GPTNeoXForCausalLM"),
    "arcee rmsnorm": ({"positions": "rotary", "norm": "rmsnorm", "rope_base": 500.0}, "ArceeForCausalLM"),
    "arcee untied relu2 biases": ({"positions": "rotary", "norm": "rmsnorm", "tie_embeddings": False,
                                   "activation": "relu2", "bias": True}, "ArceeForCausalLM"),
    "apertus qk_norm": ({"positions": "rotary", "norm": "rmsnorm", "qk_norm": True}, "ApertusForCausalLM"),
    "apertus untied relu2 zero_init_proj": ({"positions": "rotary", "norm": "rmsnorm", "qk_norm": True,
                                             "tie_embeddings": False, "activation": "relu2", "zero_init_proj": True},
                                            "ApertusForCausalLM"),
}


@pytest.mark.parametrize("options, class_name", ARCHITECTURES.values(), ids=ARCHITECTURES.keys())
def test_each_architecture_gives_our_logits(tmp_path, options, class_name):
    ours, path = snapshot_file(tmp_path / "snaps", **options)
    assert export_hf(str(path), str(tmp_path / "hf"), GPTConfig) == str(tmp_path / "hf")
    assert {p.name for p in (tmp_path / "hf").iterdir()} == HF_FILES  # no temporary file left
    theirs = load_hf(tmp_path / "hf")
    assert type(theirs).__name__ == class_name and theirs.dtype == torch.float32
    tied = theirs.get_output_embeddings().weight is theirs.get_input_embeddings().weight
    assert tied == ours.config.tie_embeddings
    ids = torch.randint(0, len(VOCAB), (3, BLOCK), generator=torch.Generator().manual_seed(1))
    assert max_logit_difference(ours, theirs, ids) <= HF_TOLERANCE


def test_the_tokenizer_is_our_vocabulary_character_by_character_and_refuses_unknown_characters(tmp_path):
    ours, path = snapshot_file(tmp_path / "snaps")
    export_hf(str(path), str(tmp_path / "hf"), GPTConfig)
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
    text = "Before  we é😀\n\nproceed, speak.\n"
    ids = tokenizer(text).input_ids
    assert ids == CharVocab(VOCAB).encode(text).tolist() and len(tokenizer) == len(VOCAB)
    assert tokenizer.decode(ids) == text  # spaces, newlines and all, as they were
    # A character outside the vocabulary has no id to stand for it: an error, as in sample.py.
    with pytest.raises(Exception, match=r"Missing \[UNK\] token"):
        tokenizer("speak!")
    with pytest.raises(UsageError, match="not in the vocabulary: '!'"):
        sample.generate_text(ours, CharVocab(VOCAB), "speak!", 1, 1.0, 1, torch.Generator())


def test_an_fsspec_target_gets_the_same_files(tmp_path):
    import fsspec
    from safetensors.torch import load

    _, path = snapshot_file(tmp_path / "snaps", positions="rotary")
    export_hf(str(path), str(tmp_path / "hf"), GPTConfig)
    assert export_hf(str(path), "memory://hf-export/run", GPTConfig) == "memory://hf-export/run"
    fs = fsspec.filesystem("memory")
    written = {name: fs.cat_file(f"/hf-export/run/{name}") for name in HF_FILES}
    for name in HF_FILES - {"model.safetensors"}:  # its header's order varies from one write to the next
        assert written[name] == (tmp_path / "hf" / name).read_bytes(), name
    remote, local = (load(data) for data in (written["model.safetensors"], (tmp_path / "hf/model.safetensors")
                                             .read_bytes()))
    assert remote.keys() == local.keys() and all(torch.equal(remote[key], local[key]) for key in local)


# ------------------------------------------------------------------------------------------------ refusals
REFUSALS = {
    "bigram_embedding": ({"bigram_embedding": True}, "gpt_config.bigram_embedding=true (no architecture"),
    "logit_softcap": ({"logit_softcap": 30.0}, "gpt_config.logit_softcap=30.0 (no architecture"),
    "rmsnorm with learned positions": ({"norm": "rmsnorm"}, "gpt_config.norm=rmsnorm with positions=learned"),
    "qk_norm with learned positions": ({"qk_norm": True}, "gpt_config.qk_norm=true with positions=learned, "
                                                          "norm=layernorm"),
    "qk_norm with layernorm": ({"qk_norm": True, "positions": "rotary"}, "gpt_config.qk_norm=true with "
                                                                         "positions=rotary, norm=layernorm"),
    "qk_norm with biases": ({"qk_norm": True, "positions": "rotary", "norm": "rmsnorm", "bias": True},
                            "gpt_config.qk_norm=true with bias=true"),
}


@pytest.mark.parametrize("options, message", REFUSALS.values(), ids=REFUSALS.keys())
def test_an_option_without_an_exact_equivalent_is_refused_in_one_line(tmp_path, capsys, options, message):
    _, path = snapshot_file(tmp_path / "snaps", **options)
    assert snapshot.cli(["export", str(path), str(tmp_path / "hf"), "--format", "hf"]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1, captured.err
    assert captured.err.startswith(f"error: cannot export as a Hugging Face model: {message}"), captured.err
    assert not (tmp_path / "hf").exists()


def test_transformers_and_tokenizers_are_imported_inside_functions_only():
    """A run, sample.py or another export never loads them (seconds of imports): no module of the project imports
    them at its top, only functions do (hf_export's, and snapshot.py's import of it is in one too)."""
    at_top = []
    for path in project_modules():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        inside = {id(node) for function in ast.walk(tree) if isinstance(function, ast.FunctionDef)
                  for node in ast.walk(function)}
        for node in ast.walk(tree):
            names = [alias.name for alias in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            if id(node) not in inside and any(name.split(".")[0] in LAZY or name.endswith("hf_export")
                                              for name in names):
                at_top.append(f"{path.relative_to(PROJECT_DIR)}:{node.lineno}")
    assert at_top == []
    source = (PROJECT_DIR / "mingpt/checkpoint/hf_export.py").read_text(encoding="utf-8")
    assert "from transformers import" in source and "from tokenizers import" in source  # the check sees them
