"""Fault tolerance with real processes: SIGKILL + torchrun restart, world-size change, a kill during a save,
damaged and foreign snapshots, SIGTERM."""

import os
import signal
from pathlib import Path

import pytest
from support import (
    PROJECT_DIR,
    TINY,
    assert_ok,
    assert_one_error_line,
    children,
    kill_and_resume,
    logged_step,
    muon_where_available,
    read_summary,
    run_cli,
    start_cli,
    wait_for,
)

from mingpt.checkpoint import store as snap
from mingpt.reporting.logs import read_metrics
from trainer import cpu_has_native_bf16


def resume_args(
    snaps: Path, run_dir: Path, max_steps: int = 150, every: int = 10, precision: str = "fp32"
) -> list[str]:
    return [
        *TINY,
        f"trainer_config.mixed_precision={precision}",  # after TINY's: the last override of a key wins
        f"trainer_config.max_steps={max_steps}",
        f"trainer_config.save_every_steps={every}",
        "trainer_config.eval_every_steps=50",
        f"trainer_config.snapshot_path={snaps}",
        f"hydra.run.dir={run_dir}",
    ]


def rows_by_step(rows: list[dict], key: str) -> dict[int, float]:
    return {r["step"]: r[key] for r in rows if key in r}


def several_files(tmp_path: Path) -> list[str]:
    """TINY's 5% of tiny-shakespeare as four files of a folder, and a cache folder of the test's own."""
    text = (PROJECT_DIR / "data" / "input.txt").read_text(encoding="utf-8")[:55_000]
    folder = tmp_path / "books"
    folder.mkdir()
    for n in range(4):
        (folder / f"part-{n}.txt").write_text(text[n * len(text) // 4 : (n + 1) * len(text) // 4], encoding="utf-8")
    return [f"data_config.path={folder}", "data_config.truncate=1.0", f"data_config.cache_dir={tmp_path / 'cache'}"]


@pytest.mark.oldest_torch
def test_sigkilled_worker_resumes_bit_for_bit(tmp_path):
    """On a cached corpus of several files: the first run builds the cache, the killed one and its restart read
    it; the weights and every logged value are those of the run that was not interrupted. In the default precision
    (bf16 autocast and matmul attention on a CPU with bf16 instructions, fp32 on others), with Muon and AdamW where
    torch has Muon; an AdamW run then refuses the Muon snapshots in one line."""
    data = [*several_files(tmp_path), *muon_where_available()]
    straight = run_cli([*resume_args(tmp_path / "snaps_a", tmp_path / "run_a", max_steps=100, precision="auto"), *data],
                       tmp_path, nproc=2)
    assert_ok(straight)
    assert "data: encoding" in straight.stdout and "of 4 files of" in straight.stdout
    assert (", bfloat16, " in straight.stdout) == cpu_has_native_bf16()

    # A worker SIGKILLed at step 35; torchrun restarts both, they resume: the weights of the run above.
    log = kill_and_resume([*resume_args(tmp_path / "snaps_b", tmp_path / "run_b", max_steps=100, precision="auto"),
                           *data], tmp_path, tmp_path / "run_b", at_step=35, reference=tmp_path / "run_a")
    assert "data: encoding" not in log and log.count("of 4 files of") == 2  # the cache, found at each start
    rows_a, rows_b = read_metrics(tmp_path / "run_a"), read_metrics(tmp_path / "run_b")
    assert len([r for r in rows_b if "train_loss" in r]) > len([r for r in rows_a if "train_loss" in r])  # re-run steps
    for key in ("train_loss", "val_loss", "lr"):
        a, b = rows_by_step(rows_a, key), rows_by_step(rows_b, key)
        for row in rows_b:  # every row, before and after the resume, the same as without interruption
            if key in row:
                assert row[key] == a[row["step"]], (key, row)
        assert b.keys() == a.keys()
    # keep_last=2: only the two newest snapshots remain
    assert [e.step for e in snap.SnapshotStore(str(tmp_path / "snaps_b")).entries()] == [100, 90]
    if muon_where_available():  # AdamW cannot continue Muon's state: refused before anything is trained or written
        refused = run_cli([*resume_args(tmp_path / "snaps_b", tmp_path / "run_c", max_steps=110), *data,
                           "optimizer_config.name=adamw"], tmp_path)
        assert_one_error_line(refused, "trained with optimizer_config.name=muon, this run asks for adamw")
        assert [e.step for e in snap.SnapshotStore(str(tmp_path / "snaps_b")).entries()] == [100, 90]


def test_world_size_change_keeps_the_global_sample_position(tmp_path):
    snaps, run_dir = tmp_path / "snaps", tmp_path / "run"
    first = run_cli(resume_args(snaps, run_dir, max_steps=30), tmp_path, nproc=2)
    assert_ok(first)
    second = run_cli(resume_args(snaps, run_dir, max_steps=40), tmp_path)  # 1 process, no torchrun
    assert_ok(second)
    # 30 steps x 2 processes x batch 8 = 480 samples, then 10 steps x 1 process x 8 = 80 more
    assert "written by 2 process(es), resuming with 1: continuing at global sample 480 of epoch 0" in second.stdout
    store = snap.SnapshotStore(str(snaps))
    entry, last = store.load_newest_valid(*_model_and_vocab(store))
    assert entry.step == 40 and last["progress"]["epoch_samples"] == 560 and last["world_size"] == 1


def _model_and_vocab(store: snap.SnapshotStore) -> tuple[dict, str]:
    newest = snap.from_bytes(store.read(store.entries()[0].name), "newest")
    return newest["model_config"], newest["vocab"]


def test_kill_during_a_save_leaves_a_loadable_snapshot(tmp_path):
    snaps, run_dir = tmp_path / "snaps", tmp_path / "run"
    # A bigger model (10 MB snapshots) saved every step, so that rank 0 is writing most of the time.
    args = [*resume_args(snaps, run_dir, max_steps=100000, every=1), "gpt_config.n_layer=4", "gpt_config.n_embd=128",
            "gpt_config.n_head=4"]
    caught = False
    for attempt in range(5):
        job = start_cli(args, tmp_path, nproc=2, log_name=f"attempt{attempt}.log")
        temporary = lambda: [n for n in os.listdir(snaps) if ".tmp-" in n] if snaps.exists() else []  # noqa: E731
        wait_for(lambda: logged_step(run_dir) >= 5 * (attempt + 1), timeout=120, what="some steps")
        wait_for(temporary, timeout=60, interval=0.001, what="a save in progress")
        for pid in children(job.pid):
            os.kill(pid, signal.SIGKILL)
        job.wait(timeout=60)
        if temporary():
            caught = True
            break
    assert caught, "never caught a save in progress"
    store = snap.SnapshotStore(str(snaps))
    entries = store.entries()
    assert entries, "no complete snapshot"
    for entry in entries:  # every visible snapshot is complete
        snap.from_bytes(store.read(entry.name), entry.name)
    newest = entries[0].step
    again = run_cli([*args, f"trainer_config.max_steps={newest + 2}"], tmp_path, nproc=2)
    assert_ok(again)
    assert f"resumed from {snaps}/{snap.snapshot_name(newest)}" in again.stdout
    assert not [n for n in os.listdir(snaps) if ".tmp-" in n]  # the killed save's leftovers are cleaned up


def test_damaged_newest_snapshot_falls_back_and_foreign_one_is_refused(tmp_path):
    snaps, run_dir = tmp_path / "snaps", tmp_path / "run"
    first = run_cli(resume_args(snaps, run_dir, max_steps=20), tmp_path)
    assert_ok(first)
    newest = snaps / snap.snapshot_name(20)
    newest.write_bytes(newest.read_bytes()[:5000])  # truncated, e.g. by a full disk outside our control
    # (The same launch checks that another attention implementation than the snapshot's is said, once.)
    resumed = run_cli([*resume_args(snaps, run_dir, max_steps=30), "gpt_config.attention=matmul"], tmp_path)
    assert_ok(resumed)
    assert "skipping snapshot" in resumed.stdout + resumed.stderr
    assert f"resumed from {snaps}/{snap.snapshot_name(10)}" in resumed.stdout
    said = "snapshot was trained with sdpa attention, this run uses matmul (gpt_config.attention)"
    assert (resumed.stdout + resumed.stderr).count(said) == 1

    before = {p.name: p.read_bytes() for p in snaps.iterdir()}
    foreign = run_cli([*resume_args(snaps, run_dir, max_steps=40), "gpt_config.n_layer=3"], tmp_path)
    assert foreign.returncode == 2
    lines = [line for line in foreign.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "different model: n_layer=2 in the snapshot, 3 in the config" in lines[0]
    assert {p.name: p.read_bytes() for p in snaps.iterdir()} == before  # nothing overwritten


def test_sigterm_saves_and_the_same_command_continues(tmp_path):
    snaps, run_dir = tmp_path / "snaps", tmp_path / "run"
    args = resume_args(snaps, run_dir, max_steps=100000, every=1000)
    job = start_cli(args, tmp_path, nproc=2)
    wait_for(lambda: logged_step(run_dir) >= 10, timeout=120, what="step 10")
    job.send_signal(signal.SIGTERM)  # what a scheduler sends to the launcher before it kills the job
    code = job.wait(timeout=60)
    log = (tmp_path / "launch.log").read_text()
    assert code in (0, 1), log[-3000:]  # torchrun itself reports the signal with exit code 1
    assert "stop requested (SIGTERM)" in log and "saved (stop requested" in log
    stopped_at = snap.SnapshotStore(str(snaps)).entries()[0].step
    assert stopped_at >= 10
    again = run_cli([*args, f"trainer_config.max_steps={stopped_at + 5}"], tmp_path, nproc=2)
    assert_ok(again)
    assert f"resumed from {snaps}/{snap.snapshot_name(stopped_at)}" in again.stdout
    assert read_summary(run_dir)["steps"] == stopped_at + 5


def test_sigterm_to_one_worker_stops_all_cleanly(tmp_path):
    snaps, run_dir = tmp_path / "snaps", tmp_path / "run"
    job = start_cli(resume_args(snaps, run_dir, max_steps=100000, every=1000), tmp_path, nproc=2)
    wait_for(lambda: logged_step(run_dir) >= 5, timeout=120, what="step 5")
    os.kill(children(job.pid)[-1], signal.SIGTERM)
    assert job.wait(timeout=60) == 0, (tmp_path / "launch.log").read_text()[-3000:]
    assert snap.SnapshotStore(str(snaps)).entries()
