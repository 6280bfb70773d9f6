"""`snapshot.py export --format hf` (mingpt/checkpoint/hf_export.py): the folder transformers loads offline computes
our model's function. In this process, per architecture: a random GPT moved off its initialisation, exported from its
snapshot file and loaded by AutoModelForCausalLM, gives our logits (fp32, within 1e-5) under GPT-2 (tied and untied,
gelu and relu2, with and without biases), GPT-NeoX, Arcee and Apertus; the tokenizer is our vocabulary's, character
by character; each option without an exact equivalent is refused in one line; only the export imports transformers.
Then the acceptance check on trained snapshots: one trained by two DDP processes (a file) and one by two FSDP
processes (a folder of shards), exported by snapshot.py, give our logits and, greedily, sample.py's text."""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import io
import subprocess
from pathlib import Path

import pytest
import torch
from support import PROJECT_DIR, assert_ok, cli, project_modules, run_cli, subprocess_env

import sample
import snapshot
from char_dataset import CharVocab
from mingpt import compat
from mingpt.checkpoint import store as snap
from mingpt.checkpoint.hf_export import export_hf
from mingpt.errors import UsageError
from model import GPT, GPTConfig

transformers = pytest.importorskip("transformers")  # requirements-hf.txt; CI's oldest-torch leg has none

TOLERANCE = 1e-5  # fp32: the same function, computed by other kernels
TEXT = "First Citizen:\nBefore we proceed any further, hear me speak.\n"
VOCAB = "".join(sorted(set(TEXT + "é😀")))  # a character outside the BMP too: tokens are characters, not bytes
BLOCK = 24
LAZY = ("transformers", "tokenizers")  # imported by `snapshot.py export --format hf` alone
HF_FILES = {"model.safetensors", "config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"}


def snapshot_file(folder: Path, seed: int = 0, **options) -> tuple[GPT, Path]:
    """A GPT with `options`, its weights moved well off their initialisation (norm gains and biases included, so that
    each shapes the output), saved as a snapshot file; the model, in eval mode, and the file."""
    cfg = GPTConfig(n_layer=2, n_head=2, n_embd=16, dropout=0.0, vocab_size=len(VOCAB), block_size=BLOCK, **options)
    torch.manual_seed(seed)
    model = GPT(cfg).eval()
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.1 * torch.randn(param.shape))
    state = {"model": model.state_dict(), "optimizer": {}, "scaler": {},
             "progress": {"step": 7, "epoch": 0, "epoch_samples": 56}}
    built = snap.build(state, {"model_config": dataclasses.asdict(cfg), "vocab": VOCAB}, world_size=1)
    path = folder / snap.snapshot_name(7)
    folder.mkdir(parents=True, exist_ok=True)
    path.write_bytes(snap.to_bytes(built))
    return model, path


def load_hf(folder: Path):  # noqa: ANN201 (a transformers model)
    """The exported model, as any transformers user loads it; no weight missing, left over or of another shape."""
    model, info = transformers.AutoModelForCausalLM.from_pretrained(str(folder), output_loading_info=True)
    assert {key: value for key, value in info.items() if value} == {}
    return model.eval()


@torch.no_grad()
def max_logit_difference(ours: GPT, theirs, ids: torch.Tensor) -> float:  # noqa: ANN001
    return (ours(ids)[0] - theirs(input_ids=ids).logits).abs().max().item()


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
    assert max_logit_difference(ours, theirs, ids) <= TOLERANCE


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


# ------------------------------------------------------------------------------------------------ trained snapshots
PROMPT = "First Citizen:\n"
# A model that learns in a few seconds to say more than one character greedily (a constant text would not show a
# wrong position or cache): after 150 DDP steps, 2.49 validation loss and "ROMEO:\nTINIUS:\nTon the the" at top_k=1.
TRAINING = ["data_config.truncate=0.05", "data_config.block_size=32", "gpt_config.n_layer=1", "gpt_config.n_head=4",
            "gpt_config.n_embd=64", "gpt_config.dropout=0.0", "optimizer_config.learning_rate=1e-2",
            "optimizer_config.warmup_steps=10", "optimizer_config.min_lr=1e-3", "trainer_config.batch_size=16",
            "trainer_config.mixed_precision=fp32", "trainer_config.eval_batches=2"]
