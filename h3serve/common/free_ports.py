"""Loopback ports for the stacks the tests and benches start on one machine: each handed out once per process.

The kernel's bind(0) can hand out a port as free that another caller has just been given too and not yet bound (the
likeliest cause of CI's shared stack once losing its gateway at start). So ports come from a block below the
kernel's ephemeral range (32768-60999 by default), one block per pytest-xdist worker, walked from a point of this
process's own; a port is handed out once, and only while nothing holds it.
"""

from __future__ import annotations

import os
import socket

PORTS = range(20000, 32768)
_handed_out: set[int] = set()


def _port_block() -> range:
    """This process's block: the whole range, or a pytest-xdist worker's share of it."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    worker = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw"))
    size = len(PORTS) // workers
    return range(PORTS.start + worker * size, PORTS.start + (worker + 1) * size)


def free_port() -> int:
    """A loopback port nothing listens on that no earlier call of this process handed out."""
    block = _port_block()
    start = os.getpid() * 7919 % len(block)  # a prime stride: processes of one worker start apart
    for step in range(len(block)):
        port = block[(start + step) % len(block)]
        if port in _handed_out:
            continue
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                continue
        _handed_out.add(port)
        return port
    raise RuntimeError(f"no free port left in {block}")
