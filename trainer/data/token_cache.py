"""Tokenised corpora cached on disk, keyed by source and tokenizer, and written atomically."""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import pickle
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

from trainer.data.packing import pack_documents
from trainer.data.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

# Bump when the stored layout or the packing rule changes, so old entries are never read as new ones.
CACHE_FORMAT = 1


@dataclass
class TokenStream:
    """A packed token stream and where it came from."""

    tokens: torch.Tensor  # int32 [N]: each document's ids followed by EOS
    num_documents: int
    cache_hit: bool
    cache_file: Path


def default_cache_dir() -> Path:
    """`$TRAINER_CACHE`, else ~/.cache/trainer."""
    return Path(os.environ.get("TRAINER_CACHE") or Path.home() / ".cache" / "trainer")


def cached_token_stream(
    documents: Iterable[str],
    source_key: str,
    tokenizer: Tokenizer,
    cache_dir: str | os.PathLike[str] | None = None,
) -> TokenStream:
    """The packed stream of `documents`, which is read (lazily) and tokenised only when no entry for
    (source_key, tokenizer) exists."""
    key = json.dumps([CACHE_FORMAT, source_key, tokenizer.fingerprint])
    file = (
        Path(cache_dir or default_cache_dir()) / f"tokens-{hashlib.sha256(key.encode()).hexdigest()[:32]}.pt"
    )
    if file.is_file():
        try:
            # mmap: ranks on one node share the page cache instead of each holding a copy.
            entry = torch.load(file, weights_only=True, mmap=True)
            return TokenStream(entry["tokens"], int(entry["num_documents"]), True, file)
        except (RuntimeError, OSError, EOFError, KeyError, pickle.UnpicklingError) as err:
            logger.warning("token cache %s is unreadable (%s); tokenising again", file, err)
    tokens, num_documents = pack_documents(documents, tokenizer)
    try:
        _save_atomically({"tokens": tokens, "num_documents": num_documents}, file)
    except OSError as err:  # a read-only or full cache disk slows the next start, it must not stop this one
        logger.warning("could not write token cache %s (%s); continuing without it", file, err)
    return TokenStream(tokens, num_documents, False, file)


def _save_atomically(entry: dict[str, object], file: Path) -> None:
    """Temp file + os.replace: a killed run leaves at most a stray *.tmp, never a truncated entry."""
    file.parent.mkdir(parents=True, exist_ok=True)
    handle, temp = tempfile.mkstemp(dir=file.parent, prefix=file.name + ".", suffix=".tmp")
    try:
        with os.fdopen(handle, "wb") as out:
            torch.save(entry, out)
            out.flush()
            os.fsync(out.fileno())
        os.replace(temp, file)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temp)
        raise
