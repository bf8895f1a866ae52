"""The routes: OpenAI's /v1/videos, h3serve's extensions (assets, cancel, restore, events) and the console.

Each route is one or two calls of the gateway's gRPC API with the caller's `authorization` header; a gRPC
error becomes OpenAI's error JSON with the same reason (errors.py).
"""

from __future__ import annotations

import asyncio
import tempfile
from collections.abc import Mapping
from pathlib import Path

import grpc
from fastapi import FastAPI, Request
from fastapi.responses import FileResponse, JSONResponse, StreamingResponse
from fastapi.routing import APIRoute
from fastapi.staticfiles import StaticFiles
from grpc_health.v1 import health_pb2, health_pb2_grpc
from starlette.datastructures import FormData, UploadFile
from starlette.exceptions import HTTPException

from h3serve.common.config import GatewayConfig
from h3serve.common.disk import DiskFull, full_named
from h3serve.gateway.api.health import REASON_KEY
from h3serve.gateway.http import schema, videos
from h3serve.gateway.http.errors import ApiError, error_response, from_api_error, from_http_error, from_rpc_error
from h3serve.gateway.http.events import job_events
from h3serve.gateway.tenants.registry import Tenants
from h3serve.model import rules
from h3serve.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc

CONSOLE = Path(__file__).with_name("console")
UPLOAD_CHUNK = 1 << 20
MAX_LIMIT, DEFAULT_LIMIT = 100, 20
FORM_BYTES = 1 << 20
# FastAPI's own routes: behind the token unless [gateway] open_without_token opens them
DOCS = ("/openapi.json", "/docs")
REVALIDATE = {"cache-control": "no-cache"}


class _ConsoleFiles(StaticFiles):
    """The console's files, revalidated on every load (by ETag), so a browser sees an upgrade at once."""

    def file_response(self, *args, **kwargs):
        response = super().file_response(*args, **kwargs)
        response.headers.update(REVALIDATE)
        return response


def _metadata(request: Request) -> tuple:
    token = request.headers.get("authorization")
    return (("authorization", token),) if token else ()


def _flag(value: str | None, name: str) -> bool:
    if value in (None, "", "false", "0"):
        return False
    if value in ("true", "1"):
        return True
    raise ApiError(grpc.StatusCode.INVALID_ARGUMENT, f"{name}: true or false, got {value!r}", name)


def _limit(value: str | None) -> int:
    if value is None:
        return DEFAULT_LIMIT
    if not value.isascii() or not value.isdigit() or not 1 <= int(value) <= MAX_LIMIT:
        raise ApiError(grpc.StatusCode.INVALID_ARGUMENT, f"limit: 1..{MAX_LIMIT}, got {value!r}", "limit")
    return int(value)


def _allowed(app: FastAPI, request: Request, error: HTTPException) -> Mapping[str, str] | None:
    """The refusal's headers; a 405's Allow lists the methods of every route of the path (the framework names only
    the first route it matched: POST of /v1/videos, not its GET)."""
    if error.status_code != 405:
        return error.headers
    methods = {
        method
        for route in app.routes
        if isinstance(route, APIRoute) and route.path_regex.match(request.url.path)
        for method in route.methods or ()
    }
    return {**(error.headers or {}), "Allow": ", ".join(sorted(methods))}


def _last_event_id(request: Request) -> int:
    value = request.headers.get("last-event-id") or request.query_params.get("after") or "0"
    if not value.isascii() or not value.isdigit():
        raise ApiError(
            grpc.StatusCode.INVALID_ARGUMENT, f"Last-Event-ID: a seq (digits), got {value!r}", "Last-Event-ID"
        )
    return int(value)


async def _form(request: Request, **limits) -> FormData:
    """The request's form (Starlette's `limits`). A file part over 1 MiB is spooled to the temporary directory, which
    a full disk there fails as DiskFull naming it (507), like the gateway's own."""
    with full_named(tempfile.gettempdir()):
        return await request.form(**limits)


async def _file_chunks(upload: UploadFile):
    first = True
    while (data := await upload.read(UPLOAD_CHUNK)) or first:
        yield gateway_pb2.UploadAssetChunk(file_name=(upload.filename or "upload") if first else "", data=data)
        first = False


