"""`trainer lighthouse`: torchft's coordinator of fault-tolerant replica groups (trainer/fault_tolerance)."""

from __future__ import annotations

import argparse
import sys


def add_parser(sub: argparse._SubParsersAction) -> None:
    """`trainer lighthouse`: torchft's coordinator of fault-tolerant replica groups (trainer/fault_tolerance)."""
    lighthouse = sub.add_parser(
        "lighthouse",
        help="run the lighthouse that fault-tolerant replica groups join (Trainer(fault_tolerance=...))",
        description="Run torchft's lighthouse until SIGINT/SIGTERM; its first line of output is the "
        "address the replica groups join (FaultTolerance(lighthouse=...)).",
    )
    lighthouse.add_argument(
        "--bind", required=True, help="host:port to listen on (port 0: one the system picks)"
    )
    add_quorum_options(lighthouse)


def add_quorum_options(parser: argparse.ArgumentParser) -> None:
    """The lighthouse's quorum options, which `trainer replicas` passes on to the lighthouse it starts."""
    parser.add_argument(
        "--min-replicas", type=int, default=1, help="groups a quorum, and so a step, needs (default 1)"
    )
    parser.add_argument(
        "--heartbeat-timeout-ms",
        type=int,
        default=5000,
        help="a silent group is dead after this (default 5000)",
    )
    parser.add_argument(
        "--join-timeout-ms",
        type=int,
        default=60000,
        help="a quorum waits this long for late groups (default 60000)",
    )


def run(args: argparse.Namespace) -> int:
    from trainer.fault_tolerance.lighthouse import run_lighthouse  # torchft only when asked for

    try:
        return run_lighthouse(args.bind, args.min_replicas, args.heartbeat_timeout_ms, args.join_timeout_ms)
    except (ImportError, ValueError) as err:
        print(f"trainer: error: {err}", file=sys.stderr)
        return 2
