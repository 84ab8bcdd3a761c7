"""The `transformers` model an HFModule wraps: built for its task from a local folder, a config or an
instance, wrapped in LoRA adapters, partly frozen."""

from __future__ import annotations

import copy
import fnmatch
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from trainer.models import hf_adapters

TASKS = ("causal-lm", "seq-classification", "token-classification", "seq2seq", "dpo")
# the Auto class of each task, and the task type PEFT gives the model it wraps
_AUTO = {
    "causal-lm": "AutoModelForCausalLM",
    "seq-classification": "AutoModelForSequenceClassification",
    "token-classification": "AutoModelForTokenClassification",
    "seq2seq": "AutoModelForSeq2SeqLM",
    "dpo": "AutoModelForCausalLM",  # a causal LM trained on preference pairs (trainer.models.hf_dpo)
}
_MAPPINGS = {
    "causal-lm": "MODEL_FOR_CAUSAL_LM_MAPPING",
    "seq-classification": "MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING",
    "token-classification": "MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING",
    "seq2seq": "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING",
    "dpo": "MODEL_FOR_CAUSAL_LM_MAPPING",
}
_PEFT_TASK_TYPE = {
    "causal-lm": "CAUSAL_LM",
    "seq-classification": "SEQ_CLS",
    "token-classification": "TOKEN_CLS",
    "seq2seq": "SEQ_2_SEQ_LM",
    "dpo": "CAUSAL_LM",
}
WRAPPER_PREFIX = "_checkpoint_wrapped_module."  # what activation checkpointing inserts in names
_PEFT_PREFIX = "base_model.model."  # what PEFT puts before the wrapped model's own names


def _auto(task: str) -> Any:
    import transformers

    return getattr(transformers, _AUTO[task])


def _mapping(task: str) -> Any:
    """transformers' Auto-class table of `task` (config class -> model class, built from its
    `MODEL_FOR_..._MAPPING_NAMES` by model type, with the classes registered since)."""
    from transformers.models.auto import modeling_auto

    return getattr(modeling_auto, _MAPPINGS[task])


def _model_class(task: str, config: Any) -> type | None:
    """The class `task`'s Auto class builds for `config`, or None if it builds none."""
    try:
        return _mapping(task)[type(config)]
    except KeyError:
        return None


def _bidirectional(config: Any) -> bool:
    """Whether transformers trains `config`'s model type as a bidirectional encoder: it has a masked-LM
    class (BERT, RoBERTa), and is not a seq2seq model, whose causal-LM class is its decoder half (BART). The
    type's causal-LM class is then the encoder under an LM head, which attends causally only with
    `config.is_decoder=True`, and would otherwise see the very tokens it is to predict."""
    from transformers.models.auto import modeling_auto

    masked = modeling_auto.MODEL_FOR_MASKED_LM_MAPPING
    return type(config) in masked and type(config) not in _mapping("seq2seq")


def _can_do(task: str, config: Any) -> bool:
    """`task`'s Auto class builds a model for `config`'s type; as a causal LM, one that attends causally."""
    if _model_class(task, config) is None:
        return False
    causal = task in ("causal-lm", "dpo")
    return not causal or not _bidirectional(config) or bool(getattr(config, "is_decoder", False))


def _check_task(task: str, config: Any, name: str | None = None) -> None:
    """A one-line ValueError when `config`'s model type cannot do `task`, naming the tasks it can do."""
    if _can_do(task, config):
        return
    able = [t for t in TASKS if _can_do(t, config)]
    kind = getattr(config, "model_type", None) or type(config).__name__
    what = f"a {name} ({kind!r})" if name else f"a {kind!r} model"
    why = (
        " (a bidirectional encoder: set config.is_decoder=True to train it causally)"
        if _model_class(task, config)
        else ""
    )
    raise ValueError(
        f"{what} cannot do task {task!r}{why}; allowed tasks for it: "
        f"{', '.join(map(repr, able)) if able else 'none of ' + ', '.join(map(repr, TASKS))}"
    )


