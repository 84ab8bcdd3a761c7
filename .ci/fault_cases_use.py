"""The fault audit's usage cases (see fault_audit.py): Ctrl-C and SIGTERM (CLI and API), the user's script
resuming past damaged checkpoints, NaN losses, a lost replica group, malformed data (text, DPO and SFT
rows), bad recipes, overrides and tool flags."""

from __future__ import annotations

import json
import re
import signal
from collections.abc import Callable
from pathlib import Path

from fault_cases_ckpt import (
    DDP,
    PLAIN,
    RECIPES,
    RUN,
    SMALL,
    STEP4,
    STEP6,
    TINY,
    all_bad,
    api,
    delete,
    flip,
    forged_pickle,
    step_at_least,
    swap,
    truncate,
    unlist,
    write_script,
)
from fault_run import TRAINER, Case, Command, fixtures, last_line, trainer_cmd
from fault_run import execute as run_command

# --- signals -------------------------------------------------------------------------------------------------------


def stop_checkpoint(folder: Path, last: str) -> str | None:
    """A check: the stop line names its step and a checkpoint of that step, which exists."""
    said = re.search(r"stopped at step (\d+) .*checkpoint (\S+);", last)
    if not said:
        return "the stop line names no checkpoint"
    step, path = int(said.group(1)), folder / said.group(2)
    if not (path / "meta.json").is_file() or json.loads((path / "meta.json").read_text())["step"] != step:
        return f"no checkpoint of step {step} at {said.group(2)}"
    return None


LONG = ["trainer.max_steps=5000", "trainer.val_check_interval=1000", "trainer.log_every_n_steps=1"]
SFT_RUN = ["model.hf=new:base", f"data.path={RECIPES / 'data' / 'sft_tiny.jsonl'}", "data.batch_size=4",
           "trainer.limit_val_batches=1", "trainer.default_root_dir=run", *LONG]  # fmt: skip
AT_STEP_3 = ("run/logs/metrics.jsonl", r'"step": 3\b')  # the run has logged step 3


def cli_signal(
    sig: int, again: bool = False, recipe: str = TINY, overrides: tuple[str, ...] = (*PLAIN, *LONG)
) -> Callable[[Path], Command]:
    """A long CLI fit (the recipe's checkpoint every 100 steps) sent `sig` once its metrics log has step 3
    (`again`: a second one once it says it is stopping)."""

    def prepare(folder: Path) -> Command:
        signals = [(*AT_STEP_3, sig)] + [("output", r"finishing the step in flight", sig)] * again
        return Command([TRAINER, "fit", recipe, *overrides], timeout=180, signals=tuple(signals))

    return prepare


def killed_then_resumed(folder: Path) -> Command:
    """A fit (checkpoints every 2 steps) killed with SIGKILL once it logged step 3, then resumed to 8."""
    argv = ["fit", TINY, *RUN, "trainer.max_steps=5000", "trainer.log_every_n_steps=1"]
    kill = Command([TRAINER, *argv], signals=((*AT_STEP_3, signal.SIGKILL),))
    killed = run_command(kill, folder, fixtures().env(folder))
    if killed.rc != -signal.SIGKILL:
        raise RuntimeError(f"the fit to kill exited {killed.rc}: {last_line(killed)}")
    return trainer_cmd("fit", TINY, *RUN, "trainer.max_steps=8", "--ckpt-path", "last")


Edit = Callable[[Path], None]


def script(*args: str, base: bool = False, damage: Edit | None = None) -> Callable[[Path], Command]:
    """The user's script run with ARGS, in a fresh folder or (`base`) a copy of its 6-step run, `damage`d."""

    def prepare(folder: Path) -> Command:
        if base:
            fixtures().copy("api", folder)
        else:
            write_script(folder)
        if damage:
            damage(folder)
        return api(*args)

    return prepare


def resume_after_signal(folder: Path) -> Command:
    write_script(folder)
    first = run_command(api("--max-steps", "8", "--signal-at", "3"), folder, fixtures().env(folder))
    if first.rc != 130:
        raise RuntimeError(f"the interrupted fit exited {first.rc}: {last_line(first)}")
    return api("--max-steps", "8", "--ckpt-path", "last")


def replicas_group_lost(folder: Path) -> Command:
    write_script(folder)
    argv = ["replicas", "--groups", "2", "--min-replicas", "2", "--max-restarts", "0", "--heartbeat-timeout-ms",
            "1000", "fit.py", "--fault-tolerance", "--exit-at", "3", "--max-steps", "50"]  # fmt: skip
    return trainer_cmd(*argv, timeout=180)


