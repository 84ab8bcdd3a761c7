"""An HFModule written in Hugging Face's layout (`save_pretrained`): merged weights, or LoRA adapters as
PEFT writes them, gathered from a sharded (FSDP) run to rank 0."""

from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from trainer.models import hf_adapters
from trainer.models.hf_build import WRAPPER_PREFIX

if TYPE_CHECKING:
    from trainer.models.hf import HFModule


def save_pretrained(
    module: HFModule, out_dir: str | os.PathLike, max_shard_size: int | str = "2GB", merged: bool = True
) -> Path:
    """Write the model in Hugging Face's layout to `out_dir` (config.json, model.safetensors or
    shards with their index above `max_shard_size`, the tokenizer's files when there is a tokenizer);
    LoRA adapters are merged into the written weights (the module keeps them), or with `merged=False`
    written as PEFT's adapter_config.json + adapter_model.safetensors, which
    `peft.PeftModel.from_pretrained(base, out_dir)` loads. Sharded (FSDP) weights are gathered to
    rank 0, so call it on every rank then; rank 0 writes. Returns `out_dir`."""
    if not merged and module.lora is None:
        raise ValueError(
            "save_pretrained(merged=False) writes LoRA adapters, and this HFModule has none; allowed: merged=True"
        )
    out_dir = Path(out_dir)
    sharded = _is_sharded(module)
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    if sharded:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        # a collective: every rank sends its shards, rank 0 alone receives the full tensors (on CPU)
        full = get_model_state_dict(module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        state = {k[len("model.") :]: v for k, v in full.items() if k.startswith("model.")}
    else:
        state = module.model.state_dict()
    if rank == 0 and not merged:
        state = {k.replace(WRAPPER_PREFIX, ""): v for k, v in state.items()}
        hf_adapters.write_adapter(module.model, state, out_dir)
        if module.tokenizer is not None:
            module.tokenizer.save_pretrained(out_dir)
    elif rank == 0:
        _write(module, out_dir, state, max_shard_size)
    if sharded:
        torch.distributed.barrier()  # no rank returns before the files are there
    return out_dir


def _write(
    module: HFModule, out_dir: Path, state: dict[str, torch.Tensor], max_shard_size: int | str
) -> None:
    """Rebuild the model's structure on the meta device, give it `state` (and the live model's
    buffers, which no state dict holds), merge LoRA and save."""
    if module.lora is not None:  # merging adds to the base weights in place: never the live ones
        state = {k: v.detach().to("cpu", copy=True) for k, v in state.items()}
    base = module.hf_model()
    with torch.device("meta"):
        skeleton: nn.Module = type(base)(copy.deepcopy(base.config))
        if module.lora is not None:
            adapter = module.model.active_adapter
            skeleton = hf_adapters.peft_wrap(skeleton, copy.deepcopy(module.model.peft_config[adapter]))
    missing, unexpected = skeleton.load_state_dict(state, strict=False, assign=True)
    if unexpected:
        raise RuntimeError(f"save_pretrained: weights the model does not have: {', '.join(unexpected[:5])}")
    live = {name.replace(WRAPPER_PREFIX, ""): b for name, b in module.model.named_buffers()}
    for name, buffer in list(skeleton.named_buffers()):
        if buffer.is_meta and name in live:
            owner, _, leaf = name.rpartition(".")
            skeleton.get_submodule(owner)._buffers[leaf] = live[name].detach().clone()
    hf = skeleton.get_base_model() if module.lora is not None else skeleton
    hf.tie_weights()  # loading by assignment unties tied weights (a shared embedding and head)
    if module.lora is not None:
        hf = skeleton.merge_and_unload()
    left = [n for n, t in [*hf.named_parameters(), *hf.named_buffers()] if t.is_meta]
    if left:
        raise RuntimeError(f"save_pretrained: no value for {', '.join(left[:5])} (missing: {missing[:5]})")
    hf.save_pretrained(out_dir, max_shard_size=max_shard_size)
    if module.tokenizer is not None:
        module.tokenizer.save_pretrained(out_dir)


def _is_sharded(module: nn.Module) -> bool:
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in module.parameters())
