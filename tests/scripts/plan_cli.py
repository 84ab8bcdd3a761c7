"""`trainer ARGS` in a process of its own (self-spawned ranks re-run it), with the tests' stand-in memory
model where strategies/plan/memory.py is absent (tests/plan_memory_fallback.py)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the fallback module

import plan_memory_fallback  # noqa: E402

plan_memory_fallback.install()

from trainer.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
