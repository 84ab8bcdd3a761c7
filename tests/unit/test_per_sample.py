"""Per-sample gradients (strategies/privacy/per_sample.py) equal gradients computed one sample at a time, for models
built as a user builds them; ghost clipping gives the same norms and clipped sums; unsupported modules are
refused by name."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from strategies.privacy.per_sample import PerSampleGradients
from trainer.models.llama import Llama, LlamaConfig

B = 4
Batch = tuple[torch.Tensor, ...]
Losses = Callable[[nn.Module, Batch], torch.Tensor]  # one loss per sample, (b,)


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(6, 8), nn.LayerNorm(8), nn.Tanh(), nn.Linear(8, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class CNN(nn.Module):
    """Strided, grouped, dilated, 'same' and non-zero padding convolutions, 2-D and 1-D, with GroupNorm."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, stride=2, padding=1)
        self.norm = nn.GroupNorm(2, 4)
        # "same" with an odd total padding (3): one more row/column at the end than at the start
        self.grouped = nn.Conv2d(4, 4, 2, padding="same", dilation=3, groups=2, padding_mode="reflect")
        self.conv1d = nn.Conv1d(4, 6, 3, stride=2, padding=1, padding_mode="circular")
        self.grouped1d = nn.Conv1d(6, 6, 2, groups=3, bias=False)
        self.head = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.grouped(torch.tanh(self.norm(self.conv(x))))  # (b, 4, 4, 4)
        h = self.grouped1d(torch.tanh(self.conv1d(h.flatten(2))))  # (b, 6, 7)
        return self.head(h.mean(-1))


class Text(nn.Module):
    """Embedding with a padding index, torch's RMSNorm, a Linear over (b, T, D), mean pooling (the padding
    tokens' outputs count too, so only the embedding's own rule keeps its padding row at zero)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(11, 6, padding_idx=0)
        self.norm = nn.RMSNorm(6)
        self.proj = nn.Linear(6, 6)
        self.head = nn.Linear(6, 2)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.proj(self.norm(self.embed(tokens)))).mean(1))


class Gain(nn.Module):
    """A custom leaf owning a parameter: no rule, so the torch.func fallback."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.linspace(0.5, 1.5, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x) * self.gain + x


