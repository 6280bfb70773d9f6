"""The tokenizer seam: text <-> ids, one interface for the data, snapshots, sample.py, prepare.py and the Hugging Face
export.

    tokenizer = tokenizer_from_description(snapshot_tokenizer(snapshot))   # what a snapshot generates text with
    ids = tokenizer.encode("ROMEO:")       # numpy ids, in the smallest of uint8/uint16/uint32 that holds every id
    tokenizer.decode(ids)                  # "ROMEO:"
    tokenizer.describe()                   # a dict of plain types that rebuilds it: what snapshots record

Two kinds (`data_config.tokenizer`):
- `char`, the default: the sorted characters of the corpus, an id being a character's position among them (the
  ids, and so the caches and snapshots, are those of the code before this seam).
- `bpe`: a byte-level BPE of Hugging Face `tokenizers` (requirements-hf.txt), either trained on the corpus by the
  token cache (`data_config.vocab_size` entries) or read from a path (a tokenizer.json, or a Hugging Face folder
  holding one, such as GPT-2's), offline. Byte-level: its vocabulary holds every byte, so any UTF-8 text encodes.
  Its description is the whole tokenizer.json, so that a snapshot alone generates text.

`tokenizers` is imported only when a BPE is used: the character path never needs it. Where `tiktoken` is
installed (requirements-hf.txt) and gives the same ids (`FastBpe`: GPT-2's pre-tokenizer, plain merges), the token
cache encodes a BPE with it, ~5x faster on one core and on every core; otherwise with `tokenizers` itself.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
from abc import ABC, abstractmethod
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Iterable, Iterator, Optional, Sequence

import numpy as np

from mingpt.errors import UsageError, first_line

log = logging.getLogger("mingpt")
UNICODE_SIZE = 0x110000
CONTINUATION_BYTES = bytes(range(0x80, 0xC0))
ASCII_MARK = 0xFF  # an ASCII character's id is below 128 (ASCII sorts first): 0xFF marks the other characters
MIN_BPE_VOCAB = 256  # a byte-level BPE holds every byte before its first merge
MAX_VOCAB = 1 << 32  # the most ids uint32 (the widest id type) holds
DEFAULT_BPE_VOCAB = 4096
TOKENIZER_FILE = "tokenizer.json"
REQUIREMENTS = "requirements-hf.txt"
PARALLELISM = "TOKENIZERS_PARALLELISM"  # tokenizers' switch of its own threads


def id_dtype(vocab_size: int) -> np.dtype:
    """The smallest unsigned type that holds every id."""
    return np.dtype(np.uint8 if vocab_size <= 1 << 8 else np.uint16 if vocab_size <= 1 << 16 else np.uint32)


class Tokenizer(ABC):
    """Text <-> ids. `describe()` is plain data (str, int, dict) that `tokenizer_from_description` rebuilds it from."""

    kind: ClassVar[str]

    @property
    @abstractmethod
    def size(self) -> int:
        """How many ids there are: the model's vocab_size."""

    def __len__(self) -> int:
        return self.size

    @property
    def dtype(self) -> np.dtype:
        return id_dtype(self.size)

    @abstractmethod
    def encode(self, text: str) -> np.ndarray:
        """The ids of `text`, as `dtype`."""

    @abstractmethod
    def decode(self, ids: Sequence[int] | np.ndarray | Any) -> str:
        """The text of `ids` (a list, numpy array or tensor)."""

    @abstractmethod
    def describe(self) -> dict:
        """Everything that rebuilds this tokenizer, as plain types: what a snapshot records."""

    @abstractmethod
    def token_bytes(self) -> np.ndarray:
        """The UTF-8 bytes each id stands for, as int64 by id: bits per byte from a loss per token."""

    @abstractmethod
    def summary(self) -> str:
        """A few words for log lines: "65 characters", "a byte-level BPE of 4,096 tokens"."""

    def encode_bytes(self, chunk: bytes) -> np.ndarray:
        """The ids of UTF-8 text (ending on a character boundary)."""
        return self.encode(chunk.decode("utf-8"))

    def stream_encoder(self) -> StreamEncoder:
        """An encoder of a text given in chunks that end on character boundaries (the token cache's)."""
        return StreamEncoder(self)