def signal_cases() -> list[Case]:
    stopped = r"stopped at step \d+"
    return [
        Case("cli-ctrl-c", "Ctrl-C once step 3 is logged (of 5000)", cli_signal(signal.SIGINT), "signal", stopped,
             130, stop_checkpoint),
        Case("cli-sigterm", "SIGTERM once step 3 is logged (of 5000)", cli_signal(signal.SIGTERM), "signal",
             stopped, 143, stop_checkpoint),
        Case("cli-ctrl-c-twice", "a second Ctrl-C while it stops", cli_signal(signal.SIGINT, again=True), "signal",
             r"Ctrl-C|interrupt", 130),
        Case("ddp-ctrl-c", "Ctrl-C to 2 DDP ranks once step 3 is logged",
             cli_signal(signal.SIGINT, overrides=(*PLAIN, *DDP, *LONG)), "signal", stopped, 130, stop_checkpoint),
        Case("hf-sft-sigterm", "SIGTERM to the HF SFT recipe once step 3 is logged",
             cli_signal(signal.SIGTERM, recipe=str(RECIPES / "hf_sft_llama_tiny.yaml"), overrides=SFT_RUN),
             "signal", stopped, 143, stop_checkpoint),
        Case("cli-sigkill-then-resume", "SIGKILL once step 3 is logged, then fit --ckpt-path last to 8",
             killed_then_resumed, "ok", check=step_at_least(8)),
        Case("api-sigint", "os.kill(SIGINT) in step 3", script("--max-steps", "50", "--signal-at", "3"),
             "signal", stopped, 130, stop_checkpoint, api=True),
        Case("api-sigterm", "os.kill(SIGTERM) in step 3",
             script("--max-steps", "50", "--signal-at", "3", "--signal", "SIGTERM"), "signal", stopped, 143,
             stop_checkpoint, api=True),
        Case("api-resume-after-sigint", "stopped by SIGINT at step 3, resumed to 8", resume_after_signal, "ok",
             api=True, check=step_at_least(8)),
    ]  # fmt: skip


# --- the user's script -----------------------------------------------------------------------------------------------


def at6(file: str, fn: Callable[[Path, Path, Path], None]) -> Callable[[Path], None]:
    return lambda folder: fn(folder / STEP6 / file, folder / STEP4 / file, folder)


def unlisted_swapped(folder: Path) -> None:
    unlist(folder / STEP6, "optimizer.pt")
    swap(folder / STEP6 / "optimizer.pt", folder / STEP4 / "optimizer.pt", folder)


def api_cases() -> list[Case]:
    resume = ("--max-steps", "8", "--ckpt-path", "last")
    six = r"step-0*6|optimizer\.pt|state\.pt|model\.safetensors"
    damages = {
        "optimizer-flip": at6("optimizer.pt", flip),
        "state-delete": at6("state.pt", delete),
        "model-truncate": at6("model.safetensors", truncate),
        "state-forged-pickle": at6("state.pt", forged_pickle),
        "optimizer-unlisted-swapped": unlisted_swapped,
    }
    cases = [
        Case(f"api-resume-{name}", f"{name} in step 6; fit(ckpt_path='last')", script(*resume, base=True, damage=d),
             "recover", six, api=True)
        for name, d in damages.items()
    ]  # fmt: skip
    return cases + [
        Case("api-resume-all-bad", "optimizer.pt flipped in every checkpoint; fit(ckpt_path='last')",
             script(*resume, base=True, damage=all_bad), "recover", r"step-0*\d|scratch|no checkpoint", api=True,
             check=step_at_least(8)),
        Case("api-nan-no-checkpointing", "loss NaN from step 3, enable_checkpointing=False",
             script("--max-steps", "6", "--no-checkpointing", "--nan-from", "3"), "refuse", r"finite|nan", api=True),
        Case("api-nan-checkpointing", "loss NaN from step 3, ModelCheckpoint(every_n_steps=2)",
             script("--max-steps", "6", "--nan-from", "3"), "refuse", r"finite|nan", api=True),
        Case("cli-huge-lr", "optimizer.lr=1e30, no clipping (the weights overflow); fit",
             lambda f: trainer_cmd("fit", TINY, *RUN, "trainer.max_steps=6", "optimizer.lr=1e30",
                                   "trainer.gradient_clip_val=null"), "refuse", r"finite"),
        Case("replicas-group-lost", "trainer replicas --groups 2 --min-replicas 2: group 1 dies at step 3",
             replicas_group_lost, "refuse", r"quorum|group 1|replica", api=True),
    ]  # fmt: skip


# --- data ----------------------------------------------------------------------------------------------------------


