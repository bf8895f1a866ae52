"""gRPC health of the gateway: SERVING only while its job store answers and every stage has a replica that answers
SERVING.

Each Check pings the store and probes the stages (each replica's answer is cached at most 1 s); nothing is a
remembered flag (the field notes' /health said "ready" for 20 minutes with the model server dead). A NOT_SERVING
answer says why in its trailing metadata (REASON_KEY: the store out of reach, naming it; a stage with no replica
serving), which /healthz shows. Watch probes the same way every `WATCH_PERIOD_S` and sends the status when it changes
(the first one at once).
"""

from __future__ import annotations

import asyncio

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from h3serve.gateway.jobs.store import JobStore, StoreUnavailable
from h3serve.gateway.stages.calls import StageCaller

SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
SERVICE_UNKNOWN = health_pb2.HealthCheckResponse.SERVICE_UNKNOWN
WATCH_PERIOD_S = 1.0
REASON_KEY = "h3serve-not-serving"  # trailing metadata of a NOT_SERVING Check: why


class StageHealth(health_pb2_grpc.HealthServicer):
    def __init__(self, caller: StageCaller, service_names: list[str], store: JobStore) -> None:
        self.caller, self.store = caller, store
        self.names = {"", *service_names}
        self.stopping = False

    async def not_serving(self) -> str:
        """Why the gateway cannot serve now ("" when it can)."""
        if self.stopping:
            return "the gateway is stopping"
        try:
            await self.store.ping()
        except StoreUnavailable as exc:
            return str(exc)
        services = list(self.caller.replicas)
        answers = await asyncio.gather(*(self.caller.replicas[service].serving() for service in services))
        down = [service for service, up in zip(services, answers, strict=True) if not up]
        return f"no replica of {', '.join(down)} answers SERVING" if down else ""

    async def serving(self) -> bool:
        return not await self.not_serving()

    async def Check(self, request, context):
        if request.service not in self.names:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"service: unknown service {request.service!r}")
        reason = await self.not_serving()
        if reason:
            context.set_trailing_metadata(((REASON_KEY, reason.encode("ascii", "replace").decode()),))
        return health_pb2.HealthCheckResponse(status=NOT_SERVING if reason else SERVING)

    async def Watch(self, request, context):
        """The status now, then each change until the client leaves. An unknown service gets SERVICE_UNKNOWN and the
        call stays open, as the health protocol asks (a service may appear later; here none does)."""
        if request.service not in self.names:
            yield health_pb2.HealthCheckResponse(status=SERVICE_UNKNOWN)
            await asyncio.Future()  # cancelled when the client leaves or the server stops
        last = None
        while True:
            status = SERVING if await self.serving() else NOT_SERVING
            if status != last:
                yield health_pb2.HealthCheckResponse(status=status)
                last = status
            await asyncio.sleep(WATCH_PERIOD_S)
