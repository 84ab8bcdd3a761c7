"""`trainer plan ... --goodput`: the effective training time of the planned layout under failures, at the
planned GPUs, at Llama 3's 16,384 and at the seed's 100,000, for restart-from-checkpoint, live recovery
(torchft replica groups) and live recovery with hot spares (strategies/plan/goodput.py), with the
assumptions it rests on."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from strategies.plan.goodput import Costs
    from strategies.plan.hardware import Hardware
    from strategies.plan.search import Candidate
    from trainer.config.plan_inputs import PlanInputs

# this project's measurements (`python bench/fault_tolerance.py --rounds 3`, issue #53): the survivor's
# stall at a loss (0.5 s since the lighthouse times heartbeats out at 500 ms), a relaunched group's rejoin
# (2.2-2.7 s over five drills, `--rounds 0`, 1.2 s of it the process's start-up; it read 3.7 s before), and
# what a step costs beyond plain DDP's whatever its length, at width 1024: what is left of the quorum's wait
# once it forms during the step's data and forward (0.16-0.20 ms; it was a 2.6-3.1 ms round trip before the
# forward), the commit vote (0.3 ms) and the step-start copy of what a rejoining peer is sent (0.05 ms). The
# gradients' average across the groups is not in it: it overlaps the backward in DDP's buckets and is the
# planned layout's own all-reduce, in its step time.
MEASURED_STALL_S, MEASURED_REJOIN_S, MEASURED_STEP_MS = 0.5, 2.3, 0.55
RESTART_MIN = 10.0  # a job's relaunch (assumed: Llama 3 gives no figure; see the assumptions printed)
SCALES = (16_384, 100_000)  # Llama 3's run, the seed's


def _number(low: float, high: float = math.inf) -> Callable[[str], float]:
    """An argparse type: a finite number in [low, high], else one line naming what is allowed."""
    allowed = f"a finite number >= {low:g}" + (f" and <= {high:g}" if high < math.inf else "")

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not (math.isfinite(value) and low <= value <= high):
            raise argparse.ArgumentTypeError(f"{text!r} is invalid; allowed: {allowed}")
        return value

    return parse


def _count(text: str) -> int:
    """An argparse type: an int >= 1, else one line."""
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is invalid; allowed: an int >= 1")
    return int(text)


class _ProjectionInput(argparse.Action):
    """One of the projection's inputs: given, it asks for the projection (a flag nothing reads would be
    silent)."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:  # fmt: skip
        setattr(namespace, self.dest, values)
        namespace.goodput = True


def add_arguments(cmd: argparse.ArgumentParser) -> None:
    """The --goodput flag and the model's inputs (each implies --goodput), with its default and where it
    comes from."""
    cmd.add_argument("--goodput", action="store_true",
                     help="print the effective training time under failures: restart-from-checkpoint, live "
                          "recovery and live recovery with hot spares, at --gpus, 16,384 and 100,000 GPUs")  # fmt: skip
    cmd.add_argument("--restart-min", action=_ProjectionInput, type=_number(0), default=RESTART_MIN,
                     help=f"minutes to relaunch the job after a failure, the checkpoint's read apart (default {RESTART_MIN:g})")  # fmt: skip
    cmd.add_argument("--replace-min", action=_ProjectionInput, type=_number(0), default=None,
                     help="minutes a lost replica group waits for a replacement node (default: --restart-min)")  # fmt: skip
    cmd.add_argument("--ft-stall-s", action=_ProjectionInput, type=_number(0), default=MEASURED_STALL_S,
                     help=f"seconds the surviving groups stall at a loss (default {MEASURED_STALL_S:g}, measured)")  # fmt: skip
    cmd.add_argument("--ft-rejoin-s", action=_ProjectionInput, type=_number(0), default=MEASURED_REJOIN_S,
                     help=f"seconds a relaunched group takes to rejoin (default {MEASURED_REJOIN_S:g}, measured)")  # fmt: skip
    cmd.add_argument("--ft-step-ms", action=_ProjectionInput, type=_number(0), default=MEASURED_STEP_MS,
                     help=f"milliseconds a live-recovery step costs beyond a plain one: quorum and commit vote "
                          f"(default {MEASURED_STEP_MS:g}, measured)")  # fmt: skip
    cmd.add_argument("--ft-step-ratio", action=_ProjectionInput, type=_number(1), default=None,
                     help="a live-recovery step over a plain one, instead of --ft-step-ms (default: 1 + "
                          "--ft-step-ms over the planned step)")  # fmt: skip
    cmd.add_argument("--group-gpus", action=_ProjectionInput, type=_count, default=None,
                     help="GPUs of a replica group (default: the smallest replica of the plan that fits)")  # fmt: skip
    cmd.add_argument("--job-wide", action=_ProjectionInput, type=_number(0, 1), default=0.0,
                     help="the share of failures that take every replica group (default 0)")  # fmt: skip


