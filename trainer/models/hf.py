"""HFModule: fine-tune any Hugging Face `transformers` model (a local folder, a config or an instance) on
one of four tasks, optionally with some parameters frozen or with LoRA adapters, and write the result
back in Hugging Face's layout (`save_pretrained`), from one process or from a sharded (FSDP) run.

Label convention: for "causal-lm", batches are {"input_ids", "labels", optional "attention_mask"} whose
labels are ALREADY SHIFTED (labels[b, t] is the target of input position t, -100 ignored), as
`TokenLoader` yields them for our own Llama; HFModule computes the cross-entropy itself and never hands
`labels` to the model (which would shift them again). For the other tasks the batch goes to the model
as is and the model's own head and loss are used (Hugging Face's conventions: one class per sequence,
one per token with -100 ignored, or the decoder's target ids, which the model shifts itself).
"""

from __future__ import annotations

import copy
import fnmatch
import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from trainer.models.hf_dpo import dpo_step, reference_model
from trainer.models.hf_packing import packed_inputs
from trainer.module import TrainModule

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedModel

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
_WRAPPER_PREFIX = "_checkpoint_wrapped_module."  # what activation checkpointing inserts in names
_PEFT_PREFIX = "base_model.model."  # what PEFT puts before the wrapped model's own names


