"""Pipeline parallelism, first of the techniques: this rank keeps only its stages' parts of the model
(strategies/techniques/pp/stages.py cuts them, schedule.py runs them)."""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from strategies.techniques.pp.stages import prune, split_blocks, stage_ids, stage_view


@dataclass
class StageCut:
    """The pipelined model (pruned to this rank's stages), the ids of those stages and every stage's blocks."""

    model: nn.Module
    ids: list[int]
    blocks: list[list[str]]

    def views(self) -> list[nn.Module]:
        """One view per stage of this rank: the model's parts of that stage only (taken after the other
        techniques changed the parts, so each view sees them as they train)."""
        last = len(self.blocks) - 1
        return [stage_view(self.model, self.blocks[i], i == 0, i == last) for i in self.ids]


def apply_pp(
    module: nn.Module, n_stages: int, schedule: str, pp_rank: int, pp: int, per_stage: list[int] | None
) -> StageCut:
    """Cut `module.pipeline_model()` into `n_stages` stages at block boundaries (balanced, or
    `per_stage` blocks each) and prune it to the stages `schedule` gives rank `pp_rank` of `pp`."""
    model = module.pipeline_model()
    names = list(getattr(model, model.pipeline_layout()[1]))
    blocks = split_blocks(names, n_stages, per_stage)
    ids = stage_ids(schedule, pp_rank, pp)
    prune(model, [blocks[i] for i in ids], 0 in ids, n_stages - 1 in ids)
    return StageCut(model, ids, blocks)
