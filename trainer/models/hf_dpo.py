"""Direct Preference Optimization (Rafailov et al., 2023) for HFModule(task="dpo"): the sigmoid loss
-log sigmoid(beta * ((log pi(y_w|x) - log ref(y_w|x)) - (log pi(y_l|x) - log ref(y_l|x)))), with each
sequence's log-probability summed over its response tokens (labels != -100), on the batches of
trainer.data.hf_preference.

The reference is a frozen model (a given one, or a copy of the policy's initial weights), or, under LoRA,
the policy itself with its adapters disabled: the base weights the adapters start from. A frozen reference
is rebuilt with the module, so checkpoints leave it out (half the size) and record a hash of its weights
instead: a resume keeps the reference it has, and refuses one whose weights differ from the run's.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, MutableMapping
from typing import Any

import torch
import torch.nn.functional as F
import xxhash
from torch import nn

IGNORE_INDEX = -100
_SIDES = ("chosen", "rejected")
_KEYS = ("input_ids", "attention_mask", "labels")
_PREFIX = {"training_step": "", "validation_step": "val_", "test_step": "test_"}  # logged names' prefix
REFERENCE = "reference"  # the module attribute that holds the FrozenReference


class FrozenReference(nn.Module):
    """The DPO reference model: no parameter trains, and it stays in eval mode (no dropout) whatever mode
    the module around it is put in."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model
        self.model.requires_grad_(False)
        self.model.eval()
        self.digest = weights_digest(model)  # as built: a strategy may shard the weights later

    def train(self, mode: bool = True) -> FrozenReference:
        return super().train(False)

    def forward(self, **inputs: Any) -> Any:
        return self.model(**inputs)


def reference_model(policy: nn.Module, given: nn.Module | None, lora: bool) -> FrozenReference | None:
    """The frozen reference: `given`, else a copy of `policy` as it is now (its initial weights); None under
    LoRA without a given one, where the policy with its adapters disabled is the reference."""
    if given is not None:
        return FrozenReference(given)
    return None if lora else FrozenReference(copy.deepcopy(policy))


def weights_digest(model: nn.Module) -> str:
    """XXH3-128 of a model's state dict: every name, dtype, shape and byte, in order."""
    h = xxhash.xxh3_128()
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            h.update(f"{name} {tensor.dtype} {tuple(tensor.shape)}".encode())
            h.update(tensor.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy())
    return h.hexdigest()


def keep_reference_out_of_checkpoints(module: nn.Module) -> None:
    """`module.reference` (a FrozenReference, or None) out of `module.state_dict()`, and kept as it is by
    `load_state_dict` of a state dict without it (one with it, older checkpoints', loads it). A module
    that checkpoints no frozen parameter (`checkpoint_frozen_parameters()`) leaves it out already."""
    module.register_state_dict_post_hook(_drop_reference)
    module.register_load_state_dict_pre_hook(_keep_reference)


def _drop_reference(module: nn.Module, state: MutableMapping[str, Any], prefix: str, _: Any) -> None:
    if getattr(module, REFERENCE) is None or not module.checkpoint_frozen_parameters():
        return
    for key in [k for k in state if k.startswith(f"{prefix}{REFERENCE}.")]:
        del state[key]


def _keep_reference(module: nn.Module, state: MutableMapping[str, Any], prefix: str, *_: Any) -> None:
    reference = getattr(module, REFERENCE)
    if reference is None:
        return
    for name, value in reference.state_dict(keep_vars=True).items():  # load_state_dict copies it onto itself
        state.setdefault(f"{prefix}{REFERENCE}.{name}", value)


def check_same_reference(saved: str | None, reference: FrozenReference | None) -> None:
    """Refuse, in one line, to resume a run against a reference whose weights differ from its own (`saved`:
    the checkpoint's digest; None: a checkpoint that holds its reference, or has none)."""
    own = None if reference is None else reference.digest
    if saved is None or saved == own:
        return
    raise ValueError(
        f"the checkpoint was trained against a DPO reference model with other weights (xxh3 {saved[:12]}) "
        f"than this HFModule's ({own[:12] if own else 'none'}); allowed: the module built as that run built it "
        "(the same model and reference; a model from a config: the same Trainer seed)"
    )


