"""A doomed restart is not tried: the same start-up failure twice in a row (same exit status or signal, same reason
class, before SERVING) stops `h3serve up`'s watch and the DiT launcher's restarts with the reason, while a process
that fails differently, or that had reached SERVING before it died, is restarted within its budget. Stand-in children
(python -c) run under the real supervisors; readiness is the real gRPC health probe."""

from __future__ import annotations

import logging
import sys

import pytest
from stand_ins import (
    SELF_KILL,
    SLEEP,
    StandIns,
    counted,
    deployment,
    health_server,
    kill_on_serving,
    meminfo,
    no_signals,
    starts,
)

from h3serve.cli.supervise import Watch
from h3serve.common.config import DiTConfig
from h3serve.common.free_ports import free_port
from h3serve.common.processes import Ending, RepeatedFailure
from h3serve.common.server import is_serving
from h3serve.services.dit.supervisor import Group, rank0_serving

pytestmark = pytest.mark.processes

# An exit code that differs at every start: the launcher's restart count (DiT), or the starts counted so far (up).
DIFFERENT_EXIT_DIT = "import os, sys; sys.exit(10 + int(os.environ['TORCHELASTIC_RESTART_COUNT']))"


def different_exit(path) -> str:
    return f"import sys; sys.exit(10 + len(open({str(path)!r}).read().splitlines()))"


@pytest.mark.parametrize(
    "code, oom, started, start_up_failure",
    [(-9, True, False, True), (1, False, False, True), (0, False, False, False), (-9, True, True, False)],
)
def test_a_start_up_failure_is_a_non_zero_end_before_ready(code, oom, started, start_up_failure):
    assert Ending(code, oom, started, "").start_up_failure is start_up_failure


def test_the_same_start_up_failure_twice_is_a_repeat_and_anything_between_resets_it():
    failures = RepeatedFailure()
    assert [failures.repeats(kind, True) for kind in [(-9, True), (-9, False), (-9, False)]] == [False, False, True]
    assert not failures.repeats((1, False), True) and not failures.repeats((1, False), False), "not a start-up one"
    assert not failures.repeats((1, False), True), "the one between started the count again"


def run_watch(tmp_path, command, **supervisor):
    """`h3serve up`'s watch over one stand-in service, memory to spare: (the reason it ended, the group)."""
    group = StandIns(deployment(tmp_path, free_port(), **supervisor), {"vae": command})
    group.start()
    try:
        return Watch(group, no_signals(), meminfo(tmp_path / "meminfo", 16, 8.0)).run(lambda: None), group
    finally:
        group.stop()


def test_up_stops_at_the_same_start_up_failure_twice(tmp_path):
    reason, group = run_watch(tmp_path, counted(tmp_path / "starts", SELF_KILL), max_restarts=5)
    assert reason == "stopped restarting: the same start-up failure twice: vae was killed by signal SIGKILL"
    assert group.starts["vae"] == starts(tmp_path / "starts") == 2


def test_up_restarts_a_service_that_fails_differently_within_its_budget(tmp_path):
    path = tmp_path / "starts"
    reason, group = run_watch(tmp_path, counted(path, different_exit(path)), max_restarts=2)
    assert reason == "vae exited with code 13, past its restart budget (2 restarts within 300 s)"
    assert starts(path) == 3


def test_up_restarts_a_service_killed_after_it_served_within_its_budget(tmp_path):
    """Killed the same way each time (as the OOM killer's), but each after it had reached SERVING."""
    port = free_port()
    group = StandIns(
        deployment(tmp_path, port, max_restarts=2),
        {"vae": counted(tmp_path / "starts", health_server(port))},
        ready=kill_on_serving(is_serving),
    )
    group.start()
    try:
        reason = Watch(group, no_signals(), meminfo(tmp_path / "meminfo", 16, 0.5)).run(lambda: None)
    finally:
        group.stop()
    assert reason.startswith("vae was most likely killed by the kernel's OOM killer: "), reason
    assert reason.endswith(", past its restart budget (2 restarts within 300 s)"), reason
    assert starts(tmp_path / "starts") == 3


def group_starts(caplog) -> int:
    """The DiT launcher's starts of its group (a rank may be stopped before it could count itself)."""
    return caplog.text.count("starting the DiT group: ")


def run_group(tmp_path, command, max_restarts=5, world_size=2):
    """The DiT launcher's group of stand-in ranks, memory to spare, rank 0's real probe: (its exit code, the group)."""
    config = DiTConfig(world_size=world_size, port=free_port(), max_restarts=max_restarts)
    group = Group(
        config, command, ("127.0.0.1", free_port()), no_signals(), meminfo=meminfo(tmp_path / "meminfo", 16, 8.0)
    )
    return group.run(), group


def test_the_dit_launcher_stops_at_the_same_start_up_failure_twice(tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="h3serve.dit.supervisor"):
        code, group = run_group(tmp_path, counted(tmp_path / "starts", SELF_KILL))
    assert code == 1 and group_starts(caplog) == 2
    assert "was killed by signal SIGKILL" in group.last_exit
    assert f"stopped restarting: the same start-up failure twice: {group.last_exit}" in caplog.text


def test_the_dit_launcher_restarts_ranks_that_fail_differently_within_max_restarts(tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="h3serve.dit.supervisor"):
        code, group = run_group(
            tmp_path, counted(tmp_path / "starts", DIFFERENT_EXIT_DIT), max_restarts=2, world_size=1
        )
    assert code == 1 and group_starts(caplog) == starts(tmp_path / "starts") == 3
    assert group.last_exit.endswith("exited with code 12")
    assert "no restart left (max_restarts = 2)" in caplog.text and "same start-up failure" not in caplog.text


def test_the_dit_launcher_restarts_a_group_killed_after_it_served_within_max_restarts(tmp_path, caplog):
    """Rank 0 serves health on the DiT's port, rank 1 sleeps; both are SIGKILLed once the launcher's real probe found
    rank 0 SERVING."""
    config = DiTConfig(world_size=2, port=free_port(), max_restarts=2)
    rank0 = health_server(config.port)
    command = [sys.executable, "-c", f"import os; exec({rank0!r} if os.environ['RANK'] == '0' else {SLEEP!r})"]
    group = Group(
        config,
        command,
        ("127.0.0.1", free_port()),
        no_signals(),
        ready=kill_on_serving(rank0_serving(config)),
        meminfo=meminfo(tmp_path / "meminfo", 16, 8.0),
    )
    with caplog.at_level(logging.INFO, logger="h3serve.dit.supervisor"):
        assert group.run() == 1
    assert group_starts(caplog) == 3
    assert "rank 0 (pid" in group.last_exit and "killed by signal SIGKILL" in group.last_exit
    assert "no restart left (max_restarts = 2)" in caplog.text and "same start-up failure" not in caplog.text
