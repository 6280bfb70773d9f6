"""A long run: thousands of steps of a tiny model with a snapshot every 25 steps. Host memory must stay flat and
the snapshot folder must hold keep_last snapshots (never more than keep_last + 1 while the next one is written).

The worker's RSS is read from outside (/proc/<pid>/status VmRSS), at the first logged step after warm-up and at
a step near the end (before the end-of-run plot and sample, which import matplotlib and add tens of MB once)."""

import re
import subprocess
import time

from support import cli, subprocess_env

from mingpt.reporting.logs import read_metrics

STEPS, SAVE_EVERY, KEEP_LAST, LOG_EVERY, EVAL_EVERY = 2000, 20, 2, 100, 400
WARM, LATE = 500, STEPS - 200  # RSS compared between these two steps (the first evaluation, at 400, is before)
# Growth allowed between them: 2.5 MB. Measured (3,000 steps, a snapshot every 25): 0.1-0.3 MB (about 0.1 kB per
# step of allocator and logging creep). What a leak would add over these 1,300 steps: one step's autograd graph kept
# per step (~50 kB of activations for this model) ~65 MB; each snapshot's CPU copy kept (weights + AdamW moments,
# ~55 kB, 65 saves) ~3.6 MB; anything kept per step above ~2 kB. The bound sits between the measured creep and the
# smallest of these.
MAX_GROWTH_KB = 2560


def _rss_kb(pid: int) -> int:
    text = open(f"/proc/{pid}/status").read()
    return int(re.search(r"VmRSS:\s+(\d+) kB", text).group(1))


def _snapshots(folder) -> int:
    return sum(1 for p in folder.glob("snapshot-*.pt")) if folder.exists() else 0


def test_long_run_keeps_memory_flat_and_keep_last_snapshots(tmp_path):
    snaps, run_dir = tmp_path / "snaps", tmp_path / "run"
    args = [
        "data_config.truncate=0.05", "data_config.block_size=16", "gpt_config.n_layer=1", "gpt_config.n_head=2",
        "gpt_config.n_embd=16", "trainer_config.batch_size=4", f"trainer_config.max_steps={STEPS}",
        f"trainer_config.log_every_steps={LOG_EVERY}", f"trainer_config.eval_every_steps={EVAL_EVERY}",
        "trainer_config.eval_batches=2", f"trainer_config.save_every_steps={SAVE_EVERY}",
        f"trainer_config.keep_last={KEEP_LAST}", "trainer_config.mixed_precision=fp32", "trainer_config.progress=lines",
        f"trainer_config.snapshot_path={snaps}", f"hydra.run.dir={run_dir}",
    ]
    env = subprocess_env(tmp_path)
    env["OMP_NUM_THREADS"] = "1"
    job = subprocess.Popen(cli(args), cwd=tmp_path, env=env,
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    rss, most_snapshots, last_step, samples = {}, 0, 0, []
    try:
        while job.poll() is None:
            most_snapshots = max(most_snapshots, _snapshots(snaps))
            if last_step < LATE:
                steps = [r["step"] for r in read_metrics(run_dir) if "train_loss" in r]
                if max(steps, default=0) > last_step:
                    last_step = max(steps)
                    samples.append((last_step, _rss_kb(job.pid)))
                for mark in (WARM, LATE):
                    if mark not in rss and last_step >= mark:
                        rss[mark] = samples[-1]
            time.sleep(0.01)
        output = job.communicate(timeout=60)[0]
    finally:
        if job.poll() is None:
            job.kill()
    assert job.returncode == 0, output[-3000:]
    assert WARM in rss and LATE in rss, (rss, last_step)
    (warm_step, warm_kb), (late_step, late_kb) = rss[WARM], rss[LATE]
    growth = late_kb - warm_kb
    print(f"RSS at step {warm_step}: {warm_kb} kB, at step {late_step}: {late_kb} kB, growth {growth} kB; "
          f"most snapshots seen: {most_snapshots}; (step, kB): {samples}")
    assert growth < MAX_GROWTH_KB, f"RSS grew {growth} kB between steps {warm_step} and {late_step}"
    assert sorted(p.name for p in snaps.iterdir()) == [f"snapshot-{STEPS - SAVE_EVERY:09d}.pt",
                                                      f"snapshot-{STEPS:09d}.pt"]
    assert 0 < most_snapshots <= KEEP_LAST + 1
