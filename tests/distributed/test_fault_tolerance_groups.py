"""The cross-group average overlapped with the backward in replica groups of several processes: 2 groups x 2
gloo processes (DDP, then FSDP2, inside each group) under a lighthouse train a small LM by SGD, once with the
sums over the groups chained onto the group's own reduction from the backward (overlap_ddp.py: DDP's comm
hook; overlap_fsdp.py: FSDP2's all-reduce hook) and once with the flat average after the backward. Both give
the weights one process gets from the union of the 4 ranks' batches, and each other's, for a plain step,
gradient accumulation, a token-weighted loss (DDP: also accumulated) and (DDP) fp16 with its loss scaler (one rank of
group 1 overflows at step 1, as the one process does: every group skips it), and DDP's fp16 gradient
compression (the strategy's comm hook, which the sum over the groups follows). The overlapped arm's sums
went out from the backward: the hooks had launched them when the loop asked for the average, each rank
sending its slice of the group's sum (DDP: a half of each bucket; under the fp16 compression hook the whole
bucket) or its shard of it (FSDP2: 1 / 2; without clipping the whole unit the backward reduces last, summed
before the group's reduce-scatter, which carries the group's commit vote). Not at the first step (FSDP2: with
clipping, it is): a group's first DDP backward fills another bucket layout than later ones, and FSDP2's
shows which unit it reduces last, so every group averages after it. Also with a
quorum every 2 steps (the groups' flags summed right after one of the backward's sums), with the gradients
clipped by their norm, and (FSDP2) in two units, the embedding's reduced last. Every commit vote is the group's own sum (GroupVote), never a round trip to torchft's
manager server: with FSDP2 it rides the reduce-scatter of the last unit (no clipping; unless a token count's
sum over the groups follows) or the all-reduce of the gradients' norm; with DDP, where the backward's
buckets went around the group's ring, it went around with the last bucket's slices, or with a token-weighted
loss in the sum of the step's tokens over the group (after their sum over the groups); else it is an
all-reduce of its own."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import pytest
import torch
from helpers import TokenMeanLM, call_ranks, fit, join_world, uneven_token_data
from torch.utils.data import DataLoader, TensorDataset

from callbacks import Callback

pytestmark = pytest.mark.slow
pytest.importorskip("torchft")

GROUPS, RANKS, STEPS, BATCH = 2, 2, 3, 4  # BATCH: per rank and micro-batch
# name: the Trainer's arguments, whether the loss reports its tokens, the strategies that run it
RUNS = {
    "plain": ({}, False, ("ddp", "fsdp")),
    "accumulate": ({"accumulate_grad_batches": 2}, False, ("ddp", "fsdp")),
    "tokens": ({}, True, ("ddp", "fsdp")),
    # DDP's token sums accumulated over the window (`no_sync`), divided once after the last backward
    "accumulate-tokens": ({"accumulate_grad_batches": 2}, True, ("ddp",)),
    "fp16": ({"precision": "16-mixed"}, False, ("ddp",)),  # FSDP2 has no fp16 scaler (refused)
    # the strategy's own comm hook (DDP takes one): the sum over the groups chains onto it
    "compressed": ({"gradient_compression": "fp16"}, False, ("ddp",)),
    # FaultTolerance(quorum_every=2): step 1 keeps step 0's quorum, the groups' flags go with the sums
    "quorum": ({"quorum_every": 2}, False, ("ddp", "fsdp")),
    # the norm of the average clips it (the one process's step's norm is ~0.2-0.4)
    "clip": ({"gradient_clip_val": 0.05}, False, ("ddp", "fsdp")),
    # two FSDP2 units (the embedding its own): the one reduced last is summed whole, the other's shard as it is
    "blocks": ({}, False, ("fsdp",)),
}
FT_ARGS = ("quorum_every",)  # RUNS' arguments that are FaultTolerance's, not the Trainer's
ROUNDED = ("fp16", "compressed")  # fp16 forwards, or fp16 gradients in the group's all-reduce
OVERFLOWS = ("fp16",)  # the loss of rank 1 of group 1 (and the one process's) is inf at step 1
ARMS = ("overlapped", "flat")
KIND = {"ddp": "OverlappedGroupAverage", "fsdp": "OverlappedShardAverage"}


class OverflowingLM(TokenMeanLM):
    """`TokenMeanLM` whose loss (without a token count) is inf at step 1 where `overflows` (DDP's first averaged
    in the backward; a fit whose last loss is inf fails)."""

    def __init__(self, report_tokens: bool, overflows: bool, blocks: bool = False) -> None:
        super().__init__(report_tokens=report_tokens)
        self.overflows, self.blocks = overflows, blocks

    def transformer_blocks(self) -> list[torch.nn.Module]:
        return [self.emb] if self.blocks else []

    def training_step(self, batch, batch_idx):
        out = super().training_step(batch, batch_idx)
        return out * torch.inf if self.overflows and self.trainer.global_step == 1 else out


def data(tokens: bool) -> TensorDataset:
    """Token-weighted: 1..12 valid labels per sample, so ranks and groups hold different token counts.
    Otherwise every label is valid: the mean of the ranks' token means is the union's token mean."""
    if tokens:
        return uneven_token_data(n=128)
    ids, labels = uneven_token_data(n=128).tensors
    return TensorDataset(ids, torch.randint(0, 16, labels.shape, generator=torch.Generator().manual_seed(2)))


class ServerVoteRefused:
    """torchft's manager client, whose commit vote (a round trip to rank 0's manager server) fails the test."""

    def __init__(self, client) -> None:
        self.client = client

    def should_commit(self, *args, **kwargs):
        raise AssertionError("the commit vote went to the manager server")

    def __getattr__(self, name):
        return getattr(self.client, name)


class Probe(Callback):
    """The overlapped average the group built, and per step how many sums over the groups its hooks had
    launched from the backward when the loop asked for the average (its `finish`), the gradient elements
    they held, whether it gave the average, and whether the step joined a quorum."""

    def __init__(self) -> None:
        self.kind, self.launched, self.sent, self.used, self.quorum = None, [], [], [], []
        self.sending = 0
        self.flag_sums, self.flag_sending = [], 0  # per step: quorum_every's flags summed on their own
        self.folded = []  # per step: whether the commit vote had been summed already (the norm's, the ring's)
        self.early = []  # per step: whether it was summed with the gradients (the ring's, the reduce-scatter's)
        # the threads of this fit's torchft manager server and client, by name (an earlier fit's may linger)
        self.runtimes, self.before = {}, set(threads())

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.quorum.append(trainer._fit_loop.replicas._joined_at[0] == trainer.global_step - 1)
        names = [name for tid, name in threads().items() if tid not in self.before]
        self.runtimes = {name: names.count(name) for name in ("torchft-manager", "torchft-mgrclnt")}

    def on_after_backward(self, trainer, module):
        self.early.append(trainer._fit_loop.replicas._early_votes is not None)

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        vote = trainer._fit_loop.replicas.manager._client
        # the group's ranks vote over their own process group (GroupVote), not through torchft's manager server
        if not isinstance(vote.client, ServerVoteRefused):
            vote.client = ServerVoteRefused(vote.client)
            should_commit = vote.should_commit

            def recorded(*args, **kwargs):
                self.folded.append(vote.summed is not None)
                return should_commit(*args, **kwargs)

            vote.should_commit = recorded
        overlap = trainer._fit_loop.replicas.overlap
        if overlap is None or self.kind is not None:
            return
        self.kind, finish, allreduce = type(overlap).__name__, overlap.finish, overlap.direct.allreduce

        def sum_counted(tensor, op):
            if tensor is overlap.terms:  # the flags on their own (riding a sum, they are in its tensor)
                self.flag_sending += 1
            elif tensor.dtype != torch.float64:  # (float64: the step's token count)
                self.sending += tensor.numel()
            return allreduce(tensor, op)

        def counted(use, undo=1.0, extra=None):
            self.launched.append(overlap.launched)
            self.sent.append(self.sending)
            self.sending = 0
            self.used.append(finish(use, undo, extra))
            self.flag_sums.append(self.flag_sending)  # (finish sends them where the backward did not)
            self.flag_sending = 0
            return self.used[-1]

        overlap.finish = counted
        overlap.direct.allreduce = sum_counted


def threads() -> dict[str, str]:
    """This process's live threads: id -> name."""
    names = {}
    for task in Path("/proc/self/task").iterdir():
        with contextlib.suppress(OSError):  # a thread that ended since the listing
            names[task.name] = (task / "comm").read_text().strip()
    return names


