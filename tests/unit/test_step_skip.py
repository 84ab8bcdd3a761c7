"""When the ranks agree on a training_step that returned None (strategies/step_skip.py, Strategy.train_step):
read from the step's code, declared by the module, and how often a two-rank strategy agrees per window."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from strategies.base import Strategy
from strategies.step_skip import may_return_none


class Step(nn.Module):
    """A linear model whose step returns the mean output, or None for the batch indices in `skip`."""

    def __init__(self, skip: tuple[int, ...] = ()) -> None:
        super().__init__()
        self.layer, self.skip = nn.Linear(2, 1), skip

    def training_step(self, batch, batch_idx):
        return self.layer(batch).mean()


class ExplicitNone(Step):
    def training_step(self, batch, batch_idx):
        if batch_idx in self.skip:
            return None
        return self.layer(batch).mean()


class BareReturn(Step):
    def training_step(self, batch, batch_idx):
        if batch_idx in self.skip:
            return
        return self.layer(batch).mean()


class FallsOffTheEnd(Step):
    def training_step(self, batch, batch_idx):
        if batch_idx not in self.skip:
            return self.layer(batch).mean()


class NoneThroughAVariable(Step):
    def training_step(self, batch, batch_idx):
        loss = None if batch_idx in self.skip else self.layer(batch).mean()
        return loss


class Declared(NoneThroughAVariable):
    training_step_may_return_none = True


class DeclaredNever(ExplicitNone):
    training_step_may_return_none = False


@pytest.mark.parametrize(
    ("module", "can"),
    [
        (Step, False),
        (ExplicitNone, True),
        (BareReturn, True),
        (FallsOffTheEnd, True),
        (NoneThroughAVariable, False),
        (Declared, True),
        (DeclaredNever, False),
    ],
)
def test_whether_a_step_can_return_none_is_read_from_its_code_or_its_declaration(module, can):
    assert may_return_none(module()) is can


class TwoRanks(Strategy):
    """Two ranks as this one sees them: `any_rank` records each agreement and ORs in the other rank's
    flags, `others` (one per agreement, False when not given)."""

    def __init__(self, locally: bool, others: tuple[bool, ...] = ()) -> None:
        super().__init__()
        self.locally, self.others, self.agreements = locally, list(others), 0

    @property
    def world_size(self) -> int:
        return 2

    def accumulates_locally(self) -> bool:
        return self.locally

    def any_rank(self, flag: bool) -> bool:
        self.agreements += 1
        return flag or (self.others.pop(0) if self.others else False)


def window(n: int = 3) -> list[torch.Tensor]:
    return [torch.ones(2, 2) * (i + 1) for i in range(n)]


@pytest.mark.parametrize("locally", [True, False])
def test_a_step_that_always_returns_a_loss_is_never_agreed_on(locally):
    strategy = TwoRanks(locally)
    out = strategy.train_step(Step(), window(), 0)
    assert out is not None and strategy.agreements == 0


@pytest.mark.parametrize(("locally", "agreements"), [(True, 1), (False, 3)])
def test_a_step_that_can_return_none_is_agreed_on_before_each_backward_that_communicates(locally, agreements):
    strategy = TwoRanks(locally)
    module = ExplicitNone()
    out = strategy.train_step(module, window(), 0)
    assert out is not None and strategy.agreements == agreements
    assert module.layer.weight.grad is not None


def test_a_rank_that_skips_alone_leaves_out_its_local_backwards_and_the_step_is_skipped():
    strategy = TwoRanks(locally=True)
    module = ExplicitNone(skip=(0,))
    assert strategy.train_step(module, window(), 0) is None
    assert strategy.agreements == 1 and module.layer.weight.grad is None


def test_another_ranks_none_skips_the_step_here_before_the_synced_backward():
    strategy = TwoRanks(locally=True, others=(True,))
    module = ExplicitNone()
    assert strategy.train_step(module, window(), 0) is None
    # the two local backwards ran (no collective in them); the synced one did not
    assert strategy.agreements == 1 and module.layer.weight.grad is not None


def test_a_none_the_code_does_not_show_is_a_one_line_error_with_several_ranks():
    with pytest.raises(
        ValueError, match=r"NoneThroughAVariable.training_step returned None on rank 0.*allowed: "
    ):
        TwoRanks(locally=True).train_step(NoneThroughAVariable(skip=(1,)), window(), 0)


def test_in_one_process_a_none_skips_the_step_without_reading_the_code():
    module = NoneThroughAVariable(skip=(1,))
    assert Strategy().train_step(module, window(), 0) is None
