"""OpenAI's video objects and create request, mapped onto h3serve's Job and GenerateRequest.

A Video is a job: `status` from its state, `progress` from its step events, `seconds` and `size` from what
runs; the `h3serve` object carries everything a client needs to run it again. The create request takes
OpenAI's fields (prompt, model, seconds, size, input_reference) and h3serve's (workflow, steps, seed,
keyframe and reference asset ids); an unknown field is refused, naming it.
"""

from __future__ import annotations

import json
import re
from typing import Annotated, Literal

import grpc
from google.protobuf.json_format import MessageToDict
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, create_model

from h3serve.gateway.http.errors import ApiError
from h3serve.gateway.webhooks.endpoint import MAX_URL_CHARS
from h3serve.model import adapters, options, rules
from h3serve.v1 import common_pb2, gateway_pb2, media_pb2

MODEL = "minimax-h3"
STATUS = {
    gateway_pb2.JOB_STATE_QUEUED: "queued",
    gateway_pb2.JOB_STATE_RUNNING: "in_progress",
    gateway_pb2.JOB_STATE_SUCCEEDED: "completed",
    gateway_pb2.JOB_STATE_FAILED: "failed",
    gateway_pb2.JOB_STATE_CANCELLED: "cancelled",
}
SIZE = re.compile(r"([1-9][0-9]{0,5})x([1-9][0-9]{0,5})")
WorkflowName = Literal["t2va", "fl2va", "ref2va"]
KindName = Literal["image", "video", "audio"]
WORKFLOWS: dict[WorkflowName, common_pb2.Workflow] = {
    "t2va": common_pb2.WORKFLOW_T2VA,
    "fl2va": common_pb2.WORKFLOW_FL2VA,
    "ref2va": common_pb2.WORKFLOW_REF2VA,
}
KINDS: dict[KindName, media_pb2.AssetKind] = {
    "image": media_pb2.ASSET_KIND_IMAGE,
    "video": media_pb2.ASSET_KIND_VIDEO,
    "audio": media_pb2.ASSET_KIND_AUDIO,
}


def _json_list(value):
    """A form field carries a list as JSON ("[...]") or comma-separated ("turbo4:0.8,style"); a JSON error is a
    ValueError, which pydantic reports against the field."""
    if not isinstance(value, str):
        return value
    return json.loads(value) if value.lstrip().startswith("[") else [item for item in value.split(",") if item]


class ReferenceIn(BaseModel):
    model_config = ConfigDict(extra="forbid")
    asset_id: str
    kind: KindName | None = None


def _adapter(value):
    """An adapter as the CLI writes it, "name[:weight]", or as an object {"name", "weight"}."""
    if isinstance(value, str):
        parsed = adapters.parse(value)  # a ValueError: pydantic names the field
        return {"name": parsed.name, "weight": parsed.weight}
    return value


class AdapterIn(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str
    weight: float = 0.0  # 0: 1.0; the gateway checks the bounds


class VideoFields(BaseModel):
    """POST /v1/videos, as JSON or as a multipart form (values arrive as strings and are converted): the request's
    own fields here, one per request option added from h3serve/model/options.py (`VideoCreate`)."""

    model_config = ConfigDict(extra="forbid")
    prompt: str
    model: str | None = None
    seconds: float | None = None
    size: str | None = None
    workflow: WorkflowName | None = None
    first_frame: str = ""
    last_frame: str = ""
    references: Annotated[list[ReferenceIn], BeforeValidator(_json_list)] = []
    adapters: Annotated[list[Annotated[AdapterIn, BeforeValidator(_adapter)]], BeforeValidator(_json_list)] = []
    # where the job's end is POSTed (docs/webhooks.md), signed with the client's webhook_secret; empty: the client's
    # endpoint, if any
    webhook_url: str = Field("", max_length=MAX_URL_CHARS)

    @classmethod
    def parse(cls, data: dict) -> VideoFields:
        try:
            return cls.model_validate(data)
        except ValidationError as error:
            problem = error.errors()[0]
            field = ".".join(str(part) for part in problem["loc"])
            raise ApiError(grpc.StatusCode.INVALID_ARGUMENT, f"{field}: {problem['msg']}", field) from None


def _option_field(option: options.Option) -> tuple[object, object]:
    """An option's body field: unset by default (a bool: false), its integers within what the wire carries; the
    gateway checks the model's bounds, naming the option."""
    if option.type is bool:
        return bool, Field(False, description=option.help)
    low, high = option.wire_bounds or (None, None)
    return option.type | None, Field(None, ge=low, le=high, description=option.help)


# The adapters are written out above (a name[:weight] string or an object each, a JSON or comma-separated list).
VideoCreate = create_model(
    "VideoCreate",
    __base__=VideoFields,
    **{option.http: _option_field(option) for option in options.OPTIONS if not option.repeated},  # type: ignore[call-overload]
)


def generate_request(body: VideoFields, request_id: str) -> gateway_pb2.GenerateRequest:
    """The gRPC request; the gateway checks every value against the model's rules and the deployment's limits."""
    if body.model not in (None, MODEL):
        raise ApiError(
            grpc.StatusCode.INVALID_ARGUMENT, f"model: this server serves {MODEL!r}, not {body.model!r}", "model"
        )
    request = gateway_pb2.GenerateRequest(
        prompt=body.prompt,
        seconds=body.seconds or 0.0,
        first_frame=body.first_frame,
        last_frame=body.last_frame,
        workflow=WORKFLOWS[body.workflow] if body.workflow is not None else common_pb2.WORKFLOW_UNSPECIFIED,
        request_id=request_id,
        webhook_url=body.webhook_url,
        params=options.params(
            {
                **{option.name: getattr(body, option.http) for option in options.OPTIONS},
                "adapters": [common_pb2.Adapter(name=a.name, weight=a.weight) for a in body.adapters],
            }
        ),
        references=[
            gateway_pb2.ReferenceInput(
                asset_id=r.asset_id, kind=KINDS[r.kind] if r.kind is not None else media_pb2.ASSET_KIND_UNSPECIFIED
            )
            for r in body.references
        ],
    )
    if body.size:
        match = SIZE.fullmatch(body.size)
        if not match:
            raise ApiError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"size: width x height in pixels, e.g. '1344x768', got {body.size!r}",
                "size",
            )
        request.width, request.height = int(match[1]), int(match[2])
    return request


