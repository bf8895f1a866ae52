"""The fork server (h3serve/common/forkserver.py): a child runs `python -m` as the interpreter would, with the
requester's arguments, environment, streams and session, and its exit status, death signal and title are those a
plain child would have; what it cannot reproduce starts plainly."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from deployments import write_config
from up_process import command, wait_until

from bench.common import process_tree
from h3serve.cli.launcher import ServiceGroup
from h3serve.common import forkserver
from h3serve.common.config import load_deploy
from h3serve.common.free_ports import free_port
from h3serve.common.processes import Proc

pytestmark = pytest.mark.processes

CHILD = """
import json, os, sys, time
import marker
what = sys.argv[1]
if what == "report":
    torch = sys.modules.get("torch")
    print(json.dumps({
        "argv": sys.argv, "cwd": os.getcwd(), "variable": os.environ.get("CHILD_VARIABLE"),
        "marker_pid": marker.PID, "pid": os.getpid(), "leads_session": os.getsid(0) == os.getpid(),
        "threads": torch.get_num_threads() if torch else None,
    }), flush=True)
elif what == "exit":
    sys.exit(int(sys.argv[2]))
elif what == "raise":
    raise RuntimeError("raised in the child")
elif what == "sleep":
    print("sleeping", flush=True)
    time.sleep(120)
"""


@pytest.fixture
def modules(tmp_path, monkeypatch) -> Path:
    """`child` (what the forks run) and `marker` (preloaded: it records the pid that imported it) on PYTHONPATH,
    which the server reads at start, as the requester's environment must."""
    directory = tmp_path / "modules"
    directory.mkdir()
    (directory / "child.py").write_text(CHILD)
    (directory / "marker.py").write_text("import os\nPID = os.getpid()\n\n\ndef preload():\n    pass\n")
    (directory / "with_torch.py").write_text("def preload():\n    import marker, torch\n")
    monkeypatch.setenv("PYTHONPATH", f"{directory}{os.pathsep}{os.getcwd()}")  # the requesters import h3serve
    monkeypatch.delenv(forkserver.ENV)
    return directory


@pytest.fixture
def server(modules):
    server = forkserver.ForkServer.launch("marker")
    yield server
    server.stop()


def run(server, *args: str, **popen):
    return forkserver.start([sys.executable, "-m", "child", *args], server, **popen)


def test_a_fork_runs_the_module_as_python_m_would(server, modules, tmp_path):
    out = tmp_path / "out"
    with open(out, "wb") as stdout:
        child = run(
            server, "report", "x y", env={**os.environ, "CHILD_VARIABLE": "set"}, stdout=stdout, start_new_session=True
        )
    assert isinstance(child, forkserver.Forked)
    assert child.wait(30) == 0
    report = json.loads(out.read_text())
    assert report["argv"] == [str(modules / "child.py"), "report", "x y"]
    assert report["cwd"] == os.getcwd() and report["variable"] == "set" and report["leads_session"]
    assert report["marker_pid"] == server.process.pid != report["pid"]  # imported once, by the server


def test_its_title_is_its_command_line_and_its_status_comes_back(server, tmp_path):
    sleeper = run(server, "sleep", stdout=subprocess.DEVNULL)
    argv = [sys.executable, "-m", "child", "sleep"]
    wait_until(lambda: command(sleeper.pid) == " ".join(argv), 10, "the title")
    assert sleeper.poll() is None
    with pytest.raises(subprocess.TimeoutExpired):
        sleeper.wait(0.2)
    sleeper.kill()
    assert sleeper.wait(10) == -signal.SIGKILL
    assert run(server, "exit", "3").wait(30) == 3
    err = tmp_path / "err"
    with open(err, "wb") as stderr:
        assert run(server, "raise", stderr=stderr).wait(30) == 1
    assert "RuntimeError: raised in the child" in err.read_text()


def test_a_child_gets_its_death_signal_when_its_requester_dies(server, modules, tmp_path):
    """The requester is a process of its own, SIGKILLed: the server sees its connection close."""
    pid_file = tmp_path / "pid"
    requester = subprocess.Popen(
        [
            sys.executable,
            "-c",
            textwrap.dedent(f"""
                import sys, time
                from h3serve.common import forkserver
                child = forkserver.ForkServer({server.path!r}).fork(
                    [sys.executable, "-m", "child", "sleep"], death_signal=15, stdout=-3)
                open({str(pid_file)!r}, "w").write(str(child.pid))
                time.sleep(120)
            """),
        ],
    )
    try:
        wait_until(lambda: pid_file.exists() and pid_file.read_text(), 30, "the requester's fork")
        child = Proc.of(int(pid_file.read_text()))
        assert child and child.alive()
        requester.kill()
        wait_until(lambda: not child.alive(), 10, "the child ended with its requester")
    finally:
        requester.kill()
        requester.wait()


