"""Checkpoints: atomic directories, retention, tied weights, and loading that never runs code."""

import json
import logging
import re

import pytest
import safetensors.torch
import torch
from helpers import Regression, checkpoint_steps, quiet, regression_loader

from callbacks import Callback, ModelCheckpoint
from trainer import Trainer, TrainModule
from trainer.checkpoint import CheckpointError, find_last, load_model_file, save_model_file
from trainer.checkpoint.integrity import hash_file


def test_model_checkpoint_keeps_the_newest_k_and_leaves_no_temporary_files(tmp_path):
    cb = ModelCheckpoint(every_n_steps=2, save_top_k=2)
    Trainer(max_steps=10, default_root_dir=tmp_path, callbacks=[cb], **quiet()).fit(
        Regression(), regression_loader()
    )
    assert checkpoint_steps(tmp_path) == [8, 10]
    assert not [p for p in (tmp_path / "checkpoints").iterdir() if p.name.startswith(".")]
    assert sorted(p.name for p in (tmp_path / "checkpoints" / "step-00000010").iterdir()) == [
        "meta.json",
        "model.safetensors",
        "optimizer.pt",
        "state.pt",
        "validated.json",
    ]


def test_model_checkpoint_with_monitor_keeps_the_best_and_the_newest(tmp_path):
    class ScriptedMetric(Callback):
        scores = {2: 5.0, 4: 1.0, 6: 3.0, 8: 4.0, 10: 6.0}

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            if trainer.global_step in self.scores:
                trainer.callback_metrics["score"] = self.scores[trainer.global_step]

    cb = ModelCheckpoint(every_n_steps=2, save_top_k=1, monitor="score", mode="min", save_last=False)
    Trainer(max_steps=10, default_root_dir=tmp_path, callbacks=[ScriptedMetric(), cb], **quiet()).fit(
        Regression(), regression_loader()
    )
    assert checkpoint_steps(tmp_path) == [4, 10]  # best (score 1.0) and the newest


def test_monitor_of_an_unknown_metric_names_what_was_logged(tmp_path):
    class LogsAccuracy(Regression):
        def training_step(self, batch, batch_idx):
            self.log("acc", 0.5)
            self.log("acc_top5", 0.9)
            return super().training_step(batch, batch_idx)

    cb = ModelCheckpoint(every_n_steps=1, monitor="val/acc")
    with pytest.raises(KeyError) as error:
        Trainer(max_steps=2, default_root_dir=tmp_path, callbacks=[cb], **quiet()).fit(
            LogsAccuracy(), regression_loader()
        )
    message = error.value.args[0]
    assert message.startswith(
        "ModelCheckpoint(monitor='val/acc') found no such metric; logged: acc, acc_top5, "
    )
    assert "train/loss, " in message  # every logged name, sorted, in a readable list


def test_last_ignores_a_half_written_checkpoint(tmp_path):
    Trainer(max_steps=2, default_root_dir=tmp_path, **quiet()).fit(Regression(), regression_loader())
    (tmp_path / "checkpoints" / ".tmp-step-00000004-123").mkdir()  # a writer killed mid-way
    (tmp_path / "checkpoints" / "step-00000006").mkdir()  # a directory without meta.json
    assert find_last(tmp_path / "checkpoints").name == "step-00000002"


def test_tied_weights_are_stored_once_and_stay_tied_after_loading(tmp_path):
    emb = torch.nn.Embedding(10, 4)
    head = torch.nn.Linear(4, 10, bias=False)
    head.weight = emb.weight
    sd = {"emb.weight": emb.weight, "head.weight": head.weight}
    save_model_file(sd, tmp_path / "m.safetensors")
    loaded = load_model_file(tmp_path / "m.safetensors")
    assert torch.equal(loaded["head.weight"], emb.weight)
    assert loaded["head.weight"] is loaded["emb.weight"]


class Boom:
    def __reduce__(self):
        return (print, ("this must never run",))


