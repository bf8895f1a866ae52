"""Durable job store: jobs, their event logs, artifacts and stage timings in one SQLite file (WAL).

One connection shared by all threads behind one lock. A read cursor left open while another connection wrote
once locked the database at start-up, so every read is fetched whole and its cursor closed at once, and every
write is its own transaction.
"""

from __future__ import annotations

import os
import sqlite3
import threading
import time
from contextlib import closing

import grpc

from h3serve.v1 import gateway_pb2
from services.common.errors import tail

TERMINAL_STATES = (gateway_pb2.JOB_STATE_SUCCEEDED, gateway_pb2.JOB_STATE_FAILED, gateway_pb2.JOB_STATE_CANCELLED)
_UNFINISHED_STATES = (gateway_pb2.JOB_STATE_QUEUED, gateway_pb2.JOB_STATE_RUNNING)

_SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
    job_id TEXT PRIMARY KEY, state INTEGER NOT NULL, request BLOB NOT NULL,
    created REAL NOT NULL, updated REAL NOT NULL, error BLOB, last_seq INTEGER NOT NULL DEFAULT 0);
CREATE TABLE IF NOT EXISTS events (
    job_id TEXT NOT NULL, seq INTEGER NOT NULL, time REAL NOT NULL, event BLOB NOT NULL,
    PRIMARY KEY (job_id, seq));
CREATE TABLE IF NOT EXISTS artifacts (
    artifact_id TEXT PRIMARY KEY, job_id TEXT NOT NULL, kind TEXT NOT NULL, file_name TEXT NOT NULL,
    path TEXT NOT NULL, bytes INTEGER NOT NULL, sha256 TEXT NOT NULL, media_type TEXT NOT NULL, created REAL NOT NULL);
CREATE INDEX IF NOT EXISTS artifacts_by_job ON artifacts (job_id);
CREATE TABLE IF NOT EXISTS stages (
    job_id TEXT NOT NULL, stage TEXT NOT NULL, seconds REAL NOT NULL, PRIMARY KEY (job_id, stage));
