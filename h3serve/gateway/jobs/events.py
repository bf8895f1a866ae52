"""Job events: persisted first, then fanned out to live watchers.

A watcher replays what the store holds and then follows live events, skipping by sequence
number what it has already seen and reading from the store what a live event skipped over, so
attaching at any moment loses and repeats nothing. (A stored event can miss its live hand-out: an
emit cancelled while the store wrote it, as a CancelJob does to a running job's step, stores it
but never publishes it.)

Events stored by another gateway on the same store reach the hub only as an announcement, the job and the seq
(`announced`, from h3serve/gateway/jobs/postgres/listen.py): its watchers then read the store from their last seq.
When announcements may have been lost (the listening connection was down), `reread` has every watcher read the store
again. On SQLite, one gateway, nothing is announced and only this process's events are fanned out.
"""

from __future__ import annotations

import asyncio
import sys
from collections import defaultdict
from collections.abc import AsyncIterator

from h3serve.gateway.jobs.store import JobStore, Lease
from h3serve.v1 import gateway_pb2

TERMINAL_EVENTS = {"done", "failed", "cancelled"}
ANY_NEWER = sys.maxsize  # an announcement of no particular seq: read the store for whatever came after the last
# What a watcher's queue carries: an event stored here (with its content), or the seq of one stored elsewhere.
Live = gateway_pb2.JobEvent | int


def is_terminal(event: gateway_pb2.JobEvent) -> bool:
    return event.WhichOneof("kind") in TERMINAL_EVENTS


class EventHub:
    def __init__(self, store: JobStore) -> None:
        self.store = store
        self._watchers: dict[str, set[asyncio.Queue[Live]]] = defaultdict(set)

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
        self._hand(event.job_id, event)
        return event

    def announced(self, job_id: str, seq: int) -> None:
        """The job's event `seq` is in the store (written by any gateway): its watchers read it from there."""
        self._hand(job_id, seq)

    def reread(self) -> None:
        """Every watcher reads the store again from its last seq (announcements may have been lost)."""
        for job_id in list(self._watchers):
            self._hand(job_id, ANY_NEWER)

    def _hand(self, job_id: str, live: Live) -> None:
        for queue in self._watchers.get(job_id, ()):
            queue.put_nowait(live)

    async def watch(self, job_id: str, after_seq: int = 0) -> AsyncIterator[gateway_pb2.JobEvent]:
        """Every event of the job after `after_seq`, stored ones first, live until its terminal event."""
        queue: asyncio.Queue[Live] = asyncio.Queue()
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
                seq = live if isinstance(live, int) else live.seq
                if seq <= last:
                    continue
                # The next event itself, or (one skipped over, or only announced) all the store holds after `last`.
                news = (
                    [live] if seq == last + 1 and not isinstance(live, int) else await self.store.events(job_id, last)
                )
                for event in news:
                    last = event.seq
                    yield event
                    if is_terminal(event):
                        return
        finally:
            self._watchers[job_id].discard(queue)
            if not self._watchers[job_id]:
                del self._watchers[job_id]
