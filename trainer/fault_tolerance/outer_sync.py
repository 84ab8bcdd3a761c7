"""DiLoCo across replica groups (Douillard et al. 2023, arXiv 2311.08105): each group takes `sync_every`
optimizer steps on its own; then the groups average their pseudo-gradient (the window's start weights minus
their own) and an outer SGD with Nesterov momentum moves the start weights by it. One cross-group
all-reduce of the parameters per window instead of one of the gradients per step: groups on slow links.

The window's start weights are kept beside the model (one copy of this rank's parameters) and are what the
outer optimizer steps, as plain tensors: sharded (DTensor) parameters need no special case. They and the
outer momentum are part of the training state (`state_dict`): a peer sends them to a rejoining group, and a
checkpoint holds them, so a relaunch from checkpoints continues the window it stopped in (a group of
sharded parameters: a checkpoint holds none, as it holds one rank's state; its relaunch starts a new
window from the checkpoint's weights).

A warm-up (`sync_warmup_steps`, the paper's DiLoCo starting from a data-parallel pretrained model) runs its
first steps as per-step sync (the groups average every step's gradients); the windows follow it.

With the inner Adam's moments averaged at meetings, `combine_second_moment` also sets the second moment to
the combined batch's (that of per-step sync's gradient): each group's v holds its own, smaller batch's
gradient noise, which made its inner steps smaller than per-step sync's where noise dominates."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from trainer.core.dtensors import is_dtensor, local_part


class OuterSync:
    """The outer loop of DiLoCo for one rank: `begin` at a window's start, `sync` after its last step."""

    def __init__(
        self, module: nn.Module, sync_every: int, lr: float, momentum: float, warmup: int = 0
    ) -> None:
        self.sync_every = sync_every
        self.warmup = warmup  # steps 0 .. warmup-1 are per-step sync (a multiple of sync_every)
        self.params = [p for p in module.parameters() if p.requires_grad]
        with torch.no_grad():
            self.start = [local_part(p).detach().clone() for p in self.params]
        self.outer = torch.optim.SGD(self.start, lr=lr, momentum=momentum, nesterov=momentum > 0)
        self.began = False  # this process has a window: until then it joins the quorum at its first step
        # the start weights were loaded (a checkpoint's, a peer's): the next window keeps them
        self.loaded = False
        self.sharded = any(is_dtensor(p) for p in self.params)

    def per_step(self, step: int) -> bool:
        """Whether the step `step` (0-based) is one of the warm-up's: the groups average its gradients."""
        return step < self.warmup

    def starts_window(self, step: int) -> bool:
        """Whether the step `step` (0-based) opens a window (or is this process's first step, or a warm-up
        step: the groups meet before each of those)."""
        return not self.began or self.per_step(step) or step % self.sync_every == 0

    def ends_window(self, step: int) -> bool:
        """Whether the step `step` (0-based, just taken) closes its window."""
        return not self.per_step(step) and (step + 1) % self.sync_every == 0

    def ends_warmup(self, step: int) -> bool:
        """Whether the step `step` (0-based, just taken) is the warm-up's last: the first window starts
        from the weights it leaves."""
        return step + 1 == self.warmup

    def begin(self) -> None:
        """Remember the weights the window starts from (after the quorum: a recovered group's are its peer's),
        unless start weights were loaded: then the window is the saved one (a relaunch inside a window)."""
        if not self.loaded:
            with torch.no_grad():
                torch._foreach_copy_(self.start, [local_part(p).detach() for p in self.params])
        self.began, self.loaded = True, False

    def sync(self, average: Any, should_commit: Any, inner: list[torch.Tensor] | None = None) -> bool:
        """Average the pseudo-gradients with `average` (in place, over the groups), then, when
        `should_commit()` agrees, step the start weights with the outer optimizer; the model takes them
        either way (a discarded window is undone). `inner` (the inner optimizer's state tensors, when the
        groups average them too) is averaged in the same all-reduce and takes the mean on a commit only."""
        local = [local_part(p).detach() for p in self.params]
        inner = inner or []
        with torch.no_grad():
            pseudo = list(torch._foreach_sub(self.start, local))
            # averaged in copies: a failed all-reduce may leave garbage, and the state keeps its own then
            mean = [t.clone() for t in inner]
        average(pseudo + mean)
        committed = bool(should_commit())
        if committed:
            for start, grad in zip(self.start, pseudo, strict=True):
                start.grad = grad
            self.outer.step()
            self.outer.zero_grad(set_to_none=True)
            if inner:
                with torch.no_grad():
                    torch._foreach_copy_(inner, mean)
        with torch.no_grad():
            torch._foreach_copy_(local, self.start)
        return committed

    def state_dict(self) -> dict[str, Any]:
        """The window's start weights (copies: a meeting changes them in place) and the outer momentum."""
        return {"start": [t.clone() for t in self.start], "outer": self.outer.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from `state_dict`'s: the next `begin` keeps these start weights."""
        with torch.no_grad():
            torch._foreach_copy_(self.start, state["start"])
        self.outer.load_state_dict(state["outer"])
        self.loaded = True


def inner_state(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """This rank's part of every floating-point state tensor of `optimizer` shaped like its parameter
    (SGD's momentum, Adam's two moments; not Adam's step count): what the groups average at a meeting
    with `FaultTolerance(sync_optimizer_state=True)`."""
    out = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            for value in optimizer.state.get(p, {}).values():
                if torch.is_tensor(value) and value.is_floating_point() and value.shape == p.shape:
                    out.append(local_part(value))
    return out


def combine_second_moment(optimizer: torch.optim.Optimizer, groups: int) -> None:
    """Set Adam's averaged second moment v to that of the `groups` groups' combined batch (per-step sync's
    gradient), per element m^2 + (v - m^2) / groups, m the averaged first moment: each group's v estimates
    mu^2 + s^2 (its batch's noise s^2), the combined batch's mu^2 + s^2 / groups, and m^2 ~ mu^2 (m's own
    noise is a tenth of s^2 or less). `FaultTolerance(sync_combined_second_moment=True)`, after the moments'
    mean is taken at a meeting."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            state = optimizer.state.get(p, {})
            if not state:
                continue
            if "exp_avg" not in state or "exp_avg_sq" not in state:
                raise ValueError(
                    f"FaultTolerance sync_combined_second_moment=True with {type(optimizer).__name__}; allowed: "
                    "an Adam-family optimizer (state exp_avg, exp_avg_sq)"
                )
            m, v = local_part(state["exp_avg"]), local_part(state["exp_avg_sq"])
            with torch.no_grad():
                signal = m * m
                # v below m^2 (its longer memory lagging a recent rise of the gradient): all signal, m^2
                v.copy_(signal + (v - signal).clamp_(min=0) / groups)
