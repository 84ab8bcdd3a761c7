"""The step's quorum forms while the step reads its data and runs its forward, and is joined before the first
backward (trainer/fault_tolerance/quorum.py): one replica group of one process under an in-process
lighthouse, with torchft's real manager, checked for the order of a step's events, for the state a peer is
sent (the step's start, though the step went on) and for a group that heals at a step's join (it runs the
step again from the peer's position and ends bit-identical to a run that never healed)."""

from __future__ import annotations

import copy
import itertools

import pytest
import torch
from helpers import Regression, regression_data
from torch.utils.data import DataLoader, Dataset

from callbacks import Callback
from trainer import Trainer
from trainer.core.rng import rng_state
from trainer.fault_tolerance import FaultTolerance

pytestmark = pytest.mark.slow
pytest.importorskip("torchft")

SEED = 0


@pytest.fixture(scope="module")
def lighthouse():
    from trainer.fault_tolerance.lighthouse import start_lighthouse

    server = start_lighthouse("127.0.0.1:0")
    yield f"127.0.0.1:{server.address().rpartition(':')[2]}"
    server.shutdown()


class Recorded(Regression):
    """The tests' regression MLP with a batch norm (a buffer its forward changes) and dropout (the RNG),
    recording its forwards and backwards; `after_forward[step]` runs after that step's forward."""

    def __init__(self, events: list, after_forward: dict | None = None) -> None:
        super().__init__(dropout=0.5, optimizer="adamw")
        self.net.insert(1, torch.nn.BatchNorm1d(32))
        self.events, self.after_forward = events, after_forward or {}

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self(x), y)
        self.events.append(("forward", batch_idx))
        loss.register_hook(lambda grad: self.events.append(("backward", batch_idx)))
        action = self.after_forward.get(self.trainer.global_step)
        if action is not None:
            action(self.trainer)
        return loss


class Reads(Dataset):
    """`regression_data` recording each read."""

    def __init__(self, events: list) -> None:
        self.data, self.events = regression_data(64), events

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i):
        self.events.append(("read",))
        return self.data[i]


class Quorum(Callback):
    """Records each quorum requested and the first wait for it, on the group's torchft manager (its quorum
    thread's executor and `wait_quorum`); `heal_at[step](manager)` makes that step's quorum (the work
    submitted to the quorum thread) hand this group the training state it returns (as torchft's quorum
    thread stages a peer's state for a group that is behind), or none (a recovery that failed)."""

    def __init__(self, events: list, heal_at: dict | None = None) -> None:
        self.events, self.heal_at = events, heal_at or {}

    def on_train_start(self, trainer, module):
        manager = trainer._fit_loop.replicas.manager
        executor, submitted, wait = manager._executor, manager._executor.submit, manager.wait_quorum
        events, heal_at = self.events, self.heal_at

        pending = []  # a quorum requested and not waited for yet (torchft waits again, at once, later)

        def submit(quorum, *args, **kwargs):
            events.append(("request",))
            pending.append(True)
            return submitted(healing, quorum, *args, **kwargs)

        def waited():
            if pending:
                events.append(("join",))
                pending.clear()
            wait()

        def healing(quorum, *args, **kwargs):
            quorum(*args, **kwargs)
            stage = heal_at.pop(trainer.global_step, None)
            if stage is not None:
                state = stage(manager)  # None: the recovery failed (`stage` recorded the error)
                user = {"user": {"trainer": state}, "torchft": manager.state_dict()}
                manager._pending_state_dict = user if state is not None else None
                manager._healing = True

        executor.submit, manager.wait_quorum = submit, waited


def fit(tmp_path, lighthouse, events, steps, callbacks=(), after_forward=None, **kwargs) -> Recorded:
    torch.manual_seed(SEED)
    module = Recorded(events, after_forward)
    trainer = Trainer(
        max_steps=steps, seed=SEED, default_root_dir=tmp_path, enable_progress_bar=False,
        enable_checkpointing=False, enable_model_summary=False, callbacks=list(callbacks),
        fault_tolerance=FaultTolerance(lighthouse, 0, replicas=1), **kwargs,
    )  # fmt: skip
    trainer.fit(module, DataLoader(Reads(events), batch_size=8, shuffle=True))
    return module


def collapsed(events: list) -> list:
    """The events with repeats in a row as one (a batch's reads)."""
    return [key for key, _ in itertools.groupby(events)]


@pytest.mark.parametrize("accumulate", [1, 2])
def test_the_quorum_is_requested_before_the_data_is_read_and_joined_after_the_forward(
    tmp_path, lighthouse, accumulate
):
    """A group that may be behind its peers joins at once: at its first step, and after a step it did not
    apply (here a callback skips step 1); else the quorum forms while the step reads and runs its forward."""
    events: list = []

    class SkipStepOne(Callback):
        def on_before_optimizer_step(self, trainer, module, optimizer):
            if trainer.global_step == 1:
                trainer.skip_optimizer_step("a test's skip")

    callbacks = [Quorum(events), SkipStepOne()]
    fit(tmp_path, lighthouse, events, 4, callbacks, accumulate_grad_batches=accumulate)
    steps = []
    for i in range(4):
        first = i * accumulate
        if i in (0, 2):  # the first step; the one after the skipped step
            one = [("request",), ("join",), ("read",), ("forward", first), ("backward", first)]
        else:
            one = [("request",), ("read",), ("forward", first), ("join",), ("backward", first)]
        for j in range(1, accumulate):  # the window's later micro-batches: the quorum is joined already
            one += [("forward", first + j), ("backward", first + j)]
        steps += one
    assert collapsed(events) == steps


