"""The time sharding adds beyond its matmuls and its collectives' wire time: DTensor's dispatch, sharding
propagation and redistribution bookkeeping, tensor parallelism's styles and FSDP's hooks and copies into
and out of its gathered buffers, in each pass and in the optimizer step and norm clip on DTensor
parameters. The step-time model (strategies/plan/step_time.py) counts it as a fixed cost per block pass
and per model pass (copies that grow with the activation, e.g. of gathered shards, are not in a tiny pass),
and per optimizer step.

Measured in pairs of the doctor's ranks (all at once): tiny Llamas of one and of three blocks (the
project's own blocks), forward and backward, sharded (tensor parallel with the project's plan and sequence
parallel; FSDP per block and at the root) against the same models unsharded, whose time is the compute
the model gives a rank (over tp for tensor parallelism, which splits it; FSDP splits only the optimizer's
work). The slope of the sharded time beyond it over the depth is the per-block cost, the intercept the
per-pass cost of the embedding, the output and the loss. The collectives the model counts are taken out at
their time measured here: tensor parallelism's 4 all-gather and reduce-scatter pairs of the activation per
block pass and 2 outside the blocks, FSDP's 2 all-gathers and 1 reduce-scatter of the parameters. The step:
AdamW (as the Llama module configures it, fused where the Trainer fuses) and the global-norm clip, likewise
per block and fixed.

Every arm is timed once per round, the rounds back to back, and each field is its median over the rounds'
fits: the costs are differences of timings, and on a shared host whose speed drifts by 10-25% over
minutes, differences of timings taken apart (the best of several) moved a field 30-fold between runs."""

from __future__ import annotations

import statistics
from dataclasses import dataclass

import torch
import torch.distributed as dist

from strategies.plan.hardware import SHARDED_FIELDS as FIELDS
from strategies.plan.hardware import SHARDED_KINDS as KINDS
from trainer.core.dtensors import full_value
from trainer.core.fused_optim import prefer_fused
from trainer.doctor.measure import ALL_GATHER, REDUCE_SCATTER, time_call

VOCAB, HEAD_DIM = 256, 16
# all-gather + reduce-scatter pairs of a sequence-parallel pass that the step-time model counts: per block,
# and outside the blocks (the embedding's output, the output layer's input)
PAIRS_PER_BLOCK, PAIRS_OUTSIDE = 4, 2
BLOCKS = (1, 3)  # the tiny Llamas' depths: a cost per block is the slope of the line through their times
ROUNDS = 7  # the rounds a field is the median of, unless the doctor's --rounds says otherwise


@dataclass(frozen=True)
class Overhead:
    """Seconds one kind of sharding adds (the slowest rank's, each clamped at 0)."""

    block_s: float  # per block pass (forward + backward), fixed
    pass_s: float  # per model pass, fixed: embedding, output, loss
    step_block_s: float  # per optimizer step and block: AdamW and the clip on its DTensor parameters
    step_s: float  # per optimizer step, the rest (embedding, output, final norm)


@dataclass(frozen=True)
class Round:
    """One round's seconds per call, each arm timed back to back with its pair: by depth in BLOCKS, the
    sharded and the unsharded model's pass and optimizer step, and the wire time of the collectives the
    step-time model counts per block pass and outside the blocks."""

    sharded_pass: tuple[float, ...]
    whole_pass: tuple[float, ...]
    sharded_step: tuple[float, ...]
    whole_step: tuple[float, ...]
    block_wire: float
    root_wire: float


