"""Every family of hf_families.py under every strategy, one run after another in one 2-process world (one
launch's start-up for the whole matrix): `python tests/scripts/hf_matrix_script.py --cases JSON --root R
--out OUT.json` under torchrun. A case is [family, task, strategy]: "ddp", "fsdp" (ZeRO-3), "tp" (tp=2 from
transformers' own plan) or "lora" (LoRA under DDP). Each run trains hf_families' STEPS on the global batch and
exports with `save_pretrained` to R/<case id>/export; rank 0 writes each run's step losses, gradient norms and
tensor-parallel layout, or the one-line ValueError a strategy refused the case with, to OUT.json, which
test_hf_matrix.py compares with one process."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parents[1]))  # tests/: helpers
from helpers import read_metrics  # noqa: E402
from hf_families import CLASSES, GLOBAL_BATCH, LR, STEPS, loader, lora_options, tiny_config  # noqa: E402
from hf_script import trainer_kwargs  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402

from strategies import DDPStrategy, FSDPStrategy  # noqa: E402
from strategies.parallel3d import Parallel3DStrategy  # noqa: E402
from trainer import Trainer  # noqa: E402
from trainer.models.hf import HFModule  # noqa: E402


def case_id(family: str, task: str, strategy: str) -> str:
    """A case's folder name (and test id): ("OLMo 2", "causal-lm", "tp") -> "OLMo_2-causal-lm-tp"."""
    return f"{family}-{task}-{strategy}".replace(" ", "_")


class SGDModule(HFModule):
    """HFModule with plain SGD: every factor on a gradient shows in the update, where AdamW's normalisation
    hides a gradient's scale and magnifies the float noise of near-zero ones (1e-8 apart, 2e-5 in weights)."""

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=self.lr)


def build(family: str, task: str, lora: bool) -> HFModule:
    """The case's module, built as one process builds it (the Trainer's seed draws its weights again)."""
    torch.manual_seed(0)
    classes = CLASSES if task.endswith("classification") else None
    return SGDModule(
        tiny_config(family), task=task, lr=LR, num_labels=classes, lora=lora_options(family) if lora else None
    )


def strategy_of(name: str):
    if name == "fsdp":
        return FSDPStrategy(zero_stage=3, timeout_s=120)
    if name == "tp":
        return Parallel3DStrategy(tp=2, sequence_parallel=False, loss_parallel=False, timeout_s=120)
    return DDPStrategy(timeout_s=120)  # "ddp", and "lora" (LoRA under DDP)


def tp_layout(module: HFModule) -> dict[str, str]:
    """Parameter name (without the layer number) -> its placement on the "tp" mesh, for those a tensor-parallel
    plan made DTensors of."""
    return {
        ".".join(p for p in name.split(".") if not p.isdigit()): str(param.placements[-1])
        for name, param in module.named_parameters()
        if isinstance(param, DTensor) and "tp" in (param.device_mesh.mesh_dim_names or ())
    }


def run(family: str, task: str, strategy: str, root: Path) -> dict:
    """One case: trained on 2 processes, exported (every rank: FSDP and tp gather the shards to rank 0)."""
    module = build(family, task, lora=strategy == "lora")
    trainer = Trainer(
        strategy=strategy_of(strategy), devices=2, enable_checkpointing=False, **trainer_kwargs(root, STEPS)
    )
    trainer.fit(module, loader(task, GLOBAL_BATCH // (1 if strategy == "tp" else 2)))
    module.save_pretrained(root / "export")
    return {
        "losses": read_metrics(root),
        "grad_norms": read_metrics(root, "train/grad_norm"),
        "tp_layout": tp_layout(module),
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--cases", required=True)  # JSON: a list of [family, task, strategy]
    p.add_argument("--root", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--devices", type=int, default=2)  # torchrun's world
    a = p.parse_args()
    torch.set_num_threads(1)
    results = {}
    for family, task, strategy in json.loads(a.cases):
        key = case_id(family, task, strategy)
        # (a job's failure message keeps the lines just before a crash: which cell a rank died in)
        print(f"[rank {os.environ.get('RANK', '0')}] starting cell {key}", file=sys.stderr, flush=True)
        try:
            results[key] = run(family, task, strategy, Path(a.root) / key)
        except ValueError as refusal:  # a cell the strategy refuses, in one line, on every rank alike
            results[key] = {"refused": str(refusal)}
    if os.environ.get("RANK", "0") == "0":
        Path(a.out).write_text(json.dumps(results))


if __name__ == "__main__":
    main()
