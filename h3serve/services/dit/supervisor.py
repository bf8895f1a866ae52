"""The DiT group's launcher on one node (`h3serve serve dit` with nnodes = 1): the store, the ranks, their restarts.

launch.py execs this module at once (rank 0 checks the configuration). It serves the group's TCPStore on a socket
it bound itself to the DiT's host: torch's own store server listens on every interface whatever host it is given.
A group of one rank meets nobody: that rank keeps its store in its own memory (parallel.attempt_store), and this
process serves none, so it never imports torch (seconds of CPU and hundreds of MiB resident at every start).
The ranks get torchrun's environment (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT,
TORCHELASTIC_RESTART_COUNT, TORCHELASTIC_USE_AGENT_STORE), so one rank code (rank.py) runs under both launchers, as
clients of the launcher's store with keys private to each restart.

When a rank exits, the others are stopped (SIGTERM, STOP_GRACE_S, SIGKILL) and the group starts again, at most
`max_restarts` times, then this process exits 1 with the reason. A rank that refused the configuration or its port
(EXIT_REFUSED, its reason on stderr) is not restarted: this process exits EXIT_REFUSED at once, so `h3serve up` does
not restart it either. The same start-up failure twice in a row (the same exit status or signal and reason class of
the ranks that ended first, before rank 0 ever served) stops the restarts too: this process exits 1. A rank's SIGKILL
with the host near its memory limit at the last sample is logged as the OOM killer's (common/processes.py,
MemoryWatch). Each rank waits its restart back-off itself after rank 0 has opened its port, so clients meanwhile read
"restarting" instead of finding a closed port. SIGTERM, SIGINT or SIGHUP stops every rank, also one started during
the stop, and exits 0. A rank gets SIGKILL when this process dies (parent-death signal): a group whose launcher is
gone cannot restart, and its GPU memory must come back.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING

from h3serve.common import forkserver, logs, processes
from h3serve.common.config import DiTConfig
from h3serve.common.forkserver import ForkServer
from h3serve.common.processes import MEMINFO, Child, Ending, MemoryWatch, RepeatedFailure, StopSignals, Tree, end_trees

if TYPE_CHECKING:
    from torch.distributed import TCPStore

log = logging.getLogger("h3serve.dit.supervisor")
STOP_GRACE_S = 15.0  # a rank stops within seconds (rank.py); `up`'s stop_grace_s gives this process more
PROBE_S = 1.0  # how often rank 0's health is asked until it serves (whether a death was a start-up failure)
WILDCARDS = {"": "127.0.0.1", "0.0.0.0": "127.0.0.1", "::": "::1"}


def store_host(host: str) -> str:
    """Where the store listens and the ranks dial: the DiT's host, or loopback for a wildcard (the ranks are local)."""
    return WILDCARDS.get(host, host)


def listen(host: str) -> socket.socket:
    """The store's listening socket, bound to `host` (a free port). It takes the ranks' connections from the moment
    they start; the store (open_store) answers them once torch has loaded here."""
    family, _, _, _, address = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)[0]
    return socket.create_server(address, family=family)


def open_store(listener: socket.socket, host: str, timeout_s: float) -> TCPStore:
    """The group's store on `listener`, which it owns from here."""
    import torch.distributed as dist  # imported here: the ranks and the stop signals do not wait for torch

    return dist.TCPStore(
        host,
        listener.getsockname()[1],
        is_master=True,
        wait_for_workers=False,
        timeout=timedelta(seconds=timeout_s),
        master_listen_fd=listener.detach(),
    )


LAST_EXIT_ENV = "H3SERVE_DIT_LAST_EXIT"  # how the start before this one ended: rank 0 reports it in DiTInfo.state


def rank_env(
    config: DiTConfig, rank: int, restart: int, master: tuple[str, int] | None, last_exit: str = ""
) -> dict[str, str]:
    """torchrun's environment for `rank`; `master`: where this process serves the store (None: one rank, no store)."""
    env = {
        **os.environ,
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "WORLD_SIZE": str(config.world_size),
        "LOCAL_WORLD_SIZE": str(config.world_size),
        "TORCHELASTIC_RESTART_COUNT": str(restart),
        LAST_EXIT_ENV: last_exit,
    }
    if master is not None:
        env |= {"MASTER_ADDR": master[0], "MASTER_PORT": str(master[1]), "TORCHELASTIC_USE_AGENT_STORE": "True"}
    if config.world_size > 1:
        env.setdefault("OMP_NUM_THREADS", "1")  # as torchrun: ranks sharing the cores do not each take them all
    return env


def start_ranks(
    config: DiTConfig,
    argv: list[str],
    restart: int,
    master: tuple[str, int] | None,
    stop: StopSignals,
    last_exit: str = "",
) -> list[Child]:
    """Every rank of one start, unless a stop comes first (what was started is then stopped by the caller): forks of
    the fork server that `h3serve up` named, if any."""
    server = ForkServer.from_env()
    ranks: list[Child] = []
    for rank in range(config.world_size):
        if stop:
            break
        env = rank_env(config, rank, restart, master, last_exit)
        ranks.append(forkserver.start(argv, server, death_signal=signal.SIGKILL, env=env))
    return ranks


def stop_ranks(ranks: list[Child]) -> None:
    """SIGTERM to every rank still running, STOP_GRACE_S for them and what they started, then SIGKILL."""
    trees = [Tree(rank, leads_group=False) for rank in ranks]
    for rank in ranks:
        if rank.poll() is None:
            rank.send_signal(signal.SIGTERM)
    end_trees(trees, time.monotonic() + STOP_GRACE_S)


