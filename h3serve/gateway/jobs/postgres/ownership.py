"""Jobs' leases on PostgreSQL (JobStore's ownership, h3serve/gateway/jobs/store.py): claim, the fence check every
fenced write starts with, release and expire; each inside the caller's transaction.

A claim takes one row with `FOR UPDATE SKIP LOCKED`, so gateways claiming at once each get a different job and
none waits on another's. The fence check is one UPDATE that also renews the lease and keeps the job's row locked to
the end of the write's transaction: a claim cannot slip in between the check and the write.
"""

from __future__ import annotations

import time

from psycopg import AsyncConnection

from h3serve.gateway.jobs.store import UNFINISHED_STATES, Fenced, Lease


async def hold(conn: AsyncConnection, job_id: str, lease: Lease | None) -> None:
    """Renew `lease` on the unfinished job; Fenced when it is not the job's (None: an unfenced write)."""
    if lease is None:
        return
    cursor = await conn.execute(
        "UPDATE jobs SET lease_until = %s WHERE job_id = %s AND lease_owner = %s AND fence = %s AND state = ANY(%s)",
        (time.time() + lease.seconds, job_id, lease.gateway_id, lease.fence, list(UNFINISHED_STATES)),
    )
    if cursor.rowcount != 1:
        raise Fenced(job_id, lease)


async def hold_record(conn: AsyncConnection, record_id: int, lease: Lease | None) -> None:
    """`hold` on the job of a stage record."""
    if lease is None:
        return
    cursor = await conn.execute("SELECT job_id FROM stage_runs WHERE record_id = %s", (record_id,))
    found = await cursor.fetchone()
    if found is None:
        raise KeyError(record_id)
    await hold(conn, found[0], lease)


async def claim(conn: AsyncConnection, gateway_id: str, lease_s: float, job_id: str) -> tuple[str, str] | None:
    """Take the oldest claimable job (or `job_id` only, if claimable); returns its id and its lease's holder before
    ("" when none ever held it)."""
    now = time.time()
    only, params = ("AND job_id = %s", (job_id,)) if job_id else ("", ())
    cursor = await conn.execute(
        "UPDATE jobs SET lease_owner = %s, lease_until = %s, fence = fence + 1 FROM (SELECT job_id, lease_owner FROM "
        f"jobs WHERE state = ANY(%s) AND lease_until < %s {only} ORDER BY created, position "
        "FOR UPDATE SKIP LOCKED LIMIT 1) AS was WHERE jobs.job_id = was.job_id RETURNING jobs.job_id, was.lease_owner",
        (gateway_id, now + lease_s, list(UNFINISHED_STATES), now, *params),
    )
    found = await cursor.fetchone()
    return (found[0], found[1]) if found else None


async def release(conn: AsyncConnection, job_id: str, lease: Lease) -> None:
    await hold(conn, job_id, lease)
    await conn.execute("UPDATE jobs SET lease_until = 0 WHERE job_id = %s", (job_id,))


async def expire(conn: AsyncConnection, gateway_id: str) -> int:
    cursor = await conn.execute(
        "UPDATE jobs SET lease_until = 0 WHERE lease_owner = %s AND lease_until > 0 AND state = ANY(%s)",
        (gateway_id, list(UNFINISHED_STATES)),
    )
    return cursor.rowcount
