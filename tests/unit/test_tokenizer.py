"""The tokenizer seam in one process: characters and byte-level BPE (round trips, any UTF-8 text, id types,
descriptions), the token cache with a BPE (trained once, shared, checked), snapshots that record their tokenizer
(and those from before, read as characters), and bits per byte. As processes: tests/e2e/test_tokenizer.py."""

import json
import math
import random

import numpy as np
import pytest
import torch
from support import PROJECT_DIR, SNAPSHOT_VOCAB, make_snapshot

import sample
from char_dataset import CharCorpus, CharDataset, DataConfig
from mingpt.checkpoint import store as snap
from mingpt.data import token_cache
from mingpt.data import tokenizer as tokenizer_module
from mingpt.data.token_cache import Encoder, entry_dir, open_tokens
from mingpt.data.tokenizer import (
    BpeTokenizer,
    CharTokenizer,
    FastBpe,
    TokenizerChoice,
    byte_alphabet,
    id_dtype,
    snapshot_tokenizer,
    split_at_boundaries,
    tokenizer_from_description,
)
from mingpt.errors import UsageError

SHAKESPEARE = (PROJECT_DIR / "data" / "input.txt").read_text(encoding="utf-8")
TEXT = SHAKESPEARE[:60_000]
ANY_TEXT = "naïve café, Ελληνικά, русский, 東京 🚀\x00\t\r\n\u200b end"


@pytest.fixture(scope="module")
def bpe() -> BpeTokenizer:
    return BpeTokenizer.train([TEXT], 300, "test")


def random_text(rng: random.Random, length: int) -> str:
    """Code points from every plane (no lone surrogates: they are not UTF-8)."""
    ranges = [(0, 0x7F), (0x80, 0x7FF), (0x800, 0xD7FF), (0xE000, 0xFFFF), (0x10000, 0x10FFFF)]
    return "".join(chr(rng.randint(*rng.choice(ranges))) for _ in range(length))


# ----------------------------------------------------------------------------------------------------- characters
def test_characters_are_todays_ids():
    tokenizer = CharTokenizer(TEXT)
    assert tokenizer.chars == "".join(sorted(set(TEXT))) and tokenizer.size == len(set(TEXT))
    ids = tokenizer.encode(TEXT)
    assert ids.dtype == np.uint8 and ids.tolist() == [tokenizer.chars.index(c) for c in TEXT]
    assert np.array_equal(ids, Encoder(tokenizer.chars).encode(TEXT.encode()))  # the cache's encoder
    assert tokenizer.decode(ids) == TEXT and tokenizer.decode(torch.from_numpy(ids.astype(np.int64))) == TEXT


def test_a_character_outside_the_vocabulary_is_named():
    with pytest.raises(UsageError, match=r"characters not in the vocabulary: 'é'"):
        CharTokenizer("abc").encode("abé")


@pytest.mark.parametrize("size, dtype", [(1, np.uint8), (256, np.uint8), (257, np.uint16), (65536, np.uint16),
                                         (65537, np.uint32), (1 << 32, np.uint32)])
def test_ids_are_stored_in_the_smallest_type_that_holds_them(size, dtype):
    assert id_dtype(size) == dtype


def test_tokenizers_encode_into_their_id_type(bpe):
    many = CharTokenizer("".join(map(chr, range(0x100, 0x100 + 300))))
    assert many.encode(many.chars[:5]).dtype == np.uint16
    assert bpe.encode("ROMEO:").dtype == np.uint16 and bpe.size == 300


# ----------------------------------------------------------------------------------------------------- BPE
def test_bpe_round_trips_any_utf8_text(bpe):
    rng = random.Random(0)
    for text in [TEXT[:5000], ANY_TEXT, "", " ", "\n\n\n", *(random_text(rng, 200) for _ in range(20))]:
        ids = bpe.encode(text)
        assert bpe.decode(ids) == text
        assert int(bpe.token_bytes()[ids.astype(np.int64)].sum()) == len(text.encode("utf-8"))


def test_bpe_merges_text_it_was_trained_on(bpe):
    assert len(bpe.encode(TEXT)) < 0.8 * len(TEXT.encode())  # 44 merges of the commonest pairs
    assert "byte-level BPE of 300 tokens" in bpe.summary()