def test_a_step_taken_again_at_an_epochs_end_keeps_the_quorum_it_joined(tmp_path, lighthouse):
    """Step 8's quorum is requested as epoch 0's data runs out (8 batches) and joined there; the step is taken
    again from epoch 1's first batch with that quorum: a second one for the same step, between the groups'
    heals and steps, could pair one group's heal with another's step (one request per step, not two)."""
    events: list = []
    fit(tmp_path, lighthouse, events, 10, [Quorum(events)])
    seen = [e for e in collapsed(events) if e[0] != "backward"]
    at_the_end = seen.index(("forward", 7)) + 1
    assert seen[at_the_end:] == [
        ("join",),  # step 7's
        ("request",), ("join",),  # step 8's, as epoch 0's data runs out (the loop joins it there)
        ("read",), ("forward", 0),  # step 8 again, in epoch 1, on the quorum it joined
        ("request",), ("read",), ("forward", 1), ("join",),  # step 9
    ], seen[at_the_end:]  # fmt: skip
    assert [e for e in events if e[0] == "request"] == [("request",)] * 10


def test_a_peer_is_sent_the_state_of_the_steps_start_while_the_step_goes_on(tmp_path, lighthouse):
    """What a recovering peer gets, asked for after the step's data read and forward (which count samples,
    draw dropout's RNG, move batch norm's statistics): the values at the step's start."""
    at_start, sent, live = {}, {}, {}

    class Start(Callback):
        def on_train_batch_start(self, trainer, module, batch, batch_idx):
            if trainer.global_step == 2:
                at_start.update(
                    loop=trainer.state.state_dict(), rng=rng_state(), model=copy.deepcopy(module.state_dict())
                )

    def ask(trainer):
        sent.update(copy.deepcopy(trainer._fit_loop.replicas.sent()))
        live.update(
            samples=trainer.state.samples_seen,
            rng=rng_state(),
            model=copy.deepcopy(trainer.module.state_dict()),
        )

    fit(tmp_path, lighthouse, [], 3, [Start()], after_forward={2: ask})
    assert sent["loop"] == at_start["loop"] and at_start["loop"]["samples_seen"] == 2 * 8 != live["samples"]
    assert torch.equal(sent["rng"][0]["torch"], at_start["rng"]["torch"])
    assert not torch.equal(live["rng"]["torch"], at_start["rng"]["torch"])  # dropout drew from it
    for name, value in at_start["model"].items():
        assert torch.equal(sent["model"][name], value), name
    assert not torch.equal(live["model"]["net.1.running_mean"], at_start["model"]["net.1.running_mean"])


def test_a_group_healed_at_the_join_runs_the_step_again_from_the_peers_position(tmp_path, lighthouse):
    """At step 4 the quorum hands the group the state a peer had at step 2's start (taken here after step
    2's forward, through the group's own `sent`): the step's forward, on the data of position 4, is thrown
    away and the loop reads position 2 again. The run then ends bit-identical to one that never healed,
    dropout's RNG, batch norm's statistics and AdamW's moments included."""
    reference = fit(tmp_path / "plain", lighthouse, [], 6)
    events: list = []
    saved: dict = {}

    def take(trainer):
        saved["state"] = copy.deepcopy(trainer._fit_loop.replicas.sent())

    heal = Quorum(events, heal_at={4: lambda manager: saved["state"]})
    healed = fit(tmp_path / "healed", lighthouse, events, 6, [heal], after_forward={2: take})
    forwards = [e[1] for e in events if e[0] == "forward"]
    assert forwards == [0, 1, 2, 3, 4, 2, 3, 4, 5], forwards
    assert [e[1] for e in events if e[0] == "backward"] == [0, 1, 2, 3, 2, 3, 4, 5]
    for p, q in zip(healed.state_dict().values(), reference.state_dict().values(), strict=True):
        assert torch.equal(p, q)


def test_a_recovery_that_failed_discards_the_step_and_does_not_run_it_again(tmp_path, lighthouse):
    """torchft records a failed recovery (the peer's state never arrived) and stages nothing: the group's
    state is its own, the step goes on from its forward and is discarded, as with the synchronous quorum."""
    events: list = []
    skipped: list = []

    class Skipped(Callback):
        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            skipped.append(outputs["skipped"])

    def failed(manager):
        manager.report_error(RuntimeError("the peer's state did not arrive"))

    fit(tmp_path, lighthouse, events, 4, [Quorum(events, heal_at={2: failed}), Skipped()])
    assert [e[1] for e in events if e[0] == "forward"] == [0, 1, 2, 3]
    assert skipped == [False, False, True, False]
