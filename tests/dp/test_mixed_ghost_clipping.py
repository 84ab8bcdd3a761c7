"""Mixed ghost clipping (the default grad_sample_mode): per weight, Gram-matrix norms where 2 T^2 < rows x cols,
per-sample gradients otherwise; with the backward that skips the batch gradient, its norms, clipped sums and
DP-SGD updates equal an explicit loop over samples, in every mode."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from helpers import quiet
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import strategies.privacy.per_sample as per_sample
import strategies.privacy.per_sample_factored as factored
from strategies.dp_sgd import DPSGDStrategy
from strategies.privacy.per_sample import PerSampleGradients
from trainer import Trainer, TrainModule

B, T, VOCAB = 6, 8, 40


class Mixed(nn.Module):
    """At T = 8 (2 T^2 = 128): `embed` (40 x 16), `wide` (32 x 16) and `head` (T = 1) take Gram matrices;
    `small` (5 x 16) and `narrow` (3 x 32, called twice: T = 16) their per-sample gradients; `norm` is dense."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 16)
        self.small = nn.Embedding(5, 16)
        self.norm = nn.LayerNorm(16)
        self.wide = nn.Linear(16, 32)
        self.narrow = nn.Linear(32, 3)
        self.head = nn.Linear(3, 3)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.wide(self.norm(self.embed(tokens) + self.small(tokens % 5))))
        return self.head(torch.tanh(self.narrow(h) + self.narrow(h.flip(1))).mean(1))


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return torch.randint(0, VOCAB, (B, T), generator=g), torch.randint(0, 3, (B,), generator=g)


