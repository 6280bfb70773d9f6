"""Fault tolerance with real processes: SIGKILL + torchrun restart, world-size change, a kill during a save,
damaged and foreign snapshots, SIGTERM."""

import os
import signal
from pathlib import Path

import pytest
from support import (
    PROJECT_DIR,
    Case,
    Fault,
    assert_ok,
    assert_one_error_line,
    children,
    job_args,
    logged_step,
    muon_where_available,
    rank_of,
    read_summary,
    resumes,
    run_case,
    run_cli,
    start_cli,
    wait_for,
)

from mingpt.checkpoint import store as snap
from mingpt.reporting.logs import read_metrics
from trainer import cpu_has_native_bf16


def resume_args(snaps: Path | str, run_dir: Path | str, max_steps: int = 150, every: int = 10,
                precision: str = "fp32") -> list[str]:
    return job_args(snaps, run_dir, f"trainer_config.mixed_precision={precision}", max_steps=max_steps,
                    save_every_steps=every, eval_every_steps=50)


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
    """On a cached corpus of several files: the first run builds the cache, its restart and the uninterrupted
    reference run read it; a worker SIGKILLed at step 35, torchrun restarts both, they resume: the weights and every
    logged value are those of the run that was not interrupted. In the default precision (bf16 autocast and matmul
    attention on a CPU with bf16 instructions, fp32 on others), with Muon and AdamW where torch has Muon; an AdamW
    run then refuses the Muon snapshots in one line."""
    # A metrics row every step: the rows the restart writes again (those past the snapshot it resumed from) are
    # compared with the uninterrupted run's too. A kill that lands between a save and the next step's row re-runs
    # none (seen in CI on the oldest torch, a fast machine: 100 rows against 100); the restart must still have
    # resumed before the end and trained the rest.
    data = [*several_files(tmp_path), *muon_where_available(), "trainer_config.log_every_steps=1"]
    killed = run_case(Case("ddp", (*resume_args("{s}", "{d}/run", max_steps=100, precision="auto"), *data), nproc=2,
                           fault=Fault(at_step=35), reference=True, expect=("resumed from",)), tmp_path)
    log = killed.output
    assert log.count("data: encoding") == 1 and log.count("of 4 files of") == 2  # built once, found at the restart
    assert (", bfloat16, " in log) == cpu_has_native_bf16()
    resumed = resumes(log)
    assert resumed and resumed[0][0] < 100, log[-3000:]  # the restart trained what the kill left
    rows_a, rows_b = read_metrics(killed.reference), read_metrics(tmp_path / "run")
    for key in ("train_loss", "val_loss", "lr"):
        a, b = rows_by_step(rows_a, key), rows_by_step(rows_b, key)
        for row in rows_b:  # every row, before and after the resume, the same as without interruption
            if key in row:
                assert row[key] == a[row["step"]], (key, row)
        assert b.keys() == a.keys()
    # keep_last=2: only the two newest snapshots remain
    assert [e.step for e in snap.SnapshotStore(str(tmp_path / "snaps")).entries()] == [100, 90]
    if muon_where_available():  # AdamW cannot continue Muon's state: refused before anything is trained or written
        refused = run_cli([*resume_args(tmp_path / "snaps", tmp_path / "run_c", max_steps=110), *data,
                           "optimizer_config.name=adamw"], tmp_path)
        assert_one_error_line(refused, "trained with optimizer_config.name=muon, this run asks for adamw")
        assert [e.step for e in snap.SnapshotStore(str(tmp_path / "snaps")).entries()] == [100, 90]


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
        # The workers found before the save, rank 0 (the writer) first: a search of /proc between seeing the save
        # and the kill (milliseconds on a busy machine) let the save finish first now and then (3 attempts, each a
        # 2-process launch, in one CI run).
        workers = sorted(children(job.pid), key=lambda pid: rank_of(pid) != 0)
        wait_for(temporary, timeout=60, interval=0.001, what="a save in progress")
        for pid in workers:
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


# A run long enough for a signal at step 5 or 10 to arrive well before its end, saving only when stopped: the
# SIGTERM cases below share its uninterrupted reference run.
SIGTERMED = tuple(resume_args("{s}", "{d}/run", max_steps=80, every=1000))


def test_sigterm_saves_and_the_same_command_continues(tmp_path):
    """SIGTERM to torchrun, as a scheduler sends it before it kills the job: the workers save and stop; the same
    command run again continues from that snapshot to the weights of the run that was not stopped."""
    stopped = run_case(Case("sigterm-launcher", SIGTERMED, nproc=2, reference=True, expect=(
        "stop requested (SIGTERM)", "saved (stop requested", "resumed from"),
        fault=Fault(at_step=10, signal=signal.SIGTERM, victim="launcher", restarts=0, rerun=True)), tmp_path)
    assert stopped.first in (0, 1), stopped.output[-3000:]  # torchrun itself reports the signal with exit code 1
    assert read_summary(tmp_path / "run")["steps"] == 80


def test_sigterm_to_one_worker_stops_all_cleanly(tmp_path):
    """SIGTERM to one worker alone: every rank agrees to stop, saves and exits 0; the command run again ends as the
    run that was not stopped."""
    stopped = run_case(Case("sigterm-worker", SIGTERMED, nproc=2, reference=True,
                            fault=Fault(at_step=5, signal=signal.SIGTERM, restarts=0, rerun=True)), tmp_path)
    assert stopped.first == 0, stopped.output[-3000:]
    assert "stop requested (SIGTERM)" in stopped.output and "resumed from" in stopped.output
