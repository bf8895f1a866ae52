"""The stack a fault walk (bench/fault_walk.py) runs against: `h3serve up --config` started as a user starts it, in
its own session, with what the walk asks of it (a service's address, its pid, whether it serves, the stop), and
`until`, the one wait loop every step of a walk uses, saying what it waits for."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import grpc

from bench.served import dit_info
from h3serve.common import forkserver, processes
from h3serve.common.config import load_deploy
from h3serve.common.server import is_serving

POLL_S = 0.1  # kill to SERVING is measured to this
PROGRESS_S = 5.0
STOP_MARGIN_S = 15.0  # past [supervisor] stop_grace_s: the fork server's stop, then `up`'s own exit
STARTED_MARGIN_S = 60.0  # past start_timeout_s, up's own limit for a start: the fork server and the gateway


class Stack:
    """`h3serve up --config CONFIG` as from a terminal: its own session, and without a fork server of the caller's (it
    starts its own, so every process it starts descends from it), the logs under `work`."""

    def __init__(self, config_path: Path, work: Path) -> None:
        self.config, self.config_path = load_deploy(config_path), config_path
        self.log_dir, self.output = work / "logs", work / "up.out"
        environment = {key: value for key, value in os.environ.items() if key != forkserver.ENV}
        command = [sys.executable, "-m", "h3serve.cli", "up", "--config", str(config_path)]
        with open(self.output, "wb") as out:
            self.process = subprocess.Popen(
                [*command, "--log-dir", str(self.log_dir)],
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env=environment,
            )

    def __enter__(self) -> Stack:
        return self

    def __exit__(self, *exc) -> None:
        if self.process.poll() is None:  # a walk that failed: nothing it started may outlive it
            self.stop()

    def address(self, service: str) -> str:
        gateway = self.config.gateway
        return f"{gateway.host}:{gateway.port}" if service == "gateway" else self.config.service(service).address

    def check(self) -> None:
        """Raise once `up` has ended by itself (a refusal, a restart budget spent): nothing will come back."""
        code = self.process.poll()
        if code is not None:
            tail = self.output.read_text(errors="replace").splitlines()[-20:]
            raise RuntimeError(f"h3serve up exited with code {code}:\n" + "\n".join(tail))

    def serving(self, service: str) -> bool:
        self.check()
        return is_serving(self.address(service))

    def wait_serving(self) -> None:
        limit_s = self.config.supervisor.start_timeout_s + STARTED_MARGIN_S
        services = ("encoder", "dit", "vae", "gateway")
        started = time.monotonic()
        if not until(lambda: all(map(self.serving, services)), limit_s, "every service SERVING", poll_s=0.5):
            raise RuntimeError(f"not every service SERVING within {limit_s:.0f} s")
        print(f"every service SERVING {time.monotonic() - started:.1f} s after `h3serve up`", flush=True)

    def pid(self, service: str) -> int | None:
        """The process a kill of `service` ends: DiT rank 0 as the DiT's Info lists it, else the service's process,
        found by its command line (`h3serve serve NAME`, also for a fork of the fork server); None while it has
        none."""
        if service == "dit":
            try:
                return next((rank.pid for rank in dit_info(self.config).ranks if rank.rank == 0), None)
            except grpc.RpcError:  # restarting
                return None
        return processes.service_pid(self.process.pid, service)

    def dit_log(self) -> Path:
        return self.log_dir / "dit.log"

    def stop(self) -> int | None:
        """SIGTERM, as a Ctrl-C: `up` stops every service within [supervisor] stop_grace_s. Its exit code; None when
        it had not exited by then (it is then killed)."""
        self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(self.config.supervisor.stop_grace_s + STOP_MARGIN_S)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)  # its services follow: their parent-death signal
            self.process.wait()
            return None


def until(
    condition: Callable, limit_s: float, waiting_for: str, report: Callable[[], str] | None = None, poll_s=POLL_S
):
    """`condition()`'s first truthy value, asked every `poll_s`, saying every PROGRESS_S what it waits for (and
    `report()`); None when `limit_s` passes first."""
    started = printed = time.monotonic()
    while not (value := condition()):
        now = time.monotonic()
        if now - started >= limit_s:
            return None
        if now - printed >= PROGRESS_S:
            said = f": {report()}" if report else ""
            print(f"  {now - started:5.0f} s waiting for {waiting_for}{said}", flush=True)
            printed = now
        time.sleep(poll_s)
    return value
