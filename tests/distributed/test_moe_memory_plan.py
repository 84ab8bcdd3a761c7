"""`trainer memory` plans MoE layouts: the bytes it plans for each rank of an expert-parallel tiny MoE (weights,
gradients, AdamW state) are the bytes real gloo ranks hold after a step, experts split evenly also where
whole experts do not split over FSDP's ranks, and the DeepSeek-V3-like and Mixtral recipes' layouts
validate and fit the H100 they name.

Run as a script (under torchrun, by `helpers.launch_layouts`), this file is the measured run: each layout
trains one step and rank 0 writes every rank's held bytes to --out.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Iterable
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

sys.path.insert(0, str(Path(__file__).parents[1]))  # tests/: helpers
from helpers import launch_layouts, token_loader  # noqa: E402

from callbacks import Callback  # noqa: E402
from strategies import Parallel3DStrategy  # noqa: E402
from strategies.plan.shards_on_meta import GIB, plan_memory  # noqa: E402
from trainer import Trainer  # noqa: E402
from trainer.models.causal_lm import CausalLM  # noqa: E402
from trainer.models.llama import LlamaConfig  # noqa: E402
from trainer.models.moe import GroupedExperts  # noqa: E402

RECIPES = Path(__file__).parents[2] / "recipes"
WORLD = 4
# ep=2 over 4 ranks, i.e. an "expert" mesh of 2: E=8 splits by whole experts (4 per ep rank, 2 per rank
# after FSDP); E=2 leaves 1 expert per ep rank for 2 ranks (as Mixtral's 8 at ep=8 on 64 GPUs), which FSDP
# would pad to 1 expert on each: it splits the expert's inner dim instead, half of it on each rank
LAYOUTS = [{"tag": "whole", "experts": 8, "ep": 2}, {"tag": "inner", "experts": 2, "ep": 2}]
H100_BYTES = 80 * 10**9  # "80GB" read as 74.5 GiB: below the 79.6 GiB CUDA reports, the safe side


def tiny_moe(experts: int) -> LlamaConfig:
    """The tiny MoE Llama (blocks 1-3 MoE, top-2, one shared expert) with `experts` routed experts."""
    return LlamaConfig.preset(
        "moe-tiny",
        vocab_size=64,
        max_seq_len=16,
        moe=dict(n_experts=experts, top_k=2, moe_ffn_dim=32, n_shared_experts=1, n_dense_layers=1),
    )


def held_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind `tensors` (a DTensor's local shard): what a rank allocated,
    FSDP's padding included, a flat gradient buffer shared by several parameters counted once."""
    storages = {}
    for t in tensors:
        local = t.to_local() if isinstance(t, DTensor) else t
        storages[local.untyped_storage().data_ptr()] = local.untyped_storage().nbytes()
    return sum(storages.values())


class HeldBytes(Callback):
    """Weights, gradients and AdamW state this rank holds after its first optimizer step (the gradients
    are still there: zero_grad comes next), and of the weights those of the routed experts."""

    def __init__(self) -> None:
        self.held: dict[str, int] = {}

    def on_before_zero_grad(self, trainer, module, optimizer):
        if not self.held:
            params = list(module.parameters())
            states = [v for s in optimizer.state.values() for v in s.values() if v.dim() > 0]  # not "step"
            experts = [p for m in module.modules() if isinstance(m, GroupedExperts) for p in m.parameters()]
            self.held = {
                "params": held_bytes(params),
                "grads": held_bytes(p.grad for p in params),
                "optimizer": held_bytes(states),
                "expert_params": held_bytes(experts),
            }


def measure_layouts(layouts: list[dict], steps: int, root: Path) -> dict:
    """Each layout trained for `steps` in this torchrun world; {tag: [held bytes of rank 0, 1, ...]}."""
    results = {}
    for layout in layouts:
        tag, experts = layout.pop("tag"), layout.pop("experts")
        probe = HeldBytes()
        trainer = Trainer(
            strategy=Parallel3DStrategy(timeout_s=120, **layout),
            devices="auto",
            max_steps=steps,
            seed=0,
            callbacks=[probe],
            default_root_dir=root / tag,
            enable_progress_bar=False,
            enable_checkpointing=False,  # the bytes of one step are the question, not a checkpoint
            enable_model_summary=False,
        )
        trainer.fit(CausalLM(tiny_moe(experts)), token_loader(1, 64))
        every: list = [None] * dist.get_world_size()
        dist.all_gather_object(every, probe.held)
        results[tag] = every
    return results


