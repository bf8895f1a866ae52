"""The HTTP door's OpenAPI document says what the door does: every status it answers, with OpenAI's error JSON and
a 429's Retry-After, the create's 422 over the deployment's ceiling, and the constraints the door itself enforces on
its query parameters and the create body.

FastAPI documents only a route's success and its own 422; the door's refusals come from the gateway's statuses
(errors.py) and from checks the routes make by hand, so they are added here, to every operation, from the same
definitions the routes use. tests/test_http_schema.py holds the door to this document with schemathesis.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from h3serve.common.config import GatewayConfig
from h3serve.model.adapters import MAX_SHIFT
from h3serve.model.rules import MAX_SECONDS_EXACT, MIN_SECONDS, MIN_STEPS

ERROR = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type", "param", "code"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"]},
                "code": {"type": ["string", "null"]},
            },
        }
    },
}
# Every refusal the door may answer (errors.py maps the gateway's statuses to these), each as OpenAI's error JSON.
REFUSALS = {
    "400": "the request breaks a rule (the message names the field)",
    "401": "no token, or the wrong one",
    "404": "no such video, asset or artifact",
    "405": "the method is not one of the path's (see Allow)",
    "409": "the Idempotency-Key names another request's video",
    "413": "the body or a field is over its limit",
    "429": "the job queue is full: come back after Retry-After seconds",
    "503": "the gateway's stages are not serving now: try again",
    "507": "the gateway's disk is full (said with the directory and the space left)",
}
# The create's own: a request well formed but over what the deployment holds (errors.py UNPROCESSABLE)
OVER_CAPACITY = {
    "422": "the request is over this deployment's ceiling (its plan's, or its capacity table's): the message gives the "
    "largest it holds at that canvas, `param` the field to change (num_frames, or height when no clip fits the canvas)"
}
RETRY_AFTER = {"Retry-After": {"description": "seconds to wait", "schema": {"type": "integer", "minimum": 0}}}


def install(app: FastAPI, config: GatewayConfig, max_limit: int, size_pattern: str) -> None:
    """Serve the completed document at /openapi.json (built once, on its first request)."""
    app.openapi = _document(app, config, max_limit, size_pattern)  # type: ignore[method-assign]


def _document(app: FastAPI, config: GatewayConfig, max_limit: int, size_pattern: str) -> Callable[[], dict[str, Any]]:
    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, summary=app.summary, routes=app.routes)
            for path, operations in schema["paths"].items():
                for method, operation in operations.items():
                    create = (path, method) == ("/v1/videos", "post")
                    _refusals(operation, {**REFUSALS, **OVER_CAPACITY} if create else REFUSALS)
                    _constraints(path, operation, max_limit)
                    if create:
                        _create_body(operation, config, size_pattern)
            app.openapi_schema = schema
        return app.openapi_schema

    return openapi


def _refusals(operation: dict, refusals: dict[str, str]) -> None:
    responses = operation.setdefault("responses", {})
    responses.pop("422", None)  # FastAPI's validation error: the door parses by hand and answers 400
    for status, description in refusals.items():
        response = {"description": description, "content": {"application/json": {"schema": ERROR}}}
        if status == "429":
            response["headers"] = RETRY_AFTER
        responses.setdefault(status, response)


def _constraints(path: str, operation: dict, max_limit: int) -> None:
    """What the routes check by hand (app.py), said in the schema."""
    query = {
        "limit": {"type": "integer", "minimum": 1, "maximum": max_limit},
        "order": {"type": "string", "enum": ["asc", "desc"]},
        "deleted": {"type": "string", "enum": ["true", "false", "1", "0", ""]},
        "variant": {"type": "string", "enum": ["video"]},
        "after": {"type": "string"},
    }
    for parameter in operation.get("parameters", []):
        if parameter["in"] == "query" and parameter["name"] in query:
            parameter["schema"] = query[parameter["name"]]
    if path == "/healthz":
        operation["responses"]["503"] = {
            "description": "not serving: the job store is out of reach or a stage is down (`reason` says which)",
            "content": {
                "application/json": {"schema": {"type": "object", "properties": {"serving": {}, "reason": {}}}}
            },
        }


def _create_body(operation: dict, config: GatewayConfig, size_pattern: str) -> None:
    """The create body's rules of one field each. The rules across fields (the canvas budget of height x width,
    the keyframes a workflow needs, adapters the DiT serves, an uploaded asset of the right kind) are the
    gateway's, refused with 400 naming the field: no schema says them."""
    fields = operation["requestBody"]["content"]["application/json"]["schema"]["properties"]
    seconds = {"type": "number", "minimum": MIN_SECONDS, "maximum": MAX_SECONDS_EXACT}
    fields["seconds"] = {"anyOf": [seconds, {"const": 0}, {"type": "null"}], "description": "0 or null: the default"}
    fields["size"] = {"anyOf": [{"type": "string", "pattern": f"^{size_pattern}$"}, {"type": "null"}]}
    fields["prompt"].update(minLength=1, maxLength=config.max_prompt_chars, pattern=r"\S")
    steps = {"type": "integer", "minimum": MIN_STEPS, "maximum": config.max_steps}
    fields["steps"] = {"anyOf": [steps, {"const": 0}, {"type": "null"}], "description": "0 or null: the default"}
    shift = {"type": "number", "exclusiveMinimum": 0, "maximum": MAX_SHIFT}
    for name in ("flow_shift", "audio_flow_shift"):
        fields[name] = {"anyOf": [shift, {"type": "null"}]}
