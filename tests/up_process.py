"""`h3serve up` as a user runs it, for the tests that kill its processes for real (supervision, the fault walk)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from conftest import free_port, write_config

from h3serve.cli.launcher import is_serving
from h3serve.client import GatewayClient
from h3serve.common.processes import Proc, children, descendants
from h3serve.v1 import gateway_pb2

CLI = [sys.executable, "-m", "h3serve.cli"]
SMALL = dict(prompt="a kite", height=32, width=64, num_inference_steps=2, seed=3)


def wait_until(condition, limit_s: float, what: str, poll_s: float = 0.2):
    deadline = time.monotonic() + limit_s
    while not (value := condition()):
        assert time.monotonic() < deadline, f"not within {limit_s:.0f} s: {what}"
        time.sleep(poll_s)
    return value


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


class Up:
    """`h3serve up` as from a terminal (its own process group), with every process it started collected as seen."""

    def __init__(self, root: Path, model_dir: Path, dit: dict, supervisor: str = "") -> None:
        self.ports = {name: free_port() for name in ("encoder", "dit", "vae", "gateway")}
        self.config = write_config(root / "deploy.toml", str(model_dir), root / "gateway", self.ports,
                                   service_keys={"threads": 1}, dit=dit)
        self.config.write_text(self.config.read_text() + "\n" + supervisor)
        self.log_dir, self.output = root / "logs", root / "up.out"
        with open(self.output, "wb") as out:
            self.process = subprocess.Popen([*CLI, "up", "--config", str(self.config), "--log-dir",
                                             str(self.log_dir)], stdout=out, stderr=subprocess.STDOUT,
                                            start_new_session=True)
        self.seen: set[Proc] = set()

    def collect(self) -> set[Proc]:
        self.seen |= {proc for proc in map(Proc.of, descendants(self.process.pid)) if proc}
        return self.seen

    def service(self, name: str) -> int | None:
        """The pid of service `name`'s process (a child of `up`; the DiT's execs its launcher), None while it has
        none."""
        marks = [f"serve {name} ".encode(), *([b"-m h3serve.services.dit.supervisor "] if name == "dit" else [])]
        for pid in children(self.process.pid):
            with open(f"/proc/{pid}/cmdline", "rb") as file:
                command = file.read().replace(b"\0", b" ")
            if any(mark in command for mark in marks):
                return pid
        return None

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

    def ended_cleanly(self, code: int = 0, clean_logs: bool = True) -> None:
        """`up` exits with `code` and leaves no process behind; its services' logs have no ERROR or Traceback."""
        assert self.process.wait(90) == code, self.output.read_text()
        wait_until(lambda: not living(self.seen), 10, f"every process of up's tree ends: {living(self.seen)}")
        for log in sorted(self.log_dir.glob("*.log")) if clean_logs else []:
            text = log.read_text()
            assert "ERROR" not in text and "Traceback" not in text, f"{log.name}:\n{text}"

    def close(self) -> None:
        kill_tree(self.process, self.seen)


