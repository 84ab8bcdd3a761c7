"""A new Hugging Face Llama with a byte-level tokenizer, saved to a local directory: the setup step of
a fine-tuning recipe that has no pretrained model to start from (nothing is downloaded).

The tokenizer maps every byte to one token (ids 0-255, as trainer.data's byte tokenizer) plus <s>, </s>
and <pad>, and carries a minimal chat template, so SFT recipes can use `messages` records."""

from __future__ import annotations

import difflib
import json
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


def ensure_hf_llama(path: str | os.PathLike[str], config: dict[str, Any]) -> Path:
    """The model folder at `path`: created by `create_hf_llama` when missing, else checked to hold a model
    of `config` (an earlier run's, not one of another shape that a changed recipe would silently reuse)."""
    out = Path(path)
    if not out.exists():
        return create_hf_llama(out, config)
    config = _checked_fields(config)
    saved_file = out / "config.json"
    if not saved_file.is_file():
        raise ValueError(
            f"model.hf='new:{path}' exists but holds no config.json; allowed: a model folder this recipe "
            "created, or a path that does not exist yet (a new model of model.hf_config is saved there)"
        )
    saved = json.loads(saved_file.read_text())
    for key, value in config.items():
        if not isinstance(value, dict) and saved.get(key) != value:
            raise ValueError(
                f"model.hf='new:{path}' holds a model with {key}={saved.get(key)!r}, not model.hf_config's "
                f"{value!r}; allowed: delete that folder to create the new model, or another path"
            )
    return out


def create_hf_llama(path: str | os.PathLike[str], config: dict[str, Any]) -> Path:
    """Save a randomly initialised `LlamaForCausalLM` of `config` (transformers LlamaConfig fields; the
    vocabulary is the byte tokenizer's) and its tokenizer to `path`; returns the directory."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    try:
        from huggingface_hub.errors import StrictDataclassError  # transformers 5's typed config fields
    except ImportError:  # an older huggingface_hub: no typed fields, nothing more to catch
        StrictDataclassError = TypeError  # noqa: N806

    config = _checked_fields(config)
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
    except (TypeError, ValueError, StrictDataclassError) as err:
        raise ValueError(f"model.hf_config: {' '.join(str(err).split())}") from err
    torch.manual_seed(0)
    out = Path(path)
    LlamaForCausalLM(llama_config).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


# the fields the byte tokenizer decides; the sizes, each an int >= 1
_FROM_TOKENIZER = ("vocab_size", "bos_token_id", "eos_token_id", "pad_token_id")
_SIZES = (
    "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
    "max_position_embeddings", "head_dim",
)  # fmt: skip


def _checked_fields(config: dict[str, Any]) -> dict[str, Any]:
    """`config` with every key a transformers LlamaConfig field (LlamaConfig ignores a misspelt one), every
    size an int >= 1 (a 0 fails deep inside the model's construction) and the epsilons as floats (YAML 1.1
    reads 1e-6, without a dot, as a string)."""
    from transformers import LlamaConfig

    fields = [name for name in LlamaConfig().to_dict() if name not in _FROM_TOKENIZER]
    for key, value in config.items():
        if key in _FROM_TOKENIZER:
            raise ValueError(f"model.hf_config.{key} is set by the byte tokenizer; allowed: leave it out")
        if key not in fields:
            close = difflib.get_close_matches(key, fields, n=1)
            hint = f"did you mean '{close[0]}'?" if close else f"allowed: {', '.join(fields)}"
            raise ValueError(f"unknown key 'model.hf_config.{key}'; {hint}")
        if key in _SIZES and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"model.hf_config.{key}={value!r} is invalid; allowed: an int >= 1")
    checked = dict(config)
    for key in set(config) & {"rms_norm_eps", "initializer_range"}:
        value = _number(config[key])
        if value is None or value <= 0:
            raise ValueError(f"model.hf_config.{key}={config[key]!r} is invalid; allowed: a number > 0")
        checked[key] = value
    return checked


def _number(value: Any) -> float | None:
    """`value` as a float when it is a number or a number's text, else None."""
    if isinstance(value, bool):
        return None
    try:
        return float(value)
    except (TypeError, ValueError):
        return None
