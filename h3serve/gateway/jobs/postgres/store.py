"""PostgresJobStore: the JobStore on a PostgreSQL database, through psycopg 3's async pool.

Each method is one transaction on a pooled connection. Where SQLite serialises writers by its one file lock,
here the writes that read-then-write take a row lock (`FOR UPDATE` on the job) and submit takes one advisory lock,
so two gateways on one database keep a request_id to one job and the unfinished-job bounds exact. Each stored
event and each cancel request is announced with pg_notify in its own transaction (listen.py), so every gateway's
watchers and the job's holder hear of it on commit.
"""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import replace

from psycopg import AsyncConnection, sql

from h3serve.common.errors import tail
from h3serve.gateway.jobs.postgres import ownership, reads
from h3serve.gateway.jobs.postgres.listen import CANCELS, EVENTS, event_payload
from h3serve.gateway.jobs.postgres.pool import PING_WAIT_S, Pool
from h3serve.gateway.jobs.postgres.schema import MIGRATION_LOCK, MIGRATIONS, VERSION_TABLE
from h3serve.gateway.jobs.progress import advance
from h3serve.gateway.jobs.rows import (
    ARTIFACT_FIELDS,
    DEFAULT_OWNER,
    JOB_FIELDS,
    RECORD_COLUMNS,
    artifact_from_row,
    insert_new_job,
    kept_end,
    new_job_values,
)
from h3serve.gateway.jobs.store import (
    TERMINAL_STATES,
    UNFINISHED_STATES,
    Lease,
    Outgoing,
    Ownership,
    QueueFull,
    RequestIdConflict,
    StoredArtifact,
    Unfinished,
)
from h3serve.gateway.webhooks import event as webhook_event
from h3serve.v1 import gateway_pb2

SUBMIT_LOCK = 0x6833_0002  # pg_advisory_xact_lock key: submits one at a time (the bounds count unfinished jobs)
RETENTION_LOCK = 0x6833_B10B  # pg_try_advisory_xact_lock key: one gateway's retention pass at a time
POOL_SIZE = 8
OPEN_TIMEOUT_S = 10  # seconds (libpq takes whole seconds)


