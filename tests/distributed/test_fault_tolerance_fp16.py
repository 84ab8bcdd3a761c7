"""fp16 with its loss scaler across torchft replica groups: two one-process groups average the gradients
the backward's buckets copy unscaled, and when one group's gradients overflow (inf) both skip that step and
lower their scale alike (the other group used to apply the inf its average took in): found in the average's
buckets (a small model), in the groups' overflow flags summed over the groups (a model past PASS_ELEMENTS), or
in those flags summed with a token-weighted loss's count. Checked by SGD against one process that reads the union of the groups' batches and overflows
at the same step."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from helpers import Regression, call_ranks, fit, regression_loader

pytest.importorskip("torchft")

STEPS, BATCH, OVERFLOW_AT = (
    4,
    8,
    2,
)  # per group; the step whose loss is inf in group 1 (all of it, in one process)


class Overflowing(Regression):
    """`Regression` by SGD whose loss is inf at step OVERFLOW_AT in the group that reads the odd samples;
    `tokens`: the loss reports a count, one a sample (the loss x its count is back-propagated: the scaler
    starts lower by the count, 8 in a group's batch, 16 in one process's)."""

    def __init__(self, overflows: bool, tokens: bool) -> None:
        super().__init__(lr=0.1, optimizer="sgd")
        self.overflows, self.tokens = overflows, tokens

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        loss = loss * math.inf if self.overflows and self.trainer.global_step == OVERFLOW_AT else loss
        return {"loss": loss, "num_tokens": torch.tensor(len(batch[0]))} if self.tokens else loss


def group(replica: int, lighthouse: str, root: str, check: str) -> None:
    """Replica group `replica` of 2 under the lighthouse; its final weights, skipped steps and scale to
    ROOT/<replica>.json."""
    from trainer.fault_tolerance import FaultTolerance, overflow

    if check == "flags":  # as for a model past it
        overflow.PASS_ELEMENTS = 0
    torch.manual_seed(0)
    module = Overflowing(overflows=replica == 1, tokens=check == "tokens")
    ft = FaultTolerance(lighthouse, replica, replicas=2, min_replicas=2, timeout_s=60, quorum_timeout_s=60)
    trainer = fit(module, regression_loader(BATCH), Path(root) / f"group{replica}", STEPS,
                  fault_tolerance=ft, precision="16-mixed", enable_checkpointing=False)  # fmt: skip
    (Path(root) / f"{replica}.json").write_text(json.dumps(result(module, trainer)))


def result(module: torch.nn.Module, trainer) -> dict:
    return {
        "params": [p.detach().flatten().tolist() for p in module.parameters()],
        "skipped": trainer.state.skipped_steps,
        "scale": trainer.strategy.precision.scaler.get_scale(),
    }


@pytest.mark.parametrize("check", ["average", "flags", "tokens"])
def test_a_peers_overflow_skips_the_step_in_every_group_and_the_rest_is_one_process(tmp_path, check):
    from trainer.fault_tolerance.lighthouse import start_lighthouse

    server = start_lighthouse("127.0.0.1:0", min_replicas=2)
    address = f"127.0.0.1:{server.address().rpartition(':')[2]}"
    try:
        call_ranks(group, 2, address, str(tmp_path), check)
    finally:
        server.shutdown()

    torch.manual_seed(0)
    reference = Overflowing(
        overflows=True, tokens=check == "tokens"
    )  # the union of both groups' batches in one batch
    trainer = fit(reference, regression_loader(2 * BATCH), tmp_path / "one", STEPS, precision="16-mixed",
                  enable_checkpointing=False)  # fmt: skip
    expected = result(reference, trainer)
    assert expected["skipped"] == 1
    got = [json.loads((tmp_path / f"{replica}.json").read_text()) for replica in (0, 1)]
    assert got[0] == got[1], "the groups differ"
    # with a token count a group's scale started at twice one process's (its batches hold half the tokens)
    assert (got[0]["skipped"], got[0]["scale"]) == (
        expected["skipped"],
        expected["scale"] * (2 if check == "tokens" else 1),
    )
    for i, (g, e) in enumerate(zip(got[0]["params"], expected["params"], strict=True)):
        g, e = torch.tensor(g), torch.tensor(e)
        # fp16 forwards of a half batch and of the whole one round alike to ~1e-3; a gradient left scaled
        # (65536x) or not averaged (2x) is far outside
        assert torch.allclose(g, e, rtol=1e-3, atol=1e-4), (
            f"parameter {i} differs by {(g - e).abs().max():.2e}"
        )
