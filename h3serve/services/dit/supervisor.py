"""The DiT group's launcher on one node (`h3serve serve dit` with nnodes = 1): the store, the ranks, their restarts.

launch.py execs this module at once (rank 0 checks the configuration). It serves the group's TCPStore on a socket
it bound itself to the DiT's host: torch's own store server listens on every interface whatever host it is given.
The ranks get torchrun's environment (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT,
TORCHELASTIC_RESTART_COUNT, TORCHELASTIC_USE_AGENT_STORE), so one rank code (rank.py) runs under both launchers, as
clients of the launcher's store with keys private to each restart.

When a rank exits, the others are stopped (SIGTERM, STOP_GRACE_S, SIGKILL) and the group starts again, at most
`max_restarts` times, then this process exits 1 with the reason. A rank that refused the configuration
(EXIT_REFUSED, its reason on stderr) is not restarted: this process exits 1 at once. Each rank waits its restart
back-off itself after rank 0 has opened its port, so clients meanwhile read "restarting" instead of finding a closed
port. SIGTERM, SIGINT or SIGHUP stops every rank, also one started during the stop, and exits 0. A rank gets SIGKILL
when this process dies (parent-death signal): a group whose launcher is gone cannot restart, and its GPU memory
must come back.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import time
from datetime import timedelta

from h3serve.common import logs, processes
from h3serve.common.config import DiTConfig
from h3serve.common.processes import StopSignals, Tree, describe_exit, end_trees

log = logging.getLogger("h3serve.dit.supervisor")
STOP_GRACE_S = 15.0  # a rank stops within seconds (rank.py); `up`'s stop_grace_s gives this process more
WILDCARDS = {"": "127.0.0.1", "0.0.0.0": "127.0.0.1", "::": "::1"}


def store_host(host: str) -> str:
    """Where the store listens and the ranks dial: the DiT's host, or loopback for a wildcard (the ranks are local)."""
    return WILDCARDS.get(host, host)


def listen(host: str) -> socket.socket:
    """The store's listening socket, bound to `host` (a free port). It takes the ranks' connections from the moment
    they start; the store (open_store) answers them once torch has loaded here."""
    family, _, _, _, address = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)[0]
    return socket.create_server(address, family=family)


def open_store(listener: socket.socket, host: str, timeout_s: float):
    """The group's store on `listener`, which it owns from here."""
    import torch.distributed as dist  # imported here: the ranks and the stop signals do not wait for torch

    return dist.TCPStore(host, listener.getsockname()[1], is_master=True, wait_for_workers=False,
                         timeout=timedelta(seconds=timeout_s), master_listen_fd=listener.detach())


def rank_env(config: DiTConfig, rank: int, restart: int, master: tuple[str, int]) -> dict[str, str]:
    env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(config.world_size),
           "LOCAL_WORLD_SIZE": str(config.world_size), "MASTER_ADDR": master[0], "MASTER_PORT": str(master[1]),
           "TORCHELASTIC_RESTART_COUNT": str(restart), "TORCHELASTIC_USE_AGENT_STORE": "True"}
    if config.world_size > 1:
        env.setdefault("OMP_NUM_THREADS", "1")  # as torchrun: ranks sharing the cores do not each take them all
    return env


def start_ranks(config: DiTConfig, argv: list[str], restart: int, master: tuple[str, int],
                stop: StopSignals) -> list[subprocess.Popen]:
    """Every rank of one start, unless a stop comes first (what was started is then stopped by the caller)."""
    ranks = []
    for rank in range(config.world_size):
        if stop:
            break
        ranks.append(processes.spawn(argv, death_signal=signal.SIGKILL, env=rank_env(config, rank, restart, master)))
    return ranks


def first_exits(ranks: list[subprocess.Popen], stop: StopSignals) -> list[str]:
    """Once a rank has exited, how each exited rank ended; [] when a stop comes first."""
    while not stop:
        ended = [f"rank {rank} (pid {p.pid}) {describe_exit(p.returncode)}"
                 for rank, p in enumerate(ranks) if p.poll() is not None]
        if ended:
            return ended
        time.sleep(processes.POLL_S)
    return []


def stop_ranks(ranks: list[subprocess.Popen]) -> None:
    """SIGTERM to every rank still running, STOP_GRACE_S for them and what they started, then SIGKILL."""
    trees = [Tree(rank, leads_group=False) for rank in ranks]
    for rank in ranks:
        if rank.poll() is None:
            rank.send_signal(signal.SIGTERM)
    end_trees(trees, time.monotonic() + STOP_GRACE_S)


def supervise(encoded: str) -> int:
    """Run the group until a stop signal (0) or a failure past `max_restarts` (1). `encoded`: the DiTConfig as
    launch.py passes it, handed on to every rank unchanged."""
    stop = StopSignals()
    logs.setup("dit")
    config = DiTConfig.model_validate_json(encoded)
    argv = [sys.executable, "-m", "h3serve.services.dit.rank", encoded]
    host = store_host(config.host)
    listener = listen(host)
    port, store = listener.getsockname()[1], None
    restart = 0
    while True:
        log.info("starting the DiT group: %d rank(s), store on %s:%d%s", config.world_size, host, port,
                 f" (restart {restart} of {config.max_restarts})" if restart else "")
        ranks = start_ranks(config, argv, restart, (host, port), stop)
        store = store or open_store(listener, host, config.collective_timeout_s)  # while the ranks import torch
        ended = first_exits(ranks, stop)
        if ended:
            log.warning("DiT group: %s; stopping the other ranks", "; ".join(ended))
        else:
            log.info("signal %s: stopping the DiT group's %d rank(s)", signal.Signals(stop.signum).name, len(ranks))
        stop_ranks(ranks)
        if stop:
            return 0
        if any(rank.returncode == processes.EXIT_REFUSED for rank in ranks):
            log.error("the DiT's configuration was refused (the reason is above): the DiT service exits")
            return 1
        if restart == config.max_restarts:
            log.error("DiT group failed with no restart left (max_restarts = %d): the DiT service exits",
                      config.max_restarts)
            return 1
        restart += 1


def main(argv: list[str] | None = None) -> None:
    raise SystemExit(supervise((sys.argv[1:] if argv is None else argv)[0]))


if __name__ == "__main__":
    main()
