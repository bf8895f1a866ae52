"""gRPC server bootstrap shared by every h3serve process.

Unlimited message sizes (tensors are chunked anyway, but a client's limits must not bite),
the standard health service, server reflection, a graceful stop on SIGTERM/SIGINT, and the
guard around every call (h3serve/common/guard.py: undecodable requests, the stage token, bugs).
Every server owns its port alone: gRPC's default SO_REUSEPORT would let a second `h3serve up` on
the same configuration bind it too, and the kernel would split the connections between them.
"""

from __future__ import annotations

import logging
import signal
import threading
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from h3serve.common.guard import Guard
from h3serve.common.processes import port_holders, refuse

EXCLUSIVE_PORT = ("grpc.so_reuseport", 0)  # in every server's options: a port in use fails the bind
GRPC_OPTIONS = [
    ("grpc.max_send_message_length", -1),
    ("grpc.max_receive_message_length", -1),
    EXCLUSIVE_PORT,
]
GRACE_SECONDS = 5.0

log = logging.getLogger("h3serve.server")


def enable_reflection(server, service_full_names: list[str]) -> None:
    reflection.enable_server_reflection([*service_full_names, health.SERVICE_NAME, reflection.SERVICE_NAME], server)


def add_health_and_reflection(server, service_full_names: list[str], serving: bool = True) -> health.HealthServicer:
    """Register health (SERVING or NOT_SERVING, for "" and each service) and reflection; returns the servicer."""
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    set_serving(health_servicer, service_full_names, serving)
    enable_reflection(server, service_full_names)
    return health_servicer


def set_serving(health_servicer: health.HealthServicer, service_full_names: list[str], serving: bool) -> None:
    status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
    for name in ["", *service_full_names]:
        health_servicer.set(name, status)


def bind(server, address: str, tls_cert: str = "", tls_key: str = "") -> int:
    """Listen on `address`: TLS when a PEM certificate chain and key are given, plaintext otherwise. A port another
    process listens on is refused (EXIT_REFUSED, naming the address and the holder): a restart would not free it."""
    if bool(tls_cert) != bool(tls_key):
        raise ValueError("tls_cert and tls_key go together")
    try:
        if tls_cert:
            with open(tls_key, "rb") as key, open(tls_cert, "rb") as cert:
                credentials = grpc.ssl_server_credentials([(key.read(), cert.read())])
            port = server.add_secure_port(address, credentials)
        else:
            port = server.add_insecure_port(address)
    except RuntimeError:
        port = 0
    if port == 0:
        refuse_port_in_use(address)
        raise RuntimeError(f"cannot bind {address}")
    return port


def refuse_port_in_use(address: str) -> None:
    """Refuse (exit EXIT_REFUSED) when something listens on `address`'s port; return otherwise."""
    port = address.rsplit(":", 1)[-1]
    holders = port_holders(int(port)) if port.isdigit() else None
    if holders is not None:
        refuse(
            f"cannot listen on {address}: port {port} is in use by "
            f"{', '.join(holders) or 'a process of another user'} (another `h3serve up` on this configuration?)"
        )


def _channel(address: str, root_pem: bytes | None) -> grpc.Channel:
    if root_pem is None:
        return grpc.insecure_channel(address)
    return grpc.secure_channel(address, grpc.ssl_channel_credentials(root_pem))


def is_serving(address: str, timeout: float = 1.0, root_pem: bytes | None = None) -> bool:
    try:
        with _channel(address, root_pem) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=timeout)
            return reply.status == health_pb2.HealthCheckResponse.SERVING
    except grpc.RpcError:
        return False


def is_answering(address: str, timeout: float = 1.0, root_pem: bytes | None = None) -> bool:
    """The process answers health checks, whatever its status (a gateway whose stages are down says NOT_SERVING)."""
    try:
        with _channel(address, root_pem) as channel:
            health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=timeout)
            return True
    except grpc.RpcError:
        return False


def start_server(
    register,
    service_full_names: list[str],
    address: str,
    max_workers: int = 16,
    tls: tuple[str, str] = ("", ""),
    serving: bool = True,
    auth_token: str = "",
):
    """Start serving in the background; returns (server, health servicer). `register(server)` adds the
    servicers; `tls` is (cert, key) PEM paths; `auth_token` (empty: none) is required on every call but
    health and reflection."""
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=max_workers), options=GRPC_OPTIONS, interceptors=[Guard(auth_token)]
    )
    register(server)
    health_servicer = add_health_and_reflection(server, service_full_names, serving)
    bind(server, address, *tls)
    server.start()
    log.info("serving %s on %s", ", ".join(service_full_names), address)
    return server, health_servicer


def run_server(
    register,
    service_full_names: list[str],
    address: str,
    max_workers: int = 16,
    tls: tuple[str, str] = ("", ""),
    auth_token: str = "",
) -> None:
    """Serve until SIGTERM/SIGINT; the arguments are start_server's."""
    server, health_servicer = start_server(
        register, service_full_names, address, max_workers, tls, auth_token=auth_token
    )
    stopped = threading.Event()

    def stop(signum, _frame):
        log.info("signal %d: stopping (grace %.0f s)", signum, GRACE_SECONDS)
        health_servicer.enter_graceful_shutdown()
        server.stop(GRACE_SECONDS).wait()
        stopped.set()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    stopped.wait()
