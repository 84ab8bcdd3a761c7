"""`trainer replicas`: N fault-tolerant replica groups on this machine, each a torchrun job with restarts,
under a lighthouse of their own (trainer/fault_tolerance/launch.py)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from trainer.commands.lighthouse import add_quorum_options
from trainer.commands.limits import check_local_processes
from trainer.config import ConfigError, load_recipe

if TYPE_CHECKING:
    from trainer.fault_tolerance.launch import Launch

EPILOG = """A recipe runs as `trainer fit RECIPE [overrides] [--ckpt-path ...]` (default --ckpt-path last:
a restarted group resumes from its own checkpoints, then takes the live state) in every group, with
fault_tolerance.{lighthouse,replica_id,replicas,min_replicas,bind} set and the run folder
trainer.default_root_dir/replica_I. A script runs as `torchrun ... SCRIPT [args]`; its Trainer takes
fault_tolerance=FaultTolerance.from_env(), which reads TORCHFT_LIGHTHOUSE, REPLICA_GROUP_ID,
NUM_REPLICA_GROUPS, TRAINER_FT_MIN_REPLICAS and TRAINER_FT_BIND.

examples:
  trainer replicas --groups 2 --max-restarts 3 recipes/llama_tiny.yaml trainer.max_steps=200
  trainer replicas --groups 4 --nproc-per-group 2 --min-replicas 2 train.py --lr 1e-3
"""


def add_parser(sub: argparse._SubParsersAction) -> None:
    """`trainer replicas`: the arguments of a local fault-tolerant job."""
    cmd = sub.add_parser(
        "replicas",
        help="run N fault-tolerant replica groups here, each a torchrun job with restarts (tests, demos)",
        description="Start a lighthouse on --bind and one `torchrun --standalone` job per replica group; "
        "prefix each group's output, forward SIGINT/SIGTERM, exit non-zero naming a group that failed for good.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    cmd.add_argument("--groups", type=int, required=True, help="replica groups (>= 1)")
    cmd.add_argument("--nproc-per-group", type=int, default=1, help="processes per group (default 1)")
    cmd.add_argument("--max-restarts", type=int, default=3, help="torchrun restarts per group (default 3)")
    cmd.add_argument("--bind", default="127.0.0.1", help="address of the lighthouse and the groups' servers")
    add_quorum_options(cmd)
    cmd.add_argument("target", help="a recipe (.yaml) or a Python script (.py)")
    cmd.add_argument(
        "args", nargs=argparse.REMAINDER, help="the recipe's overrides and options, or the script's"
    )


def run(args: argparse.Namespace) -> int:
    from trainer.fault_tolerance.launch import Launch, run_replica_groups  # torchft only when asked for

    try:
        launch = Launch(
            groups=args.groups,
            nproc_per_group=args.nproc_per_group,
            max_restarts=args.max_restarts,
            min_replicas=args.min_replicas,
            bind=args.bind,
            heartbeat_timeout_ms=args.heartbeat_timeout_ms,
            join_timeout_ms=args.join_timeout_ms,
        )
        check_local_processes(f"--groups {launch.groups} x --nproc-per-group {launch.nproc_per_group}",
                              launch.groups * launch.nproc_per_group)  # fmt: skip
        entry = group_entry(Path(args.target), args.args, launch)
        return run_replica_groups(launch, entry)
    except (ImportError, ValueError, ConfigError) as err:
        print(f"trainer: error: {err}", file=sys.stderr)
        return 2


def group_entry(target: Path, rest: list[str], launch: Launch) -> Callable[[int, str], list[str]]:
    """What follows torchrun's options in group I (given the lighthouse's address): the recipe's `trainer fit`
    with this group's settings, or the script as given (it reads them from the environment)."""
    if target.suffix == ".py":
        if not target.is_file():
            raise ValueError(f"replicas script '{target}' does not exist; allowed: a Python file")
        return lambda replica, lighthouse: [str(target), *rest]
    if target.suffix not in (".yaml", ".yml"):
        raise ValueError(f"replicas target '{target}'; allowed: a recipe (.yaml) or a Python script (.py)")
    overrides = [item for item in rest if "=" in item and not item.startswith("-")]
    # resume or start: a group torchrun restarts continues in its own run folder, then heals to the live step
    resume = [] if any(item.split("=")[0] == "--ckpt-path" for item in rest) else ["--ckpt-path", "last"]

    def settings(replica: int, lighthouse: str) -> list[str]:
        ft = {"lighthouse": lighthouse, "replica_id": replica, "replicas": launch.groups,
              "min_replicas": launch.min_replicas, "bind": launch.bind}  # fmt: skip
        return [f"fault_tolerance.{key}={value}" for key, value in ft.items()]

    # checked before starting, as group 0 will load it (the lighthouse's port is not known yet)
    config = load_recipe(target, [*overrides, *settings(0, f"{launch.bind}:1")])
    root = config["trainer"].get("default_root_dir") or "runs"

    def recipe(replica: int, lighthouse: str) -> list[str]:
        return ["-m", "trainer.cli", "fit", str(target), *rest, *resume, *settings(replica, lighthouse),
                f"trainer.default_root_dir={Path(root) / f'replica_{replica}'}"]  # fmt: skip

    return recipe
