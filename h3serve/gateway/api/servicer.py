"""The public gRPC API (h3serve.v1.Gateway): admission, durable jobs, event streams, listings, downloads, Info.

Each call acts for its caller (common/guard.py's `caller()`, a client of h3serve/gateway/tenants/): a job and an
upload belong to the client that made them, and another client's are unknown to it, with the same NOT_FOUND as an
id never made; an admin client reaches every job."""

from __future__ import annotations

import asyncio
import hashlib
import logging
import re
import uuid

import grpc

from h3serve.common.bounds import MAX_ID_CHARS, check_id, shown
from h3serve.common.config import GatewayConfig
from h3serve.common.disk import DiskFull
from h3serve.common.guard import caller
from h3serve.common.streams import drain_async
from h3serve.gateway.admission.capacity import CapacityTable, OverCapacity
from h3serve.gateway.admission.request import RequestLimits, resolve
from h3serve.gateway.admission.served import AdaptersUnknown, ServedWorkflows, WorkflowNotServed
from h3serve.gateway.admission.text_rows import TextRows
from h3serve.gateway.api.health import StageHealth
from h3serve.gateway.assets.store import AssetStore
from h3serve.gateway.assets.validate import AssetRefused
from h3serve.gateway.jobs.events import EventHub
from h3serve.gateway.jobs.runner import JobRunner
from h3serve.gateway.jobs.store import UNFINISHED_STATES, JobStore, Ownership, QueueFull, RequestIdConflict
from h3serve.gateway.tenants.clients import Client
from h3serve.gateway.tenants.registry import DEFAULT_CLIENT, Tenants
from h3serve.gateway.webhooks.endpoint import host_problem, url_problem
from h3serve.model import rules, workflows
from h3serve.model.adapters import AdapterCatalog
from h3serve.model.rules import InvalidRequest
from h3serve.v1 import error_info, gateway_pb2, gateway_pb2_grpc, media_pb2, retry_info

log = logging.getLogger("h3serve.gateway")
DOWNLOAD_CHUNK = 1 << 20
END_POLL_S = 0.1  # a cancel waiting for its job's end looks this often whether a full disk holds it back
MAX_PAGE_SIZE, DEFAULT_PAGE_SIZE = 1000, 100
PAGE_TOKEN = re.compile(r"[0-9]{1,19}")  # a row id: ASCII digits within int64 (str.isdigit also takes "²")
MAX_ROWID = 2**63 - 1


def _page_token(token: str) -> int | None:
    """The row id a next_page_token stands for (0: the first page), or None when it is not one."""
    if not token:
        return 0
    return int(token) if PAGE_TOKEN.fullmatch(token) and int(token) <= MAX_ROWID else None


def _client() -> Client:
    """The caller (the default client where no guard named one: a servicer called directly)."""
    who = caller()
    return who if isinstance(who, Client) else DEFAULT_CLIENT


def _scope() -> str | None:
    """Whose jobs the caller reaches: its own, or every client's (None) for an admin."""
    client = _client()
    return None if client.admin else client.name


def _webhook_url(request: gateway_pb2.GenerateRequest, client: Client, hosts: tuple[str, ...]) -> str:
    """The job's endpoint: the request's, else the client's (empty: none). InvalidRequest for one it cannot have."""
    if not request.webhook_url:
        return client.webhook_url
    if problem := url_problem(request.webhook_url) or host_problem(request.webhook_url, hosts):
        raise InvalidRequest("webhook_url", problem)
    if not client.webhook_secret:
        raise InvalidRequest(
            "webhook_url", f"client {client.name!r} has no webhook_secret in the clients file to sign its events with"
        )
    return request.webhook_url


def _digest(request: gateway_pb2.GenerateRequest) -> str:
    """What a request_id stands for: the request as sent (without the id), so a retry matches its original."""
    copy = gateway_pb2.GenerateRequest()
    copy.CopyFrom(request)
    copy.ClearField("request_id")
    return hashlib.sha256(copy.SerializeToString(deterministic=True)).hexdigest()


