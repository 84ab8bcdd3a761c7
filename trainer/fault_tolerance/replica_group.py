"""One replica group's side of per-step fault tolerance: a torchft `Manager` and the calls the loop makes
each step (the quorum requested before the data is read and joined before the first backward, gradients
averaged over the groups, commit or discard)."""

from __future__ import annotations

import logging
import sys
from time import perf_counter
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from strategies.gradients import shard_group, sharded_norm
from trainer.core.dtensors import local_part
from trainer.fault_tolerance import overflow
from trainer.fault_tolerance.cadence import QuorumCadence
from trainer.fault_tolerance.config import NoQuorumError
from trainer.fault_tolerance.costs import StepCosts
from trainer.fault_tolerance.group_average import GroupAverage
from trainer.fault_tolerance.group_calls import DirectSum, GroupVote, OwnVote
from trainer.fault_tolerance.manager import start_manager
from trainer.fault_tolerance.outer_sync import OuterSync, combine_second_moment, inner_state
from trainer.fault_tolerance.overlap import OverlappedAverage
from trainer.fault_tolerance.overlap_ddp import OverlappedGroupAverage
from trainer.fault_tolerance.overlap_group import overlap_fits_group, overlap_in_group
from trainer.fault_tolerance.quorum import (
    Healed,
    commit_vote,
    join_quorum,
    own_vote,
    participants,
    request_quorum,
    reset_for_step,
)
from trainer.fault_tolerance.state import SentState, load_replica_state

if TYPE_CHECKING:
    from trainer.trainer import Trainer

log = logging.getLogger("trainer")


