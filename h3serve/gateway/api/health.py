"""gRPC health of the gateway: SERVING only while every stage has a replica that answers SERVING.

Each Check probes the stages (each replica's answer is cached at most 1 s); nothing is a remembered
flag (the field notes' /health said "ready" for 20 minutes with the model server dead). Watch probes
the same way every `WATCH_PERIOD_S` and sends the status when it changes (the first one at once).
"""

from __future__ import annotations

import asyncio

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from h3serve.gateway.stages.calls import StageCaller

SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
SERVICE_UNKNOWN = health_pb2.HealthCheckResponse.SERVICE_UNKNOWN
WATCH_PERIOD_S = 1.0


class StageHealth(health_pb2_grpc.HealthServicer):
    def __init__(self, caller: StageCaller, service_names: list[str]) -> None:
        self.caller = caller
        self.names = {"", *service_names}
        self.stopping = False

    async def serving(self) -> bool:
        if self.stopping:
            return False
        return all(await asyncio.gather(*(replicas.serving() for replicas in self.caller.replicas.values())))

    async def status(self) -> int:
        return SERVING if await self.serving() else NOT_SERVING

    async def Check(self, request, context):
        if request.service not in self.names:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"service: unknown service {request.service!r}")
        return health_pb2.HealthCheckResponse(status=await self.status())

    async def Watch(self, request, context):
        """The status now, then each change until the client leaves. An unknown service gets SERVICE_UNKNOWN and the
        call stays open, as the health protocol asks (a service may appear later; here none does)."""
        if request.service not in self.names:
            yield health_pb2.HealthCheckResponse(status=SERVICE_UNKNOWN)
            await asyncio.Future()  # cancelled when the client leaves or the server stops
        last = None
        while True:
            status = await self.status()
            if status != last:
                yield health_pb2.HealthCheckResponse(status=status)
                last = status
            await asyncio.sleep(WATCH_PERIOD_S)
