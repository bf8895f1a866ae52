"""The encode phase of fl2va / ref2va jobs: prompt + media to the encoder, media to the VAE, both at once.

Both stages get the assets' stored (compressed) bytes and normalise them themselves. The VAE's
conditioning latents are relayed to the DiT with the prompt embeddings, as chunks the gateway never
decodes, together with what the DiT's spec needs (keyframe anchors or the reference manifest).
t2va jobs take the plain encode call.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from h3serve.v1 import common_pb2, dit_pb2, gateway_pb2, media_pb2, tensor_pb2, vae_pb2
from gateway.asset_store import AssetStore
from gateway.stages import Encoded, StageClients, relay
from services.common.media import media_inputs

ROLES = {"first_frame": media_pb2.MEDIA_ROLE_FIRST_FRAME, "last_frame": media_pb2.MEDIA_ROLE_LAST_FRAME}


@dataclass
class Conditions:
    chunks: list[tensor_pb2.TensorChunk] = field(default_factory=list)
    summary: vae_pb2.ConditionSummary | None = None


@dataclass
class DenoiseInputs:
    encoded: Encoded
    chunks: list[tensor_pb2.TensorChunk]   # prompt embeddings, then conditioning latents
    spec: dit_pb2.DenoiseSpec              # the workflow's extra DenoiseSpec fields
    conditions: vae_pb2.ConditionSummary | None = None


def media_spec(job_id: str, request: gateway_pb2.ResolvedRequest, assets: AssetStore) -> media_pb2.MediaSpec:
    spec = media_pb2.MediaSpec(job_id=job_id, workflow=request.workflow, height=request.height,
                               width=request.width, num_frames=request.num_frames, prompt=request.prompt)
    given = [(request.first_frame, ROLES["first_frame"]), (request.last_frame, ROLES["last_frame"])] + \
        [(reference.asset_id, media_pb2.MEDIA_ROLE_REFERENCE) for reference in request.references]
    for asset_id, role in given:
        if asset_id:
            asset = assets.get(asset_id)
            spec.items.add(asset_id=asset_id, kind=asset.kind, role=role, bytes=asset.bytes)
    return spec


async def encode_inputs(stages: StageClients, assets: AssetStore | None, job_id: str,
                        request: gateway_pb2.ResolvedRequest,
                        on_progress: Callable[[vae_pb2.ConditionProgress], Awaitable[None]]) -> DenoiseInputs:
    if request.workflow in (common_pb2.WORKFLOW_UNSPECIFIED, common_pb2.WORKFLOW_T2VA):
        encoded = await stages.encode(job_id, request.prompt)
        return DenoiseInputs(encoded, encoded.chunks, dit_pb2.DenoiseSpec())
    spec = media_spec(job_id, request, assets)
    encoded, conditions = await asyncio.gather(_encode(stages, assets, spec),
                                               _conditions(stages, assets, spec, on_progress))
    extra = dit_pb2.DenoiseSpec(keyframe_anchors=conditions.summary.keyframe_anchors,
                                references=conditions.summary.references)
    return DenoiseInputs(encoded, [*encoded.chunks, *conditions.chunks], extra, conditions.summary)


async def _encode(stages: StageClients, assets: AssetStore, spec: media_pb2.MediaSpec) -> Encoded:
    async def call() -> Encoded:
        result = Encoded([], None)
        async for reply in stages.encoder.EncodeMedia(media_inputs(spec, assets.chunks),
                                                      timeout=stages.config.encode_deadline_s):
            if reply.HasField("chunk"):
                result.chunks.append(reply.chunk)
            else:
                result.summary = reply.summary
        return result

    return await stages._retrying(call)


async def _conditions(stages: StageClients, assets: AssetStore, spec: media_pb2.MediaSpec,
                      on_progress: Callable[[vae_pb2.ConditionProgress], Awaitable[None]]) -> Conditions:
    request_spec = media_pb2.MediaSpec()
    request_spec.CopyFrom(spec)
    request_spec.prompt = ""  # the VAE has no use for it

    async def call() -> Conditions:
        stream = stages.vae.EncodeConditions(media_inputs(request_spec, assets.chunks),
                                             timeout=stages.config.encode_deadline_s)
        return Conditions(*await relay(stream, "progress", on_progress))

    return await stages._retrying(call)

