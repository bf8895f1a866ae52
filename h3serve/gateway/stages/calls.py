"""Async clients for the three model stages: replicas, deadlines, bounded retries, the watchdog.

Every stage call is deterministic for a given input (the seed is part of the DiT spec), so a
call that fails UNAVAILABLE (the replica is down or restarting) is retried from the start with
exponential back-off, on another replica when there is one; any other status (a bad request
above all) is final at once. Each try runs under the watchdog of its phase.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import grpc
from tenacity import AsyncRetrying, retry_if_exception, stop_after_attempt, wait_exponential

from h3serve.v1 import (dit_pb2, dit_pb2_grpc, encoder_pb2, encoder_pb2_grpc, gateway_pb2, media_pb2, tensor_pb2,
                        vae_pb2, vae_pb2_grpc)
from h3serve.gateway.metrics import STAGES, GatewayMetrics
from h3serve.gateway.stages.replicas import Replica, ReplicaSet
from h3serve.gateway.stages.watchdog import Stuck, Watchdog
from h3serve.common.config import GatewayConfig

Chunks = list[tensor_pb2.TensorChunk]
TRANSIENT = {grpc.StatusCode.UNAVAILABLE}
T = TypeVar("T")


def _is_transient(exc: BaseException) -> bool:
    return isinstance(exc, grpc.aio.AioRpcError) and exc.code() in TRANSIENT


def _payload(chunks: Chunks) -> int:
    return sum(len(chunk.tensor.data) for chunk in chunks)


@dataclass
class CallRecord:
    """What one stage pass did: the tries, the replica of the last one, the bytes each way."""

    tries: int = 0
    replica: str = ""
    bytes_in: int = 0
    bytes_out: int = 0
async def relay(stream, progress: str, on_progress) -> tuple[Chunks, object]:
    """Read a stage's event stream: `progress` events go to `on_progress`, tensor chunks are kept in order,
    the final summary is returned with them."""
    chunks, summary = [], None
    async for event in stream:
        kind = event.WhichOneof("kind")
        if kind == progress:
            await on_progress(getattr(event, kind))
        elif kind == "chunk":
            chunks.append(event.chunk)
        else:
            summary = event.summary
    return chunks, summary


@dataclass
class Encoded:
    chunks: Chunks
    summary: encoder_pb2.EncodeSummary


@dataclass
class Denoised:
    chunks: Chunks
    summary: dit_pb2.DenoiseSummary


@dataclass
class Decoded:
    files: dict[str, bytearray] = field(default_factory=dict)
    summary: vae_pb2.DecodeSummary | None = None


class StageClients:
    def __init__(self, config: GatewayConfig, metrics: GatewayMetrics) -> None:
        self.config, self.metrics = config, metrics
        root = Path(config.stage_tls_ca).read_bytes() if config.stage_tls_ca else None
        self.replicas = {stage: ReplicaSet.open(stage, config.replicas(stage), root) for stage in STAGES}
        self.cache_hits = self.cache_misses = 0

    def cache_hit_rate(self) -> float:
        """Share of this gateway's encoder calls served from the embedding cache."""
        calls = self.cache_hits + self.cache_misses
        return self.cache_hits / calls if calls else 0.0

    async def close(self) -> None:
        for replicas in self.replicas.values():
            await replicas.close()

    async def call(self, stage: str, record: CallRecord, once: Callable[[Replica], Awaitable[T]]) -> T:
        """Run `once` on a replica; retry transient failures on the next replica with back-off."""
        replicas, tried = self.replicas[stage], set()
        retrying = AsyncRetrying(
            retry=retry_if_exception(_is_transient), reraise=True,
            stop=stop_after_attempt(self.config.retry_attempts),
            wait=wait_exponential(multiplier=self.config.retry_backoff_s, max=10),
            before_sleep=lambda _: self.metrics.stage_retries.labels(stage).inc(),
        )
        async for attempt in retrying:
            with attempt:
                replica = await replicas.pick(tried)
                tried.add(replica.address)
                record.tries, record.replica = record.tries + 1, replica.address
                return await self._try(replica, once)

    @staticmethod
    async def _try(replica: Replica, once: Callable[[Replica], Awaitable[T]]) -> T:
        replica.in_flight += 1
        replica.calls += 1
        try:
            result = await once(replica)
        except grpc.aio.AioRpcError as exc:
            replica.failed(f"{exc.code().name}: {exc.details()}", down=_is_transient(exc))
            raise
        except Stuck as exc:
            replica.failed(str(exc), down=True)
            raise
        finally:
            replica.in_flight -= 1
        replica.succeeded()
        return result

    def _moved(self, stage: str, record: CallRecord) -> None:
        self.metrics.tensor_bytes.labels(stage, "in").inc(record.bytes_in)
        self.metrics.tensor_bytes.labels(stage, "out").inc(record.bytes_out)

    async def encode(self, job_id: str, prompt: str, watchdog: Watchdog, record: CallRecord) -> Encoded:
        record.bytes_in = len(prompt.encode("utf-8"))
        request = encoder_pb2.EncodeRequest(prompt=prompt, job_id=job_id)
        return await self._encode(lambda stub: stub.Encode(request, timeout=self.config.encode_deadline_s),
                                  watchdog, record)

    async def encode_media(self, requests: Callable[[], Iterator[media_pb2.MediaInput]], bytes_in: int,
                           watchdog: Watchdog, record: CallRecord) -> Encoded:
        """fl2va / ref2va: the prompt with its keyframes / references (`requests()` opens a fresh input stream)."""
        record.bytes_in = bytes_in
        return await self._encode(lambda stub: stub.EncodeMedia(requests(), timeout=self.config.encode_deadline_s),
                                  watchdog, record)

    async def _encode(self, open_call, watchdog: Watchdog, record: CallRecord) -> Encoded:
        async def stream(replica: Replica) -> Encoded:
            chunks, summary = [], None
            async for reply in open_call(encoder_pb2_grpc.EncoderStub(replica.channel)):
                if reply.HasField("chunk"):
                    chunks.append(reply.chunk)
                else:
                    summary = reply.summary
            return Encoded(chunks, summary)

        encoded = await self.call("encoder", record, lambda replica: watchdog.run("encode", stream(replica)))
        record.bytes_out = _payload(encoded.chunks)
        self._moved("encoder", record)
        hit = encoded.summary.cache_hit
        self.cache_hits, self.cache_misses = self.cache_hits + hit, self.cache_misses + (not hit)
        self.metrics.cache.labels("hit" if hit else "miss").inc()
        return encoded

    async def encode_conditions(self, requests: Callable[[], Iterator[media_pb2.MediaInput]], bytes_in: int,
                                on_progress: Callable[[vae_pb2.ConditionProgress], Awaitable[None]],
                                watchdog: Watchdog, record: CallRecord) -> tuple[Chunks, vae_pb2.ConditionSummary]:
        """fl2va / ref2va: keyframes / references to conditioning latents on a VAE replica."""
        record.bytes_in = bytes_in

        async def progress(event: vae_pb2.ConditionProgress) -> None:
            watchdog.progress("encode")
            await on_progress(event)

        async def stream(replica: Replica):
            call = vae_pb2_grpc.VAEStub(replica.channel).EncodeConditions(
                requests(), timeout=self.config.encode_deadline_s)
            return await relay(call, "progress", progress)

        chunks, summary = await self.call("vae", record, lambda replica: watchdog.run("encode", stream(replica)))
        record.bytes_out = _payload(chunks)
        self._moved("vae", record)
        return chunks, summary

    async def denoise(self, job_id: str, request: gateway_pb2.ResolvedRequest, embeds: Chunks,
                      on_step: Callable[[dit_pb2.StepProgress], Awaitable[None]], watchdog: Watchdog,
                      record: CallRecord, extra: dit_pb2.DenoiseSpec | None = None) -> Denoised:
        """`embeds`: every input tensor's chunks; `extra`: workflow fields (keyframe anchors, reference manifest)."""
        spec = dit_pb2.DenoiseSpec(
            job_id=job_id, workflow=request.workflow, height=request.height, width=request.width,
            num_frames=request.num_frames, num_inference_steps=request.num_inference_steps, seed=request.seed)
        if extra is not None:
            spec.MergeFrom(extra)
        inputs = [dit_pb2.DenoiseInput(spec=spec), *(dit_pb2.DenoiseInput(chunk=c) for c in embeds)]
        record.bytes_in = _payload(embeds)

        async def step(progress: dit_pb2.StepProgress) -> None:
            watchdog.progress("denoise")
            self.metrics.step_seconds.observe(progress.seconds)
            await on_step(progress)

        async def stream(replica: Replica) -> Denoised:
            call = dit_pb2_grpc.DiTStub(replica.channel).Denoise(iter(inputs), timeout=self.config.denoise_deadline_s)
            return Denoised(*await relay(call, "step", step))

        denoised = await self.call("dit", record, lambda replica: watchdog.run("denoise", stream(replica)))
        record.bytes_out = _payload(denoised.chunks)
        self._moved("dit", record)
        return denoised

    async def decode(self, job_id: str, include_raw: bool, latents: Chunks,
                     on_progress: Callable[[vae_pb2.DecodeProgress], Awaitable[None]], watchdog: Watchdog,
                     record: CallRecord) -> Decoded:
        spec = vae_pb2.DecodeSpec(job_id=job_id, include_raw=include_raw)
        inputs = [vae_pb2.DecodeInput(spec=spec), *(vae_pb2.DecodeInput(chunk=c) for c in latents)]
        record.bytes_in = _payload(latents)

        async def stream(replica: Replica) -> Decoded:
            result = Decoded()
            call = vae_pb2_grpc.VAEStub(replica.channel).Decode(iter(inputs), timeout=self.config.decode_deadline_s)
            async for event in call:
                kind = event.WhichOneof("kind")
                if kind == "progress":
                    watchdog.progress("mux" if event.progress.phase == vae_pb2.DECODE_PHASE_MUX else "decode")
                    await on_progress(event.progress)
                elif kind == "file":
                    result.files.setdefault(event.file.name, bytearray()).extend(event.file.data)
                else:
                    result.summary = event.summary
            return result

        decoded = await self.call("vae", record, lambda replica: watchdog.run("decode", stream(replica)))
        record.bytes_out = sum(len(data) for data in decoded.files.values())
        self._moved("vae", record)
        return decoded
