"""The CUDA paths of issues 51 and 52 on one GPU, each a line of PASS/FAIL with what it measured (a lent H200:
bench/gpu_check.sh runs it; any CUDA machine will do):

  resume       a fit with fused AdamW and a cosine schedule, stopped at step 6 and resumed from its checkpoint
               through the training state's parts, ends with the weights of an uninterrupted fit (bit-exact)
  manual-gan   manual optimization with two optimizers, toggled, under 16-mixed (the gradient scaler) and
               fused Adam: 12 steps, finite losses, global_step counting every optimizer step
  hooks        a callback with Lightning's signatures sees the batch on the GPU and its batch_idx
  syncs        logging every step adds no host sync per step: the extra syncs of a fit do not grow from 20
               to 40 steps (the values are read when callback_metrics is)

    PYTHONPATH=. python bench/gpu_paths.py
"""

from __future__ import annotations

import tempfile
import warnings

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from callbacks import Callback
from trainer import Trainer, TrainModule

QUIET = dict(
    enable_progress_bar=False, enable_model_summary=False, logger=False, accelerator="gpu", devices=1
)


def data(n: int = 512, width: int = 64) -> DataLoader:
    g = torch.Generator().manual_seed(0)
    return DataLoader(
        TensorDataset(torch.randn(n, width, generator=g), torch.randn(n, 1, generator=g)), batch_size=32
    )


class Regression(TrainModule):
    def __init__(self, logs: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 1))
        self.logs = logs

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        if self.logs:
            self.log("train_loss", loss)
            self.log("twice", loss * 2, on_epoch=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


class StopAt(Callback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == self.step:
            trainer.save_and_stop("gpu_paths: the interruption")


def resume() -> tuple[bool, str]:
    def trainer(root, *callbacks):
        return Trainer(
            max_steps=12, lr_schedule="cosine", default_root_dir=root, callbacks=list(callbacks), **QUIET
        )

    with tempfile.TemporaryDirectory() as a, tempfile.TemporaryDirectory() as b:
        whole = Regression()
        trainer(a).fit(whole, data())
        first = Regression()
        t = trainer(b, StopAt(6))
        t.fit(first, data())
        fused = [g.get("fused") for g in t.optimizer.param_groups]
        resumed = Regression()
        t = trainer(b)
        t.fit(resumed, data(), ckpt_path="last")
        same = all(torch.equal(p, q) for p, q in zip(whole.parameters(), resumed.parameters(), strict=True))
        return same and fused == [
            True
        ], f"fused={fused}, resumed == uninterrupted: {same}, step {t.global_step}"


class GAN(TrainModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.automatic_optimization = False
        self.generator = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64))
        self.discriminator = nn.Sequential(nn.Linear(64, 64), nn.LeakyReLU(0.2), nn.Linear(64, 1))
        self.losses: list[float] = []

    def training_step(self, batch):
        real, _ = batch
        opt_g, opt_d = self.optimizers()
        z = torch.randn(real.shape[0], 16, device=real.device)
        ones, zeros = (
            torch.ones(real.shape[0], 1, device=real.device),
            torch.zeros(real.shape[0], 1, device=real.device),
        )
        self.toggle_optimizer(opt_g)
        g_loss = nn.functional.binary_cross_entropy_with_logits(self.discriminator(self.generator(z)), ones)
        opt_g.zero_grad()
        self.manual_backward(g_loss)
        opt_g.step()
        self.untoggle_optimizer(opt_g)
        self.toggle_optimizer(opt_d)
        fake = self.generator(z).detach()
        d_loss = (
            nn.functional.binary_cross_entropy_with_logits(self.discriminator(real), ones)
            + nn.functional.binary_cross_entropy_with_logits(self.discriminator(fake), zeros)
        ) / 2
        opt_d.zero_grad()
        self.manual_backward(d_loss)
        opt_d.step()
        self.untoggle_optimizer(opt_d)
        self.losses += [float(g_loss.detach()), float(d_loss.detach())]

    def configure_optimizers(self):
        return (
            torch.optim.Adam(self.generator.parameters(), lr=2e-4, betas=(0.5, 0.999)),
            torch.optim.Adam(self.discriminator.parameters(), lr=2e-4, betas=(0.5, 0.999)),
        )


def manual_gan() -> tuple[bool, str]:
    with tempfile.TemporaryDirectory() as root:
        module = GAN()
        t = Trainer(
            max_steps=12, precision="16-mixed", default_root_dir=root, enable_checkpointing=False, **QUIET
        )
        t.fit(module, data(width=64))
        fused = [g.get("fused") for opt in t.optimizers for g in opt.param_groups]
        finite = all(torch.isfinite(torch.tensor(module.losses)))
        ok = finite and t.global_step == 12 and len(module.losses) == 12
        return ok, f"global_step {t.global_step}, {len(module.losses)} losses finite: {finite}, fused {fused}"


class Seen(Callback):
    def __init__(self) -> None:
        self.seen: list[tuple[str, int]] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.seen.append((batch[0].device.type, batch_idx))


def hooks() -> tuple[bool, str]:
    with tempfile.TemporaryDirectory() as root:
        seen = Seen()
        Trainer(
            max_steps=3, default_root_dir=root, callbacks=[seen], enable_checkpointing=False, **QUIET
        ).fit(Regression(), data())
        return seen.seen == [("cuda", 0), ("cuda", 1), ("cuda", 2)], f"seen {seen.seen}"


def syncs() -> tuple[bool, str]:
    def count(logs: bool, steps: int) -> int:
        with tempfile.TemporaryDirectory() as root:
            t = Trainer(
                max_steps=steps,
                log_every_n_steps=10**6,
                default_root_dir=root,
                enable_checkpointing=False,
                **QUIET,
            )
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                torch.cuda.set_sync_debug_mode("warn")
                t.fit(Regression(logs), data(n=4096))
                torch.cuda.set_sync_debug_mode(0)
            return sum("synchroniz" in str(w.message) for w in caught)

    extra = {steps: count(True, steps) - count(False, steps) for steps in (20, 40)}
    return extra[40] <= extra[20], f"extra host syncs of a fit that logs every step, by its steps: {extra}"


if __name__ == "__main__":
    print(torch.cuda.get_device_name(), torch.__version__)
    for name, check in (("resume", resume), ("manual-gan", manual_gan), ("hooks", hooks), ("syncs", syncs)):
        try:
            ok, what = check()
        except Exception as exc:  # one check's failure does not hide the others'
            ok, what = False, f"{type(exc).__name__}: {exc}"
        print(f"{name:11s} {'PASS' if ok else 'FAIL'}  {what}", flush=True)