class ReplicaGroup:
    """This group's membership in the fault-tolerant job. Every rank of the group makes the same calls:
    `start_step` (before the step's data is read), `join` (before the step's first backward, or wherever
    the quorum is first needed), `average_gradients` (after the group's own gradient sync), `commit`
    (before the optimizer step); `shutdown` at the end of the fit."""

    def __init__(self, trainer: Trainer) -> None:
        self.trainer, self.config = trainer, trainer.fault_tolerance
        strategy, config = trainer.strategy, self.config
        # quorum_every's flag rides the overlapped average's sums over the groups
        if config.quorum_every > 1 and not (_overlap_is_valid(trainer) or overlap_fits_group(trainer)):
            raise ValueError(
                f"FaultTolerance quorum_every={config.quorum_every} with replica groups of {strategy.world_size} "
                f"process(es) under {type(strategy).__name__}; allowed: quorum_every=1, or groups whose backward "
                "averages over the groups: one process with whole (unsharded) parameters, DDP or FSDP2"
            )
        self.manager, self.pg, self._store = start_manager(strategy, config)
        client = self.manager._client
        self.vote = OwnVote(client) if strategy.world_size == 1 else GroupVote(client, strategy.root_device)
        self.manager._client = self.vote
        self.sent = SentState(trainer)
        self.manager.register_state_dict_fn("trainer", self._load, self.sent)
        self._participants = 0
        self._logged_participants: int | None = None  # the last "train/replicas" value logged (see `commit`)
        self._forming = False  # this step's quorum was requested and is not joined yet
        self._void = False  # the quorum healed this group: the step's work so far is void (see `join`)
        self._joined_at: tuple[int, int] | None = None  # the loop's step and `_applied` at the last join
        self._quorum_id: int | None = None  # torchft's id of the last quorum joined (new with new members)
        self._averaged_in: int | None = None  # the quorum id of the last step whose gradients were averaged
        self._armed = False  # the overlapped average is armed for this step (see `_arm`)
        self._armed_scaler: Any = None  # fp16's scaler whose scale it was armed with
        # FSDP2 keeps gathered parameters and hooks from a forward for its backward: a heal after the forward
        # (which the step then runs again) left the rerun's forward with gathered and sharded ones mixed, so
        # such a group joins before its forward
        self._join_first = _has_fsdp_units(trainer.module)
        self.synced: bool | None = (
            None  # DiLoCo: whether the last step's meeting committed (None: no meeting)
        )
        self.outer = (
            OuterSync(
                trainer.module,
                config.sync_every,
                config.outer_lr,
                config.outer_momentum,
                config.sync_warmup_steps,
            )
            if config.sync_every > 1
            else None
        )
        self.costs = StepCosts()
        direct = DirectSum(self.manager, self.pg)
        self.overlap = (  # DiLoCo: none (the groups meet between windows)
            None
            if self.outer is not None
            else OverlappedAverage(trainer.module, direct, costs=self.costs, flag=config.quorum_every > 1)
            if _overlap_is_valid(trainer)
            else overlap_in_group(trainer, direct, self.costs)
        )
        self.cadence = (
            QuorumCadence(config.quorum_every, config.max_quorum_interval_s)
            if config.quorum_every > 1
            else None
        )
        self._out_of_step = False  # the step's flags showed a group out of step: every group discards it
        self._ready = False  # this step's vote is made up (`_ready_to_vote`)
        self._early_votes: torch.Tensor | None = None  # the vote summed before `commit` (`_early_terms`)
        if isinstance(self.vote, GroupVote) and isinstance(self.overlap, GroupAverage):
            self.overlap.vote_terms = self._early_terms

    def start_step(self) -> None:
        """Request this step's quorum; it forms on torchft's quorum thread while the step reads its data and
        runs its forward, and is waited for at `join`. A group that may be behind its peers (at its process's
        first quorum, or after a step it did not apply) waits here (`Healed`: see `join`), so that a
        recovery comes before the step's hooks and forward."""
        # (a step that raised before its vote left them)
        self._ready, self.vote.summed, self._early_votes = False, None, None
        if self.outer is not None and not self.outer.starts_window(self.trainer.global_step):
            return  # DiLoCo: inside a window the group trains alone
        # torchft's step is what its quorum compares to pick the groups to heal and the one to heal from
        # (`quorum_step`): after a resume the group with the newest checkpoint is the source, not the one
        # torchft ranks first among fresh processes at step 0
        step, applied = self.trainer.state.global_step, self._applied()
        ranked = quorum_step(step, applied)
        if self.manager.current_step() != ranked:
            self.manager.load_state_dict(
                {"step": ranked, "batches_committed": self.manager.batches_committed()}
            )
        if self._joined_at == (step, applied):
            # joined already, the step taken again (its first try found the epoch's data read): a second
            # quorum between them could pair one group's heal with another's step (a collective mismatch)
            return
        if self.cadence is not None and not self.cadence.due(step):
            reset_for_step(self.manager)
            self._arm()
            return
        self.sent.freeze()  # what a peer that recovers from this group gets: the state as of now
        request_quorum(self.manager)
        self._forming = True
        if (
            self._join_first
            or self._joined_at is None
            or step - self._joined_at[0] != applied - self._joined_at[1]
        ):
            self.join()

    def _applied(self) -> int:
        """The updates this group applied: the loop's steps less its skipped ones (DiLoCo: the loop's steps)."""
        loop = self.trainer.state
        return loop.global_step if self.outer is not None else max(loop.global_step - loop.skipped_steps, 0)

    def join(self) -> None:
        """Wait for this step's quorum (once a step; later calls return at once). Raises `Healed` when this
        group was behind and now holds a peer's training state: the loop then reads the step again from
        the new data position (and every later call raises it, until `start_again`). A one-line error when
        fewer than `min_replicas` groups are alive for longer than `quorum_timeout_s`."""
        if self._forming:
            self._forming = False
            start = perf_counter()
            try:
                self._void = join_quorum(self.manager)
            except PeerStateMismatch:
                raise
            except Exception as err:  # torchft raises the lighthouse client's error, several lines long
                raise NoQuorumError(
                    f"fault tolerance: no quorum of min_replicas={self.config.min_replicas} replica group(s) within "
                    f"quorum_timeout_s={self.config.quorum_timeout_s:g} at lighthouse {self.config.lighthouse} ({_first_line(err)})"
                ) from None  # torchft's error, several lines long, is in the line already (its first line)
            self._participants = participants(self.manager)
            self.costs.add("quorum", start)
            self._joined_at = (self.trainer.state.global_step, self._applied())
            if self.cadence is not None:
                self.cadence.asked()
            self._quorum_id = self.manager._quorum_id
            self._arm()
            if self.outer is not None:
                self.outer.begin()
        if self._void:
            raise Healed(f"replica group {self.config.replica_id} recovered from a peer")
        if self._armed and self.trainer.strategy.precision.scaler is not self._armed_scaler:
            self._arm()  # fp16's scaler started lower at the run's first backward (a token sum's)

    def _arm(self) -> None:
        """The overlapped average armed for this step: its participants, the window's micro-batches (a
        gradient is final in the last backward), fp16's loss scale. Not where the sums' layout may differ
        between the groups (DDP's buckets): until a step of the quorum's members has averaged."""
        self._armed = False
        # a group new to the quorum (a restarted one's manager has a new id, so its quorum has a new id) would
        # sum its first backward's layout against its peers' later one: every group averages after the
        # backward, in the parameters' own layout, until a step of this quorum has (not only at its first
        # step: that may end an epoch with no batch left, and the next epoch's first step is taken again)
        layout_may_differ = self.overlap is not None and self.overlap.layout_after_first_backward
        if layout_may_differ and self._averaged_in != self._quorum_id:
            return
        if self.overlap is not None:
            self._armed = True
            scaler = self._armed_scaler = self.trainer.strategy.precision.scaler
            inv_scale = 1.0 / scaler.get_scale() if scaler is not None else 1.0
            arm = (max(self._participants, 1), self.trainer.accumulate_grad_batches, inv_scale)
            if self.cadence is None:
                self.overlap.arm(*arm)
            else:  # quorum_every's terms: summed with the last gradient bucket (one process) or after a sum
                self.overlap.arm(*arm, self.cadence.terms())

    def start_again(self) -> None:
        """After `Healed`: the loop runs the step again (from the peer's data position), its quorum joined."""
        self._void = False

    @property
    def participants(self) -> int:
        """The groups taking part in this step (read inside a step before the first backward, it joins the
        step's quorum there)."""
        self.join()
        return self._participants

    @property
    def sums_tokens(self) -> bool:
        """Whether a token-weighted loss's gradients reach `average_gradients` as token sums (over the group's
        processes), the strategy leaving them so: a group of one process, or of DDP ranks, whose backward
        averages over the groups, where the strategy's division by the group's tokens (a sum over the group
        and a pass over the gradients) would be undone after it: one pass then divides by every group's."""
        return isinstance(self.overlap, (OverlappedAverage, OverlappedGroupAverage))

    def average_gradients(self, module: nn.Module, num_tokens: torch.Tensor | None = None) -> None:
        """Average the step's gradients over the participating groups: the buckets the backward launched
        (see `OverlappedAverage`), else one all-reduce per dtype of a flat copy. A failure (a peer died
        mid-reduce) is not raised: torchft records it and `commit` discards the step; the gradients may then
        be garbage, and are never applied. `num_tokens` (this rank's, for a token-weighted loss): each group
        weighs by its share of the step's tokens, so the result is the one-process token-mean gradient of
        all groups' batches, also when they hold different token counts. Under DiLoCo: nothing (the
        groups meet in `end_step`), except in its per-step warm-up."""
        if self.outer is not None and not self.outer.per_step(self.trainer.global_step):
            return
        strategy, several = self.trainer.strategy, self.trainer.strategy.world_size > 1
        if num_tokens is not None:  # the group's tokens (`sums_tokens` in a group of several: this rank's)
            mine = num_tokens.double() if self.sums_tokens and several else self._group_tokens(num_tokens)
        # a gradient the hooks did not copy (from an earlier micro-batch only) was divided by the group's
        # tokens since, unless `sums_tokens`: undone for the buckets, which hold token sums
        undo = float(mine) if num_tokens is not None and not self.sums_tokens else 1.0
        scaler = self.trainer.strategy.precision.scaler
        # one process with fp16: the overflow `unscale_` found in this group's own gradients (an inf or nan),
        # summed over the groups, stands for a pass over the average's gradients (an inf anywhere is one in
        # the average): every group skips alike. With the token count's sum it costs nothing; on its own, its
        # round trip after the last bucket's costs more than the pass up to PASS_ELEMENTS gradients
        alone = isinstance(self.overlap, OverlappedAverage)
        rides = alone and (num_tokens is not None or self.overlap.elements > overflow.PASS_ELEMENTS)
        found = overflow.found_inf(scaler, self.trainer.optimizer) if scaler is not None and rides else []
        sums = ([mine.reshape(())] if num_tokens is not None else []) + (
            [sum(f.sum() for f in found).double()] if found else []
        )
        extra = torch.stack(sums) if sums else None  # summed over the groups with the buckets
        checked = False
        averaged = self.overlap is not None and self.overlap.finish(use=True, undo=undo, extra=extra)
        # the terms were summed whether or not the buckets were used (and not at all where not armed: the
        # quorum's first steps, whose groups it put in step)
        if self.cadence is not None and self._armed:
            self._out_of_step = not self.cadence.agreed(self.overlap.flags, self._participants)
        if averaged and extra is None and isinstance(self.overlap, GroupAverage):
            # the vote of the ring's last bucket or of the last FSDP2 unit's reduce-scatter came after the
            # step's last sum over the groups (with `extra`: one more followed)
            self._early_votes = self.overlap.voted
        if averaged:
            if num_tokens is not None:  # the buckets held token sums: their mean over the mean token count
                tokens = self._tokens_with_vote(extra[0]) if self.sums_tokens and several else float(extra[0])
                mean = tokens / max(self._participants, 1)
                weight = strategy.world_size if self.sums_tokens else 1.0  # (the group's mean of its sums)
                start = perf_counter()
                factor = weight / mean if mean > 0 else 0.0  # 0: no tokens anywhere
                torch._foreach_mul_(_grads(module), factor)
                self.costs.add("copies", start)
            if found and float(extra[-1]) > 0:
                for tensor in found:
                    tensor.fill_(1.0)
            # a DDP group's backward put the average in `.grad` before `unscale_` checked it
            checked = bool(found) or isinstance(self.overlap, OverlappedGroupAverage)
        else:
            grads = _grads(module)
            if num_tokens is not None:  # .grad is this group's token mean (or its sums' mean): weigh it
                if self.sums_tokens and several:
                    mine = self._group_tokens(num_tokens)
                mean = self._mean_over_groups(mine)
                weight = strategy.world_size if self.sums_tokens else float(mine)
                torch._foreach_mul_(grads, weight / mean if mean > 0 else 0.0)  # 0: no tokens anywhere
            self._average(grads)
        self._averaged_in = self._quorum_id  # every group's DDP has had a synced backward (see `_arm`)
        if scaler is not None and not checked:  # one process's buckets: a sum each, not one per gradient
            flats = [bucket.flat for bucket in self.overlap.buckets] if averaged and alone else _grads(module)
            overflow.check_the_average(scaler, self.trainer.optimizer, flats)

    def _average(self, tensors: list[torch.Tensor]) -> None:
        """Replace `tensors` by their mean over the participating groups: one all-reduce per dtype of a flat
        copy. A failure leaves them as they are or garbage; torchft then discards the step."""
        by_kind: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
        for t in tensors:
            by_kind.setdefault((t.dtype, t.device), []).append(t)
        for group in by_kind.values():
            start = perf_counter()
            flat = torch.cat([t.reshape(-1) for t in group])
            start = self.costs.add("copies", start)
            done = self.manager.allreduce(flat).wait()
            start = self.costs.add("allreduce", start)
            if not done:
                return
            torch._foreach_copy_(
                group,
                [
                    piece.view_as(t)
                    for piece, t in zip(flat.split([t.numel() for t in group]), group, strict=True)
                ],
            )
            self.costs.add("copies", start)

    def _group_tokens(self, num_tokens: torch.Tensor) -> torch.Tensor:
        """This group's tokens: `num_tokens` summed over its processes."""
        return self.trainer.strategy.reduce(num_tokens.float(), "sum", group="loss").double()

    def _tokens_with_vote(self, summed: torch.Tensor) -> float:
        """Every group's tokens: `summed` (this rank's, summed over the groups) summed over the group's
        processes, in the all-reduce that also sums the commit vote (every sum over the groups is done)."""
        both = torch.cat([summed.reshape(1), self._early_terms().double()])
        dist.all_reduce(both, async_op=True).wait(self.manager._timeout)
        self._early_votes = both[1:]
        return float(both[0])

    def _mean_over_groups(self, tokens: torch.Tensor) -> float:
        """The mean of the participating groups' `tokens` (a group that is not participating counts as 0)."""
        start, mean = perf_counter(), tokens.clone()
        self.manager.allreduce(mean).wait()  # a failure leaves garbage: the step is then discarded
        self.costs.add("allreduce", start)
        return float(mean)

    def commit(self, vote: bool) -> bool:
        """Whether this step's update is applied (every rank of the group gets the same answer). `vote`
        False (a callback skips the step here) makes the group vote against it, so its ranks agree."""
        # where a row is written, and where the count changed (callback_metrics keep the latest value between)
        if self.trainer.logs_this_step or self.participants != self._logged_participants:
            self._logged_participants = self.participants
            self.trainer.metrics.add("train/replicas", float(self.participants), on_step=True, on_epoch=False)
        if self._votes_alone():
            return vote  # DiLoCo: a step inside a window is this group's own
        self._ready_to_vote(vote)
        self._ready = False
        if self._early_votes is not None:
            self.vote.summed, self._early_votes = self._early_votes, None
            self.vote.summed[0] += float(not vote)  # a callback's skip: every rank's (skip_optimizer_step)
        start = perf_counter()
        committed = commit_vote(self.manager)
        self.costs.add("commit", start)
        if self.cadence is not None:
            self.cadence.committed(committed, self.vote.group_wants_quorum)
        if not committed and vote:  # a callback's skip is the user's own
            log.warning(
                f"fault tolerance: replica group {self.config.replica_id} discarded step "
                f"{self.trainer.global_step}: {self._discard_reason()}"
            )
        return committed

    def norm_with_vote(self, params: list[nn.Parameter], vote: bool) -> torch.Tensor | None:
        """The global norm of `params`' gradients, this step's commit vote summed with it, where one
        all-reduce over the group's ranks takes the norm (FSDP2): `commit` then makes no collective of its
        own. None elsewhere (the norm is then the strategy's). `vote` as `commit`'s, which must follow."""
        if not isinstance(self.vote, GroupVote) or self._votes_alone():
            return None
        grads = [p.grad for p in params if p.grad is not None]
        group = shard_group(grads)
        if group is None or dist.get_world_size(group) != self.trainer.strategy.world_size:
            return None  # (DDP's norm is each rank's own; HSDP inside the group sums over part of it)
        self._ready_to_vote(vote)
        start = perf_counter()
        self.vote.summed = self.vote.terms(own_vote(self.manager))
        norm = sharded_norm(grads, group, self.vote.summed)
        self.costs.add("commit", start)
        return norm

    def _early_terms(self) -> torch.Tensor:
        """This rank's vote on the step once the step's sums over the groups are done, summed over the group
        before `commit`: around a DDP group's ring with the last bucket's slices (overlap_ddp.py, on the ring's
        thread), in the last FSDP2 unit's reduce-scatter (overlap_fsdp.py), or with a token-weighted loss's
        token count. What failed, a group out of step, too few groups; a
        callback's skip (`skip_optimizer_step`: every rank alike) is added at `commit`."""
        out_of_step = self.cadence is not None and not self.cadence.agreed(
            self.overlap.flags, self._participants
        )
        failed = self.manager.errored() is not None
        wants = failed or (self.cadence is not None and self.cadence.due_next)
        return torch.tensor(
            [float(out_of_step or not own_vote(self.manager)), float(wants)], device=self.vote.device
        )

    def _votes_alone(self) -> bool:
        """Whether this step is the group's own, with no vote (DiLoCo: a step inside a window)."""
        return self.outer is not None and not self.outer.per_step(self.trainer.global_step)

    def _ready_to_vote(self, vote: bool) -> None:
        """This rank's vote on the step made up (once a step): what failed or was skipped recorded with
        torchft, whether the group is to ask for a quorum at the next step."""
        if self._ready:
            return
        self._ready = True
        failed = self.manager.errored() is not None  # a collective or a recovery (not a vote)
        if self._out_of_step:
            self._out_of_step = False
            self.manager.report_error(RuntimeError("a replica group had not applied the step before"))
        if not vote:
            self.manager.report_error(RuntimeError("a callback skipped the optimizer step"))
        # a quorum at the next step, for every rank of the group alike: this rank's collectives failed, or
        # its sums showed a group out of step or wishing for one
        self.vote.wants_quorum = failed or (self.cadence is not None and self.cadence.due_next)

    def end_step(self) -> None:
        """After the optimizer step: under DiLoCo, at a window's last step, the groups meet (the outer step,
        or the window undone when torchft discards it)."""
        self.synced = None
        if self.outer is not None and self.outer.ends_window(self.trainer.global_step):
            inner = inner_state(self.trainer.optimizer) if self.config.sync_optimizer_state else None
            self.synced = self.outer.sync(self._average, lambda: commit_vote(self.manager), inner)
            if self.synced and self.config.sync_combined_second_moment:
                combine_second_moment(self.trainer.optimizer, max(self._participants, 1))
            self.trainer.metrics.add("train/outer_sync", float(self.synced), on_step=True, on_epoch=False)
        elif self.outer is not None and self.outer.ends_warmup(self.trainer.global_step):
            # the first window starts from these weights: a checkpoint taken now holds them as its start
            self.outer.begin()

    def _discard_reason(self) -> str:
        """Why this group's step was discarded, in one line: the error it recorded (a collective that failed,
        a callback's skip), too few groups, or another rank of the group."""
        error = self.manager.errored()
        if error is not None:
            return _first_line(getattr(error, "original_exception", error))
        if self.participants < self.config.min_replicas:
            return f"{self.participants} replica group(s) took part, fewer than min_replicas={self.config.min_replicas}"
        return "another rank of this replica group failed"

    def shutdown(self) -> None:
        """Stop this group's manager server, its transport and the quorum thread; take the hooks off."""
        if self.overlap is not None:
            self.overlap.remove()
        self.manager.shutdown(wait=False)
        self.pg.abort()
        self._store = None  # rank 0's store server stops with its last reference

    def _load(self, state: dict[str, Any]) -> None:
        try:
            load_replica_state(self.trainer, state)
        except Exception as err:
            raise PeerStateMismatch(
                f"fault tolerance: replica group {self.config.replica_id} cannot load the training state a peer "
                f"group sent ({_first_line(err)}); allowed: every group runs the same model, optimizer and "
                "layout, and one lighthouse serves one run"
            ) from err
        log.info(
            f"fault tolerance: replica group {self.config.replica_id} recovered from a peer at step "
            f"{self.trainer.global_step}"
        )


