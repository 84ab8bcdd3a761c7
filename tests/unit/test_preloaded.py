"""The forked test processes (tests/preloaded.py) run a command as a fresh interpreter would: its argv,
module globals, sys.path, directory, environment, exit code, atexit handlers and output; a job's first
failure ends the rest; a different import-time environment gets a fresh interpreter; a script that starts
its own file has the copy forked, with a piped stdout and a session of its own, still there to killpg until its
exit status is read; torchrun started by a test is forked, and so are its workers (`python -u`), its rendezvous
events named as torch names them; a shared server (pytest-xdist's) that never listened is named; a
pytest-xdist worker is a fork that runs `python -u -c CODE` on its pipes, and starts plain processes; a
fork logs torchft at the level of its RUST_LOG."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import preloaded
import pytest
from conftest import XDIST_FORK
from helpers import SESSION_ENV, failure, launch_env, run_commands, start_process

REPORT = """
import atexit, json, os, sys
atexit.register(lambda: print("atexit ran", flush=True))
print(json.dumps({"argv": sys.argv, "name": __name__, "file": __file__, "path0": sys.path[0],
                  "cwd": os.getcwd(), "var": os.environ.get("SOME_VAR"), "torch": "torch" in sys.modules,
                  "pid": os.getpid(), "ppid": os.getppid()}))
sys.exit(int(sys.argv[1]))
"""


def _report(tmp_path: Path, code: int, **env: str) -> tuple[int, dict, str, list[str]]:
    """Run REPORT with exit `code` and `env`: its exit code, what it saw, what it printed after, and what
    kept it from being forked."""
    script = tmp_path / "report.py"
    script.write_text(REPORT)
    cmd = [sys.executable, str(script), str(code)]
    done = run_commands([(cmd, launch_env(**env))], str(tmp_path), 60)
    first, *rest = done.stdout.splitlines()
    blockers = preloaded.fork_blockers(cmd, launch_env(**env), preloaded.server({}).env)
    return done.returncode, json.loads(first), "\n".join(rest), blockers


def test_a_forked_script_sees_what_python_script_would_and_exits_with_its_code(tmp_path):
    code, seen, after, blockers = _report(tmp_path, 3, SOME_VAR="here")
    script = str(tmp_path / "report.py")
    assert code == 3
    assert seen["argv"] == [script, "3"] and seen["name"] == "__main__" and seen["file"] == script
    assert seen["path0"] == str(tmp_path) and seen["cwd"] == str(tmp_path) and seen["var"] == "here"
    assert seen["torch"] and not blockers, f"not forked from the server (which imported torch): {blockers}"
    assert after == "atexit ran"


def test_another_import_time_environment_gets_a_fresh_interpreter(tmp_path):
    code, seen, after, blockers = _report(tmp_path, 0, PYTHONHASHSEED="123")
    assert code == 0 and not seen["torch"] and after == "atexit ran" and blockers == ["PYTHONHASHSEED"]


def test_an_uncaught_error_exits_1_with_its_traceback(tmp_path):
    script = tmp_path / "fail.py"
    script.write_text("raise ValueError('the reason')\n")
    done = run_commands([([sys.executable, str(script)], launch_env())], str(tmp_path), 60)
    assert done.returncode == 1
    assert done.stderr.strip().splitlines()[-1] == "ValueError: the reason"


def test_an_abort_prints_the_python_stack_and_a_failed_assertion_keeps_it_past_the_tail(tmp_path):
    # a rank that aborts (a C++ exception on a gloo thread) takes its peers down, whose tracebacks come
    # after its own last words in the job's stderr: the fault handler's stack is what names the cause
    script = tmp_path / "abort.py"
    script.write_text(
        "import os, sys\n\ndef where_it_died():\n    os.abort()\n\n"
        "print('starting case 7', file=sys.stderr, flush=True)\nwhere_it_died()\n"
    )
    cmd = [sys.executable, str(script)]
    done = run_commands([(cmd, launch_env())], str(tmp_path), 60)
    assert done.returncode == -6 and not preloaded.fork_blockers(cmd, launch_env(), preloaded.server({}).env)
    assert "Fatal Python error: Aborted" in done.stderr and "where_it_died" in done.stderr, done.stderr
    job = done.stderr + "[rank1]: RuntimeError: Connection closed by peer\n" * 200
    shown = failure(job)
    assert "Fatal Python error: Aborted" in shown and "where_it_died" in shown
    # and what it said just before, which a fault in a native thread's stack does not tell (which case it ran)
    assert "starting case 7\n" in shown
    assert shown.endswith(job[-3000:]) and "Extension modules" not in shown and len(shown) < len(job)


def test_the_first_failure_ends_the_rest_of_the_job(tmp_path):
    waits = tmp_path / "waits.py"
    waits.write_text("import signal\nsignal.pause()\n")  # would never end by itself
    fails = tmp_path / "fails.py"
    fails.write_text("import sys\nsys.exit(7)\n")
    env = launch_env()
    done = run_commands(
        [([sys.executable, str(waits)], env), ([sys.executable, str(fails)], env)], str(tmp_path), 120
    )
    # a waiting process left running would make run_commands raise TimeoutExpired after 120 s
    assert done.returncode == 7


def test_a_module_runs_as_python_m_does(tmp_path):
    done = run_commands([([sys.executable, "-m", "trainer.cli", "--help"], launch_env())], str(tmp_path), 60)
    assert done.returncode == 0 and done.stdout.startswith("usage: trainer")
    assert "RuntimeWarning" not in done.stderr, done.stderr


SELF_LAUNCHER = """
import json, os, signal, subprocess, sys
if sys.argv[1:] == ["child"]:
    print(json.dumps({"torch": "torch" in sys.modules, "leader": os.getsid(0) == os.getpid()}))
    print("to stderr", file=sys.stderr)
    sys.exit(0)
