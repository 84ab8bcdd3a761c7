"""Lightning's manual optimization as its docs write it, run on PyTorch Lightning or on this project with the
import as the only difference:

    python manual_parity.py {lightning|trainer} OUT FORM[,FORM...] --devices N [--batch B] [--max-steps S]
        [--ckpt-path PATH] [--save]

FORM is one module:
- "gan", "gan_dicts", "gan_tuple": the docs' GAN (`automatic_optimization = False`, two optimizers,
  `toggle_optimizer`, `manual_backward`, `opt.step()`, `opt.zero_grad()`, `untoggle_optimizer`), clipping the
  discriminator's gradients with `self.clip_gradients`, its two StepLR schedulers stepped by hand every other
  batch; `configure_optimizers` returns `([opts], [schedulers])`, a list of dicts, or a tuple of the
  optimizers (no schedulers).
- "closure": one optimizer (`self.optimizers()` unwrapped from the list), the docs' gradient accumulation
  (`opt.step()` every 2 batches, the others' gradients kept local by `toggle_model(sync_grad=False)`),
  `opt.step(closure=...)`, clipping by value, a scheduler stepped at each
  epoch's end; "closure_layer": the same, calling its layer directly instead of through `self(x)`.
SGD with momentum (constant factors show; momentum is state a resume must restore). The noise a generator
draws is part of each sample, so that any data-parallel layout feeds each sample the same noise. DEVICES > 1
runs DDP (with find_unused_parameters: a toggled optimizer leaves the other's parameters unused; here
`--strategy ddp_plain` leaves it off, `fsdp` runs FSDPStrategy(zero_stage=3) instead). Each rank
writes OUT/FORM/rank<R>.json: every hook call in order, each optimizer step's loss, learning rate and
`global_step`, what on_train_batch_end received, the logged metrics, the trainer's attributes and the final
weights, and with `--val-every N` (val_check_interval) the global steps validated at; `--save` writes a
checkpoint at the end (OUT/FORM/saved), `--ckpt-path` resumes from one.
Lightning's GAN tutorial writes `training_step(self, batch)`; here it takes `batch_idx` too (README)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from trainer.core.launch import destroy_process_group

_parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
_parser.add_argument("framework", choices=["lightning", "trainer"])
_parser.add_argument("out", type=Path)
_parser.add_argument("forms")  # FORM[,FORM...]
_parser.add_argument("--devices", type=int, required=True)
_parser.add_argument("--batch", type=int, default=8)
_parser.add_argument("--max-steps", type=int, default=-1)
_parser.add_argument("--ckpt-path", default=None)
_parser.add_argument("--save", action="store_true")
_parser.add_argument("--val-every", type=int, default=None)  # val_check_interval, with a validation loader
_parser.add_argument("--strategy", default="ddp", choices=["ddp", "ddp_plain", "fsdp"])
_args = _parser.parse_args()
FRAMEWORK, OUT, DEVICES, FORMS = _args.framework, _args.out, _args.devices, _args.forms.split(",")
if FRAMEWORK == "lightning":
    from pytorch_lightning import Callback, LightningModule, Trainer, seed_everything

    DDP = "ddp_find_unused_parameters_true"
else:
    from callbacks import Callback
    from strategies import DDPStrategy, FSDPStrategy
    from trainer import Trainer, seed_everything
    from trainer import TrainModule as LightningModule

    DDP = {
        "ddp": DDPStrategy(find_unused_parameters=True),
        "ddp_plain": "ddp",
        "fsdp": FSDPStrategy(zero_stage=3),
    }[_args.strategy]

from hook_recording import recording  # noqa: E402

CALLS: list[str] = []
MODULE_HOOKS = [
    "on_train_batch_start", "on_before_backward", "on_after_backward", "on_before_optimizer_step",
    "on_before_zero_grad", "on_train_batch_end", "on_train_epoch_end",
]  # fmt: skip
CALLBACK_HOOKS = [
    "on_train_batch_start", "on_after_backward", "on_before_optimizer_step", "on_before_zero_grad",
    "on_train_batch_end", "on_train_epoch_end",
]  # fmt: skip
LATENT = 4


class Generator(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(LATENT, 16), nn.Tanh(), nn.Linear(16, 8))

    def forward(self, z):
        return self.net(z)


class Discriminator(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.LeakyReLU(0.2), nn.Linear(16, 1))

    def forward(self, x):
        return self.net(x)


class Recorded(LightningModule):
    """What every form records: each step (loss, lr, global_step) and what on_train_batch_end received."""

    def __init__(self):
        super().__init__()
        self.steps: list[dict] = []
        self.batch_outputs: list[dict] = []
        self.attrs: dict = {}

    def on_train_batch_end(self, outputs, batch, batch_idx):
        self.batch_outputs.append({k: plain(v) for k, v in outputs.items()})

    def on_validation_start(self):
        if not self.trainer.sanity_checking:
            self.attrs.setdefault("validated_at", []).append(self.global_step)

    def validation_step(self, batch, batch_idx):
        self.log("val_score", self.validation_score(*batch))

    def on_train_start(self):
        self.attrs.update(
            optimizers=len(self.trainer.optimizers),
            schedulers=len(self.trainer.lr_scheduler_configs),
            estimated_stepping_batches=self.trainer.estimated_stepping_batches,
        )


@recording(MODULE_HOOKS, "", CALLS)
class GAN(Recorded):
    def __init__(self, form: str = "gan", lr: float = 0.05):
        super().__init__()
        self.save_hyperparameters()
        self.automatic_optimization = False
        self.generator = Generator()
        self.discriminator = Discriminator()

    def forward(self, z):
        return self.generator(z)

    def adversarial_loss(self, y_hat, y):
        return F.binary_cross_entropy_with_logits(y_hat, y)

    def training_step(self, batch, batch_idx):
        imgs, z = batch
        optimizer_g, optimizer_d = self.optimizers()

        # train generator
        self.toggle_optimizer(optimizer_g)
        valid = torch.ones(imgs.size(0), 1).type_as(imgs)
        g_loss = self.adversarial_loss(self.discriminator(self(z)), valid)
        self.log("g_loss", g_loss, prog_bar=True)
        self.manual_backward(g_loss)
        optimizer_g.step()
        self.record("g", g_loss, optimizer_g)
        optimizer_g.zero_grad()
        self.untoggle_optimizer(optimizer_g)

        # train discriminator
        self.toggle_optimizer(optimizer_d)
        real_loss = self.adversarial_loss(self.discriminator(imgs), valid)
        fake = torch.zeros(imgs.size(0), 1).type_as(imgs)
        fake_loss = self.adversarial_loss(self.discriminator(self(z).detach()), fake)
        d_loss = (real_loss + fake_loss) / 2
        self.log("d_loss", d_loss, prog_bar=True, on_epoch=True, sync_dist=True)
        self.manual_backward(d_loss)
        self.clip_gradients(optimizer_d, gradient_clip_val=0.05, gradient_clip_algorithm="norm")
        optimizer_d.step()
        self.record("d", d_loss, optimizer_d)
        optimizer_d.zero_grad()
        self.untoggle_optimizer(optimizer_d)

        schedulers = self.lr_schedulers()
        if schedulers is not None and self.trainer.global_step % 4 == 0:  # every other batch
            for scheduler in schedulers:
                scheduler.step()
        return {"loss": d_loss, "g_loss": g_loss}

    def validation_score(self, imgs, z):
        return self.adversarial_loss(self.discriminator(imgs), torch.ones(imgs.size(0), 1))

    def record(self, which, loss, optimizer):
        lr = optimizer.param_groups[0]["lr"]
        self.steps.append({"opt": which, "loss": loss.item(), "lr": lr, "step": self.global_step})

    def configure_optimizers(self):
        lr, form = self.hparams.lr, self.hparams.form
        opt_g = torch.optim.SGD(self.generator.parameters(), lr=lr, momentum=0.9)
        opt_d = torch.optim.SGD(self.discriminator.parameters(), lr=lr, momentum=0.9)
        sched_g = torch.optim.lr_scheduler.StepLR(opt_g, step_size=1, gamma=0.9)
        sched_d = torch.optim.lr_scheduler.StepLR(opt_d, step_size=1, gamma=0.8)
        if form == "gan_tuple":
            return opt_g, opt_d
        if form == "gan_dicts":
            return [
                {"optimizer": opt_g, "lr_scheduler": {"scheduler": sched_g, "interval": "step"}},
                {"optimizer": opt_d, "lr_scheduler": sched_d},
            ]
        return [opt_g, opt_d], [sched_g, sched_d]


class ShardedGAN(GAN):
    """The GAN with its two networks as FSDP's units (this project's hook; Lightning never calls it): a step
    that calls `self(z)` and then another of the root's layers needs them outside the root (README)."""

    def transformer_blocks(self):
        return [self.generator, self.discriminator]


