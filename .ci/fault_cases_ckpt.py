"""The fault audit's checkpoint cases (see fault_audit.py): a real run's checkpoint files truncated, flipped,
deleted, appended to, swapped with another step's, replaced by a pickle that runs code (with and without the
manifest's hash recomputed), then `trainer fit --ckpt-path last`, `validate`, `export`; every checkpoint bad,
a step that collides, a file outside the manifest, chmod, a file where a folder goes, a full disk, a forged
DCP `.metadata` under 2 DDP ranks, a LoRA base copied or changed. Also the runs every case starts from."""

from __future__ import annotations

import builtins
import json
import os
import pickle
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from fault_run import MARKER, PY, REPO, TRAINER, Case, Command, fixtures, trainer_cmd

RECIPES = REPO / "recipes"
TINY, SFT = str(RECIPES / "llama_tiny.yaml"), str(RECIPES / "hf_sft_llama_tiny.yaml")
SMALL = ["model.dim=64", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2", "data.seq_len=64"]
EVERY_2 = "callbacks=[{class_path: callbacks.ModelCheckpoint, init_args: {every_n_steps: 2, save_top_k: -1}}]"
TOP_2 = EVERY_2.replace("save_top_k: -1", "save_top_k: 2")
PLAIN = [*SMALL, "data.batch_size=4", "trainer.val_check_interval=2", "trainer.limit_val_batches=2",
         "trainer.warmup_steps=1", "trainer.val_at_start=false", "trainer.default_root_dir=run"]  # fmt: skip
RUN = [*PLAIN, EVERY_2]  # the recipe's checkpoints every 100 steps become every 2, all kept
DDP = ["strategy.name=ddp", "trainer.devices=2", "data.global_batch_size=8"]
LORA = [*"model.hf=new:base data.batch_size=4 trainer.val_check_interval=2 trainer.limit_val_batches=1".split(),
        "model.lora={r: 4, target_modules: [q_proj, v_proj]}", f"data.path={RECIPES / 'data' / 'sft_tiny.jsonl'}",
        "trainer.default_root_dir=run", "trainer.warmup_steps=1", EVERY_2]  # fmt: skip
RESUME = ["fit", TINY, *RUN, "trainer.max_steps=8", "--ckpt-path", "last"]
VALIDATE = ["validate", TINY, *RUN]
STEP6, STEP4 = "run/checkpoints/step-00000006", "run/checkpoints/step-00000004"
EXPORT6 = ["export", STEP6, "out"]


def api(*args: str, timeout: float = 120.0) -> Command:
    """`python fit.py ARGS`: the user's script (fault_fit.py)."""
    return Command([PY, "fit.py", *args], timeout=timeout)


def write_script(folder: Path) -> None:
    shutil.copyfile(Path(__file__).with_name("fault_fit.py"), folder / "fit.py")


def build_api(folder: Path) -> list[Command]:
    write_script(folder)
    return [api("--max-steps", "6", timeout=300)]


BUILDS: dict[str, Callable[[Path], list[Command]]] = {  # the runs cases copy; checkpoints at steps 2, 4 (, 6)
    "cli": lambda folder: [trainer_cmd("fit", TINY, *RUN, "trainer.max_steps=6", timeout=300)],
    "api": build_api,
    "ddp": lambda folder: [trainer_cmd("fit", TINY, *RUN, *DDP, "trainer.max_steps=4", timeout=300)],
    "lora": lambda folder: [trainer_cmd("fit", SFT, *LORA, "trainer.max_steps=4", timeout=300)],  # base/: new
}


# --- damage: each (path, the same file in step 4, the case folder) ------------------------------------------------


class Shell:
    """A pickle payload: unpickling it runs a shell command."""

    def __init__(self, command: str) -> None:
        self.command = command

    def __reduce__(self):
        return (os.system, (self.command,))


class Exec:
    """A pickle payload: unpickling it runs Python code."""

    def __init__(self, code: str) -> None:
        self.code = code

    def __reduce__(self):
        return (builtins.exec, (self.code,))


def truncate(path: Path, other: Path, case: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def flip(path: Path, other: Path, case: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def delete(path: Path, other: Path, case: Path) -> None:
    path.unlink()


def append(path: Path, other: Path, case: Path) -> None:
    with path.open("ab") as f:
        f.write(b"\0appended by the fault audit\n")


def swap(path: Path, other: Path, case: Path) -> None:
    shutil.copyfile(other, path)


def crafted_pickle(path: Path, other: Path, case: Path) -> None:
    import torch

    torch.save({"state": Shell(f"touch {case / MARKER}")}, path)


def forged_pickle(path: Path, other: Path, case: Path) -> None:
    """A code-running pickle with the manifest's hash and size recomputed, as anyone who can write it can."""
    import torch

    torch.save({"state": Exec(f"open({str(case / MARKER)!r}, 'w').close()")}, path)
    rehash(path)


def rehash(path: Path) -> None:
    """Record `path`'s new hash and size in its checkpoint's manifest (meta.json)."""
    sys.path.insert(0, str(REPO))
    from trainer.checkpoint.integrity import hash_file

    ckpt = next(p for p in path.parents if (p / "meta.json").exists())
    meta = json.loads((ckpt / "meta.json").read_text())
    meta["manifest"][path.relative_to(ckpt).as_posix()] = hash_file(path)
    (ckpt / "meta.json").write_text(json.dumps(meta))


def unlist(ckpt: Path, file: str) -> None:
    """Drop `file` from the checkpoint's manifest."""
    meta = json.loads((ckpt / "meta.json").read_text())
    del meta["manifest"][file]
    (ckpt / "meta.json").write_text(json.dumps(meta, indent=1))


DAMAGES: dict[str, Callable[[Path, Path, Path], None]] = {
    "truncate": truncate, "flip": flip, "delete": delete, "append": append, "swap": swap,
    "pickle": crafted_pickle, "forged-pickle": forged_pickle,
}  # fmt: skip
ON_FIT = {  # the damages worth trying per file, on a resume
    "model.safetensors": ("truncate", "flip", "delete", "append", "swap"),
    "optimizer.pt": tuple(DAMAGES),
    "state.pt": tuple(DAMAGES),
    "meta.json": ("truncate", "flip", "delete", "append", "swap"),
    "validated.json": ("flip", "delete", "swap"),
}
ON_VALIDATE = {("model.safetensors", d) for d in ("truncate", "flip", "swap")} | {
    ("optimizer.pt", "flip"), ("optimizer.pt", "append"), ("optimizer.pt", "forged-pickle"),
    ("state.pt", "forged-pickle"), ("state.pt", "delete"), ("meta.json", "flip"), ("meta.json", "delete"),
}  # fmt: skip
ON_EXPORT = {("model.safetensors", d) for d in ("truncate", "flip", "delete", "swap")} | {
    ("optimizer.pt", "flip"), ("optimizer.pt", "delete"), ("optimizer.pt", "forged-pickle"),
    ("optimizer.pt", "pickle"), ("state.pt", "forged-pickle"), ("meta.json", "delete"), ("meta.json", "truncate"),
}  # fmt: skip
COMMANDS = {  # what runs after the damage, and what it must do
    "fit": (RESUME, "recover"),  # go on from step 4, saying why step 6 was set aside
    "validate": (VALIDATE, "notice"),  # refuse, or fall back saying why
    "export": (EXPORT6, "refuse"),
}


def damaged(file: str, damage: str, command: str) -> Case:
    """The CLI run's newest checkpoint (step 6) with `file` damaged, then `command`."""
    argv, expect = COMMANDS[command]
    if file == "validated.json" and damage != "delete":  # the record of a validation that passed, damaged:
        expect = "answer"  # the files themselves still verify by the manifest

    def prepare(folder: Path) -> Command:
        fixtures().copy("cli", folder)
        DAMAGES[damage](folder / STEP6 / file, folder / STEP4 / file, folder)
        return trainer_cmd(*argv)

    what, names = f"{damage} step-6/{file}; trainer {command}", rf"step-0*6|{re.escape(file)}"
    return Case(f"ckpt-{command}-{file}-{damage}", what, prepare, expect, names)


def damaged_cases() -> list[Case]:
    cases = [damaged(f, d, "fit") for f, ds in ON_FIT.items() for d in ds]
    cases += [damaged(f, d, "validate") for f, d in sorted(ON_VALIDATE)]
    return cases + [damaged(f, d, "export") for f, d in sorted(ON_EXPORT)]


# --- whole checkpoints and folders ---------------------------------------------------------------------------------


def copied(
    edit: Callable[[Path], None], argv: list[str], name: str = "cli", **kw
) -> Callable[[Path], Command]:
    """A copy of fixture `name`, `edit`ed, then `trainer ARGV`."""

    def prepare(folder: Path) -> Command:
        fixtures().copy(name, folder)
        edit(folder)
        return trainer_cmd(*argv, **kw)

    return prepare


def all_bad(folder: Path) -> None:
    for ckpt in sorted((folder / "run/checkpoints").glob("step-*")):
        flip(ckpt / "optimizer.pt", ckpt, folder)


def step_collides(folder: Path) -> None:
    meta = folder / STEP6 / "meta.json"
    meta.write_text(meta.read_text().replace('"step": 6', '"step": 4'))


def unlisted_flipped(folder: Path) -> None:
    unlist(folder / STEP6, "optimizer.pt")
    flip(folder / STEP6 / "optimizer.pt", folder, folder)


def chmod_checkpoints(mode: int, argv: list[str]) -> Callable[[Path], Command]:
    """The CLI run with its checkpoints folder chmod `mode`, then `argv` by a root that obeys it."""

    def prepare(folder: Path) -> Command:
        fixtures().copy("cli", folder)
        os.chmod(folder / "run/checkpoints", mode)
        return Command([TRAINER, *argv], no_dac=True)

    return prepare


def file_at(rel: str) -> Callable[[Path], Command]:
    """The user's file where the run's folder `rel` goes, then a fit."""

    def prepare(folder: Path) -> Command:
        (folder / rel).parent.mkdir(parents=True, exist_ok=True)
        (folder / rel).write_text("the user's notes, not a folder\n")
        return trainer_cmd("fit", TINY, *RUN, "trainer.max_steps=4", timeout=90)

    return prepare


def tmpfs(folder: Path, size: int) -> Path:
    """A tmpfs of `size` bytes at folder/disk (fault_audit unmounts it after the case)."""
    disk = folder / "disk"
    disk.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(disk)], check=True)
    return disk


def disk_full_resume(folder: Path) -> Command:
    """The run on a tmpfs 1 MB larger than it: the step-8 checkpoint cannot be written."""
    fixtures().copy("cli", folder / "src")
    used = sum(p.stat().st_size for p in (folder / "src").rglob("*") if p.is_file())
    disk = tmpfs(folder, used + (1 << 20))
    shutil.copytree(folder / "src/run", disk / "run")
    shutil.rmtree(folder / "src")
    return trainer_cmd(*[a.replace("default_root_dir=run", "default_root_dir=disk/run") for a in RESUME])


def file_size_limit(folder: Path) -> Command:
    fixtures().copy("cli", folder)
    return Command([TRAINER, *RESUME], fsize=1_000_000)  # model.safetensors (0.6 MB) fits, optimizer.pt not


def export_full(folder: Path) -> Command:
    fixtures().copy("cli", folder)
    tmpfs(folder, 256 * 1024)
    return trainer_cmd("export", STEP6, "disk/out", timeout=60)


def step_at_least(n: int) -> Callable[[Path, str], str | None]:
    """A check: the run's newest checkpoint is of step `n` or later."""

    def check(folder: Path, last: str) -> str | None:
        steps = [int(p.name.split("-")[-1]) for p in (folder / "run/checkpoints").glob("step-*")]
        return None if max(steps, default=0) >= n else f"no checkpoint at step >= {n}: {sorted(steps)}"

    return check


def folder_cases() -> list[Case]:
    six, fit8 = r"step-0*6|optimizer\.pt", ["fit", TINY, *RUN, "trainer.max_steps=8"]
    flipped = lambda f: flip(f / STEP6 / "optimizer.pt", f, f)  # noqa: E731
    return [
        Case("ckpt-fit-all-bad", "optimizer.pt flipped in every checkpoint; fit --ckpt-path last (save_top_k 2)",
             copied(all_bad, ["fit", TINY, *RUN, TOP_2, "trainer.max_steps=6", "--ckpt-path", "last"]), "recover",
             r"step-0*\d|scratch|no checkpoint", check=step_at_least(6)),
        Case("ckpt-validate-all-bad", "optimizer.pt flipped in every checkpoint; validate",
             copied(all_bad, VALIDATE), "notice", r"step-0*\d|checkpoint"),
        Case("ckpt-fit-step-collides", "step-6/meta.json says step 4; fit --ckpt-path last",
             copied(step_collides, RESUME), "recover", r"step-0*6|meta\.json", check=step_at_least(8)),
        Case("ckpt-fit-unlisted", "optimizer.pt dropped from the manifest and flipped; fit",
             copied(unlisted_flipped, RESUME), "recover", six),
        Case("ckpt-validate-unlisted", "optimizer.pt dropped from the manifest and flipped; validate",
             copied(unlisted_flipped, VALIDATE), "notice", six),
        Case("ckpt-export-unlisted", "optimizer.pt dropped from the manifest and flipped; export",
             copied(unlisted_flipped, EXPORT6), "refuse", six),
        Case("ckpt-fit-explicit-flipped", "--ckpt-path step-6 (optimizer.pt flipped); fit",
             copied(flipped, [*fit8, "--ckpt-path", STEP6]), "refuse", six),
        Case("ckpt-validate-explicit-flipped", "--ckpt-path step-6 (optimizer.pt flipped); validate",
             copied(flipped, [*VALIDATE, "--ckpt-path", STEP6]), "refuse", six),
        Case("ckpt-fresh-over-other-run", "a new run (no --ckpt-path, save_top_k 2) where another run saved",
             copied(lambda f: None, ["fit", TINY, *RUN, TOP_2, "trainer.max_steps=6"]), "answer"),
        Case("folder-read-only", "checkpoints folder chmod 555 (root without DAC override); fit --ckpt-path last",
             chmod_checkpoints(0o555, RESUME), "refuse", r"run/checkpoints"),
        Case("folder-unreadable-fit", "checkpoints folder chmod 000 (root without DAC override); fit --ckpt-path last",
             chmod_checkpoints(0o000, RESUME), "refuse", r"run/checkpoints"),
        Case("folder-unreadable-validate", "checkpoints folder chmod 000 (root without DAC override); validate",
             chmod_checkpoints(0o000, VALIDATE), "refuse", r"run/checkpoints"),
        Case("folder-run-is-a-file", "a file where the run folder goes; fit", file_at("run"), "refuse", r"\brun\b"),
        Case("folder-checkpoints-is-a-file", "a file at run/checkpoints; fit", file_at("run/checkpoints"),
             "refuse", r"run/checkpoints"),
        Case("disk-full-tmpfs", "run on a tmpfs 1 MB larger than it; fit --ckpt-path last to 8", disk_full_resume,
             "refuse", r"disk/run/checkpoints|step-0*8", owned=("disk/run/logs/", "disk/run/export/")),
        Case("disk-file-size-limit", "RLIMIT_FSIZE 1 MB; fit --ckpt-path last to 8", file_size_limit, "refuse",
             r"run/checkpoints|step-0*8|optimizer\.pt"),
        Case("disk-full-export", "export into a 256 KB tmpfs", export_full, "refuse", r"disk/out"),
        Case("export-missing-checkpoint", "trainer export of a folder that does not exist",
             lambda f: trainer_cmd("export", "run/checkpoints/step-00000042", "out"), "refuse", r"step-0*42"),
        Case("export-out-is-a-file", "trainer export into a path that is the user's file",
             copied(lambda f: (f / "out").write_text("the user's file\n"), EXPORT6), "refuse", r"\bout\b"),
    ]  # fmt: skip


# --- sharded (DCP) checkpoints and LoRA ----------------------------------------------------------------------------


def forge_metadata(folder: Path) -> None:
    path = folder / STEP4 / "dcp" / ".metadata"
    path.write_bytes(pickle.dumps(Shell(f"touch {folder / MARKER}")))
    rehash(path)


def truncate_metadata(folder: Path) -> None:
    truncate(folder / STEP4 / "dcp" / ".metadata", folder, folder)


def flip_shard(folder: Path) -> None:
    flip(sorted((folder / STEP4 / "dcp").glob("*.distcp"))[0], folder, folder)


def ddp_case(name: str, damage: Callable[[Path], None], argv: list[str], expect: str) -> Case:
    prepare = copied(damage, argv, "ddp", timeout=180)
    return Case(
        name, f"{name} (2 DDP ranks' checkpoint, step 4)", prepare, expect, r"\.metadata|\.distcp|step-0*4"
    )


def lora_resume(base: str, edit: Callable[[Path], None]) -> Callable[[Path], Command]:
    return copied(
        edit, ["fit", SFT, *LORA, f"model.hf={base}", "trainer.max_steps=6", "--ckpt-path", "last"], "lora"
    )


def sharded_cases() -> list[Case]:
    resume = ["fit", TINY, *RUN, *DDP, "trainer.max_steps=6", "--ckpt-path", "last"]
    export = ["export", STEP4, "out"]
    return [
        ddp_case("dcp-meta-forged-fit", forge_metadata, resume, "recover"),
        ddp_case("dcp-meta-forged-validate", forge_metadata, ["validate", TINY, *RUN, *DDP], "notice"),
        ddp_case("dcp-meta-forged-export", forge_metadata, export, "refuse"),
        ddp_case("dcp-meta-truncated-export", truncate_metadata, export, "refuse"),
        ddp_case("dcp-shard-flipped-export", flip_shard, export, "refuse"),
        Case("lora-base-copied", "LoRA resumed on a byte-identical copy of its base in another folder",
             lora_resume("base2", lambda f: shutil.copytree(f / "base", f / "base2")), "ok"),
        Case("lora-base-changed", "LoRA resumed after its base's weights were changed in place",
             lora_resume("base", lambda f: flip(f / "base/model.safetensors", f, f)), "notice", r"\bbase\b"),
    ]  # fmt: skip


def checkpoint_cases() -> list[Case]:
    return [*damaged_cases(), *folder_cases(), *sharded_cases()]