def build(model: Any, task: str, num_labels: int | None) -> tuple[nn.Module, list[str] | None]:
    """The model, and the names of its randomly initialised weights (None: all of them)."""
    from transformers import PretrainedConfig

    if isinstance(model, (str, os.PathLike)):
        path = Path(model)
        if not path.exists():
            raise FileNotFoundError(
                f"model path '{path}' does not exist; allowed: a local folder written by save_pretrained"
            )
        if not (path / "config.json").is_file():
            raise ValueError(
                f"model path '{path}' has no config.json; allowed: a local folder written by save_pretrained"
            )
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(path, local_files_only=True)
        _check_task(task, config)
        extra = {} if num_labels is None else {"num_labels": num_labels}
        # float32 master weights whatever the folder's dtype: the Trainer's precision sets the compute dtype
        from packaging.version import Version
        from transformers import __version__

        dtype_key = "dtype" if Version(__version__) >= Version("4.56") else "torch_dtype"  # renamed in 4.56
        extra[dtype_key] = torch.float32
        built, info = _auto(task).from_pretrained(
            path, local_files_only=True, output_loading_info=True, **extra
        )
        return built, [*info["missing_keys"], *(key for key, *_ in info["mismatched_keys"])]
    if isinstance(model, PretrainedConfig):
        _check_task(task, model)
        config = copy.deepcopy(model)
        if num_labels is not None:
            config.num_labels = num_labels
        return _auto(task).from_config(config), None
    if isinstance(model, nn.Module) and isinstance(getattr(model, "config", None), PretrainedConfig):
        base = model.get_base_model() if callable(getattr(model, "get_base_model", None)) else model
        expected = _model_class(task, base.config)
        if expected is not None and isinstance(base, expected):
            _check_task(task, base.config, type(base).__name__)  # an encoder as a causal LM
        elif expected is not None or type(base).__module__.startswith("transformers."):
            able = [t for t in TASKS if isinstance(base, _model_class(t, base.config) or ())]
            raise ValueError(
                f"a {type(base).__name__} ({base.config.model_type!r}) cannot do task {task!r}; allowed tasks "
                f"for it: {', '.join(map(repr, able)) or 'none'} (or build it with the task's Auto class)"
            )
        if num_labels is not None and getattr(base.config, "num_labels", num_labels) != num_labels:
            raise ValueError(
                f"num_labels={num_labels} but the given model has {base.config.num_labels}; "
                "allowed: None or the model's own"
            )
        return model, []
    raise TypeError(
        f"model is a {type(model).__name__}; allowed: a local folder path, a transformers PretrainedConfig "
        "or a PreTrainedModel"
    )


def checked_num_labels(labels: Sequence[str] | None, num_labels: int | None, task: str) -> int | None:
    """`num_labels`, or the number of class `labels` (which must agree with it)."""
    if labels is None:
        return num_labels
    if task not in ("seq-classification", "token-classification") or isinstance(labels, str):
        raise ValueError(
            f"labels={labels!r} is invalid for task {task!r}; allowed: a list of class names with "
            "seq-classification or token-classification"
        )
    names = list(labels)
    if not names or len(set(names)) != len(names) or (num_labels is not None and num_labels != len(names)):
        raise ValueError(
            f"labels={names!r} with num_labels={num_labels!r}; allowed: distinct class names, as many as num_labels"
        )
    return len(names)


def wrap_lora(model: nn.Module, lora: dict[str, Any], task: str) -> nn.Module:
    """`model` inside PEFT's LoRA wrapper, `lora` being `peft.LoraConfig`'s keyword arguments (`task_type`
    defaults to the task's)."""
    try:
        import peft
    except ImportError:
        raise ImportError(
            "lora= needs the optional dependency peft, which is not installed: pip install .[peft]"
        ) from None
    options = {"task_type": _PEFT_TASK_TYPE[task], **lora}
    try:
        config = peft.LoraConfig(**options)
    except TypeError as err:
        raise ValueError(f"lora={lora!r} is not a valid peft.LoraConfig: {err}") from None
    return hf_adapters.peft_wrap(model, config)


def freeze(model: nn.Module, patterns: str | Sequence[str]) -> None:
    """Stop training the parameters whose names match any of the fnmatch `patterns` (also without PEFT's and
    activation checkpointing's insertions); a pattern that matches none is a one-line ValueError."""
    patterns = [patterns] if isinstance(patterns, str) else list(patterns)
    named = list(model.named_parameters())
    for pattern in patterns:
        hits = [p for name, p in named if _matches(name, pattern)]
        if not hits:
            sample = ", ".join(name for name, _ in named[:4])
            raise ValueError(
                f"freeze pattern {pattern!r} matches no parameter; names look like: {sample}, ... "
                f"({len(named)} in all)"
            )
        for p in hits:
            p.requires_grad_(False)


def _matches(name: str, pattern: str) -> bool:
    """`pattern` matches the parameter name, or the name without PEFT's and checkpointing's insertions."""
    plain = name.replace(WRAPPER_PREFIX, "")
    plain = plain[len(_PEFT_PREFIX) :] if plain.startswith(_PEFT_PREFIX) else plain
    return fnmatch.fnmatchcase(name, pattern) or fnmatch.fnmatchcase(plain, pattern)