TRAINED = {
    # GPT-2's options, one file written by rank 0 of two DDP processes
    "ddp": (150, [], "GPT2LMHeadModel", True),
    # every option that has an equivalent (Apertus; it learns faster, and a step of FSDP costs more), shards written
    # by two FSDP processes
    "fsdp": (80, ["parallel_config.strategy=fsdp", "gpt_config.positions=rotary", "gpt_config.norm=rmsnorm",
                  "gpt_config.qk_norm=true", "gpt_config.activation=relu2", "gpt_config.tie_embeddings=false"],
             "ApertusForCausalLM", False),
}


@pytest.fixture(scope="module", params=[
    "ddp", pytest.param("fsdp", marks=pytest.mark.skipif(compat.TORCH < compat.CPU_FSDP_TORCH,
                                                         reason="FSDP on a CPU needs torch 2.7"))])
def trained(request, tmp_path_factory) -> tuple[Path, str, bool]:
    """A snapshot of the TRAINING model on tiny-shakespeare by two torchrun processes (gloo), the architecture it
    maps onto, and whether the test runs the commands as processes."""
    steps, options, class_name, as_processes = TRAINED[request.param]
    folder = tmp_path_factory.mktemp(request.param)
    args = [*TRAINING, *options, f"trainer_config.max_steps={steps}", f"trainer_config.eval_every_steps={steps}",
            f"hydra.run.dir={folder / 'run'}"]
    assert_ok(run_cli(args, folder, nproc=2))
    path = folder / "snapshots" / snap.snapshot_name(steps, sharded=request.param == "fsdp")
    assert path.exists(), sorted((folder / "snapshots").iterdir())
    return path, class_name, as_processes


def test_a_trained_snapshot_gives_our_logits_and_sample_pys_greedy_text(trained, tmp_path):
    """The DDP snapshot through the commands as a user runs them (snapshot.py, sample.py), the FSDP one through
    the same commands' functions in this process (each process costs seconds of imports)."""
    path, class_name, as_processes = trained
    exported = export_command(["export", str(path), str(tmp_path / "hf"), "--format", "hf"], tmp_path, as_processes)
    assert exported == f"{tmp_path / 'hf'}\n"
    theirs, tokenizer = load_hf(tmp_path / "hf"), transformers.AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
    assert type(theirs).__name__ == class_name
    ours, vocab = sample.model_from_snapshot(snap.read_snapshot(str(path)), torch.device("cpu"))
    block = ours.config.block_size
    ids = torch.randint(0, len(vocab), (4, block), generator=torch.Generator().manual_seed(2))
    assert max_logit_difference(ours, theirs, ids) <= TOLERANCE

    # Greedy: sample.py with top_k=1. Prompt and new text fill the block and no more: beyond it sample.py crops the
    # context to the last block_size characters and starts their positions at 0 again, which transformers'
    # generate() does not do (and GPT-2 has no position embedding beyond block_size).
    new = block - len(PROMPT)
    (tmp_path / "prompt.txt").write_text(PROMPT)  # a newline in a Hydra override stays a backslash and an n
    sampled = sample_command([f"snapshot={path}", f"prompt_file={tmp_path / 'prompt.txt'}", f"max_new_tokens={new}",
                              "top_k=1"], tmp_path, as_processes)
    generated = theirs.generate(**tokenizer(PROMPT, return_tensors="pt"), do_sample=False, max_new_tokens=new)
    text = tokenizer.decode(generated[0])
    assert len(text) == block and text.startswith(PROMPT)
    assert len(set(text[len(PROMPT):])) >= 3  # not one character over and over, which would show little
    assert sampled == text + "\n"


def script_output(script: str, args: list[str], tmp_path: Path) -> str:
    """What `python SCRIPT ARGS` prints, run as a process (exit code 0)."""
    result = subprocess.run(cli(args, script=script), cwd=tmp_path, env=subprocess_env(tmp_path),
                            capture_output=True, text=True, timeout=120)
    assert_ok(result)
    return result.stdout


def export_command(args: list[str], tmp_path: Path, as_process: bool) -> str:
    """What `python snapshot.py ARGS` prints (exit code 0), run as a process or by its function here."""
    if as_process:
        return script_output("snapshot.py", args, tmp_path)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert snapshot.cli(args) == 0
    return printed.getvalue()


def sample_command(overrides: list[str], tmp_path: Path, as_process: bool) -> str:
    """What `python sample.py OVERRIDES` prints (exit code 0), run as a process or by its function here."""
    if as_process:
        return script_output("sample.py", overrides, tmp_path)
    settings = dict(override.split("=", 1) for override in overrides)
    config = sample.SampleConfig(**{**settings, "max_new_tokens": int(settings["max_new_tokens"]),
                                    "top_k": int(settings["top_k"])})
    return "\n".join(sample.run(config)) + "\n"
