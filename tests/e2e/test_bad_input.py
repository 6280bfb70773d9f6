"""Bad input, one table: every case runs the real CLI and must exit non-zero with ONE readable line naming the
problem (no traceback), and leave the snapshots that were already there byte-for-byte as they were: the config,
the command line (Hydra's own flags included), layouts the degrees cannot make, data, storage locations,
snapshots, sample.py's settings and the environment.

A module fixture trains a tiny model once (snapshots at steps 5 and 10); each case gets its own copy of that
snapshot folder, may damage or add files in it, and runs `main.py` (or torchrun, `sample.py`, `snapshot.py info` or
`list`) in an empty folder of its own, which must stay empty: a storage location that looks like a URL is parsed as
one or refused, never turned into a local folder (`s3:`) there or in the project folder. The rows are
support.Case's, run by support.run_case (which checks the exit code and the one error line), two at a time.
Cases fail before training starts, so the whole table takes a few minutes on 2 cores.
"""

from __future__ import annotations

import atexit
import importlib.util
import json
import os
import random
import re
import shutil
import subprocess
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

import pytest
from support import (
    PROJECT_DIR,
    Case,
    Outcome,
    assert_ok,
    cli,
    free_port,
    job_args,
    run_case,
    subprocess_env,
    text_files,
)

from mingpt.checkpoint import store as snap

SNAPSHOTS = [snap.snapshot_name(5), snap.snapshot_name(10)]
SHAKESPEARE = (PROJECT_DIR / "data" / "input.txt").read_text(encoding="utf-8")


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """A snapshot folder written by a short real run of TINY."""
    home = tmp_path_factory.mktemp("trained")
    snaps = home / "snaps"
    result = subprocess.run(
        cli(job_args(snaps, home / "run", max_steps=10, save_every_steps=5, eval_every_steps=10, eval_batches=1)),
        cwd=home, env=subprocess_env(home), capture_output=True, text=True, timeout=600,
    )
    assert_ok(result)
    assert sorted(p.name for p in snaps.iterdir()) == SNAPSHOTS
    return snaps


# --------------------------------------------------------------------------------------------------- case helpers
def write(d: Path, name: str, content: bytes) -> Path:
    path = d / name
    path.write_bytes(content)
    return path


def damage_all(snaps: Path, how: Callable[[bytes], bytes]) -> None:
    for path in snaps.iterdir():
        path.write_bytes(how(path.read_bytes()))


def craft(snaps: Path, name: str, change: Callable[[dict], None], recompute_digest: bool = True) -> Path:
    """A copy of the newest snapshot with `change` applied, saved as `name` in the folder."""
    snapshot = snap.from_bytes((snaps / SNAPSHOTS[-1]).read_bytes(), "newest")
    change(snapshot)
    if recompute_digest:
        snapshot["integrity_sha256"] = snap.integrity_sha256(snapshot)
    return write(snaps, name, snap.to_bytes(snapshot))


class WritesMarker:
    """Pickles as a call to exec() that would create a file; loading must refuse it without running it."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (exec, (f"open({self.marker!r}, 'w').close()",))


def broken_shards(snaps: Path) -> None:
    """A folder of shards whose snapshot.json is not JSON."""
    folder = snaps / "snapshot-000000011.dcp"
    folder.mkdir()
    write(folder, "snapshot.json", b"{")


def gpt2_folder(folder: Path, model_type: str = "gpt2", n_layer: int = 3, weights: bytes | None = None) -> None:
    """A Hugging Face folder's config.json (of TINY's shape but for `n_layer`), a BPE tokenizer.json trained on
    the text (where `tokenizers` is installed) and `weights` as its model.safetensors."""
    folder.mkdir()
    config = {"model_type": model_type, "n_layer": n_layer, "n_head": 2, "n_embd": 32, "n_positions": 32,
              "vocab_size": 300, "activation_function": "gelu_new"}
    write(folder, "config.json", json.dumps(config).encode())
    if importlib.util.find_spec("tokenizers") is not None:
        from mingpt.data.tokenizer import BpeTokenizer

        write(folder, "tokenizer.json", BpeTokenizer.train([SHAKESPEARE[:20000]], 300, "test").json.encode())
    else:
        write(folder, "tokenizer.json", b"{}")  # enough for the refusals that come before the tokenizer is read
    if weights is not None:
        write(folder, "model.safetensors", weights)


def different_vocabulary(d: Path) -> Path:
    """As much text as the fixture's data, with the same number of distinct characters but one of them other."""
    text = SHAKESPEARE[: int(len(SHAKESPEARE) * 0.05)]
    return write(d, "other.txt", text.replace("z", "\u00e9").encode("utf-8"))


