"""The encoded-corpus cache: text sources -> one token file, its tokenizer and a manifest, built once per node.

    >>> tokens = open_tokens("/data/books/*.txt", separator="\\n", cache_dir=Path("~/.cache/mingpt-ddp/data"))
    >>> tokens.tokenizer, tokens.n_tokens, tokens.path    # characters: ids are positions in the sorted vocabulary
    >>> open_tokens(..., tokenizer=TokenizerChoice("bpe", 4096))   # a byte-level BPE trained on the text, cached

A location is a file, a folder (every file under it, hidden ones skipped), a glob, or the same as an fsspec URL
(`s3://bucket/corpus/*.txt`). Its files are joined in sorted order with `separator` between them, and encoded in
two streamed passes of bounded memory (the vocabulary, then the ids; numpy, no per-character Python) into
uint8/uint16/uint32 ids, whichever the vocabulary fits. Remote files are copied to the cache folder once in the
first pass, never once per rank.

With a BPE (tokenizer.py) the first pass trains it on the text (on a bounded sample, spread over the text, of a
large one), or reads the tokenizer file; the second encodes the text in pieces cut where the ids cannot change, in
parallel; the tokenizer is written beside the manifest as tokenizer.json, which the manifest checks by SHA-256. So
the ranks of a node and every restart share one tokenizer, trained once.

One folder per (location, separator, tokenizer settings -- none for characters, so their caches are those from
before tokenizers: the kind and vocab_size of a trained BPE, the SHA-256 of a tokenizer file) under the cache
directory holds `manifest.json` (format version, the sources' paths, sizes and versions -- modification time or
ETag --, the vocabulary or the tokenizer file's SHA-256, the token count, dtype and CRC-32) and the token file it
names. Both are written under temporary names and renamed, the manifest last, so a
cache is complete or absent; a manifest whose sources no longer match is rebuilt, a damaged one (bad JSON, its
own checksum, the token file's size or CRC-32) too, with a warning. Every process that opens the cache checks the
token file's CRC-32 before it maps it (about 1.7 GB/s here): a damaged cache is never trained on.
A file lock (flock) in the folder lets one builder write at a time, across ranks and jobs; only processes asked to
build (main.py: local rank 0) ever build, the others wait for a valid cache.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import glob
import hashlib
import json
import logging
import os
import re
import shutil
import socket
import sys
import time
import uuid
import zlib
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import BinaryIO, Callable, Iterator, Optional

import fsspec
import fsspec.implementations.local
import numpy as np

from mingpt.data.tokenizer import (  # noqa: F401 (Encoder and id_dtype: the cache's, re-exported)
    TOKENIZER_FILE,
    UNICODE_SIZE,
    BpeTokenizer,
    CharTokenizer,
    Encoder,
    Tokenizer,
    TokenizerChoice,
    id_dtype,
    non_ascii_codes,
    split_at_boundaries,
)
from mingpt.errors import UsageError, first_line
from mingpt.storage.durable import fsync_folder

log = logging.getLogger("mingpt")

FORMAT_VERSION = 1
CHUNK_BYTES = 4 << 20  # bytes read at a time: the encoder's memory is a small multiple of this
WAIT_POLL_S = 0.2
NO_LOCKS = {errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP}  # file systems without flock (Lustre...)
ROOM_MARGIN = 64 << 10  # the file system's own blocks, on top of what is written
TRIM_BYTES = 64 << 20  # text read between two returns of freed heap memory to the system (release_freed_memory)


@dataclass(frozen=True)
class Source:
    """One file of a corpus as found now: its identity decides whether a cache is still current."""

    path: str  # full URL for remote files, absolute path for local ones
    size: int
    version: str  # local: mtime in ns; remote: ETag, else the modification time the store reports


@dataclass
class Tokens:
    """An opened, verified cache: the token file and what it encodes. `fd` holds the file open with a shared
    flock, so that a rebuild (another job, `prepare.py --rebuild`) leaves it in place while this process uses it."""

    path: Path
    dtype: np.dtype
    n_tokens: int
    tokenizer: Tokenizer
    sources: list[Source]
    built_now: bool  # False: an existing cache was reused
    fd: int

    @property
    def vocab(self) -> str:
        """The characters of a character tokenizer (what the cache held before tokenizers); "" for another."""
        return getattr(self.tokenizer, "chars", "")

    def array(self, start: int = 0, count: Optional[int] = None) -> np.ndarray:
        """The ids [start, start + count) as a read-only memory map (an empty array for none): for whole reads."""
        count = self.n_tokens - start if count is None else count
        if count == 0:
            return np.zeros(0, dtype=self.dtype)
        return np.memmap(self.path, dtype=self.dtype, mode="r", offset=start * self.dtype.itemsize, shape=(count,))

    def part(self, start: int, count: int) -> TokenFile:
        """The ids [start, start + count), read window by window (what training reads)."""
        return TokenFile(self.path, self.dtype, start, count, fd=os.dup(self.fd))

    def __del__(self) -> None:
        _close(getattr(self, "fd", None))


def _pinned(path: Path) -> int:
    """A descriptor of `path` holding a shared flock on it: leftover removal skips a token file in use."""
    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)
    except OSError as e:
        if e.errno not in NO_LOCKS:
            os.close(fd)
            raise
    return fd


def _close(fd: Optional[int]) -> None:
    if fd is not None:
        try:
            os.close(fd)
        except OSError:
            pass


class TokenFile:
    """A stretch of a token file, read by position (one `preadv` a window, into the batch's own buffer).

    Why not a memory map: the kernel's page cache already shares the file's pages between every process that
    reads it, and a map makes them count as each process's resident memory. With large page-cache folios (Linux
    6.x) a window touched maps the whole folio around it, up to 2 MB: measured here, 100 batches of 16 random
    windows of a 608 MB split put 535 MB of it in the process's RSS; read by position, none. The same ids, at
    the same speed (~1 ms for a batch of 16, the epoch order included, either way). A copy sent to a DataLoader
    worker by pickling opens the file again by name (the parent's lock keeps it there).
    """

    def __init__(self, path: Path, dtype: np.dtype, start: int, count: int, fd: Optional[int] = None) -> None:
        self.path, self.dtype, self.start, self.count = Path(path), np.dtype(dtype), start, count
        self._fd = fd

    def __len__(self) -> int:
        return self.count

    def read(self, starts: np.ndarray, length: int) -> np.ndarray:
        """The windows [s, s + length) for s in `starts`, as one (len(starts), length) array."""
        if self._fd is None:
            self._fd = _pinned(self.path)
        out = np.empty((len(starts), length), dtype=self.dtype)
        view, item = memoryview(out).cast("B"), self.dtype.itemsize
        size = length * item
        for k, first in enumerate(starts.tolist()):
            if not 0 <= first <= self.count - length:
                raise IndexError(f"window [{first}, {first + length}) is outside the {self.count} ids")
            if os.preadv(self._fd, [view[k * size : (k + 1) * size]], (self.start + first) * item) != size:
                raise OSError(f"{self.path} ended early: the cache changed under this process")
        return out

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_fd": None}  # a DataLoader worker opens its own

    def __del__(self) -> None:
        _close(getattr(self, "_fd", None))


# ----------------------------------------------------------------------------------------------------- sources
GLOB_CHARS = re.compile(r"[*?\[]")


def list_sources(location: str) -> list[Source]:
    """The files of a location (file, folder, glob; local or fsspec URL), sorted by path, with their identity."""
    try:
        fs, path = fsspec.core.url_to_fs(location)
        remote = not isinstance(fs, fsspec.implementations.local.LocalFileSystem)
        if not remote:
            return _local_sources(path)
        if GLOB_CHARS.search(path) and not fs.exists(path):  # "book [1].txt" is a name, not a pattern
            # Like a shell's glob, a wildcard does not match a name that starts with a dot (unless written so).
            root = _glob_root(path)
            found = {name: info for name, info in fs.glob(path, detail=True).items()
                     if "/." in path[len(root):] or not _hidden(name, root)}
            what = "matches no file"
        elif fs.isdir(path):
            found = {name: info for name, info in fs.find(path, detail=True).items() if not _hidden(name, path)}
            what = "is a folder without files"
        else:
            found, what = {path: fs.info(path)}, "is not a file"
        sources = [_source(fs, name, info) for name, info in sorted(found.items()) if info.get("type") == "file"]
    except FileNotFoundError as e:
        cause = e.__cause__
        if isinstance(cause, OSError) and not isinstance(cause, FileNotFoundError):
            # fsspec's HTTP filesystem reports an unreachable server as FileNotFoundError; say what really failed
            raise _unreadable(location, cause) from None
        missing = e.filename or location
        raise UsageError(f"data file not found: {missing}") from None
    except UsageError:
        raise
    except Exception as e:  # no permission, unreachable server, missing credentials, unknown protocol, ...
        raise _unreadable(getattr(e, "filename", None) or location, e) from None
    if not sources:
        raise UsageError(f"data_config.path {location!r} {what}")
    return sources


def _glob_root(pattern: str) -> str:
    """The folder a glob starts in: everything before the folder of its first wildcard."""
    return pattern[: GLOB_CHARS.search(pattern).start()].rsplit("/", 1)[0]


def _hidden(name: str, folder: str) -> bool:
    """A file under the folder whose name, or a folder's on the way to it, starts with a dot (.DS_Store, .git/)."""
    relative = name[len(folder.rstrip("/")):] if name.startswith(folder.rstrip("/")) else name
    return any(part.startswith(".") for part in relative.split("/") if part)


def _source(fs, name: str, info: dict) -> Source:
    version = next((str(info[k]) for k in ("ETag", "etag", "md5Hash", "mtime", "LastModified", "last_modified",
                                           "updated", "created") if info.get(k) is not None), "")
    return Source(fs.unstrip_protocol(name), int(info.get("size") or 0), version)


def _local_sources(path: str) -> list[Source]:
    """Local files, walked with os.walk so that a folder that cannot be read is an error, not files silently left
    out (fsspec's walk omits it); links to files are followed, links to folders are not (no cycles)."""
    if GLOB_CHARS.search(path) and not os.path.exists(path):  # "book [1].txt" is a name, not a pattern
        _list_folders_of(path)
        names, what = glob.glob(path, recursive=True), "matches no file"  # as a shell: * skips .hidden names
    elif os.path.isdir(path):
        names, what = [n for n in _walk(path) if not _hidden(n, path)], "is a folder without files"
    elif os.path.lexists(path):
        names, what = [path], "is not a file"
    else:
        raise FileNotFoundError(errno.ENOENT, "No such file or directory", path)
    sources = []
    for name in sorted(names):
        if os.path.islink(name) and not os.path.exists(name):
            raise UsageError(f"data file {name} is a broken symbolic link (to {os.readlink(name)})")
        if os.path.isfile(name):
            stat = os.stat(name)
            sources.append(Source(name, stat.st_size, str(stat.st_mtime_ns)))
    if not sources:
        raise UsageError(f"data_config.path {path!r} {what}")
    return sources


def _list_folders_of(pattern: str) -> None:
    """List the folders a glob looks into, so that one that cannot be read is an error (glob skips it)."""
    parent = os.path.dirname(pattern)
    if "**" in pattern:
        root = _glob_root(pattern) or "/"
        for _ in _walk(root):
            pass
        return
    for folder in glob.glob(parent) if GLOB_CHARS.search(parent) else [parent]:
        if os.path.isdir(folder):
            os.listdir(folder)


def _walk(root: str) -> Iterator[str]:
    def unreadable(error: OSError) -> None:
        raise error

    for folder, _, files in os.walk(root, onerror=unreadable):
        yield from (os.path.join(folder, name) for name in files)


def _unreadable(location: str, error: BaseException) -> UsageError:
    # An error without any text still says what it is through its repr.
    return UsageError(f"cannot read data file {location}: {type(error).__name__}: {first_line(error) or repr(error)}")


def _open_source(source: Source) -> BinaryIO:
    try:
        return fsspec.open(source.path, "rb").open()
    except FileNotFoundError:
        raise UsageError(f"data file not found: {source.path} (it was there when the files were listed)") from None
    except Exception as e:
        raise _unreadable(source.path, e) from None


# ------------------------------------------------------------------------------------------------ memory
def _malloc_trim():  # noqa: ANN202 (a ctypes function, or None)
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):  # musl and others: no malloc_trim
        return None


