"""The `trainer` command: recipes run end to end; bad keys, types and paths give one-line errors."""

import json
import logging
import textwrap

import pytest
import yaml
from helpers import REPO, SMALL, TINY, failure, run_cli

from trainer.cli import main
from trainer.config import ConfigError, load_recipe


@pytest.mark.slow
def test_fit_the_tiny_recipe_end_to_end_then_resume_and_validate(tmp_path):
    root = tmp_path / "run"
    args = [
        str(TINY),
        "trainer.max_steps=20",  # shorter than the recipe's warmup: scaled to 2 steps, with a note
        "trainer.val_check_interval=10",
        "trainer.limit_val_batches=2",
        f"trainer.default_root_dir={root}",
        *SMALL,
    ]
    done = run_cli("fit", *args, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = [json.loads(line) for line in (root / "logs" / "metrics.jsonl").read_text().splitlines()]
    val = [(r["step"], r["val/loss"]) for r in rows if "val/loss" in r]
    assert [s for s, _ in val] == [0, 10, 20]
    assert val[-1][1] < val[0][1] - 1.0, f"validation loss did not fall: {val}"
    assert "done: 20 steps" in done.stdout and "export/model.safetensors" in done.stdout
    assert "trainer.warmup_steps 30 -> 2" in done.stderr
    assert (root / "export" / "config.json").exists() and (root / "checkpoints" / "step-00000020").is_dir()
    assert list((tmp_path / "trainer-cache").iterdir()), (
        "the token cache is written under the test's tmp_path"
    )

    more = run_cli(
        "fit", *args[: -len(SMALL)], *SMALL, "trainer.max_steps=25", "--ckpt-path", "last", cwd=tmp_path
    )
    assert more.returncode == 0, more.stderr[-2000:]
    assert "resuming from" in more.stderr
    steps = [json.loads(line)["step"] for line in (root / "logs" / "metrics.jsonl").read_text().splitlines()]
    assert max(steps) == 25

    checked = run_cli("validate", *args, cwd=tmp_path)
    assert checked.returncode == 0, checked.stderr[-2000:]
    assert yaml.safe_load(checked.stdout)["val/loss"] < val[0][1]


@pytest.mark.parametrize(
    "override, message",
    [
        ("trainer.max_step=5", "unknown key 'trainer.max_step'; did you mean 'max_steps'?"),
        ("model.n_layer=2", "unknown key 'model.n_layer'; did you mean 'n_layers'?"),
        ("optimzer.lr=1", "unknown section 'optimzer'; did you mean 'optimizer'?"),
        ("trainer.max_steps=abc", "trainer.max_steps expects int or null; got str 'abc'"),
        ("optimizer.lr=fast", "optimizer.lr expects float; got str 'fast'"),
        ("data.batch_size=2.5", "data.batch_size expects int; got float 2.5"),
        (
            "trainer.enable_progress_bar=3",
            "trainer.enable_progress_bar expects bool (true/false) or null; got int 3",
        ),
        ("strategy.name=ddpp", "strategy.name='ddpp' is unknown"),
        ("strategy.bucket=3", "strategy 'auto' takes no arguments (got bucket)"),
        ("model.n_heads=7", "model: dim=256 is not divisible by n_heads=7"),
        ("model.preset=13b", "model: Llama preset '13b' is unknown; allowed: tiny, 1b, 8b, 70b"),
        ("trainer", "override 'trainer' is not key.path=value"),
        ("model.dim=0", "model.dim=0 is invalid; allowed: an int >= 1"),
        ("model.ffn_hidden=-4", "model.ffn_hidden=-4 is invalid; allowed: an int >= 1"),
        ("model.norm_eps=0", "model.norm_eps=0.0 is invalid; allowed: a number > 0"),
        ("model.init_std=-0.02", "model.init_std=-0.02 is invalid; allowed: a number > 0"),
        (
            "model.task=regression",
            "model.task='regression' is unknown; allowed: causal-lm, seq-classification",
        ),
        ("model.num_labels=0", "model.num_labels=0 is invalid; allowed: an int >= 1"),
        ("model.freeze=[3]", "model.freeze[0] expects str; got int 3"),
        ("optimizer.lr=-1", "optimizer.lr=-1.0 is invalid; allowed: a number > 0"),
        ("optimizer.weight_decay=-0.1", "optimizer.weight_decay=-0.1 is invalid; allowed: a number >= 0"),
        ("optimizer.eps=0", "optimizer.eps=0.0 is invalid; allowed: a number > 0"),
        (
            "optimizer.betas=[0.9, 1.0]",
            "optimizer.betas=[0.9, 1.0] is invalid; allowed: two numbers in [0, 1)",
        ),
        ("optimizer.betas=[0.9]", "optimizer.betas=[0.9] is invalid; allowed: two numbers in [0, 1)"),
    ],
)
def test_bad_overrides_name_the_key_and_what_is_allowed(override, message):
    with pytest.raises(ConfigError) as err:
        load_recipe(TINY, [override])
    assert message in str(err.value)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(
    "moe, message",
    [
        ("{moe_ffn_dim: 0}", "model.moe.moe_ffn_dim=0 is invalid; allowed: an int >= 1"),
        ("{aux_loss_coef: -0.01}", "model.moe.aux_loss_coef=-0.01 is invalid; allowed: a number >= 0"),
        ("{bias_update_rate: -1}", "model.moe.bias_update_rate=-1.0 is invalid; allowed: a number >= 0"),
        ("{n_experts: two}", "model.moe.n_experts expects int; got str 'two'"),
    ],
)
def test_bad_moe_fields_name_the_key_and_what_is_allowed(moe, message):
    with pytest.raises(ConfigError) as err:
        load_recipe(REPO / "recipes" / "moe_tiny.yaml", [f"model.moe={moe}"])
    assert str(err.value) == message


def test_ckpt_path_may_come_before_or_between_the_overrides(tmp_path, caplog):
    root = tmp_path / "run"
    run = [
        *SMALL,
        "trainer.warmup_steps=1",
        "trainer.limit_val_batches=1",
        f"trainer.default_root_dir={root}",
    ]
    assert main(["fit", str(TINY), "--ckpt-path", "last", *run, "trainer.max_steps=2"]) == 0
    with caplog.at_level(logging.INFO, logger="trainer"):
        assert main(["fit", str(TINY), *run[:2], "--ckpt-path", "last", *run[2:], "trainer.max_steps=3"]) == 0
    assert "resuming from" in caplog.text and "step-00000002" in caplog.text
    assert sorted(p.name for p in (root / "checkpoints").iterdir()) == ["step-00000002", "step-00000003"]


def test_a_short_run_from_the_command_line_scales_the_recipes_warmup_down_with_a_note(capsys, caplog):
    recipe = yaml.safe_load(TINY.read_text())["trainer"]
    with caplog.at_level(logging.INFO, logger="trainer"):
        assert main(["config", str(TINY), "trainer.max_steps=20"]) == 0
    warmup = yaml.safe_load(capsys.readouterr().out)["trainer"]["warmup_steps"]
    assert (
        warmup == recipe["warmup_steps"] * 20 // recipe["max_steps"] < 20
    )  # the recipe's ratio, rounded down
    notes = [r.getMessage() for r in caplog.records if "warmup_steps" in r.getMessage()]
    assert len(notes) == 1 and f"trainer.warmup_steps {recipe['warmup_steps']} -> {warmup}" in notes[0]


def test_a_recipe_whose_warmup_outlasts_its_run_names_the_override_that_fixes_it(tmp_path, capsys):
    recipe = yaml.safe_load(TINY.read_text())
    recipe["trainer"].update(max_steps=20, warmup_steps=30)
    path = tmp_path / "short.yaml"
    path.write_text(yaml.safe_dump(recipe))
    assert main(["config", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "trainer.warmup_steps=30 leaves no room to decay in 20" in err
    fix = err.split("e.g. the override ")[1]
    assert main(["config", str(path), fix]) == 0
    assert yaml.safe_load(capsys.readouterr().out)["trainer"]["warmup_steps"] < 20


def test_strategy_arguments_are_checked_against_the_named_strategy():
    with pytest.raises(ConfigError, match="unknown key 'strategy.bucket_cap'; did you mean 'bucket_cap_mb'"):
        load_recipe(TINY, ["strategy.name=ddp", "strategy.bucket_cap=3"])
    assert (
        load_recipe(TINY, ["strategy.name=ddp", "strategy.bucket_cap_mb=1"])["strategy"]["bucket_cap_mb"] == 1
    )


def test_yaml_numbers_without_a_dot_are_read_as_floats():
    assert load_recipe(TINY, ["optimizer.lr=1e-3"])["optimizer"]["lr"] == 1e-3


def test_cli_errors_are_one_line_with_exit_code_2(tmp_path, capsys):
    assert main(["fit", str(tmp_path / "missing.yaml")]) == 2
    assert "recipe '" in capsys.readouterr().err
    assert main(["fit", str(TINY), f"data.path={tmp_path / 'nope.txt'}", *SMALL]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("trainer: error: data:") and "nope.txt" in err and len(err.splitlines()) == 1
    assert (
        main(
            [
                "fit",
                str(TINY),
                "callbacks=[{class_path: callbacks.ModelCheckpoint, init_args: {every_n_step: 3}}]",
            ]
        )
        == 2
    )
    assert (
        "unknown key 'callbacks[0].init_args.every_n_step'; did you mean 'every_n_steps'?"
        in capsys.readouterr().err
    )
    assert (
        main(["fit", str(TINY), "callbacks=[{class_path: callbacks.Timer, init_args: {duration: 4 hours}}]"])
        == 2
    )
    assert (
        "trainer: error: callbacks[0] (callbacks.Timer): duration='4 hours' is invalid; allowed: seconds"
        in capsys.readouterr().err
    )
    assert main(["fit", str(TINY), "loggers=[mlflow]"]) == 2
    assert "loggers[0]: cannot import 'mlflow'" in capsys.readouterr().err
    assert main(["fit", str(TINY), "trainer.max_steps=5", "trainer.warmup_steps=10"]) == 2
    assert "warmup_steps=10 leaves no room to decay in 5 total steps" in capsys.readouterr().err


def test_config_prints_the_resolved_recipe_with_defaults(capsys):
    assert main(["config", str(TINY), "trainer.max_steps=7"]) == 0
    resolved = yaml.safe_load(capsys.readouterr().out)
    assert resolved["trainer"]["max_steps"] == 7
    assert resolved["trainer"]["accumulate_grad_batches"] == 1  # a default filled in
    assert list(resolved) == ["model", "data", "optimizer", "trainer", "strategy", "callbacks", "loggers"]


def test_help_lists_subcommands_and_recipe_sections(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    for word in (
        "fit",
        "validate",
        "test",
        "config",
        "model",
        "data",
        "optimizer",
        "trainer",
        "strategy",
        "callbacks",
        "loggers",
    ):
        assert word in out


def test_a_users_own_train_module_is_named_by_import_path(tmp_path, monkeypatch):
    (tmp_path / "my_lm.py").write_text(
        textwrap.dedent("""
        import torch
        from trainer import TrainModule

        class Bigram(TrainModule):
            def __init__(self, vocab: int = 257):
                super().__init__()
                self.table = torch.nn.Embedding(vocab, vocab)

            def training_step(self, batch, batch_idx):
                logits = self.table(batch["input_ids"])
                return torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten())

            validation_step = training_step

            def configure_optimizers(self):
                return torch.optim.SGD(self.parameters(), lr=1.0)
    """)
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("the quick brown fox jumps over the lazy dog. " * 200)
    code = main(
        [
            "fit",
            str(TINY),
            "model.class_path=my_lm.Bigram",
            "model.init_args={vocab: 257}",
            f"data.path={corpus}",
            "data.seq_len=32",
            "trainer.max_steps=5",
            "trainer.warmup_steps=1",
            "trainer.enable_progress_bar=false",
            f"trainer.default_root_dir={tmp_path / 'run'}",
        ]
    )
    assert code == 0
    assert (tmp_path / "run" / "checkpoints" / "step-00000005").is_dir()
    with pytest.raises(ConfigError, match="unknown key 'model.init_args.vocab_size'; did you mean 'vocab'"):
        from trainer.config import build_run

        build_run(load_recipe(TINY, ["model.class_path=my_lm.Bigram", "model.init_args={vocab_size: 3}"]))


@pytest.mark.parametrize("recipe", sorted((REPO / "recipes").glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_recipe_resolves(recipe):
    resolved = load_recipe(recipe)
    assert (resolved["trainer"]["max_steps"] or resolved["trainer"]["max_epochs"]) >= 1


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["auto", "fsdp"])
def test_devices_in_a_recipe_starts_that_many_processes(tmp_path, strategy):
    root = tmp_path / "run"
    done = run_cli(
        "fit",
        str(TINY),
        *SMALL,
        f"strategy.name={strategy}",
        "trainer.devices=2",
        "data.global_batch_size=8",
        "trainer.max_steps=6",
        "trainer.warmup_steps=1",
        "trainer.val_check_interval=3",
        "trainer.limit_val_batches=2",
        f"trainer.default_root_dir={root}",
        cwd=tmp_path,
        ranks=2,
    )
    assert done.returncode == 0, failure(done.stderr)
    assert json.loads((root / "logs" / "hparams.json").read_text())["world_size"] == 2
    assert (
        "global batch = 4 per micro-batch x 1 accumulated x 2 data-parallel = 8 samples/step" in done.stderr
    )
    assert done.stdout.count("done: 6 steps") == 1, "only rank zero reports"
    assert (root / "export" / "config.json").exists(), (
        "the final (sharded) checkpoint is exported for transformers"
    )


def test_global_batch_that_does_not_divide_is_refused_before_start(capsys):
    # ddp named: strategy auto would plan a layout of 2 data-parallel ranks (x cp or pp) that 10 divides
    assert (
        main(["fit", str(TINY), "strategy.name=ddp", "trainer.devices=4", "data.global_batch_size=10"]) == 2
    )
    assert (
        "data.global_batch_size=10 does not divide by 4 data-parallel ranks x accumulate_grad_batches=1"
        in capsys.readouterr().err
    )
