"""An HFModule's tokenizer: read from a given folder, else from the model's own folder when it holds one
(no download)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

# files one of which a folder holding a tokenizer has
_TOKENIZER_FILES = (
    "tokenizer_config.json",
    "tokenizer.json",
    "tokenizer.model",
    "vocab.txt",
    "vocab.json",
    "spiece.model",
    "sentencepiece.bpe.model",
)


def load_tokenizer(tokenizer: str | os.PathLike | None, model: Any) -> Any:
    """The tokenizer in the folder `tokenizer`; else in the model folder `model` when it holds one; else None."""
    from transformers import AutoTokenizer

    if tokenizer is not None:
        path = Path(tokenizer)
        if not path.exists():
            raise FileNotFoundError(
                f"tokenizer path '{path}' does not exist; allowed: a local folder written by save_pretrained"
            )
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    if isinstance(model, (str, os.PathLike)) and any((Path(model) / f).is_file() for f in _TOKENIZER_FILES):
        return AutoTokenizer.from_pretrained(Path(model), local_files_only=True)
    return None
