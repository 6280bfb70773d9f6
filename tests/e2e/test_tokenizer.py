"""data_config.tokenizer=bpe through the real CLI: a byte-level BPE trained on the corpus once (by the cache), a
worker SIGKILLed under torchrun resuming bit-for-bit, sample.py generating from the snapshot alone, FSDP and the
pipeline layout training it; and the refusals, one line each with exit 2 and the snapshots untouched: resuming a
character snapshot with bpe (and a bpe one with characters), a tokenizer path that does not exist or is not a
tokenizer, a vocab_size below 256. In one process: tests/unit/test_tokenizer.py."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
from support import (
    PROJECT_DIR,
    Case,
    Fault,
    assert_ok,
    assert_one_error_line,
    cli,
    job_args,
    make_snapshot,
    read_summary,
    run_case,
    run_cli,
    subprocess_env,
)

from mingpt import compat
from mingpt.checkpoint import store as snap
from mingpt.reporting.logs import read_metrics

TEXT = (PROJECT_DIR / "data" / "input.txt").read_text(encoding="utf-8")[:120_000]
BPE = ("data_config.tokenizer=bpe", "data_config.vocab_size=320", "data_config.truncate=1.0")


def bpe_args(snaps: str, run_dir: str, folder: str, *more: str, **trainer_config: object) -> tuple[str, ...]:
    """The tiny model on TEXT (corpus.txt in `folder`, its cache there too) with a BPE of 320 tokens."""
    return tuple(job_args(snaps, run_dir, *BPE, f"data_config.path={folder}/corpus.txt",
                          f"data_config.cache_dir={folder}/cache", *more, **trainer_config))


def sample(snapshot: Path, tmp_path: Path, *more: str) -> subprocess.CompletedProcess:
    return subprocess.run(cli([f"snapshot={snapshot}", *more], script="sample.py"), cwd=tmp_path,
                          env=subprocess_env(tmp_path), capture_output=True, text=True, timeout=120)


def test_a_bpe_run_resumes_bit_for_bit_and_its_snapshot_alone_generates_text(tmp_path):
    """2 processes: the BPE trained once (rank 0, before the group), the restart finds it in the cache; a worker
    SIGKILLed at step 25 resumes to the weights and every logged value (val_bpb included) of the run that was not
    interrupted. Then sample.py from the snapshot with the cache gone, and a character run refused on the folder."""
    (tmp_path / "corpus.txt").write_text(TEXT, encoding="utf-8")  # the reference run's too (its cache its own)
    args = bpe_args("{s}", "{d}/run", "{d}", f"data_config.path={tmp_path / 'corpus.txt'}", max_steps=50,
                    save_every_steps=10)
    killed = run_case(Case("bpe", args, nproc=2, fault=Fault(at_step=25), reference=True, expect=("resumed from",)),
                      tmp_path)
    log = killed.output
    assert log.count("data: trained a byte-level BPE of 320 tokens") == 1 and log.count("data: encoding") == 1
    assert "tokens of" in log and "a byte-level BPE of 320 tokens (cache" in log
    rows, reference = read_metrics(tmp_path / "run"), read_metrics(killed.reference)
    evaluated = {r["step"]: r for r in reference if "val_loss" in r}
    assert evaluated and all("val_bpb" in r for r in evaluated.values())
    for row in rows:
        if "val_loss" in row:
            assert (row["val_loss"], row["val_bpb"]) == (evaluated[row["step"]]["val_loss"],
                                                         evaluated[row["step"]]["val_bpb"])
    summary = read_summary(tmp_path / "run")
    assert summary["val_bpb"] == evaluated[50]["val_bpb"] > 0

    snaps = tmp_path / "snaps"
    newest = snap.summary(snap.read_snapshot(str(snaps / snap.snapshot_name(50))))
    assert (newest["tokenizer"], newest["vocab_size"], newest["format_version"]) == ("bpe", 320, snap.FORMAT_VERSION)
    shutil.rmtree(tmp_path / "cache")  # the snapshot alone
    (tmp_path / "corpus.txt").unlink()
    generated = sample(snaps, tmp_path, "prompt=ROMEO:", "max_new_tokens=40")
    assert_ok(generated)
    assert generated.stdout.startswith("ROMEO:") and len(generated.stdout) > len("ROMEO:") + 20, generated.stdout
    assert generated.stdout == sample(snaps, tmp_path, "prompt=ROMEO:", "max_new_tokens=40").stdout  # the seed's

    before = {p.name: p.read_bytes() for p in snaps.iterdir()}
    refused = run_cli([*job_args(snaps, tmp_path / "char", max_steps=60)], tmp_path)
    assert refused.returncode == 2
    assert_one_error_line(refused, "was trained with the bpe tokenizer, this run uses char "
                                   r"\(data_config.tokenizer=char\)")
    assert {p.name: p.read_bytes() for p in snaps.iterdir()} == before


def test_resuming_a_character_snapshot_with_bpe_is_refused_in_one_line(tmp_path):
    snaps = tmp_path / "snaps"
    snaps.mkdir()
    (tmp_path / "corpus.txt").write_text(TEXT, encoding="utf-8")
    (snaps / snap.snapshot_name(10)).write_bytes(snap.to_bytes(make_snapshot()))  # characters, format 1
    before = (snaps / snap.snapshot_name(10)).read_bytes()
    refused = run_cli(list(bpe_args(str(snaps), str(tmp_path / "run"), str(tmp_path), max_steps=20)), tmp_path)
    assert refused.returncode == 2
    assert_one_error_line(refused, "was trained with the char tokenizer, this run uses bpe")
    assert [p.name for p in snaps.iterdir()] == [snap.snapshot_name(10)]
    assert (snaps / snap.snapshot_name(10)).read_bytes() == before


@pytest.mark.parametrize("setting, error", [
    ("data_config.tokenizer={d}/missing/tokenizer.json", "no such tokenizer file or folder: .*missing"),
    ("data_config.tokenizer={d}", "holds no tokenizer.json"),
    ("data_config.tokenizer={d}/corpus.txt", "corpus.txt is not a tokenizer"),
    ("data_config.vocab_size=255", "data_config.vocab_size must be between 256"),
])
def test_a_bad_tokenizer_setting_is_one_line(setting, error, tmp_path):
    """Refused while the settings are checked: before a run folder, a process group or the cache."""
    run_case(Case("bad", (*BPE, setting, "data_config.path={d}/corpus.txt", "data_config.cache_dir={d}/cache",
                          "hydra.run.dir={d}/run"),
                  files=(("corpus.txt", TEXT[:20000].encode()),), exit_code=2, error=error, no_run_dir=True), tmp_path)
    assert not (tmp_path / "cache").exists()


@pytest.mark.skipif(compat.TORCH < compat.FSDP_TORCH, reason="mesh layouts on a CPU need torch 2.7")
@pytest.mark.parametrize("layout", ["parallel_config.strategy=fsdp", "parallel_config.tp=2", "parallel_config.pp=2"])
def test_sharded_layouts_train_a_bpe_and_their_shards_generate(layout, tmp_path):
    (tmp_path / "corpus.txt").write_text(TEXT, encoding="utf-8")
    snaps = tmp_path / "snaps"
    trained = run_cli(list(bpe_args(str(snaps), str(tmp_path / "run"), str(tmp_path), layout, max_steps=10)),
                      tmp_path, nproc=2)
    assert_ok(trained)
    assert read_summary(tmp_path / "run")["replicas_identical"]
    shards = snaps / snap.snapshot_name(10, sharded=True)
    assert snap.summary(snap.read_snapshot(str(shards)))["tokenizer"] == "bpe"
    assert_ok(sample(shards, tmp_path, "max_new_tokens=10"))
