"""FSDP/ZeRO in real multi-process gloo groups: equivalence with one process, memory per rank,
resharding checkpoints, export, meta-device init, and bad input."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from helpers import (
    DDP_SCRIPT,
    FSDP_SCRIPT,
    LLAMA,
    SCRIPTS,
    assert_params_close,
    read_metrics,
    run_cli,
    run_ranks,
    run_script,
    run_world,
    token_loader,
)
from helpers import script_result as result
from test_ddp import single_process

from strategies import FSDPStrategy
from trainer import Trainer
from trainer.checkpoint.weights import dcp_model_state as _dcp_model_state
from trainer.models.causal_lm import CausalLM

pytestmark = pytest.mark.slow


def single_llama(tmp):
    torch.manual_seed(0)  # CausalLM builds its Llama in configure_model, after the Trainer's seed
    return single_process(tmp, CausalLM(LLAMA, lr=1e-2), token_loader(16))


def fsdp(tmp, name: str, *args: str, devices: int = 2, timeout: float = 180):
    """fsdp_script.py training the tiny Llama on `devices` ranks; rank 0's result and the run root."""
    _, root = run_script(devices, FSDP_SCRIPT, tmp, name, "--model", "llama", *args, timeout=timeout)
    return result(tmp, name), root


# 12 ZeRO-3 steps, a checkpoint every 4: trained on 2 and on 4 ranks in the shared worlds, resumed on the other
STRAIGHT_12 = ["--stage", "3", "--steps", "12", "--ckpt-every", "4"]
# the runs of the tests below that start from nothing, by world size: each world is launched once (on first use)
# and trains them one after another, instead of one launch each
SHARED_RUNS = {
    2: {
        **{f"zero-{s}": ["--stage", str(s), "--accumulate", "2"] for s in (1, 2, 3)},
        "plain": ["--stage", "3"],
        "ac-full": ["--stage", "3", "--ac", "full"],
        "ac-selective": ["--stage", "3", "--ac", "selective"],
        "offload": ["--stage", "3", "--offload"],
        "bf16": ["--stage", "3", "--precision", "bf16-mixed"],
        **{f"validated-{s}": ["--stage", str(s), "--steps", "4", "--validate"] for s in (1, 3)},
        "async": ["--stage", "2", "--steps", "6", "--ckpt-every", "2", "--async-save"],
        "sharded": ["--stage", "3", "--steps", "4"],
        "small": ["--stage", "3", "--steps", "2", "--ckpt-every", "2"],
        "fresh-regression": ["--model", "regression", "--stage", "3", "--resume"],  # nothing to resume
        "straight-12": STRAIGHT_12,
    },
    4: {
        **{f"zero-{s}": ["--stage", str(s), "--accumulate", "2"] for s in (1, 3)},
        "plain": ["--stage", "3"],
        "replicate-2": ["--stage", "3", "--replicate", "2"],
        "straight-12": STRAIGHT_12,
    },
}


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    """`shared(devices, name)`: rank 0's result and the run root of SHARED_RUNS[devices][name]."""
    worlds = {}

    def get(devices: int, name: str) -> tuple[dict, Path]:
        if devices not in worlds:
            tmp = worlds[devices] = tmp_path_factory.mktemp(f"fsdp-{devices}-ranks")
            run_world(devices, FSDP_SCRIPT, tmp, SHARED_RUNS[devices], "--model", "llama", timeout=600)
        return result(worlds[devices], name), worlds[devices] / name

    return get


# every stage on 2 ranks, stages 1 and 3 also on 4 (stage 2 is stage 3 without the second gather)
@pytest.mark.parametrize("stage, devices", [(1, 2), (2, 2), (3, 2), (1, 4), (3, 4)])
def test_each_zero_stage_matches_one_process_and_holds_the_formula_memory(tmp_path, shared, stage, devices):
    out, root = shared(devices, f"zero-{stage}")
    params, losses = single_llama(tmp_path)
    got = read_metrics(root)
    for step, loss in losses.items():
        assert abs(got[step] - loss) <= 1e-5, (
            f"step {step}: zero-{stage} on {devices} ranks {got[step]} vs {loss}"
        )
    # the sums over the ranks are ordered differently from one process's; AdamW's m/sqrt(v) at lr 1e-2
    # magnifies that for elements whose gradient is near zero: measured 1.2e-5 and 3.1e-5 in single elements
    # of layers.1 after 8 steps on 4 ranks, and 2.06e-5 in parameter 17 on 2 ranks on an AVX-512 Xeon (the
    # same on the code before this change), while the losses agree to 1e-5. The gradient arithmetic itself
    # is checked step by step with SGD at 1e-6 (test_gradient_sync.py)
    assert_params_close(out["params"], params, atol=1e-4)

    # bytes this rank held, against the formula (FSDP2 shards dim 0 in whole rows: allow one row per tensor)
    with_grads, after_step = out["memory"]["grads"], out["memory"]["states"]
    row_slack = 4 * sum(len(p) for p in params) / 8  # generous bound on one row per parameter tensor
    for measured, key in (
        (with_grads["params_bytes"], "params"),
        (with_grads["grads_bytes"], "grads"),
        (after_step["optimizer_bytes"], "optimizer states"),
    ):
        expected = with_grads["expected"][key]
        assert abs(measured - expected) <= (0 if stage == 1 and key != "optimizer states" else row_slack), (
            f"zero-{stage}, {devices} ranks, {key}: measured {measured} bytes, formula {expected}"
        )
    full = 4 * with_grads["parameters"]
    assert after_step["optimizer_bytes"] <= 2 * full / devices + 8 * len(params), "optimizer state is sharded"
    if stage == 3:
        assert with_grads["params_bytes"] < full / devices + row_slack, (
            "stage 3 keeps only a shard of the weights"
        )


