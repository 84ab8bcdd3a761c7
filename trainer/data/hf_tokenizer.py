"""Hugging Face `tokenizers` models read from a local path, and training a small byte-level BPE one."""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable
from pathlib import Path

EOS_TOKEN = "<|endoftext|>"
# Tried when no config names the EOS token: the spellings of common model families.
KNOWN_EOS_TOKENS = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "<|im_end|>")


class HFTokenizer:
    """A `tokenizers.Tokenizer` from tokenizer.json, EOS from tokenizer_config.json: no transformers import."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        from tokenizers import Tokenizer

        file = Path(path)
        if file.is_dir():
            file = file / "tokenizer.json"
        if not file.is_file():
            raise FileNotFoundError(
                f"{file} not found; allowed: a directory saved by train_bpe_tokenizer or a Hugging Face "
                "tokenizer's save_pretrained (it holds tokenizer.json), or that tokenizer.json itself"
            )
        self.path = file
        self._tokenizer = Tokenizer.from_file(str(file))
        eos = _eos_token(file.parent, self._tokenizer)
        self.eos_id: int = self._tokenizer.token_to_id(eos)
        self.vocab_size: int = self._tokenizer.get_vocab_size(with_added_tokens=True)
        digest = hashlib.sha256(file.read_bytes() + b"\0" + eos.encode()).hexdigest()
        self.fingerprint = f"hf-{digest[:32]}"

    def encode(self, text: str) -> list[int]:
        """The ids of `text`, without special tokens."""
        # No special tokens: packing puts EOS between documents itself; a template's BOS/EOS would double it.
        return self._tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Iterable[int]) -> str:
        """Text of `ids`, special tokens (EOS) left out."""
        return self._tokenizer.decode(list(ids), skip_special_tokens=True)


def _eos_token(directory: Path, tokenizer) -> str:
    """The token that ends a document: as the configs beside tokenizer.json say, else a well-known name."""
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        config = directory / name
        if config.is_file():
            eos = json.loads(config.read_text(encoding="utf-8")).get("eos_token")
            if isinstance(eos, dict):  # an AddedToken serialised by transformers
                eos = eos.get("content")
            if eos and tokenizer.token_to_id(eos) is not None:
                return eos
    for eos in KNOWN_EOS_TOKENS:
        if tokenizer.token_to_id(eos) is not None:
            return eos
    raise ValueError(
        f"{directory}: no EOS token found; allowed: an eos_token in tokenizer_config.json that is in the "
        f"vocabulary, or one of {list(KNOWN_EOS_TOKENS)} in it"
    )


def train_bpe_tokenizer(texts: Iterable[str], vocab_size: int, path: str | os.PathLike[str]) -> HFTokenizer:
    """Train a byte-level BPE tokenizer (lossless on any UTF-8 text) and save it where `load_tokenizer` reads it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < len(alphabet) + 1:
        raise ValueError(
            f"vocab_size={vocab_size!r} is invalid; allowed: an int >= {len(alphabet) + 1} (256 bytes + EOS)"
        )
    tokenizer = Tokenizer(models.BPE())
    # No prefix space, so decode(encode(text)) gives back exactly `text`.
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[EOS_TOKEN], initial_alphabet=alphabet, show_progress=False
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    directory = Path(path)
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(directory / "tokenizer.json"))
    # transformers.AutoTokenizer.from_pretrained(directory) reads this too.
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": EOS_TOKEN}
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    return HFTokenizer(directory)