@recording(MODULE_HOOKS, "", CALLS)
class Accumulating(Recorded):
    """The docs' gradient accumulation with manual optimization, its step taking a closure."""

    def __init__(self, form: str = "closure"):
        super().__init__()
        self.save_hyperparameters()
        self.automatic_optimization = False
        self.layer = nn.Linear(8, 1)

    def forward(self, x):
        return self.layer(x)

    def training_step(self, batch, batch_idx):
        x, z = batch
        model = self.layer if self.hparams.form == "closure_layer" else self
        opt = self.optimizers()
        n = 2

        def closure():
            loss = F.mse_loss(model(x), z[:, :1]) / n
            self.manual_backward(loss)
            self.clip_gradients(opt, gradient_clip_val=0.02, gradient_clip_algorithm="value")
            return loss

        if (batch_idx + 1) % n == 0:
            loss = opt.step(closure=closure)
            self.steps.append({"opt": "one", "loss": loss.item(), "lr": opt.param_groups[0]["lr"]})
            self.steps[-1]["step"] = self.global_step
            opt.zero_grad()
        else:  # accumulated on each rank: synced with the backward of the batch that steps
            with opt.toggle_model(sync_grad=False):
                loss = F.mse_loss(model(x), z[:, :1]) / n
                self.manual_backward(loss)
        self.log("train_loss", loss)
        return loss

    def validation_score(self, x, z):
        return F.mse_loss(self(x), z[:, :1])

    def on_train_epoch_end(self):
        self.lr_schedulers().step()

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.5)
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.5)}