@pytest.mark.parametrize("saved_on, resumed_on", [(4, 2), (2, 4)])  # ZeRO-1: test_zero1_checkpoint
def test_a_sharded_checkpoint_resumes_on_another_world_size(tmp_path, shared, saved_on, resumed_on):
    straight, root = shared(saved_on, "straight-12")
    resumed_root = tmp_path / "resumed"
    (resumed_root / "checkpoints").mkdir(parents=True)
    shutil.copytree(root / "checkpoints" / "step-00000008", resumed_root / "checkpoints" / "step-00000008")
    resumed, _ = fsdp(tmp_path, "resumed", *STRAIGHT_12, "--resume", devices=resumed_on)
    expected, got = read_metrics(root), read_metrics(resumed_root)
    assert sorted(got) == list(range(9, 13))
    for step in range(9, 13):
        assert abs(got[step] - expected[step]) <= 1e-5, (
            f"step {step}: resumed on {resumed_on} {got[step]} vs {expected[step]}"
        )
    assert_params_close(resumed["params"], straight["params"])


def test_a_ddp_checkpoint_resumes_sharded_under_fsdp_and_loads_in_one_process(tmp_path):
    # DDP and FSDP write the same layout (torch's state dict, each rank its part): a run can move between them
    _, ddp_root = run_script(
        2, DDP_SCRIPT, tmp_path, "ddp", "--model", "llama", "--steps", "8", "--ckpt-every", "4"
    )
    ckpt = ddp_root / "checkpoints" / "step-00000004"
    root = tmp_path / "fsdp"
    shutil.copytree(ckpt, root / "checkpoints" / ckpt.name)
    fsdp(tmp_path, "fsdp", "--stage", "3", "--steps", "8", "--ckpt-every", "4", "--resume")
    expected, got = read_metrics(ddp_root), read_metrics(root)
    assert sorted(got) == [5, 6, 7, 8]
    for step in got:
        assert abs(got[step] - expected[step]) <= 1e-5, (
            f"step {step}: fsdp {got[step]} vs ddp {expected[step]}"
        )
    torch.manual_seed(0)
    one = CausalLM(LLAMA, lr=1e-2)
    Trainer(enable_progress_bar=False, default_root_dir=tmp_path / "one").validate(
        one, token_loader(8), ckpt_path=ckpt
    )
    saved = _dcp_model_state(ckpt)  # read back without a process group, as `trainer export` does
    assert set(saved) == set(one.state_dict())
    for name, value in one.state_dict().items():
        assert torch.equal(value, saved[name]), f"{name} was not loaded from the DDP checkpoint"


def test_async_save_writes_complete_checkpoints_while_training(shared):
    out, root = shared(2, "async")
    saved = sorted(p.name for p in (root / "checkpoints").iterdir())
    assert saved == ["step-00000004", "step-00000006"]  # save_top_k=2, every one completed and renamed
    assert (root / "checkpoints" / "step-00000006" / "meta.json").exists()


@pytest.mark.parametrize(
    "options", [["--ac", "full"], ["--ac", "selective"], ["--offload"], ["--replicate", "2"]]
)
def test_checkpointing_offload_and_hybrid_sharding_train_exactly_like_plain_fsdp(shared, options):
    devices = 4 if "--replicate" in options else 2
    name = "-".join(o.lstrip("-") for o in options)  # "ac-full", ..., "replicate-2"
    assert SHARED_RUNS[devices][name] == ["--stage", "3", *options]
    plain, _ = shared(devices, "plain")
    other, _ = shared(devices, name)
    assert_params_close(other["params"], plain["params"], atol=1e-5)  # hybrid: another reduction order


@pytest.mark.parametrize("stage", [1, 3])
def test_validation_runs_through_the_sharded_model(shared, stage):
    _, root = shared(2, f"validated-{stage}")
    val = read_metrics(root, "val/loss")
    assert list(val) == [4] and 0 < val[4] < 10


def test_bf16_mixed_precision_policy_trains_close_to_fp32(shared):
    fp32, fp32_root = shared(2, "plain")
    bf16, bf16_root = shared(2, "bf16")
    assert_params_close(bf16["params"], fp32["params"], atol=5e-2)  # bf16 compute, 8 steps at lr 1e-2
    expected, got = read_metrics(fp32_root), read_metrics(bf16_root)
    assert all(abs(got[s] - expected[s]) < 0.05 for s in expected), (got, expected)
    assert any(got[s] != expected[s] for s in expected), "bf16 compute must differ from fp32 in the last bits"


