"""Job events: persisted first, then fanned out to live watchers.

A watcher replays what the store holds and then follows live events, skipping by sequence
number what it has already seen and reading from the store what a live event skipped over, so
attaching at any moment loses and repeats nothing. (A stored event can miss its live hand-out: an
emit cancelled while the store wrote it, as a CancelJob does to a running job's step, stores it
but never publishes it.)
"""

from __future__ import annotations

import asyncio
from collections import defaultdict
from collections.abc import AsyncIterator

from h3serve.gateway.jobs.store import JobStore, Lease
from h3serve.v1 import gateway_pb2

TERMINAL_EVENTS = {"done", "failed", "cancelled"}


def is_terminal(event: gateway_pb2.JobEvent) -> bool:
    return event.WhichOneof("kind") in TERMINAL_EVENTS


class EventHub:
    def __init__(self, store: JobStore) -> None:
        self.store = store
        self._watchers: dict[str, set[asyncio.Queue]] = defaultdict(set)

    async def emit(self, job_id: str, lease: Lease | None = None, **kind) -> gateway_pb2.JobEvent:
        """Persist one event (e.g. `denoising=Denoising(...)`), fenced by `lease` (store.py), and hand it to the
        job's watchers."""
        event = await self.store.append_event(job_id, gateway_pb2.JobEvent(**kind), lease=lease)
        self.publish(event)
        return event

    def publish(self, event: gateway_pb2.JobEvent | None) -> gateway_pb2.JobEvent | None:
        """Hand an already stored event to the job's watchers (None: nothing was stored, nothing to hand)."""
        if event is None:
            return None
        for queue in self._watchers.get(event.job_id, ()):
            queue.put_nowait(event)
        return event

    async def watch(self, job_id: str, after_seq: int = 0) -> AsyncIterator[gateway_pb2.JobEvent]:
        """Every event of the job after `after_seq`, stored ones first, live until its terminal event."""
        queue: asyncio.Queue = asyncio.Queue()
        self._watchers[job_id].add(queue)
        try:
            last = after_seq
            for event in await self.store.events(job_id, after_seq):
                last = event.seq
                yield event
                if is_terminal(event):
                    return
            while True:
                live = await queue.get()
                if live.seq <= last:
                    continue
                missed = await self.store.events(job_id, last) if live.seq > last + 1 else []
                for event in [e for e in missed if e.seq < live.seq] + [live]:
                    last = event.seq
                    yield event
                    if is_terminal(event):
                        return
        finally:
            self._watchers[job_id].discard(queue)
            if not self._watchers[job_id]:
                del self._watchers[job_id]
