"""Stand-in children for the supervisors' own tests: small `python -c` scripts that load no model, run under the real
supervisors (`h3serve up`'s Watch, the DiT launcher's Group), as real processes on loopback ports."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
from collections import Counter
from pathlib import Path

from h3serve.cli.launcher import ServiceGroup
from h3serve.common.config import DeployConfig, load_deploy
from h3serve.common.processes import StopSignals, children
from h3serve.common.server import is_serving

SELF_KILL = "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"
REFUSE = "import sys; print('refused: a stand-in reason', file=sys.stderr); sys.exit(78)"
SLEEP = "import time; time.sleep(600)"


def health_server(port: int) -> str:
    """A child that serves gRPC health (SERVING) on `port` until it is killed. It holds on to its server: one that is
    collected stops serving."""
    return (
        "import threading; from h3serve.common.server import start_server; "
        f"server = start_server(lambda s: None, [], '127.0.0.1:{port}'); threading.Event().wait()"
    )


def counted(path: Path, code: str) -> list[str]:
    """`code` as a child that first appends a line to `path` (one line per start)."""
    return [sys.executable, "-c", f"open({str(path)!r}, 'a').write('start\\n'); {code}"]


def starts(path: Path) -> int:
    return len(path.read_text().splitlines()) if path.exists() else 0


def meminfo(path: Path, total_gib: float, available_gib: float) -> str:
    """A stand-in /proc/meminfo with these figures."""
    kib = 1 << 20
    path.write_text(
        f"MemTotal:       {int(total_gib * kib)} kB\nMemFree:        1 kB\n"
        f"MemAvailable:   {int(available_gib * kib)} kB\nBuffers:        0 kB\n"
    )
    return str(path)


def no_signals() -> StopSignals:
    """A stop that only comes when a test asks (no handler replaces pytest's)."""
    return StopSignals(signals=())


def deployment(root: Path, port: int, **supervisor) -> DeployConfig:
    keys = {"backoff_s": 0.05, "max_backoff_s": 0.1, "stop_grace_s": 5.0, **supervisor}
    path = root / "deploy.toml"
    path.write_text(f"[vae]\nport = {port}\n\n[supervisor]\n" + "".join(f"{k} = {v}\n" for k, v in keys.items()))
    return load_deploy(str(path))


class StandIns(ServiceGroup):
    """`h3serve up`'s services, each started by the given command instead of `h3serve serve <name>`."""

    def __init__(self, config: DeployConfig, commands: dict[str, list[str]], ready=is_serving) -> None:
        super().__init__(config, None, names=tuple(commands), ready=ready)
        self.commands = commands
        self.starts: Counter[str] = Counter()

    def _command(self, name: str) -> list[str]:
        self.starts[name] += 1
        return self.commands[name]


def kill_on_serving(probe):
    """A readiness probe that SIGKILLs what it found serving, right after finding it so: a child that died after
    it had reached SERVING. `probe(*args)` is the real probe; the kill goes to the test's children that serve."""

    def ready(*args, **kwargs) -> bool:
        if not probe(*args, **kwargs):
            return False
        for pid in children(os.getpid()):
            with contextlib.suppress(OSError):  # another child may end meanwhile
                if b"start_server" in Path(f"/proc/{pid}/cmdline").read_bytes():
                    os.kill(pid, signal.SIGKILL)
        return True

    return ready
