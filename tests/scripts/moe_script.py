"""Trains the tiny MoE Llama under expert-parallel Parallel3DStrategy layouts, as a user's script run under
torchrun would; first checks the all-to-all dispatcher alone against the local one (routings that leave
whole ranks without tokens).

`--layouts` is a JSON list of {"tag": ..., **Parallel3DStrategy kwargs} ("experts": the model's routed
experts, default 8; "router": MoEConfig fields to override; "precision": the Trainer's; "steps", "save",
"save_at" and "resume" as in parallel3d_script.py); each is one `Trainer.fit` in the same world. Rank 0 writes {"dispatcher": max abs
differences, tag: {"params": {name: values}, "empty_chunks": (source rank, expert) pairs that sent no rows,
summed over ranks and layers, "expert_placements": the expert weights' placements}} to `--out`; the losses
are in each run's metrics log under `--root`/tag.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parents[1]))  # tests/: helpers
from helpers import token_loader  # noqa: E402
from parallel3d_script import SaveAt, full_parameters  # noqa: E402

from strategies import Parallel3DStrategy  # noqa: E402
from strategies.techniques.ep.all_to_all import AllToAllDispatcher  # noqa: E402
from trainer import Trainer  # noqa: E402
from trainer.models.causal_lm import CausalLM  # noqa: E402
from trainer.models.llama import LlamaConfig  # noqa: E402
from trainer.models.moe import GroupedExperts, LocalDispatcher, MoE, Routing  # noqa: E402


def tiny_moe(n_experts: int, **router: object) -> LlamaConfig:
    """The tiny MoE Llama with `n_experts` routed experts (top-2, one shared expert, blocks 1-3 MoE) and
    any MoEConfig field of `router` overridden."""
    config = LlamaConfig.preset(
        "moe-tiny",
        vocab_size=64,
        max_seq_len=16,
        # the preset's MoE with the auxiliary-loss-free bias balancing (its loads summed over the ranks)
        # instead of the load-balancing loss: that loss is a product of per-batch means, so one process's
        # differs from the mean of the ranks' (as in every data-parallel MoE); the z-loss is a mean over tokens
        moe=dict(n_experts=n_experts, top_k=2, moe_ffn_dim=32, n_shared_experts=1, n_dense_layers=1,
                 aux_loss_coef=0.0, z_loss_coef=0.001, bias_update_rate=1e-3),
    )  # fmt: skip
    config.moe = dataclasses.replace(config.moe, **router)
    return config


MODEL = tiny_moe(8)
GLOBAL_BATCH = 4  # sequences of 16 tokens: 4 ranks get 32 (token, choice) pairs each for 8 experts


def make_run(
    root: Path,
    steps: int,
    batch: int,
    strategy="auto",
    precision="32",
    model: LlamaConfig = MODEL,
    accumulate: int = 1,
    val_batches: int = 2,
):
    """(trainer, module, train loader, val loader) of one run; the single-process reference uses it too."""
    trainer = Trainer(
        strategy=strategy,
        accumulate_grad_batches=accumulate,
        devices="auto",
        precision=precision,
        max_steps=steps,
        seed=0,
        gradient_clip_val=0.5,  # below these steps' norms: clipping acts, with the norm over both meshes
        default_root_dir=root,
        enable_progress_bar=False,
        log_every_n_steps=1,
        limit_val_batches=val_batches,
        num_sanity_val_steps=0,  # (the fit's end validates each layout: the number compared)
    )
    train = token_loader(batch, MODEL.vocab_size)
    val = token_loader(batch, MODEL.vocab_size, n_tokens=1000, seed=2)
    return trainer, CausalLM(model, lr=3e-3), train, val


def check_dispatcher() -> float:
    """Max abs difference, over outputs and gradients (inputs, gates, expert weights), between the
    all-to-all dispatcher with E/ep experts per rank and the local one with all E experts, for routings
    where every rank sends only to rank 0's experts (the others receive nothing), with dropped pairs,
    and random."""
    rank, world = dist.get_rank(), dist.get_world_size()
    n_experts, dim, ffn, n_tokens, k = 4 * world, 8, 16, 6, 2
    n_local = n_experts // world
    torch.manual_seed(0)
    full = GroupedExperts(dim, ffn, n_experts)
    for w in full.parameters():
        torch.nn.init.normal_(w, std=0.3)
    local = GroupedExperts(dim, ffn, n_local)
    with torch.no_grad():
        for name, w in local.named_parameters():
            w.copy_(getattr(full, name)[rank * n_local : (rank + 1) * n_local])
    g = torch.Generator().manual_seed(100 + rank)
    worst = 0.0
    for case in ("rank0-only", "dropped", "random"):
        x = torch.randn(n_tokens, dim, generator=g, requires_grad=True)
        logits = torch.randn(n_tokens, n_experts, generator=g, requires_grad=True)
        if case == "random":
            indices = torch.stack([torch.randperm(n_experts, generator=g)[:k] for _ in range(n_tokens)])
        else:
            indices = torch.stack([torch.randperm(n_local, generator=g)[:k] for _ in range(n_tokens)])
        keep = torch.rand(n_tokens, k, generator=g) > 0.3 if case == "dropped" else None
        results = []
        for dispatcher, experts in ((LocalDispatcher(), full), (AllToAllDispatcher(dist.group.WORLD), local)):
            for t in (x, logits, *experts.parameters()):
                t.grad = None
            gates = torch.softmax(logits, -1).gather(-1, indices)
            routing = Routing(indices, gates, keep, logits, torch.zeros(()), torch.zeros(()))
            tokens, counts, ctx = dispatcher.dispatch(x, routing, n_experts)
            y = dispatcher.combine(experts(tokens, counts), routing, ctx)
            (y * torch.arange(1.0, dim + 1)).sum().backward()
            grads = [p.grad.clone() for p in experts.parameters()]
            results.append((y.detach(), x.grad.clone(), logits.grad.clone(), grads))
        (y0, gx0, gl0, gw0), (y1, gx1, gl1, gw1) = results
        for a, b in ((y0, y1), (gx0, gx1), (gl0, gl1)):
            worst = max(worst, (a - b).abs().max().item())
        for a, b in zip(gw0, gw1, strict=True):  # the owner's gradient sums every rank's tokens
            dist.all_reduce(a)
            worst = max(worst, (a[rank * n_local : (rank + 1) * n_local] - b).abs().max().item())
    return worst


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--layouts", required=True)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--out", required=True)
    p.add_argument("--root", required=True)
    args = p.parse_args()
    torch.set_num_threads(1)
    results: dict = {}
    for layout in json.loads(args.layouts):
        tag = layout.pop("tag")
        steps, save, resume, precision, experts = (
            layout.pop("steps", args.steps),
            layout.pop("save", None),
            layout.pop("resume", None),
            layout.pop("precision", "32"),
            layout.pop("experts", MODEL.moe.n_experts),
        )
        router = layout.pop("router", {})
        save_at = layout.pop("save_at", None)  # with "save": written after that step, the fit going on
        # the loader's batch is per data-parallel rank: tp and pp ranks read the same data
        dp = int(os.environ["WORLD_SIZE"]) // (layout.get("tp", 1) * layout.get("pp", 1))
        trainer, module, train, val = make_run(
            Path(args.root) / tag,
            steps,
            GLOBAL_BATCH // dp,
            Parallel3DStrategy(timeout_s=120, **layout),
            precision,
            tiny_moe(experts, **router),
        )
        if save_at is not None:
            trainer.callbacks.append(SaveAt(save_at, save))
        trainer.fit(module, train, val, ckpt_path=resume)
        if save and save_at is None:
            trainer.save_checkpoint(save)
        empty = torch.tensor(
            float(
                sum(getattr(m.dispatcher, "empty_chunks", 0) for m in module.modules() if isinstance(m, MoE))
            )
        )
        dist.all_reduce(empty)
        placements = {
            str(p.placements)
            for m in module.modules()
            if isinstance(m, GroupedExperts)
            for p in m.parameters()
        }
        results[tag] = {
            "params": full_parameters(module),
            "empty_chunks": empty.item(),
            "expert_placements": sorted(placements),
        }
    if not dist.is_initialized():  # the fits made the world; without layouts make it here
        dist.init_process_group("gloo")
    results["dispatcher"] = check_dispatcher()
    if dist.get_rank() == 0:
        Path(args.out).write_text(json.dumps(results))


if __name__ == "__main__":
    main()