def sequence_logps(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """FloatTensor[B]: each row's summed log-probability of its (already shifted) labels that are not -100,
    in float32 whatever the logits' dtype."""
    logp = logits.float().log_softmax(-1)
    valid = labels != IGNORE_INDEX
    picked = logp.gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return (picked * valid).sum(-1)


def dpo_loss(
    policy_chosen: torch.Tensor,
    policy_rejected: torch.Tensor,
    reference_chosen: torch.Tensor,
    reference_rejected: torch.Tensor,
    beta: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(per-pair losses, chosen rewards, rejected rewards) of the sigmoid DPO loss from sequence
    log-probabilities; a reward is beta * (policy - reference) log-probability, detached."""
    chosen = policy_chosen - reference_chosen
    rejected = policy_rejected - reference_rejected
    losses = -F.logsigmoid(beta * (chosen - rejected))
    return losses, beta * chosen.detach(), beta * rejected.detach()


def preference_logps(
    model: nn.Module, batch: Mapping[str, torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """(chosen, rejected) summed response log-probabilities of `model`, both halves in one forward of 2B
    rows (one forward per step keeps DDP's and FSDP's hooks to their usual one pass)."""
    both = {key: torch.cat([batch[f"{side}_{key}"] for side in _SIDES]) for key in _KEYS}
    logits = model(input_ids=both["input_ids"], attention_mask=both["attention_mask"], use_cache=False).logits
    logps = sequence_logps(logits, both["labels"])
    n = batch["chosen_input_ids"].shape[0]
    return logps[:n], logps[n:]


def dpo_step(
    module: Any, policy: nn.Module, reference: nn.Module | None, batch: Any, beta: float, method: str
) -> dict[str, torch.Tensor]:
    """{"loss", "num_tokens"} of one preference batch for `module` (a TrainModule, which logs rewards/chosen,
    rewards/rejected, rewards/margin and rewards/accuracy, prefixed val_/test_ outside training). The loss
    is the mean over pairs and "num_tokens" counts the pairs, so strategies weight ranks by pairs."""
    if not isinstance(batch, Mapping):
        raise TypeError(f"{method} got a {type(batch).__name__} batch; allowed: a dict of preference tensors")
    missing = [f"{side}_{key}" for side in _SIDES for key in _KEYS if f"{side}_{key}" not in batch]
    if missing:
        raise ValueError(
            f"{method}: the DPO batch lacks {', '.join(missing)}; allowed: batches of "
            "trainer.data.hf_preference (chosen_/rejected_ input_ids, attention_mask, labels)"
        )
    policy_chosen, policy_rejected = preference_logps(policy, batch)
    with torch.no_grad():
        if reference is not None:
            reference_chosen, reference_rejected = preference_logps(reference, batch)
        else:  # LoRA: the base weights, with the adapters switched off for this forward only
            with policy.disable_adapter():
                reference_chosen, reference_rejected = preference_logps(policy, batch)
    losses, chosen, rejected = dpo_loss(
        policy_chosen, policy_rejected, reference_chosen, reference_rejected, beta
    )
    pairs = losses.shape[0]
    prefix = _PREFIX.get(method, "")
    metrics = {
        "rewards/chosen": chosen.mean(),
        "rewards/rejected": rejected.mean(),
        "rewards/margin": (chosen - rejected).mean(),
        "rewards/accuracy": (chosen > rejected).float().mean(),
    }
    if getattr(module, "_trainer", None) is not None:  # a step called by hand, outside a run, logs nothing
        for name, value in metrics.items():
            module.log(prefix + name, value, batch_size=pairs, sync_dist=True)
    return {"loss": losses.mean(), "num_tokens": torch.tensor(pairs, device=losses.device)}
