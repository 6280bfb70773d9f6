"""The trainer in one process (no process group): steps, accumulation, evaluation, precision, sampling. Trainers
are built by main.build_trainer (support.make_trainer), as a run builds them."""

import pytest
import torch
from support import corpus_text, make_trainer, read_summary

import main
from char_dataset import CharCorpus, DataConfig
from mingpt.distributed.process_group import setup_distributed
from mingpt.errors import UsageError
from mingpt.reporting.logs import read_metrics
from model import GPT, GPTConfig
from trainer import (
    resolve_attention,
    resolve_precision,
    seed_dropout,
)


def test_fit_writes_metrics_and_loss_falls(tmp_path):
    trainer = make_trainer(tmp_path, max_steps=30, batch_size=16, eval_every_steps=10)
    trainer.fit()
    rows = read_metrics(tmp_path)
    train_rows = [r for r in rows if "train_loss" in r]
    val_rows = [r for r in rows if "val_loss" in r]
    assert [r["step"] for r in train_rows] == [5, 10, 15, 20, 25, 30]
    assert [r["step"] for r in val_rows] == [10, 20, 30]
    assert train_rows[-1]["train_loss"] < train_rows[0]["train_loss"] - 0.5
    assert all(r["tokens_per_s"] > 0 and "lr" in r and "epoch" in r for r in train_rows)
    summary = read_summary(tmp_path)
    assert summary["steps"] == 30 and summary["replicas_identical"]


def test_gradient_accumulation_matches_one_big_batch():
    """batch 4 x 2 micro-steps must give (nearly) the update of batch 8 x 1: same samples, same mean loss.

    AdamW with an epsilon above every gradient entry (the norm is clipped to 1): its first update is then ~lr * g,
    not g / |g|, which moves a weight whose gradient is at rounding level by a whole learning rate either way, as
    the fp32 sums of the two ways flip its sign. Tolerance: a few roundings of a weight of ~1 (6e-8 each)."""
    big = make_trainer(max_steps=1, batch_size=8, grad_accum_steps=1, learning_rate=1.0, eps=1.0)
    small = make_trainer(max_steps=1, batch_size=4, grad_accum_steps=2, learning_rate=1.0, eps=1.0)
    start = [p.detach().clone() for p in big.parallel.modules[0].parameters()]
    big.fit()
    small.fit()
    moved = 0.0
    for (name, a), b, before in zip(big.parallel.modules[0].named_parameters(), small.parallel.modules[0].parameters(),
                                    start):
        assert torch.allclose(a, b, rtol=0, atol=1e-6), name
        moved = max(moved, (a - before).abs().max().item())
    assert moved > 1e-3  # the step moved the weights: the comparison is of an update, not of the initial weights


def test_epoch_boundaries_and_max_epochs():
    trainer = make_trainer(max_epochs=2, batch_size=512, eval_every_steps=0)
    assert trainer.steps_per_epoch == len(trainer.sampler) // 512
    trainer.fit()
    assert trainer.step == 2 * trainer.steps_per_epoch and trainer.epoch == 2


def test_evaluation_is_deterministic_and_in_eval_mode():
    trainer = make_trainer(max_steps=1, batch_size=8, dropout=0.3)
    first, second = trainer.validation_loss(), trainer.validation_loss()
    assert first == second  # dropout off during evaluation
    assert trainer.parallel.modules[0].training  # and back in training mode afterwards


def test_evaluation_runs_micro_batch_sized_passes_and_their_mean_is_the_whole_batchs():
    """An evaluation batch (4 x batch_size windows) goes through the model batch_size windows at a time, so its
    logits are never larger than a training step's (a vocabulary of thousands makes them most of the memory); the
    mean over its counted targets is the one-pass mean, padding included (a slice of padding alone counts for
    nothing instead of making the mean nan)."""
    trainer = make_trainer(max_steps=1, batch_size=8)
    model = trainer.parallel.modules[0]
    rows_per_pass = []
    hook = model.register_forward_pre_hook(lambda module, args: rows_per_pass.append(args[0].size(0)))
    trainer.validation_loss()
    hook.remove()
    assert trainer.eval_batch_size == 32 and set(rows_per_pass) == {8}
    x, y = trainer.split(next(iter(trainer.val_loader))[:10])
    x, y = trainer.eval_shaped(x, y)  # 10 windows padded to 32: the last two slices are padding alone
    assert x.size(0) == 32
    trainer.parallel.train(False)
    whole = trainer.parallel.evaluate(x, y)
    sliced = trainer.parallel.evaluate(x, y, max_rows=8)
    trainer.parallel.train(True)
    assert torch.isfinite(sliced) and abs(sliced.item() - whole.item()) < 1e-6 * whole.item()


