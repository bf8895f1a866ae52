"""The replicas of one service: health probed on demand (cached at most 1 s) and least-loaded routing.

Health is never a remembered flag alone: `probe` asks the replica's gRPC health service when the last
answer is older than HEALTH_TTL_S. Routing uses the last known health (a failed call marks a replica
down at once; a down replica is probed again before routing, and a successful probe or call brings it
back) and picks the healthy replica with the fewest calls in flight; when every replica looks down it
still tries one, so a call fails with the real error. A replica can serve several stages (the VAE
service decodes and encodes conditions), so its call counters are kept per stage. With a stage token,
every call on a replica's channel (stage calls and probes) carries it.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import defaultdict
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from h3serve.common.server import GRPC_OPTIONS
from h3serve.v1 import gateway_pb2

HEALTH_TTL_S = 1.0
PROBE_TIMEOUT_S = 1.0
# A replica that went away is dialled again at least every second (gRPC's default waits up to 2 minutes between
# attempts after a long outage), so a service back from a restart takes the next try of a waiting job.
CHANNEL_OPTIONS = [*GRPC_OPTIONS, ("grpc.max_reconnect_backoff_ms", 1000)]


class _StageToken:
    """Adds `authorization: Bearer <token>` to a call. grpc.aio files an interceptor under the first call shape it
    implements, so each shape has its own class below."""

    def __init__(self, token: str) -> None:
        self.metadata = (("authorization", f"Bearer {token}"),)

    async def _call(self, continuation, details: grpc.aio.ClientCallDetails, request):
        return await continuation(details._replace(metadata=(*(details.metadata or ()), *self.metadata)), request)


class _UnaryUnary(_StageToken, grpc.aio.UnaryUnaryClientInterceptor):
    intercept_unary_unary = _StageToken._call


class _UnaryStream(_StageToken, grpc.aio.UnaryStreamClientInterceptor):
    intercept_unary_stream = _StageToken._call


class _StreamUnary(_StageToken, grpc.aio.StreamUnaryClientInterceptor):
    intercept_stream_unary = _StageToken._call


class _StreamStream(_StageToken, grpc.aio.StreamStreamClientInterceptor):
    intercept_stream_stream = _StageToken._call


def open_channel(address: str, root_pem: bytes | None, token: str = "") -> grpc.aio.Channel:
    interceptors = (
        [shape(token) for shape in (_UnaryUnary, _UnaryStream, _StreamUnary, _StreamStream)] if token else None
    )
    if root_pem is None:
        return grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS, interceptors=interceptors)
    return grpc.aio.secure_channel(
        address, grpc.ssl_channel_credentials(root_pem), options=CHANNEL_OPTIONS, interceptors=interceptors
    )


@dataclass
class CallStats:
    """One stage's calls on one replica."""

    in_flight: int = 0
    calls: int = 0
    failures: int = 0
    last_error: str = ""  # why the last call failed; cleared when a call succeeds


@dataclass
class Replica:
    address: str
    channel: grpc.aio.Channel
    healthy: bool = True  # last known health, from a probe or a call
    health_error: str = ""  # why the last probe said it is down
    probed_at: float = -math.inf
    failed_at: float = -math.inf
    stats: dict[str, CallStats] = field(default_factory=lambda: defaultdict(CallStats))

    @property
    def in_flight(self) -> int:
        return sum(s.in_flight for s in self.stats.values())

    @property
    def calls(self) -> int:
        return sum(s.calls for s in self.stats.values())

    async def probe(self) -> bool:
        if time.monotonic() - self.probed_at <= HEALTH_TTL_S:
            return self.healthy
        try:
            reply = await health_pb2_grpc.HealthStub(self.channel).Check(
                health_pb2.HealthCheckRequest(), timeout=PROBE_TIMEOUT_S
            )
            self.healthy = reply.status == health_pb2.HealthCheckResponse.SERVING
            self.health_error = (
                "" if self.healthy else f"health: {health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)}"
            )
        except grpc.aio.AioRpcError as exc:
            self.healthy, self.health_error = False, f"health probe: {exc.code().name}: {exc.details()}"
        self.probed_at = time.monotonic()
        return self.healthy

    def succeeded(self, stage: str) -> None:
        self.healthy, self.health_error = True, ""
        self.stats[stage].last_error = ""

    def failed(self, stage: str, error: str, down: bool) -> None:
        """A call failed; `down` (a transient failure or a stall) takes it out of routing until it answers again."""
        self.stats[stage].failures += 1
        self.stats[stage].last_error = error
        if down:
            self.healthy, self.failed_at = False, time.monotonic()

    def info(self, stage: str) -> gateway_pb2.ReplicaInfo:
        """How this replica looks to one stage: its health and that stage's calls on it."""
        stats = self.stats[stage]
        return gateway_pb2.ReplicaInfo(
            address=self.address,
            healthy=self.healthy,
            in_flight=stats.in_flight,
            calls=stats.calls,
            failures=stats.failures,
            last_error=stats.last_error or self.health_error,
        )


@dataclass
class ReplicaSet:
    service: str
    replicas: list[Replica] = field(default_factory=list)

    @classmethod
    def open(cls, service: str, addresses: tuple[str, ...], root_pem: bytes | None, token: str = "") -> ReplicaSet:
        return cls(service, [Replica(address, open_channel(address, root_pem, token)) for address in addresses])

    async def close(self) -> None:
        for replica in self.replicas:
            await replica.channel.close()

    async def pick(self, tried: set[str]) -> Replica:
        """The least-loaded healthy replica not yet tried by this call; else the one that failed longest ago.
        Replicas marked down are probed again first (at most once per HEALTH_TTL_S), so a replica that came
        back rejoins the routing."""
        stale = [r for r in self.replicas if not r.healthy and time.monotonic() - r.probed_at > HEALTH_TTL_S]
        await asyncio.gather(*(replica.probe() for replica in stale))
        fresh = [r for r in self.replicas if r.address not in tried] or self.replicas
        healthy = [r for r in fresh if r.healthy]
        if healthy:
            return min(healthy, key=lambda r: (r.in_flight, r.calls))
        return min(fresh, key=lambda r: r.failed_at)

    async def probe_all(self) -> list[bool]:
        return list(await asyncio.gather(*(replica.probe() for replica in self.replicas)))

    async def serving(self) -> bool:
        return any(await self.probe_all())
