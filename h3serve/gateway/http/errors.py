"""gRPC statuses as HTTP statuses and OpenAI's error JSON: {"error": {"message", "type", "param", "code"}}.

A request over the deployment's ceiling is 422 (h3serve/v1/error_info.py). Every 429 says when to come back
(`Retry-After`, whole seconds): the wait the gateway's refusal advises (h3serve/v1/retry_info.py), else the queue's
default; so does a 503 whose refusal advises one (the job store out of reach)."""

from __future__ import annotations

import math
from collections.abc import Mapping

import grpc
from fastapi.responses import JSONResponse

from h3serve.common import disk
from h3serve.gateway.jobs.drain import DEFAULT_WAIT_S
from h3serve.v1 import error_info, retry_info

_HTTP = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.FAILED_PRECONDITION: (400, "invalid_request_error"),
    grpc.StatusCode.UNAUTHENTICATED: (401, "authentication_error"),
    grpc.StatusCode.PERMISSION_DENIED: (403, "permission_error"),
    grpc.StatusCode.NOT_FOUND: (404, "not_found_error"),
    grpc.StatusCode.ALREADY_EXISTS: (409, "conflict_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    grpc.StatusCode.UNAVAILABLE: (503, "server_error"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "server_error"),
}
RETRYABLE = {429, 503, 504}
# gRPC's own RESOURCE_EXHAUSTED for a message over the server's max_receive_message_length ("Received message larger
# than max (N vs. M)"; "Sent ..." on the client's side): the request is too large, which no retry fixes, unlike the
# gateway's RESOURCE_EXHAUSTED for a full job queue (too many), the one 429 worth retrying.
_TOO_LARGE = ("message larger than max",)
# The gateway's RESOURCE_EXHAUSTED for a full disk (its message starts with disk.MARK) is 507 Insufficient Storage,
# never retried: space returns only when someone frees it, and until then every retry fails the same way.
INSUFFICIENT_STORAGE = 507
# The gateway's INVALID_ARGUMENT for a request over the deployment's ceiling (h3serve/v1/error_info.py OVER_CAPACITY:
# its plan or capacity table) is 422, as the ceiling table of the earlier stacks answered: the request is well formed
# but more than this deployment holds; the message gives the ceiling, and no retry of the same request is admitted.
UNPROCESSABLE = 422


def too_large(code: grpc.StatusCode, message: str) -> bool:
    return code == grpc.StatusCode.RESOURCE_EXHAUSTED and any(mark in message for mark in _TOO_LARGE)


def disk_full(code: grpc.StatusCode, message: str) -> bool:
    return code == grpc.StatusCode.RESOURCE_EXHAUSTED and message.startswith(disk.MARK)


def _mapped(code: grpc.StatusCode, message: str) -> tuple[int, str]:
    """The HTTP status and OpenAI error type a gRPC status stands for."""
    if too_large(code, message):
        return 413, "invalid_request_error"
    if disk_full(code, message):
        return INSUFFICIENT_STORAGE, "server_error"
    return _HTTP.get(code, (500, "server_error"))


class ApiError(Exception):
    """A refusal the door itself makes, with the gRPC status it stands for (so it maps like the gateway's)."""

    def __init__(self, code: grpc.StatusCode, message: str, param: str | None = None, status: int | None = None):
        super().__init__(message)
        self.code, self.message, self.param, self.status = code, message, param, status


def error_response(
    code: grpc.StatusCode,
    message: str,
    param: str | None = None,
    status: int | None = None,
    retry_after_s: float | None = None,
) -> JSONResponse:
    """`status` overrides the HTTP status `code` maps to (413: a body over the door's limit); `retry_after_s`: the
    wait a 429 or 503 advises."""
    mapped, kind = _mapped(code, message)
    status = status or mapped
    if status < 500 and kind == "server_error" or status in (400, 413) and kind == "rate_limit_error":
        kind = "invalid_request_error"
    # OpenAI's SDKs retry 409 and every 5xx unless told: only a busy or absent server is worth a retry.
    headers = {"x-should-retry": "true" if status in RETRYABLE else "false"}
    if status == 429:
        headers["retry-after"] = str(math.ceil(DEFAULT_WAIT_S if retry_after_s is None else retry_after_s))
    elif status == 503 and retry_after_s is not None:
        headers["retry-after"] = str(math.ceil(retry_after_s))
    body = {"error": {"message": message, "type": kind, "param": param, "code": code.name.lower()}}
    return JSONResponse(body, status_code=status, headers=headers)


def from_http_error(status: int, detail: str, headers: Mapping[str, str] | None = None) -> JSONResponse:
    """The framework's own refusals (an unknown path, a method not allowed, a malformed form) as OpenAI's error
    JSON too, never retried, with the framework's headers (a 405's Allow)."""
    kind = "server_error" if status >= 500 else "invalid_request_error"
    body = {"error": {"message": str(detail), "type": kind, "param": None, "code": None}}
    return JSONResponse(body, status_code=status, headers={**(headers or {}), "x-should-retry": "false"})


def from_rpc_error(error: grpc.aio.AioRpcError) -> JSONResponse:
    """The gateway's refusal; one over the deployment's ceiling (its ErrorInfo says so) is 422 naming the field."""
    wait_s = retry_info.advised_wait_s(error)
    reason, field = error_info.reason(error) or ("", None)
    status = UNPROCESSABLE if reason == error_info.OVER_CAPACITY else None
    param = field if status else None
    return error_response(error.code(), error.details() or error.code().name, param, status, retry_after_s=wait_s)


def from_api_error(error: ApiError) -> JSONResponse:
    return error_response(error.code, error.message, error.param, error.status)
