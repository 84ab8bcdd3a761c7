"""Fault audit (issue 48; a CI tool, not part of pytest): about 130 cases run as a user runs them (the
`trainer` CLI, a small script with the `Trainer` API, 2 DDP ranks, `trainer replicas`), each in its own temp
folder, after something went wrong: a checkpoint file truncated, flipped, deleted, appended to, swapped,
forged with a pickle that runs code; malformed data; bad flags; a full disk; Ctrl-C and SIGTERM. Prints one
row per case (the exit code and the last line the user saw: stderr's last non-empty line) and the totals.
The cases: fault_cases_ckpt.py and fault_cases_use.py; running them: fault_run.py.

    .venv/bin/python .ci/fault_audit.py [--only SUBSTR] [--jobs 1] [--keep] [--list]

Runs as root (it mounts small tmpfs disks to fill; chmod cases drop root's override with setpriv), offline,
every command under a timeout; never in the repository's runs/. Verdicts, the first that applies:
  HANG      the command ran past its timeout (it is killed with its process group)
  CODE-RUN  a crafted pickle in a checkpoint ran: its marker file exists
  LOST      a file the folder held before the command (another run's checkpoint, the user's data) is gone or
            changed and its bytes are nowhere in the folder (a checkpoint set aside as discarded-... is kept)
  SILENT    bad input, exit 0 and no line naming the problem (the run went on as if nothing was wrong)
  WRONG     not the outcome the case needs: a good command failed, a resume that should go on failed, a
            signal's exit code or checkpoint missing
  UGLY      the right outcome, badly told: a traceback (a user script's own traceback of one exception is
            Python's; a chained one is not), torch's weights_only advice, or a last line not naming the thing
  ok        none of the above
Non-ok case folders are kept (with the command and its output); the others are removed unless --keep.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import re
import shutil
import subprocess
import sys
import tempfile
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from fault_cases_ckpt import BUILDS, checkpoint_cases
from fault_cases_use import usage_cases
from fault_run import MARKER, Case, Fixtures, Result, execute, fixtures, last_line, lines, use_fixtures

WARN_WORDS = re.compile(
    r"skip|discard|set aside|refus|mismatch|missing|corrupt|truncat|not listed|bad|invalid|damaged|cannot|"
    r"can't|fail|not a |unreadable|ignor|error|warn|unknown|no checkpoint|left out|not finite|non-finite",
    re.I,
)
UGLY_TEXT = re.compile(
    r"weights_only|metadata is None|During handling of the above|direct cause of the", re.I
)
VERDICTS = ["ok", "LOST", "SILENT", "HANG", "CODE-RUN", "UGLY", "WRONG", "ERROR"]  # ERROR: a case's own setup


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def snapshot(folder: Path, owned: tuple[str, ...]) -> dict[str, str]:
    """relative path -> sha256 of every file in `folder` but the run's own outputs."""
    out = {}
    for path in sorted(folder.rglob("*")):
        rel = path.relative_to(folder).as_posix()
        if path.is_file() and not path.is_symlink() and not rel.startswith(owned) and rel != MARKER:
            out[rel] = digest(path)
    return out


def lost_files(folder: Path, before: dict[str, str]) -> list[str]:
    """The files of `before` whose bytes are now nowhere in `folder`."""
    now = {digest(p) for p in folder.rglob("*") if p.is_file() and not p.is_symlink()}
    return [rel for rel, h in before.items() if h not in now]


def judge(case: Case, r: Result, folder: Path, lost: list[str]) -> tuple[str, str]:
    """(verdict, why) by the rules of the module docstring."""
    if r.timed_out:
        return "HANG", f"killed after {r.seconds:.0f} s"
    if (folder / MARKER).exists():
        return "CODE-RUN", "the crafted pickle's marker exists"
    if lost:
        return "LOST", ", ".join(lost[:4])
    said = lines(r.stderr) + lines(r.stdout)
    warnings = [s for s in said if re.search(case.names, s, re.I) and WARN_WORDS.search(s)]
    r.warning = warnings[0] if warnings and case.expect != "ok" else ""
    wrong = outcome(case, r.rc, bool(warnings))
    if wrong:
        return wrong
    if case.check and (problem := case.check(folder, last_line(r))):
        return "WRONG", problem
    return looks(case, r)


