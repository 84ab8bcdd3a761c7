"""The token data pipeline: sources, tokenizers, packing, cache, and the sharded resumable loader."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset

from trainer.data import (
    ByteTokenizer,
    HFTokenizer,
    PackedDataset,
    TokenLoader,
    cached_token_stream,
    default_corpus,
    lm_dataloaders,
    load_tokenizer,
    pack_documents,
    read_documents,
    source_fingerprint,
    train_bpe_tokenizer,
)
from trainer.data.distributed import shard_loader

EOS = ByteTokenizer.eos_id


def numbered_blocks(num_blocks: int, seq_len: int = 2) -> PackedDataset:
    """A dataset whose sample i starts with token i * seq_len, so a batch says which samples it holds."""
    return PackedDataset(torch.arange(num_blocks * seq_len + 1, dtype=torch.int32), seq_len)


def sample_ids(batches: list[dict[str, torch.Tensor]], seq_len: int = 2) -> list[int]:
    return [int(first) // seq_len for batch in batches for first in batch["input_ids"][:, 0]]


def write_corpus(directory: Path, texts: dict[str, str]) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    for name, text in texts.items():
        (directory / name).write_text(text, encoding="utf-8")
    return directory


def test_packing_keeps_every_token_as_a_label_once_and_separates_documents_with_eos():
    documents = ["hello", "wörld!", "abc" * 7]
    tokens, num_documents = pack_documents(documents, ByteTokenizer())
    expected = [t for doc in documents for t in [*doc.encode("utf-8"), EOS]]
    assert num_documents == 3 and tokens.tolist() == expected

    seq_len = 4
    dataset = PackedDataset(tokens, seq_len)
    samples = [dataset[i] for i in range(len(dataset))]
    for i, sample in enumerate(samples):
        assert sample["input_ids"].dtype == sample["labels"].dtype == torch.long
        assert sample["input_ids"].tolist() == expected[i * seq_len : (i + 1) * seq_len]
        assert sample["labels"].tolist() == expected[i * seq_len + 1 : (i + 1) * seq_len + 1]
    labels = torch.cat([s["labels"] for s in samples]).tolist()
    # Every token but the first (no context) and the documented tail is a target exactly once.
    assert labels == expected[1 : 1 + len(labels)]
    assert 1 + len(labels) + dataset.dropped_tokens == len(expected)
    assert dataset.dropped_tokens == (len(expected) - 1) % seq_len < seq_len


def test_validation_split_takes_the_last_blocks_and_shares_no_target_with_train():
    train, val = numbered_blocks(10).split(0.25)
    assert (len(train), len(val)) == (7, 3)  # 2.5 blocks round up: a positive fraction is never empty
    train_labels = {t for i in range(len(train)) for t in train[i]["labels"].tolist()}
    val_labels = {t for i in range(len(val)) for t in val[i]["labels"].tolist()}
    assert train_labels.isdisjoint(val_labels) and train_labels | val_labels == set(range(1, 21))


def test_two_ranks_see_disjoint_samples_that_together_cover_the_epoch():
    dataset = numbered_blocks(20)
    ranks = [TokenLoader(dataset, batch_size=3, seed=5, rank=r, world_size=2) for r in range(2)]
    seen = [sample_ids(list(loader)) for loader in ranks]
    assert len(ranks[0]) == len(ranks[1]) == 3  # 20 samples // global batch 6
    assert set(seen[0]).isdisjoint(seen[1])
    # The documented drop: the permutation's tail beyond whole global batches (20 - 18 samples).
    permutation = torch.randperm(20, generator=torch.Generator().manual_seed(5)).tolist()
    assert set(seen[0]) | set(seen[1]) == set(permutation[:18])

    # Without drop_last every sample is seen; ranks still yield equally many batches (the last short).
    ranks = [TokenLoader(dataset, 3, shuffle=False, drop_last=False, rank=r, world_size=3) for r in range(3)]
    batches = [list(loader) for loader in ranks]
    assert [len(b) for b in batches] == [len(loader) for loader in ranks] == [3, 3, 3]
    assert set().union(*(sample_ids(b) for b in batches)) == set(range(20))
    assert sum(len(sample_ids(b)) for b in batches) == 21  # padded by one repeated sample

    with pytest.raises(ValueError, match=r"rank=2 is invalid.*world_size=2"):
        ranks[0].shard_for_rank(2, 2)


def test_shuffle_differs_between_epochs_and_repeats_for_the_same_seed():
    def two_epochs(seed: int) -> list[list[int]]:
        loader = TokenLoader(numbered_blocks(32), batch_size=4, seed=seed)
        return [sample_ids(list(loader)) for _ in range(2)]

    first, again, other_seed = two_epochs(0), two_epochs(0), two_epochs(1)
    assert first == again
    assert first[0] != first[1] and sorted(first[0]) == sorted(first[1]) == list(range(32))
    assert other_seed[0] != first[0]


def test_resume_mid_epoch_continues_with_exactly_the_next_batch_across_epochs(tmp_path):
    def make() -> TokenLoader:
        return TokenLoader(numbered_blocks(41), batch_size=4, seed=3, rank=1, world_size=2)

    reference = make()
    expected = [sample_ids(list(reference)) for _ in range(3)]  # 5 batches of 4 per epoch on this rank
    flat = [ids for epoch in expected for ids in epoch]

    for epoch, taken in [(0, 2), (1, 5)]:  # mid-epoch, and after the last batch of an epoch
        interrupted = make()
        for _ in range(epoch):
            list(interrupted)
        batches = iter(interrupted)
        for _ in range(taken):
            next(batches)
        torch.save(interrupted.state_dict(), tmp_path / "loader.pt")

        resumed = make()
        resumed.load_state_dict(torch.load(tmp_path / "loader.pt", weights_only=True))
        rest = sample_ids(list(resumed)) + sample_ids(list(resumed))
        start = epoch * 20 + taken * 4
        assert rest == flat[start : start + len(rest)], f"resumed at epoch {epoch}, batch {taken}"
        assert len(rest) >= 20  # it crossed into the next epoch, reshuffled as the reference did
        assert resumed.state_dict()["position"] == 0

    other = TokenLoader(numbered_blocks(41), batch_size=2, seed=3, rank=1, world_size=2)
    other.load_state_dict(make().state_dict())
    with pytest.raises(ValueError, match="global_batch=8 in the saved state but 4 now"):
        iter(other)


def test_second_call_hits_the_cache_and_a_changed_file_invalidates_it(tmp_path, monkeypatch, caplog):
    calls = []
    encode = ByteTokenizer.encode
    monkeypatch.setattr(ByteTokenizer, "encode", lambda self, text: calls.append(text) or encode(self, text))
    corpus = write_corpus(tmp_path / "corpus", {"a.txt": "alpha " * 100, "b.md": "bravo " * 100})
    cache = tmp_path / "cache"

    caplog.set_level(logging.INFO, logger="trainer.data")
    first = lm_dataloaders(str(corpus), seq_len=16, batch_size=4, cache_dir=cache)[0]
    assert len(calls) == 2 and "cache miss" in caplog.text
    second = lm_dataloaders(str(corpus), seq_len=16, batch_size=4, cache_dir=cache)[0]
    assert len(calls) == 2 and "cache hit" in caplog.text
    assert torch.equal(first.dataset.tokens, second.dataset.tokens)

    (corpus / "b.md").write_text("gamma " * 100, encoding="utf-8")  # same size: only the mtime tells
    os.utime(corpus / "b.md", ns=(1, 1))  # a different mtime even where the clock is coarse
    changed = lm_dataloaders(str(corpus), seq_len=16, batch_size=4, cache_dir=cache)[0]
    assert len(calls) == 4
    assert ByteTokenizer().decode(changed.dataset.tokens.tolist()) == "alpha " * 100 + "gamma " * 100
    assert not list(cache.glob("*.tmp"))


def test_unreadable_cache_entry_is_tokenised_again(tmp_path, caplog):
    documents = ["some text", "more text"]
    first = cached_token_stream(documents, "key", ByteTokenizer(), tmp_path)
    first.cache_file.write_bytes(b"not a torch file")
    again = cached_token_stream(documents, "key", ByteTokenizer(), tmp_path)
    assert not again.cache_hit and "unreadable" in caplog.text
    assert torch.equal(again.tokens, first.tokens)
    assert cached_token_stream(documents, "key", ByteTokenizer(), tmp_path).cache_hit


def test_byte_tokenizer_round_trips_text():
    tokenizer = load_tokenizer("byte")
    text = "Grüße, 世界! 🙂\n\ttabs and  spaces"
    ids = tokenizer.encode(text)
    assert ids == list(text.encode("utf-8")) and max(ids) < 256
    assert (tokenizer.vocab_size, tokenizer.eos_id) == (257, 256)
    assert tokenizer.decode(ids) == text
    assert tokenizer.decode([*ids, EOS]) == text  # EOS marks a boundary, it is not text


def test_trained_bpe_tokenizer_saves_reloads_and_round_trips(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    corpus = default_corpus()[:10]
    trained = train_bpe_tokenizer(corpus, vocab_size=400, path=tmp_path / "bpe")
    loaded = load_tokenizer(str(tmp_path / "bpe"))
    assert isinstance(loaded, HFTokenizer) and loaded.fingerprint == trained.fingerprint
    assert loaded.vocab_size == 400 and loaded.decode([loaded.eos_id]) == ""

    text = "Grüße, 世界! 🙂 The assert statement\n\tis a way to insert debugging assertions."
    ids = loaded.encode(text)
    assert loaded.decode(ids) == text
    assert len(ids) < len(text.encode("utf-8"))  # merges learned from the corpus compress it

    # The saved directory is a regular Hugging Face tokenizer: transformers agrees on ids and EOS.
    from transformers import AutoTokenizer

    reference = AutoTokenizer.from_pretrained(str(tmp_path / "bpe"))
    assert reference.encode(text, add_special_tokens=False) == ids
    assert reference.eos_token_id == loaded.eos_id


def test_jsonl_and_a_saved_datasets_directory_are_read(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    jsonl = tmp_path / "docs.jsonl"
    jsonl.write_text('{"body": "first doc", "id": 1}\n\n{"body": "second\\ndoc"}\n', encoding="utf-8")
    assert list(read_documents(jsonl, text_field="body")) == ["first doc", "second\ndoc"]

    import datasets

    datasets.Dataset.from_dict({"text": ["one", "two", "three"], "n": [1, 2, 3]}).save_to_disk(
        tmp_path / "ds"
    )
    assert list(read_documents(tmp_path / "ds")) == ["one", "two", "three"]
    train, val, _ = lm_dataloaders(
        str(tmp_path / "ds"), seq_len=2, batch_size=2, val_fraction=0.2, cache_dir=tmp_path / "cache"
    )
    assert train.dataset.tokens.tolist() == [*b"one", EOS, *b"two", EOS, *b"three", EOS]


def test_default_corpus_is_nonempty_and_deterministic(tmp_path):
    from pydoc_data.topics import topics

    documents = default_corpus()
    assert len(documents) == len(topics) > 50 and sum(map(len, documents)) > 100_000
    assert documents == default_corpus() == [topics[key] for key in sorted(topics)]
    assert source_fingerprint(None) == source_fingerprint(None)

    cold_train, cold_val, _ = lm_dataloaders(None, seq_len=64, cache_dir=tmp_path)
    warm_train, warm_val, _ = lm_dataloaders(None, seq_len=64, cache_dir=tmp_path)
    assert torch.equal(next(iter(cold_train))["input_ids"], next(iter(warm_train))["input_ids"])
    assert len(cold_val) == len(warm_val) > 0
    # Validation neither shuffles nor drops: it walks its blocks once, in order.
    blocks = cold_val.dataset.blocks
    val_labels = torch.cat([batch["labels"].flatten() for batch in cold_val])
    assert torch.equal(
        val_labels, cold_val.dataset.tokens[blocks.start * 64 + 1 : blocks.stop * 64 + 1].long()
    )
    assert blocks.stop == (len(cold_val.dataset.tokens) - 1) // 64  # the last blocks of the stream


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"path": "missing-corpus"}, FileNotFoundError, r"'missing-corpus' does not exist; allowed: a \.txt"),
        (
            {"tokenizer": "no-such-tokenizer"},
            FileNotFoundError,
            r"'no-such-tokenizer' not found; allowed: 'byte'",
        ),
        ({"path": "no-text.jsonl"}, ValueError, r"no-text\.jsonl:2: no string field 'text'"),
        ({"seq_len": 0}, ValueError, r"seq_len=0 is invalid; allowed: an int >= 1"),
        ({"batch_size": 0}, ValueError, r"batch_size=0 is invalid; allowed: an int >= 1"),
        (
            {"val_fraction": 1.5},
            ValueError,
            r"val_fraction=1\.5 is invalid; allowed: .*0 <= val_fraction < 1",
        ),
        (
            {"seq_len": 16},
            ValueError,
            r"corpus too small: 'small' has 98 tokens, giving 5 training blocks .* batch_size=8",
        ),
    ],
)
def test_bad_input_gets_a_one_line_error_naming_the_value(tmp_path, monkeypatch, kwargs, error, message):
    monkeypatch.chdir(tmp_path)
    write_corpus(tmp_path / "small", {"a.txt": "x" * 97})
    (tmp_path / "no-text.jsonl").write_text(
        '{"text": "ok"}\n{"content": "no text field"}\n', encoding="utf-8"
    )
    arguments = {"path": "small", "cache_dir": str(tmp_path / "cache"), **kwargs}
    with pytest.raises(error, match=message) as caught:
        lm_dataloaders(**arguments)
    assert "\n" not in str(caught.value)


def test_a_position_resumes_on_another_number_of_ranks_with_the_same_global_batch():
    data = numbered_blocks(64)
    four = [TokenLoader(data, batch_size=2, seed=3, rank=r, world_size=4) for r in range(4)]
    iters = [iter(loader) for loader in four]
    for it in iters:
        next(it)  # one global batch consumed
    state = four[0].state_dict()
    expected = sorted(int(i) for it in iters for i in next(it)["input_ids"][:, 0])
    two = [TokenLoader(data, batch_size=4, seed=3, rank=r, world_size=2) for r in range(2)]
    for loader in two:
        loader.load_state_dict(state)
    got = sorted(int(i) for loader in two for i in next(iter(loader))["input_ids"][:, 0])
    assert got == expected


class Numbers(IterableDataset):
    """0..n-1 as one stream; `split_over_workers`: each DataLoader worker reads its own slice, as PyTorch's
    docs show for an iterable dataset used with workers."""

    def __init__(self, n: int, split_over_workers: bool) -> None:
        self.n, self.split_over_workers = n, split_over_workers

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        if not self.split_over_workers or info is None:
            return iter(range(self.n))
        return iter(range(info.id, self.n, info.num_workers))


@pytest.mark.parametrize("split_over_workers", [False, True])
def test_an_iterable_dataset_with_workers_yields_each_sample_once_over_ranks_and_workers(split_over_workers):
    def rank_batches(rank: int, workers: int) -> list[list[int]]:
        loader = DataLoader(Numbers(21, split_over_workers), batch_size=2, num_workers=workers)
        return [batch.tolist() for batch in shard_loader(loader, rank, 2, seed=0)]

    with_workers = [rank_batches(rank, workers=2) for rank in range(2)]
    assert len(with_workers[0]) == len(with_workers[1])  # ranks step together: as many batches each
    for rank, batches in enumerate(with_workers):
        samples = [i for batch in batches for i in batch]
        without = {i for batch in rank_batches(rank, workers=0) for i in batch}
        assert len(samples) == len(set(samples)) == 10
        # rank r keeps item r of each complete round of 2; item 20 starts an incomplete round: dropped
        assert set(samples) == without == set(range(rank, 20, 2))