if sys.argv[1:] == ["hang"]:
    signal.pause()
def start(mode):
    pipe = dict(stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    return subprocess.Popen([sys.executable, __file__, mode], **pipe)
child = start("child")
out, _ = child.communicate(timeout=60)
hang = start("hang")
try:
    hang.communicate(timeout=0.5)  # it never ends by itself
    timed_out = False
except subprocess.TimeoutExpired:
    timed_out = True
os.killpg(hang.pid, signal.SIGKILL)  # its own session, as the benches end an arm past its time
hang.communicate()
print(json.dumps({"out": out, "kinds": [type(p).__name__ for p in (child, hang)], "timed_out": timed_out,
                  "codes": [child.returncode, hang.returncode]}))
"""


def test_a_script_that_starts_its_own_file_has_it_forked_with_a_pipe_and_its_own_session(tmp_path):
    # the benches start each arm so (bench/gpu_throughput.py): stdout piped, stderr into it, a new session
    script = tmp_path / "launcher.py"
    script.write_text(SELF_LAUNCHER)
    done = run_commands([([sys.executable, str(script)], launch_env())], str(tmp_path), 120)
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout.splitlines()[-1])
    assert seen["kinds"] == ["PreloadedProcess", "PreloadedProcess"]
    first, second = seen["out"].splitlines()
    assert json.loads(first) == {"torch": True, "leader": True} and second == "to stderr"
    assert seen["timed_out"] and seen["codes"] == [0, -9]


ENDED = """
import json, os, select, subprocess, sys
if sys.argv[1:] == ["child"]:
    sys.exit(3)
child = subprocess.Popen([sys.executable, __file__, "child"], start_new_session=True)
select.select([child], [], [], 60)  # readable: its exit status is there to read
try:
    os.killpg(child.pid, 0)  # what torchrun's agent does (with SIGTERM) to a worker whose poll() said running
    found = True
except ProcessLookupError:
    found = False
print(json.dumps({"kind": type(child).__name__, "found": found, "code": child.wait(timeout=60)}))
"""


def test_an_ended_fork_keeps_its_process_group_until_its_exit_status_is_read(tmp_path):
    # torchrun's agent closing a group's workers killpg()s one whose poll() said running: a fork reaped before
    # its status reached the agent had no group left, and the agent died of ProcessLookupError instead of
    # restarting the group (seen in test_fault_tolerance.py's kill test, ddp-1)
    script = tmp_path / "ended.py"
    script.write_text(ENDED)
    done = run_commands([([sys.executable, str(script)], launch_env())], str(tmp_path), 120)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.splitlines()[-1]) == {"kind": "PreloadedProcess", "found": True, "code": 3}


WORKER = """
import json, os, sys
seen = {"torch": "torch" in sys.modules, "leader": os.getsid(0) == os.getpid(), "rank": os.environ["RANK"]}
# one write (print writes the line and its newline apart: the two ranks' lines interleaved, flaky), not
# flushed: only torchrun's -u gets it out before os._exit
sys.stdout.write(json.dumps(seen) + "\\n")
print("rank", os.environ["RANK"], "on stderr", file=sys.stderr)
os._exit(0)
"""


def test_torchrun_started_by_a_test_is_forked_and_so_are_its_workers_with_python_u(tmp_path):
    # the fault drills start torchrun so (helpers.start_ranks): stdout and stderr piped apart, as text
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(script)]
    proc = start_process(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=launch_env())
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert isinstance(proc, preloaded.PreloadedProcess)
    seen = sorted((json.loads(line) for line in out.splitlines()), key=lambda row: row["rank"])
    # forks of the server, each leading its own session (torchrun's agent ends a worker by killpg)
    assert seen == [{"torch": True, "leader": True, "rank": r} for r in ("0", "1")], out
    assert "rank 0 on stderr" in err and "rank 1 on stderr" in err and "on stderr" not in out


NAMES = """
import inspect, json
from torch.distributed.elastic.rendezvous import dynamic_rendezvous

def _record():  # as torch's: each event is named after the method that recorded it, the caller's caller
    return dynamic_rendezvous.get_method_name(), inspect.stack()[1].function

def next_rendezvous():
    return _record()

print(json.dumps([*next_rendezvous(), dynamic_rendezvous.get_method_name(depth=500)]))
"""


def test_a_forks_rendezvous_events_are_named_as_torchs_inspect_stack_names_them(tmp_path):
    # the server names them from the frame (torch's inspect.stack() was ~0.75 CPU-s of each forked launch)
    script = tmp_path / "names.py"
    script.write_text(NAMES)
    done = run_commands([([sys.executable, str(script)], launch_env())], str(tmp_path), 60)
    assert done.returncode == 0, failure(done.stderr)
    assert json.loads(done.stdout) == ["next_rendezvous", "next_rendezvous", "no_method_name"]


def test_a_fork_takes_devnull_a_file_and_bytes_from_a_pipe(tmp_path):
    script = tmp_path / "streams.py"
    script.write_text("import sys\nprint('out')\nprint('err', file=sys.stderr)\n")
    cmd = [sys.executable, str(script)]
    with open(tmp_path / "err.txt", "w") as err:
        quiet = start_process(cmd, stdout=subprocess.DEVNULL, stderr=err, env=launch_env())
        assert quiet.wait(timeout=60) == 0
    assert (tmp_path / "err.txt").read_text() == "err\n"
    loud = start_process(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=launch_env())
    assert loud.communicate(timeout=60) == (b"out\n", b"err\n")
    assert all(isinstance(p, preloaded.PreloadedProcess) for p in (quiet, loud))


def test_a_shared_server_that_never_listened_is_named_in_one_line(tmp_path):
    # what a pytest-xdist worker meets when the server its controller started died importing: the lock free,
    # no socket
    (tmp_path / "env.json").write_text("{}")
    (tmp_path / "ready.lock").touch()
    with pytest.raises(RuntimeError, match=f"^the shared preloading server at {tmp_path} did not start"):
        preloaded.Shared(str(tmp_path))


XDIST_WORKER = """
import json, os, subprocess, sys
line = sys.stdin.readline()
print(json.dumps({"argv": sys.argv, "path0": sys.path[0], "line": line, "torch": "torch" in sys.modules,
                  "popen": subprocess.Popen.__name__, "forks": preloaded_socket in os.environ,
                  "threads": os.environ.get("OMP_NUM_THREADS")}))
sys.exit(5)
"""


def test_a_pytest_xdist_worker_is_a_fork_on_its_pipes_that_starts_plain_processes(tmp_path):
    # execnet's command for a worker, with tests/xdist_fork.py as its python (conftest's setupnodes hook)
    shared = None if preloaded.SHARED in os.environ else preloaded.Server(SESSION_ENV, shared=True)
    folder = os.environ[preloaded.SHARED] if shared is None else shared.folder
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"} | {preloaded.SHARED: folder}
    code = f"preloaded_socket = {preloaded._SERVER_PATH!r}\n{XDIST_WORKER}"
    try:
        proc = subprocess.Popen(
            [sys.executable, str(XDIST_FORK), "-u", "-c", code, "extra"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, text=True,
        )  # fmt: skip
        out, err = proc.communicate("first line\nsecond\n", timeout=60)
    finally:
        if shared is not None:
            shared.stop()
    assert proc.returncode == 5, err
    seen = json.loads(out)
    assert seen["argv"] == ["-c", "extra"] and seen["path0"] == "" and seen["line"] == "first line\n"
    assert seen["torch"], "not forked from the server (which imported torch)"
    # what it starts is what any process starts: subprocess's own Popen, no server to fork from
    assert seen["popen"] == "Popen" and not seen["forks"]
    assert seen["threads"] == "1"  # imported as the server did (helpers.SESSION_ENV), not as this process


def test_this_pytest_xdist_worker_is_a_fork_of_the_preloading_server():
    if "PYTEST_XDIST_WORKER" not in os.environ:
        pytest.skip("not under pytest-xdist (make test runs it so)")
    # its parent: the server's process between it and the server (a fork of the server: its command line)
    parent = Path(f"/proc/{os.getppid()}/cmdline").read_bytes().split(b"\0")
    assert Path(parent[1].decode()).name == "preloaded.py", parent


TORCHFT_LOGS = """
import sys
from datetime import timedelta
from torchft._torchft import LighthouseServer, ManagerServer
lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=2)
manager = ManagerServer(
    replica_id="r0", lighthouse_addr=lighthouse.address(), hostname="127.0.0.1", bind="127.0.0.1:0",
    store_addr="127.0.0.1:1", world_size=1, heartbeat_interval=timedelta(milliseconds=100),
    connect_timeout=timedelta(seconds=5), quorum_retries=0,
)
manager.shutdown()
lighthouse.shutdown()
print("transformers" in sys.modules)  # the server imported it; torchft does not
"""


def test_a_fork_logs_torchft_at_the_level_of_its_rust_log(tmp_path):
    # torchft's Rust extension reads RUST_LOG as it is imported, which a fork's server did: the tests'
    # processes (launch_env) and the server import under warn, and any other level gets a fresh interpreter
    pytest.importorskip("torchft")
    script = tmp_path / "torchft_logs.py"
    script.write_text(TORCHFT_LOGS)
    cmd = [sys.executable, str(script)]
    for level, forked in (("warn", True), ("info", False)):
        env = launch_env(RUST_LOG=level)
        assert (not preloaded.fork_blockers(cmd, env, preloaded.server({}).env)) is forked
        done = run_commands([(cmd, env)], str(tmp_path), 60)
        assert done.returncode == 0, done.stderr
        assert done.stdout.strip() == str(forked)
        assert ("[INFO] [torchft::manager]" in done.stderr) is (level == "info"), (level, done.stderr)
