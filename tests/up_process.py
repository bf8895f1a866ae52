"""`h3serve up` as a user runs it, for the tests that kill its processes for real (supervision, the fault walk)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from deployments import write_config

from h3serve.cli.launcher import is_serving
from h3serve.client import GatewayClient
from h3serve.common.forkserver import ENV as FORK_SERVER
from h3serve.common.free_ports import free_port
from h3serve.common.processes import Proc, command_line, descendants, service_pid
from h3serve.v1 import gateway_pb2

CLI = [sys.executable, "-m", "h3serve.cli"]
SMALL = dict(prompt="a kite", height=32, width=64, num_inference_steps=2, seed=3)


def eventually(condition, limit_s: float, poll_s: float = 0.2):
    """`condition()`'s first truthy value within `limit_s`, else its last (falsy) value."""
    deadline = time.monotonic() + limit_s
    while not (value := condition()) and time.monotonic() < deadline:
        time.sleep(poll_s)
    return value


def wait_until(condition, limit_s: float, what: str, poll_s: float = 0.2):
    value = eventually(condition, limit_s, poll_s)
    assert value, f"not within {limit_s:.0f} s: {what}"
    return value


def environment(pid: int) -> dict[str, str]:
    """A process's environment; empty once it is gone (a stopping rank may be reaped while we look)."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as file:
            raw = file.read()
    except OSError:
        return {}
    return dict(item.decode().split("=", 1) for item in raw.split(b"\0") if b"=" in item)


def own_environment() -> dict[str, str]:
    """The test's environment without its fork server: a process started with it starts its own, as for a user."""
    return {key: value for key, value in os.environ.items() if key != FORK_SERVER}


def command(pid: int) -> str:
    """A process's whole command line, its arguments joined by spaces ("?" once it is gone)."""
    return command_line(pid, limit=1 << 20)


def living(procs) -> list[int]:
    return sorted(proc.pid for proc in procs if proc.alive())


def kill_tree(process: subprocess.Popen, seen) -> None:
    """SIGKILL a test's process and every descendant it was seen with, whatever state they are in."""
    if process.poll() is None:
        process.kill()
        process.wait()
    for proc in seen:
        if proc.alive():
            os.kill(proc.pid, signal.SIGKILL)


@dataclass(frozen=True)
class Ended:
    code: int
    survivors: list[int]  # pids of up's tree still alive
    log_errors: list[str]  # "<log>: <first ERROR or Traceback line>"


CLEAN_EXIT = Ended(0, [], [])


class Up:
    """`h3serve up` as from a terminal (its own process group), with every process it started collected as seen."""

    def __init__(
        self, root: Path, model_dir: Path, dit: dict, supervisor: str = "", gateway: dict | None = None
    ) -> None:
        self.ports = {name: free_port() for name in ("encoder", "dit", "vae", "gateway")}
        self.config = write_config(
            root / "deploy.toml",
            str(model_dir),
            root / "gateway",
            self.ports,
            service_keys={"threads": 1},
            dit=dit,
            **(gateway or {}),
        )
        self.config.write_text(self.config.read_text() + "\n" + supervisor)
        self.log_dir, self.output = root / "logs", root / "up.out"
        with open(self.output, "wb") as out:
            self.process = subprocess.Popen(
                [*self.program(), "up", "--config", str(self.config), "--log-dir", str(self.log_dir)],
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env=own_environment(),
            )
        self.seen: set[Proc] = set()

    def program(self) -> list[str]:
        """The command line before `up`'s own arguments."""
        return CLI

    def collect(self) -> set[Proc]:
        self.seen |= {proc for proc in map(Proc.of, descendants(self.process.pid)) if proc}
        return self.seen

    def service(self, name: str) -> int | None:
        """The pid of service `name`'s process (a fork of `up`'s fork server, or a child of `up`), None while it has
        none."""
        return service_pid(self.process.pid, name)

    def wait_serving(self, limit_s: float = 240.0) -> None:
        def serving():
            assert self.process.poll() is None, self.output.read_text()
            return all(is_serving(f"127.0.0.1:{port}") for port in self.ports.values())

        wait_until(serving, limit_s, "every service SERVING", poll_s=0.5)
        self.collect()

    def generate(self, **request):
        client = GatewayClient(f"127.0.0.1:{self.ports['gateway']}")
        try:
            return client.generate(gateway_pb2.GenerateRequest(**{**SMALL, **request}))
        finally:
            client.close()

    def end(self, clean_logs: bool = True) -> Ended:
        """How `up` ended (it was told to stop or gave up): its exit code, the processes of its tree still alive 10 s
        later, and (with `clean_logs`) the first ERROR or Traceback line of each service log that has one."""
        code = self.process.wait(90)
        eventually(lambda: not living(self.seen), 10)
        errors = []
        for log in sorted(self.log_dir.glob("*.log")) if clean_logs else []:
            bad = [line for line in log.read_text().splitlines() if "ERROR" in line or "Traceback" in line]
            errors += [f"{log.name}: {bad[0]}"] if bad else []
        return Ended(code, living(self.seen), errors)

    def close(self) -> None:
        kill_tree(self.process, self.seen)
