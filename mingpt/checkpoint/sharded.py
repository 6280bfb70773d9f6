"""Sharded snapshots (strategy=fsdp): one folder per snapshot, every rank writing its own shards in parallel with
torch.distributed.checkpoint (DCP), to a local folder or any fsspec URL.

    snapshots/default/snapshot-000002000.dcp/
        __0_0.distcp  __1_0.distcp     each rank's shards of the model and optimizer state (DCP's files)
        .metadata                      DCP's index of the shards
        snapshot.json                  everything else (progress, model config, tokenizer, training config, the
                                       optimizer's hyper-parameters) and every file's size and SHA-256

Never visible half-written: locally the folder is written under a hidden temporary name and renamed into place
when complete; on an object store snapshot.json is the last object written, and a folder without it is an
incomplete save (ignored, and removed after the next save completes). Read back, nothing is trusted: snapshot.json's
own checksum, every file's size and SHA-256, DCP's index unpickled with an allow-list of DCP's own classes (DCP's
reader would use plain pickle) and refused unless it indexes tensors only (DCP unpickles other items with
weights_only=False), the tensors with weights_only=True (DCP's reader). A snapshot loads at any world size: DCP
reads the parts of the shards each rank's new shards need.
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import io
import json
import logging
import os
import pickle
import shutil
import threading
import time
import warnings
from dataclasses import dataclass
from typing import Any, Iterator, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import FileSystemBase, FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from mingpt.compat import dcp_alone
from mingpt.data.tokenizer import description_problem, is_characters
from mingpt.errors import CorruptSnapshot, UsageError, describe, is_permanent
from mingpt.parallel.state import is_fresh, numbered_optimizer_state
from mingpt.storage.durable import fsync_folder

log = logging.getLogger(__name__)

COMMIT_FILE = "snapshot.json"
DCP_INDEX = ".metadata"
FORMAT_VERSION = 2  # of snapshot.json: written in the oldest that holds the tokenizer, as store.py's snapshots
CHAR_FORMAT_VERSION = 1  # the character tokenizer's, which readers from before tokenizer descriptions read
HASH_CHUNK = 8 * 2**20
REQUIRED_TYPES = {"format_version": int, "progress": dict, "model_config": dict, "world_size": int,
                  "files": dict, "meta_sha256": str}
# What DCP's index (.metadata) pickles, and nothing else: its dataclasses, torch.Size, dtypes, a layout by name,
# the checkpoint's path.
INDEX_CLASSES = {
    ("torch.distributed.checkpoint.metadata", name) for name in (
        "Metadata", "TensorStorageMetadata", "ChunkStorageMetadata", "TensorProperties", "MetadataIndex",
        "StorageMeta", "BytesStorageMetadata", "_MEM_FORMAT_ENCODING")
} | {("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"),
     ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"),
     ("collections", "OrderedDict")}


# --------------------------------------------------------------------------------------------------- state trees
def split_tensors(state: dict, path: str = "state") -> tuple[dict, dict]:
    """(the tensors, everything else) of a nest of dicts, each keeping the nesting: the tensors go to DCP, the rest
    to snapshot.json. Keys must be strings (JSON's, and DCP's flattened names)."""
    tensors, plain = {}, {}
    for key, value in state.items():
        if not isinstance(key, str):
            raise TypeError(f"{path} has a key that is not a string: {key!r}")
        if isinstance(value, torch.Tensor):
            tensors[key] = value
        elif isinstance(value, dict):
            sub_tensors, sub_plain = split_tensors(value, f"{path}.{key}")
            if sub_tensors:
                tensors[key] = sub_tensors
            if sub_plain or not sub_tensors:
                plain[key] = sub_plain
        else:
            plain[key] = value
    return tensors, plain


def merge(tensors: dict, plain: dict) -> dict:
    """The reverse of split_tensors."""
    merged = dict(plain)
    for key, value in tensors.items():
        merged[key] = merge(value, plain.get(key, {})) if isinstance(value, dict) else value
    return merged


def doc_sha256(doc: dict) -> str:
    """SHA-256 of snapshot.json's content without its own checksum, in a canonical form."""
    body = {key: value for key, value in doc.items() if key != "meta_sha256"}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


