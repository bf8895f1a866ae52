"""The public gRPC API: admission, durable jobs, event streams, listings, downloads, health and Info."""

from __future__ import annotations

import asyncio
import hashlib
import logging
import signal
import uuid
from pathlib import Path

import grpc

from h3serve.v1 import gateway_pb2, gateway_pb2_grpc, media_pb2
from grpc_health.v1 import health_pb2_grpc
from h3serve.gateway.admission.capacity import CapacityTable
from h3serve.gateway.jobs.artifacts import ArtifactStore
from h3serve.gateway.assets.store import AssetStore
from h3serve.gateway.assets.validate import AssetLimits, AssetRefused
from h3serve.gateway.api.auth import BearerTokenInterceptor
from h3serve.gateway.admission.media import referenced_assets, resolve_media
from h3serve.gateway.jobs.events import EventHub
from h3serve.gateway.api.health import StageHealth
from h3serve.gateway.jobs.runner import REPLICAS_OF, JobRunner
from h3serve.gateway.metrics import GatewayMetrics
from h3serve.gateway.admission.request import InvalidRequest, RequestLimits, resolve
from h3serve.gateway.admission.served import ServedWorkflows, WorkflowNotServed
from h3serve.gateway.stages.calls import StageClients
from h3serve.gateway.admission.text_rows import TextRows
from h3serve.gateway.jobs.store import JobStore, QueueFull, RequestIdConflict
from h3serve.common import logs
from h3serve.common.config import GatewayConfig
from h3serve.common.server import GRACE_SECONDS, bind, enable_reflection

log = logging.getLogger("h3serve.gateway")
DOWNLOAD_CHUNK = 1 << 20
MAX_ID_CHARS = 128
MAX_PAGE_SIZE, DEFAULT_PAGE_SIZE = 1000, 100
RETENTION_PERIOD_S = 60.0


def _request_id(value: str) -> str:
    if len(value) > MAX_ID_CHARS or not all(" " < c <= "~" for c in value):
        raise InvalidRequest("request_id", f"at most {MAX_ID_CHARS} printable ASCII characters without spaces, "
                                           f"got {len(value)} characters")
    return value


def _digest(request: gateway_pb2.GenerateRequest) -> str:
    """What a request_id stands for: the request as sent (without the id), so a retry matches its original."""
    copy = gateway_pb2.GenerateRequest()
    copy.CopyFrom(request)
    copy.ClearField("request_id")
    return hashlib.sha256(copy.SerializeToString(deterministic=True)).hexdigest()


