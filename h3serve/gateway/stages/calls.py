"""Stage calls: a replica of the stage's service, the per-call deadline, bounded retries, the watchdog.

Every stage call is deterministic for a given input (the seed is part of the DiT spec), so a call
that fails UNAVAILABLE (the replica is down or restarting), or breaks while its request is still being sent,
is retried from the start with
exponential back-off, on another replica when there is one; any other status (a bad request above
all) is final at once. Each try runs under the watchdog of its phase.

Past the stage's outage limit, the job waits on while `h3serve up` says it is bringing the stage's service back
(starting it, or a restart due; common/supervision.py) or brought it back less than the limit ago; a supervisor that
gave up, or none (no state file, or its writer gone), leaves the decision to the limit.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import grpc

from h3serve.common.config import GatewayConfig
from h3serve.common.supervision import SERVING, STATE_ENV, ServiceState, read_live
from h3serve.gateway.metrics import GatewayMetrics
from h3serve.gateway.stages import SERVICES, STAGES
from h3serve.gateway.stages.replicas import Replica, ReplicaSet
from h3serve.gateway.stages.stage import JobContext, Stage, StageOutput
from h3serve.gateway.stages.watchdog import Stuck, Watchdog
from h3serve.v1 import gateway_pb2

TRANSIENT = {grpc.StatusCode.UNAVAILABLE}
# What grpc's client reports when a call ends while it is still writing the request stream: the server's own status
# is lost. Our services read a refused stream to its end first (wire.refusal_heard), so this is a process or a
# connection that went away mid-upload: transient, like UNAVAILABLE.
BROKEN_UPLOAD = (grpc.StatusCode.INTERNAL, "Internal error from Core")
T = TypeVar("T")


def _is_transient(exc: BaseException) -> bool:
    return isinstance(exc, grpc.aio.AioRpcError) and (
        exc.code() in TRANSIENT or (exc.code(), exc.details()) == BROKEN_UPLOAD
    )


class StageFailed(Exception):
    """A stage call ended with a gRPC error for good; the message names the stage and the replica."""

    def __init__(self, stage: str, replica: str, code: grpc.StatusCode, details: str | None):
        self.code = code
        super().__init__(f"{stage} ({replica}): {details or code.name}")


def _status(exc: grpc.aio.AioRpcError) -> str:
    return f"{exc.code().name}: {exc.details()}"


@dataclass
class CallRecord:
    """What one stage pass did: the tries, the replica of the last one, the bytes each way."""

    tries: int = 0
    replica: str = ""
    bytes_in: int = 0
    bytes_out: int = 0


@dataclass
class Outage:
    """A stage's calls failing transiently since `began` (monotonic seconds), and the start of the stage's service
    under `h3serve up` the job was last told it waits for."""

    began: float
    limit: float  # the stage's outage limit
    told: ServiceState | None = None

    def past_limit(self) -> bool:
        return time.monotonic() - self.began >= self.limit


class StageCaller:
    """Holds the stages and their services' replicas; runs one stage call of one job."""

    def __init__(self, config: GatewayConfig, metrics: GatewayMetrics) -> None:
        self.config, self.metrics = config, metrics
        root = Path(config.stage_tls_ca).read_bytes() if config.stage_tls_ca else None
        self.stages: dict[str, Stage] = {cls.name: cls(metrics) for cls in STAGES}
        self.replicas = {
            service: ReplicaSet.open(service, config.replicas(service), root, config.stage_token)
            for service in SERVICES
        }
        self.supervisor_state = os.environ.get(STATE_ENV)  # set by `h3serve up`

    async def close(self) -> None:
        for replicas in self.replicas.values():
            await replicas.close()

    async def run(self, stage: Stage, job: JobContext, record: CallRecord, watchdog: Watchdog) -> StageOutput:
        """The stage's call for `job` on one of its replicas, tried through outages; the reply stream read."""
        request = stage.request(job)
        record.bytes_in = request.bytes_in
        timeout = getattr(self.config, stage.deadline)

        async def once(replica: Replica) -> StageOutput:
            return await watchdog.run(
                stage.phase, stage.read(job, stage.call(replica.channel, request, timeout), watchdog)
            )

        output = await self._through_outages(stage, job, record, watchdog, once)
        record.bytes_out = output.payload_bytes
        self.metrics.tensor_bytes.labels(stage.name, "in").inc(record.bytes_in)
        self.metrics.tensor_bytes.labels(stage.name, "out").inc(record.bytes_out)
        return output

    async def _through_outages(
        self,
        stage: Stage,
        job: JobContext,
        record: CallRecord,
        watchdog: Watchdog,
        once: Callable[[Replica], Awaitable[T]],
    ) -> T:
        """Run `once` on a replica; after a transient failure, again on the next one with back-off, until the
        stage has taken no call and made no progress for its outage limit (StageFailed then), or longer while
        `h3serve up` is bringing its service back."""
        tried: set[str] = set()
        replicas, limit = self.replicas[stage.service], self.config.outage_s[stage.name]
        delays, outage = self._backoff(), None
        while True:
            replica = await replicas.pick(tried)
            tried.add(replica.address)
            record.tries, record.replica = record.tries + 1, replica.address
            events = watchdog.events
            try:
                return await self._try(stage.name, replica, once)
            except grpc.aio.AioRpcError as exc:
                if not _is_transient(exc):
                    raise StageFailed(stage.name, replica.address, exc.code(), exc.details()) from exc
                if outage is None or watchdog.events > events:  # a new outage: the job hears of it once
                    outage, delays = Outage(time.monotonic(), limit), self._backoff()
                    await job.emit(waiting=gateway_pb2.Waiting(stage=stage.name, reason=_status(exc), limit_s=limit))
                if outage.past_limit() and not await self._coming_back(stage, job, outage):
                    raise StageFailed(
                        stage.name,
                        replica.address,
                        exc.code(),
                        f"{exc.details()}; no {stage.name} replica took the call for {limit:g} s (its outage limit)",
                    ) from exc
            self.metrics.stage_retries.labels(stage.name).inc()
            await asyncio.sleep(next(delays))

    async def _coming_back(self, stage: Stage, job: JobContext, outage: Outage) -> bool:
        """Past the outage limit: whether `h3serve up` is bringing the stage's service back, or brought it back (saw it
        serve) less than the limit ago, its channel maybe not yet reconnected. The job hears of each start it waits
        for."""
        live = await asyncio.to_thread(read_live, self.supervisor_state) if self.supervisor_state else None
        if live is None or stage.service not in live.services:
            return False
        service = live.services[stage.service]
        if service.coming_back and service != outage.told:  # a state is the same until the next change
            outage.told = service
            await job.emit(
                waiting=gateway_pb2.Waiting(
                    stage=stage.name,
                    reason=service.describe(stage.service, live.start_timeout_s),
                    limit_s=round(service.left_s(live.start_timeout_s)),
                )
            )
        return service.coming_back or (service.state == SERVING and time.time() - service.since < outage.limit)

    def _backoff(self) -> Iterator[float]:
        delay = self.config.retry_backoff_s
        while True:
            yield delay
            delay = min(self.config.max_backoff_s, max(delay, 0.05) * 2)

    @staticmethod
    async def _try(stage: str, replica: Replica, once: Callable[[Replica], Awaitable[T]]) -> T:
        stats = replica.stats[stage]
        stats.in_flight += 1
        stats.calls += 1
        try:
            result = await once(replica)
        except grpc.aio.AioRpcError as exc:
            replica.failed(stage, _status(exc), down=_is_transient(exc))
            raise
        except Stuck as exc:
            replica.failed(stage, str(exc), down=True)
            raise
        finally:
            stats.in_flight -= 1
        replica.succeeded(stage)
        return result
