"""Commands and distributed ranks run as forks of the tests' fork server: the model's imports already done."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time

from h3serve.common import forkserver
from h3serve.common.free_ports import free_port


def run_forked(
    server: forkserver.ForkServer, argv: list[str], timeout_s: float = 240, check: bool = True
) -> subprocess.CompletedProcess:
    """`subprocess.run(argv, capture_output=True, text=True)` for `python -m MODULE ...`, as a fork of `server`: the
    model's imports done (a fresh interpreter's `h3serve reference` or `serve dit` spends 10 CPU seconds on them)."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        child = forkserver.start(argv, server, stdout=out, stderr=err)
        try:
            code = child.wait(timeout_s)
        finally:
            child.kill()
        out.seek(0), err.seek(0)
        done = subprocess.CompletedProcess(argv, code, out.read().decode(), err.read().decode())
    if check:
        done.check_returncode()
    return done


def run_ranks(server: forkserver.ForkServer, module: str, args: list[str], world_size: int = 2, timeout_s=420) -> None:
    """`python -m module args` as `world_size` ranks of a standalone group on this host, forks of `server` with
    torchrun's environment, as h3serve's own DiT launcher starts its ranks: torchrun's agent and each rank's imports
    cost 16 CPU seconds a launch. As under torchrun the store is served outside the ranks (here, by this process). A
    rank that fails stops the others, as torchrun. Not for a rank that measures its own host memory: test_sharded_load's
    forked rank 0 measured 48-50 MiB above its shard and block in two full suites (13 MiB alone), over its margin."""
    from torch.distributed import TCPStore

    port = free_port()
    _store = TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)  # served while this call runs
    env = {
        **os.environ,
        "WORLD_SIZE": str(world_size),
        "LOCAL_WORLD_SIZE": str(world_size),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "TORCHELASTIC_USE_AGENT_STORE": "True",  # the ranks are the store's clients
        "OMP_NUM_THREADS": "1",
    }
    ranks = [
        forkserver.start(
            [sys.executable, "-m", module, *args],
            server,
            death_signal=signal.SIGKILL,
            env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)},
        )
        for rank in range(world_size)
    ]
    deadline = time.monotonic() + timeout_s
    try:
        while (codes := [rank.poll() for rank in ranks]).count(0) < world_size:
            failed = [(rank, code) for rank, code in enumerate(codes) if code not in (None, 0)]
            assert not failed, f"{module}: rank(s) failed (rank, exit code): {failed}"
            assert time.monotonic() < deadline, f"{module}: the ranks did not finish in {timeout_s} s"
            time.sleep(0.2)
    finally:
        for rank in ranks:
            rank.kill()
