"""DDPStrategy: data parallel with DistributedDataParallel; every rank holds the whole model."""

from __future__ import annotations

from strategies.parallel import ParallelStrategy
from strategies.parallelize import ParallelOptions
from strategies.techniques.ddp.apply import check_compression


class DDPStrategy(ParallelStrategy):
    """Replicate the model on every rank and average gradients with bucketed all-reduces that overlap
    the backward pass. DDP's knobs are exposed as is; `gradient_compression` registers a DDP comm hook:
    "fp16"/"bf16" halve the bytes all-reduced, "powersgd" sends a rank-`powersgd_rank` factorisation
    with error feedback after `powersgd_start_iter` exact steps. The PowerSGD error-feedback buffers are
    not checkpointed: a resumed run rebuilds them, so it is not bit-identical to an uninterrupted one.
    `bucket_cap_mb` None: DDP's own buckets (25 MB, the first 1 MB, so the first all-reduce starts early in
    the backward); a number caps every bucket, the first too (DDP's rule: one bucket for a smaller model).
    """

    name = "ddp"

    def __init__(
        self,
        bucket_cap_mb: float | None = None,
        gradient_as_bucket_view: bool = True,
        static_graph: bool = False,
        find_unused_parameters: bool = False,
        gradient_compression: str | None = None,
        powersgd_rank: int = 1,
        powersgd_start_iter: int = 10,
        timeout_s: float = 600.0,
    ) -> None:
        ddp_kwargs = {
            "gradient_as_bucket_view": gradient_as_bucket_view,
            "static_graph": static_graph,
            "find_unused_parameters": find_unused_parameters,
        }
        if bucket_cap_mb is not None:  # (passing DDP's 25 itself would drop its 1 MB first bucket)
            ddp_kwargs["bucket_cap_mb"] = bucket_cap_mb
        options = ParallelOptions(
            data_parallel="ddp",
            zero_stage=0,
            ddp_kwargs=ddp_kwargs,
            gradient_compression=check_compression(gradient_compression),
            powersgd_rank=powersgd_rank,
            powersgd_start_iter=powersgd_start_iter,
        )
        super().__init__(None, options, timeout_s=timeout_s)  # dims None: every rank a replica
