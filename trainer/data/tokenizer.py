"""The tokenizer interface the data pipeline needs, the byte tokenizer, and `load_tokenizer`."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Protocol, runtime_checkable

from trainer.data.hf_tokenizer import HFTokenizer


@runtime_checkable
class Tokenizer(Protocol):
    """What packing and recipes use; `fingerprint` changes whenever `encode` could give other ids."""

    vocab_size: int
    eos_id: int
    fingerprint: str

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Iterable[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255 and EOS as 256: needs no files and never meets an unknown character."""

    vocab_size = 257
    eos_id = 256
    fingerprint = "byte-v1"

    def encode(self, text: str) -> list[int]:
        """The UTF-8 bytes of `text`, without EOS (packing adds it between documents)."""
        return list(text.encode("utf-8"))

    def decode(self, ids: Iterable[int]) -> str:
        """Text of `ids`, EOS left out; a model's invalid byte runs become U+FFFD rather than an error."""
        return bytes(i for i in ids if i != self.eos_id).decode("utf-8", errors="replace")


def load_tokenizer(spec: str) -> Tokenizer:
    """`"byte"` gives a `ByteTokenizer`; anything else is a local Hugging Face tokenizer directory or tokenizer.json."""
    if spec == "byte":
        return ByteTokenizer()
    if not Path(spec).exists():
        raise FileNotFoundError(
            f"tokenizer {spec!r} not found; allowed: 'byte' or a local directory holding tokenizer.json "
            "(or that file itself)"
        )
    return HFTokenizer(spec)
