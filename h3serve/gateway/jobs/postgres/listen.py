"""What other gateways on one PostgreSQL store announce: stored events and cancel requests, heard on LISTEN.

The store announces each event it stores (EVENTS, "seq job_id") and each cancel request (CANCELS, the job id) with
pg_notify in the transaction that writes it, so PostgreSQL delivers the announcement on commit, never for a write
rolled back. Each gateway keeps one connection listening on both channels (`Listener`) and hands every
announcement on. A dropped connection is opened again with backoff; announcements made while it was down are lost,
so each time it listens again it calls `on_listening`: what depends on them re-reads the store (the event hub's
watchers, from their last seq).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import psycopg
from psycopg import AsyncConnection

from h3serve.common.errors import describe

log = logging.getLogger("h3serve.gateway.jobs")
EVENTS = "h3serve_events"  # payload: "seq job_id" of one stored event
CANCELS = "h3serve_cancels"  # payload: the job id a cancel was requested for
APPLICATION_NAME = "h3serve listener"
CONNECT_TIMEOUT_S = 10  # seconds (libpq takes whole seconds)
PROBE_S = 30.0  # how often the connection is asked `SELECT 1`: one cut without a word ends there
PROBE_TIMEOUT_S = 10.0
FIRST_BACKOFF_S, MAX_BACKOFF_S = 0.2, 10.0  # reconnecting after a drop: doubling from the first, up to the most


def event_payload(job_id: str, seq: int) -> str:
    return f"{seq} {job_id}"


def parse_event(payload: str) -> tuple[str, int]:
    """(job id, seq) of an EVENTS payload."""
    seq, job_id = payload.split(" ", 1)
    return job_id, int(seq)


class Listener:
    """One LISTEN connection to the store's database, named `APPLICATION_NAME` and the gateway's id in
    pg_stat_activity: `on_event(job_id, seq)` for each stored event, `on_cancel(job_id)` for each cancel request,
    `on_listening()` each time it listens (again). `start` and `stop` with the gateway."""

    def __init__(
        self,
        url: str,
        gateway_id: str,
        on_event: Callable[[str, int], None],
        on_cancel: Callable[[str], object],
        on_listening: Callable[[], None],
    ):
        self.url, self.name = url, f"{APPLICATION_NAME} {gateway_id}"
        self.on_event, self.on_cancel, self.on_listening = on_event, on_cancel, on_listening
        self._task: asyncio.Task | None = None
        self.listening = asyncio.Event()  # set while LISTEN holds (what a test waits for after cutting it)

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="store-listener")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def _run(self) -> None:
        backoff = FIRST_BACKOFF_S
        while True:
            try:
                async with await AsyncConnection.connect(
                    self.url, autocommit=True, connect_timeout=CONNECT_TIMEOUT_S, application_name=self.name
                ) as conn:
                    await conn.execute(f"LISTEN {EVENTS}; LISTEN {CANCELS}")
                    backoff = FIRST_BACKOFF_S
                    self.listening.set()
                    self.on_listening()
                    await self._hear(conn)
            except (psycopg.Error, OSError, TimeoutError) as exc:
                log.warning("listening to the job store: %s; again in %g s", describe(exc, lines=1), backoff)
            finally:
                self.listening.clear()
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, MAX_BACKOFF_S)

    async def _hear(self, conn: AsyncConnection) -> None:
        """Hand on announcements until the connection fails (raises)."""
        while True:
            async for notify in conn.notifies(timeout=PROBE_S):
                self._hand_on(notify.channel, notify.payload)
            await asyncio.wait_for(conn.execute("SELECT 1"), PROBE_TIMEOUT_S)

    def _hand_on(self, channel: str, payload: str) -> None:
        try:
            if channel == EVENTS:
                self.on_event(*parse_event(payload))
            elif channel == CANCELS:
                self.on_cancel(payload)
        except Exception:  # one bad announcement must not stop the others
            log.exception("announcement %r on %s", payload, channel)