@recording(CALLBACK_HOOKS, "cb.", CALLS)
class Recorder(Callback):
    pass


def plain(value):
    if isinstance(value, torch.Tensor):
        return value.tolist()
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    return value


def full(tensor: torch.Tensor) -> torch.Tensor:
    """A sharded (FSDP) tensor's whole value; every rank calls it."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def data() -> TensorDataset:
    """48 samples: a shifted Gaussian 'image' of 8 values and the generator's noise for it."""
    g = torch.Generator().manual_seed(1234)
    return TensorDataset(torch.randn(48, 8, generator=g) + 1.5, torch.randn(48, LATENT, generator=g))


def run(form: str, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    CALLS.clear()
    seed_everything(0)
    gan = ShardedGAN if _args.strategy == "fsdp" else GAN
    model = gan(form) if form.startswith("gan") else Accumulating(form)
    limit = {"max_steps": _args.max_steps} if _args.max_steps > 0 else {}
    trainer = Trainer(
        accelerator="cpu", devices=DEVICES, strategy=DDP if DEVICES > 1 else "auto", max_epochs=2, **limit,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        log_every_n_steps=2, default_root_dir=out, callbacks=[Recorder()], num_sanity_val_steps=0,
        **({} if _args.val_every is None else {"val_check_interval": _args.val_every}),
    )  # fmt: skip
    loader = DataLoader(data(), batch_size=_args.batch)
    val = None if _args.val_every is None else DataLoader(data(), batch_size=_args.batch)
    trainer.fit(model, loader, val, ckpt_path=_args.ckpt_path)
    if _args.save:  # where a resumed fit goes on from
        trainer.save_checkpoint(out / "saved")
    record = {
        "calls": list(CALLS),
        "steps": model.steps,
        "batch_outputs": model.batch_outputs,
        "attrs": {**model.attrs, "global_step": trainer.global_step, "epoch": trainer.current_epoch},
        "callback_metrics": plain(dict(trainer.callback_metrics)),
        "logged_metrics": plain(dict(trainer.logged_metrics)),
        "weights": {k: full(v).flatten().tolist() for k, v in model.state_dict().items()},
    }
    (out / f"rank{trainer.global_rank}.json").write_text(json.dumps(record))


def main() -> None:
    torch.set_num_threads(1)
    for form in FORMS:
        run(form, OUT / form)


if __name__ == "__main__":
    main()
    destroy_process_group()  # see lightning_parity.py