def small_disk(mount: Path) -> None:
    """A 256 KiB tmpfs (root only), unmounted when the tests end."""
    mount.mkdir()
    if os.geteuid() != 0 or os.system(f"mount -t tmpfs -o size=256k tmpfs {mount} 2>/dev/null") != 0:
        pytest.skip("mounting a tmpfs needs root")
    atexit.register(os.system, f"umount {mount} 2>/dev/null")


def newer_cache(d: Path) -> None:
    """A cache of {d}/t.txt whose manifest says it was written by a newer format."""
    from mingpt.data.token_cache import FORMAT_VERSION, open_tokens

    tokens = open_tokens(str(write(d, "t.txt", SHAKESPEARE[:20000].encode())), "\n", d / "cache")
    manifest_path = tokens.path.parent / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    manifest_path.write_text(json.dumps({**manifest, "format_version": FORMAT_VERSION + 1}))


def no_aws_credentials(d: Path) -> dict[str, str | None]:
    """No AWS credentials from anywhere (None: removed from the environment); no EC2 metadata service either."""
    names = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE")
    env: dict[str, str | None] = dict.fromkeys(names)
    env.update(AWS_SHARED_CREDENTIALS_FILE=str(d / "none"), AWS_CONFIG_FILE=str(d / "none"),
               AWS_EC2_METADATA_DISABLED="true", AWS_ENDPOINT_URL=f"http://127.0.0.1:{free_port()}")
    return env


def unreachable_s3(d: Path) -> dict[str, str | None]:
    env = no_aws_credentials(d)
    env.update(AWS_ACCESS_KEY_ID="AKIDEXAMPLE", AWS_SECRET_ACCESS_KEY="example-secret", AWS_REGION="us-east-1")
    return env


def refused(name: str, args: list[str], error: str, tool: str = "main",
            prepare: Callable[[Path, Path], object] | None = None, env: Callable[[Path], dict] | None = None,
            no_run_dir: bool = False, marks: tuple = ()) -> Case:
    """A row of the table: `args` (`{d}`: the case's own folder, `{s}`: its copy of the snapshot folder, `{port}`: a
    port nothing listens on) given to `tool` (main: a 10-step TINY run of main.py on those snapshots; torchrun: the
    same on 2 processes; sample: sample.py; info, list: snapshot.py's commands), after `prepare(d, s)` wrote or
    damaged files and `env(d)` changed the environment; it must end with exit code 2 (torchrun's: 1) and the one
    error line `error` (a regex, after "error: ")."""
    if tool == "sample":
        script, full = "sample.py", [*args, "max_new_tokens=5"]
    elif tool in ("info", "list"):
        script, full = "snapshot.py", [tool, *args]
    else:
        script, full = "main.py", job_args("{s}", "{d}/run", *args, max_steps=10, progress="off")
    return Case(name, tuple(full), nproc=2 if tool == "torchrun" else None, script=script, prepare=prepare, env=env,
                exit_code=1 if tool == "torchrun" else 2, error=error, no_run_dir=no_run_dir, marks=marks)