def one_at_a_time(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> dict[nn.Parameter, torch.Tensor]:
    """Per-sample gradients (B, *shape) by a loop of one-sample backwards."""
    rows = []
    for i in range(len(x)):
        model.zero_grad(set_to_none=True)
        F.cross_entropy(model(x[i : i + 1]), y[i : i + 1], reduction="sum").backward()
        rows.append([p.grad.clone() for p in model.parameters()])
    model.zero_grad(set_to_none=True)
    return {p: torch.stack([row[k] for row in rows]) for k, p in enumerate(model.parameters())}


def norms_of(grads: dict[nn.Parameter, torch.Tensor]) -> torch.Tensor:
    return torch.stack([g.flatten(1).pow(2).sum(1) for g in grads.values()]).sum(0).sqrt()


@pytest.mark.parametrize(
    "mode, reduction", [("mixed", "sum"), ("mixed", "mean"), ("hooks", "sum"), ("ghost", "sum")]
)
def test_norms_and_clipped_sums_equal_one_sample_at_a_time(monkeypatch, mode, reduction):
    torch.manual_seed(0)
    model, (x, y) = Mixed().double(), batch()
    expected = one_at_a_time(model, x, y)
    monkeypatch.setattr(factored, "_CHUNK_ELEMENTS", 200)  # per-sample gradients built 2 samples at a time
    taken: dict[str, list[tuple[int, int]]] = {"ghost": [], "instantiated": []}
    for kind, name in (("ghost", "ghost_sq_norms"), ("instantiated", "instantiated_sq_norms")):
        real = getattr(per_sample, name)

        def spy(parts, kind=kind, real=real):
            taken[kind].append((parts[0].rows, parts[0].cols))
            return real(parts)

        monkeypatch.setattr(per_sample, name, spy)

    engine = PerSampleGradients(model, loss_reduction=reduction, mode=mode)
    with engine.capture():
        loss = F.cross_entropy(model(x), y, reduction=reduction)
        engine.backward(loss)
    assert all(p.grad is None for p in model.parameters())  # no batch gradient was computed
    norms = engine.per_sample_norms()
    torch.testing.assert_close(norms, norms_of(expected), atol=1e-9, rtol=1e-9)
    C = float(norms.median())  # some samples clipped, some not
    factors = (C / (norms_of(expected) + 1e-6)).clamp(max=1.0)
    assert (factors < 1).any() and (factors == 1).any()
    result = engine.clip_and_accumulate(C)
    for p, g in expected.items():
        torch.testing.assert_close(result.grads[p], torch.tensordot(factors, g, dims=1), atol=1e-9, rtol=1e-9)

    weights = {"embed": (40, 16), "wide": (32, 16), "head": (3, 3), "small": (5, 16), "narrow": (3, 32)}
    by_gram = {"mixed": ["embed", "wide", "head"], "ghost": list(weights), "hooks": []}[mode]
    assert sorted(taken["ghost"]) == sorted(weights[n] for n in by_gram)
    assert sorted(taken["instantiated"]) == sorted(weights[n] for n in weights if n not in by_gram)


class Doubling(nn.Module):
    """Its first layer's output is doubled in place after the layer returned it."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = nn.Linear(4, 8), nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.first(x)
        h.mul_(2.0)
        return self.second(torch.tanh(h))


def test_an_output_changed_in_place_gets_the_gradient_of_what_its_layer_returned():
    model = Doubling().double()
    x, y = torch.randn(B, 4, dtype=torch.float64), torch.randint(0, 2, (B,))
    expected = one_at_a_time(model, x, y)
    engine = PerSampleGradients(model, loss_reduction="sum")
    with engine.capture():
        engine.backward(F.cross_entropy(model(x), y, reduction="sum"))
    assert model.first.weight.grad is None  # the restricted backward ran
    torch.testing.assert_close(engine.per_sample_norms(), norms_of(expected), atol=1e-9, rtol=1e-9)


def test_a_parameter_used_outside_its_modules_forward_is_named_after_the_restricted_backward():
    model = nn.ModuleDict({"a": nn.Linear(3, 3), "b": nn.Linear(3, 3)})
    engine = PerSampleGradients(model)
    with engine.capture():
        engine.backward((model.a(torch.randn(B, 3)) @ model.b.weight.T).sum())
    with pytest.raises(RuntimeError, match=r"\['b.weight'\]"):
        engine.per_sample_norms()


def test_under_backward_a_norm_layer_keeps_its_per_sample_gradients_not_its_input():
    model, (x, y) = Mixed(), batch()
    engine = PerSampleGradients(model)
    (norm,) = [layer for layer in engine._layers if layer.name == "norm"]
    with engine.capture():
        loss = F.cross_entropy(model(x), y, reduction="sum")
        loss.backward(retain_graph=True)  # another backward may follow: the input stays
        assert norm.calls[0].args[0].shape == (B, T, 16)
        engine.backward(loss)  # the last one: (B, 16) per-sample gradients, not the (B, T, 16) input
        assert norm.calls[0].args == () and [t["weight"].shape for t in norm.calls[0].terms] == [(B, 16)] * 2


class Classifier(TrainModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = Mixed()
        self.seen: list[tuple[torch.Tensor, torch.Tensor]] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        self.seen.append((x.clone(), y.clone()))
        return F.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.5)


def test_a_noise_free_dpsgd_step_is_the_explicit_clipped_mean_applied_by_sgd(tmp_path):
    torch.manual_seed(0)
    module = Classifier()
    start = copy.deepcopy(module.net)
    x, y = batch()
    data = TensorDataset(torch.cat([x, x.flip(0)]), torch.cat([y, y.flip(0)]))
    strategy = DPSGDStrategy(noise_multiplier=0.0, max_grad_norm=0.05, poisson_sampling=False, noise_seed=0)
    Trainer(
        strategy=strategy, max_steps=2, default_root_dir=tmp_path, enable_checkpointing=False, **quiet()
    ).fit(module, DataLoader(data, batch_size=B))
    assert strategy.grad_sample_mode == "mixed"
    for xs, ys in module.seen:  # SGD on the mean of the clipped per-sample gradients, by hand
        grads = one_at_a_time(start, xs, ys)
        factors = (0.05 / (norms_of(grads) + 1e-6)).clamp(max=1.0)
        assert (factors < 1).all()
        with torch.no_grad():
            for p, g in grads.items():
                p -= 0.5 * torch.tensordot(factors, g, dims=1) / len(xs)
    for (name, p), q in zip(module.net.named_parameters(), start.parameters(), strict=True):
        torch.testing.assert_close(p, q, atol=1e-6, rtol=1e-5, msg=lambda m, name=name: f"{name}: {m}")