@pytest.mark.parametrize("env", [{}, {"TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD": "1"}])
def test_loading_a_checkpoint_never_executes_code_from_it(tmp_path, capsys, monkeypatch, env):
    for key, value in env.items():  # set for some other tool: it must not make our loads unsafe
        monkeypatch.setenv(key, value)
    Trainer(max_steps=2, default_root_dir=tmp_path, **quiet()).fit(Regression(), regression_loader())
    ckpt = tmp_path / "checkpoints" / "step-00000002"
    torch.save({"loop": Boom()}, ckpt / "state.pt")
    meta = json.loads((ckpt / "meta.json").read_text())
    meta["manifest"] = {
        f.name: hash_file(f) for f in ckpt.iterdir() if f.name != "meta.json"
    }  # a forger rewrites the checksums too: loading itself must be safe
    (ckpt / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match=r"state.pt is refused: it holds the global \S*print\b") as err:
        Trainer(max_steps=4, default_root_dir=tmp_path, **quiet()).fit(
            Regression(), regression_loader(), ckpt_path="last"
        )
    assert "\n" not in str(err.value)  # one line, naming the file
    assert "this must never run" not in capsys.readouterr().out


def test_validate_and_test_load_weights_from_a_checkpoint(tmp_path):
    class WithTest(Regression):
        def test_step(self, batch, batch_idx):
            return self.validation_step(batch, batch_idx)

    trained = WithTest()
    Trainer(max_steps=30, default_root_dir=tmp_path, **quiet()).fit(trained, regression_loader())
    fresh = WithTest()
    before = Trainer(default_root_dir=tmp_path, **quiet()).validate(fresh, regression_loader())
    after = Trainer(default_root_dir=tmp_path, **quiet()).validate(
        fresh, regression_loader(), ckpt_path="last"
    )
    tested = Trainer(default_root_dir=tmp_path, **quiet()).test(fresh, regression_loader())
    with torch.no_grad():
        expected = torch.stack(
            [torch.nn.functional.mse_loss(trained.net(x), y) for x, y in regression_loader()]
        ).mean()
    assert after["val/loss"] == pytest.approx(float(expected), rel=1e-6)
    assert tested["test/loss"] == pytest.approx(after["val/loss"], rel=1e-6)
    assert before["val/loss"] != pytest.approx(after["val/loss"])


def test_module_hooks_add_their_own_state_to_the_checkpoint(tmp_path):
    class Counting(Regression):
        def __init__(self):
            super().__init__()
            self.seen = 0

        def on_save_checkpoint(self, checkpoint):
            checkpoint["seen"] = self.seen + 41

        def on_load_checkpoint(self, checkpoint):
            self.seen = checkpoint["seen"]

    Trainer(max_steps=2, default_root_dir=tmp_path, **quiet()).fit(Counting(), regression_loader())
    resumed = Counting()
    Trainer(max_steps=3, default_root_dir=tmp_path, **quiet()).fit(
        resumed, regression_loader(), ckpt_path="last"
    )
    assert resumed.seen == 41


def test_trainmodule_log_outside_a_run_is_an_error():
    class M(TrainModule):
        pass

    with pytest.raises(RuntimeError, match=r"M.log\('x'\) called outside of a Trainer run"):
        M().log("x", 1.0)


def test_meta_json_records_the_format_the_step_and_when_it_was_saved(tmp_path):
    Trainer(max_steps=2, default_root_dir=tmp_path, **quiet()).fit(Regression(), regression_loader())
    meta = json.loads((tmp_path / "checkpoints" / "step-00000002" / "meta.json").read_text())
    # format 1: weights in model.safetensors (a sharded FSDP checkpoint says "dcp"); tools pick the reader by it
    assert meta["format"] == 1 and meta["step"] == 2 and isinstance(meta["time"], float)
    assert meta["files"] == ["model.safetensors", "optimizer.pt", "state.pt"]


