"""Job events: persisted first, then fanned out to live watchers.

A watcher replays what the store holds and then follows live events, skipping by sequence
number what it has already seen, so attaching at any moment loses and repeats nothing.
"""

from __future__ import annotations

import asyncio
from collections import defaultdict
from collections.abc import AsyncIterator

from h3serve.v1 import gateway_pb2
from gateway.store import JobStore

TERMINAL_EVENTS = {"done", "failed", "cancelled"}


def is_terminal(event: gateway_pb2.JobEvent) -> bool:
    return event.WhichOneof("kind") in TERMINAL_EVENTS


class EventHub:
    def __init__(self, store: JobStore) -> None:
        self.store = store
        self._watchers: dict[str, set[asyncio.Queue]] = defaultdict(set)

    def emit(self, job_id: str, **kind) -> gateway_pb2.JobEvent:
        """Persist one event (e.g. `denoising=Denoising(...)`) and hand it to the job's watchers."""
        event = self.store.append_event(job_id, gateway_pb2.JobEvent(**kind))
        for queue in self._watchers.get(job_id, ()):
            queue.put_nowait(event)
        return event

    async def watch(self, job_id: str) -> AsyncIterator[gateway_pb2.JobEvent]:
        """Every event of the job from the first, live until its terminal event."""
        queue: asyncio.Queue = asyncio.Queue()
        self._watchers[job_id].add(queue)
        try:
            last = 0
            for event in self.store.events(job_id):
                last = event.seq
                yield event
                if is_terminal(event):
                    return
            while True:
                event = await queue.get()
                if event.seq <= last:
                    continue
                last = event.seq
                yield event
                if is_terminal(event):
                    return
        finally:
            self._watchers[job_id].discard(queue)
            if not self._watchers[job_id]:
                del self._watchers[job_id]