def test_bpe_training_is_deterministic(bpe):
    assert BpeTokenizer.train([TEXT], 300, "again").json == bpe.json


def test_pieces_and_chunks_encode_as_the_whole_text(bpe):
    whole = bpe.encode(TEXT)
    data = TEXT.encode()
    pieces = split_at_boundaries(data, piece_bytes=1000)
    assert len(pieces) > 20 and "".join(pieces) == TEXT
    assert np.array_equal(bpe.encode_pieces(pieces), whole)
    stream = bpe.stream_encoder()
    rng = random.Random(1)
    cuts = sorted(rng.sample(range(1, len(data)), 40))
    chunks = [data[a:b] for a, b in zip([0, *cuts], [*cuts, len(data)])]
    streamed = np.concatenate([stream.feed(c) for c in chunks] + [stream.finish()])
    assert np.array_equal(streamed, whole)


# ----------------------------------------------------------------------------------------------------- the fast BPE
def mixed_text(size: int, seed: int = 0) -> str:
    """~`size` characters of what real corpora hold: this project's Python source, prose, contractions, digits,
    non-ASCII letters, CJK, emoji (joined ones too), and odd whitespace (no-break, ideographic and zero-width
    spaces, NEL, tabs and carriage returns, runs of spaces before a word)."""
    rng = random.Random(seed)
    code = [path.read_text(encoding="utf-8") for path in sorted(PROJECT_DIR.glob("*.py"))]
    words = ["it's", "they've", "I'm", "we'll", "she'd", "you're", "don't", "'S", "O'Neil", "3.14159", "2026",
             "١٢٣", "x²", "naïve", "café", "Ελληνικά", "русский", "東京タワー", "한국어", "中文字符", "🚀", "👩‍👩‍👧",
             "🇫🇷", "e\u0301", "$$", "!!!", "--", "__init__", "0x7FF", "1e-5", "𝔘𝔫𝔦", "\ufeffbom"]
    spaces = [" ", "  ", "   ", "\t", "\n", "\n\n", "\r\n", "\u00a0", "\u3000", "\u2009", "\u200b", "\u0085", " \n ",
              "\u180e", "\u2028", "\x0b", "\x0c", "    \n"]
    parts, length = [], 0
    while length < size:
        if rng.random() < 0.3:
            source = rng.choice(code)
            start = rng.randrange(len(source))
            part = source[start : start + rng.randint(100, 5000)]
        else:
            part = "".join(rng.choice(words) + rng.choice(spaces) for _ in range(rng.randint(5, 200)))
        parts.append(part)
        length += len(part)
    return "".join(parts)


MIXED = mixed_text(1 << 20)
needs_tiktoken = pytest.mark.skipif(tokenizer_module._tiktoken() is None, reason="tiktoken is not installed")


@pytest.fixture(scope="module")
def mixed_bpe() -> BpeTokenizer:
    """A BPE trained on mixed text: merges of non-ASCII letters, emoji bytes and whitespace runs too."""
    return BpeTokenizer.train(split_at_boundaries(mixed_text(1 << 20, seed=1).encode()), 2000, "mixed")


def gpt2_shaped(tokenizer: BpeTokenizer) -> BpeTokenizer:
    """`tokenizer` written as GPT-2's tokenizer.json is: merges as "a b" strings, <|endoftext|> an added special
    token (the last id), a ByteLevel post-processor, every BPE option spelt out."""
    spec = json.loads(tokenizer.json)
    size = len(spec["model"]["vocab"])
    spec["model"].update(merges=[" ".join(merge) for merge in spec["model"]["merges"]], dropout=None,
                         unk_token=None, continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False)
    spec["model"]["vocab"]["<|endoftext|>"] = size
    spec["added_tokens"] = [{"id": size, "content": "<|endoftext|>", "single_word": False, "lstrip": False,
                             "rstrip": False, "normalized": True, "special": True}]
    spec["post_processor"] = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False,
                              "use_regex": True}
    return BpeTokenizer(json.dumps(spec), "gpt2-shaped")


