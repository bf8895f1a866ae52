"""`h3serve demo`: start everything with the tiny model on CPU, generate one MP4 with sound, stop everything."""

from __future__ import annotations

import signal
import tempfile
import time
from pathlib import Path

from h3serve.cli.generate import generate, print_timings
from h3serve.cli.request_flags import add_request_args, request
from h3serve.common.config import load_deploy


def _run(args) -> None:
    """The gateway keeps its jobs in a fresh directory, so the demo neither shows nor leaves jobs in `up`'s
    data_dir."""
    from h3serve.cli.launcher import ServiceGroup

    for signum in (signal.SIGTERM, signal.SIGHUP):  # like Ctrl-C: the group stops its services, gateway first
        signal.signal(signum, signal.default_int_handler)
    work = Path(tempfile.mkdtemp(prefix="h3serve-demo-"))
    log_dir, data_dir = work / "logs", work / "gateway"
    config = load_deploy(args.config)
    started = time.perf_counter()
    with ServiceGroup(config, args.config, str(log_dir), flags={"gateway": ["--data-dir", str(data_dir)]}):
        print(
            f"services healthy in {time.perf_counter() - started:.1f} s (logs in {log_dir}, "
            f"jobs in {data_dir}: a fresh data directory for this demo)",
            flush=True,
        )
        out = Path(args.out or "out")
        out.mkdir(parents=True, exist_ok=True)
        job, path = generate(f"127.0.0.1:{config.gateway.port}", request(args), out, None)
    print_timings(job, path)


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("demo", help="up + one generation with the tiny model + stop")
    p.add_argument("--config")
    add_request_args(p, steps=8, height=64, width=128)
    p.set_defaults(run=_run)
