"""One tensor-parallel, sequence-parallel Llama block on 2 gloo ranks, its first input gathered by
GatherKeepingShard (trainer/models/sequence_gather.py) and by torch's PrepareModuleInput: the bytes its
forward leaves alive (what it keeps for the backward, and its output) and its gradients, with bf16 weights
and a bf16 stream as under FSDP's mixed precision. Rank 0 writes {"kept": {how: bytes}, "equal": bool,
"tokens": n, "dim": d} to `--out`."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import PrepareModuleInput, parallelize_module

from trainer.core.memory_peak import PeakBytes
from trainer.models.llama import Llama, LlamaConfig

CONFIG = LlamaConfig(
    vocab_size=64, dim=128, n_layers=1, n_heads=4, n_kv_heads=2, ffn_hidden=256, max_seq_len=128
)
B, T = 2, 128
REPEATS = 12


def run(keep_shard: bool, mesh, rank: int) -> tuple[int, list[torch.Tensor]]:
    torch.manual_seed(0)
    model = Llama(CONFIG)
    plan = {
        k.removeprefix("layers.0."): v
        for k, v in model.tensor_parallel_plan(True, False).items()
        if k.startswith("layers.0.")
    }
    if not keep_shard:
        plan["attention"] = PrepareModuleInput(
            input_layouts=(Shard(1), None, None), desired_input_layouts=(Replicate(), None, None)
        )
        plan["feed_forward"] = PrepareModuleInput(
            input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
        )
    block = parallelize_module(model.layers["0"], mesh, plan).to(torch.bfloat16)
    x = torch.randn(B, T, CONFIG.dim, generator=torch.Generator().manual_seed(1), dtype=torch.bfloat16)
    x = x[:, rank * T // 2 : (rank + 1) * T // 2].clone().requires_grad_()
    cos, sin = (t.to(torch.bfloat16) for t in model.rope(torch.bfloat16))
    # the profiler misses a free now and then (a gathered block the gloo thread lets go of after the window
    # closes, in a third to half of the windows): a miss only adds bytes, so the least of REPEATS forwards
    kept = []
    for _ in range(REPEATS):
        y = None  # the previous forward's graph let go before the next is tracked
        tracker = PeakBytes()
        with tracker.track():
            y = block(x, cos, sin)
        kept.append(tracker.end)
    y.float().pow(2).sum().backward()
    grads = [x.grad] + [p.grad.full_tensor() for p in block.parameters()]
    return min(kept), grads


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    args = p.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (2,))
    kept, grads = {}, {}
    for keep_shard in (True, False):
        kept[keep_shard], grads[keep_shard] = run(keep_shard, mesh, dist.get_rank())
    equal = all(torch.equal(a, b) for a, b in zip(grads[True], grads[False], strict=True))
    if dist.get_rank() == 0:
        out = {"kept": {"shard": kept[True], "gathered": kept[False]}, "equal": equal, "tokens": B * T}
        Path(args.out).write_text(json.dumps({**out, "dim": CONFIG.dim}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
