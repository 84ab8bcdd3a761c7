"""DPO (HFModule(task="dpo")) on a tiny Hugging Face Llama: the loss and the logged rewards equal the paper's
formula written out here on each pair alone; the reference is frozen (a given model, the initial weights,
or under LoRA the base with its adapters disabled); DDP(2) and FSDP(2) train as one process does."""

from __future__ import annotations

import copy
import math

import datasets
import pytest
import torch
import torch.nn.functional as F
from helpers import SCRIPTS, failure, launch_layouts, read_metrics
from hf_dpo_script import GLOBAL_BATCH, LR, pair_loader, preference_records, tiny_llama, tokenizer
from hf_script import trainer_kwargs
from torch.utils.data import DataLoader

from trainer import Trainer
from trainer.data.hf_preference import preference_dataloaders
from trainer.models.hf import HFModule

SCRIPT = SCRIPTS / "hf_dpo_script.py"
LORA = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]}
RECORDS = preference_records(6, seed=3)
# DPO's default beta: the loss moves by beta times a log-probability's float32 rounding (~1e-6 at ~30 tokens)
CHECK_BETA = 0.1


def one_batch(records: list[dict[str, str]]) -> dict[str, torch.Tensor]:
    """All `records` as one batch of trainer.data.hf_preference, in their order."""
    data = datasets.Dataset.from_list(records)
    train, _ = preference_dataloaders(data, tokenizer(), seq_len=32, val_fraction=0, batch_size=1)
    return next(iter(DataLoader(train.dataset, batch_size=len(records), collate_fn=train.collate_fn)))


