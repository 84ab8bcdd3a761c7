"""Fine-tuning a Hugging Face model from a local folder as a user would, on 1 or N processes:
`python tests/scripts/hf_script.py --model-dir DIR --strategy fsdp --devices 2 --root R --export E`.
Every rank calls `save_pretrained` (FSDP gathers the shards to rank 0, which writes); rank 0 writes
what it saw of the wrapping to R/report.json. test_hf_module.py imports the data and settings from here,
so its one-process reference trains on exactly the same batches."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parents[1]))  # tests/: helpers
from dist_common import parse_runs  # noqa: E402
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper  # noqa: E402
from torch.distributed.fsdp import FSDPModule  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402

from strategies import DDPStrategy, FSDPStrategy  # noqa: E402
from strategies.parallel3d import Parallel3DStrategy  # noqa: E402
from trainer import Trainer  # noqa: E402
from trainer.data import PackedDataset, TokenLoader  # noqa: E402
from trainer.models.hf import HFModule  # noqa: E402

VOCAB, SEQ_LEN, GLOBAL_BATCH, LR = 128, 16, 16, 1e-2


def lm_tokens(n: int = 4000, seed: int = 0) -> torch.Tensor:
    """A learnable stream: the next token is (7 * token + 3) % VOCAB, except at random restarts (1 in 10)."""
    g = torch.Generator().manual_seed(seed)
    restart = torch.rand(n, generator=g) < 0.1
    fresh = torch.randint(0, VOCAB, (n,), generator=g)
    # on Python ints, the same tokens: indexing the tensors element by element took ~0.1 s of CPU a call (the
    # HF matrix builds one for each of its 58 causal cells in each rank: 28% of its ranks' CPU), this ~1.5 ms
    out = fresh.tolist()
    for i, again in enumerate(restart.tolist()):
        if i and not again:
            out[i] = (7 * out[i - 1] + 3) % VOCAB
    return torch.tensor(out, dtype=torch.long)


def lm_loader(batch_size: int, seed: int = 1) -> TokenLoader:
    """{"input_ids", "labels"} blocks of SEQ_LEN, labels already shifted (the project's convention)."""
    return TokenLoader(
        PackedDataset(lm_tokens(), seq_len=SEQ_LEN), batch_size=batch_size, shuffle=True, seed=seed
    )


def trainer_kwargs(root: str | Path, steps: int) -> dict:
    return {
        "max_steps": steps,
        "gradient_clip_val": 0.5,
        "seed": 0,
        "log_every_n_steps": 1,
        "enable_progress_bar": False,
        "default_root_dir": str(root),
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model-dir", required=True)
    p.add_argument("--strategy", default="ddp", choices=["ddp", "fsdp", "tp"])
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--ac", default=None)  # FSDP's activation_checkpointing
    p.add_argument("--lora", action="store_true")  # LoRA r=4 on q_proj and v_proj
    p.add_argument("--root", required=True)
    p.add_argument("--export", required=True)
    for a in parse_runs(p):
        fit(a)


def fit(a: argparse.Namespace) -> None:
    """One run: HFModule trained under the strategy `a` names, its report written and its model exported."""
    torch.set_num_threads(1)
    if a.strategy == "fsdp":
        strategy = FSDPStrategy(zero_stage=3, activation_checkpointing=a.ac, timeout_s=120)
    elif a.strategy == "tp":  # transformers' own tp_plan: attention and MLP split over the 2 ranks
        strategy = Parallel3DStrategy(
            tp=a.devices, sequence_parallel=False, loss_parallel=False, timeout_s=120
        )
    else:
        strategy = DDPStrategy(timeout_s=120)
    world = a.devices // (a.devices if a.strategy == "tp" else 1)  # the ranks that read different data
    lora = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]} if a.lora else None
    torch.manual_seed(0)  # LoRA draws its A matrices when the module is built: the same on every rank
    module = HFModule(a.model_dir, lr=LR, lora=lora)
    trainer = Trainer(strategy=strategy, devices=a.devices, **trainer_kwargs(a.root, a.steps))
    trainer.fit(module, lm_loader(GLOBAL_BATCH // world))
    report = {
        "world_size": trainer.strategy.world_size,
        "tp_split": sorted(  # parameters a tensor-parallel plan split across ranks
            n.split(".")[-2]
            for n, p in module.named_parameters()
            if isinstance(p, DTensor)
            and "tp" in (p.device_mesh.mesh_dim_names or ())
            and any(pl.is_shard() for pl in p.placements)
        ),
        "fsdp_units": sorted(type(m).__name__ for m in module.modules() if isinstance(m, FSDPModule)),
        "checkpointed": sorted(
            type(m._checkpoint_wrapped_module).__name__
            for m in module.modules()
            if isinstance(m, CheckpointWrapper)
        ),
    }
    module.save_pretrained(a.export, max_shard_size="40KB")  # every rank: a collective under FSDP
    if trainer.is_global_zero:
        Path(a.root, "report.json").write_text(json.dumps(report))


if __name__ == "__main__":
    main()
