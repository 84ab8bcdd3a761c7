"""DDP's own knobs, as a user's script sets them: `python tests/scripts/ddp_script.py --devices N ...`
(self-spawning) or under torchrun, on one node or several (--num-nodes), with gradient compression
(--compression) and a count of the gradient all-reduces per step (--count-allreduces). Rank 0 writes the
final parameters to --out (see dist_common)."""

from __future__ import annotations

import argparse

from dist_common import TIMEOUT_S, parse_runs, parser, train

from callbacks import Callback
from strategies import DDPStrategy


class AllReduceCounter(Callback):
    """DDP's gradient all-reduces (one per bucket) in each optimizer step, counted by a comm hook that
    then does DDP's own all-reduce."""

    def __init__(self) -> None:
        self.per_step: list[int] = []
        self._count = 0

    def on_fit_start(self, trainer, module):
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        def counting(group, bucket):
            self._count += 1
            return allreduce_hook(group, bucket)

        trainer.strategy.model.register_comm_hook(trainer.strategy.dp_group, counting)

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.per_step.append(self._count)
        self._count = 0


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--num-nodes", type=int, default=1)
    p.add_argument("--compression", default=None)  # DDPStrategy(gradient_compression=...)
    p.add_argument("--count-allreduces", action="store_true")  # DDP's gradient all-reduces per step
    p.add_argument("--trainer-ac", default=None)  # the Trainer's activation_checkpointing flag
    for a in parse_runs(p):
        fit(a)


def fit(a: argparse.Namespace) -> None:
    """One run of this script: the strategy its flags describe, trained and reported (dist_common.train)."""
    strategy = DDPStrategy(gradient_compression=a.compression, powersgd_start_iter=2, timeout_s=TIMEOUT_S)
    allreduces = AllReduceCounter()
    train(
        a,
        strategy,
        [allreduces] if a.count_allreduces else [],
        num_nodes=a.num_nodes,
        activation_checkpointing=a.trainer_ac,
        results=lambda: {"allreduces": allreduces.per_step},
    )


if __name__ == "__main__":
    main()
