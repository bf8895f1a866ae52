"""Why a refusal was made, for a door to answer by: google.rpc.ErrorInfo in the rich status.

The wire contract of every door: a request over what the deployment holds (its plan's ceilings or its capacity
table) is INVALID_ARGUMENT like any invalid request, and carries the reason OVER_CAPACITY with the field to change in
the status details (`grpc-status-details-bin`), as Google's APIs mark theirs. The HTTP door answers it 422, the
ceiling table's status in the earlier stacks, and names the field; a gRPC client reads the same reason.
"""

from __future__ import annotations

import grpc
from google.protobuf import any_pb2
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

DOMAIN = "h3serve.v1"
OVER_CAPACITY = "OVER_CAPACITY"


def details(code: grpc.StatusCode, message: str, reason: str, field: str) -> tuple[tuple[str, bytes], ...]:
    """The trailing metadata that gives a refusal its reason and field, to pass to `context.abort`."""
    info = error_details_pb2.ErrorInfo(reason=reason, domain=DOMAIN, metadata={"field": field})
    packed = any_pb2.Any()
    packed.Pack(info)
    status = status_pb2.Status(code=code.value[0], message=message, details=[packed])
    return tuple(rpc_status.to_status(status).trailing_metadata)


def reason(error: grpc.RpcError) -> tuple[str, str] | None:
    """(reason, field) of a refusal marked by `details`; None when it carries none (or is not a call's error)."""
    if not isinstance(error, grpc.Call | grpc.aio.AioRpcError):
        return None
    try:
        status = rpc_status.from_call(error)  # type: ignore[arg-type]  # an AioRpcError answers the same methods
    except ValueError:  # details that contradict the status: ignored, as no reason
        return None
    for packed in status.details if status else ():
        info = error_details_pb2.ErrorInfo()
        if packed.Unpack(info) and info.domain == DOMAIN:
            return info.reason, info.metadata.get("field", "")
    return None
