"""What the tests share besides fixtures (those are in conftest.py): the tiny model's overrides, a tiny trainer built in
this process the way a run builds it, running the real CLI (python main.py / torchrun) as a subprocess, killing a
worker and checking that the job resumes to the weights of a run that was not interrupted, integration cases as rows
of a table, waiting, reading a run's summary.json, and the two assertions every CLI test makes."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pytest

from benchmarks.chaos import TINY_MODEL, alive, children, rank_of, wait_until
from mingpt import PROJECT_DIR
from mingpt.reporting.logs import SUMMARY_FILE, read_metrics

PYTHON = sys.executable
# What may sit at the project's root besides dotfiles: the design card's files, the commands a user runs, their
# configs, and the project's own files (tests/e2e/test_style.py keeps the root to this).
ROOT_ENTRIES = frozenset({
    "main.py", "trainer.py", "model.py", "char_dataset.py", "gpt2_train_cfg.yaml", "data", "tests", "requirements.txt",
    "sample.py", "sample_cfg.yaml", "snapshot.py", "prepare.py", "plot.py", "gpu_check.sh", "preset", "slurm",
    "mingpt", "benchmarks", "docs", "README.md", "Makefile", "pyproject.toml", "pytest.ini",
    "requirements-oldest.txt", "requirements-test.txt", "requirements-without-torch.txt", "requirements-hf.txt",
    "requirements-mlflow.txt", "requirements-wandb.txt", "requirements-tensorboard.txt",
})


def project_modules() -> list[Path]:
    """Every Python file of the project but the tests': the root's commands, the mingpt package, benchmarks/, slurm/."""
    return sorted([*PROJECT_DIR.glob("*.py"), *PROJECT_DIR.glob("mingpt/**/*.py"),
                   *PROJECT_DIR.glob("benchmarks/*.py"), *PROJECT_DIR.glob("slurm/*.py")])


def module_name(path: Path) -> str:
    """mingpt/checkpoint/store.py -> mingpt.checkpoint.store; mingpt/__init__.py -> mingpt."""
    parts = path.relative_to(PROJECT_DIR).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
TORCHRUN = [PYTHON, "-m", "torch.distributed.run"]

# A model and a data slice small enough that a run takes seconds on 2 CPU cores (the chaos harness's, chaos.py), and
# a short run of it, without the end-of-run plot and sample (a child process and a second of CPU a run: the tests
# of what they show ask for them, trainer_config.report_at_end=true).
TINY = [
    *TINY_MODEL,
    "trainer_config.max_steps=40",
    "trainer_config.log_every_steps=5",
    "trainer_config.eval_every_steps=20",
    "trainer_config.eval_batches=8",
    "trainer_config.report_at_end=false",
]


def muon_where_available() -> list[str]:
    """The override that trains with Muon where torch has it (2.9+): the kill-and-resume tests then cover Muon's
    state (and AdamW's beside it); on older torch (CI's oldest legs) they train AdamW alone."""
    import torch

    return ["optimizer_config.name=muon", "optimizer_config.muon_momentum_warmup_steps=20"] \
        if hasattr(torch.optim, "Muon") else []


def corpus_text(lines: int) -> str:
    """`lines` short lines of text: the corpus of a trainer built in the test's own process."""
    return "".join(f"line {i}: the quick brown fox jumps over the lazy dog.\n" for i in range(lines))


