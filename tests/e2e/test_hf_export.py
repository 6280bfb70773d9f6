"""`snapshot.py export --format hf` on trained snapshots, the acceptance check: one trained by two DDP processes (a
file) and one by two FSDP processes (a folder of shards), exported by snapshot.py, give our logits and, greedily,
sample.py's text (per architecture, in one process: tests/unit/test_hf_export.py)."""

from __future__ import annotations

import contextlib
import io
import subprocess
from pathlib import Path

import pytest
import torch
from support import (
    HF_TOLERANCE,
    assert_ok,
    cli,
    load_hf,
    max_logit_difference,
    run_cli,
    subprocess_env,
)

import sample
import snapshot
from mingpt import compat
from mingpt.checkpoint import store as snap

transformers = pytest.importorskip("transformers")  # requirements-hf.txt; CI's oldest-torch leg has none

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
    "ddp", pytest.param("fsdp", marks=pytest.mark.skipif(compat.TORCH < compat.FSDP_TORCH,
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
    assert max_logit_difference(ours, theirs, ids) <= HF_TOLERANCE

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
