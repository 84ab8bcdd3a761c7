"""Recipe YAML -> typed sections -> objects, with one-line errors for bad keys, types and paths.

A recipe reads like a description of the run; its sections are `model`, `data`, `optimizer`,
`trainer`, `strategy`, `callbacks` and `loggers`. Every key is checked against the dataclass (or
signature) it configures: an unknown key names the closest valid one, a wrong type names the key,
the expected type and the value given. `key.path=value` overrides go through the same checks.

schema.py holds the sections, checks.py the generic key/type/range checks, load.py the loading,
overrides and resolution, build.py the objects a resolved recipe describes.
"""

from trainer.config.build import _micro_batch as _micro_batch  # tests split a global batch through it
from trainer.config.build import build_run, memory_lines
from trainer.config.checks import check_init_args, import_path
from trainer.config.load import apply_override, build_llama_config, load_recipe, resolve
from trainer.config.schema import (
    NEW_HF,
    SECTIONS,
    ConfigError,
    DataSection,
    ModelSection,
    OptimizerSection,
)

__all__ = [
    "NEW_HF",
    "SECTIONS",
    "ConfigError",
    "DataSection",
    "ModelSection",
    "OptimizerSection",
    "apply_override",
    "build_llama_config",
    "build_run",
    "check_init_args",
    "import_path",
    "load_recipe",
    "memory_lines",
    "resolve",
]