def first_rows(source: Path, n: int, edits: dict[int, Callable[[dict], object] | str]) -> str:
    """The first `n` rows of a JSON-lines file, row i replaced by `edits[i]` (a function of it, or a line)."""
    rows = source.read_text().splitlines()[:n]
    for i, edit in edits.items():
        rows[i] = edit if isinstance(edit, str) else json.dumps(edit(json.loads(rows[i])))
    return "\n".join(rows) + "\n"


def hf_case(name: str, recipe: str, edits: dict, expect: str = "refuse", names: str = "", extra=()) -> Case:
    """A 2-step fit of the HF recipe (a new tiny model) on its data's first 48 rows, edited (rows.jsonl)."""
    source = RECIPES / "data" / ("dpo_tiny.jsonl" if "dpo" in recipe else "sft_tiny.jsonl")

    def prepare(folder: Path) -> Command:
        (folder / "rows.jsonl").write_text(first_rows(source, 48, edits))
        argv = ["fit", str(RECIPES / recipe), "model.hf=new:base", "data.path=rows.jsonl", "data.batch_size=4",
                "trainer.max_steps=2", "trainer.val_check_interval=2", "trainer.limit_val_batches=1",
                "trainer.default_root_dir=run", "trainer.warmup_steps=1", "callbacks=[]", *extra]  # fmt: skip
        return trainer_cmd(*argv, timeout=180)

    return Case(name, name.replace("-", " "), prepare, expect, names or r"rows\.jsonl:\d+")


def lm_data_case(name: str, make: Callable[[Path], str], names: str = r"data") -> Case:
    """The tiny recipe on `data.path=make(folder)`."""

    def prepare(folder: Path) -> Command:
        return trainer_cmd("fit", TINY, *RUN, "trainer.max_steps=2", f"data.path={make(folder)}", timeout=90)

    return Case(name, name.replace("-", " "), prepare, "refuse", names)


def files(**content: bytes) -> Callable[[Path], str]:
    """data/NAME files (`_` for `.`) in the case folder; data.path is the folder."""

    def make(folder: Path) -> str:
        (folder / "data").mkdir()
        for name, data in content.items():
            (folder / "data" / name.replace("_", ".")).write_bytes(data)
        return "data"

    return make


def bad_json_lines(folder: Path) -> str:
    (folder / "text.jsonl").write_text('{"text": "hello there"}\n{"text": oops}\n{"text": "more"}\n')
    return "text.jsonl"


def no_text_field(folder: Path) -> str:
    (folder / "text.jsonl").write_text('{"text": "hello there"}\n{"body": "no text field"}\n')
    return "text.jsonl"


def without(key: str) -> Callable[[dict], dict]:
    return lambda row: {k: v for k, v in row.items() if k != key}


def data_cases() -> list[Case]:
    no_content = lambda row: {"messages": [{"role": "user"}, *row["messages"][1:]]}  # noqa: E731
    dpo, sft, skip = "hf_dpo_tiny.yaml", "hf_sft_llama_tiny.yaml", "data.skip_bad_rows=true"
    return [
        lm_data_case("data-binary-txt", files(image_txt=b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 64), r"image\.txt"),
        lm_data_case("data-empty-folder", files()),
        lm_data_case("data-empty-txt", files(empty_txt=b""), r"empty\.txt|data"),
        lm_data_case("data-missing-path", lambda f: "no/such/data", r"no/such/data"),
        lm_data_case("data-non-json-line", bad_json_lines, r"text\.jsonl:2"),
        lm_data_case("data-jsonl-without-text", no_text_field, r"text\.jsonl:2"),
        hf_case("dpo-non-json-line", dpo, {5: '{"prompt": "x", "chosen": '}),
        hf_case("dpo-missing-rejected", dpo, {5: without("rejected")}),
        hf_case("dpo-chosen-number", dpo, {9: lambda r: {**r, "chosen": 123}}),
        hf_case("dpo-prompt-null", dpo, {3: lambda r: {**r, "prompt": None}}),
        hf_case("dpo-skip-bad-rows", dpo, {5: without("rejected")}, "recover", r"skip|left out", [skip]),
        hf_case("sft-message-without-content", sft, {4: no_content}),
        hf_case("sft-non-json-line", sft, {7: "not json at all"}),
        hf_case("sft-messages-not-a-list", sft, {2: lambda r: {"messages": "hi"}}),
        hf_case("sft-packing-bad-rows", sft, {4: no_content}, extra=["data.sft_packing=true"]),
        hf_case("sft-packing-skip-bad-rows", sft, {4: no_content}, "recover", r"skip|left out",
                ["data.sft_packing=true", skip]),
    ]  # fmt: skip


# --- recipes, overrides and tools ----------------------------------------------------------------------------------


