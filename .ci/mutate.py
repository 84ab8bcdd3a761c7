"""Mutation testing of the core files (`make mutate`; not in CI): mutmut mutates the files listed in
pyproject's [tool.mutmut] one change at a time and runs the fast tests (`-m "not slow"`) that reach the
changed function; a mutant the tests do not fail on "survived". Prints the score per file and lists the
survivors. All ~3,700 mutants take hours on 2 cores, so `--sample N` tries N mutants per file, drawn with
`--seed`; `mutmut show NAME` prints a survivor's diff.

Multi-process tests are not used: their ranks import the project from the install, not mutmut's copy, so
strategies/ddp.py, fsdp.py and zero1.py are mostly "not reached" here; the gloo tests cover them instead.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

MUTMUT = str(Path(sys.executable).with_name("mutmut"))
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
    p.add_argument("--keep", action="store_true", help="reuse mutants/ (results of an earlier run stand)")
    a = p.parse_args()
    if not a.keep:
        shutil.rmtree("mutants", ignore_errors=True)  # mutmut skips copies that exist: stale source otherwise
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
