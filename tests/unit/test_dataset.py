"""The data layer in one process: vocabulary, windows, the split, sources (files, folders, globs, URLs), the
encoded-corpus cache (reuse, rebuild, damage, locking, room) and the epoch order (an unlistable folder, as another
user: tests/e2e/test_dataset.py)."""

import fcntl
import gc
import io
import json
import os
import random
import threading
import time
import tracemalloc

import fsspec
import numpy as np
import pytest
import torch
from support import PROJECT_DIR, text_files

from char_dataset import (
    LEGACY_ORDER,
    CharCorpus,
    CharDataset,
    CharVocab,
    DataConfig,
    EpochOrder,
    ResumableDistributedSampler,
    resolve_path,
)
from mingpt.data import token_cache
from mingpt.data.token_cache import CharScan, Encoder, entry_dir, open_tokens, utf8_chunks
from mingpt.errors import UsageError

SHAKESPEARE = (PROJECT_DIR / "data" / "input.txt").read_text(encoding="utf-8")


def load(path, cache, **kwargs) -> CharCorpus:
    return CharCorpus.load(DataConfig(path=str(path), cache_dir=str(cache), **{"block_size": 8, **kwargs}))


def text_of(corpus: CharCorpus) -> str:
    return corpus.vocab.decode(corpus.ids(0, corpus.n_tokens))


# ------------------------------------------------------------------------------------------- vocabulary, windows
def test_vocab_is_sorted_and_round_trips():
    text = "hello, world!"
    vocab = CharVocab(text)
    assert vocab.chars == "".join(sorted(set(text)))
    assert vocab.decode(vocab.encode(text)) == text


def test_unknown_characters_are_named():
    with pytest.raises(UsageError, match="'xzé'"):
        CharVocab("abc").encode("axbzé")


@pytest.mark.parametrize("chunk_bytes", [1, 2, 3, 5, 64, 1 << 20])
def test_the_streamed_encoder_matches_a_per_character_reference(chunk_bytes):
    """Vocabulary and ids from chunks cut anywhere (inside multi-byte characters too) equal sorted(set(text)) and
    text.index per character, for ASCII, NUL, 2-, 3- and 4-byte characters."""
    rng = random.Random(chunk_bytes)
    alphabet = "abc XYZ\n\t\x00é—東京🚀ж"
    for _ in range(30):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 400)))
        chunks = list(utf8_chunks(io.BytesIO(text.encode()), "t", chunk_bytes))
        assert b"".join(chunks) == text.encode()
        scan = CharScan()
        for chunk in chunks:
            scan.add(chunk)
        vocab = scan.vocab()
        assert vocab == "".join(sorted(set(text))) and scan.n_chars == len(text)
        ids = np.concatenate([Encoder(vocab).encode(chunk) for chunk in chunks])
        assert ids.tolist() == [vocab.index(ch) for ch in text]


@pytest.mark.parametrize("size, dtype", [(200, np.uint8), (256, np.uint8), (257, np.uint16), (70_000, np.uint32)])
def test_ids_take_the_smallest_type_the_vocabulary_fits(tmp_path, size, dtype):
    chars = [chr(c) for c in range(0x20, 0x20 + size + 2048) if not 0xD800 <= c < 0xE000][:size]
    path = tmp_path / "v.txt"
    path.write_text("".join(chars) * 2, encoding="utf-8")
    corpus = load(path, tmp_path / "cache")
    assert corpus.tokens.dtype == dtype and len(corpus.vocab) == size
    assert text_of(corpus) == "".join(chars) * 2


def test_split_is_contiguous_and_windows_do_not_cross_it():
    text = "".join(chr(ord("a") + i % 26) for i in range(1000))
    corpus = CharCorpus.from_text(text, DataConfig(block_size=10, train_split=0.9))
    train, val = corpus.train_dataset(), corpus.val_dataset()
    ids = corpus.ids(0, 1000)
    assert corpus.n_train == 900 and len(train) == 900 - 10
    np.testing.assert_array_equal(train.data, ids[:900])  # every training window lies in the first 900 ...
    np.testing.assert_array_equal(val.data, ids[900:])  # ... every validation window after them (from_text: arrays)
    assert val[0][0].tolist() == ids[900:910].tolist()
    with pytest.raises(IndexError):
        train[len(train)]


