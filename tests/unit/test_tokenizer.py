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
from mingpt.data.token_cache import Encoder, entry_dir, open_tokens
from mingpt.data.tokenizer import (
    BpeTokenizer,
    CharTokenizer,
    TokenizerChoice,
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