class StreamEncoder:
    """Encodes a text given chunk by chunk (each ending on a character boundary) into the ids of the whole text:
    each chunk alone, as characters are."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer

    def feed(self, chunk: bytes) -> np.ndarray:
        return self.tokenizer.encode_bytes(chunk)

    def finish(self) -> np.ndarray:
        """The ids of what is still held back (the end of the text)."""
        return np.zeros(0, dtype=self.tokenizer.dtype)


class PieceStreamEncoder(StreamEncoder):
    """A BPE's stream encoder. A chunk alone would not do (a word cut in two is two other words): a chunk's text is
    encoded up to its last line that starts with an ASCII letter or digit, and the rest carried on. No pre-tokenizer
    in use (GPT-2's, Llama 3's) joins a newline with a letter or digit after it, so the pieces' ids are the whole
    text's. A carry that grows past `max_carry` bytes without such a line is cut where it ends."""

    def __init__(self, tokenizer: BpeTokenizer, max_carry: int = 16 << 20) -> None:
        super().__init__(tokenizer)
        self.max_carry, self._carry = max_carry, b""

    def feed(self, chunk: bytes) -> np.ndarray:
        text = self._carry + chunk
        cut = last_boundary(text, 0, len(text))
        if cut <= 0:
            cut = len(text) if len(text) > self.max_carry else 0
        self._carry = text[cut:]
        return self.tokenizer.encode_pieces(split_at_boundaries(text[:cut]))

    def finish(self) -> np.ndarray:
        text, self._carry = self._carry, b""
        return self.tokenizer.encode_pieces(split_at_boundaries(text))


ALPHANUMERIC = frozenset(b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789")
PIECE_BYTES = 64 << 10  # what one encode_batch item holds: enough pieces per chunk to keep every core busy
BATCH_PIECES = 16  # pieces per encode_batch call: its Encoding objects (~100 bytes a token) stay ~100 MB at most


def last_boundary(text: bytes, low: int, high: int) -> int:
    """The largest p in (low, high] that starts a line with an ASCII letter or digit (text[p - 1] is a newline);
    -1 if none. Where a BPE's pieces may be cut without changing the ids (StreamEncoder)."""
    end = high
    while True:
        newline = text.rfind(b"\n", low, end)
        if newline < 0:
            return -1
        if newline + 1 < len(text) and text[newline + 1] in ALPHANUMERIC:
            return newline + 1
        end = newline


def split_at_boundaries(text: bytes, piece_bytes: int = PIECE_BYTES) -> list[str]:
    """`text` as pieces of about `piece_bytes` cut at `last_boundary`s (the pieces' ids are the whole's)."""
    pieces, start = [], 0
    while len(text) - start > piece_bytes:
        cut = last_boundary(text, start, start + piece_bytes)
        if cut <= start:
            cut = last_boundary(text, start, len(text))  # the next boundary after a long line
            if cut <= start:
                break
        pieces.append(text[start:cut].decode("utf-8"))
        start = cut
    if start < len(text):
        pieces.append(text[start:].decode("utf-8"))
    return pieces


# ------------------------------------------------------------------------------------------------------- characters
def non_ascii_codes(chunk: np.ndarray) -> np.ndarray:
    """The code points of a chunk's non-ASCII characters, in order (its bytes >= 0x80 are exactly their
    encodings, so they decode on their own)."""
    text = chunk[chunk >= 0x80].tobytes().decode("utf-8")
    return np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)