class PostgresJobStore:
    """JobStore (h3serve/gateway/jobs/store.py, where each method is described) on PostgreSQL. Open with `open`."""

    def __init__(self, pool: Pool):
        self._pool = pool  # a server out of reach is StoreUnavailable from every method (pool.py)

    @classmethod
    async def open(cls, url: str, pool_size: int = POOL_SIZE) -> PostgresJobStore:
        """Connect and bring the schema up to date, on one connection first: a server that is down or refuses us
        raises its own error (psycopg.OperationalError) within OPEN_TIMEOUT_S, where the pool would only time out."""
        async with await AsyncConnection.connect(url, connect_timeout=OPEN_TIMEOUT_S) as conn, conn.transaction():
            await _migrate(conn)
        pool = Pool(url, pool_size)
        await pool.open(OPEN_TIMEOUT_S)
        return cls(pool)

    async def close(self) -> None:
        await self._pool.close()

    async def ping(self) -> None:
        async with self._pool.connection(PING_WAIT_S) as conn:
            await conn.execute("SELECT 1")

    async def _rows(self, query: str, params: tuple = ()) -> list[tuple]:
        """One statement in its own transaction."""
        async with self._pool.connection() as conn:
            return await reads.fetch(conn, query, params)

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
        owner = owner or Ownership(DEFAULT_OWNER)
        async with self._pool.connection() as conn, conn.transaction():
            await conn.execute("SELECT pg_advisory_xact_lock(%s)", (SUBMIT_LOCK,))
            if request_id:
                known = await reads.fetch(
                    conn,
                    "SELECT job_id, request_digest FROM jobs WHERE owner = %s AND request_id = %s",
                    (owner.client, request_id),
                )
                if known:
                    if known[0][1] != digest:
                        raise RequestIdConflict(request_id, known[0][0])
                    return await reads.stored_job(conn, known[0][0]), False
            await _check_bounds(conn, owner, max_unfinished)
            now = time.time()
            await conn.execute(
                insert_new_job("%s"),
                new_job_values(job_id, request, now, request_id, digest, owner),
            )
            if first_event is not None:
                await _write_event(conn, job_id, first_event)
            return await reads.stored_job(conn, job_id), True

    async def append_event(
        self, job_id: str, event: gateway_pb2.JobEvent, lease: Lease | None = None
    ) -> gateway_pb2.JobEvent:
        async with self._pool.connection() as conn, conn.transaction():
            await ownership.hold(conn, job_id, lease)
            return await _write_event(conn, job_id, event)

    async def start_attempt(self, job_id: str, lease: Lease | None = None) -> int:
        async with self._pool.connection() as conn, conn.transaction():
            await ownership.hold(conn, job_id, lease)
            if not await _write_state(conn, job_id, gateway_pb2.JOB_STATE_RUNNING, None):
                return 0
            rows = await reads.fetch(
                conn, "UPDATE jobs SET attempts = attempts + 1 WHERE job_id = %s RETURNING attempts", (job_id,)
            )
            return rows[0][0]

    async def requeue(
        self,
        job_id: str,
        event: gateway_pb2.JobEvent,
        count_attempt: bool = True,
        interrupted: str = "",
        count_restart: bool = False,
        lease: Lease | None = None,
    ) -> gateway_pb2.JobEvent | None:
        async with self._pool.connection() as conn, conn.transaction():
            await ownership.hold(conn, job_id, lease)
            if not await _write_state(conn, job_id, gateway_pb2.JOB_STATE_QUEUED, None):
                return None
            await conn.execute(
                "UPDATE jobs SET attempts = GREATEST(attempts - %s, 0), restarts = restarts + %s WHERE job_id = %s",
                (0 if count_attempt else 1, 1 if count_restart else 0, job_id),
            )
            if interrupted:
                await conn.execute(
                    "UPDATE stage_runs SET error = %s WHERE job_id = %s AND finished = 0 AND error = ''",
                    (interrupted, job_id),
                )
            return await _write_event(conn, job_id, event)

    async def finish(
        self, job_id: str, state: int, event: gateway_pb2.JobEvent, lease: Lease | None = None
    ) -> gateway_pb2.JobEvent | None:
        async with self._pool.connection() as conn, conn.transaction():
            await ownership.hold(conn, job_id, lease)
            failed = event.failed if event.HasField("failed") else None
            if not await _write_state(conn, job_id, state, failed):
                return None
            stored = await _write_event(conn, job_id, event)
            await _queue_webhook(conn, job_id, state, stored.time)
            return stored

    async def unfinished(self) -> list[Unfinished]:
        async with self._pool.connection() as conn:
            return await reads.unfinished(conn)

    # Ownership (ownership.py).

    async def claim(self, gateway_id: str, lease_s: float, job_id: str = "") -> Unfinished | None:
        async with self._pool.connection() as conn, conn.transaction():
            claimed = await ownership.claim(conn, gateway_id, lease_s, job_id)
            return replace((await reads.unfinished(conn, claimed[0]))[0], holder=claimed[1]) if claimed else None

    async def renew(self, job_id: str, lease: Lease) -> None:
        async with self._pool.connection() as conn:
            await ownership.hold(conn, job_id, lease)

    async def release(self, job_id: str, lease: Lease) -> None:
        async with self._pool.connection() as conn, conn.transaction():
            await ownership.release(conn, job_id, lease)

    async def expire(self, gateway_id: str) -> int:
        async with self._pool.connection() as conn:
            return await ownership.expire(conn, gateway_id)

    async def request_cancel(self, job_id: str) -> str | None:
        now = time.time()
        async with self._pool.connection() as conn, conn.transaction():
            rows = await reads.fetch(
                conn,
                "UPDATE jobs SET cancel_requested = %s WHERE job_id = %s AND state = ANY(%s) "
                "RETURNING CASE WHEN lease_until >= %s THEN lease_owner ELSE '' END",
                (now, job_id, list(UNFINISHED_STATES), now),
            )
            if rows:  # announced on commit, to the gateway that runs it
                await conn.execute("SELECT pg_notify(%s, %s)", (CANCELS, job_id))
        return rows[0][0] if rows else None

    async def cancel_requested(self, job_id: str) -> bool:
        return bool(await self._rows("SELECT 1 FROM jobs WHERE job_id = %s AND cancel_requested > 0", (job_id,)))

    # Stage records and timings.

    async def stage_enqueued(self, job_id: str, attempt: int, stage: str, lease: Lease | None = None) -> int:
        async with self._pool.connection() as conn, conn.transaction():
            await ownership.hold(conn, job_id, lease)
            rows = await reads.fetch(
                conn,
                "INSERT INTO stage_runs (job_id, attempt, stage, enqueued) VALUES (%s, %s, %s, %s) RETURNING record_id",
                (job_id, attempt, stage, time.time()),
            )
        return rows[0][0]

    async def stage_update(self, record_id: int, lease: Lease | None = None, **values) -> None:
        unknown = set(values) - set(RECORD_COLUMNS)
        if unknown:
            raise ValueError(f"unknown stage record column(s): {', '.join(sorted(unknown))}")
        assignments = sql.SQL(", ").join(sql.SQL("{} = %s").format(sql.Identifier(name)) for name in values)
        async with self._pool.connection() as conn, conn.transaction():
            await ownership.hold_record(conn, record_id, lease)
            await conn.execute(
                sql.SQL("UPDATE stage_runs SET {} WHERE record_id = %s").format(assignments),
                (*values.values(), record_id),
            )

    async def set_stage_seconds(self, job_id: str, stage: str, seconds: float, lease: Lease | None = None) -> None:
        async with self._pool.connection() as conn, conn.transaction():
            await ownership.hold(conn, job_id, lease)
            await conn.execute(
                "INSERT INTO stages (job_id, stage, seconds) VALUES (%s, %s, %s) "
                "ON CONFLICT (job_id, stage) DO UPDATE SET seconds = excluded.seconds",
                (job_id, stage, seconds),
            )

    # Artifacts.

    async def add_artifact(
        self, job_id: str, kind: str, artifact: gateway_pb2.Artifact, key: str, lease: Lease | None = None
    ) -> None:
        values = (job_id, kind, artifact.file_name, key, artifact.bytes, artifact.sha256, artifact.media_type)
        async with self._pool.connection() as conn, conn.transaction():
            await ownership.hold(conn, job_id, lease)
            await conn.execute(
                "INSERT INTO artifacts (artifact_id, job_id, kind, file_name, blob_key, bytes, sha256, media_type, "
                "created) VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s) ON CONFLICT (artifact_id) DO UPDATE SET "
                "job_id = excluded.job_id, kind = excluded.kind, file_name = excluded.file_name, "
                "blob_key = excluded.blob_key, "
                "bytes = excluded.bytes, sha256 = excluded.sha256, media_type = excluded.media_type, "
                "created = excluded.created",
                (artifact.artifact_id, *values, time.time()),
            )

    async def artifact(self, artifact_id: str, client: str | None = None) -> tuple[gateway_pb2.Artifact, str] | None:
        mine, params = reads.owned_by(client)
        rows = await self._rows(
            f"SELECT {ARTIFACT_FIELDS}, blob_key FROM artifacts WHERE artifact_id = %s AND job_id IN "
            f"(SELECT job_id FROM jobs WHERE {mine})",
            (artifact_id, *params),
        )
        if not rows:
            return None
        *fields, key = rows[0]
        return artifact_from_row(fields), key

    async def artifacts_oldest_first(self) -> list[StoredArtifact]:
        rows = await self._rows(
            "SELECT artifact_id, blob_key, bytes, created FROM artifacts ORDER BY created, position"
        )
        return [StoredArtifact(*row) for row in rows]

    async def delete_artifact(self, artifact_id: str) -> None:
        await self._rows("DELETE FROM artifacts WHERE artifact_id = %s RETURNING 1", (artifact_id,))

    @contextlib.asynccontextmanager
    async def retention_turn(self) -> AsyncIterator[bool]:
        """A transaction-level advisory lock, tried, held for the pass: the transaction's end (also a connection
        lost or an error in the pass) lets it go, so no gateway keeps the turn by accident."""
        async with self._pool.connection() as conn, conn.transaction():
            rows = await reads.fetch(conn, "SELECT pg_try_advisory_xact_lock(%s)", (RETENTION_LOCK,))
            yield bool(rows[0][0])

    # Reads.

    async def get_job(self, job_id: str, client: str | None = None) -> gateway_pb2.Job | None:
        async with self._pool.connection() as conn:
            return await reads.job(conn, job_id, client)

    async def list_jobs(
        self,
        states: list[int],
        limit: int,
        cursor: int = 0,
        deleted: bool = False,
        oldest_first: bool = False,
        client: str | None = None,
    ) -> tuple[list[gateway_pb2.Job], int]:
        mine, owner = reads.owned_by(client)
        where, params = [f"deleted {'>' if deleted else '='} 0", mine], list(owner)
        if states:
            where.append("state = ANY(%s)")
            params.append(list(states))
        if cursor > 0:
            where.append(f"position {'>' if oldest_first else '<'} %s")
            params.append(cursor)
        async with self._pool.connection() as conn:
            rows = await reads.fetch(
                conn,
                f"SELECT position, {JOB_FIELDS} FROM jobs WHERE {' AND '.join(where)} "
                f"ORDER BY position {'ASC' if oldest_first else 'DESC'} LIMIT %s",
                (*params, limit + 1),
            )
            jobs = await reads.filled(conn, [row[1:] for row in rows[:limit]], records=False)
        return jobs, (rows[limit - 1][0] if len(rows) > limit else 0)

    async def position(self, job_id: str, client: str | None = None) -> int:
        mine, params = reads.owned_by(client)
        rows = await self._rows(f"SELECT position FROM jobs WHERE job_id = %s AND {mine}", (job_id, *params))
        return rows[0][0] if rows else 0

    async def set_deleted(self, job_id: str, deleted: bool) -> gateway_pb2.Job | None:
        # Only a change of side writes: a second delete keeps the time the job first went to the bin.
        async with self._pool.connection() as conn, conn.transaction():
            await conn.execute(
                "UPDATE jobs SET deleted = %s WHERE job_id = %s AND (deleted > 0) != %s",
                (time.time() if deleted else 0.0, job_id, deleted),
            )
            return await reads.job(conn, job_id)

    async def count_by_state(self, client: str | None = None) -> dict[int, int]:
        mine, params = reads.owned_by(client)
        return dict(await self._rows(f"SELECT state, COUNT(*) FROM jobs WHERE {mine} GROUP BY state", params))

    async def events(self, job_id: str, after_seq: int = 0) -> list[gateway_pb2.JobEvent]:
        async with self._pool.connection() as conn:
            return await reads.events(conn, job_id, after_seq)

    # Uploads' owners.

    async def own_asset(self, asset_id: str, client: str) -> bool:
        rows = await self._rows(
            "INSERT INTO asset_owners VALUES (%s, %s) ON CONFLICT DO NOTHING RETURNING 1", (asset_id, client)
        )
        return bool(rows)

    async def owned_assets(self, asset_ids: list[str], client: str) -> set[str]:
        if not asset_ids:
            return set()
        owners: dict[str, set[str]] = {asset_id: set() for asset_id in asset_ids}
        for asset_id, owner in await self._rows(
            "SELECT asset_id, owner FROM asset_owners WHERE asset_id = ANY(%s)", (list(asset_ids),)
        ):
            owners[asset_id].add(owner)
        return {a for a, who in owners.items() if client in who or (client == DEFAULT_OWNER and not who)}

    # The webhook outbox.

    async def due_webhooks(self, now: float, limit: int, hold_s: float = 0.0) -> list[Outgoing]:
        # Taken under row locks that other gateways skip (not wait for), and moved past hold_s before they are let go:
        # gateways polling at once each get different events.
        async with self._pool.connection() as conn, conn.transaction():
            rows = await reads.fetch(
                conn,
                "SELECT o.event_id, o.job_id, j.owner, j.webhook_url, o.body, o.attempts FROM outbox o JOIN jobs j "
                "USING (job_id) WHERE o.next_at > 0 AND o.next_at <= %s ORDER BY o.next_at LIMIT %s "
                "FOR UPDATE OF o SKIP LOCKED",
                (now, limit),
            )
            if rows and hold_s > 0:
                await conn.execute(
                    "UPDATE outbox SET next_at = %s WHERE event_id = ANY(%s)", (now + hold_s, [row[0] for row in rows])
                )
        return [Outgoing(*row) for row in rows]

    async def webhook_attempted(self, event_id: str, status: int, error: str, delivered: bool, next_at: float) -> None:
        await self._rows(
            "UPDATE outbox SET attempts = attempts + 1, last_status = %s, last_error = %s, delivered_at = %s, "
            "next_at = %s WHERE event_id = %s RETURNING 1",
            (status, "" if delivered else error, time.time() if delivered else 0.0, next_at, event_id),
        )


