"""A job's events as Server-Sent Events: `id: <seq>`, `event: <kind>`, `data: <json>`, resumable.

The stream replays the job's stored events from the first, so the progress of each one is the same fold
(h3serve/gateway/jobs/progress.py) whatever the resume point, and sends those after `Last-Event-ID`; then
the live ones, until the terminal event. A reconnecting client therefore sees no gap and no repeat.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator, AsyncIterator

from h3serve.gateway.http.videos import event
from h3serve.gateway.jobs.progress import advance
from h3serve.v1 import gateway_pb2, gateway_pb2_grpc

HEARTBEAT_S = 15.0  # a comment line this often keeps idle proxies from closing a quiet stream


def sse(message: gateway_pb2.JobEvent, progress: float) -> bytes:
    data = json.dumps(event(message, progress), separators=(",", ":"))
    return f"id: {message.seq}\nevent: {message.WhichOneof('kind')}\ndata: {data}\n\n".encode()


async def job_events(
    stub: gateway_pb2_grpc.GatewayStub, job_id: str, after_seq: int, metadata: tuple, closing: asyncio.Event
) -> AsyncIterator[bytes]:
    """The stream of one job; it ends cleanly when `closing` is set (the gateway stops: the client resumes)."""
    progress = 0.0
    call = stub.Watch(gateway_pb2.WatchRequest(job_id=job_id), metadata=metadata)
    beats = _with_heartbeats(aiter(call), closing)
    try:
        async for message in beats:
            if message is None:
                yield b": keep-alive\n\n"
                continue
            progress = advance(progress, message)
            if message.seq > after_seq:
                yield sse(message, progress)
    finally:  # the client went away, the job ended or the door closes: stop the gateway's stream too
        await beats.aclose()
        call.cancel()


async def _with_heartbeats(
    events: AsyncIterator[gateway_pb2.JobEvent], closing: asyncio.Event
) -> AsyncGenerator[gateway_pb2.JobEvent | None, None]:
    """The events, with None after every HEARTBEAT_S without one (the pending read is kept, not cancelled),
    until the events end or `closing` is set."""
    closed = asyncio.ensure_future(closing.wait())
    pending = None
    try:
        while True:
            pending = pending or asyncio.ensure_future(anext(events))
            done, _ = await asyncio.wait({pending, closed}, timeout=HEARTBEAT_S, return_when=asyncio.FIRST_COMPLETED)
            if closed in done:
                return
            if not done:
                yield None
                continue
            message, pending = pending, None
            try:
                yield message.result()
            except StopAsyncIteration:
                return
    finally:
        closed.cancel()
        if pending:
            pending.cancel()
