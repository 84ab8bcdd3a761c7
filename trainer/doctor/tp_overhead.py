"""The host time tensor parallelism adds beyond its matmuls and its collectives' wire time: DTensor's
dispatch, sharding propagation and redistribution bookkeeping, the parallel styles' hooks. The step-time
model (strategies/plan/step_time.py) counts it as a fixed cost per block pass and per model pass (copies
that grow with the activation, e.g. of gathered shards, are not in a tiny pass): on a CPU host it adds to
the step, on a GPU it hides behind the kernels it queues when they take longer.

Measured in tensor-parallel pairs of the doctor's ranks (all at once): a tiny Llama of one and of two
blocks (the project's own blocks and tensor-parallel plan, sequence parallel), forward and backward,
against the same models unsharded; the second block's extra time is the per-block cost, the rest the
per-pass cost of the embedding, the output and the loss. The collectives the model counts (4 all-gather
and reduce-scatter pairs of the activation per block pass, 2 outside the blocks) are taken out at their
time measured here."""

from __future__ import annotations

import torch
import torch.distributed as dist

from trainer.doctor.measure import ALL_GATHER, REDUCE_SCATTER, time_call

VOCAB, HEAD_DIM = 256, 16
# all-gather + reduce-scatter pairs of a sequence-parallel pass that the step-time model counts: per block,
# and outside the blocks (the embedding's output, the output layer's input)
PAIRS_PER_BLOCK, PAIRS_OUTSIDE = 4, 2


def tp_overhead(device: torch.device, iters: int = 10) -> tuple[float, float]:
    """(per block, per pass) host seconds of tensor parallelism over pairs of ranks (all of them when their
    number is odd), beyond the unsharded pass and the block's collectives; the slowest rank's, clamped at 0.
    Every rank calls it."""
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size()
    tp = 2 if world % 2 == 0 else world
    mesh = init_device_mesh(device.type, (world // tp, tp), mesh_dim_names=("dp", "tp"))["tp"]
    heads, seq = 2 * tp, 8 * tp  # divisible by tp: heads split, sequence parallel splits the tokens
    times = {
        (blocks, sharded): _pass_s(blocks, heads, seq, mesh if sharded else None, device, iters)
        for blocks in (1, 2)
        for sharded in (False, True)
    }
    block = (times[2, True] - times[1, True]) - (times[2, False] - times[1, False])
    fixed = (times[1, True] - times[1, False]) - block
    pair = _pair_s(mesh.get_group(), seq * heads * HEAD_DIM, device, iters)
    block -= PAIRS_PER_BLOCK * pair
    fixed -= PAIRS_OUTSIDE * pair
    slowest = torch.tensor([block, fixed], dtype=torch.float64, device=device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return max(slowest[0].item(), 0.0), max(slowest[1].item(), 0.0)


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


def _pass_s(blocks: int, heads: int, seq: int, mesh, device: torch.device, iters: int) -> float:
    """Seconds of one forward and backward of a tiny Llama with `blocks` blocks (tensor-parallel over
    `mesh`, else whole on this rank)."""
    from trainer.models.llama import Llama, LlamaConfig

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB,
        dim=heads * HEAD_DIM,
        n_layers=blocks,
        n_heads=heads,
        n_kv_heads=heads,
        max_seq_len=seq,
    )
    model = Llama(config).to(device)
    if mesh is not None:
        from torch.distributed.tensor.parallel import parallelize_module

        parallelize_module(
            model, mesh, model.tensor_parallel_plan(sequence_parallel=True, loss_parallel=False)
        )
    tokens = torch.randint(0, VOCAB, (1, seq), device=device)

    def one() -> None:
        out = model(tokens)
        (out.to_local() if hasattr(out, "to_local") else out).float().sum().backward()

    return _best_s(one, device, iters)


def _best_s(call, device: torch.device, iters: int) -> float:
    """Seconds per call: the best of three timings of `iters` calls between barriers, after three warm-up
    calls (sharding propagation's cache, the allocator)."""
    return min(time_call(call, device, 3 if i == 0 else 0, iters) for i in range(3))