def test_a_fresh_run_never_replaces_an_earlier_runs_checkpoint_of_the_same_step(tmp_path):
    # the twin of the old "a new checkpoint of the same step replaces the old one": that was data loss
    earlier = Regression()
    Trainer(max_steps=2, default_root_dir=tmp_path, **quiet()).fit(earlier, regression_loader())
    later = Regression()  # other initial weights: a fresh run in the same folder
    Trainer(max_steps=2, default_root_dir=tmp_path, **quiet()).fit(later, regression_loader())
    assert checkpoint_steps(tmp_path) == [2]
    assert not [p for p in (tmp_path / "checkpoints").iterdir() if p.name.startswith(".")]
    kept = load_model_file(tmp_path / "checkpoints" / "step-00000002" / "model.safetensors")
    assert all(torch.equal(kept[k], v) for k, v in earlier.state_dict().items())
    saved = load_model_file(tmp_path / "checkpoints" / "version_1" / "step-00000002" / "model.safetensors")
    assert all(torch.equal(saved[k], v) for k, v in later.state_dict().items())


class TiedGain(Regression):
    """A one-element gain applied twice: two layers share the same 1x1 weight."""

    def __init__(self):
        super().__init__()
        self.gain_in = torch.nn.Linear(1, 1, bias=False)
        self.gain_out = torch.nn.Linear(1, 1, bias=False)
        self.gain_out.weight = self.gain_in.weight

    def forward(self, x):
        return self.gain_out(self.gain_in(self.net(x)))


def test_a_tied_one_element_weight_is_saved_once_and_a_resume_continues_exactly(tmp_path):
    torch.manual_seed(0)
    straight = TiedGain()
    Trainer(max_steps=4, seed=0, default_root_dir=tmp_path / "straight", **quiet()).fit(
        straight, regression_loader()
    )
    torch.manual_seed(0)
    Trainer(max_steps=2, seed=0, default_root_dir=tmp_path / "run", **quiet()).fit(
        TiedGain(), regression_loader()
    )
    saved = load_model_file(tmp_path / "run" / "checkpoints" / "step-00000002" / "model.safetensors")
    assert saved["gain_out.weight"] is saved["gain_in.weight"]
    torch.manual_seed(0)
    resumed = TiedGain()
    Trainer(max_steps=4, seed=0, default_root_dir=tmp_path / "run", **quiet()).fit(
        resumed, regression_loader(), ckpt_path="last"
    )
    assert resumed.gain_out.weight is resumed.gain_in.weight
    for (name, a), b in zip(straight.named_parameters(), resumed.parameters(), strict=True):
        assert torch.equal(a, b), f"parameter {name} differs after resume"


def rewrite_manifest(ckpt_dir, drop=()):
    """Record the files as they are now (what a tool that rewrote a file would do); drop keys from meta.json."""
    meta = json.loads((ckpt_dir / "meta.json").read_text())
    meta["manifest"] = {
        f.name: hash_file(f) for f in ckpt_dir.iterdir() if f.name not in ("meta.json", "validated.json")
    }
    for key in drop:
        meta.pop(key)
    (ckpt_dir / "meta.json").write_text(json.dumps(meta))


def test_weights_written_by_plain_safetensors_without_alias_metadata_load(tmp_path):
    trained = Regression()
    Trainer(max_steps=2, default_root_dir=tmp_path, **quiet()).fit(trained, regression_loader())
    ckpt = tmp_path / "checkpoints" / "step-00000002"
    weights = safetensors.torch.load_file(ckpt / "model.safetensors")
    safetensors.torch.save_file(weights, ckpt / "model.safetensors")  # no metadata at all
    rewrite_manifest(ckpt)
    fresh = Regression()
    Trainer(default_root_dir=tmp_path, **quiet()).validate(fresh, regression_loader(), ckpt_path=ckpt)
    for a, b in zip(trained.parameters(), fresh.parameters(), strict=True):
        assert torch.equal(a, b)


def test_a_checkpoint_with_a_corrupted_meta_json_is_named(tmp_path):
    Trainer(max_steps=2, default_root_dir=tmp_path, **quiet()).fit(Regression(), regression_loader())
    ckpt = tmp_path / "checkpoints" / "step-00000002"
    (ckpt / "meta.json").write_text('{"step": 2, "fil')  # cut short
    with pytest.raises(
        CheckpointError, match=rf"^checkpoint '{re.escape(str(ckpt))}': meta.json corrupted \("
    ):
        Trainer(max_steps=4, default_root_dir=tmp_path, **quiet()).fit(
            Regression(), regression_loader(), ckpt_path=ckpt
        )


