"""The docs' commands run as written. Every fenced block of README.md, docs/*.md and benchmarks/*.md is ```bash (a
shell block) or ```text; each shell block either runs here, in order with its document's others, in a fresh copy of
the project's tracked files, and must exit 0, or is listed in SKIPPED with the reason it cannot run here. An
unlabelled fence, or a listed block that no document has any more, fails, so the docs cannot drift from the code."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from support import PROJECT_DIR, subprocess_env

SHELL = "bash"  # the one info string of a shell block; ```text for anything else
# A block is run here only if it takes under a minute on 2 idle cores; the timeout catches a hang, not slowness: a
# one-command block of 58 CPU-s took 150 s in CI while the other worker's 4-process launch held both cores
# (2026-12-07). This much for each command of the block.
TIMEOUT_PER_COMMAND_S = 300

# (document, the start of its block's first line, whitespace collapsed): why the block does not run here.
NEEDS_GPU = "needs a node with GPUs"
SEVERAL_MACHINES = "needs several machines"
NEEDS_S3 = "needs an S3 bucket and its credentials"
INSTALLS = "creates a virtual environment and installs packages"
YOUR_DATA = "needs your own files at /data"
BENCHMARK = "a benchmark: minutes of measuring, not a check"
NANOGPT = "needs nanoGPT's repository cloned beside the project (network), and minutes of measuring"
SKIPPED = {
    ("README.md", "make run"): INSTALLS + "; then trains the whole quick-start (one or two minutes more)",
    ("README.md", "python sample.py snapshot=snapshots/cpu-quickstart"): "needs `make run`'s snapshot",
    ("README.md", "python3 -m venv .venv"): INSTALLS,
    ("README.md", "pip install -r requirements-without-torch.txt"): INSTALLS,
    ("README.md", "torchrun --standalone --nproc_per_node=4 main.py"): NEEDS_GPU,
    ("README.md", "python prepare.py data_config.path='/data/books/*.txt'"): YOUR_DATA,
    ("README.md", "torchrun --standalone --nproc_per_node=4 --max-restarts=3"): NEEDS_GPU + "; " + NEEDS_S3,
    ("README.md", "export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1"): SEVERAL_MACHINES,
    ("README.md", "# on 4 GPUs, then on 8"): NEEDS_GPU,
    ("docs/parallelism.md", "# one 8-GPU node"): NEEDS_GPU + "; " + SEVERAL_MACHINES,
    ("docs/cpu.md", "torchrun --standalone --nproc_per_node=2 main.py preset=cpu trainer_config.snapshot_path="):
        "the whole 2,200-step quick-start, on two processes (one process alone trains for one or two minutes)",
    ("docs/data.md", "python prepare.py data_config.path='/data/books/*.txt'"): YOUR_DATA + "; " + NEEDS_GPU,
    ("docs/fsdp.md", "torchrun --standalone --nproc_per_node=4"): NEEDS_GPU,
    ("docs/gpu.md", "torchrun --standalone --nproc_per_node=4 main.py"): NEEDS_GPU,
    ("docs/gpu.md", "make gpu-wheels"): "downloads wheels (network), then needs a GPU machine",
    ("docs/multinode.md", "# on each of 2 nodes"): SEVERAL_MACHINES,
    ("docs/multinode.md", "# CPU-only nodes"): "needs a SLURM cluster (tests/e2e/test_slurm.py starts one, as root)",
    ("docs/multinode.md", "# on each node"): SEVERAL_MACHINES,
    ("docs/s3.md", "export AWS_ACCESS_KEY_ID=..."): NEEDS_S3 + "; " + NEEDS_GPU,
    ("docs/settings.md", "python main.py data_config.path=/data/corpus.txt"): YOUR_DATA + "; " + NEEDS_S3,
    ("docs/settings.md", "python sample.py snapshot=s3://"): NEEDS_S3,
    ("docs/snapshots.md", "# a killed worker"): NEEDS_GPU,
    ("docs/snapshots.md", "python snapshot.py consolidate snapshots/fsdp/snapshot-000002000.dcp"):
        "needs a 2,000-step FSDP run (docs/fsdp.md consolidates a short one, and runs)",
    ("docs/testing.md", "make test"): INSTALLS + "; then the whole suite (this test among it)",
    ("docs/testing.md", "python -m pytest -q tests/unit"): "the unit tests, which this suite runs itself",
    ("docs/testing.md", "python -m pytest -q tests/e2e/test_resume.py"): "end-to-end tests this suite runs itself",
    ("docs/tracking.md", "pip install -r requirements-mlflow.txt"): INSTALLS,
    ("docs/tracking.md", "pip install mlflow"): "installs the whole mlflow package (for its server), then trains "
                                                "the whole quick-start against that server",
    ("docs/tracking.md", "wandb login"): "needs a W&B account and network access",
    ("benchmarks/bench.md", "python benchmarks/bench.py preset=nanogpt_cpu"): NANOGPT,
    ("benchmarks/bench.md", "python benchmarks/bench.py --baseline nanogpt"): BENCHMARK,
    ("benchmarks/bench.md", "# one pair; the rows below ran it"): BENCHMARK,
    ("benchmarks/bench_data.md", "python benchmarks/bench_data.py"): BENCHMARK + " (a 340 MB corpus)",
    ("benchmarks/bench_launch.md", "python benchmarks/bench_launch.py --only startup"): NANOGPT,
    ("benchmarks/bench_launch.md", "git clone https://github.com/karpathy/nanoGPT"): NANOGPT,
    ("benchmarks/bench_launch.md", "# in a checkout before (ad40edd) and after (8144515)"): BENCHMARK,
    ("benchmarks/time_to_loss.md", "python benchmarks/time_to_loss.py --nanogpt"): NANOGPT,
    ("benchmarks/recipe.md", "python benchmarks/recipe.py"): BENCHMARK + " (a minute a run)",
    ("benchmarks/chaos.md", "python benchmarks/chaos.py --trials 20"): "minutes a trial: 10.5 minutes for these",
    ("benchmarks/ci.md", "git clone -q . /tmp/ci"): "the whole of CI: 20 minutes or more, and 13 GB of disk",
}

# (document, the start of its block's first line): the documents whose blocks run each of its commands, as written.
# The README shows what a guide shows and runs: each such command runs once, in the guide (the test below keeps them
# equal).
RUNS_IN = {
    ("README.md", "python main.py preset=cpu trainer_config.max_steps=100"): ("docs/settings.md",),
    ("README.md", "python main.py --help"): ("docs/settings.md",),
    ("README.md", "python main.py preset=cpu optimizer_config.name=muon"): ("docs/recipe.md",),
    ("README.md", "python main.py preset=cpu gpt_config.bigram_embedding=false"): ("docs/snapshots.md",
                                                                                  "docs/tracking.md"),
}

FENCE = re.compile(r"^```([^\n]*)\n(.*?)^```[ \t]*$", re.M | re.S)


def documents() -> list[str]:
    found = [PROJECT_DIR / "README.md", *sorted(PROJECT_DIR.glob("docs/*.md")),
             *sorted(PROJECT_DIR.glob("benchmarks/*.md"))]
    return [str(path.relative_to(PROJECT_DIR)) for path in found]


def first_line(block: str) -> str:
    return " ".join(next(line for line in block.splitlines() if line.strip()).split())


def fences(document: str) -> list[tuple[str, str]]:
    """(info string, text) of every fenced block, in order."""
    text = (PROJECT_DIR / document).read_text(encoding="utf-8")
    return [(match.group(1).strip(), match.group(2)) for match in FENCE.finditer(text)]


def command_count(block: str) -> int:
    """The block's commands: its lines that are neither comments nor the continuation of a line ending in `\\`."""
    lines = [line for line in block.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    return sum(1 for i, line in enumerate(lines) if i == 0 or not lines[i - 1].rstrip().endswith("\\"))


def commands(block: str) -> list[str]:
    """The block's commands, each with its continuation lines joined, without comments, whitespace collapsed."""
    joined = re.sub(r"\\\n", " ", block)
    lines = (re.sub(r"(^|\s)#.*", "", line) for line in joined.splitlines())
    return [" ".join(line.split()) for line in lines if line.strip()]


def runs_in(document: str, block: str) -> tuple[str, ...]:
    line = first_line(block)
    return next((docs for (doc, start), docs in RUNS_IN.items() if doc == document and line.startswith(start)), ())


def skip_reason(document: str, block: str) -> str | None:
    line = first_line(block)
    if elsewhere := runs_in(document, block):
        return f"its commands run in {', '.join(elsewhere)}"
    return next((why for (doc, start), why in SKIPPED.items() if doc == document and line.startswith(start)), None)


def runnable(document: str) -> list[str]:
    return [block for info, block in fences(document) if info == SHELL and skip_reason(document, block) is None]


def test_every_block_is_a_shell_block_or_text():
    """An unlabelled fence, or another shell's label, would hide a command from the test."""
    labels = {(doc, info) for doc in documents() for info, _ in fences(doc)}
    assert {(doc, info) for doc, info in labels if info not in (SHELL, "text")} == set()


def test_each_listed_block_matches_exactly_one_block():
    """A listed block that a document lost, or a start that names two blocks, is a stale or vague entry."""
    for (doc, start), why in SKIPPED.items():
        blocks = [block for info, block in fences(doc) if info == SHELL] if (PROJECT_DIR / doc).is_file() else []
        matches = [block for block in blocks if first_line(block).startswith(start)]
        assert len(matches) == 1, f"SKIPPED[{doc!r}, {start!r}] ({why}) matches {len(matches)} blocks"


def test_a_block_that_runs_in_another_document_is_its_commands_as_written():
    """A README block listed in RUNS_IN is not run twice: each of its commands is one that those documents run (a
    command edited in one place only fails here), and each listed start names exactly one block."""
    for (doc, start), docs in RUNS_IN.items():
        blocks = [block for info, block in fences(doc) if info == SHELL and first_line(block).startswith(start)]
        assert len(blocks) == 1, f"RUNS_IN[{doc!r}, {start!r}] matches {len(blocks)} blocks"
        elsewhere = {command for other in docs for block in runnable(other) for command in commands(block)}
        missing = [command for command in commands(blocks[0]) if command not in elsewhere]
        assert missing == [], f"{doc}: not run by {docs}: {missing}"


def test_the_files_a_skipped_block_names_exist():
    """What cannot run here can still be checked: every .py, .sh and .yaml file it names is in the project."""
    missing = []
    for doc in documents():
        for info, block in fences(doc):
            if info != SHELL or skip_reason(doc, block) is None:
                continue
            commands = re.sub(r"(^|\s)#.*", "", block)  # comments may name other projects' files
            for name in re.findall(r"(?<![\w./-])((?:[\w-]+/)*[\w-]+\.(?:py|sh|yaml))\b", commands):
                if not (PROJECT_DIR / name).is_file():
                    missing.append(f"{doc}: {name}")
    assert missing == []


def tracked_copy(destination: Path) -> Path:
    """The project's tracked files (as they are in the working tree), copied: what a fresh clone holds."""
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=PROJECT_DIR, capture_output=True, text=True)
    if listed.returncode != 0:
        pytest.skip("not a git checkout")
    for name in filter(None, listed.stdout.split("\0")):
        source = PROJECT_DIR / name
        if source.is_file():  # a tracked file deleted in the working tree is not in the copy
            (destination / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, destination / name)
    return destination


@pytest.mark.parametrize("document", [doc for doc in documents() if runnable(doc)])
def test_the_documents_blocks_run_as_written(document, tmp_path):
    project = tracked_copy(tmp_path / "project")
    env = subprocess_env(tmp_path)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"  # python, torchrun: this venv's
    env["XDG_CACHE_HOME"] = str(tmp_path / "cache")  # the data cache, not the user's
    env["MPLCONFIGDIR"] = str(tmp_path / "matplotlib")
    for block in runnable(document):
        started = time.monotonic()
        result = subprocess.run(["bash", "-euo", "pipefail", "-c", block], cwd=project, env=env,
                                stdin=subprocess.DEVNULL, capture_output=True, text=True,
                                timeout=TIMEOUT_PER_COMMAND_S * command_count(block))
        took = time.monotonic() - started
        output = ((result.stderr or "") + (result.stdout or ""))[-3000:]
        assert result.returncode == 0, f"{document}, block `{first_line(block)}` exit {result.returncode}:\n{output}"
        print(f"{document}: `{first_line(block)[:70]}` {took:.0f} s")
