"""[supervisor]: how `h3serve up` restarts and stops the services, and the machine `h3serve plan` checks the
deployment against."""

from __future__ import annotations

from pydantic import NonNegativeFloat, NonNegativeInt, PositiveFloat, ValidationInfo, field_validator

from h3serve.common.config.base import Section


class SupervisorConfig(Section):
    """[supervisor]: how `h3serve up` restarts a service that exits, and how long a stop may take."""

    max_restarts: NonNegativeInt = 5  # restarts of one service within window_s; the next exit stops `up` (exit 1)
    window_s: PositiveFloat = 300.0
    backoff_s: NonNegativeFloat = 1.0  # wait before the k-th restart within the window: backoff_s * 2^(k-1) ...
    max_backoff_s: NonNegativeFloat = 30.0  # ... at most this
    stop_grace_s: PositiveFloat = 30.0  # SIGTERM to SIGKILL; above the DiT launcher's own grace for its ranks
    # Start to SERVING, for every start and restart: a start past it is stopped and counts as an exit; [dit] warmup
    # shapes compile first (minutes each)
    start_timeout_s: PositiveFloat = 300.0
    # start the model processes (services, the DiT's ranks, every restart) as forks of one process that imported
    # torch, diffusers and transformers once (h3serve/common/forkserver.py): 10-12 s of CPU less per start, for about
    # 1 GiB of host memory that the children share
    fork_server: bool = True
    # the host's memory, GiB, that `h3serve plan` checks every process's private host memory against (less a reserve
    # for the OS); 0: the machine's MemTotal where the plan runs
    host_memory_gib: NonNegativeFloat = 0.0
    # each GPU's memory, GiB, that `h3serve plan` adds the processes on it up against (a card emulated on a bigger
    # one: its size); 0: the largest memory_limit_gib of the processes on that GPU
    gpu_memory_gib: NonNegativeFloat = 0.0

    @field_validator("max_backoff_s")
    @classmethod
    def _not_below_backoff(cls, limit: float, info: ValidationInfo) -> float:
        if "backoff_s" in info.data and limit < info.data["backoff_s"]:
            raise ValueError(f"must be at least backoff_s ({info.data['backoff_s']}), got {limit}")
        return limit
