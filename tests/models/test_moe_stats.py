"""MoE auxiliary losses and router statistics from the user's side: the load-balancing and z-losses add
the gradient of their formulas (computed here from the router inputs in plain PyTorch) in the plain and
the pipeline-stage loss paths, and an accumulated step logs and trains as one big batch."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from helpers import fit, read_metrics

from strategies.techniques.pp.stages import stage_view
from trainer.models.causal_lm import CausalLM
from trainer.models.llama import LlamaConfig
from trainer.models.moe import Router

VOCAB, SEQ = 32, 16


def tiny_moe_lm(**router: object) -> LlamaConfig:
    """The tiny MoE Llama (blocks 1-3 MoE, 8 experts, top-2), dropless, with `router` fields set."""
    config = LlamaConfig.preset("moe-tiny", vocab_size=VOCAB, max_seq_len=SEQ)
    config.moe = dataclasses.replace(config.moe, **router)
    return config


def independent_aux_and_z(
    x: torch.Tensor, weight: torch.Tensor, top_k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Switch load balancing E * sum_e f_e P_e (f_e: fraction of the N*k top-k choices that picked e, P_e:
    mean softmax probability) and the router z-loss mean_t logsumexp(logits_t)^2, from x (N, dim)."""
    logits = x.float() @ weight.float().T
    probs = torch.softmax(logits, -1)
    n_experts = logits.shape[-1]
    chosen = F.one_hot(probs.topk(top_k, -1).indices, n_experts).sum((0, 1)).float()
    aux = n_experts * (chosen / chosen.sum() * probs.mean(0)).sum()
    return aux, torch.logsumexp(logits, -1).pow(2).mean()


def batch(seed: int = 0) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, VOCAB, (2, SEQ + 1), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids[:, :-1], "labels": ids[:, 1:]}


def loss_of(module: CausalLM, data: dict[str, torch.Tensor], pipelined: bool) -> torch.Tensor:
    """The training loss through `training_step`, or through two pipeline stages and `pipeline_loss`."""
    if not pipelined:
        return module.training_step(data, 0)["loss"]
    model = module.model
    first, last = stage_view(model, ["0", "1"], True, False), stage_view(model, ["2", "3"], False, True)
    logits, aux = last(*first(data["input_ids"]))
    return module.pipeline_loss((logits, aux), data["labels"])["loss"]


@pytest.mark.parametrize("pipelined", [False, True], ids=["training_step", "pipeline_stages"])
def test_aux_and_z_losses_add_the_gradient_of_their_formulas(pipelined: bool) -> None:
    aux_coef, z_coef = 0.5, 0.05  # large, so their share of the gradient is far above rounding
    grads, expected = [], None
    for coefs in ((0.0, 0.0), (aux_coef, z_coef)):
        torch.manual_seed(0)
        module = CausalLM(tiny_moe_lm(aux_loss_coef=coefs[0], z_loss_coef=coefs[1]))
        module.configure_model()
        routers = [m for m in module.modules() if isinstance(m, Router)]
        inputs: list[torch.Tensor] = []
        for router in routers:
            router.register_forward_pre_hook(lambda _, args, seen=inputs: seen.append(args[0]))
        loss = loss_of(module, batch(), pipelined)
        params = [p for p in module.parameters() if p.requires_grad]
        if coefs[0]:  # the formulas' gradient, through every path from the weights to the router inputs
            formula = sum(
                aux_coef * aux + z_coef * z
                for aux, z in (
                    independent_aux_and_z(x, r.gate.weight, 2) for x, r in zip(inputs, routers, strict=True)
                )
            )
            expected = torch.autograd.grad(formula, params, retain_graph=True, allow_unused=True)
        loss.backward()
        grads.append([p.grad if p.grad is not None else torch.zeros_like(p) for p in params])
    assert len(inputs) == 3
    router_ids = {id(r.gate.weight) for r in routers}
    for p, without, with_aux, want in zip(params, *grads, expected, strict=True):
        want = torch.zeros_like(p) if want is None else want
        if id(p) in router_ids:
            assert want.abs().max() > 1e-3  # the losses do move the routers
        torch.testing.assert_close(with_aux - without, want, atol=2e-6, rtol=1e-4)


class SGDLM(CausalLM):
    """CausalLM with plain SGD: every factor on the gradient shows in the update."""

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_an_accumulated_step_logs_and_trains_as_one_big_batch(tmp_path) -> None:
    g = torch.Generator().manual_seed(0)
    big = []
    for _ in range(2):
        ids = torch.randint(0, VOCAB, (4, SEQ + 1), generator=g)
        labels = ids[:, 1:].clone()
        # the first micro-batch has 6 labelled tokens of the 32 it routes, the second all 32
        labels[:2, : SEQ - 3] = -100
        big.append({"input_ids": ids[:, :-1], "labels": labels})
    micro = [{k: v[rows] for k, v in b.items()} for b in big for rows in (slice(0, 2), slice(2, 4))]
    config = tiny_moe_lm(aux_loss_coef=0.0, z_loss_coef=0.5, bias_update_rate=1e-2)
    runs = {}
    for name, data, accumulate in (("big", big, 1), ("accumulated", micro, 2)):
        module = SGDLM(config)
        fit(module, data, tmp_path / name, steps=2, accumulate_grad_batches=accumulate)
        runs[name] = module
    for (name, a), b in zip(runs["big"].named_parameters(), runs["accumulated"].parameters(), strict=True):
        torch.testing.assert_close(b, a, atol=1e-6, rtol=1e-5, msg=name)
    names = ["z_loss", "load_min", "load_max", "load_cv", "imbalance", "dropped_frac", "bias_min", "bias_max"]
    names += [f"load_e{i}" for i in range(8)]
    for name in names:
        got, want = (read_metrics(tmp_path / run, f"moe/{name}") for run in ("accumulated", "big"))
        assert got == pytest.approx(want, abs=1e-5), name
    assert sum(read_metrics(tmp_path / "big", f"moe/load_e{i}")[1] for i in range(8)) == 3 * 4 * SEQ * 2
