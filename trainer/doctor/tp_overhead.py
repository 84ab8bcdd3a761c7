"""The host time tensor parallelism adds beyond its matmuls and its collectives' wire time: DTensor's
dispatch, sharding propagation and redistribution bookkeeping, the parallel styles' hooks, in each pass and
in the optimizer step and norm clip on DTensor parameters. The step-time model
(strategies/plan/step_time.py) counts it as a fixed cost per block pass and per model pass (copies that
grow with the activation, e.g. of gathered shards, are not in a tiny pass), and per optimizer step.

Measured in tensor-parallel pairs of the doctor's ranks (all at once): tiny Llamas of one and of two
blocks (the project's own blocks and tensor-parallel plan, sequence parallel), forward and backward,
against the same models unsharded, whose time over tp is the compute the model gives a rank; the second
block's extra time is the per-block cost, the rest the per-pass cost of the embedding, the output and the
loss. The collectives the model counts (4 all-gather and reduce-scatter pairs of the activation per block
pass, 2 outside the blocks) are taken out at their time measured here. The step: AdamW (as the Llama
module configures it, fused where the Trainer fuses) and the global-norm clip, likewise per block and
fixed."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from trainer.doctor.measure import ALL_GATHER, REDUCE_SCATTER, time_call
from trainer.dtensors import full_value
from trainer.fused_optim import prefer_fused

VOCAB, HEAD_DIM = 256, 16
# all-gather + reduce-scatter pairs of a sequence-parallel pass that the step-time model counts: per block,
# and outside the blocks (the embedding's output, the output layer's input)
PAIRS_PER_BLOCK, PAIRS_OUTSIDE = 4, 2


@dataclass(frozen=True)
class TpOverhead:
    """Seconds tensor parallelism adds (the slowest rank's, each clamped at 0)."""

    block_s: float  # per block pass (forward + backward), fixed
    pass_s: float  # per model pass, fixed: embedding, output, loss
    step_block_s: float  # per optimizer step and block: AdamW and the clip on its DTensor parameters
    step_s: float  # per optimizer step, the rest (embedding, output, final norm)


def tp_overhead(device: torch.device, iters: int = 10) -> TpOverhead:
    """TpOverhead over pairs of ranks (all of them when their number is odd). Every rank calls it."""
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size()
    tp = 2 if world % 2 == 0 else world
    mesh = init_device_mesh(device.type, (world // tp, tp), mesh_dim_names=("dp", "tp"))["tp"]
    heads, tokens = 2 * tp, 8 * tp  # divisible by tp: heads split, sequence parallel splits the tokens
    found = {  # (blocks, sharded) -> (pass seconds, step seconds)
        (blocks, sharded): _timed(blocks, heads, tokens, mesh if sharded else None, device, iters)
        for blocks in (1, 2)
        for sharded in (False, True)
    }

    def beyond(blocks: int, which: int) -> float:  # sharded over unsharded / tp: the model's compute
        return found[blocks, True][which] - found[blocks, False][which] / tp

    pair = _pair_s(mesh.get_group(), tokens * heads * HEAD_DIM, device, iters)
    block = beyond(2, 0) - beyond(1, 0) - PAIRS_PER_BLOCK * pair
    fixed = beyond(1, 0) - block - PAIRS_OUTSIDE * pair
    step_block = beyond(2, 1) - beyond(1, 1)
    measured = [block, fixed, step_block, beyond(1, 1) - step_block]
    slowest = torch.tensor(measured, dtype=torch.float64, device=device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return TpOverhead(*(max(x, 0.0) for x in slowest.tolist()))


def _pair_s(group: dist.ProcessGroup, elements: int, device: torch.device, iters: int) -> float:
    """One all-gather plus one reduce-scatter of an activation of `elements` over `group`: the wire time
    the model counts for each of a block's collective pairs."""
    n = dist.get_world_size(group)
    full = torch.ones(elements // n * n, device=device)
    part = torch.ones(elements // n, device=device)

    def pair() -> None:
        ALL_GATHER(full, part, group=group)
        REDUCE_SCATTER(part, full, group=group)

    return _best_s(pair, device, iters)


def _timed(
    blocks: int, heads: int, tokens: int, mesh, device: torch.device, iters: int
) -> tuple[float, float]:
    """Seconds of one forward and backward of a tiny Llama with `blocks` blocks over a sequence of `tokens`
    (tensor-parallel over `mesh`, else whole on this rank), and of its optimizer step with the clip."""
    from trainer.models.llama import Llama, LlamaConfig

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB,
        dim=heads * HEAD_DIM,
        n_layers=blocks,
        n_heads=heads,
        n_kv_heads=heads,
        max_seq_len=tokens,
    )
    model = Llama(config).to(device)
    if mesh is not None:
        from torch.distributed.tensor.parallel import parallelize_module

        parallelize_module(
            model, mesh, model.tensor_parallel_plan(sequence_parallel=True, loss_parallel=False)
        )
    ids = torch.randint(0, VOCAB, (1, tokens), device=device)

    def one() -> None:
        out = model(ids)
        (out.to_local() if hasattr(out, "to_local") else out).float().sum().backward()

    passed = _best_s(one, device, iters)
    params = list(model.parameters())
    matrices = [p for p in params if p.dim() >= 2]  # AdamW's groups as the Llama module makes them
    optimizer = prefer_fused(
        torch.optim.AdamW(
            [{"params": matrices}, {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}],
            lr=1e-9,  # the step's cost, not its effect
        )
    )
    grads = [p.grad for p in params]

    def update() -> None:
        norm = full_value(torch.nn.utils.get_total_norm(grads, 2.0))
        torch._foreach_mul_(grads, (1.0 / (norm + 1e-6)).clamp(max=1.0))
        optimizer.step()

    return passed, _best_s(update, device, iters)


def _best_s(call, device: torch.device, iters: int) -> float:
    """Seconds per call: the best of three timings of `iters` calls between barriers, after three warm-up
    calls (sharding propagation's cache, the allocator)."""
    return min(time_call(call, device, 3 if i == 0 else 0, iters) for i in range(3))