def _check_length(request: Request, limit: int) -> None:
    """Refuse a body over `limit` before reading it (the gateway's upload limits apply again as it streams)."""
    length = request.headers.get("content-length", "")
    if length.isascii() and length.isdigit() and int(length) > limit:
        raise ApiError(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"the body is {int(length):,} bytes; this server takes at "
            f"most {limit:,} (its largest upload limit plus the form)",
            status=413,
        )


def _check_request_size(request: gateway_pb2.GenerateRequest, config: GatewayConfig) -> None:
    """A GenerateRequest over the public API's message limit (`max_request_bytes`) would never reach the gateway's
    checks: gRPC refuses it with RESOURCE_EXHAUSTED, which reads like a full queue (429, retried for ever by the
    SDKs). Refuse it here as a 400 naming its largest field: a 9 MB prompt is the prompt's rule broken."""
    size, limit = request.ByteSize(), config.max_request_bytes
    if size <= limit:
        return
    names = [field.name for field, _ in request.ListFields()]

    def alone(name: str) -> int:
        part = gateway_pb2.GenerateRequest()
        part.CopyFrom(request)
        for other in names:
            if other != name:
                part.ClearField(other)
        return part.ByteSize()

    largest = max(names, key=alone)
    problem = rules.prompt_problem(request.prompt, config.max_prompt_chars) if largest == "prompt" else None
    param = "adapters" if largest == "params" else largest
    raise ApiError(
        grpc.StatusCode.INVALID_ARGUMENT,
        f"{param}: {problem}"
        if problem
        else f"{param}: {alone(largest):,} bytes; a request takes at most {limit:,} bytes in all (max_request_bytes)",
        param,
    )


def max_body_bytes(config: GatewayConfig) -> int:
    """The largest upload the gateway takes, plus room for the form's other fields."""
    return config.largest_upload_bytes() + FORM_BYTES


def _inlined(schema: dict) -> dict:
    """A pydantic model's JSON schema with its `$defs` references replaced by the definitions (for openapi_extra)."""
    defs = schema.pop("$defs", {})

    def walk(node):
        if isinstance(node, dict):
            if "$ref" in node:
                return walk(dict(defs[node["$ref"].rsplit("/", 1)[-1]]))
            return {key: walk(value) for key, value in node.items()}
        return [walk(item) for item in node] if isinstance(node, list) else node

    return walk(schema)


# The bodies the routes read themselves (JSON or a form), declared so the OpenAPI schema documents them (and a
# schema-driven client or fuzzer sends them).
CREATE_BODY = {
    "requestBody": {
        "required": True,
        "content": {"application/json": {"schema": _inlined(videos.VideoCreate.model_json_schema())}},
    }
}
ASSET_BODY = {
    "requestBody": {
        "required": True,
        "content": {
            "multipart/form-data": {
                "schema": {
                    "type": "object",
                    "required": ["file"],
                    "properties": {"file": {"type": "string", "format": "binary"}},
                }
            }
        },
    }
}


