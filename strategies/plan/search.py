"""The layouts of a world, ranked: every way to cut `world` GPUs into tp x cp x pp x data parallel (and ep
for a MoE model) that the strategies run, with each micro-batch size and activation checkpointing mode,
kept if the memory model says a rank fits in the device's memory, ranked by the step-time model's
tokens/s, with one line of why for the winner. The global batch (sequences per optimizer step) is the
recipe's and stays fixed: a layout only decides how it is split."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from strategies.plan.hardware import GB, Hardware
from strategies.plan.shapes import ACTIVATION_CHECKPOINTING, Layout, ModelShape, RunShape
from strategies.plan.step_time import StepTime, crosses_nodes, dense_params, expert_params, step_time

# what a rank may fill of the device: the caching allocator's fragmentation and the CUDA context, NCCL's
# buffers and the kernels' workspaces take the rest (PyTorch's memory notes: ~5-10% in practice)
USABLE_MEMORY = 0.9
TIE = 0.02  # predictions this close count as equal
# stages per rank of interleaved_1f1b the runtime builds (strategies/techniques/pp/stages.py's SCHEDULES:
# Interleaved1F1B holds 2); a what-if search may try more (Llama 3 ran ~8 blocks' worth per stage)
RUNTIME_VIRTUAL_STAGES = (2,)
MICRO_BATCHES = (1, 2, 4, 8, 16)  # sequences per micro-batch tried: the larger the fewer FSDP gathers
# ten times the largest clusters built: past it a world is a typo, and factoring it would take ever longer
MAX_WORLD = 10_000_000
# layouts weighed in one search: the shipped recipes' plans weigh up to ~20,000 (a few seconds); past this the
# world and the global batch share so many divisors that the answer would take minutes
MAX_LAYOUTS = 50_000
Memory = Callable[[ModelShape, Layout, RunShape], Any]  # -> an estimate with `.peak` in bytes
Kernels = Mapping[str, bool]  # Layout's kernel fields: fused_kernels, flash_attention


@dataclass(frozen=True)
class Candidate:
    """A layout that fits, with the batch split it runs, its memory estimate and its predicted step."""

    layout: Layout
    run: RunShape
    peak_bytes: float
    time: StepTime


@dataclass(frozen=True)
class Plan:
    """The ranked layouts that fit (best first), how many were tried and did not fit, and why the winner."""

    ranked: list[Candidate]
    tried: int
    too_big: int
    why: str
    versus: str | None = None  # the best layout of the other choice on pipelining across nodes, and its costs

    @property
    def best(self) -> Candidate:
        return self.ranked[0]


def divisors(n: int) -> list[int]:
    """The divisors of `n` >= 1, ascending, from its prime factors (trial division up to sqrt(n)): a
    world of a billion GPUs has 100 of them, found in microseconds, not by trying all billion."""
    found = [1]
    rest, p = n, 2
    while p * p <= rest:
        power = 0
        while rest % p == 0:
            rest //= p
            power += 1
        found = [d * p**k for d in found for k in range(power + 1)]
        p += 1 if p == 2 else 2
    if rest > 1:  # the one prime factor above sqrt(n) left
        found = [d * m for d in found for m in (1, rest)]
    return sorted(found)


def layouts(shape: ModelShape, world: int, gpus_per_node: int, seq_len: int, global_batch: int,
            precision: str = "bf16", optimizer: str = "adamw", virtual_stages: tuple[int, ...] = RUNTIME_VIRTUAL_STAGES,
            rejected: Counter[str] | None = None, kernels: Kernels | None = None) -> Iterator[tuple[Layout, RunShape]]:  # fmt: skip
    """Every (layout, per-rank batch) of `world` ranks the strategies run for this model: tp divides the
    heads and the vocabulary and stays in a node, cp splits the sequence into 2 cp chunks, pp gives each
    stage a block, the data-parallel ranks split `global_batch` sequences evenly; DDP and ZeRO-1 only
    without tp/pp/cp (their strategies run no other dimension). cp may span nodes (its ring then runs over the
    inter-node link, step_time's cost). `rejected` counts, by reason, the meshes and splits left out."""
    rejected = rejected if rejected is not None else Counter()
    for tp in divisors(world):
        if tp > gpus_per_node:
            rejected["tp beyond a node"] += 1
            continue
        if shape.n_heads % tp or shape.n_kv_heads % tp or shape.vocab_size % tp or (tp > 1 and seq_len % tp):
            rejected[f"tp={tp} does not divide the heads, the vocabulary or the sequence"] += 1
            continue
        for cp in divisors(world // tp):
            if cp > 1 and seq_len % (2 * cp):
                rejected[f"cp={cp}: the sequence of {seq_len} does not split into 2 cp chunks"] += 1
                continue
            for pp in divisors(world // (tp * cp)):
                if pp > shape.n_layers:
                    rejected["pp beyond the blocks"] += 1
                    continue
                dp = world // (tp * cp * pp)
                if global_batch % dp:
                    rejected[f"the global batch of {global_batch} does not split over dp={dp}"] += 1
                    continue
                yield from _data_parallel(shape, tp, cp, pp, dp, gpus_per_node, seq_len, global_batch // dp,
                                          precision, optimizer, virtual_stages, rejected, kernels or {})  # fmt: skip


def _data_parallel(shape: ModelShape, tp: int, cp: int, pp: int, dp: int, gpus_per_node: int, seq_len: int,
                   per_rank: int, precision: str, optimizer: str, virtual_stages: tuple[int, ...],
                   rejected: Counter[str], kernels: Kernels) -> Iterator[tuple[Layout, RunShape]]:  # fmt: skip
    """The data-parallel splits (FSDP over all, HSDP with a node-wide shard, replicas only) of `dp` ranks,
    each with its ZeRO stages, expert degrees, schedules, micro-batch sizes and AC modes."""
    node_shard = max(1, gpus_per_node // (tp * cp))
    shards = sorted({dp, 1, *([node_shard] if dp % node_shard == 0 else [])})
    plain = tp == cp == pp == 1
    for dp_shard in shards:
        dp_replicate = dp // dp_shard
        if dp_shard > 1:
            stages = (1, 2, 3) if plain and dp_replicate == 1 else (2, 3)
        else:
            stages = (3,)  # one shard: no ZeRO stage applies (the layout's default)
        for zero_stage in stages:
            span = dp_shard * cp * tp
            eps = [1]
            if shape.n_experts:
                eps = [
                    e
                    for e in divisors(span)
                    if shape.n_experts % e == 0 and not (e > 1 and tp > 1 and pp > 1)
                ]
            for ep in eps:
                schedules = [("1f1b", 1)]
                if pp > 1:
                    schedules += [("interleaved_1f1b", v) for v in virtual_stages]
                for schedule, v in schedules:
                    if pp * v > shape.n_layers:
                        rejected[f"pp={pp} x {v} stages per rank exceeds the {shape.n_layers} blocks"] += 1
                        continue
                    for mb in MICRO_BATCHES:  # sequences of each forward-backward pass
                        if per_rank % mb:
                            continue
                        passes = per_rank // mb
                        if pp > 1 and not runs_microbatches(schedule, pp, passes):
                            rejected[f"{passes} micro-batches do not fill pp={pp} ({schedule})"] += 1
                            continue
                        # a pipeline cuts the rank's batch into `passes` micro-batches in one step; without
                        # one the rank accumulates `passes` batches of mb
                        if pp > 1:
                            run, cuts = RunShape(per_rank, seq_len, optimizer), passes
                        else:
                            run, cuts = RunShape(mb, seq_len, optimizer, accumulation=passes), 1
                        for ac in ACTIVATION_CHECKPOINTING:
                            yield Layout(
                                dp_replicate=dp_replicate, dp_shard=dp_shard, tp=tp, pp=pp, cp=cp, ep=ep,
                                zero_stage=zero_stage, sequence_parallel=tp > 1, pp_schedule=schedule,
                                pp_microbatches=cuts, pp_virtual_stages=v if v > 1 else 2, activation_checkpointing=ac,
                                precision=precision, **kernels,
                            ), run  # fmt: skip


def runs_microbatches(schedule: str, pp: int, m: int) -> bool:
    """Whether torch.distributed.pipelining runs `m` micro-batches over `pp` stages: 1F1B needs m >= pp;
    interleaved 1F1B takes any m that splits into rounds of about pp (m % max(1, m // pp) == 0: Llama 3's
    relaxed rule, torch's flexible interleaving)."""
    if schedule == "interleaved_1f1b":
        return m % max(1, m // pp) == 0
    return m >= pp


def default_memory() -> Memory:
    """The per-rank memory model (strategies/plan/memory.py), imported when first needed."""
    from strategies.plan.memory import per_rank_memory

    return per_rank_memory


def search(shape: ModelShape, hardware: Hardware, world: int, seq_len: int, global_batch: int,
           precision: str = "bf16", optimizer: str = "adamw", memory: Memory | None = None,
           keep: Callable[[Layout, RunShape], bool] | None = None,
           virtual_stages: tuple[int, ...] = RUNTIME_VIRTUAL_STAGES, kernels: Kernels | None = None) -> Plan:  # fmt: skip
    """The layouts of `world` ranks on `hardware` that fit its memory, fastest first (see the module's
    docstring); `keep` narrows the layouts tried (e.g. to what a CPU backend runs, or `trainer plan --keep`'s
    pins, the micro-batch among them: hence the RunShape); `virtual_stages` the
    interleaved schedule's stages per rank tried (more than the runtime builds: a what-if, said in `why`);
    `kernels` the Layout's kernel fields every layout takes (fused_kernels: torch.compile, the runtime's
    `compile`; flash_attention). A
    one-line ValueError when none fits, naming what bit: memory (the smallest peak seen), or the
    constraints that left no layout to try."""
    if not 1 <= world <= MAX_WORLD:
        raise ValueError(f"a world of {world:,} GPUs is not planned; allowed: 1 to {MAX_WORLD:,} GPUs")
    memory = memory or default_memory()
    limit = hardware.device.memory_bytes * USABLE_MEMORY
    fits: list[Candidate] = []
    tried = too_big = 0
    smallest = None
    # listing them is cheap (microseconds each); weighing one with the memory and step-time models is not
    rejected: Counter[str] = Counter()
    every = list(layouts(shape, world, hardware.gpus_per_node, seq_len, global_batch, precision, optimizer,
                         virtual_stages, rejected, kernels))  # fmt: skip
    if len(every) > MAX_LAYOUTS:
        raise ValueError(
            f"{len(every):,} layouts of {world:,} GPUs to weigh (global batch {global_batch:,}, {shape.n_layers} "
            f"blocks); allowed: up to {MAX_LAYOUTS:,} (fewer GPUs, or a world and global batch with fewer divisors)"
        )
    for layout, run in every:
        if keep is not None and not keep(layout, run):
            continue
        tried += 1
        peak = float(memory(shape, layout, run).peak)
        if peak > limit:
            too_big += 1
            smallest = peak if smallest is None else min(smallest, peak)
            continue
        fits.append(Candidate(layout, run, peak, step_time(shape, layout, run, hardware)))
    if not fits:
        if not tried:
            bit = "; ".join(f"{why} ({n}x)" for why, n in rejected.most_common(3))
            if every:  # the constraints given (keep) left none of what the rest allowed
                bit = f"{bit}; the {len(every)} layouts left are all outside the constraints given".lstrip(
                    "; "
                )
            raise ValueError(
                f"no layout of {world} GPUs to try for a global batch of {global_batch} sequences of {seq_len}: "
                f"{bit}; allowed: a global batch with more divisors, more sequences per rank, or fewer constraints"
            )
        raise ValueError(
            f"no layout of {world} GPUs fits in {hardware.device.memory_bytes / GB:.0f} GB per GPU (the smallest "
            f"needs {smallest / GB:.1f} GB); allowed: more GPUs, a larger --gpu-memory, or a shorter sequence"
        )
    fits.sort(key=lambda c: (-c.time.tokens_per_s, _complexity(c.layout), _passes(c), c.peak_bytes))
    # within TIE of the fastest the simpler layout wins, then fewer passes a step (each has overheads the
    # model leaves out), then less memory: the model is not that exact, and fewer dimensions fail less
    close = [c for c in fits if c.time.tokens_per_s >= (1 - TIE) * fits[0].time.tokens_per_s]
    winner = min(close, key=lambda c: (_complexity(c.layout), _passes(c), c.peak_bytes))
    fits.remove(winner)
    fits.insert(0, winner)
    ranked = _best_per_layout(fits)
    return Plan(ranked, tried, too_big, why(shape, winner, hardware, world), versus(ranked, hardware, world))


def versus(ranked: list[Candidate], hardware: Hardware, world: int) -> str | None:
    """On more than one node, the fastest layout that decides pipelining across nodes the other way from the
    winner (the practice of Megatron-style recipes, or the lack of it), its predicted speed against the
    winner's and the costs that decide between them; None on one node or when no such layout fits."""
    if world <= hardware.gpus_per_node:
        return None
    # pp is the mesh's outermost dimension: on more than one node, a pipeline's stages are on different nodes
    winner = ranked[0]
    others = [c for c in ranked[1:] if (c.layout.pp > 1) != (winner.layout.pp > 1)]
    if not others:
        return None
    other = others[0]  # ranked: the fastest of them
    ratio = other.time.tokens_per_s / winner.time.tokens_per_s - 1
    fastest = max(c.time.tokens_per_s for c in ranked)
    verdict = f"{ratio:+.0%}"
    if other.time.tokens_per_s >= (1 - TIE) * fastest:  # it lost the tie-break, not on speed
        verdict += f": within {TIE:.0%} of the fastest, a tie, which fewer dimensions, passes and memory win"
    kind = "no pipeline across nodes" if winner.layout.pp > 1 else "pipeline stages across nodes"
    return (
        f"{kind}: {layout_text(other.layout)} predicts {other.time.tokens_per_s:,.0f} tokens/s ({verdict}); "
        f"its step waits {_waits(other)}, the winner's {_waits(winner)}"
    )


def _waits(c: Candidate) -> str:
    """The exposed costs of a candidate's step, largest first: 'pp bubble 0.31s + fsdp 0.015s'."""
    shown = sorted(((s, name) for name, s in c.time.exposed_s.items() if s > 0), reverse=True)
    return " + ".join(f"{name} {s:.2g}s" for s, name in shown) or "on nothing"


def _complexity(layout: Layout) -> int:
    """Ties go to the simpler layout: fewer dimensions in use, no checkpointing."""
    dims = sum(
        d > 1 for d in (layout.tp, layout.pp, layout.cp, layout.ep, layout.dp_replicate, layout.dp_shard)
    )
    return dims * 4 + ACTIVATION_CHECKPOINTING.index(layout.activation_checkpointing)


def _passes(c: Candidate) -> int:
    return c.run.accumulation * c.layout.pp_microbatches


def pass_size(c: Candidate) -> int:
    """Sequences of each forward-backward pass of a rank (a pipeline's micro-batch)."""
    return c.run.micro_batch // c.layout.pp_microbatches


def _best_per_layout(ranked: list[Candidate]) -> list[Candidate]:
    """The best micro-batch and AC mode of each mesh (the table lists meshes, not every knob)."""
    seen, out = set(), []
    for c in ranked:
        L = c.layout
        key = (
            L.dp_replicate,
            L.dp_shard,
            L.tp,
            L.pp,
            L.cp,
            L.ep,
            L.zero_stage,
            L.pp_schedule,
            L.stages_per_rank,
        )
        if key not in seen:
            seen.add(key)
            out.append(c)
    return out


def layout_text(layout: Layout) -> str:
    """'tp=8 x pp=4 (interleaved_1f1b, 16 mb) x fsdp=16 (zero 3), ac full' and the like."""
    L = layout
    parts = []
    if L.tp > 1:
        parts.append(f"tp={L.tp}" + (" sp" if L.sequence_parallel else ""))
    if L.cp > 1:
        parts.append(f"cp={L.cp}")
    if L.ep > 1:
        parts.append(f"ep={L.ep}")
    if L.pp > 1:
        v = f" v{L.stages_per_rank}" if L.stages_per_rank > 1 else ""
        parts.append(f"pp={L.pp} {L.pp_schedule}{v}/{L.pp_microbatches}")
    if L.dp_shard > 1:
        name = "zero1" if L.zero_stage == 1 else f"fsdp z{L.zero_stage}"
        parts.append(f"{name}={L.dp_shard}" + (" per linear" if L.fsdp_unit == "linear" else ""))
    if L.dp_replicate > 1:
        parts.append(
            f"{'ddp' if L.dp_shard == 1 and L.world == L.dp_replicate else 'replicas'}={L.dp_replicate}"
        )
    text = " x ".join(parts) or "single"
    return text + ("" if L.activation_checkpointing == "none" else f", ac {L.activation_checkpointing}")


def why(shape: ModelShape, best: Candidate, hardware: Hardware, world: int) -> str:
    """One line on why the winner: what forced each dimension (memory, the link it sits on) and what
    its step is spent on."""
    L, gpn = best.layout, hardware.gpus_per_node
    params = dense_params(shape) + expert_params(shape)
    # weights + gradients + AdamW in mixed precision: ~16 bytes per parameter (fp32 master, grads, 2 states)
    states = params * 16 / (hardware.device.memory_bytes * USABLE_MEMORY)
    reasons = []
    size = f"{params / 1e9:.1f}B" if params >= 1e9 else f"{params / 1e6:.1f}M"
    state = f"{params * 16 / GB:.0f} GB" if params * 16 >= GB else f"{params * 16 / 1e6:.0f} MB"
    if L.tp > 1:
        reasons.append(
            f"tp={L.tp} inside the node (its per-block all-reduces need NVLink; it splits each block's "
            f"weights and activations {L.tp} ways)"
        )
    if L.pp > 1:
        across = "across nodes" if crosses_nodes(world // L.pp, L.pp, gpn) else "inside the node"
        reasons.append(
            f"pp={L.pp} {across} (stages pass activations only; {L.pp_schedule} over {L.pp_microbatches} "
            f"micro-batches: bubble {best.time.exposed_s.get('pp bubble', 0) / best.time.step_s:.0%})"
        )
    if L.pp > 1 and L.stages_per_rank > 1 and L.stages_per_rank not in RUNTIME_VIRTUAL_STAGES:
        reasons.append(
            f"{L.stages_per_rank} stages per rank is a what-if: the runtime's interleaved schedule builds "
            f"{RUNTIME_VIRTUAL_STAGES[0]}"
        )
    if L.cp > 1:
        across = " across nodes" if crosses_nodes(L.tp, L.cp, gpn) else ""
        reasons.append(f"cp={L.cp}{across} splits the {best.run.seq_len}-token sequence")
    if L.ep > 1:
        reasons.append(f"ep={L.ep} spreads the {shape.n_experts} experts")
    if L.dp_shard > 1:
        rest = "all" if L.dp_shard == world else "the remaining"
        need = "needs sharding" if states > 1 else "fits whole, sharded to save memory for the batch"
        reasons.append(
            f"{'ZeRO-1' if L.zero_stage == 1 else f'FSDP (ZeRO-{L.zero_stage})'} over {rest} {L.dp_shard}: "
            f"the {size} weights' training state ({state}) {need}"
        )
    elif L.dp_replicate > 1:
        reasons.append(f"DDP over {L.dp_replicate}: the {size} model's state fits on one GPU")
    if L.dp_replicate > 1 and L.dp_shard > 1:
        reasons.append(f"replicated {L.dp_replicate} times (HSDP) so the shards' traffic stays in the node")
    if L.activation_checkpointing != "none":
        reasons.append(f"{L.activation_checkpointing} activation checkpointing to fit the activations")
    if not reasons:
        reasons.append(f"one device holds the {size} model")
    cost = best.time.dominant
    share = (best.time.compute_s if cost == "compute" else best.time.exposed_s[cost]) / best.time.step_s
    return "; ".join(reasons) + f"; the step is {share:.0%} {cost}"
