"""The request stream of the stages that take keyframes / references: one MediaSpec, then each asset's bytes.

The gateway sends the stored (compressed) bytes; each stage decodes and normalises them itself, so
decoded frames never cross the network.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from h3serve.gateway.stages.stage import JobContext
from h3serve.v1 import media_pb2


def media_spec(job: JobContext, with_prompt: bool) -> media_pb2.MediaSpec:
    request = job.request
    return media_pb2.MediaSpec(
        job_id=job.job_id,
        workflow=request.workflow,
        height=request.height,
        width=request.width,
        num_frames=request.num_frames,
        items=job.media,
        prompt=request.prompt if with_prompt else "",
    )


async def media_stream(spec: media_pb2.MediaSpec, job: JobContext) -> AsyncIterator[media_pb2.MediaInput]:
    yield media_pb2.MediaInput(spec=spec)
    for item in spec.items:
        offset = 0
        async for data in job.read_asset(item.asset_id):
            yield media_pb2.MediaInput(chunk=media_pb2.MediaChunk(asset_id=item.asset_id, offset=offset, data=data))
            offset += len(data)


def media_bytes(job: JobContext) -> int:
    return sum(item.bytes for item in job.media)
