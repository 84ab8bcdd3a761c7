"""Lightning's SpikeDetection and ModelPruning run under PyTorch Lightning and here on the same module, weights
and data with SGD (tests/lightning_twins.py): where a spike ends the fit and the batches file it leaves, the
masks each epoch's pruning makes, the sparsity logged, the weights in checkpoints and at the end; Lightning's
error cases fail here too. The one difference on purpose, asserted: every pruning round's lottery-ticket
reset goes back to the initial weights (Lightning's later rounds reset nothing, README)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import pytorch_lightning.callbacks as lit_callbacks
import torch
import torch.nn.utils.prune as torch_prune
from lightning_fabric.utilities.spike import TrainingSpikeException as LitSpike
from lightning_twins import assert_same_weights, loader, logged, nets, trainers, weights

import callbacks
from callbacks import ModelCheckpoint
from callbacks.spike_detection import TrainingSpikeException
from trainer import checkpoint as ckpt


# ---- SpikeDetection ------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("losses", "options", "spike_at"),
    [
        ({5: 100.0}, {}, 5),  # a loss 100 times the others'
        ({3: float("nan")}, {}, 3),  # non-finite: a spike with finite_only
        ({5: 1.5}, {"rtol": 0.2, "warmup": 2}, 5),  # a smaller jump, a tighter bound
        ({1: 100.0}, {"warmup": 2}, 3),  # inside the warm-up not judged; the steps it upset are
        ({5: 0.01}, {"mode": "max", "rtol": 0.9}, 5),  # a drop, where higher is better
        ({5: 100.0}, {"atol": 1e6}, None),  # both bounds must be passed
    ],
)
def test_spike_detection_stops_where_lightnings_stops_and_writes_the_same_batches(
    tmp_path, losses, options, spike_at
):
    lit, ours = nets(losses=losses)
    lit_trainer, our_trainer = trainers(
        tmp_path,
        [lit_callbacks.SpikeDetection(**options)],
        [callbacks.SpikeDetection(**options)],
        max_epochs=1,
    )
    for trainer, module, error in ((lit_trainer, lit, LitSpike), (our_trainer, ours, TrainingSpikeException)):
        if spike_at is None:
            trainer.fit(module, loader())
        else:
            with pytest.raises(error, match=f"^Training spike detected in batch {spike_at}$"):
                trainer.fit(module, loader())
    written = [tmp_path / side / "skip_batches.json" for side in ("lightning", "ours")]
    assert [p.exists() for p in written] == [spike_at is not None] * 2
    if spike_at is not None:
        assert (
            json.loads(written[1].read_text())
            == json.loads(written[0].read_text())
            == [spike_at - 1, spike_at]
        )
    assert our_trainer.global_step == lit_trainer.global_step == (8 if spike_at is None else spike_at + 1)
    if spike_at != 3:  # (a NaN step leaves NaN weights in both)
        assert_same_weights(lit, ours)
    lit_spike, our_spike = lit_trainer.callbacks[0], our_trainer.callbacks[0]
    assert our_spike.last_val == pytest.approx(float(lit_spike.last_val), rel=1e-6)
    assert our_spike.losses.mean() == pytest.approx(float(lit_spike.running_mean.compute()), rel=1e-5)


def test_spike_detection_writes_into_a_given_folder_and_its_state_round_trips(tmp_path):
    _, ours = nets(losses={4: 100.0})
    spike = callbacks.SpikeDetection(exclude_batches_path=tmp_path / "skips", window=3)
    with pytest.raises(TrainingSpikeException):
        trainers(tmp_path, [], [spike], max_epochs=1)[1].fit(ours, loader())
    assert json.loads((tmp_path / "skips" / "skip_batches.json").read_text()) == [3, 4]
    again = callbacks.SpikeDetection()
    again.load_state_dict(spike.state_dict())
    assert again.state_dict() == spike.state_dict() and len(again.losses) == 3


def test_a_non_finite_loss_without_finite_only_is_no_spike_and_stays_out_of_the_mean():
    spike = callbacks.SpikeDetection(finite_only=False)
    assert not spike._is_spike(float("nan")) and not spike._is_spike(float("inf"))
    assert callbacks.SpikeDetection()._is_spike(float("nan"))


def test_spike_detection_refuses_an_unknown_mode(tmp_path):
    lit, _ = nets()
    lit_trainer, _ = trainers(tmp_path, [lit_callbacks.SpikeDetection(mode="avg")], [], max_epochs=1)
    with pytest.raises(ValueError, match="mode"):
        lit_trainer.fit(lit, loader())
    with pytest.raises(ValueError, match="mode='avg' is unknown"):  # here at once
        callbacks.SpikeDetection(mode="avg")


# ---- ModelPruning --------------------------------------------------------------------------------------
def masks_after_pruning(lambda_callback: type, seen: list) -> object:
    """Records every mask at each epoch's end, after ModelPruning (which comes before it in the list)."""

    def record(trainer, module):
        seen.append({k: v.clone() for k, v in module.named_buffers() if k.endswith("_mask")})

    return lambda_callback(on_train_epoch_end=record)


