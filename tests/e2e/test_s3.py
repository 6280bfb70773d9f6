"""Snapshots and corpora on S3: a real S3-compatible server (moto's standalone server) on 127.0.0.1, spoken to
over HTTP by s3fs in the training processes, and checked with a separate client (boto3)."""

import json
import subprocess
import sys

import numpy as np
import pytest
from support import PROJECT_DIR, Case, Fault, assert_ok, job_args, read_summary, run_case, run_cli

from mingpt.checkpoint import store as snap


def args_for(url: str, run_dir, max_steps: int) -> list[str]:
    return job_args(url, run_dir, max_steps=max_steps, save_every_steps=10)


def keys(s3, bucket: str, prefix: str) -> list[str]:
    return sorted(o["Key"] for o in s3.list_objects_v2(Bucket=bucket, Prefix=prefix).get("Contents", []))


# Not marked oldest_torch: the old leg writes and reads S3 snapshots below (test_sample_from_an_s3_snapshot_...) and
# resumes a SIGKILLed worker bit for bit against its reference in tests/e2e/test_resume.py; this one's 31 CPU-s there
# added neither.
def test_train_kill_and_resume_on_s3(tmp_path, s3):
    s3.create_bucket(Bucket="runs")
    run_dir = tmp_path / "run"
    run_case(Case("s3", tuple(args_for("s3://runs/job1/", "{d}/run", max_steps=120)), nproc=2,
                  fault=Fault(at_step=25, victim="rank0"), expect=("resumed from s3://runs/job1/snapshot-",)), tmp_path)

    assert keys(s3, "runs", "job1/") == ["job1/snapshot-000000110.pt", "job1/snapshot-000000120.pt"]
    body = s3.get_object(Bucket="runs", Key="job1/snapshot-000000120.pt")["Body"].read()
    newest = snap.from_bytes(body, "s3 object")
    summary = read_summary(run_dir)
    assert newest["progress"]["step"] == 120 and newest["weights_sha256"] == summary["weights_sha256"]


def test_snapshot_cli_reads_s3(tmp_path, s3):
    s3.create_bucket(Bucket="cli")
    result = run_cli(args_for("s3://cli/r/", tmp_path / "run", max_steps=20), tmp_path)
    assert_ok(result)
    listing = subprocess.run([sys.executable, str(PROJECT_DIR / "snapshot.py"), "list", "s3://cli/r"],
                             capture_output=True, text=True, timeout=60)
    assert [json.loads(line)["step"] for line in listing.stdout.splitlines()] == [20, 10], listing.stderr
    info = subprocess.run([sys.executable, str(PROJECT_DIR / "snapshot.py"), "info", "s3://cli/r/snapshot-000000020.pt"],
                          capture_output=True, text=True, timeout=60)
    assert json.loads(info.stdout)["step"] == 20, info.stderr


def test_missing_bucket_fails_fast_and_is_not_created(tmp_path, s3):
    result = run_cli(args_for("s3://no-such-bucket/run/", tmp_path / "run", max_steps=20), tmp_path, timeout=60)
    assert result.returncode == 2
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "bucket 'no-such-bucket' does not exist" in lines[0], result.stderr
    assert "no-such-bucket" not in [b["Name"] for b in s3.list_buckets()["Buckets"]]


def test_credentials_in_storage_options_are_not_written_anywhere(tmp_path, s3):
    s3.create_bucket(Bucket="secret")
    key, secret = "AKIDSECRETKEYID0001", "super/secret+value/0002"
    options = f"trainer_config.snapshot_storage_options={{key:'{key}',secret:'{secret}'}}"
    run_dir = tmp_path / "run"
    result = run_cli([*args_for("s3://secret/r/", run_dir, max_steps=10), options], tmp_path)
    assert_ok(result)
    for path in run_dir.rglob("*"):
        if path.is_file():
            text = path.read_bytes()
            assert key.encode() not in text and secret.encode() not in text, path
    assert key not in result.stdout + result.stderr and secret not in result.stdout + result.stderr
    body = s3.get_object(Bucket="secret", Key="r/snapshot-000000010.pt")["Body"].read()
    assert key.encode() not in body and secret.encode() not in body
    saved = snap.from_bytes(body, "s3")["train_config"]["trainer_config"]["snapshot_storage_options"]
    assert saved == {"key": "***", "secret": "***"}


@pytest.mark.oldest_torch
def test_sample_from_an_s3_snapshot_is_deterministic(tmp_path, s3):
    s3.create_bucket(Bucket="gen")
    result = run_cli(args_for("s3://gen/r/", tmp_path / "run", max_steps=10), tmp_path)
    assert_ok(result)
    command = [sys.executable, str(PROJECT_DIR / "sample.py"), "snapshot=s3://gen/r/", "max_new_tokens=40", "seed=7"]
    first = subprocess.run(command, capture_output=True, text=True, timeout=60, cwd=tmp_path)
    again = subprocess.run([*command[:-1], "snapshot=s3://gen/r/snapshot-000000010.pt", "seed=7"],
                           capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert_ok(first)
    assert len(first.stdout.rstrip("\n")) == 1 + 40 and first.stdout == again.stdout


def test_a_corpus_under_an_s3_prefix_is_downloaded_once_and_encoded_as_the_same_files_locally(tmp_path, s3):
    """Three objects under s3://corpus/books/ (and one beside them that the glob leaves out), two processes: one
    download into the cache, one vocabulary over the three, the same ids as the same files read locally."""
    from char_dataset import CharCorpus, DataConfig
    from mingpt.data.token_cache import default_cache_dir, entry_dir, open_tokens

    s3.create_bucket(Bucket="corpus")
    text = (PROJECT_DIR / "data" / "input.txt").read_text(encoding="utf-8")[:60_000]
    local = tmp_path / "books"
    local.mkdir()
    for n in range(3):
        part = text[n * 20_000 : (n + 1) * 20_000]
        s3.put_object(Bucket="corpus", Key=f"books/part-{n}.txt", Body=part.encode())
        (local / f"part-{n}.txt").write_text(part, encoding="utf-8")
    s3.put_object(Bucket="corpus", Key="books/README.md", Body=b"not part of the corpus \xff")
    run_dir = tmp_path / "run"
    location = "s3://corpus/books/*.txt"
    result = run_cli(job_args(tmp_path / "snaps", run_dir, "data_config.truncate=1.0", f"data_config.path={location}",
                              max_steps=5), tmp_path, nproc=2)
    assert_ok(result)
    assert result.stdout.count("data: encoding s3://corpus/books/*.txt (3 files, 60,000 bytes)") == 1
    assert "60,002 characters of 3 files of s3://corpus/books/*.txt" in result.stdout
    cached = open_tokens(location, "\n", default_cache_dir(), build=False, timeout_s=5)
    assert not cached.built_now and cached.path.parent == entry_dir(default_cache_dir(), location, "\n")
    assert [p.suffix for p in cached.path.parent.iterdir()].count(".tmp") == 0  # the downloaded copies are gone
    same = CharCorpus.load(DataConfig(path=str(local), cache_dir=str(tmp_path / "cache")))
    assert cached.vocab == same.vocab.chars
    assert np.array_equal(cached.array(), same.ids(0, same.n_tokens))
