"""Bad input gets a one-line error naming the value and what is allowed."""

import pytest
import torch
from helpers import Regression, quiet, regression_loader

from callbacks import ModelCheckpoint
from trainer import Trainer, TrainModule
from trainer.checkpoint import CheckpointError


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"strategy": "dpp"}, ValueError, r"strategy='dpp' is unknown; allowed: auto, single, ddp"),
        ({"max_steps": 0}, ValueError, r"max_steps=0 is invalid; allowed: an int >= 1"),
        ({"max_steps": -5}, ValueError, r"max_steps=-5 is invalid"),
        ({"max_epochs": 0}, ValueError, r"max_epochs=0 is invalid"),
        (
            {"accumulate_grad_batches": 0},
            ValueError,
            r"accumulate_grad_batches=0 is invalid; allowed: an int >= 1",
        ),
        (
            {"precision": "fp8"},
            ValueError,
            r"precision='fp8' is unknown; allowed: 32, bf16-mixed, 16-mixed, bf16-true",
        ),
        (
            {"lr_schedule": "step"},
            ValueError,
            r"lr_schedule='step' is unknown; allowed: 'constant', 'linear'",
        ),
        ({"gradient_clip_val": -1.0}, ValueError, r"gradient_clip_val=-1.0 is invalid"),
        ({"gradient_clip_algorithm": "max"}, ValueError, r"gradient_clip_algorithm='max' is unknown"),
        ({"accelerator": "tpu"}, ValueError, r"accelerator='tpu' is unknown"),
        (
            {"strategy": "single", "devices": 2},
            ValueError,
            r"strategy .single. runs one process, got devices=2",
        ),
        ({"val_check_interval": 0}, ValueError, r"val_check_interval=0 is invalid"),
        ({"limit_train_batches": 1.5}, ValueError, r"limit_train_batches=1.5 is invalid"),
        ({"log_every_n_steps": 0}, ValueError, r"log_every_n_steps=0 is invalid"),
        (
            {"loggers": ["mlflow"]},
            ValueError,
            r"logger 'mlflow' is unknown; allowed: jsonl, csv, tensorboard, wandb",
        ),
        ({"callbacks": [object()]}, TypeError, r"callbacks must be Callback instances; got object"),
        ({"seed": -1}, ValueError, r"seed=-1 is invalid"),
    ],
)
def test_bad_trainer_flags_are_named_with_what_is_allowed(kwargs, error, match):
    with pytest.raises(error, match=match):
        Trainer(**kwargs)


def test_cuda_requested_without_a_gpu_says_so():
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    with pytest.raises(ValueError, match="accelerator='cuda' but no CUDA device is available"):
        Trainer(accelerator="cuda")


class DictWithoutLoss(Regression):
    def training_step(self, batch, batch_idx):
        return {"prediction": self.net(batch[0])}


@pytest.mark.parametrize("module_cls, got", [(DictWithoutLoss, "NoneType")])  # None itself: a skip
def test_training_step_without_a_loss_is_an_error(tmp_path, module_cls, got):
    with pytest.raises(
        TypeError, match=rf"training_step returned {got}; allowed: a scalar loss tensor or a dict"
    ):
        Trainer(max_steps=1, default_root_dir=tmp_path, **quiet()).fit(module_cls(), regression_loader())


def test_configure_optimizers_returning_nothing_is_an_error(tmp_path):
    class NoOpt(Regression):
        def configure_optimizers(self):
            return None

    with pytest.raises(
        TypeError, match=r"configure_optimizers returned NoneType; allowed: an optimizer, \[optimizers\]"
    ):
        Trainer(max_steps=1, default_root_dir=tmp_path, **quiet()).fit(NoOpt(), regression_loader())


def test_a_module_without_parameters_is_an_error(tmp_path):
    class Empty(TrainModule):
        pass

    with pytest.raises(ValueError, match="Empty has no parameters"):
        Trainer(max_steps=1, default_root_dir=tmp_path, **quiet()).fit(Empty(), regression_loader())


def test_fit_needs_a_train_module_and_a_loader(tmp_path):
    with pytest.raises(TypeError, match="expected a TrainModule, got Linear"):
        Trainer(default_root_dir=tmp_path).fit(torch.nn.Linear(2, 2), regression_loader())
    with pytest.raises(ValueError, match="fit needs train_dataloaders; got None"):
        Trainer(default_root_dir=tmp_path).fit(Regression(), None)


def test_an_empty_loader_is_refused_before_the_first_step(tmp_path):
    """An empty validation loader used to end the fit with a bare StopIteration and no final checkpoint."""
    steps = []

    class Counting(Regression):
        def training_step(self, batch, batch_idx):
            steps.append(batch_idx)
            return super().training_step(batch, batch_idx)

    empty = regression_loader(n=0)
    with pytest.raises(
        ValueError, match=r"^val_dataloaders is empty \(len 0\); allowed: a loader that yields"
    ):
        Trainer(max_steps=2, default_root_dir=tmp_path, **quiet()).fit(Counting(), regression_loader(), empty)
    with pytest.raises(ValueError, match=r"^train_dataloaders is empty \(len 0\)"):
        Trainer(max_steps=2, default_root_dir=tmp_path, **quiet()).fit(Counting(), empty)
    assert steps == [] and not (tmp_path / "checkpoints").exists()


