"""Serve the HTTP app on the gateway's own event loop, beside its gRPC server.

The app reaches the gateway through a private abstract-namespace Unix socket that only this process binds,
so every HTTP request takes the gRPC path (guard, auth, admission) with no network hop and no second
certificate. The HTTP side serves TLS with the gateway's certificate when it has one. Uvicorn's own signal
handling is off: the gateway owns SIGTERM and stops the door first.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket

import grpc
import uvicorn

from h3serve.common.config import GatewayConfig
from h3serve.common.server import GRPC_OPTIONS
from h3serve.gateway.http.app import create_app
from h3serve.gateway.tenants.registry import Tenants

log = logging.getLogger("h3serve.gateway")


def private_address() -> str:
    """The gateway's in-process gRPC address for the door (Linux abstract socket: no file, gone with the process)."""
    return f"unix-abstract:h3serve-gateway-{os.getpid()}"


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self):  # the gateway's handlers stay in place
        yield


class HttpDoor:
    def __init__(self, config: GatewayConfig, tenants: Tenants | None = None) -> None:
        self.config = config
        self.channel = grpc.aio.insecure_channel(private_address(), options=GRPC_OPTIONS)
        self.closing = asyncio.Event()
        self.server = _Server(
            uvicorn.Config(
                create_app(self.channel, self.closing, config, tenants),
                log_config=None,
                access_log=False,
                lifespan="off",
                ssl_certfile=config.tls_cert or None,
                ssl_keyfile=config.tls_key or None,
                timeout_graceful_shutdown=5,
            )
        )
        self.task: asyncio.Task | None = None

    async def start(self) -> None:
        """Bind now (a taken port fails the gateway's start, not a background task) and serve."""
        sock = socket.create_server((self.config.http_host, self.config.http_port), reuse_port=False)
        self.task = asyncio.get_running_loop().create_task(self.server.serve([sock]))
        while not self.server.started:
            if self.task.done():
                self.task.result()
                raise RuntimeError(f"the HTTP door on {self.config.http_host}:{self.config.http_port} did not start")
            await asyncio.sleep(0.01)
        log.info(
            "HTTP door on %s://%s:%d (OpenAI /v1/videos, console at /)",
            "https" if self.config.tls_cert else "http",
            self.config.http_host,
            self.config.http_port,
        )

    async def stop(self) -> None:
        """Stop taking requests; open event streams end cleanly (their clients resume with Last-Event-ID), the
        other requests get the graceful shutdown's time to finish."""
        self.closing.set()
        self.server.should_exit = True
        if self.task:
            await self.task
        await self.channel.close()
