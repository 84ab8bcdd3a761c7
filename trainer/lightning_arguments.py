"""Lightning's Trainer arguments that are not loop flags, resolved to what runs here: `plugins` (the kinds
that have a counterpart: precision, SyncBatchNorm, the cluster environments this Trainer reads itself),
`barebones` (its opt-outs applied, its conflicts refused as Lightning refuses them), `profiler` (a
callback) and `use_distributed_sampler`'s limits. Each is a one-line error where it cannot apply."""

from __future__ import annotations

from typing import Any

from callbacks.base import Callback
from callbacks.phase_times import PhaseTimes
from callbacks.profiler import Profiler
from strategies.base import Strategy
from trainer.core.logging import rank_zero_info

# Lightning's cluster environments whose variables trainer/core/launch.py reads itself: nothing to plug in
ENVIRONMENTS = ("LightningEnvironment", "TorchElasticEnvironment", "SLURMEnvironment")

# profiler= names: "simple" the phase clock's totals at the end of the fit (no trace), "advanced" the torch
# profiler's trace with Python stacks and shapes (where Lightning's runs cProfile), "pytorch" its trace
PROFILERS = {
    "simple": PhaseTimes,
    "advanced": lambda: Profiler(with_stack=True, record_shapes=True),
    "pytorch": Profiler,
}

# barebones=True turns these off: (argument, the values that agree with it, what it would switch on)
_OPT_OUTS = (
    ("enable_checkpointing", (None, False), "checkpointing"),
    ("logger", (None, False), "logging"),
    ("loggers", (None, []), "logging"),
    ("enable_progress_bar", (None, False), "the progress bar"),
    ("log_every_n_steps", (None, 0), "logging"),
    ("enable_model_summary", (None, False), "the model summary"),
    ("num_sanity_val_steps", (None, 0), "the sanity check"),
    ("fast_dev_run", (False, 0), "a development run"),
    ("detect_anomaly", (False,), "anomaly detection"),
    ("profiler", (None,), "profiling"),
)


def resolve_plugins(given: dict[str, Any]) -> None:
    """Lightning's `plugins` into the arguments they stand for, in `given` (the Trainer's arguments): a
    precision plugin's `precision`, TorchSyncBatchNorm's `sync_batchnorm=True`; a cluster environment this
    Trainer reads itself is taken as is; any other kind is refused, by name. `precision=None` is "32"."""
    plugins = given["plugins"]
    for plugin in plugins if isinstance(plugins, (list, tuple)) else [] if plugins is None else [plugins]:
        name = type(plugin).__name__
        precision = getattr(plugin, "precision", None)
        if isinstance(precision, str):
            if given["precision"] not in (None, "32", 32, "32-true"):
                raise ValueError(
                    f"precision={given['precision']!r} and plugins=[{name}(precision={precision!r})]; "
                    "allowed: one of the two, as in Lightning"
                )
            given["precision"] = precision
        elif name == "TorchSyncBatchNorm":
            given["sync_batchnorm"] = True
        elif name not in ENVIRONMENTS:
            raise ValueError(
                f"plugins=[{name}] has no counterpart here; allowed: a precision plugin (MixedPrecision, "
                f"HalfPrecision, ...), TorchSyncBatchNorm, or {', '.join(ENVIRONMENTS)}"
            )
    if given["precision"] is None:
        given["precision"] = "32"


def apply_barebones(given: dict[str, Any]) -> None:
    """`barebones=True` in `given`: what it turns off is off, and an argument that asks for one of those is
    refused in one line, as Lightning refuses it. The JSONL run log stays (at the default interval)."""
    if not given["barebones"]:
        return
    for name, agreeing, feature in _OPT_OUTS:
        value = given[name]
        if not any(value is v or (type(value) is type(v) and value == v) for v in agreeing):
            raise ValueError(
                f"barebones=True with {name}={value!r}: {feature} is off in barebones mode; allowed: leave "
                f"{name} unset, or barebones=False"
            )
    given.update(enable_checkpointing=False, logger=False, enable_progress_bar=False)
    given.update(log_every_n_steps=None, enable_model_summary=False, num_sanity_val_steps=0)
    rank_zero_info(
        "barebones=True: checkpointing, your loggers, the progress bar, the model summary and the sanity "
        "check are off (the JSONL run log stays)"
    )


def profiler_callback(profiler: Any) -> Callback | None:
    """The callback that `profiler=` stands for: a name of `PROFILERS`, or a Profiler/PhaseTimes itself."""
    if profiler is None or isinstance(profiler, (Profiler, PhaseTimes)):
        return profiler
    if isinstance(profiler, str) and profiler in PROFILERS:
        return PROFILERS[profiler]()
    raise ValueError(
        f"profiler={profiler!r} is unknown; allowed: {', '.join(map(repr, PROFILERS))}, a callbacks.Profiler "
        "or a callbacks.PhaseTimes"
    )


def check_distributed_sampler(use: bool, strategy: Strategy, fault_tolerance: Any) -> None:
    """`use_distributed_sampler=False` (every rank reads its loaders as given) where the data's split is
    not the user's to make: a strategy that samples its own batches, or replica groups."""
    if use:
        return
    if fault_tolerance is not None:
        raise ValueError(
            "use_distributed_sampler=False with fault_tolerance=: the replica groups split the training data; "
            "allowed: use_distributed_sampler=True"
        )
    # imported when used, as trainer.fault_tolerance imports it
    from trainer.fault_tolerance.data import check_strategy

    check_strategy(strategy, "use_distributed_sampler=False")


def say_unapplied(model_registry: str | None) -> None:
    """One line for an argument that is kept but does nothing here."""
    if model_registry is not None:
        rank_zero_info(
            f"model_registry={model_registry!r} names a model on Lightning's hub (litmodels); this Trainer "
            "uploads and downloads nothing: checkpoints stay in the run's folder"
        )
