"""The data: UTF-8 text from files, folders, globs or fsspec URLs, encoded once into a token cache (token_cache.py)
by the tokenizer data_config.tokenizer names (characters by default, or a byte-level BPE: mingpt/data/tokenizer.py),
served as (x, y) windows read from it, in an epoch order that needs no memory.

    >>> corpus = CharCorpus.load(DataConfig(path="data/input.txt", block_size=128))
    >>> train, val = corpus.train_dataset(), corpus.val_dataset()
    >>> x, y = train[0]            # int64 ids of block_size tokens (characters by default), y shifted by one
    >>> val.token_bytes[y].sum()   # the UTF-8 bytes of the text the targets stand for (val_bpb's denominator)

The text is split *before* windows are cut: the first `train_split` of the tokens train, the rest validate, so no
validation window shares a token with a training window. The windows are read by position from the
cache's token file (`TokenFile`), so a process's memory does not grow with the corpus and the ranks of a node
share its pages through the page cache. The epoch order (`EpochOrder`) is a keyed bijection on the window
indices: a pure function of (seed, epoch), computed a block at a time. Knows nothing of ranks beyond which
positions of the order are one's own.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional, Sequence

import numpy as np
import torch
from torch.utils.data import Dataset, Sampler

from mingpt.data.token_cache import TokenFile, Tokens, default_cache_dir, open_tokens
from mingpt.data.tokenizer import DEFAULT_BPE_VOCAB, REQUIREMENTS, CharTokenizer, Tokenizer, TokenizerChoice
from mingpt.errors import UsageError
from mingpt.storage.locations import check_location, resolve_path


@dataclass
class DataConfig:
    """Where the text is, how its files are joined, where the encoded cache lives, how windows are cut."""

    path: str = "data/input.txt"
    """UTF-8 text: a file, folder or glob, local (relative = to the project folder) or an fsspec URL (s3://b/x/*.txt)"""
    separator: str = "\n"
    """text put between two files of a folder or glob (joined in sorted order)

    On the command line, where Hydra keeps a backslash as it is, \\n, \\t and \\\\ mean a newline, a tab and a
    backslash: data_config.separator='\\n\\n' puts an empty line between files."""
    cache_dir: Optional[str] = None
    """local folder of the encoded-corpus cache (relative = to the project); null = ~/.cache/mingpt-ddp/data"""
    cache_timeout_s: float = 3600.0
    """how long a process waits for another (local rank 0, another job) to build the cache"""
    block_size: int = 256
    """tokens of context per training window (characters under the character tokenizer)"""
    train_split: float = 0.9
    """fraction of the text (from the start) used for training; the rest is validation"""
    truncate: float = 1.0
    """fraction of the text to use at all, from the start (1.0 = everything)"""
    tokenizer: str = "char"
    """char (each character a token) | bpe (a byte-level BPE trained on the text) | path: a tokenizer.json or folder

    bpe and a path need Hugging Face tokenizers (requirements-hf.txt). A BPE is trained once per corpus and
    vocab_size and kept with the token cache; a path is read offline, and must be a byte-level BPE (GPT-2's)."""
    vocab_size: int = DEFAULT_BPE_VOCAB
    """tokenizer=bpe: the tokens of the trained BPE (at least 256: every byte is one)"""

    def __post_init__(self) -> None:
        if self.block_size <= 0:
            raise UsageError(f"data_config.block_size must be positive, got {self.block_size}")
        if not 0.0 < self.train_split < 1.0:
            raise UsageError(f"data_config.train_split must be in (0, 1), got {self.train_split}")
        if not 0.0 < self.truncate <= 1.0:
            raise UsageError(f"data_config.truncate must be in (0, 1], got {self.truncate}")
        if not self.cache_timeout_s > 0:
            raise UsageError(f"data_config.cache_timeout_s must be positive, got {self.cache_timeout_s}")
        check_location(self.path, "data_config.path")  # a malformed URL fails here, before Hydra makes a run folder
        try:
            unescape(self.separator).encode("utf-8")
        except UnicodeEncodeError:
            raise UsageError(f"data_config.separator {self.separator!r} is not valid text (a lone surrogate)") from None
        if self.cache_dir is not None and check_location(self.cache_dir, "data_config.cache_dir"):
            raise UsageError(f"data_config.cache_dir must be a local folder (the cache is memory-mapped), got "
                             f"{self.cache_dir!r}")
        choice = self.tokenizer_choice()  # a missing tokenizer file or a vocab_size out of range: one line, here
        if choice.kind != "char":
            import importlib.util

            if importlib.util.find_spec("tokenizers") is None:
                raise UsageError(f"data_config.tokenizer={self.tokenizer} needs the tokenizers package: pip install "
                                 f"-r {REQUIREMENTS}")

    def tokenizer_choice(self) -> TokenizerChoice:
        """The tokenizer settings as the token cache takes them (a path: its file read and hashed)."""
        return TokenizerChoice.from_settings(self.tokenizer, self.vocab_size)

    def cache_folder(self) -> Path:
        if self.cache_dir is None:
            return default_cache_dir()
        return Path(resolve_path(self.cache_dir))


ESCAPES = {"\\n": "\n", "\\t": "\t", "\\\\": "\\"}


def unescape(text: str) -> str:
    """\\n, \\t and \\\\ as a newline, a tab and a backslash; anything else as it is."""
    return re.sub(r"\\[nt\\]", lambda m: ESCAPES[m.group()], text)


CharVocab = CharTokenizer  # its name before the tokenizer seam (mingpt/data/tokenizer.py)


class CharDataset(Dataset):
    """Windows of `block_size + 1` consecutive ids of one split, starting every `stride` characters.

    Item i is `(data[s : s + block_size], data[s + 1 : s + block_size + 1])` with `s = i * stride`, as int64.
    Training uses stride 1 (every position); evaluation uses stride `block_size`, so every character is predicted
    exactly once. `data` is the ids: a `TokenFile` (a stretch of the token cache, read by position), or an array
    or tensor in memory. `windows(indices)` reads a whole batch at once; `__getitems__` lets a DataLoader use it.
    `token_bytes` (the UTF-8 bytes each id stands for, by id) lets the trainer turn a loss per token into bits per
    byte of the text (val_bpb), which compares across tokenizers.
    """

    def __init__(self, data: TokenFile | np.ndarray | torch.Tensor, block_size: int, stride: int = 1,
                 token_bytes: Optional[np.ndarray] = None) -> None:
        if isinstance(data, torch.Tensor):
            data = data.numpy()
        if len(data) < block_size + 1:
            raise ValueError(f"{len(data)} tokens cannot make a window of {block_size + 1}")
        self.data = data
        self.block_size = block_size
        self.stride = stride
        self.token_bytes = token_bytes
        self._offsets = np.arange(block_size + 1)

    def __len__(self) -> int:
        return (len(self.data) - self.block_size - 1) // self.stride + 1

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= i < len(self):
            raise IndexError(f"window {i} out of range for {len(self)} windows")
        window = self.windows([i])[0]
        return window[:-1], window[1:]

    def __getitems__(self, indices: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        windows = self.windows(indices)
        return windows[:, :-1], windows[:, 1:]

    def windows(self, indices: Sequence[int]) -> torch.Tensor:
        """The windows `indices` as one contiguous (batch, block_size + 1) int64 tensor: x = w[:, :-1] and
        y = w[:, 1:]. What the trainer copies to the GPU (one pinned block; x and y are sliced there)."""
        starts = np.asarray(indices, dtype=np.int64) * self.stride
        if isinstance(self.data, TokenFile):
            ids = self.data.read(starts, self.block_size + 1)
        else:
            ids = self.data[starts[:, None] + self._offsets]
        return torch.from_numpy(ids.astype(np.int64))


class CharCorpus:
    """The encoded text (in the token cache), its tokenizer, and the contiguous train/validation split."""

    def __init__(self, tokens: Tokens | np.ndarray, tokenizer: Tokenizer, cfg: DataConfig,
                 source: str = "<text>") -> None:
        self.cfg, self.tokenizer, self.source = cfg, tokenizer, source
        self.tokens = tokens if isinstance(tokens, Tokens) else None
        total = tokens.n_tokens if isinstance(tokens, Tokens) else len(tokens)
        self.n_tokens = int(total * cfg.truncate)
        if self.n_tokens == 0:
            raise UsageError(f"data file {source} is empty")
        self._array = tokens if self.tokens is None else None
        self.n_train = int(self.n_tokens * cfg.train_split)
        need = cfg.block_size + 1
        for split, n in (("training", self.n_train), ("validation", self.n_tokens - self.n_train)):
            if n < need:
                raise UsageError(
                    f"data file {source} is too short: the {split} split has {n} {self._unit} but "
                    f"block_size + 1 = {need} are needed (use more text, a smaller block_size or another train_split)"
                )

    @property
    def vocab(self) -> Tokenizer:
        """The tokenizer, by its name from before the tokenizer seam (a CharTokenizer has `chars`, as CharVocab)."""
        return self.tokenizer

    @property
    def _unit(self) -> str:
        return "characters" if isinstance(self.tokenizer, CharTokenizer) else "tokens"

    @classmethod
    def load(cls, cfg: DataConfig, build: bool = True, progress=None, rebuild: bool = False) -> CharCorpus:
        """The corpus of `cfg.path` from its cache (encoded with `cfg.tokenizer`), built here first if needed and
        `build` (main.py: on local rank 0; the other ranks wait for it)."""
        location = resolve_path(cfg.path)
        tokens = open_tokens(location, unescape(cfg.separator), cfg.cache_folder(), build, cfg.cache_timeout_s,
                             progress, rebuild, cfg.tokenizer_choice())
        return cls(tokens, tokens.tokenizer, cfg, source=location)

    @classmethod
    def from_text(cls, text: str, cfg: DataConfig, tokenizer: Optional[Tokenizer] = None) -> CharCorpus:
        """A corpus of an in-memory text (no cache): tests and small experiments. Characters unless `tokenizer`."""
        tokenizer = tokenizer or CharTokenizer(text)
        return cls(tokenizer.encode(text), tokenizer, cfg)

    def describe(self) -> str:
        """What a run logs: tokens, where from, tokenizer, cache folder."""
        where = self.source
        if self.tokens is not None and len(self.tokens.sources) > 1:
            where = f"{len(self.tokens.sources)} files of {self.source}"
        cache = f" (cache {self.tokens.path.parent})" if self.tokens is not None else ""
        if isinstance(self.tokenizer, CharTokenizer):
            return f"{self.n_tokens:,} characters of {where}, vocabulary of {len(self.tokenizer)}{cache}"
        return f"{self.n_tokens:,} tokens of {where}, {self.tokenizer.summary()}{cache}"

    def ids(self, start: int, stop: int) -> np.ndarray:
        """The ids [start, stop) of the (truncated) corpus, as an array (a memory map of the cache)."""
        if self.tokens is not None:
            return self.tokens.array(start, stop - start)
        return self._array[start:stop]

    def _part(self, start: int, stop: int) -> TokenFile | np.ndarray:
        return self.tokens.part(start, stop - start) if self.tokens is not None else self._array[start:stop]

    def train_dataset(self) -> CharDataset:
        return CharDataset(self._part(0, self.n_train), self.cfg.block_size)

    def val_dataset(self) -> CharDataset:
        """Non-overlapping windows: each validation token is a target exactly once. Knows each id's bytes
        (`token_bytes`, for val_bpb)."""
        return CharDataset(self._part(self.n_train, self.n_tokens), self.cfg.block_size, stride=self.cfg.block_size,
                           token_bytes=self.tokenizer.token_bytes())


# ------------------------------------------------------------------------------------------------ the epoch order
EPOCH_ORDER = "feistel-1"  # what snapshots record as `progress.epoch_order`
LEGACY_ORDER = "randperm"  # snapshots written before it (no `epoch_order`): torch.randperm of the whole epoch
_U64 = (1 << 64) - 1


def _splitmix64(z: np.ndarray) -> np.ndarray:
    """SplitMix64's output function: a strong 64-bit mixer (uint64 arithmetic wraps, shifts are logical)."""
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


class EpochOrder:
    """The order of one epoch: a keyed pseudorandom bijection of [0, n), position -> window index.

    A balanced Feistel network on 2h bits (the smallest h with 4^h >= n) is a bijection of [0, 4^h) for any round
    function; cycle walking (applying it again while the result is >= n) restricts it to a bijection of [0, n),
    with fewer than 4 applications on average since 4^h < 4n. The round keys come from (seed, epoch) alone. Memory
    O(1), the same cost for every position, any position directly: no permutation is ever materialised.
    """

    ROUNDS = 6

    def __init__(self, n: int, seed: int, epoch: int) -> None:
        if n <= 0:
            raise ValueError(f"an epoch order needs at least one index, got {n}")
        self.n = n
        self.half = max(1, ((n - 1).bit_length() + 1) // 2)
        self.mask = np.uint64((1 << self.half) - 1)
        base = _splitmix64(np.array([(seed * 0x9E3779B97F4A7C15 + epoch) & _U64], dtype=np.uint64))
        rounds = np.arange(1, self.ROUNDS + 1, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
        self.keys = [np.uint64(k) for k in _splitmix64(base + rounds)]

    def __call__(self, positions: np.ndarray) -> np.ndarray:
        """The window indices at `positions` (integers in [0, n)), as int64."""
        out = self._permute(np.asarray(positions, dtype=np.uint64))
        walking = np.flatnonzero(out >= self.n)
        while walking.size:
            out[walking] = self._permute(out[walking])
            walking = walking[out[walking] >= self.n]
        return out.astype(np.int64)

    def _permute(self, x: np.ndarray) -> np.ndarray:
        half = np.uint64(self.half)
        left, right = x >> half, x & self.mask
        for key in self.keys:
            left, right = right, left ^ (_splitmix64(right ^ key) & self.mask)
        return (left << half) | right


class ResumableDistributedSampler(Sampler[int]):
    """This rank's share of an epoch's order, from a global position in it.

    The order depends only on (seed, epoch), never on the world size; rank r takes positions start + r,
    start + r + W, ... so the first k*W positions are exactly the samples consumed after k per-rank samples, and a
    resume at position p skips nothing by iterating and stays valid with a different number of processes. Like
    DistributedSampler, every rank gets the same count: positions past the end wrap to the start of what was left.
    Indices are computed a block at a time: memory independent of the number of windows.
    """

    BLOCK = 4096

    def __init__(self, n: int, num_replicas: int, rank: int, seed: int) -> None:
        self.n, self.num_replicas, self.rank, self.seed = n, num_replicas, rank, seed
        self.epoch, self.start, self.order = 0, 0, EPOCH_ORDER

    def set_epoch(self, epoch: int, start: int = 0, order: str = EPOCH_ORDER) -> None:
        self.epoch, self.start, self.order = epoch, start, order

    def _remaining(self) -> int:
        return max(0, self.n - self.start)

    def __len__(self) -> int:
        return math.ceil(self._remaining() / self.num_replicas)

    def __iter__(self) -> Iterator[int]:
        if self.order == LEGACY_ORDER:
            return self._legacy()
        return self._blocks()

    def _blocks(self) -> Iterator[int]:
        order, remaining, count = EpochOrder(self.n, self.seed, self.epoch), self._remaining(), len(self)
        for first in range(0, count, self.BLOCK):
            positions = self.rank + np.arange(first, min(count, first + self.BLOCK), dtype=np.int64) * self.num_replicas
            yield from order(self.start + positions % remaining).tolist()

    def _legacy(self) -> Iterator[int]:
        """The order before EPOCH_ORDER, for the rest of an epoch begun by an older snapshot (small corpora)."""
        generator = torch.Generator()
        generator.manual_seed(self.seed + self.epoch)
        order = torch.randperm(self.n, generator=generator)[self.start :]
        padding = len(self) * self.num_replicas - order.numel()
        if padding:
            order = torch.cat([order, order[:padding]])
        return iter(order[self.rank :: self.num_replicas].tolist())