def test_a_checkpoint_without_a_manifest_is_refused_unless_allowed_and_a_lost_file_is_reported_missing(
    tmp_path, caplog
):
    trained = Regression()
    Trainer(max_steps=2, default_root_dir=tmp_path, **quiet()).fit(trained, regression_loader())
    ckpt = tmp_path / "checkpoints" / "step-00000002"
    # the first format (or a manifest someone removed): meta.json lists the files, with no checksums
    rewrite_manifest(ckpt, drop=("manifest", "pending_validation"))
    (ckpt / "validated.json").unlink()
    with pytest.raises(
        CheckpointError, match=r"meta.json has no manifest, so nothing in it can be verified; refused"
    ):
        Trainer(default_root_dir=tmp_path, **quiet()).validate(
            Regression(), regression_loader(), ckpt_path=ckpt
        )
    fresh = Regression()
    with caplog.at_level(logging.WARNING, logger="trainer"):
        Trainer(default_root_dir=tmp_path, allow_unverified_checkpoints=True, **quiet()).validate(
            fresh, regression_loader(), ckpt_path=ckpt
        )
    assert any("loaded unverified" in r.getMessage() for r in caplog.records)
    assert all(torch.equal(a, b) for a, b in zip(trained.parameters(), fresh.parameters(), strict=True))
    (ckpt / "model.safetensors").unlink()  # lost in a copy: it is missing, not corrupted
    with pytest.raises(
        CheckpointError,
        match=rf"^checkpoint '{re.escape(str(ckpt))}': incomplete: missing model.safetensors$",
    ):
        Trainer(default_root_dir=tmp_path, allow_unverified_checkpoints=True, **quiet()).validate(
            Regression(), regression_loader(), ckpt_path=ckpt
        )


def test_a_checkpoint_missing_files_names_all_of_them(tmp_path):
    Trainer(max_steps=2, default_root_dir=tmp_path, **quiet()).fit(Regression(), regression_loader())
    ckpt = tmp_path / "checkpoints" / "step-00000002"
    (ckpt / "optimizer.pt").unlink()
    (ckpt / "state.pt").unlink()
    with pytest.raises(
        CheckpointError,
        match=rf"^checkpoint '{re.escape(str(ckpt))}': incomplete: missing optimizer.pt, state.pt$",
    ):
        Trainer(max_steps=4, default_root_dir=tmp_path, **quiet()).fit(
            Regression(), regression_loader(), ckpt_path=ckpt
        )


@pytest.mark.parametrize("mode, kept", [("min", [4, 10]), ("max", [6, 10])])
def test_model_checkpoint_with_monitor_keeps_the_best_by_mode_and_the_newest(tmp_path, mode, kept):
    class ScriptedMetric(Callback):
        scores = {2: 5.0, 4: 1.0, 6: 9.0, 8: 4.0, 10: 2.0}

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            if trainer.global_step in self.scores:
                trainer.callback_metrics["score"] = self.scores[trainer.global_step]

    cb = ModelCheckpoint(every_n_steps=2, save_top_k=1, monitor="score", mode=mode, save_last=False)
    Trainer(max_steps=10, default_root_dir=tmp_path, callbacks=[ScriptedMetric(), cb], **quiet()).fit(
        Regression(), regression_loader()
    )
    assert checkpoint_steps(tmp_path) == kept  # min: 1.0 at step 4; max: 9.0 at step 6


def test_a_resumed_run_goes_on_pruning_the_checkpoints_of_the_run_before(tmp_path):
    Trainer(
        max_steps=6,
        default_root_dir=tmp_path,
        callbacks=[ModelCheckpoint(every_n_steps=2, save_top_k=2)],
        **quiet(),
    ).fit(Regression(), regression_loader())
    assert checkpoint_steps(tmp_path) == [4, 6]
    Trainer(
        max_steps=10,
        default_root_dir=tmp_path,
        callbacks=[ModelCheckpoint(every_n_steps=2, save_top_k=2)],
        **quiet(),
    ).fit(Regression(), regression_loader(), ckpt_path="last")
    assert checkpoint_steps(tmp_path) == [8, 10]


