"""Parallel3DStrategy: every layout trains the tiny Llama like one process (real gloo worlds of 2, 4
and 8 torchrun processes), a 2x2x2 checkpoint resumes on another layout, sequence parallelism saves
activation memory, and bad layouts fail in one line before any process starts."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from helpers import SCRIPTS, Regression, assert_validated, launch_layouts, read_metrics, reference_run
from parallel3d_script import MODEL, make_run

from strategies import Parallel3DStrategy
from strategies.techniques.pp.stages import prune, split_blocks, stage_ids
from trainer import Trainer
from trainer.config import ConfigError, build_run, load_recipe
from trainer.models.causal_lm import CausalLM
from trainer.models.llama import Llama, LlamaConfig

SCRIPT = SCRIPTS / "parallel3d_script.py"
RECIPES = Path(__file__).parents[2] / "recipes"
STEPS = 5
# TP and CP change the order of sums; measured differences are ~5e-7 in the loss and ~1e-5 in weights
LOSS_TOL, PARAM_TOL = 1e-5, 1e-4


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """One process, the same model, data, global batch (8) and seed: step losses, gradient norms (the
    global norm that clipping divides by), val loss, weights."""
    root = tmp_path_factory.mktemp("reference")
    return reference_run(make_run, root, STEPS, 8)


def launch(tmp: Path, nproc: int, layouts: list[dict], timeout: float = 400) -> dict:
    return launch_layouts(SCRIPT, tmp, nproc, layouts, STEPS, timeout)


def assert_trains_like_one_process(
    tmp: Path, tag: str, result: dict, reference, steps=range(1, STEPS + 1)
) -> None:
    losses, norms, val_losses, weights = reference
    got, got_norms = read_metrics(tmp / "runs" / tag), read_metrics(tmp / "runs" / tag, "train/grad_norm")
    for step in steps:
        assert abs(got_norms[step] - norms[step]) <= LOSS_TOL, (
            f"{tag}: step {step} gradient norm {got_norms[step]} vs {norms[step]}"
        )
        assert abs(got[step] - losses[step]) <= LOSS_TOL, (
            f"{tag}: step {step} loss {got[step]} vs {losses[step]}"
        )
    got_val = read_metrics(tmp / "runs" / tag, "val/loss")
    if not got_val:  # a layout run without validation
        assert tag.endswith("ZBVZeroBubble"), f"{tag}: no validation loss logged"
    else:
        assert abs(got_val[STEPS] - val_losses[STEPS]) <= LOSS_TOL, (
            f"{tag}: val loss {got_val} vs {val_losses}"
        )
    assert set(result["params"]) == set(weights), f"{tag}: parameter names differ"
    for name, expected in weights.items():
        diff = (torch.tensor(result["params"][name]) - expected).abs().max().item()
        assert diff <= PARAM_TOL, f"{tag}: {name} differs by {diff:.2e} from one process"
    assert_validated(tmp / "runs" / tag, max(steps), with_loss=bool(got_val))  # the layout's own save path


TWO_RANKS = [
    {"tag": "tp2", "tp": 2, "probe": True},
    {"tag": "tp2-no-sp", "tp": 2, "sequence_parallel": False, "probe": True},
    {"tag": "tp2-no-loss-parallel", "tp": 2, "loss_parallel": False},
    *({"tag": f"pp2-{s}", "pp": 2, "pp_schedule": s}
      for s in ("GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble")),
    {"tag": "pp2-ZBVZeroBubble", "pp": 2, "pp_schedule": "ZBVZeroBubble", "validate": False},
    {"tag": "pp2-1F1B-4-microbatches", "pp": 2, "microbatches": 4},
    {"tag": "cp2", "cp": 2},
]  # fmt: skip
FOUR_RANKS = [
    {"tag": "cp4", "cp": 4},
    {"tag": "dp2-tp2", "tp": 2},
    {"tag": "pp2-tp2", "pp": 2, "tp": 2},
    {"tag": "pp2-tp2-checkpointed", "pp": 2, "tp": 2, "activation_checkpointing": "full"},
    {"tag": "pp2-fsdp2", "pp": 2},
    {"tag": "pp2-interleaved-fsdp2-zero2", "pp": 2, "pp_schedule": "Interleaved1F1B", "zero_stage": 2},
    {"tag": "hsdp2-tp2", "dp_replicate": 2, "dp_shard": 1, "tp": 2},
    {"tag": "cp2-tp2", "cp": 2, "tp": 2},
]


@pytest.mark.slow
def test_two_ranks_tensor_pipeline_and_context_parallel_train_like_one_process(tmp_path, reference):
    results = launch(tmp_path, 2, TWO_RANKS)
    for layout in TWO_RANKS:
        assert_trains_like_one_process(tmp_path, layout["tag"], results[layout["tag"]], reference)
    with_sp, without_sp = results["tp2"]["saved_bytes"], results["tp2-no-sp"]["saved_bytes"]
    # the norms' inputs and outputs are split over the 2 tp ranks; the attention and MLP internals (most
    # of this tiny model's, its MLP is 8x wider than dim) are tensor-parallel either way: measured 0.907
    assert with_sp < 0.95 * without_sp, f"sequence parallel saved {with_sp} bytes, without it {without_sp}"


@pytest.mark.slow
def test_four_ranks_composed_layouts_train_like_one_process(tmp_path, reference):
    results = launch(tmp_path, 4, FOUR_RANKS)
    for layout in FOUR_RANKS:
        assert_trains_like_one_process(tmp_path, layout["tag"], results[layout["tag"]], reference)


@pytest.mark.slow
def test_2x2x2_on_eight_ranks_trains_like_one_process_and_resumes_as_tp2_dp2(tmp_path, reference):
    saved = tmp_path / "ckpt" / "step-3"
    # the checkpoint written after step 3 of the run that goes on to step 5 (which then still trains like one
    # process: the save changed nothing)
    layout = {"tag": "pp2-dp2-tp2", "pp": 2, "tp": 2, "save": str(saved), "save_at": 3}
    results = launch(tmp_path, 8, [layout], timeout=500)
    assert_trains_like_one_process(tmp_path, "pp2-dp2-tp2", results["pp2-dp2-tp2"], reference)
    resumed = launch(tmp_path, 4, [{"tag": "resumed", "tp": 2, "resume": str(saved)}])
    assert sorted(read_metrics(tmp_path / "runs" / "resumed")) == [4, 5]  # continued, not restarted
    assert_trains_like_one_process(tmp_path, "resumed", resumed["resumed"], reference, steps=[4, 5])


# ---- how stages are cut (no processes) -----------------------------------------------------------------
@pytest.mark.parametrize(
    "blocks, stages, expected",
    [
        (4, 2, [2, 2]),
        (4, 4, [1, 1, 1, 1]),
        (6, 4, [1, 2, 2, 1]),  # the embedding and the output weigh one block each
        (8, 2, [4, 4]),
        (16, 4, [3, 5, 5, 3]),  # units 4, 5, 5, 4 of 18
    ],
)
def test_balanced_stages_weigh_embedding_and_output_like_blocks(blocks, stages, expected):
    names = [str(i) for i in range(blocks)]
    split = split_blocks(names, stages)
    assert [len(s) for s in split] == expected
    assert sum(split, []) == names


def test_a_given_split_is_used_as_is():
    assert split_blocks(list("abcde"), 2, [1, 4]) == [["a"], ["b", "c", "d", "e"]]


@pytest.mark.parametrize(
    "schedule, expected",
    [
        ("1F1B", [[0], [1], [2], [3]]),
        ("GPipe", [[0], [1], [2], [3]]),
        ("Interleaved1F1B", [[0, 4], [1, 5], [2, 6], [3, 7]]),
        ("ZBVZeroBubble", [[0, 7], [1, 6], [2, 5], [3, 4]]),
    ],
)
def test_each_rank_holds_the_stages_of_its_schedule(schedule, expected):
    assert [stage_ids(schedule, r, 4) for r in range(4)] == expected


def test_a_stage_keeps_its_blocks_under_the_full_models_names_and_counts_the_whole_models_flops():
    torch.manual_seed(0)
    full = Llama(MODEL)
    torch.manual_seed(0)
    stage = Llama(MODEL)
    prune(stage, [["2", "3"]], first=False, last=True)
    assert stage.tok_embeddings is None and stage.output is not None
    assert [k for k in stage.state_dict() if k.startswith("layers.")][0] == "layers.2.attention_norm.weight"
    for name, value in stage.state_dict().items():
        assert torch.equal(value, full.state_dict()[name]), (
            f"{name}: a stage's init differs from the full model's"
        )
    assert stage.flops_per_token(16) == full.flops_per_token(16)
    hidden = torch.randn(2, 16, MODEL.dim)
    assert stage(hidden).shape == (2, 16, MODEL.vocab_size)  # a later stage takes hidden states


# ---- bad input, each before any process starts ---------------------------------------------------------
def fit_on(devices: int, strategy: Parallel3DStrategy, module=None):
    trainer = Trainer(strategy=strategy, devices=devices, max_steps=1, enable_progress_bar=False)
    trainer.fit(module or CausalLM(MODEL), [{"input_ids": torch.zeros(2, 16, dtype=torch.long)}])


@pytest.mark.parametrize(
    "devices, kwargs, match",
    [
        (3, {"tp": 3}, r"tp=3 does not divide the model's 4 heads"),
        (4, {"tp": 4}, r"tp=4 does not divide the model's 2 kv-heads"),
        (2, {"tp": 2, "vocab_size": 65}, r"tp=2 does not divide the model's 65 vocab"),
        (2, {"pp": 2, "tie_embeddings": True}, r"pp=2 puts the embedding and the output on different stages"),
        (8, {"pp": 8}, r"pp=8 with 1F1B makes 8 stages but the model has 4 blocks"),
        (4, {"pp": 4, "pp_schedule": "Interleaved1F1B"}, r"makes 8 stages but the model has 4 blocks"),
        (
            2,
            {"pp": 2, "pp_layers_per_stage": [1, 2]},
            r"pp_layers_per_stage=\[1, 2\] does not fit 2 stages of 4",
        ),
    ],
)
def test_a_model_the_layout_cannot_cut_is_refused_before_spawning(devices, kwargs, match):
    shape = {k: kwargs.pop(k) for k in ("vocab_size", "tie_embeddings") if k in kwargs}
    model = dataclasses.replace(MODEL, **shape)
    with pytest.raises(ValueError, match=match):
        fit_on(devices, Parallel3DStrategy(**kwargs), CausalLM(model))


def test_validation_under_the_v_shaped_zero_bubble_schedule_is_refused_at_the_start():
    strategy = Parallel3DStrategy(pp=2, pp_schedule="ZBVZeroBubble")
    with pytest.raises(
        ValueError, match=r"cannot run this schedule forward-only .* allowed: InterleavedZeroBubble"
    ):
        strategy.process_dataloader([{"input_ids": torch.zeros(2, 16)}], seed=0, train=False)


def test_a_module_without_the_needed_hook_is_named():
    with pytest.raises(ValueError, match=r"Regression does not declare tensor_parallel_plan\(\)"):
        fit_on(2, Parallel3DStrategy(tp=2), Regression())


@pytest.mark.parametrize(
    "devices, kwargs, match",
    [
        (4, {"tp": 2, "pp": 2, "dp_shard": 2}, r"make 8 ranks but the world has 4 processes"),
        (6, {"tp": 4}, r"others make 4 ranks, which does not divide the world of 6"),
        (
            4,
            {"pp": 2, "pp_schedule": "ZBVZeroBubble"},
            r"with data parallelism .* loses the deferred weight gradients",
        ),
        (2, {"tp": 0}, r"tp=0 is invalid; allowed: an int >= 1"),
        (2, {"pp_schedule": "1f1b"}, r"pp_schedule='1f1b' is unknown; allowed: GPipe, 1F1B"),
        (2, {"zero_stage": 1}, r"zero_stage=1 is invalid for parallel3d; allowed: 2 or 3"),
    ],
)
def test_bad_degrees_are_refused_in_one_line(devices, kwargs, match):
    with pytest.raises(ValueError, match=match) as err:
        Trainer(strategy=Parallel3DStrategy(**kwargs), devices=devices)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(
    "strategy, data, match",
    [
        (
            {"pp": 2, "microbatches": 3},
            {"batch_size": 8},
            r"per-rank batch of 8 does not split into microbatches=3",
        ),
        (
            {"cp": 2},
            {"seq_len": 30},
            r"seq_len=30 does not fit cp=2, tp=1; allowed: a multiple of 2\*cp\*tp = 4",
        ),
        ({"tp": 2}, {"seq_len": 63}, r"seq_len=63 does not fit cp=1, tp=2; allowed: a multiple of tp = 2"),
    ],
)
def test_a_recipe_whose_batch_the_layout_cannot_split_fails_before_spawning(strategy, data, match):
    overrides = ["strategy.name=parallel3d", "trainer.devices=2"]
    overrides += [f"strategy.{k}={v}" for k, v in strategy.items()] + [
        f"data.{k}={v}" for k, v in data.items()
    ]
    with pytest.raises(ConfigError, match=match):
        build_run(load_recipe(RECIPES / "llama_tiny.yaml", overrides))


def test_the_tiny_3d_recipe_describes_pp2_dp2_tp2_on_eight_processes():
    trainer, module, _, _ = build_run(load_recipe(RECIPES / "llama_tiny_3d.yaml"))
    strategy = trainer.strategy
    assert isinstance(strategy, Parallel3DStrategy) and (strategy.pp, strategy.tp) == (2, 2)
    assert strategy.planned_group_size("batch") == 2 and trainer.strategy.devices == 8
    assert isinstance(module.config, LlamaConfig)


# ---- memory per GPU of the production recipes, planned on this CPU -------------------------------------
def test_the_70b_recipe_plans_half_a_billion_elements_per_gpu_and_its_stages_cover_the_model(capsys):
    from trainer.cli import main

    assert main(["memory", str(RECIPES / "llama_70b.yaml")]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("80-layer Llama, 128 GPUs as pp=4 x dp_shard=4 x tp=8")
    stages = [line for line in lines if line.startswith("rank ")]
    assert [line.split()[1] for line in stages] == ["0", "32", "64", "96"]  # one line per pipeline stage
    elements = [float(line.split("): ")[1].split("B elements")[0]) for line in stages]
    # each stage's shards over its 8 tp x 4 FSDP ranks, summed over the stages, make the whole model
    assert sum(elements) * 32 == pytest.approx(70.55, rel=0.01)
    assert "blocks 0-8, 40-49" in stages[0] and "blocks 30-39, 71-79" in stages[3]


def test_the_8b_recipe_holds_a_32nd_of_the_model_per_gpu():
    from strategies.plan.shards_on_meta import plan_memory
    from trainer.config import build_llama_config

    config = load_recipe(RECIPES / "llama_8b.yaml")
    strategy = Parallel3DStrategy(tp=8, dp_shard=-1)
    (rank0,) = plan_memory(strategy, lambda: CausalLM(build_llama_config(config["model"])), 32)
    assert rank0.numel == pytest.approx(8_030_261_248 / 32, rel=1e-3)
    assert rank0.total_bytes == 16 * rank0.numel  # fp32 weights and gradients, two fp32 AdamW states


def test_trainer_memory_refuses_a_strategy_that_does_not_shard(capsys):
    from trainer.cli import main

    assert main(["memory", str(RECIPES / "llama_tiny.yaml"), "trainer.devices=2", "strategy.name=ddp"]) == 2
    assert "trainer memory plans sharded layouts; strategy 'ddp' is not one" in capsys.readouterr().err


def test_predict_under_a_pipeline_is_refused_in_one_line():
    strategy = Parallel3DStrategy(pp=2)
    strategy.pipeline = object()  # as after setup: the pipeline runs the loss, not predict_step
    with pytest.raises(ValueError, match=r"predict under pp>1: .* allowed: predict with a layout without"):
        strategy.eval_step(CausalLM(MODEL), "predict_step", {"input_ids": torch.zeros(2, 16)}, 0)
