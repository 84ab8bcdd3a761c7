"""The logged speed counts the samples and tokens of every batch form a loader may yield: a tuple whose
first element is the token ids, the ids tensor alone, a dict with `input_ids` among other tensors, and
float features (samples only). trainer/trainer.py's perf_counter is a fake clock that moves 1 s per
micro-batch, so every rate is exact: a batch's samples (tokens) per second."""

from __future__ import annotations

import pytest
import torch
from helpers import FakeClock, fake_time, fit, read_metrics

from trainer import TrainModule

BATCH, SEQ = 4, 6  # deliberately different: a count taken along the wrong axis shows


class AnyBatchLM(TrainModule):
    """Predicts each token from itself, whatever form the batch has; 1 fake second per micro-batch."""

    def __init__(self, clock: FakeClock) -> None:
        super().__init__()
        self.clock = clock
        self.emb = torch.nn.Embedding(16, 8)
        self.head = torch.nn.Linear(8, 16)

    def training_step(self, batch, batch_idx):
        self.clock.advance(1.0)
        if isinstance(batch, dict):
            ids = batch["input_ids"]
        elif isinstance(batch, (list, tuple)):
            ids = batch[0]
        else:
            ids = batch
        if ids.is_floating_point():  # (features, target): a regression
            return torch.nn.functional.mse_loss(self.head(ids[:, :8]).sum(-1, keepdim=True), batch[1])
        return torch.nn.functional.cross_entropy(self.head(self.emb(ids)).flatten(0, 1), ids.flatten())

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def ids() -> torch.Tensor:
    return torch.randint(0, 16, (BATCH, SEQ))


BATCHES = {
    "tuple of ids and labels": lambda: (ids(), ids()),
    "ids tensor alone": ids,
    "dict with a shared mask before input_ids": lambda: {
        "causal_mask": torch.ones(SEQ, SEQ, dtype=torch.bool).tril(),
        "input_ids": ids(),
    },
}


@pytest.mark.parametrize("form", list(BATCHES))
def test_samples_and_tokens_per_second_count_the_token_batch(tmp_path, monkeypatch, form):
    clock = FakeClock()
    fake_time(monkeypatch, "trainer.loop.step_log", clock, "perf_counter")
    loader = [BATCHES[form]() for _ in range(3)]
    fit(AnyBatchLM(clock), loader, tmp_path, 3, enable_checkpointing=False)
    assert read_metrics(tmp_path, "train/samples_per_s") == {1: BATCH, 2: BATCH, 3: BATCH}
    assert read_metrics(tmp_path, "train/tokens_per_s") == {1: BATCH * SEQ, 2: BATCH * SEQ, 3: BATCH * SEQ}


def test_float_features_count_samples_and_no_tokens(tmp_path, monkeypatch):
    clock = FakeClock()
    fake_time(monkeypatch, "trainer.loop.step_log", clock, "perf_counter")
    loader = [(torch.randn(BATCH, SEQ + 4), torch.randn(BATCH, 1)) for _ in range(3)]
    fit(AnyBatchLM(clock), loader, tmp_path, 3, enable_checkpointing=False)
    assert read_metrics(tmp_path, "train/samples_per_s") == {1: BATCH, 2: BATCH, 3: BATCH}
    assert read_metrics(tmp_path, "train/tokens_per_s") == {}
