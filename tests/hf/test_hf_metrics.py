"""HFModule(metrics=...): computed over every rank's predictions (gathered, not a mean of per-rank values),
logged as val_<name> to the console's validation line and metrics.jsonl, usable as ModelCheckpoint's
monitor, and the best checkpoint reloaded at the end of fit with load_best_model_at_end."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import hand_f1, read_metrics
from test_hf_module import TINY_BERT, class_data
from torch.utils.data import DataLoader
from transformers import BertConfig

from callbacks import Callback, ModelCheckpoint
from trainer import Trainer
from trainer.checkpoint import MODEL_FILE, CheckpointError, load_model_file
from trainer.models.hf import HFModule
from trainer.models.hf_metrics import EvalCollector, resolve


def test_metrics_are_computed_over_every_ranks_predictions_not_averaged():
    g = torch.Generator().manual_seed(0)
    logits = [torch.randn(n, 3, generator=g) for n in (10, 30)]  # two ranks' shares, of unequal sizes
    labels = [torch.randint(0, 3, (n,), generator=g) for n in (10, 30)]
    seen = []

    def top2(predictions, labels):  # a user's compute_metrics gets all logits and labels at once
        seen.append(len(labels))
        return {"top2": (predictions.topk(2).indices == labels[:, None]).any(-1).double().mean()}

    collector = EvalCollector(resolve(["accuracy", "f1", top2]))
    collector.add(logits[0][:4], labels[0][:4])  # rank 0's batches
    collector.add(logits[0][4:], labels[0][4:])
    other = (logits[1], labels[1])  # what rank 1 gathered
    got = collector.compute(lambda mine: [mine, other])
    predicted, every = torch.cat(logits).argmax(-1), torch.cat(labels)
    assert got["f1"] == pytest.approx(hand_f1(predicted, every), abs=1e-12)
    assert got["accuracy"] == pytest.approx((predicted == every).double().mean().item(), abs=1e-12)
    assert seen == [40]
    per_rank = sum(hand_f1(lo.argmax(-1), la) for lo, la in zip(logits, labels, strict=True)) / 2
    assert abs(per_rank - got["f1"]) > 1e-3  # what averaging over ranks would have said instead
    assert collector.compute(lambda mine: [mine]) == {}  # reset after each evaluation

    with pytest.raises(
        ValueError, match=r"metrics entry 'auc' is unknown; allowed: 'accuracy', 'f1' or a callable"
    ):
        resolve(["auc"])
    with pytest.raises(TypeError, match=r"returned float 0.5; allowed: a dict of metric name -> number"):
        EvalCollector(resolve(lambda p, lab: 0.5)).compute(lambda mine: [other])


def test_metrics_show_on_the_console_go_to_jsonl_and_pick_the_best_checkpoint_reloaded_at_the_end(
    tmp_path, capsys
):
    calls = []

    def order(predictions, labels):  # the first validation after the sanity check scores best
        calls.append(1)
        return {"order": -float(len(calls))}

    torch.manual_seed(0)
    module = HFModule(
        BertConfig(**TINY_BERT), task="seq-classification", num_labels=3, lr=3e-3, metrics=["f1", order],
        load_best_model_at_end=True,
    )  # fmt: skip
    saver = ModelCheckpoint(every_n_steps=2, monitor="val_order", mode="max", save_top_k=-1)
    trainer = Trainer(
        max_steps=6, val_check_interval=2, seed=0, log_every_n_steps=1, default_root_dir=str(tmp_path),
        callbacks=[saver], num_sanity_val_steps=0,
    )  # fmt: skip
    train = DataLoader(class_data(256, 0), batch_size=16, shuffle=True)
    val = DataLoader(class_data(48, 1), batch_size=16)
    trainer.fit(module, train, val)
    console = capsys.readouterr().err
    assert "validation at step 2 (epoch 0): val_f1=" in console
    assert ", val_order=-1, val/loss=" in console
    assert sorted(read_metrics(tmp_path, "val_f1")) == [2, 4, 6]

    best = load_model_file(Path(saver.dirpath) / "step-00000002" / MODEL_FILE)
    last = load_model_file(Path(saver.dirpath) / "step-00000006" / MODEL_FILE)
    live = module.state_dict()
    assert all(torch.equal(live[k], v) for k, v in best.items()), "the best checkpoint was not reloaded"
    assert any(not torch.equal(live[k], v) for k, v in last.items())
    # the reloaded model's F1 over the validation set, against one written out from its predictions
    module.eval()
    with torch.no_grad():
        predicted = torch.cat([module(input_ids=b["input_ids"]).logits.argmax(-1) for b in val])
    labels = torch.cat([b["labels"] for b in val])
    assert trainer.validate(module, val)["val_f1"] == pytest.approx(hand_f1(predicted, labels), abs=1e-6)

    lone = HFModule(
        BertConfig(**TINY_BERT), task="seq-classification", num_labels=3, load_best_model_at_end=True
    )
    with pytest.raises(ValueError) as err:
        Trainer(max_steps=1, default_root_dir=str(tmp_path / "lone"), enable_checkpointing=False).fit(
            lone, train
        )
    assert str(err.value) == (
        "HFModule(load_best_model_at_end=True) needs the Trainer's ModelCheckpoint(monitor=...) to say which "
        "checkpoint is best; allowed: add one, or load_best_model_at_end=False"
    )


class CorruptBest(Callback):
    """Flips a byte of step-2's weights once training ends, before load_best_model_at_end reads them."""

    def on_train_end(self, trainer, module):
        path = Path(trainer.checkpoint_callback.dirpath) / "step-00000002" / MODEL_FILE
        data = bytearray(path.read_bytes())
        data[-1] ^= 0xFF
        path.write_bytes(bytes(data))


def test_load_best_model_at_end_verifies_the_best_checkpoint_before_loading_it(tmp_path):
    calls = []

    def order(predictions, labels):  # the first validation scores best: step-2
        calls.append(1)
        return {"order": -float(len(calls))}

    torch.manual_seed(0)
    module = HFModule(
        BertConfig(**TINY_BERT), task="seq-classification", num_labels=3, metrics=[order],
        load_best_model_at_end=True,
    )  # fmt: skip
    saver = ModelCheckpoint(every_n_steps=2, monitor="val_order", mode="max", save_top_k=-1)
    trainer = Trainer(
        max_steps=4, val_check_interval=2, seed=0, default_root_dir=str(tmp_path), enable_progress_bar=False,
        callbacks=[saver, CorruptBest()], num_sanity_val_steps=0,
    )  # fmt: skip
    train = DataLoader(class_data(64, 0), batch_size=16, shuffle=True)
    with pytest.raises(CheckpointError, match=r"model.safetensors checksum mismatch"):
        trainer.fit(module, train, DataLoader(class_data(16, 1), batch_size=16))
