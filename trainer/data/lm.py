"""`lm_dataloaders`: a corpus path to train/validation loaders of packed next-token samples in one call."""

from __future__ import annotations

import logging
import os

from trainer.data.loader import TokenLoader
from trainer.data.packing import PackedDataset
from trainer.data.sources import default_corpus, read_documents, source_fingerprint
from trainer.data.token_cache import cached_token_stream
from trainer.data.tokenizer import Tokenizer, load_tokenizer

logger = logging.getLogger(__name__)


def lm_dataloaders(
    path: str | os.PathLike[str] | None,
    tokenizer: str = "byte",
    seq_len: int = 256,
    batch_size: int = 8,
    val_fraction: float = 0.05,
    seed: int = 0,
    cache_dir: str | os.PathLike[str] | None = None,
    text_field: str = "text",
) -> tuple[TokenLoader, TokenLoader, Tokenizer]:
    """(train, validation, tokenizer) for `path` (None: CPython's embedded docs), tokenised once and cached.

    The validation loader takes the last `val_fraction` of the blocks; it neither shuffles nor drops, so
    on one rank it covers every validation sample once (see `TokenLoader` for the padding across ranks).
    """
    for name, value in (("seq_len", seq_len), ("batch_size", batch_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r} is invalid; allowed: an int >= 1")
    if not (isinstance(val_fraction, (int, float)) and 0 <= val_fraction < 1):
        raise ValueError(
            f"val_fraction={val_fraction!r} is invalid; allowed: a number with 0 <= val_fraction < 1"
        )
    tok = load_tokenizer(tokenizer)
    # read_documents raises for a bad path now but reads nothing until the cache misses.
    documents = default_corpus() if path is None else read_documents(path, text_field)
    stream = cached_token_stream(documents, source_fingerprint(path, text_field), tok, cache_dir)
    train, val = PackedDataset(stream.tokens, seq_len).split(val_fraction)
    source = "the default corpus" if path is None else repr(str(path))
    if len(train) < batch_size:
        raise ValueError(
            f"corpus too small: {source} has {len(stream.tokens)} tokens, giving {len(train)} training blocks "
            f"of seq_len={seq_len}; allowed: at least batch_size={batch_size} training blocks (add text, or "
            "lower seq_len, batch_size or val_fraction)"
        )
    logger.info(
        "%s: %d documents, %d tokens (%s tokenizer); %d train / %d validation blocks of %d; token cache %s %s",
        source,
        stream.num_documents,
        len(stream.tokens),
        tokenizer,
        len(train),
        len(val),
        seq_len,
        "hit" if stream.cache_hit else "miss, wrote",
        stream.cache_file,
    )
    train_loader = TokenLoader(train, batch_size, shuffle=True, seed=seed, drop_last=True)
    val_loader = TokenLoader(val, batch_size, shuffle=False, seed=seed, drop_last=False)
    return train_loader, val_loader, tok