def make_trainer(run_dir: Path | None = None, *, snapshots: Path | str | None = None, strategy: str = "ddp",
                 dropout: float = 0.0, n_layer: int = 1, lines: int = 400, learning_rate: float = 1e-2,
                 eps: float = 1e-8, **settings):
    """A Trainer in this process (no torchrun), built by main.build_trainer as a training run builds it: a GPT of
    `n_layer` blocks of width 16 over `lines` lines of corpus_text (block_size 16), AdamW at `learning_rate` (1e-2)
    with epsilon `eps` and without warm-up,
    fp32 and a log line every 5 steps unless `settings` (TrainerConfig's fields, or ParallelConfig's: compile,
    activation_checkpointing) say otherwise; its snapshots in `snapshots` (a folder or URL; None: none), its metrics
    in `run_dir` (None: none)."""
    import dataclasses

    import main  # torch and the model: paid for by the tests that build a trainer only
    from char_dataset import CharCorpus, DataConfig
    from mingpt.distributed.process_group import DistContext
    from mingpt.optim import OptimizerConfig
    from mingpt.parallel.layout import ParallelConfig
    from trainer import TrainerConfig

    parallel_fields = {f.name for f in dataclasses.fields(ParallelConfig)}
    parallel = ParallelConfig(strategy=strategy, **{k: v for k, v in settings.items() if k in parallel_fields})
    trainer = {"mixed_precision": "fp32", "log_every_steps": 5,
               **{k: v for k, v in settings.items() if k not in parallel_fields}}
    if snapshots is not None:
        trainer["snapshot_path"] = str(snapshots)
    data = DataConfig(block_size=16)
    cfg = main.TrainConfig(data, main.ModelSettings(n_layer=n_layer, n_head=2, n_embd=16, dropout=dropout),
                           OptimizerConfig(learning_rate=learning_rate, eps=eps, warmup_steps=0,
                                           min_lr=min(1e-3, learning_rate)), TrainerConfig(**trainer),
                           parallel)
    corpus = CharCorpus.from_text(corpus_text(lines), data)
    return main.build_trainer(cfg, corpus, DistContext(), run_dir, with_snapshots=snapshots is not None)


# The FSDP trainers of tests/*/test_fsdp.py: make_trainer under FSDP (strategy="ddp" for the other), two blocks,
# dropout, batches of 8, 2 validation batches, over FSDP_LINES lines.
FSDP_LINES = 300


def fsdp_trainer(**settings):
    return make_trainer(**{"strategy": "fsdp", "dropout": 0.1, "n_layer": 2, "lines": FSDP_LINES, "batch_size": 8,
                           "eval_batches": 2, **settings})


def gpu_path_trainer(**settings):
    """The trainers of tests/*/test_gpu_path.py: make_trainer with dropout, over 200 lines, 4 steps of batches of 8."""
    return make_trainer(**{"dropout": 0.1, "lines": 200, "batch_size": 8, "max_steps": 4, **settings})


def reopen(trainer_factory):
    """A trainer built afresh in this process, as a restarted job builds it."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    return trainer_factory()


def text_files(folder: Path, texts: dict[str, str | bytes]) -> Path:
    """`folder` holding each of `texts` (relative name -> text, written as UTF-8, or bytes as they are; sub-folders
    made as needed)."""
    folder.mkdir(parents=True, exist_ok=True)
    for name, text in texts.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_bytes(text.encode("utf-8") if isinstance(text, str) else text)
    return folder


SNAPSHOT_VOCAB = "abcdefghij"


def moved_gpt_snapshot_file(folder: Path, tokenizer: dict | str, vocab_size: int, block_size: int, seed: int = 0,
                            **options):
    """A 2-block GPT with `options`, its weights moved well off their initialisation (norm gains and biases
    included, so that each shapes the output), saved in `folder` as the snapshot file of step 7 with `tokenizer`
    (a description; a string: characters); the model, in eval mode, and the file's path."""
    import dataclasses

    import torch

    from mingpt.checkpoint import store as snap
    from mingpt.data.tokenizer import as_description
    from model import GPT, GPTConfig

    cfg = GPTConfig(n_layer=2, n_head=2, n_embd=16, dropout=0.0, vocab_size=vocab_size, block_size=block_size,
                    **options)
    torch.manual_seed(seed)
    model = GPT(cfg).eval()
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.1 * torch.randn(param.shape))
    state = {"model": model.state_dict(), "optimizer": {}, "scaler": {},
             "progress": {"step": 7, "epoch": 0, "epoch_samples": 56}}
    built = snap.build(state, {"model_config": dataclasses.asdict(cfg),
                               **snap.tokenizer_fields(as_description(tokenizer))}, world_size=1)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / snap.snapshot_name(7)
    path.write_bytes(snap.to_bytes(built))
    return model, path


def make_snapshot(step: int = 10, n_layer: int = 1, vocab: str = SNAPSHOT_VOCAB) -> dict:
    """A snapshot as a 2-process run at `step` writes it: a GPT of `n_layer` blocks after one AdamW step."""
    import dataclasses

    import torch

    from mingpt.checkpoint import store as snap
    from model import GPT, GPTConfig

    cfg = GPTConfig(n_layer=n_layer, n_head=2, n_embd=16, vocab_size=len(vocab), block_size=8)
    torch.manual_seed(step)
    model = GPT(cfg)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.zeros(1, 8, dtype=torch.long), torch.zeros(1, 8, dtype=torch.long))[1].backward()
    optimizer.step()
    state = {
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "scaler": {},
        "progress": {"step": step, "epoch": 0, "epoch_samples": 8 * step, "val_loss": 2.5, "last_eval_step": step},
        "loss_window": {"sums": [0.0], "count": 0, "start_step": step},
    }
    metadata = {"model_config": dataclasses.asdict(cfg), "vocab": vocab, "train_config": {"trainer_config": {}}}
    return snap.build(state, metadata, world_size=2)