def test_missing_checkpoint_path_is_named(tmp_path):
    with pytest.raises(
        FileNotFoundError, match=r"ckpt_path '.*nope' does not exist; allowed: an existing checkpoint"
    ):
        Trainer(default_root_dir=tmp_path).fit(Regression(), regression_loader(), ckpt_path=tmp_path / "nope")


def saved_checkpoint(tmp_path):
    Trainer(max_steps=2, default_root_dir=tmp_path, **quiet()).fit(Regression(), regression_loader())
    return tmp_path / "checkpoints" / "step-00000002"


@pytest.mark.parametrize("victim", ["model.safetensors", "optimizer.pt", "state.pt"])
def test_truncated_checkpoint_file_is_named_and_the_files_are_kept(tmp_path, victim):
    ckpt = saved_checkpoint(tmp_path)
    data = (ckpt / victim).read_bytes()
    (ckpt / victim).write_bytes(data[: len(data) // 2])
    with pytest.raises(
        CheckpointError,
        match=rf"step-00000002': {victim} has {len(data) // 2} bytes, {len(data)} were written",
    ):
        Trainer(max_steps=4, default_root_dir=tmp_path, **quiet()).fit(
            Regression(), regression_loader(), ckpt_path=ckpt
        )
    assert (ckpt / victim).read_bytes() == data[: len(data) // 2], (
        "a failed load must not touch the checkpoint"
    )


@pytest.mark.parametrize("victim", ["model.safetensors", "optimizer.pt", "state.pt"])
def test_altered_checkpoint_file_fails_its_checksum(tmp_path, victim):
    ckpt = saved_checkpoint(tmp_path)
    data = bytearray((ckpt / victim).read_bytes())
    data[-9] ^= 0x01  # one bit, same size: only the hash can tell
    (ckpt / victim).write_bytes(bytes(data))
    with pytest.raises(
        CheckpointError, match=rf"{victim} checksum mismatch at bytes 0-\d+ \(corrupted or altered\)$"
    ):
        Trainer(max_steps=4, default_root_dir=tmp_path, **quiet()).fit(
            Regression(), regression_loader(), ckpt_path=ckpt
        )


def test_checkpoint_without_meta_is_reported_incomplete(tmp_path):
    ckpt = saved_checkpoint(tmp_path)
    (ckpt / "meta.json").unlink()
    with pytest.raises(CheckpointError, match="no meta.json: it was never completed"):
        Trainer(max_steps=4, default_root_dir=tmp_path, **quiet()).fit(
            Regression(), regression_loader(), ckpt_path=ckpt
        )


def test_checkpoint_of_a_different_model_names_the_mismatch(tmp_path):
    ckpt = saved_checkpoint(tmp_path)

    class Wider(Regression):
        def __init__(self):
            super().__init__()
            self.net[0] = torch.nn.Linear(8, 64)
            self.net[3] = torch.nn.Linear(64, 1)

    with pytest.raises(
        CheckpointError, match=r"does not fit Wider: wrong shape \['net.0.bias', 'net.0.weight'"
    ):
        Trainer(max_steps=4, default_root_dir=tmp_path, **quiet()).fit(
            Wider(), regression_loader(), ckpt_path=ckpt
        )


def test_bad_model_checkpoint_arguments():
    with pytest.raises(ValueError, match="every_n_steps=0 is invalid"):
        ModelCheckpoint(every_n_steps=0)
    with pytest.raises(ValueError, match="save_top_k=-2 is invalid"):  # 0 is Lightning's "keep none"
        ModelCheckpoint(save_top_k=-2)
    with pytest.raises(ValueError, match="^filename='a/b' is invalid; allowed: None or a template of one"):
        ModelCheckpoint(filename="a/b")
    with pytest.raises(
        ValueError, match="^save_last='copy' is invalid; allowed: True, False, None or 'link'"
    ):
        ModelCheckpoint(save_last="copy")
    with pytest.raises(ValueError, match="^every_n_epochs=1 with a step or time interval; allowed: one of"):
        ModelCheckpoint(every_n_epochs=1, every_n_train_steps=5)
    for budget in (0, -0.1, "2%"):  # a share of the fit's time: > 0, or None for every checkpoint
        with pytest.raises(ValueError, match=rf"^validate_budget={budget!r} is invalid; allowed: "):
            ModelCheckpoint(validate_budget=budget)


def test_schedule_needing_a_length_without_one_is_an_error(tmp_path):
    class Endless(torch.utils.data.IterableDataset):
        def __iter__(self):
            while True:
                yield torch.randn(8), torch.randn(1)

    loader = torch.utils.data.DataLoader(Endless(), batch_size=4)
    with pytest.raises(ValueError, match="lr_schedule='cosine' needs the run length"):
        Trainer(max_epochs=1, lr_schedule="cosine", default_root_dir=tmp_path, **quiet()).fit(
            Regression(), loader
        )