# --------------------------------------------------------------------------------------------------- files
class _HashingStream(io.RawIOBase):
    """A write stream that hashes what goes through it (DCP writes a shard file in one pass)."""

    def __init__(self, inner: Any) -> None:
        super().__init__()
        self.inner, self.sha256, self.size = inner, hashlib.sha256(), 0

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        written = self.inner.write(data)
        view = memoryview(data).cast("B")[:written]
        self.sha256.update(view)
        self.size += len(view)
        return written

    def tell(self) -> int:
        return self.inner.tell()

    def fileno(self) -> int:
        return self.inner.fileno()

    def flush(self) -> None:
        self.inner.flush()


class StoreFiles(FileSystemBase):
    """DCP's view of a snapshot store's file system (local or fsspec): every file written is hashed as it is
    written (`digests`: name -> {"bytes", "sha256"}), so the commit needs no second read."""

    def __init__(self, fs: Any, is_local: bool) -> None:
        self.fs, self.is_local = fs, is_local
        self.digests: dict[str, dict] = {}

    @contextlib.contextmanager
    def create_stream(self, path: Any, mode: str) -> Iterator[Any]:
        path = os.fspath(path)
        with (open(path, mode) if self.is_local else self.fs.open(path, mode)) as stream:
            if "w" not in mode:
                yield stream
                return
            hashing = _HashingStream(stream)
            yield hashing
            self.digests[os.path.basename(path)] = {"bytes": hashing.size, "sha256": hashing.sha256.hexdigest()}

    def concat_path(self, path: Any, suffix: str) -> str:
        return f"{os.fspath(path).rstrip('/')}/{suffix}"

    def init_path(self, path: Any) -> str:
        return os.fspath(path)

    def rename(self, path: Any, new_path: Any) -> None:
        old, new = os.path.basename(os.fspath(path)), os.path.basename(os.fspath(new_path))
        if self.is_local:
            os.replace(path, new_path)
        else:
            self.fs.mv(os.fspath(path), os.fspath(new_path))
        if old in self.digests:
            self.digests[new] = self.digests.pop(old)

    def mkdir(self, path: Any) -> None:
        if self.is_local:
            os.makedirs(path, exist_ok=True)
        else:
            self.fs.makedirs(os.fspath(path), exist_ok=True)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return True

    def exists(self, path: Any) -> bool:
        return os.path.exists(path) if self.is_local else self.fs.exists(os.fspath(path))

    def rm_file(self, path: Any) -> None:
        if self.is_local:
            os.remove(path)
        else:
            self.fs.rm_file(os.fspath(path))

    def ls(self, path: Any) -> list[str]:
        return os.listdir(path) if self.is_local else self.fs.ls(os.fspath(path), detail=False)


class _ShardWriter(FileSystemWriter):
    """DCP's file writer on a StoreFiles. Local files are fsynced; an object store commits an object on close.

    per_thread_copy_ahead=0: the state is already in CPU memory, and DCP would otherwise pick its overlapping
    loader wherever CUDA is available (torch/distributed/checkpoint/filesystem.py, _write_files_from_queue), which
    takes `torch.cuda.current_stream()`: on the writer thread, whose current device is GPU 0, every rank would
    create a CUDA context there (0.3-0.5 GB each; a failed save on GPUs in exclusive-process mode)."""

    def __init__(self, path: str, files: StoreFiles) -> None:
        super().__init__(path, sync_files=files.is_local, overwrite=True, per_thread_copy_ahead=0)
        self.fs, self.path = files, path


