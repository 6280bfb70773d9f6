"""Snapshots: what they hold, turning them into bytes and back, atomic writes, finding the newest valid one.

    store = SnapshotStore(resolve_path("snapshots/default"))
    newest = store.entries()[0]                  # the newest valid one (its name holds the step)
    snapshot = read_snapshot(store.url(newest.name))

A snapshot is a `torch.save`d dict of plain Python types and tensors, loaded with `weights_only=True` (a snapshot
is data: it may come from a shared bucket, and loading it never runs code). It holds everything needed to continue
as if the job had never stopped: model weights (unwrapped), optimizer, GradScaler, progress (step, epoch, global
samples consumed in the epoch), the model config and tokenizer (`tokenizer`: its full description, so that a
snapshot alone generates text; snapshots from before it have only `vocab`, their characters), the training config,
the world size, and a format version. Dropout needs no saved RNG state: the trainer reseeds it from (seed, step,
rank) every step.

Storage goes through fsspec: a local folder or any URL (`s3://...` through s3fs). A snapshot is never visible
half-written: locally it is written to a temporary file in the same folder, fsynced and renamed into place; on an
object store it is one object, which appears only when its upload completes. A write that fails is retried with
backoff and then reported in one line; the snapshots already there stay as they are. Knows nothing of the training
loop.
"""

from __future__ import annotations

import datetime
import hashlib
import io
import json
import logging
import os
import pickle
import re
import shutil
import threading
import time
import uuid
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional, TypeVar

import fsspec
import torch
from fsspec.implementations.local import LocalFileSystem

from mingpt.data import tokenizer as tokenizers
from mingpt.errors import CorruptSnapshot, UsageError, describe, first_line, is_permanent  # noqa: F401 (re-exported)
from mingpt.parallel.state import is_dtensor
from mingpt.storage.durable import fsync_folder, temporary_name
from mingpt.storage.locations import check_location, resolve_path

log = logging.getLogger(__name__)
T = TypeVar("T")

# A snapshot is written in the oldest format that holds it, and a reader refuses a newer format than it knows, in one
# line. 1: the character tokenizer, whose `vocab` readers of format 1 use (they ignore `tokenizer`); 2: another
# tokenizer, described only in `tokenizer` (a reader of format 1 would take its ids for characters).
FORMAT_VERSION = 2
CHAR_FORMAT_VERSION = 1
ZIP_MAGIC = b"PK\x03\x04"  # what every torch.save file starts with
NAME_PATTERN = re.compile(r"^snapshot-(\d{9})\.pt$")
SHARDED_SUFFIX = ".dcp"
SHARDED_PATTERN = re.compile(r"^snapshot-(\d{9})\.dcp$")  # a folder of shards (strategy=fsdp): sharded.py
BEST_FILE = "best.json"  # which snapshot has the lowest validation loss (trainer_config.keep_best)
SHAPE_FIELDS = ("n_layer", "n_head", "n_embd", "bias", "vocab_size", "block_size")
# The model options that change its function or parameters, added after the first snapshots were written: a snapshot
# without one was made by GPT-2's choice, which is what its absence means (fixed here: a later change of
# gpt_config's defaults does not change what an old snapshot was trained with). zero_init_proj (only how training
# starts) and attention (the same function either way) are not among them.
OPTION_DEFAULTS = {"positions": "learned", "rope_base": 10000.0, "norm": "layernorm", "activation": "gelu",
                   "qk_norm": False, "tie_embeddings": True, "logit_softcap": None, "bigram_embedding": False}
OPTION_FIELDS = tuple(OPTION_DEFAULTS)
REQUIRED_KEYS = ("format_version", "model", "optimizer", "progress", "model_config", "integrity_sha256")
REQUIRED_TYPES = {"format_version": int, "model": dict, "optimizer": dict, "progress": dict, "model_config": dict,
                  "integrity_sha256": str}

# A save that fails is tried again: a store that is briefly unreachable (an S3 endpoint restarting, a network blip)
# should not cost a snapshot, and one that stays down must not hold up the run for long either (the next periodic
# save tries again anyway). Waits between attempts double: 1, 2, 4 s, so a save gives up after ~7 s plus its attempts.
SAVE_ATTEMPTS = 4
SAVE_FIRST_BACKOFF_S = 1.0
# botocore's default ("legacy", 5 attempts, backoff up to 8 s) spends ~10 s on every request to an endpoint that
# refuses connections, and s3fs probes a bucket with two requests: a store that is down at start took 20 s to
# report. Our own retries cover whole saves, so each request gets fewer attempts (unless the user chose otherwise);
# s3fs's own connect (5 s) and read (15 s) timeouts already bound an attempt on an endpoint that does not answer.
S3_DEFAULT_RETRIES = {"total_max_attempts": 3, "mode": "standard"}
# s3fs uploads an object of two parts or more (parts of this size: s3fs's own default) as a multipart upload. One
# that fails or is killed midway leaves its parts in the bucket, unlisted and billed until aborted: a failed save
# aborts them where s3fs could not, and every completed save aborts those that failed or killed saves left.
S3_PART_BYTES = 50 * 2**20


def _sharded():  # noqa: ANN202 (the module)
    """sharded.py, imported on first use: it imports torch.distributed.checkpoint (about 0.5 s), which a run that
    meets no folder of shards never needs."""
    from mingpt.checkpoint import sharded

    return sharded


def snapshot_name(step: int, sharded: bool = False) -> str:
    return f"snapshot-{step:09d}{SHARDED_SUFFIX if sharded else '.pt'}"


def snapshot_step(name: str) -> Optional[int]:
    """The step of a snapshot's name (a file or a folder of shards); None for other names."""
    match = NAME_PATTERN.match(name) or SHARDED_PATTERN.match(name)
    return int(match.group(1)) if match else None


# --------------------------------------------------------------------------------------------------- digests
def weights_sha256(model_state: dict[str, torch.Tensor]) -> str:
    """SHA-256 over the model's tensors in sorted key order, bytes as stored."""
    digest = hashlib.sha256()
    for key in sorted(model_state):
        digest.update(_tensor_bytes(model_state[key]))
    return digest.hexdigest()


def _tensor_bytes(tensor: torch.Tensor) -> memoryview:
    flat = tensor.detach().cpu().contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy())