def test_children_end_with_the_server_and_report_their_death_signal(server):
    child = run(server, "sleep", death_signal=signal.SIGTERM, stdout=subprocess.DEVNULL)
    proc = Proc.of(child.pid)
    assert proc
    server.process.kill()
    assert child.wait(10) == -signal.SIGTERM
    wait_until(lambda: not proc.alive(), 10, "the child ended with the server")


def test_what_a_fork_cannot_reproduce_starts_plainly(server, tmp_path):
    env = {**os.environ, "TORCH_LOGS": "dynamo"}  # read when torch imports: the server's import did not see it
    child = run(server, "exit", "4", env=env)
    assert isinstance(child, subprocess.Popen) and child.wait(30) == 4
    blas = {**os.environ, "OPENBLAS_NUM_THREADS": "3"}  # read when numpy loads its OpenBLAS, in the server
    child = run(server, "exit", "3", env=blas)
    assert isinstance(child, subprocess.Popen) and child.wait(30) == 3
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    assert run(server, "exit", "5", cwd=str(elsewhere)).wait(30) == 5  # a Popen option it does not take
    server.stop()
    child = run(server, "exit", "6")  # the server is gone
    assert isinstance(child, subprocess.Popen) and child.wait(30) == 6


def test_a_child_takes_its_own_thread_count_from_its_environment(modules, tmp_path):
    """OpenMP read the server's OMP_NUM_THREADS when torch loaded there; a rank sharing the cores asks for one."""
    server = forkserver.ForkServer.launch("with_torch")
    try:
        out = tmp_path / "out"
        with open(out, "wb") as stdout:
            child = run(server, "report", env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=stdout)
            assert isinstance(child, forkserver.Forked) and child.wait(60) == 0
        assert json.loads(out.read_text())["threads"] == 1
    finally:
        server.stop()


def test_the_stacks_model_services_are_forks_of_the_fork_server(stack, fork_server):
    """The suite's stacks start as `h3serve up` does, from the session's fork server; the gateway, which imports no
    torch, starts plainly."""
    forked = {
        item.name: item.process.pid for item in stack.group.running if isinstance(item.process, forkserver.Forked)
    }
    assert forked.keys() == {"encoder", "dit", "vae"}
    for pid in forked.values():
        with open(f"/proc/{pid}/stat") as file:
            assert int(file.read().rsplit(")", 1)[1].split()[1]) == fork_server.process.pid


def test_the_launcher_of_a_one_rank_dit_group_never_loads_torch(stack):
    """One rank keeps its store in its own memory (parallel.attempt_store): its launcher (a fork that exec'd the
    supervisor) serves none, so it imports no torch."""
    (launcher,) = (item.process.pid for item in stack.group.running if item.name == "dit")
    maps = Path(f"/proc/{launcher}/maps").read_text()
    assert "h3serve.services.dit.supervisor" in Path(f"/proc/{launcher}/cmdline").read_text().replace("\0", " ")
    assert "libtorch" not in maps, "the launcher loaded torch"


def test_a_group_with_a_fork_server_of_its_own_counts_it_among_its_roots(tiny_model_dir, tmp_path, monkeypatch):
    """What a bench samples (bench/e2e.py: the trees of `process_roots`) holds the DiT's rank, a child of the group's
    fork server and not of the DiT's launcher."""
    monkeypatch.delenv(forkserver.ENV)
    ports = {name: free_port() for name in ("encoder", "dit", "vae", "gateway")}
    config = write_config(tmp_path / "deploy.toml", str(tiny_model_dir), tmp_path / "gateway", ports)
    with ServiceGroup(load_deploy(config), str(config), names=("dit",)) as group:
        assert group.fork_server and group.fork_server.process
        assert group.fork_server.process.pid in group.process_roots()
        ranks = [pid for pid in process_tree(group.process_roots()) if "-m h3serve.services.dit.rank " in command(pid)]
        assert len(ranks) == 1
        rank = Proc.of(ranks[0])
    assert rank and not rank.alive(), "the group's stop ended its rank"