class Encoder:
    """Text bytes -> ids of a sorted vocabulary, vectorised; a character outside the vocabulary is a UsageError."""

    def __init__(self, vocab: str) -> None:
        self.dtype = id_dtype(len(vocab))
        codes = np.frombuffer(vocab.encode("utf-32-le"), dtype=np.uint32)
        self._known = np.zeros(UNICODE_SIZE, dtype=bool)
        self._known[codes] = True
        self._ids = np.zeros(UNICODE_SIZE, dtype=self.dtype)
        self._ids[codes] = np.arange(len(codes), dtype=self.dtype)
        ascii_table = np.full(256, ASCII_MARK, dtype=np.uint8)
        ascii_codes = codes[codes < 0x80]
        ascii_table[ascii_codes] = self._ids[ascii_codes]
        self._ascii_table = ascii_table.tobytes()

    def encode(self, chunk: bytes) -> np.ndarray:
        """The ids of a chunk of valid UTF-8 (one that ends on a character boundary)."""
        # One byte per character: ASCII -> its id, a lead byte -> the mark, continuation bytes (0x80-0xBF, which
        # in valid UTF-8 are nothing else) deleted. ~600 MB/s, where masking and compressing runs at ~200 MB/s.
        ids8 = np.frombuffer(chunk.translate(self._ascii_table, CONTINUATION_BYTES), dtype=np.uint8)
        marks = np.flatnonzero(ids8 == ASCII_MARK)
        if chunk.isascii():
            if marks.size:
                self._refuse(ids8[:0], chunk)
            return ids8 if self.dtype == np.uint8 else ids8.astype(self.dtype)
        codes = non_ascii_codes(np.frombuffer(chunk, dtype=np.uint8))
        if marks.size != codes.size or not self._known[codes].all():
            self._refuse(codes, chunk)
        ids = ids8.astype(self.dtype)
        ids[marks] = self._ids[codes]
        return ids

    def _refuse(self, codes: np.ndarray, chunk: bytes) -> None:
        """The characters of a chunk outside the vocabulary, in one line."""
        raw = np.frombuffer(chunk, dtype=np.uint8)
        every = np.unique(np.concatenate([raw[raw < 0x80].astype(np.uint32), codes]))
        chars = "".join(map(chr, every[~self._known[every]]))
        raise UsageError(f"characters not in the vocabulary: {chars!r}")


class CharTokenizer(Tokenizer):
    """The sorted set of a text's characters, an id being a character's position in it. A character outside the
    set is an error that names it: there is no spare id to map it to."""

    kind = "char"

    def __init__(self, chars: Sequence[str]) -> None:
        self.chars = "".join(sorted(set(chars)))
        self._encoder: Optional[Encoder] = None

    @property
    def size(self) -> int:
        return len(self.chars)

    def encode_bytes(self, chunk: bytes) -> np.ndarray:
        if self._encoder is None:
            self._encoder = Encoder(self.chars)
        return self._encoder.encode(chunk)

    def encode(self, text: str) -> np.ndarray:
        return self.encode_bytes(text.encode("utf-8"))

    def decode(self, ids: Sequence[int] | np.ndarray | Any) -> str:
        return "".join(self.chars[i] for i in _as_list(ids))

    def describe(self) -> dict:
        return {"kind": self.kind, "chars": self.chars}

    def token_bytes(self) -> np.ndarray:
        return np.array([len(char.encode("utf-8")) for char in self.chars], dtype=np.int64)

    def summary(self) -> str:
        return f"{self.size} characters"


# ------------------------------------------------------------------------------------------------------- BPE
def _tokenizers():  # noqa: ANN202 (the module)
    """Hugging Face tokenizers, imported on first use; missing, one line naming the file that installs it."""
    try:
        import tokenizers
    except ImportError:
        raise UsageError(f"a BPE tokenizer needs the tokenizers package: pip install -r {REQUIREMENTS}") from None
    return tokenizers


def byte_alphabet() -> dict[str, int]:
    """GPT-2's byte-level alphabet, character -> byte: the printable characters every byte is written as in a
    byte-level BPE's vocabulary (tokenizers' ByteLevel uses the same table)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    codes, extra = list(printable), 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            codes.append(256 + extra)
            extra += 1
    return {chr(code): byte for byte, code in zip(printable, codes)}


def _is_byte_level(component: Optional[dict]) -> bool:
    """Whether a pre-tokenizer or decoder (as in tokenizer.json) is ByteLevel, or a Sequence with one."""
    if not isinstance(component, dict):
        return False
    if component.get("type") == "ByteLevel":
        return True
    parts = component.get("pretokenizers") or component.get("decoders") or []
    return any(_is_byte_level(part) for part in parts)


@contextlib.contextmanager
def serial_tokenizers() -> Iterator[None]:
    """tokenizers on one thread for the while: its BPE trainer's threads each count words and pairs into maps of their
    own (and allocator arenas), which on 16 MiB of Python source took a process from 627 to 782 MiB at its peak, for
    5.1 -> 3.1 s of training. tokenizers reads TOKENIZERS_PARALLELISM at each parallel step
    (tokenizers/src/utils/parallelism.rs, `get_parallelism`); the user's own setting is restored after."""
    before = os.environ.get(PARALLELISM)
    os.environ[PARALLELISM] = "false"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(PARALLELISM, None)
        else:
            os.environ[PARALLELISM] = before


