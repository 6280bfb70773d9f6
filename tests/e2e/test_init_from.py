"""gpt_config.init_from through the real CLI: two DDP processes (torchrun) start from a GPT2LMHeadModel folder that
transformers saved, with its tokenizer and its vocabulary, and a rerun resumes from the run's newest snapshot, not
from the folder. The mapping itself, each layout's build and the refusals: tests/unit/test_hf_import.py; bad input in
one line through the CLI: tests/e2e/test_bad_input.py ("init_from: ...")."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from support import PROJECT_DIR, assert_ok, run_cli

from mingpt.checkpoint import store as snap

transformers = pytest.importorskip("transformers")  # requirements-hf.txt; CI's oldest-torch leg has none

from mingpt.data.tokenizer import BpeTokenizer  # noqa: E402 (after the skip: it needs tokenizers)

VOCAB = 320  # more rows than the tokenizer's 300 tokens: kept whole
# A learning rate so small that two AdamW steps move no weight by more than 1e-9: the snapshot after them is the
# starting point, to that precision (a random start is ~0.02 away)
STILL = ["optimizer_config.learning_rate=1e-12", "optimizer_config.min_lr=0", "optimizer_config.warmup_steps=0"]


def args(folder: Path, steps: int) -> list[str]:
    """A short run from `folder`: no gpt_config shape (the folder's), a window within its 64 positions."""
    return [f"gpt_config.init_from={folder}", "gpt_config.dropout=0.0", "data_config.truncate=0.02",
            "data_config.block_size=32", *STILL, "trainer_config.batch_size=4", "trainer_config.mixed_precision=fp32",
            "trainer_config.eval_batches=1", "trainer_config.progress=off", f"trainer_config.max_steps={steps}",
            "trainer_config.save_every_steps=2"]


def test_two_processes_start_from_a_gpt2_folder_and_a_rerun_resumes_its_snapshot(tmp_path):
    text = (PROJECT_DIR / "data" / "input.txt").read_text(encoding="utf-8")[:20000]
    tokenizer = BpeTokenizer.train([text], 300, "test")
    config = transformers.GPT2Config(n_layer=2, n_head=2, n_embd=32, n_positions=64, vocab_size=VOCAB)
    folder = tmp_path / "gpt2"
    torch.manual_seed(0)
    transformers.GPT2LMHeadModel(config).save_pretrained(str(folder))
    (folder / "tokenizer.json").write_text(tokenizer.json, encoding="utf-8")
    from safetensors.torch import load_file, save_file

    theirs = load_file(str(folder / "model.safetensors"))

    assert_ok(run_cli(args(folder, steps=2), tmp_path, nproc=2))
    first = snap.read_snapshot(str(tmp_path / "snapshots" / snap.snapshot_name(2)))
    assert first["model_config"]["activation"] == "gelu_tanh" and first["model_config"]["vocab_size"] == VOCAB
    assert first["model_config"]["block_size"] == 64 and "init_from" not in first["model_config"]
    assert first["tokenizer"]["tokenizer_json"] == tokenizer.json  # the folder's tokenizer is the run's
    weights = snap.model_tensors(first)
    conv = ("c_attn.weight", "c_proj.weight", "c_fc.weight")
    for name, tensor in theirs.items():
        ours = weights[name].t() if name.endswith(conv) else weights[name]
        assert torch.allclose(ours, tensor, rtol=0, atol=1e-9), name

    # Other weights in the folder: a rerun resumes from the step-2 snapshot, not from the folder
    save_file({name: tensor + 1.0 for name, tensor in theirs.items()}, str(folder / "model.safetensors"))
    rerun = run_cli(args(folder, steps=4), tmp_path, nproc=2)
    assert_ok(rerun)
    assert "resumed from" in rerun.stdout + rerun.stderr
    last = snap.model_tensors(snap.read_snapshot(str(tmp_path / "snapshots" / snap.snapshot_name(4))))
    assert all(torch.allclose(last[name], weights[name], rtol=0, atol=1e-9) for name in weights)
