"""`h3serve serve dit`: become the group's launcher, at once (this module imports neither torch nor diffusers).

On one node the launcher is h3serve's own (h3serve/services/dit/supervisor.py): it starts the ranks,
serves their store on the DiT's host only, and restarts the group when a rank exits. Over several
nodes it is torchrun (torch.distributed.run), which starts `world_size / nnodes` ranks on each node and
restarts them alike; its store listens on every interface, so the rendezvous port must be firewalled to
the nodes. Either restarts the group at most `max_restarts` times (each rank waits its back-off first,
h3serve/services/dit/rank.py). Errors that a restart cannot fix fail once, with the reason
(h3serve/services/dit/config_check.py says where they are checked).

Over several nodes the rendezvous is torchrun's static one, each node with its own node rank: the node that
owns the rendezvous address is node 0 (the store's host, and rank 0's: the gRPC server runs there), another node
takes $H3SERVE_DIT_NODE_RANK, or 1 of two nodes. torchrun's c10d rendezvous, run for real across two network
namespaces (tests/test_multinode.py), found no node to host its store (it asks whether the address is the
machine's hostname), and it orders nodes by hostname and pid, so rank 0 would land on any node; its restarts
for a node rejoining count on one node and not on the other, so the ranks' per-restart store keys would differ.
A group's ranks exit when it breaks (rank.py), so every node's torchrun restarts exactly once per break.
gloo listens on the address this host's name resolves to, which is loopback on many hosts (Debian's 127.0.1.1, or
these namespaces): unless GLOO_SOCKET_IFNAME is set, it is set to the interface that reaches the rendezvous host.
"""

from __future__ import annotations

import fcntl
import os
import socket
import struct
import sys

from h3serve.common.config import DiTConfig
from h3serve.common.processes import refuse
from h3serve.common.server import refuse_port_in_use

# Shared multi-GPU hosts: NVLink multicast off (docs/deploy/sharded-dit.md, "NCCL on a shared multi-GPU host").
NCCL_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
REFUSED_PREFIX = "h3serve serve dit: "  # a refused configuration's reason on stderr starts with it, whoever checked
GLOO_INTERFACE_ENV = "GLOO_SOCKET_IFNAME"
SIOCGIFADDR = 0x8915  # Linux: an interface's IPv4 address
NODE_RANK_ENV = "H3SERVE_DIT_NODE_RANK"  # a node's rank in a group of several nodes (node 0 is found by address)


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
        f"--node-rank={node_rank(config)}",
        "--rdzv-backend=static",
        f"--rdzv-endpoint={config.rdzv_endpoint}",
        f"--rdzv-id={config.rdzv_id}",
        "-m",
        "h3serve.services.dit.rank",
        encode_config(config),
    ]


def node_rank(config: DiTConfig) -> int:
    """This node's rank: $H3SERVE_DIT_NODE_RANK when set; else 0 on the node that owns the rendezvous address, 1 on
    the other of two nodes. Raises ValueError where neither tells (more than two nodes)."""
    named = os.environ.get(NODE_RANK_ENV, "").strip()
    if named:
        if not named.isdigit() or int(named) >= config.nnodes:
            raise ValueError(f"{NODE_RANK_ENV}={named!r}: a node rank is 0 to nnodes - 1 ({config.nnodes - 1})")
        return int(named)
    if owns_address(rendezvous_host(config)):
        return 0
    if config.nnodes == 2:
        return 1
    raise ValueError(
        f"nnodes = {config.nnodes}: set {NODE_RANK_ENV} (1 to {config.nnodes - 1}) on every node but the one that "
        f"owns the rendezvous address {config.rdzv_endpoint}"
    )


def rendezvous_host(config: DiTConfig) -> str:
    return config.rdzv_endpoint.rsplit(":", 1)[0].strip("[]")


def owns_address(host: str) -> bool:
    """Whether `host` names an address of this node: a socket binds only to an address of its own."""
    try:
        found = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)
    except socket.gaierror:
        return False
    for family, kind, _, _, address in found:
        with socket.socket(family, kind) as probe:
            try:
                probe.bind((address[0], 0))
            except OSError:
                continue
            return True
    return False


def interface_to(host: str) -> str | None:
    """The name of the interface this node reaches `host` through (IPv4), or None where it cannot tell."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((host, 9))  # a UDP connect sends nothing: it only picks the route and its source address
            source = probe.getsockname()[0]
    except OSError:
        return None
    for _, name in socket.if_nameindex():
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            try:
                found = fcntl.ioctl(probe.fileno(), SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
            except OSError:  # no IPv4 address on it
                continue
        if socket.inet_ntoa(found[20:24]) == source:
            return name
    return None


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
    interface = interface_to(rendezvous_host(config)) if config.nnodes > 1 else None
    if interface:
        os.environ.setdefault(GLOO_INTERFACE_ENV, interface)
    try:
        argv = launcher_argv(config)
    except ValueError as exc:  # no node rank for this node
        refuse(f"{REFUSED_PREFIX}{exc}")
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(argv[0], argv)
