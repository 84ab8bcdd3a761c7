"""DPO's frozen reference model is rebuilt with the module, so it is neither saved in checkpoints (which
hold the policy: half the size) nor counted in the start line's "all params" (the policy's, as PEFT and
transformers count them); a resume is still exact, and one against a reference with other weights is
refused in one line. A tiny Hugging Face Llama, one process."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import SCRIPTS, read_metrics, run_ranks
from hf_dpo_script import GLOBAL_BATCH, LR, pair_loader, tiny_llama
from hf_script import trainer_kwargs
from safetensors import safe_open
from transformers import AutoModelForCausalLM

from callbacks import ModelCheckpoint
from trainer import Trainer
from trainer.checkpoint import MODEL_FILE
from trainer.checkpoint.export import export_checkpoint
from trainer.models.hf import HFModule


def dpo_fit(root, steps: int, ckpt_path=None, reference=None) -> tuple[HFModule, Trainer]:
    module = HFModule(tiny_llama(seed=0), task="dpo", reference=reference, lr=LR)
    trainer = Trainer(**trainer_kwargs(root, steps), callbacks=[ModelCheckpoint(every_n_steps=2)])
    trainer.fit(module, pair_loader(GLOBAL_BATCH), ckpt_path=ckpt_path)
    return module, trainer


def test_checkpoints_hold_the_policy_only_and_resume_exactly(tmp_path, caplog):
    caplog.set_level("INFO", logger="trainer")
    straight, trainer = dpo_fit(tmp_path / "straight", 4)
    policy = {n for n, _ in straight.named_parameters() if not n.startswith("reference.")}
    ckpt = trainer.checkpoint_dir / "step-00000002"
    with safe_open(ckpt / MODEL_FILE, "pt") as f:
        assert set(f.keys()) == policy
    count = straight.model.num_parameters()  # transformers' count of the policy
    assert count == sum(p.numel() for n, p in straight.named_parameters() if n in policy)
    line = f"HFModule: trainable params: {count:,} || all params: {count:,} || trainable%: 100.0000 |"
    assert line in caplog.text

    resumed, _ = dpo_fit(tmp_path / "resumed", 4, ckpt_path=ckpt)
    for (name, got), want in zip(
        resumed.state_dict(keep_vars=False).items(), straight.state_dict().items(), strict=True
    ):
        assert name == want[0] and torch.equal(got, want[1]), name
    for (name, got), want in zip(
        resumed.reference.state_dict().items(), straight.reference.state_dict().values(), strict=True
    ):
        assert torch.equal(got, want), name  # the initial weights, kept: the reference trains never

    exported = export_checkpoint(trainer.checkpoint_dir / "step-00000004", tmp_path / "export")
    reloaded = AutoModelForCausalLM.from_pretrained(exported.parent)
    for name, want in straight.model.state_dict().items():
        assert torch.equal(reloaded.state_dict()[name], want), name

    with pytest.raises(ValueError) as err:  # the same policy resumed against another reference
        dpo_fit(tmp_path / "other", 4, ckpt_path=ckpt, reference=tiny_llama(seed=1))
    line = str(err.value)
    assert "\n" not in line and line.startswith("the checkpoint was trained against a DPO reference model"), (
        line
    )


@pytest.mark.slow
def test_under_ddp_and_fsdp_the_sharded_checkpoint_holds_the_policy_only_and_resumes_exactly(tmp_path):
    out = tmp_path / "out.json"
    run_ranks(
        2, SCRIPTS / "hf_dpo_resume_script.py", "--out", str(out), "--root", str(tmp_path), torchrun=True
    )
    policy = sorted(n for n, _ in HFModule(tiny_llama(), task="dpo").model.named_parameters())
    for tag, keys in json.loads(out.read_text()).items():
        assert keys == ["model." + n for n in policy], tag
        straight, resumed = (read_metrics(tmp_path / tag / run) for run in ("straight", "resumed"))
        print(f"{tag}: straight {straight}, resumed {resumed}")
        assert sorted(resumed) == [3, 4] and all(resumed[s] == straight[s] for s in (3, 4)), tag