def sharded_overhead(device: torch.device, rounds: int = ROUNDS, iters: int = 3) -> dict[str, Overhead]:
    """The Overhead of tensor parallelism and of FSDP over pairs of ranks (all of them when their number is
    odd), from `rounds` rounds of `iters` calls per arm. Every rank calls it."""
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size()
    n = 2 if world % 2 == 0 else world
    mesh = init_device_mesh(device.type, (world // n, n), mesh_dim_names=("rest", "pair"))["pair"]
    heads, tokens = 2 * n, 8 * n  # divisible by n: heads split, sequence parallel splits the tokens
    measured = []
    for kind in KINDS:
        found = _rounds(kind, heads, tokens, mesh, device, rounds, iters)
        measured += overhead_of(found, split=n if kind == "tp" else 1, shards=n)
    slowest = torch.tensor(measured, dtype=torch.float64, device=device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    values = iter(max(x, 0.0) for x in slowest.tolist())
    return {kind: Overhead(**{name: next(values) for name in FIELDS}) for kind in KINDS}


def overhead_of(rounds: list[Round], split: int, shards: int) -> list[float]:
    """The Overhead fields (unclamped) from timed rounds: each round's sharded time beyond the unsharded
    model's over `split` (the pass's compute a rank keeps: tp splits it, FSDP does not) or over `shards`
    (the optimizer's work), fitted per round by a line over the depths (slope per block, intercept fixed),
    less the wire time; then each field's median over the rounds. A round is timed within seconds, so the
    host's drift over minutes moves its arms together and a slow round is outvoted."""
    fields = []
    for r in rounds:
        passes = [s - w / split for s, w in zip(r.sharded_pass, r.whole_pass, strict=True)]
        steps = [s - w / shards for s, w in zip(r.sharded_step, r.whole_step, strict=True)]
        block, fixed = statistics.linear_regression(BLOCKS, passes)
        step_block, step = statistics.linear_regression(BLOCKS, steps)
        fields.append((block - r.block_wire, fixed - r.root_wire, step_block, step))
    return [statistics.median(column) for column in zip(*fields, strict=True)]


def _rounds(
    kind: str, heads: int, tokens: int, mesh, device: torch.device, rounds: int, iters: int
) -> list[Round]:
    """`rounds` Rounds of `kind` sharding over `mesh`, as this rank timed them."""
    arms = {
        (blocks, sharded): _Arm(blocks, heads, tokens, kind if sharded else None, mesh, device)
        for blocks in BLOCKS
        for sharded in (False, True)
    }
    group = mesh.get_group()
    if kind == "tp":
        pair = _wire(group, tokens * heads * HEAD_DIM, 1, 1, device)

        def wire_s() -> tuple[float, float]:  # one timing of a pair, counted as the model counts them
            seconds = time_call(pair, device, 0, iters)
            return PAIRS_PER_BLOCK * seconds, PAIRS_OUTSIDE * seconds
    else:
        block_params, root_params = arms[1, False].parameters
        block_call = _wire(group, block_params, 2, 1, device)
        root_call = _wire(group, root_params, 2, 1, device)

        def wire_s() -> tuple[float, float]:  # a block's parameters, and the root's
            return time_call(block_call, device, 0, iters), time_call(root_call, device, 0, iters)

    for arm in arms.values():  # sharding propagation's cache, the allocator, the gradients the step reads
        time_call(arm.one_pass, device, 3, 1)
        time_call(arm.step, device, 3, 1)
    found = []
    for _ in range(rounds):
        passes = {key: time_call(arm.one_pass, device, 0, iters) for key, arm in arms.items()}
        steps = {key: time_call(arm.step, device, 0, iters) for key, arm in arms.items()}
        block_wire, root_wire = wire_s()
        found.append(
            Round(
                sharded_pass=tuple(passes[b, True] for b in BLOCKS),
                whole_pass=tuple(passes[b, False] for b in BLOCKS),
                sharded_step=tuple(steps[b, True] for b in BLOCKS),
                whole_step=tuple(steps[b, False] for b in BLOCKS),
                block_wire=block_wire,
                root_wire=root_wire,
            )
        )
    return found


def _wire(group: dist.ProcessGroup, elements: int, gathers: int, reduces: int, device: torch.device):
    """A call of `gathers` all-gathers and `reduces` reduce-scatters of `elements` (the gathered size) over
    `group`: the collectives whose wire time the model counts."""
    n = dist.get_world_size(group)
    full = torch.ones(elements // n * n, device=device)
    part = torch.ones(elements // n, device=device)

    def calls() -> None:
        for _ in range(gathers):
            ALL_GATHER(full, part, group=group)
        for _ in range(reduces):
            REDUCE_SCATTER(part, full, group=group)

    return calls


class _Arm:
    """A tiny Llama of `blocks` blocks over a sequence of `tokens`, sharded by `kind` over `mesh` (else
    whole on this rank), with AdamW as the Llama module configures it (fused where the Trainer fuses)."""

    def __init__(self, blocks: int, heads: int, tokens: int, kind: str | None, mesh, device: torch.device):
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
        self.parameters = block, total - blocks * block  # one block's and the rest's, unsharded
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
        self.model, self.ids = model, torch.randint(0, VOCAB, (1, tokens), device=device)
        self.params = list(model.parameters())
        matrices = [p for p in self.params if p.dim() >= 2]  # AdamW's groups as the Llama module makes them
        self.optimizer = prefer_fused(
            torch.optim.AdamW(
                [
                    {"params": matrices},
                    {"params": [p for p in self.params if p.dim() < 2], "weight_decay": 0.0},
                ],
                lr=1e-9,  # the step's cost, not its effect
            )
        )

    def one_pass(self) -> None:
        """One forward and backward."""
        out = self.model(self.ids)
        (out.to_local() if hasattr(out, "to_local") else out).float().sum().backward()

    def step(self) -> None:
        """The global-norm clip and the optimizer step, as the Trainer runs them."""
        grads = [p.grad for p in self.params]
        norm = full_value(torch.nn.utils.get_total_norm(grads, 2.0))
        torch._foreach_mul_(grads, (1.0 / (norm + 1e-6)).clamp(max=1.0))
        self.optimizer.step()
