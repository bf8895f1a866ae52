"""The webhook outbox on SQLite: a job's end queued in its terminal transaction, the events due, each attempt.

Functions on the store's connection, called by database.py inside its transactions (docs/webhooks.md).
"""

from __future__ import annotations

import sqlite3
import time
from contextlib import closing

from h3serve.gateway.jobs.store import Outgoing
from h3serve.gateway.webhooks import event as webhook_event


def queue(conn: sqlite3.Connection, job_id: str, state: int, now: float) -> None:
    """The job's end into the outbox, due now, in the transaction of its terminal state: a job with an endpoint
    and an end that has an event (webhooks/event.py)."""
    with closing(conn.execute("SELECT webhook_url FROM jobs WHERE job_id = ?", (job_id,))) as cursor:
        url = cursor.fetchone()
    if not url or not url[0] or state not in webhook_event.TYPES:
        return
    event_id, event_type = webhook_event.new_id(), webhook_event.TYPES[state]
    conn.execute(
        "INSERT INTO outbox (event_id, job_id, type, body, next_at) VALUES (?, ?, ?, ?, ?)",
        (event_id, job_id, event_type, webhook_event.body(event_id, event_type, job_id, now), now),
    )


def due(conn: sqlite3.Connection, now: float, limit: int) -> list[Outgoing]:
    with closing(
        conn.execute(
            "SELECT o.event_id, o.job_id, j.owner, j.webhook_url, o.body, o.attempts FROM outbox o JOIN jobs j "
            "USING (job_id) WHERE o.next_at > 0 AND o.next_at <= ? ORDER BY o.next_at LIMIT ?",
            (now, limit),
        )
    ) as cursor:
        return [Outgoing(*row) for row in cursor.fetchall()]


def attempted(
    conn: sqlite3.Connection, event_id: str, status: int, error: str, delivered: bool, next_at: float
) -> None:
    conn.execute(
        "UPDATE outbox SET attempts = attempts + 1, last_status = ?, last_error = ?, delivered_at = ?, "
        "next_at = ? WHERE event_id = ?",
        (status, "" if delivered else error, time.time() if delivered else 0.0, next_at, event_id),
    )
