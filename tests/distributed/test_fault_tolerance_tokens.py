"""Token-weighted losses across torchft replica groups: two one-process groups whose batches hold about
fourfold different token counts (group 0 reads the even samples, with 8..12 labels each, group 1 the odd
ones, with 1..3) train, by SGD, the weights one process gets from the union of their batches with the
token-mean loss: each group weighs by its share of the step's tokens, not 1/2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import TokenMeanLM, call_ranks, fit, uneven_token_data
from torch.utils.data import DataLoader

pytest.importorskip("torchft")

STEPS, BATCH = 3, 4  # per group and micro-batch


def group(replica: int, lighthouse: str, root: str, accumulate: int) -> None:
    """Replica group `replica` (one process) of 2 under the lighthouse; its final weights to ROOT/<replica>.json."""
    from trainer.fault_tolerance import FaultTolerance

    torch.manual_seed(0)
    module = TokenMeanLM()
    ft = FaultTolerance(lighthouse, replica, replicas=2, min_replicas=2, timeout_s=60, quorum_timeout_s=60)
    loader = DataLoader(uneven_token_data(by_parity=True), batch_size=BATCH)
    fit(module, loader, Path(root) / f"group{replica}", STEPS, fault_tolerance=ft,
        accumulate_grad_batches=accumulate, enable_checkpointing=False)  # fmt: skip
    (Path(root) / f"{replica}.json").write_text(
        json.dumps([p.detach().flatten().tolist() for p in module.parameters()])
    )


@pytest.mark.parametrize("accumulate", [1, 2])  # both averaged by the backward's buckets (2: in its last)
def test_groups_with_different_token_counts_train_as_one_process(tmp_path, accumulate):
    from trainer.fault_tolerance.lighthouse import start_lighthouse

    server = start_lighthouse("127.0.0.1:0", min_replicas=2)
    address = f"127.0.0.1:{server.address().rpartition(':')[2]}"
    try:
        call_ranks(group, 2, address, str(tmp_path), accumulate)
    finally:
        server.shutdown()

    torch.manual_seed(0)
    reference = TokenMeanLM()  # the union of the groups' micro-batches in one batch
    loader = DataLoader(uneven_token_data(by_parity=True), batch_size=2 * BATCH * accumulate)
    fit(reference, loader, tmp_path / "one", STEPS, enable_checkpointing=False)
    expected = [p.detach().flatten() for p in reference.parameters()]
    torch.manual_seed(0)
    untrained = TokenMeanLM()
    for replica in (0, 1):
        got = [torch.tensor(p) for p in json.loads((tmp_path / f"{replica}.json").read_text())]
        for i, (g, e) in enumerate(zip(got, expected, strict=True)):
            assert torch.allclose(g, e, atol=1e-6), (
                f"group {replica}: parameter {i} differs by {(g - e).abs().max():.2e}"
            )
    assert not torch.allclose(expected[0], next(untrained.parameters()).flatten())