HF_TOLERANCE = 1e-5  # fp32: the same function as ours, computed by transformers' kernels


def load_hf(folder: Path):  # noqa: ANN201 (a transformers model)
    """The exported model, as any transformers user loads it; no weight missing, left over or of another shape."""
    import transformers

    model, info = transformers.AutoModelForCausalLM.from_pretrained(str(folder), output_loading_info=True)
    assert {key: value for key, value in info.items() if value} == {}
    return model.eval()


def max_logit_difference(ours, theirs, ids) -> float:  # noqa: ANN001 (our GPT, a transformers model, token ids)
    import torch

    with torch.no_grad():
        return (ours(ids)[0] - theirs(input_ids=ids).logits).abs().max().item()


def muon_required():
    """A pytest mark: skipped where torch has no torch.optim.Muon (before 2.9)."""
    import torch

    return pytest.mark.skipif(not hasattr(torch.optim, "Muon"), reason="torch.optim.Muon is torch 2.9+")


def subprocess_env(tmp_path: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["TMPDIR"] = str(tmp_path)  # torchrun's torchelastic_* folders
    env.pop("RANK", None)
    env.pop("TORCHELASTIC_RUN_ID", None)
    env.pop("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", None)  # tests run the commands as the README gives them
    env["PYTHONUNBUFFERED"] = "1"
    return env


def own_snapshots(tmp_path: Path) -> list[str]:
    """Keep a test's snapshots out of the project folder (a later snapshot_path argument still wins)."""
    return [f"trainer_config.snapshot_path={tmp_path / 'snapshots'}"]


def cli(args: list[str], torchrun: list[str] | None = None, script: str = "main.py") -> list[str]:
    """The command line of one of the project's tools: `python SCRIPT ARGS`, or with `torchrun` (its own
    arguments, e.g. ["--standalone", "--nproc_per_node=2"]) `torchrun ... SCRIPT ARGS`. Every test builds its
    commands here."""
    launcher = [PYTHON] if torchrun is None else [*TORCHRUN, *torchrun]
    return [*launcher, str(PROJECT_DIR / script), *args]


def standalone(nproc: int, *more: str) -> list[str]:
    """torchrun's arguments for one node of `nproc` workers."""
    return ["--standalone", f"--nproc_per_node={nproc}", *more]


def run_cli(
    args: list[str], tmp_path: Path, nproc: int | None = None, timeout: float = 240
) -> subprocess.CompletedProcess:
    """`python main.py ARGS` (nproc None) or `torchrun --standalone --nproc_per_node=N main.py ARGS`."""
    return subprocess.run(
        cli([*own_snapshots(tmp_path), *args], None if nproc is None else standalone(nproc)),
        cwd=tmp_path,  # not the project: relative data paths must still resolve against the project
        env=subprocess_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=timeout,
    )




def start_cli(args: list[str], tmp_path: Path, nproc: int, max_restarts: int = 0, log_name: str = "launch.log",
              extra_env: dict[str, str] | None = None) -> subprocess.Popen:
    """Start `torchrun --standalone` in the background; its output goes to tmp_path/log_name."""
    env = subprocess_env(tmp_path)
    env.update(extra_env or {})
    command = cli([*own_snapshots(tmp_path), *args], standalone(nproc, f"--max-restarts={max_restarts}"))
    return subprocess.Popen(
        command, cwd=tmp_path, env=env,
        stdout=(tmp_path / log_name).open("w"), stderr=subprocess.STDOUT, text=True,
    )


def wait_for(predicate, timeout: float, interval: float = 0.02, what: str = "condition"):
    """The predicate's first true value, polled every `interval` s (chaos.wait_until); a TimeoutError after
    `timeout` s, where the harness would go on."""
    value = wait_until(predicate, timeout, interval)
    if not value:
        raise TimeoutError(f"timed out after {timeout} s waiting for {what}")
    return value


def resumes(log: str) -> list[tuple[int, int, int]]:
    """(step, epoch, sample of the epoch) of each resume a run's output reports (Trainer's "resumed from ..." line)."""
    return [(int(step), int(epoch), int(sample))
            for step, epoch, sample in re.findall(r"resumed from \S+: step (\d+), epoch (\d+), sample (\d+)", log)]


def logged_step(run_dir: Path) -> int:
    """Highest training step in metrics.jsonl so far (0 if none)."""
    return max((row["step"] for row in read_metrics(run_dir) if "train_loss" in row), default=0)


def kill_all(pids: list[int]) -> None:
    """SIGKILL each of these processes that is still there (torchrun's workers run in sessions of their own)."""
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def job_args(snapshots: Path | str, run_dir: Path | str, *overrides: str, **trainer_config: object) -> list[str]:
    """The end-to-end tests' one argument builder: TINY (the tiny model, a 40-step run), `trainer_config.KEY=VALUE`
    for each keyword (max_steps=100, save_every_steps=10, ...), the snapshot location and the run directory, then
    `overrides` (of any group: Hydra's last override of a key wins)."""
    return [*TINY, *(f"trainer_config.{key}={value}" for key, value in trainer_config.items()),
            f"trainer_config.snapshot_path={snapshots}", f"hydra.run.dir={run_dir}", *overrides]


@dataclass(frozen=True)
class Fault:
    """What happens to a running torchrun job once its metrics reach `at_step`: `signal` sent to its `victim` (one
    of VICTIMS); torchrun then restarts the workers up to `restarts` times, and with `rerun` the user runs the same
    command again once the job has ended."""

    at_step: int
    signal: int = signal.SIGKILL
    victim: str = "worker"
    restarts: int = 1
    rerun: bool = False


# Who a Fault hits: the last worker by process id (as the OOM killer picks one), rank 0's worker (the one writing
# the metrics and feeding the trackers), the torchrun agent (a lost agent: SIGKILL), or torchrun as a scheduler
# signals it (SIGTERM to the launcher).
VICTIMS = ("worker", "rank0", "agent", "launcher")


@dataclass(frozen=True)
class Case:
    """An end-to-end case as a row of a table (after torchtitan's OverrideDefinitions), run by run_case. What runs:
    `script` with `args` (`{d}` stands for the case's own folder, `{s}` for its snapshot folder, `{port}` for a
    port nothing listens on) as one process (`nproc` None) or under `torchrun --standalone` with `nproc` workers,
    after `files` (name, bytes) are written in `{d}` and `prepare(d, s)` has run, in the environment changed by
    `env(d)` (a None value removes a variable); what happens to it (`fault`). What must come out: `exit_code`, the
    texts its output contains (`expect`), the regex its one `error: ...` line matches (`error`: the line is all of
    stderr, with no traceback; under torchrun, whose own report of a failed worker is a launcher traceback, none
    from the project's code), no run directory where it ends before Hydra makes one (`no_run_dir`), the weights of
    the same command run without the fault (`reference`)."""

    id: str
    args: tuple[str, ...]
    nproc: int | None = None
    script: str = "main.py"
    files: tuple[tuple[str, bytes], ...] = ()
    prepare: Callable[[Path, Path], object] | None = None
    env: Callable[[Path], dict[str, str | None]] | None = None
    fault: Fault | None = None
    exit_code: int = 0
    expect: tuple[str, ...] = ()
    error: str = ""
    no_run_dir: bool = False
    reference: bool = False
    marks: tuple = ()

    def arguments(self, folder: Path, snapshots: Path) -> list[str]:
        # str.replace, not str.format: an argument may hold braces of its own (a Hydra dict: {token:'...'})
        return [arg.replace("{d}", str(folder)).replace("{s}", str(snapshots)).replace("{port}", str(free_port()))
                for arg in self.args]


@dataclass
class Outcome:
    """What a case's run left: the exit code and output of the job (of the rerun, with Fault.rerun: `first` is the
    interrupted job's exit code and `stdout` holds both), the workers the fault saw, and where it ran."""

    code: int
    stdout: str
    stderr: str
    folder: Path
    snapshots: Path
    cwd: Path  # where the command ran: empty before
    first: int | None = None
    workers: tuple[int, ...] = ()
    workers_gone_s: float | None = None  # after a killed agent: seconds until its orphaned workers had left
    reference: Path | None = None  # the run directory of the reference run

    @property
    def output(self) -> str:
        return self.stdout + self.stderr


def table(*cases: Case) -> list:
    """The cases as pytest parameters, each named by its id: `@pytest.mark.parametrize("case", table(...))`."""
    return [pytest.param(case, id=case.id, marks=case.marks) for case in cases]


def case_command(case: Case, args: list[str], folder: Path, *torchrun: str) -> list[str]:
    """The command line of `case` with its arguments filled in: main.py's snapshots kept in `folder` unless the
    arguments name their own; under torchrun (with `torchrun`'s further arguments) when the case has processes."""
    launcher = None if case.nproc is None else standalone(case.nproc, *torchrun)
    return cli([*own_snapshots(folder), *args] if case.script == "main.py" else args, launcher, case.script)


def error_lines(output: str) -> list[str]:
    """The `error: ...` lines of an output, without the `[rank N] ` prefix of ranks other than 0."""
    prefixed = re.compile(r"^(\[rank \d+\] )?(?=error: )")
    return [prefixed.sub("", line) for line in output.splitlines() if prefixed.match(line)]


def run_dir_of(args: list[str], folder: Path) -> Path:
    """The run directory a command's `hydra.run.dir=` names (the case's folder's `run` if it names none)."""
    named = [arg.split("=", 1)[1] for arg in args if arg.startswith("hydra.run.dir=")]
    return Path(named[-1]) if named else folder / "run"


def run_case(case: Case, folder: Path, snapshots: Path | None = None, timeout: float = 300) -> Outcome:
    """Run `case` in `folder` (its snapshots in `snapshots`, by default folder/snaps) and check what every case
    promises: its exit code, its `expect` texts in the output, no run directory where it ends before one, and with
    `reference` the weights of the same command run in folder/reference without the fault. Returns the Outcome for
    the test's own checks."""
    snapshots = snapshots or folder / "snaps"
    for name, content in case.files:
        (folder / name).write_bytes(content)
    if case.prepare is not None:
        case.prepare(folder, snapshots)
    args = case.arguments(folder, snapshots)
    env = {**subprocess_env(folder), **(case.env(folder) if case.env else {})}
    env = {key: value for key, value in env.items() if value is not None}
    cwd = folder / "cwd"  # a folder of its own: relative data paths must still resolve against the project
    cwd.mkdir(exist_ok=True)
    run_dir = run_dir_of(args, folder)
    if case.fault is None:
        done = subprocess.run(case_command(case, args, folder), cwd=cwd, env=env, capture_output=True, text=True,
                              timeout=timeout)
        outcome = Outcome(done.returncode, done.stdout, done.stderr, folder, snapshots, cwd)
    else:
        outcome = _interrupted(case, args, cwd, env, run_dir, folder, snapshots, timeout)
    assert outcome.code == case.exit_code, f"exit {outcome.code}:\n{outcome.output[-3000:]}"
    missing = [text for text in case.expect if text not in outcome.output]
    assert not missing, (missing, outcome.output[-3000:])
    if case.error:
        errors = error_lines(outcome.stderr)
        assert len(errors) == 1, outcome.output[-3000:]  # under torchrun too: once for the job, not once per rank
        assert re.search(case.error, errors[0].removeprefix("error: ")), errors[0]
        if case.nproc is None:
            assert "Traceback" not in outcome.output, outcome.output[-3000:]
            assert [line for line in outcome.stderr.splitlines() if line.strip()] == errors, outcome.stderr[-3000:]
        else:
            frames = re.findall(r'File "([^"]+)"', outcome.output)
            assert not [f for f in frames if f.startswith(str(PROJECT_DIR)) and "/.venv/" not in f], outcome.output
    if case.no_run_dir:
        assert not run_dir.exists() and not (cwd / "outputs").exists()  # it failed before Hydra made one
    if case.reference:
        outcome.reference = reference_run(case, folder, cwd, env, timeout)
        assert weights_digest(run_dir) == weights_digest(outcome.reference)
    return outcome


# The reference runs made so far, by command (its `{d}`, `{s}` unformatted) and launch: cases that would run the
# same uninterrupted command share one run of it.
_REFERENCES: dict[tuple, Path] = {}


def reference_run(case: Case, folder: Path, cwd: Path, env: dict[str, str], timeout: float) -> Path:
    """The run directory of `case`'s command run without its fault (in folder/reference, or where another case ran
    the same command before)."""
    key = (case.script, case.nproc, case.args)
    if key not in _REFERENCES:
        home = folder / "reference"
        home.mkdir()
        args = case.arguments(home, home / "snaps")
        straight = subprocess.run(case_command(case, args, home), cwd=cwd, env=env, capture_output=True, text=True,
                                  timeout=timeout)
        assert_ok(straight)
        _REFERENCES[key] = run_dir_of(args, home)
    return _REFERENCES[key]


def _interrupted(case: Case, args: list[str], cwd: Path, env: dict[str, str], run_dir: Path, folder: Path,
                 snapshots: Path, timeout: float) -> Outcome:
    """The torchrun job of `case`, its Fault injected from outside once its metrics reach the fault's step."""
    fault, log_path = case.fault, folder / "launch.log"
    assert fault.victim in VICTIMS and case.nproc, case
    command = case_command(case, args, folder, f"--max-restarts={fault.restarts}")
    with log_path.open("w") as log:
        job = subprocess.Popen(command, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT, text=True)
    workers: list[int] = []
    try:
        wait_for(lambda: logged_step(run_dir) >= fault.at_step or job.poll() is not None, timeout=120,
                 what=f"step {fault.at_step}")
        workers = children(job.pid)
        assert job.poll() is None and len(workers) == case.nproc, (workers, log_path.read_text()[-3000:])
        if fault.victim in ("agent", "launcher"):
            os.kill(job.pid, fault.signal)
        else:
            os.kill(workers[-1] if fault.victim == "worker" else next(w for w in workers if rank_of(w) == 0),
                    fault.signal)
        code = job.wait(timeout=timeout)
        gone_s = None
        if fault.victim == "agent":  # its workers are orphans now, which must leave by themselves
            killed_at = time.monotonic()
            wait_for(lambda: not any(alive(w) for w in workers), timeout=30, what="the orphaned workers to exit")
            gone_s = time.monotonic() - killed_at
    finally:
        if job.poll() is None:  # something failed on the way: no job left behind
            kill_all([*children(job.pid), job.pid])
            job.wait()
        kill_all(workers)
    output = log_path.read_text()
    if not fault.rerun:
        return Outcome(code, output, "", folder, snapshots, cwd, first=code, workers=tuple(workers),
                       workers_gone_s=gone_s)
    again = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    return Outcome(again.returncode, output + again.stdout, again.stderr, folder, snapshots, cwd, first=code,
                   workers=tuple(workers), workers_gone_s=gone_s)


def read_summary(run_dir: Path) -> dict:
    """A run's summary.json (written by rank 0 at the end: steps, world_size, weights_sha256, ...)."""
    return json.loads((run_dir / SUMMARY_FILE).read_text())


def weights_digest(run_dir: Path) -> str:
    """The sha256 of the weights a run ended with, from its summary.json."""
    return read_summary(run_dir)["weights_sha256"]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def assert_ok(proc: subprocess.CompletedProcess) -> None:
    """Exit code 0; otherwise the failure shows the end of what the command printed."""
    assert proc.returncode == 0, ((proc.stderr or "") + (proc.stdout or ""))[-3000:]


def assert_one_error_line(proc: subprocess.CompletedProcess, pattern: str = "") -> str:
    """A non-zero exit with exactly one line on stderr, `error: ...` (matching `pattern`, a regex); returns it."""
    lines = (proc.stderr or "").splitlines()
    assert proc.returncode != 0 and len(lines) == 1, f"exit {proc.returncode}:\n{(proc.stderr or '')[-3000:]}"
    assert re.match(rf"(\[rank \d+\] )?error: .*{pattern}", lines[0]), lines[0]
    return lines[0]


class S3Server:
    """moto's S3 server (its standalone server: real HTTP) on 127.0.0.1, on a port of its own that a test may stop and
    start again. moto keeps buckets and objects in this process, so they survive a restart, as a real store's would.
    `env` is what a process needs to reach it (endpoint, credentials, region; no EC2 metadata lookups)."""

    def __init__(self, credentials: dict[str, str]) -> None:
        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.env = {"AWS_ENDPOINT_URL": self.endpoint, **credentials, "AWS_REGION": "us-east-1",
                    "AWS_DEFAULT_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true"}
        self._server = None

    def start(self) -> None:
        from moto.server import ThreadedMotoServer

        self._server = ThreadedMotoServer(ip_address="127.0.0.1", port=self.port, verbose=False)
        self._server.start()

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop()
            self._server = None

