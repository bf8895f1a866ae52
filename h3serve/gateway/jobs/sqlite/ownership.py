"""Jobs' leases on SQLite (JobStore's ownership, h3serve/gateway/jobs/store.py): claim, the fence check that every
fenced write starts with, release and expire. Run inside the caller's transaction on the store's one connection.

One gateway uses a SQLite store (the data_dir lock), so a claim needs no row lock: the file's write lock already
makes each claim whole. The lease is kept anyway, so one gateway and several run the same code path.
"""

from __future__ import annotations

import sqlite3
import time
from contextlib import closing

from h3serve.gateway.jobs.store import UNFINISHED_STATES, Fenced, Lease

UNFINISHED = f"state IN ({', '.join('?' * len(UNFINISHED_STATES))})"


def hold(conn: sqlite3.Connection, job_id: str, lease: Lease | None) -> None:
    """Renew `lease` on the unfinished job; Fenced when it is not the job's (None: an unfenced write)."""
    if lease is None:
        return
    with closing(
        conn.execute(
            f"UPDATE jobs SET lease_until = ? WHERE job_id = ? AND lease_owner = ? AND fence = ? AND {UNFINISHED}",
            (time.time() + lease.seconds, job_id, lease.gateway_id, lease.fence, *UNFINISHED_STATES),
        )
    ) as cursor:
        if cursor.rowcount != 1:
            raise Fenced(job_id, lease)


def hold_record(conn: sqlite3.Connection, record_id: int, lease: Lease | None) -> None:
    """`hold` on the job of a stage record."""
    if lease is None:
        return
    with closing(conn.execute("SELECT job_id FROM stage_runs WHERE rowid = ?", (record_id,))) as cursor:
        found = cursor.fetchone()
    if found is None:
        raise KeyError(record_id)
    hold(conn, found[0], lease)


def claim(conn: sqlite3.Connection, gateway_id: str, lease_s: float, job_id: str) -> tuple[str, str] | None:
    """Take the oldest claimable job (or `job_id` only, if claimable); returns its id and its lease's holder before
    ("" when none ever held it)."""
    now = time.time()
    only, params = ("AND job_id = ?", (job_id,)) if job_id else ("", ())
    with closing(
        conn.execute(
            f"SELECT job_id, lease_owner FROM jobs WHERE {UNFINISHED} AND lease_until < ? {only} "
            "ORDER BY created, rowid LIMIT 1",
            (*UNFINISHED_STATES, now, *params),
        )
    ) as cursor:
        found = cursor.fetchone()
    if found is not None:
        conn.execute(
            "UPDATE jobs SET lease_owner = ?, lease_until = ?, fence = fence + 1 WHERE job_id = ?",
            (gateway_id, now + lease_s, found[0]),
        )
    return (found[0], found[1]) if found else None


def release(conn: sqlite3.Connection, job_id: str, lease: Lease) -> None:
    hold(conn, job_id, lease)
    conn.execute("UPDATE jobs SET lease_until = 0 WHERE job_id = ?", (job_id,))


def expire(conn: sqlite3.Connection, gateway_id: str) -> int:
    with closing(
        conn.execute(
            f"UPDATE jobs SET lease_until = 0 WHERE lease_owner = ? AND lease_until > 0 AND {UNFINISHED}",
            (gateway_id, *UNFINISHED_STATES),
        )
    ) as cursor:
        return cursor.rowcount