def create_app(
    channel: grpc.aio.Channel, closing: asyncio.Event, config: GatewayConfig, tenants: Tenants | None = None
) -> FastAPI:
    """The door onto the gateway reached through `channel` (the gateway process's private in-process port);
    `closing` ends the open event streams when the door stops; `tenants` decides who reads the API's documents (the
    gRPC calls check every other route's token)."""
    max_body, keep_s = max_body_bytes(config), config.artifact_max_age_s
    gateway = gateway_pb2_grpc.GatewayStub(channel)
    health = health_pb2_grpc.HealthStub(channel)
    app = FastAPI(title="h3serve", summary="MiniMax-H3 through OpenAI's /v1/videos", docs_url="/docs", redoc_url=None)
    app.add_exception_handler(grpc.aio.AioRpcError, lambda request, error: from_rpc_error(error))
    app.add_exception_handler(ApiError, lambda request, error: from_api_error(error))
    app.add_exception_handler(
        HTTPException,
        lambda request, error: from_http_error(error.status_code, error.detail, _allowed(app, request, error)),
    )
    app.add_exception_handler(
        DiskFull, lambda request, error: error_response(grpc.StatusCode.RESOURCE_EXHAUSTED, str(error))
    )

    @app.middleware("http")
    async def documents_behind_token(request: Request, call_next):
        if (
            tenants is not None
            and request.url.path.startswith(DOCS)
            and not tenants.docs_allowed(request.headers.get("authorization"), request.client and request.client.host)
        ):
            return error_response(
                grpc.StatusCode.UNAUTHENTICATED,
                "authorization: this document needs the header 'authorization: Bearer <token>' ([gateway] "
                "open_without_token)",
            )
        return await call_next(request)

    async def upload(file: UploadFile, request: Request) -> gateway_pb2.Asset:
        return await gateway.UploadAsset(_file_chunks(file), metadata=_metadata(request))

    def as_video(found: gateway_pb2.Job) -> dict:
        return videos.video(found, keep_s)

    async def job(video_id: str, request: Request) -> gateway_pb2.Job:
        return await gateway.GetJob(gateway_pb2.GetJobRequest(job_id=video_id), metadata=_metadata(request))

    @app.post("/v1/videos", openapi_extra=CREATE_BODY)
    async def create(request: Request):
        _check_length(request, max_body)
        form = await _body(request, max_field_bytes(config))
        reference = form.pop("input_reference", None)
        body = videos.VideoCreate.parse(form)
        if isinstance(reference, UploadFile):  # OpenAI's image-to-video: the upload is the first keyframe
            body.first_frame = (await upload(reference, request)).asset_id
        elif reference is not None:
            raise ApiError(
                grpc.StatusCode.INVALID_ARGUMENT,
                "input_reference: upload the image as a file; "
                "this server never fetches a URL (or pass an uploaded asset id as first_frame)",
                "input_reference",
            )
        generate = videos.generate_request(body, request.headers.get("idempotency-key", ""))
        _check_request_size(generate, config)
        submitted = await gateway.Submit(generate, metadata=_metadata(request))
        return as_video(submitted)

    @app.get("/v1/videos")
    async def listing(
        request: Request, after: str = "", order: str = "desc", deleted: str | None = None, limit: str | None = None
    ):
        if order not in ("asc", "desc"):
            raise ApiError(grpc.StatusCode.INVALID_ARGUMENT, f"order: asc or desc, got {order!r}", "order")
        page = await gateway.ListJobs(
            gateway_pb2.ListJobsRequest(
                page_size=_limit(limit),
                after_job_id=after,
                oldest_first=order == "asc",
                deleted=_flag(deleted, "deleted"),
            ),
            metadata=_metadata(request),
        )
        data = [as_video(item) for item in page.jobs]
        return {
            "object": "list",
            "data": data,
            "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None,
            "has_more": bool(page.next_page_token),
        }

    @app.get("/v1/videos/{video_id}")
    async def retrieve(video_id: str, request: Request):
        return as_video(await job(video_id, request))

    @app.delete("/v1/videos/{video_id}")
    async def delete(video_id: str, request: Request):
        deleted = await gateway.DeleteJob(gateway_pb2.DeleteJobRequest(job_id=video_id), metadata=_metadata(request))
        return {"id": deleted.job_id, "object": "video.deleted", "deleted": True}

    @app.post("/v1/videos/{video_id}/cancel")
    async def cancel(video_id: str, request: Request):
        return as_video(
            await gateway.CancelJob(gateway_pb2.CancelJobRequest(job_id=video_id), metadata=_metadata(request))
        )

    @app.post("/v1/videos/{video_id}/restore")
    async def restore(video_id: str, request: Request):
        return as_video(
            await gateway.RestoreJob(gateway_pb2.RestoreJobRequest(job_id=video_id), metadata=_metadata(request))
        )

    @app.get("/v1/videos/{video_id}/content")
    async def content(video_id: str, request: Request, variant: str = "video"):
        if variant != "video":
            raise ApiError(
                grpc.StatusCode.INVALID_ARGUMENT, f"variant: only 'video' is made here, got {variant!r}", "variant"
            )
        found = await job(video_id, request)
        mp4 = next((a for a in found.artifacts if a.media_type == "video/mp4"), None)
        if mp4 is None:
            raise ApiError(
                grpc.StatusCode.NOT_FOUND,
                f"video {video_id} is {videos.STATUS[found.state]}: its content exists once it is completed",
            )
        chunks = gateway.DownloadArtifact(
            gateway_pb2.DownloadArtifactRequest(artifact_id=mp4.artifact_id), metadata=_metadata(request)
        )
        received = aiter(chunks)
        first = await anext(received)  # before the 200: a file removed by retention is still a 404

        async def stream():
            yield first.data
            async for chunk in received:
                yield chunk.data

        return StreamingResponse(
            stream(),
            media_type="video/mp4",
            headers={
                "content-length": str(first.total_bytes),
                "content-disposition": f'attachment; filename="{first.file_name}"',
            },
        )

    @app.get("/v1/videos/{video_id}/events")
    async def events(video_id: str, request: Request):
        after = _last_event_id(request)
        await job(video_id, request)  # unknown id or a wrong token: an error status, not an empty stream
        return StreamingResponse(
            job_events(gateway, video_id, after, _metadata(request), closing),
            media_type="text/event-stream",
            headers={"cache-control": "no-cache", "x-accel-buffering": "no"},
        )

    @app.post("/v1/assets", openapi_extra=ASSET_BODY)
    async def assets(request: Request):
        _check_length(request, max_body)
        form = await _form(request)
        file = form.get("file")
        if not isinstance(file, UploadFile):
            raise ApiError(
                grpc.StatusCode.INVALID_ARGUMENT, "file: a multipart file field named 'file' is required", "file"
            )
        return videos.asset(await upload(file, request))

    @app.get("/v1/models")
    async def model_list(request: Request):
        return videos.models(await gateway.Info(common_pb2.InfoRequest(), metadata=_metadata(request)))

    @app.get("/healthz")
    async def healthz():
        call = health.Check(health_pb2.HealthCheckRequest())
        if (await call).status == health_pb2.HealthCheckResponse.SERVING:
            return JSONResponse({"serving": True})
        reason = dict(await call.trailing_metadata()).get(REASON_KEY, "")
        return JSONResponse({"serving": False, "reason": reason}, status_code=503)

    @app.get("/", include_in_schema=False)
    async def console():
        return FileResponse(CONSOLE / "index.html", headers=REVALIDATE)

    app.mount("/console", _ConsoleFiles(directory=CONSOLE), name="console")
    schema.install(app, config, MAX_LIMIT, videos.SIZE.pattern)
    return app


