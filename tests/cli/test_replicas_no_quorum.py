"""A replica group lost under `--min-replicas 2`: the survivor's fit ends for want of a quorum, and the one
line saying so is the last line the user sees, from `trainer replicas` (after torchrun's own reports) and
from `trainer fit` of a recipe (no traceback)."""

from __future__ import annotations

import pytest
from helpers import SMALL, TESTS, TINY, failure, run_cli

from trainer import cli
from trainer.fault_tolerance.lighthouse import start_lighthouse

pytest.importorskip("torchft")

# a user's script: group 1 is lost at once; group 0 trains and waits 2 s for a quorum of 2 that never forms
SCRIPT = f"""
import sys
sys.path.insert(0, {str(TESTS)!r})
from helpers import Regression, regression_loader
from trainer import Trainer
from trainer.fault_tolerance import FaultTolerance

ft = FaultTolerance.from_env(quorum_timeout_s=2, timeout_s=5)
if ft.replica_id == 1:
    sys.exit(1)
trainer = Trainer(max_steps=3, default_root_dir=sys.argv[1], enable_progress_bar=False, fault_tolerance=ft)
trainer.fit(Regression(optimizer="sgd"), regression_loader())
"""
NO_QUORUM = (
    "fault tolerance: no quorum of min_replicas=2 replica group(s) within quorum_timeout_s=2 at lighthouse"
)


@pytest.mark.slow
def test_replicas_ends_with_the_survivors_no_quorum_line(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    argv = ["--groups", "2", "--min-replicas", "2", "--max-restarts", "0", "--heartbeat-timeout-ms", "1000"]
    done = run_cli("replicas", *argv, str(script), str(tmp_path), cwd=tmp_path, timeout=180, ranks=2)
    assert done.returncode == 1, failure(done.stderr)
    summary, reason = done.stderr.strip().splitlines()[-2:]
    assert summary.startswith(
        "replicas: replica group 0 (torchrun exit 1), replica group 1 (torchrun exit 1)"
    )
    assert reason.startswith(f"replicas: replica group 0: NoQuorumError: {NO_QUORUM} 127.0.0.1:"), reason


def test_fit_of_a_recipe_without_a_quorum_ends_in_one_line(tmp_path, capsys):
    server = start_lighthouse("127.0.0.1:0", min_replicas=2)
    lighthouse = f"127.0.0.1:{server.address().rpartition(':')[2]}"
    ft = [f"fault_tolerance.lighthouse={lighthouse}", "fault_tolerance.replica_id=0",
          "fault_tolerance.min_replicas=2", "fault_tolerance.quorum_timeout_s=2"]  # fmt: skip
    run = ["trainer.max_steps=2", "trainer.warmup_steps=1", f"trainer.default_root_dir={tmp_path}"]
    try:
        assert cli.main(["fit", str(TINY), *SMALL, *run, *ft]) == 2
    finally:
        server.shutdown()
    err = capsys.readouterr().err.strip()
    assert err.splitlines()[-1].startswith(f"trainer: error: {NO_QUORUM} {lighthouse}"), err[-3000:]
    assert "Traceback" not in err, err[-3000:]


def test_a_groups_reason_is_its_cli_error_or_its_last_exception_never_torchruns_report():
    from trainer.fault_tolerance.launch import LastError

    torchrun = ["Traceback (most recent call last):", '  File "run.py", line 9, in <module>',
                "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: ", "====", "trainer.cli FAILED"]  # fmt: skip
    recipe = LastError()
    for line in ["[trainer] step 3", f"trainer: error: {NO_QUORUM} h:1 (timeout)", *torchrun]:
        recipe.see(line)
    assert recipe.line == f"{NO_QUORUM} h:1 (timeout)"
    script = LastError()  # a chained traceback: the last exception of the chain, named without its module
    chain = ["Traceback (most recent call last):", '  File "x.py", line 1', "TimeoutError: status: Cancelled", "",
             "The above exception was the direct cause of the following exception:", "",
             "Traceback (most recent call last):", '  File "y.py", line 2', "    raise NoQuorumError(",
             f"trainer.fault_tolerance.config.NoQuorumError: {NO_QUORUM} h:1"]  # fmt: skip
    for line in [*chain, *torchrun]:
        script.see(f"[rank0]: {line}" if line in chain else line)  # each line of a worker's error tagged
    assert script.line == f"NoQuorumError: {NO_QUORUM} h:1"
    quiet = LastError()  # killed: nothing of its own to report
    for line in torchrun:
        quiet.see(line)
    assert quiet.line is None