class RMSNorm(nn.Module):
    """Named like Llama's RMSNorm but scaling by exp(weight): the engine must not apply Llama's rule."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.eps = 1e-6
        self.weight = nn.Parameter(torch.full((dim,), 0.3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight.exp()


class Custom(nn.Module):
    """A frozen layer, one Linear called twice, custom leaves, and a parameter of the root module itself."""

    def __init__(self) -> None:
        super().__init__()
        self.frozen = nn.Linear(5, 5).requires_grad_(False)
        self.shared = nn.Linear(5, 5)
        self.gain = Gain(5)
        self.norm = RMSNorm(5)
        self.head = nn.Linear(5, 2)
        self.offset = nn.Parameter(torch.tensor([0.2, -0.1]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.shared(torch.tanh(self.shared(self.frozen(x))))
        return self.head(self.norm(self.gain(h))) * self.offset.exp()


def classify(model: nn.Module, batch: Batch) -> torch.Tensor:
    x, y = batch
    return F.cross_entropy(model(x), y, reduction="none")


def next_token(model: nn.Module, batch: Batch) -> torch.Tensor:
    (tokens,) = batch
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.transpose(1, 2), tokens[:, 1:], reduction="none").mean(1)


def tiny_llama() -> Llama:
    config = LlamaConfig(
        vocab_size=64, dim=32, n_layers=2, n_heads=2, n_kv_heads=1, ffn_hidden=24,
        max_seq_len=8, rope_theta=10000.0, tie_embeddings=True,
    )  # fmt: skip
    model = Llama(config)
    assert model.output.weight is model.tok_embeddings.weight
    with torch.no_grad():  # norms away from 1, so a wrong RMSNorm rule shows
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(torch.randn_like(p) * 0.3)
    return model


def case(name: str) -> tuple[nn.Module, Batch, Losses]:
    """A float64 model, a batch of B samples and its per-sample loss."""
    torch.manual_seed(0)
    labels = torch.randint(0, 3, (B,))
    if name == "mlp":
        model, batch, losses = MLP(), (torch.randn(B, 6), labels), classify
    elif name == "cnn":
        model, batch, losses = CNN(), (torch.randn(B, 3, 8, 8), labels), classify
    elif name == "text":
        tokens = torch.randint(0, 11, (B, 12))
        tokens[:, -3:] = 0  # padding
        model, batch, losses = Text(), (tokens, labels % 2), classify
    elif name == "llama":
        model, batch, losses = tiny_llama(), (torch.randint(0, 64, (B, 9)),), next_token
    else:
        model, batch, losses = Custom(), (torch.randn(B, 5), labels % 2), classify
    return model.double(), tuple(t.double() if t.is_floating_point() else t for t in batch), losses


CASES = ["mlp", "cnn", "text", "llama", "custom"]


def reference(model: nn.Module, batch: Batch, losses: Losses) -> dict[nn.Parameter, torch.Tensor]:
    """Per-sample gradients by a loop of batches of one sample."""
    params = list(dict.fromkeys(p for p in model.parameters() if p.requires_grad))
    rows = []
    for i in range(B):
        model.zero_grad(set_to_none=True)
        losses(model, tuple(t[i : i + 1] for t in batch)).sum().backward()
        rows.append([torch.zeros_like(p) if p.grad is None else p.grad.clone() for p in params])
    model.zero_grad(set_to_none=True)
    return {p: torch.stack([row[k] for row in rows]) for k, p in enumerate(params)}


def norms_of(grads: dict[nn.Parameter, torch.Tensor]) -> torch.Tensor:
    return torch.stack([g.flatten(1).pow(2).sum(1) for g in grads.values()]).sum(0).sqrt()


def clipped_sum(
    grads: dict[nn.Parameter, torch.Tensor], factors: torch.Tensor
) -> dict[nn.Parameter, torch.Tensor]:
    return {p: torch.tensordot(factors, g, dims=1) for p, g in grads.items()}


def capture(engine: PerSampleGradients, model: nn.Module, batch: Batch, losses: Losses) -> torch.Tensor:
    """One forward/backward of the whole batch under capture; returns the batch loss."""
    with engine.capture():
        per_sample = losses(model, batch)
        loss = per_sample.mean() if engine.loss_reduction == "mean" else per_sample.sum()
        loss.backward()
    return loss


def assert_close(actual: dict, expected: dict, atol: float = 1e-6) -> None:
    assert actual.keys() == expected.keys()
    for p in expected:
        torch.testing.assert_close(actual[p], expected[p], atol=atol, rtol=1e-5)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("name", CASES)
def test_hooks_per_sample_gradients_norms_and_clipped_sum_equal_one_sample_at_a_time(name, reduction):
    model, batch, losses = case(name)
    expected = reference(model, batch, losses)
    engine = PerSampleGradients(model, loss_reduction=reduction, mode="hooks")
    capture(engine, model, batch, losses)
    grads = engine.per_sample_grads()
    assert_close(grads, expected)
    norms = engine.per_sample_norms()
    torch.testing.assert_close(norms, norms_of(expected), atol=1e-6, rtol=1e-6)
    C = float(norms.median())  # some samples clipped, some not
    factors = (C / (norms + 1e-6)).clamp(max=1.0)
    assert (factors < 1).any() and (factors == 1).any()
    clipped_norms = norms_of({p: g * factors.view(-1, *[1] * (g.dim() - 1)) for p, g in grads.items()})
    assert (clipped_norms <= C).all()
    result = engine.clip_and_accumulate(C)
    torch.testing.assert_close(result.norms, norms_of(expected), atol=1e-6, rtol=1e-6)
    assert_close(result.grads, clipped_sum(expected, factors))


@pytest.mark.parametrize("name", CASES)
def test_ghost_norms_and_clipped_sum_equal_one_sample_at_a_time(name):
    model, batch, losses = case(name)
    expected = reference(model, batch, losses)
    reduction = "sum" if name == "llama" else "mean"
    engine = PerSampleGradients(model, loss_reduction=reduction, mode="ghost")
    capture(engine, model, batch, losses)
    norms = engine.per_sample_norms()
    torch.testing.assert_close(norms, norms_of(expected), atol=1e-6, rtol=1e-6)
    C = float(norms.median())
    result = engine.clip_and_accumulate(C)
    assert_close(result.grads, clipped_sum(expected, (C / (norms_of(expected) + 1e-6)).clamp(max=1.0)))


def test_ghost_never_materialises_the_weights_it_can_factor(monkeypatch):
    """In the tied Llama every weight is a Linear or the embedding, each cheaper by Gram matrices at T=8:
    ghost mode must not build a single per-sample weight gradient. Every layer has a rule (RMSNorm too):
    the torch.func fallback is never used."""
    model, batch, losses = case("llama")
    engine = PerSampleGradients(model, mode="ghost")
    built, materialise = [], engine._materialised
    monkeypatch.setattr(engine, "_materialised", lambda p: built.append(p) or materialise(p))
    monkeypatch.setattr(engine, "_vmap_rule", lambda layer, *_: pytest.fail(f"fallback for {layer.name}"))
    capture(engine, model, batch, losses)
    engine.clip_and_accumulate(1.0)
    assert built and all(p.dim() == 1 for p in built), "only the RMSNorm weights may be materialised"


@pytest.mark.parametrize("mode", ["hooks", "ghost"])
def test_per_layer_clipping_bounds_each_layer_by_its_share(mode):
    model, batch, losses = case("text")
    expected = reference(model, batch, losses)
    engine = PerSampleGradients(model, mode=mode, clipping="per_layer")
    capture(engine, model, batch, losses)
    layers = {
        "embed": [model.embed.weight],
        "norm": [model.norm.weight],
        "proj": [model.proj.weight, model.proj.bias],
    }
    layers["head"] = [model.head.weight, model.head.bias]
    assert engine.layer_names == list(layers)
    layer_norms = engine.per_layer_norms()
    C = 0.5 * float(engine.per_sample_norms().median())
    budget = C / len(layers) ** 0.5
    want, clipped_any = {}, False
    for name, params in layers.items():
        reference_norms = norms_of({p: expected[p] for p in params})
        torch.testing.assert_close(layer_norms[name], reference_norms, atol=1e-6, rtol=1e-6)
        factors = (budget / (reference_norms + 1e-6)).clamp(max=1.0)
        clipped_any |= bool((factors < 1).any())
        clipped = {p: expected[p] * factors.view(-1, *[1] * p.dim()) for p in params}
        assert (norms_of(clipped) <= budget).all()
        want.update(clipped_sum({p: expected[p] for p in params}, factors))
    assert clipped_any
    assert_close(engine.clip_and_accumulate(C).grads, want)


@pytest.mark.parametrize("mode", ["hooks", "ghost"])
def test_huge_max_grad_norm_gives_the_batch_gradient_times_B_and_clears_grad(mode):
    model, batch, losses = case("llama")
    engine = PerSampleGradients(model, loss_reduction="mean", mode=mode)
    capture(engine, model, batch, losses)
    batch_grads = {p: p.grad.clone() for p in engine.params}
    result = engine.clip_and_accumulate(1e9)
    assert_close(result.grads, {p: g * B for p, g in batch_grads.items()})
    assert all(p.grad is None for p in engine.params)
    with pytest.raises(RuntimeError, match="nothing was captured"):  # the data is gone
        engine.per_sample_norms()


def test_two_backwards_in_one_capture_add_up():
    model, batch, losses = case("mlp")
    expected = reference(model, batch, losses)
    engine = PerSampleGradients(model, loss_reduction="sum")
    with engine.capture():
        per_sample = losses(model, batch)
        per_sample[:2].sum().backward(retain_graph=True)
        per_sample[2:].sum().backward()
    assert_close(engine.per_sample_grads(), expected)


def test_frozen_parameters_are_skipped():
    model, batch, losses = case("custom")
    engine = PerSampleGradients(model)
    assert not {id(model.frozen.weight), id(model.frozen.bias)} & {id(p) for p in engine.params}
    assert len(engine.params) == 7  # shared (2), gain, norm, head (2), offset
    capture(engine, model, batch, losses)
    result = engine.clip_and_accumulate(1.0)
    assert {id(p) for p in result.grads} == {id(p) for p in engine.params}


def test_capture_is_off_outside_the_context():
    model, batch, losses = case("mlp")
    engine = PerSampleGradients(model)
    hooked = lambda: sum(len(m._forward_hooks) for m in model.modules())  # noqa: E731
    with engine.capture():
        assert hooked() == 3  # the three modules owning parameters
    assert hooked() == 0
    losses(model, batch).mean().backward()  # an ordinary step outside: nothing recorded
    with pytest.raises(RuntimeError, match="nothing was captured"):
        engine.per_sample_norms()
    with pytest.raises(ValueError), engine.capture():  # an error inside removes the hooks and the data
        losses(model, batch).mean().backward()
        raise ValueError
    assert hooked() == 0
    with pytest.raises(RuntimeError, match="nothing was captured"):
        engine.per_sample_norms()


def test_batchnorm_is_refused_naming_the_submodule():
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU())
    with pytest.raises(ValueError, match=r"'1' \(BatchNorm2d\).*GroupNorm, LayerNorm"):
        PerSampleGradients(model)
    frozen = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3).requires_grad_(False))
    with pytest.raises(ValueError, match="'1'"):  # frozen, it still mixes the samples
        PerSampleGradients(frozen)


def test_modules_that_cannot_be_handled_are_named():
    with pytest.raises(ValueError, match=r"'rnn' \(LSTM\)"):
        PerSampleGradients(nn.ModuleDict({"rnn": nn.LSTM(3, 3)}))

    class Branchy(nn.Module):  # data-dependent Python control flow: torch.func cannot vmap it
        def __init__(self) -> None:
            super().__init__()
            self.scale = nn.Parameter(torch.ones(3))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x * self.scale if x.sum() > 0 else x

    model = nn.Sequential(nn.Linear(3, 3), Branchy())
    engine = PerSampleGradients(model)
    capture(engine, model, (torch.ones(B, 3),), lambda m, b: m(b[0]).sum(1))
    with pytest.raises(RuntimeError, match=r"'1' \(Branchy\)"):
        engine.per_sample_norms()


def test_a_parameter_used_outside_its_modules_forward_is_named():
    model = nn.ModuleDict({"a": nn.Linear(3, 3), "b": nn.Linear(3, 3)})
    engine = PerSampleGradients(model)
    capture(engine, model, (torch.randn(B, 3),), lambda m, b: (m.a(b[0]) @ m.b.weight.T).sum(1))
    with pytest.raises(RuntimeError, match=r"\['b.weight'\]"):
        engine.per_sample_norms()


def test_a_layer_seeing_another_batch_size_is_refused():
    model = nn.Sequential(nn.Embedding(5, 4), nn.Flatten(0, 1), nn.Linear(4, 2))  # (B*T, D) into the Linear
    engine = PerSampleGradients(model)
    capture(engine, model, (torch.randint(0, 5, (B, 3)),), lambda m, b: m(b[0]).sum(1))
    with pytest.raises(ValueError, match=r"'0': 4, '2': 12"):
        engine.per_sample_norms()
