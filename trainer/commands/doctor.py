"""`trainer doctor`: the collectives of the world it is launched into, measured (trainer/doctor)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def add_parser(sub: argparse._SubParsersAction) -> None:
    """`trainer doctor`: the collectives of the world it runs in, measured."""
    doctor = sub.add_parser(
        "doctor",
        help="measure all-reduce/all-gather/reduce-scatter/all-to-all bus bandwidth of this world",
        description="Launched like a fit (self-spawns --devices processes: gloo on the CPU, NCCL on GPUs; under "
        "torchrun or SLURM it measures the job's world), times each collective per group and message size "
        "and prints busbw as nccl-tests defines it against the link's nominal rate; on GPUs also the NVML "
        "topology, ECC/XID state and the NCCL variables in effect, with hints.",
    )
    doctor.add_argument(
        "--devices", type=int, help="processes on this node (default: every GPU, or 2 on the CPU)"
    )
    doctor.add_argument(
        "--sizes", help="message sizes in bytes, comma-separated: 64K,1M,1G (default per backend)"
    )
    doctor.add_argument("--mesh", help="also measure each dimension of a mesh, e.g. dp_shard=2,tp=2")
    doctor.add_argument(
        "--gpus-per-node",
        type=int,
        help="ranks per node for the intra/inter-node split (default: the launcher's)",
    )
    doctor.add_argument("--warmup", type=int, help="untimed calls per size (default: 2 on gloo, 5 on NCCL)")
    doctor.add_argument("--iters", type=int, help="timed calls per size (default: 5 on gloo, 20 on NCCL)")
    doctor.add_argument(
        "--rounds",
        type=int,
        help="rounds of the tensor-parallel and FSDP host-time measurement, each figure their median (default: 7)",
    )
    doctor.add_argument(
        "--out", type=Path, help="write the rates file (JSON, GB/s) that `trainer plan` reads"
    )


def run(args: argparse.Namespace) -> int:
    from trainer.commands.limits import check_local_processes
    from trainer.doctor.run import DoctorOptions, doctor

    options = DoctorOptions(
        devices=args.devices,
        sizes=args.sizes,
        mesh=args.mesh,
        gpus_per_node=args.gpus_per_node,
        warmup=args.warmup,
        iters=args.iters,
        rounds=args.rounds,
        out=args.out,
    )
    try:
        if args.devices is not None:
            check_local_processes(f"--devices {args.devices}", args.devices)
        report = doctor(options)
    except ValueError as err:
        print(f"trainer: error: {err}", file=sys.stderr)
        return 2
    if report is not None:
        print(report)
    return 0
