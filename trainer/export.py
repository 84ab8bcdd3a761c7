"""Export trained Llama weights in Hugging Face layout: `LlamaForCausalLM.from_pretrained(dir)` loads them."""

from __future__ import annotations

from pathlib import Path

from trainer.checkpoint import save_model_file
from trainer.models.hf_llama import to_hf_config, to_hf_state_dict
from trainer.models.llama import Llama


def export_llama(model: Llama, out_dir: str | Path) -> Path:
    """Write `model.safetensors` (HF key names) and `config.json` to `out_dir`; returns the weights file."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    state = to_hf_state_dict(model.state_dict())
    if model.config.tie_embeddings:
        state.pop("lm_head.weight")  # transformers re-ties it from the embedding
    save_model_file(state, out_dir / "model.safetensors")
    to_hf_config(model.config).save_pretrained(out_dir)
    return out_dir / "model.safetensors"
