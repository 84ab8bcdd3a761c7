"""Trains the tiny Llama under Parallel3DStrategy layouts, as a user's script run under torchrun would.

`--layouts` is a JSON list of {"tag": ..., **Parallel3DStrategy kwargs}, optionally with "steps", "save"
(a checkpoint path written after the fit, or with "save_at" after that step, the fit going on), "resume" (the
fit's ckpt_path), "validate" (default true),
"probe" (measure saved activations), "scalar_sgd" (ScalarLossSGD instead of CausalLM), "clip" (the
gradient_clip_val, default 1.0; null: none) and "accumulate" (accumulate_grad_batches); each is one
`Trainer.fit` in the same world. Rank 0 writes {tag: {"params": {name: values}, "saved_bytes": ...}} to
`--out`: the parameters gathered whole from every shard and stage, and with "probe" the activation bytes
rank 0 saved for backward in the first step; the losses are in each run's metrics log under `--root`/tag.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parents[1]))  # tests/: helpers
from helpers import token_loader  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402

from callbacks import Callback  # noqa: E402
from strategies import Parallel3DStrategy  # noqa: E402
from trainer import Trainer  # noqa: E402
from trainer.models.causal_lm import CausalLM  # noqa: E402
from trainer.models.llama import LlamaConfig  # noqa: E402

MODEL = LlamaConfig(
    vocab_size=64,
    dim=32,
    n_layers=4,
    n_heads=4,
    n_kv_heads=2,
    max_seq_len=16,
    rope_theta=10000.0,
    init_std=0.1,  # attention far from uniform, so positions (RoPE, masks) show in the loss
)


class SavedActivations(Callback):
    """Bytes of the distinct tensors autograd saves for backward in the first step's forward on this
    rank, parameters (and views of them, also FSDP's gathered copies) left out; a DTensor counts its
    local shard."""

    def __init__(self) -> None:
        self.bytes: int | None = None
        self._hooks = None

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        if self.bytes is not None:
            return
        seen: dict[int, int] = {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            if not isinstance(t._base if t._base is not None else t, torch.nn.Parameter):
                local = t.to_local() if isinstance(t, DTensor) else t
                try:
                    storage = local.untyped_storage()
                    seen[storage.data_ptr()] = storage.nbytes()
                except RuntimeError:  # a collective's result not waited for yet: count it by size
                    seen[id(local)] = local.numel() * local.element_size()
            return t

        self._seen = seen
        self._hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
        self._hooks.__enter__()

    def on_after_backward(self, trainer, module):
        if self._hooks is not None:
            self._hooks.__exit__(None, None, None)
            self._hooks, self.bytes = None, sum(self._seen.values())


class SaveAt(Callback):
    """The training state written to `path` once the fit has taken `step` steps; the fit goes on (a checkpoint
    taken mid-fit, as a periodic one is)."""

    def __init__(self, step: int, path: str) -> None:
        self.step, self.path, self.saved = step, path, False

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if trainer.global_step == self.step and not self.saved:  # (every rank alike: the save is collective)
            trainer.save_checkpoint(self.path)
            self.saved = True


def full_parameters(module: torch.nn.Module) -> dict[str, list]:
    """Every parameter whole, keyed by name, merged over the ranks (pipeline stages hold different ones), on
    rank 0, which writes the results (the others get {})."""
    mine = {}
    for name, p in module.named_parameters():
        t = p.detach()
        mine[name.replace("._checkpoint_wrapped_module", "")] = (
            t.full_tensor() if hasattr(t, "full_tensor") else t.clone()
        )
    # tensors through the gather, lists made once on rank 0: every rank pickling and unpickling every rank's
    # nested lists of floats (all_gather_object) was ~3% of the layout tests' CPU
    parts = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(mine, parts, dst=0)
    return {name: t.tolist() for part in parts or () for name, t in part.items()}


class ScalarLossSGD(CausalLM):
    """The tiny Llama whose loss is a plain scalar (no token count: micro-batches weigh equally) and whose
    optimizer is SGD, so that any constant factor on the gradient shows in the update."""

    def pipeline_loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return super().pipeline_loss(logits, labels)["loss"]  # training_step's loss too, through _loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr)


def make_run(
    root: Path,
    steps: int,
    batch: int,
    strategy="auto",
    probe=None,
    scalar_sgd: bool = False,
    clip: float | None = 1.0,  # below the norms of these steps (~3): clipping acts on every step
    accumulate: int = 1,
):
    """(trainer, module, train loader, val loader) of one run; the single-process reference uses it too.
    `batch` is that of one optimizer step: each of the `accumulate` micro-batches holds its share."""
    trainer = Trainer(
        strategy=strategy,
        devices="auto",
        max_steps=steps,
        seed=0,
        gradient_clip_val=clip,
        accumulate_grad_batches=accumulate,
        default_root_dir=root,
        enable_progress_bar=False,
        log_every_n_steps=1,
        limit_val_batches=2,
        num_sanity_val_steps=0,  # (the fit's end validates each layout: the number compared)
        callbacks=[probe] if probe else [],
    )
    train = token_loader(batch // accumulate, MODEL.vocab_size)
    val = token_loader(batch, MODEL.vocab_size, n_tokens=1000, seed=2)
    module = ScalarLossSGD(MODEL, lr=0.1) if scalar_sgd else CausalLM(MODEL, lr=1e-3)
    return trainer, module, train, val


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--layouts", required=True)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--global-batch", type=int, default=8)
    p.add_argument("--out", required=True)
    p.add_argument("--root", required=True)
    args = p.parse_args()
    torch.set_num_threads(1)
    results = {}
    for layout in json.loads(args.layouts):
        tag = layout.pop("tag")
        steps, save, resume = (
            layout.pop("steps", args.steps),
            layout.pop("save", None),
            layout.pop("resume", None),
        )
        save_at = layout.pop("save_at", None)
        probe = SavedActivations() if layout.pop("probe", False) else None
        validate = layout.pop("validate", True)
        run_kwargs = {k: layout.pop(k) for k in ("scalar_sgd", "clip", "accumulate") if k in layout}
        # the loader's batch is per rank (as in Lightning): the global batch over the data-parallel ranks
        dp = int(os.environ["WORLD_SIZE"]) // (
            layout.get("tp", 1) * layout.get("pp", 1) * layout.get("cp", 1)
        )
        trainer, module, train, val = make_run(
            Path(args.root) / tag,
            steps,
            args.global_batch // dp,
            Parallel3DStrategy(timeout_s=120, **layout),
            probe,
            **run_kwargs,
        )
        if save_at is not None:
            trainer.callbacks.append(SaveAt(save_at, save))
        trainer.fit(module, train, val if validate else None, ckpt_path=resume)
        if save and save_at is None:
            trainer.save_checkpoint(save)
        results[tag] = {"params": full_parameters(module), "saved_bytes": probe.bytes if probe else None}
    if dist.get_rank() == 0:
        Path(args.out).write_text(json.dumps(results))


if __name__ == "__main__":
    main()