# ---- the plan against what the ranks hold ----------------------------------------------------------------
@pytest.mark.slow
def test_planned_bytes_of_every_rank_are_what_expert_parallel_ranks_hold(tmp_path):
    measured = launch_layouts(
        Path(__file__), tmp_path, WORLD, [dict(x) for x in LAYOUTS], steps=1, timeout=300
    )
    for layout in LAYOUTS:
        tag, config = layout["tag"], tiny_moe(layout["experts"])
        planned = plan_memory(
            Parallel3DStrategy(ep=layout["ep"]), lambda c=config: CausalLM(c), WORLD, [0, 1, 2, 3]
        )
        experts = 4 * expert_elements(config) // WORLD  # fp32 bytes of a quarter of the routed experts
        for rank, (plan, held) in enumerate(zip(planned, measured[tag], strict=True)):
            held = dict(held)
            assert held.pop("expert_params") == experts, f"{tag}: rank {rank} holds {held} of {experts} bytes"
            got = {"params": plan.param_bytes, "grads": plan.grad_bytes, "optimizer": plan.optimizer_bytes}
            assert got == held, f"{tag}: rank {rank} planned {got}, holds {held}"


def expert_elements(config: LlamaConfig) -> int:
    """The routed experts' elements of the whole model: w1, w3 (dim x ffn) and w2 (ffn x dim) each."""
    moe = config.moe
    return (config.n_layers - moe.n_dense_layers) * moe.n_experts * 3 * config.dim * moe.moe_ffn_dim


def test_expert_shards_are_the_experts_split_over_ep_and_the_expert_mesh():
    config = tiny_moe(8)
    for ep in (1, 2, 4):  # ep=1: the experts are FSDP-sharded with their blocks over all 4 ranks
        (rank0,) = plan_memory(Parallel3DStrategy(ep=ep), lambda: CausalLM(config), WORLD)
        # the experts' elements over ep ranks x the WORLD / ep of the expert mesh
        assert rank0.expert_numel == expert_elements(config) // WORLD, f"ep={ep}"
        assert rank0.param_bytes == rank0.even_param_bytes == 4 * rank0.numel  # nothing padded


@pytest.mark.parametrize("experts", [2, 6])
def test_experts_that_do_not_split_over_the_expert_mesh_are_split_evenly_on_every_rank(experts):
    """E/ep = 1 or 3 local experts over an "expert" mesh of 2: every rank holds a quarter of the experts'
    elements and bytes (FSDP's dim-0 split would give rank 0 twice that: 1 or 2 whole experts, padded)."""
    config = tiny_moe(experts)
    planned = plan_memory(Parallel3DStrategy(ep=2), lambda: CausalLM(config), WORLD, [0, 1, 2, 3])
    for plan in planned:
        assert plan.expert_numel == expert_elements(config) // WORLD, f"rank {plan.rank}: {plan.line()}"


def test_unknown_ranks_are_refused_in_one_line():
    with pytest.raises(ValueError, match=r"ranks \[4\] are outside the world of 4; allowed: 0..3"):
        plan_memory(Parallel3DStrategy(ep=2), lambda: CausalLM(tiny_moe(8)), WORLD, [0, 4])


# ---- the GPU-scale recipes ---------------------------------------------------------------------------------
def planned_per_gpu(recipe: Path, capsys) -> tuple[str, str, float]:
    """`trainer memory recipe`'s head line, its rank line and the total it plans per GPU (bytes), after
    checking that the recipe's comments state the rank line's numbers."""
    from trainer.cli import main

    assert main(["memory", str(recipe)]) == 0
    head, line, peak = capsys.readouterr().out.splitlines()  # the peak with activations: strategies/plan
    assert peak.startswith("peak of pp rank 0 with activations")
    numbers = line.split("; ", 1)[1]  # "params 9.8 GiB + grads 9.8 GiB + AdamW 19.6 GiB = 39.1 GiB"
    assert numbers in recipe.read_text(), f"the recipe's comments do not state the plan: {numbers}"
    return head, line, float(re.search(r"= ([\d.]+) GiB", numbers).group(1)) * GIB