def _seconds(num_frames: int) -> str:
    return f"{num_frames / rules.FPS:.2f}".rstrip("0").rstrip(".")


def _fields(message) -> dict:
    return MessageToDict(message, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)


def _option_values(params: common_pb2.GenerationParams) -> dict:
    """The resolved options under the body's names: what a create body sends to run the same request again."""
    return {
        option.http: [{"name": a.name, "weight": a.weight} for a in params.adapters]
        if option.repeated
        else getattr(params, option.name)
        for option in options.OPTIONS
    }


def video(job: gateway_pb2.Job, keep_s: float = 0.0) -> dict:
    """A job as OpenAI's Video object, plus `deleted_at` and the `h3serve` object. `keep_s`: how long the
    retention policy keeps an artifact (0: for ever), which makes `expires_at`."""
    r = job.request
    finished = job.state in (
        gateway_pb2.JOB_STATE_SUCCEEDED,
        gateway_pb2.JOB_STATE_FAILED,
        gateway_pb2.JOB_STATE_CANCELLED,
    )
    mp4 = next((a for a in job.artifacts if a.media_type == "video/mp4"), None)
    return {
        "id": job.job_id,
        "object": "video",
        "model": MODEL,
        "status": STATUS[job.state],
        "progress": round(100 * job.progress),
        "created_at": int(job.created),
        "completed_at": int(job.updated) if finished else None,
        "expires_at": int(job.updated + keep_s) if mp4 and keep_s else None,  # the MP4 is the job's last write
        "prompt": r.prompt,
        "seconds": _seconds(r.num_frames),
        "size": f"{r.width}x{r.height}",
        "error": {"code": job.error.code_name.lower(), "message": job.error.message}
        if job.state == gateway_pb2.JOB_STATE_FAILED
        else None,
        "deleted_at": int(job.deleted) if job.deleted else None,
        "h3serve": {
            "workflow": common_pb2.Workflow.Name(r.workflow).removeprefix("WORKFLOW_").lower(),
            **_option_values(r.params),
            "num_frames": r.num_frames,
            "width": r.width,
            "height": r.height,
            "first_frame": r.first_frame,
            "last_frame": r.last_frame,
            "references": [
                {
                    "asset_id": ref.asset_id,
                    "kind": media_pb2.AssetKind.Name(ref.kind).removeprefix("ASSET_KIND_").lower(),
                    "label": ref.label,
                }
                for ref in r.references
            ],
            "request_id": job.request_id,
            "file_name": mp4.file_name if mp4 else None,
            "client": job.client,
            "webhook": _fields(job.webhook) if job.HasField("webhook") else None,
        },
    }


def models(info: gateway_pb2.GatewayInfo) -> dict:
    """OpenAI's model list: the one model, with what a request may ask of it in h3serve's own object (the adapters
    as the DiT's Info lists them; None while no DiT replica has said)."""
    adapters = [_fields(adapter) for adapter in info.adapters] if info.adapters_known else None
    served = {
        "adapter_mode": "fused" if any(a.fused for a in info.adapters) else "unfused",
        "adapters": adapters,
        "max_request_adapters": info.max_request_adapters,
    }
    return {"object": "list", "data": [{"id": MODEL, "object": "model", "owned_by": "h3serve", "h3serve": served}]}


def asset(found: gateway_pb2.Asset) -> dict:
    fields = _fields(found)
    fields.pop("asset_id")
    return {
        "id": found.asset_id,
        "object": "asset",
        **fields,
        "bytes": found.bytes,
        "audio_samples": found.audio_samples,
        "kind": media_pb2.AssetKind.Name(found.kind).removeprefix("ASSET_KIND_").lower(),
    }


def event(message: gateway_pb2.JobEvent, progress: float) -> dict:
    """One progress event for SSE: its kind's fields under the kind's name, and the job's progress so far."""
    kind = message.WhichOneof("kind")
    return {
        "seq": message.seq,
        "job_id": message.job_id,
        "time": message.time,
        "kind": kind,
        "progress": round(100 * progress),
        kind: _fields(getattr(message, kind)),
    }
