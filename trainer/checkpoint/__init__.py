"""Checkpoints on disk, and the one name space of the checkpoint files (`from trainer import checkpoint as
ckpt`).

A checkpoint is a directory `step-00000120/` holding `model.safetensors`, `optimizer.pt`, `state.pt`
(loop counters, RNG, scheduler, scaler, data position, callback state) and `meta.json`; a sharded one
holds each rank's own shards under `dcp/` instead of the first two. It is written under a temporary name
that carries its owner (`.tmp-step-N-<run id>-<pid>`) and renamed into place, so a directory with the
final name is always complete; a failed save removes its temporary directory, and a fit removes the ones
dead writers left in its folder (run_folder.py keeps one live writer per folder). A checkpoint written by
another run is never replaced. The pieces, in this folder: layout.py (names, meta.json, listing a folder),
files.py (hashed safetensors/torch files), staging.py (the write-and-rename protocol, setting aside),
verify.py (the gate every load passes) with integrity.py (the block hashes) and safe_dcp.py (pickle-free DCP
reading), weights.py (a checkpoint's full weights in one process), run_folder.py (which folder a fit
writes, its lock), records.py (SavedCheckpoint, and the one rule for which checkpoint is best), manager.py
(the one owner of a run's checkpoint folders) and export.py; callers use the first four through this name
space. The manager imports the callbacks: it is imported by its own path
(trainer.checkpoint.manager), never from here.
"""

from __future__ import annotations

from trainer.checkpoint.files import (
    check_pickled_files,
    load_model_file,
    load_torch_file,
    save_model_file,
    save_torch_file,
)
from trainer.checkpoint.layout import (
    DCP_DIR,
    FORMAT_VERSION,
    META_FILE,
    MODEL_FILE,
    OPTIMIZER_FILE,
    STATE_FILE,
    VALIDATED_FILE,
    CheckpointError,
    Entries,
    completed,
    find_last,
    manifest_bytes,
    meta_for,
    newer_than,
    read_meta,
    require_exists,
    run_of,
    step_dir_name,
    step_of,
    tensor_bytes,
)
from trainer.checkpoint.staging import (
    clear_stale_staging,
    dir_bytes,
    mark_bad,
    mark_validated,
    move_aside,
    no_space,
    refuse_foreign,
    save_error,
    staging_dir,
    write_atomically,
)
from trainer.checkpoint.verify import (
    Agree,
    alone,
    check_good,
    check_step,
    find_last_good,
    problem,
    unlisted_files,
)

__all__ = [  # the one name space callers use (`from trainer import checkpoint as ckpt`)
    "DCP_DIR",
    "FORMAT_VERSION",
    "META_FILE",
    "MODEL_FILE",
    "OPTIMIZER_FILE",
    "STATE_FILE",
    "VALIDATED_FILE",
    "Agree",
    "CheckpointError",
    "Entries",
    "alone",
    "check_good",
    "check_pickled_files",
    "check_step",
    "clear_stale_staging",
    "completed",
    "dir_bytes",
    "find_last",
    "find_last_good",
    "load_model_file",
    "load_torch_file",
    "manifest_bytes",
    "mark_bad",
    "mark_validated",
    "meta_for",
    "move_aside",
    "newer_than",
    "no_space",
    "problem",
    "read_meta",
    "refuse_foreign",
    "require_exists",
    "run_of",
    "save_error",
    "save_model_file",
    "save_torch_file",
    "staging_dir",
    "step_dir_name",
    "step_of",
    "tensor_bytes",
    "unlisted_files",
    "write_atomically",
]
