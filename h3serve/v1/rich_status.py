"""The rich status both refusal markers ride on: a google.rpc.Status in `grpc-status-details-bin`.

retry_info.py (when to come back) and error_info.py (why, for a door to answer by) each put one detail message in
it and read theirs back; this module is the packing and unpacking they share.
"""

from __future__ import annotations

from typing import TypeVar

import grpc
from google.protobuf import any_pb2, message
from google.rpc import status_pb2
from grpc_status import rpc_status

Detail = TypeVar("Detail", bound=message.Message)


def trailing(code: grpc.StatusCode, text: str, detail: message.Message) -> tuple[tuple[str, bytes], ...]:
    """The trailing metadata that carries `detail` with the refusal, to pass to `context.abort`."""
    packed = any_pb2.Any()
    packed.Pack(detail)
    status = status_pb2.Status(code=code.value[0], message=text, details=[packed])
    return tuple(rpc_status.to_status(status).trailing_metadata)


def details(error: grpc.RpcError, kind: type[Detail]) -> list[Detail]:
    """The details of type `kind` a refusal carries; none when it carries none (or is not a call's error)."""
    if not isinstance(error, grpc.Call | grpc.aio.AioRpcError):
        return []
    try:
        status = rpc_status.from_call(error)  # type: ignore[arg-type]  # an AioRpcError answers the same methods
    except ValueError:  # details that contradict the status: ignored, as none
        return []
    found = []
    for packed in status.details if status else ():
        detail = kind()
        if packed.Unpack(detail):
            found.append(detail)
    return found
