"""Build the 8B Llama on meta, shard it with FSDP over the ranks of this job and report each rank's
shard shapes and bytes, without allocating the model (run with a self-spawn: --devices N)."""

from __future__ import annotations

import json
import resource
import sys
from pathlib import Path

import torch

from strategies import FSDPStrategy
from trainer.models.llama import Llama, LlamaConfig
from trainer.precision import Precision


def report(strategy: FSDPStrategy, out: Path) -> None:
    strategy.setup_environment()
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with strategy.module_init_context():
        model = Llama(LlamaConfig.preset("8b"))
    strategy.shard(model)
    shards = {name: list(p.to_local().shape) for name, p in model.named_parameters()}
    local = sum(p.to_local().numel() for p in model.parameters())
    grown_mb = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before) / 1024
    Path(out, f"rank{strategy.global_rank}.json").write_text(
        json.dumps(
            {
                "shards": shards,
                "local_numel": local,
                "meta": all(p.is_meta for p in model.parameters()),
                "rss_mb": grown_mb,
            }
        )
    )


if __name__ == "__main__":
    torch.set_num_threads(1)
    strategy = FSDPStrategy(zero_stage=3)
    strategy.configure("cpu", int(sys.argv[1]), 1, Precision("32"))
    strategy.launch(report, strategy, Path(sys.argv[2]))
