"""CausalLM: next-token training of a decoder over packed token blocks, usable from Python and recipes."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from trainer.models.linear_cross_entropy import linear_cross_entropy
from trainer.models.llama import Llama, LlamaConfig
from trainer.models.moe import moe_layers, reset_moe_stats
from trainer.module import TrainModule


class CausalLM(TrainModule):
    """Trains `model` (a LlamaConfig, built late in `configure_model`, or any module mapping tokens
    [B, T] to logits [B, T, V]) on batches {"input_ids", "labels"}; labels of -100 are ignored.

    The loss is the mean over the micro-batch's predicted tokens and reports their count, so the Trainer
    weights micro-batches and ranks by tokens: accumulation equals one big batch. AdamW decays matrices
    and embeddings, not norms or biases (nanoGPT's grouping).

    A MoE model's auxiliary losses (each a statistic of the micro-batch's routed tokens, every one of
    them, labelled or not) join its loss scaled by routed / labelled tokens, so that under the Trainer's
    weighting by labelled tokens each micro-batch's losses count by the tokens it routed: the step's
    z-loss is the sum over all its routed tokens divided by its labelled tokens (their mean when no
    label is -100), however the step is split into micro-batches and ranks.

    `loss_chunk_tokens` (a Llama's loss only): the output projection and cross-entropy run fused over
    chunks of that many tokens, so the B x T x vocab logits are never held at once
    (trainer.models.linear_cross_entropy).
    """

    def __init__(
        self,
        model: LlamaConfig | nn.Module,
        lr: float = 3e-4,
        betas: tuple[float, float] = (0.9, 0.95),
        weight_decay: float = 0.1,
        eps: float = 1e-8,
        loss_chunk_tokens: int | None = None,
    ) -> None:
        super().__init__()
        if not isinstance(model, (LlamaConfig, nn.Module)):
            raise TypeError(f"model is a {type(model).__name__}; allowed: a LlamaConfig or an nn.Module")
        if loss_chunk_tokens is not None and (
            isinstance(loss_chunk_tokens, bool)
            or not isinstance(loss_chunk_tokens, int)
            or loss_chunk_tokens < 1
        ):
            raise ValueError(
                f"loss_chunk_tokens={loss_chunk_tokens!r} is invalid; allowed: None (the plain loss) or an "
                "int >= 1 (tokens per chunk of the fused output projection and loss)"
            )
        self.loss_chunk_tokens = loss_chunk_tokens
        self.config = model if isinstance(model, LlamaConfig) else None
        self.model = model if isinstance(model, nn.Module) else None
        self.lr, self.betas, self.weight_decay, self.eps = lr, tuple(betas), weight_decay, eps

    def configure_model(self) -> None:
        if self.model is None:
            self.model = Llama(self.config)

    def init_weights(self) -> None:
        """Initialise the model in place (after a strategy materialised it from the meta device)."""
        _hook(self.model, "init_weights")()

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """The Llama's shape travels with its weights, so `trainer export` can write a Hugging Face model."""
        if isinstance(self.model, Llama):
            checkpoint["llama_config"] = dataclasses.asdict(self.model.config)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids)

    def _loss(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        labels = batch["labels"]
        weight = self._fused_output_weight()
        if weight is None:
            return self.pipeline_loss(self.model(batch["input_ids"]), labels)
        hidden = self.model(batch["input_ids"], hidden_only=True)
        loss = linear_cross_entropy(hidden, weight, labels, self.loss_chunk_tokens)
        return {"loss": loss, "num_tokens": (labels != -100).sum()}

    def _fused_output_weight(self) -> torch.Tensor | None:
        """The output weight when the chunked loss applies: asked for, on a whole Llama whose weight is a
        plain tensor (tensor parallelism makes it a vocabulary-sharded DTensor: loss parallelism's case),
        and not under fp16 autocast (the fused loss makes its gradients in the forward, before a
        GradScaler's scale could keep them from underflowing); else None, for the plain loss."""
        model = self.model
        if self.loss_chunk_tokens is None or not isinstance(model, Llama) or model.output is None:
            return None
        weight = model.output.weight
        device = weight.device.type
        if hasattr(weight, "device_mesh") or (
            torch.is_autocast_enabled(device) and torch.get_autocast_dtype(device) == torch.float16
        ):
            return None
        return weight

    def pipeline_loss(
        self, logits: torch.Tensor | tuple[torch.Tensor, torch.Tensor], labels: torch.Tensor
    ) -> dict[str, torch.Tensor]:
        """Mean cross-entropy of logits [B, T, V] over the labels that are not -100, and their count;
        also what a pipeline's last stage computes on its output, which for a MoE model is (logits, the
        auxiliary losses of every stage): in training they join the loss, as `training_step` adds them."""
        aux = None
        if isinstance(logits, tuple):
            logits, aux = logits
        loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=-100)
        out = {"loss": loss, "num_tokens": (labels != -100).sum()}
        return _with_extra(out, aux, labels) if self.training else out

    def pipeline_batch(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """What a pipeline feeds its first stage and hands its loss: (input_ids, labels)."""
        return batch["input_ids"], batch["labels"]

    def pipeline_model(self) -> nn.Module:
        """The model a pipeline cuts into stages (it declares `pipeline_layout()`)."""
        return self.model

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> dict[str, torch.Tensor]:
        out = self._loss(batch)
        extra = getattr(self.model, "extra_loss", None)
        return _with_extra(out, extra() if callable(extra) else None, batch["labels"])

    def on_before_zero_grad(self, optimizer: torch.optim.Optimizer) -> None:
        """After each optimizer step (on every rank, also under a pipeline schedule): a MoE model logs its
        router statistics on logged steps, those of the step's micro-batches summed over all ranks (one
        all-reduce), and starts them afresh. (The strategy then moves the balancing biases, in
        `after_optimizer_step`, from the loads of `expert_modules()`.)"""
        trainer = self._trainer
        if trainer is None:
            return
        stats = getattr(self.model, "moe_stats", None)
        if callable(stats) and trainer.logs_this_step:
            strategy = trainer.strategy
            world_sum = (
                (lambda t: t.copy_(strategy.reduce(t, "sum", group="world")))
                if strategy.world_size > 1
                else None
            )
            self.log_dict({f"moe/{k}": v for k, v in stats(world_sum).items()})
        if getattr(getattr(self.model, "config", None), "moe", None) is not None:  # dense: no module walk
            reset_moe_stats(moe_layers(self.model))

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> dict[str, torch.Tensor]:
        return self._loss(batch)

    def test_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> dict[str, torch.Tensor]:
        return self._loss(batch)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        decay = [p for p in self.parameters() if p.requires_grad and p.dim() >= 2]
        no_decay = [p for p in self.parameters() if p.requires_grad and p.dim() < 2]
        groups = [
            {"params": decay, "weight_decay": self.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ]
        return torch.optim.AdamW(groups, lr=self.lr, betas=self.betas, eps=self.eps)

    # ---- hooks strategies and callbacks read (present when the model has them) ---------------
    def transformer_blocks(self) -> list[nn.Module]:
        return _hook(self.model, "transformer_blocks")()

    def flops_per_token(self, seq_len: int) -> float:
        return _hook(self.model, "flops_per_token")(seq_len)

    def parallel_shape(self) -> dict[str, int] | None:
        """Heads, kv-heads, vocabulary and blocks of the Llama (known before it is built), which tensor
        and pipeline parallelism must divide; None for a model of another kind."""
        config = self.config or getattr(self.model, "config", None)
        if not isinstance(config, LlamaConfig):
            return None
        return {
            "heads": config.n_heads,
            "kv_heads": config.n_kv_heads,
            "blocks": config.n_layers,
            "vocab": config.vocab_size,
            "tied": config.tie_embeddings,
        }

    def expert_modules(self) -> list[nn.Module]:
        """The model's MoE layers ([] for a model without the hook): what strategies shard and balance."""
        experts = getattr(self.model, "expert_modules", None)
        return experts() if callable(experts) else []

    def tensor_parallel_plan(self, sequence_parallel: bool, loss_parallel: bool) -> dict[str, Any]:
        plan = _hook(self.model, "tensor_parallel_plan")(sequence_parallel, loss_parallel)
        return {f"model.{path}": style for path, style in plan.items()}

    def enable_context_parallel(self, attention_fn: Any, positions_fn: Any) -> None:
        _hook(self.model, "enable_context_parallel")(attention_fn, positions_fn)


def _with_extra(
    out: dict[str, torch.Tensor], extra: torch.Tensor | None, labels: torch.Tensor
) -> dict[str, torch.Tensor]:
    """`out` with a MoE model's auxiliary losses `extra` (None: none) added to its loss, times routed /
    labelled tokens (see `CausalLM`)."""
    if extra is not None:
        out["loss"] = _add(out["loss"], extra * (labels.numel() / out["num_tokens"].clamp_min(1)))
    return out


def _add(loss: torch.Tensor, extra: torch.Tensor) -> torch.Tensor:
    """loss + extra, where under loss parallelism the loss is a DTensor replicated over the tp ranks and
    `extra` the same value on each (trainer.models.moe.summed_extra_loss)."""
    if hasattr(loss, "device_mesh"):
        from torch.distributed.tensor import DTensor, Replicate

        extra = DTensor.from_local(extra, loss.device_mesh, [Replicate()] * loss.device_mesh.ndim)
    return loss + extra


def _hook(model: Any, name: str) -> Any:
    if not callable(getattr(model, name, None)):
        raise AttributeError(
            f"{type(model).__name__} does not declare {name}(); it is needed for this feature"
        )
    return getattr(model, name)
