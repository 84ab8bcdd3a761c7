"""Mutation testing of the core files (`make mutate`; not in CI): mutmut mutates the files listed in
pyproject's [tool.mutmut] one change at a time and runs the fast tests (`-m "not slow"`) that reach the
changed function; a mutant the tests do not fail on "survived". Prints the score per file and lists the
survivors. All ~3,700 mutants take hours on 2 cores, so `--sample N` tries N mutants per file, drawn with
`--seed`; `mutmut show NAME` prints a survivor's diff.

mutmut's own runs use only tests that call the mutated function in pytest's process, so strategies/ddp.py,
fsdp.py and techniques/zero1/sliced_parameters.py, whose code runs in spawned ranks, are mostly "not
reached" by them. `--gloo N` tries N mutants of each of those files against the multi-process gloo tests in
GLOO_TESTS instead: the ranks import mutmut's copy (PYTHONPATH) and inherit the mutant's name (MUTANT_UNDER_TEST).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

MUTMUT = str(Path(sys.executable).with_name("mutmut"))
GLOO_TESTS = {  # the gloo tests a mutant of each strategy file must fail (fastest first: -x stops there)
    "strategies/ddp.py": [
        "tests/unit/test_sharding.py",
        "tests/distributed/test_ddp.py::test_accumulated_micro_batches_are_all_reduced_once_per_step",
        "tests/distributed/test_gradient_sync.py::test_two_ranks_with_sgd_and_no_clipping_match_one_process_step_by_step[ddp-accumulate2]",
        "tests/distributed/test_gradient_sync.py::test_token_mean_loss_with_uneven_tokens_per_rank_matches_one_process",
        "tests/distributed/test_ddp.py::test_gradient_compression_trains_close_to_exact_all_reduce",
    ],
    "strategies/techniques/zero1/sliced_parameters.py": [
        "tests/distributed/test_gradient_sync.py::test_two_ranks_with_sgd_and_no_clipping_match_one_process_step_by_step[zero1]",
        "tests/distributed/test_fsdp.py::test_each_zero_stage_matches_one_process_and_holds_the_formula_memory[2-1]",
        "tests/distributed/test_fsdp.py::test_validation_runs_through_the_sharded_model[1]",
        "tests/distributed/test_fsdp.py::test_a_sharded_checkpoint_resumes_on_another_world_size[1-4-2]",
    ],
    "strategies/fsdp.py": [
        "tests/checkpoint/test_async_save.py",
        "tests/distributed/test_fsdp.py::test_bad_fsdp_arguments_are_named",
        "tests/distributed/test_fsdp.py::test_a_mesh_that_does_not_divide_the_world_and_fp16_scaling_are_refused_before_spawning",
        "tests/distributed/test_gradient_sync.py::test_two_ranks_with_sgd_and_no_clipping_match_one_process_step_by_step[zero3-llama-accumulate2]",
        "tests/distributed/test_fsdp_memory_features.py",
        "tests/distributed/test_fsdp.py::test_a_sharded_checkpoint_resumes_on_another_world_size",
    ],
}
STATUS = {1: "killed", 3: "killed", 36: "killed", 0: "survived", 33: "not reached", 34: "skipped"}


def mutant_keys() -> dict[str, dict[str, int | None]]:
    """file -> {mutant name: exit code or None (not run)}, from mutmut's metadata next to each copy."""
    return {
        str(meta.relative_to("mutants"))[: -len(".meta")]: json.loads(meta.read_text())["exit_code_by_key"]
        for meta in sorted(Path("mutants").rglob("*.py.meta"))
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sample", type=int, default=None, help="mutants per file (default: all)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--files", nargs="*", help="sample only these of the configured files (with --sample)")
    p.add_argument("--gloo", type=int, default=None, help="N mutants per strategy file, against gloo tests")
    p.add_argument("--keep", action="store_true", help="reuse mutants/ (results of an earlier run stand)")
    a = p.parse_args()
    if not a.keep:
        shutil.rmtree("mutants", ignore_errors=True)  # mutmut skips copies that exist: stale source otherwise
    if a.gloo is not None:
        if not a.keep:
            subprocess.run([MUTMUT, "run", "generate-only"], capture_output=True)
        gloo(a.gloo, random.Random(a.seed))
        return
    if a.sample is None:
        subprocess.run([MUTMUT, "run"], check=True)
    else:
        # generate the mutants and the test map (a filter matching nothing stops mutmut right after)
        subprocess.run([MUTMUT, "run", "generate-only"], capture_output=True)
        rng = random.Random(a.seed)
        files = {path: keys for path, keys in mutant_keys().items() if not a.files or path in a.files}
        names = [n for keys in files.values() for n in rng.sample(sorted(keys), min(a.sample, len(keys)))]
        subprocess.run([MUTMUT, "run", *names], check=True)
    report()


def gloo(n: int, rng: random.Random) -> None:
    """Run `n` mutants of each file in GLOO_TESTS against its multi-process tests; print a line each."""
    keys, env = mutant_keys(), {**os.environ, "PYTHONPATH": str(Path("mutants").resolve())}
    print(f"{'file':28} {'tried':>6} {'killed':>7} {'survived':>9} {'score':>6}")
    survivors = []
    for path, tests in GLOO_TESTS.items():
        names = rng.sample(sorted(keys[path]), min(n, len(keys[path])))
        if run_tests(tests, env, mutant="") != 0:
            sys.exit(f"the gloo tests of {path} fail without a mutant: fix them first ({' '.join(tests)})")
        killed = 0
        for name in names:
            survived = run_tests(tests, env, mutant=name) == 0
            print(f"  {name}: {'survived' if survived else 'killed'}", flush=True)
            killed += not survived
            survivors += [name] if survived else []
        print(
            f"{path:28} {len(names):6} {killed:7} {len(names) - killed:9} {100 * killed / len(names):5.1f}%"
        )
    if survivors:
        print("\nnot killed (mutmut show NAME for the change):")
        print("\n".join(f"  {name}" for name in survivors))


def run_tests(tests: list[str], env: dict[str, str], mutant: str) -> int:
    """pytest's exit code for `tests` in mutmut's copy with `mutant` switched on ("" for none)."""
    command = [
        sys.executable,
        "-m",
        "pytest",
        "-x",
        "-q",
        "-p",
        "no:cacheprovider",
        "-o",
        "timeout=150",
        *tests,
    ]
    return subprocess.run(
        command, cwd="mutants", env={**env, "MUTANT_UNDER_TEST": mutant}, capture_output=True
    ).returncode


def report() -> None:
    print(f"\n{'file':28} {'tried':>6} {'killed':>7} {'survived':>9} {'not reached':>12} {'score':>6}")
    survivors = []
    for path, keys in mutant_keys().items():
        tried = {k: STATUS.get(v, f"exit {v}") for k, v in keys.items() if v is not None}
        counts = Counter(tried.values())
        judged = counts["killed"] + counts["survived"] + counts["not reached"]
        score = f"{100 * counts['killed'] / judged:5.1f}%" if judged else "   -"
        print(
            f"{path:28} {len(tried):6} {counts['killed']:7} {counts['survived']:9} {counts['not reached']:12} {score}"
        )
        survivors += [k for k, status in tried.items() if status in ("survived", "not reached")]
    if survivors:
        print("\nnot killed (mutmut show NAME for the change):")
        print("\n".join(f"  {name}" for name in survivors))


if __name__ == "__main__":
    main()