def outcome(case: Case, rc: int | None, warned: bool) -> tuple[str, str] | None:
    """SILENT or WRONG when the exit code and the warnings are not what `case.expect` needs."""
    if case.expect == "ok" and rc != 0:
        return "WRONG", f"a good command exited {rc}"
    if case.expect in ("refuse", "notice", "recover") and rc == 0 and not warned:
        return "SILENT", "exit 0 and no line names the problem"
    if case.expect == "recover" and rc != 0:
        return "WRONG", f"exited {rc}: the run should go on past the bad input"
    if case.expect == "refuse" and rc == 0:
        return "WRONG", "warned but exited 0: should refuse"
    if case.expect == "signal" and rc != case.code:
        return "WRONG", f"exit {rc}, expected {case.code}"
    return None


def looks(case: Case, r: Result) -> tuple[str, str]:
    """UGLY or ok: how the outcome was told."""
    if "Traceback" in r.stderr and not case.api:
        return "UGLY", "a traceback"
    if ugly := UGLY_TEXT.search(r.stderr):
        return "UGLY", ugly.group(0)
    if r.rc != 0 and not re.search(case.names, last_line(r), re.I):
        return "UGLY", f"the last line does not name /{case.names}/"
    return "ok", ""


def run_case(case: Case, work: Path) -> Result:
    """Prepare the case's folder, snapshot it, run the command, judge; a case whose setup fails is ERROR."""
    folder = work / "cases" / case.name
    folder.mkdir(parents=True)
    try:
        cmd = case.prepare(folder)
        before = snapshot(folder, case.owned)
        r = execute(cmd, folder, fixtures().env(folder))
        r.last, r.folder = last_line(r), folder
        r.verdict, r.why = judge(case, r, folder, lost_files(folder, before))
        (folder / "audit-command.txt").write_text(" ".join(cmd.argv) + "\n")  # for a look at a kept folder
        (folder / "audit-stdout.txt").write_text(r.stdout)
        (folder / "audit-stderr.txt").write_text(r.stderr)
    except Exception as err:  # reported in the table, not fatal to the audit
        r = Result(
            None, "", "", False, 0.0, f"{type(err).__name__}: {err}", "", "ERROR", "setup failed", folder
        )
    finally:
        disk = folder / "disk"  # a case's tmpfs (fault_cases_ckpt.tmpfs)
        if disk.is_mount():
            subprocess.run(["umount", str(disk)], check=False)
    return r


def row(case: Case, r: Result) -> str:
    why = f" [{r.why}]" if r.verdict != "ok" and r.why else ""
    warned = f" | warned: {r.warning[:150]}" if r.rc == 0 and r.warning else ""
    return f"{case.name:<40} {r.verdict:<8} {r.rc!s:>4} {r.seconds:5.0f}s  {r.last[:160]}{warned}{why}"


def report(results: list[tuple[Case, Result]], work: Path) -> None:
    counts = Counter(r.verdict for _, r in results)
    print("\ntotals: " + ", ".join(f"{v} {counts.get(v, 0)}" for v in VERDICTS) + f" (of {len(results)})")
    bad = [(c, r) for c, r in results if r.verdict != "ok"]
    if bad:
        print(f"not ok (folders kept under {work / 'cases'}):")
        for case, r in bad:
            print(f"  {r.verdict:<8} {case.name}: {case.what} -> rc {r.rc}: {r.last[:220]}  [{r.why}]")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", help="run the cases whose name contains this")
    parser.add_argument("--jobs", type=int, default=1, help="cases run at once (default 1)")
    parser.add_argument("--keep", action="store_true", help="keep every case's folder, not only non-ok ones")
    parser.add_argument("--list", action="store_true", help="list the cases and exit")
    args = parser.parse_args()
    cases = [c for c in [*checkpoint_cases(), *usage_cases()] if not args.only or args.only in c.name]
    if args.list:
        print("\n".join(f"{c.name:<40} {c.expect:<8} {c.what}" for c in cases))
        return 0
    work = Path(tempfile.mkdtemp(prefix="fault-audit-"))
    use_fixtures(Fixtures(work, BUILDS))
    print(f"{len(cases)} cases in {work}", flush=True)
    print(f"{'case':<40} {'verdict':<8} {'rc':>4} {'time':>6}  last line [why]", flush=True)
    results: list[tuple[Case, Result]] = []
    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        for case, r in zip(cases, pool.map(functools.partial(run_case, work=work), cases), strict=True):
            results.append((case, r))
            print(row(case, r), flush=True)
            if r.verdict == "ok" and not args.keep:
                shutil.rmtree(r.folder, ignore_errors=True)
    report(results, work)
    return 0 if all(r.verdict == "ok" for _, r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
