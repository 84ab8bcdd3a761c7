"""Build a Llama on meta and shard it with FSDP over this job's ranks (self-spawned: `script OUT --devices
N`). Default: the 8B preset, reporting each rank's shard shapes without allocating the model. With a preset
name after OUT: materialise it and say whether it equals an unsharded build with the same seed."""

from __future__ import annotations

import argparse
import json
import resource
from pathlib import Path

import torch

from strategies import FSDPStrategy
from trainer.core.precision import Precision
from trainer.models.llama import Llama, LlamaConfig


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


def materialized_equals_unsharded(strategy: FSDPStrategy, out: Path, preset: str) -> None:
    from strategies.meta_init import materialize

    strategy.setup_environment()
    config = LlamaConfig.preset(preset, vocab_size=512)
    torch.manual_seed(7)
    with strategy.module_init_context():
        model = Llama(config)
    strategy.shard(model)
    materialize(model, strategy.root_device)
    full = [p.full_tensor() for p in model.parameters()]
    torch.manual_seed(7)
    reference = Llama(config)  # built directly on the CPU, unsharded
    equal = all(torch.equal(a, b) for a, b in zip(full, reference.parameters(), strict=True))
    Path(out, f"rank{strategy.global_rank}.json").write_text(
        json.dumps({"equal": equal, "tensors": len(full)})
    )


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", type=Path)
    p.add_argument("preset", nargs="?", default=None)  # materialise this preset and compare (default: report)
    p.add_argument("--devices", type=int, required=True)
    a = p.parse_args()
    torch.set_num_threads(1)
    strategy = FSDPStrategy(zero_stage=3)
    strategy.configure("cpu", a.devices, 1, Precision("32"))
    if a.preset is not None:
        strategy.launch(materialized_equals_unsharded, strategy, a.out, a.preset)
    else:
        strategy.launch(report, strategy, a.out)