def argv_case(name: str, argv: list[str], expect: str, names: str = r".", timeout: float = 60) -> Case:
    what = " ".join(a if len(a) < 30 else "..." for a in argv[:3]) + " ... " + " ".join(argv[-2:])
    return Case(name, what, lambda folder: trainer_cmd(*argv, timeout=timeout), expect, names)


def recipe_file(name: str, content: str) -> Case:
    def prepare(folder: Path) -> Command:
        (folder / "recipe.yaml").write_text(content)
        return trainer_cmd("fit", "recipe.yaml", timeout=60)

    return Case(name, f"a recipe: {content[:30]!r}", prepare, "refuse", r"recipe\.yaml")


def config_cases() -> list[Case]:
    fit, l8b = ["fit", TINY, *RUN, "trainer.max_steps=2"], str(RECIPES / "llama_8b.yaml")
    ft = ["replicas", "--groups", "1", TINY, *SMALL, "trainer.max_steps=2", "trainer.default_root_dir=run"]
    plan8 = ["plan", l8b, "--gpus", "8"]
    return [
        argv_case("cfg-unknown-key", [*fit, "trainer.max_stepz=5"], "refuse", "max_stepz"),
        argv_case("cfg-wrong-type", [*fit, "trainer.max_steps=abc"], "refuse", "max_steps"),
        argv_case("cfg-negative-steps", [*fit, "trainer.max_steps=-5"], "refuse", "max_steps"),
        argv_case("cfg-zero-batch", [*fit, "data.batch_size=0"], "refuse", "batch_size"),
        argv_case("cfg-negative-lr", [*fit, "optimizer.lr=-1"], "refuse", r"\blr\b"),
        argv_case("cfg-bad-precision", [*fit, "trainer.precision=17"], "refuse", "precision"),
        argv_case("cfg-override-without-value", [*fit, "trainer.max_steps"], "refuse", "max_steps"),
        argv_case("cfg-missing-recipe", ["fit", "no_such_recipe.yaml"], "refuse", r"no_such_recipe\.yaml"),
        recipe_file("cfg-recipe-not-yaml", "model: [unclosed\n  dim: 3\n"),
        recipe_file("cfg-recipe-a-list", "- 1\n- 2\n"),
        argv_case("cfg-ckpt-path-missing", [*fit, "--ckpt-path", "no/such/ckpt"], "refuse", r"no/such/ckpt"),
        argv_case("cfg-tokenizer-missing", [*fit, "data.tokenizer=no/such/tokenizer"], "refuse", "no/such/tokenizer"),
        argv_case("cfg-hf-model-missing", ["fit", str(RECIPES / "hf_sft_llama_tiny.yaml"), "model.hf=no/such/model"],
                  "refuse", "no/such/model"),
        argv_case("memory-70b", ["memory", str(RECIPES / "llama_70b.yaml")], "ok"),
        argv_case("cli-version", ["--version"], "ok"),
        argv_case("doctor-devices-0", ["doctor", "--devices", "0"], "refuse", "--devices"),
        argv_case("doctor-devices-negative", ["doctor", "--devices", "-2"], "refuse", "--devices"),
        argv_case("doctor-iters-0", ["doctor", "--devices", "2", "--iters", "0"], "refuse", "--iters"),
        argv_case("plan-gpus-1e9", ["plan", l8b, "--gpus", "1000000000"], "answer", r"--gpus|1,000,000,000 GPUs",
                  timeout=90),
        argv_case("plan-gpus-0", ["plan", l8b, "--gpus", "0"], "refuse", "--gpus"),
        argv_case("plan-gpus-negative", ["plan", l8b, "--gpus", "-8"], "refuse", "--gpus"),
        argv_case("plan-storage-0", [*plan8, "--storage-gbps", "0"], "refuse", "--storage-gbps"),
        argv_case("plan-mtbf-negative", [*plan8, "--mtbf-hours", "-1"], "refuse", "--mtbf-hours"),
        argv_case("plan-gpu-memory-0", [*plan8, "--gpu-memory", "0GB"], "refuse", r"--gpu-memory|'0GB'"),
        argv_case("plan-8-gpus", plan8, "ok"),
        argv_case("replicas-groups-0", ["replicas", "--groups", "0", TINY], "refuse", "--groups"),
        argv_case("replicas-bad-quorum-timeout", [*ft, "fault_tolerance.quorum_timeout_s=abc"], "refuse",
                  "quorum_timeout_s"),
        argv_case("replicas-quorum-timeout-15", [*ft, "fault_tolerance.quorum_timeout_s=15"], "ok", timeout=180),
        argv_case("replicas-huge-timeout", [*ft, "fault_tolerance.timeout_s=1e12"], "refuse", "timeout_s"),
    ]  # fmt: skip


def usage_cases() -> list[Case]:
    return [*signal_cases(), *api_cases(), *data_cases(), *config_cases()]
