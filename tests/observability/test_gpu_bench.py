"""bench/gpu_throughput.py end to end on the CPU with the tiny preset: every arm runs in its own process
and prints a row with a positive tokens/s; an arm that crashes gets its error in its row and the others
still run. No timing is asserted."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from helpers import failure, launch_env, run_commands

REPO = Path(__file__).parents[2]
BENCH = REPO / "bench" / "gpu_throughput.py"
ARMS = ("hf-lightning", "hf-loop", "trainer-eager", "trainer-speed")
SMOKE = ["--shape", "tiny", "--device", "cpu", "--steps", "2", "--warmup", "1"]


def run_bench(*args: str) -> subprocess.CompletedProcess[str]:
    """The bench as `python bench/gpu_throughput.py ...` (the project is installed, so no PYTHONPATH), forked
    from the preloaded interpreter, as its arms are (a script that starts its own file: tests/preloaded.py)."""
    return run_commands([([sys.executable, str(BENCH), *SMOKE, *args], launch_env())], str(REPO), 240)


def table_rows(stdout: str) -> dict[str, list[str]]:
    """The table's rows (after its header line), by arm: the words after the arm's name."""
    lines = stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("arm ") and "tokens/s" in line)
    rows = {}
    for line in lines[header + 1 :]:
        words = line.split()
        if words and words[0] in ARMS:
            rows[words[0]] = words[1:]
    return rows


@pytest.mark.slow
def test_every_arm_prints_a_row_with_positive_tokens_per_s():
    done = run_bench()
    assert done.returncode == 0, done.stdout[-3000:] + failure(done.stderr)
    rows = table_rows(done.stdout)
    assert sorted(rows) == sorted(ARMS), done.stdout
    for arm, words in rows.items():
        tokens_per_s, mfu, peak_gib, ratio = words
        assert float(tokens_per_s.replace(",", "")) > 0, (arm, words)
        assert mfu == "-"  # no MFU on the CPU
        assert float(peak_gib) > 0, (arm, words)
        assert ratio.endswith("x"), (arm, words)
    assert rows["hf-lightning"][3] == "1.00x"
    last = done.stdout.splitlines()[-1]
    assert last.startswith(("acceptance: PASS (", "acceptance: FAIL (")), last


@pytest.mark.slow
def test_a_crashed_arm_gets_its_error_in_its_row_and_the_others_still_run():
    done = run_bench("--arms", "trainer-speed,trainer-eager", "--loss-chunk-tokens", "0")
    assert done.returncode == 1, done.stdout[-3000:] + failure(done.stderr)
    rows = table_rows(done.stdout)
    assert rows["trainer-speed"][0] == "error:" and "loss_chunk_tokens=0" in " ".join(rows["trainer-speed"])
    assert float(rows["trainer-eager"][0].replace(",", "")) > 0
    assert "acceptance: not checked" in done.stdout
    assert "---- trainer-speed failed" in done.stderr  # the child's last lines, for the diagnosis
