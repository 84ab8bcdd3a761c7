"""Expert parallelism: the all-to-all dispatcher equals the local one, EP layouts (real gloo worlds of 2
and 4 torchrun processes, alone and composed with FSDP, HSDP, tensor and pipeline parallelism, activation
checkpointing and bf16) train the tiny MoE Llama like one process, with uneven routing and gradient
clipping, log the router statistics of all ranks, an EP checkpoint resumes, experts that do not split
over FSDP's ranks are sharded on their inner dim (and their checkpoint exports whole), and bad degrees fail
in one line before any process starts."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from helpers import (
    REPO,
    SCRIPTS,
    assert_validated,
    failure,
    launch_layouts,
    read_metrics,
    reference_run,
    run_cli,
)
from moe_script import GLOBAL_BATCH, MODEL, make_run, tiny_moe
from safetensors.torch import load_file

from strategies import Parallel3DStrategy
from strategies.techniques.ep.all_to_all import AllToAllDispatcher
from trainer.checkpoint.export import export_checkpoint
from trainer.models.causal_lm import CausalLM
from trainer.models.llama import LlamaConfig
from trainer.models.moe import GroupedExperts, LocalDispatcher, MoE, MoEConfig

SCRIPT = SCRIPTS / "moe_script.py"
STEPS = 5
# the all-to-all changes no sum; FSDP's reduce-scatters, tp's partial router gradients and the gradient
# norm do: measured ~5e-7 in losses and norms, ~1e-5 in weights
LOSS_TOL, PARAM_TOL = 1e-5, 1e-4
# bf16-mixed against the fp32 reference: measured 1.3e-3 in the losses, 9e-3 in the norms (of ~1.9); its
# weights are not compared: Adam moves a weight whose gradient is ~0 by up to lr per step in either
# direction, so bf16 rounding alone makes them differ by 2e-2, more than the whole run moves them
BF16_LOSS_TOL, BF16_NORM_TOL = 5e-3, 3e-2
# every router statistic rank 0 logs: the loads are counts, the rest follow from them and the z-losses
STATS = ("load_min", "load_max", "load_cv", "imbalance", "dropped_frac", "z_loss", "bias_min", "bias_max")
STATS_TOL = 1e-4
# the load-balancing loss and capacity dropping on: under tp they are decided on the whole sequence
AUX_TP_ROUTER = {"aux_loss_coef": 0.01, "capacity_factor": 1.0}
AUX_TP_MODEL = tiny_moe(8, **AUX_TP_ROUTER)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """One process, the same model, data, global batch and seed: step losses, gradient norms, val losses,
    weights and router statistics."""
    return one_process(tmp_path_factory.mktemp("reference"), MODEL)


@pytest.fixture(scope="module")
def reference_e6(tmp_path_factory):
    """The same, for the tiny MoE with 6 routed experts (3 per ep rank of 2: not divisible by FSDP's 2)."""
    return one_process(tmp_path_factory.mktemp("reference-e6"), tiny_moe(6))


@pytest.fixture(scope="module")
def reference_aux_tp(tmp_path_factory):
    """One process for 2 dp ranks x tp 2 with the load-balancing loss and capacity dropping: both depend on
    the batch a forward routes, so each step is 2 accumulated micro-batches, each the sequences one dp
    rank reads (rows 0, 2 and 1, 3 of a global batch: the loader deals samples to ranks in turn), and
    validation routes the same batches."""
    root = tmp_path_factory.mktemp("reference-aux-tp")
    trainer, module, train, val = make_run(
        root, STEPS, GLOBAL_BATCH, model=AUX_TP_MODEL, accumulate=2, val_batches=4
    )
    trainer.fit(module, dp_rank_batches(train, STEPS), dp_rank_batches(val, 2))
    weights = {n: p.detach() for n, p in module.named_parameters()}
    metrics = (read_metrics(root), read_metrics(root, "train/grad_norm"), read_metrics(root, "val/loss"))
    return (*metrics, weights, router_stats(root, AUX_TP_MODEL.moe.n_experts))


def dp_rank_batches(loader, n: int) -> list[dict]:
    """The first `n` batches of `loader`, each as the two halves 2 dp ranks read of it, in turn."""
    batches = [b for b, _ in zip(loader, range(n), strict=False)]
    return [{k: v[rows] for k, v in b.items()} for b in batches for rows in ([0, 2], [1, 3])]


def one_process(root: Path, model: LlamaConfig) -> tuple:
    """`reference_run` of `model` under `root`, with the router statistics it logged."""
    run = functools.partial(make_run, model=model)
    return (*reference_run(run, root, STEPS, GLOBAL_BATCH), router_stats(root, model.moe.n_experts))


def router_stats(root: Path, n_experts: int) -> dict[str, dict[int, float]]:
    """moe/<statistic> -> step -> value, every statistic and per-expert load the run logged."""
    names = (*STATS, *(f"load_e{i}" for i in range(n_experts)))
    return {name: read_metrics(root, f"moe/{name}") for name in names}


def launch(tmp: Path, nproc: int, layouts: list[dict], timeout: float = 400) -> dict:
    return launch_layouts(SCRIPT, tmp, nproc, layouts, STEPS, timeout)


def assert_trains_like_one_process(
    tmp: Path, tag: str, result: dict, reference, steps=range(1, STEPS + 1), bf16: bool = False
) -> None:
    losses, norms, val_losses, weights, stats = reference
    runs = tmp / "runs" / tag
    got, got_norms, got_val = (
        read_metrics(runs),
        read_metrics(runs, "train/grad_norm"),
        read_metrics(runs, "val/loss"),
    )
    loss_tol, norm_tol = (BF16_LOSS_TOL, BF16_NORM_TOL) if bf16 else (LOSS_TOL, LOSS_TOL)
    for step in steps:
        assert norms[step] > 0.5, f"step {step}: norm {norms[step]} below the clip value, clipping idle"
        assert abs(got_norms[step] - norms[step]) <= norm_tol, (
            f"{tag}: step {step} norm {got_norms[step]} vs {norms[step]}"
        )
        assert abs(got[step] - losses[step]) <= loss_tol, (
            f"{tag}: step {step} loss {got[step]} vs {losses[step]}"
        )
    assert abs(got_val[STEPS] - val_losses[STEPS]) <= loss_tol, f"{tag}: val loss {got_val} vs {val_losses}"
    assert set(result["params"]) == set(weights), f"{tag}: parameter names differ"
    for name, expected in weights.items() if not bf16 else ():
        diff = (torch.tensor(result["params"][name]) - expected).abs().max().item()
        assert diff <= PARAM_TOL, f"{tag}: {name} differs by {diff:.2e} from one process"
    assert_validated(runs, max(steps), with_loss=True)  # the layout's own save path
    # (source rank, expert) pairs that sent no rows: the uneven case happened
    assert result["empty_chunks"] > 0, f"{tag}: every rank sent rows to every expert"
    if not bf16:  # (bf16 rounding may flip a routing choice)
        got_stats = {name: read_metrics(runs, f"moe/{name}") for name in stats}
        assert_logs_router_stats_of_all_ranks(tag, got_stats, stats, steps)


def assert_logs_router_stats_of_all_ranks(tag: str, got: dict, expected: dict, steps) -> None:
    """Rank 0 logs the statistics of every rank's tokens, every stage's layers and every micro-batch of the
    step (a pipeline's): one process's."""
    for step in steps:
        for name in expected:
            diff = abs(got[name][step] - expected[name][step])
            assert diff <= STATS_TOL, (
                f"{tag}: step {step} moe/{name} {got[name][step]} vs {expected[name][step]}"
            )


@pytest.mark.slow
def test_two_ranks_expert_parallel_trains_like_one_process(tmp_path, reference):
    ckpt = str(tmp_path / "ep2-step3.ckpt")
    layouts = [
        # a DCP checkpoint of the sharded experts after step 3 of a run that goes on (and still trains like one
        # process)
        {"tag": "ep2", "ep": 2, "save": ckpt, "save_at": 3},
        {"tag": "ep2-resumed", "ep": 2, "resume": ckpt},
        # the backward recomputes each block's forward, all-to-alls included
        {"tag": "ep2-checkpointed", "ep": 2, "activation_checkpointing": "full"},
        {"tag": "ep2-bf16", "ep": 2, "precision": "bf16-mixed"},
    ]
    results = launch(tmp_path, 2, layouts)
    assert results["dispatcher"] <= 1e-5, f"all-to-all dispatcher differs by {results['dispatcher']}"
    assert_trains_like_one_process(tmp_path, "ep2", results["ep2"], reference)
    assert_trains_like_one_process(
        tmp_path, "ep2-resumed", results["ep2-resumed"], reference, range(4, STEPS + 1)
    )
    assert_trains_like_one_process(tmp_path, "ep2-checkpointed", results["ep2-checkpointed"], reference)
    assert_trains_like_one_process(tmp_path, "ep2-bf16", results["ep2-bf16"], reference, bf16=True)


FOUR_RANKS = [
    {"tag": "ep4", "ep": 4},
    {"tag": "dp4-ep2", "ep": 2},  # experts also FSDP-sharded over the 2-rank "expert" mesh
    {"tag": "hsdp2-ep2", "dp_replicate": 2, "dp_shard": 2, "ep": 2},
    # each tp rank computes its sequence shard; the ep ranks are the tp ranks, FSDP over the dp ranks
    {"tag": "ep2-tp2", "ep": 2, "tp": 2},
    # each stage's MoE layers exchange tokens with the other dp rank of the stage; aux losses ride along
    {"tag": "ep2-pp2", "ep": 2, "pp": 2},
]


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # the export reads DCP in one process
def test_four_ranks_expert_parallel_layouts_train_like_one_process(
    tmp_path, reference, reference_e6, reference_aux_tp
):
    ckpt = tmp_path / "e6.ckpt"
    # 6 experts: 3 per ep rank over a 2-rank "expert" mesh; FSDP would pad dim 0 to 2 experts per rank, so
    # it shards their inner dim (w1, w3: dim 64; w2: ffn 32) instead, 3 experts x half the rows on each rank
    uneven = {"tag": "dp4-ep2-e6", "ep": 2, "experts": 6, "save": str(ckpt)}
    aux_tp = {"tag": "ep2-tp2-aux", "ep": 2, "tp": 2, "router": AUX_TP_ROUTER}
    results = launch(tmp_path, 4, [*FOUR_RANKS, uneven, aux_tp])
    assert results["dispatcher"] <= 1e-5, f"all-to-all dispatcher differs by {results['dispatcher']}"
    for layout in FOUR_RANKS:
        assert_trains_like_one_process(tmp_path, layout["tag"], results[layout["tag"]], reference)
    # (FSDP's placement, ep's): whole experts where they divide (dim 0 of ep's shard, a strided shard of
    # the whole), their inner dim where they do not
    assert results["dp4-ep2"]["expert_placements"] == ["(_StridedShard(dim=0, sf=2), Shard(dim=0))"]
    assert results["dp4-ep2-e6"]["expert_placements"] == ["(Shard(dim=1), Shard(dim=0))"]
    assert_trains_like_one_process(tmp_path, "dp4-ep2-e6", results["dp4-ep2-e6"], reference_e6)
    # DCP wrote each rank's dim-1 shard at its offsets: the consolidated export is one process's weights
    exported = load_file(export_checkpoint(ckpt, tmp_path / "export"))
    for name, expected in reference_e6[3].items():
        diff = (exported[name] - expected).abs().max().item()
        assert diff <= PARAM_TOL, f"exported {name} differs by {diff:.2e} from one process"
    # tp ranks route halves of a sequence: the balancing loss and capacity of the whole, as one process's
    assert reference_aux_tp[4]["dropped_frac"][1] > 0, "capacity dropped no pair"
    assert_trains_like_one_process(tmp_path, "ep2-tp2-aux", results["ep2-tp2-aux"], reference_aux_tp)


@pytest.fixture
def one_rank_group(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()


def test_all_to_all_dispatcher_on_one_rank_equals_local(one_rank_group):
    torch.manual_seed(0)
    config = MoEConfig(n_experts=8, top_k=2, moe_ffn_dim=16, capacity_factor=0.8)  # some pairs dropped
    moe = MoE(12, config)
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.3)
    x = torch.randn(2, 10, 12)
    outs = []
    for dispatcher in (LocalDispatcher(), AllToAllDispatcher(one_rank_group)):
        moe.dispatcher = dispatcher
        moe.zero_grad()
        moe.reset_stats()
        xi = x.clone().requires_grad_(True)
        y = moe(xi)
        (y * torch.linspace(-1, 1, 12)).sum().backward()
        outs.append((y.detach(), xi.grad, [p.grad.clone() for p in moe.parameters()], moe.stats["load"]))
    (y0, gx0, gp0, load0), (y1, gx1, gp1, load1) = outs
    torch.testing.assert_close(y1, y0, rtol=0, atol=1e-6)
    torch.testing.assert_close(gx1, gx0, rtol=0, atol=1e-6)
    for a, b in zip(gp1, gp0, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    assert torch.equal(load1, load0) and load0.sum() < 2 * 20  # per-expert load as before; pairs dropped


def test_grouped_experts_without_rows_still_give_zero_gradients():
    experts = GroupedExperts(8, 16, 4)
    for p in experts.parameters():
        torch.nn.init.normal_(p)
    experts(torch.zeros(0, 8, requires_grad=True), torch.zeros(4, dtype=torch.long)).sum().backward()
    assert all(p.grad is not None and not p.grad.any() for p in experts.parameters())


def _strategy_checks(strategy: Parallel3DStrategy, module, world: int) -> None:
    strategy.devices, strategy.num_nodes = world, 1
    strategy.parallel_dims().resolve(world)
    strategy.check_module(module)


def test_bad_expert_parallel_degrees_fail_in_one_line():
    moe6 = LlamaConfig.preset("moe-tiny", moe=dict(n_experts=6, top_k=2, moe_ffn_dim=32))
    with pytest.raises(ValueError, match="E=6 experts are not divisible by ep") as err:
        _strategy_checks(Parallel3DStrategy(ep=4), CausalLM(moe6), 4)
    assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match=r"ep=3 does not divide dp_shard\*cp\*tp = 4") as err:
        Parallel3DStrategy(ep=3).parallel_dims().resolve(4)
    assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match="needs a MoE model"):
        _strategy_checks(Parallel3DStrategy(ep=2), CausalLM(LlamaConfig.preset("tiny")), 2)
    with pytest.raises(ValueError, match="with tp=2 and pp=2: .* not with both at once") as err:
        Parallel3DStrategy(ep=2, tp=2, pp=2)
    assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match="tp=2 with pp=2 on a MoE model") as err:
        _strategy_checks(Parallel3DStrategy(tp=2, pp=2), CausalLM(MODEL), 4)
    assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match="ep=0 is invalid"):
        Parallel3DStrategy(ep=0)
    for fits in (dict(ep=2), dict(ep=2, tp=2), dict(ep=2, pp=2)):  # no error
        _strategy_checks(Parallel3DStrategy(**fits), CausalLM(MODEL), 4)


@pytest.mark.slow
def test_the_moe_recipe_trains_with_expert_parallelism_and_logs_its_router(tmp_path):
    root = tmp_path / "run"
    done = run_cli(
        "fit", str(REPO / "recipes" / "moe_tiny.yaml"), "trainer.max_steps=40", "trainer.warmup_steps=4",
        "trainer.val_check_interval=20", "trainer.log_every_n_steps=5", f"trainer.default_root_dir={root}",
        cwd=tmp_path, ranks=2,
    )  # fmt: skip
    assert done.returncode == 0, failure(done.stderr)
    rows = [json.loads(line) for line in (root / "logs" / "metrics.jsonl").read_text().splitlines()]
    losses = [r["train/loss"] for r in rows if "train/loss" in r]
    assert losses[-1] < losses[0] - 1.0, losses
    assert all("moe/imbalance" in r and "moe/aux_loss" in r for r in rows if "train/loss" in r)
    assert (root / "export" / "model.safetensors").exists()