class BpeTokenizer(Tokenizer):
    """A byte-level BPE (Hugging Face tokenizers): trained on a corpus (`train`) or read from a tokenizer.json
    (`from_json`). `origin` says where it came from, for messages only (it is not part of its identity)."""

    kind = "bpe"

    def __init__(self, tokenizer_json: str, origin: str) -> None:
        try:
            spec = json.loads(tokenizer_json)
        except ValueError:
            raise UsageError(f"{origin} is not a tokenizer (not JSON)") from None
        model = spec.get("model") if isinstance(spec, dict) else None
        if not isinstance(model, dict) or model.get("type") != "BPE":
            what = model.get("type") if isinstance(model, dict) else "no model"
            raise UsageError(f"{origin} is not a BPE tokenizer.json ({what}); data_config.tokenizer takes byte-level "
                             f"BPE tokenizers (GPT-2's, Llama 3's, one trained with data_config.tokenizer=bpe)")
        if not (_is_byte_level(spec.get("pre_tokenizer")) and _is_byte_level(spec.get("decoder"))):
            raise UsageError(f"{origin} is not byte-level (its pre-tokenizer or decoder is not ByteLevel): a text "
                             f"could hold a character it has no id for")
        try:
            self._tokenizer = _tokenizers().Tokenizer.from_str(tokenizer_json)
        except Exception as e:  # tokenizers' own parse error (an Exception subclass of its Rust side)
            raise UsageError(f"{origin} is not a tokenizer: {first_line(e)}") from None
        self.json, self.origin = tokenizer_json, origin
        self._fast: Optional[tuple[Optional[FastBpe], str]] = None  # fast_encoder's answer, once asked
        self._size = self._tokenizer.get_vocab_size(with_added_tokens=True)
        if self._size > MAX_VOCAB:
            raise UsageError(f"{origin} has {self._size:,} tokens, more than uint32 ids hold")

    @classmethod
    def train(cls, texts: Iterable[str], vocab_size: int, origin: str) -> BpeTokenizer:
        """A byte-level BPE of (at most) `vocab_size` tokens trained on `texts`: GPT-2's pre-tokenizer, every byte a
        token before the merges, no special tokens. Deterministic: the same texts give the same tokenizer."""
        tk = _tokenizers()
        tokenizer = tk.Tokenizer(tk.models.BPE())
        tokenizer.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        tokenizer.decoder = tk.decoders.ByteLevel()
        trainer = tk.trainers.BpeTrainer(vocab_size=vocab_size, show_progress=False, special_tokens=[],
                                         initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet())
        with serial_tokenizers():
            tokenizer.train_from_iterator(texts, trainer=trainer)
        return cls(tokenizer.to_str(), origin)

    @property
    def size(self) -> int:
        return self._size

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self._tokenizer.encode(text, add_special_tokens=False).ids, dtype=self.dtype)

    def stream_encoder(self) -> PieceStreamEncoder:
        return PieceStreamEncoder(self)

    def fast_encoder(self) -> tuple[Optional[FastBpe], str]:
        """(tiktoken's encoder of the same ids, "") or (None, why tokenizers itself encodes): built once."""
        if self._fast is None:
            self._fast = FastBpe.of(self)
            if self._fast[0] is None:
                log.info("data: encoding with tokenizers (not tiktoken: %s)", self._fast[1])
        return self._fast

    def encode_pieces(self, pieces: list[str]) -> np.ndarray:
        """The ids of the pieces one after another, encoded in parallel: tiktoken's where it gives the same ids
        (`FastBpe`), else tokenizers' (its own threads)."""
        fast, _ = self.fast_encoder()
        if fast is not None:
            return fast.encode_pieces(pieces)
        return self.encode_pieces_hf(pieces)

    def encode_pieces_hf(self, pieces: list[str]) -> np.ndarray:
        """`encode_pieces` by tokenizers itself: right for every tokenizer (the reference the fast one is tested
        against)."""
        ids = [np.zeros(0, dtype=self.dtype)]
        for start in range(0, len(pieces), BATCH_PIECES):
            encodings = self._tokenizer.encode_batch_fast(pieces[start : start + BATCH_PIECES],
                                                          add_special_tokens=False)
            ids.extend(np.asarray(e.ids, dtype=self.dtype) for e in encodings)
        return np.concatenate(ids)

    def decode(self, ids: Sequence[int] | np.ndarray | Any) -> str:
        return self._tokenizer.decode(_as_list(ids), skip_special_tokens=False)

    def describe(self) -> dict:
        return {"kind": self.kind, "tokenizer_json": self.json, "vocab_size": self.size, "origin": self.origin}

    def token_bytes(self) -> np.ndarray:
        alphabet = byte_alphabet()
        lengths = np.zeros(self.size, dtype=np.int64)
        for token, i in self._tokenizer.get_vocab(with_added_tokens=False).items():
            lengths[i] = sum(1 if char in alphabet else len(char.encode("utf-8")) for char in token)
        for i, added in self._tokenizer.get_added_tokens_decoder().items():
            lengths[i] = len(added.content.encode("utf-8"))  # added tokens decode to their own text
        return lengths

    def summary(self) -> str:
        return f"a byte-level BPE of {self.size:,} tokens"

    def hf_tokenizer(self):  # noqa: ANN201 (a tokenizers.Tokenizer)
        return self._tokenizer


