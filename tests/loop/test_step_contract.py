"""The strategy owns the step: a strategy may run all micro-batches of an optimizer step its own way
(as a pipeline schedule or DP-SGD does) and choose how the data is read, while the Trainer's loop,
normalisation, clipping order and logging stay the same."""

from __future__ import annotations

import torch
from helpers import Regression, TokenMeanLM, quiet, read_metrics, regression_loader, uneven_token_data
from torch.utils.data import DataLoader, Subset

from callbacks import Callback
from strategies import SingleDeviceStrategy
from strategies.step_output import StepOutput
from trainer import Trainer


class OneForwardPerStep(SingleDeviceStrategy):
    """Concatenates the step's micro-batches and runs one forward+backward over all of them."""

    def __init__(self) -> None:
        super().__init__()
        self.windows: list[int] = []

    def train_step(self, module, micro_batches, first_batch_idx):
        self.windows.append(len(micro_batches))
        x = torch.cat([b[0] for b in micro_batches])
        y = torch.cat([b[1] for b in micro_batches])
        loss = module.training_step((x, y), first_batch_idx)
        self.backward(loss)
        return StepOutput(loss.detach())


class Order(Callback):
    """Records the gradient norm the step's hooks see, in the order they fire."""

    def __init__(self) -> None:
        self.events: list[tuple[str, float]] = []

    def norm(self, module) -> float:
        return float(torch.nn.utils.get_total_norm([p.grad for p in module.parameters()]))

    def on_after_backward(self, trainer, module):
        self.events.append(("after_backward", self.norm(module)))

    def on_before_zero_grad(self, trainer, module, optimizer):  # after the step: the gradients it took
        self.events.append(("before_zero_grad", self.norm(module)))


def fit(module, loader, root, strategy="auto", **kwargs):
    order = Order()
    trainer = Trainer(
        strategy=strategy,
        max_steps=5,
        gradient_clip_val=0.05,
        seed=0,
        default_root_dir=root,
        enable_checkpointing=False,
        callbacks=[order],
        **quiet(**kwargs),
    )
    trainer.fit(module, loader)
    return trainer, order


def test_a_strategy_that_runs_the_whole_step_itself_trains_like_accumulation(tmp_path):
    torch.manual_seed(0)
    reference = Regression()
    _, ref_order = fit(reference, regression_loader(batch_size=4), tmp_path / "a", accumulate_grad_batches=4)
    torch.manual_seed(0)
    module, strategy = Regression(), OneForwardPerStep()
    _, order = fit(
        module, regression_loader(batch_size=4), tmp_path / "b", strategy=strategy, accumulate_grad_batches=4
    )
    assert strategy.windows == [4] * 5, "the strategy gets each step's micro-batches at once"
    for a, b in zip(reference.parameters(), module.parameters(), strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)
    # the Trainer still clips after on_after_backward and before the optimizer step, and logs the step
    assert [e for e, _ in order.events] == ["after_backward", "before_zero_grad"] * 5
    assert all(n <= 0.05 * (1 + 1e-5) for e, n in order.events if e == "before_zero_grad")
    assert all(n > 0.05 for e, n in order.events if e == "after_backward")
    for (event, got), (_, expected) in zip(order.events, ref_order.events, strict=True):
        assert abs(got - expected) <= 1e-5 * expected, (
            f"{event}: grad norm {got} vs accumulation's {expected}"
        )
    ref_losses, losses = read_metrics(tmp_path / "a"), read_metrics(tmp_path / "b")
    assert sorted(losses) == [1, 2, 3, 4, 5]
    assert all(abs(losses[s] - ref_losses[s]) < 1e-6 for s in losses)


def test_after_backward_sees_the_gradient_of_the_mean_loss_of_the_step(tmp_path):
    """Token-weighted accumulation back-propagates token *sums*; by on_after_backward they are divided by
    the step's token count, so `.grad` equals autograd's gradient of the mean loss over the whole step."""
    data = uneven_token_data()
    torch.manual_seed(0)
    module = TokenMeanLM()
    expected_model = TokenMeanLM()
    expected_model.load_state_dict(module.state_dict())
    seen = []

    class Grab(Callback):
        def on_after_backward(self, trainer, module):
            if not seen:
                seen.extend(p.grad.detach().clone() for p in module.parameters())

    Trainer(
        max_steps=1,
        accumulate_grad_batches=4,
        default_root_dir=tmp_path,
        enable_checkpointing=False,
        callbacks=[Grab()],
        **quiet(),
    ).fit(module, DataLoader(data, batch_size=4))
    ids, labels = data[:16]
    logits = expected_model.head(expected_model.emb(ids))
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
    loss.backward()
    for got, p in zip(seen, expected_model.parameters(), strict=True):
        torch.testing.assert_close(got, p.grad, atol=1e-6, rtol=1e-5)


def test_a_strategy_decides_which_data_its_rank_reads(tmp_path):
    class EvenSamplesOnly(SingleDeviceStrategy):
        def process_dataloader(self, loader, seed, train=True):
            if not train:
                return loader
            dataset = loader.dataset
            return DataLoader(Subset(dataset, range(0, len(dataset), 2)), batch_size=loader.batch_size)

    seen = []

    class Recording(Regression):
        def training_step(self, batch, batch_idx):
            seen.append(batch[0])
            return super().training_step(batch, batch_idx)

    loader = regression_loader(batch_size=16, n=64)
    Trainer(
        strategy=EvenSamplesOnly(),
        max_epochs=1,
        default_root_dir=tmp_path,
        enable_checkpointing=False,
        **quiet(),
    ).fit(Recording(), loader)
    x = loader.dataset.tensors[0]
    torch.testing.assert_close(torch.cat(seen), x[0::2])
