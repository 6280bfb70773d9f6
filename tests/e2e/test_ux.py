"""What users see: progress output, TensorBoard events, the loss plot, sample.py, --help, --cfg job, sweeps."""

import fcntl
import os
import pty
import select
import struct
import subprocess
import termios
from pathlib import Path

import pytest
from support import PROJECT_DIR, PYTHON, TINY, Case, assert_ok, cli, job_args, run_case, run_cli, subprocess_env, table

from mingpt.reporting import plot
from mingpt.reporting.logs import read_metrics


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """One tiny single-process run shared by the tests that only look at its results."""
    tmp = tmp_path_factory.mktemp("trained")
    result = run_cli(job_args(tmp / "snaps", tmp / "run", report_at_end="true"), tmp)
    assert_ok(result)
    (tmp / "stdout.txt").write_text(result.stdout)
    return tmp


def run_in_terminal(args: list[str], cwd: Path, timeout: float = 120) -> str:
    """Run main.py with stdout and stderr on a pseudo-terminal (140 columns) and return what it showed."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 140, 0, 0))
    proc = subprocess.Popen(cli(args), cwd=cwd, env=subprocess_env(cwd),
                            stdin=subprocess.DEVNULL, stdout=slave, stderr=slave)
    os.close(slave)
    output = b""
    while True:
        ready, _, _ = select.select([master], [], [], 0.5)
        if ready:
            try:
                chunk = os.read(master, 65536)
            except OSError:  # the terminal closed
                break
            if not chunk:
                break
            output += chunk
        elif proc.poll() is not None:
            break
    os.close(master)
    assert proc.wait(timeout=timeout) == 0, output.decode(errors="replace")[-3000:]
    return output.decode(errors="replace")


def test_progress_bar_on_a_terminal(tmp_path):
    shown = run_in_terminal(job_args(tmp_path / "snaps", tmp_path / "run"), tmp_path)
    assert "%|" in shown and "40/40" in shown  # the bar, counting to the last step
    assert "tok/s, lr" in shown and "loss " in shown  # its postfix
    assert "step 5/40 |" not in shown  # no per-step lines on the terminal under a bar ...
    assert "step 5/40 | epoch 0 | loss" in (tmp_path / "run" / "train.log").read_text()  # ... they are in train.log
    assert "val loss" in shown  # other messages still appear


def test_plain_lines_when_output_is_not_a_terminal(trained):
    stdout = (trained / "stdout.txt").read_text()
    assert "step 5/40 | epoch 0 | loss" in stdout and "%|" not in stdout and "\r" not in stdout


def test_progress_can_be_switched_off(tmp_path):
    result = run_cli(job_args(tmp_path / "snaps", tmp_path / "run", progress="off"), tmp_path)
    assert_ok(result)
    assert "| loss" not in result.stdout and "%|" not in result.stdout
    assert "val loss" in result.stdout and "step 40/40 |" in (tmp_path / "run" / "train.log").read_text()


def test_tensorboard_events_hold_the_run_values(trained):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir = trained / "run"
    assert list(run_dir.glob("events.out.tfevents.*"))
    events = EventAccumulator(str(run_dir))
    events.Reload()
    rows = read_metrics(run_dir)
    for tag, key in [("loss/train", "train_loss"), ("loss/val", "val_loss"), ("lr", "lr"),
                     ("throughput/tokens_per_s", "tokens_per_s"), ("grad_norm", "grad_norm")]:
        logged = {e.step: e.value for e in events.Scalars(tag)}
        expected = {r["step"]: r[key] for r in rows if key in r}
        assert logged.keys() == expected.keys(), tag
        assert all(abs(logged[s] - v) <= 1e-5 * max(1.0, abs(v)) for s, v in expected.items()), tag


def test_loss_plot_is_written_and_holds_the_run_values(trained, tmp_path):
    run_dir = trained / "run"
    png = run_dir / "loss.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    train, val = plot.read_losses(run_dir / "metrics.jsonl")
    rows = read_metrics(run_dir)
    assert train == {r["step"]: r["train_loss"] for r in rows if "train_loss" in r}
    assert val == {r["step"]: r["val_loss"] for r in rows if "val_loss" in r} and len(val) == 2
    out = tmp_path / "curve.png"
    result = subprocess.run([PYTHON, str(PROJECT_DIR / "plot.py"), str(run_dir / "metrics.jsonl"), "-o", str(out)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and out.read_bytes()[:4] == b"\x89PNG", result.stderr


def test_training_ends_with_a_generated_sample(trained):
    assert "sample (temperature 0.8, top_k 40):" in (trained / "stdout.txt").read_text()


def sample(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([PYTHON, str(PROJECT_DIR / "sample.py"), *args], cwd=cwd, env=subprocess_env(cwd),
                          capture_output=True, text=True, timeout=120)


def test_sample_is_deterministic_for_a_seed(trained, tmp_path):
    """(Not marked oldest_torch: the old legs sample twice with one seed in test_s3.py, from an S3 snapshot.)"""
    snaps = trained / "snaps"
    first = sample(f"snapshot={snaps}", "prompt=ROMEO:", "max_new_tokens=80", "seed=3", cwd=tmp_path)
    again = sample(f"snapshot={snaps / 'snapshot-000000040.pt'}", "prompt=ROMEO:", "max_new_tokens=80", "seed=3",
                   cwd=tmp_path)
    other = sample(f"snapshot={snaps}", "prompt=ROMEO:", "max_new_tokens=80", "seed=4", cwd=tmp_path)
    assert_ok(first)
    assert first.stdout.startswith("ROMEO:") and len(first.stdout.rstrip("\n")) == len("ROMEO:") + 80
    assert first.stdout == again.stdout and first.stdout != other.stdout
    assert not (tmp_path / "outputs").exists()  # sampling leaves no files behind


def test_sample_options(trained, tmp_path):
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("KING:\n", encoding="utf-8")
    result = sample(f"snapshot={trained / 'snaps'}", f"prompt_file={prompt}", "num_samples=2",
                    "max_new_tokens=30", "top_k=null", "temperature=1.2", cwd=tmp_path)
    assert_ok(result)
    texts = result.stdout.split("\n" + "-" * 40 + "\n")
    assert len(texts) == 2 and all(t.startswith("KING:\n") for t in texts) and texts[0] != texts[1]


READ_ONLY_COMMANDS = table(  # main.py commands that print and exit 0: what they print, and no run directory
    Case("--help describes groups and fields", ("--help",),
         expect=("preset: cpu, gpu, nanogpt_cpu", "max_epochs", "passes over the training windows", "n_head",
                 "must divide n_embd"), no_run_dir=True),
    Case("--cfg job prints the resolved config", ("preset=cpu", "gpt_config.n_layer=3", "--cfg", "job"),
         expect=("trainer_config:", "n_layer: 3", "n_embd: 128"), no_run_dir=True),
)


@pytest.mark.parametrize("case", READ_ONLY_COMMANDS)
def test_read_only_commands_print_and_write_nothing(tmp_path, case):
    run_case(case, tmp_path)


def test_multirun_sweep_gives_each_job_its_own_run_dir_and_snapshots(tmp_path):
    snaps = tmp_path / "snaps"
    result = subprocess.run(
        cli(["-m", *TINY, "optimizer_config.learning_rate=1e-3,3e-3", "trainer_config.max_steps=10",
             f"trainer_config.snapshot_path={snaps}", f"hydra.sweep.dir={tmp_path / 'sweep'}"]),
        capture_output=True, text=True, timeout=240, cwd=tmp_path, env=subprocess_env(tmp_path),
    )
    assert_ok(result)
    jobs = sorted(p for p in (tmp_path / "sweep").iterdir() if p.is_dir())
    assert [j.name for j in jobs] == ["0", "1"], result.stdout[-3000:] + result.stderr[-3000:]
    lrs = [read_metrics(j)[0]["lr"] for j in jobs]
    assert lrs[0] != lrs[1]
    assert sorted(p.name for p in snaps.iterdir()) == [
        "optimizer_config.learning_rate=0.001", "optimizer_config.learning_rate=0.003"]
    assert all(list((snaps / name).glob("snapshot-*.pt")) for name in os.listdir(snaps))
