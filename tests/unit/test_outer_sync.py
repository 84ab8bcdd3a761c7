"""DiLoCo's outer step (trainer/fault_tolerance/outer_sync.py) on a quadratic whose trajectory is known in
closed form: each group's inner SGD shrinks w by a known factor per window, so the averaged pseudo-gradient
and the outer Nesterov SGD can be followed with plain floats."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from trainer.fault_tolerance.outer_sync import OuterSync, combine_second_moment, inner_state

K, INNER_LR = 8, 0.05
CURVATURES = (1.0, 3.0)  # group 0 (this process) and group 1 (its pseudo-gradient computed in closed form)


def expected(w0: float, outer_lr: float, momentum: float, windows: int) -> list[float]:
    """The start weight after each window: group g's k SGD steps on a*w^2/2 take w to (1 - lr*a)^k * w, so its
    pseudo-gradient is (1 - (1 - lr*a)^k) * w; their mean steps w by Nesterov SGD (buffer b = m*b + g, the
    first b = g; w -= lr * (g + m*b))."""
    shrink = sum(1 - (1 - INNER_LR * a) ** K for a in CURVATURES) / len(CURVATURES)
    w, buf, out = w0, None, []
    for _ in range(windows):
        g = shrink * w
        buf = g if buf is None else momentum * buf + g
        w -= outer_lr * (g + momentum * buf if momentum else g)
        out.append(w)
    return out


@pytest.mark.parametrize(("outer_lr", "momentum"), [(0.7, 0.9), (1.0, 0.0), (0.5, 0.5)])
def test_the_outer_step_follows_the_closed_form_diloco_trajectory(outer_lr, momentum):
    w = nn.Parameter(torch.tensor([2.0], dtype=torch.float64))
    module = nn.ParameterList([w])
    outer = OuterSync(module, K, outer_lr, momentum)
    inner = torch.optim.SGD([w], lr=INNER_LR)
    other = CURVATURES[1]

    def average(pseudo: list[torch.Tensor]) -> None:  # the mean with group 1's pseudo-gradient
        theirs = (1 - (1 - INNER_LR * other) ** K) * outer.start[0]
        pseudo[0].copy_((pseudo[0] + theirs) / 2)

    got = []
    for step in range(10 * K):
        if outer.starts_window(step):
            outer.begin()
        inner.zero_grad()
        (CURVATURES[0] * w**2 / 2).sum().backward()
        inner.step()
        if outer.ends_window(step):
            assert outer.sync(average, lambda: True)
            got.append(w.item())
    assert got == pytest.approx(expected(2.0, outer_lr, momentum, 10), rel=1e-12)


def test_a_discarded_meeting_returns_the_model_to_the_windows_start():
    w = nn.Parameter(torch.tensor([2.0]))
    outer = OuterSync(nn.ParameterList([w]), K, 0.7, 0.9)
    outer.begin()
    with torch.no_grad():
        w.sub_(0.5)
    assert not outer.sync(lambda pseudo: None, lambda: False)
    assert w.item() == 2.0 and not outer.outer.state


def test_the_inner_state_takes_the_groups_mean_on_a_commit_only():
    """`sync_optimizer_state`: the inner optimizer's state tensors go through the meeting's all-reduce (here:
    the mean with a peer whose momentum is 3) and take the mean when it commits; a discarded meeting (whose
    all-reduce may have left garbage) leaves them as they were."""
    w = nn.Parameter(torch.tensor([2.0]))
    outer = OuterSync(nn.ParameterList([w]), K, 1.0, 0.0)
    momentum = torch.tensor([1.0])

    def average(tensors: list[torch.Tensor]) -> None:  # [pseudo-gradient, momentum]: the peer's are 0 and 3
        tensors[0].div_(2)
        tensors[1].add_(3.0).div_(2)

    for commit, want in ((False, 1.0), (True, 2.0)):
        outer.begin()
        with torch.no_grad():
            w.sub_(0.5)
        assert outer.sync(average, lambda commit=commit: commit, [momentum]) is commit
        assert momentum.item() == want
    assert w.item() == 2.0 - 0.25  # the discarded window undone, then half of this group's step


def test_the_inner_state_averaged_is_every_state_tensor_shaped_like_its_parameter():
    model = nn.Linear(3, 2)
    adam = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.ones(1, 3)).sum().backward()
    adam.step()
    want = [adam.state[p][key] for p in model.parameters() for key in ("exp_avg", "exp_avg_sq")]
    got = inner_state(adam)
    assert len(got) == len(want) and all(a is b for a, b in zip(got, want, strict=True))  # no step counts


def test_a_warm_up_meets_every_step_then_every_k_steps():
    """`sync_warmup_steps=W`: the groups meet (a quorum, the gradients averaged) before each of the first W
    steps, then every k steps: a quorum at each window's first step, a meeting after its last."""
    warmup = 2 * K
    outer = OuterSync(nn.Linear(2, 1), K, 1.0, 0.0, warmup)
    quorums, per_step, meetings = [], [], []
    for step in range(warmup + 3 * K):
        if outer.starts_window(step):
            quorums.append(step)
            outer.begin()
        if outer.per_step(step):
            per_step.append(step)
        if outer.ends_window(step):
            meetings.append(step)
        assert outer.ends_warmup(step) is (step == warmup - 1)
    assert per_step == list(range(warmup))
    assert quorums == [*range(warmup), warmup, warmup + K, warmup + 2 * K]
    assert meetings == [warmup + K - 1, warmup + 2 * K - 1, warmup + 3 * K - 1]


def test_without_a_warm_up_the_windows_are_as_before():
    outer = OuterSync(nn.Linear(2, 1), K, 1.0, 0.0)
    outer.begin()
    assert not any(outer.per_step(step) or outer.ends_warmup(step) for step in range(3 * K))
    assert [s for s in range(3 * K) if outer.starts_window(s)] == [0, K, 2 * K]
    assert [s for s in range(3 * K) if outer.ends_window(s)] == [K - 1, 2 * K - 1, 3 * K - 1]


def test_the_combined_second_moment_removes_the_noise_one_group_more_has_averaged_away():
    """v (each group's batch: signal m^2 plus its noise) becomes m^2 + noise / groups; a v below m^2 is all
    signal (m^2); a group alone keeps its own."""
    model = nn.Linear(3, 1, bias=False)
    adam = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.ones(1, 3)).sum().backward()
    adam.step()
    state = adam.state[model.weight]
    state["exp_avg"].copy_(torch.tensor([[2.0, -1.0, 3.0]]))
    state["exp_avg_sq"].copy_(torch.tensor([[10.0, 1.0, 5.0]]))
    combine_second_moment(adam, 1)
    assert state["exp_avg_sq"].tolist() == [[10.0, 1.0, 9.0]]
    combine_second_moment(adam, 2)
    assert state["exp_avg_sq"].tolist() == [[4.0 + 6.0 / 2, 1.0, 9.0]]
    assert state["exp_avg"].tolist() == [[2.0, -1.0, 3.0]]


def test_the_combined_second_moment_needs_an_adam_family_optimizer():
    model = nn.Linear(3, 1)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.ones(1, 3)).sum().backward()
    sgd.step()
    with pytest.raises(
        ValueError, match=r"sync_combined_second_moment=True with SGD; allowed: an Adam-family"
    ):
        combine_second_moment(sgd, 2)
