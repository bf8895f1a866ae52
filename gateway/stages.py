"""Async clients for the three model stages, with deadlines and bounded retries.

Every stage call is deterministic for a given input (the seed is part of the DiT spec), so a
call that fails UNAVAILABLE (the service is down or restarting) is retried from the start
with exponential back-off; any other status (a bad request above all) is final at once.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import grpc
from tenacity import AsyncRetrying, retry_if_exception, stop_after_attempt, wait_exponential

from h3serve.v1 import dit_pb2, dit_pb2_grpc, encoder_pb2, encoder_pb2_grpc, gateway_pb2, tensor_pb2, vae_pb2, vae_pb2_grpc
from services.common.config import GatewayConfig
from services.common.server import GRPC_OPTIONS

Chunks = list[tensor_pb2.TensorChunk]
TRANSIENT = {grpc.StatusCode.UNAVAILABLE}


def _is_transient(exc: BaseException) -> bool:
    return isinstance(exc, grpc.aio.AioRpcError) and exc.code() in TRANSIENT


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
    def __init__(self, config: GatewayConfig) -> None:
        self.config = config
        self._channels = {name: grpc.aio.insecure_channel(getattr(config, name), options=GRPC_OPTIONS)
                          for name in ("encoder", "dit", "vae")}
        self.encoder = encoder_pb2_grpc.EncoderStub(self._channels["encoder"])
        self.dit = dit_pb2_grpc.DiTStub(self._channels["dit"])
        self.vae = vae_pb2_grpc.VAEStub(self._channels["vae"])

    async def close(self) -> None:
        for channel in self._channels.values():
            await channel.close()

    async def _retrying(self, call: Callable[[], Awaitable]):
        retrying = AsyncRetrying(
            retry=retry_if_exception(_is_transient), reraise=True,
            stop=stop_after_attempt(self.config.retry_attempts),
            wait=wait_exponential(multiplier=self.config.retry_backoff_s, max=10),
        )
        async for attempt in retrying:
            with attempt:
                return await call()

    async def encode(self, job_id: str, prompt: str) -> Encoded:
        async def call() -> Encoded:
            chunks, summary = [], None
            stream = self.encoder.Encode(encoder_pb2.EncodeRequest(prompt=prompt, job_id=job_id),
                                         timeout=self.config.encode_deadline_s)
            async for reply in stream:
                if reply.HasField("chunk"):
                    chunks.append(reply.chunk)
                else:
                    summary = reply.summary
            return Encoded(chunks, summary)

        return await self._retrying(call)

    async def denoise(self, job_id: str, request: gateway_pb2.ResolvedRequest, embeds: Chunks,
                      on_step: Callable[[dit_pb2.StepProgress], Awaitable[None]],
                      extra: dit_pb2.DenoiseSpec | None = None) -> Denoised:
        """`embeds`: every input tensor's chunks; `extra`: workflow fields (keyframe anchors, reference manifest)."""
        spec = dit_pb2.DenoiseSpec(
            job_id=job_id, workflow=request.workflow, height=request.height, width=request.width,
            num_frames=request.num_frames, num_inference_steps=request.num_inference_steps, seed=request.seed)
        if extra is not None:
            spec.MergeFrom(extra)
        inputs = [dit_pb2.DenoiseInput(spec=spec), *(dit_pb2.DenoiseInput(chunk=c) for c in embeds)]

        async def call() -> Denoised:
            stream = self.dit.Denoise(iter(inputs), timeout=self.config.denoise_deadline_s)
            return Denoised(*await relay(stream, "step", on_step))

        return await self._retrying(call)

    async def decode(self, job_id: str, include_raw: bool, latents: Chunks,
                     on_progress: Callable[[vae_pb2.DecodeProgress], Awaitable[None]]) -> Decoded:
        spec = vae_pb2.DecodeSpec(job_id=job_id, include_raw=include_raw)
        inputs = [vae_pb2.DecodeInput(spec=spec), *(vae_pb2.DecodeInput(chunk=c) for c in latents)]

        async def call() -> Decoded:
            result = Decoded()
            async for event in self.vae.Decode(iter(inputs), timeout=self.config.decode_deadline_s):
                kind = event.WhichOneof("kind")
                if kind == "progress":
                    await on_progress(event.progress)
                elif kind == "file":
                    result.files.setdefault(event.file.name, bytearray()).extend(event.file.data)
                else:
                    result.summary = event.summary
            return result

        return await self._retrying(call)
