"""Malformed rows and unreadable data files, as a user meets them: a preference pair without "rejected" or
with a number for "chosen", a chat message without "content", a line that is not JSON, a binary ".txt".
Each fails in one line naming FILE:LINE and the field; `skip_bad_rows` (recipes: data.skip_bad_rows) trains
on the other rows and says how many were left out."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import REPO, failure, run_cli
from hf_dpo_script import tokenizer

from trainer.data import lm_dataloaders
from trainer.data.hf_data import hf_dataloaders
from trainer.data.hf_preference import preference_dataloaders

DPO = REPO / "recipes" / "data" / "dpo_tiny.jsonl"
SFT = REPO / "recipes" / "data" / "sft_tiny.jsonl"
SKIP = "skip_bad_rows=True (recipes: data.skip_bad_rows=true) skips such rows"


def broken(source: Path, out: Path, n: int, edits: dict[int, object]) -> Path:
    """The first `n` records of `source` as JSON lines in `out`, record i (0-based) changed by `edits[i]` (a
    function of the record, or a raw line), with a blank line after the first record (rows != lines)."""
    lines = source.read_text().splitlines()[:n]
    for i, edit in edits.items():
        lines[i] = edit if isinstance(edit, str) else json.dumps(edit(json.loads(lines[i])))
    out.write_text("\n".join([lines[0], "", *lines[1:]]) + "\n")
    return out


def without(key: str):
    return lambda record: {k: v for k, v in record.items() if k != key}


def test_a_malformed_preference_pair_is_refused_in_one_line_naming_file_line_and_field(tmp_path):
    no_rejected = broken(DPO, tmp_path / "a.jsonl", 40, {5: without("rejected")})
    with pytest.raises(ValueError) as err:
        preference_dataloaders(no_rejected, tokenizer(), seq_len=96, batch_size=4)
    assert str(err.value) == f"{no_rejected}:7: field 'rejected' is missing; allowed: a string ({SKIP})"

    number = broken(DPO, tmp_path / "b.jsonl", 40, {9: lambda r: {**r, "chosen": 123}})
    with pytest.raises(ValueError) as err:
        preference_dataloaders(number, tokenizer(), seq_len=96, batch_size=4)
    # datasets refuses a column of strings and numbers itself, or reads it as JSON values: the same line
    assert str(err.value).startswith(f"{number}:11: field 'chosen' is int 123, not a string")
    assert "\n" not in str(err.value)


def test_skip_bad_rows_trains_on_the_others_and_counts_what_it_left_out(tmp_path, caplog):
    data = broken(
        DPO, tmp_path / "pairs.jsonl", 40, {5: without("rejected"), 9: lambda r: {**r, "chosen": None}}
    )
    caplog.set_level("WARNING", logger="trainer")
    train, val = preference_dataloaders(
        data, tokenizer(), seq_len=96, batch_size=4, val_fraction=0, skip_bad_rows=True
    )
    assert val is None and len(train.dataset) == 38
    assert (
        f"2 of 40 rows skipped: {data}:7 field 'rejected' is missing, {data}:11 field 'chosen' is missing"
    ) in caplog.text
    clean, _ = preference_dataloaders(
        broken(DPO, tmp_path / "clean.jsonl", 40, {}), tokenizer(), seq_len=96, batch_size=4, val_fraction=0
    )
    kept = [i for i in range(40) if i not in (5, 9)]  # the same pairs, tokenised the same
    assert [train.dataset[j]["rejected_input_ids"] for j in range(38)] == [
        clean.dataset[i]["rejected_input_ids"] for i in kept
    ]


def test_sft_rows_without_text_are_refused_for_chat_and_prompt_response_data(tmp_path):
    from trainer.models.hf_create import byte_tokenizer

    chat = broken(
        SFT,
        tmp_path / "chat.jsonl",
        40,
        {3: lambda r: {"messages": [r["messages"][0], {"role": "assistant"}]}},
    )
    for packing in (False, True):
        with pytest.raises(ValueError) as err:
            hf_dataloaders(chat, byte_tokenizer(), messages_field="messages", seq_len=64, sft_packing=packing)
        assert str(err.value).startswith(f"{chat}:5: field 'messages' message 1 has no 'content'; allowed: ")

    pairs = [{"q": f"question {i}", "a": f"answer {i}"} for i in range(20)]
    pairs[12]["a"] = None
    qa = tmp_path / "qa.jsonl"
    qa.write_text("".join(json.dumps(p) + "\n" for p in pairs))
    with pytest.raises(ValueError, match=rf"^{qa}:13: field 'a' is missing; allowed: a string"):
        hf_dataloaders(qa, tokenizer(), prompt_field="q", response_field="a", seq_len=32, batch_size=2)
    train, _ = hf_dataloaders(
        qa, tokenizer(), prompt_field="q", response_field="a", seq_len=32, batch_size=2, val_fraction=0,
        skip_bad_rows=True,
    )  # fmt: skip
    assert len(train.dataset) == 19


def test_unreadable_data_files_are_named_with_their_line(tmp_path):
    text = tmp_path / "notes.txt"
    text.write_bytes(b"plain words\nmore words\n\x89PNG\r\n\x1a\n")
    for read in (
        lambda: hf_dataloaders(text, tokenizer(), seq_len=8, batch_size=1),
        lambda: list(lm_dataloaders(text, seq_len=8, batch_size=1, cache_dir=tmp_path / "cache")),
    ):
        with pytest.raises(ValueError) as err:
            read()
        assert str(err.value) == f"{text}:3: not UTF-8 text (byte 1 of the line is 0x89); allowed: UTF-8 text"

    not_json = broken(DPO, tmp_path / "pairs.jsonl", 40, {12: '{"prompt": "x", "chosen": oops}'})
    with pytest.raises(ValueError) as err:
        preference_dataloaders(not_json, tokenizer(), seq_len=96, batch_size=4)
    assert str(err.value).startswith(f"{not_json}:14: invalid JSON (Expecting value at column 27); allowed: ")


@pytest.mark.slow
def test_the_cli_names_the_data_file_line_and_field_as_its_last_line(tmp_path):
    data = broken(
        SFT,
        tmp_path / "chat.jsonl",
        200,
        {30: lambda r: {"messages": r["messages"][:1] + [{"role": "assistant"}]}},
    )
    args = (
        "fit", str(REPO / "recipes" / "hf_sft_llama_tiny.yaml"), f"trainer.default_root_dir={tmp_path / 'run'}",
        f"model.hf=new:{tmp_path / 'base'}", f"data.path={data}", "data.sft_packing=true", "trainer.max_steps=2",
        "trainer.val_check_interval=2", "trainer.limit_val_batches=1",
    )  # fmt: skip
    done = run_cli(*args, cwd=REPO)
    assert done.returncode == 2, failure(done.stderr)
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith(f"trainer: error: data: {data}:32: field 'messages' message 1 has no 'content'"), (
        failure(done.stderr)
    )
    done = run_cli(*args, "data.skip_bad_rows=true", cwd=REPO)
    assert done.returncode == 0, failure(done.stderr)
    assert f"1 of 200 rows skipped: {data}:32 field 'messages' message 1 has no 'content'" in done.stderr
