"""What each entry point runs in every process: set-up (the process group, data preparation, seeds, the
module built and wrapped by the strategy), the stage itself (one `FitLoop`, or the evaluation loop for
validate/test/predict) and the tear-down that follows it even when the stage fails."""

from __future__ import annotations

import functools
import sys
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from callbacks.tuning import TunerExit
from strategies.techniques.sync_batchnorm import convert_sync_batchnorm, revert_sync_batchnorm
from trainer.core.host_memory import keep_freed_memory
from trainer.core.logging import rank_zero_info, set_rank
from trainer.core.rng import global_seed, seed_everything, seeds_workers, worker_init_function
from trainer.data.distributed import sequential_loader
from trainer.data.loader import pin_for_device, several_loaders
from trainer.datamodule import call_if_defined, loaders_from
from trainer.fault_tolerance.data import replica_loader
from trainer.fault_tolerance.replica_group import ReplicaGroup
from trainer.loop import eval_loop, torch_switches
from trainer.loop.entry_checks import check_not_empty
from trainer.loop.fit_loop import FitLoop
from trainer.loop.manual_step import ManualFitLoop
from trainer.loop.reload import LoaderReload
from trainer.module import TrainModule, uncalled_lightning_methods

if TYPE_CHECKING:
    from trainer.trainer import Trainer

_WARNED_UNCALLED: set[type] = set()  # module classes told about their uncalled Lightning hooks


def run_fit(
    trainer: Trainer,
    module: TrainModule,
    train_loader: Iterable | None,
    val_loader: Iterable | None,
    ckpt_path: Any,
    datamodule: Any,
) -> None:
    """`Trainer.fit` in this process: set up, then one new `FitLoop` (the trainer's `_fit_loop`) runs."""
    trainer.fitting = True
    _setup(trainer, module, "fit", datamodule)
    replicas = None
    try:
        reload = LoaderReload()
        if train_loader is None:  # the datamodule's, or the module's own, read after their setup
            source = datamodule or module
            train_loader, own_val = loaders_from(source, "fit")
            if trainer.reload_dataloaders_every_n_epochs:
                load = functools.partial(
                    _reloaded, trainer, source, own_val is not None and val_loader is None
                )
                reload = LoaderReload(trainer.reload_dataloaders_every_n_epochs, load)
            val_loader = own_val if val_loader is None else val_loader
        if val_loader is not None and not _validates(module):
            # as Lightning: no validation (nor sanity check) without a validation_step (the GAN example)
            rank_zero_info(
                "warning: a val_dataloader was given but the module has no validation_step: no validation"
            )
            val_loader = None
        train_loader = fit_loader(trainer, train_loader, train=True)
        val_loader = fit_loader(trainer, val_loader, train=False)
        loop = FitLoop if module.automatic_optimization else ManualFitLoop
        trainer._fit_loop = loop(trainer, module, train_loader, val_loader)
        trainer._fit_loop.reload = reload
        if trainer.fault_tolerance is not None:  # this group joins the others at the lighthouse
            replicas = trainer._fit_loop.replicas = ReplicaGroup(trainer)
        trainer._fit_loop.run(ckpt_path)
    except TunerExit:  # a Tuner's fit ends once its value is found: no failure, as in Lightning
        raise
    except BaseException as exc:
        trainer._dispatch.callbacks("on_exception", exc)
        raise
    finally:
        if replicas is not None:
            replicas.shutdown()
        _finish(trainer, "fit")
    if trainer._fit_loop.stopped_by is not None:  # after the tear-down: its checkpoint is complete
        raise trainer._fit_loop.signal_exit()


def _validates(module: TrainModule) -> bool:
    """Whether `module` has a validation_step of its own (as Lightning's `is_overridden`, one set on the
    instance counts)."""
    return getattr(module.validation_step, "__code__", None) is not TrainModule.validation_step.__code__


def fit_loader(trainer: Trainer, loader: Iterable | None, train: bool) -> Iterable | None:
    """A loader of the fit as this rank reads it: not empty, unshuffled under `overfit_batches` (as Lightning
    turns shuffling off there, for the train and the val loader), its share of the data."""
    if loader is None:
        return None
    if not train and several_loaders(loader):  # Lightning's list of val loaders: each as one
        return [fit_loader(trainer, one, train) for one in loader]
    check_not_empty("train_dataloader()" if train else "val_dataloader()", loader)
    if trainer.overfit_batches:
        loader = sequential_loader(loader)
    return _rank_loader(trainer, loader, train=train)


def _reloaded(trainer: Trainer, source: Any, with_val: bool, which: str) -> Iterable | None:
    """`reload_dataloaders_every_n_epochs`: `source`'s `train_dataloader()` or `val_dataloader()` called again
    (the val one only when the fit's val loader came from it), made this rank's as at the fit's start."""
    if which == "val" and not with_val:
        return None
    return fit_loader(trainer, getattr(source, f"{which}_dataloader")(), which == "train")


