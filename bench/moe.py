"""Expert parallelism's cost: tokens/s of the tiny MoE Llama on 2 CPU processes with the experts
replicated (ep=1, FSDP over both) and split over the ranks (ep=2, tokens sent to their experts by
all-to-all), and the share of the ep=2 step spent in all-to-all (torch.profiler's time in the
collective, which gloo runs synchronously on the CPU). Same invocation, same data and steps.
`python bench/moe.py` (it starts its second process itself)."""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).parent))
from common import StepClock  # noqa: E402

from strategies import Parallel3DStrategy  # noqa: E402
from trainer import Trainer  # noqa: E402
from trainer.data import PackedDataset, TokenLoader  # noqa: E402
from trainer.models.causal_lm import CausalLM  # noqa: E402
from trainer.models.llama import LlamaConfig  # noqa: E402

STEPS, WARMUP, SEQ, BATCH = 30, 5, 64, 16  # BATCH sequences per process and step
CONFIG = LlamaConfig.preset("moe-tiny", vocab_size=256, max_seq_len=SEQ)


def run(ep: int) -> tuple[float, float]:
    """(tokens/s over both processes, seconds of the profiled steps spent in all-to-all / their time)."""
    torch.manual_seed(0)
    tokens = torch.randint(0, 256, (200_000,))
    loader = TokenLoader(PackedDataset(tokens, SEQ), BATCH, shuffle=True, seed=0)
    clock = StepClock()
    with tempfile.TemporaryDirectory() as root:
        trainer = Trainer(
            strategy=Parallel3DStrategy(ep=ep), devices=2, max_steps=STEPS, enable_progress_bar=False,
            enable_checkpointing=False, enable_model_summary=False, callbacks=[clock], default_root_dir=root,
            log_every_n_steps=STEPS, num_sanity_val_steps=0,
        )  # fmt: skip
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            started = time.perf_counter()
            trainer.fit(CausalLM(CONFIG), loader)
            elapsed = time.perf_counter() - started
    step = statistics.median(
        b - a for a, b in zip(clock.stamps[WARMUP:], clock.stamps[WARMUP + 1 :], strict=False)
    )
    # the backend's own event (gloo:all_to_all) is the exchange itself; c10d's op around it only enqueues
    all_to_all = sum(e.cpu_time_total for e in prof.key_averages() if e.key.endswith(":all_to_all"))
    return 2 * BATCH * SEQ / step, all_to_all / 1e6 / elapsed


def main() -> None:
    torch.set_num_threads(1)
    results = {ep: run(ep) for ep in (1, 2)}
    if torch.distributed.get_rank() == 0:
        (tps1, _), (tps2, share) = results[1], results[2]
        print(f"tiny MoE Llama ({CONFIG.moe.n_experts} experts, top-{CONFIG.moe.top_k}), 2 CPU processes:")
        print(f"  ep=1 (experts replicated): {tps1:8.0f} tokens/s")
        print(f"  ep=2 (experts split)     : {tps2:8.0f} tokens/s ({tps2 / tps1:.2f}x ep=1)")
        print(f"  ep=2 time in all-to-all  : {share:.1%} of the fit")


if __name__ == "__main__":
    main()
