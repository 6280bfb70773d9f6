"""Bad input, one table: every case runs the real CLI and must exit non-zero with ONE readable line naming the
problem (no traceback), and leave the snapshots that were already there byte-for-byte as they were.

A module fixture trains a tiny model once (snapshots at steps 5 and 10); each case gets its own copy of that
snapshot folder, may damage or add files in it, and runs `main.py` (or torchrun, `sample.py`, `snapshot.py info` or
`list`) in an empty folder of its own, which must stay empty: a storage location that looks like a URL is parsed as
one or refused, never turned into a local folder (`s3:`) there or in the project folder.
Cases fail before training starts, so the whole table takes about three minutes on 2 cores.
"""

from __future__ import annotations

import atexit
import json
import os
import random
import re
import shutil
import subprocess
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import pytest
from support import PROJECT_DIR, TINY, assert_ok, cli, free_port, standalone, subprocess_env

from mingpt.checkpoint import store as snap

SNAPSHOTS = [snap.snapshot_name(5), snap.snapshot_name(10)]
SHAKESPEARE = (PROJECT_DIR / "data" / "input.txt").read_text(encoding="utf-8")


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """A snapshot folder written by a short real run of TINY."""
    home = tmp_path_factory.mktemp("trained")
    snaps = home / "snaps"
    result = subprocess.run(
        cli([*TINY, "trainer_config.max_steps=10", "trainer_config.save_every_steps=5",
             "trainer_config.eval_every_steps=10", "trainer_config.eval_batches=1",
             f"trainer_config.snapshot_path={snaps}", f"hydra.run.dir={home / 'run'}"]),
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


def different_vocabulary(d: Path) -> Path:
    """As much text as the fixture's data, with the same number of distinct characters but one of them other."""
    text = SHAKESPEARE[: int(len(SHAKESPEARE) * 0.05)]
    return write(d, "other.txt", text.replace("z", "\u00e9").encode("utf-8"))


def books(d: Path, files: dict[str, str | bytes]) -> Path:
    folder = d / "books"
    folder.mkdir()
    for name, content in files.items():
        write(folder, name, content.encode() if isinstance(content, str) else content)
    return folder


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


@dataclass
class Case:
    """The extra command-line arguments (`{d}`: the case's own folder, `{s}`: its copy of the snapshot folder,
    `{port}`: a port nothing listens on), the regex the one error line must match (after "error: "), what runs, and
    what is set up first: `prepare(d, s)` writes or damages files, `env(d)` changes the environment."""

    args: list[str]
    error: str
    tool: str = "main"  # main | torchrun | sample | info | list
    prepare: Callable[[Path, Path], object] | None = None
    env: Callable[[Path], dict[str, str | None]] = field(default=lambda d: {})

    def arguments(self, d: Path, snaps: Path) -> list[str]:
        return [arg.format(d=d, s=snaps, port=free_port()) for arg in self.args]


# Each case: (what it sets up and passes) -> the one error line it must give.
CASES: dict[str, Case] = {
    # ---- config: fails before Hydra makes a run folder
    "config: unknown key": Case(
        ["gpt_config.nlayer=3"],
        r"Key 'nlayer' not in 'GPTConfig'"),
    "config: +new_key": Case(
        ["+trainer_config.max_epoch=3"],
        r"unknown config key trainer_config\.max_epoch \(known keys: .*max_epochs"),
    "config: wrong type": Case(
        ["trainer_config.max_steps=ten"],
        r"Value 'ten' of type 'str' could not be converted to Integer"),
    "config: dropout out of range": Case(
        ["gpt_config.dropout=1.5"],
        r"gpt_config\.dropout must be in \[0, 1\), got 1\.5"),
    "config: unknown attention implementation": Case(
        ["gpt_config.attention=flash"],
        r"gpt_config\.attention must be one of auto, sdpa, matmul, got 'flash'"),
    "config: unknown strategy": Case(
        ["parallel_config.strategy=zero3"],
        r"parallel_config\.strategy must be one of ddp, fsdp, got 'zero3'"),
    "config: unknown activation checkpointing": Case(
        ["parallel_config.activation_checkpointing=all"],
        r"parallel_config\.activation_checkpointing must be one of none, blocks, got 'all'"),
    "config: zero keep_last": Case(
        ["trainer_config.keep_last=0"],
        r"trainer_config\.keep_last must be positive, got 0"),
    "config: min_lr above learning_rate": Case(
        ["optimizer_config.min_lr=0.01"],
        r"min_lr must be in \[0, learning_rate=0\.003\], got 0\.01"),
    "config: n_embd not divisible by n_head": Case(
        ["gpt_config.n_head=3"],
        r"divisible by gpt_config\.n_head"),
    "config: decay ends before warmup": Case(
        ["optimizer_config.decay_steps=3"],
        r"decay_steps \(3\) must be larger than optimizer_config\.warmup_steps \(5\)"),
    # ---- data: fails before the process group
    "data: missing file": Case(
        ["data_config.path=data/no-such-file.txt"],
        rf"data file not found: {re.escape(str(PROJECT_DIR))}/data/no-such-file\.txt$"),
    "data: empty file": Case(
        ["data_config.path={d}/empty.txt"], prepare=lambda d, s: write(d, "empty.txt", b""),
        error=r"data file .*empty\.txt is empty"),
    "data: shorter than block_size + 1": Case(
        ["data_config.path={d}/short.txt", "data_config.truncate=1.0"],
        prepare=lambda d, s: write(d, "short.txt", SHAKESPEARE[:60].encode()),
        error=r"short\.txt is too short: the validation split has 6 characters but block_size \+ 1 = 33 are needed"),
    "data: not UTF-8": Case(
        ["data_config.path={d}/latin1.txt"],
        prepare=lambda d, s: write(d, "latin1.txt", "café au lait. ".encode("latin-1") * 50),
        error=r"latin1\.txt is not UTF-8 text \(invalid byte at offset 3\)"),
    "data: a glob that matches nothing": Case(
        ["data_config.path={d}/books/*.txt"], prepare=lambda d, s: books(d, {"a.md": SHAKESPEARE[:5000]}),
        error=r"data_config\.path '.*/books/\*\.txt' matches no file$"),
    "data: an unreadable file among many": Case(
        ["data_config.path={d}/books"],
        prepare=lambda d, s: (books(d, {"a.txt": SHAKESPEARE[:5000]}) / "c.txt").symlink_to("/proc/self/mem"),
        error=r"cannot read data file .*/books/c\.txt: OSError: \[Errno \d+\] "),
    "data: invalid UTF-8 in one file of many": Case(
        ["data_config.path={d}/books/*.txt", "data_config.truncate=1.0"],
        prepare=lambda d, s: books(d, {"a.txt": SHAKESPEARE[:5000], "b.txt": "caf\u00e9 au lait".encode("latin-1")}),
        error=r"data file .*/books/b\.txt is not UTF-8 text \(invalid byte at offset 3\)$"),
    "data: no room for the cache": Case(
        ["data_config.cache_dir={d}/small", "data_config.truncate=1.0"], prepare=lambda d, s: small_disk(d / "small"),
        error=r"no room for the data cache in .*/small/input\.txt-\w+ \(the token file and manifest: 1,181,190 bytes "
        r"needed, [\d,]+ free\): free some space or set data_config\.cache_dir"),
    "data: a cache written by a newer version": Case(
        ["data_config.path={d}/t.txt", "data_config.cache_dir={d}/cache", "data_config.truncate=1.0"],
        prepare=lambda d, s: newer_cache(d),
        error=r"the data cache .*/cache/t\.txt-\w+ was written by a newer mingpt-ddp \(format 2; this one reads 1\)"),
    "data: the cache folder is a file": Case(
        ["data_config.cache_dir={d}/cache"], prepare=lambda d, s: write(d, "cache", b"not a folder"),
        error=r"cannot use the data cache folder .*/cache/input\.txt-\w+: .*; set data_config\.cache_dir to a "
        r"writable local folder$"),
    "data: unknown protocol": Case(
        ["data_config.path=nope://bucket/input.txt"],
        r"data_config\.path 'nope://bucket/input\.txt': unknown protocol 'nope' \(fsspec knows s3, "),
    "data: s3 URL with one slash": Case(
        ["data_config.path=s3:/corpus/input.txt"],
        r"data_config\.path 's3:/corpus/input\.txt' is not a complete URL: 's3:' must be followed by '//' "
        r"\(expected s3://BUCKET/PATH\)$"),
    "data: file URL with an empty path": Case(
        ["data_config.path=file://"],
        r"data_config\.path 'file://': no path after 'file://' \(expected file:///ABSOLUTE/PATH\)$"),
    "data: ftp server refusing connections": Case(
        ["data_config.path=ftp://127.0.0.1:{port}/input.txt"],
        r"cannot read data file ftp://127\.0\.0\.1:\d+/input\.txt: ConnectionRefusedError: "),
    "data: http server unreachable": Case(
        ["data_config.path=http://127.0.0.1:{port}/input.txt"],
        r"cannot read data file http://127\.0\.0\.1:\d+/input\.txt: ClientConnectorError: Cannot connect to host"),
    "data: s3 endpoint unreachable": Case(
        ["data_config.path=s3://corpus/input.txt"],
        r"cannot read data file s3://corpus/input\.txt: EndpointConnectionError: Could not connect to the endpoint URL",
        env=unreachable_s3),
    # ---- the snapshot location: a URL is one or an error, never a local folder (issue 17)
    "location: s3:// without a bucket": Case(
        ["trainer_config.snapshot_path=s3://"],
        r"trainer_config.snapshot_path 's3://': no bucket after 's3://' \(expected s3://BUCKET/PATH\)$"),
    "location: s3:/bucket with one slash": Case(
        ["trainer_config.snapshot_path=s3:/bucket/run"],
        r"trainer_config.snapshot_path 's3:/bucket/run' is not a complete URL: 's3:' must be followed by '//'"),
    "location: s3:///x with an empty bucket": Case(
        ["trainer_config.snapshot_path=s3:///run"],
        r"trainer_config.snapshot_path 's3:///run': no bucket after 's3://'"),
    "location: file:// with an empty path": Case(
        ["trainer_config.snapshot_path=file://"],
        r"trainer_config.snapshot_path 'file://': no path after 'file://' \(expected file:///ABSOLUTE/PATH\)$"),
    "location: unknown protocol": Case(
        ["trainer_config.snapshot_path=s4://bucket/run"],
        r"trainer_config.snapshot_path 's4://bucket/run': unknown protocol 's4' \(fsspec knows s3, "),
    "location: ftp store refusing connections": Case(
        ["trainer_config.snapshot_path=ftp://127.0.0.1:{port}/run"],
        r"cannot use snapshot location ftp://127\.0\.0\.1:\d+/run: ConnectionRefusedError: .*Connection refused$"),
    "location: s3:// without a bucket (sample.py)": Case(
        ["snapshot=s3://"],
        r"storage location 's3://': no bucket after 's3://'", tool="sample"),
    "location: s3:/bucket with one slash (sample.py)": Case(
        [f"snapshot=s3:/bucket/run/{SNAPSHOTS[-1]}"],
        r"storage location 's3:/bucket/run/snapshot-000000010\.pt' is not a complete URL", tool="sample"),
    "location: s3:///x with an empty bucket (snapshot.py info)": Case(
        [f"s3:///run/{SNAPSHOTS[-1]}"],
        r"storage location 's3:///run/snapshot-000000010\.pt': no bucket after 's3://'", tool="info"),
    "location: unknown protocol (snapshot.py list)": Case(
        ["s4://bucket/run"],
        r"storage location 's4://bucket/run': unknown protocol 's4'", tool="list"),
    "location: s3:// without a bucket (snapshot.py list)": Case(
        ["s3://"],
        r"storage location 's3://': no bucket after 's3://'", tool="list"),
    "location: missing folder (snapshot.py list)": Case(
        ["{d}/no-such-folder"],
        r"no such snapshot folder: .*/no-such-folder$", tool="list"),
    # ---- snapshots already in the snapshot folder
    "snapshot: every snapshot truncated": Case(
        ["trainer_config.max_steps=20"], prepare=lambda d, s: damage_all(s, lambda b: b[: len(b) // 2]),
        error=r"no readable snapshot in .*: all 2 damaged \(newest: .*snapshot-000000010\.pt: unreadable "
        r"\(RuntimeError: "
        r"PytorchStreamReader failed reading zip archive: failed finding central directory\)\); move them away"),
    "snapshot: random bytes (snapshot.py info)": Case(
        ["{s}/" + SNAPSHOTS[-1]], prepare=lambda d, s: damage_all(s, lambda b: random.Random(len(b)).randbytes(len(b))),
        error=r"snapshot-000000010\.pt: unreadable \(not a snapshot file\)$", tool="info"),
    "snapshot: truncated (sample.py)": Case(
        ["snapshot={s}/" + SNAPSHOTS[-1]], prepare=lambda d, s: damage_all(s, lambda b: b[:4000]),
        error=r"snapshot .*snapshot-000000010\.pt: unreadable \(.*\)$", tool="sample"),
    "snapshot: a folder in the place of the newest snapshot (a store failure during resume)": Case(
        ["trainer_config.max_steps=20"], prepare=lambda d, s: (s / snap.snapshot_name(11)).mkdir(),
        error=r"cannot read snapshot .*/snapshot-000000011\.pt \(1 attempt\(s\) in \d+\.\d s, last error "
        r"IsADirectoryError: "),
    "snapshot: other model shape": Case(
        ["gpt_config.n_embd=64"],
        r"is for a different model: n_embd=32 in the snapshot, 64 in the config"),
    "snapshot: other model shape, resumed under fsdp": Case(
        ["parallel_config.strategy=fsdp", "gpt_config.n_embd=64"],
        r"is for a different model: n_embd=32 in the snapshot, 64 in the config"),
    "snapshot: a damaged folder of shards (snapshot.py info)": Case(
        ["{s}/snapshot-000000011.dcp"], prepare=lambda d, s: broken_shards(s),
        error=r"snapshot-000000011\.dcp: damaged \(snapshot\.json is not JSON\)$", tool="info"),
    "snapshot: other vocabulary": Case(
        ["data_config.path={d}/other.txt", "data_config.truncate=1.0"], prepare=lambda d, s: different_vocabulary(d),
        error=r"has a different vocabulary \(65 characters, this data 59; only in the data: '\u00e9', "
        r"only in the snapshot: '.*z'"),
    "snapshot: newer format version": Case(
        ["trainer_config.max_steps=20"],
        prepare=lambda d, s: craft(s, snap.snapshot_name(11),
                                   lambda x: x.update(format_version=snap.FORMAT_VERSION + 1)),
        error=r"snapshot-000000011\.pt has snapshot format 2, newer than this code understands \(1\)"),
    "snapshot: pickled code": Case(
        ["trainer_config.max_steps=20"],
        prepare=lambda d, s: craft(s, snap.snapshot_name(11), lambda x: x.update(progress=WritesMarker(d / "code-ran")),
                                   recompute_digest=False),
        error=r"refusing to load .*snapshot-000000011\.pt: it references code \(.*exec\), not only data"),
    "snapshot: weights that do not fit its own config (sample.py)": Case(
        ["snapshot={s}/" + snap.snapshot_name(11)],
        prepare=lambda d, s: craft(s, snap.snapshot_name(11), lambda x: x["model_config"].update(n_embd=64, n_head=4)),
        error=r"the snapshot's weights do not match its model config: .*size mismatch", tool="sample"),
    # ---- environment
    "environment: world size does not divide the work": Case(
        ["data_config.path={d}/small.txt", "data_config.truncate=1.0", "trainer_config.batch_size=200"],
        prepare=lambda d, s: write(d, "small.txt", SHAKESPEARE[:400].encode()),
        error=r"an optimizer step needs batch_size x grad_accum_steps x data-parallel ranks = 200 x 1 x 2 windows, "
        r"but the training split has only 328", tool="torchrun"),
    "environment: a misspelled key under torchrun (every rank sees it; printed once)": Case(
        ["trainer_config.max_step=3"], r"Key 'max_step' not in 'TrainerConfig'", tool="torchrun"),
    "environment: a missing data file under torchrun (printed once)": Case(
        ["data_config.path=/no/such/file.txt"], r"data file not found", tool="torchrun"),
    "environment: missing S3 credentials": Case(
        ["trainer_config.snapshot_path=s3://bucket/run1/"],
        r"snapshot location s3://bucket/run1 .*NoCredentialsError: Unable to locate credentials",
        env=no_aws_credentials),
    "environment: RANK without torchrun": Case(
        [],
        r"RANK is set but LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT is not: launch with torchrun",
        env=lambda d: {"RANK": "0"}),
}


def command(case: Case, args: list[str], d: Path, snaps: Path) -> list[str]:
    if case.tool == "sample":
        return cli([*args, "max_new_tokens=5"], script="sample.py")
    if case.tool in ("info", "list"):
        return cli([case.tool, *args], script="snapshot.py")
    return cli([*TINY, "trainer_config.max_steps=10", "trainer_config.progress=off",
                f"trainer_config.snapshot_path={snaps}", f"hydra.run.dir={d / 'run'}", *args],
               standalone(2) if case.tool == "torchrun" else None)


def folder_contents(folder: Path) -> dict[str, bytes | dict]:
    """Every file's bytes, by name; a folder as its own contents."""
    return {p.name: folder_contents(p) if p.is_dir() else p.read_bytes() for p in sorted(folder.iterdir())}


# What a URL mangled into a local path would make: a folder named `s3:` (or `file:`, ...).
URL_LIKE_NAME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")


def url_like_names(folder: Path) -> set[str]:
    return {path.name for path in folder.iterdir() if URL_LIKE_NAME.match(path.name)}


def error_lines(output: str) -> list[str]:
    """`error: ...` lines, with a `[rank N] ` prefix from ranks other than 0."""
    prefixed = re.compile(r"^(\[rank \d+\] )?(?=error: )")
    return [prefixed.sub("", line) for line in output.splitlines() if prefixed.match(line)]


@dataclass
class Outcome:
    result: subprocess.CompletedProcess
    snaps: Path
    before: dict[str, bytes | dict]
    marker: Path
    cwd: Path  # empty before the run
    project_url_like_before: set[str]


def run_case(name: str, trained: Path, d: Path) -> Outcome:
    case = CASES[name]
    snaps = d / "snaps"
    shutil.copytree(trained, snaps)
    if case.prepare is not None:
        case.prepare(d, snaps)
    args = case.arguments(d, snaps)
    before = folder_contents(snaps)
    env = {**subprocess_env(d), **case.env(d)}
    env = {key: value for key, value in env.items() if value is not None}
    cwd = d / "cwd"  # its own folder: TMPDIR (torchrun's files) and the run folder are elsewhere in d
    cwd.mkdir()
    project_before = url_like_names(PROJECT_DIR)
    result = subprocess.run(command(case, args, d, snaps), cwd=cwd, env=env, capture_output=True, text=True,
                            timeout=300)
    return Outcome(result, snaps, before, d / "code-ran", cwd, project_before)


@pytest.fixture(scope="module")
def outcomes(request, trained, tmp_path_factory) -> dict[str, Future]:
    """The selected cases, run two at a time (each is mostly a process start-up on one core)."""
    selected = [item.callspec.params["name"] for item in request.session.items
                if item.module.__name__ == __name__ and hasattr(item, "callspec")]
    pool = ThreadPoolExecutor(max_workers=2)
    futures = {name: pool.submit(run_case, name, trained, tmp_path_factory.mktemp("case")) for name in selected}
    yield futures
    pool.shutdown(wait=True, cancel_futures=True)


@pytest.mark.parametrize("name", CASES)
def test_bad_input_is_refused_in_one_line_and_changes_no_snapshot(name, outcomes):
    case = CASES[name]
    outcome = outcomes[name].result()
    result = outcome.result
    output = result.stdout + result.stderr

    assert result.returncode != 0, output[-3000:]
    errors = error_lines(result.stderr)
    assert errors, output[-3000:]
    assert len(errors) == 1, errors  # under torchrun too: once for the job, not once per rank
    assert re.search(case.error, errors[0].removeprefix("error: ")), errors[0]
    if case.tool == "torchrun":
        # torchrun's own report of a failed worker is a traceback of the launcher; none may come from our code.
        frames = re.findall(r'File "([^"]+)"', output)
        assert not [f for f in frames if f.startswith(str(PROJECT_DIR)) and "/.venv/" not in f], output[-3000:]
        assert result.returncode == 1  # torchrun's code for a failed worker
    else:
        assert "Traceback" not in output, output[-3000:]
        assert [line for line in result.stderr.splitlines() if line.strip()] == errors, result.stderr[-3000:]
        assert result.returncode == 2
    assert folder_contents(outcome.snaps) == outcome.before  # not one snapshot written, removed or changed
    assert not outcome.marker.exists()  # nothing from a snapshot was executed
    assert not list(outcome.cwd.iterdir())  # nothing written where the command ran (a local `s3:` folder, ...)
    assert url_like_names(PROJECT_DIR) <= outcome.project_url_like_before  # nor in the project folder
