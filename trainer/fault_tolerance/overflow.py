"""fp16's loss scaler across replica groups: every group skips a step whose average holds an inf or nan (a
peer's overflow), as one process would, and lowers its scale alike."""

from __future__ import annotations

from typing import Any

import torch

# groups of one process check the average up to this many gradient elements: a pass over 1M fp32 (their sum)
# takes 0.15-0.6 ms here (in cache or not), the overflow flags' own sum over the groups after the last
# bucket's ~0.5 ms a step (bench/fault_tolerance.py --configs fp16: torchft's fixed cost at width 256, 1.1 ms
# with it, 0.5-0.6 ms with the pass)
PASS_ELEMENTS = 1 << 20


def check_the_average(scaler: torch.amp.GradScaler, optimizer: Any, grads: list[torch.Tensor]) -> None:
    """fp16: the scaler checked this group's own gradients for inf/nan when it unscaled them; a peer's inf
    is in the average (`grads`: its gradients, or the buckets holding them). Every group takes the check of
    the average (an inf anywhere: every group skips the step and lowers its scale), not its own (a group
    whose own were finite would apply the inf)."""
    # a sum is inf/nan where an element is (or past 3e38, no gradient a step keeps): one read of each
    # gradient, where isfinite's compare-abs-compare took ~15x as long
    if not grads or torch.stack([g.sum() for g in grads]).isfinite().all():
        return
    for flag in found_inf(scaler, optimizer):
        flag.fill_(1.0)


def found_inf(scaler: torch.amp.GradScaler, optimizer: Any) -> list[torch.Tensor]:
    """The inf checks (1.0: found) `unscale_` recorded for `optimizer`'s next `step`, one per device: torch
    has no public way to read or add to them."""
    return list(scaler._per_optimizer_states[id(optimizer)]["found_inf_per_device"].values())