class _ShardReader(FileSystemReader):
    """DCP's file reader on a StoreFiles, with the index already read and checked (never DCP's own unpickling)."""

    def __init__(self, path: str, files: StoreFiles, index: Metadata) -> None:
        super().__init__(path)
        self.fs, self.path, self.index = files, path, index

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        return self.index


class _IndexUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("torch", "Size") or (module, name) in INDEX_CLASSES:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"{module}.{name} was not an allowed global")


def parse_index(data: bytes, source: str) -> Metadata:
    """DCP's .metadata, unpickled with an allow-list; it must index tensors only."""
    try:
        index = _IndexUnpickler(io.BytesIO(data)).load()
    except pickle.UnpicklingError as e:
        raise UsageError(f"refusing to load {source}: its shard index references code ({e})") from None
    except Exception as e:
        raise CorruptSnapshot(f"{source}: damaged shard index ({type(e).__name__})") from None
    if not isinstance(index, Metadata):
        raise CorruptSnapshot(f"{source}: not a shard index")
    others = [key for key, item in index.state_dict_metadata.items() if not isinstance(item, TensorStorageMetadata)]
    if others:  # DCP would unpickle these with weights_only=False
        raise UsageError(f"refusing to load {source}: it holds pickled objects, not only tensors ({others[0]})")
    return index


# --------------------------------------------------------------------------------------------------- reading
@dataclass
class Shards:
    """The tensors of a verified sharded snapshot, loaded on demand."""

    files: StoreFiles
    path: str
    index: Metadata
    source: str

    def load_into(self, tensors: dict, group: Optional[dist.ProcessGroup]) -> None:
        """Collective over `group` (None: this process alone). Fill `tensors` (a nest of the names saved, holding
        full tensors or this rank's DTensor shards) from the snapshot; each rank reads what its shards need."""
        reader = _ShardReader(self.path, self.files, self.index)
        try:
            with warnings.catch_warnings():  # alone, DCP warns that it assumes so
                warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
                dcp.load(tensors, storage_reader=reader, **dcp_alone(group))
        except (Exception, CheckpointException) as e:  # verified files that do not fit: not another try's to fix
            raise UsageError(f"cannot load snapshot {self.source}: {_dcp_error(e)}") from None

    def names(self) -> list[str]:
        """The flattened names of the tensors saved (model.<param>, optimizer.state.<param>.<name>)."""
        return list(self.index.state_dict_metadata)

    def full(self, prefix: str) -> dict[str, torch.Tensor]:
        """In this process alone: every saved tensor whose name starts with `prefix`, whole, keyed by the rest."""
        template = {}
        for name, item in self.index.state_dict_metadata.items():
            if name.startswith(prefix):
                template[name] = torch.empty(item.size, dtype=item.properties.dtype)
        self.load_into(template, None)
        return {name[len(prefix):]: tensor for name, tensor in template.items()}


def read(fs: Any, is_local: bool, path: str, source: str) -> dict:
    """A sharded snapshot's snapshot.json, with every file checked, and its tensors as `["shards"]`."""
    files = StoreFiles(fs, is_local)
    try:
        raw = _read_bytes(files, f"{path}/{COMMIT_FILE}")
    except FileNotFoundError:
        if not files.exists(path):
            raise  # gone since it was listed
        raise CorruptSnapshot(f"{source}: incomplete (no {COMMIT_FILE}: a save that did not finish)") from None
    doc = _parse_doc(raw, source)
    for name, expected in sorted(doc["files"].items()):
        _verify_file(files, f"{path}/{name}", expected, source)
    if DCP_INDEX not in doc["files"]:
        raise CorruptSnapshot(f"{source}: damaged ({COMMIT_FILE} lists no shard index)")
    index = parse_index(_read_bytes(files, f"{path}/{DCP_INDEX}"), source)
    return {**doc, "shards": Shards(files, path, index, source)}


def _read_bytes(files: StoreFiles, path: str) -> bytes:
    with files.create_stream(path, "rb") as stream:
        return stream.read()


