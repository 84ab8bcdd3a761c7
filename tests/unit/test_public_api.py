"""The names DESIGN.md and the README promise, importable where they say."""


def test_the_public_names_import_from_their_packages():
    from callbacks import (  # noqa: F401
        Callback,
        EarlyStopping,
        GPUHealthMonitor,
        LearningRateMonitor,
        ModelCheckpoint,
        NaNGuard,
        Profiler,
        StragglerDetector,
        ThroughputMonitor,
        Timer,
    )
    from strategies import DDPStrategy, DPSGDStrategy, FSDPStrategy, Parallel3DStrategy, SingleDeviceStrategy
    from strategies.dp_sgd import DPSGDStrategy as Defined
    from trainer import DataModule, Trainer, TrainModule, seed_everything  # noqa: F401
    from trainer.data.hf_data import hf_dataloaders  # noqa: F401
    from trainer.models.hf import HFModule  # noqa: F401

    assert DPSGDStrategy is Defined
    assert {DDPStrategy, FSDPStrategy, Parallel3DStrategy, SingleDeviceStrategy} <= set(
        __import__("strategies.registry").registry.STRATEGIES.values()
    )


def test_every_callback_class_of_lightning_has_its_name_here():
    import pytorch_lightning as pl

    import callbacks

    assert set(pl.callbacks.__all__) <= set(callbacks.__all__)
    assert issubclass(callbacks.ModelCheckpoint, callbacks.Checkpoint)
    assert issubclass(callbacks.TQDMProgressBar, callbacks.ProgressBar)