class GatewayServicer(gateway_pb2_grpc.GatewayServicer):
    def __init__(self, config: GatewayConfig, store: JobStore, hub: EventHub, runner: JobRunner,
                 health: StageHealth, assets: AssetStore, text_rows: TextRows) -> None:
        self.config, self.limits = config, RequestLimits.from_config(config)
        self.capacity = CapacityTable(config.capacity, config.max_rows)
        self.store, self.hub, self.runner, self.health, self.assets = store, hub, runner, health, assets
        self.text_rows = text_rows
        self.workflows = ServedWorkflows(runner.stages.replicas["dit"])

    async def _submit(self, request: gateway_pb2.GenerateRequest, context) -> gateway_pb2.Job:
        """Validate, admit and persist; the job is durable when this returns. A known request_id returns its job."""
        try:
            request_id = _request_id(request.request_id)
            resolved = resolve_media(request, resolve(request, self.limits), self.assets.get, self.config.geometry)
            await self.workflows.check(resolved.workflow)
            resolved.text_rows = self.text_rows(resolved, referenced_assets(resolved, self.assets.get))
            resolved.total_rows = self.capacity.admit(resolved).total
            job, created = self.store.submit(
                uuid.uuid4().hex[:16], resolved, request_id, _digest(request), self.config.max_unfinished_jobs,
                first_event=gateway_pb2.JobEvent(accepted=gateway_pb2.Accepted(request=resolved)))
        except InvalidRequest as exc:  # OverCapacity included: a retry of the same request is refused again
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except WorkflowNotServed as exc:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        except QueueFull as exc:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        except RequestIdConflict as exc:
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, str(exc))
        if created:
            self.runner.start(job.job_id, resolved)
            log.info("job %s accepted: %dx%d, %d frames, %d steps, seed %d", job.job_id, resolved.height,
                     resolved.width, resolved.num_frames, resolved.num_inference_steps, resolved.seed)
        return job

    async def Submit(self, request, context):
        return await self._submit(request, context)

    async def Generate(self, request, context):
        job = await self._submit(request, context)
        async for event in self.hub.watch(job.job_id):
            yield event

    async def Watch(self, request, context):
        job = await self._job_or_abort(request.job_id, context)
        if request.after_seq < 0:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"after_seq: must be >= 0, got {request.after_seq}")
        async for event in self.hub.watch(job.job_id, request.after_seq):
            yield event

    async def GetJob(self, request, context):
        return await self._job_or_abort(request.job_id, context)

    async def ListJobs(self, request, context):
        page_size = request.page_size or DEFAULT_PAGE_SIZE
        if not 1 <= page_size <= MAX_PAGE_SIZE:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"page_size: must be within 1..{MAX_PAGE_SIZE} (0: {DEFAULT_PAGE_SIZE}), "
                                f"got {request.page_size}")
        unknown = [s for s in request.states if s not in gateway_pb2.JobState.values() or s == 0]
        if unknown:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"states: unknown job state(s) {unknown}; known: 1..{max(gateway_pb2.JobState.values())}")
        token = request.page_token
        if token and not (token.isdigit() and len(token) <= 19):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                "page_token: pass the next_page_token of the previous page unchanged")
        jobs, next_rowid = self.store.list_jobs(list(request.states), page_size, int(token or 0))
        return gateway_pb2.ListJobsResponse(jobs=jobs, next_page_token=str(next_rowid) if next_rowid else "")

    async def CancelJob(self, request, context):
        job = await self._job_or_abort(request.job_id, context)
        if self.runner.cancel(job.job_id):
            async for _ in self.hub.watch(job.job_id):
                pass  # returns once the job has reached its terminal state
        return self.store.get_job(job.job_id)

    async def DownloadArtifact(self, request, context):
        found = self.store.artifact(request.artifact_id) if len(request.artifact_id) <= MAX_ID_CHARS else None
        if found is None or not Path(found[1]).is_file():
            await context.abort(grpc.StatusCode.NOT_FOUND,
                                f"artifact_id: no artifact {request.artifact_id[:MAX_ID_CHARS]!r} (never made, or "
                                f"removed by the retention policy)")
        artifact, path = found
        with open(path, "rb") as file:
            first = True
            while data := file.read(DOWNLOAD_CHUNK):
                chunk = gateway_pb2.ArtifactChunk(data=data)
                if first:
                    chunk.file_name, chunk.total_bytes, first = artifact.file_name, artifact.bytes, False
                yield chunk

    async def Info(self, request, context):
        stages = self.runner.stages
        serving = await self.health.serving()
        counts = self.store.count_by_state()
        info = gateway_pb2.GatewayInfo(
            unfinished_jobs=counts.get(gateway_pb2.JOB_STATE_QUEUED, 0) + counts.get(gateway_pb2.JOB_STATE_RUNNING, 0),
            max_unfinished_jobs=self.config.max_unfinished_jobs, serving=serving)
        for stage, queue in self.runner.queues.items():
            replicas = stages.replicas[REPLICAS_OF.get(stage, stage)]
            info.stages.add(
                stage=stage, queue_depth=queue.depth, busy_workers=queue.busy, workers=queue.workers,
                cache_hit_rate=stages.cache_hit_rate() if stage == "encoder" else 0.0,
                replicas=[gateway_pb2.ReplicaInfo(address=r.address, healthy=r.healthy, in_flight=r.in_flight,
                                                  calls=r.calls, failures=r.failures, last_error=r.last_error)
                          for r in replicas.replicas])
        return info

    async def UploadAsset(self, request_iterator, context):
        try:
            asset = await self.assets.upload(request_iterator, asyncio.to_thread)
        except AssetRefused as exc:
            await context.abort(exc.code, exc.message)
        log.info("asset %s (%s, %s, %d bytes)%s", asset.asset_id[:16], media_pb2.AssetKind.Name(asset.kind),
                 asset.format, asset.bytes, " already stored" if asset.deduplicated else "")
        return asset

    async def _job_or_abort(self, job_id: str, context) -> gateway_pb2.Job:
        job = self.store.get_job(job_id) if len(job_id) <= MAX_ID_CHARS else None
        if job is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"job_id: no job {job_id[:MAX_ID_CHARS]!r}")
        return job