def test_model_checkpoint_keeps_the_two_newest_by_default(tmp_path):
    Trainer(
        max_steps=10, default_root_dir=tmp_path, callbacks=[ModelCheckpoint(every_n_steps=2)], **quiet()
    ).fit(Regression(), regression_loader())
    assert checkpoint_steps(tmp_path) == [8, 10]


def test_a_checkpoint_folder_that_does_not_exist_yet_is_created_with_its_parents(tmp_path):
    dirpath = tmp_path / "experiments" / "lr-1e-2" / "checkpoints"
    trained = Regression()
    Trainer(
        max_steps=2,
        default_root_dir=tmp_path / "run",
        callbacks=[ModelCheckpoint(dirpath=dirpath)],
        **quiet(),
    ).fit(trained, regression_loader())
    assert find_last(dirpath) == dirpath / "step-00000002"
    saved = load_model_file(dirpath / "step-00000002" / "model.safetensors")
    assert all(torch.equal(saved[k], v) for k, v in trained.state_dict().items())


class ExtraState(Regression):
    """Keeps a vocabulary in its state_dict through `get_extra_state`: a dict, not a tensor."""

    def get_extra_state(self):
        return {"vocab": ["a", "b"]}

    def set_extra_state(self, state):
        pass


@pytest.mark.parametrize("val_loader", [None, regression_loader(batch_size=8)], ids=["no-val", "val"])
def test_a_state_dict_entry_that_is_not_a_tensor_is_named_and_a_fixed_rerun_saves(tmp_path, val_loader):
    # without a validation loss the save first checks that every tensor of the state is finite
    with pytest.raises(
        CheckpointError, match=r"^state_dict entry '_extra_state' is a dict; only tensors can be saved$"
    ):
        Trainer(max_steps=2, default_root_dir=tmp_path, **quiet()).fit(
            ExtraState(), regression_loader(), val_loader
        )
    # fixed, and run again in the same process (a notebook): the failed save left nothing in the way
    trained = Regression()
    Trainer(max_steps=2, default_root_dir=tmp_path, **quiet()).fit(trained, regression_loader())
    assert checkpoint_steps(tmp_path) == [2]
    saved = load_model_file(tmp_path / "checkpoints" / "step-00000002" / "model.safetensors")
    assert all(torch.equal(saved[k], v) for k, v in trained.state_dict().items())


def test_distinct_empty_tensors_are_not_taken_for_tied_weights(tmp_path):
    # empty tensors have no memory of their own: they all report the same (null) address
    sd = {"mask": torch.zeros(0, dtype=torch.bool), "ids": torch.zeros(0, dtype=torch.int64)}
    save_model_file(sd, tmp_path / "m.safetensors")
    loaded = load_model_file(tmp_path / "m.safetensors")
    assert {k: v.dtype for k, v in loaded.items()} == {"mask": torch.bool, "ids": torch.int64}
    assert loaded["mask"] is not loaded["ids"]


def test_meta_json_has_one_field_per_line_for_people_and_line_tools(tmp_path):
    Trainer(max_steps=2, default_root_dir=tmp_path, **quiet()).fit(Regression(), regression_loader())
    lines = [
        line.strip()
        for line in (tmp_path / "checkpoints" / "step-00000002" / "meta.json").read_text().splitlines()
    ]
    # `grep`/`diff` of two checkpoints' meta.json shows the step and which file's checksum differs
    assert '"step": 2,' in lines
    assert '"model.safetensors": {' in lines


def test_monitor_ranks_scores_near_the_largest_float(tmp_path):
    class ScriptedMetric(Callback):
        scores = {2: 1.0e308, 4: 1.5e308, 6: 0.0}

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            if trainer.global_step in self.scores:
                trainer.callback_metrics["score"] = self.scores[trainer.global_step]

    cb = ModelCheckpoint(every_n_steps=2, save_top_k=1, monitor="score", mode="max", save_last=False)
    Trainer(max_steps=6, default_root_dir=tmp_path, callbacks=[ScriptedMetric(), cb], **quiet()).fit(
        Regression(), regression_loader()
    )
    assert checkpoint_steps(tmp_path) == [4, 6]  # the best (1.5e308) and the newest