def max_field_bytes(config: GatewayConfig) -> int:
    """The largest form field (not file) the door reads: past the request limit, so that a field over it is read and
    refused by name (`_check_request_size`); a field over this is refused unread, without a name."""
    return 4 * config.max_request_bytes


async def _body(request: Request, max_field: int) -> dict:
    """The create request's fields from JSON or a multipart / urlencoded form, where a repeated field, or one named
    `name[]` (how OpenAI's SDKs send a list), is a list."""
    kind = request.headers.get("content-type", "")
    if kind.startswith(("multipart/form-data", "application/x-www-form-urlencoded")):
        fields: dict[str, list] = {}
        try:
            form = await _form(request, max_part_size=max_field)
        except HTTPException as error:  # Starlette's 400 for a malformed form or a field over `max_field`
            raise ApiError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"the form: {error.detail} (a field takes at most {max_field:,} bytes)",
            ) from None
        for key, value in form.multi_items():
            fields.setdefault(key, []).append(value)
        return {
            key.removesuffix("[]"): values if len(values) > 1 or key.endswith("[]") else values[0]
            for key, values in fields.items()
        }
    try:
        data = await request.json()
    except ValueError as error:
        raise ApiError(
            grpc.StatusCode.INVALID_ARGUMENT, f"the body is not JSON ({error}); send JSON or a multipart form"
        ) from None
    if not isinstance(data, dict):
        raise ApiError(grpc.StatusCode.INVALID_ARGUMENT, "the body must be a JSON object")
    return data
