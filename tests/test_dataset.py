import fsspec
import pytest
import torch

from char_dataset import CharCorpus, CharDataset, CharVocab, DataConfig, read_text, resolve_path
from errors import UsageError


def test_vocab_is_sorted_and_round_trips():
    text = "hello, world!"
    vocab = CharVocab(text)
    assert vocab.chars == "".join(sorted(set(text)))
    assert vocab.decode(vocab.encode(text)) == text


def test_utf8_beyond_ascii_round_trips(tmp_path):
    text = "Zoë naïve café — 東京 🚀\n" * 20
    path = tmp_path / "u.txt"
    path.write_text(text, encoding="utf-8")
    corpus = CharCorpus.load(DataConfig(path=str(path), block_size=8))
    assert "🚀" in corpus.vocab.chars and "東" in corpus.vocab.chars
    assert corpus.vocab.decode(corpus.data) == text


def test_unknown_characters_are_named():
    with pytest.raises(UsageError, match="'xz'"):
        CharVocab("abc").encode("axbz")


def test_split_is_contiguous_and_windows_do_not_cross_it():
    text = "".join(chr(ord("a") + i % 26) for i in range(1000))
    corpus = CharCorpus(text, DataConfig(block_size=10, train_split=0.9))
    train, val = corpus.train_dataset(), corpus.val_dataset()
    assert corpus.n_train == 900
    # Every training window lies inside the first 900 characters, every validation window after them.
    last_x, last_y = train[len(train) - 1]
    assert last_y.data_ptr() + last_y.element_size() * last_y.numel() <= corpus.data[900:].data_ptr()
    first_x, _ = val[0]
    assert first_x.data_ptr() == corpus.data[900:].data_ptr()
    assert len(train) == 900 - 10
    with pytest.raises(IndexError):
        train[len(train)]


def test_windows_are_shifted_views():
    data = torch.arange(100)
    ds = CharDataset(data, block_size=8)
    x, y = ds[5]
    assert torch.equal(x, torch.arange(5, 13)) and torch.equal(y, torch.arange(6, 14))
    assert x.untyped_storage().data_ptr() == data.untyped_storage().data_ptr()  # a view, not a copy
    bx, by = ds.__getitems__([5, 0, 91])
    assert bx.shape == (3, 8)
    assert torch.equal(bx[0], x) and torch.equal(by[0], y) and torch.equal(by[2], torch.arange(92, 100))


def test_validation_windows_do_not_overlap():
    data = torch.arange(100)
    ds = CharDataset(data, block_size=10, stride=10)
    assert len(ds) == 9
    targets = torch.cat([ds[i][1] for i in range(len(ds))])
    assert targets.unique().numel() == targets.numel()  # each character is a target at most once


def test_truncate_keeps_the_start():
    text = "abcdefghij" * 100
    corpus = CharCorpus(text, DataConfig(block_size=4, truncate=0.5))
    assert corpus.data.numel() == 500


def test_relative_path_resolves_against_project(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert read_text("data/input.txt").startswith("First Citizen")
    assert resolve_path("s3://bucket/x.txt") == "s3://bucket/x.txt"


def test_reads_through_fsspec_urls(tmp_path):
    path = tmp_path / "t.txt"
    path.write_text("some text\n" * 10, encoding="utf-8")
    assert read_text(f"file://{path}") == "some text\n" * 10
    with fsspec.open("memory://corpus/t.txt", "wb") as f:
        f.write("in memory ✓".encode())
    assert read_text("memory://corpus/t.txt") == "in memory ✓"
    with pytest.raises(UsageError, match="not found"):
        read_text("memory://corpus/missing.txt")


@pytest.mark.parametrize(
    "content, cfg, message",
    [
        (b"", DataConfig(block_size=4), "is empty"),
        (b"short text", DataConfig(block_size=64), "too short"),
        (b"abc\xff\xfedef" * 50, DataConfig(block_size=4), "not UTF-8"),
    ],
)
def test_bad_data(tmp_path, content, cfg, message):
    path = tmp_path / "bad.txt"
    path.write_bytes(content)
    cfg.path = str(path)
    with pytest.raises(UsageError, match=message):
        CharCorpus.load(cfg)


def test_missing_file(tmp_path):
    with pytest.raises(UsageError, match="not found"):
        read_text(str(tmp_path / "missing.txt"))


@pytest.mark.parametrize(
    "kwargs, message",
    [(dict(train_split=1.0), "train_split"), (dict(train_split=0.0), "train_split"), (dict(block_size=0), "block_size"),
     (dict(truncate=0.0), "truncate")],
)
def test_config_errors(kwargs, message):
    with pytest.raises(UsageError, match=message):
        DataConfig(**kwargs)
