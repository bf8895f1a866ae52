"""One owner of a port and of a data directory: every gRPC server binds its port exclusively (no SO_REUSEPORT), so a
second server on it is refused at start naming the address and the holder; a second gateway on one data_dir is
refused naming the directory and the holder's pid; and a refusal (EXIT_REFUSED) is not restarted, neither by
`h3serve up`'s watch nor by the DiT launcher. Real processes on loopback ports."""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import threading
import time

import pytest
from conftest import free_port, write_config
from stand_ins import REFUSE, StandIns, counted, deployment, no_signals, starts

from h3serve.cli.launcher import ServiceGroup
from h3serve.cli.supervise import Watch
from h3serve.common.config import ConfigError, DiTConfig, load_deploy
from h3serve.common.processes import (
    EXIT_REFUSED,
    LOCK_FILE,
    Refused,
    command_line,
    lock_directory,
    port_holders,
    wait_port_released,
)
from h3serve.common.server import start_server
from h3serve.services.dit.supervisor import Group

pytestmark = pytest.mark.processes

CLI = [sys.executable, "-m", "h3serve.cli"]


def test_who_listens_on_a_port_is_named_from_proc():
    with socket.create_server(("127.0.0.1", 0)) as listener:
        port = listener.getsockname()[1]
        (holder,) = port_holders(port)
        assert holder == f"pid {os.getpid()} ({command_line(os.getpid())})" and command_line(os.getpid()) != "?"
    assert port_holders(port) is None, "nothing listens on it any more"


def test_a_restart_waits_until_the_old_instance_has_released_its_port():
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    closing = threading.Timer(0.5, listener.close)
    closing.start()
    started = time.monotonic()
    assert wait_port_released(port, started + 30), "released once the listener closed"
    assert time.monotonic() - started >= 0.5, "not before"
    with socket.create_server(("127.0.0.1", 0)) as held:
        deadline = time.monotonic() + 0.3
        assert not wait_port_released(held.getsockname()[1], deadline) and time.monotonic() >= deadline


def test_a_second_server_on_a_port_in_use_is_refused_naming_the_address_and_the_holder():
    port = free_port()
    server, _ = start_server(lambda s: None, [], f"127.0.0.1:{port}")
    try:
        second = subprocess.run(
            [
                sys.executable,
                "-c",
                f"from h3serve.common.server import start_server; start_server(lambda s: None, [], '127.0.0.1:{port}')",
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
    finally:
        server.stop(0)
    assert second.returncode == EXIT_REFUSED, second.stderr
    assert f"refused: cannot listen on 127.0.0.1:{port}: port {port} is in use by pid {os.getpid()} (" in second.stderr


@pytest.mark.parametrize("key", ["metrics_port", "http_port"])
def test_a_gateway_whose_metrics_or_http_port_is_in_use_is_refused_naming_the_address(tmp_path, key):
    ports = dict(encoder=free_port(), dit=free_port(), vae=free_port(), gateway=free_port())
    with socket.create_server(("127.0.0.1", 0)) as held:
        port = held.getsockname()[1]
        config = write_config(tmp_path / "deploy.toml", "", tmp_path / "gateway", ports, **{key: port})
        second = subprocess.run(
            [*CLI, "serve", "gateway", "--config", str(config)], capture_output=True, text=True, timeout=120
        )
    assert second.returncode == EXIT_REFUSED, second.stderr
    assert f"refused: cannot listen on 127.0.0.1:{port}: port {port} is in use by pid {os.getpid()} (" in second.stderr


def test_two_listeners_of_one_group_on_one_port_are_refused_before_anything_starts(tmp_path):
    ports = dict(encoder=free_port(), dit=free_port(), vae=free_port(), gateway=free_port())
    config = write_config(tmp_path / "deploy.toml", "", tmp_path / "gateway", ports, http_port=ports["vae"])
    group = ServiceGroup(load_deploy(config), str(config), log_dir=str(tmp_path / "logs"))
    with pytest.raises(ConfigError) as refused:
        group.start()
    assert (
        str(refused.value)
        == f"{config} [gateway] http_port = {ports['vae']} is also [vae] port: give each listener a port of its own"
    )
    assert group.running == [] and not (tmp_path / "logs").exists()
    ServiceGroup(load_deploy(config), str(config), names=("encoder", "dit", "gateway")).check_ports()  # no VAE here


def test_a_service_that_ends_during_start_up_is_reported_with_the_end_of_its_log(tmp_path):
    data_dir = tmp_path / "gateway"
    config = write_config(tmp_path / "deploy.toml", "", data_dir, dict(encoder=1, dit=2, vae=3, gateway=free_port()))
    group = ServiceGroup(load_deploy(config), str(config), log_dir=str(tmp_path / "logs"), names=("gateway",))
    data_dir.mkdir()
    (data_dir / "jobs.sqlite").write_text("not a database")  # the gateway refuses its store once started
    with pytest.raises(RuntimeError) as ended:
        group.__enter__()
    log = tmp_path / "logs" / "gateway.log"
    assert str(ended.value).startswith(f"gateway refused to start (exit code 78) during start-up; the end of {log}:\n")
    assert f"refused: [gateway] job store {data_dir / 'jobs.sqlite'} is damaged (" in str(ended.value)


def test_a_data_directory_has_one_holder_for_as_long_as_it_holds_the_lock(tmp_path):
    data_dir = str(tmp_path / "data")
    first = lock_directory(data_dir)
    with pytest.raises(Refused, match=rf"^{data_dir} is in use by pid {os.getpid()} \(.*\), which holds its lock"):
        lock_directory(data_dir)
    first.close()
    lock_directory(data_dir).close()
    assert (tmp_path / "data" / LOCK_FILE).read_text() == f"{os.getpid()}\n"


def test_a_second_gateway_on_a_data_dir_in_use_is_refused_naming_it_and_the_holder(tmp_path):
    data_dir = tmp_path / "gateway"
    config = write_config(tmp_path / "deploy.toml", "", data_dir, dict(encoder=1, dit=2, vae=3, gateway=free_port()))
    with lock_directory(str(data_dir)):  # as a first gateway holds it
        second = subprocess.run(
            [*CLI, "serve", "gateway", "--config", str(config)], capture_output=True, text=True, timeout=120
        )
    assert second.returncode == EXIT_REFUSED, second.stderr
    assert f"refused: [gateway] data_dir {data_dir} is in use by pid {os.getpid()} (" in second.stderr


def test_up_does_not_restart_a_refusal(tmp_path):
    group = StandIns(deployment(tmp_path, free_port(), max_restarts=5), {"vae": counted(tmp_path / "starts", REFUSE)})
    group.start()
    try:
        reason = Watch(group, no_signals()).run(lambda: None)
    finally:
        group.stop()
    assert reason == "vae refused to start (exit code 78): not restarting it (the reason is in its output above)"
    assert starts(tmp_path / "starts") == 1


def test_the_dit_launcher_does_not_restart_a_refusal_and_exits_refused(tmp_path, caplog):
    config = DiTConfig(world_size=1, port=free_port(), max_restarts=5)
    group = Group(config, counted(tmp_path / "starts", REFUSE), ("127.0.0.1", free_port()), no_signals())
    with caplog.at_level(logging.INFO, logger="h3serve.dit.supervisor"):
        assert group.run() == EXIT_REFUSED
    assert starts(tmp_path / "starts") == 1 and "configuration was refused" in caplog.text