MALLOC_TRIM = _malloc_trim()


def release_freed_memory() -> None:
    """Return the C heap's freed pages to the system (glibc's malloc_trim; elsewhere nothing).

    Why: a pass over a corpus allocates and frees chunk-sized buffers (4 MiB bytes, their translations, ids) over
    and over. glibc raises its mmap threshold to the largest block freed (up to 32 MiB), so these come from the
    heap, where the holes they leave are reused badly and kept: measured here, a character build of 267 MB grew
    its process by ~240 MiB that Python had freed (tracemalloc: 39 MiB at most alive), kept after the build (a
    worker's peak then adds the training's own on top); the BPE trainer's and tokenizers' freed memory stays too.
    Trimmed every TRIM_BYTES of text and after each phase, the pass holds what it uses. malloc_trim(0) walks
    every arena (the encoding threads' too) and gives back their free pages (madvise), ~ms."""
    if MALLOC_TRIM is not None:
        MALLOC_TRIM(0)


class _Trimmer:
    """Calls release_freed_memory every TRIM_BYTES of text counted."""

    def __init__(self) -> None:
        self._since = 0

    def count(self, n_bytes: int) -> None:
        self._since += n_bytes
        if self._since >= TRIM_BYTES:
            self._since = 0
            release_freed_memory()