def test_dropout_masks_depend_on_step_and_rank():
    cpu = torch.device("cpu")
    seed_dropout(1337, 5, 0, cpu)
    a = torch.rand(4)
    seed_dropout(1337, 5, 0, cpu)
    assert torch.equal(a, torch.rand(4))  # a pure function of (seed, step, rank)
    seed_dropout(1337, 6, 0, cpu)
    assert not torch.equal(a, torch.rand(4))
    seed_dropout(1337, 5, 1, cpu)
    assert not torch.equal(a, torch.rand(4))
    seed_dropout(1338, 5, 0, cpu)
    assert not torch.equal(a, torch.rand(4))


def test_fp16_on_cpu_uses_a_grad_scaler(tmp_path):
    trainer = make_trainer(tmp_path, max_steps=5, batch_size=8, mixed_precision="fp16", eval_every_steps=0)
    assert trainer.scaler.is_enabled()
    trainer.fit()
    rows = read_metrics(tmp_path)
    assert "loss_scale" in rows[0]


def test_bf16_on_cpu_trains():
    trainer = make_trainer(max_steps=3, batch_size=8, mixed_precision="bf16", eval_every_steps=0)
    assert not trainer.scaler.is_enabled()
    trainer.fit()
    assert trainer.last_val_loss is not None and trainer.last_val_loss < 10


def test_precision_resolution_on_cpu(monkeypatch):
    cpu = torch.device("cpu")
    for native, expected in ((True, torch.bfloat16), (False, torch.float32)):  # bf16 only with bf16 instructions
        monkeypatch.setattr("trainer.cpu_has_native_bf16", lambda native=native: native)
        assert resolve_precision("auto", cpu) == expected
    assert resolve_precision("bf16", cpu) == torch.bfloat16
    assert resolve_precision("fp16", cpu) == torch.float16


def test_too_few_windows_for_one_step():
    with pytest.raises(UsageError, match="needs batch_size"):
        make_trainer(max_steps=1, batch_size=100_000)


def test_a_resume_between_log_lines_logs_what_the_uninterrupted_run_logs(tmp_path):
    """A snapshot taken between two log lines (a SIGTERM, save_every_steps) carries the partial loss window: the
    resumed run's next line averages the same steps, to the same value, as the uninterrupted run's."""
    common = {"max_steps": 20, "batch_size": 8, "log_every_steps": 10, "eval_every_steps": 0, "save_every_steps": 7,
              "keep_last": 5}
    whole = make_trainer(tmp_path / "whole", snapshots=tmp_path / "snaps", **common)
    whole.fit()
    for later in ("snapshot-000000014.pt", "snapshot-000000020.pt"):  # as if the job had stopped at step 7
        (tmp_path / "snaps" / later).unlink()
    resumed = make_trainer(tmp_path / "resumed", snapshots=tmp_path / "snaps", **common)
    resumed.fit()
    want = {r["step"]: r["train_loss"] for r in read_metrics(tmp_path / "whole") if "train_loss" in r}
    got = {r["step"]: r["train_loss"] for r in read_metrics(tmp_path / "resumed") if "train_loss" in r}
    assert got == {10: want[10], 20: want[20]}


