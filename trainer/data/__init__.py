"""Token data pipeline: documents -> tokenizer -> packed fixed-length blocks -> sharded, resumable loader."""

from trainer.data.hf_tokenizer import HFTokenizer, train_bpe_tokenizer
from trainer.data.lm import lm_dataloaders
from trainer.data.loader import TokenLoader
from trainer.data.packing import PackedDataset, pack_documents
from trainer.data.sources import default_corpus, read_documents, source_fingerprint
from trainer.data.token_cache import TokenStream, cached_token_stream, default_cache_dir
from trainer.data.tokenizer import ByteTokenizer, Tokenizer, load_tokenizer

__all__ = [
    "ByteTokenizer",
    "HFTokenizer",
    "PackedDataset",
    "TokenLoader",
    "TokenStream",
    "Tokenizer",
    "cached_token_stream",
    "default_cache_dir",
    "default_corpus",
    "lm_dataloaders",
    "load_tokenizer",
    "pack_documents",
    "read_documents",
    "source_fingerprint",
    "train_bpe_tokenizer",
]