# The steps a method takes inside its transaction, on its connection.


async def _migrate(conn: AsyncConnection) -> None:
    """The migrations this database has not had, each once, and the store's id on a new one."""
    await conn.execute("SELECT pg_advisory_xact_lock(%s)", (MIGRATION_LOCK,))
    await conn.execute(VERSION_TABLE)
    found = await reads.fetch(conn, "SELECT version FROM schema_version")
    done = found[0][0] if found else 0
    for step in MIGRATIONS[done:]:
        await conn.execute(step)
    if not found:
        await conn.execute("INSERT INTO schema_version VALUES (0)")
        await conn.execute("INSERT INTO store VALUES (%s, %s)", (uuid.uuid4().hex, time.time()))
    await conn.execute("UPDATE schema_version SET version = %s", (len(MIGRATIONS),))


async def _check_bounds(conn: AsyncConnection, owner: Ownership, max_unfinished: int) -> None:
    """QueueFull when the gateway's bound, or the owner's own, on unfinished jobs is reached."""
    states = list(UNFINISHED_STATES)
    if max_unfinished > 0:
        depth = (await reads.fetch(conn, "SELECT COUNT(*) FROM jobs WHERE state = ANY(%s)", (states,)))[0][0]
        if depth >= max_unfinished:
            raise QueueFull(depth, max_unfinished)
    if owner.max_unfinished > 0:
        query = "SELECT COUNT(*) FROM jobs WHERE owner = %s AND state = ANY(%s)"
        own = (await reads.fetch(conn, query, (owner.client, states)))[0][0]
        if own >= owner.max_unfinished:
            raise QueueFull(own, owner.max_unfinished, owner.client)


