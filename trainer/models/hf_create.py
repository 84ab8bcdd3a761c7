"""A new Hugging Face Llama with a byte-level tokenizer, saved to a local directory: the setup step of
a fine-tuning recipe that has no pretrained model to start from (nothing is downloaded).

The tokenizer maps every byte to one token (ids 0-255, as trainer.data's byte tokenizer) plus <s>, </s>
and <pad>, and carries a minimal chat template, so SFT recipes can use `messages` records."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

CHAT_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }}</s>"
    "{% endgeneration %}{% else %}<|{{ m['role'] }}|>{{ m['content'] }}\n<|assistant|>{% endif %}{% endfor %}"
)


def byte_tokenizer() -> Any:
    """A `PreTrainedTokenizerFast` with one token per byte (ByteLevel, no merges) and <s>, </s>, <pad>."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()  # the 256 printable stand-ins of the bytes
    byte_to_char = sorted(alphabet, key=lambda c: _byte_of(c))
    vocab = {char: i for i, char in enumerate(byte_to_char)}
    for special in ("<s>", "</s>", "<pad>"):
        vocab[special] = len(vocab)
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core, bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def _byte_of(char: str) -> int:
    """The byte that ByteLevel's printable character `char` stands for (GPT-2's bytes_to_unicode)."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    if ord(char) in printable:
        return ord(char)
    others = [b for b in range(256) if b not in printable]
    return others[ord(char) - 256]


def create_hf_llama(path: str | os.PathLike[str], config: dict[str, Any]) -> Path:
    """Save a randomly initialised `LlamaForCausalLM` of `config` (transformers LlamaConfig fields; the
    vocabulary is the byte tokenizer's) and its tokenizer to `path`; returns the directory."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = byte_tokenizer()
    fields = {
        **config,
        "vocab_size": len(tokenizer),
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
    }
    try:
        llama_config = LlamaConfig(**fields)
    except TypeError as err:
        raise ValueError(f"model.hf_config: {err}") from err
    torch.manual_seed(0)
    out = Path(path)
    LlamaForCausalLM(llama_config).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out