def _parse_doc(raw: bytes, source: str) -> dict:
    try:
        doc = json.loads(raw.decode())
    except (UnicodeDecodeError, ValueError):
        raise CorruptSnapshot(f"{source}: damaged ({COMMIT_FILE} is not JSON)") from None
    if not isinstance(doc, dict) or any(key not in doc for key in REQUIRED_TYPES):
        raise CorruptSnapshot(f"{source}: not a mingpt-ddp snapshot ({COMMIT_FILE} lacks keys)")
    for key, kind in REQUIRED_TYPES.items():
        if not isinstance(doc[key], kind) or isinstance(doc[key], bool):
            raise CorruptSnapshot(f"{source}: not a mingpt-ddp snapshot ({key} is a {type(doc[key]).__name__})")
    if doc["format_version"] > FORMAT_VERSION:
        raise UsageError(f"{source} has sharded snapshot format {doc['format_version']}, newer than this code "
                         f"understands ({FORMAT_VERSION}); update mingpt-ddp")
    problem = description_problem(doc)
    if problem is not None:
        raise CorruptSnapshot(f"{source}: not a mingpt-ddp snapshot ({problem})")
    if doc_sha256(doc) != doc["meta_sha256"]:
        raise CorruptSnapshot(f"{source}: damaged ({COMMIT_FILE} checksum mismatch)")
    return doc


def _verify_file(files: StoreFiles, path: str, expected: dict, source: str) -> None:
    name = path.rsplit("/", 1)[-1]
    digest, size = hashlib.sha256(), 0
    try:
        with files.create_stream(path, "rb") as stream:
            while chunk := stream.read(HASH_CHUNK):
                digest.update(chunk)
                size += len(chunk)
    except FileNotFoundError:
        raise CorruptSnapshot(f"{source}: damaged ({name} is missing)") from None
    if size != expected.get("bytes"):
        raise CorruptSnapshot(f"{source}: damaged ({name} has {size} bytes, {expected.get('bytes')} were written)")
    if digest.hexdigest() != expected.get("sha256"):
        raise CorruptSnapshot(f"{source}: damaged ({name} checksum mismatch)")


# --------------------------------------------------------------------------------------------------- writing
def new_group() -> Optional[dist.ProcessGroup]:
    """Collective. The group the snapshot threads' collectives go through: gloo (DCP exchanges its plans as
    objects), and not the training group, whose collectives the training thread issues meanwhile."""
    if not dist.is_initialized():
        return None
    return dist.new_group(backend="gloo", timeout=datetime.timedelta(minutes=10))


@dataclass
class _Failure:
    message: str
    permanent: bool = False


