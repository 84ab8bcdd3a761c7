"""`Trainer(activation_checkpointing=...)` on one process and under DDP, as under FSDP: measured on what
it changes (the bytes the forward keeps for the backward), and on what it must leave alone (the losses).
A checkpointing that is silently ignored trains exactly like none, so both are checked."""

from __future__ import annotations

import pytest
import torch
from dist_common import ActivationProbe, ScriptLM
from helpers import DDP_SCRIPT, LLAMA, read_metrics, run_script, script_result, token_loader
from test_fsdp import single_llama
from torch import nn

from strategies import FSDPStrategy
from trainer import Trainer, TrainModule


def one_process(tmp_path, mode: str | None) -> tuple[dict, dict[int, float]]:
    """(bytes the first forward kept for backward, losses) of an 8-step run as the distributed scripts'
    reference runs it: the whole global batch of 16 in one process."""
    torch.manual_seed(0)
    probe = ActivationProbe()
    Trainer(
        max_steps=8,
        activation_checkpointing=mode,
        gradient_clip_val=0.5,
        seed=0,
        log_every_n_steps=1,
        enable_progress_bar=False,
        enable_checkpointing=False,
        default_root_dir=tmp_path / str(mode),
    ).fit(ScriptLM(LLAMA, lr=1e-2, probe=probe), token_loader(16))
    return probe.report, read_metrics(tmp_path / str(mode))


def test_one_process_checkpointing_keeps_fewer_activations_and_the_same_losses(tmp_path):
    runs = {mode: one_process(tmp_path, mode) for mode in (None, "selective", "full")}
    saved = {mode: runs[mode][0]["saved_bytes"] for mode in runs}
    held = {mode: runs[mode][0]["forward_bytes"] for mode in runs}
    # autograd itself saves little outside the checkpointed blocks (measured 2.87 MB without, 0.24 MB
    # with either mode); inside them "selective" keeps the matmul/attention outputs, so after the
    # forward it holds more than "full" and less than none (measured 1.62 MB, 0.24 MB and 2.86 MB)
    for mode in ("selective", "full"):
        assert saved[mode] < saved[None] / 5, f"{mode}: {saved[mode]} bytes saved, {saved[None]} without"
    assert held["full"] < 0.8 * held["selective"] and held["selective"] < 0.8 * held[None], held
    for mode in ("selective", "full"):
        for step, loss in runs[None][1].items():
            assert abs(runs[mode][1][step] - loss) <= 1e-6, (
                f"{mode}, step {step}: {runs[mode][1][step]} vs {loss}"
            )


@pytest.mark.slow
def test_ddp_checkpointing_matches_one_process_and_keeps_fewer_activations(tmp_path):
    args = ["--model", "llama", "--trainer-ac", "full", "--report-activations"]
    _, root = run_script(2, DDP_SCRIPT, tmp_path, "ddp", *args)
    out = script_result(tmp_path, "ddp")
    plain, _ = one_process(tmp_path, None)
    # each DDP rank holds half the batch: half the activations, and checkpointing keeps a fraction of that
    assert out["activations"]["saved_bytes"] < plain["saved_bytes"] / 10, (out["activations"], plain)
    _, single = single_llama(tmp_path)
    got = read_metrics(root)
    for step, loss in single.items():
        assert abs(got[step] - loss) <= 1e-5, f"step {step}: ddp+full {got[step]} vs one process {loss}"


def test_the_trainer_and_the_strategy_must_agree(tmp_path):
    with pytest.raises(
        ValueError, match="Trainer activation_checkpointing='selective' but FSDPStrategy was built"
    ):
        Trainer(
            strategy=FSDPStrategy(activation_checkpointing="full"),
            activation_checkpointing="selective",
            default_root_dir=tmp_path,
        )
    same = Trainer(
        strategy=FSDPStrategy(activation_checkpointing="full"),
        activation_checkpointing="full",
        default_root_dir=tmp_path,
    )
    assert same.strategy.activation_checkpointing == "full"
    with pytest.raises(
        ValueError, match=r"activation_checkpointing='some' is invalid; allowed: None, 'full'"
    ):
        Trainer(activation_checkpointing="some", default_root_dir=tmp_path)


def test_checkpointing_a_model_without_blocks_is_refused(tmp_path):
    class Flat(TrainModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Linear(4, 1)

        def forward(self, x):
            return self.net(x)

        def training_step(self, batch, batch_idx):
            return self(batch[0]).pow(2).mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    trainer = Trainer(
        activation_checkpointing="full", max_steps=1, enable_progress_bar=False, default_root_dir=tmp_path
    )
    with pytest.raises(ValueError, match="Flat declares none: add the hook"):
        trainer.fit(Flat(), [(torch.randn(2, 4),)])


def test_selective_checkpointing_keeps_attention_under_every_kernel_torch_may_pick():
    """Each forward kernel of `scaled_dot_product_attention` (flash, memory-efficient and cuDNN on CUDA, not
    only the CPU's) is saved, not rerun in the backward; a kernel a later torch adds fails here."""
    from torch.utils.checkpoint import CheckpointPolicy

    from strategies.techniques.activation_checkpointing import _policy

    # every registered forward kernel but a composite one (it decomposes into bmm/softmax before any
    # dispatch mode sees it: its bmm are saved)
    names = [
        name.removeprefix("aten::")
        for name in torch._C._dispatch_get_all_op_names()
        if name.startswith("aten::_scaled_dot_product")
        and not name.endswith("_backward")
        and "." not in name
        and not torch._C._dispatch_has_kernel_for_dispatch_key(name, "CompositeImplicitAutograd")
    ]
    kernels = [getattr(torch.ops.aten, name).default for name in names]
    assert len(kernels) >= 4, kernels
    for op in kernels:
        assert _policy(None, op) == CheckpointPolicy.MUST_SAVE, op
    assert _policy(None, torch.ops.aten.silu.default) == CheckpointPolicy.PREFER_RECOMPUTE