def _walk_tensors(obj: Any) -> Iterator[torch.Tensor]:
    """Every tensor in a nest of dicts/lists/tuples, in a deterministic order."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for key in sorted(obj, key=str):
            yield from _walk_tensors(obj[key])
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            yield from _walk_tensors(item)


def integrity_sha256(snapshot: dict) -> str:
    """Digest of every tensor except the digest itself. torch.load does not notice flipped bytes inside tensor
    data; this does."""
    digest = hashlib.sha256()
    for key in sorted(k for k in snapshot if k != "integrity_sha256"):
        for tensor in _walk_tensors(snapshot[key]):
            digest.update(_tensor_bytes(tensor))
    return digest.hexdigest()


def nonfinite_tensors(state: Any, prefix: str = "") -> list[str]:
    """The names (dotted paths) of the floating-point tensors in a nest of dicts/lists that hold a NaN or an
    infinity; a DTensor is checked in its local part (its shard). One host read for the whole nest."""
    named = list(_named_float_tensors(state, prefix))
    by_device: dict[torch.device, list[int]] = {}
    for index, (_, tensor) in enumerate(named):
        by_device.setdefault(tensor.device, []).append(index)
    finite = [True] * len(named)
    for indices in by_device.values():  # one reduction per device (optimizer steps are CPU scalars beside CUDA)
        flags = torch.stack([torch.isfinite(named[i][1]).all() for i in indices]).cpu().tolist()
        for i, ok in zip(indices, flags):
            finite[i] = ok
    return [name for (name, _), ok in zip(named, finite) if not ok]


def _named_float_tensors(obj: Any, prefix: str) -> Iterator[tuple[str, torch.Tensor]]:
    if isinstance(obj, torch.Tensor):
        local = obj.to_local() if hasattr(obj, "to_local") else obj  # a DTensor: this rank's part
        if local.is_floating_point() and local.numel():
            yield prefix, local.detach()
    elif isinstance(obj, dict):
        for key, value in obj.items():
            yield from _named_float_tensors(value, f"{prefix}.{key}" if prefix else str(key))
    elif isinstance(obj, (list, tuple)):
        for index, value in enumerate(obj):
            yield from _named_float_tensors(value, f"{prefix}.{index}" if prefix else str(index))


def describe_nonfinite(names: list[str]) -> str:
    """'model.wte.weight and 3 more' for a one-line message."""
    return names[0] if len(names) == 1 else f"{names[0]} and {len(names) - 1} more"


# --------------------------------------------------------------------------------------------------- tokenizer
def tokenizer_fields(description: dict) -> dict:
    """What a snapshot records of its tokenizer: its description, and for characters their string as `vocab` too
    (what readers of format 1 read)."""
    fields = {"tokenizer": description}
    if description["kind"] == tokenizers.CharTokenizer.kind:
        fields["vocab"] = description["chars"]
    return fields


def format_version_of(snapshot: dict) -> int:
    """The format a snapshot (or a run's metadata) is written in: the oldest that holds its tokenizer."""
    return CHAR_FORMAT_VERSION if tokenizers.is_characters(snapshot) else FORMAT_VERSION


# --------------------------------------------------------------------------------------------------- bytes
def build(state: dict, metadata: dict, world_size: int) -> dict:
    """A complete snapshot from the trainer's state and the run's metadata (model config, tokenizer, train config)."""
    snapshot = {
        "format_version": format_version_of(metadata),
        "created_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "world_size": world_size,
        **metadata,
        **state,
    }
    return seal(snapshot)


def seal(snapshot: dict) -> dict:
    """The digests a single-file snapshot carries: of its weights (`weights_sha256`) and of every tensor."""
    snapshot["weights_sha256"] = weights_sha256(snapshot["model"])
    snapshot["integrity_sha256"] = integrity_sha256(snapshot)
    return snapshot


def to_bytes(snapshot: dict) -> bytes:
    buffer = io.BytesIO()
    torch.save(snapshot, buffer)
    return buffer.getvalue()


def from_bytes(data: bytes, source: str) -> dict:
    """Parse and verify a snapshot. Damaged -> CorruptSnapshot; code or a newer format -> UsageError."""
    if not data.startswith(ZIP_MAGIC):
        # torch.save has written zip archives since 1.6. Anything else would go to torch's legacy pickle reader,
        # whose error for arbitrary bytes is a matter of chance (UnicodeDecodeError, KeyError, IndexError, ...).
        raise CorruptSnapshot(f"{source}: unreadable (not a snapshot file)")
    try:
        with warnings.catch_warnings():  # a damaged archive can make torch warn (e.g. of an odd pickle protocol)
            warnings.simplefilter("ignore")
            snapshot = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        # The weights-only unpickler names the global (a function or class) it refused to import.
        found = re.search(r"GLOBAL ([\w.]+)|([\w.]+) was not an allowed global", str(e))
        if found:
            what = (found.group(1) or found.group(2)).removeprefix("builtins.")  # torch 2.6 names builtins so
            raise UsageError(f"refusing to load {source}: it references code ({what}), not only data") from None
        raise CorruptSnapshot(f"{source}: unreadable (not a snapshot file)") from None
    except Exception as e:  # truncated zip, random bytes, ... (torch raises RuntimeError, EOFError, ...)
        raise CorruptSnapshot(f"{source}: unreadable ({type(e).__name__}: {_first_sentence(e)})") from None
    if not isinstance(snapshot, dict) or any(key not in snapshot for key in REQUIRED_KEYS):
        raise CorruptSnapshot(f"{source}: not a mingpt-ddp snapshot (missing keys)")
    for key, kind in REQUIRED_TYPES.items():  # a file from elsewhere must not crash the checks below
        if not isinstance(snapshot[key], kind) or isinstance(snapshot[key], bool):
            raise CorruptSnapshot(f"{source}: not a mingpt-ddp snapshot ({key} is a {type(snapshot[key]).__name__})")
    if not all(isinstance(value, torch.Tensor) for value in snapshot["model"].values()):
        raise CorruptSnapshot(f"{source}: not a mingpt-ddp snapshot (model holds values that are not tensors)")
    if snapshot["format_version"] > FORMAT_VERSION:
        raise UsageError(
            f"{source} has snapshot format {snapshot['format_version']}, newer than this code understands "
            f"({FORMAT_VERSION}); update mingpt-ddp"
        )
    problem = tokenizers.description_problem(snapshot)
    if problem is not None:
        raise CorruptSnapshot(f"{source}: not a mingpt-ddp snapshot ({problem})")
    if integrity_sha256(snapshot) != snapshot["integrity_sha256"]:
        raise CorruptSnapshot(f"{source}: damaged (tensor checksum mismatch)")
    return snapshot


def _first_sentence(error: BaseException) -> str:
    """torch's errors for damaged files run on with advice about checkpoints; the first sentence says it."""
    line = first_line(error)
    return line.split(". ", 1)[0].rstrip(".") if len(line) > 100 else line


def check_compatible(snapshot: dict, model_config: dict, tokenizer: dict | str, source: str) -> None:
    """A snapshot of another model shape or tokenizer must never be silently trained over (or ignored). `tokenizer`
    is the run's description (a string: the characters, as callers from before tokenizers pass them)."""
    saved = snapshot["model_config"]
    # The tokenizer first: other data changes vocab_size as well, and "different vocabulary" names the cause.
    different = tokenizers.difference(tokenizers.snapshot_tokenizer(snapshot), tokenizer)
    if different is not None:
        raise UsageError(f"snapshot {source} {different}; use another trainer_config.snapshot_path for other data "
                         f"or another tokenizer")
    saved, wanted = with_option_defaults(saved), with_option_defaults(model_config)
    for name in (*SHAPE_FIELDS, *OPTION_FIELDS):
        if saved.get(name) != wanted.get(name):
            raise UsageError(
                f"snapshot {source} is for a different model: {name}={saved.get(name)} in the snapshot, "
                f"{wanted.get(name)} in the config (use another trainer_config.snapshot_path to start afresh)"
            )


def with_option_defaults(model_config: dict) -> dict:
    """A model config with the options it does not name (one from before they existed) at GPT-2's choice."""
    return {**OPTION_DEFAULTS, **model_config}


# --------------------------------------------------------------------------------------------------- storage
@dataclass
class Entry:
    name: str
    step: int

    @property
    def sharded(self) -> bool:
        return self.name.endswith(SHARDED_SUFFIX)


class SnapshotStore:
    """A folder of snapshots at a local path or fsspec URL."""

    def __init__(self, location: str, storage_options: Optional[dict] = None) -> None:
        check_location(location, "snapshot location")  # a malformed URL never becomes a local folder
        stripped = location.rstrip("/")
        self.location = stripped if stripped and not stripped.endswith(":") else location  # file:/// stays a URL
        try:
            options = with_default_retries(self.location, storage_options or {})
            self.fs, self.root = fsspec.core.url_to_fs(self.location, **options)
        except Exception as e:  # a missing package, bad options; a store that connects at once (ftp, sftp) refusing
            raise UsageError(f"cannot use snapshot location {self.location}: {describe(e)}") from None
        self.root = self.root.rstrip("/") or self.root
        self.is_local = isinstance(self.fs, LocalFileSystem)
        self._upload_cleanup_warned = False
        self._writable = False  # check_writable() succeeded once

    def url(self, name: str) -> str:
        return f"{self.location.rstrip('/')}/{name}"

    def _path(self, name: str) -> str:
        return f"{self.root.rstrip('/')}/{name}"

    def size(self, entry: Entry) -> int:
        """The bytes a snapshot takes: its file, or every file of its folder of shards."""
        path = self._path(entry.name)
        return self.fs.du(path, total=True) if entry.sharded else self.fs.size(path)

    def entries(self, missing_ok: bool = True) -> list[Entry]:
        """Snapshots present, newest (highest step) first. A location that does not exist holds none, or is a
        UsageError without `missing_ok`."""
        try:
            names = [path.rstrip("/").rsplit("/", 1)[-1] for path in self.fs.ls(self.root, detail=False)]
        except FileNotFoundError:
            if not missing_ok:
                raise UsageError(f"no such snapshot folder: {self.location}") from None
            return []
        found = [Entry(name, step) for name in names if (step := snapshot_step(name)) is not None]
        if not self.is_local:  # on an object store a folder of shards is complete once its commit file is there
            found = [entry for entry in found if not entry.sharded or self._committed(entry.name)]
        return sorted(found, key=lambda entry: (entry.step, entry.sharded), reverse=True)

    def _committed(self, name: str) -> bool:
        return self.fs.exists(self._path(f"{name}/{_sharded().COMMIT_FILE}"))

    def check_writable(self) -> None:
        """Fail in seconds, before training, if snapshots cannot be written here (checked once per store: the run
        checks before it reads data, the checkpointer before it restores)."""
        if self._writable:
            return
        try:
            if self.is_local:
                self.fs.makedirs(self.root, exist_ok=True)
            else:
                self._check_reachable()
                # Writing through s3fs into a bucket that does not exist silently creates it; refuse instead.
                bucket = self.root.split("/", 1)[0]  # "" for stores of absolute paths (ftp, sftp, memory): none
                if bucket and not self.fs.exists(bucket):
                    raise UsageError(f"snapshot location {self.location}: bucket {bucket!r} does not exist")
            probe = self._path(f".write-check-{uuid.uuid4().hex}")
            self.fs.pipe_file(probe, b"ok")
            self.fs.rm_file(probe)
        except UsageError:
            raise
        except Exception as e:
            raise UsageError(
                f"snapshot location {self.location} is not writable: {describe(e)}"
            ) from None
        self._writable = True

    def _check_reachable(self) -> None:
        """Raise the store's own error if it cannot be reached. `exists()` answers False for an endpoint that is
        down, which would be reported as a missing bucket."""
        try:
            self.fs.ls(self.root, detail=False, refresh=True)
        except FileNotFoundError:
            pass  # the folder (or the bucket: checked next) is not there yet; the store answered
        except Exception as e:
            raise UsageError(
                f"snapshot location {self.location} cannot be reached: {describe(e)}"
            ) from None

    def write(self, name: str, data: bytes) -> None:
        """Make `name` appear complete or not at all."""
        if self.is_local:
            write_local_atomically(self._path(name), data)
        elif not self._speaks_s3:
            self.fs.pipe_file(self._path(name), data)  # an object store commits an object when its upload ends
        else:
            try:
                self.fs.pipe_file(self._path(name), data, chunksize=S3_PART_BYTES)
            except Exception:
                # s3fs aborts a multipart upload that fails, unless the abort fails as well (a lost connection);
                # only data of two parts or more goes up in parts.
                if len(data) >= 2 * S3_PART_BYTES:
                    self._abort_incomplete_uploads_quietly(logging.INFO)
                raise

    @property
    def _speaks_s3(self) -> bool:
        """An S3 store through s3fs (multipart uploads), also under a caching or other wrapper."""
        return callable(getattr(self.fs, "call_s3", None))

    def abort_incomplete_uploads(self) -> list[str]:
        """Abort the multipart uploads of snapshots here that never completed (failed or killed saves) and return
        their keys. S3 keeps such parts, invisible to listings and billed, until they are aborted. Only keys of
        snapshot names directly in this location: its one writer is the only one uploading them, one at a time,
        so none is in flight when this runs. [] for stores other than S3."""
        if not self._speaks_s3:
            return []
        bucket, _, folder = self.root.partition("/")
        prefix = f"{folder}/" if folder else ""
        aborted, page_marker = [], {}
        while True:
            page = self.fs.call_s3("list_multipart_uploads", Bucket=bucket, Prefix=prefix, **page_marker)
            for upload in page.get("Uploads") or []:
                if snapshot_step(upload["Key"][len(prefix):].split("/", 1)[0]) is not None:
                    self.fs.call_s3("abort_multipart_upload", Bucket=bucket, Key=upload["Key"],
                                    UploadId=upload["UploadId"])
                    aborted.append(upload["Key"])
            if not page.get("IsTruncated"):
                return aborted
            page_marker = {"KeyMarker": page["NextKeyMarker"], "UploadIdMarker": page["NextUploadIdMarker"]}

    def _abort_incomplete_uploads_quietly(self, level: int) -> list[str]:
        """`abort_incomplete_uploads`, its failure logged in one line (at `level`; a warning only once per store:
        a store that refuses the listing refuses it at every save) instead of raised."""
        try:
            return self.abort_incomplete_uploads()
        except Exception as e:
            if level < logging.WARNING or not self._upload_cleanup_warned:
                self._upload_cleanup_warned |= level >= logging.WARNING
                log.log(level, "incomplete uploads in %s not aborted (%s); tried again after the next save",
                        self.location, describe(e))
            return []

    def read(self, name: str) -> bytes:
        return self.fs.cat_file(self._path(name))

    def read_entry(self, entry: Entry) -> dict:
        """A snapshot, verified: a file's content, or a folder of shards' snapshot.json with its tensors as
        `["shards"]` (sharded.Shards, loaded on demand). Damage is a CorruptSnapshot; one that is gone a
        FileNotFoundError; a store that fails is tried again (`read_with_retries`)."""
        source = self.url(entry.name)
        if entry.sharded:
            return read_with_retries(f"cannot read snapshot {source}", lambda: _sharded().read(
                self.fs, self.is_local, self._path(entry.name), source))
        data = read_with_retries(f"cannot read snapshot {source}", lambda: self.read(entry.name))
        return from_bytes(data, source)

    def prune(self, keep_last: int, keep: tuple[str, ...] = ()) -> list[str]:
        """Delete all but the newest `keep_last` snapshots, those named in `keep` and the best one (best.json's),
        and what interrupted saves left: local temporary files and folders; folders of shards without their commit
        file; on S3 the incomplete multipart uploads."""
        removed = []
        best = self.best()
        protected = {*keep, *([best["snapshot"]] if best else [])}
        for entry in self.entries()[keep_last:]:
            if entry.name in protected:
                continue
            self._remove(entry.name)
            removed.append(entry.name)
        if self.is_local and os.path.isdir(self.root):
            for name in os.listdir(self.root):
                if name.startswith(".snapshot-") and ".tmp-" in name and f".tmp-{os.getpid()}-" not in name:
                    self._remove(name)
        elif not self.is_local:
            for name in self._incomplete_sharded():
                self._remove(name)
                removed.append(f"the incomplete {name}")
        for key in self._abort_incomplete_uploads_quietly(logging.WARNING):
            removed.append(f"the incomplete upload of {key.rsplit('/', 1)[-1]}")
        return removed

    # ----------------------------------------------------------------------------------------- the best one
    def mark_best(self, name: str, step: int, val_loss: float) -> None:
        """Record the complete snapshot `name` as the one with the lowest validation loss so far: best.json, which
        readers see whole or not at all (a local file renamed into place; one object on a store)."""
        record = json.dumps({"snapshot": name, "step": step, "val_loss": val_loss}).encode()
        if self.is_local:
            write_local_atomically(self._path(BEST_FILE), record)
        else:
            self.fs.pipe_file(self._path(BEST_FILE), record)

    def best(self) -> Optional[dict]:
        """best.json's record ({"snapshot", "step", "val_loss"}), or None where there is none; one that cannot be
        read is reported in one line and taken as none (the snapshots themselves are unharmed)."""
        try:
            record = json.loads(self.fs.cat_file(self._path(BEST_FILE)))
        except FileNotFoundError:
            return None
        except Exception as e:  # damaged, unreadable
            log.warning("ignoring %s: %s", self.url(BEST_FILE), describe(e))
            return None
        if not isinstance(record, dict) or snapshot_step(str(record.get("snapshot", ""))) is None:
            log.warning("ignoring %s: it names no snapshot", self.url(BEST_FILE))
            return None
        return record

    def best_entry(self) -> Optional[Entry]:
        """The snapshot best.json names, if it is still there."""
        record = self.best()
        if record is None:
            return None
        return next((entry for entry in self.entries() if entry.name == record["snapshot"]), None)

    def _remove(self, name: str) -> None:
        path = self._path(name)
        if self.is_local and os.path.isdir(path):
            shutil.rmtree(path)
        elif self.is_local:
            os.remove(path)
        elif name.endswith(SHARDED_SUFFIX):
            self.fs.rm(path, recursive=True)
        else:
            self.fs.rm_file(path)

    def _incomplete_sharded(self) -> list[str]:
        """Folders of shards on an object store whose save never committed (killed or failed)."""
        try:
            names = [path.rstrip("/").rsplit("/", 1)[-1] for path in self.fs.ls(self.root, detail=False, refresh=True)]
        except FileNotFoundError:
            return []
        return [name for name in names if SHARDED_PATTERN.match(name) and not self._committed(name)]

    # ----------------------------------------------------------------------------------------- sharded saves
    def begin_sharded(self, name: str) -> str:
        """Where the ranks write the shards of snapshot `name`: locally a new hidden folder beside it (renamed into
        place by `commit_sharded`); on an object store the snapshot's own folder, emptied of what an interrupted
        save of the same step left."""
        if self.is_local:
            path = self._path(temporary_name(name))
            os.makedirs(path)
            return path
        path = self._path(name)
        if self.fs.exists(path):
            self.fs.rm(path, recursive=True)
        return path

    def discard_sharded(self, written: str) -> None:
        """What a failed sharded save wrote (`begin_sharded`'s folder), removed; a failure here is left to prune."""
        try:
            if self.is_local:
                shutil.rmtree(written, ignore_errors=True)
            elif self.fs.exists(written):
                self.fs.rm(written, recursive=True)
        except Exception as e:
            log.info("the shards of a failed save in %s are left for the next save to remove: %s", written,
                     describe(e))

    def commit_sharded(self, name: str, written: str, doc: dict) -> None:
        """Make a sharded snapshot whose shards are all `written` visible: its snapshot.json goes last."""
        if self.is_local:
            _sharded().commit_local(self.root, written, self._path(name), doc)
        else:
            self.fs.pipe_file(f"{written}/{_sharded().COMMIT_FILE}", json.dumps(doc).encode())

    def load_newest_valid(
        self, model_config: Optional[dict] = None, tokenizer: Optional[dict | str] = None
    ) -> Optional[tuple[Entry, dict]]:
        """The newest snapshot that reads back intact and finite; damaged and non-finite ones are reported in one
        line each and skipped.

        With `model_config` and `tokenizer` (a description; a string: characters), one of another model shape or
        tokenizer is an error, not skipped; so
        are a newer format and pickled code. Snapshots that are all damaged (or not finite) are an error too:
        starting afresh would overwrite them (and prune them) and throw away whatever could still be recovered.
        A store that fails to list or read is tried again as a failed save is (`read_with_retries`), then is a
        UsageError in one line.
        """
        damaged, diverged = [], []
        for entry in read_with_retries(f"cannot list the snapshots in {self.location}", self.entries):
            source = self.url(entry.name)
            try:
                snapshot = self.read_entry(entry)
            except FileNotFoundError:  # removed since the listing (pruned by a writer): the next older one
                log.warning("skipping snapshot %s: it is gone", source)
                continue
            except CorruptSnapshot as e:
                log.warning("skipping snapshot %s", e)
                damaged.append(str(e))
                continue
            if model_config is not None and tokenizer is not None:
                check_compatible(snapshot, model_config, tokenizer, source)
            # A diverged run's (written before snapshots were checked): resuming it would train NaN forever. Folders
            # of shards were checked on every rank when written.
            not_finite = [] if entry.sharded else nonfinite_tensors({"model": snapshot["model"],
                                                                     "optimizer": snapshot["optimizer"]})
            if not_finite:
                log.warning("skipping snapshot %s: %s is not finite (a diverged run's)", source,
                            describe_nonfinite(not_finite))
                diverged.append(source)
                continue
            return entry, snapshot
        if damaged or diverged:
            what = (f"all {len(damaged)} damaged (newest: {damaged[0]})" if not diverged else
                    f"{len(damaged)} damaged, {len(diverged)} not finite (newest: {diverged[0]})")
            raise UsageError(f"no readable snapshot in {self.location}: {what}; move them away to start afresh, or "
                             f"use another trainer_config.snapshot_path")
        return None


def write_local_atomically(path: str, data: bytes) -> None:
    """Write a file so that readers see the old one or the new one, never a part (durable once it returns)."""
    folder = os.path.dirname(path)
    os.makedirs(folder, exist_ok=True)
    temporary = os.path.join(folder, temporary_name(os.path.basename(path)))
    try:
        with open(temporary, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temporary, path)  # atomic on POSIX: readers see the old or the new file, never a part
    except BaseException:
        if os.path.exists(temporary):
            os.remove(temporary)
        raise
    fsync_folder(folder)  # make the rename itself durable


def prune_quietly(store: SnapshotStore, keep_last: int, keep: tuple[str, ...] = ()) -> str:
    """Remove old snapshots once a new one is complete (not those named in `keep`, nor the best); a failure here
    loses nothing (tried again next save). Returns what to add to the "saved" line."""
    try:
        removed = store.prune(keep_last, keep)
    except Exception as e:
        log.warning("old snapshots in %s not removed: %s", store.location, describe(e))
        return ""
    return f"; removed {', '.join(removed)}" if removed else ""


def with_retries(action: Callable[[], T], what: str, interrupted: Callable[[float], Optional[str]],
                 passthrough: tuple[type[BaseException], ...] = ()) -> tuple[Optional[T], int, Optional[str]]:
    """The retry policy of saves and reads: an error that another attempt may fix (a store briefly down, a dropped
    connection) is tried again after 1, 2, 4 s (SAVE_ATTEMPTS, SAVE_FIRST_BACKOFF_S); one that it cannot
    (`is_permanent`) is not. `interrupted(delay)` waits, and returns why to stop early (None: go on);
    `passthrough` errors are raised as they are. Returns (result, attempts, None), or (None, attempts, the last
    error in one line)."""
    attempt = 0
    while True:
        attempt += 1
        try:
            return action(), attempt, None
        except passthrough:
            raise
        except Exception as e:
            failure, permanent = describe(e), is_permanent(e)
        if permanent or attempt >= SAVE_ATTEMPTS:
            return None, attempt, failure
        delay = SAVE_FIRST_BACKOFF_S * 2 ** (attempt - 1)
        log.info("%s: attempt %d of %d failed (%s); retrying in %.0f s", what, attempt, SAVE_ATTEMPTS, failure, delay)
        reason = interrupted(delay)
        if reason is not None:
            return None, attempt, f"{failure}; {reason}"


def read_with_retries(what: str, read: Callable[[], T]) -> T:
    """`read()` under `with_retries`; its final failure is a UsageError: `what (N attempt(s) in T s, last error
    ...)`. FileNotFoundError is left to the caller (nothing there is an answer, not a failure)."""
    start = time.perf_counter()
    result, attempts, failure = with_retries(read, what, interrupted=_sleep,
                                             passthrough=(FileNotFoundError, UsageError, CorruptSnapshot))
    if failure is not None:
        raise UsageError(f"{what} ({attempts} attempt(s) in {time.perf_counter() - start:.1f} s, "
                         f"last error {failure})")
    return result


def _sleep(delay: float) -> Optional[str]:
    time.sleep(delay)
    return None


def with_default_retries(location: str, options: dict) -> dict:
    """`options` plus bounded request retries for S3 (see S3_DEFAULT_RETRIES); whatever the user set wins: the
    option itself, fsspec's config for s3, AWS_MAX_ATTEMPTS / AWS_RETRY_MODE, or the AWS config file's profile."""
    protocol = fsspec.utils.get_protocol(location)
    if protocol not in ("s3", "s3a"):
        return options
    # An explicit config_kwargs replaces fsspec.config's one wholesale, so start from it.
    configured = fsspec.config.conf.get(protocol, {}).get("config_kwargs") or {}
    config_kwargs = {**configured, **(options.get("config_kwargs") or {})}
    if "retries" in config_kwargs or _aws_retries_configured(options.get("profile")):
        return options
    return {**options, "config_kwargs": {**config_kwargs, "retries": dict(S3_DEFAULT_RETRIES)}}


def _aws_retries_configured(profile: Optional[str]) -> bool:
    if "AWS_MAX_ATTEMPTS" in os.environ or "AWS_RETRY_MODE" in os.environ:
        return True
    try:
        import botocore.session

        scoped = botocore.session.Session(profile=profile).get_scoped_config()
    except Exception:  # no botocore, or a profile that does not exist: s3fs reports that itself
        return False
    return "max_attempts" in scoped or "retry_mode" in scoped


class BackgroundWriter:
    """Serialises, checksums and writes snapshots on a background thread, so training is blocked at most for
    starting the copy of its state into host memory (`HostStaging`). One write at a time: a new one first waits for
    the previous one. A failed write is retried with backoff, then reported in one line; training goes on and the
    next save tries again."""

    def __init__(self, store: SnapshotStore, keep_last: int) -> None:
        self.store = store
        self.keep_last = keep_last
        self._thread: Optional[threading.Thread] = None
        self._error: Optional[str] = None
        self._superseded = threading.Event()  # set: a failing save stops retrying, a newer one replaces it
        self.newest_saved: Optional[str] = None  # the newest snapshot this writer completed

    def make_room(self) -> None:
        """Before the next save: a save still waiting to retry is given up, so training does not wait out its
        backoff (the next one is newer); an attempt in flight is waited for (one write at a time, and a healthy slow
        store is never cut short). Afterwards nothing reads the previous state's host buffers."""
        self._superseded.set()
        self.wait(raise_error=False)
        self._superseded.clear()

    def submit(self, name: str, state: dict | StagedState, metadata: dict, world_size: int, reason: str,
               after_commit: Optional[Callable[[], str]] = None) -> None:
        """`state` is a private host copy, or one on its way (`HostStaging.stage`, waited for on the writer's
        thread): training goes on changing the live tensors. `after_commit` runs once the snapshot is complete
        (marks, retention) and returns what to add to its "saved" line; by default the older snapshots beyond
        keep_last are pruned. The previous save is given up or waited for first (`make_room`)."""
        self.make_room()
        after_commit = after_commit or (lambda: prune_quietly(self.store, self.keep_last, keep=(name,)))
        self._thread = threading.Thread(target=self._write, args=(name, state, metadata, world_size, reason,
                                                                   after_commit), name="snapshot-writer", daemon=True)
        self._thread.start()

    def _write(self, name: str, state: dict | StagedState, metadata: dict, world_size: int, reason: str,
               after_commit: Callable[[], str]) -> None:
        start = time.perf_counter()
        url = self.store.url(name)
        try:
            data = to_bytes(build(host_copy(state), metadata, world_size))
        except Exception as e:
            self._fail(f"snapshot {url} could not be written: {describe(e)}")
            return
        attempts, failure = self._store_with_retries(name, data)
        if failure is not None:
            kept = f"{self.newest_saved} stays the newest" if self.newest_saved else "older snapshots are unchanged"
            self._fail(f"snapshot {url} not saved ({attempts} attempt(s) in {time.perf_counter() - start:.1f} s, "
                       f"last error {failure}); {kept}")
            return
        self._error = None
        self.newest_saved = name
        retried = f", {attempts} attempts" if attempts > 1 else ""
        log.info("snapshot %s saved (%s, %.2f s in the background%s)%s", url, reason,
                 time.perf_counter() - start, retried, after_commit())

    def _fail(self, message: str) -> None:
        """One line, no traceback: the run goes on with the previous snapshot; wait() turns it into an error."""
        self._error = message
        log.warning(message)

    def _store_with_retries(self, name: str, data: bytes) -> tuple[int, Optional[str]]:
        """Write with exponential backoff. Returns (attempts made, None or the last error in one line)."""
        _, attempts, failure = with_retries(lambda: self.store.write(name, data), f"snapshot {self.store.url(name)}",
                                            interrupted=self._given_up)
        return attempts, failure

    def _given_up(self, delay: float) -> Optional[str]:
        """Wait before the next attempt, unless a newer snapshot replaces this one."""
        return "given up for a newer snapshot" if self._superseded.wait(delay) else None

    def wait(self, raise_error: bool = True) -> None:
        """Block until the current write is done, retries included; with raise_error, a failed write becomes a
        UsageError (one line for the user, non-zero exit)."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if raise_error and self._error is not None:
            error, self._error = self._error, None
            raise UsageError(error)


def cpu_copy(obj: Any) -> Any:
    """A private CPU copy of every tensor in a nest of dicts/lists (other values are kept as they are), in fresh
    memory, made now: a state kept aside (a run's starting point). Snapshots go through `HostStaging`. A DTensor
    (a shard) stays a DTensor of the same layout: what DCP saves."""
    if isinstance(obj, torch.Tensor):  # a DTensor keeps its layout, its local part copied to the CPU (as torch's
        # own checkpoint staging does, torch/distributed/_state_dict_utils.py): DTensor.from_local would move it back
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {key: cpu_copy(value) for key, value in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(cpu_copy(value) for value in obj)
    return obj


# A CPU tensor of at least this many bytes is copied on the staging thread, beside the next forward and backward
# pass; a smaller one (AdamW's step counts, a bias) at once: microseconds, less than handing it over costs.
BACKGROUND_COPY_BYTES = 64 * 2**10


def copy_tensors(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """(host buffer, live tensor) pairs, copied in order. On the staging thread aten's copy releases the GIL, so
    the training thread runs meanwhile."""
    with torch.no_grad():  # grad mode is per thread: a parameter's copy must not join the autograd graph
        for buffer, live in pairs:
            buffer.copy_(live)


class StagedState:
    """A state on its way into host memory (`HostStaging.stage`) and the copy's one synchronisation point: the
    training thread calls `done_reading()` before anything changes the live tensors in place, the writer thread
    `result()` before it serialises the copy."""

    def __init__(self, state: Any, gpu_copied: Optional[list[tuple[torch.device, Any]]] = None,
                 background: Optional[list[tuple[torch.Tensor, torch.Tensor]]] = None) -> None:
        self._state = state
        self._gpu_copied = gpu_copied or []  # (device, CUDA event recorded after its device-to-host copies)
        self._error: Optional[BaseException] = None
        self._copying: Optional[threading.Thread] = None
        if background:
            self._copying = threading.Thread(target=self._copy, args=(background,), name="snapshot-staging",
                                             daemon=True)
            self._copying.start()

    def _copy(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        try:
            copy_tensors(pairs)
        except BaseException as e:  # reported by the writer as the save's failure, never a silent end of the thread
            self._error = e

    def done_reading(self) -> float:
        """On the training thread, before the live tensors change in place (an optimizer step, a load): block until
        the copy has read them. A CPU copy on the staging thread is waited for; copies from a GPU need no wait, as
        every later kernel of the stream they were queued on (the optimizer's update included) runs after them.
        Returns the seconds waited."""
        if self._copying is None:
            return 0.0
        start = time.perf_counter()
        self._copying.join()
        return time.perf_counter() - start

    def result(self) -> Any:
        """On the writer thread: the host copy, complete (the staging thread joined, the GPU copies' events
        synchronised). Raises what failed while copying."""
        if self._copying is not None:
            self._copying.join()
        for device, event in self._gpu_copied:
            with torch.cuda.device(device):  # a new thread's current device is GPU 0: no context made there
                event.synchronize()
        if self._error is not None:
            raise self._error
        return self._state


def host_copy(state: dict | StagedState) -> dict:
    """What a writer serialises: a staged state once its copy is complete, or a private host copy as it is."""
    return state.result() if isinstance(state, StagedState) else state


class HostStaging:
    """Private host copies of a state's tensors for the background writers, in buffers allocated at the first save
    and reused by the next ones (a tensor whose shape, strides, dtype, device or DTensor layout changed gets a new
    one). It is torch's own cached staging (torch/distributed/checkpoint/staging.py, BlockingAsyncStager with
    cache_staged_state_dict: `_create_cpu_state_dict(pin_memory=True)` once, then `_copy_state_dict` into it,
    torch/distributed/_state_dict_utils.py), with every large copy left asynchronous:

    - a tensor on a GPU: `copy_(non_blocking=True)` into pinned memory on the current (training) stream, one CUDA
      event recorded after the copies, synchronised by the writer thread. The training thread never waits: the
      optimizer's in-place update is queued later on the same stream. (torch's DefaultStager copies on a stream of
      its own instead, which needs a wait before the next update.)
    - a CPU tensor of BACKGROUND_COPY_BYTES or more: copied on a staging thread while the next forward and backward
      pass run; `StagedState.done_reading()` is the wait before the next update or load.
    - a smaller CPU tensor, or one on another device: copied at once. Values that are not tensors are kept as they
      are, the dicts, lists and tuples around them rebuilt.

    A DTensor (an FSDP or tensor-parallel shard) stays a DTensor of the same layout whose local part is the host
    buffer: what DCP saves. Its buffer is `torch.empty_like(dtensor, device="cpu", ...)`, which DTensor's dispatch
    runs on the local part alone, keeping the spec (as `_create_cpu_state_dict` keeps it through `.to("cpu")`;
    `DTensor.from_local` would move the buffer back to the mesh's device); the copy goes between the local parts, as
    `_copy_state_dict` copies `_local_tensor`s."""

    def __init__(self) -> None:
        self._buffers: dict[tuple, tuple[tuple, torch.Tensor]] = {}  # path in the state -> (what it fits, buffer)

    def stage(self, state: Any) -> StagedState:
        """On the training thread, with the state as it is now; copies are queued (GPU), started (CPU, large) or
        done (the rest). Nothing may read the previous staged state any more: its buffers are reused."""
        buffers: dict[tuple, tuple[tuple, torch.Tensor]] = {}
        background: list[tuple[torch.Tensor, torch.Tensor]] = []
        gpus: set[torch.device] = set()
        with torch.no_grad():
            copy = self._stage(state, (), buffers, background, gpus)
            events = []
            for device in sorted(gpus, key=str):
                event = torch.cuda.Event()
                event.record(torch.cuda.current_stream(device))  # after this stream's copies, before its next kernels
                events.append((device, event))
        self._buffers = buffers  # buffers of tensors the state no longer holds are freed
        return StagedState(copy, events, background)

    def _stage(self, obj: Any, path: tuple, buffers: dict, background: list, gpus: set) -> Any:
        if isinstance(obj, torch.Tensor):
            buffer = self._buffer(obj, path, buffers)
            host, live = _local_part(buffer), _local_part(obj)
            if live.device.type == "cuda":
                host.copy_(live, non_blocking=True)
                gpus.add(live.device)
            elif live.device.type == "cpu" and live.numel() * live.element_size() >= BACKGROUND_COPY_BYTES:
                background.append((host, live))
            else:
                host.copy_(live)
            return buffer
        if isinstance(obj, dict):
            return {key: self._stage(value, (*path, key), buffers, background, gpus) for key, value in obj.items()}
        if isinstance(obj, (list, tuple)):
            return type(obj)(self._stage(value, (*path, index), buffers, background, gpus)
                             for index, value in enumerate(obj))
        return obj

    def _buffer(self, live: torch.Tensor, path: tuple, buffers: dict) -> torch.Tensor:
        """The buffer at `path` of the previous save if it fits `live`, else a new one."""
        fits = _buffer_key(live)
        kept = self._buffers.get(path)
        buffer = kept[1] if kept is not None and kept[0] == fits else _new_buffer(live)
        buffers[path] = (fits, buffer)
        return buffer


def _local_part(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's local part (with grad mode off, its own `_local_tensor`: writing it writes the DTensor), or the
    tensor itself."""
    return tensor.to_local() if is_dtensor(tensor) else tensor


def _buffer_key(live: torch.Tensor) -> tuple:
    """What a host buffer must match to be reused for `live`."""
    local = _local_part(live)
    key = (tuple(local.shape), local.stride(), local.dtype, local.device.type)
    if is_dtensor(live):
        key += (tuple(live.shape), live.stride(), tuple(live.placements), live.device_mesh)
    return key


def _new_buffer(live: torch.Tensor) -> torch.Tensor:
    """Host memory for `live`'s copy, its strides kept; pinned where `live` is on a GPU, so that the copy is
    asynchronous (an empty tensor has nothing to pin, and pinning it fails). A DTensor gets a DTensor of its layout."""
    local = _local_part(live)
    pinned = local.device.type == "cuda" and local.numel() > 0
    return torch.empty_like(live, device="cpu", pin_memory=pinned)


# --------------------------------------------------------------------------------------------------- CLI
def model_tensors(snapshot: dict) -> dict[str, torch.Tensor]:
    """The model's full tensors of a verified snapshot of either kind (sharded ones are read now, in this process)."""
    return snapshot["shards"].full("model.") if "shards" in snapshot else snapshot["model"]


def _tied(snapshot: dict) -> bool:
    """Whether the snapshot's output head is its token embedding (its state dict names the one tensor twice)."""
    return with_option_defaults(snapshot["model_config"])["tie_embeddings"]


def summary(snapshot: dict) -> dict:
    """The same fields for both kinds; weights_sha256 is always over the full tensors."""
    progress, model = snapshot["progress"], model_tensors(snapshot)
    second_names = {"lm_head.weight"} if _tied(snapshot) else set()  # the tied matrix, counted once
    return {
        "format_version": snapshot["format_version"],
        "format": "sharded" if "shards" in snapshot else "file",
        "strategy": snapshot.get("strategy", "ddp"),
        "layout": snapshot.get("layout", snapshot.get("strategy", "ddp")),  # "pp 2 x dp_replicate 2" on a mesh
        "epoch": progress["epoch"],
        "step": progress["step"],
        "epoch_samples": progress["epoch_samples"],
        "world_size": snapshot["world_size"],
        "n_params": sum(t.numel() for k, t in model.items() if k not in second_names),
        "vocab_size": tokenizers.tokenizer_size(tokenizers.snapshot_tokenizer(snapshot)),
        "tokenizer": tokenizers.snapshot_tokenizer(snapshot)["kind"],
        "val_loss": progress.get("val_loss"),
        "created_at": snapshot["created_at"],
        "weights_sha256": weights_sha256(model),
        "model_config": snapshot["model_config"],
    }


def read_snapshot(path_or_url: str, storage_options: Optional[dict] = None) -> dict:
    """One snapshot, a file or a folder of shards (relative paths = to the project), verified; a missing one is a
    UsageError."""
    url = resolve_path(path_or_url).rstrip("/")
    last = url.rsplit("::", 1)[-1]  # of a chained URL, the part that names the file
    if "://" in last and "/" not in last.split("://", 1)[1]:
        raise UsageError(f"{url} names a bucket or host, not a snapshot (.../snapshot-NNNNNNNNN.pt or .dcp)")
    location, _, name = url.rpartition("/")
    try:
        store = SnapshotStore(location or "/", storage_options)
        sharded = name.endswith(SHARDED_SUFFIX) or store.fs.isdir(store._path(name))
        if sharded and not name.endswith(SHARDED_SUFFIX) and SnapshotStore(url, storage_options).entries():
            raise UsageError(f"{url} is a folder of snapshots, not one snapshot (snapshot.py list {url} shows them)")
        if sharded:
            return _sharded().read(store.fs, store.is_local, store._path(name), url)
        data = store.read(name)
    except FileNotFoundError:
        raise UsageError(f"no such snapshot: {url}") from None
    except (UsageError, CorruptSnapshot):
        raise
    except Exception as e:  # no permission, no credentials, an unreachable store, ...
        raise UsageError(f"cannot read snapshot {url}: {describe(e)}") from None
    return from_bytes(data, url)


def best_snapshot_url(location: str, storage_options: Optional[dict] = None) -> str:
    """The URL of the snapshot with the lowest validation loss in folder `location` (best.json's, which runs with
    trainer_config.keep_best write); a UsageError where none is marked."""
    store = SnapshotStore(resolve_path(location), storage_options)
    try:
        entry = store.best_entry()
    except Exception as e:  # no permission, no credentials, an unreachable store, ...
        raise UsageError(f"cannot read {store.url(BEST_FILE)}: {describe(e)}") from None
    if entry is None:
        raise UsageError(f"no best snapshot in {store.location}: none is marked there (a run with "
                         f"trainer_config.keep_best=true marks the one of the lowest validation loss in {BEST_FILE})")
    return store.url(entry.name)


def single_file(snapshot: dict) -> dict:
    """A verified snapshot of either kind as a single-file snapshot (full tensors), its digests renewed."""
    if "shards" not in snapshot:
        return snapshot
    return seal({**_sharded().full_state(snapshot), "format_version": format_version_of(snapshot)})


def consolidate(source: str, target: str) -> str:
    """Write snapshot `source` (either kind) as one file at `target`: a file name, or a folder (then it keeps the
    snapshot's name, .pt). Returns where it went."""
    snapshot = single_file(read_snapshot(source))
    location, _, name = resolve_path(target).rstrip("/").rpartition("/")
    if not name.endswith(".pt"):
        location, name = resolve_path(target).rstrip("/"), snapshot_name(snapshot["progress"]["step"])
    store = SnapshotStore(location or "/")
    write_output(store, name, to_bytes(snapshot))
    return store.url(name)


def write_output(store: SnapshotStore, name: str, data: bytes) -> None:
    """A tool's output file; a location it cannot be written to is one line."""
    try:
        store.write(name, data)
    except Exception as e:  # a file where a folder should be, no permission, a full disk, ...
        raise UsageError(f"cannot write {store.url(name)}: {describe(e)}") from None


def export(source: str, target: str) -> str:
    """The weights of snapshot `source` (either kind) as `model.safetensors` in folder `target`, and beside them
    `config.json` (model config, vocabulary, the tied weights, where they come from). safetensors holds no code and
    no shared tensors: the output head, which is the token embedding, is stored once."""
    from safetensors.torch import save as safetensors_bytes

    snapshot = read_snapshot(source)
    model = {name: tensor.contiguous() for name, tensor in model_tensors(snapshot).items()}
    tied = {}
    if _tied(snapshot) and "lm_head.weight" in model and torch.equal(model["lm_head.weight"],
                                                                      model["transformer.wte.weight"]):
        tied["lm_head.weight"] = "transformer.wte.weight"
    stored = {name: tensor for name, tensor in model.items() if name not in tied}
    config = {"format": "mingpt-ddp safetensors export", "format_version": 1, "model_config": snapshot["model_config"],
              **tokenizer_fields(tokenizers.snapshot_tokenizer(snapshot)), "tied_weights": tied,
              "step": snapshot["progress"]["step"],
              "val_loss": snapshot["progress"].get("val_loss"), "weights_sha256": weights_sha256(model),
              "source": resolve_path(source)}
    store = SnapshotStore(resolve_path(target))
    write_output(store, "model.safetensors", safetensors_bytes(stored, metadata={"format": "pt"}))
    write_output(store, "config.json", json.dumps(config, indent=1).encode())
    return store.location
