"""The public gRPC API: validation, durable jobs, event streams and downloads."""

from __future__ import annotations

import asyncio
import logging
import signal
import uuid
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from h3serve.v1 import gateway_pb2, gateway_pb2_grpc, media_pb2
from gateway.artifacts import ArtifactStore
from gateway.asset_store import AssetStore
from gateway.assets import AssetLimits, AssetRefused
from gateway.conditioning import OverCapacity, resolve_media
from gateway.events import EventHub
from gateway.jobs import JobRunner
from gateway.request import InvalidRequest, RequestLimits, resolve
from gateway.stages import StageClients
from gateway.store import JobStore
from services.common import logs
from services.common.config import GatewayConfig
from services.common.server import GRACE_SECONDS, GRPC_OPTIONS, enable_reflection

log = logging.getLogger("h3serve.gateway")
DOWNLOAD_CHUNK = 1 << 20
RESTART_REASON = "the gateway restarted while this job was in flight; submit it again"


class GatewayServicer(gateway_pb2_grpc.GatewayServicer):
    def __init__(self, config: GatewayConfig, store: JobStore, hub: EventHub, runner: JobRunner,
                 assets: AssetStore) -> None:
        self.limits = RequestLimits.from_config(config)
        self.config = config
        self.store, self.hub, self.runner, self.assets = store, hub, runner, assets

    async def Generate(self, request, context):
        try:
            resolved = resolve_media(request, resolve(request, self.limits), self.assets.get, self.config.geometry,
                                     self.config.max_rows)
        except OverCapacity as exc:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        except InvalidRequest as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        job_id = uuid.uuid4().hex[:16]
        self.store.create_job(job_id, resolved)
        self.hub.emit(job_id, accepted=gateway_pb2.Accepted(request=resolved))
        self.runner.start(job_id, resolved)
        log.info("job %s accepted: %dx%d, %d frames, %d steps, seed %d", job_id, resolved.height,
                 resolved.width, resolved.num_frames, resolved.num_inference_steps, resolved.seed)
        async for event in self.hub.watch(job_id):
            yield event

    async def GetJob(self, request, context):
        return await self._job_or_abort(request.job_id, context)

    async def CancelJob(self, request, context):
        job = await self._job_or_abort(request.job_id, context)
        if self.runner.cancel(job.job_id):
            async for _ in self.hub.watch(job.job_id):
                pass  # returns once the job has reached its terminal state
        return self.store.get_job(job.job_id)

    async def DownloadArtifact(self, request, context):
        found = self.store.artifact(request.artifact_id)
        if found is None or not Path(found[1]).is_file():
            await context.abort(grpc.StatusCode.NOT_FOUND, f"artifact_id: no artifact {request.artifact_id!r}")
        artifact, path = found
        with open(path, "rb") as file:
            first = True
            while data := file.read(DOWNLOAD_CHUNK):
                chunk = gateway_pb2.ArtifactChunk(data=data)
                if first:
                    chunk.file_name, chunk.total_bytes, first = artifact.file_name, artifact.bytes, False
                yield chunk

    async def UploadAsset(self, request_iterator, context):
        try:
            asset = await self.assets.upload(request_iterator, asyncio.to_thread)
        except AssetRefused as exc:
            await context.abort(exc.code, exc.message)
        log.info("asset %s (%s, %s, %d bytes)%s", asset.asset_id[:16], media_pb2.AssetKind.Name(asset.kind),
                 asset.format, asset.bytes, " already stored" if asset.deduplicated else "")
        return asset

    async def _job_or_abort(self, job_id: str, context) -> gateway_pb2.Job:
        job = self.store.get_job(job_id)
        if job is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"job_id: no job {job_id!r}")
        return job


async def serve_async(config: GatewayConfig) -> None:
    data_dir = Path(config.data_dir)
    store = JobStore(str(data_dir / "jobs.sqlite"))
    interrupted = store.fail_interrupted(RESTART_REASON)
    if interrupted:
        log.warning("marked %d interrupted job(s) failed: %s", len(interrupted), ", ".join(interrupted))
    hub = EventHub(store)
    stages = StageClients(config)
    assets = AssetStore(str(data_dir / "assets"), AssetLimits.from_config(config))
    runner = JobRunner(store, hub, stages, ArtifactStore(str(data_dir / "artifacts")), assets)
    server = grpc.aio.server(options=GRPC_OPTIONS)
    gateway_pb2_grpc.add_GatewayServicer_to_server(GatewayServicer(config, store, hub, runner, assets), server)
    service_name = gateway_pb2.DESCRIPTOR.services_by_name["Gateway"].full_name
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    enable_reflection(server, [service_name])
    if server.add_insecure_port(f"{config.host}:{config.port}") == 0:
        raise RuntimeError(f"cannot bind {config.host}:{config.port}")
    await server.start()
    for name in ("", service_name):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    log.info("gateway on %s:%d (encoder %s, dit %s, vae %s)", config.host, config.port, config.encoder,
             config.dit, config.vae)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    await stop.wait()
    log.info("stopping (grace %.0f s)", GRACE_SECONDS)
    await health_servicer.enter_graceful_shutdown()
    await runner.shutdown()
    await server.stop(GRACE_SECONDS)
    await stages.close()
    store.close()


def serve(config: GatewayConfig) -> None:
    logs.setup("gateway")
    asyncio.run(serve_async(config))