class HFModule(TrainModule):
    """A TrainModule around a `transformers` model.

    - `model`: a local folder written by `save_pretrained` (loaded with `local_files_only=True`, in
      float32: the Trainer's `precision` decides the compute dtype), a `PretrainedConfig` (a fresh model,
      `from_config`) or a `PreTrainedModel` instance (used as is).
    - `task`: "causal-lm", "seq-classification", "token-classification", "seq2seq" or "dpo" (a causal LM
      on {"prompt", "chosen", "rejected"} pairs, trainer.models.hf_dpo: the sigmoid loss with `beta` against
      `reference`, a frozen model given in any of `model`'s forms; None: a frozen copy of the initial
      weights, or under LoRA the model with its adapters disabled).
    - `tokenizer`: a local tokenizer folder; else the model folder's tokenizer when it has one; else None.
    - `num_labels`: the classes of a classification head.
    - `lr`, `weight_decay`, `betas`: AdamW over the trainable parameters, decay on matrices only.
    - `freeze`: fnmatch patterns of parameter names (as `model.named_parameters()` names them; with LoRA
      also without PEFT's "base_model.model." prefix) whose parameters are not trained.
    - `lora`: `peft.LoraConfig` keyword arguments (`task_type` defaults to the task's); the model is
      wrapped by `peft.get_peft_model` (the optional dependency: `pip install .[peft]`). Its A matrices are
      drawn from torch's RNG as the module is built: seed before, the same on every rank (FSDP does not
      broadcast rank 0's weights as DDP does).

    Under FSDP each layer `_no_split_modules` names is its own shard unit (`transformer_blocks()`), and
    the Trainer's `activation_checkpointing` and `compile` take the same layers; `save_pretrained` must then be
    called on every rank (it gathers the full weights to rank 0, which writes).
    """

    def __init__(
        self,
        model: str | os.PathLike | PreTrainedModel | PretrainedConfig,
        task: str = "causal-lm",
        tokenizer: str | os.PathLike | None = None,
        num_labels: int | None = None,
        lr: float = 3e-4,
        weight_decay: float = 0.0,
        betas: tuple[float, float] = (0.9, 0.999),
        freeze: Sequence[str] = (),
        lora: dict[str, Any] | None = None,
        reference: str | os.PathLike | PreTrainedModel | PretrainedConfig | None = None,
        beta: float = 0.1,
    ) -> None:
        super().__init__()
        if task not in TASKS:
            raise ValueError(f"task={task!r} is unknown; allowed: {', '.join(map(repr, TASKS))}")
        if num_labels is not None and (
            isinstance(num_labels, bool) or not isinstance(num_labels, int) or num_labels < 1
        ):
            raise ValueError(f"num_labels={num_labels!r} is invalid; allowed: an int >= 1 or None")
        self.task, self.lr, self.weight_decay, self.betas = task, lr, weight_decay, tuple(betas)
        self.model = _build(model, task, num_labels)
        self.tokenizer = _load_tokenizer(tokenizer, model)
        self.lora = dict(lora) if lora is not None else None
        self.reference, self.beta = None, beta
        if task == "dpo":
            if isinstance(beta, bool) or not isinstance(beta, (int, float)) or beta <= 0:
                raise ValueError(f"beta={beta!r} is invalid; allowed: a number > 0")
            given = None if reference is None else _build(reference, task, None)
            self.reference = reference_model(self.model, given, lora=self.lora is not None)
        elif reference is not None:
            raise ValueError(
                f"reference= is DPO's reference model; allowed: it with task='dpo', not {task!r}"
            )
        if self.lora is not None:
            self.model = _wrap_lora(self.model, self.lora, task)
        self._freeze(freeze)
        self.train()  # from_pretrained returns its model in eval mode; a module starts in training mode

    # ---- the model -------------------------------------------------------------------------------
    def hf_model(self) -> nn.Module:
        """The `transformers` model itself (inside PEFT's wrapper when there is one)."""
        return (
            self.model.get_base_model()
            if callable(getattr(self.model, "get_base_model", None))
            else self.model
        )

    def forward(self, **inputs: Any) -> Any:
        """The wrapped model's forward: `module(input_ids=..., attention_mask=...)` returns its output."""
        return self.model(**inputs)

    def parallel_shape(self) -> dict[str, int] | None:
        """Heads, kv-heads, vocabulary, layers and tying of a decoder config, which tensor parallelism must
        divide (Parallel3DStrategy checks them before training); None for configs without them."""
        c = self.hf_model().config
        names = ("num_attention_heads", "vocab_size", "num_hidden_layers")
        if not all(isinstance(getattr(c, n, None), int) for n in names):
            return None
        return {
            "heads": c.num_attention_heads,
            "kv_heads": getattr(c, "num_key_value_heads", None) or c.num_attention_heads,
            "vocab": c.vocab_size,
            "blocks": c.num_hidden_layers,
            "tied": bool(getattr(c, "tie_word_embeddings", False)),
        }

    def tensor_parallel_plan(self, sequence_parallel: bool, loss_parallel: bool) -> dict[str, Any]:
        """Parallel3DStrategy's `tp` from transformers' own `base_model_tp_plan` (Megatron's column/row
        split of attention and MLP); embeddings and the head stay replicated, so no sequence or loss
        parallelism."""
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

        if sequence_parallel or loss_parallel:
            raise ValueError(
                "a Hugging Face model's tensor-parallel plan covers attention and MLP only; allowed: "
                "Parallel3DStrategy(..., sequence_parallel=False, loss_parallel=False)"
            )
        hf = self.hf_model()
        plan = getattr(hf.config, "base_model_tp_plan", None)
        if not plan:
            raise ValueError(f"{type(hf).__name__} has no base_model_tp_plan in its config; allowed: tp=1")
        styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
        unknown = sorted({s for s in plan.values() if s not in styles})
        if unknown:
            raise ValueError(
                f"{type(hf).__name__}'s tensor-parallel plan uses {', '.join(unknown)}; allowed: colwise, rowwise"
            )
        base = f"{self._hf_path()}.{hf.base_model_prefix}"
        return {f"{base}.{path}": styles[style]() for path, style in plan.items()}

    def _hf_path(self) -> str:
        """Where the transformers model sits inside this module ("model", or PEFT's nesting)."""
        target = self.hf_model()
        return next(name for name, m in self.named_modules() if m is target)

    def transformer_blocks(self) -> list[nn.Module]:
        """The model's repeated layers: every submodule whose class `_no_split_modules` names (outermost
        ones only), in forward order; a model that names none: the children of its longest ModuleList."""
        names = set(getattr(self.hf_model(), "_no_split_modules", None) or ())
        blocks: list[nn.Module] = []
        inside: set[int] = set()
        for module in self.model.modules():
            if id(module) in inside:
                continue
            if type(module).__name__ in names:
                blocks.append(module)
                inside.update(id(m) for m in module.modules())
        if blocks:
            return blocks
        lists = [m for m in self.model.modules() if isinstance(m, nn.ModuleList)]
        return list(max(lists, key=len)) if lists else []

    def enable_activation_checkpointing(self) -> None:
        """Hugging Face's own activation checkpointing of its layers (non-reentrant). The Trainer's (or
        FSDP's) `activation_checkpointing=` wraps the same layers itself, under every strategy: use one or
        the other."""
        model, kwargs = self.hf_model(), {"use_reentrant": False}
        if callable(getattr(model, "activation_checkpointing_enable", None)):  # transformers >= 5.x
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)

    # ---- steps -----------------------------------------------------------------------------------
    def _outputs(self, batch: Any, method: str) -> tuple[dict[str, torch.Tensor], Any]:
        """({"loss", "num_tokens"?}, model outputs) of a batch."""
        if not isinstance(batch, Mapping):
            raise TypeError(
                f"{method} got a {type(batch).__name__} batch; allowed: a dict of tensors (input_ids, labels, ...)"
            )
        if self.task == "dpo":
            return dpo_step(self, self.model, self.reference, batch, self.beta, method), None
        if "labels" not in batch:
            raise ValueError(
                f"{method}: the batch has no 'labels' (keys: {', '.join(batch)}); allowed: a batch with labels"
            )
        labels = batch["labels"]
        if self.task == "causal-lm":
            inputs = {k: v for k, v in batch.items() if k != "labels"}  # the model would shift them again
            outputs = self.model(**packed_inputs(self.hf_model(), inputs), use_cache=False)
            loss = F.cross_entropy(outputs.logits.flatten(0, 1).float(), labels.flatten(), ignore_index=-100)
            return {"loss": loss, "num_tokens": (labels != -100).sum()}, outputs
        outputs = self.model(**batch)
        if self.task == "seq-classification":
            return {"loss": outputs.loss}, outputs
        return {"loss": outputs.loss, "num_tokens": (labels != -100).sum()}, outputs

    def training_step(self, batch: Any, batch_idx: int) -> dict[str, torch.Tensor]:
        return self._outputs(batch, "training_step")[0]

    def validation_step(self, batch: Any, batch_idx: int) -> dict[str, torch.Tensor]:
        return self._evaluate(batch, "validation_step", "val_acc")

    def test_step(self, batch: Any, batch_idx: int) -> dict[str, torch.Tensor]:
        return self._evaluate(batch, "test_step", "test_acc")

    def _evaluate(self, batch: Any, method: str, metric: str) -> dict[str, torch.Tensor]:
        loss, outputs = self._outputs(batch, method)
        labels = batch.get("labels")
        if self.task in ("seq-classification", "token-classification") and not labels.is_floating_point():
            valid = labels != -100
            correct = ((outputs.logits.argmax(-1) == labels) & valid).sum()
            count = int(valid.sum())
            if count:
                self.log(metric, correct.float() / count, batch_size=count)
        return loss

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        """The logits of the batch (a causal LM's labels, if any, are not given to the model)."""
        if not isinstance(batch, Mapping):
            raise TypeError(f"predict_step got a {type(batch).__name__} batch; allowed: a dict of tensors")
        if self.task in ("causal-lm", "dpo"):
            inputs = {k: v for k, v in batch.items() if k != "labels"}
            return self.model(**packed_inputs(self.hf_model(), inputs), use_cache=False).logits
        return self.model(**batch).logits

    def configure_optimizers(self) -> torch.optim.Optimizer:
        trainable = [p for p in self.parameters() if p.requires_grad]
        if not trainable:
            raise ValueError("HFModule has no trainable parameter (all are frozen); allowed: at least one")
        groups = [
            {"params": [p for p in trainable if p.dim() >= 2], "weight_decay": self.weight_decay},
            {"params": [p for p in trainable if p.dim() < 2], "weight_decay": 0.0},
        ]
        return torch.optim.AdamW([g for g in groups if g["params"]], lr=self.lr, betas=self.betas)

    # ---- freezing --------------------------------------------------------------------------------
    def _freeze(self, patterns: Sequence[str]) -> None:
        patterns = [patterns] if isinstance(patterns, str) else list(patterns)
        named = list(self.model.named_parameters())
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

    # ---- export ----------------------------------------------------------------------------------
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """What `trainer export CHECKPOINT OUT` needs to rebuild this model from the checkpoint's weights
        alone: its config, task, LoRA options and where its tokenizer came from."""
        checkpoint["hf"] = {
            "config": json.loads(self.hf_model().config.to_json_string()),
            "task": self.task,
            "lora": self.lora,
            "tokenizer": getattr(self.tokenizer, "name_or_path", None)
            if self.tokenizer is not None
            else None,
        }

    def save_pretrained(self, out_dir: str | os.PathLike, max_shard_size: int | str = "2GB") -> Path:
        """Write the model in Hugging Face's layout to `out_dir` (config.json, model.safetensors or
        shards with their index above `max_shard_size`, the tokenizer's files when there is a tokenizer);
        LoRA adapters are merged into the written weights, the module keeps them. Sharded (FSDP) weights
        are gathered to rank 0, so call it on every rank then; rank 0 writes. Returns `out_dir`."""
        out_dir = Path(out_dir)
        sharded = _is_sharded(self)
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        if sharded:
            from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

            # a collective: every rank sends its shards, rank 0 alone receives the full tensors (on CPU)
            full = get_model_state_dict(
                self, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
            )
            state = {k[len("model.") :]: v for k, v in full.items() if k.startswith("model.")}
        else:
            state = self.model.state_dict()
        if rank == 0:
            self._write(out_dir, state, max_shard_size)
        if sharded:
            torch.distributed.barrier()  # no rank returns before the files are there
        return out_dir

    def _write(self, out_dir: Path, state: dict[str, torch.Tensor], max_shard_size: int | str) -> None:
        """Rebuild the model's structure on the meta device, give it `state` (and the live model's
        buffers, which no state dict holds), merge LoRA and save."""
        if self.lora is not None:  # merging adds to the base weights in place: never the live ones
            state = {k: v.detach().to("cpu", copy=True) for k, v in state.items()}
        base = self.hf_model()
        with torch.device("meta"):
            skeleton: nn.Module = type(base)(copy.deepcopy(base.config))
            if self.lora is not None:
                import peft

                adapter = self.model.active_adapter
                skeleton = peft.get_peft_model(skeleton, copy.deepcopy(self.model.peft_config[adapter]))
        missing, unexpected = skeleton.load_state_dict(state, strict=False, assign=True)
        if unexpected:
            raise RuntimeError(
                f"save_pretrained: weights the model does not have: {', '.join(unexpected[:5])}"
            )
        live = {name.replace(_WRAPPER_PREFIX, ""): b for name, b in self.model.named_buffers()}
        for name, buffer in list(skeleton.named_buffers()):
            if buffer.is_meta and name in live:
                owner, _, leaf = name.rpartition(".")
                skeleton.get_submodule(owner)._buffers[leaf] = live[name].detach().clone()
        hf = skeleton.get_base_model() if self.lora is not None else skeleton
        hf.tie_weights()  # loading by assignment unties tied weights (a shared embedding and head)
        if self.lora is not None:
            hf = skeleton.merge_and_unload()
        left = [n for n, t in [*hf.named_parameters(), *hf.named_buffers()] if t.is_meta]
        if left:
            raise RuntimeError(
                f"save_pretrained: no value for {', '.join(left[:5])} (missing: {missing[:5]})"
            )
        hf.save_pretrained(out_dir, max_shard_size=max_shard_size)
        if self.tokenizer is not None:
            self.tokenizer.save_pretrained(out_dir)


