"""The DiT launcher's Group (h3serve/services/dit/supervisor.py) as a process of its own, logging and stopping as the
real launcher does, over 2 stand-in ranks that load no model: rank 0 serves gRPC health on the DiT's port, rank 1
sleeps. `python stand_in_dit_launcher.py PORT [anything else, ignored]`.

It serves no store: the stand-in ranks never dial one (the real store and rendezvous are tests/test_supervision.py's
real DiT)."""

from __future__ import annotations

import sys

from stand_ins import SLEEP, health_server

from h3serve.common import logs
from h3serve.common.config import DiTConfig
from h3serve.common.processes import StopSignals
from h3serve.services.dit.supervisor import Group


def rank(port: int) -> list[str]:
    """Rank 0 serves health on `port`, any other sleeps."""
    code = f"import os; exec({health_server(port)!r} if os.environ['RANK'] == '0' else {SLEEP!r})"
    return [sys.executable, "-c", code]


def stand_in_launcher(port: int) -> list[str]:
    """The command that starts this launcher, its rank 0 serving on `port`."""
    return [sys.executable, __file__, str(port)]


def main(port: int) -> int:
    stop = StopSignals()  # first, as the real launcher: a stop during the start is not lost
    logs.setup("dit")
    return Group(DiTConfig(world_size=2, port=port), rank(port), ("127.0.0.1", 0), stop).run()


if __name__ == "__main__":
    raise SystemExit(main(int(sys.argv[1])))
