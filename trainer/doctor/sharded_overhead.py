"""The time sharding adds beyond its matmuls and its collectives' wire time: DTensor's dispatch, sharding
propagation and redistribution bookkeeping, tensor parallelism's styles and FSDP's hooks and copies into
and out of its gathered buffers, in each pass and in the optimizer step and norm clip on DTensor
parameters. The step-time model (strategies/plan/step_time.py) counts it as a fixed cost per block pass
and per model pass (copies that grow with the activation, e.g. of gathered shards, are not in a tiny pass),
and per optimizer step.

Measured in pairs of the doctor's ranks (all at once): tiny Llamas of one and of two blocks (the project's
own blocks), forward and backward, sharded (tensor parallel with the project's plan and sequence
parallel; FSDP per block and at the root) against the same models unsharded, whose time is the compute
the model gives a rank (over tp for tensor parallelism, which splits it; FSDP splits only the optimizer's
work). The second block's extra time is the per-block cost, the rest the per-pass cost of the embedding,
the output and the loss. The collectives the model counts are taken out at their time measured here:
tensor parallelism's 4 all-gather and reduce-scatter pairs of the activation per block pass and 2 outside
the blocks, FSDP's 2 all-gathers and 1 reduce-scatter of the parameters. The step: AdamW (as the Llama
module configures it, fused where the Trainer fuses) and the global-norm clip, likewise per block and
fixed."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from strategies.plan.hardware import SHARDED_FIELDS as FIELDS
from strategies.plan.hardware import SHARDED_KINDS as KINDS
from trainer.doctor.measure import ALL_GATHER, REDUCE_SCATTER, time_call
from trainer.dtensors import full_value
from trainer.fused_optim import prefer_fused

VOCAB, HEAD_DIM = 256, 16
# all-gather + reduce-scatter pairs of a sequence-parallel pass that the step-time model counts: per block,
# and outside the blocks (the embedding's output, the output layer's input)
PAIRS_PER_BLOCK, PAIRS_OUTSIDE = 4, 2


@dataclass(frozen=True)
class Overhead:
    """Seconds one kind of sharding adds (the slowest rank's, each clamped at 0)."""

    block_s: float  # per block pass (forward + backward), fixed
    pass_s: float  # per model pass, fixed: embedding, output, loss
    step_block_s: float  # per optimizer step and block: AdamW and the clip on its DTensor parameters
    step_s: float  # per optimizer step, the rest (embedding, output, final norm)


def sharded_overhead(device: torch.device, iters: int = 10) -> dict[str, Overhead]:
    """The Overhead of tensor parallelism and of FSDP over pairs of ranks (all of them when their number is
    odd). Every rank calls it."""
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size()
    n = 2 if world % 2 == 0 else world
    mesh = init_device_mesh(device.type, (world // n, n), mesh_dim_names=("rest", "pair"))["pair"]
    heads, tokens = 2 * n, 8 * n  # divisible by n: heads split, sequence parallel splits the tokens
    measured = [x for kind in KINDS for x in _measure(kind, heads, tokens, mesh, device, iters)]
    slowest = torch.tensor(measured, dtype=torch.float64, device=device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    values = iter(max(x, 0.0) for x in slowest.tolist())
    return {kind: Overhead(**{name: next(values) for name in FIELDS}) for kind in KINDS}


def _measure(kind: str, heads: int, tokens: int, mesh, device: torch.device, iters: int) -> list[float]:
    """This rank's Overhead fields of `kind` sharding over `mesh` (unclamped)."""
    n = mesh.size()
    found = {  # (blocks, sharded) -> (pass seconds, step seconds, block's and root's parameters)
        (blocks, sharded): _timed(blocks, heads, tokens, kind if sharded else None, mesh, device, iters)
        for blocks in (1, 2)
        for sharded in (False, True)
    }
    split = n if kind == "tp" else 1  # what of the pass's compute a rank keeps: tp splits it, FSDP does not

    def beyond(blocks: int, which: int) -> float:  # sharded over unsharded / the split of its work
        return found[blocks, True][which] - found[blocks, False][which] / (split if which == 0 else n)

    group = mesh.get_group()
    if kind == "tp":
        pair = _wire_s(group, tokens * heads * HEAD_DIM, 1, 1, device, iters)
        block_wire, root_wire = PAIRS_PER_BLOCK * pair, PAIRS_OUTSIDE * pair
    else:
        block_params, root_params = found[1, False][2]
        block_wire = _wire_s(group, block_params, 2, 1, device, iters)
        root_wire = _wire_s(group, root_params, 2, 1, device, iters)
    block = beyond(2, 0) - beyond(1, 0) - block_wire
    step_block = beyond(2, 1) - beyond(1, 1)
    return [block, beyond(1, 0) - block - root_wire, step_block, beyond(1, 1) - step_block]


def _wire_s(
    group: dist.ProcessGroup, elements: int, gathers: int, reduces: int, device: torch.device, iters: int
) -> float:
    """`gathers` all-gathers and `reduces` reduce-scatters of `elements` (the gathered size) over `group`:
    the wire time the model counts for them."""
    n = dist.get_world_size(group)
    full = torch.ones(elements // n * n, device=device)
    part = torch.ones(elements // n, device=device)

    def calls() -> None:
        for _ in range(gathers):
            ALL_GATHER(full, part, group=group)
        for _ in range(reduces):
            REDUCE_SCATTER(part, full, group=group)

    return _best_s(calls, device, iters)


def _timed(
    blocks: int, heads: int, tokens: int, kind: str | None, mesh, device: torch.device, iters: int
) -> tuple[float, float, tuple[int, int]]:
    """Seconds of one forward and backward of a tiny Llama with `blocks` blocks over a sequence of `tokens`
    (sharded by `kind` over `mesh`, else whole on this rank) and of its optimizer step with the clip, and
    its parameters: one block's and the rest's."""
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
    total = sum(p.numel() for p in model.parameters())
    block = sum(p.numel() for p in next(iter(model.layers.values())).parameters())
    if kind == "tp":
        from torch.distributed.tensor.parallel import parallelize_module

        parallelize_module(
            model, mesh, model.tensor_parallel_plan(sequence_parallel=True, loss_parallel=False)
        )
    elif kind == "fsdp":
        from torch.distributed.fsdp import fully_shard

        for layer in model.layers.values():
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
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

    return passed, _best_s(update, device, iters), (block, total - blocks * block)


def _best_s(call, device: torch.device, iters: int) -> float:
    """Seconds per call: the best of three timings of `iters` calls between barriers, after three warm-up
    calls (sharding propagation's cache, the allocator)."""
    return min(time_call(call, device, 3 if i == 0 else 0, iters) for i in range(3))
