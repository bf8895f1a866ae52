"""When to come back: a refusal worth retrying carries google.rpc.RetryInfo in its rich status.

The wire contract of every door: a queue-full RESOURCE_EXHAUSTED carries the wait in the status details
(`grpc-status-details-bin`, a google.rpc.Status holding a RetryInfo), as Google's APIs do; the HTTP door turns it
into `Retry-After`, the client waits it out. A refusal without one (a size or validation refusal, a full disk) is
not worth a retry.
"""

from __future__ import annotations

import math

import grpc
from google.protobuf import duration_pb2
from google.rpc import error_details_pb2

from h3serve.v1 import rich_status


def details(code: grpc.StatusCode, message: str, wait_s: float) -> tuple[tuple[str, bytes], ...]:
    """The trailing metadata that gives a refusal its retry time, to pass to `context.abort`."""
    retry = error_details_pb2.RetryInfo(retry_delay=duration_pb2.Duration(seconds=math.ceil(wait_s)))
    return rich_status.trailing(code, message, retry)


def advised_wait_s(error: grpc.RpcError) -> float | None:
    """The wait a refusal advises, in seconds; None when it advises none (or is not a call's error)."""
    for retry in rich_status.details(error, error_details_pb2.RetryInfo):
        return retry.retry_delay.seconds + retry.retry_delay.nanos / 1e9
    return None
