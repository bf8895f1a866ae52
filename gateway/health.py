"""gRPC health of the gateway: SERVING only while every stage has a replica that answers SERVING.

Each Check probes the stages (each replica's answer is cached at most 1 s); nothing is a remembered
flag (the field notes' /health said "ready" for 20 minutes with the model server dead).
"""

from __future__ import annotations

import asyncio

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gateway.stages import StageClients

SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING


class StageHealth(health_pb2_grpc.HealthServicer):
    def __init__(self, stages: StageClients, service_names: list[str]) -> None:
        self.stages = stages
        self.names = {"", *service_names}
        self.stopping = False

    async def serving(self) -> bool:
        if self.stopping:
            return False
        return all(await asyncio.gather(*(replicas.serving() for replicas in self.stages.replicas.values())))

    async def Check(self, request, context):
        if request.service not in self.names:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"service: unknown service {request.service!r}")
        return health_pb2.HealthCheckResponse(status=SERVING if await self.serving() else NOT_SERVING)

    async def Watch(self, request, context):
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "Watch: poll Check instead (each Check probes the stages)")