def prune_both(tmp_path: Path, epochs: int, **options) -> tuple:
    """Lightning's and our fit with ModelPruning(**options) (its `parameters_to_prune` given as a function of
    the module); returns both modules, trainers and the masks seen each epoch."""
    lit, ours = nets()
    pairs = options.pop("parameters_to_prune", lambda m: ())
    lit_masks, our_masks = [], []
    lit_trainer, our_trainer = trainers(
        tmp_path,
        [lit_callbacks.ModelPruning(parameters_to_prune=pairs(lit), **options),
         masks_after_pruning(lit_callbacks.LambdaCallback, lit_masks)],
        [callbacks.ModelPruning(parameters_to_prune=pairs(ours), **options),
         masks_after_pruning(callbacks.LambdaCallback, our_masks)],
        max_epochs=epochs,
    )  # fmt: skip
    for trainer, module in ((lit_trainer, lit), (our_trainer, ours)):
        torch.manual_seed(1)  # random pruning draws from the global generator, at the same moments in both
        trainer.fit(module, loader())
    return lit, ours, lit_masks, our_masks


@pytest.mark.parametrize(
    "options",
    [
        {"pruning_fn": "l1_unstructured", "amount": 0.5, "use_lottery_ticket_hypothesis": False},
        {"pruning_fn": "l1_unstructured", "amount": lambda epoch: 0.3 * (epoch + 1), "parameter_names": ["weight"],
         "use_lottery_ticket_hypothesis": False},
        {"pruning_fn": torch_prune.L1Unstructured, "amount": 40, "use_lottery_ticket_hypothesis": lambda e: e == 0},
        {"pruning_fn": "ln_structured", "pruning_dim": 0, "pruning_norm": 1, "amount": 0.25,
         "use_global_unstructured": False, "use_lottery_ticket_hypothesis": False,
         "parameters_to_prune": lambda m: [(m.layer, "weight")]},
        {"pruning_fn": "random_unstructured", "amount": 0.5, "apply_pruning": lambda epoch: epoch == 1,
         "use_global_unstructured": False, "use_lottery_ticket_hypothesis": False},
        {"pruning_fn": "l1_unstructured", "amount": 0.5, "make_pruning_permanent": False,
         "use_lottery_ticket_hypothesis": False},
    ],
)  # fmt: skip
def test_pruning_makes_lightnings_masks_and_weights(tmp_path, options):
    lit, ours, lit_masks, our_masks = prune_both(tmp_path, 2, **options)
    assert len(our_masks) == len(lit_masks) == 2
    for theirs, mine in zip(lit_masks, our_masks, strict=True):
        assert mine.keys() == theirs.keys()
        assert all(torch.equal(mine[k], theirs[k]) for k in theirs)
    assert our_masks[-1], "nothing was pruned"
    permanent = options.get("make_pruning_permanent", True)
    assert any(k.endswith("_orig") for k in weights(ours)) != permanent
    assert_same_weights(lit, ours)


def test_pruning_logs_lightnings_sparsity_lines(tmp_path):
    options = {
        "pruning_fn": "l1_unstructured",
        "amount": 0.5,
        "verbose": 2,
        "use_lottery_ticket_hypothesis": False,
    }
    with logged("pytorch_lightning.callbacks.pruning") as theirs, logged("trainer") as mine:
        prune_both(tmp_path, 1, **options)
    mine = [line for line in mine if line.startswith("Applied")]
    assert len(theirs) == 5 and mine == theirs  # the overall line, then one per tensor
    assert theirs[0] == "Applied `L1Unstructured`. Pruned: 0/161 (0.00%) -> 80/161 (49.69%)"


