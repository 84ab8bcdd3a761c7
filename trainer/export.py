"""Export trained weights as one `model.safetensors`: from a live Llama, or from any checkpoint (sharded
DCP ones included, read without a process group, so the original world size is not needed). A dense
Llama is written in Hugging Face's layout with its `config.json`: `LlamaForCausalLM.from_pretrained(dir)`;
an HFModule's run as `save_pretrained` writes it; a MoE Llama or any other module under its own names."""

from __future__ import annotations

from pathlib import Path

import torch

from trainer import checkpoint as ckpt
from trainer.checkpoint_weights import read_checkpoint
from trainer.models.hf_llama import to_hf_config, to_hf_state_dict
from trainer.models.llama import Llama, LlamaConfig


def export_llama(model: Llama, out_dir: str | Path) -> Path:
    """Write `model.safetensors` (HF key names) and `config.json` to `out_dir`; returns the weights file."""
    return _write_hf(model.state_dict(), model.config, Path(out_dir))


def export_checkpoint(ckpt_dir: str | Path, out_dir: str | Path) -> Path:
    """Consolidate a checkpoint's model weights into `out_dir/model.safetensors` (HF layout for a Llama)."""
    ckpt_dir, out_dir = Path(ckpt_dir), Path(out_dir)
    weights, state = read_checkpoint(ckpt_dir)  # verified as a resume would be: hashes, manifest, validation
    module_state = state.get("module", {})
    if "hf" in module_state:  # an HFModule's run: the Hugging Face layout, tokenizer included
        return _write_hf_module(weights, module_state["hf"], out_dir)
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


def _write_hf_module(weights: dict[str, torch.Tensor], hf: dict, out_dir: Path) -> Path:
    """Rebuild the HFModule a checkpoint was saved from (config, task, LoRA; its tokenizer when the
    folder it came from still exists), load the weights and `save_pretrained` it to `out_dir`."""
    from transformers import AutoConfig

    from trainer.models.hf import HFModule

    fields = dict(hf["config"])
    config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    tokenizer = hf.get("tokenizer")
    module = HFModule(
        config,
        task=hf["task"],
        tokenizer=tokenizer if tokenizer and Path(tokenizer).is_dir() else None,
        lora=hf.get("lora"),
    )
    module.load_state_dict(weights)
    module.save_pretrained(out_dir)
    index = out_dir / "model.safetensors.index.json"
    return index if index.exists() else out_dir / "model.safetensors"
