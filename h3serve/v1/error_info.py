"""Why a refusal was made, for a door to answer by: google.rpc.ErrorInfo in the rich status.

The wire contract of every door: a request over what the deployment holds (its plan's ceilings or its capacity
table) is INVALID_ARGUMENT like any invalid request, and carries the reason OVER_CAPACITY with the field to change in
the status details (`grpc-status-details-bin`), as Google's APIs mark theirs. The HTTP door answers it 422, the
ceiling table's status in the earlier stacks, and names the field; a gRPC client reads the same reason.
"""

from __future__ import annotations

import grpc
from google.rpc import error_details_pb2

from h3serve.v1 import rich_status

DOMAIN = "h3serve.v1"
OVER_CAPACITY = "OVER_CAPACITY"


def details(code: grpc.StatusCode, message: str, reason: str, field: str) -> tuple[tuple[str, bytes], ...]:
    """The trailing metadata that gives a refusal its reason and field, to pass to `context.abort`."""
    info = error_details_pb2.ErrorInfo(reason=reason, domain=DOMAIN, metadata={"field": field})
    return rich_status.trailing(code, message, info)


def reason(error: grpc.RpcError) -> tuple[str, str] | None:
    """(reason, field) of a refusal marked by `details`; None when it carries none (or is not a call's error)."""
    for info in rich_status.details(error, error_details_pb2.ErrorInfo):
        if info.domain == DOMAIN:
            return info.reason, info.metadata.get("field", "")
    return None
