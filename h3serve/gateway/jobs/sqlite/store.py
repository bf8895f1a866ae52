"""SqliteJobStore: the JobStore on one SQLite file, each method its Database's twin run on the store's own thread.

The event loop never waits on disk: every call is handed to one worker thread that owns the connection
(database.py), in order. A full disk is DiskFull (h3serve/common/disk.py) naming the store's directory; the
transaction it broke is rolled back, so nothing of it is written.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import ParamSpec, TypeVar

from h3serve.common.disk import full_named
from h3serve.gateway.jobs.sqlite.database import DEFAULT_OWNERSHIP, Database
from h3serve.gateway.jobs.store import Lease, Outgoing, Ownership, StoredArtifact, Unfinished
from h3serve.v1 import gateway_pb2

P = ParamSpec("P")
T = TypeVar("T")


class SqliteJobStore:
    """JobStore (h3serve/gateway/jobs/store.py, where each method is described) on one SQLite file. Raises Refused
    at open for a damaged, locked, missing, emptied or foreign file, DiskFull from any method when the disk is full."""

    def __init__(self, path: str):
        self._directory = os.path.dirname(os.path.abspath(path))
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="h3serve-jobstore")
        try:
            self._db = self._thread.submit(self._on_disk, functools.partial(Database, path)).result()
        except BaseException:
            self._thread.shutdown()
            raise

    def _on_disk(self, call: Callable[[], T]) -> T:
        """`call()`, on the store's thread; a full disk is DiskFull naming the store's directory."""
        with full_named(self._directory):
            return call()

    async def _on_thread(self, function: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
        call = functools.partial(function, *args, **kwargs)
        return await asyncio.wrap_future(self._thread.submit(self._on_disk, call))

    async def close(self) -> None:
        await self._on_thread(self._db.close)
        self._thread.shutdown()

    async def ping(self) -> None:
        """A file on this host: nothing to reach (a full disk is DiskFull at the write that meets it)."""

    # Jobs and events.

    async def submit(
        self,
        job_id: str,
        request: gateway_pb2.ResolvedRequest,
        request_id: str = "",
        digest: str = "",
        max_unfinished: int = 0,
        first_event: gateway_pb2.JobEvent | None = None,
        owner: Ownership | None = None,
    ) -> tuple[gateway_pb2.Job, bool]:
        owner = owner or DEFAULT_OWNERSHIP
        return await self._on_thread(
            self._db.submit, job_id, request, request_id, digest, max_unfinished, first_event, owner
        )

    async def append_event(
        self, job_id: str, event: gateway_pb2.JobEvent, lease: Lease | None = None
    ) -> gateway_pb2.JobEvent:
        return await self._on_thread(self._db.append_event, job_id, event, lease)

    async def start_attempt(self, job_id: str, lease: Lease | None = None) -> int:
        return await self._on_thread(self._db.start_attempt, job_id, lease)

    async def requeue(
        self,
        job_id: str,
        event: gateway_pb2.JobEvent,
        count_attempt: bool = True,
        interrupted: str = "",
        count_restart: bool = False,
        lease: Lease | None = None,
    ) -> gateway_pb2.JobEvent | None:
        return await self._on_thread(self._db.requeue, job_id, event, count_attempt, interrupted, count_restart, lease)

    async def finish(
        self, job_id: str, state: int, event: gateway_pb2.JobEvent, lease: Lease | None = None
    ) -> gateway_pb2.JobEvent | None:
        return await self._on_thread(self._db.finish, job_id, state, event, lease)

    async def unfinished(self) -> list[Unfinished]:
        return await self._on_thread(self._db.unfinished)

    # Ownership.

    async def claim(self, gateway_id: str, lease_s: float, job_id: str = "") -> Unfinished | None:
        return await self._on_thread(self._db.claim, gateway_id, lease_s, job_id)

    async def renew(self, job_id: str, lease: Lease) -> None:
        await self._on_thread(self._db.renew, job_id, lease)

    async def release(self, job_id: str, lease: Lease) -> None:
        await self._on_thread(self._db.release, job_id, lease)

    async def expire(self, gateway_id: str) -> int:
        return await self._on_thread(self._db.expire, gateway_id)

    async def request_cancel(self, job_id: str) -> str | None:
        return await self._on_thread(self._db.request_cancel, job_id)

    async def cancel_requested(self, job_id: str) -> bool:
        return await self._on_thread(self._db.cancel_requested, job_id)

    # Stage records and timings.

    async def stage_enqueued(self, job_id: str, attempt: int, stage: str, lease: Lease | None = None) -> int:
        return await self._on_thread(self._db.stage_enqueued, job_id, attempt, stage, lease)

    async def stage_update(self, record_id: int, lease: Lease | None = None, **values) -> None:
        await self._on_thread(self._db.stage_update, record_id, lease, **values)

    async def set_stage_seconds(self, job_id: str, stage: str, seconds: float, lease: Lease | None = None) -> None:
        await self._on_thread(self._db.set_stage_seconds, job_id, stage, seconds, lease)

    # Artifacts.

    async def add_artifact(
        self, job_id: str, kind: str, artifact: gateway_pb2.Artifact, key: str, lease: Lease | None = None
    ) -> None:
        await self._on_thread(self._db.add_artifact, job_id, kind, artifact, key, lease)

    async def artifact(self, artifact_id: str, client: str | None = None) -> tuple[gateway_pb2.Artifact, str] | None:
        return await self._on_thread(self._db.artifact, artifact_id, client)

    async def artifacts_oldest_first(self) -> list[StoredArtifact]:
        return await self._on_thread(self._db.artifacts_oldest_first)

    async def delete_artifact(self, artifact_id: str) -> None:
        await self._on_thread(self._db.delete_artifact, artifact_id)

    @contextlib.asynccontextmanager
    async def retention_turn(self) -> AsyncIterator[bool]:
        yield True  # one gateway uses a SQLite store (its data_dir lock): always its turn

    # Reads.

    async def get_job(self, job_id: str, client: str | None = None) -> gateway_pb2.Job | None:
        return await self._on_thread(self._db.get_job, job_id, client)

    async def list_jobs(
        self,
        states: list[int],
        limit: int,
        cursor: int = 0,
        deleted: bool = False,
        oldest_first: bool = False,
        client: str | None = None,
    ) -> tuple[list[gateway_pb2.Job], int]:
        return await self._on_thread(self._db.list_jobs, states, limit, cursor, deleted, oldest_first, client)

    async def position(self, job_id: str, client: str | None = None) -> int:
        return await self._on_thread(self._db.position, job_id, client)

    async def set_deleted(self, job_id: str, deleted: bool) -> gateway_pb2.Job | None:
        return await self._on_thread(self._db.set_deleted, job_id, deleted)

    async def count_by_state(self, client: str | None = None) -> dict[int, int]:
        return await self._on_thread(self._db.count_by_state, client)

    async def events(self, job_id: str, after_seq: int = 0) -> list[gateway_pb2.JobEvent]:
        return await self._on_thread(self._db.events, job_id, after_seq)

    # Uploads' owners.

    async def own_asset(self, asset_id: str, client: str) -> bool:
        return await self._on_thread(self._db.own_asset, asset_id, client)

    async def owned_assets(self, asset_ids: list[str], client: str) -> set[str]:
        return await self._on_thread(self._db.owned_assets, asset_ids, client)

    # The webhook outbox.

    async def due_webhooks(self, now: float, limit: int, hold_s: float = 0.0) -> list[Outgoing]:
        return await self._on_thread(self._db.due_webhooks, now, limit)  # one gateway's: nothing to take from others

    async def webhook_attempted(self, event_id: str, status: int, error: str, delivered: bool, next_at: float) -> None:
        await self._on_thread(self._db.webhook_attempted, event_id, status, error, delivered, next_at)