def test_export_consolidates_a_sharded_checkpoint_for_one_process_and_transformers(
    tmp_path, shared, monkeypatch
):
    import transformers

    from trainer.checkpoint import load_model_file
    from trainer.models.hf_llama import from_hf_state_dict
    from trainer.models.llama import Llama

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    out, root = shared(2, "sharded")
    ckpt = root / "checkpoints" / "step-00000004"
    done = run_cli("export", str(ckpt), str(tmp_path / "export"), cwd=tmp_path)
    assert done.returncode == 0, done.stderr

    trained = Llama(LLAMA)  # the run's final weights, gathered by its rank 0
    with torch.no_grad():
        for p, values in zip(trained.parameters(), out["params"], strict=True):
            p.copy_(torch.tensor(values).view_as(p))
    fresh = Llama(LLAMA)
    fresh.load_state_dict(from_hf_state_dict(load_model_file(tmp_path / "export" / "model.safetensors")))
    hf = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "export").eval()
    tokens = torch.randint(0, LLAMA.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = trained(tokens)
        torch.testing.assert_close(fresh(tokens), expected, atol=1e-5, rtol=0)
        torch.testing.assert_close(hf(tokens).logits, expected, atol=1e-5, rtol=0)


def test_the_8b_preset_is_sharded_over_four_ranks_on_meta_without_allocating_it(tmp_path):
    run_ranks(4, SCRIPTS / "shard_report_script.py", str(tmp_path), timeout=300)
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(4)]
    assert sum(r["local_numel"] for r in reports) == 8_030_261_248
    for r in reports:
        assert r["meta"] and r["rss_mb"] < 500, "nothing of the 32 GB model may be allocated"
        assert r["shards"]["tok_embeddings.weight"] == [128256 // 4, 4096]
        assert r["shards"]["layers.0.feed_forward.w1.weight"] == [14336 // 4, 4096]


def test_meta_materialisation_gives_the_values_of_an_unsharded_init(tmp_path):
    run_ranks(2, SCRIPTS / "shard_report_script.py", str(tmp_path), "tiny", timeout=300)
    for r in range(2):
        report = json.loads((tmp_path / f"rank{r}.json").read_text())
        assert report["equal"] and report["tensors"] == 39


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"zero_stage": 4}, "zero_stage=4 is invalid; allowed: 1, 2 or 3"),
        ({"zero_stage": 1, "cpu_offload": True}, "cpu_offload=True needs zero_stage 2 or 3"),
        ({"replicate": 0}, "replicate=0 is invalid"),
        ({"activation_checkpointing": "some"}, "activation_checkpointing='some' is invalid"),
        ({"reduce_dtype": "fp8"}, "reduce_dtype='fp8' is invalid"),
    ],
)
def test_bad_fsdp_arguments_are_named(kwargs, match):
    with pytest.raises(ValueError, match=match):
        FSDPStrategy(**kwargs)


def test_a_mesh_that_does_not_divide_the_world_and_fp16_scaling_are_refused_before_spawning():
    with pytest.raises(ValueError, match="replicate=3 does not divide the world of 4 processes"):
        Trainer(strategy=FSDPStrategy(replicate=3), devices=4)
    with pytest.raises(ValueError, match="precision '16-mixed' needs a gradient scaler FSDP2 lacks"):
        Trainer(strategy=FSDPStrategy(), devices=2, precision="16-mixed")
    # stage 1 is DDP underneath, whose gradients the scaler unscales: fp16 is allowed there
    trainer = Trainer(strategy=FSDPStrategy(zero_stage=1), devices=2, precision="16-mixed")
    assert trainer.strategy.precision.name == "16-mixed"


def test_a_checkpoint_of_another_model_or_stage_is_refused(tmp_path, shared):
    out, root = shared(2, "small")
    ckpt = root / "checkpoints" / "step-00000002"
    shared(2, "fresh-regression")  # --resume in a root of its own: nothing to resume, it started fresh
    target = tmp_path / "regression2" / "checkpoints"
    target.mkdir(parents=True)
    shutil.copytree(ckpt, target / ckpt.name)
    done, _ = run_script(2, FSDP_SCRIPT, tmp_path, "regression2", "--stage", "3", "--resume", check=False)
    assert done.returncode != 0 and "does not fit this model" in done.stderr
    args = ["--model", "llama", "--stage", "1", "--resume"]
    done, _ = run_script(2, FSDP_SCRIPT, tmp_path, "regression2", *args, check=False)
    assert done.returncode != 0 and (
        "was written by ddp, dp_sgd, fsdp with zero_stage 2/3 or parallel3d; this FSDPStrategy reads "
        "checkpoints written by fsdp with zero_stage=1" in done.stderr
    ), done.stderr[-2000:]
