"""Parallel3DStrategy: tensor (+ sequence, + loss) parallel, pipeline parallel and context parallel,
composed with FSDP/HSDP over the rest of the world, on one mesh (strategies/parallel_dims.py).

A preset of ParallelStrategy: strategies/parallelize.py applies the techniques in TorchTitan's order. A
model takes part through declared hooks: `tensor_parallel_plan`, `pipeline_model`/`pipeline_batch`/
`pipeline_loss` (its model: `pipeline_layout`) and `enable_context_parallel`; each is needed only when
its degree is above 1.
"""

from __future__ import annotations

from typing import Any

from strategies.parallel import ParallelStrategy
from strategies.parallel_dims import ParallelDims
from strategies.parallelize import ParallelOptions
from strategies.techniques.activation_checkpointing import check_mode
from strategies.techniques.fsdp.apply import check_reduce_dtype
from strategies.techniques.pp.stages import SCHEDULES, check_layers_per_stage, check_schedule


class Parallel3DStrategy(ParallelStrategy):
    """Data x tensor x pipeline (x context) parallelism.

    - `tp`: DTensor tensor parallelism with the model's plan; `sequence_parallel` shards the activations
      between blocks over the tp ranks, `loss_parallel` keeps the logits vocabulary-sharded for the loss.
    - `pp`: pipeline stages cut at block boundaries (`pp_layers_per_stage` or balanced), run by the
      schedule `pp_schedule` over `microbatches` micro-batches of each batch (default: pp).
    - `cp`: the sequence sharded over cp ranks (load-balanced chunks), attention over gathered K/V.
    - `dp_shard` (FSDP, ZeRO `zero_stage` 2 or 3) and `dp_replicate` (HSDP's replicas; with
      dp_shard=1 plain replication, i.e. DDP) over what is left: dp_shard=-1 takes the rest.
    - `ep`: expert parallelism of MoE layers over ep of the dp_shard x cp x tp ranks: each holds E/ep
      experts (DTensor Shard(0) on the "ep" mesh, FSDP-sharded over the "expert" mesh) and exchanges
      tokens with all-to-alls (strategies/techniques/ep/all_to_all.py). With tp, each tp rank routes its own
      sequence shard (the model's plan) and the ep ranks are the tp ranks first; with pp, each stage's
      MoE layers exchange tokens with the ep ranks of that stage. Not with tp and pp at once.
    """

    name = "parallel3d"

    def __init__(
        self,
        dp_replicate: int = 1,
        dp_shard: int = -1,
        tp: int = 1,
        pp: int = 1,
        cp: int = 1,
        ep: int = 1,
        sequence_parallel: bool = True,
        loss_parallel: bool = True,
        pp_schedule: str = "1F1B",
        microbatches: int | None = None,
        pp_layers_per_stage: list[int] | None = None,
        zero_stage: int = 3,
        reduce_dtype: str = "fp32",
        activation_checkpointing: str | None = None,
        async_save: bool = False,
        timeout_s: float = 600.0,
    ) -> None:
        if zero_stage not in (2, 3) or isinstance(zero_stage, bool):
            raise ValueError(f"zero_stage={zero_stage!r} is invalid for parallel3d; allowed: 2 or 3")
        dims = ParallelDims(
            dp_replicate=_degree("dp_replicate", dp_replicate),
            dp_shard=_degree("dp_shard", dp_shard, allow_rest=True),
            cp=_degree("cp", cp),
            tp=_degree("tp", tp),
            pp=_degree("pp", pp),
            ep=_degree("ep", ep),
        )
        if ep > 1 and tp > 1 and pp > 1:
            raise ValueError(
                f"ep={ep} with tp={tp} and pp={pp}: expert parallelism is composed with tensor or with pipeline "
                "parallelism, not with both at once; allowed: ep > 1 with tp=1 or pp=1"
            )
        check_schedule(pp_schedule)
        if microbatches is not None:
            _degree("microbatches", microbatches)
        if pp_layers_per_stage is not None:
            check_layers_per_stage(pp_layers_per_stage, pp * SCHEDULES[pp_schedule], sum(pp_layers_per_stage))
        options = ParallelOptions(
            data_parallel="fsdp",
            zero_stage=zero_stage,
            reduce_dtype=check_reduce_dtype(reduce_dtype),
            sequence_parallel=bool(sequence_parallel),
            loss_parallel=bool(loss_parallel),
            pp_schedule=pp_schedule,
            microbatches=microbatches if microbatches is not None else pp,
            pp_layers_per_stage=pp_layers_per_stage,
        )
        super().__init__(
            dims,
            options,
            activation_checkpointing=check_mode(activation_checkpointing),
            async_save=async_save,
            timeout_s=timeout_s,
        )


def _degree(name: str, value: Any, allow_rest: bool = False) -> int:
    if (
        isinstance(value, bool)
        or not isinstance(value, int)
        or (value < 1 and not (allow_rest and value == -1))
    ):
        rest = ", or -1 for the rest of the world" if allow_rest else ""
        raise ValueError(f"{name}={value!r} is invalid; allowed: an int >= 1{rest}")
    return value