def test_a_checkpoint_saved_while_pruned_holds_lightnings_weights_and_the_fit_goes_on_as_lightnings(tmp_path):
    """After epoch 0's pruning both save a checkpoint: the same weights, under the unpruned names (so it loads
    into the unpruned model); our reload check of it loads into the still pruned model and changes nothing."""
    lit, ours = nets()
    options = {"pruning_fn": "l1_unstructured", "amount": 0.5, "use_lottery_ticket_hypothesis": False}
    lit_saver = lit_callbacks.ModelCheckpoint(dirpath=tmp_path / "lit", save_top_k=-1)
    our_saver = ModelCheckpoint(dirpath=tmp_path / "ours", save_top_k=-1, every_n_epochs=1)
    lit_trainer, our_trainer = trainers(
        tmp_path,
        [lit_callbacks.ModelPruning(**options), lit_saver],
        [callbacks.ModelPruning(**options), our_saver],
        max_epochs=2,
        enable_checkpointing=True,
    )
    lit_trainer.fit(lit, loader())
    our_trainer.fit(ours, loader())
    assert_same_weights(lit, ours)
    theirs = torch.load(tmp_path / "lit" / "epoch=0-step=8.ckpt", weights_only=False)["state_dict"]
    (first,) = [p for p in (tmp_path / "ours").rglob("meta.json") if ckpt.read_meta(p.parent)["step"] == 8]
    mine = type(ours).load_from_checkpoint(first.parent).state_dict()
    assert mine.keys() == theirs.keys() and not any("_mask" in k for k in mine)
    for name, value in theirs.items():
        assert torch.allclose(mine[name], value, atol=1e-6), name
    assert (mine["layer.weight"] == 0).float().mean() > 0.3


def test_every_round_of_the_lottery_ticket_goes_back_to_the_initial_weights(tmp_path):
    """Here each pruning round resets the kept weights to their values at the start; Lightning's reset shares
    its storage with its copy of those values, so from the second round on it resets nothing."""
    options = {"pruning_fn": "l1_unstructured", "amount": 0.3}
    initial, _ = nets()
    lit, ours, _, our_masks = prune_both(tmp_path, 2, **options)
    for name, value in weights(ours).items():
        assert torch.equal(value, weights(initial)[name] * our_masks[-1][f"{name}_mask"]), name
    kept = our_masks[-1]["layer.weight_mask"].bool()
    assert not torch.equal(weights(lit)["layer.weight"][kept], weights(initial)["layer.weight"][kept])


@pytest.mark.parametrize(
    "options",
    [
        {"pruning_fn": "l1_unstructured", "parameter_names": ["gamma"]},
        {"pruning_fn": "l2_unstructured"},
        {"pruning_fn": "ln_structured", "use_global_unstructured": False},
        {"pruning_fn": "ln_structured", "pruning_dim": 0, "use_global_unstructured": False},
        {"pruning_fn": "random_structured", "pruning_dim": 0},
        {"pruning_fn": torch_prune.L1Unstructured, "use_global_unstructured": False},
        {"pruning_fn": torch_prune.l1_unstructured},
        {"pruning_fn": "l1_unstructured", "amount": "half"},
        {"pruning_fn": "l1_unstructured", "verbose": 3},
    ],
)
def test_pruning_refuses_what_lightning_refuses(options):
    with pytest.raises(Exception):  # noqa: B017 - Lightning's MisconfigurationException
        lit_callbacks.ModelPruning(**options)
    with pytest.raises(ValueError) as error:
        callbacks.ModelPruning(**options)
    assert "\n" not in str(error.value)


def test_pruning_refuses_parameters_the_module_does_not_have(tmp_path):
    lit, ours = nets()
    other = torch.nn.Linear(2, 2)
    lit_trainer, our_trainer = trainers(
        tmp_path,
        [lit_callbacks.ModelPruning("l1_unstructured", parameters_to_prune=[(other, "weight")])],
        [callbacks.ModelPruning("l1_unstructured", parameters_to_prune=[(other, "weight")])],
        max_epochs=1,
    )
    with pytest.raises(Exception, match="don't exist in the model"):
        lit_trainer.fit(lit, loader())
    with pytest.raises(ValueError, match="names what the module does not have"):
        our_trainer.fit(ours, loader())