class ShardedWriter:
    """Writes sharded snapshots on a background thread in every rank (the same interface as
    snapshot.BackgroundWriter). Every step of a save whose outcome decides what happens next is agreed by all
    ranks (DCP raises on every rank if one failed; rank 0 broadcasts its parts), so the ranks retry, give up or
    commit together and never wait in different collectives."""

    def __init__(self, store: Any, rank: int, group: Optional[dist.ProcessGroup], attempts: int,
                 first_backoff_s: float, prune: Any, device: torch.device = torch.device("cpu")) -> None:
        self.store, self.rank, self.group, self.device = store, rank, group, device
        self.prune = prune  # snapshot.prune_quietly for this store: () -> what to add to the "saved" line
        self.attempts, self.first_backoff_s = attempts, first_backoff_s
        self._thread: Optional[threading.Thread] = None
        self._error: Optional[str] = None
        self.newest_saved: Optional[str] = None

    def make_room(self) -> None:
        """Before the next save: this rank's part of the previous one is done (an attempt is collective: it is never
        cut short). Afterwards nothing reads the previous state's host buffers."""
        self.wait(raise_error=False)

    def submit(self, name: str, state: Any, metadata: dict, world_size: int, reason: str,
               after_commit: Optional[Any] = None) -> None:
        """On every rank, with this rank's private host copy of its state, or one on its way (store.py's
        `HostStaging.stage`, the staging of single files too: waited for on the writer's thread). `after_commit`
        (rank 0, once the snapshot is committed: marks, retention; returns what to add to the "saved" line)
        defaults to `prune`."""
        self.make_room()
        self._thread = threading.Thread(target=self._write, args=(name, state, metadata, world_size, reason,
                                                                   after_commit or self.prune),
                                        name="snapshot-writer", daemon=True)
        self._thread.start()

    def _write(self, name: str, state: Any, metadata: dict, world_size: int, reason: str, after_commit: Any) -> None:
        try:
            if self.device.type == "cuda":  # a new thread's current device is GPU 0: anything CUDA goes to this rank's
                torch.cuda.set_device(self.device)
            self._save(name, _host_copy(state), metadata, world_size, reason, after_commit)
        except BaseException as e:  # a collective that failed (a peer gone), a bug: never a silent end of the thread
            self._error = f"snapshot {self.store.url(name)} not saved: {_dcp_error(e)}"
            log.warning(self._error)

    def _save(self, name: str, state: dict, metadata: dict, world_size: int, reason: str, after_commit: Any) -> None:
        start = time.perf_counter()
        url = self.store.url(name)
        tensors, plain = split_tensors(state)
        version = CHAR_FORMAT_VERSION if is_characters(metadata) else FORMAT_VERSION
        doc = {"format_version": version, "format": "sharded",
               "created_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               "world_size": world_size, **metadata, **plain}
        for attempt in range(1, self.attempts + 1):
            failure = self._attempt(name, tensors, doc)
            if failure is None:
                break
            if failure.permanent or attempt == self.attempts:
                kept = f"{self.newest_saved} stays the newest" if self.newest_saved else "older snapshots are unchanged"
                self._error = (f"snapshot {url} not saved ({attempt} attempt(s) in {time.perf_counter() - start:.1f}"
                               f" s, last error {failure.message}); {kept}")
                if self.rank == 0:
                    log.warning(self._error)
                return
            delay = self.first_backoff_s * 2 ** (attempt - 1)
            if self.rank == 0:
                log.info("snapshot %s: attempt %d of %d failed (%s); retrying in %.0f s", url, attempt, self.attempts,
                         failure.message, delay)
            time.sleep(delay)  # every rank: the next attempt is collective
        self._error, self.newest_saved = None, name
        if self.rank == 0:
            log.info("snapshot %s saved (%s, shards of %d rank(s), %.2f s in the background)%s", url, reason,
                     world_size, time.perf_counter() - start, after_commit())

    def _attempt(self, name: str, tensors: dict, doc: dict) -> Optional[_Failure]:
        """Collective. One try at a save; the same outcome on every rank. A failed try leaves nothing behind."""
        target = self._broadcast(self._guarded(lambda: self.store.begin_sharded(name))
                                 if self.rank == 0 else None)
        if isinstance(target, _Failure):
            return target
        files = StoreFiles(self.store.fs, self.store.is_local)
        try:
            dcp.save(tensors, storage_writer=_ShardWriter(target, files), **dcp_alone(self.group))
        except (Exception, CheckpointException) as e:  # DCP raises on every rank when any rank failed
            outcome: Any = _Failure(_dcp_error(e), is_permanent(_first_cause(e)))
        else:
            digests = self._gather(files.digests)
            outcome = None
            if self.rank == 0:
                committed = {**doc, "files": digests}
                committed["meta_sha256"] = doc_sha256(committed)
                outcome = self._guarded(lambda: self.store.commit_sharded(name, target, committed))
            outcome = self._broadcast(outcome)
        if isinstance(outcome, _Failure):
            if self.rank == 0:
                self.store.discard_sharded(target)
            return outcome
        return None

    @staticmethod
    def _guarded(action: Any) -> Any:
        try:
            return action()
        except Exception as e:
            return _Failure(describe(e), is_permanent(e))

    def _broadcast(self, value: Any) -> Any:
        if self.group is None:
            return value
        box = [value]
        dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]

    def _gather(self, digests: dict) -> dict:
        if self.group is None:
            return dict(digests)
        everyone: list = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(everyone, digests, group=self.group)
        return {name: info for part in everyone for name, info in part.items()}

    def wait(self, raise_error: bool = True, timeout: Optional[float] = None) -> None:
        """Block until this rank's part of the current save is done (at most `timeout` s: a save cannot complete
        once a peer is gone); with raise_error, a failed save becomes a UsageError."""
        if self._thread is not None:
            self._thread.join(timeout)
            if not self._thread.is_alive():
                self._thread = None
        if raise_error and self._error is not None:
            error, self._error = self._error, None
            raise UsageError(error)