def both_ways(tokenizer: BpeTokenizer, text: str, piece_bytes: int = 64 << 10) -> tuple[np.ndarray, np.ndarray]:
    """(tiktoken's ids, tokenizers' ids) of `text` cut into pieces as the cache cuts it."""
    pieces = split_at_boundaries(text.encode(), piece_bytes)
    fast, why = FastBpe.of(tokenizer)
    assert fast is not None, why
    return fast.encode_pieces(pieces), tokenizer.encode_pieces_hf(pieces)


@needs_tiktoken
def test_the_fast_bpe_gives_tokenizers_ids_on_the_bundled_text():
    trained = BpeTokenizer.train(split_at_boundaries(SHAKESPEARE.encode()), 1000, "shakespeare")
    fast, ids = both_ways(trained, SHAKESPEARE)
    assert fast.dtype == ids.dtype == np.uint16 and len(ids) < 0.5 * len(SHAKESPEARE)
    assert np.array_equal(fast, ids)
    assert np.array_equal(trained.encode_pieces(split_at_boundaries(SHAKESPEARE.encode())), ids)  # the default


@needs_tiktoken
@pytest.mark.parametrize("shape", ["trained", "gpt2-shaped"])
def test_the_fast_bpe_gives_tokenizers_ids_on_mixed_text(mixed_bpe, bpe, shape):
    """MBs of code, non-ASCII, emoji, CJK, odd whitespace, contractions and digits, through two tokenizers trained
    on other text (so that many words are new to them), as trained and in GPT-2's shape (an added token too)."""
    rng = random.Random(2)
    text = mixed_text(3 << 20, seed=3) + "".join(random_text(rng, 50) + " it's 42\n" for _ in range(500))
    text = text.replace("naïve", "naïve<|endoftext|>", 3)
    for trained in (mixed_bpe, bpe):
        tokenizer = trained if shape == "trained" else gpt2_shaped(trained)
        fast, ids = both_ways(tokenizer, text)
        assert np.array_equal(fast, ids)
        if shape == "gpt2-shaped":
            assert ids.tolist().count(tokenizer.size - 1) == 3  # <|endoftext|>, by tokenizers in those pieces


@needs_tiktoken
def test_the_fast_bpe_gives_tokenizers_ids_on_every_small_piece(mixed_bpe):
    """Pieces that are one word, one space, one emoji: the ends of pieces and the whole-word path of tiktoken."""
    tokenizer = gpt2_shaped(mixed_bpe)
    fast, _ = FastBpe.of(tokenizer)
    vocab = json.loads(tokenizer.json)["model"]["vocab"]
    alphabet = byte_alphabet()
    tokens = [bytes(alphabet[c] for c in token).decode("utf-8", errors="ignore") for token in vocab
              if token != "<|endoftext|>"]
    for text in [*tokens, *MIXED[:3000].split(" "), "", " ", "'s", " 's", "\u00a0'll", "a\u3000b"]:
        assert fast.encode(text).tolist() == tokenizer.encode(text).tolist(), text


def without_tiktoken(monkeypatch):
    monkeypatch.setattr(tokenizer_module, "_tiktoken", lambda: None)


def spec_with(tokenizer: BpeTokenizer, change) -> str:
    spec = json.loads(tokenizer.json)
    change(spec)
    return json.dumps(spec)


def duplicate_merge(spec: dict) -> None:
    """A second merge that makes an existing token by another split: tiktoken has one rank per byte string."""
    vocab, merges = spec["model"]["vocab"], spec["model"]["merges"]
    for left, right in merges:
        joined = left + right
        for cut in range(1, len(joined)):
            if cut != len(left) and joined[:cut] in vocab and joined[cut:] in vocab:
                merges.append([joined[:cut], joined[cut:]])
                return
    raise AssertionError("no token with two splits")


LLAMA3_PRE_TOKENIZER = {"type": "Sequence", "pretokenizers": [
    {"type": "Split", "pattern": {"Regex": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?"
                                            r"[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"},
     "behavior": "Isolated", "invert": False},
    {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}]}

