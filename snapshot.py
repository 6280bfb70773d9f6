"""Snapshots: what they hold, turning them into bytes and back, atomic writes, finding the newest valid one.

    python snapshot.py info snapshots/default/snapshot-000002000.pt      # one JSON object (relative = project)
    python snapshot.py info s3://bucket/run1/snapshot-000002000.pt
    python snapshot.py list s3://bucket/run1/                            # the snapshots there, newest first

A snapshot is a `torch.save`d dict of plain Python types and tensors, loaded with `weights_only=True` (a snapshot
is data: it may come from a shared bucket, and loading it never runs code). It holds everything needed to continue
as if the job had never stopped: model weights (unwrapped), optimizer, GradScaler, progress (step, epoch, global
samples consumed in the epoch), the model config and vocabulary, the training config, the world size, and a format
version. Dropout needs no saved RNG state: the trainer reseeds it from (seed, step, rank) every step.

Storage goes through fsspec: a local folder or any URL (`s3://...` through s3fs). A snapshot is never visible
half-written: locally it is written to a temporary file in the same folder, fsynced and renamed into place; on an
object store it is one object, which appears only when its upload completes. Knows nothing of the training loop.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import io
import json
import logging
import os
import pickle
import re
import sys
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any, Iterator, Optional

import fsspec
import torch
from fsspec.implementations.local import LocalFileSystem

from char_dataset import resolve_path
from errors import UsageError

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
NAME_PATTERN = re.compile(r"^snapshot-(\d{9})\.pt$")
SHAPE_FIELDS = ("n_layer", "n_head", "n_embd", "bias", "vocab_size", "block_size")
REQUIRED_KEYS = ("format_version", "model", "optimizer", "progress", "model_config", "vocab", "integrity_sha256")


class CorruptSnapshot(Exception):
    """A snapshot that cannot be read back as written (truncated, damaged, not a snapshot at all)."""


def snapshot_name(step: int) -> str:
    return f"snapshot-{step:09d}.pt"


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


# --------------------------------------------------------------------------------------------------- bytes
def build(state: dict, metadata: dict, world_size: int) -> dict:
    """A complete snapshot from the trainer's state and the run's metadata (model config, vocab, train config)."""
    snapshot = {
        "format_version": FORMAT_VERSION,
        "created_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "world_size": world_size,
        **metadata,
        **state,
    }
    snapshot["weights_sha256"] = weights_sha256(snapshot["model"])
    snapshot["integrity_sha256"] = integrity_sha256(snapshot)
    return snapshot


def to_bytes(snapshot: dict) -> bytes:
    buffer = io.BytesIO()
    torch.save(snapshot, buffer)
    return buffer.getvalue()


def from_bytes(data: bytes, source: str) -> dict:
    """Parse and verify a snapshot. Damaged -> CorruptSnapshot; code or a newer format -> UsageError."""
    try:
        snapshot = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        # The weights-only unpickler names the global (a function or class) it refused to import.
        found = re.search(r"GLOBAL ([\w.]+)|([\w.]+) was not an allowed global", str(e))
        if found:
            what = found.group(1) or found.group(2)
            raise UsageError(f"refusing to load {source}: it references code ({what}), not only data") from None
        raise CorruptSnapshot(f"{source}: unreadable (not a snapshot file)") from None
    except Exception as e:  # truncated zip, random bytes, ... (torch raises RuntimeError, EOFError, ...)
        raise CorruptSnapshot(f"{source}: unreadable ({type(e).__name__}: {_first_line(e)})") from None
    if not isinstance(snapshot, dict) or any(key not in snapshot for key in REQUIRED_KEYS):
        raise CorruptSnapshot(f"{source}: not a mingpt-ddp snapshot (missing keys)")
    if snapshot["format_version"] > FORMAT_VERSION:
        raise UsageError(
            f"{source} has snapshot format {snapshot['format_version']}, newer than this code understands "
            f"({FORMAT_VERSION}); update mingpt-ddp"
        )
    if integrity_sha256(snapshot) != snapshot["integrity_sha256"]:
        raise CorruptSnapshot(f"{source}: damaged (tensor checksum mismatch)")
    return snapshot


def _first_line(error: BaseException) -> str:
    return next((line.strip() for line in str(error).splitlines() if line.strip()), "")


def check_compatible(snapshot: dict, model_config: dict, vocab: str, source: str) -> None:
    """A snapshot of another model shape or vocabulary must never be silently trained over (or ignored)."""
    saved = snapshot["model_config"]
    for name in SHAPE_FIELDS:
        if saved.get(name) != model_config.get(name):
            raise UsageError(
                f"snapshot {source} is for a different model: {name}={saved.get(name)} in the snapshot, "
                f"{model_config.get(name)} in the config (use another trainer_config.snapshot_path to start afresh)"
            )
    if snapshot["vocab"] != vocab:
        added = "".join(sorted(set(vocab) - set(snapshot["vocab"])))
        missing = "".join(sorted(set(snapshot["vocab"]) - set(vocab)))
        raise UsageError(
            f"snapshot {source} has a different vocabulary ({len(snapshot['vocab'])} characters, this data "
            f"{len(vocab)}; only in the data: {added!r}, only in the snapshot: {missing!r})"
        )


# --------------------------------------------------------------------------------------------------- storage
@dataclass
class Entry:
    name: str
    step: int


class SnapshotStore:
    """A folder of snapshots at a local path or fsspec URL."""

    def __init__(self, location: str, storage_options: Optional[dict] = None) -> None:
        self.location = location.rstrip("/")
        try:
            self.fs, self.root = fsspec.core.url_to_fs(self.location, **(storage_options or {}))
        except (ImportError, ValueError) as e:
            raise UsageError(f"cannot use snapshot location {location}: {_first_line(e)}") from None
        self.root = self.root.rstrip("/")
        self.is_local = isinstance(self.fs, LocalFileSystem)

    def url(self, name: str) -> str:
        return f"{self.location}/{name}"

    def _path(self, name: str) -> str:
        return f"{self.root}/{name}"

    def entries(self) -> list[Entry]:
        """Snapshots present, newest (highest step) first."""
        try:
            names = [path.rstrip("/").rsplit("/", 1)[-1] for path in self.fs.ls(self.root, detail=False)]
        except FileNotFoundError:
            return []
        found = [Entry(name, int(m.group(1))) for name in names if (m := NAME_PATTERN.match(name))]
        return sorted(found, key=lambda entry: entry.step, reverse=True)

    def check_writable(self) -> None:
        """Fail in seconds, before training, if snapshots cannot be written here."""
        try:
            if self.is_local:
                self.fs.makedirs(self.root, exist_ok=True)
            else:
                # Writing through s3fs into a bucket that does not exist silently creates it; refuse instead.
                bucket = self.root.split("/", 1)[0]
                if not self.fs.exists(bucket):
                    raise UsageError(f"snapshot location {self.location}: bucket {bucket!r} does not exist")
            probe = self._path(f".write-check-{uuid.uuid4().hex}")
            self.fs.pipe_file(probe, b"ok")
            self.fs.rm_file(probe)
        except UsageError:
            raise
        except Exception as e:
            raise UsageError(
                f"snapshot location {self.location} is not writable: {type(e).__name__}: {_first_line(e)}"
            ) from None

    def write(self, name: str, data: bytes) -> None:
        """Make `name` appear complete or not at all."""
        if self.is_local:
            self._write_local_atomically(self._path(name), data)
        else:
            self.fs.pipe_file(self._path(name), data)  # an object store commits an object when its upload ends

    @staticmethod
    def _write_local_atomically(path: str, data: bytes) -> None:
        folder = os.path.dirname(path)
        os.makedirs(folder, exist_ok=True)
        temporary = os.path.join(folder, f".{os.path.basename(path)}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
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
        directory = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(directory)  # make the rename itself durable
        finally:
            os.close(directory)

    def read(self, name: str) -> bytes:
        return self.fs.cat_file(self._path(name))

    def prune(self, keep_last: int) -> list[str]:
        """Delete all but the newest `keep_last` snapshots (and temporary files of interrupted local saves)."""
        removed = []
        for entry in self.entries()[keep_last:]:
            self.fs.rm_file(self._path(entry.name))
            removed.append(entry.name)
        if self.is_local and os.path.isdir(self.root):
            for name in os.listdir(self.root):
                if name.startswith(".snapshot-") and ".tmp-" in name and f".tmp-{os.getpid()}-" not in name:
                    os.remove(os.path.join(self.root, name))
        return removed

    def load_newest_valid(
        self, model_config: Optional[dict] = None, vocab: Optional[str] = None
    ) -> Optional[tuple[Entry, dict]]:
        """The newest snapshot that reads back intact; damaged ones are reported in one line and skipped.

        With `model_config` and `vocab`, one of another model shape or vocabulary is an error, not skipped; so
        are a newer format and pickled code.
        """
        for entry in self.entries():
            source = self.url(entry.name)
            try:
                snapshot = from_bytes(self.read(entry.name), source)
            except CorruptSnapshot as e:
                log.warning("skipping snapshot %s", e)
                continue
            if model_config is not None and vocab is not None:
                check_compatible(snapshot, model_config, vocab, source)
            return entry, snapshot
        return None


class BackgroundWriter:
    """Serialises, checksums and writes snapshots on a background thread, so training is blocked only for the
    copy of its state into CPU memory. One write at a time: a new one first waits for the previous one."""

    def __init__(self, store: SnapshotStore, keep_last: int) -> None:
        self.store = store
        self.keep_last = keep_last
        self._thread: Optional[threading.Thread] = None
        self._error: Optional[str] = None

    def submit(self, name: str, state: dict, metadata: dict, world_size: int, reason: str) -> None:
        """`state` must already be a private CPU copy: training goes on changing the live tensors."""
        self.wait(raise_error=False)
        self._thread = threading.Thread(
            target=self._write, args=(name, state, metadata, world_size, reason), name="snapshot-writer", daemon=True
        )
        self._thread.start()

    def _write(self, name: str, state: dict, metadata: dict, world_size: int, reason: str) -> None:
        start = time.perf_counter()
        try:
            self.store.write(name, to_bytes(build(state, metadata, world_size)))
            removed = self.store.prune(self.keep_last)  # only once the new snapshot is complete
        except Exception as e:  # reported here and by wait(); training goes on with the previous snapshot
            self._error = f"snapshot {self.store.url(name)} could not be written: {type(e).__name__}: {_first_line(e)}"
            log.error(self._error)
            return
        self._error = None
        log.info("snapshot %s saved (%s, %.2f s in the background)%s", self.store.url(name), reason,
                 time.perf_counter() - start, f"; removed {', '.join(removed)}" if removed else "")  # fmt: skip

    def wait(self, raise_error: bool = True) -> None:
        """Block until the current write is done; with raise_error, a failed write becomes a UsageError."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if raise_error and self._error is not None:
            error, self._error = self._error, None
            raise UsageError(error)