"""


def _kept_end(failed: gateway_pb2.Failed) -> gateway_pb2.Failed:
    """A copy whose message is cut from the front: the cause of an error is at its end."""
    trimmed = gateway_pb2.Failed()
    trimmed.CopyFrom(failed)
    trimmed.message = tail(failed.message)
    return trimmed


class JobStore:
    def __init__(self, path: str):
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        self._lock = threading.Lock()
        self._conn = sqlite3.connect(path, check_same_thread=False)
        with self._lock:
            self._rows("PRAGMA journal_mode=WAL")
            self._rows("PRAGMA synchronous=NORMAL")
            self._conn.executescript(f"BEGIN; {_SCHEMA} COMMIT;")

    def close(self) -> None:
        with self._lock:
            self._conn.close()

    # Callers hold self._lock; writers also hold a transaction (`with self._conn`).

    def _rows(self, sql: str, params: tuple = ()) -> list[tuple]:
        with closing(self._conn.execute(sql, params)) as cursor:
            return cursor.fetchall()

    def _write_event(self, job_id: str, event: gateway_pb2.JobEvent) -> gateway_pb2.JobEvent:
        now = time.time()
        seq = self._rows("UPDATE jobs SET last_seq = last_seq + 1, updated = ? WHERE job_id = ? RETURNING last_seq",
                         (now, job_id))
        if not seq:
            raise KeyError(job_id)
        stored = gateway_pb2.JobEvent()
        stored.CopyFrom(event)
        stored.job_id, stored.seq, stored.time = job_id, seq[0][0], now
        if stored.HasField("failed"):
            stored.failed.message = tail(stored.failed.message)
        self._conn.execute("INSERT INTO events VALUES (?, ?, ?, ?)",
                           (job_id, stored.seq, now, stored.SerializeToString()))
        return stored

    def _write_state(self, job_id: str, state: int, error: gateway_pb2.Failed | None) -> bool:
        blob = None if error is None else _kept_end(error).SerializeToString()
        with closing(self._conn.execute(
                f"UPDATE jobs SET state = ?, updated = ?, error = COALESCE(?, error) "
                f"WHERE job_id = ? AND state NOT IN ({', '.join('?' * len(TERMINAL_STATES))})",
                (state, time.time(), blob, job_id, *TERMINAL_STATES))) as cursor:
            return cursor.rowcount == 1

    # Writes.

    def create_job(self, job_id: str, request: gateway_pb2.ResolvedRequest) -> gateway_pb2.Job:
        now = time.time()
        with self._lock, self._conn:
            self._conn.execute("INSERT INTO jobs (job_id, state, request, created, updated) VALUES (?, ?, ?, ?, ?)",
                               (job_id, gateway_pb2.JOB_STATE_QUEUED, request.SerializeToString(), now, now))
        return gateway_pb2.Job(job_id=job_id, state=gateway_pb2.JOB_STATE_QUEUED, request=request,
                               created=now, updated=now)

    def append_event(self, job_id: str, event: gateway_pb2.JobEvent) -> gateway_pb2.JobEvent:
        """Store the event as the job's next seq, stamped now; returns the stored copy. KeyError: unknown job."""
        with self._lock, self._conn:
            return self._write_event(job_id, event)

    def set_state(self, job_id: str, state: int, error: gateway_pb2.Failed | None = None) -> bool:
        """False when the job is unknown or already terminal: a finished job never changes again."""
        with self._lock, self._conn:
            return self._write_state(job_id, state, error)

    def add_artifact(self, job_id: str, kind: str, artifact: gateway_pb2.Artifact, path: str) -> None:
        with self._lock, self._conn:
            self._conn.execute(
                "INSERT OR REPLACE INTO artifacts VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (artifact.artifact_id, job_id, kind, artifact.file_name, path, artifact.bytes, artifact.sha256,
                 artifact.media_type, time.time()))

    def set_stage_seconds(self, job_id: str, stage: str, seconds: float) -> None:
        # An upsert rather than REPLACE keeps the row id, which orders stages as they first ran.
        with self._lock, self._conn:
            self._conn.execute("INSERT INTO stages VALUES (?, ?, ?) "
                               "ON CONFLICT (job_id, stage) DO UPDATE SET seconds = excluded.seconds",
                               (job_id, stage, seconds))

    def fail_interrupted(self, reason: str) -> list[str]:
        """At start-up: jobs a previous gateway left queued or running can never finish; fail them with `reason`."""
        failed = gateway_pb2.Failed(code=grpc.StatusCode.ABORTED.value[0], code_name="ABORTED", message=reason)
        with self._lock, self._conn:
            ids = [row[0] for row in self._rows(
                "SELECT job_id FROM jobs WHERE state IN (?, ?) ORDER BY created", _UNFINISHED_STATES)]
            for job_id in ids:
                self._write_state(job_id, gateway_pb2.JOB_STATE_FAILED, failed)
                self._write_event(job_id, gateway_pb2.JobEvent(failed=failed))
        return ids

    # Reads.

    def artifact(self, artifact_id: str) -> tuple[gateway_pb2.Artifact, str] | None:
        with self._lock:
            rows = self._rows("SELECT artifact_id, file_name, bytes, sha256, media_type, path FROM artifacts "
                              "WHERE artifact_id = ?", (artifact_id,))
        if not rows:
            return None
        *fields, path = rows[0]
        return _artifact(fields), path

    def get_job(self, job_id: str) -> gateway_pb2.Job | None:
        with self._lock:
            jobs = self._rows("SELECT state, request, created, updated, error, last_seq FROM jobs WHERE job_id = ?",
                              (job_id,))
            artifacts = self._rows("SELECT artifact_id, file_name, bytes, sha256, media_type FROM artifacts "
                                   "WHERE job_id = ? ORDER BY kind != 'video', created", (job_id,))
            stages = self._rows("SELECT stage, seconds FROM stages WHERE job_id = ? ORDER BY rowid", (job_id,))
        if not jobs:
            return None
        state, request, created, updated, error, last_seq = jobs[0]
        job = gateway_pb2.Job(
            job_id=job_id, state=state, request=gateway_pb2.ResolvedRequest.FromString(request),
            created=created, updated=updated, last_event_seq=last_seq,
            artifacts=[_artifact(row) for row in artifacts],
            stages=[gateway_pb2.StageTiming(stage=stage, seconds=seconds) for stage, seconds in stages])
        if error is not None:
            job.error.ParseFromString(error)
        return job

    def events(self, job_id: str, after_seq: int = 0) -> list[gateway_pb2.JobEvent]:
        with self._lock:
            rows = self._rows("SELECT event FROM events WHERE job_id = ? AND seq > ? ORDER BY seq", (job_id, after_seq))
        return [gateway_pb2.JobEvent.FromString(row[0]) for row in rows]


def _artifact(row) -> gateway_pb2.Artifact:
    artifact_id, file_name, size, sha256, media_type = row
    return gateway_pb2.Artifact(artifact_id=artifact_id, file_name=file_name, bytes=size, sha256=sha256,
                                media_type=media_type)