# ------------------------------------------------------------------------------------------------ UTF-8 chunks
def utf8_chunks(stream: BinaryIO, name: str, chunk_bytes: int = CHUNK_BYTES) -> Iterator[bytes]:
    """The stream's bytes in chunks that each end on a character boundary, every one checked to be UTF-8: an
    invalid byte is a UsageError naming the file and the byte's offset in it."""
    offset, carry = 0, b""
    while True:
        try:
            block = stream.read(chunk_bytes)
        except Exception as e:
            raise _unreadable(name, e) from None
        if not block:
            break
        chunk = carry + block
        if chunk.isascii():
            carry = b""
        else:
            cut = _complete_prefix(chunk)
            chunk, carry = chunk[:cut], chunk[cut:]
            try:
                chunk.decode("utf-8")
            except UnicodeDecodeError as e:
                raise UsageError(f"data file {name} is not UTF-8 text (invalid byte at offset {offset + e.start})"
                                 ) from None
        offset += len(chunk)
        if chunk:
            yield chunk
    if carry:
        try:
            carry.decode("utf-8")
        except UnicodeDecodeError as e:
            if e.reason != "unexpected end of data":  # an invalid byte, not a character cut short
                raise UsageError(f"data file {name} is not UTF-8 text (invalid byte at offset {offset + e.start})"
                                 ) from None
        raise UsageError(f"data file {name} is not UTF-8 text (it ends inside a character, at offset {offset})")


