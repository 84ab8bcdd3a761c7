"""Token data pipeline: documents -> tokenizer -> packed fixed-length blocks -> sharded, resumable loader;
and Hugging Face datasets -> DataLoaders (`trainer.data.hf_data.hf_dataloaders`).

Batch convention, the one every loader here yields and every model here reads:
- causal LM: {"input_ids": LongTensor[B, T], "labels": LongTensor[B, T], "attention_mask": LongTensor[B, T]
  (only when padded: 1 on tokens, 0 on padding)}; labels are ALREADY SHIFTED: labels[b, t] is the target
  of input position t (the token at t + 1), and -100 means no loss there (padding; prompt and chat-template
  tokens under SFT masking; a last position with no next token). Models compute cross-entropy of
  logits[b, t] against labels[b, t] without shifting again.
- sequence classification: {"input_ids", "attention_mask": LongTensor[B, T], "labels": LongTensor[B]}.
- token classification: as causal LM but labels[b, t] is the label of token t itself (not shifted), -100 on
  special and word-continuation tokens and padding.
"""

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
