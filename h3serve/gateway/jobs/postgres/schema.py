"""The job store's PostgreSQL schema, as numbered migrations applied once each at open.

The tables and columns are SQLite's (h3serve/gateway/jobs/sqlite/schema.py) in PostgreSQL's types, so both
backends read rows with the one decoder (h3serve/gateway/jobs/rows.py). SQLite's implicit rowid (the listing
order, a stage record's id, an event's log_seq) is an identity column here. A later release appends a migration;
`schema_version` records how far a database has come, and one advisory lock keeps two gateways starting at once
from applying the same step twice.
"""

from __future__ import annotations

from h3serve.gateway.jobs.artifacts import KEYS_FROM_PATHS
from h3serve.gateway.jobs.rows import DEFAULT_OWNER

MIGRATION_LOCK = 0x6833_0001  # pg_advisory_xact_lock key held while migrating

MIGRATIONS: tuple[str, ...] = (
    f"""
    CREATE TABLE jobs (
        position BIGINT GENERATED ALWAYS AS IDENTITY UNIQUE,
        job_id TEXT PRIMARY KEY, state INTEGER NOT NULL, request BYTEA NOT NULL,
        created DOUBLE PRECISION NOT NULL, updated DOUBLE PRECISION NOT NULL, error BYTEA,
        last_seq INTEGER NOT NULL DEFAULT 0, attempts INTEGER NOT NULL DEFAULT 0, request_id TEXT,
        request_digest TEXT, deleted DOUBLE PRECISION NOT NULL DEFAULT 0, progress DOUBLE PRECISION NOT NULL DEFAULT 0,
        restarts INTEGER NOT NULL DEFAULT 0, owner TEXT NOT NULL DEFAULT '{DEFAULT_OWNER}',
        webhook_url TEXT NOT NULL DEFAULT '');
    CREATE UNIQUE INDEX jobs_by_owner_request_id ON jobs (owner, request_id) WHERE request_id IS NOT NULL;
    CREATE INDEX jobs_by_state ON jobs (state, created);
    CREATE TABLE events (
        log_seq BIGINT GENERATED ALWAYS AS IDENTITY UNIQUE, job_id TEXT NOT NULL, seq INTEGER NOT NULL,
        time DOUBLE PRECISION NOT NULL, event BYTEA NOT NULL, PRIMARY KEY (job_id, seq));
    CREATE TABLE artifacts (
        position BIGINT GENERATED ALWAYS AS IDENTITY UNIQUE,
        artifact_id TEXT PRIMARY KEY, job_id TEXT NOT NULL, kind TEXT NOT NULL, file_name TEXT NOT NULL,
        path TEXT NOT NULL, bytes BIGINT NOT NULL, sha256 TEXT NOT NULL, media_type TEXT NOT NULL,
        created DOUBLE PRECISION NOT NULL);
    CREATE INDEX artifacts_by_job ON artifacts (job_id);
    CREATE TABLE stages (
        position BIGINT GENERATED ALWAYS AS IDENTITY UNIQUE,
        job_id TEXT NOT NULL, stage TEXT NOT NULL, seconds DOUBLE PRECISION NOT NULL, PRIMARY KEY (job_id, stage));
    CREATE TABLE stage_runs (
        record_id BIGINT GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
        job_id TEXT NOT NULL, attempt INTEGER NOT NULL, stage TEXT NOT NULL, enqueued DOUBLE PRECISION NOT NULL,
        started DOUBLE PRECISION NOT NULL DEFAULT 0, finished DOUBLE PRECISION NOT NULL DEFAULT 0,
        replica TEXT NOT NULL DEFAULT '', bytes_in BIGINT NOT NULL DEFAULT 0, bytes_out BIGINT NOT NULL DEFAULT 0,
        tries INTEGER NOT NULL DEFAULT 0, error TEXT NOT NULL DEFAULT '');
    CREATE INDEX stage_runs_by_job ON stage_runs (job_id);
    CREATE TABLE store (store_id TEXT NOT NULL, created DOUBLE PRECISION NOT NULL);
    CREATE TABLE asset_owners (asset_id TEXT NOT NULL, owner TEXT NOT NULL, PRIMARY KEY (asset_id, owner));
    CREATE TABLE outbox (
        event_id TEXT PRIMARY KEY, job_id TEXT NOT NULL UNIQUE, type TEXT NOT NULL, body BYTEA NOT NULL,
        attempts INTEGER NOT NULL DEFAULT 0, last_status INTEGER NOT NULL DEFAULT 0,
        last_error TEXT NOT NULL DEFAULT '', delivered_at DOUBLE PRECISION NOT NULL DEFAULT 0,
        next_at DOUBLE PRECISION NOT NULL);
    CREATE INDEX outbox_due ON outbox (next_at) WHERE next_at > 0;
    """,
    # 2: ownership (store.py's Lease): who holds the job, until when, and the fence counter each claim raises
    """
    ALTER TABLE jobs ADD COLUMN lease_owner TEXT NOT NULL DEFAULT '',
        ADD COLUMN lease_until DOUBLE PRECISION NOT NULL DEFAULT 0, ADD COLUMN fence BIGINT NOT NULL DEFAULT 0;
    """,
    # 3: artifacts' blob keys (h3serve/gateway/blobs.py) in place of local paths, so that any gateway serves them
    "; ".join(KEYS_FROM_PATHS),
    # 4: a cancel requested on any gateway (JobStore.request_cancel): when (0: none), for the job's holder to act on
    # (IF NOT EXISTS: a database whose schema_version was set back below it, as tests/test_blobs.py's, migrates again)
    "ALTER TABLE jobs ADD COLUMN IF NOT EXISTS cancel_requested DOUBLE PRECISION NOT NULL DEFAULT 0;",
)

VERSION_TABLE = "CREATE TABLE IF NOT EXISTS schema_version (version INTEGER NOT NULL)"