def build_as_rank_0(recipe: Path, world: int, monkeypatch) -> tuple:
    """(trainer, module, train loader) of `recipe` as rank 0 of a torchrun world of `world` (8 per node),
    with the checks of a cuda run on this CPU."""
    from trainer.config import build_run, load_recipe

    for key, value in dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE=str(world), LOCAL_WORLD_SIZE="8",
                           MASTER_ADDR="127.0.0.1", MASTER_PORT="29500", TORCHELASTIC_RUN_ID="plan").items():  # fmt: skip
        monkeypatch.setenv(key, value)
    trainer, module, train, _ = build_run(load_recipe(recipe, ["trainer.accelerator=cpu"]))
    return trainer, module, train


def test_the_deepseek_v3_like_recipe_plans_39_gib_per_h100_as_its_comments_say(capsys):
    head, line, total = planned_per_gpu(RECIPES / "moe_deepseek_v3_like.yaml", capsys)
    assert head.startswith("61-layer Llama, 256 GPUs as dp_shard=256, ep=64, precision bf16-mixed")
    # 672.15B parameters, 653.9B in experts: each GPU holds 1/256 of both, nothing padded
    assert "2.63B elements (2.55B in experts)" in line and "padded" not in line
    assert total + 30 * GIB <= H100_BYTES, "30 GiB of an H100 80GB must stay for activations and buffers"


def test_the_deepseek_v3_like_recipe_builds_its_run_as_rank_0_of_its_world(monkeypatch):
    trainer, module, train = build_as_rank_0(RECIPES / "moe_deepseek_v3_like.yaml", 256, monkeypatch)
    strategy = trainer.strategy
    strategy.check_module(module)  # 256 experts divide over ep=64
    dims = strategy.parallel_dims().resolve(256)
    assert (dims.dp_shard, dims.ep, dims.tp, dims.pp) == (256, 64, 1, 1)
    assert strategy.activation_checkpointing == "full" and trainer.accumulate_grad_batches == 4
    assert train.batch_size == 1  # 1024 sequences / 256 data-parallel ranks / 4 accumulated
    assert module.config.moe.n_experts == 256 and module.config.moe.top_k == 8


def test_the_mixtral_recipe_plans_11_gib_per_h100_as_its_comments_say(capsys):
    head, line, total = planned_per_gpu(RECIPES / "moe_mixtral_8x7b.yaml", capsys)
    assert head.startswith("32-layer Llama, 64 GPUs as dp_shard=64, ep=8, precision bf16-mixed")
    # 46.70B parameters, 45.10B in experts: each GPU holds 1/64 of both, though 1 expert per ep rank does
    # not split over its 8-GPU "expert" mesh (dim-0 shards planned 84.4 GiB, "padded", on the first node)
    assert "0.73B elements (0.70B in experts)" in line and "padded" not in line
    # fp32 weights and gradients and AdamW's two fp32 states: 16 bytes of each of 46.70B parameters, / 64
    assert f"{total / GIB:.1f}" == f"{46.70e9 * 16 / 64 / GIB:.1f}" == "10.9"
    assert total + 30 * GIB <= H100_BYTES, "30 GiB of an H100 80GB must stay for activations and buffers"


def test_the_mixtral_recipe_builds_its_run_as_rank_0_of_its_world(monkeypatch):
    trainer, module, train = build_as_rank_0(RECIPES / "moe_mixtral_8x7b.yaml", 64, monkeypatch)
    strategy = trainer.strategy
    strategy.check_module(module)  # 8 experts divide over ep=8
    dims = strategy.parallel_dims().resolve(64)
    assert (dims.dp_shard, dims.ep, dims.tp, dims.pp) == (64, 8, 1, 1)
    assert dims.size("expert") == 8  # the 1 expert of each ep rank, over 8 GPUs: sharded on its inner dim
    assert strategy.activation_checkpointing == "full" and trainer.accumulate_grad_batches == 4
    assert strategy.precision.name == "bf16-mixed"
    assert train.batch_size == 2  # 512 sequences / 64 data-parallel ranks / 4 accumulated
    assert module.config.moe.n_experts == 8 and module.config.moe.moe_ffn_dim == 14336


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    for flag in ("--layouts", "--out", "--root"):
        parser.add_argument(flag, required=True)
    parser.add_argument("--steps", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(1)
    results = measure_layouts(json.loads(args.layouts), args.steps, Path(args.root))
    if dist.get_rank() == 0:
        Path(args.out).write_text(json.dumps(results))