def rank_main(rank: int, strategy: str, ports: list[int], lighthouses: dict[str, str], root: str) -> None:
    """Rank `rank % RANKS` of replica group `rank // RANKS`: every run of RUNS for `strategy`, both arms, one
    after another in the same group; the group's rank 0 writes its final weights and what its Probe saw."""
    import trainer.fault_tolerance.replica_group as replica_group
    from strategies import DDPStrategy
    from trainer.core.dtensors import full_value
    from trainer.fault_tolerance import FaultTolerance

    replica, local = divmod(rank, RANKS)
    join_world(local, RANKS, ports[replica], run_id=f"group{replica}")  # each group's store hosted here
    overlap_in_group = replica_group.overlap_in_group
    for name, (kwargs, tokens, strategies) in RUNS.items():
        if strategy not in strategies:
            continue
        for arm in ARMS:
            replica_group.overlap_in_group = overlap_in_group if arm == "overlapped" else lambda *_: None
            torch.manual_seed(0)
            overflows = name in OVERFLOWS and (replica, local) == (1, 1)
            module, probe = (
                OverflowingLM(report_tokens=tokens, overflows=overflows, blocks=name == "blocks"),
                Probe(),
            )
            compression = kwargs.get("gradient_compression")
            layout = DDPStrategy(gradient_compression=compression) if compression else strategy
            ft = FaultTolerance(
                lighthouses[f"{name}-{arm}"], replica, replicas=GROUPS, min_replicas=GROUPS,
                timeout_s=60, quorum_timeout_s=60,
                **{k: v for k, v in kwargs.items() if k in FT_ARGS and arm == "overlapped"},  # its flag rides the sums
            )  # fmt: skip
            loader = DataLoader(data(tokens), batch_size=BATCH)
            fit(module, loader, Path(root) / f"{name}-{arm}-{replica}", STEPS, strategy=layout,
                fault_tolerance=ft, callbacks=[probe], enable_checkpointing=False,
                **{k: v for k, v in kwargs.items() if k not in ("gradient_compression", *FT_ARGS)})  # fmt: skip
            weights = [full_value(p.detach()).flatten().tolist() for p in module.parameters()]
            if local == 0:
                seen = {
                    "weights": weights,
                    "kind": probe.kind,
                    "launched": probe.launched,
                    "sent": probe.sent,
                    "flag_sums": probe.flag_sums,
                    "used": probe.used,
                    "quorum": probe.quorum,
                    "folded": probe.folded,
                    "early": probe.early,
                    "runtimes": probe.runtimes,
                }
                (Path(root) / f"{name}-{arm}-{replica}.json").write_text(json.dumps(seen))


