"""Export trained weights as one `model.safetensors`: from a live Llama, or from any checkpoint (sharded
DCP ones included, read without a process group, so the original world size is not needed). A dense
Llama is written in Hugging Face's layout with its `config.json`: `LlamaForCausalLM.from_pretrained(dir)`;
an HFModule's run as `save_pretrained` writes it (LoRA merged, or as PEFT's adapters with merged=False);
a MoE Llama or any other module under its own names."""

from __future__ import annotations

from pathlib import Path

import torch

from trainer import checkpoint as ckpt
from trainer.checkpoint.weights import read_checkpoint
from trainer.models.hf_llama import to_hf_config, to_hf_state_dict
from trainer.models.llama import Llama, LlamaConfig


def export_llama(model: Llama, out_dir: str | Path) -> Path:
    """Write `model.safetensors` (HF key names) and `config.json` to `out_dir`; returns the weights file."""
    return _write_hf(model.state_dict(), model.config, Path(out_dir))


def export_checkpoint(ckpt_dir: str | Path, out_dir: str | Path, merged: bool = True) -> Path:
    """Consolidate a checkpoint's model weights into `out_dir/model.safetensors` (HF layout for a Llama);
    an HFModule's LoRA adapters merged into them, or with `merged=False` PEFT's adapter files alone."""
    ckpt_dir, out_dir = Path(ckpt_dir), Path(out_dir)
    weights, state = read_checkpoint(ckpt_dir)  # verified as a resume would be: hashes, manifest, validation
    module_state = state.get("module", {})
    if "hf" in module_state:  # an HFModule's run: the Hugging Face layout, tokenizer included
        return _write_hf_module(weights, module_state["hf"], out_dir, merged)
    if not merged:
        raise ckpt.CheckpointError(
            f"checkpoint '{ckpt_dir}' is not an HFModule's with LoRA adapters; allowed: export it merged"
        )
    llama = module_state.get("llama_config")
    if llama is None or llama.get("moe") is not None:  # not a Llama transformers knows: our key names
        out_dir.mkdir(parents=True, exist_ok=True)
        ckpt.save_model_file(weights, out_dir / "model.safetensors")
        return out_dir / "model.safetensors"
    prefix = "model."  # CausalLM keeps its Llama under .model
    return _write_hf(
        {k[len(prefix) :]: v for k, v in weights.items() if k.startswith(prefix)},
        LlamaConfig(**llama),
        out_dir,
    )


def _write_hf(state: dict[str, torch.Tensor], config: LlamaConfig, out_dir: Path) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    state = to_hf_state_dict(state)
    if config.tie_embeddings:
        state.pop("lm_head.weight", None)  # transformers re-ties it from the embedding
    ckpt.save_model_file(state, out_dir / "model.safetensors")
    to_hf_config(config).save_pretrained(out_dir)
    return out_dir / "model.safetensors"


def _write_hf_module(weights: dict[str, torch.Tensor], hf: dict, out_dir: Path, merged: bool) -> Path:
    """Rebuild the HFModule a checkpoint was saved from (config, task, LoRA, adapters onto their base; its
    tokenizer when the folder it came from still exists), load the weights and `save_pretrained` it."""
    from trainer.models.hf import HFModule

    if not merged and not hf.get("lora"):
        raise ckpt.CheckpointError(
            "the checkpoint's HFModule has no LoRA adapters; allowed: export it merged"
        )
    HFModule.from_checkpoint(hf, weights).save_pretrained(out_dir, merged=merged)
    if not merged:
        return out_dir / "adapter_model.safetensors"
    index = out_dir / "model.safetensors.index.json"
    return index if index.exists() else out_dir / "model.safetensors"
