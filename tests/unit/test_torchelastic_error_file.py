"""The error file a rank writes for torchrun's agent is whole or absent: the agent SIGTERMs the other ranks
when one fails, and an empty file crashed its failure summary (the fault drill's flake in CI)."""

from __future__ import annotations

import json

import pytest
from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

from strategies import mesh


def test_the_agent_reads_the_recorded_error(tmp_path, monkeypatch):
    path = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(path))
    mesh._record_for_torchelastic(RuntimeError("rank 1: the peer went away"))
    failure = ProcessFailure(local_rank=1, pid=123, exitcode=1, error_file=str(path))
    assert failure.message["message"] == "RuntimeError: rank 1: the peer went away"


def test_a_rank_stopped_while_writing_leaves_no_file_the_agent_cannot_parse(tmp_path, monkeypatch):
    path = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(path))

    def stopped_midway(data, file):  # as a SIGTERM between open() and the write does
        file.write('{"message": ')
        raise KeyboardInterrupt

    monkeypatch.setattr(json, "dump", stopped_midway)
    with pytest.raises(KeyboardInterrupt):
        mesh._record_for_torchelastic(RuntimeError("boom"))
    monkeypatch.undo()
    assert not path.exists() or json.loads(path.read_text())
    ProcessFailure(local_rank=0, pid=1, exitcode=1, error_file=str(path))  # what crashed torchrun's agent