def one_process(name: str, root: Path) -> list[torch.Tensor]:
    """The weights one process gets from the union of every rank's micro-batches, step by step."""
    kwargs, tokens, _ = RUNS[name]
    torch.manual_seed(0)
    module = OverflowingLM(report_tokens=tokens, overflows=name in OVERFLOWS)
    micro = kwargs.get("accumulate_grad_batches", 1)
    loader = DataLoader(data(tokens), batch_size=GROUPS * RANKS * BATCH * micro)
    fit(module, loader, root / f"one-{name}", STEPS, enable_checkpointing=False,
        **{k: v for k, v in kwargs.items() if k not in ("accumulate_grad_batches", "gradient_compression", *FT_ARGS)})  # fmt: skip
    return [p.detach().flatten() for p in module.parameters()]


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_overlapped_average_in_groups_of_two_processes_equals_the_flat_one_and_one_process(
    tmp_path, strategy
):
    import torch.distributed as dist

    from trainer.fault_tolerance.lighthouse import start_lighthouse

    runs = [name for name, (_, _, strategies) in RUNS.items() if strategy in strategies]
    servers = {
        f"{name}-{arm}": start_lighthouse("127.0.0.1:0", min_replicas=GROUPS) for name in runs for arm in ARMS
    }
    stores = [dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False) for _ in range(GROUPS)]
    addresses = {key: f"127.0.0.1:{s.address().rpartition(':')[2]}" for key, s in servers.items()}
    try:
        call_ranks(rank_main, GROUPS * RANKS, strategy, [s.port for s in stores], addresses, str(tmp_path),
                   timeout=600)  # fmt: skip
    finally:
        for server in servers.values():
            server.shutdown()

    for name in runs:
        got = {
            (arm, replica): json.loads((tmp_path / f"{name}-{arm}-{replica}.json").read_text())
            for arm in ARMS
            for replica in range(GROUPS)
        }
        overlapped = got["overlapped", 0]
        # every step's sums went out from the backward (one per DDP bucket / FSDP unit), and were the average;
        # DDP's not at the first step (every group's first backward: DDP's one bucket of every parameter,
        # whose layout a group new to the quorum would not share: the average after the backward)
        assert overlapped["kind"] == KIND[strategy], (name, overlapped["kind"])
        # (FSDP2's reduce-scatter carries the vote where no norm's all-reduce will: without clipping)
        first = 1 if strategy == "ddp" or name != "clip" else 0
        assert overlapped["used"] == [False] * first + [True] * (STEPS - first), (name, overlapped)
        assert overlapped["launched"][:first] == [0] * first, (name, overlapped)
        assert min(overlapped["launched"][first:]) >= 1, (name, overlapped)
        assert got["flat", 0]["kind"] is None
        # what rank 0 sent over the groups: its slice of each DDP bucket (the whole bucket under a strategy's
        # own hook: compression), or its FSDP2 shard of each gradient
        grads = sum(len(w) for w in overlapped["weights"])
        # (the test's model is one FSDP2 unit, well under SUM_FIRST_ELEMENTS: summed whole without clipping,
        # each process's part with 2 slots for the vote and quorum_every's flags)
        first_summed = strategy == "fsdp" and name != "clip"
        share = grads + 2 * RANKS if first_summed else grads if name == "compressed" else grads / RANKS
        if name == "blocks":  # the embedding's unit goes last (its input ids need no gradient: FSDP2 reduces
            # it in its final callback, after the root's head): it is summed whole, the head's shard as it is
            embedding = len(overlapped["weights"][0])
            share = embedding + 2 * RANKS + (grads - embedding) / RANKS
        # DDP's one bucket (the backward's last, a short one) is summed over the groups whole, 2 slots with it;
        # quorum_every's 2 flags (the quorum run) ride them (FSDP2's: its summed-first unit's), never a sum
        # of their own
        share = grads + 2 if strategy == "ddp" and name != "compressed" else share
        assert overlapped["sent"][first:] == [share] * (STEPS - first), (name, overlapped["sent"], grads)
        assert overlapped["flag_sums"] == [0] * STEPS, (name, overlapped["flag_sums"])
        # a quorum at every step, or with quorum_every=2 at steps 0 and 2 only (the flat arm: every step)
        assert overlapped["quorum"] == ([True, False, True] if name == "quorum" else [True] * STEPS), name
        # the commit vote went with the all-reduce of the gradients' norm (taken to clip or log it: every
        # step here) where one spans the group (FSDP2's shards; DDP's norm is each rank's own), or with
        # DDP's: around the ring with the last bucket's slices, or with the step's token count
        ringed = strategy == "ddp" and name != "compressed"  # (the strategy's hook: no ring)
        expected_folds = {
            "overlapped": [True] * STEPS
            if strategy == "fsdp"
            else [False] * first + [ringed] * (STEPS - first),
            "flat": [strategy == "fsdp"] * STEPS,
        }
        # summed with the gradients: around DDP's ring, or in FSDP2's last reduce-scatter where no token
        # count's sum over the groups follows it
        early = ringed or (first_summed and name != "tokens")
        assert overlapped["early"] == [False] * first + [early] * (STEPS - first), (name, overlapped["early"])
        assert got["flat", 0]["early"] == [False] * STEPS, (name, got["flat", 0]["early"])
        for arm in ARMS:
            assert got[arm, 0]["folded"] == expected_folds[arm], (name, arm, got[arm, 0]["folded"])
            # one tokio worker each (config.TOKIO_WORKERS): a control plane of a few calls a step
            one_each = {"torchft-manager": 1, "torchft-mgrclnt": 1}
            assert got[arm, 0]["runtimes"] == one_each, (name, arm, got[arm, 0]["runtimes"])
        expected = one_process(name, tmp_path)
        # fp16 forwards of a quarter batch and of the whole one, or fp16 gradients, round alike to ~1e-3 only
        tolerance = {"rtol": 1e-3, "atol": 1e-4} if name in ROUNDED else {"rtol": 0, "atol": 1e-6}
        for (arm, replica), seen in got.items():
            for i, (g, e) in enumerate(zip(seen["weights"], expected, strict=True)):
                g = torch.tensor(g)
                assert torch.allclose(g, e, **tolerance), (
                    f"{name}, {arm}, group {replica}: parameter {i} differs from one process by {(g - e).abs().max():.2e}"
                )
                flat = torch.tensor(got["flat", replica]["weights"][i])
                assert torch.allclose(g, flat, rtol=0, atol=1e-6), (name, arm, replica, i)