def _host_copy(state: Any) -> dict:
    """What a save writes: a staged state (store.StagedState, not imported: store.py imports this module) once its
    copy is complete, or a private host copy as it is."""
    return state.result() if callable(getattr(state, "result", None)) else state


def _first_cause(error: BaseException) -> BaseException:
    """The error behind DCP's CheckpointException (a BaseException that wraps every failing rank's error and
    traceback): the first failing rank's own."""
    failures = getattr(error, "failures", None)
    if isinstance(failures, dict) and failures:
        cause = sorted(failures.items())[0][1]
        cause = cause[0] if isinstance(cause, tuple) else cause
        if isinstance(cause, BaseException):
            return cause
    return error


def _dcp_error(error: BaseException) -> str:
    """One line for a failed save or load: DCP's own message lists every rank's traceback."""
    failures = getattr(error, "failures", None)
    if isinstance(failures, dict) and failures:
        return f"rank {sorted(failures)[0]}: {describe(_first_cause(error))}"
    return describe(error)


# --------------------------------------------------------------------------------------------------- local commit
def commit_local(root: str, temporary: str, final: str, doc: dict) -> None:
    """snapshot.json into the complete temporary folder, then the folder renamed into place (replacing a damaged
    snapshot of the same step, which was not resumed from)."""
    path = os.path.join(temporary, COMMIT_FILE)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(doc, f)
        f.flush()
        os.fsync(f.fileno())
    fsync_folder(temporary)
    if os.path.exists(final):
        aside = f"{temporary}.old"
        os.replace(final, aside)
        shutil.rmtree(aside, ignore_errors=True)
    os.replace(temporary, final)
    fsync_folder(root)


# --------------------------------------------------------------------------------------------------- one file
def full_state(snapshot: dict) -> dict:
    """In this process alone: a verified sharded snapshot (`read`) as a single-file snapshot holds it: the model's
    full tensors, and the optimizer's state numbered as torch.optim's own state_dict numbers it."""
    shards: Shards = snapshot["shards"]
    model = shards.full("model.")
    kept = {key: value for key, value in snapshot.items()
            if key not in ("shards", "files", "meta_sha256", "format", "optimizer")}
    if is_fresh(snapshot["optimizer"]):  # a run's starting point: no optimizer state yet
        return {**kept, "model": model, "optimizer": snapshot["optimizer"]}
    saved = shards.full("optimizer.state.")  # "<parameter name>.<exp_avg|exp_avg_sq|step>"
    groups = snapshot["optimizer"]["param_groups"]
    named: dict = {"state": {}, "param_groups": groups}
    for name in (name for group in groups for name in group["params"]):
        prefix = f"{name}."
        entries = {key[len(prefix):]: value for key, value in saved.items()
                   if key.startswith(prefix) and "." not in key[len(prefix):]}
        if entries:
            named["state"][name] = entries
    return {**kept, "model": model, "optimizer": numbered_optimizer_state(named)}
