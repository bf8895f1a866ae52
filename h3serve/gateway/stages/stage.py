"""A stage as data: the call one job makes to one model service, declared once.

A stage names the service whose replicas run it, the watchdog phase its call starts in, the config
key of its per-call deadline, how it builds its request from the job (and what earlier stages
produced), and how the events of its reply stream become job events. The job runner executes a
workflow's plan of stage names (h3serve/model/workflows) through these declarations; queues,
metrics, Info and stage records all follow from the list in h3serve/gateway/stages/__init__.py.

Every reply stream has one shape: progress events, then tensor chunks or file chunks, then one
summary (the `oneof kind` of EncodeReply, ConditionEvent, DenoiseEvent and DecodeEvent).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import grpc

from h3serve.gateway.stages.watchdog import Watchdog
from h3serve.v1 import gateway_pb2, media_pb2, tensor_pb2

Chunks = list[tensor_pb2.TensorChunk]


@dataclass
class StageOutput:
    """What a stage's reply stream carried."""

    chunks: Chunks = field(default_factory=list)
    files: dict[str, bytearray] = field(default_factory=dict)
    summary: Any = None

    @property
    def payload_bytes(self) -> int:
        return sum(len(c.tensor.data) for c in self.chunks) + sum(len(data) for data in self.files.values())


@dataclass
class JobContext:
    """One attempt of a job as the stages see it: the request, its media, and what earlier stages produced."""

    job_id: str
    request: gateway_pb2.ResolvedRequest
    media: list[media_pb2.MediaItem]  # the assets the workflow sends to the stages
    read_asset: Callable[[str], AsyncIterator[bytes]]  # asset id -> its stored bytes, chunk by chunk
    emit: Callable[..., Awaitable[object]]  # emit(denoising=Denoising(...)): one job event (the stored one returned)
    outputs: dict[str, StageOutput] = field(default_factory=dict)
    scratch: dict[str, Any] = field(default_factory=dict)  # a stage's own state across its events


@dataclass(frozen=True)
class Request:
    """What a stage sends: the RPC, its request made afresh for every try (one message, or an iterator of them
    for a client stream), and the payload size for the stage record."""

    method: str
    make: Callable[[], Any]
    bytes_in: int


class Stage:
    name: str  # "encoder", "vae-encode", "dit", "vae": the stage's queue, metrics label and record
    service: str  # whose replicas run it: a [gateway] address key ("encoder", "dit", "vae")
    phase: str  # the watchdog phase its call starts in
    deadline: str  # the GatewayConfig field holding its per-call deadline in seconds
    stub: type  # the service's gRPC stub class

    def __init__(self, metrics) -> None:
        self.metrics = metrics  # h3serve/gateway/metrics.GatewayMetrics

    def request(self, job: JobContext) -> Request:
        raise NotImplementedError

    def call(self, channel: grpc.aio.Channel, request: Request, timeout: float):
        """Open the RPC on a replica's channel; returns the reply stream."""
        return getattr(self.stub(channel), request.method)(request.make(), timeout=timeout)

    def cache_hit_rate(self) -> float:
        """Share of this stage's calls its service answered from a cache (the encoder's embeddings)."""
        return 0.0

    async def progress(self, job: JobContext, kind: str, event, watchdog: Watchdog) -> None:
        """One progress event of the reply stream: restart the phase's clock, tell the job."""
        watchdog.progress(self.phase)

    async def finished(self, job: JobContext, output: StageOutput) -> dict[str, float]:
        """After the reply stream ended: tell the job, and return the stage timings to record (name -> s)."""
        return {}

    async def read(self, job: JobContext, replies, watchdog: Watchdog) -> StageOutput:
        output = StageOutput()
        async for reply in replies:
            kind = reply.WhichOneof("kind")
            value = getattr(reply, kind)
            if kind == "chunk":
                output.chunks.append(value)
            elif kind == "file":
                output.files.setdefault(value.name, bytearray()).extend(value.data)
            elif kind == "summary":
                output.summary = value
            else:
                await self.progress(job, kind, value, watchdog)
        return output
