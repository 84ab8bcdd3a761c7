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

import json
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from trainer.core.logging import rank_zero_info
from trainer.data.hf_data import padding_id
from trainer.models import hf_adapters, hf_build, hf_dpo, hf_export, hf_init, hf_metrics, hf_tp_plan
from trainer.models.hf_build import TASKS
from trainer.models.hf_packing import packed_inputs
from trainer.models.hf_tokenizer import load_tokenizer
from trainer.module import TrainModule

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedModel


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
      wrapped by `peft.get_peft_model` (the optional dependency: `pip install .[peft]`). Checkpoints of a
      base read from a folder then hold only the trainable weights (adapters, a new head) and the base's
      identity (a hash of its weight files and config; its folder): a resume onto another base is refused.
      `save_pretrained(out, merged=False)` writes PEFT's own layout.
    - `labels`: the class names of a classification head, in id order (`hf_data.class_names` reads them
      from string or ClassLabel labels): its `num_labels`, and `id2label`/`label2id` in the exported config.
    - `metrics`: computed over the whole validation/test set across ranks and logged as `val_<name>` /
      `test_<name>` (on the console's validation line too): "accuracy", "f1" (macro), or callables
      `compute_metrics(predictions, labels) -> dict` (trainer/models/hf_metrics.py says what they get).
    - `load_best_model_at_end`: at the end of fit, load the best good checkpoint of the Trainer's
      `ModelCheckpoint(monitor=...)` into the module (Hugging Face Trainer's option of that name).

    Randomly initialised weights (a model built from a config, a new head, LoRA's A matrices) are drawn
    again under `Trainer(seed=...)` when a fit sets the model up (`configure_model`), the same on every rank,
    unless they were changed since the module was built. Without a Trainer seed they stay as built: seed
    before building then (FSDP does not broadcast rank 0's weights as DDP does).
    With a tokenizer that has no pad token (the loaders then pad with EOS), a model config without
    `pad_token_id` gets the EOS id for the tasks whose models look for padding (all but causal-lm).

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
        labels: Sequence[str] | None = None,
        metrics: str | Callable | Sequence[str | Callable] | None = None,
        load_best_model_at_end: bool = False,
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
        num_labels = hf_build.checked_num_labels(labels, num_labels, task)
        self.task, self.lr, self.weight_decay, self.betas = task, lr, weight_decay, tuple(betas)
        self._metrics = hf_metrics.EvalCollector(hf_metrics.resolve(metrics))
        self.load_best_model_at_end = bool(load_best_model_at_end)
        self.model, missing = hf_build.build(model, task, num_labels)
        self._base = hf_adapters.base_identity(model, self.model.config, hash_weights=lora is not None)
        self.tokenizer = load_tokenizer(tokenizer, model)
        self._configure_head(labels)
        fresh = hf_init.fresh_modules(self.model, missing)
        self.lora = dict(lora) if lora is not None else None
        self.reference, self.beta = None, beta
        self._reference_is_copy = task == "dpo" and reference is None and self.lora is None
        if task == "dpo":
            if isinstance(beta, bool) or not isinstance(beta, (int, float)) or beta <= 0:
                raise ValueError(f"beta={beta!r} is invalid; allowed: a number > 0")
            given = None if reference is None else hf_build.build(reference, task, None)[0]
            self.reference = hf_dpo.reference_model(self.model, given, lora=self.lora is not None)
            hf_dpo.keep_reference_out_of_checkpoints(self)
        elif reference is not None:
            raise ValueError(
                f"reference= is DPO's reference model; allowed: it with task='dpo', not {task!r}"
            )
        if self.lora is not None:
            self.model = hf_build.wrap_lora(self.model, self.lora, task)
        hf_build.freeze(self.model, freeze)
        # what configure_model draws again under the Trainer's seed, and how it was as built
        self._fresh = fresh
        self._fresh_print = hf_init.fingerprint(self._fresh_tensors())
        self._redraw_pending = True
        self.train()  # from_pretrained returns its model in eval mode; a module starts in training mode

    def _configure_head(self, labels: Sequence[str] | None) -> None:
        """Class names into the config; the pad id the loaders pad with, where the model looks for padding."""
        config = self.model.config
        if labels is not None:
            config.id2label = dict(enumerate(labels))
            config.label2id = {name: i for i, name in enumerate(labels)}
        if self.task != "causal-lm" and self.tokenizer is not None and config.pad_token_id is None:
            config.pad_token_id = padding_id(self.tokenizer)

    def _fresh_tensors(self) -> list[torch.Tensor]:
        return hf_init.fresh_tensors(self._fresh, self.model if self.lora is not None else None)

    def configure_model(self) -> None:
        """Draw the randomly initialised weights again under the Trainer's seed (set just before), once:
        a later fit of the same module continues from its trained weights."""
        trainer = self._trainer
        if not self._redraw_pending or trainer is None or trainer.seed is None:
            return
        self._redraw_pending = False
        if hf_init.fingerprint(self._fresh_tensors()) != self._fresh_print:
            rank_zero_info(
                f"{type(self).__name__}: its new weights were changed since it was built; kept as they are "
                f"(not drawn again under seed={trainer.seed})"
            )
            return
        hf_init.redraw(self.hf_model(), self._fresh, self.model if self.lora is not None else None)
        if self.task == "dpo" and self._reference_is_copy:  # the reference is the policy's initial weights
            self.reference = hf_dpo.reference_model(self.model, None, lora=False)

    def counted_parameters(self) -> Any:
        """The parameters the start line counts: the model's, as PEFT counts them (not DPO's reference)."""
        return self.model.parameters()

    def checkpoint_frozen_parameters(self) -> bool:
        """Whether checkpoints hold the frozen weights too: not for LoRA over a base read from a folder
        (they come back from that folder; the checkpoint names it)."""
        return not self._adapters_only

    @property
    def _adapters_only(self) -> bool:
        return self.lora is not None and self._base["path"] is not None

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
        """Parallel3DStrategy's `tp` from transformers' own `base_model_tp_plan`, each of its styles as a
        DTensor style (trainer/models/hf_tp_plan.py); the head stays whole on every rank, so no sequence or
        loss parallelism."""
        if sequence_parallel or loss_parallel:
            raise ValueError(
                "a Hugging Face model's tensor-parallel plan splits its layers, not the activations between them "
                "nor the head; allowed: Parallel3DStrategy(..., sequence_parallel=False, loss_parallel=False)"
            )
        return hf_tp_plan.tensor_parallel_plan(self.hf_model(), self._hf_path())

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
            return hf_dpo.dpo_step(self, self.model, self.reference, batch, self.beta, method), None
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

    def on_validation_epoch_start(self) -> None:
        self._metrics.reset()

    def on_test_epoch_start(self) -> None:
        self._metrics.reset()

    def on_validation_epoch_end(self) -> None:
        self._log_metrics("val")

    def on_test_epoch_end(self) -> None:
        self._log_metrics("test")

    def _log_metrics(self, prefix: str) -> None:
        """The metrics over what every rank of the batch group evaluated (the same numbers on each)."""
        if not self._metrics.functions:
            return
        strategy = self.trainer.strategy
        results = self._metrics.compute(lambda obj: strategy.all_gather_object(obj, group="batch"))
        for name, value in results.items():
            self.log(f"{prefix}_{name}", value, prog_bar=True)

    def _evaluate(self, batch: Any, method: str, metric: str) -> dict[str, torch.Tensor]:
        loss, outputs = self._outputs(batch, method)
        labels = batch.get("labels")  # DPO's pairs have none
        if self._metrics.functions and labels is not None:
            self._collect(outputs.logits, labels)
            return loss
        if self.task in ("seq-classification", "token-classification") and not labels.is_floating_point():
            valid = labels != -100
            correct = ((outputs.logits.argmax(-1) == labels) & valid).sum()
            count = int(valid.sum())
            if count:
                self.log(metric, correct.float() / count, batch_size=count)
        return loss

    def _collect(self, logits: torch.Tensor, labels: torch.Tensor) -> None:
        """Keep what `compute_metrics` gets of this batch: the logits of labelled examples or tokens (the
        classification tasks), the predicted ids of the labelled tokens (the generative ones)."""
        if self.task == "seq-classification":
            self._metrics.add(logits, labels)
            return
        valid = labels != -100
        if self.task == "token-classification":
            self._metrics.add(logits[valid], labels[valid])
        else:  # one vocabulary-wide row per token would not fit: the ids the model predicts
            self._metrics.add(logits.argmax(-1)[valid], labels[valid])

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
            "base": self._base,
            "adapters_only": self._adapters_only,
            "reference": None if self.reference is None else self.reference.digest,
        }

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Refuse adapters trained on another base model, a DPO run trained against another reference."""
        saved = checkpoint.get("hf", {})
        if saved.get("adapters_only"):
            hf_adapters.check_same_base(saved.get("base"), self._base)
        hf_dpo.check_same_reference(saved.get("reference"), self.reference)

    def on_fit_start(self) -> None:
        if self.load_best_model_at_end:
            saver = self.trainer.checkpoint_callback
            if saver is None or not saver.monitor:
                raise ValueError(
                    "HFModule(load_best_model_at_end=True) needs the Trainer's ModelCheckpoint(monitor=...) "
                    "to say which checkpoint is best; allowed: add one, or load_best_model_at_end=False"
                )

    def on_fit_end(self) -> None:
        """With `load_best_model_at_end`, the weights of the ModelCheckpoint's `best_model_path` (its best good
        checkpoint: of equal scores the older, as `ckpt_path="best"`) into the module (every rank)."""
        if not self.load_best_model_at_end:
            return
        saver = self.trainer.checkpoint_callback
        path = saver.best_model_path
        if not path:
            rank_zero_info(
                f"load_best_model_at_end: no good checkpoint scored by {saver.monitor}; kept the last weights"
            )
            return
        # verified against its manifest first
        self.trainer.checkpoint_manager.load_model(Path(path))
        score = float(saver.best_model_score)
        rank_zero_info(f"load_best_model_at_end: loaded {path} ({saver.monitor} {score:.6g})")

    @classmethod
    def from_checkpoint(cls, hf: dict[str, Any], weights: dict[str, torch.Tensor]) -> HFModule:
        """The module a checkpoint was saved from, rebuilt from its "hf" record (on_save_checkpoint's) and
        its model weights: LoRA adapters go onto their base, read from its folder again."""
        from transformers import AutoConfig

        fields = dict(hf["config"])
        tokenizer = hf.get("tokenizer")
        tokenizer = tokenizer if tokenizer and Path(tokenizer).is_dir() else None
        if hf.get("adapters_only"):
            base = hf["base"]
            if not Path(base["path"]).is_dir():
                raise FileNotFoundError(
                    f"the checkpoint holds LoRA adapters only and their base model folder '{base['path']}' is "
                    "gone; allowed: put that folder back to export them"
                )
            classes = len(fields["id2label"]) if hf["task"] != "causal-lm" and "id2label" in fields else None
            module = cls(
                base["path"], task=hf["task"], tokenizer=tokenizer, num_labels=classes, lora=hf["lora"]
            )
            hf_adapters.check_same_base(base, module._base)
            config = module.hf_model().config
            config.id2label = {int(k): v for k, v in fields.get("id2label", config.id2label).items()}
            config.label2id = dict(fields.get("label2id", config.label2id))
            config.pad_token_id = fields.get("pad_token_id", config.pad_token_id)
        else:
            config = AutoConfig.for_model(fields.pop("model_type"), **fields)
            module = cls(config, task=hf["task"], tokenizer=tokenizer, lora=hf.get("lora"))
        frozen = {n for n, p in module.named_parameters(remove_duplicate=False) if not p.requires_grad}
        missing, unexpected = module.load_state_dict(weights, strict=False)
        missing = [k for k in missing if not (module._adapters_only and k in frozen)]
        if missing or unexpected:
            raise ValueError(
                f"the checkpoint's weights do not fit its HFModule: missing {missing[:3]}, unexpected {unexpected[:3]}"
            )
        return module

    def save_pretrained(
        self, out_dir: str | os.PathLike, max_shard_size: int | str = "2GB", merged: bool = True
    ) -> Path:
        """Write the model in Hugging Face's layout to `out_dir`, LoRA merged unless `merged=False`; call on
        every rank (trainer/models/hf_export.py says what is written)."""
        return hf_export.save_pretrained(self, out_dir, max_shard_size, merged)