def _complete_prefix(chunk: bytes) -> int:
    """The length of `chunk` without an incomplete multi-byte sequence at its end."""
    for back in range(1, min(4, len(chunk)) + 1):
        byte = chunk[-back]
        if byte & 0xC0 != 0x80:  # the last lead (or ASCII) byte
            need = 1 if byte < 0x80 else 2 if byte >> 5 == 0b110 else 3 if byte >> 4 == 0b1110 else 4
            return len(chunk) if need <= back else len(chunk) - back
    return len(chunk)  # four continuation bytes: invalid anyway, and decode says where


class CharScan:
    """The first pass: which characters occur, and how many characters there are."""

    def __init__(self) -> None:
        self.seen = np.zeros(UNICODE_SIZE, dtype=bool)
        self.n_chars = 0
        self._table = self._known_to_zero()

    def _known_to_zero(self) -> bytes:
        """A byte table: seen ASCII bytes and every byte >= 0x80 -> 0, other ASCII bytes -> themselves."""
        return bytes(0 if b >= 0x80 or self.seen[b] else b for b in range(256))

    def add(self, chunk: bytes) -> None:
        # A chunk that maps to zeros only has no new ASCII character: a check at ~350 MB/s, where marking
        # every byte seen runs at ~200 MB/s. (NUL maps to 0 either way, so it is looked for on its own.)
        nul_seen = bool(self.seen[0]) or 0 in chunk
        mapped = chunk.translate(self._table)
        if mapped.count(0) != len(mapped):
            self.seen[np.frombuffer(mapped, dtype=np.uint8)] = True
            self._table = self._known_to_zero()
        self.seen[0] = nul_seen
        if chunk.isascii():
            self.n_chars += len(chunk)
            return
        raw = np.frombuffer(chunk, dtype=np.uint8)
        self.seen[non_ascii_codes(raw)] = True
        self.n_chars += len(chunk) - int(np.count_nonzero((raw & 0xC0) == 0x80))

    def vocab(self) -> str:
        return "".join(map(chr, np.flatnonzero(self.seen)))


# What a BPE is trained on at most: its time and memory stay bounded on any corpus, and grow with the merges it must
# learn (4 KiB of text per token of vocabulary, at least 16 MiB, at most 64 MiB). Measured on 267 MB of Python source,
# vocab_size 4096, in one process (benchmarks/tokenizers.md): 64 MiB trained in 29 s peaking at 968 MiB, 32 MiB in
# 10 s at 733 MiB, 16 MiB in 5 s at 617 MiB; the whole corpus then took 3.205, 3.164 and 3.097 bytes a token (16 MiB:
# 3.4% more tokens than 64 MiB). A cache keeps the tokenizer it was built with.
BPE_SAMPLE_BYTES_PER_TOKEN = 4 << 10
BPE_SAMPLE_BYTES = (16 << 20, 64 << 20)


def bpe_sample_bytes(vocab_size: int) -> int:
    """How much of a corpus a BPE of `vocab_size` tokens is trained on at most."""
    low, high = BPE_SAMPLE_BYTES
    return min(high, max(low, vocab_size * BPE_SAMPLE_BYTES_PER_TOKEN))