# ------------------------------------------------------------------------------------------------- the fast BPE
# GPT-2's pre-tokenizer: tokenizers' ByteLevel with use_regex=true splits with exactly this pattern before mapping
# bytes to characters (tokenizers' pre_tokenizers/byte_level.rs; tiktoken's gpt2 encoding in
# tiktoken_ext/openai_public.py uses the same pattern).
GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""


def _tiktoken():  # noqa: ANN202 (the module, or None)
    try:
        import tiktoken
    except ImportError:
        return None
    return tiktoken


def encode_threads() -> int:
    """The cores this process may use (the builder encodes while the other ranks wait)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)


class FastBpe:
    """A BPE encoded by tiktoken with the merges of a `tokenizers` BPE, giving exactly its ids (`of` checks that
    they are; tests/unit/test_tokenizer.py compares the two on MBs of text), ~5x faster per core.

    tiktoken's `Encoding` takes bytes -> rank: each byte is a rank of its own (0-255) and merge k's result is
    256 + k; its ranks map back to the tokenizer's ids through one lookup array. Why its ids are tokenizers':
    - tokenizers' BPE (tokenizers/src/models/bpe/word.rs, `Word::merge_all`) merges, within each pre-tokenized
      word, the adjacent pair of the lowest merge rank, the leftmost one on a tie; tiktoken (src/lib.rs,
      `_byte_pair_merge`, "we hash bytes when indexing into `ranks`, not token pairs") the adjacent pair whose
      joined bytes have the lowest rank, the leftmost one on a tie. With ranks 256 + k, a pair that is a merge has
      the same rank in both.
    - tiktoken would also join two adjacent parts whose bytes form a merge's result by another split. That never
      happens when every merge's result, tokenized by tokenizers alone, is that one token (checked here, for every
      merge): the merges within the span of two adjacent parts X, Y happen in the same order as in X+Y alone (no
      merge crossed the span's ends, or X and Y would not be whole), so X+Y alone would end at [X, Y] too unless
      (X, Y) is its merge. The same check covers tiktoken taking a whole word that is a token as that token
      (src/lib.rs `CoreBPE::encode_ordinary`) where tokenizers merges (ignore_merges=false).
    - two merges with the same result (one rank per byte string in tiktoken), a normalizer, a pre-tokenizer other
      than exactly GPT-2's ByteLevel regex (Llama 3's Split + ByteLevel(use_regex=false) included), a prefix space,
      dropout, subword prefixes or suffixes, byte fallback, ignore_merges, a post-processor other than ByteLevel,
      truncation or padding: not this encoder (`of` says why), tokenizers encodes.
    - added tokens (GPT-2's <|endoftext|>): tokenizers matches their text before pre-tokenizing; a piece that
      holds one (as a substring: lstrip/rstrip/single_word only widen or narrow a match of it) is encoded by
      tokenizers, the others here.
    Read in tiktoken 0.14.0's and tokenizers' repositories (the Rust sources are not in their wheels); GPT-2's
    pattern is tokenizers/src/pre_tokenizers/byte_level.rs's `RE`. tokenizers matches it with Oniguruma and tiktoken
    with fancy-regex, whose Unicode classes could differ on rare characters: the tests compare the two encoders on
    MBs of mixed text (tests/unit/test_tokenizer.py).
    """

    def __init__(self, tiktoken, ranks: dict[bytes, int], ids: np.ndarray, tokenizer: BpeTokenizer,  # noqa: ANN001
                 added: list[str]) -> None:
        self._encoding = tiktoken.Encoding(f"mingpt-{len(ranks)}", pat_str=GPT2_PATTERN, mergeable_ranks=ranks,
                                           special_tokens={})
        self._ids, self._tokenizer = ids, tokenizer
        self._added = re.compile("|".join(map(re.escape, added))) if added else None
        self._pool: Optional[ThreadPoolExecutor] = None

    @classmethod
    def of(cls, tokenizer: BpeTokenizer) -> tuple[Optional[FastBpe], str]:
        """(the fast encoder of `tokenizer`, "") or (None, why it would not give the same ids)."""
        tiktoken = _tiktoken()
        if tiktoken is None:
            return None, "tiktoken is not installed"
        spec = json.loads(tokenizer.json)
        why = fast_bpe_problem(spec)
        if why:
            return None, why
        model = spec["model"]
        vocab, alphabet = model["vocab"], byte_alphabet()
        if not all(char in vocab for char in alphabet):
            return None, "its vocabulary lacks some bytes"
        ranks = {bytes([byte]): byte for byte in alphabet.values()}
        ids = np.zeros(256 + len(model["merges"]), dtype=tokenizer.dtype)
        for char, byte in alphabet.items():
            ids[byte] = vocab[char]
        hf_model = tokenizer.hf_tokenizer().model
        for k, merge in enumerate(model["merges"]):
            left, right = merge.split(" ") if isinstance(merge, str) else merge
            joined = left + right
            if left not in vocab or right not in vocab or joined not in vocab:
                return None, f"merge {k} ({left!r}, {right!r}) names a token outside the vocabulary"
            if not all(char in alphabet for char in joined):
                return None, f"merge {k} ({left!r}, {right!r}) is not of byte-level characters"
            data = bytes(alphabet[char] for char in joined)
            if data in ranks:
                return None, f"two merges make {joined!r}"
            if [token.id for token in hf_model.tokenize(joined)] != [vocab[joined]]:
                return None, f"the merges do not make {joined!r} from its own bytes"
            ranks[data], ids[256 + k] = 256 + k, vocab[joined]
        added = [token["content"] for token in spec.get("added_tokens") or [] if token.get("content")]
        return cls(tiktoken, ranks, ids, tokenizer, added), ""

    def encode(self, text: str) -> np.ndarray:
        """The ids of one text (a piece of `encode_pieces`)."""
        if self._added is not None and self._added.search(text):
            return self._tokenizer.encode(text)  # an added token: tokenizers matches it before pre-tokenizing
        # tiktoken releases the GIL while it encodes (src/py.rs: `py.detach`): the pool's threads run at once
        return self._ids[np.array(self._encoding.encode_ordinary(text), dtype=np.uint32)]

    def encode_pieces(self, pieces: list[str]) -> np.ndarray:
        """The ids of the pieces one after another, encoded on every core."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(encode_threads(), thread_name_prefix="bpe")
        ids = list(self._pool.map(self.encode, pieces)) if len(pieces) > 1 else [self.encode(p) for p in pieces]
        return np.concatenate([np.zeros(0, dtype=self._ids.dtype), *ids])

    def __del__(self) -> None:
        pool = getattr(self, "_pool", None)
        if pool is not None:
            pool.shutdown(wait=False)


def fast_bpe_problem(spec: dict) -> str:
    """Why tiktoken with this tokenizer.json's merges could give other ids than tokenizers ("" if it cannot): the
    settings `FastBpe` does not reproduce."""
    model, pre = spec.get("model") or {}, spec.get("pre_tokenizer") or {}
    if spec.get("normalizer") is not None:
        return "it has a normalizer"
    if pre.get("type") != "ByteLevel" or pre.get("use_regex") is not True:
        return "its pre-tokenizer is not GPT-2's (ByteLevel with its regex)"
    if pre.get("add_prefix_space"):
        return "it adds a prefix space"
    for option in ("dropout", "continuing_subword_prefix", "end_of_word_suffix", "byte_fallback", "ignore_merges"):
        if model.get(option):
            return f"its BPE has {option}={model[option]!r}"
    if (spec.get("post_processor") or {}).get("type", "ByteLevel") != "ByteLevel":
        return f"its post-processor is {spec['post_processor'].get('type')}"
    if spec.get("truncation") or spec.get("padding"):
        return "it truncates or pads"
    return ""


def _as_list(ids: Sequence[int] | np.ndarray | Any) -> list[int]:
    return ids.tolist() if hasattr(ids, "tolist") else list(ids)


# ------------------------------------------------------------------------------------------------------- descriptions
def tokenizer_from_description(description: dict | str) -> Tokenizer:
    """The tokenizer a description (`describe()`, what a snapshot records) stands for; a string is the characters
    of a snapshot written before tokenizers were described."""
    description = as_description(description)
    kind = description.get("kind")
    if kind == CharTokenizer.kind:
        return CharTokenizer(description["chars"])
    if kind == BpeTokenizer.kind:
        return BpeTokenizer(description["tokenizer_json"], description.get("origin") or "the snapshot's tokenizer")
    raise UsageError(f"unknown tokenizer kind {kind!r} (written by a newer mingpt-ddp?)")


def as_description(tokenizer: dict | str) -> dict:
    """A description; a vocabulary string (snapshots and callers from before the tokenizer seam) is characters."""
    return {"kind": CharTokenizer.kind, "chars": tokenizer} if isinstance(tokenizer, str) else tokenizer


def snapshot_tokenizer(snapshot: dict) -> dict:
    """The tokenizer description of a snapshot (or of a run's metadata): its `tokenizer`, or, written before
    tokenizers were described, the characters of its `vocab`."""
    described = snapshot.get("tokenizer")
    return described if isinstance(described, dict) else as_description(snapshot.get("vocab", ""))


def is_characters(snapshot: dict) -> bool:
    """Whether a snapshot (or a run's metadata) has the character tokenizer: what snapshot formats before
    tokenizer descriptions hold (store.py and sharded.py write those in their oldest format)."""
    return snapshot_tokenizer(snapshot)["kind"] == CharTokenizer.kind


def description_problem(snapshot: dict) -> Optional[str]:
    """Why a snapshot's tokenizer fields are not a snapshot's (None: they are): a description is a dict with a kind;
    without one (written before descriptions) a `vocab` string."""
    described = snapshot.get("tokenizer")
    if described is None:
        return None if isinstance(snapshot.get("vocab"), str) else "no tokenizer and no vocab"
    if not isinstance(described, dict) or not isinstance(described.get("kind"), str):
        return f"tokenizer is a {type(described).__name__} without a kind"
    return None


def tokenizer_size(description: dict | str) -> int:
    description = as_description(description)
    return len(description["chars"]) if description["kind"] == CharTokenizer.kind else int(description["vocab_size"])


def identity(description: dict | str) -> tuple[str, str]:
    """What makes two tokenizers the same (the same ids for the same text): their kind and content, not where
    they came from."""
    description = as_description(description)
    if description.get("kind") == CharTokenizer.kind:
        return CharTokenizer.kind, description["chars"]
    content = str(description.get("tokenizer_json", ""))
    return str(description.get("kind")), hashlib.sha256(content.encode()).hexdigest()


def difference(saved: dict | str, wanted: dict | str) -> Optional[str]:
    """None for the same tokenizer; otherwise what differs, in words (a snapshot's `saved` vs a run's `wanted`)."""
    saved, wanted = as_description(saved), as_description(wanted)
    if identity(saved) == identity(wanted):
        return None
    if saved["kind"] != wanted["kind"]:
        return (f"was trained with the {saved['kind']} tokenizer, this run uses {wanted['kind']} "
                f"(data_config.tokenizer={_setting(wanted)})")
    if saved["kind"] == CharTokenizer.kind:
        added = "".join(sorted(set(wanted["chars"]) - set(saved["chars"])))
        missing = "".join(sorted(set(saved["chars"]) - set(wanted["chars"])))
        return (f"has a different vocabulary ({len(saved['chars'])} characters, this data {len(wanted['chars'])}; "
                f"only in the data: {added!r}, only in the snapshot: {missing!r})")
    return (f"has a different tokenizer (a {saved['kind']} of {tokenizer_size(saved):,} tokens from "
            f"{saved.get('origin')}, this run's: {tokenizer_size(wanted):,} tokens from {wanted.get('origin')})")


def _setting(description: dict) -> str:
    origin = str(description.get("origin", ""))
    return origin.removeprefix("path ") if origin.startswith("path ") else description["kind"]


# ------------------------------------------------------------------------------------------------------- settings
@dataclass(frozen=True)
class TokenizerChoice:
    """`data_config.tokenizer` and `vocab_size` as the token cache needs them: `char`, `bpe` (trained on the corpus,
    `vocab_size` tokens), or `path` (a tokenizer file, with the SHA-256 of its content)."""

    kind: str = "char"  # char | bpe | path
    vocab_size: int = DEFAULT_BPE_VOCAB
    path: str = ""
    sha256: str = ""

    @classmethod
    def from_settings(cls, tokenizer: str, vocab_size: int) -> TokenizerChoice:
        """Checked settings (data_config): a bad one is a UsageError in one line. A path is read here."""
        if tokenizer == "char":
            return cls()
        if tokenizer == "bpe":
            if not MIN_BPE_VOCAB <= vocab_size <= MAX_VOCAB:
                raise UsageError(f"data_config.vocab_size must be between {MIN_BPE_VOCAB} (every byte is a token) "
                                 f"and {MAX_VOCAB:,} (what uint32 ids hold) for data_config.tokenizer=bpe, got "
                                 f"{vocab_size}")
            return cls("bpe", vocab_size)
        path = tokenizer_file(tokenizer)
        choice = cls("path", 0, str(path), hashlib.sha256(path.read_bytes()).hexdigest())
        choice.load()  # a file that is not a byte-level BPE: one line now, before any run folder or process group
        return choice

    def cache_key(self) -> Optional[dict]:
        """What the token cache's key adds for this tokenizer: nothing for characters (the key before tokenizers)."""
        if self.kind == "char":
            return None
        return {"kind": "bpe", "vocab_size": self.vocab_size} if self.kind == "bpe" else {"sha256": self.sha256}

    def load(self) -> BpeTokenizer:
        """The tokenizer of a path (its content checked against the SHA-256 read with the settings)."""
        data = Path(self.path).read_bytes()
        if hashlib.sha256(data).hexdigest() != self.sha256:
            raise UsageError(f"the tokenizer {self.path} changed while the job started: run again")
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            raise UsageError(f"{self.path} is not a tokenizer (not UTF-8 JSON)") from None
        return BpeTokenizer(text, f"path {self.path}")


def tokenizer_file(setting: str) -> Path:
    """The tokenizer.json a `data_config.tokenizer` path names: the file, or the one in a folder (a Hugging Face
    tokenizer folder); a missing one is a UsageError in one line."""
    from mingpt.storage.locations import check_location, resolve_path

    if check_location(setting, "data_config.tokenizer"):
        raise UsageError(f"data_config.tokenizer must be char, bpe or a local path to a tokenizer, got {setting!r}")
    path = Path(resolve_path(setting))
    if path.is_dir():
        if not (path / TOKENIZER_FILE).is_file():
            raise UsageError(f"data_config.tokenizer: the folder {path} holds no {TOKENIZER_FILE} (a Hugging Face "
                             f"tokenizer folder saved by a fast tokenizer has one)")
        path = path / TOKENIZER_FILE
    elif not path.is_file():
        raise UsageError(f"data_config.tokenizer: no such tokenizer file or folder: {path} (char, bpe, or a path to "
                         f"a tokenizer.json or a folder holding one)")
    if not os.access(path, os.R_OK):
        raise UsageError(f"data_config.tokenizer: cannot read {path}")
    return path
