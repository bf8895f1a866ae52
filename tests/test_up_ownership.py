"""`h3serve up` owns its ports and its data directory before it starts anything (issue 51): a second `up` beside
the running stack, on the same configuration or on other ports with the same data_dir, is refused at once (exit
EXIT_REFUSED) naming each port or directory and the pid holding it, in its own output; none of its services ever
started (no log written, nothing answering on its ports). Real processes: the session's stack is the first `up`."""

from __future__ import annotations

import subprocess
import sys

import pytest
from conftest import free_port, write_config

from h3serve.common.config import load_deploy
from h3serve.common.processes import EXIT_REFUSED, LOCK_FILE, command_line
from h3serve.common.server import is_answering

pytestmark = pytest.mark.processes

CLI = [sys.executable, "-m", "h3serve.cli"]


def _up(config, log_dir) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*CLI, "up", "--config", str(config), "--log-dir", str(log_dir)], capture_output=True, text=True, timeout=120
    )


def _gateway(stack) -> str:
    """ "pid N (command)" of the stack's gateway, as a refusal names a holder."""
    pid = next(item.process.pid for item in stack.group.running if item.name == "gateway")
    return f"pid {pid} ({command_line(pid)})"


def test_a_second_up_on_the_same_configuration_is_refused_naming_each_port_and_the_directory(stack, tmp_path):
    second = _up(stack.config_path, tmp_path / "logs")
    assert second.returncode == EXIT_REFUSED, second.stderr
    (line,) = [line for line in second.stderr.splitlines() if line.startswith("refused: ")]
    assert line.startswith(f"refused: h3serve up: {stack.config_path}: ")
    gateway, data_dir = _gateway(stack), load_deploy(stack.config_path).gateway.data_dir
    for key, name in (
        ("[gateway] port", "gateway"),
        ("[gateway] http_port", "http"),
        ("[gateway] metrics_port", "metrics"),
    ):
        assert f"{key} = {stack.ports[name]}: the port is in use by {gateway}" in line
    for name in ("encoder", "dit", "vae"):
        assert f"[{name}] port = {stack.ports[name]}: the port is in use by pid " in line
    assert f"[gateway] data_dir: {data_dir} is in use by {gateway}, which holds its lock {LOCK_FILE}" in line
    assert not (tmp_path / "logs").exists(), "no service of the refused `up` was started"


def test_a_second_up_on_other_ports_with_the_same_data_dir_is_refused_before_any_service_starts(stack, tmp_path):
    ports = {name: free_port() for name in ("encoder", "dit", "vae", "gateway")}
    data_dir = load_deploy(stack.config_path).gateway.data_dir
    config = write_config(tmp_path / "deploy.toml", str(stack.model_dir), data_dir, ports)
    second = _up(config, tmp_path / "logs")
    assert second.returncode == EXIT_REFUSED, second.stderr
    assert (
        f"refused: h3serve up: {config}: [gateway] data_dir: {data_dir} is in use by {_gateway(stack)}, which holds "
        f"its lock {LOCK_FILE}. Stop what holds them (another `h3serve up`?) or give this deployment ports and a "
        "data_dir of its own"
    ) in second.stderr.splitlines()
    assert not (tmp_path / "logs").exists(), "no service of the refused `up` was started"
    assert not any(is_answering(f"127.0.0.1:{port}") for port in ports.values())