class GatewayServicer(gateway_pb2_grpc.GatewayServicer):
    def __init__(
        self,
        config: GatewayConfig,
        store: JobStore,
        hub: EventHub,
        runner: JobRunner,
        health: StageHealth,
        assets: AssetStore,
        text_rows: TextRows,
        capacity: CapacityTable | None = None,  # with the plan's ceilings (gateway/server.py); else the file's bounds
        tenants: Tenants | None = None,
    ) -> None:
        self.config, self.limits = config, RequestLimits.from_config(config)
        self.tenants = tenants
        self.capacity = capacity or CapacityTable(config.capacity, config.max_rows)
        self.store, self.hub, self.runner, self.health, self.assets = store, hub, runner, health, assets
        self.text_rows = text_rows
        self.served = ServedWorkflows(runner.caller.replicas["dit"])

    async def _submit(self, request: gateway_pb2.GenerateRequest, context) -> gateway_pb2.Job:
        """Validate, admit and persist; the job is durable when this returns. A known request_id returns its job."""
        client = _client()
        try:
            request_id = check_id("request_id", request.request_id)
            for field, asset_id in workflows.asset_fields(request):
                check_id(field, asset_id)  # before any refusal echoes it
            assets = await self._owned_assets(workflows.asset_ids(request), client)
            endpoint = _webhook_url(request, client, self.config.webhook_hosts)
            owner = Ownership(client.name, self.tenants.bound(client) if self.tenants else 0, endpoint)
            offer = await self.served.offer()
            catalog = offer.adapters if offer else None
            if catalog is None and request.params.adapters:
                raise AdaptersUnknown(
                    "adapters: no DiT replica is serving now (down or still loading), so the "
                    "adapters cannot be checked nor their recommended steps and shifts applied; "
                    "try again"
                )
            resolved = resolve(request, self.limits, assets.get, AdapterCatalog() if catalog is None else catalog)
            self._check_prompt_tokens(resolved.prompt)
            self.served.check(resolved.workflow, offer)
            resolved.text_rows = self.text_rows(resolved, assets.get)
            resolved.total_rows = self.capacity.admit(resolved).total
            job, created = await self.store.submit(
                uuid.uuid4().hex[:16],
                resolved,
                request_id,
                _digest(request),
                self.config.max_unfinished_jobs,
                first_event=gateway_pb2.JobEvent(accepted=gateway_pb2.Accepted(request=resolved)),
                owner=owner,
            )
        except OverCapacity as exc:  # invalid as any, marked: the HTTP door answers 422 with the ceiling
            code = grpc.StatusCode.INVALID_ARGUMENT
            await context.abort(code, str(exc), error_info.details(code, str(exc), error_info.OVER_CAPACITY, exc.field))
        except InvalidRequest as exc:  # a retry of the same request is refused again
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except WorkflowNotServed as exc:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        except AdaptersUnknown as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        except QueueFull as exc:  # worth a retry: when, from how fast the queue drains
            wait_s = self.runner.drain.wait_s(exc.depth, exc.bound)
            message = f"{exc}; retry in {wait_s} s"
            code = grpc.StatusCode.RESOURCE_EXHAUSTED
            await context.abort(code, message, retry_info.details(code, message, wait_s))
        except DiskFull as exc:  # nothing was written (the transaction rolled back); no retry time: space returns
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))  # only when someone frees it
        except RequestIdConflict as exc:
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, str(exc))
        if created:
            self.runner.start(job.job_id, resolved)
            log.info(
                "job %s accepted: %dx%d, %d frames, %d steps, seed %d",
                job.job_id,
                resolved.height,
                resolved.width,
                resolved.num_frames,
                resolved.params.num_inference_steps,
                resolved.params.seed,
            )
        return job

    async def _owned_assets(self, asset_ids: list[str], client: Client) -> dict[str, gateway_pb2.Asset]:
        """The stored assets among `asset_ids` that `client` uploaded (an admin's: all): another client's upload is
        an unknown asset to it."""
        found = await self.assets.find(asset_ids)
        if client.admin or not found:
            return found
        owned = await self.store.owned_assets(list(found), client.name)
        return {asset_id: asset for asset_id, asset in found.items() if asset_id in owned}

    def _check_prompt_tokens(self, prompt: str) -> None:
        problem = rules.prompt_tokens_problem(self.text_rows.counter.tokens(prompt), self.config.max_prompt_tokens)
        if problem:
            raise InvalidRequest("prompt", problem)

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
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"page_size: must be within 1..{MAX_PAGE_SIZE} (0: {DEFAULT_PAGE_SIZE}), got {request.page_size}",
            )
        unknown = [s for s in request.states if s not in gateway_pb2.JobState.values() or s == 0]
        if unknown:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"states: unknown job state(s) {unknown[:8]}; known: 1..{max(gateway_pb2.JobState.values())}",
            )
        cursor = await self._list_cursor(request, context)
        jobs, next_rowid = await self.store.list_jobs(
            list(request.states),
            page_size,
            cursor,
            deleted=request.deleted,
            oldest_first=request.oldest_first,
            client=_scope(),
        )
        return gateway_pb2.ListJobsResponse(jobs=jobs, next_page_token=str(next_rowid) if next_rowid else "")

    async def _list_cursor(self, request: gateway_pb2.ListJobsRequest, context) -> int:
        """Where a listing continues: after the page_token's row, or after the job named by after_job_id."""
        if request.after_job_id and request.page_token:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, "after_job_id: give either after_job_id or page_token, not both"
            )
        if job_id := request.after_job_id:
            position = await self.store.position(job_id, client=_scope()) if len(job_id) <= MAX_ID_CHARS else 0
            if not position:
                await context.abort(grpc.StatusCode.NOT_FOUND, f"after_job_id: no job {shown(job_id, MAX_ID_CHARS)}")
            return position
        cursor = _page_token(request.page_token)
        if cursor is None:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, "page_token: pass the next_page_token of the previous page unchanged"
            )
        assert cursor is not None  # abort raised
        return cursor

    async def CancelJob(self, request, context):
        job = await self._job_or_abort(request.job_id, context)
        await self._cancel(job.job_id)
        return await self.store.get_job(job.job_id)

    async def DeleteJob(self, request, context):
        job = await self._job_or_abort(request.job_id, context)
        await self._cancel(job.job_id)  # a job in the bin never runs on
        return await self.store.set_deleted(job.job_id, True)

    async def RestoreJob(self, request, context):
        job = await self._job_or_abort(request.job_id, context)
        return await self.store.set_deleted(job.job_id, False)

    async def _cancel(self, job_id: str) -> None:
        """Cancel a queued or running job, wherever it runs, and return once it has reached its terminal state (else
        at once). While a full disk keeps that state from the store, DiskFull says so at once (the guard's
        RESOURCE_EXHAUSTED): the job is stopped, and its end is recorded when space returns."""
        if not await self.runner.request_cancel(job_id):
            return
        ended = asyncio.ensure_future(self._terminal(job_id))
        try:
            while not (await asyncio.wait({ended}, timeout=END_POLL_S))[0]:
                if (full := self.runner.end_waiting(job_id)) is not None:
                    raise full
        finally:
            ended.cancel()

    async def _terminal(self, job_id: str) -> None:
        async for _ in self.hub.watch(job_id):
            pass

    async def DownloadArtifact(self, request, context):
        found = (
            await self.store.artifact(request.artifact_id, client=_scope())
            if len(request.artifact_id) <= MAX_ID_CHARS
            else None
        )
        if found is None or not await asyncio.to_thread(self.runner.artifacts.exists, found[1]):
            await context.abort(
                grpc.StatusCode.NOT_FOUND,
                f"artifact_id: no artifact {shown(request.artifact_id, MAX_ID_CHARS)} (never made, or "
                f"removed by the retention policy)",
            )
        assert found is not None  # context.abort raised otherwise
        artifact, key = found
        file = await asyncio.to_thread(self.runner.artifacts.open, key)
        try:
            first = True
            while data := await asyncio.to_thread(file.read, DOWNLOAD_CHUNK):
                chunk = gateway_pb2.ArtifactChunk(data=data)
                if first:
                    chunk.file_name, chunk.total_bytes, first = artifact.file_name, artifact.bytes, False
                yield chunk
        finally:
            file.close()

    async def Info(self, request, context):
        caller = self.runner.caller
        counts = await self.store.count_by_state(_scope())
        info = gateway_pb2.GatewayInfo(
            unfinished_jobs=sum(counts.get(state, 0) for state in UNFINISHED_STATES),
            max_unfinished_jobs=self.config.max_unfinished_jobs,
            serving=await self.health.serving(),
        )
        offer = await self.served.offer()
        if offer is not None and offer.adapters is not None:
            info.adapters_known, info.max_request_adapters = True, offer.adapters.max_per_request
            info.adapters.extend(offer.adapters.adapters[name].to_info() for name in sorted(offer.adapters.adapters))
        for name, stage in caller.stages.items():
            queue = self.runner.queues[name]
            info.stages.add(
                stage=name,
                queue_depth=queue.depth,
                busy_workers=queue.busy,
                workers=queue.workers,
                cache_hit_rate=stage.cache_hit_rate(),
                replicas=[r.info(name) for r in caller.replicas[stage.service].replicas],
            )
        return info

    async def UploadAsset(self, request_iterator, context):
        try:
            asset = await self.assets.upload(request_iterator)
        except AssetRefused as exc:
            await drain_async(request_iterator)  # so that the client hears the refusal (common/streams.py)
            await context.abort(exc.code, exc.message)
        except DiskFull as exc:
            await drain_async(request_iterator)
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        # deduplicated says whether this client had uploaded it: another client's copy is no business of its own
        asset.deduplicated = not await self.store.own_asset(asset.asset_id, _client().name)
        log.info(
            "asset %s (%s, %s, %d bytes)%s",
            asset.asset_id[:16],
            media_pb2.AssetKind.Name(asset.kind),
            asset.format,
            asset.bytes,
            " already stored" if asset.deduplicated else "",
        )
        return asset

    async def _job_or_abort(self, job_id: str, context) -> gateway_pb2.Job:
        job = await self.store.get_job(job_id, client=_scope()) if len(job_id) <= MAX_ID_CHARS else None
        if job is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"job_id: no job {shown(job_id, MAX_ID_CHARS)}")
        assert job is not None  # abort raised
        return job