# Each case: (what it sets up and passes) -> the one error line it must give.
CASES: dict[str, Case] = {case.id: case for case in [
    # ---- the command line, as main.py checks it before Hydra runs (config.precheck_overrides): one row for each way
    # through that check here; the values it refuses, each with its line, are tests/unit/test_config.py's
    # PRECHECK_REFUSALS, run in-process (the same function, no run folder either way)
    refused("config: unknown key",
        ["gpt_config.nlayer=3"],
        r"Key 'nlayer' not in 'ModelSettings'"),
    refused("config: wrong type",
        ["trainer_config.max_steps=ten"],
        r"Value 'ten' of type 'str' could not be converted to Integer"),
    refused("command line: a misspelled override (before a run folder is made)",
        ["trainer_config.max_epoch=3"], r"max_epoch.*TrainerConfig", no_run_dir=True,
        marks=(pytest.mark.oldest_torch,)),
    refused("command line: zero batch size", ["trainer_config.batch_size=0"], r"batch_size must be positive"),
    refused("command line: a typo inside a sweep (-m)", ["-m", "trainer_config.max_step=1,2"],
        r"Key 'max_step' not in", no_run_dir=True),
    refused("command line: a bad value inside a sweep", ["--multirun", "trainer_config.batch_size=8,0"],
        r"batch_size must be positive, got 0", no_run_dir=True),
    refused("command line: a typo with --cfg job", ["--cfg", "job", "gpt_config.n_layr=2"], r"Key 'n_layr' not in",
        no_run_dir=True),
    refused("command line: an unknown flag", ["--bogus"], r"unknown option --bogus", no_run_dir=True),
    refused("command line: two Hydra modes", ["-m", "--cfg", "job"], r"only one of --cfg, --multirun can be given",
        no_run_dir=True),
    # ---- layouts the degrees cannot make (checked before a run folder is made, as above, but for the world size's)
    refused("layout: tp not dividing the heads", ["parallel_config.tp=3"],
        r"parallel_config\.tp=3 must divide gpt_config\.n_head", no_run_dir=True),
    refused("layout: degrees that are not the world", ["parallel_config.tp=2"],
        r"1 process\(es\) cannot be split as tp 2"),
    # ---- sample.py's own settings (the trained snapshot's vocabulary is the corpus's: Z is in it)
    refused("sample.py: a prompt outside the vocabulary", ["snapshot={s}", "prompt='Zoë ☃'"],
        r"characters not in the vocabulary: 'ë☃'", tool="sample"),
    refused("sample.py: zero temperature", ["snapshot={s}", "temperature=0"], r"temperature must be positive",
        tool="sample"),
    refused("sample.py: a missing folder", ["snapshot=/no/such/folder"], r"no snapshot found at /no/such/folder",
        tool="sample"),
    refused("sample.py: a missing snapshot", ["snapshot=/no/such/snapshot-000000001.pt"], r"no such snapshot",
        tool="sample"),
    refused("sample.py: a misspelled key", ["snapshot={s}", "max_new_token=5"],
        r"Key 'max_new_token' not in 'SampleConfig'", tool="sample"),
    # ---- gpt_config.init_from (a Hugging Face GPT-2 folder): fails before the process group
    refused("init_from: a folder that does not exist",
        ["gpt_config.init_from={d}/no-gpt2"],
        r"gpt_config\.init_from=.*/no-gpt2: no such folder \(a Hugging Face GPT-2 folder: "),
    refused("init_from: a model that is not GPT-2",
        ["gpt_config.init_from={d}/llama"], prepare=lambda d, s: gpt2_folder(d / "llama", model_type="llama"),
        error=r"gpt_config\.init_from=.*/llama is a llama model, not GPT-2 \(model_type gpt2, GPT2LMHeadModel\)"),
    refused("init_from: a shape override that contradicts the folder",
        ["gpt_config.init_from={d}/gpt2", "gpt_config.n_layer=2"], prepare=lambda d, s: gpt2_folder(d / "gpt2"),
        error=r"gpt_config\.n_layer=2 contradicts gpt_config\.init_from=.*/gpt2, whose config\.json gives "
              r"n_layer=3: leave it out, the folder sets the model$"),
    refused("init_from: a damaged weights file",
        ["gpt_config.init_from={d}/gpt2"],
        prepare=lambda d, s: gpt2_folder(d / "gpt2", n_layer=2, weights=b"not safetensors"),
        error=r"gpt_config\.init_from=.*/gpt2: cannot read model\.safetensors: ",
        marks=(pytest.mark.skipif(importlib.util.find_spec("tokenizers") is None,
                                  reason="a folder's tokenizer needs requirements-hf.txt"),)),
    # ---- data: fails before the process group
    refused("data: missing file",
        ["data_config.path=data/no-such-file.txt"],
        rf"data file not found: {re.escape(str(PROJECT_DIR))}/data/no-such-file\.txt$"),
    refused("data: empty file",
        ["data_config.path={d}/empty.txt"], prepare=lambda d, s: write(d, "empty.txt", b""),
        error=r"data file .*empty\.txt is empty"),
    refused("data: shorter than block_size + 1",
        ["data_config.path={d}/short.txt", "data_config.truncate=1.0"],
        prepare=lambda d, s: write(d, "short.txt", SHAKESPEARE[:60].encode()),
        error=r"short\.txt is too short: the validation split has 6 characters but block_size \+ 1 = 33 are needed"),
    refused("data: not UTF-8",
        ["data_config.path={d}/latin1.txt"],
        prepare=lambda d, s: write(d, "latin1.txt", "café au lait. ".encode("latin-1") * 50),
        error=r"latin1\.txt is not UTF-8 text \(invalid byte at offset 3\)"),
    refused("data: a glob that matches nothing",
        ["data_config.path={d}/books/*.txt"],
        prepare=lambda d, s: text_files(d / "books", {"a.md": SHAKESPEARE[:5000]}),
        error=r"data_config\.path '.*/books/\*\.txt' matches no file$"),
    refused("data: an unreadable file among many",
        ["data_config.path={d}/books"],
        prepare=lambda d, s: (text_files(d / "books", {"a.txt": SHAKESPEARE[:5000]}) / "c.txt").symlink_to(
            "/proc/self/mem"),
        error=r"cannot read data file .*/books/c\.txt: OSError: \[Errno \d+\] "),
    refused("data: invalid UTF-8 in one file of many",
        ["data_config.path={d}/books/*.txt", "data_config.truncate=1.0"],
        prepare=lambda d, s: text_files(d / "books", {"a.txt": SHAKESPEARE[:5000],
                                                      "b.txt": "caf\u00e9 au lait".encode("latin-1")}),
        error=r"data file .*/books/b\.txt is not UTF-8 text \(invalid byte at offset 3\)$"),
    refused("data: no room for the cache",
        ["data_config.cache_dir={d}/small", "data_config.truncate=1.0"], prepare=lambda d, s: small_disk(d / "small"),
        error=r"no room for the data cache in .*/small/input\.txt-\w+ \(the token file and manifest: 1,181,190 bytes "
        r"needed, [\d,]+ free\): free some space or set data_config\.cache_dir"),
    refused("data: a cache written by a newer version",
        ["data_config.path={d}/t.txt", "data_config.cache_dir={d}/cache", "data_config.truncate=1.0"],
        prepare=lambda d, s: newer_cache(d),
        error=r"the data cache .*/cache/t\.txt-\w+ was written by a newer mingpt-ddp \(format 2; this one reads 1\)"),
    refused("data: the cache folder is a file",
        ["data_config.cache_dir={d}/cache"], prepare=lambda d, s: write(d, "cache", b"not a folder"),
        error=r"cannot use the data cache folder .*/cache/input\.txt-\w+: .*; set data_config\.cache_dir to a "
        r"writable local folder$"),
    refused("data: unknown protocol",
        ["data_config.path=nope://bucket/input.txt"],
        r"data_config\.path 'nope://bucket/input\.txt': unknown protocol 'nope' \(fsspec knows s3, "),
    refused("data: s3 URL with one slash",
        ["data_config.path=s3:/corpus/input.txt"],
        r"data_config\.path 's3:/corpus/input\.txt' is not a complete URL: 's3:' must be followed by '//' "
        r"\(expected s3://BUCKET/PATH\)$"),
    refused("data: file URL with an empty path",
        ["data_config.path=file://"],
        r"data_config\.path 'file://': no path after 'file://' \(expected file:///ABSOLUTE/PATH\)$"),
    refused("data: ftp server refusing connections",
        ["data_config.path=ftp://127.0.0.1:{port}/input.txt"],
        r"cannot read data file ftp://127\.0\.0\.1:\d+/input\.txt: ConnectionRefusedError: "),
    refused("data: http server unreachable",
        ["data_config.path=http://127.0.0.1:{port}/input.txt"],
        r"cannot read data file http://127\.0\.0\.1:\d+/input\.txt: ClientConnectorError: Cannot connect to host"),
    refused("data: s3 endpoint unreachable",
        ["data_config.path=s3://corpus/input.txt"],
        r"cannot read data file s3://corpus/input\.txt: EndpointConnectionError: Could not connect to the endpoint URL",
        env=unreachable_s3),
    # ---- the snapshot location: a URL is one or an error, never a local folder (issue 17)
    refused("location: s3:// without a bucket",
        ["trainer_config.snapshot_path=s3://"],
        r"trainer_config.snapshot_path 's3://': no bucket after 's3://' \(expected s3://BUCKET/PATH\)$"),
    refused("location: s3:/bucket with one slash",
        ["trainer_config.snapshot_path=s3:/bucket/run"],
        r"trainer_config.snapshot_path 's3:/bucket/run' is not a complete URL: 's3:' must be followed by '//'"),
    refused("location: s3:///x with an empty bucket",
        ["trainer_config.snapshot_path=s3:///run"],
        r"trainer_config.snapshot_path 's3:///run': no bucket after 's3://'"),
    refused("location: file:// with an empty path",
        ["trainer_config.snapshot_path=file://"],
        r"trainer_config.snapshot_path 'file://': no path after 'file://' \(expected file:///ABSOLUTE/PATH\)$"),
    refused("location: unknown protocol",
        ["trainer_config.snapshot_path=s4://bucket/run"],
        r"trainer_config.snapshot_path 's4://bucket/run': unknown protocol 's4' \(fsspec knows s3, "),
    refused("location: ftp store refusing connections",
        ["trainer_config.snapshot_path=ftp://127.0.0.1:{port}/run"],
        r"cannot use snapshot location ftp://127\.0\.0\.1:\d+/run: ConnectionRefusedError: .*Connection refused$"),
    refused("location: s3:// without a bucket (sample.py)",
        ["snapshot=s3://"],
        r"storage location 's3://': no bucket after 's3://'", tool="sample"),
    refused("location: s3:/bucket with one slash (sample.py)",
        [f"snapshot=s3:/bucket/run/{SNAPSHOTS[-1]}"],
        r"storage location 's3:/bucket/run/snapshot-000000010\.pt' is not a complete URL", tool="sample"),
    refused("location: s3:///x with an empty bucket (snapshot.py info)",
        [f"s3:///run/{SNAPSHOTS[-1]}"],
        r"storage location 's3:///run/snapshot-000000010\.pt': no bucket after 's3://'", tool="info"),
    refused("location: unknown protocol (snapshot.py list)",
        ["s4://bucket/run"],
        r"storage location 's4://bucket/run': unknown protocol 's4'", tool="list"),
    refused("location: s3:// without a bucket (snapshot.py list)",
        ["s3://"],
        r"storage location 's3://': no bucket after 's3://'", tool="list"),
    refused("location: missing folder (snapshot.py list)",
        ["{d}/no-such-folder"],
        r"no such snapshot folder: .*/no-such-folder$", tool="list"),
    # ---- snapshots already in the snapshot folder
    refused("snapshot: every snapshot truncated",
        ["trainer_config.max_steps=20"], prepare=lambda d, s: damage_all(s, lambda b: b[: len(b) // 2]),
        error=r"no readable snapshot in .*: all 2 damaged \(newest: .*snapshot-000000010\.pt: unreadable "
        r"\(RuntimeError: "
        r"PytorchStreamReader failed reading zip archive: failed finding central directory\)\); move them away"),
    refused("snapshot: random bytes (snapshot.py info)",
        ["{s}/" + SNAPSHOTS[-1]], prepare=lambda d, s: damage_all(s, lambda b: random.Random(len(b)).randbytes(len(b))),
        error=r"snapshot-000000010\.pt: unreadable \(not a snapshot file\)$", tool="info"),
    refused("snapshot: truncated (sample.py)",
        ["snapshot={s}/" + SNAPSHOTS[-1]], prepare=lambda d, s: damage_all(s, lambda b: b[:4000]),
        error=r"snapshot .*snapshot-000000010\.pt: unreadable \(.*\)$", tool="sample"),
    refused("snapshot: a folder in the place of the newest snapshot (a store failure during resume)",
        ["trainer_config.max_steps=20"], prepare=lambda d, s: (s / snap.snapshot_name(11)).mkdir(),
        error=r"cannot read snapshot .*/snapshot-000000011\.pt \(1 attempt\(s\) in \d+\.\d s, last error "
        r"IsADirectoryError: "),
    refused("snapshot: other model shape",
        ["gpt_config.n_embd=64"],
        r"is for a different model: n_embd=32 in the snapshot, 64 in the config"),
    refused("snapshot: other model shape, resumed under fsdp",
        ["parallel_config.strategy=fsdp", "gpt_config.n_embd=64"],
        r"is for a different model: n_embd=32 in the snapshot, 64 in the config"),
    refused("snapshot: a damaged folder of shards (snapshot.py info)",
        ["{s}/snapshot-000000011.dcp"], prepare=lambda d, s: broken_shards(s),
        error=r"snapshot-000000011\.dcp: damaged \(snapshot\.json is not JSON\)$", tool="info"),
    refused("snapshot: other vocabulary",
        ["data_config.path={d}/other.txt", "data_config.truncate=1.0"], prepare=lambda d, s: different_vocabulary(d),
        error=r"has a different vocabulary \(65 characters, this data 59; only in the data: '\u00e9', "
        r"only in the snapshot: '.*z'"),
    refused("snapshot: newer format version",
        ["trainer_config.max_steps=20"],
        prepare=lambda d, s: craft(s, snap.snapshot_name(11),
                                   lambda x: x.update(format_version=snap.FORMAT_VERSION + 1)),
        error=rf"snapshot-000000011\.pt has snapshot format {snap.FORMAT_VERSION + 1}, newer than this code "
              rf"understands \({snap.FORMAT_VERSION}\)"),
    refused("snapshot: pickled code",
        ["trainer_config.max_steps=20"],
        prepare=lambda d, s: craft(s, snap.snapshot_name(11), lambda x: x.update(progress=WritesMarker(d / "code-ran")),
                                   recompute_digest=False),
        error=r"refusing to load .*snapshot-000000011\.pt: it references code \(.*exec\), not only data"),
    refused("snapshot: weights that do not fit its own config (sample.py)",
        ["snapshot={s}/" + snap.snapshot_name(11)],
        prepare=lambda d, s: craft(s, snap.snapshot_name(11), lambda x: x["model_config"].update(n_embd=64, n_head=4)),
        error=r"the snapshot's weights do not match its model config: .*size mismatch", tool="sample"),
    # ---- environment
    refused("environment: world size does not divide the work",
        ["data_config.path={d}/small.txt", "data_config.truncate=1.0", "trainer_config.batch_size=200"],
        prepare=lambda d, s: write(d, "small.txt", SHAKESPEARE[:400].encode()),
        error=r"an optimizer step needs batch_size x grad_accum_steps x data-parallel ranks = 200 x 1 x 2 windows, "
        r"but the training split has only 328", tool="torchrun"),
    refused("environment: a misspelled key under torchrun (every rank sees it; printed once)",
        ["trainer_config.max_step=3"], r"Key 'max_step' not in 'TrainerConfig'", tool="torchrun"),
    refused("environment: a missing data file under torchrun (printed once)",
        ["data_config.path=/no/such/file.txt"], r"data file not found", tool="torchrun"),
    refused("environment: missing S3 credentials",
        ["trainer_config.snapshot_path=s3://bucket/run1/"],
        r"snapshot location s3://bucket/run1 .*NoCredentialsError: Unable to locate credentials",
        env=no_aws_credentials),
    refused("environment: RANK without torchrun",
        [],
        r"RANK is set but LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT is not: launch with torchrun",
        env=lambda d: {"RANK": "0"}),
]}


def folder_contents(folder: Path) -> dict[str, bytes | dict]:
    """Every file's bytes, by name; a folder as its own contents."""
    return {p.name: folder_contents(p) if p.is_dir() else p.read_bytes() for p in sorted(folder.iterdir())}


# What a URL mangled into a local path would make: a folder named `s3:` (or `file:`, ...).
URL_LIKE_NAME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")


def url_like_names(folder: Path) -> set[str]:
    return {path.name for path in folder.iterdir() if URL_LIKE_NAME.match(path.name)}


@dataclass
class Prepared:
    """A case's folder, its copy of the trained snapshots (their bytes before the run), where it ran, and the names
    in the project folder that look like a URL, before the run."""

    snaps: Path
    before: dict[str, bytes | dict]
    outcome: Outcome
    project_url_like_before: set[str]


def run_refused(name: str, trained: Path, d: Path) -> Prepared:
    snaps = d / "snaps"
    shutil.copytree(trained, snaps)
    case = CASES[name]
    if case.prepare is not None:  # here, not in run_case: the snapshots' bytes are taken after it, before the run
        case.prepare(d, snaps)
    before, project_before = folder_contents(snaps), url_like_names(PROJECT_DIR)
    outcome = run_case(replace(case, prepare=None), d, snaps)
    return Prepared(snaps, before, outcome, project_before)


@pytest.fixture(scope="module")
def outcomes(request, trained, tmp_path_factory) -> dict[str, Future]:
    """The selected cases, run two at a time (each is mostly a process start-up on one core)."""
    selected = [item.callspec.params["name"] for item in request.session.items
                if item.module.__name__ == __name__ and hasattr(item, "callspec")]
    pool = ThreadPoolExecutor(max_workers=2)
    futures = {name: pool.submit(run_refused, name, trained, tmp_path_factory.mktemp("case")) for name in selected}
    yield futures
    pool.shutdown(wait=True, cancel_futures=True)


@pytest.mark.parametrize("name", [pytest.param(name, id=name, marks=case.marks) for name, case in CASES.items()])
def test_bad_input_is_refused_in_one_line_and_changes_no_snapshot(name, outcomes):
    """run_case checks the exit code and the one error line; here: nothing else changed."""
    prepared = outcomes[name].result()
    outcome = prepared.outcome
    assert folder_contents(prepared.snaps) == prepared.before  # not one snapshot written, removed or changed
    assert not (outcome.folder / "code-ran").exists()  # nothing from a snapshot was executed
    assert not list(outcome.cwd.iterdir())  # nothing written where the command ran (a local `s3:` folder, ...)
    assert url_like_names(PROJECT_DIR) <= prepared.project_url_like_before  # nor in the project folder