# ---- building ------------------------------------------------------------------------------------
def _auto(task: str) -> Any:
    import transformers

    return getattr(transformers, _AUTO[task])


def _mapping(task: str) -> Any:
    from transformers.models.auto import modeling_auto

    return getattr(modeling_auto, _MAPPINGS[task])


def _model_class(task: str, config: Any) -> type | None:
    """The class `task`'s Auto class builds for `config`, or None if it builds none."""
    try:
        return _mapping(task)[type(config)]
    except KeyError:
        return None


def _can_do(task: str, config: Any) -> bool:
    """`task`'s Auto class builds a model for `config`; for "causal-lm" it must also attend causally: an
    encoder that can be a decoder (BERT, RoBERTa) declares `is_decoder`, False unless set, and would
    otherwise see the very tokens it is to predict."""
    if _model_class(task, config) is None:
        return False
    return task not in ("causal-lm", "dpo") or getattr(config, "is_decoder", True) is not False


def _check_task(task: str, config: Any, name: str | None = None) -> None:
    if _can_do(task, config):
        return
    able = [t for t in TASKS if _can_do(t, config)]
    kind = getattr(config, "model_type", None) or type(config).__name__
    what = f"a {name} ({kind!r})" if name else f"a {kind!r} model"
    why = (
        " (an encoder: set config.is_decoder=True to train it causally)" if _model_class(task, config) else ""
    )
    raise ValueError(
        f"{what} cannot do task {task!r}{why}; allowed tasks for it: "
        f"{', '.join(map(repr, able)) if able else 'none of ' + ', '.join(map(repr, TASKS))}"
    )