async def _write_event(conn: AsyncConnection, job_id: str, event: gateway_pb2.JobEvent) -> gateway_pb2.JobEvent:
    """The job's next event, and its progress advanced by it (JobStore.append_event); the job's row stays locked
    to the end of the transaction, so two writers of one job's events take turns."""
    current = await reads.fetch(conn, "SELECT progress FROM jobs WHERE job_id = %s FOR UPDATE", (job_id,))
    if not current:
        raise KeyError(job_id)
    now = time.time()
    seq = await reads.fetch(
        conn,
        "UPDATE jobs SET last_seq = last_seq + 1, updated = %s, progress = %s WHERE job_id = %s RETURNING last_seq",
        (now, advance(current[0][0], event), job_id),
    )
    stored = gateway_pb2.JobEvent()
    stored.CopyFrom(event)
    stored.job_id, stored.seq, stored.time = job_id, seq[0][0], now
    if stored.HasField("failed"):
        stored.failed.message = tail(stored.failed.message)
    rows = await reads.fetch(  # announced on commit, to every gateway's watchers (listen.py)
        conn,
        "INSERT INTO events (job_id, seq, time, event) VALUES (%s, %s, %s, %s) RETURNING log_seq, pg_notify(%s, %s)",
        (job_id, stored.seq, now, stored.SerializeToString(), EVENTS, event_payload(job_id, stored.seq)),
    )
    stored.log_seq = rows[0][0]  # stored blobs lack it: reads take it from the column
    return stored


async def _write_state(conn: AsyncConnection, job_id: str, state: int, error: gateway_pb2.Failed | None) -> bool:
    blob = None if error is None else kept_end(error).SerializeToString()
    rows = await reads.fetch(
        conn,
        "UPDATE jobs SET state = %s, updated = %s, error = COALESCE(%s, error) "
        "WHERE job_id = %s AND NOT state = ANY(%s) RETURNING 1",
        (state, time.time(), blob, job_id, list(TERMINAL_STATES)),
    )
    return bool(rows)


async def _queue_webhook(conn: AsyncConnection, job_id: str, state: int, now: float) -> None:
    """The job's end into the outbox, due now, in the transaction of its terminal state (as SQLite's)."""
    url = await reads.fetch(conn, "SELECT webhook_url FROM jobs WHERE job_id = %s", (job_id,))
    if not url or not url[0][0] or state not in webhook_event.TYPES:
        return
    event_id, event_type = webhook_event.new_id(), webhook_event.TYPES[state]
    await conn.execute(
        "INSERT INTO outbox (event_id, job_id, type, body, next_at) VALUES (%s, %s, %s, %s, %s)",
        (event_id, job_id, event_type, webhook_event.body(event_id, event_type, job_id, now), now),
    )