def goodput_lines(
    args: argparse.Namespace, best: Candidate, inputs: PlanInputs, hardware: Hardware
) -> list[str]:
    """The projection's table (planned GPUs, 16,384, 100,000 at Llama 3's rate and the seed's), the per-step
    cost at which live recovery stops paying, and the assumptions."""
    from strategies.plan.checkpoint_interval import (
        LLAMA3_DAYS,
        LLAMA3_GPUS,
        LLAMA3_INTERRUPTIONS,
        llama3_mtbf_s,
    )
    from strategies.plan.goodput import LLAMA3_UNEXPECTED, SEED_GPUS, SEED_MTBF_S, seed_mtbf_s
    from strategies.plan.hardware import GB
    from strategies.plan.replica_group import checkpoint_bytes, smallest_group

    state = checkpoint_bytes(inputs.shape, best.layout, best.run)
    group = args.group_gpus or smallest_group(
        inputs.shape, best.layout, best.run, hardware.device.memory_bytes, args.gpus_per_node
    )
    given = args.mtbf_hours is not None
    planned = [] if args.gpus in SCALES and not given else [
        (args.gpus, args.mtbf_hours * 3600 if given else llama3_mtbf_s(args.gpus), "given" if given else "Llama 3's rate")
    ]  # fmt: skip
    rows = [
        *planned,
        *((n, llama3_mtbf_s(n), "Llama 3's rate") for n in SCALES),
        (SEED_GPUS, seed_mtbf_s(SEED_GPUS), "the seed's"),
    ]
    lines = [
        f"goodput (effective training time: the share of wall time whose training is kept), step {best.time.step_s:.2f}s, "
        f"checkpoint {state / GB:,.0f} GB, replica groups of {group} GPUs:",
        f"  {'GPUs':>8} {'groups':>7} {'MTBF':>8}  {'failures':<15} {'ckpt every':>10} {'restart':>8} {'live':>6} {'spares':>7}",
    ]
    for gpus, mtbf, source in rows:
        costs = _costs(args, best.time.step_s, state, gpus, group)
        lines.append(_row(gpus, mtbf, source, costs))
    at = _costs(args, best.time.step_s, state, SCALES[0], group)
    lines.append(_break_even(at, llama3_mtbf_s(SCALES[0]), at.step_ratio))
    replace = "--restart-min" if args.replace_min is None else f"{args.replace_min:g} min"
    lines += [
        "assumptions:",
        f"  failures: Llama 3 405B's pre-training, {LLAMA3_INTERRUPTIONS} interruptions ({LLAMA3_UNEXPECTED} unexpected) in {LLAMA3_DAYS} "
        f"days on {LLAMA3_GPUS:,} H100s (Dubey et al. 2024, 'The Llama 3 Herd of Models', section 3.3.4), independent "
        f"per GPU: a job's MTBF falls as 1/GPUs; the seed's: one every {SEED_MTBF_S / 60:.0f} min at {SEED_GPUS:,} GPUs",
        f"  restart: relaunch {args.restart_min:g} min (assumed: Llama 3 reports > 90% effective time, no restart "
        "figure), the checkpoint read back at the write rate, half an interval redone; checkpoints at Young/Daly's "
        f"sqrt(2 C MTBF), C = one copy of the training state (fp32 weights and optimizer state, the memory model) "
        f"written by every node at {args.storage_gbps:g} GB/s (Llama 3's storage: 2 TB/s sustained)",
        f"  live recovery: survivors stall {args.ft_stall_s:g}s and drop the step in flight; the lost group's share "
        f"waits for a replacement node ({replace}) and its rejoin ({args.ft_rejoin_s:g}s); every step costs "
        f"{_step_cost(args, at.step_s)}; the share of failures that take every group (and restart): {args.job_wide:g}",
        "  the groups' gradient average runs where the planned layout's all-reduce does (NCCL's speed, overlapping "
        "the backward); over gloo it costs more (Clockwork's blog, 2025: TorchTitan on 64 H200s, a failure every "
        "45-75 min, reached 3,000 steps in 930 min with torchft and 818 with checkpoint restarts, the cost they "
        "name torchft's gloo all-reduce)",
        "  hot spares: a spare node is waiting, the group rejoins at once; the step time is the planned layout's "
        "at every scale (weak scaling: more replica groups, a larger global batch); first order (Young 1974)",
    ]
    return lines


