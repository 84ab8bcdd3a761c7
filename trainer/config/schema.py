"""The recipe's sections as dataclasses (each key with its type and default) and the smallest value of
each number field: what a recipe may say, before anything checks what it did say."""

from __future__ import annotations

import inspect
import typing
from dataclasses import dataclass, field, make_dataclass
from pathlib import Path

from trainer.models.llama import LlamaConfig


class ConfigError(ValueError):
    """A recipe or override that cannot describe a run."""


ModelSection = make_dataclass(
    "ModelSection",
    [
        ("preset", str, field(default="tiny")),
        ("class_path", str | None, field(default=None)),
        ("init_args", dict, field(default_factory=dict)),
        ("hf", str | None, field(default=None)),
        ("task", str, field(default="causal-lm")),
        ("num_labels", int | None, field(default=None)),
        ("freeze", list[str], field(default_factory=list)),
        ("lora", dict | None, field(default=None)),
        ("hf_config", dict | None, field(default=None)),
        ("reference", str | None, field(default=None)),  # task dpo: the frozen reference model's folder
        ("beta", float, field(default=0.1)),  # task dpo: the DPO loss's beta
        ("loss_chunk_tokens", int | None, field(default=None)),
    ]
    + [
        # model.moe: a mapping of MoEConfig fields that override the MoE preset's (build_llama_config)
        (name, (dict if name == "moe" else tp) | None, field(default=None))
        for name, tp in typing.get_type_hints(LlamaConfig).items()
    ],
)
ModelSection.__doc__ = (
    "A Llama `preset` with any LlamaConfig field overridden, or `class_path` (a TrainModule, or an nn.Module "
    "mapping tokens to logits) built with `init_args`, or `hf`: a local Hugging Face model directory (or "
    "'py:package.function' returning one) fine-tuned for `task` (trainer.models.hf.HFModule, with `num_labels`, "
    "`freeze` patterns and `lora` options); `moe` overrides fields of a MoE preset's MoEConfig; `hf: 'new:PATH'` "
    "with `hf_config` (a transformers LlamaConfig's fields) first creates PATH, when missing, with a new model of "
    "that config and a byte-level tokenizer; task `dpo` trains on preference pairs with `beta` against `reference` "
    "(a model folder; null: the initial weights, frozen). "
    "`loss_chunk_tokens`: CausalLM's fused output projection and loss over chunks of that many tokens."
)
NOT_LLAMA = (
    "preset", "class_path", "init_args", "hf", "task", "num_labels", "freeze", "lora", "hf_config",
    "loss_chunk_tokens", "reference", "beta",
)  # fmt: skip


@dataclass
class DataSection:
    """Arguments of trainer.data.lm_dataloaders; `path` None is the embedded corpus. `global_batch_size`
    (samples per optimizer step over all processes) replaces `batch_size` when set."""

    path: str | None = None
    val_path: str | None = None  # Hugging Face models: a separate validation file (else val_fraction of path)
    tokenizer: str = "byte"
    seq_len: int = 256
    batch_size: int = 8  # per process and micro-batch
    global_batch_size: int | None = None  # if set: batch_size = this / (processes x accumulation), exactly
    val_fraction: float = 0.05
    text_field: str = "text"
    cache_dir: str | None = None
    prompt_field: str | None = None  # Hugging Face SFT: loss on the response tokens only
    response_field: str | None = None
    messages_field: str | None = None  # chat records, formatted with the tokenizer's chat template
    label_field: str = "label"  # classification
    packing: bool = True  # causal-lm plain text: packed windows (else padded per batch)
    sft_packing: bool = False  # SFT: whole examples packed into rows, attention kept inside each
    skip_bad_rows: bool = False  # Hugging Face data: leave out (and count) malformed rows instead of failing


@dataclass
class OptimizerSection:
    """AdamW of CausalLM."""

    lr: float = 3e-4
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    weight_decay: float = 0.1
    eps: float = 1e-8


def trainer_section() -> type:
    """Every Trainer flag but strategy/callbacks/loggers/fault_tolerance (sections of their own), with its type
    and default."""
    from trainer.trainer import Trainer

    hints = typing.get_type_hints(Trainer.__init__)
    specs = []
    for name, param in inspect.signature(Trainer.__init__).parameters.items():
        if name in ("self", "strategy", "callbacks", "loggers", "fault_tolerance"):
            continue
        default = str(param.default) if isinstance(param.default, Path) else param.default
        tp = str | None if name == "default_root_dir" else hints[name]
        specs.append((name, tp, field(default=default)))
    return make_dataclass("TrainerSection", specs)


SECTIONS = ("model", "data", "optimizer", "trainer", "strategy", "callbacks", "loggers", "fault_tolerance")
NEW_HF = "new:"  # model.hf: 'new:PATH' creates a new model of model.hf_config at PATH when it is missing

# The smallest value of each number field of the model and optimizer sections: (minimum, strict), strict
# meaning the minimum itself is refused. Checked here, as a 0 or a negative fails later in a traceback.
_AT_LEAST_1, _POSITIVE, _NON_NEGATIVE = (1, False), (0, True), (0, False)
MODEL_RANGES = {
    **dict.fromkeys(
        ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "ffn_hidden", "multiple_of", "max_seq_len"),
        _AT_LEAST_1,
    ),
    **dict.fromkeys(("ffn_dim_multiplier", "norm_eps", "rope_theta", "init_std"), _POSITIVE),
    "num_labels": _AT_LEAST_1,
    "loss_chunk_tokens": _AT_LEAST_1,
    "beta": _POSITIVE,
}  # fmt: skip
MOE_RANGES = {
    **dict.fromkeys(("n_experts", "top_k", "moe_ffn_dim", "moe_every"), _AT_LEAST_1),
    **dict.fromkeys(("n_shared_experts", "n_dense_layers"), _NON_NEGATIVE),
    **dict.fromkeys(("aux_loss_coef", "z_loss_coef", "bias_update_rate"), _NON_NEGATIVE),
    "capacity_factor": _POSITIVE,
}
OPTIMIZER_RANGES = {"lr": _POSITIVE, "weight_decay": _NON_NEGATIVE, "eps": _POSITIVE}