def run_evaluate(
    trainer: Trainer,
    module: TrainModule,
    loader: Iterable | None,
    ckpt_path: Any,
    stage: str,
    datamodule: Any,
) -> Any:
    """`validate`/`test` (their metrics) or `predict` (every step's output) in this process."""
    _setup(trainer, module, stage, datamodule)
    try:
        if loader is None:
            loader, _ = loaders_from(datamodule or module, stage)
            check_not_empty(f"{stage} dataloader", loader)
        if several_loaders(loader):  # Lightning's list of loaders, run one after the other
            loader = [_rank_loader(trainer, one, train=False) for one in loader]
        else:
            loader = _rank_loader(trainer, loader, train=False)
        trainer.checkpoint_manager.load_model(ckpt_path)
        if stage == "predict":
            return eval_loop.evaluate(trainer, module, loader, "predict", trainer.limit_predict_batches)[2]
        loop = "validation" if stage == "validate" else "test"
        limit = trainer.limit_val_batches if stage == "validate" else trainer.limit_test_batches
        metrics = eval_loop.evaluate_alone(trainer, module, loader, loop, limit)
        if trainer.is_global_zero and trainer.enable_progress_bar:
            print("  ".join(f"{k} {v:.4f}" for k, v in metrics.items()), file=sys.stderr)
        return metrics
    finally:
        _finish(trainer, stage)


def _setup(trainer: Trainer, module: TrainModule, stage: str, datamodule: Any) -> None:
    strategy = trainer.strategy
    strategy.setup_environment()
    set_rank(strategy.global_rank)
    if strategy.root_device.type == "cpu":  # a CPU step reuses the pages of the one before (host_memory.py)
        keep_freed_memory()
    trainer.datamodule = datamodule
    _prepare_data(trainer, module, datamodule)
    call_if_defined(datamodule, "setup", stage)
    if trainer.seed is not None:
        seed_everything(trainer.seed, workers=seeds_workers())
    # for this stage only: _finish puts them back
    trainer._torch_switches = torch_switches.set_for_stage(trainer)
    module._trainer = trainer
    trainer.module = module
    trainer._module_name = type(module).__name__  # before wrapping (FSDP2 renames the class)
    uncalled = uncalled_lightning_methods(module)
    if uncalled and type(module) not in _WARNED_UNCALLED:
        _WARNED_UNCALLED.add(type(module))
        rank_zero_info(
            f"warning: {type(module).__name__} defines Lightning hook(s) this Trainer never calls: "
            f"{', '.join(uncalled)} (see README, 'Coming from Lightning')"
        )
    trainer._dispatch.callbacks("setup", stage)
    module.setup(stage)
    with strategy.module_init_context():
        module.configure_model()
    if not any(True for _ in module.parameters()):
        raise ValueError(
            f"{type(module).__name__} has no parameters; build layers in __init__ or configure_model()"
        )
    if stage == "fit" and trainer.sync_batchnorm and strategy.dp_size > 1:
        # before the wrapping, as Lightning converts them: the ranks that read different data normalise together
        convert_sync_batchnorm(module, strategy.dp_group, strategy.root_device.type)
    strategy.setup_module(module)
    module.zero_grad()  # every stage starts without gradients from before it, as Lightning's


def _prepare_data(trainer: Trainer, module: TrainModule, datamodule: Any) -> None:
    """Lightning's `prepare_data`: once per node (local rank 0; global rank 0 when the owner sets
    `prepare_data_per_node = False`) while the other processes wait, so none reads a half-written file."""
    for owner in (datamodule, module):
        if owner is None or not callable(getattr(owner, "prepare_data", None)):
            continue
        per_node = getattr(owner, "prepare_data_per_node", True)
        if (trainer.strategy.local_rank if per_node else trainer.strategy.global_rank) == 0:
            owner.prepare_data()
    trainer.strategy.barrier()


def _finish(trainer: Trainer, stage: str) -> None:
    trainer.fitting = False
    loop = trainer._fit_loop
    if loop is not None and loop.progress is not None:
        loop.progress.close()
        loop.progress = None
    trainer.strategy.teardown()  # first: it completes checkpoints still being written
    trainer.checkpoint_manager.release()  # then this fit's folders are free for the next one
    trainer._dispatch.callbacks("teardown", stage)
    trainer.module.teardown(stage)
    call_if_defined(trainer.datamodule, "teardown", stage)
    if trainer.is_global_zero and stage == "fit":  # last: callbacks may still log in teardown
        for lg in trainer.loggers:
            lg.finalize()
    if stage == "fit":  # the module leaves the fit with the BatchNorm layers it came with, as in Lightning
        revert_sync_batchnorm(trainer.module)
    trainer._torch_switches.apply()


def _rank_loader(trainer: Trainer, loader: Iterable, train: bool) -> Iterable:
    """The loader this rank reads, as the strategy decides (by default: its share of the batch group);
    ours pins its batches for a GPU, so that their copies there don't wait for the step in flight."""
    # the sampling seed: the Trainer's, else seed_everything's (as Lightning's DistributedSampler), else 0
    seed = trainer.seed if trainer.seed is not None else global_seed()
    if train and trainer.fault_tolerance is not None:  # the replica groups split the data first
        loader = replica_loader(loader, trainer.fault_tolerance, trainer.strategy, seed)
    elif trainer.use_distributed_sampler:
        loader = trainer.strategy.process_dataloader(loader, seed, train=train)
    pin_for_device(loader, trainer.strategy.root_device)
    if seeds_workers() and getattr(loader, "worker_init_fn", False) is None:  # as Lightning adds it
        loader.worker_init_fn = functools.partial(worker_init_function, rank=trainer.global_rank)
    return loader