class PeerStateMismatch(RuntimeError):
    """A peer group's state does not fit this group's model (another run at the same lighthouse)."""


def quorum_step(step: int, applied: int) -> int:
    """torchft's step for a group at the loop's `step` that applied `applied` updates: ordered by the loop's
    step (a group resumed from a checkpoint saved before a step its peers discarded has applied as many
    updates but is a step behind), then by the updates (one that discarded or skipped a step its peers
    committed is behind them). Under DiLoCo `applied` is the loop's step. torchft's logs print it: in
    decimal, the loop's step then nine digits of updates (step 11 with 9 updates: 11000000009)."""
    return step * 10**9 + applied


def _overlap_is_valid(trainer: Trainer) -> bool:
    """Whether the backward may launch the cross-group average from each parameter's gradient hook (the same
    answer in every group: they run the same configuration). Only where a parameter's accumulated gradient is
    already the group's final one: one process (groups of several chain the sum onto the group's own
    reduction instead: overlap_group.py). With gradient accumulation the hooks count a parameter's backwards
    and copy its gradient in the window's last; with fp16's scaler they copy it unscaled."""
    strategy = trainer.strategy
    return strategy.world_size == 1 and not any(hasattr(p, "to_local") for p in trainer.module.parameters())


def _grads(module: nn.Module) -> list[torch.Tensor]:
    """This rank's part of every gradient of `module`."""
    return [local_part(p.grad) for p in module.parameters() if p.grad is not None]


def _has_fsdp_units(module: nn.Module) -> bool:
    """Whether FSDP2 shards part of `module` (its module is imported once something used it)."""
    fsdp = sys.modules.get("torch.distributed.fsdp")
    return fsdp is not None and any(isinstance(m, fsdp.FSDPModule) for m in module.modules())


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0].rstrip(":") if text else type(err).__name__
