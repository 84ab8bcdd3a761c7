"""DDPStrategy: data parallel with DistributedDataParallel; every rank holds the whole model."""

from __future__ import annotations

import contextlib
from typing import Any

from torch import nn
from torch.nn.parallel import DistributedDataParallel

from strategies.base import StepRunner
from strategies.mesh import MeshStrategy

COMPRESSION = (None, "fp16", "bf16", "powersgd")


class DDPStrategy(MeshStrategy):
    """Replicate the model on every rank and average gradients with bucketed all-reduces that overlap
    the backward pass. DDP's knobs are exposed as is; `gradient_compression` registers a DDP comm hook:
    "fp16"/"bf16" halve the bytes all-reduced, "powersgd" sends a rank-`powersgd_rank` factorisation
    with error feedback after `powersgd_start_iter` exact steps. The PowerSGD error-feedback buffers are
    not checkpointed: a resumed run rebuilds them, so it is not bit-identical to an uninterrupted one.
    """

    name = "ddp"

    def __init__(
        self,
        bucket_cap_mb: float = 25.0,
        gradient_as_bucket_view: bool = True,
        static_graph: bool = False,
        find_unused_parameters: bool = False,
        gradient_compression: str | None = None,
        powersgd_rank: int = 1,
        powersgd_start_iter: int = 10,
        timeout_s: float = 600.0,
    ) -> None:
        super().__init__(timeout_s=timeout_s)
        if gradient_compression not in COMPRESSION:
            raise ValueError(
                f"gradient_compression={gradient_compression!r} is unknown; allowed: None, 'fp16', 'bf16', 'powersgd'"
            )
        self.ddp_kwargs = {
            "bucket_cap_mb": bucket_cap_mb,
            "gradient_as_bucket_view": gradient_as_bucket_view,
            "static_graph": static_graph,
            "find_unused_parameters": find_unused_parameters,
        }
        self.gradient_compression = gradient_compression
        self.model: DistributedDataParallel | None = None
        self.powersgd_rank, self.powersgd_start_iter = powersgd_rank, powersgd_start_iter

    def check_configuration(self) -> None:
        if self.gradient_compression == "bf16" and self.accelerator != "cuda":
            raise ValueError(
                "gradient_compression='bf16' needs CUDA with NCCL (DDP's bf16 hook); allowed on the CPU: 'fp16', 'powersgd'"
            )
        super().check_configuration()

    def setup_module(self, module: nn.Module) -> nn.Module:
        module = super().setup_module(module)
        device_ids = [self.root_device.index] if self.root_device.type == "cuda" else None
        # DDP hooks its own forward: it wraps a StepRunner, whose forward is the step being run, so the
        # step's backward is synced while the module keeps its own forward for `self(x)` in the step.
        # DDP's constructor broadcasts rank 0's parameters and buffers, so every replica starts equal.
        self.model = DistributedDataParallel(
            StepRunner(module),
            device_ids=device_ids,
            process_group=self.dp_group,
            **self.ddp_kwargs,
        )
        self._register_compression()
        return module

    def _register_compression(self) -> None:
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

        if self.gradient_compression == "fp16":
            self.model.register_comm_hook(self.dp_group, default_hooks.fp16_compress_hook)
        elif self.gradient_compression == "bf16":
            self.model.register_comm_hook(self.dp_group, default_hooks.bf16_compress_hook)
        elif self.gradient_compression == "powersgd":
            state = powerSGD_hook.PowerSGDState(
                process_group=self.dp_group,  # PowerSGD's own all-reduces: over DDP's replicas only
                matrix_approximation_rank=self.powersgd_rank,
                start_powerSGD_iter=self.powersgd_start_iter,
            )
            self.model.register_comm_hook(state, powerSGD_hook.powerSGD_hook)

    def call_step(self, module: nn.Module, method: str, *args: Any) -> Any:
        return self.model(method, *args)

    def accumulation_context(self, is_last_micro_batch: bool) -> contextlib.AbstractContextManager:
        """All-reduce only on the step's last micro-batch; the others accumulate locally."""
        return contextlib.nullcontext() if is_last_micro_batch else self.model.no_sync()

    def teardown(self) -> None:
        super().teardown()
        # DDP's reducer holds the process group; freed here, not by C++ destructors while Python shuts down
        self.model = None