def _resume(store: JobStore, hub: EventHub, runner: JobRunner, config: GatewayConfig, metrics: GatewayMetrics):
    """Queued jobs run; jobs a dead gateway left in flight run again or fail with the reason."""
    recovery = store.recover(config.max_attempts)
    for job_id in recovery.failed:
        log.warning("job %s failed: interrupted by restarts %d times", job_id, config.max_attempts)
    for job_id, request in recovery.rerun:
        runner.start(job_id, request)
    reran = [job_id for job_id, _ in recovery.rerun if store.get_job(job_id).attempts]
    metrics.job_retries.labels("restart").inc(len(reran))
    if recovery.rerun:
        log.info("resumed %d job(s) (%d interrupted in flight)", len(recovery.rerun), len(reran))


async def _retention_loop(runner: JobRunner) -> None:
    while True:
        runner.retention.enforce()
        await asyncio.sleep(RETENTION_PERIOD_S)


def _load_text_rows(config: GatewayConfig) -> TextRows:
    try:
        return TextRows.load(config.model_dir, config.geometry)
    except Exception as exc:
        raise RuntimeError(f"[gateway] model_dir {config.model_dir or '(tiny preset)'!r}: admission counts text rows "
                           f"with the model's tokenizer and processor, which did not load: {exc}") from exc


async def serve_async(config: GatewayConfig) -> None:
    data_dir = Path(config.data_dir)
    store = JobStore(str(data_dir / "jobs.sqlite"))
    metrics = GatewayMetrics()
    hub = EventHub(store)
    stages = StageClients(config, metrics)
    assets = AssetStore(str(data_dir / "assets"), AssetLimits.from_config(config))
    runner = JobRunner(config, store, hub, stages, ArtifactStore(str(data_dir / "artifacts")), metrics, assets)
    text_rows = await asyncio.to_thread(_load_text_rows, config)
    metrics.watch(store.count_by_state, lambda: {name: queue.depth for name, queue in runner.queues.items()})
    service_name = gateway_pb2.DESCRIPTOR.services_by_name["Gateway"].full_name
    health = StageHealth(stages, [service_name])
    interceptors = [BearerTokenInterceptor(config.auth_token)] if config.auth_token else []
    server = grpc.aio.server(interceptors=interceptors, options=[
        ("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", config.max_request_bytes)])
    gateway_pb2_grpc.add_GatewayServicer_to_server(
        GatewayServicer(config, store, hub, runner, health, assets, text_rows), server)
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    enable_reflection(server, [service_name])
    bind(server, f"{config.host}:{config.port}", config.tls_cert, config.tls_key)
    if config.metrics_port:
        metrics.serve(config.metrics_host, config.metrics_port)
    await server.start()
    _resume(store, hub, runner, config, metrics)
    retention = asyncio.get_running_loop().create_task(_retention_loop(runner))
    log.info("gateway on %s:%d (%s); metrics on %s", config.host, config.port,
             "; ".join(f"{stage} {', '.join(config.replicas(stage))}" for stage in stages.replicas),
             f"{config.metrics_host}:{config.metrics_port}" if config.metrics_port else "off")
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    await stop.wait()
    log.info("stopping (grace %.0f s)", GRACE_SECONDS)
    health.stopping = True
    retention.cancel()
    await runner.shutdown()
    await server.stop(GRACE_SECONDS)
    await stages.close()
    store.close()


def serve(config: GatewayConfig) -> None:
    logs.setup("gateway")
    asyncio.run(serve_async(config))