FALLBACKS = {
    "a normalizer": (lambda s: s.update(normalizer={"type": "NFC"}), "normalizer"),
    "Llama 3's pre-tokenizer": (lambda s: s.update(pre_tokenizer=LLAMA3_PRE_TOKENIZER), "not GPT-2's"),
    "ByteLevel without its regex": (lambda s: s["pre_tokenizer"].update(use_regex=False), "not GPT-2's"),
    "a prefix space": (lambda s: s["pre_tokenizer"].update(add_prefix_space=True), "prefix space"),
    "dropout": (lambda s: s["model"].update(dropout=0.1), "dropout=0.1"),
    "a subword prefix": (lambda s: s["model"].update(continuing_subword_prefix="##"), "continuing_subword_prefix"),
    "a word suffix": (lambda s: s["model"].update(end_of_word_suffix="</w>"), "end_of_word_suffix"),
    "byte fallback": (lambda s: s["model"].update(byte_fallback=True), "byte_fallback"),
    "ignore_merges": (lambda s: s["model"].update(ignore_merges=True), "ignore_merges"),
    "a template post-processor": (lambda s: s.update(post_processor={
        "type": "TemplateProcessing", "single": [{"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [{"Sequence": {"id": "A", "type_id": 0}}], "special_tokens": {}}), "post-processor"),
    "truncation": (lambda s: s.update(truncation={"direction": "Right", "max_length": 512, "strategy":
                                                  "LongestFirst", "stride": 0}), "truncates"),
    "two merges making one token": (duplicate_merge, "two merges make"),
}


@needs_tiktoken
@pytest.mark.parametrize("case", FALLBACKS)
def test_tokenizers_encodes_where_tiktoken_could_differ(mixed_bpe, case):
    change, why = FALLBACKS[case]
    spec = spec_with(mixed_bpe, change)
    if case == "a subword prefix":  # merges without the prefix: tokenizers itself cannot load it (a panic)
        assert why in tokenizer_module.fast_bpe_problem(json.loads(spec))
        return
    tokenizer = BpeTokenizer(spec, case)
    fast, reason = tokenizer.fast_encoder()
    assert fast is None and why in reason
    if case not in ("dropout", "truncation"):  # the others are deterministic and whole: the fallback's ids
        pieces = split_at_boundaries(MIXED[:200_000].encode())
        assert np.array_equal(tokenizer.encode_pieces(pieces), tokenizer.encode_pieces_hf(pieces))


@needs_tiktoken
def test_a_token_the_merges_do_not_make_from_its_bytes_is_not_left_to_tiktoken(bpe):
    """"abc" merged as (ab, c) after (b, c): tokenizers makes [a, bc] of "abc", tiktoken (which takes a whole word
    that is a token as that token, and joins any two parts that form one) would make [abc]."""
    def three_merges(spec: dict) -> None:
        vocab = {char: i for i, char in enumerate(byte_alphabet())}
        vocab.update(bc=256, ab=257, abc=258)
        spec["model"].update(vocab=vocab, merges=[["b", "c"], ["a", "b"], ["ab", "c"]])

    tokenizer = BpeTokenizer(spec_with(bpe, three_merges), "unreachable")
    fast, why = FastBpe.of(tokenizer)
    assert fast is None and "do not make 'abc'" in why
    assert tokenizer.encode(" abc").tolist()[-2:] == [tokenizer.hf_tokenizer().token_to_id(t) for t in ("a", "bc")]
    assert np.array_equal(tokenizer.encode_pieces(["abc abcd"]), tokenizer.encode("abc abcd"))


def test_without_tiktoken_tokenizers_encodes(monkeypatch, bpe):
    without_tiktoken(monkeypatch)
    tokenizer = BpeTokenizer(bpe.json, "no tiktoken")
    fast, why = tokenizer.fast_encoder()
    assert fast is None and why == "tiktoken is not installed"
    pieces = split_at_boundaries(TEXT.encode(), 1000)
    assert np.array_equal(tokenizer.encode_pieces(pieces), bpe.encode(TEXT))


@pytest.mark.parametrize("tokenizer", ["char", "bpe"])
def test_a_description_is_plain_data_that_rebuilds_the_tokenizer(tokenizer, bpe, tmp_path):
    original = CharTokenizer(TEXT) if tokenizer == "char" else bpe
    description = original.describe()
    assert json.loads(json.dumps(description)) == description  # plain types: JSON (sharded snapshots) holds it
    torch.save({"tokenizer": description}, tmp_path / "t.pt")
    loaded = torch.load(tmp_path / "t.pt", weights_only=True)["tokenizer"]  # snapshots are data
    rebuilt = tokenizer_from_description(loaded)
    assert type(rebuilt) is type(original) and rebuilt.describe() == description
    assert np.array_equal(rebuilt.encode(TEXT[:3000]), original.encode(TEXT[:3000]))


def test_a_tokenizer_file_that_is_not_byte_level_bpe_is_refused(tmp_path, bpe):
    spec = json.loads(bpe.json)
    spec["model"] = {"type": "WordLevel", "vocab": {"a": 0}, "unk_token": "a"}
    with pytest.raises(UsageError, match="not a BPE tokenizer.json"):
        BpeTokenizer(json.dumps(spec), "x.json")
    spec = json.loads(bpe.json)
    spec["pre_tokenizer"] = {"type": "Whitespace"}
    with pytest.raises(UsageError, match="not byte-level"):
        BpeTokenizer(json.dumps(spec), "x.json")
    with pytest.raises(UsageError, match="not a tokenizer"):
        BpeTokenizer("hello", "x.json")


# ----------------------------------------------------------------------------------------------------- settings
@pytest.mark.parametrize("vocab_size", [0, 255, (1 << 32) + 1])
def test_a_bpe_vocab_size_out_of_range_is_one_line(vocab_size):
    with pytest.raises(UsageError, match="data_config.vocab_size must be between 256") as error:
        DataConfig(tokenizer="bpe", vocab_size=vocab_size)
    assert "\n" not in str(error.value)


def test_a_tokenizer_path_is_a_file_or_a_folder_holding_one(tmp_path, bpe):
    with pytest.raises(UsageError, match="no such tokenizer file or folder"):
        DataConfig(tokenizer=str(tmp_path / "missing.json"))
    with pytest.raises(UsageError, match="holds no tokenizer.json"):
        DataConfig(tokenizer=str(tmp_path))
    (tmp_path / "tokenizer.json").write_text(bpe.json)
    by_folder, by_file = TokenizerChoice.from_settings(str(tmp_path), 0), TokenizerChoice.from_settings(
        str(tmp_path / "tokenizer.json"), 0)
    assert by_folder == by_file and by_folder.kind == "path" and by_folder.load().json == bpe.json
    (tmp_path / "text.json").write_text("just text")
    with pytest.raises(UsageError, match="is not a tokenizer"):
        TokenizerChoice.from_settings(str(tmp_path / "text.json"), 0).load()


# ----------------------------------------------------------------------------------------------------- the cache
def test_the_character_cache_keeps_its_key():
    assert entry_dir(PROJECT_DIR, "/x/a.txt", "\n") == entry_dir(PROJECT_DIR, "/x/a.txt", "\n", TokenizerChoice())
    others = {entry_dir(PROJECT_DIR, "/x/a.txt", "\n", TokenizerChoice("bpe", size)) for size in (300, 301)}
    assert len(others | {entry_dir(PROJECT_DIR, "/x/a.txt", "\n")}) == 3


def test_a_bpe_is_trained_once_and_kept_with_the_cache(tmp_path, caplog):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(TEXT + ANY_TEXT, encoding="utf-8")
    choice = TokenizerChoice("bpe", 300)
    built = open_tokens(str(corpus), "\n", tmp_path / "cache", tokenizer=choice)
    assert built.built_now and isinstance(built.tokenizer, BpeTokenizer) and built.dtype == np.uint16
    assert np.array_equal(built.array(), built.tokenizer.encode(TEXT + ANY_TEXT))  # nothing out of vocabulary
    assert (built.path.parent / "tokenizer.json").read_text() == built.tokenizer.json
    waiter = open_tokens(str(corpus), "\n", tmp_path / "cache", build=False, tokenizer=choice)  # another rank
    assert not waiter.built_now and waiter.tokenizer.json == built.tokenizer.json
    (built.path.parent / "tokenizer.json").write_text(built.tokenizer.json.replace('"Ġ', '"X', 1))  # damaged
    rebuilt = open_tokens(str(corpus), "\n", tmp_path / "cache", tokenizer=choice)
    assert rebuilt.built_now and rebuilt.tokenizer.json == built.tokenizer.json
    assert "tokenizer.json does not match its SHA-256" in caplog.text


def test_a_large_text_is_trained_on_a_spread_sample():
    sample = token_cache.TrainingSample(total_bytes=100 * 4096, budget=10 * 4096)
    for i in range(100):
        sample.add(bytes([65 + i % 26]) * 4096)
    assert sample.stride == 10 and sample.n_bytes == 10 * 4096
    assert [text[0] for text in sample.texts()] == [chr(65 + i % 26) for i in range(0, 100, 10)]


def test_a_corpus_with_a_tokenizer_file(tmp_path, bpe):
    (tmp_path / "tok").mkdir()
    (tmp_path / "tok" / "tokenizer.json").write_text(bpe.json)
    (tmp_path / "corpus.txt").write_text(TEXT, encoding="utf-8")
    cfg = DataConfig(path=str(tmp_path / "corpus.txt"), cache_dir=str(tmp_path / "cache"), block_size=16,
                     tokenizer=str(tmp_path / "tok"))
    corpus = CharCorpus.load(cfg)
    assert corpus.tokenizer.json == bpe.json and corpus.n_tokens == len(bpe.encode(TEXT))
    assert "tokens of" in corpus.describe() and "byte-level BPE of 300 tokens" in corpus.describe()


# ----------------------------------------------------------------------------------------------------- snapshots
def test_a_snapshot_from_before_tokenizers_loads_as_characters():
    old = make_snapshot()  # metadata with `vocab` only, as every snapshot before the tokenizer seam
    assert "tokenizer" not in old and old["format_version"] == snap.CHAR_FORMAT_VERSION
    loaded = snap.from_bytes(snap.to_bytes(old), "old.pt")
    assert snapshot_tokenizer(loaded) == {"kind": "char", "chars": SNAPSHOT_VOCAB}
    _, tokenizer = sample.model_from_snapshot(loaded, torch.device("cpu"))
    assert isinstance(tokenizer, CharTokenizer) and tokenizer.chars == SNAPSHOT_VOCAB
    snap.check_compatible(loaded, loaded["model_config"], CharTokenizer(SNAPSHOT_VOCAB).describe(), "old.pt")


def bpe_snapshot(bpe: BpeTokenizer) -> dict:
    char = make_snapshot()
    metadata = {"model_config": {**char["model_config"], "vocab_size": bpe.size},
                **snap.tokenizer_fields(bpe.describe())}
    return snap.build({"model": char["model"], "optimizer": char["optimizer"], "progress": char["progress"]},
                      metadata, world_size=1)


def test_a_bpe_snapshot_records_its_whole_tokenizer_in_a_newer_format(bpe):
    written = bpe_snapshot(bpe)
    assert written["format_version"] == snap.FORMAT_VERSION > snap.CHAR_FORMAT_VERSION and "vocab" not in written
    loaded = snap.from_bytes(snap.to_bytes(written), "bpe.pt")
    tokenizer = tokenizer_from_description(snapshot_tokenizer(loaded))
    assert isinstance(tokenizer, BpeTokenizer) and tokenizer.json == bpe.json
    assert snap.summary(loaded)["vocab_size"] == 300 and snap.summary(loaded)["tokenizer"] == "bpe"


def test_a_snapshot_with_a_broken_tokenizer_field_is_not_a_snapshot():
    broken = make_snapshot()
    broken["tokenizer"] = "chars"
    with pytest.raises(snap.CorruptSnapshot, match="tokenizer is a str"):
        snap.from_bytes(snap.to_bytes(snap.seal(broken)), "x.pt")


def test_resuming_under_another_tokenizer_is_refused_in_one_line(bpe):
    char = make_snapshot()
    with pytest.raises(UsageError) as error:
        snap.check_compatible(char, char["model_config"], bpe.describe(), "s.pt")
    message = str(error.value)
    assert "\n" not in message
    assert "snapshot s.pt was trained with the char tokenizer, this run uses bpe" in message
    other = BpeTokenizer.train([TEXT[:20000]], 280, "other text")
    with pytest.raises(UsageError, match="has a different tokenizer .* of 300 tokens from test"):
        snap.check_compatible(bpe_snapshot(bpe), {}, other.describe(), "b.pt")
    with pytest.raises(UsageError, match="has a different vocabulary"):
        snap.check_compatible(char, char["model_config"], "abc", "s.pt")  # a vocabulary string: characters


# ----------------------------------------------------------------------------------------------------- bits per byte
def evaluated_trainer(text: str, tokenizer, eval_batches=None):
    """A one-block Trainer (main.build_trainer, this process) over `text` encoded by `tokenizer`, evaluated once:
    the trainer, the validation loss, the corpus."""
    import main
    from mingpt.distributed.process_group import DistContext
    from mingpt.optim import OptimizerConfig
    from trainer import TrainerConfig

    data = DataConfig(block_size=16)
    cfg = main.TrainConfig(data, main.ModelSettings(n_layer=1, n_head=2, n_embd=16, dropout=0.0), OptimizerConfig(),
                           TrainerConfig(mixed_precision="fp32", batch_size=4, eval_batches=eval_batches))
    corpus = CharCorpus.from_text(text, data, tokenizer)
    trainer = main.build_trainer(cfg, corpus, DistContext(), None, with_snapshots=False)
    return trainer, trainer.validation_loss(), corpus


def test_bits_per_byte_of_characters_on_ascii_is_the_loss_over_ln2():
    trainer, loss, _ = evaluated_trainer(TEXT[:20000], CharTokenizer(TEXT[:20000]))
    assert trainer.last_val_bpb == pytest.approx(loss / math.log(2), rel=1e-12)


def test_bits_per_byte_counts_the_utf8_bytes_of_exactly_the_targets_evaluated(bpe):
    """nanochat's val_bpb: the nats summed over the targets evaluated / (ln 2 x the UTF-8 bytes those targets stand
    for), here over the first 3 validation batches of a text with multi-byte characters (not the whole split's
    ratio, which differs)."""
    text = (TEXT[:20000] + ANY_TEXT) * 2
    token_bytes = torch.from_numpy(bpe.token_bytes())
    trainer, loss, corpus = evaluated_trainer(text, bpe, eval_batches=3)
    targets, text_bytes = 0, 0
    for _, windows in zip(range(3), trainer.val_loader):
        y = windows[:, 1:]
        targets, text_bytes = targets + y.numel(), text_bytes + int(token_bytes[y].sum())
    assert text_bytes > targets  # several bytes a token: the ratio matters
    assert trainer.last_val_bpb == pytest.approx(loss * targets / (math.log(2) * text_bytes), rel=1e-12)
    split = torch.from_numpy(corpus.ids(corpus.n_train, corpus.n_tokens).astype(np.int64))
    whole_split = loss * split.numel() / (math.log(2) * int(token_bytes[split].sum()))
    assert trainer.last_val_bpb != pytest.approx(whole_split, rel=1e-6)
    assert CharDataset(np.zeros(40, dtype=np.uint8), 8).token_bytes is None  # without bytes per token: no val_bpb


def test_added_tokens_count_their_own_bytes(bpe):
    """As GPT-2's <|endoftext|>: an added token decodes to its text, and bits per byte counts that text."""
    hf = bpe.hf_tokenizer().__class__.from_str(bpe.json)
    hf.add_special_tokens(["<|endoftext|>"])
    gpt2_like = BpeTokenizer(hf.to_str(), "gpt2-like")
    assert gpt2_like.size == 301
    text = "The end.<|endoftext|>Begin: 東京"
    ids = gpt2_like.encode(text)
    assert 300 in ids.tolist() and gpt2_like.decode(ids) == text
    assert int(gpt2_like.token_bytes()[ids.astype(np.int64)].sum()) == len(text.encode("utf-8"))
