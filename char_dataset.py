"""Character-level data: read UTF-8 text through fsspec, build a vocabulary, serve (x, y) windows.

    >>> corpus = CharCorpus.load(DataConfig(path="data/input.txt", block_size=128))
    >>> train, val = corpus.train_dataset(), corpus.val_dataset()
    >>> x, y = train[0]            # two int64 views of the encoded text, y shifted by one character

The text is split *before* windows are cut: the first `train_split` of the characters train, the rest validate,
so no validation window shares a character with a training window. Knows nothing of ranks or models.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import fsspec
import torch
from torch.utils.data import Dataset

from errors import UsageError, first_line

PROJECT_DIR = Path(__file__).resolve().parent


@dataclass
class DataConfig:
    """Where the text is and how it is cut into training windows."""

    path: str = "data/input.txt"
    """UTF-8 text: a local path (relative = to the project folder, not the cwd) or an fsspec URL"""
    block_size: int = 256
    """characters of context per training window"""
    train_split: float = 0.9
    """fraction of the text (from the start) used for training; the rest is validation"""
    truncate: float = 1.0
    """fraction of the text to use at all, from the start (1.0 = everything)"""

    def __post_init__(self) -> None:
        if self.block_size <= 0:
            raise UsageError(f"data_config.block_size must be positive, got {self.block_size}")
        if not 0.0 < self.train_split < 1.0:
            raise UsageError(f"data_config.train_split must be in (0, 1), got {self.train_split}")
        if not 0.0 < self.truncate <= 1.0:
            raise UsageError(f"data_config.truncate must be in (0, 1], got {self.truncate}")
        check_location(self.path, "data_config.path")  # a malformed URL fails here, before Hydra makes a run folder


# What starts a URL: a scheme (RFC 3986) and a colon. Such a location is parsed as a URL or refused; it is never
# taken for a local path (`s3:/bucket/run` would otherwise be a local folder named `s3:`). `runs/a:b` is local.
URL_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*:")
# Protocols whose URLs name a path without a bucket or host (file:///abs/path, memory://x, hdfs:///user/x); every
# other protocol needs one: s3://BUCKET/..., http://HOST/...
HOSTLESS_PROTOCOLS = frozenset({"file", "local", "memory", "hdfs", "arrow_hdfs"})
HOST_PROTOCOLS = frozenset({"http", "https", "ftp", "sftp", "ssh", "smb", "webdav", "webhdfs"})  # for the messages


def check_location(location: str, what: str = "storage location") -> bool:
    """True for a URL, False for a local path; a UsageError (one line) for anything that looks like a URL but is
    not a usable one. The one check behind every storage location (data, snapshots, sample.py, snapshot.py).

    The rule: a location that starts with a scheme and a colon (`^[A-Za-z][A-Za-z0-9+.-]*:`) is a URL, and must be
    `PROTOCOL://...` with a protocol fsspec knows and a non-empty bucket or host (`file:///ABSOLUTE/PATH` for
    files); chained URLs (`simplecache::s3://bucket/x`) are checked part by part. Anything else is a local path,
    which may not contain `://` or `::` (fsspec would read those as a URL). A local name that starts with
    `word:` is written `./word:...`.
    """
    if not location.strip():
        raise UsageError(f"{what} is empty")
    if not URL_SCHEME.match(location):
        if "://" in location or "::" in location:
            raise UsageError(f"{what} {location!r} is not a URL (it does not start with PROTOCOL://) nor a local path "
                             f"(a local path cannot contain '://' or '::')")
        return False
    known = set(fsspec.available_protocols())
    parts = location.split("::")
    for i, part in enumerate(parts):
        if i < len(parts) - 1 and part in known:
            continue  # the bare protocol of a chain link, as in simplecache::s3://...
        _check_url(part, location, what, known)
    return True


def _check_url(url: str, location: str, what: str, known: set[str]) -> None:
    scheme = URL_SCHEME.match(url)
    if scheme is None:
        raise UsageError(f"{what} {location!r}: {url!r} in a chained URL is not a URL (PROTOCOL://...)")
    protocol, rest = scheme.group()[:-1], url[scheme.end():]
    if protocol not in known:
        hint = f"did you mean {protocol.lower()}://?" if protocol.lower() in known else (
            "fsspec knows s3, gs, az, http, https, ftp, sftp, file, memory, ...")
        local = "" if rest.startswith("//") else f"; a local path is written ./{location}"
        raise UsageError(f"{what} {location!r}: unknown protocol {protocol!r} ({hint}{local})")
    if protocol in ("file", "local"):
        shape = f"{protocol}:///ABSOLUTE/PATH"
    elif protocol in HOSTLESS_PROTOCOLS:
        shape = f"{protocol}://PATH"
    else:
        shape = f"{protocol}://{'HOST' if protocol in HOST_PROTOCOLS else 'BUCKET'}/PATH"
    if not rest.startswith("//"):
        raise UsageError(f"{what} {location!r} is not a complete URL: {protocol + ':'!r} must be followed by '//' "
                         f"(expected {shape})")
    rest = rest[2:]
    if protocol in ("file", "local") and rest and not rest.startswith("/"):
        # fsspec would take file://runs/x relative to the current directory, not to the project
        raise UsageError(f"{what} {location!r}: a {protocol} URL needs an absolute path (expected {shape}; a "
                         f"relative local path is written without {protocol}://)")
    if not rest or (protocol not in HOSTLESS_PROTOCOLS and not rest.split("/", 1)[0]):
        missing = "path" if protocol in HOSTLESS_PROTOCOLS else ("host" if protocol in HOST_PROTOCOLS else "bucket")
        raise UsageError(f"{what} {location!r}: no {missing} after '{protocol}://' (expected {shape})")


def resolve_path(path: str) -> str:
    """A URL stays as it is; a relative local path is taken relative to the project, not the cwd. Anything that
    looks like a URL but is not a usable one is a UsageError (see `check_location`)."""
    if check_location(path):
        return path
    local = Path(path).expanduser()
    return str(local if local.is_absolute() else PROJECT_DIR / local)


def read_text(path: str) -> str:
    """Read a whole UTF-8 text file from any fsspec location, with user-readable errors."""
    url = resolve_path(path)
    try:
        with fsspec.open(url, "rb") as f:
            raw = f.read()
    except FileNotFoundError as e:
        cause = e.__cause__
        if isinstance(cause, OSError) and not isinstance(cause, FileNotFoundError):
            # fsspec's HTTP filesystem reports an unreachable server as FileNotFoundError; say what really failed
            raise _unreadable(url, cause) from None
        raise UsageError(f"data file not found: {url}") from None
    except Exception as e:  # no permission, unreachable server, missing credentials, unknown protocol, ...
        raise _unreadable(url, e) from None
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise UsageError(f"data file {url} is not UTF-8 text (invalid byte at offset {e.start})") from None


def _unreadable(url: str, error: BaseException) -> UsageError:
    # An error without any text still says what it is through its repr.
    return UsageError(f"cannot read data file {url}: {type(error).__name__}: {first_line(error) or repr(error)}")


class CharVocab:
    """Sorted set of characters <-> integer ids. Stored in snapshots as a plain string."""

    def __init__(self, chars: Sequence[str]) -> None:
        self.chars = "".join(sorted(set(chars)))
        self._index = {ch: i for i, ch in enumerate(self.chars)}

    def __len__(self) -> int:
        return len(self.chars)

    def encode(self, text: str) -> torch.Tensor:
        unknown = sorted(set(text) - self._index.keys())
        if unknown:
            raise UsageError(f"characters not in the vocabulary: {''.join(unknown)!r}")
        return torch.tensor([self._index[ch] for ch in text], dtype=torch.long)

    def decode(self, ids: Sequence[int] | torch.Tensor) -> str:
        if isinstance(ids, torch.Tensor):
            ids = ids.tolist()
        return "".join(self.chars[i] for i in ids)


class CharDataset(Dataset):
    """Windows of `block_size + 1` consecutive characters of one encoded split, starting every `stride` characters.

    Item i is `(data[s : s + block_size], data[s + 1 : s + block_size + 1])` with `s = i * stride`, two views of the
    same tensor. Training uses stride 1 (every position); evaluation uses stride `block_size`, so every character
    is predicted exactly once.
    `__getitems__` lets a DataLoader fetch a whole batch with one indexing operation instead of per-sample
    Python work and collation; `windows` is the same batch before it is split into x and y.
    """

    def __init__(self, data: torch.Tensor, block_size: int, stride: int = 1) -> None:
        if data.numel() < block_size + 1:
            raise ValueError(f"{data.numel()} characters cannot make a window of {block_size + 1}")
        self.data = data
        self.block_size = block_size
        self.stride = stride
        self._offsets = torch.arange(block_size + 1)

    def __len__(self) -> int:
        return (self.data.numel() - self.block_size - 1) // self.stride + 1

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= i < len(self):
            raise IndexError(f"window {i} out of range for {len(self)} windows")
        start = i * self.stride
        window = self.data[start : start + self.block_size + 1]
        return window[:-1], window[1:]

    def __getitems__(self, indices: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        windows = self.windows(indices)
        return windows[:, :-1], windows[:, 1:]

    def windows(self, indices: Sequence[int]) -> torch.Tensor:
        """The windows `indices` as one contiguous (batch, block_size + 1) tensor, one gather: x = w[:, :-1] and
        y = w[:, 1:]. What the trainer copies to the GPU (one pinned block; x and y are sliced there)."""
        starts = torch.as_tensor(indices, dtype=torch.long) * self.stride
        return self.data[starts[:, None] + self._offsets]


class CharCorpus:
    """The encoded text, its vocabulary, and the contiguous train/validation split."""

    def __init__(self, text: str, cfg: DataConfig, source: str = "<text>") -> None:
        text = text[: int(len(text) * cfg.truncate)]
        if not text:
            raise UsageError(f"data file {source} is empty")
        self.cfg = cfg
        self.vocab = CharVocab(text)
        self.data = self.vocab.encode(text)
        self.n_train = int(len(text) * cfg.train_split)
        need = cfg.block_size + 1
        for split, n in (("training", self.n_train), ("validation", len(text) - self.n_train)):
            if n < need:
                raise UsageError(
                    f"data file {source} is too short: the {split} split has {n} characters but "
                    f"block_size + 1 = {need} are needed (use more text, a smaller block_size or another train_split)"
                )

    @classmethod
    def load(cls, cfg: DataConfig) -> "CharCorpus":
        return cls(read_text(cfg.path), cfg, source=resolve_path(cfg.path))

    def train_dataset(self) -> CharDataset:
        return CharDataset(self.data[: self.n_train], self.cfg.block_size)

    def val_dataset(self) -> CharDataset:
        """Non-overlapping windows: each validation character is a target exactly once."""
        return CharDataset(self.data[self.n_train :], self.cfg.block_size, stride=self.cfg.block_size)