def test_windows_are_shifted_int64_pairs():
    ds = CharDataset(torch.arange(100), block_size=8)
    x, y = ds[5]
    assert x.dtype == torch.int64 and torch.equal(x, torch.arange(5, 13)) and torch.equal(y, torch.arange(6, 14))
    bx, by = ds.__getitems__([5, 0, 91])
    assert bx.shape == (3, 8)
    assert torch.equal(bx[0], x) and torch.equal(by[0], y) and torch.equal(by[2], torch.arange(92, 100))


def test_validation_windows_do_not_overlap():
    ds = CharDataset(np.arange(100), block_size=10, stride=10)
    assert len(ds) == 9
    targets = torch.cat([ds[i][1] for i in range(len(ds))])
    assert targets.unique().numel() == targets.numel()  # each character is a target at most once


def test_windows_are_read_from_the_cache_and_pickle_by_reference(tmp_path):
    import pickle

    corpus = load(PROJECT_DIR / "data" / "input.txt", tmp_path / "cache")
    train, val = corpus.train_dataset(), corpus.val_dataset()
    assert isinstance(train.data, token_cache.TokenFile)
    ids = corpus.ids(0, corpus.n_tokens)
    assert train.windows([0, 12345]).tolist() == [ids[0:9].tolist(), ids[12345:12354].tolist()]
    assert len(pickle.dumps(train)) < 10_000  # the file and the place in it, not the ids
    assert torch.equal(pickle.loads(pickle.dumps(train)).windows([7, 99]), train.windows([7, 99]))
    assert corpus.vocab.decode(val[0][0]) == SHAKESPEARE[corpus.n_train : corpus.n_train + 8]
    last = len(val) - 1
    assert val.windows([last]).tolist() == [ids[corpus.n_train + 8 * last : corpus.n_train + 8 * last + 9].tolist()]
    with pytest.raises(IndexError):
        val.data.read(np.array([len(val.data) - 8]), 9)


def resident_mb() -> float:
    line = next(line for line in open("/proc/self/status") if line.startswith("VmRSS:"))
    return int(line.split()[1]) / 1024


def test_reading_windows_leaves_the_resident_memory_flat(tmp_path):
    """12,800 random windows of a 36 MB split: the process's memory does not grow by the split's size, and
    nothing of the token file is mapped into it."""
    path = tmp_path / "big.txt"
    path.write_text(SHAKESPEARE * 36, encoding="utf-8")
    train = load(path, tmp_path / "cache").train_dataset()
    order = EpochOrder(len(train), seed=1, epoch=0)
    train.windows(order(np.arange(64)))
    before = resident_mb()
    for first in range(0, 64 * 200, 64):
        train.windows(order(np.arange(first, first + 64)))
    assert resident_mb() - before < 8
    assert [line for line in open("/proc/self/maps") if str(train.data.path) in line] == []


def test_truncate_keeps_the_start():
    corpus = CharCorpus.from_text("abcdefghij" * 100, DataConfig(block_size=4, truncate=0.5))
    assert corpus.n_tokens == 500 and corpus.vocab.decode(corpus.ids(0, 10)) == "abcdefghij"