def cpu_copy(obj: Any) -> Any:
    """A private CPU copy of every tensor in a nest of dicts/lists (other values are kept as they are)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {key: cpu_copy(value) for key, value in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(cpu_copy(value) for value in obj)
    return obj


# --------------------------------------------------------------------------------------------------- CLI
def summary(snapshot: dict) -> dict:
    progress = snapshot["progress"]
    return {
        "format_version": snapshot["format_version"],
        "epoch": progress["epoch"],
        "step": progress["step"],
        "epoch_samples": progress["epoch_samples"],
        "world_size": snapshot["world_size"],
        "n_params": sum(t.numel() for k, t in snapshot["model"].items() if k != "lm_head.weight"),
        "vocab_size": len(snapshot["vocab"]),
        "val_loss": progress.get("val_loss"),
        "created_at": snapshot["created_at"],
        "weights_sha256": weights_sha256(snapshot["model"]),
        "model_config": snapshot["model_config"],
    }


def read_file(path_or_url: str, storage_options: Optional[dict] = None) -> dict:
    """One snapshot file (relative paths = to the project), verified; a missing file is a UsageError."""
    url = resolve_path(path_or_url).rstrip("/")
    location, _, name = url.rpartition("/")
    try:
        data = SnapshotStore(location or ".", storage_options).read(name)
    except FileNotFoundError:
        raise UsageError(f"no such snapshot: {url}") from None
    return from_bytes(data, url)


def cli(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="snapshot.py", description="Inspect mingpt-ddp snapshots.")
    commands = parser.add_subparsers(dest="command", required=True)
    info = commands.add_parser("info", help="print one snapshot's summary as JSON")
    info.add_argument("path", help="snapshot file: local path or fsspec URL")
    listing = commands.add_parser("list", help="list the snapshots in a location, newest first")
    listing.add_argument("location", help="snapshot folder: local path or fsspec URL")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(message)s")
    try:
        if args.command == "info":
            print(json.dumps(summary(read_file(args.path))))
        else:
            store = SnapshotStore(resolve_path(args.location))
            for entry in store.entries():
                size = store.fs.size(store._path(entry.name))
                print(json.dumps({"name": entry.name, "step": entry.step, "bytes": size, "url": store.url(entry.name)}))
    except (UsageError, CorruptSnapshot) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(cli())
