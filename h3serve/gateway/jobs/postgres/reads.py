"""How PostgresJobStore reads: one statement's rows, and jobs with their artifacts, timings, webhook and stage
records (one query per table for a page of jobs), on the caller's connection and transaction."""

from __future__ import annotations

from psycopg import AsyncConnection

from h3serve.gateway.jobs.rows import (
    ARTIFACT_FIELDS,
    JOB_FIELDS,
    OUTBOX_FIELDS,
    RECORD_COLUMNS,
    artifact_from_row,
    delivery_from_row,
    job_from_row,
    stored_request,
)
from h3serve.gateway.jobs.store import UNFINISHED_STATES, Unfinished
from h3serve.v1 import gateway_pb2


def owned_by(client: str | None) -> tuple[str, tuple]:
    """A condition on jobs' rows: those of `client` (None: every client's), and its parameters."""
    return ("owner = %s", (client,)) if client is not None else ("TRUE", ())


async def fetch(conn: AsyncConnection, query, params: tuple = ()) -> list[tuple]:
    async with conn.cursor() as cursor:
        await cursor.execute(query, params)
        return await cursor.fetchall() if cursor.description else []


async def unfinished(conn: AsyncConnection, job_id: str = "") -> list[Unfinished]:
    """Queued and running jobs, oldest first (`job_id`: that one only)."""
    only, params = ("AND job_id = %s", (job_id,)) if job_id else ("", ())
    rows = await fetch(
        conn,
        "SELECT job_id, state, request, attempts, COALESCE((SELECT stage FROM stage_runs r WHERE "
        "r.job_id = jobs.job_id ORDER BY record_id DESC LIMIT 1), ''), restarts, EXISTS (SELECT 1 FROM "
        "stage_runs r WHERE r.job_id = jobs.job_id AND r.started > 0 AND r.finished = 0 AND r.error = ''), fence "
        f"FROM jobs WHERE state = ANY(%s) {only} ORDER BY created, position",
        (list(UNFINISHED_STATES), *params),
    )
    return [
        Unfinished(job_id, state, stored_request(request), attempts, stage, restarts, in_stage, fence)
        for job_id, state, request, attempts, stage, restarts, in_stage, fence in rows
    ]


async def events(conn: AsyncConnection, job_id: str, after_seq: int) -> list[gateway_pb2.JobEvent]:
    rows = await fetch(
        conn, "SELECT log_seq, event FROM events WHERE job_id = %s AND seq > %s ORDER BY seq", (job_id, after_seq)
    )
    events = []
    for log_seq, blob in rows:
        event = gateway_pb2.JobEvent.FromString(blob)
        event.log_seq = log_seq
        events.append(event)
    return events


async def stored_job(conn: AsyncConnection, job_id: str) -> gateway_pb2.Job:
    """A job this transaction has just read or written."""
    found = await job(conn, job_id)
    assert found is not None
    return found


async def job(conn: AsyncConnection, job_id: str, client: str | None = None) -> gateway_pb2.Job | None:
    mine, params = owned_by(client)
    rows = await fetch(conn, f"SELECT {JOB_FIELDS} FROM jobs WHERE job_id = %s AND {mine}", (job_id, *params))
    jobs = await filled(conn, rows, records=True)
    return jobs[0] if jobs else None


async def filled(conn: AsyncConnection, rows: list[tuple], records: bool) -> list[gateway_pb2.Job]:
    """Jobs from their rows (JOB_FIELDS), in order, with their artifacts, stage timings, webhook and (`records`)
    stage records: one query per table for all of them."""
    if not rows:
        return []
    jobs = {row[0]: job_from_row(row) for row in rows}
    ids = (list(jobs),)
    for job_id, *fields in await fetch(
        conn,
        f"SELECT job_id, {ARTIFACT_FIELDS} FROM artifacts WHERE job_id = ANY(%s) "
        "ORDER BY kind != 'video', created, position",
        ids,
    ):
        jobs[job_id].artifacts.append(artifact_from_row(fields))
    query = "SELECT job_id, stage, seconds FROM stages WHERE job_id = ANY(%s) ORDER BY position"
    for job_id, stage, seconds in await fetch(conn, query, ids):
        jobs[job_id].stages.add(stage=stage, seconds=seconds)
    query = f"SELECT job_id, {OUTBOX_FIELDS} FROM outbox WHERE job_id = ANY(%s)"
    for job_id, *fields in await fetch(conn, query, ids):
        delivery_from_row(jobs[job_id].webhook, fields)
    if records:
        query = (
            f"SELECT job_id, stage, attempt, {', '.join(RECORD_COLUMNS)} FROM stage_runs WHERE job_id = ANY(%s) "
            "ORDER BY record_id"
        )
        for job_id, *fields in await fetch(conn, query, ids):
            jobs[job_id].stage_records.add(**dict(zip(("stage", "attempt", *RECORD_COLUMNS), fields, strict=True)))
    return list(jobs.values())
