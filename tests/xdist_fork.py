"""pytest-xdist's workers as forks of the preloading server that the controller shares with them
(tests/preloaded.py): a worker then starts with torch, transformers, Lightning and this project imported,
~9 of the ~13 CPU-s a fresh worker spends on its start-up and collection here, three times a run.

`conftest.pytest_xdist_setupnodes` makes this file each worker's `python`: run as `python
tests/xdist_fork.py -u -c CODE` (execnet's command), it has the server fork `python -u -c CODE` on this
process's stdin, stdout and stderr, and exits as that fork does; killed, it takes the fork with it. The fork
imports under the server's environment (its import-time variables: IMPORT_TIME); what it starts is started
as from a fresh worker (`plain`: fresh interpreters, or forks where a test asks for one)."""

from __future__ import annotations

import os
import sys

import preloaded


def worker_env(environ: dict[str, str], server_env: dict[str, str]) -> dict[str, str]:
    """`environ` with the import-time variables (IMPORT_TIME) the server imported under instead of its own."""
    kept = {k: v for k, v in environ.items() if not preloaded.read_at_import(k)}
    return {**kept, **{k: v for k, v in server_env.items() if preloaded.read_at_import(k)}}


def main(args: list[str]) -> int:
    """Run `python ARGS` forked from the shared server; its exit code."""
    server = preloaded.Shared(os.environ[preloaded.SHARED])
    cmd, env = [sys.executable, *args], worker_env(dict(os.environ), server.env)
    proc = preloaded.PreloadedProcess(server.path, cmd, env, os.getcwd(), {0: 0, 1: 1, 2: 2}, plain=True)
    return proc.wait()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