def _build(model: Any, task: str, num_labels: int | None) -> nn.Module:
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
        return _auto(task).from_pretrained(path, local_files_only=True, **extra)
    if isinstance(model, PretrainedConfig):
        _check_task(task, model)
        config = copy.deepcopy(model)
        if num_labels is not None:
            config.num_labels = num_labels
        return _auto(task).from_config(config)
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
        return model
    raise TypeError(
        f"model is a {type(model).__name__}; allowed: a local folder path, a transformers PretrainedConfig "
        "or a PreTrainedModel"
    )


def _load_tokenizer(tokenizer: str | os.PathLike | None, model: Any) -> Any:
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


def _wrap_lora(model: nn.Module, lora: dict[str, Any], task: str) -> nn.Module:
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
    return peft.get_peft_model(model, config)


def _matches(name: str, pattern: str) -> bool:
    """`pattern` matches the parameter name, or the name without PEFT's and checkpointing's insertions."""
    plain = name.replace(_WRAPPER_PREFIX, "")
    plain = plain[len(_PEFT_PREFIX) :] if plain.startswith(_PEFT_PREFIX) else plain
    return fnmatch.fnmatchcase(name, pattern) or fnmatch.fnmatchcase(plain, pattern)


def _is_sharded(module: nn.Module) -> bool:
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in module.parameters())
