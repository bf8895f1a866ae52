"""What `h3serve up` says about its services, for the gateway: a small JSON file its watch (h3serve/cli/supervise.py)
rewrites whenever a service's state changes, and that the gateway reads when a stage has been out past its outage
limit (h3serve/gateway/stages/calls.py), to keep a job waiting while `up` is bringing the stage's service back.

`up` passes the file's path to the gateway in STATE_ENV. A service is STARTING (its process runs and has not reached
SERVING yet: a first start or a restart, which has [supervisor] start_timeout_s to get there), SERVING, RESTART_DUE
(its process ended; it starts again at `due`) or GIVEN_UP (`up` stops everything, for `reason`). The file names its
writer by pid and process start time, so a reader tells a live supervisor's file from one a dead `up` left behind,
even where the pid was reused since. Each write replaces the file whole (a temporary file in the same directory, then
os.replace), so a reader never sees half of one.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from dataclasses import asdict, dataclass

from h3serve.common.processes import Proc

STATE_ENV = "H3SERVE_SUPERVISOR_STATE"
STATE_FILE = "supervisor.json"
STARTING, SERVING, RESTART_DUE, GIVEN_UP = "starting", "serving", "restart_due", "given_up"


@dataclass(frozen=True)
class ServiceState:
    state: str  # STARTING, SERVING, RESTART_DUE or GIVEN_UP
    since: float  # unix seconds: when it entered this state (STARTING: when its process started)
    pid: int = 0  # STARTING, SERVING: the service's process
    restart: bool = False  # STARTING, SERVING: the process is a restart, not the first start
    due: float = 0.0  # RESTART_DUE: unix seconds, when it starts again
    reason: str = ""  # RESTART_DUE: how its last process ended; GIVEN_UP: why `up` stops

    @property
    def coming_back(self) -> bool:
        """`up` is bringing the service (back) to SERVING: its process is starting, or a restart is due."""
        return self.state in (STARTING, RESTART_DUE)

    def left_s(self, start_timeout_s: float) -> float:
        """Coming back: the most seconds from now until it serves or its start is given up."""
        if self.state == RESTART_DUE:
            return max(0.0, self.due - time.time()) + start_timeout_s
        return max(0.0, self.since + start_timeout_s - time.time())

    def describe(self, name: str, start_timeout_s: float) -> str:
        """Coming back: one line for a person waiting on service `name`."""
        doing = "restarting" if self.restart or self.state == RESTART_DUE else "starting"
        if self.state == RESTART_DUE:
            return f"{name} is {doing} under h3serve up: {self.reason}; it starts again in {self.left_s(0.0):.0f} s"
        return (
            f"{name} is {doing} under h3serve up: started {time.time() - self.since:.0f} s ago (pid {self.pid}), "
            f"it has {start_timeout_s:g} s to serve ([supervisor] start_timeout_s)"
        )


@dataclass(frozen=True)
class SupervisorState:
    writer: Proc  # the `up` process that wrote it
    start_timeout_s: float
    services: dict[str, ServiceState]

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)

    @classmethod
    def from_json(cls, text: str) -> SupervisorState:
        raw = json.loads(text)
        return cls(
            Proc(**raw["writer"]),
            float(raw["start_timeout_s"]),
            {name: ServiceState(**state) for name, state in raw["services"].items()},
        )


def write_atomically(path: str, text: str) -> None:
    """Replace `path` with `text` whole: a reader sees the old file or the new one."""
    directory, name = os.path.split(path)
    with tempfile.NamedTemporaryFile("w", dir=directory or ".", prefix=f".{name}.", delete=False) as file:
        file.write(text)
    os.replace(file.name, path)


class StateWriter:
    """`up`'s side: each service's state, the file at `path` rewritten whenever one changes (no path: kept only
    here, as for a ServiceGroup whose gateway is not told)."""

    def __init__(self, path: str | None, start_timeout_s: float) -> None:
        self.path, self.start_timeout_s = path, start_timeout_s
        self.writer = Proc.of(os.getpid()) or Proc(os.getpid(), "")  # no /proc: readers take it for a dead writer
        self.services: dict[str, ServiceState] = {}

    def set(self, name: str, state: ServiceState) -> None:
        self.services[name] = state
        if self.path:
            write_atomically(self.path, SupervisorState(self.writer, self.start_timeout_s, self.services).to_json())


def read_live(path: str) -> SupervisorState | None:
    """What a live supervisor said at `path`; None when there is no file, it does not parse, or its writer has ended."""
    try:
        with open(path) as file:
            state = SupervisorState.from_json(file.read())
    except (OSError, ValueError, TypeError, KeyError):
        return None
    return state if state.writer.alive() else None
