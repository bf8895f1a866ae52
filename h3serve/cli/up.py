"""`h3serve up`: start the encoder, DiT, VAE and gateway of a deployment, watch them, stop them all on Ctrl-C or
when one cannot be brought back."""

from __future__ import annotations

import os
import sys
import tempfile

from h3serve.common.ceilings import require_holding
from h3serve.common.config import load_deploy


def _run(args) -> None:
    from h3serve.cli.launcher import ServiceGroup
    from h3serve.cli.supervise import Watch
    from h3serve.common.processes import StopSignals
    from h3serve.common.supervision import STATE_FILE

    config = load_deploy(args.config)
    require_holding(config, args.config)  # a deployment whose cards hold not even the smallest clip never starts
    stop = StopSignals()  # SIGINT, SIGTERM, SIGHUP: the services have sessions of their own, so stop them here
    # The watch's state file, for the gateway: in a directory of this `up`'s own, so no other stack (one sharing the
    # log dir or the data_dir, refused or not) can overwrite it; it goes when `up` ends.
    state_dir = tempfile.TemporaryDirectory(prefix="h3serve-up-")
    group = ServiceGroup(config, args.config, args.log_dir, supervisor_state=os.path.join(state_dir.name, STATE_FILE))
    try:
        group.start()
        reason = Watch(group, stop).run(
            lambda: print(
                f"h3serve up: gateway on {config.gateway.host}:{config.gateway.port}; Ctrl-C stops everything",
                flush=True,
            )
        )
        print(
            f"h3serve up: {reason}; stopping everything" if reason else "stopping",
            flush=True,
            file=sys.stderr if reason else sys.stdout,
        )
    finally:
        group.stop()
        state_dir.cleanup()
    if reason:
        raise SystemExit(1)


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("up", help="start encoder, dit, vae and gateway; Ctrl-C stops them")
    p.add_argument("--config")
    p.add_argument("--log-dir", help="write each service's log here instead of the terminal (created if missing)")
    p.set_defaults(run=_run)