def response_logp(model, prompt: str, response: str) -> torch.Tensor:
    """log p(response + EOS | prompt) under `model`, the pair alone (no padding), summed token by token."""
    tok = tokenizer()
    p = tok(prompt, add_special_tokens=False)["input_ids"]
    ids = p + tok(response, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    with torch.no_grad():
        logp = model(input_ids=torch.tensor([ids])).logits[0].double().log_softmax(-1)
    return sum(logp[t - 1, ids[t]] for t in range(len(p), len(ids)))


def paper_dpo(policy, reference, records, beta: float) -> dict[str, float]:
    """Rafailov et al.'s sigmoid loss -log sigmoid(beta * ((pi_c - ref_c) - (pi_r - ref_r))), averaged over
    the pairs, with the mean rewards beta * (pi - ref), margin and accuracy."""
    losses, chosen, rejected = [], [], []
    for r in records:
        c = beta * (
            response_logp(policy, r["prompt"], r["chosen"])
            - response_logp(reference, r["prompt"], r["chosen"])
        )
        w = beta * (
            response_logp(policy, r["prompt"], r["rejected"])
            - response_logp(reference, r["prompt"], r["rejected"])
        )
        losses.append(-F.logsigmoid(c - w))
        chosen.append(c)
        rejected.append(w)
    n = len(records)
    return {
        "loss": float(sum(losses) / n),
        "rewards/chosen": float(sum(chosen) / n),
        "rewards/rejected": float(sum(rejected) / n),
        "rewards/margin": float(sum(c - w for c, w in zip(chosen, rejected, strict=True)) / n),
        "rewards/accuracy": sum(float(c > w) for c, w in zip(chosen, rejected, strict=True)) / n,
    }


def test_dpo_loss_and_rewards_equal_the_papers_formula_on_each_pair_alone(tmp_path):
    policy, reference = tiny_llama(seed=0), tiny_llama(seed=1)  # a reference unlike the policy: loss != log 2
    expected = paper_dpo(policy, reference, RECORDS, CHECK_BETA)
    module = HFModule(
        copy.deepcopy(policy), task="dpo", reference=copy.deepcopy(reference), beta=CHECK_BETA, lr=LR
    )
    assert not any(p.requires_grad for p in module.reference.parameters())
    batch = one_batch(RECORDS)
    out = module.training_step(batch, 0)
    print(f"DPO loss {out['loss'].item():.9f} vs independent {expected['loss']:.9f}; {expected}")
    assert abs(out["loss"].item() - expected["loss"]) <= 1e-6
    assert out["num_tokens"].item() == len(RECORDS) and abs(expected["loss"] - math.log(2)) > 1e-3

    # one step of a fit logs the same numbers (computed before the update) and trains only the policy
    before = {n: p.detach().clone() for n, p in module.reference.named_parameters()}
    Trainer(**trainer_kwargs(tmp_path, 1)).fit(module, [batch])
    for name, value in expected.items():
        logged = read_metrics(tmp_path, "train/loss" if name == "loss" else name)[1]
        assert logged == pytest.approx(value, abs=1e-6), name
    assert all(torch.equal(p, before[n]) for n, p in module.reference.named_parameters())
    assert module.reference.training is False  # fit put the module in training mode; the reference stays eval
    assert not torch.equal(module.model.model.embed_tokens.weight, policy.model.embed_tokens.weight)


@pytest.mark.filterwarnings(
    "error:.*is_gradient_checkpointing.*:FutureWarning"
)  # peft reads it: kept out of sight
def test_under_lora_the_reference_is_the_base_model_with_the_adapters_disabled():
    base = tiny_llama(seed=0)
    module = HFModule(copy.deepcopy(base), task="dpo", lora=LORA, beta=CHECK_BETA)
    assert module.reference is None
    batch = one_batch(RECORDS)
    assert abs(module.training_step(batch, 0)["loss"].item() - math.log(2)) <= 1e-6  # B = 0: policy == base
    g = torch.Generator().manual_seed(0)
    for name, p in module.model.named_parameters():
        if "lora_B" in name:  # as if the adapters had trained
            p.data.copy_(torch.randn(p.shape, generator=g))
    expected = paper_dpo(module.model, base, RECORDS, CHECK_BETA)
    assert abs(module.training_step(batch, 0)["loss"].item() - expected["loss"]) <= 1e-6
    assert abs(expected["loss"] - math.log(2)) > 1e-3


def test_bad_dpo_input_is_refused_in_one_line():
    with pytest.raises(ValueError, match=r"^beta=0 is invalid; allowed: a number > 0$"):
        HFModule(tiny_llama(), task="dpo", beta=0)
    with pytest.raises(
        ValueError, match=r"^reference= is DPO's reference model; allowed: it with task='dpo'"
    ):
        HFModule(tiny_llama(), reference=tiny_llama())
    module = HFModule(tiny_llama(), task="dpo")
    with pytest.raises(ValueError, match="the DPO batch lacks rejected_input_ids") as err:
        module.training_step({k: v for k, v in one_batch(RECORDS).items() if k != "rejected_input_ids"}, 0)
    assert "\n" not in str(err.value)
    missing = [{"prompt": "a", "chosen": "b"}] * 4
    with pytest.raises(ValueError, match=r"field 'rejected' is not in the dataset"):
        one_batch(missing)


# ---- two processes -------------------------------------------------------------------------------
@pytest.mark.slow
def test_dpo_under_ddp_and_fsdp_trains_as_one_process(tmp_path):
    steps = 4
    done = launch_layouts(SCRIPT, tmp_path, 2, [{"tag": "ddp"}, {"tag": "fsdp"}], steps, timeout=300)
    assert [d["world_size"] for d in done] == [2, 2]
    from hf_dpo_script import dpo_module

    Trainer(**trainer_kwargs(tmp_path / "single", steps)).fit(dpo_module(), pair_loader(GLOBAL_BATCH))
    for key in ("train/loss", "rewards/margin", "rewards/accuracy"):
        expected = read_metrics(tmp_path / "single", key)
        assert sorted(expected) == list(range(1, steps + 1)), key
        for tag in ("ddp", "fsdp"):
            got = read_metrics(tmp_path / "runs" / tag, key)
            print(
                f"{tag} {key}: max {max(abs(got[s] - v) for s, v in expected.items()):.2e} from one process"
            )
            for step, value in expected.items():
                assert abs(got[step] - value) <= 1e-5, (
                    f"{tag} step {step} {key}: {got[step]} vs one process {value}"
                )


# ---- the recipe ----------------------------------------------------------------------------------
@pytest.mark.slow
def test_dpo_recipe_raises_the_chosen_over_rejected_reward_margin(tmp_path):
    import json

    from helpers import run_cli

    repo = SCRIPT.parents[2]
    root = tmp_path / "dpo"
    done = run_cli(
        "fit", str(repo / "recipes" / "hf_dpo_tiny.yaml"), f"trainer.default_root_dir={root}",
        f"model.hf=new:{tmp_path / 'base'}", "trainer.max_steps=10", "trainer.log_every_n_steps=5",
        "trainer.val_check_interval=10", "trainer.limit_val_batches=1", cwd=repo,
    )  # fmt: skip
    assert done.returncode == 0, failure(done.stderr)
    rows = [json.loads(line) for line in (root / "logs" / "metrics.jsonl").read_text().splitlines()]
    margins = {r["step"]: r["rewards/margin"] for r in rows if "rewards/margin" in r}
    print(f"recipe margins by step: {margins}")
    assert sorted(margins) == [5, 10]
    # the reference is the initial policy, so the margin starts at 0 and a step's margin is its own batch's
    assert margins[10] > margins[5] + 0.2 > 0.2, margins
    assert [r["val_rewards/accuracy"] for r in rows if "val_rewards/accuracy" in r][-1] > 0.9


def test_a_policy_built_from_a_config_keeps_its_initial_weights_as_reference_after_the_seeded_draw(tmp_path):
    # HFModule draws a config-built model's weights again under Trainer(seed=...): the default reference
    # must be a copy of those weights, not of the ones drawn before, so the first step's margin is 0
    module = HFModule(tiny_llama().config, task="dpo", beta=CHECK_BETA, lr=LR)
    Trainer(**trainer_kwargs(tmp_path, 1)).fit(module, [one_batch(RECORDS)])
    for name in ("rewards/chosen", "rewards/rejected", "rewards/margin"):
        assert read_metrics(tmp_path, name)[1] == pytest.approx(0.0, abs=1e-6), name
