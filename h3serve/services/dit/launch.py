"""`h3serve serve dit`: become the group's launcher, at once (this module imports neither torch nor diffusers).

On one node the launcher is h3serve's own (h3serve/services/dit/supervisor.py): it starts the ranks,
serves their store on the DiT's host only, and restarts the group when a rank exits. Over several
nodes it is torchrun (torch.distributed.run) with a c10d rendezvous, which starts `world_size / nnodes`
ranks on each node and restarts them alike; its store listens on every interface, so the rendezvous
port must be firewalled to the nodes. Either restarts the group at most `max_restarts` times (each rank
waits its back-off first, h3serve/services/dit/rank.py). Errors that a restart cannot fix fail once, with the
reason (h3serve/services/dit/config_check.py says where they are checked).
"""

from __future__ import annotations

import os
import sys

from h3serve.common.config import DiTConfig
from h3serve.common.processes import refuse
from h3serve.common.server import refuse_port_in_use

# Shared multi-GPU hosts: NVLink multicast off (docs/deploy/sharded-dit.md, "NCCL on a shared multi-GPU host").
NCCL_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
REFUSED_PREFIX = "h3serve serve dit: "  # a refused configuration's reason on stderr starts with it, whoever checked


def launcher_argv(config: DiTConfig) -> list[str]:
    """h3serve's launcher on one node, torchrun over several."""
    if config.nnodes == 1:
        return [sys.executable, "-m", "h3serve.services.dit.supervisor", encode_config(config)]
    return torchrun_argv(config)


def torchrun_argv(config: DiTConfig) -> list[str]:
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc-per-node={config.world_size // config.nnodes}",
        f"--max-restarts={config.max_restarts}",
        f"--nnodes={config.nnodes}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint={config.rdzv_endpoint}",
        f"--rdzv-id={config.rdzv_id}",
        "-m",
        "h3serve.services.dit.rank",
        encode_config(config),
    ]


def encode_config(config: DiTConfig) -> str:
    """The resolved config as one JSON argument for every rank (checked again when a rank reads it)."""
    return config.model_dump_json()


def decode_config(text: str) -> DiTConfig:
    return DiTConfig.model_validate_json(text)


def serve(config: DiTConfig) -> None:
    """Replace this process with the group's launcher, so signals reach it directly. torchrun restarts whatever
    exits, so over several nodes the configuration is checked here first (rank 0 checks it on one node)."""
    if config.nnodes > 1:
        from h3serve.services.dit import config_check  # torch and diffusers: only where torchrun follows

        try:
            config_check.check(config)
        except config_check.REFUSALS as exc:
            refuse(f"{REFUSED_PREFIX}{exc}")  # EXIT_REFUSED: `up` does not start it again
    refuse_port_in_use(config.address)  # before the ranks load for minutes: a restart would not free the port
    for key, value in NCCL_ENV.items():
        os.environ.setdefault(key, value)
    argv = launcher_argv(config)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(argv[0], argv)
