"""No collective per micro-batch: under DDP and FSDP with gradient accumulation, a micro-batch's forward and
backward call none beyond the strategy's own gradient and parameter sync, and an optimizer step calls a
small, stated set (tests/scripts/collective_count_script.py records every Python-level collective)."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
from helpers import SCRIPTS, run_script

pytestmark = pytest.mark.slow

SCRIPT = SCRIPTS / "collective_count_script.py"
ACCUMULATE, LOG_EVERY, SKIP_AT = 3, 4, 2
# rank 1's fake clock moves 2 s per micro-batch, 6 s per step: max_time=50 s is up after step 9 (54 s).
# max_time's agreements (time_limit.py): after step 1 (6 s; half the 44 s left is 3 steps) -> 4 (24 s;
# 13 s: 2 steps) -> 6 (36 s; 7 s: 1 step) -> 7 -> 8 -> 9 (54 s >= 50: stop); rank 0's clock alone (27 s)
# would not stop it
MAX_TIME_S, STOP_STEP, TIME_AGREED_AFTER = 50, 9, {1, 4, 6, 7, 8, 9}
# what only forwards the call to a collective: the reason is the caller above them
PLUMBING = (
    "strategies/collectives.py:",
    "strategies/mesh.py:reduce",
    "strategies/base.py:any_rank",
    "strategies/base.py:every_rank",
    "strategies/base.py:global_norm",
    "strategies/parallel.py:global_norm",
    "strategies/gradients.py:sharded_norm",
)


def reason(owner: str) -> str:
    """The framework function a collective serves: its first caller that is not plumbing."""
    return next((c for c in owner.split(" < ") if not c.startswith(PLUMBING)), owner)


def per_step(events: list[list]) -> list[tuple[list[list[list]], list[list], bool]]:
    """Each optimizer step's (collectives of each micro-batch but the last, collectives of the rest of the
    step up to its stop check, skipped). A micro-batch lasts from its forward to the next one's."""
    starts = [i for i, e in enumerate(events) if e[0] == "step_start"]
    steps = []
    for k, start in enumerate(starts):
        end = starts[k + 1] if k + 1 < len(starts) else None
        if end is None:  # the last step ends at its stop check; what follows is the end of the fit
            step_end = next(i for i in range(start, len(events)) if events[i][0] == "step_end")
            end = next(i for i in range(step_end, len(events)) if events[i][0] == "done") + 1
        segment = events[start:end]
        micro = [i for i, e in enumerate(segment) if e[0] == "micro"]
        assert len(micro) == ACCUMULATE, f"step {k + 1}: {len(micro)} micro-batches"
        inside = [
            [e for e in segment[a:b] if e[0] == "collective"] for a, b in zip(micro, micro[1:], strict=False)
        ]
        rest = [e for e in segment[: micro[0]] + segment[micro[-1] :] if e[0] == "collective"]
        skipped = next(e[2] for e in segment if e[0] == "step_end")
        steps.append((inside, rest, skipped))
    return steps


def expected(strategy: str, step: int, skipped: bool) -> Counter:
    """The framework's collectives of optimizer step `step` (1-based), by the function they serve."""
    # Ctrl-C/SIGTERM: the ranks' agreement, started after each step (on the CPU) and read after the next
    want = Counter({"trainer/loop/stop_signals.py:agreed": 1})
    if strategy == "ddp":  # its module can return None: the ranks agree once, before the gradient sync
        want["strategies/base.py:train_step"] += 1
    if not skipped:
        want["strategies/base.py:finish_gradients"] += 1  # the step's token count (CausalLM's num_tokens)
        if strategy == "fsdp":
            want["strategies/base.py:clip_gradients"] += 1  # the norm over FSDP's gradient shards
        if step % LOG_EVERY == 0:
            want["trainer/loop/step_log.py:log_train"] += 1  # the logged loss, averaged over the ranks
    if step in TIME_AGREED_AFTER:
        want["trainer/loop/stopping.py:_slowest"] += 1  # max_time: the ranks' slowest clock
    return want


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_a_micro_batch_calls_no_collective_beyond_the_strategys_own_sync(tmp_path: Path, strategy: str):
    # DDP: the module's step returns None on rank 1 at step 3's first micro-batch (a rank that skips
    # alone); FSDP: a module that always returns a loss
    skip = ["--skip-at", str(SKIP_AT)] if strategy == "ddp" else []
    args = ["--strategy", strategy, "--devices", "2", "--accumulate", str(ACCUMULATE), "--model", "llama"]
    args += ["--steps", "12", "--global-batch", "24", "--max-time-s", str(MAX_TIME_S), "--log-every"]
    run_script(2, SCRIPT, tmp_path, "run", *args, str(LOG_EVERY), *skip, timeout=240)
    ranks = [json.loads((tmp_path / "run" / f"rank{r}.json").read_text()) for r in range(2)]
    assert ranks[0]["params"] == ranks[1]["params"], "the replicas' parameters differ after the fit"
    fsdp_seen = 0
    for rank, result in enumerate(ranks):
        steps = per_step(result["events"])
        assert len(steps) == STOP_STEP, f"rank {rank} stopped after {len(steps)} steps, not {STOP_STEP}"
        for k, (inside, rest, skipped) in enumerate(steps, start=1):
            assert skipped == (strategy == "ddp" and k == SKIP_AT + 1), (
                f"rank {rank} step {k}: skipped={skipped}"
            )
            for i, calls in enumerate(inside):
                own = [c for c in calls if c[2] != "fsdp"]
                assert not own, f"rank {rank} step {k} micro-batch {i}: {own}"
                fsdp_seen += len(calls)
            got = Counter(reason(c[2]) for c in rest if c[2] != "fsdp")
            assert got == expected(strategy, k, skipped), f"rank {rank} step {k}: {got}"
    if strategy == "fsdp":  # the counter sees the strategy's own collectives: its all-gathers
        assert fsdp_seen > 0