def rank0_serving(config: DiTConfig) -> Callable[[], bool]:
    """Whether rank 0 says SERVING (the group is whole and warm); probed as `h3serve up` probes the service."""
    host = store_host(config.host)
    address = f"[{host}]:{config.port}" if ":" in host else f"{host}:{config.port}"
    root_pem = Path(config.tls_cert).read_bytes() if config.tls_cert else None

    def serving() -> bool:
        from h3serve.common.server import is_serving  # grpc: imported once the ranks have started

        return is_serving(address, root_pem=root_pem)

    return serving


class Group:
    """The ranks' starts on one node: how each start ended, and whether to start again."""

    def __init__(
        self,
        config: DiTConfig,
        argv: list[str],
        master: tuple[str, int] | None,
        stop: StopSignals,
        ready: Callable[[], bool] | None = None,
        meminfo: str = MEMINFO,
    ) -> None:
        self.config, self.argv, self.master, self.stop = config, argv, master, stop
        self.ready = ready or rank0_serving(config)
        self.memory = MemoryWatch(meminfo)
        self.failures = RepeatedFailure()
        self.served = False  # the current start has reached SERVING
        self.last_exit = ""  # how the last start ended: logged, and in the next start's DiTInfo.state

    def run(self, on_started: Callable[[], None] = lambda: None) -> int:
        """Start the group until a stop signal (0), a refusal (EXIT_REFUSED) or a failure it must not retry (1).
        `on_started` runs after each start's ranks were spawned."""
        restart = 0
        while True:
            log.info(
                "starting the DiT group: %d rank(s), store %s%s",
                self.config.world_size,
                "in the rank's memory" if self.master is None else f"on {self.master[0]}:{self.master[1]}",
                f" (restart {restart} of {self.config.max_restarts})" if restart else "",
            )
            ranks = start_ranks(self.config, self.argv, restart, self.master, self.stop, self.last_exit)
            self.memory.sample_host()
            on_started()
            ended = self.first_exits(ranks)
            if ended:
                self.last_exit = "; ".join(f"rank {rank} (pid {ranks[rank].pid}) {e.text}" for rank, e in ended)
                log.warning("DiT group: %s; stopping the other ranks", self.last_exit)
            else:
                signum = self.stop.signum
                assert signum is not None  # first_exits saw no exit: a stop came first
                log.info("signal %s: stopping the DiT group's %d rank(s)", signal.Signals(signum).name, len(ranks))
            stop_ranks(ranks)
            if self.stop:
                return 0
            code = self.verdict(ranks, ended, restart)
            if code is not None:
                return code
            restart += 1

    def first_exits(self, ranks: list[Child]) -> list[tuple[int, Ending]]:
        """Once a rank has exited, (rank, how it ended) for each exited rank; [] when a stop comes first. Meanwhile
        the ranks' memory is sampled, and rank 0's health until it serves."""
        self.served, probe_at = False, 0.0
        while not self.stop:
            ended = [
                (rank, self.memory.ending(p.pid, code, self.served))
                for rank, p in enumerate(ranks)
                if (code := p.poll()) is not None
            ]
            if ended:
                return ended
            self.memory.sample(p.pid for p in ranks)
            if not self.served and time.monotonic() >= probe_at:
                self.served, probe_at = self.ready(), time.monotonic() + PROBE_S
            time.sleep(processes.POLL_S)
        return []

    def verdict(self, ranks: list[Child], ended: list[tuple[int, Ending]], restart: int) -> int | None:
        """This process's exit code when the group must not start again; None to restart it."""
        if any(rank.returncode == processes.EXIT_REFUSED for rank in ranks):
            log.error(
                "the DiT's configuration was refused (the reason is above: a setting, or its port in use): "
                "the DiT service exits"
            )
            return processes.EXIT_REFUSED
        start_up_failure = any(ending.start_up_failure for _, ending in ended)
        if self.failures.repeats(frozenset(ending.kind for _, ending in ended), start_up_failure):
            log.error("stopped restarting: the same start-up failure twice: %s: the DiT service exits", self.last_exit)
            return 1
        if restart == self.config.max_restarts:
            log.error(
                "DiT group failed with no restart left (max_restarts = %d): the DiT service exits",
                self.config.max_restarts,
            )
            return 1
        return None


def supervise(encoded: str) -> int:
    """Run the group until a stop signal (0), a refusal (EXIT_REFUSED) or a failure it must not retry (1).
    `encoded`: the DiTConfig as launch.py passes it, handed on to every rank unchanged."""
    stop = StopSignals()
    logs.setup("dit")
    config = DiTConfig.model_validate_json(encoded)
    argv = [sys.executable, "-m", "h3serve.services.dit.rank", encoded]
    if config.world_size == 1:
        return Group(config, argv, None, stop).run()
    host = store_host(config.host)
    listener = listen(host)
    master = (host, listener.getsockname()[1])
    store: list[TCPStore] = []

    def open_store_once() -> None:  # after the first start's spawn: while the ranks import torch
        if not store:
            store.append(open_store(listener, host, config.collective_timeout_s))

    return Group(config, argv, master, stop).run(open_store_once)


def main(argv: list[str] | None = None) -> None:
    raise SystemExit(supervise((sys.argv[1:] if argv is None else argv)[0]))


if __name__ == "__main__":
    main()
