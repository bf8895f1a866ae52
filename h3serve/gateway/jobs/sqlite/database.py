"""The job store's database: the JobStore methods as plain functions on one SQLite connection (WAL).

Called only from the store's own thread (store.py), in order, so no lock is needed. A read cursor left open
while another connection wrote once locked a database at start-up in the field, so every read is fetched whole and
its cursor closed at once, and every method is its own transaction.

A file no restart can fix is refused at open (Refused, with the way out): one damaged (not a database, or failing
`PRAGMA quick_check`), one another program keeps locked, or one that is not the store this directory held
(identity.py).
"""

from __future__ import annotations

import os
import sqlite3
import time
from contextlib import closing
from dataclasses import replace

from h3serve.common.errors import tail
from h3serve.common.processes import Refused
from h3serve.gateway.jobs.progress import advance
from h3serve.gateway.jobs.rows import insert_new_job, kept_end, new_job_values
from h3serve.gateway.jobs.sqlite import asset_owners, identity, outbox, ownership
from h3serve.gateway.jobs.sqlite.refusals import BUSY_WAIT_S, damaged, locked
from h3serve.gateway.jobs.sqlite.schema import (
    ARTIFACT_FIELDS,
    DEFAULT_OWNER,
    JOB_FIELDS,
    OUTBOX_FIELDS,
    RECORD_COLUMNS,
    SCHEMA,
    artifact_from_row,
    delivery_from_row,
    job_from_row,
    migrate,
    stored_request,
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
from h3serve.v1 import gateway_pb2

DEFAULT_OWNERSHIP = Ownership(DEFAULT_OWNER)
DAMAGED = (sqlite3.SQLITE_NOTADB, sqlite3.SQLITE_CORRUPT)
LOCKED = (sqlite3.SQLITE_BUSY, sqlite3.SQLITE_LOCKED)


class Database:
    """The JobStore methods as plain functions on one connection; called only from the store's thread."""

    def __init__(self, path: str):
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        self._expected_id = identity.expected_id(path)  # before the connection creates a missing file
        self._conn = sqlite3.connect(path, timeout=BUSY_WAIT_S)
        try:
            self._open(path)
        except BaseException:
            self._conn.close()
            raise

    def _open(self, path: str) -> None:
        """Check the file, then bring its schema up to date. Refused: damaged, locked by another program, or not
        the store this directory held."""
        try:
            self._check(path)
            found, had_jobs = identity.stored_id(self._rows), identity.has_jobs_table(self._rows)
            identity.check(path, self._expected_id, found, had_jobs)
            self._rows("PRAGMA journal_mode=WAL")
            self._rows("PRAGMA synchronous=NORMAL")
            self._conn.executescript(f"BEGIN; {SCHEMA} COMMIT;")
            migrate(self._conn, self._rows, self.events)
            store_id = found or self._give_id()
            if store_id != self._expected_id:
                identity.adopt(path, store_id, created_now=not had_jobs)
        except sqlite3.Error as exc:
            code = getattr(exc, "sqlite_errorcode", 0) & 0xFF
            if code in DAMAGED:
                raise Refused(damaged(path, str(exc))) from None
            if code in LOCKED:
                raise Refused(locked(path)) from None
            raise

    def _check(self, path: str) -> None:
        """The file reads as a sound database, and its write lock can be taken (waiting BUSY_WAIT_S for it): a
        program holding it (the sqlite3 shell in a transaction) would otherwise fail the first write much later."""
        found = [row[0] for row in self._rows("PRAGMA quick_check")]
        if found != ["ok"]:
            problems = [line for line in "\n".join(found).splitlines() if not line.startswith("*** in database")]
            raise Refused(damaged(path, "PRAGMA quick_check: " + "; ".join(problems[:3])))
        self._conn.execute("BEGIN IMMEDIATE")
        self._conn.rollback()

    def _give_id(self) -> str:
        store_id = identity.new_id()
        with self._conn:
            self._conn.execute("INSERT INTO store VALUES (?, ?)", (store_id, time.time()))
        return store_id

    def close(self) -> None:
        self._conn.close()

    # Writers hold a transaction (`with self._conn`).

    def _rows(self, sql: str, params: tuple = ()) -> list[tuple]:
        with closing(self._conn.execute(sql, params)) as cursor:
            return cursor.fetchall()

    def _write_event(self, job_id: str, event: gateway_pb2.JobEvent) -> gateway_pb2.JobEvent:
        """The job's next event, and its progress advanced by it (JobStore.append_event)."""
        current = self._rows("SELECT progress FROM jobs WHERE job_id = ?", (job_id,))
        if not current:
            raise KeyError(job_id)
        now = time.time()
        seq = self._rows(
            "UPDATE jobs SET last_seq = last_seq + 1, updated = ?, progress = ? WHERE job_id = ? RETURNING last_seq",
            (now, advance(current[0][0], event), job_id),
        )
        stored = gateway_pb2.JobEvent()
        stored.CopyFrom(event)
        stored.job_id, stored.seq, stored.time = job_id, seq[0][0], now
        if stored.HasField("failed"):
            stored.failed.message = tail(stored.failed.message)
        with closing(
            self._conn.execute(
                "INSERT INTO events VALUES (?, ?, ?, ?)", (job_id, stored.seq, now, stored.SerializeToString())
            )
        ) as cursor:
            assert cursor.lastrowid is not None  # set by the INSERT
            stored.log_seq = cursor.lastrowid  # stored blobs lack it: reads take it from the rowid
        return stored

    def _write_state(self, job_id: str, state: int, error: gateway_pb2.Failed | None) -> bool:
        blob = None if error is None else kept_end(error).SerializeToString()
        with closing(
            self._conn.execute(
                f"UPDATE jobs SET state = ?, updated = ?, error = COALESCE(?, error) "
                f"WHERE job_id = ? AND state NOT IN ({', '.join('?' * len(TERMINAL_STATES))})",
                (state, time.time(), blob, job_id, *TERMINAL_STATES),
            )
        ) as cursor:
            return cursor.rowcount == 1

    # Writes.

    def submit(
        self,
        job_id: str,
        request: gateway_pb2.ResolvedRequest,
        request_id: str = "",
        digest: str = "",
        max_unfinished: int = 0,
        first_event: gateway_pb2.JobEvent | None = None,
        owner: Ownership = DEFAULT_OWNERSHIP,
    ) -> tuple[gateway_pb2.Job, bool]:
        with self._conn:
            if request_id:
                known = self._rows(
                    "SELECT job_id, request_digest FROM jobs WHERE owner = ? AND request_id = ?",
                    (owner.client, request_id),
                )
                if known:
                    if known[0][1] != digest:
                        raise RequestIdConflict(request_id, known[0][0])
                    return self._stored_job(known[0][0]), False
            self._check_bounds(owner, max_unfinished)
            now = time.time()
            self._conn.execute(
                insert_new_job("?"),
                new_job_values(job_id, request, now, request_id, digest, owner),
            )
            if first_event is not None:
                self._write_event(job_id, first_event)
            return self._stored_job(job_id), True

    def _check_bounds(self, owner: Ownership, max_unfinished: int) -> None:
        """QueueFull when the gateway's bound, or the owner's own, on unfinished jobs is reached."""
        unfinished = f"state IN ({', '.join('?' * len(UNFINISHED_STATES))})"
        if max_unfinished > 0:
            depth = self._rows(f"SELECT COUNT(*) FROM jobs WHERE {unfinished}", UNFINISHED_STATES)[0][0]
            if depth >= max_unfinished:
                raise QueueFull(depth, max_unfinished)
        if owner.max_unfinished > 0:
            own = self._rows(
                f"SELECT COUNT(*) FROM jobs WHERE owner = ? AND {unfinished}", (owner.client, *UNFINISHED_STATES)
            )[0][0]
            if own >= owner.max_unfinished:
                raise QueueFull(own, owner.max_unfinished, owner.client)

    def append_event(
        self, job_id: str, event: gateway_pb2.JobEvent, lease: Lease | None = None
    ) -> gateway_pb2.JobEvent:
        with self._conn:
            ownership.hold(self._conn, job_id, lease)
            return self._write_event(job_id, event)

    def add_artifact(
        self, job_id: str, kind: str, artifact: gateway_pb2.Artifact, key: str, lease: Lease | None = None
    ) -> None:
        with self._conn:
            ownership.hold(self._conn, job_id, lease)
            self._conn.execute(
                "INSERT OR REPLACE INTO artifacts VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    artifact.artifact_id,
                    job_id,
                    kind,
                    artifact.file_name,
                    key,
                    artifact.bytes,
                    artifact.sha256,
                    artifact.media_type,
                    time.time(),
                ),
            )

    def set_stage_seconds(self, job_id: str, stage: str, seconds: float, lease: Lease | None = None) -> None:
        # An upsert rather than REPLACE keeps the row id, which orders stages as they first ran.
        with self._conn:
            ownership.hold(self._conn, job_id, lease)
            self._conn.execute(
                "INSERT INTO stages VALUES (?, ?, ?) "
                "ON CONFLICT (job_id, stage) DO UPDATE SET seconds = excluded.seconds",
                (job_id, stage, seconds),
            )

    def start_attempt(self, job_id: str, lease: Lease | None = None) -> int:
        with self._conn:
            ownership.hold(self._conn, job_id, lease)
            if not self._write_state(job_id, gateway_pb2.JOB_STATE_RUNNING, None):
                return 0
            return self._rows("UPDATE jobs SET attempts = attempts + 1 WHERE job_id = ? RETURNING attempts", (job_id,))[
                0
            ][0]

    def requeue(
        self,
        job_id: str,
        event: gateway_pb2.JobEvent,
        count_attempt: bool = True,
        interrupted: str = "",
        count_restart: bool = False,
        lease: Lease | None = None,
    ) -> gateway_pb2.JobEvent | None:
        with self._conn:
            ownership.hold(self._conn, job_id, lease)
            if not self._write_state(job_id, gateway_pb2.JOB_STATE_QUEUED, None):
                return None
            if not count_attempt:
                self._rows("UPDATE jobs SET attempts = MAX(attempts - 1, 0) WHERE job_id = ?", (job_id,))
            if count_restart:
                self._rows("UPDATE jobs SET restarts = restarts + 1 WHERE job_id = ?", (job_id,))
            if interrupted:
                self._rows(
                    "UPDATE stage_runs SET error = ? WHERE job_id = ? AND finished = 0 AND error = ''",
                    (interrupted, job_id),
                )
            return self._write_event(job_id, event)

    def finish(
        self, job_id: str, state: int, event: gateway_pb2.JobEvent, lease: Lease | None = None
    ) -> gateway_pb2.JobEvent | None:
        with self._conn:
            ownership.hold(self._conn, job_id, lease)
            failed = event.failed if event.HasField("failed") else None
            if not self._write_state(job_id, state, failed):
                return None
            stored = self._write_event(job_id, event)
            outbox.queue(self._conn, job_id, state, stored.time)
            return stored

    def set_deleted(self, job_id: str, deleted: bool) -> gateway_pb2.Job | None:
        # Only a change of side writes: a second delete keeps the time the job first went to the bin.
        with self._conn:
            self._conn.execute(
                "UPDATE jobs SET deleted = ? WHERE job_id = ? AND (deleted > 0) != ?",
                (time.time() if deleted else 0.0, job_id, deleted),
            )
            return self._job(job_id)

    def unfinished(self, job_id: str = "") -> list[Unfinished]:
        """Queued and running jobs, oldest first (`job_id`: that one only)."""
        only, params = ("AND job_id = ?", (job_id,)) if job_id else ("", ())
        rows = self._rows(
            "SELECT job_id, state, request, attempts, COALESCE((SELECT stage FROM stage_runs r WHERE "
            "r.job_id = jobs.job_id ORDER BY rowid DESC LIMIT 1), ''), restarts, EXISTS (SELECT 1 FROM stage_runs r "
            "WHERE r.job_id = jobs.job_id AND r.started > 0 AND r.finished = 0 AND r.error = ''), fence "
            f"FROM jobs WHERE state IN (?, ?) {only} ORDER BY created, rowid",
            (*UNFINISHED_STATES, *params),
        )
        return [
            Unfinished(job_id, state, stored_request(request), attempts, stage, restarts, bool(in_stage), fence)
            for job_id, state, request, attempts, stage, restarts, in_stage, fence in rows
        ]

    # Ownership (ownership.py).

    def claim(self, gateway_id: str, lease_s: float, job_id: str = "") -> Unfinished | None:
        with self._conn:
            claimed = ownership.claim(self._conn, gateway_id, lease_s, job_id)
            return replace(self.unfinished(claimed[0])[0], holder=claimed[1]) if claimed else None

    def renew(self, job_id: str, lease: Lease) -> None:
        with self._conn:
            ownership.hold(self._conn, job_id, lease)

    def release(self, job_id: str, lease: Lease) -> None:
        with self._conn:
            ownership.release(self._conn, job_id, lease)

    def expire(self, gateway_id: str) -> int:
        with self._conn:
            return ownership.expire(self._conn, gateway_id)

    def request_cancel(self, job_id: str) -> str | None:
        now = time.time()
        with self._conn:
            rows = self._rows(
                "UPDATE jobs SET cancel_requested = ? WHERE job_id = ? AND state IN (?, ?) "
                "RETURNING CASE WHEN lease_until >= ? THEN lease_owner ELSE '' END",
                (now, job_id, *UNFINISHED_STATES, now),
            )
        return rows[0][0] if rows else None

    def cancel_requested(self, job_id: str) -> bool:
        return bool(self._rows("SELECT 1 FROM jobs WHERE job_id = ? AND cancel_requested > 0", (job_id,)))

    # Stage records: one row per pass of a job through a stage.

    def stage_enqueued(self, job_id: str, attempt: int, stage: str, lease: Lease | None = None) -> int:
        with self._conn:
            ownership.hold(self._conn, job_id, lease)
            with closing(
                self._conn.execute(
                    "INSERT INTO stage_runs (job_id, attempt, stage, enqueued) VALUES (?, ?, ?, ?)",
                    (job_id, attempt, stage, time.time()),
                )
            ) as cur:
                assert cur.lastrowid is not None  # set by the INSERT
                return cur.lastrowid

    def stage_update(self, record_id: int, lease: Lease | None = None, **values) -> None:
        unknown = set(values) - set(RECORD_COLUMNS)
        if unknown:
            raise ValueError(f"unknown stage record column(s): {', '.join(sorted(unknown))}")
        assignments = ", ".join(f"{name} = ?" for name in values)
        with self._conn:
            ownership.hold_record(self._conn, record_id, lease)
            self._conn.execute(f"UPDATE stage_runs SET {assignments} WHERE rowid = ?", (*values.values(), record_id))

    # Artifact retention.

    def artifacts_oldest_first(self) -> list[StoredArtifact]:
        return [
            StoredArtifact(*row)
            for row in self._rows("SELECT artifact_id, blob_key, bytes, created FROM artifacts ORDER BY created, rowid")
        ]

    def delete_artifact(self, artifact_id: str) -> None:
        with self._conn:
            self._conn.execute("DELETE FROM artifacts WHERE artifact_id = ?", (artifact_id,))

    # Reads.

    def artifact(self, artifact_id: str, client: str | None = None) -> tuple[gateway_pb2.Artifact, str] | None:
        mine, params = _owned_by(client)
        rows = self._rows(
            f"SELECT {ARTIFACT_FIELDS}, blob_key FROM artifacts WHERE artifact_id = ? AND job_id IN "
            f"(SELECT job_id FROM jobs WHERE {mine})",
            (artifact_id, *params),
        )
        if not rows:
            return None
        *fields, key = rows[0]
        return artifact_from_row(fields), key

    def get_job(self, job_id: str, client: str | None = None) -> gateway_pb2.Job | None:
        return self._job(job_id, client)

    def _stored_job(self, job_id: str) -> gateway_pb2.Job:
        """A job this transaction has just read or written."""
        job = self._job(job_id)
        assert job is not None
        return job

    def _job(self, job_id: str, client: str | None = None) -> gateway_pb2.Job | None:
        mine, params = _owned_by(client)
        jobs = self._filled(
            self._rows(f"SELECT {JOB_FIELDS} FROM jobs WHERE job_id = ? AND {mine}", (job_id, *params)), records=True
        )
        return jobs[0] if jobs else None

    def _filled(self, rows: list[tuple], records: bool) -> list[gateway_pb2.Job]:
        """Jobs from their rows (JOB_FIELDS), in order, with their artifacts, stage timings and (`records`) stage
        records: one query per table for all of them."""
        if not rows:
            return []
        jobs = {row[0]: job_from_row(row) for row in rows}
        ids = tuple(jobs)
        marks = ", ".join("?" * len(ids))
        for job_id, *fields in self._rows(
            f"SELECT job_id, {ARTIFACT_FIELDS} FROM artifacts WHERE job_id IN "
            f"({marks}) ORDER BY kind != 'video', created",
            ids,
        ):
            jobs[job_id].artifacts.append(artifact_from_row(fields))
        for job_id, stage, seconds in self._rows(
            f"SELECT job_id, stage, seconds FROM stages WHERE job_id IN ({marks}) ORDER BY rowid", ids
        ):
            jobs[job_id].stages.add(stage=stage, seconds=seconds)
        for job_id, *fields in self._rows(f"SELECT job_id, {OUTBOX_FIELDS} FROM outbox WHERE job_id IN ({marks})", ids):
            delivery_from_row(jobs[job_id].webhook, fields)
        if records:
            for job_id, *fields in self._rows(
                f"SELECT job_id, stage, attempt, {', '.join(RECORD_COLUMNS)} FROM "
                f"stage_runs WHERE job_id IN ({marks}) ORDER BY rowid",
                ids,
            ):
                jobs[job_id].stage_records.add(**dict(zip(("stage", "attempt", *RECORD_COLUMNS), fields, strict=True)))
        return list(jobs.values())

    def list_jobs(
        self,
        states: list[int],
        limit: int,
        cursor: int = 0,
        deleted: bool = False,
        oldest_first: bool = False,
        client: str | None = None,
    ) -> tuple[list[gateway_pb2.Job], int]:
        mine, owner = _owned_by(client)
        where, params = [f"deleted {'>' if deleted else '='} 0", mine], list(owner)
        if states:
            where.append(f"state IN ({', '.join('?' * len(states))})")
            params.extend(states)
        if cursor > 0:
            where.append(f"rowid {'>' if oldest_first else '<'} ?")
            params.append(cursor)
        rows = self._rows(
            f"SELECT rowid, {JOB_FIELDS} FROM jobs WHERE {' AND '.join(where)} "
            f"ORDER BY rowid {'ASC' if oldest_first else 'DESC'} LIMIT ?",
            (*params, limit + 1),
        )
        jobs = self._filled([row[1:] for row in rows[:limit]], records=False)
        return jobs, (rows[limit - 1][0] if len(rows) > limit else 0)

    def position(self, job_id: str, client: str | None = None) -> int:
        mine, params = _owned_by(client)
        rows = self._rows(f"SELECT rowid FROM jobs WHERE job_id = ? AND {mine}", (job_id, *params))
        return rows[0][0] if rows else 0

    # Uploads' owners (asset_owners.py).

    def own_asset(self, asset_id: str, client: str) -> bool:
        with self._conn:
            return asset_owners.own(self._conn, asset_id, client)

    def owned_assets(self, asset_ids: list[str], client: str) -> set[str]:
        return asset_owners.owned(self._conn, asset_ids, client)

    # The webhook outbox (outbox.py).

    def due_webhooks(self, now: float, limit: int) -> list[Outgoing]:
        return outbox.due(self._conn, now, limit)

    def webhook_attempted(self, event_id: str, status: int, error: str, delivered: bool, next_at: float) -> None:
        with self._conn:
            outbox.attempted(self._conn, event_id, status, error, delivered, next_at)

    def count_by_state(self, client: str | None = None) -> dict[int, int]:
        mine, params = _owned_by(client)
        return dict(self._rows(f"SELECT state, COUNT(*) FROM jobs WHERE {mine} GROUP BY state", params))

    def events(self, job_id: str, after_seq: int = 0) -> list[gateway_pb2.JobEvent]:
        rows = self._rows(
            "SELECT rowid, event FROM events WHERE job_id = ? AND seq > ? ORDER BY seq", (job_id, after_seq)
        )
        events = []
        for rowid, blob in rows:
            event = gateway_pb2.JobEvent.FromString(blob)
            event.log_seq = rowid
            events.append(event)
        return events


def _owned_by(client: str | None) -> tuple[str, tuple]:
    """A condition on jobs' rows: those of `client` (None: every client's), and its parameters."""
    return ("owner = ?", (client,)) if client is not None else ("1", ())