def test_a_snapshot_older_than_the_epoch_order_finishes_its_epoch_in_its_own_order(tmp_path):
    """A snapshot written mid-epoch before `epoch_order` existed (no such field: torch.randperm's order) resumes
    that epoch in randperm's order and the next in the current one: the same weights as a run that never stopped
    (its first epoch in randperm's order too); one of an unknown order is refused in one line."""
    from char_dataset import EPOCH_ORDER, LEGACY_ORDER
    from mingpt.checkpoint import store as snap

    common = {"max_epochs": 2, "batch_size": 256, "eval_every_steps": 0, "save_every_steps": 30, "keep_last": 9}
    whole = make_trainer(snapshots=tmp_path / "whole", **common)
    assert 40 < whole.steps_per_epoch < 90  # the snapshot at step 30 is mid-epoch, and the run crosses an epoch
    whole.epoch_order = LEGACY_ORDER  # what the older version ran its first epoch in
    whole.fit()
    old = snap.from_bytes((tmp_path / "whole" / snap.snapshot_name(30)).read_bytes(), "step 30")
    assert old["progress"].pop("epoch_order") == LEGACY_ORDER and old["progress"]["epoch_samples"] > 0
    old["integrity_sha256"] = snap.integrity_sha256(old)
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / snap.snapshot_name(30)).write_bytes(snap.to_bytes(old))
    resumed = make_trainer(snapshots=tmp_path / "old", **common)
    resumed.fit()
    assert resumed.epoch_order == EPOCH_ORDER and resumed.step == whole.step
    for a, b in zip(whole.parallel.modules[0].parameters(), resumed.parallel.modules[0].parameters()):
        assert torch.equal(a, b)

    old["progress"]["epoch_order"] = "feistel-9"
    old["integrity_sha256"] = snap.integrity_sha256(old)
    (tmp_path / "old" / snap.snapshot_name(30)).write_bytes(snap.to_bytes(old))
    for later in (tmp_path / "old").iterdir():
        if later.name != snap.snapshot_name(30):
            later.unlink()
    with pytest.raises(UsageError, match=r"epoch order 'feistel-9' is unknown to this version"):
        make_trainer(snapshots=tmp_path / "old", **common).fit()


@pytest.mark.parametrize("max_norm", [1e9, 0.05])  # nothing clipped; everything clipped
def test_clipping_gives_torchs_bits(max_norm):
    """parallel.clip_grad_norm (the norm returned as a plain tensor, also under FSDP) against torch.nn.utils."""
    from mingpt.parallel.parallelize import clip_grad_norm

    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=16, vocab_size=11, block_size=8))
    _, loss = model(torch.randint(0, 11, (4, 8)), torch.randint(0, 11, (4, 8)))
    loss.backward()
    params = list(model.parameters())
    grads = [p.grad.clone() for p in params]
    expected_norm = torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=True)
    expected = [p.grad.clone() for p in params]
    for p, g in zip(params, grads):
        p.grad = g.clone()
    norm = clip_grad_norm(params, max_norm)
    assert torch.equal(norm, expected_norm)
    assert all(torch.equal(p.grad, e) for p, e in zip(params, expected))
    assert (max_norm < norm.item()) == any(not torch.equal(p.grad, g) for p, g in zip(params, grads))


def test_attention_resolution():
    cpu, gpu = torch.device("cpu"), torch.device("cuda", 0)
    assert resolve_attention("auto", cpu, torch.bfloat16, 64, 0.0) == "matmul"  # CPU flash backward is slow in bf16
    assert resolve_attention("auto", cpu, torch.bfloat16, 256, 0.0) == "matmul"
    assert resolve_attention("auto", cpu, torch.bfloat16, 512, 0.0) == "sdpa"  # flash wins at long contexts
    assert resolve_attention("auto", cpu, torch.bfloat16, 1024, 0.2) == "matmul"  # with dropout sdpa writes them too
    assert resolve_attention("auto", cpu, torch.bfloat16, 2048, 0.2) == "sdpa"  # (T x T) scores: memory
    assert resolve_attention("auto", cpu, torch.float32, 64, 0.0) == "sdpa"
    assert resolve_attention("auto", gpu, torch.bfloat16, 64, 0.0) == "sdpa"
    assert resolve_attention("sdpa", cpu, torch.bfloat16, 64, 0.0) == "sdpa"  # what the user set stands
    assert resolve_attention("matmul", gpu, torch.float32, 4096, 0.0) == "matmul"


def test_a_default_run_on_a_bf16_cpu_records_what_ran(monkeypatch):
    """mixed_precision=auto and attention=auto on a CPU with bf16 instructions: bf16 with matmul attention, and the
    snapshot's model_config says matmul (sample.py rebuilds the model from it), not auto."""
    monkeypatch.setattr("trainer.cpu_has_native_bf16", lambda: True)
    cfg = main.load_config(["preset=nanogpt_cpu", "gpt_config.n_layer=1", "trainer_config.max_steps=2"])
    corpus = CharCorpus.from_text(corpus_text(400), DataConfig(block_size=cfg.data_config.block_size))
    trainer = main.build_trainer(cfg, corpus, setup_distributed(), run_dir=None, with_snapshots=False)
    assert trainer.amp_dtype == torch.bfloat16
    assert trainer.checkpoints.metadata["model_config"]["attention"] == "matmul"
    assert trainer.parallel.modules[0].transformer.h[0].attn.attention == "matmul"
    trainer.train_step()
