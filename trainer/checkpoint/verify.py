"""Verifying a checkpoint before it is loaded: the one gate every load passes (`problem`, `check_good`).

What loading protects against:
- corruption (a flipped bit, a truncated, extended or half-copied file, a deleted file): meta.json carries
  a manifest, the size and block hashes (trainer/checkpoint/integrity.py) of every file, taken while writing; every
  file is verified before it is loaded. The manifest is the allow-list: a checkpoint holding a file it
  does not list (added, or swapped in from another checkpoint with its entry removed) is refused, naming
  it. A checkpoint without a manifest, or whose manifest lists no file, is refused unless the caller opts
  in (`allow_unverified`); meta.json's step must equal the loop state's inside the hashed files.
- code in a file: nothing is unpickled beyond an allow-list (safetensors; `torch.load(weights_only=True)`;
  DCP's metadata through an allow-listed unpickler and its byte items with `weights_only`), so a forged
  file is refused, naming it, instead of running.
What it does not protect against: an adversary who rewrites a file *and* its manifest entry can change
the weights or the loop state undetected (the hashes are for integrity, not authenticity).

A checkpoint saved with `pending_validation` is *good* only once `validated.json` exists (ModelCheckpoint
writes it after reloading the checkpoint and comparing losses); one that failed validation is renamed
`bad-step-XXXXXXXX` and kept for inspection.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from trainer.checkpoint import integrity
from trainer.checkpoint.layout import (
    META_FILE,
    VALIDATED_FILE,
    CheckpointError,
    completed,
    read_meta,
    require_exists,
    step_of,
    unfinished_steps,
)

log = logging.getLogger("trainer")


Agree = Callable[[Any], Any]  # this rank's problem (or None) -> the first of every rank's, on every rank


def alone(problem: str | None) -> str | None:
    """The `Agree` of a single process."""
    return problem


def problem(
    ckpt_dir: Path, part: tuple[int, int] = (0, 1), validated: bool = True, allow_unverified: bool = False
) -> str | None:
    """Why the checkpoint is not good, as rank `part[0]` of `part[1]` sees it, or None: the one gate every
    load passes. Every rank checks meta.json, that its manifest lists every file (unlisted_files), each
    file's presence and size, and (with `validated`) the validation marker; the block
    hashes are split over the ranks (integrity.share), so the ranks' answers must be combined (`Agree`).
    A checkpoint whose manifest is missing or lists no file is refused unless `allow_unverified`."""
    try:
        meta = read_meta(ckpt_dir)
    except CheckpointError as err:
        return err.reason
    manifest = meta.get("manifest") or {}
    if not manifest and not allow_unverified:
        return (
            f"{META_FILE} {'lists no file' if 'manifest' in meta else 'has no manifest'}, so nothing in it "
            "can be verified; refused (allow_unverified_checkpoints=True loads it unverified)"
        )
    unlisted = unlisted_files(ckpt_dir, manifest) if manifest else []
    if unlisted:
        return (
            f"{unlisted[0]} is not in {META_FILE}'s manifest (added or replaced after the save): "
            "refused; a checkpoint loads only the files its manifest lists and verifies"
        )
    for name, entry in manifest.items():
        path = Path(ckpt_dir) / name
        if not path.is_file():
            return f"incomplete: missing {name}"
        actual, size = path.stat().st_size, integrity.expected_size(entry)
        if actual != size:
            return f"{name} has {actual} bytes, {size} were written (truncated or altered)"
    mismatch = integrity.first_mismatch(ckpt_dir, integrity.share(integrity.units(manifest), *part))
    if mismatch is not None:
        return mismatch
    if validated and meta.get("pending_validation") and not (Path(ckpt_dir) / VALIDATED_FILE).exists():
        return "never validated (the run stopped during validation?)"
    return None


def unlisted_files(ckpt_dir: Path, manifest: dict[str, Any]) -> list[str]:
    """The files under `ckpt_dir` (paths relative to it, sorted) that neither `manifest` lists nor are the
    checkpoint's own records (meta.json, validated.json and its temporary name)."""
    ckpt_dir = Path(ckpt_dir)
    records = {META_FILE, VALIDATED_FILE, f".{VALIDATED_FILE}.tmp"}
    found = []
    for root, _, files in os.walk(ckpt_dir):
        for name in files:
            relative = (Path(root) / name).relative_to(ckpt_dir).as_posix()
            if relative not in manifest and relative not in records:
                found.append(relative)
    return sorted(found)


def check_good(
    ckpt_dir: Path, part: tuple[int, int] = (0, 1), agree: Agree = alone, allow_unverified: bool = False
) -> dict[str, Any]:
    """meta.json of a checkpoint that is complete, intact and, if it awaited validation, validated; else
    CheckpointError "checkpoint '<dir>': <why>". In a distributed run call it on every rank, with `agree`."""
    require_exists(ckpt_dir)
    why = agree(problem(ckpt_dir, part, allow_unverified=allow_unverified))
    if why is not None:
        raise CheckpointError(f"checkpoint '{ckpt_dir}': {why}", reason=why)
    meta = read_meta(ckpt_dir)
    if not meta.get("manifest"):
        log.warning(
            f"checkpoint '{ckpt_dir}' has no manifest: loaded unverified (allow_unverified_checkpoints)"
        )
    return meta


def check_step(ckpt_dir: Path, state: dict[str, Any]) -> None:
    """CheckpointError unless meta.json's step (not hashed) equals the loop state's (inside hashed files)."""
    said, inside = read_meta(ckpt_dir).get("step"), state.get("loop", {}).get("global_step")
    if said != inside:
        why = f"{META_FILE} says step {said} but its loop state is at step {inside} (meta.json was altered)"
        raise CheckpointError(f"checkpoint '{ckpt_dir}': {why}", reason=why)


def find_last_good(
    directory: Path,
    before_step: int | None = None,
    part: tuple[int, int] = (0, 1),
    agree: Agree = alone,
    allow_unverified: bool = False,
) -> tuple[Path | None, list[str]]:
    """(the newest checkpoint under `directory`, of a step < `before_step`, that is good, or None; one line
    "step-00000004: optimizer.pt checksum mismatch ..." per newer checkpoint it skipped). In a distributed
    run call it on every rank with `part` and `agree`: the hashing is split over the ranks."""
    skipped, found = [], None
    for path in completed(directory):
        if before_step is not None and step_of(path) >= before_step:
            continue
        why = agree(problem(path, part, allow_unverified=allow_unverified))
        if why is None:
            found = path
            break
        skipped.append(f"{path.name}: {why}")
    newest = -1 if found is None else step_of(found)  # newer folders "last" passed over without a meta.json
    for path, why in unfinished_steps(directory):
        if newest < step_of(path) and (before_step is None or step_of(path) < before_step):
            skipped.append(f"{path.name}: {why}")
    return found, skipped
