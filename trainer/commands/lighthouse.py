"""`trainer lighthouse`: torchft's coordinator of fault-tolerant replica groups (trainer/fault_tolerance)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

from trainer.fault_tolerance.config import HEARTBEAT_INTERVAL_MS, HEARTBEAT_TIMEOUT_MS


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
        "--min-replicas",
        type=bounded_int(1, MAX_REPLICAS),
        default=1,
        help="groups a quorum, and so a step, needs (default 1)",
    )
    parser.add_argument(
        "--heartbeat-timeout-ms",
        type=bounded_int(1, DAY_MS),
        default=HEARTBEAT_TIMEOUT_MS,
        help=f"a silent group is dead after this: the survivors' stall after a crash (default "
        f"{HEARTBEAT_TIMEOUT_MS}; groups heartbeat every {HEARTBEAT_INTERVAL_MS})",
    )
    parser.add_argument(
        "--join-timeout-ms",
        type=bounded_int(1, DAY_MS),
        default=60000,
        help="a quorum waits this long for late groups (default 60000)",
    )


MAX_REPLICAS = 100_000  # replica groups of one job: the largest runs have hundreds
DAY_MS = 86_400_000  # a timeout beyond a day is a typo; torchft's counters overflow far beyond it


def bounded_int(least: int, most: int) -> Callable[[str], int]:
    """An argparse type: an int from `least` to `most`, else argparse's one-line error saying so."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or not least <= value <= most:
            raise argparse.ArgumentTypeError(f"{text!r} is invalid; allowed: an int from {least} to {most}")
        return value

    return parse


def run(args: argparse.Namespace) -> int:
    from trainer.fault_tolerance.lighthouse import run_lighthouse  # torchft only when asked for

    try:
        return run_lighthouse(args.bind, args.min_replicas, args.heartbeat_timeout_ms, args.join_timeout_ms)
    except (ImportError, ValueError) as err:
        print(f"trainer: error: {err}", file=sys.stderr)
        return 2