# ------------------------------------------------------------------------------------------------------ sources
def test_relative_path_resolves_against_project(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert text_of(load("data/input.txt", tmp_path / "cache")).startswith("First Citizen")
    assert resolve_path("s3://bucket/x.txt") == "s3://bucket/x.txt"


def test_utf8_beyond_ascii_round_trips(tmp_path):
    text = "Zoë naïve café — 東京 🚀\n" * 20
    path = tmp_path / "u.txt"
    path.write_text(text, encoding="utf-8")
    corpus = load(path, tmp_path / "cache")
    assert "🚀" in corpus.vocab.chars and "東" in corpus.vocab.chars
    assert text_of(corpus) == text


def test_a_folder_and_a_glob_join_their_files_in_sorted_order(tmp_path):
    folder = text_files(tmp_path / "text_files", {"b.txt": "bee " * 10, "a.txt": "ant " * 10, "sub/c.txt": "cat " * 10,
                                        ".hidden.txt": "NOT THIS", ".git/x": "NOR THIS", "notes.md": "md " * 10})
    joined = load(folder, tmp_path / "cache")
    assert text_of(joined) == "\n".join(["ant " * 10, "bee " * 10, "md " * 10, "cat " * 10])
    assert len(joined.tokens.sources) == 4
    globbed = load(f"{folder}/*.txt", tmp_path / "cache", separator="<|>")
    assert text_of(globbed) == "ant " * 10 + "<|>" + "bee " * 10
    assert set(globbed.vocab.chars) == set("ant be<|>")  # one vocabulary over all the files, separator included
    two_lines = load(f"{folder}/*.txt", tmp_path / "cache", separator="\\n\\n")  # as typed on a command line
    assert text_of(two_lines) == "ant " * 10 + "\n\n" + "bee " * 10
    (folder / "link.txt").symlink_to(folder / "sub" / "c.txt")  # a link to a file is a file
    assert text_of(load(f"{folder}/*.txt", tmp_path / "cache", separator="")).endswith("cat " * 10)


def test_reads_through_fsspec_urls(tmp_path):
    path = tmp_path / "t.txt"
    path.write_text("some text\n" * 10, encoding="utf-8")
    assert text_of(load(f"file://{path}", tmp_path / "cache")) == "some text\n" * 10
    for name, text in (("a.txt", "in memory ✓ " * 5), ("b.txt", "and more " * 5)):
        with fsspec.open(f"memory://corpus/{name}", "wb") as f:
            f.write(text.encode())
    corpus = load("memory://corpus/", tmp_path / "cache")  # remote: copied once into the cache folder, then encoded
    assert text_of(corpus) == "in memory ✓ " * 5 + "\n" + "and more " * 5
    assert [p.name for p in corpus.tokens.path.parent.iterdir() if p.suffix == ".tmp"] == []
    with pytest.raises(UsageError, match="not found"):
        load("memory://corpus/missing.txt", tmp_path / "cache")


@pytest.mark.parametrize(
    "files, path, kwargs, message",
    [
        ({"e.txt": b""}, "e.txt", {}, "is empty"),
        ({"s.txt": b"short text"}, "s.txt", {"block_size": 64}, "too short"),
        ({"l.txt": b"abc\xff\xfedef" * 50}, "l.txt", {}, r"l\.txt is not UTF-8 text \(invalid byte at offset 3\)"),
        ({"a.txt": b"fine " * 40, "b.txt": "ok é".encode() + b"\xe9 no"}, "*.txt", {},
         r"b\.txt is not UTF-8 text \(invalid byte at offset 5\)"),
        ({"cut.txt": "abc 東".encode()[:-1]}, "cut.txt", {}, r"ends inside a character, at offset 4"),
        ({"a.txt": b"x" * 50}, "*.md", {}, r"'.*\*\.md' matches no file"),
        ({"sub/.hidden": b"x" * 50}, "sub", {}, r"'.*sub' is a folder without files"),
        ({"a.txt": b"x" * 50}, "missing.txt", {}, r"data file not found: .*missing\.txt$"),
    ],
)
def test_bad_data(tmp_path, files, path, kwargs, message):
    for name, content in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_bytes(content)
    with pytest.raises(UsageError, match=message):
        load(tmp_path / path, tmp_path / "cache", **kwargs)


def test_a_broken_link_and_an_unreadable_file_among_many_are_named(tmp_path):
    folder = text_files(tmp_path / "text_files", {"a.txt": "fine " * 20})
    (folder / "b.txt").symlink_to(tmp_path / "gone.txt")
    with pytest.raises(UsageError, match=r"b\.txt is a broken symbolic link"):
        load(folder, tmp_path / "cache")
    (folder / "b.txt").unlink()
    (folder / "c.txt").symlink_to("/proc/self/mem")  # a file even root cannot read from its start
    with pytest.raises(UsageError, match=r"cannot read data file .*/text_files/c\.txt: OSError: "):
        load(folder, tmp_path / "cache")


@pytest.mark.parametrize(
    "kwargs, message",
    [(dict(train_split=1.0), "train_split"), (dict(train_split=0.0), "train_split"), (dict(block_size=0), "block_size"),
     (dict(truncate=0.0), "truncate"), (dict(cache_timeout_s=0), "cache_timeout_s"),
     (dict(cache_dir="s3://bucket/cache"), "cache_dir must be a local folder")],
)
def test_data_config_refuses_out_of_range_splits_sizes_and_a_remote_cache(kwargs, message):
    with pytest.raises(UsageError, match=message):
        DataConfig(**kwargs)


# ------------------------------------------------------------------------------------------------------ the cache
def test_the_cache_is_reused_while_the_sources_are_unchanged_and_rebuilt_when_they_change(tmp_path):
    folder = text_files(tmp_path / "text_files", {"a.txt": "one " * 20, "b.txt": "two " * 20})
    cache = tmp_path / "cache"
    first = load(folder, cache)
    assert first.tokens.built_now
    again = load(folder, cache)
    assert not again.tokens.built_now and again.tokens.path == first.tokens.path
    (folder / "b.txt").write_text("three " * 20, encoding="utf-8")  # modified: size and mtime change
    changed = load(folder, cache)
    assert changed.tokens.built_now and text_of(changed) == "one " * 20 + "\n" + "three " * 20
    text_files(folder, {"c.txt": "four " * 20})  # a file added
    entry, in_use = changed.tokens.path.parent, changed.tokens.path
    assert load(folder, cache).tokens.built_now
    assert in_use.exists() and text_of(changed) == "one " * 20 + "\n" + "three " * 20  # still read here: kept
    del first, again, changed
    gc.collect()
    (folder / "a.txt").write_text("five " * 20, encoding="utf-8")
    latest = load(folder, cache)
    names = sorted(p.name for p in entry.iterdir())
    assert names == ["lock", "manifest.json", latest.tokens.path.name]  # the replaced token files are gone


def corrupt_tokens(entry):
    path = next(entry.glob("tokens-*.bin"))
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def truncate_tokens(entry):
    path = next(entry.glob("tokens-*.bin"))
    path.write_bytes(path.read_bytes()[:-3])


def edit_manifest(entry):
    manifest = json.loads((entry / "manifest.json").read_text())
    manifest["n_tokens"] -= 1
    (entry / "manifest.json").write_text(json.dumps(manifest))


@pytest.mark.parametrize("damage, why", [
    (corrupt_tokens, "does not match its CRC-32"),
    (truncate_tokens, "the manifest says"),
    (lambda entry: (entry / "manifest.json").write_text('{"format_version": 1, "sour'), "manifest.json is unreadable"),
    (edit_manifest, "manifest.json does not match its checksum"),
    (lambda entry: next(entry.glob("tokens-*.bin")).unlink(), "is unreadable"),
])
def test_a_damaged_cache_is_rebuilt_never_trained_on(tmp_path, caplog, damage, why):
    path = text_files(tmp_path, {"t.txt": SHAKESPEARE[:5000]}) / "t.txt"
    cache = tmp_path / "cache"
    entry = load(path, cache).tokens.path.parent
    damage(entry)
    with caplog.at_level("INFO", logger="mingpt"):
        rebuilt = load(path, cache)
    assert rebuilt.tokens.built_now and text_of(rebuilt) == SHAKESPEARE[:5000]
    assert any(r.levelname == "WARNING" and why in r.getMessage() for r in caplog.records), caplog.text


def test_a_cache_of_a_newer_format_is_refused_in_one_line(tmp_path):
    path = text_files(tmp_path, {"t.txt": SHAKESPEARE[:5000]}) / "t.txt"
    entry = load(path, tmp_path / "cache").tokens.path.parent
    manifest = json.loads((entry / "manifest.json").read_text())
    manifest["format_version"] = token_cache.FORMAT_VERSION + 1
    (entry / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(UsageError, match=r"written by a newer mingpt-ddp \(format 2; this one reads 1\)"):
        load(path, tmp_path / "cache")
    assert json.loads((entry / "manifest.json").read_text()) == manifest  # left for the version that wrote it


@pytest.fixture
def small_disk(tmp_path):
    """A 256 KiB file system (tmpfs; root only)."""
    mount = tmp_path / "small"
    mount.mkdir()
    if os.geteuid() != 0 or os.system(f"mount -t tmpfs -o size=256k tmpfs {mount} 2>/dev/null") != 0:
        pytest.skip("mounting a tmpfs needs root")
    yield mount
    os.system(f"umount {mount}")


def test_no_room_for_the_cache_is_one_line_and_leaves_nothing_behind(tmp_path, small_disk):
    with pytest.raises(UsageError, match=r"no room for the data cache in .*small/input\.txt-\w+ \(the token file "
                                         r"and manifest: 1,181,190 bytes needed, [\d,]+ free\)"):
        load(PROJECT_DIR / "data" / "input.txt", small_disk)
    remote = "memory://big/corpus.txt"
    with fsspec.open(remote, "wb") as f:
        f.write(SHAKESPEARE.encode())
    with pytest.raises(UsageError, match=r"local copies of the remote files: 1,180,930 bytes needed"):
        load(remote, small_disk)
    assert [p.name for p in small_disk.rglob("*") if p.is_file()] == ["lock", "lock"]


def test_a_cache_prepared_on_a_read_only_file_system_is_used_as_it_is(tmp_path, small_disk):
    path = text_files(tmp_path, {"t.txt": SHAKESPEARE[:5000]}) / "t.txt"
    load(path, small_disk)
    assert os.system(f"mount -o remount,ro {small_disk}") == 0
    corpus = load(path, small_disk)
    assert not corpus.tokens.built_now and text_of(corpus) == SHAKESPEARE[:5000]


def test_a_rebuild_leaves_the_token_file_a_reader_still_uses(tmp_path):
    """Another job (here: a rebuild in this process) replaces the cache while a corpus is open: its splits, even
    one not read before the rebuild, still read the ids they were opened with."""
    path = text_files(tmp_path, {"t.txt": SHAKESPEARE[:5000]}) / "t.txt"
    corpus = load(path, tmp_path / "cache")
    train, val = corpus.train_dataset(), corpus.val_dataset()
    train.windows([0])
    rebuilt = open_tokens(str(path), "\n", tmp_path / "cache", rebuild=True)
    assert rebuilt.path != corpus.tokens.path and corpus.tokens.path.exists()
    assert corpus.vocab.decode(val.windows([0])[0]) == SHAKESPEARE[corpus.n_train : corpus.n_train + 9]


def test_a_failed_build_leaves_nothing_behind(tmp_path):
    folder = text_files(tmp_path / "text_files", {"a.txt": SHAKESPEARE[:5000], "b.txt": "fine"})
    (folder / "c.txt").write_bytes(b"ok \xff")
    with pytest.raises(UsageError, match="not UTF-8"):
        load(folder, tmp_path / "cache")
    assert [p.name for p in entry_dir(tmp_path / "cache", str(folder), "\n").iterdir()] == ["lock"]


def test_a_waiter_checks_an_unusable_cache_once_not_at_every_poll(tmp_path, monkeypatch):
    """A waiting rank that found the cache damaged does not read it again until a new manifest appears: reading
    it under the shared lock at every poll could keep the builder out (flock has no queue)."""
    path = text_files(tmp_path, {"t.txt": SHAKESPEARE[:5000]}) / "t.txt"
    cache = tmp_path / "cache"
    del load(path, cache).tokens  # built, then closed
    corrupt_tokens(entry_dir(cache, str(path), "\n"))
    checks = []
    real = token_cache._crc32_of
    monkeypatch.setattr(token_cache, "_crc32_of", lambda fd: checks.append(1) or real(fd))
    waiter = threading.Thread(target=lambda: checks.append(open_tokens(str(path), "\n", cache, build=False)))
    waiter.start()
    time.sleep(1.5)  # ~7 polls
    assert len(checks) == 1
    open_tokens(str(path), "\n", cache)  # the builder: rebuilds
    waiter.join(10)
    assert isinstance(checks[-1], token_cache.Tokens) and checks[-1].n_tokens == 5000


def hold_lock(entry, seconds: float) -> threading.Thread:
    entry.mkdir(parents=True, exist_ok=True)
    handle = open(entry / "lock", "a+")
    fcntl.flock(handle, fcntl.LOCK_EX)
    handle.write("pid 4242 on testhost\n")
    handle.flush()

    def release():
        time.sleep(seconds)
        fcntl.flock(handle, fcntl.LOCK_UN)
        handle.close()

    thread = threading.Thread(target=release)
    thread.start()
    return thread


def test_a_process_that_does_not_build_waits_for_one_that_does(tmp_path):
    path = text_files(tmp_path, {"t.txt": SHAKESPEARE[:5000]}) / "t.txt"
    cache = tmp_path / "cache"
    with pytest.raises(UsageError, match=r"waited 0\.3 s for the data cache .* to be built by another process "
                                         r"\(local rank 0; no cache yet\); data_config.cache_timeout_s"):
        open_tokens(str(path), "\n", cache, build=False, timeout_s=0.3)
    builder = threading.Thread(target=lambda: (time.sleep(0.5), open_tokens(str(path), "\n", cache)))
    builder.start()
    waited = open_tokens(str(path), "\n", cache, build=False, timeout_s=30)
    builder.join()
    assert waited.n_tokens == 5000 and not waited.built_now


def test_a_builder_waits_for_the_lock_and_names_its_last_builder_when_it_gives_up(tmp_path):
    path = text_files(tmp_path, {"t.txt": SHAKESPEARE[:5000]}) / "t.txt"
    cache = tmp_path / "cache"
    entry = entry_dir(cache, str(path), "\n")
    hold_lock(entry, 1.0)
    with pytest.raises(UsageError, match=r"stayed locked past data_config.cache_timeout_s \(the last process to "
                                         r"build it: pid 4242 on testhost\)"):
        open_tokens(str(path), "\n", cache, timeout_s=0.3)
    hold_lock(entry, 0.5).join(0)
    assert open_tokens(str(path), "\n", cache, timeout_s=30).n_tokens == 5000  # once it is free


# ------------------------------------------------------------------------------------------------ the epoch order
@pytest.mark.parametrize("n", [1, 2, 3, 5, 16, 17, 100, 4097, 65_537, 1_000_003])
def test_the_epoch_order_is_a_permutation_for_any_size(n):
    order = EpochOrder(n, seed=1337, epoch=0)(np.arange(n))
    assert np.array_equal(np.sort(order), np.arange(n))


def test_the_epoch_order_is_a_pure_function_of_seed_and_epoch():
    n = 10_000
    positions = np.arange(n)
    first = EpochOrder(n, 5, 3)(positions)
    assert np.array_equal(EpochOrder(n, 5, 3)(positions), first)
    assert np.array_equal(EpochOrder(n, 5, 3)(positions[::-1])[::-1], first)  # any position, directly
    assert not np.array_equal(EpochOrder(n, 5, 4)(positions), first)
    assert not np.array_equal(EpochOrder(n, 6, 3)(positions), first)
    assert abs(np.corrcoef(positions, first)[0, 1]) < 0.05  # shuffled, not a near-identity


@pytest.mark.parametrize("world_size", [1, 2, 3])
@pytest.mark.parametrize("start", [0, 7, 50])
def test_sampler_start_position_is_world_size_independent(world_size, start):
    full = ResumableDistributedSampler(101, 1, 0, seed=5)
    full.set_epoch(3)
    order = list(full)
    ranks = [ResumableDistributedSampler(101, world_size, r, seed=5) for r in range(world_size)]
    for sampler in ranks:
        sampler.set_epoch(3, start=start)
    per_rank = [list(s) for s in ranks]
    assert len({len(p) for p in per_rank}) == 1 and len(per_rank[0]) == len(ranks[0])
    interleaved = [p[i] for i in range(len(per_rank[0])) for p in per_rank]
    remaining = order[start:]
    assert interleaved[: len(remaining)] == remaining  # nothing skipped, nothing repeated (before padding)
    assert interleaved[len(remaining):] == remaining[: len(interleaved) - len(remaining)]


def test_every_rank_gets_as_many_samples_even_when_fewer_are_left_than_ranks():
    ranks = [ResumableDistributedSampler(10, 4, r, seed=5) for r in range(4)]
    for sampler in ranks:
        sampler.set_epoch(0, start=9)
    assert [len(list(s)) for s in ranks] == [1, 1, 1, 1]


def test_sampler_order_changes_with_epoch():
    sampler = ResumableDistributedSampler(50, 1, 0, seed=5)
    sampler.set_epoch(0)
    first = list(sampler)
    sampler.set_epoch(1)
    assert list(sampler) != first and sorted(first) == list(range(50))


def test_the_samplers_memory_does_not_grow_with_the_number_of_windows():
    peaks = {}
    for n in (100_000, 10**12):
        sampler = ResumableDistributedSampler(n, 2, 1, seed=5)
        sampler.set_epoch(7, start=n // 3)
        tracemalloc.start()
        it = iter(sampler)
        picked = [next(it) for _ in range(5000)]
        peaks[n] = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        assert all(0 <= i < n for i in picked)
    assert peaks[10**12] < 2 * peaks[100_000] + 100_000 and peaks[10**12] < 1_000_000, peaks


def test_the_legacy_order_is_the_one_older_snapshots_began_their_epoch_in():
    sampler = ResumableDistributedSampler(100, 3, 2, seed=5)
    sampler.set_epoch(4, start=10, order=LEGACY_ORDER)
    generator = torch.Generator().manual_seed(5 + 4)
    old = torch.randperm(100, generator=generator)[10:]
    old = torch.cat([old, old[:len(sampler) * 3 - old.numel()]])
    assert list(sampler) == old[2::3].tolist()
