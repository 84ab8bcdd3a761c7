"""One rank of `helpers.call_ranks`: `FUNCTION(RANK, *ARGS)` from the test module at PATH, as a process that
torch.multiprocessing.spawn would start, but forked from the preloaded interpreter. Exits 0 once the function
returns; a rank that raises prints its traceback and exits 1.

    python call_rank.py PATH FUNCTION ARGS_JSON RANK"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[1]))  # tests/: what a test module imports (helpers)


def main() -> None:
    path, name, args, rank = Path(sys.argv[1]), sys.argv[2], json.loads(sys.argv[3]), int(sys.argv[4])
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = module  # as an import would: pickling, dataclasses and the like look it up
    spec.loader.exec_module(module)
    getattr(module, name)(rank, *args)


if __name__ == "__main__":
    main()
