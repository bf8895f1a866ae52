"""A request stream that a service refuses part-way is read to its end before the refusal is sent.

grpc's client reports a call that ends while it is still writing its request stream as INTERNAL "Internal error
from Core", and the server's status is lost: a refusal that is final (INVALID_ARGUMENT), one worth another try
(UNAVAILABLE: a DiT group that is restarting) and a full disk (RESOURCE_EXHAUSTED) would all reach the client as
that. Reading (and dropping) what the client still sends lets it hear the refusal itself. The read is bounded: a
longer rest is cut off, and its sender then sees grpc's INTERNAL.
"""

from __future__ import annotations

from collections.abc import AsyncIterable, Iterable

MAX_DRAIN_BYTES = 1 << 30


def drain(messages: Iterable) -> None:
    read = 0
    for message in messages:
        read += message.ByteSize()
        if read > MAX_DRAIN_BYTES:
            return


async def drain_async(messages: AsyncIterable) -> None:
    read = 0
    async for message in messages:
        read += message.ByteSize()
        if read > MAX_DRAIN_BYTES:
            return