def _costs(args: argparse.Namespace, step_s: float, state: float, gpus: int, group: int) -> Costs:
    """The model's inputs at `gpus`: the save and the read over every node's storage rate, the flags'."""
    from strategies.plan.goodput import Costs

    nodes = max(1, -(-gpus // args.gpus_per_node))
    save = state / (args.storage_gbps * 1e9 * nodes)
    restart = args.restart_min * 60
    replace = restart if args.replace_min is None else args.replace_min * 60
    return Costs(
        step_s=step_s, save_s=save, restore_s=save, restart_s=restart, stall_s=args.ft_stall_s,
        rejoin_s=args.ft_rejoin_s, replace_s=replace, step_ratio=_step_ratio(args, step_s),
        groups=max(1, gpus // group), job_wide=args.job_wide,
    )  # fmt: skip


def _step_ratio(args: argparse.Namespace, step_s: float) -> float:
    """A live-recovery step over a plain one: `--ft-step-ratio` when given, else the planned step plus the
    fixed per-step cost (`--ft-step-ms`) over the planned step."""
    if args.ft_step_ratio is not None:
        return args.ft_step_ratio
    return 1.0 + args.ft_step_ms / 1e3 / step_s


def _step_cost(args: argparse.Namespace, step_s: float) -> str:
    """The per-step cost as the assumptions say it."""
    if args.ft_step_ratio is not None:
        return f"{args.ft_step_ratio:g}x (given)"
    return (
        f"{args.ft_step_ms:g} ms more (the quorum's wait left after the forward, the commit vote and the "
        "step-start copy of what a rejoining peer is sent, measured), "
        f"{_step_ratio(args, step_s):.4f}x of the planned {step_s:.2f}s step"
    )


def _row(gpus: int, mtbf: float, source: str, costs: Costs) -> str:
    """One row of the table: the three ways' goodput at `gpus` ('-' for live recovery of one group)."""
    from strategies.plan.goodput import checkpoint_every_s, live_goodput, restart_goodput

    every = checkpoint_every_s(costs, mtbf)
    if costs.groups >= 2:
        live, spares = f"{live_goodput(costs, mtbf):.1%}", f"{live_goodput(costs, mtbf, spares=True):.1%}"
    else:
        live = spares = "-"  # one group: no survivor to recover from
    return (
        f"  {gpus:>8,} {costs.groups:>7,} {_duration(mtbf):>8}  {source:<15} {_duration(every):>10} "
        f"{restart_goodput(costs, mtbf):>8.1%} {live:>6} {spares:>7}"
    )


def _break_even(costs: Costs, mtbf: float, ratio: float) -> str:
    """The per-step costs under which live recovery beats restart, and reaches 95%."""
    from strategies.plan.goodput import break_even_ratio, restart_goodput

    if costs.groups < 2:
        return f"at {SCALES[0]:,} GPUs: one replica group, no live recovery"
    beats = break_even_ratio(costs, mtbf, restart_goodput(costs, mtbf))
    high = break_even_ratio(costs, mtbf, 0.95)
    if beats < 1:
        return f"at {SCALES[0]:,} GPUs live recovery loses to restart even at no per-step cost"
    reaches = f"reaches 95% under {high:.3f}x" if high >= 1 else "never reaches 95%"
    return (
        f"at {SCALES[0]:,} GPUs live recovery beats restart while its step costs under {beats:.3f}x a plain "
        f"step's, and {reaches} (this projection's: {ratio:.4f}x; issue #53's target: 1.02x)"
    )


def _duration(seconds: float) -> str:
    """Seconds as s, min or h, whichever reads best (one word: a table cell)."""
    if seconds < 120:
        return f"{seconds:.0f}s"
    if seconds < 7200:
        return f"{seconds / 60:.0f}min"
    return f"{seconds / 3600:.1f}h"
