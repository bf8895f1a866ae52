"""The encode phase of fl2va / ref2va jobs: prompt + media to the encoder, media to the VAE, both at once.

Both stages get the assets' stored (compressed) bytes and normalise them themselves. The VAE's
conditioning latents are relayed to the DiT with the prompt embeddings, as chunks the gateway never
decodes, together with what the DiT's spec needs (keyframe anchors or the reference manifest).
t2va jobs take the plain encode call. Each call runs as a pass of its stage ("encoder", "vae-encode")
through `run_stage`, the job runner's queue, record and watchdog wrapper.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from h3serve.v1 import common_pb2, dit_pb2, gateway_pb2, media_pb2, tensor_pb2, vae_pb2
from h3serve.gateway.assets.store import AssetStore
from h3serve.gateway.stages.calls import CallRecord, Encoded, StageClients
from h3serve.gateway.stages.watchdog import Watchdog
from h3serve.runtime.media import media_inputs

# run_stage(stage name, work(record) -> awaitable result) -> the result
StageRunner = Callable[[str, Callable[[CallRecord], Awaitable]], Awaitable]

ROLES = {"first_frame": media_pb2.MEDIA_ROLE_FIRST_FRAME, "last_frame": media_pb2.MEDIA_ROLE_LAST_FRAME}


@dataclass
class DenoiseInputs:
    encoded: Encoded
    chunks: list[tensor_pb2.TensorChunk]   # prompt embeddings, then conditioning latents
    spec: dit_pb2.DenoiseSpec              # the workflow's extra DenoiseSpec fields
    conditions: vae_pb2.ConditionSummary | None = None


async def _both(first: Awaitable, second: Awaitable) -> list:
    """Both results; when one fails the other is cancelled, so no stage call outlives its job's attempt."""
    tasks = [asyncio.ensure_future(first), asyncio.ensure_future(second)]
    try:
        return await asyncio.gather(*tasks)
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


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
                        on_progress: Callable[[vae_pb2.ConditionProgress], Awaitable[None]],
                        run_stage: StageRunner, stall_s: dict[str, float]) -> DenoiseInputs:
    if request.workflow in (common_pb2.WORKFLOW_UNSPECIFIED, common_pb2.WORKFLOW_T2VA):
        encoded = await run_stage("encoder", lambda record: stages.encode(job_id, request.prompt, Watchdog(stall_s),
                                                                          record))
        return DenoiseInputs(encoded, encoded.chunks, dit_pb2.DenoiseSpec())
    spec = media_spec(job_id, request, assets)
    conditions_spec = media_pb2.MediaSpec()
    conditions_spec.CopyFrom(spec)
    conditions_spec.prompt = ""  # the VAE has no use for it
    media_bytes = sum(item.bytes for item in spec.items)
    encoded, (chunks, summary) = await _both(
        run_stage("encoder", lambda record: stages.encode_media(
            lambda: media_inputs(spec, assets.chunks), media_bytes, Watchdog(stall_s), record)),
        run_stage("vae-encode", lambda record: stages.encode_conditions(
            lambda: media_inputs(conditions_spec, assets.chunks), media_bytes, on_progress, Watchdog(stall_s), record)))
    extra = dit_pb2.DenoiseSpec(keyframe_anchors=summary.keyframe_anchors, references=summary.references)
    return DenoiseInputs(encoded, [*encoded.chunks, *chunks], extra, summary)
