"""The job store's SQLite schema and how its rows read back as messages.

The tables are made with IF NOT EXISTS, so opening a file of any release is one idempotent step; the columns
added after the first release (JOB_COLUMNS) are added to an older file in place (database.py).
"""

from __future__ import annotations

from h3serve.gateway.tenants.clients import DEFAULT as DEFAULT_OWNER
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
    path TEXT NOT NULL, bytes INTEGER NOT NULL, sha256 TEXT NOT NULL, media_type TEXT NOT NULL, created REAL NOT NULL);
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
)
# A request_id names one job per client: a client reusing another's id makes its own job, and learns nothing.
REQUEST_ID_INDEX = (
    "CREATE UNIQUE INDEX IF NOT EXISTS jobs_by_owner_request_id ON jobs (owner, request_id) "
    "WHERE request_id IS NOT NULL"
)
OLD_INDEXES = ("jobs_by_request_id",)  # request_id unique over every client, from before tenants

JOB_FIELDS = (
    "job_id, state, request, created, updated, error, last_seq, request_id, attempts, deleted, progress, owner, "
    "webhook_url"
)
OUTBOX_FIELDS = "event_id, type, attempts, last_status, last_error, delivered_at, next_at"
ARTIFACT_FIELDS = "artifact_id, file_name, bytes, sha256, media_type"
RECORD_COLUMNS = ("enqueued", "started", "finished", "replica", "bytes_in", "bytes_out", "tries", "error")


def job_from_row(row) -> gateway_pb2.Job:
    job_id, state, request, created, updated, error, last_seq, request_id, attempts, deleted, done, owner, url = row
    job = gateway_pb2.Job(
        job_id=job_id,
        state=state,
        request=stored_request(request),
        created=created,
        updated=updated,
        last_event_seq=last_seq,
        request_id=request_id or "",
        attempts=attempts,
        deleted=deleted,
        progress=done,
        client=owner,
    )
    if error is not None:
        job.error.ParseFromString(error)
    if url:
        job.webhook.url = url
    return job


def delivery_from_row(delivery: gateway_pb2.WebhookDelivery, row) -> None:
    """The outbox row's state (OUTBOX_FIELDS) on the job's webhook."""
    (
        delivery.event_id,
        delivery.event_type,
        delivery.attempts,
        delivery.last_status,
        delivery.last_error,
        delivery.delivered_at,
        delivery.next_attempt_at,
    ) = row


def artifact_from_row(row) -> gateway_pb2.Artifact:
    artifact_id, file_name, size, sha256, media_type = row
    return gateway_pb2.Artifact(
        artifact_id=artifact_id, file_name=file_name, bytes=size, sha256=sha256, media_type=media_type
    )


def stored_request(blob: bytes) -> gateway_pb2.ResolvedRequest:
    """A stored request; one stored before GenerationParams existed takes them from its top-level copies."""
    request = gateway_pb2.ResolvedRequest.FromString(blob)
    if not request.HasField("params"):
        request.params.num_inference_steps, request.params.include_raw = (
            request.num_inference_steps,
            request.include_raw,
        )
        request.params.seed = request.seed
    return request
