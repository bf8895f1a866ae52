"""The job store's SQLite schema (its rows read back as messages by the shared h3serve/gateway/jobs/rows.py).

The tables are made with IF NOT EXISTS, so opening a file of any release is one idempotent step; the columns
added after the first release (JOB_COLUMNS) are added to an older file in place (database.py).
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable

from h3serve.gateway.jobs.artifacts import KEYS_FROM_PATHS
from h3serve.gateway.jobs.progress import progress
from h3serve.gateway.jobs.rows import (  # noqa: F401 (re-exported: the SQLite store reads its rows with them)
    ARTIFACT_FIELDS,
    DEFAULT_OWNER,
    JOB_FIELDS,
    OUTBOX_FIELDS,
    RECORD_COLUMNS,
    artifact_from_row,
    delivery_from_row,
    job_from_row,
    stored_request,
)
from h3serve.gateway.jobs.sqlite.identity import Rows
from h3serve.v1 import gateway_pb2

SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
    job_id TEXT PRIMARY KEY, state INTEGER NOT NULL, request BLOB NOT NULL,
    created REAL NOT NULL, updated REAL NOT NULL, error BLOB, last_seq INTEGER NOT NULL DEFAULT 0);
CREATE TABLE IF NOT EXISTS events (
    job_id TEXT NOT NULL, seq INTEGER NOT NULL, time REAL NOT NULL, event BLOB NOT NULL,
    PRIMARY KEY (job_id, seq));
CREATE TABLE IF NOT EXISTS artifacts (
    artifact_id TEXT PRIMARY KEY, job_id TEXT NOT NULL, kind TEXT NOT NULL, file_name TEXT NOT NULL,
    blob_key TEXT NOT NULL, bytes INTEGER NOT NULL, sha256 TEXT NOT NULL, media_type TEXT NOT NULL,
    created REAL NOT NULL);
CREATE INDEX IF NOT EXISTS artifacts_by_job ON artifacts (job_id);
CREATE TABLE IF NOT EXISTS stages (
    job_id TEXT NOT NULL, stage TEXT NOT NULL, seconds REAL NOT NULL, PRIMARY KEY (job_id, stage));
CREATE TABLE IF NOT EXISTS stage_runs (
    job_id TEXT NOT NULL, attempt INTEGER NOT NULL, stage TEXT NOT NULL, enqueued REAL NOT NULL,
    started REAL NOT NULL DEFAULT 0, finished REAL NOT NULL DEFAULT 0, replica TEXT NOT NULL DEFAULT '',
    bytes_in INTEGER NOT NULL DEFAULT 0, bytes_out INTEGER NOT NULL DEFAULT 0, tries INTEGER NOT NULL DEFAULT 0,
    error TEXT NOT NULL DEFAULT '');
CREATE INDEX IF NOT EXISTS stage_runs_by_job ON stage_runs (job_id);
CREATE TABLE IF NOT EXISTS store (store_id TEXT NOT NULL, created REAL NOT NULL);
CREATE TABLE IF NOT EXISTS asset_owners (asset_id TEXT NOT NULL, owner TEXT NOT NULL, PRIMARY KEY (asset_id, owner));
CREATE TABLE IF NOT EXISTS outbox (
    event_id TEXT PRIMARY KEY, job_id TEXT NOT NULL UNIQUE, type TEXT NOT NULL, body BLOB NOT NULL,
    attempts INTEGER NOT NULL DEFAULT 0, last_status INTEGER NOT NULL DEFAULT 0, last_error TEXT NOT NULL DEFAULT '',
    delivered_at REAL NOT NULL DEFAULT 0, next_at REAL NOT NULL);
CREATE INDEX IF NOT EXISTS outbox_due ON outbox (next_at) WHERE next_at > 0;
"""
# Columns added after the first release: (name, declaration); added in place to an older file. `progress` is
# NULL only in rows from before it existed (new jobs start at 0): they are filled from their events at open.
JOB_COLUMNS = (
    ("attempts", "INTEGER NOT NULL DEFAULT 0"),
    ("request_id", "TEXT"),
    ("request_digest", "TEXT"),
    ("deleted", "REAL NOT NULL DEFAULT 0"),
    ("progress", "REAL"),
    ("restarts", "INTEGER NOT NULL DEFAULT 0"),
    ("owner", f"TEXT NOT NULL DEFAULT '{DEFAULT_OWNER}'"),  # the client (tenants): jobs from before are the default's
    ("webhook_url", "TEXT NOT NULL DEFAULT ''"),
    # ownership (store.py's Lease): who holds the job, until when, and the fence counter each claim raises
    ("lease_owner", "TEXT NOT NULL DEFAULT ''"),
    ("lease_until", "REAL NOT NULL DEFAULT 0"),
    ("fence", "INTEGER NOT NULL DEFAULT 0"),
    ("cancel_requested", "REAL NOT NULL DEFAULT 0"),  # when a cancel was requested (request_cancel; 0: none)
)
# A request_id names one job per client: a client reusing another's id makes its own job, and learns nothing.
REQUEST_ID_INDEX = (
    "CREATE UNIQUE INDEX IF NOT EXISTS jobs_by_owner_request_id ON jobs (owner, request_id) "
    "WHERE request_id IS NOT NULL"
)
OLD_INDEXES = ("jobs_by_request_id",)  # request_id unique over every client, from before tenants


def migrate(conn: sqlite3.Connection, rows: Rows, events: Callable[[str], list[gateway_pb2.JobEvent]]) -> None:
    """Bring an older file's jobs table up to JOB_COLUMNS and its indexes, in one transaction: the columns added
    after the first release, and the progress of jobs stored before that column existed, folded from their events
    (once: NULL only); and artifacts' blob keys in place of the local paths stored before them (once: the column
    is renamed)."""
    present = {row[1] for row in rows("PRAGMA table_info(jobs)")}
    paths_stored = "path" in {row[1] for row in rows("PRAGMA table_info(artifacts)")}
    with conn:
        for statement in KEYS_FROM_PATHS if paths_stored else ():
            conn.execute(statement)
        for name, declaration in JOB_COLUMNS:
            if name not in present:
                conn.execute(f"ALTER TABLE jobs ADD COLUMN {name} {declaration}")
        for old in OLD_INDEXES:
            conn.execute(f"DROP INDEX IF EXISTS {old}")
        conn.execute(REQUEST_ID_INDEX)
        for (job_id,) in rows("SELECT job_id FROM jobs WHERE progress IS NULL"):
            conn.execute("UPDATE jobs SET progress = ? WHERE job_id = ?", (progress(events(job_id)), job_id))
