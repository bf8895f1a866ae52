"""Why a supervised process died: a SIGKILL with the host near its memory limit at the last sample reads as the OOM
killer's, with the figures, in `h3serve up`'s watch and in the DiT launcher. The judgement is a pure function of
sampled figures; the whole path runs real children that SIGKILL themselves, with a stand-in meminfo file."""

from __future__ import annotations

import logging
import math
import signal
import subprocess
import sys

import pytest
from stand_ins import SELF_KILL, SLEEP, StandIns, counted, deployment, meminfo, no_signals, starts

from h3serve.cli.supervise import Watch
from h3serve.common.config import DiTConfig
from h3serve.common.free_ports import free_port
from h3serve.common.processes import (
    GIB,
    LARGE_ANON_SHARE,
    LOW_AVAILABLE_SHARE,
    HostMemory,
    MemoryWatch,
    near_memory_limit,
    process_anon,
    read_meminfo,
)
from h3serve.services.dit.supervisor import Group

pytestmark = pytest.mark.processes

TOTAL = 16 * GIB
OOM_SAID = "most likely killed by the kernel's OOM killer: host had 0.50 GiB available of 16.00 GiB, "


@pytest.mark.parametrize(
    "available, anon, near",
    [
        (LOW_AVAILABLE_SHARE * TOTAL - 1, None, True),  # the host was at its limit
        (LOW_AVAILABLE_SHARE * TOTAL, None, False),  # just not
        (TOTAL / 2, LARGE_ANON_SHARE * TOTAL, True),  # the process alone held half the host
        (TOTAL / 2, LARGE_ANON_SHARE * TOTAL - 1, False),
        (LOW_AVAILABLE_SHARE * TOTAL - 1, 1 << 20, True),  # a small victim of a full host
    ],
)
def test_near_the_limit_is_a_function_of_the_last_figures(available, anon, near):
    figures = HostMemory(TOTAL, math.ceil(available)), None if anon is None else math.ceil(anon)
    assert near_memory_limit(*figures) is near


def test_meminfo_and_a_process_memory_are_read_from_proc_or_a_given_file(tmp_path):
    assert read_meminfo(meminfo(tmp_path / "meminfo", 16, 0.5)) == HostMemory(TOTAL, GIB // 2)
    assert read_meminfo(str(tmp_path / "absent")) is None
    host = read_meminfo()
    assert host and 0 < host.available <= host.total
    child = subprocess.Popen([sys.executable, "-c", SLEEP])
    try:
        assert process_anon(child.pid) > 0
    finally:
        child.kill()
        child.wait()
    assert process_anon(child.pid) is None, "reaped: nothing to read"


def test_a_sigkill_reads_as_the_oom_killer_only_near_the_limit(tmp_path):
    """A real child, sampled while it runs, killed by the test: the figures are from before its death."""
    for available, said in ((0.5, f"was {OOM_SAID}the process held "), (8.0, "was killed by signal SIGKILL")):
        watch = MemoryWatch(meminfo(tmp_path / "meminfo", 16, available))
        child = subprocess.Popen([sys.executable, "-c", SLEEP])
        watch.sample([child.pid])
        child.kill()
        ending = watch.ending(child.pid, child.wait(), started=False)
        assert ending.text.startswith(said), ending.text
        assert ending.oom is (available == 0.5) and ending.kind == (-signal.SIGKILL, ending.oom)
        if ending.oom:
            assert ending.text.endswith(" GiB (anon) at its last sample")


def test_an_exit_is_no_oom_kill_however_full_the_host(tmp_path):
    watch = MemoryWatch(meminfo(tmp_path / "meminfo", 16, 0.5))
    watch.sample_host()
    assert watch.ending(12345, 3, started=False).text == "exited with code 3"
    assert watch.ending(12345, -signal.SIGTERM, started=True).text == "was killed by signal SIGTERM"


def test_up_reports_a_service_sigkilled_near_the_limit_as_oom_killed(tmp_path, capsys):
    config = deployment(tmp_path, free_port(), max_restarts=5)
    group = StandIns(config, {"vae": counted(tmp_path / "starts", SELF_KILL)})
    group.start()
    try:
        reason = Watch(group, no_signals(), meminfo(tmp_path / "meminfo", 16, 0.5)).run(lambda: None)
    finally:
        group.stop()
    assert reason.startswith(f"stopped restarting: the same start-up failure twice: vae was {OOM_SAID}"), reason
    assert starts(tmp_path / "starts") == 2
    assert f"h3serve up: vae was {OOM_SAID}" in capsys.readouterr().err, "the first death, logged as it restarted"


def test_the_dit_launcher_reports_a_rank_sigkilled_near_the_limit_as_oom_killed(tmp_path, caplog):
    config = DiTConfig(world_size=2, port=free_port(), max_restarts=5)
    group = Group(
        config,
        [sys.executable, "-c", SELF_KILL],
        ("127.0.0.1", free_port()),
        no_signals(),
        meminfo=meminfo(tmp_path / "meminfo", 16, 0.5),
    )
    with caplog.at_level(logging.INFO, logger="h3serve.dit.supervisor"):
        assert group.run() == 1
    assert f") was {OOM_SAID}" in group.last_exit, group.last_exit
    assert "stopped restarting: the same start-up failure twice: rank " in caplog.text
    assert caplog.text.count("starting the DiT group: ") == 2


def test_a_restarted_dit_reports_how_the_start_before_it_ended():
    """The launcher hands the last exit reason to the next start's ranks; rank 0 puts it in DiTInfo.state."""
    from h3serve.common.config import DiTConfig
    from h3serve.services.dit import rank, supervisor

    config = DiTConfig(max_restarts=3)
    reason = "rank 0 (pid 7) most likely killed by the kernel's OOM killer: host had 0.50 GiB available of 16.00 GiB"
    env = supervisor.rank_env(config, 0, 1, ("127.0.0.1", 1), reason)
    assert env[supervisor.LAST_EXIT_ENV] == reason
    assert rank.start_state(config, 1, env[supervisor.LAST_EXIT_ENV]) == f"restarting (restart 1 of 3; after: {reason})"
    assert rank.start_state(config, 0, "") == "starting"