class TrainingSample:
    """The chunks a BPE is trained on: all of a text up to `budget` bytes (bpe_sample_bytes), else every k-th chunk,
    spread over the whole text (the same chunks for the same text: training is deterministic)."""

    def __init__(self, total_bytes: int, budget: int) -> None:
        self.stride = max(1, -(-total_bytes // budget))
        self.chunks: list[bytes] = []
        self.n_bytes, self._seen = 0, 0

    def add(self, chunk: bytes) -> None:
        if self._seen % self.stride == 0:
            self.chunks.append(chunk)
            self.n_bytes += len(chunk)
        self._seen += 1

    def texts(self) -> Iterator[str]:
        """The sample as pieces of about 64 KiB, cut between lines (words stay whole). The trainer holds each text
        it is given pre-tokenized: 4 MiB chunks took it to 880 MB on 16 MB of text, 64 KiB pieces to 85 MB."""
        while self.chunks:
            yield from split_at_boundaries(self.chunks.pop(0))  # each chunk freed once the trainer has read it


# ------------------------------------------------------------------------------------------------------ the cache
def default_cache_dir() -> Path:
    """$XDG_CACHE_HOME/mingpt-ddp/data, or ~/.cache/mingpt-ddp/data."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "mingpt-ddp" / "data"


def entry_dir(cache_dir: Path, location: str, separator: str, tokenizer: TokenizerChoice = TokenizerChoice()) -> Path:
    """The cache folder of one (location, separator, tokenizer settings): readable name, unique hash. The
    character tokenizer adds nothing to the key (its caches are those from before tokenizers were chosen)."""
    extra = tokenizer.cache_key()
    key = hashlib.sha256(json.dumps([location, separator] + ([extra] if extra else [])).encode()).hexdigest()[:16]
    tail = location.rstrip("/").rsplit("/", 1)[-1]
    slug = re.sub(r"[^A-Za-z0-9._-]+", "_", tail)[:40].strip("._") or "corpus"
    return cache_dir / f"{slug}-{key}{'' if extra is None else '-' + tokenizer.kind}"


def open_tokens(location: str, separator: str, cache_dir: Path, build: bool = True, timeout_s: float = 3600.0,
                progress: Optional[Callable[[str, int], Callable[[int], None]]] = None,
                rebuild: bool = False, tokenizer: TokenizerChoice = TokenizerChoice()) -> Tokens:
    """The verified cache of `location` encoded with `tokenizer`, built here if it is missing, stale or damaged and
    `build` is True; otherwise waits (up to `timeout_s`) for a builder to make one. `progress(phase, total_bytes)`
    returns a callback that is given the bytes done."""
    sources = list_sources(location)
    entry = CacheEntry(entry_dir(cache_dir, location, separator, tokenizer), location, separator, tokenizer)
    deadline = time.monotonic() + timeout_s
    if build:
        return _open_or_build(entry, sources, deadline, progress, rebuild)
    judged, why = None, "no cache yet"
    while True:
        # A waiter reads (and checks the CRC of) each manifest once: re-reading an unchanged, unusable cache
        # under the shared lock, over and over, could keep the builder's exclusive lock out until the timeout.
        seen = entry.manifest_stamp()
        if seen != judged:
            if seen is not None:
                sources = list_sources(location)  # the builder may have seen newer files than this process did
            with entry.locked(shared=True, deadline=deadline):
                tokens, why = entry.read(sources)
            if tokens is not None:
                return tokens
            judged = seen
        if time.monotonic() > deadline:
            raise UsageError(f"waited {timeout_s:g} s for the data cache {entry.dir} to be built by another process "
                             f"(local rank 0; {why}); data_config.cache_timeout_s sets the wait")
        time.sleep(WAIT_POLL_S)


def _open_or_build(entry: CacheEntry, sources: list[Source], deadline: float, progress, rebuild: bool) -> Tokens:
    if not rebuild:
        with entry.locked(shared=True, deadline=deadline):
            tokens, _ = entry.read(sources)
        if tokens is not None:
            return tokens
    with entry.locked(shared=False, deadline=deadline):
        tokens, why = (None, "asked to rebuild") if rebuild else entry.read(sources)
        if tokens is not None:
            return tokens  # another process built it meanwhile
        return entry.build(sources, why, progress)


def _flock(handle, mode: int, deadline: float, folder: Path) -> bool:
    """flock, polled until `deadline` (then one line naming the last builder). False where the file system has
    no locks (some Lustre, NFS and FUSE mounts): the renames still keep every reader's view whole."""
    while True:
        try:
            fcntl.flock(handle, mode | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() > deadline:
                handle.seek(0)
                builder = handle.read().strip() or "unknown"
                raise UsageError(f"the data cache {folder} stayed locked past data_config.cache_timeout_s (the last "
                                 f"process to build it: {builder})") from None
            time.sleep(WAIT_POLL_S)
        except OSError as e:
            if e.errno in NO_LOCKS:
                log.warning("warning: the file system of %s has no file locks: two processes could build the "
                            "data cache at once", folder)
                return False
            raise


class CacheEntry:
    """One cache folder: its lock, its manifest, its token file."""

    def __init__(self, path: Path, location: str, separator: str,
                 tokenizer: TokenizerChoice = TokenizerChoice()) -> None:
        self.dir, self.location, self.separator, self.choice = path, location, separator, tokenizer
        self.manifest_path = path / "manifest.json"

    def manifest_stamp(self) -> Optional[tuple[int, int, int]]:
        """What changes whenever a manifest is written (it is replaced by a rename): inode, mtime, size."""
        try:
            stat = self.manifest_path.stat()
        except OSError:
            return None
        return stat.st_ino, stat.st_mtime_ns, stat.st_size

    # ---------------------------------------------------------------------------------------------- lock
    @contextlib.contextmanager
    def locked(self, shared: bool, deadline: float) -> Iterator[None]:
        """flock on the folder's lock file: shared to read, exclusive to build; polled, so a wait ends at
        `deadline` with one line that names the holder."""
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            handle = open(self.dir / "lock", "a+")
        except OSError as e:
            if shared and self.manifest_path.exists():  # a cache prepared elsewhere on a read-only file system
                yield
                return
            raise UsageError(f"cannot use the data cache folder {self.dir}: {e.strerror or e}; set "
                             f"data_config.cache_dir to a writable local folder") from None
        with handle:
            locked = _flock(handle, fcntl.LOCK_SH if shared else fcntl.LOCK_EX, deadline, self.dir)
            if locked and not shared:
                handle.seek(0)
                handle.truncate()
                handle.write(f"pid {os.getpid()} on {socket.gethostname()}\n")
                handle.flush()
            try:
                yield
            finally:
                if locked:
                    fcntl.flock(handle, fcntl.LOCK_UN)

    # ---------------------------------------------------------------------------------------------- reading
    def read(self, sources: list[Source]) -> tuple[Optional[Tokens], str]:
        """(the verified cache, "") or (None, why it cannot be used). A newer format is a UsageError."""
        if not self.manifest_path.exists():
            return None, "no cache yet"
        try:
            manifest = json.loads(self.manifest_path.read_text(encoding="utf-8"))
            version = manifest.get("format_version")
        except (OSError, ValueError, AttributeError) as e:
            return None, self._damaged(f"manifest.json is unreadable ({type(e).__name__})")
        if isinstance(version, int) and version > FORMAT_VERSION:
            raise UsageError(f"the data cache {self.dir} was written by a newer mingpt-ddp (format {version}; this "
                             f"one reads {FORMAT_VERSION}): update, or set data_config.cache_dir to another folder")
        if manifest.get("manifest_sha256") != _digest({k: v for k, v in manifest.items() if k != "manifest_sha256"}):
            return None, self._damaged("manifest.json does not match its checksum")
        if version != FORMAT_VERSION:
            return None, f"format {version} is older than {FORMAT_VERSION}"
        if manifest.get("sources") != [asdict(s) for s in sources]:
            return None, _changes(manifest.get("sources") or [], sources)
        try:
            return self._verified(manifest, sources)
        except (KeyError, TypeError, ValueError) as e:
            return None, self._damaged(f"manifest.json lacks a field or has a wrong one ({type(e).__name__}: {e})")

    def _verified(self, manifest: dict, sources: list[Source]) -> tuple[Optional[Tokens], str]:
        dtype = np.dtype(manifest["dtype"])
        path = self.dir / manifest["tokens_file"]
        expected = manifest["n_tokens"] * dtype.itemsize
        try:
            fd = _pinned(path)
        except OSError as e:
            return None, self._damaged(f"{path.name} is unreadable ({e.strerror or e})")
        try:
            size = os.fstat(fd).st_size
            why = f"{path.name} has {size} bytes, the manifest says {expected}" if size != expected else (
                f"{path.name} does not match its CRC-32" if _crc32_of(fd) != manifest["tokens_crc32"] else "")
        except OSError as e:
            why = f"{path.name} is unreadable ({e.strerror or e})"
        tokenizer = None
        if not why:
            tokenizer, why = self._tokenizer_of(manifest)
        if why:
            os.close(fd)
            return None, self._damaged(why)
        return Tokens(path, dtype, manifest["n_tokens"], tokenizer, sources, built_now=False, fd=fd), ""

    def _tokenizer_of(self, manifest: dict) -> tuple[Optional[Tokenizer], str]:
        """(the cache's tokenizer, "") or (None, why its file is damaged). Characters: the manifest's vocabulary;
        a BPE: the tokenizer.json beside it, checked against the SHA-256 the manifest records."""
        if self.choice.kind == "char":
            return CharTokenizer(manifest["vocab"]), ""
        path = self.dir / manifest["tokenizer_file"]
        try:
            data = path.read_bytes()
        except OSError as e:
            return None, f"{path.name} is unreadable ({e.strerror or e})"
        if hashlib.sha256(data).hexdigest() != manifest["tokenizer_sha256"]:
            return None, f"{path.name} does not match its SHA-256"
        return BpeTokenizer(data.decode("utf-8"), manifest["tokenizer_origin"]), ""

    @staticmethod
    def _damaged(what: str) -> str:
        return f"damaged: {what}"

    # ---------------------------------------------------------------------------------------------- building
    def build(self, sources: list[Source], why: str, progress=None) -> Tokens:
        """Encode the sources into a new token file and manifest (under the exclusive lock). A build that fails
        leaves nothing behind: no token file, no copy of a remote file."""
        start = time.perf_counter()
        total = sum(s.size for s in sources)
        log.log(logging.WARNING if why.startswith("damaged") else logging.INFO,
                "data: encoding %s (%d file%s, %s bytes) into the cache %s (%s)", self.location, len(sources),
                "s" if len(sources) > 1 else "", f"{total:,}", self.dir, why)
        self._remove_leftovers()
        path = self.dir / f"tokens-{uuid.uuid4().hex[:12]}.bin"
        spools: dict[str, Path] = {}
        try:
            tokenizer, most_tokens = self._first_pass(sources, spools, progress)
            # the manifest's vocabulary, or tokenizer.json
            described = len(tokenizer.chars) if isinstance(tokenizer, CharTokenizer) else len(tokenizer.json)
            self._check_room(most_tokens * tokenizer.dtype.itemsize + 4 * described, "the token file and manifest")
            crc, n_tokens = self._write_tokens(sources, spools, tokenizer, path, progress)
            if list_sources(self.location) != sources:
                raise UsageError(f"the data files of {self.location} changed while they were being encoded: run "
                                 f"again")
            self._write_manifest(sources, tokenizer, n_tokens, path.name, crc)
        except BaseException:
            path.unlink(missing_ok=True)
            raise
        finally:
            for spool in spools.values():
                spool.unlink(missing_ok=True)
            release_freed_memory()
        self._remove_leftovers()
        seconds = time.perf_counter() - start
        if isinstance(tokenizer, CharTokenizer):
            log.info("data: encoded %s characters (vocabulary of %d) in %.1f s, %.0f MB/s", f"{n_tokens:,}",
                     tokenizer.size, seconds, total / max(seconds, 1e-9) / 1e6)
        else:
            log.info("data: encoded %s tokens (%s) in %.1f s, %.1f MB/s", f"{n_tokens:,}", tokenizer.summary(),
                     seconds, total / max(seconds, 1e-9) / 1e6)
        return Tokens(path, tokenizer.dtype, n_tokens, tokenizer, sources, built_now=True, fd=_pinned(path))

    def _write_manifest(self, sources: list[Source], tokenizer: Tokenizer, n_tokens: int, name: str,
                        crc: int) -> None:
        """The manifest, last; a BPE's tokenizer.json (its full description) first, beside it."""
        manifest = {"format_version": FORMAT_VERSION, "location": self.location, "separator": self.separator,
                    "sources": [asdict(s) for s in sources]}
        if isinstance(tokenizer, CharTokenizer):
            manifest["vocab"] = tokenizer.chars
        else:
            data = tokenizer.json.encode("utf-8")
            _write_atomically(self.dir / TOKENIZER_FILE, data)
            manifest.update(tokenizer=self.choice.cache_key(), tokenizer_file=TOKENIZER_FILE,
                            tokenizer_sha256=hashlib.sha256(data).hexdigest(), tokenizer_origin=tokenizer.origin)
        manifest.update(n_tokens=n_tokens, dtype=tokenizer.dtype.name, tokens_file=name, tokens_crc32=crc)
        manifest["manifest_sha256"] = _digest(manifest)
        _write_atomically(self.manifest_path, json.dumps(manifest, ensure_ascii=False, indent=1).encode())

    def _first_pass(self, sources: list[Source], spools: dict[str, Path], progress) -> tuple[Tokenizer, int]:
        """The first pass and the tokenizer it gives: the corpus's characters, a BPE trained on a bounded sample
        of it, or the tokenizer file's; with the most tokens the text can have (for the room check)."""
        if self.choice.kind == "char":
            scan = CharScan()
            self._scan(sources, spools, progress, scan.add)
            return CharTokenizer(scan.vocab()), scan.n_chars
        if self.choice.kind == "path":
            return self.choice.load(), self._scan(sources, spools, progress, None)
        sample = TrainingSample(sum(s.size for s in sources), bpe_sample_bytes(self.choice.vocab_size))
        n_bytes = self._scan(sources, spools, progress, sample.add)
        start = time.perf_counter()
        origin = f"data_config.tokenizer=bpe, vocab_size={self.choice.vocab_size}, trained on {self.location}"
        tokenizer = BpeTokenizer.train(sample.texts(), self.choice.vocab_size, origin)
        release_freed_memory()  # the trainer's words and pair counts
        log.info("data: trained %s on %s bytes of the text in %.1f s", tokenizer.summary(), f"{sample.n_bytes:,}",
                 time.perf_counter() - start)
        return tokenizer, n_bytes

    def _scan(self, sources: list[Source], spools: dict[str, Path], progress,
              visit: Optional[Callable[[bytes], None]]) -> int:
        """The first pass: every chunk (and separator) of the text to `visit`, checked to be UTF-8; remote files
        copied into the folder on the way. Returns the text's bytes."""
        n_bytes = 0
        remote = [s for s in sources if "://" in s.path]
        if remote:
            self._check_room(sum(s.size for s in remote), "local copies of the remote files")
        tick = progress("scanning", sum(s.size for s in sources)) if progress else None
        separator = self.separator.encode("utf-8")
        trimmer = _Trimmer()
        for i, source in enumerate(sources):
            with _no_room_on_enospc(self.dir), contextlib.ExitStack() as files:
                stream = files.enter_context(_open_source(source))
                spool = None
                if source in remote:
                    spools[source.path] = self.dir / f"source-{uuid.uuid4().hex[:12]}.tmp"
                    spool = files.enter_context(open(spools[source.path], "wb"))
                for chunk in utf8_chunks(stream, source.path):
                    n_bytes += len(chunk)
                    trimmer.count(len(chunk))
                    if visit is not None:
                        visit(chunk)
                    if spool is not None:
                        spool.write(chunk)
                    if tick:
                        tick(len(chunk))
            if i + 1 < len(sources):
                n_bytes += len(separator)
                if visit is not None:
                    visit(separator)
        if n_bytes == 0:
            raise UsageError(f"data file {self.location} is empty")
        release_freed_memory()
        return n_bytes

    def _write_tokens(self, sources: list[Source], spools: dict[str, Path], tokenizer: Tokenizer, path: Path,
                      progress) -> tuple[int, int]:
        """The second pass: ids into a temporary file, renamed into place once complete. (CRC-32, count)."""
        tmp = path.with_suffix(".tmp")
        try:
            with _no_room_on_enospc(self.dir), open(tmp, "wb") as out:
                crc, count = self._encode_into(out, sources, spools, tokenizer, progress)
                out.flush()
                os.fsync(out.fileno())
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)  # a failed pass leaves nothing behind
        return crc, count

    def _encode_into(self, out: BinaryIO, sources: list[Source], spools: dict[str, Path], tokenizer: Tokenizer,
                     progress) -> tuple[int, int]:
        crc, count = 0, 0
        encoder = tokenizer.stream_encoder()
        separator = self.separator.encode("utf-8")
        tick = progress("encoding", sum(s.size for s in sources)) if progress else None
        trimmer = _Trimmer()

        def emit(ids: np.ndarray) -> None:
            nonlocal crc, count
            crc, count = zlib.crc32(ids, crc), count + ids.size
            out.write(ids)

        for i, source in enumerate(sources):
            spool = spools.get(source.path)
            with (open(spool, "rb") if spool else _open_source(source)) as stream:
                for chunk in utf8_chunks(stream, source.path):
                    emit(encoder.feed(chunk))
                    trimmer.count(len(chunk))
                    if tick:
                        tick(len(chunk))
            if i + 1 < len(sources):
                emit(encoder.feed(separator))
        emit(encoder.finish())
        return crc, count

    def _check_room(self, needed: int, what: str) -> None:
        free = shutil.disk_usage(self.dir).free
        needed += ROOM_MARGIN
        if needed > free:
            raise _no_room(self.dir, f"{what}: {needed:,} bytes needed, {free:,} free")

    def _remove_leftovers(self) -> None:
        """Under the exclusive lock: temporary files of builds that died, and token files the manifest does not
        name, unless a process still reads one (it holds a shared flock on it: see `_pinned`)."""
        current = self._named_tokens_file()
        for path in self.dir.iterdir():
            if path.suffix == ".tmp":
                path.unlink(missing_ok=True)
            elif path.name.startswith("tokens-") and path.name != current:
                _unlink_unless_in_use(path)

    def _named_tokens_file(self) -> str:
        try:
            return str(json.loads(self.manifest_path.read_text(encoding="utf-8")).get("tokens_file", ""))
        except (OSError, ValueError, AttributeError):
            return ""


def _unlink_unless_in_use(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        path.unlink(missing_ok=True)
    except OSError:
        pass  # in use (or no locks here: then kept, and removed by a later build)
    finally:
        os.close(fd)


def _changes(old: list[dict], sources: list[Source]) -> str:
    before = {s["path"]: s for s in old}
    now = {s.path: asdict(s) for s in sources}
    added, removed = len(now.keys() - before.keys()), len(before.keys() - now.keys())
    changed = sum(1 for p in now.keys() & before.keys() if now[p] != before[p])
    return f"the files changed since it was built ({added} added, {removed} removed, {changed} modified)"


def _no_room(folder: Path, detail: str) -> UsageError:
    return UsageError(f"no room for the data cache in {folder} ({detail}): free some space or set "
                      f"data_config.cache_dir to a folder on a larger disk")


@contextlib.contextmanager
def _no_room_on_enospc(folder: Path) -> Iterator[None]:
    """A full disk while writing, flushing, syncing or closing -> one line, not a traceback."""
    try:
        yield
    except OSError as e:
        if e.errno == errno.ENOSPC:
            raise _no_room(folder, "the disk filled up while it was being written") from None
        raise


def _write_atomically(path: Path, data: bytes) -> None:
    tmp = path.with_name(f"{path.name}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        with _no_room_on_enospc(path.parent), open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    fsync_folder(path.parent)  # the rename itself survives a crash


def _digest(body: dict) -> str:
    return hashlib.sha256(json.dumps(body, sort_keys=True, ensure_ascii=False).encode()).hexdigest()


def _crc32_of(fd: int, block: int = 16 << 20) -> int:
    """The CRC-32 of a whole open file, read from its start."""
    crc, offset = 0, 0
    buffer = bytearray(block)
    view = memoryview(buffer)
    while n := os.preadv(fd, [buffer], offset):
        crc, offset = zlib.crc32(view[:n], crc), offset + n
    return crc
