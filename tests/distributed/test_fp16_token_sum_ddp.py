"""fp16 with a token-weighted loss under 2-process gloo DDP whose ranks count different tokens (3000 and 1000 a
batch): the scaler starts lower by the power of two from the largest count on every rank alike (from its own,
rank 1 would start 4x higher and unscale the average DDP took of both ranks' differently scaled gradients by
its own scale: the ranks' weights would part), and no step is skipped (at the usual 2**16 the first ~11 were)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed as dist
from helpers import TokenCounted, call_ranks, fit, join_world, regression_loader

from strategies import DDPStrategy

WORLD, STEPS, TOKENS = 2, 6, (3000, 1000)


def _rank(rank: int, port: int, root: str) -> None:
    join_world(rank, WORLD, port)
    torch.manual_seed(0)
    module = TokenCounted(TOKENS[rank])
    trainer = fit(module, regression_loader(8), Path(root) / "run", STEPS, precision="16-mixed",
                  strategy=DDPStrategy(), enable_checkpointing=False)  # fmt: skip
    got = {
        "params": [p.detach().flatten().tolist() for p in module.parameters()],
        "skipped": trainer.state.skipped_steps,
        "scale": trainer.strategy.precision.scaler.get_scale(),
    }
    (Path(root) / f"{rank}.json").write_text(json.dumps(got))


def test_ranks_counting_different_tokens_start_at_one_scale_and_skip_nothing(tmp_path):
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)  # bound on a port it picks
    call_ranks(_rank, WORLD, store.port, str(tmp_path))
    got = [json.loads((tmp_path / f"{rank}.json").read_text()) for rank in range(WORLD)]
    assert [g["scale"] for g in got] == [2.0**16 / 2**12] * WORLD  # 3000 -> 2**12
    assert [g["skipped"] for g in got] == [0] * WORLD
    assert got[0]["params"] == got[1]["params"], "the ranks' weights parted"
